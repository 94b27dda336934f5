"""Decoding with jax_ring.models: a decode step's time against the
memory-bandwidth floor, and prefill throughput, on one GPU or with the KV
cache's sequence split over several.

  python benchmarks/decoding.py [--context 8192 32768 131072]
                                [--batch 1 8] [--prefill 32768 131072]
  python benchmarks/decoding.py --devices 4 --context 262144 1048576 \
      --batch 1 --prefill 1048576 --equal-at 16384

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
* ``--devices D``: the model as a user loads it (``save_pretrained``, then
  ``load_pretrained`` on a ``("data", "context")`` mesh of 1 x D with
  ``ContextParallel(axis="context", inputs="load_balanced")``), weights
  replicated, every cache split along its sequence (device d holds slots
  ``[d L, (d + 1) L)``). The floor is per device: the weights and a D-th
  of the K/V. Each prefill's own cache is then decoded too
  (``step_after_prefill_ms``). ``--equal-at N``: one prompt of N tokens
  generated greedily (16 tokens) by the one-GPU model and by the split
  one: the tokens and the first logits compared.
* ``--host``: where a batch-1 step's host time goes, at 64 tokens of
  context: ``Generator.step`` (its checks, then the program); the step's
  program called directly with NumPy arguments; with the token and the
  step number already on the device (the same two arrays every call,
  then a new step array each call); and a program that does nothing with
  the same arguments, the cache donated and returned (the cost of passing
  them). Each: the host's microseconds a call, and a call's microseconds
  end to end over consecutive calls. Then ``generate``'s mean time a
  token from a 64-token prompt, with one decode step a call (the step
  and the draw) and with 8 (``tokens_per_call=8``, the default: one
  program loops over them), after the first call.
* ``--kernels``: each ``decode_attention`` implementation timed, one
  after the other, on the same shapes (default: ``pallas xla`` on GPUs,
  the kernel the default path runs against the XLA baseline; ``xla``
  elsewhere).

* ``--default-load``: the path a user writes instead: the model saved as a
  bfloat16 checkpoint, ``load_pretrained(path)`` with no dtype argument
  (it loads in the checkpoint's dtype), and ``Generator.generate`` with
  its defaults from a prompt of each ``--context`` length, batch 1: a
  token's mean time after the first call (``on_tokens``' clock, from the
  first decode call's last token), against the floor; and the loaded
  weights' bytes against the checkpoint's.

Writes benchmarks/results/decoding_<count>x<gpu>.json after each row (a
run that is stopped keeps the rows it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

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


def random_cache(cfg, batch: int, context: int, seed: int,
                 mesh=None) -> gen.KVCache:
  """A cache holding ``context`` random tokens per row and at least
  ``MARGIN`` free slots, as ``Generator.prefill`` makes it: each device's
  slots a multiple of ``SLOT_ALIGN``, the first ``context / D`` of device
  d at positions ``d context / D ...``, the cache split along its slots
  over the mesh's ``context`` axis (D devices; one without ``mesh``)."""
  d = 1 if mesh is None else mesh.shape["context"]
  per = -(-context // d)
  slots = -(-(per + -(-MARGIN // d)) // gen.SLOT_ALIGN) * gen.SLOT_ALIGN
  c = d * slots
  shape = (batch, cfg.num_kv_heads, c, cfg.head_dim)

  def make():
    keys = jax.random.split(jax.random.key(seed), 2 * cfg.num_layers)
    kv = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]
    local, device = jnp.arange(c) % slots, jnp.arange(c) // slots
    positions = jnp.where(local < per, device * per + local, -1)
    return gen.KVCache(kv[::2], kv[1::2],
                       jnp.broadcast_to(positions, (batch, c)).astype(
                           jnp.int32),
                       jnp.full((batch,), context, jnp.int32), per, d)

  if mesh is None:
    return jax.jit(make)()
  split = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))
  kv = split(None, None, "context", None)
  out = gen.KVCache([kv] * cfg.num_layers, [kv] * cfg.num_layers,
                    split(None, "context"), split(), per, d)
  return jax.jit(make, out_shardings=out)()


def step_seconds(generator, cache, steps: int = 24) -> tuple[float, float]:
  """Seconds per decode step over ``steps`` consecutive ones after 3, and
  the host's seconds per step call (the Python calls alone: equal to the
  step when the host, not the GPU, sets the pace)."""
  b = cache.lengths.shape[0]
  tokens = np.arange(b, dtype=np.int32) + 7
  for i in range(3):
    logits, cache = generator.step(cache, tokens, i)
  jax.block_until_ready(logits)
  t0 = time.perf_counter()
  for i in range(3, 3 + steps):
    logits, cache = generator.step(cache, tokens, i)
  host = time.perf_counter() - t0
  jax.block_until_ready(logits)
  return (time.perf_counter() - t0) / steps, host / steps


def host_rows(cfg, model, generator, mesh, rows, save, calls: int = 48):
  """Rows ``kind="host"``, one per way of calling a batch-1 step at 64
  tokens of context (see the module's ``--host``), appended to ``rows``
  and saved. The program is ``Generator.lower_step``'s, compiled, called
  with the model's arrays (``nnx.state``, flattened as the Generator
  holds them)."""
  tokens = np.array([7], np.int32)
  on_device = jnp.asarray(tokens), jnp.int32(3)
  steps = [jnp.int32(i) for i in range(calls + 3)]
  leaves = jax.tree.leaves(nnx.state(model))
  cache = random_cache(cfg, 1, 64, 4, mesh)
  program = generator.lower_step(cache, tokens, 0).compile()
  step = lambda *a: program(leaves, *a)
  nothing = jax.jit(lambda leaves, cache, t, s: (t + s, cache),
                    donate_argnums=(1,))
  ways = {
      "Generator.step": lambda c, i: generator.step(c, tokens, i),
      "program, NumPy arguments": lambda c, i: step(c, tokens, np.int32(i)),
      "program, the same device arguments": lambda c, i: step(c, *on_device),
      "program, a new step array a call": lambda c, i: step(
          c, on_device[0], steps[i]),
      "nothing, the same arguments": lambda c, i: nothing(
          leaves, c, tokens, np.int32(i)),
  }
  for way, call in ways.items():
    for i in range(3):
      out, cache = call(cache, i)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for i in range(3, 3 + calls):
      out, cache = call(cache, i)
    host = time.perf_counter() - t0
    jax.block_until_ready(out)
    total = time.perf_counter() - t0
    rows.append(dict(kind="host", way=way, batch=1, context=64,
                     host_us=host / calls * 1e6,
                     call_us=total / calls * 1e6))
    print(rows[-1], flush=True)
    save()
  prompt = [list(range(1, 65))]
  for n in (1, 8):
    times = []
    for _ in range(2):  # the first run compiles
      times.clear()
      generator.generate(prompt, max_new_tokens=calls + 1 + n,
                         tokens_per_call=n, on_tokens=lambda *_: times.append(
                             time.perf_counter()))
    after = times[n:]  # from the first decode call's last token (step n)
    rows.append(dict(kind="host", way=f"generate, {n} token(s) a call: a "
                     "token's time (mean)", batch=1, context=64,
                     tokens_per_call=n, call_us=(after[-1] - after[0]) / (
                         len(after) - 1) * 1e6))
    print(rows[-1], flush=True)
    save()


def kernel_profile(generator, cache, steps: int = 5, top: int = 12):
  """Per decode step, on the busiest GPU: its kernels' total microseconds,
  their count, the ``top`` kernels by time and every kind of kernel
  (``by_kind``: the name less its numbering, ``[count, us]`` a step;
  ``jax.profiler`` trace, device planes); each GPU's total; and the step
  program's launches in and out of CUDA graphs
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
  per_device = []  # each GPU's kernels: {name: us per step}, count
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    by_name, kinds, count = collections.Counter(), {}, 0
    for line in plane.lines:
      if "Stream" not in line.name:
        continue
      for ev in line.events:
        by_name[ev.name] += ev.duration_ns / 1e3 / steps
        kind = kinds.setdefault(re.sub(r"[._]\d+$", "", re.sub(
            r"(_\d+)+(_fusion)?(_\d+)*$", r"\2", ev.name[:60])), [0, 0.0])
        kind[0] += 1 / steps
        kind[1] += ev.duration_ns / 1e3 / steps
        count += 1
    per_device.append((by_name, count / steps, kinds))
  by_name, count, kinds = max(per_device, key=lambda x: sum(x[0].values()),
                              default=(collections.Counter(), 0, {}))
  program = program_summary(
      generator.lower_step(cache, tokens, 1).compile().as_text())
  return dict(kernel_us=sum(by_name.values()), kernels=count,
              kernel_us_per_gpu=[round(sum(x.values()), 1)
                                 for x, _, _ in per_device],
              by_kind={k: [round(n, 1), round(us, 1)] for k, (n, us) in
                       sorted(kinds.items(), key=lambda x: -x[1][1])},
              program=program,
              top={k: round(v, 1) for k, v in by_name.most_common(top)})


def default_load_rows(a, cfg, model, bw, rows, save, new: int = 49):
  """``--default-load``: a row per context and load, appended to ``rows``:
  ``load_pretrained(path)`` as a user writes it, then with float32 master
  weights asked for (``param_dtype=jnp.float32``, bfloat16 compute)."""
  import tempfile
  from safetensors import safe_open
  with tempfile.TemporaryDirectory() as tmp:
    models.save_pretrained(model, tmp, dtype=jnp.bfloat16)
    stored = 0
    for path in pathlib.Path(tmp).glob("*.safetensors"):
      with safe_open(path, "np") as f:
        stored += sum(2 * int(np.prod(f.get_slice(n).get_shape()))
                      for n in f.keys())
    loads = {"load_pretrained(path)": models.load_pretrained(tmp),
             "param_dtype=float32": models.load_pretrained(
                 tmp, param_dtype=jnp.float32)}
  for way, loaded in loads.items():
    weights = weight_bytes(loaded)
    generator = gen.Generator(loaded)
    for ctx in a.context:
      prompt = np.random.default_rng(1).integers(1, cfg.vocab_size,
                                                 ctx).tolist()
      times = []
      for _ in range(2):  # the first call compiles
        times.clear()
        generator.generate([prompt], max_new_tokens=new,
                           on_tokens=lambda *_: times.append(
                               time.perf_counter()))
      after = times[gen.TOKENS_PER_CALL:]  # from the first decode call's end
      token = (after[-1] - after[0]) / (len(after) - 1)
      kv = 2 * cfg.num_layers * ctx * cfg.num_kv_heads * cfg.head_dim * 2
      floor = (stored + kv) / bw  # bfloat16 weights + the cache
      rows.append(dict(kind="generate", way=way, batch=1, context=ctx,
                       devices=1, step_ms=token * 1e3, floor_ms=floor * 1e3,
                       over_floor=token / floor,
                       param_dtype=str(jnp.dtype(loaded.cfg.param_dtype)),
                       dtype=str(jnp.dtype(loaded.cfg.dtype)),
                       loaded_gib=weights / 2**30,
                       checkpoint_gib=stored / 2**30))
      print(rows[-1], flush=True)
      save()


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


def load_split(model, devices: int):
  """``model`` saved, then loaded as a user would with its cache's
  sequence over ``devices`` GPUs: (the model, its 1 x devices mesh)."""
  import tempfile

  import jax_ring
  mesh = jax.make_mesh((1, devices), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:devices])
  with tempfile.TemporaryDirectory() as tmp, jax.set_mesh(mesh):
    models.save_pretrained(model, tmp)
    split = models.load_pretrained(
        tmp, mesh=mesh, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
        context_parallel=jax_ring.ContextParallel(axis="context",
                                                  inputs="load_balanced"),
        rules=models.model_rules(data=None))
  return split, mesh


def equal_to_one(model, split, mesh, length: int, new: int = 16) -> dict:
  """One random prompt of ``length`` tokens, ``new`` greedy tokens by the
  one-GPU ``model`` and by the ``split`` one: are they the same, and the
  relative error of the split prefill's logits."""
  prompt = np.random.default_rng(2).integers(
      0, model.cfg.vocab_size, length).tolist()
  one = gen.Generator(model)
  first, _ = one.prefill([prompt], max_new_tokens=new)
  tokens = one.generate([prompt], max_new_tokens=new)[0]
  with jax.set_mesh(mesh):
    many = gen.Generator(split)
    got, _ = many.prefill([prompt], max_new_tokens=new)
    got_tokens = many.generate([prompt], max_new_tokens=new)[0]
  same = [a == b for a, b in zip(tokens, got_tokens)]
  return dict(equal_at=length, new_tokens=new, tokens_equal=all(same),
              first_difference=None if all(same) else same.index(False),
              prefill_logits_rel_err=rel_err(got, first))


def parse_args():
  p = argparse.ArgumentParser()
  p.add_argument("--context", type=int, nargs="+",
                 default=[8192, 32768, 131072])
  p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  p.add_argument("--prefill", type=int, nargs="*", default=[32768, 131072])
  p.add_argument("--devices", type=int, default=1, help="GPUs the cache's "
                 "sequence is split over")
  p.add_argument("--equal-at", type=int, default=16384, help="with "
                 "--devices > 1: the prompt length of the comparison with "
                 "one GPU (0: none)")
  p.add_argument("--kernels", nargs="+", default=None,
                 choices=["xla", "pallas"], help="decode_attention "
                 "implementations, each timed on the same caches (default: "
                 "pallas xla on GPUs, xla elsewhere)")
  p.add_argument("--mode", default="default")
  p.add_argument("--profile", action="store_true", help="also a kernel "
                 "profile of the step at each batch's longest context")
  p.add_argument("--host", action="store_true", help="also where a "
                 "batch-1 step's host time goes (rows kind=host)")
  p.add_argument("--default-load", action="store_true", help="only "
                 "generate through load_pretrained(path) of a bfloat16 "
                 "checkpoint with no dtype argument (rows kind=generate)")
  p.add_argument("--dry-run", action="store_true", help="a 2-layer model "
                 "of hidden 64 (CPU: checks that the script runs)")
  return p.parse_args()


def decode_rows(a, cfg, model, weights, bw, mesh, rows, save):
  """A row per batch x context x decode kernel, appended to ``rows`` and
  saved as it comes: the step against its per-device floor, the kernels
  timed one after the other on the same shapes."""
  d = 1 if mesh is None else mesh.shape["context"]
  generators = {k: gen.Generator(model, decode_implementation=k)
                for k in a.kernels}
  for b, kernel in itertools.product(a.batch, a.kernels):
    generator = generators[kernel]
    base, _ = step_seconds(generator, random_cache(cfg, b, 64, 1, mesh))
    for ctx in a.context:
      print(f"decode ({kernel}): batch {b}, context {ctx} (a first step "
            f"compiles)", flush=True)
      cache = random_cache(cfg, b, ctx, 2, mesh)
      kv = 2 * cfg.num_layers * b * ctx * cfg.num_kv_heads * cfg.head_dim * 2
      t, host = step_seconds(generator, cache)
      prof = None
      if a.profile and ctx == max(a.context):
        prof = kernel_profile(generator, random_cache(cfg, b, ctx, 3, mesh))
        print(f"profile, batch {b}, context {ctx}: {prof}", flush=True)
      del cache
      floor = (weights + kv / d) / bw
      rows.append(dict(kind="decode", kernel=kernel, batch=b, context=ctx,
                       devices=d, step_ms=t * 1e3, floor_ms=floor * 1e3,
                       over_floor=t / floor, step_64_ms=base * 1e3,
                       host_ms=host * 1e3, cache_gib=kv / 2**30, **(
                           {} if prof is None else dict(profile=prof))))
      print(rows[-1], flush=True)
      save()


def prefill_rows(a, cfg, generator, weights, bw, mesh, rows, save):
  """A row per prompt length, appended to ``rows`` and saved as it comes:
  prefill tokens/s (the second call), and the decode step on that
  prefill's cache against its per-device floor."""
  d = 1 if mesh is None else mesh.shape["context"]
  for ctx in a.prefill:
    print(f"prefill: {ctx} tokens (the first call compiles)", flush=True)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size,
                                               ctx).tolist()
    run = lambda: jax.block_until_ready(
        generator.prefill([prompt], max_new_tokens=MARGIN))
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, cache = run()
    t = time.perf_counter() - t0
    step, _ = step_seconds(generator, cache)
    del cache
    kv = 2 * cfg.num_layers * ctx * cfg.num_kv_heads * cfg.head_dim * 2
    floor = (weights + kv / d) / bw
    rows.append(dict(kind="prefill", batch=1, context=ctx, devices=d,
                     prefill_s=t, first_prefill_s=first,
                     tokens_per_s=ctx / t, step_after_prefill_ms=step * 1e3,
                     floor_ms=floor * 1e3, over_floor=step / floor))
    print(rows[-1], flush=True)
    save()


