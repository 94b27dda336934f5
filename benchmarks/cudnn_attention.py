"""jax_ring's cuDNN backend against jax.nn's cuDNN path, same process.

  python benchmarks/cudnn_attention.py [--seq 4096 8192 ...] [--quick]

B=1, D=128, bf16; N=32 query heads with 32 (MHA) or 8 (GQA) kv heads;
causal and non-causal. FLOPs: 4*S^2*N*D (halved for causal); forward+backward
counts 3.5x the forward. Writes
benchmarks/results/cudnn_attention_<count>x<gpu>.json.
"""

from __future__ import annotations

import argparse

import jax

import jax_ring
from common import random_qkv, shape_args, time_fn, write


def step_fns(impl_fn):
  fwd = jax.jit(impl_fn)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(impl_fn, q, k, v)
    return vjp(do)

  return fwd, fwd_bwd


def main():
  p = argparse.ArgumentParser()
  shape_args(p, [4096, 8192, 16384, 32768, 65536])
  a = p.parse_args()
  rows = []
  for s in a.seq:
    for kh in a.kv_heads:
      for causal in (True, False):
        q, k, v, do = random_qkv(s + kh, s, a.heads, kh, a.head_dim)
        flops = 4 * s * s * a.heads * a.head_dim * (0.5 if causal else 1.0)
        row = dict(seq=s, heads=a.heads, kv_heads=kh, causal=causal)
        for name, mod in (("jax_ring", jax_ring), ("jax_nn", jax.nn)):
          fn = lambda q, k, v, mod=mod: mod.dot_product_attention(
              q, k, v, is_causal=causal, implementation="cudnn")
          fwd, fwd_bwd = step_fns(fn)
          t_f = time_fn(fwd, q, k, v)
          t_fb = time_fn(fwd_bwd, q, k, v, do)
          row[f"{name}_fwd_ms"] = t_f * 1e3
          row[f"{name}_fwd_tflops"] = flops / t_f / 1e12
          row[f"{name}_fwdbwd_ms"] = t_fb * 1e3
          row[f"{name}_fwdbwd_tflops"] = 3.5 * flops / t_fb / 1e12
        row["fwd_ratio"] = row["jax_nn_fwd_ms"] / row["jax_ring_fwd_ms"]
        row["fwdbwd_ratio"] = (row["jax_nn_fwdbwd_ms"] /
                               row["jax_ring_fwdbwd_ms"])
        rows.append(row)
        print(row, flush=True)
  write("cudnn_attention", rows,
        ["seq", "kv_heads", "causal", "jax_ring_fwd_tflops",
         "jax_nn_fwd_tflops", "fwd_ratio", "jax_ring_fwdbwd_tflops",
         "jax_nn_fwdbwd_tflops", "fwdbwd_ratio"],
        extra=dict(dtype="bfloat16", batch=1, head_dim=a.head_dim,
                   flops="4*S^2*N*D (x0.5 causal); fwd+bwd = 3.5x fwd",
                   ratio="jax.nn time / jax_ring time (>1: jax_ring faster)"),
        mode=a.mode)


if __name__ == "__main__":
  main()
