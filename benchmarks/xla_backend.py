"""Pure-JAX blockwise backend: time and memory of forward+backward.

Shows that memory grows linearly in S: the compiled program's temporary
buffers are reported next to what one S x S float32 score matrix would need,
and the process's peak RSS next to both.

  python benchmarks/xla_backend.py --seq 32768 --heads 8 --head-dim 128

Run one S per process for a per-S peak RSS. Writes
benchmarks/results/xla_backend_<count>x<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp

import jax_ring
from common import write


def run(seq, heads, kv_heads, head_dim, dtype, causal):
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (1, seq, heads, head_dim), dtype)
  k = jax.random.normal(ks[1], (1, seq, kv_heads, head_dim), dtype)
  v = jax.random.normal(ks[2], (1, seq, kv_heads, head_dim), dtype)

  def loss(q, k, v):
    out = jax_ring.dot_product_attention(q, k, v, is_causal=causal,
                                         implementation="xla")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
      q, k, v).compile()
  mem = compiled.memory_analysis()
  jax.block_until_ready(compiled(q, k, v))  # warm-up
  t0 = time.perf_counter()  # one timed run: seconds-long on a CPU
  jax.block_until_ready(compiled(q, k, v))
  seconds = time.perf_counter() - t0
  flops = 3.5 * 4 * seq * seq * heads * head_dim * (0.5 if causal else 1.0)
  return dict(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              dtype=jnp.dtype(dtype).name, causal=causal,
              fwd_bwd_s=seconds, gflops=flops / seconds / 1e9,
              temp_mib=(mem.temp_size_in_bytes if mem else 0) / 2**20,
              scores_mib=seq * seq * heads * 4 / 2**20,
              peak_rss_mib=resource.getrusage(
                  resource.RUSAGE_SELF).ru_maxrss / 2**10)


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--seq", type=int, nargs="+", default=[32768])
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--non-causal", action="store_true")
  a = p.parse_args()
  rows = [run(s, a.heads, a.kv_heads or a.heads, a.head_dim,
              jnp.dtype(a.dtype), not a.non_causal) for s in sorted(a.seq)]
  write("xla_backend", rows, ["seq", "fwd_bwd_s", "gflops", "temp_mib",
                              "scores_mib", "peak_rss_mib"],
        extra=dict(flops="3.5 * 4*S^2*N*D (x0.5 causal)",
                   temp_mib="XLA's temporary buffers of the compiled step",
                   scores_mib="one S x S float32 score matrix per head set"))


if __name__ == "__main__":
  main()