def main():
  a = parse_args()
  a.kernels = a.kernels or (["pallas", "xla"] if jax.default_backend() ==
                            "gpu" else ["xla"])
  shapes = LLAMA_1B | (dict(hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16,
                            vocab_size=1000) if a.dry_run else {})
  cfg = models.config_from_hf(shapes, dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16)
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  bw = bandwidth()
  weights = weight_bytes(model)
  print(f"HBM {bw / 1e12:.2f} TB/s; weights {weights / 2**30:.2f} GiB",
        flush=True)
  extra = dict(model="Llama-3.2-1B shapes, random, bfloat16",
               hbm_tb_s=bw / 1e12, weight_gib=weights / 2**30,
               floor="(weights + K/V of the context / devices) / measured "
               "HBM bandwidth; step over consecutive donated-cache steps")
  mesh, scope = None, contextlib.nullcontext()
  if a.devices > 1:
    split, mesh = load_split(model, a.devices)
    if a.equal_at:
      extra["equal_to_one_gpu"] = equal_to_one(model, split, mesh,
                                               a.equal_at)
      print(extra["equal_to_one_gpu"], flush=True)
    model, scope = split, jax.set_mesh(mesh)
  rows = []
  save = lambda show=False: write(
      "decoding", rows,
      ["kind", "kernel", "batch", "context", "devices", "step_ms",
       "floor_ms", "over_floor", "step_64_ms", "host_ms",
       "step_after_prefill_ms", "tokens_per_s", "way", "host_us",
       "call_us"], extra=extra, mode=a.mode,
      show=show)
  if a.default_load:
    default_load_rows(a, cfg, model, bw, rows, save)
    save(show=True)
    return
  with scope:
    decode_rows(a, cfg, model, weights, bw, mesh, rows, save)
    generator = gen.Generator(model)
    if a.host:
      host_rows(cfg, model, generator, mesh, rows, save)
    prefill_rows(a, cfg, generator, weights, bw, mesh, rows, save)
  if mesh is None:
    err = check(model, generator)
    print(f"prefill + decode logits against the full forward: {err:.2e}")
    extra["logits_rel_err_vs_full_forward"] = err
  save(show=True)


if __name__ == "__main__":
  main()
