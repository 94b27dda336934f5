"""Decoding with jax_ring.models on one GPU: a decode step's time against
the memory-bandwidth floor, and prefill throughput.

  python benchmarks/decoding.py [--context 8192 32768 131072]
                                [--batch 1 8] [--prefill 32768 131072]

A random Llama-3.2-1B-shaped model (16 layers, hidden 2048, 32 query / 8
kv heads of 64, vocabulary 128256, tied embeddings) in bfloat16.

* Decode: one ``Generator.step`` (every layer's projections, the append to
  the cache, ``decode_attention`` over the cache, the MLP, the logits)
  with L tokens of context per row in a cache of L + 64 slots rounded up
  to a multiple of 1024 (``generation.SLOT_ALIGN``), timed over
  consecutive steps (the cache donated from one to the next). The floor is
  the bytes a step must read, the weights once (the tied embedding as the
  output layer) and each row's K and V (2 x 16 layers x L x 8 x 64 x 2
  bytes), over the HBM bandwidth measured in the same run (a copy of 2 GiB,
  bytes read plus written). A step at 64 tokens of context is timed too:
  what the step costs beyond its cache reads.
* Prefill: ``Generator.prefill`` of one prompt of P tokens (cuDNN
  attention), tokens per second, the second call (the first compiles).
* Check: the logits of a prefill and 8 decode steps against the full
  forward's at the same positions (1024 tokens, bfloat16).

Writes benchmarks/results/decoding_<count>x<gpu>.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import program_summary, rel_err, time_fn, write
from jax_ring import models
from jax_ring.models import generation as gen

LLAMA_1B = dict(
    model_type="llama", vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True,
    max_position_embeddings=131072, rope_scaling=dict(
        rope_type="llama3", factor=32.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192))
MARGIN = 64  # free slots after the context: the steps timed


def bandwidth(gib: float = 2.0) -> float:
  """HBM bytes/s: ``x + 1`` over ``gib`` GiB of bfloat16, read + written."""
  x = jax.random.normal(jax.random.key(0), (int(gib * 2**29),), jnp.bfloat16)
  t = time_fn(jax.jit(lambda x: x + 1), x)
  return 2 * x.nbytes / t


def random_cache(cfg, batch: int, context: int, seed: int) -> gen.KVCache:
  """A cache holding ``context`` random tokens per row (positions 0..L-1)
  and at least ``MARGIN`` free slots, the cache's length a multiple of
  ``SLOT_ALIGN``, as ``Generator.prefill`` makes it."""
  c = -(-(context + MARGIN) // gen.SLOT_ALIGN) * gen.SLOT_ALIGN
  shape = (batch, cfg.num_kv_heads, c, cfg.head_dim)
  keys = jax.random.split(jax.random.key(seed), 2 * cfg.num_layers)
  kv = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]
  positions = jnp.where(jnp.arange(c) < context, jnp.arange(c), -1)
  return gen.KVCache(kv[::2], kv[1::2],
                     jnp.broadcast_to(positions, (batch, c)).astype(jnp.int32),
                     jnp.full((batch,), context, jnp.int32), context, 1)


def step_seconds(generator, cache, steps: int = 24) -> float:
  """Seconds per decode step, over ``steps`` consecutive ones after 3."""
  b = cache.lengths.shape[0]
  tokens = np.arange(b, dtype=np.int32) + 7
  for i in range(3):
    logits, cache = generator.step(cache, tokens, i)
  jax.block_until_ready(logits)
  t0 = time.perf_counter()
  for i in range(3, 3 + steps):
    logits, cache = generator.step(cache, tokens, i)
  jax.block_until_ready(logits)
  return (time.perf_counter() - t0) / steps


def kernel_profile(generator, cache, steps: int = 5, top: int = 12):
  """Per decode step: GPU kernels' total microseconds, their count, the
  ``top`` kernels by time (``jax.profiler`` trace, device planes), and the
  step program's launches in and out of CUDA graphs
  (``common.program_summary``)."""
  import collections
  import glob
  import tempfile
  b = cache.lengths.shape[0]
  tokens = np.arange(b, dtype=np.int32) + 7
  logits, cache = generator.step(cache, tokens, 0)
  jax.block_until_ready(logits)
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    for i in range(1, 1 + steps):
      logits, cache = generator.step(cache, tokens, i)
    jax.block_until_ready(logits)
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(
        glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
  by_name, count = collections.Counter(), 0
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if "Stream" not in line.name:
        continue
      for ev in line.events:
        by_name[ev.name] += ev.duration_ns / 1e3 / steps
        count += 1
  program = program_summary(
      generator.lower_step(cache, tokens, 1).compile().as_text())
  return dict(kernel_us=sum(by_name.values()), kernels=count / steps,
              program=program,
              top={k: round(v, 1) for k, v in by_name.most_common(top)})


def weight_bytes(model) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def check(model, generator) -> float:
  """max relative error of prefill + 8 decode logits against the full
  forward's, 1024 tokens."""
  prompt = np.random.default_rng(0).integers(
      0, model.cfg.vocab_size, 1016).tolist()
  logits, cache = generator.prefill([prompt], max_new_tokens=8)
  got, seq = [logits[0]], list(prompt)
  for step in range(7):
    token = int(jnp.argmax(logits[0]))
    seq.append(token)
    logits, cache = generator.step(cache, [token], step)
    got.append(logits[0])
  full = model(np.array([seq]), np.arange(len(seq))[None])[0]
  return rel_err(jnp.stack(got), full[len(prompt) - 1:])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--context", type=int, nargs="+",
                 default=[8192, 32768, 131072])
  p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  p.add_argument("--prefill", type=int, nargs="*", default=[32768, 131072])
  p.add_argument("--mode", default="default")
  p.add_argument("--profile", action="store_true", help="also a kernel "
                 "profile of the step at each batch's longest context")
  p.add_argument("--dry-run", action="store_true", help="a 2-layer model "
                 "of hidden 64 (CPU: checks that the script runs)")
  a = p.parse_args()
  shapes = LLAMA_1B | (dict(hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16,
                            vocab_size=1000) if a.dry_run else {})
  cfg = models.config_from_hf(shapes, dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16)
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  generator = gen.Generator(model)
  bw = bandwidth()
  weights = weight_bytes(model)
  print(f"HBM {bw / 1e12:.2f} TB/s; weights {weights / 2**30:.2f} GiB",
        flush=True)
  rows = []
  for b in a.batch:
    base = step_seconds(generator, random_cache(cfg, b, 64, 1))
    for ctx in a.context:
      cache = random_cache(cfg, b, ctx, 2)
      kv = 2 * cfg.num_layers * b * ctx * cfg.num_kv_heads * cfg.head_dim * 2
      t = step_seconds(generator, cache)
      prof = None
      if a.profile and ctx == max(a.context):
        prof = kernel_profile(generator, random_cache(cfg, b, ctx, 3))
        print(f"profile, batch {b}, context {ctx}: {prof}", flush=True)
      del cache
      floor = (weights + kv) / bw
      rows.append(dict(kind="decode", batch=b, context=ctx,
                       step_ms=t * 1e3, floor_ms=floor * 1e3,
                       over_floor=t / floor, step_64_ms=base * 1e3,
                       cache_gib=kv / 2**30, **(
                           {} if prof is None else dict(profile=prof))))
      print(rows[-1], flush=True)
  for ctx in a.prefill:
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size,
                                               ctx).tolist()
    run = lambda: jax.block_until_ready(
        generator.prefill([prompt], max_new_tokens=MARGIN))
    run()
    t0 = time.perf_counter()
    run()
    t = time.perf_counter() - t0
    rows.append(dict(kind="prefill", batch=1, context=ctx, prefill_s=t,
                     tokens_per_s=ctx / t))
    print(rows[-1], flush=True)
  err = check(model, generator)
  print(f"prefill + decode logits against the full forward: {err:.2e}")
  write("decoding", rows,
        ["kind", "batch", "context", "step_ms", "floor_ms", "over_floor",
         "step_64_ms", "tokens_per_s"],
        extra=dict(model="Llama-3.2-1B shapes, random, bfloat16",
                   hbm_tb_s=bw / 1e12, weight_gib=weights / 2**30,
                   logits_rel_err_vs_full_forward=err,
                   floor="(weights + K/V of the context) / measured HBM "
                   "bandwidth; step over consecutive donated-cache steps"),
        mode=a.mode)


if __name__ == "__main__":
  main()
