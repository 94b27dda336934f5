"""The compile of issue 29 under jax's default flags, in a fresh process.

A tiny Qwen2 (``jax_ring.models``, 2 layers, packed documents) under
``hybrid`` on data=2 x ulysses=2 x ring=2 used to compile in seconds or never
(killed after 5 minutes; once more than 14), depending on how deep the
Python stack was when it was traced: XLA's call-inliner metadata pass
concatenated the unrelated stack frames that the ``custom_partitioning``
bodies carried (see ``jax_ring/_src/__init__.py``), and
``jax_include_full_tracebacks_in_locations=False`` hid it. The program runs
in a subprocess: jax's defaults whatever the test process has set, a stack
of a known depth, and a hang that ends in a timeout. Its reference, the
model unsharded, runs in the test's process (compiled under jax's default
flags, it would be most of the child's time).

  python tests/test_compile_default_flags.py [OUT.npy]   # the child: prints
  # JSON and saves its output to OUT.npy
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).parent
# Extra frames under the compile, as a test runner's stack has: from this
# depth the old code's compile had not finished after 2 minutes (from the
# script's own shallow stack it took 3 s, with the partitioned bodies'
# foreign stack frames that the body-frames assertion finds).
DEPTH = 40
COMPILE_LIMIT_S = 60  # it takes about 4 s


def test_hybrid_packed_qwen2_compiles_in_seconds_under_default_flags(
    tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  for name in list(env):  # jax's defaults, whatever the caller's shell says
    if name.startswith("JAX_"):
      del env[name]
  env["PYTHONPATH"] = os.pathsep.join(
      [str(HERE.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
  try:
    run = subprocess.run([sys.executable, __file__, str(tmp_path / "out.npy")],
                         env=env, text=True, capture_output=True, timeout=240)
  except subprocess.TimeoutExpired:
    pytest.fail("the default-flags compile did not finish in 240 s")
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  assert result["full_tracebacks"]  # jax's default was in force
  assert result["compile_s"] < COMPILE_LIMIT_S, result
  # The partitioned bodies carry no stack frames of their own: every source
  # location on their instructions is one the program's own operations
  # carry (none of jax_ring's, no stack another loop left).
  assert result["body_locations"], result
  assert set(result["body_locations"]) <= set(
      result["program_locations"]), result
  got, want = np.load(tmp_path / "out.npy"), _unsharded_forward()
  error = float(np.abs(got - want).max() / np.abs(want).max())
  assert error <= 1e-5, (error, result)


def _qwen2():
  """A tiny Qwen2 (``jax_ring.models``, 2 layers), tokens and packed
  document ids, and ``build(cfg, place)``: the model with random weights
  (norms and biases too), built without running its initialisers (each is
  a small compile)."""
  import jax
  from flax import nnx

  from jax_ring import models

  cfg = models.LlamaConfig(
      vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
      tie_word_embeddings=True, model_type="qwen2", implementation="xla")
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (2, 64))
  ids = np.repeat(np.array([[1, 2, 3, 4], [1, 1, 2, 3]]), 16, axis=1)

  def build(cfg, place):
    gdef, state = nnx.split(nnx.eval_shape(
        lambda: models.Llama(cfg, rngs=nnx.Rngs(0))))
    weights = np.random.default_rng(1)
    return nnx.merge(gdef, jax.tree.map(lambda s: place(
        (0.2 * weights.standard_normal(s.shape)).astype(s.dtype)), state))

  return cfg, tokens, ids, build


def _forward(model, batch):
  return model(batch.inputs, batch.positions, batch.segment_ids)


def _unsharded_forward():
  """The child's model on one CPU device, in this process (float32, as the
  child's)."""
  import jax

  from jax_ring import flax as jrf

  cfg, tokens, ids, build = _qwen2()
  cpu = functools.partial(jax.device_put, device=jax.devices("cpu")[0])
  return np.asarray(jax.jit(_forward)(build(cfg, cpu), jax.tree.map(
      cpu, jrf.make_lm_batch(tokens, ids))))


def _child():
  import re
  import time

  import jax

  # XLA:CPU's 8 simulated devices, also on a machine with GPUs.
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jax_ring
  from jax_ring import flax as jrf
  from jax_ring import models

  mesh = jax.make_mesh((2, 2, 2), ("data", "ulysses", "ring"),
                       axis_types=(AxisType.Auto,) * 3)
  cpc = jax_ring.ContextParallel(axis=("ulysses", "ring"), strategy="hybrid",
                                 inputs="load_balanced")
  seq = ("ring", "ulysses")
  cfg, tokens, ids, build = _qwen2()
  forward = jax.jit(_forward)
  with jax.set_mesh(mesh):
    model = build(cfg.replace(context_parallel=cpc,
                              rules=models.model_rules(context=seq)),
                  lambda x: jax.device_put(x, NamedSharding(mesh, P())))
  batch = jrf.prepare_lm_batch(tokens, ids, mesh=mesh, spec=P("data", seq),
                               context_parallel=cpc)

  def deep(n):
    if n:
      return deep(n - 1)
    with jax.set_mesh(mesh):
      lowered = forward.lower(model, batch)
      start = time.perf_counter()
      compiled = lowered.compile()
      return compiled, time.perf_counter() - start

  compiled, seconds = deep(DEPTH)
  with jax.set_mesh(mesh):
    got = np.asarray(jax_ring.reorder_from_load_balance(
        compiled(model, batch), jrf.reorder_size(cpc, mesh)))
  # Each instruction's stack frame, as the source location it names (jax
  # 0.11 numbers a body's frames apart from the program's own, at the same
  # locations).
  text = compiled.as_text()
  location = {int(f): int(loc) for f, loc in re.findall(
      r"^(\d+) \{file_location_id=(\d+) parent_frame_id", text, re.M)}
  frames = {True: set(), False: set()}
  for line in text.splitlines():
    frame = re.search(r"stack_frame_id=(\d+)", line)
    if frame:  # jax names the partitioned bodies' module tmp_xla_computation
      frames["tmp_xla_computation" in line].add(
          location[int(frame.group(1))])
  print(json.dumps(dict(
      full_tracebacks=jax.config.jax_include_full_tracebacks_in_locations,
      compile_s=seconds, body_locations=sorted(frames[True]),
      program_locations=sorted(frames[False]))))
  if len(sys.argv) > 1:
    np.save(sys.argv[1], got)


if __name__ == "__main__":
  _child()
