"""Quick start: causal GQA attention with jax_ring on whatever device jax has,
checked against jax.nn's dense attention computed in float64.

  python examples/quickstart.py [--seq 2048]
"""

import argparse
import time

import jax

jax.config.update("jax_enable_x64", True)  # for the float64 reference only

import jax.numpy as jnp  # noqa: E402

import jax_ring  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  a = p.parse_args()
  ks = jax.random.split(jax.random.key(0), 4)
  qs = (a.batch, a.seq, a.heads, a.head_dim)
  kvs = (a.batch, a.seq, a.kv_heads, a.head_dim)
  q, k, v, do = (jax.random.normal(key, s, jnp.float32)
                 for key, s in zip(ks, (qs, kvs, kvs, qs)))

  def grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out,) + vjp(do.astype(out.dtype))

  ours = jax.jit(lambda q, k, v: grads(
      lambda q, k, v: jax_ring.dot_product_attention(q, k, v, is_causal=True),
      q, k, v))
  jax.block_until_ready(ours(q, k, v))
  t0 = time.perf_counter()
  got = jax.block_until_ready(ours(q, k, v))
  elapsed = time.perf_counter() - t0

  f64 = [x.astype(jnp.float64) for x in (q, k, v)]
  want = jax.jit(lambda q, k, v: grads(
      lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="xla"), q, k, v))(*f64)
  print(f"jax_ring.dot_product_attention on {jax.devices()[0].device_kind}: "
        f"q {qs}, k/v {kvs}, causal, float32")
  print(f"forward+backward: {elapsed * 1e3:.1f} ms")
  print("max |error| against float64 jax.nn attention:")
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    err = float(jnp.max(jnp.abs(g.astype(jnp.float64) - w)))
    print(f"  {name:>3}: {err:.2e}  (max |value| {float(jnp.max(jnp.abs(w))):.2f})")


if __name__ == "__main__":
  main()
