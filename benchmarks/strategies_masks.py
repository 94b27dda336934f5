"""Every strategy with masks (packed documents, windows, padding lengths) on
all local GPUs against one GPU: the forward and the three gradients, each as
max |error| / max(1, max |expected|).

  python benchmarks/strategies_masks.py

B=2, S=8192 (--seq), N=8, K=2, D=128, bf16, cuDNN blocks where they apply, the
automatic path (names and meshes as in strategies.py). Writes
benchmarks/results/strategies_masks_<count>x<gpu>.json.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS",
                      "--xla_gpu_enable_latency_hiding_scheduler=true")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_ring  # noqa: E402
from common import write  # noqa: E402
from strategies import default_strategies, setup  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
import reference as ref  # noqa: E402

B, N, K, H = 2, 8, 2, 128


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--seq", type=int, default=8192)
  S = p.parse_args().seq
  cp = jax.device_count()
  q, k, v, do = ref.random_qkv(1, B, S, S, N, K, H, jnp.bfloat16)
  ids = jnp.asarray(ref.random_segments(2, B, S, 7))
  lens = dict(query_seq_lengths=jnp.array([S - 1000, 5000], jnp.int32),
              key_value_seq_lengths=jnp.array([S - 300, 4100], jnp.int32))
  configs = {
      "causal_packed": dict(is_causal=True, segment_ids=ids),
      "causal_window_padding": dict(is_causal=True,
                                    local_window_size=(1500, 0), **lens),
      "full_window_packed": dict(local_window_size=(700, 300),
                                 segment_ids=ids)}
  cases = [(n, "dual_chunk") for n in default_strategies(cp)]
  cases.insert(1, ("ring", "striped"))

  def with_grads(f, do, *args):
    out, vjp = jax.vjp(f, *args)
    return (out,) + vjp(do)

  rows = []
  for cname, kw in configs.items():
    single = lambda q, k, v, kw=kw: jax_ring.dot_product_attention(
        q, k, v, **kw)
    want = jax.jit(lambda *a: with_grads(single, do, *a))(q, k, v)
    for name, lb in cases:
      row = dict(config=cname, strategy=name, load_balance=lb)
      try:
        cpc, sh, to, back = setup(name, cp, lb)
        kw2 = dict(kw)
        if "segment_ids" in kw2:
          kw2["segment_ids"] = jax.device_put(to(kw2["segment_ids"]), sh)
        f = lambda q, k, v, cpc=cpc, kw2=kw2: jax_ring.dot_product_attention(
            q, k, v, context_parallel=cpc, **kw2)
        q_, k_, v_, do_ = (jax.device_put(to(x), sh) for x in (q, k, v, do))
        got = jax.jit(lambda *a, f=f, do_=do_: with_grads(f, do_, *a))(
            q_, k_, v_)
        for n, g, w in zip(("out", "dq", "dk", "dv"), got, want):
          g, w = back(g).astype(jnp.float32), w.astype(jnp.float32)
          row[n] = float(jnp.max(jnp.abs(g - w)) /
                         max(1.0, float(jnp.max(jnp.abs(w)))))
      except Exception as e:  # a failing case is reported, not hidden
        row["error"] = f"{type(e).__name__}: {e}"[:400]
      rows.append(row)
      print(row, flush=True)
  write("strategies_masks", rows,
        ["config", "strategy", "load_balance", "out", "dq", "dk", "dv"],
        extra=dict(shapes=dict(B=B, S=S, N=N, K=K, H=H, dtype="bfloat16"),
                   error="max|got - want| / max(1, max|want|)"))


if __name__ == "__main__":
  main()
