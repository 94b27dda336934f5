"""Pure-JAX blockwise backend: time and peak memory of forward+backward.

Shows that memory grows linearly in S: the compiled program's temporary
buffers are reported next to the size an S x S score matrix would need.

  python benchmarks/xla_backend.py --seq 4096 8192 32768 --heads 8 --head-dim 128

Writes benchmarks/results/xla_backend_<platform>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_ring


def run(seq, heads, kv_heads, head_dim, dtype, causal, repeats):
  ks = jax.random.split(jax.random.key(0), 4)
  shape_q, shape_kv = (1, seq, heads, head_dim), (1, seq, kv_heads, head_dim)
  q = jax.random.normal(ks[0], shape_q, dtype)
  k = jax.random.normal(ks[1], shape_kv, dtype)
  v = jax.random.normal(ks[2], shape_kv, dtype)

  def loss(q, k, v):
    out = jax_ring.dot_product_attention(q, k, v, is_causal=causal,
                                         implementation="xla")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  compiled = step.lower(q, k, v).compile()
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem else None
  jax.block_until_ready(compiled(q, k, v))  # warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    times.append(time.perf_counter() - t0)
  flops = 4 * seq * seq * heads * head_dim * (0.5 if causal else 1.0) * 3.5
  median = float(np.median(times))
  return dict(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              dtype=jnp.dtype(dtype).name, causal=causal,
              fwd_bwd_s=median, gflops=flops / median / 1e9,
              compiled_temp_bytes=temp,
              scores_s_by_s_bytes=seq * seq * heads * 4,
              peak_rss_bytes=resource.getrusage(
                  resource.RUSAGE_SELF).ru_maxrss * 1024)


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 32768])
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--non-causal", action="store_true")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--out", default=None)
  a = p.parse_args()
  rows = [run(s, a.heads, a.kv_heads or a.heads, a.head_dim,
              jnp.dtype(a.dtype), not a.non_causal, a.repeats)
          for s in sorted(a.seq)]
  dev = jax.devices()[0]
  result = dict(
      benchmark="xla_backend", device=dev.device_kind, platform=dev.platform,
      host=platform.processor() or platform.machine(),
      jax=jax.__version__, jaxlib=jax.lib.__version__ if hasattr(
          jax.lib, "__version__") else jax.__version__,
      jax_ring=jax_ring.__version__, rows=rows)
  print(f"{'S':>7} {'fwd+bwd s':>10} {'GFLOP/s':>8} {'temp MiB':>9} "
        f"{'SxS MiB':>9} {'peak RSS MiB':>12}")
  for r in rows:
    temp = r["compiled_temp_bytes"]
    print(f"{r['seq']:>7} {r['fwd_bwd_s']:>10.2f} {r['gflops']:>8.1f} "
          f"{(temp or 0) / 2**20:>9.0f} {r['scores_s_by_s_bytes'] / 2**20:>9.0f}"
          f" {r['peak_rss_bytes'] / 2**20:>12.0f}")
  out = pathlib.Path(a.out or pathlib.Path(__file__).parent / "results" /
                     f"xla_backend_{dev.platform}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
