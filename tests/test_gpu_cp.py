"""Every context-parallel strategy with cuDNN blocks, on the machine's real
devices, against the float64 reference: the GPU lane.

  python -m pytest tests -m gpu        # on a machine with >= 2 NVIDIA GPUs

The matrix, for each cp that divides the device count (cp >= 2; on a
machine of one GPU, cp = 1):

==========  ==================================================  ===========
axis        values                                              entry
==========  ==================================================  ===========
strategy    ring: neighbour / gather sends x unrolled / scan;   shard_map
            all_gather (one-shot / ``kv_chunk_heads=1``);       and jit
            ulysses; hybrid (U=2, R=cp/2; cp >= 4); auto (jit;
            dual-chunk, and contiguous: the ring first)
mask        causal, full, window (crosses shards), padding
            lengths (odd), packed documents (odd lengths,
            crossing shards), soft cap
layout      dual_chunk, striped (all_gather: dual_chunk,
            contiguous)
shape       MHA / GQA / MQA, head dim 64 / 128, bf16 / fp16,
            local lengths 256-2048, cycled through the cases;
            and at cp = 1, MLA head dims (192 for q/k, 128 for v),
            causal and packed, each strategy but hybrid
==========  ==================================================  ===========

Each case runs forward and backward with ``implementation=None`` (cuDNN
wherever it serves), rank-codes the shards (device r's tokens shifted by r
/ 2, so a misplaced shard is a wrong number), and checks output and
gradients against ``reference.attention`` at the dtype's tolerance. It also
proves which backend ran: the compiled program must hold cuDNN's FFI custom
calls (forward and backward), and no block may have been lowered through
the pure-JAX backend or fallen back inside the cuDNN backend (a spy counts
both while the program lowers), so a silent fallback fails the case.

Without GPUs the same harness runs a few cases with the pure-JAX blocks in
float32 on the simulated CPU devices (``test_harness_on_cpu``), where the
spy must see every block go through XLA and the program hold no FFI call.
With ``JAX_RING_TEST_RECORD=path`` each GPU case appends one JSON line
(id, seconds, FFI calls, errors) for ``benchmarks/gpu_tests.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from jax_ring._src.core import registry
from jax_ring._src.backends import cudnn

GPUS = len(jax.devices("gpu")) if jax.default_backend() == "gpu" else 0

# name -> (strategy, its options, the layouts it runs in). The options are
# ``ContextParallel`` fields, passed the same to the shard_map functions.
STRATEGIES = {
    "ring_neighbour_unrolled": ("ring", dict(kv_sends="neighbour",
                                             loop="unrolled")),
    "ring_neighbour_scan": ("ring", dict(kv_sends="neighbour", loop="scan")),
    "ring_gather_unrolled": ("ring", dict(kv_sends="gather",
                                          loop="unrolled")),
    "ring_gather_scan": ("ring", dict(kv_sends="gather", loop="scan")),
    # The default sends: on contiguous shards, packed rows run the steps
    # up to the last one a document reaches (ring.reach).
    "ring_default": ("ring", {}),
    "all_gather": ("all_gather", {}),
    "all_gather_chunked": ("all_gather", dict(kv_chunk_heads=1)),
    "ulysses": ("ulysses", {}),
    "hybrid": ("hybrid", {}),
    "auto": ("auto", {}),
    # On contiguous shards, packed rows that auto gives Ulysses run the
    # ring's own block and reach test first (auto.ring_first).
    "auto_contiguous": ("auto", {}),
}
# Layouts per strategy kind or name (others: dual_chunk, striped); all-gather
# and hybrid take no striped layout.
LAYOUTS = {"all_gather": ("dual_chunk", None), "hybrid": ("dual_chunk", None),
           "ring_default": ("dual_chunk", None),
           "auto_contiguous": ("dual_chunk", None)}
# Strategies run in some of their layouts only (each case keeps the shape
# its (cp, mask, layout) has for the others).
ONLY = {"ring_default": (None,), "auto_contiguous": (None,)}
MASKS = ("causal", "full", "window", "padding", "packed", "soft_cap")
# At the largest cp only: sinks (causal; their gradient checked too), and
# rows of many documents (MANY_DOCS a row).
EXTRA_MASKS = ("sinks", "many_docs")
MANY_DOCS = 64
SHARD_MAP_FUNCTIONS = {"ring": jax_ring.ring_attention,
                       "all_gather": jax_ring.all_gather_attention,
                       "ulysses": jax_ring.ulysses_attention,
                       "hybrid": jax_ring.hybrid_attention}
HYBRID_AXES = ("ulysses", "ring")


@dataclasses.dataclass(frozen=True)
class Shape:
  """B batch, N query heads, K kv heads, H head dim, T tokens per device;
  Hv the value head dim, if not H."""

  name: str
  b: int
  n: int
  k: int
  h: int
  t: int
  dtype: object
  hv: int | None = None

  def __str__(self):
    v = f"_v{self.hv}" if self.hv else ""
    return (f"{self.name}{self.n}x{self.k}_h{self.h}{v}_t{self.t}_"
            f"{jnp.dtype(self.dtype).name}")


# Cycled through the cases of each strategy. N = 8 serves Ulysses up to cp =
# 8 (and hybrid's U = 2). A shape's T is the local length at cp = 2; at
# larger cp it shrinks (not below 256) so that the whole sequence stays
# within MAX_TOKENS: the float64 reference holds several (B, N, S, S)
# arrays, 1 GB each at B x N = 8 and S = 4096.
GPU_SHAPES = (
    Shape("mha", 1, 8, 8, 128, 512, jnp.bfloat16),
    Shape("gqa", 1, 8, 2, 64, 1000, jnp.float16),
    Shape("mqa", 2, 8, 1, 64, 256, jnp.bfloat16),
    Shape("gqa", 1, 8, 2, 128, 2048, jnp.bfloat16),
    Shape("mha", 1, 8, 8, 64, 640, jnp.float16),
    Shape("mqa", 1, 8, 1, 128, 384, jnp.float16),
)
MAX_TOKENS = 4096
CPU_SHAPES = (Shape("gqa", 2, 8, 2, 16, 12, jnp.float32),)
# Multi-head latent attention (DeepSeek-V3's head dims: 192 for queries and
# keys, 128 for values), at cp = 1 on any GPU machine.
MLA_SHAPE = Shape("gqa", 1, 8, 2, 192, 512, jnp.bfloat16, hv=128)
MLA_MASKS = ("causal", "packed")


@dataclasses.dataclass(frozen=True)
class CpCase:
  strategy: str  # a key of STRATEGIES
  mask: str
  layout: str | None
  entry: str  # "shard_map" or "jit"
  cp: int
  shape: Shape

  def __str__(self):
    return (f"n{self.cp}-{self.strategy}-{self.mask}-"
            f"{self.layout or 'contiguous'}-{self.entry}-{self.shape}")


def cases(devices: int, shapes=GPU_SHAPES, min_cp: int = 2) -> list[CpCase]:
  """The lane's matrix on ``devices`` devices, for each cp >= ``min_cp``
  that divides it; at the largest cp also EXTRA_MASKS and the MLA cases.

  A case's shape is set by its cp, mask and layout, not by its strategy or
  entry: every strategy and entry of one (cp, mask, layout) solves the same
  problem, so its float64 reference is computed once (``expected``)."""
  cps = [c for c in range(min_cp, devices + 1) if devices % c == 0]
  out = []
  for cp in cps:
    masks = MASKS + (EXTRA_MASKS if cp == cps[-1] else ())
    for name, (kind, _) in STRATEGIES.items():
      if kind == "hybrid" and (cp < 4 or cp % 2):
        continue
      entries = ("jit",) if kind == "auto" else ("shard_map", "jit")
      layouts = LAYOUTS.get(name, LAYOUTS.get(kind, ("dual_chunk",
                                                     "striped")))
      for j, (mask, layout) in enumerate(itertools.product(masks, layouts)):
        if layout not in ONLY.get(name, layouts):
          continue
        shape = shapes[(j + cp) % len(shapes)]
        t = max(min(shape.t, MAX_TOKENS // cp), 256) if shapes is GPU_SHAPES \
            else shape.t
        out += [CpCase(name, mask, layout, entry, cp,
                       dataclasses.replace(shape, t=t)) for entry in entries]
  if shapes is GPU_SHAPES and cps:
    out += mla_cases(cps[-1])
  return out


def mla_cases(cp: int) -> list[CpCase]:
  """Each strategy that runs at ``cp`` on MLA_SHAPE: the causal and packed
  masks, in its first layout, through shard_map (auto: jit)."""
  out = []
  for name, (kind, _) in STRATEGIES.items():
    if kind == "hybrid" and (cp < 4 or cp % 2):
      continue
    layout = ONLY.get(name, LAYOUTS.get(kind, ("dual_chunk",)))[0]
    entry = "jit" if kind == "auto" else "shard_map"
    out += [CpCase(name, mask, layout, entry, cp, MLA_SHAPE)
            for mask in MLA_MASKS]
  return out


# ---------------------------------------------------------------------------
# Inputs and the reference problem


def odd_documents(seed, b, s, per_row=5):
  """(B, S) int32 packed-document ids: about ``per_row`` documents of odd
  lengths (the last takes what is left), so most cross a shard border."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((b, s), np.int32)
  for row in range(b):
    start, doc = 0, 0
    while start < s:
      length = int(rng.integers(s // (2 * per_row), 5 * s // (4 * per_row)))
      length |= 1
      ids[row, start:start + length] = doc
      start, doc = start + length, doc + 1
  return ids


def problem(case: CpCase, seed: int):
  """(q, k, v, dout in natural order, rank-coded; the reference Case; the
  call's options; the segment ids or None; the sinks or None)."""
  sh, cp = case.shape, case.cp
  s = sh.t * cp
  q, k, v, do = ref.random_qkv(seed, sh.b, s, s, sh.n, sh.k, sh.h, hv=sh.hv)
  # At most 0.5 apart, so that the code's q.k cross term (about code^2 x
  # sqrt(H)) moves the logits by a few units, not by tens.
  code = ref.shard_code(s, cp, case.layout, layout_cp(case), step=0.5 / cp)
  q, k, v, do = (x.astype(sh.dtype) for x in (q + code, k - code, v + code,
                                               do))
  scale = sh.h**-0.5
  rcase = ref.Case(scale, is_causal=case.mask != "full")
  kw = dict(is_causal=rcase.is_causal)
  ids = sinks = None
  if case.mask == "window":
    window = (sh.t * 3 // 4 + 1, 0)  # reaches into the previous shard
    rcase = dataclasses.replace(rcase, window=window)
    kw["local_window_size"] = window
  elif case.mask == "padding":
    lengths = np.array([s - 2 * sh.t // 3 - 1, sh.t // 2 + 3][:sh.b],
                       np.int32), np.array([s - 5, sh.t + 7][:sh.b], np.int32)
    rcase = dataclasses.replace(rcase, q_lengths=lengths[0],
                                kv_lengths=lengths[1])
    kw["query_seq_lengths"] = jnp.asarray(lengths[0])
    kw["key_value_seq_lengths"] = jnp.asarray(lengths[1])
  elif case.mask in ("packed", "many_docs"):
    many = case.mask == "many_docs"
    ids = odd_documents(seed, sh.b, s, per_row=MANY_DOCS if many else 5)
    # packed: a handful of long documents a row (each at least s / 10
    # tokens); many_docs: dozens of short ones, in class 0's larger menus
    # of virtual batches (test_cudnn.py runs rows of several classes and
    # loops of calls on one GPU).
    assert (ids.max() >= MANY_DOCS // 2) if many else ids.max() <= 10, (
        ids.max())
    rcase = dataclasses.replace(rcase, q_segment_ids=ids, kv_segment_ids=ids)
  elif case.mask == "soft_cap":
    rcase = dataclasses.replace(rcase, soft_cap=5.0)
    kw["logits_soft_cap"] = 5.0
  elif case.mask == "sinks":
    # Around the logits' scale, so that each sink takes a real share.
    sinks = jax.random.normal(jax.random.key(seed + 1), (sh.n,),
                              jnp.float32) + 1.0
  return (q, k, v, do), rcase, kw, ids, sinks


# ---------------------------------------------------------------------------
# Which backend ran


@dataclasses.dataclass
class BackendSpy:
  """What lowered while it was installed: blocks through the pure-JAX
  backend, and the reasons cuDNN gave for blocks it passed on to it."""

  xla_blocks: int = 0
  cudnn_fallbacks: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def backend_spy():
  spy = BackendSpy()
  xla, unsupported = registry.BACKENDS["xla"], cudnn.unsupported

  def counted(fn):
    def wrapper(*args):
      spy.xla_blocks += 1
      return fn(*args)
    return wrapper

  def reasons(*args):
    why = unsupported(*args)
    if why is not None:
      spy.cudnn_fallbacks.append(why)
    return why

  registry.BACKENDS["xla"] = dataclasses.replace(
      xla, forward=counted(xla.forward), backward=counted(xla.backward))
  cudnn.unsupported = reasons
  try:
    yield spy
  finally:
    registry.BACKENDS["xla"], cudnn.unsupported = xla, unsupported


def ffi_calls(hlo: str) -> dict[str, int]:
  """cuDNN FFI custom calls in a compiled program, by target."""
  found = re.findall(r'custom_call_target="(jax_ring_sdpa_\w+)"', hlo)
  return {t: found.count(t) for t in sorted(set(found))}


# ---------------------------------------------------------------------------
# Running one case


def layout_cp(case: CpCase) -> int:
  """The cp_size of the load-balance layout: the ring axis for hybrid."""
  return case.cp // 2 if STRATEGIES[case.strategy][0] == "hybrid" else case.cp


def case_mesh(case: CpCase):
  devices = np.array(jax.devices()[:case.cp])
  if STRATEGIES[case.strategy][0] == "hybrid":
    return Mesh(devices.reshape(case.cp // 2, 2), ("ring", "ulysses"))
  return Mesh(devices, ("cp",))


def attention_fn(case: CpCase, kw, implementation, mesh):
  """(f(q, k, v, ids, sinks) on global arrays in the layout, the token
  spec); ``ids`` and ``sinks`` may be None."""
  kind, options = STRATEGIES[case.strategy]
  hybrid = kind == "hybrid"
  axis = HYBRID_AXES if hybrid else "cp"
  spec = P(None, ("ring", "ulysses")) if hybrid else P(None, "cp")
  call = dict(kw, load_balance=case.layout, implementation=implementation)
  if case.entry == "jit":
    cpc = jax_ring.ContextParallel(axis=axis, strategy=kind,
                                   load_balance=case.layout,
                                   inputs="load_balanced", **options)
    del call["load_balance"]
    f = lambda q, k, v, ids, sinks: jax_ring.dot_product_attention(
        q, k, v, segment_ids=ids, sinks=sinks, context_parallel=cpc, **call)
    return f, spec
  fn = SHARD_MAP_FUNCTIONS[kind]

  def f(q, k, v, ids, sinks):
    # The optional operands travel as a dict (None leaves are no operands):
    # ids split like the tokens, the sinks whole on every device.
    extra = {n: x for n, x in dict(segment_ids=ids, sinks=sinks).items()
             if x is not None}
    specs = dict(segment_ids=spec, sinks=P())
    inner = lambda q, k, v, extra: fn(q, k, v, axis_name=axis, **extra,
                                      **options, **call)
    return jax.shard_map(inner, mesh=mesh, in_specs=(spec,) * 3 + (
        {n: specs[n] for n in extra},), out_specs=spec)(q, k, v, extra)
  return f, spec


def run_case(case: CpCase, implementation, seed=0):
  """Forward and backward of ``case`` on its mesh. Returns (inputs, the
  reference Case, the sinks or None, out, grads (dq, dk, dv[, dsinks]),
  the backend spy, FFI calls by target, seconds by phase)."""
  inputs, rcase, kw, ids, sinks = problem(case, seed)
  mesh = case_mesh(case)
  f, spec = attention_fn(case, kw, implementation, mesh)
  n = layout_cp(case)
  to = lambda x: (jax_ring.reorder_for_load_balance(x, n, layout=case.layout)
                  if case.layout else x)
  back = lambda x: (jax_ring.reorder_from_load_balance(
      x, n, layout=case.layout) if case.layout else x)
  tok = NamedSharding(mesh, spec)
  q, k, v, do = (jax.device_put(to(x), tok) for x in inputs)
  seg = None if ids is None else jax.device_put(to(jnp.asarray(ids)), tok)
  primals = (q, k, v) + (() if sinks is None else (sinks,))

  @jax.jit
  def go(primals, do, seg):
    out, vjp = jax.vjp(
        lambda q, k, v, *s: f(q, k, v, seg, s[0] if s else None), *primals)
    return out, vjp(do)

  seconds, t0 = {}, time.perf_counter()
  with backend_spy() as spy:
    compiled = go.lower(primals, do, seg).compile()
  seconds["compile"], t0 = time.perf_counter() - t0, time.perf_counter()
  out, grads = compiled(primals, do, seg)
  out = jax.block_until_ready(out)
  seconds["run"] = time.perf_counter() - t0
  grads = tuple(back(g) for g in grads[:3]) + grads[3:]
  return (inputs, rcase, sinks, back(out), grads, spy,
          ffi_calls(compiled.as_text()), seconds)


def expected(case: CpCase, inputs, rcase, sinks, seed=0):
  """The float64 reference's {out, dq, dk, dv[, dsinks]} for ``case``'s
  problem. With ``JAX_RING_REF_CACHE=dir`` it is kept there, one file a
  problem, for every case (and lane worker) that solves the same one."""
  q, k, v, do = inputs

  def solve():
    out, _, g = ref.attention(q, k, v, rcase, dout=do, sinks=sinks)
    return dict(out=out, dq=g["q"], dk=g["k"], dv=g["v"],
                **({} if sinks is None else dict(dsinks=g["sinks"])))

  root = os.environ.get("JAX_RING_REF_CACHE")
  if not root:
    return solve()
  # What the problem depends on (test_gpu_cp.problem): the shape, mask,
  # the rank code's layout and device counts, and the seed.
  key = repr((case.shape, case.mask, case.layout, layout_cp(case), case.cp,
              seed))
  path = pathlib.Path(root) / (hashlib.sha1(key.encode()).hexdigest() +
                               ".npz")
  if path.exists():
    with np.load(path) as f:
      return dict(f)
  want = solve()
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".{os.getpid()}.npz")
  np.savez(tmp, **want)
  os.replace(tmp, path)  # whole or absent, for the other workers
  return want


def check_values(case: CpCase, inputs, rcase, sinks, out, grads):
  """Max relative errors, after asserting each within the dtype's
  tolerance against the float64 reference."""
  want = expected(case, inputs, rcase, sinks)
  got = dict(zip(("out", "dq", "dk", "dv", "dsinks"), (out,) + grads))
  assert got.keys() == want.keys(), (got.keys(), want.keys())
  errors = {}
  for name in want:
    ref.assert_close(got[name], want[name], inputs[0].dtype, name)
    errors[name] = ref.relative_error(got[name], want[name])
  return errors


# ---------------------------------------------------------------------------
# The lane


def _gpu_params():
  # Collected on every machine, run where the devices are: ids of the
  # 2-GPU matrix without GPUs, so that `-m gpu` lists what it would run.
  # A machine of one GPU runs the matrix at cp = 1 instead (ids n1-...):
  # no collectives, but the same cuDNN blocks, spy and FFI checks.
  extra = cases(1, min_cp=1) if GPUS == 1 else []
  return [pytest.param(c, id=str(c)) for c in cases(max(GPUS, 2)) + extra]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_params())
def test_cuda_blocks_match_reference(case):
  if GPUS < case.cp:
    pytest.skip(f"needs {case.cp} NVIDIA GPUs; found {GPUS}")
  assert cudnn.LOAD_ERROR is None, cudnn.LOAD_ERROR
  start = time.perf_counter()
  inputs, rcase, sinks, out, grads, spy, calls, seconds = run_case(case, None)
  assert spy.xla_blocks == 0, (
      f"{spy.xla_blocks} blocks lowered through the pure-JAX backend")
  assert not spy.cudnn_fallbacks, spy.cudnn_fallbacks
  fwd = sum(n for t, n in calls.items() if t.startswith("jax_ring_sdpa_fwd"))
  bwd = sum(n for t, n in calls.items() if t.startswith("jax_ring_sdpa_bwd"))
  assert fwd and bwd, f"no cuDNN forward/backward call in the program: {calls}"
  t0 = time.perf_counter()
  errors = check_values(case, inputs, rcase, sinks, out, grads)
  seconds["check"] = time.perf_counter() - t0
  record = os.environ.get("JAX_RING_TEST_RECORD")
  if record:
    with open(record, "a") as fh:
      fh.write(json.dumps(dict(
          case=str(case), ffi_calls=calls, errors=errors,
          tolerance=ref.TOLERANCES[jnp.dtype(case.shape.dtype)],
          seconds=round(time.perf_counter() - start, 2),
          phases={k: round(v, 2) for k, v in seconds.items()})) + "\n")


def test_lane_covers_the_matrix():
  """The 2- and 4-GPU lanes: every strategy x mask x layout x entry, each
  shape at least once per strategy; EXTRA_MASKS and MLA at the largest cp;
  at least 150 cases on 2 GPUs and 350 on 4."""
  two, four = cases(2), cases(4)
  assert len(two) >= 150 and len(four) >= 350, (len(two), len(four))
  assert len({str(c) for c in four}) == len(four)
  for name, (kind, _) in STRATEGIES.items():
    for lane, cps in ((two, {2}), (four, {2, 4})):
      mine = [c for c in lane if c.strategy == name]
      if kind == "hybrid":
        cps -= {2}  # needs 4 devices
      assert {c.cp for c in mine} == cps, name
      if not mine:
        continue
      top = [c for c in mine if c.cp == max(cps)]
      assert {c.mask for c in top} == set(MASKS + EXTRA_MASKS), name
      assert any(c.shape.hv for c in top), name
      if name not in ONLY:  # a subset of layouts keeps the others' shapes
        assert {c.shape.name for c in mine} == {"mha", "gqa", "mqa"}, name
      assert {c.entry for c in mine} == (
          {"jit"} if kind == "auto" else {"shard_map", "jit"}), name
  eight = cases(8)
  assert {c.cp for c in eight} == {2, 4, 8}
  assert not any(c.mask in EXTRA_MASKS or c.shape.hv for c in eight
                 if c.cp < 8)
  for c in eight:
    kind = STRATEGIES[c.strategy][0]
    heads = c.cp if kind == "ulysses" else 2 if kind == "hybrid" else 1
    assert c.shape.n % heads == 0, c  # Ulysses splits the heads
    assert 256 <= c.shape.t <= 2048 and c.shape.t * c.cp <= MAX_TOKENS, c


def test_cases_of_one_problem_share_its_reference(tmp_path, monkeypatch):
  """Every strategy and entry of a (cp, mask, layout) solves one problem:
  its shape is theirs, and the reference is solved once for all of them
  (the cache's file is what the others read)."""
  by_problem = {}
  for c in cases(4):
    by_problem.setdefault((c.cp, c.mask, c.layout, layout_cp(c), c.shape.hv),
                          set()).add(c.shape)
  assert all(len(s) == 1 for s in by_problem.values()), by_problem
  monkeypatch.setenv("JAX_RING_REF_CACHE", str(tmp_path))
  a = CpCase("ring_gather_scan", "sinks", "striped", "jit", 2, CPU_SHAPES[0])
  b = dataclasses.replace(a, strategy="ulysses", entry="shard_map")
  inputs, rcase, _, _, sinks = problem(a, 0)
  first = expected(a, inputs, rcase, sinks)
  assert len(list(tmp_path.iterdir())) == 1 and "dsinks" in first
  inputs, rcase, _, _, sinks = problem(b, 0)
  again = expected(b, inputs, rcase, sinks)
  assert len(list(tmp_path.iterdir())) == 1
  for name in first:
    np.testing.assert_array_equal(again[name], first[name])
  # Every mask's inputs build on the CPU shape (each asserts its own kind).
  for mask in MASKS:
    assert problem(dataclasses.replace(a, mask=mask), 0)[1].is_causal == (
        mask != "full")


# By default the quickest to compile; the shard_map entry runs in
# test_spy_records_blocks_the_cudnn_backend_passes_on, and the other masks'
# inputs build in test_cases_of_one_problem_share_its_reference.
@pytest.mark.parametrize("case", [
    CpCase("all_gather_chunked", "window", None, "jit", 4, CPU_SHAPES[0]),
    CpCase("ulysses", "sinks", "striped", "shard_map", 4, CPU_SHAPES[0]),
    CpCase("ring_gather_unrolled", "packed", "dual_chunk", "shard_map", 4,
           CPU_SHAPES[0]),
    CpCase("ring_neighbour_scan", "padding", "striped", "jit", 2,
           CPU_SHAPES[0]),
    CpCase("hybrid", "soft_cap", "dual_chunk", "shard_map", 4,
           CPU_SHAPES[0]),
    CpCase("all_gather", "packed", "dual_chunk", "shard_map", 4,
           CPU_SHAPES[0]),
], ids=str)
@pytest.mark.sample(1)
def test_harness_on_cpu(case):
  """The lane's own code (inputs, layouts, both entry points, the spy, the
  FFI count) on simulated CPU devices with the pure-JAX blocks."""
  if len(jax.devices()) < case.cp:
    pytest.skip(f"needs {case.cp} devices")
  inputs, rcase, sinks, out, grads, spy, calls, _ = run_case(case, "xla")
  assert spy.xla_blocks > 0 and not spy.cudnn_fallbacks, spy
  assert calls == {}, calls
  check_values(case, inputs, rcase, sinks, out, grads)


def test_spy_records_blocks_the_cudnn_backend_passes_on(monkeypatch):
  """What the GPU lane's assertions rest on: a backend that resolves like
  cuDNN and runs cuDNN's block functions, on CPU, where cuDNN passes every
  block on to the pure-JAX kernel. The spy records each reason, and the
  program holds no FFI call: the lane's assertions would fail."""
  monkeypatch.setitem(registry.BACKENDS, "cudnn", registry.Backend(
      "cudnn", cudnn.forward, cudnn.backward, lambda *_: None))
  case = CpCase("ring_neighbour_unrolled", "causal", "dual_chunk",
                "shard_map", 2, CPU_SHAPES[0])
  inputs, rcase, sinks, out, grads, spy, calls, _ = run_case(case, "cudnn")
  assert spy.xla_blocks == 0 and calls == {}, (spy, calls)
  assert spy.cudnn_fallbacks and all(
      "platform 'cpu'" in why for why in spy.cudnn_fallbacks), spy
  check_values(case, inputs, rcase, sinks, out, grads)


# ---------------------------------------------------------------------------
# Any length: natural inputs that no layout divides, padded inside the call


def odd_length_run(kind, cp, implementation, causal=True, seed=0):
  """A packed bf16 call of S = 512 cp - 5 natural-order tokens under
  ``jit`` with ``ContextParallel(strategy=kind)`` (hybrid: 2 x cp/2) on
  the first ``cp`` devices, its output and gradients checked against the
  float64 reference (causal: the padding extends the last document; not:
  it is a document of its own). Returns (the backend spy, FFI calls by
  target)."""
  s, n, k, h = 512 * cp - 5, 8, 2, 64
  q, k_, v, do = (x.astype(jnp.bfloat16) for x in ref.random_qkv(
      seed, 1, s, s, n, k, h))
  ids = odd_documents(seed, 1, s)
  hybrid = kind == "hybrid"
  devices = np.array(jax.devices()[:cp])
  mesh = Mesh(devices.reshape(cp // 2, 2) if hybrid else devices,
              ("ring", "ulysses") if hybrid else ("cp",))
  cpc = jax_ring.ContextParallel(axis=HYBRID_AXES if hybrid else "cp",
                                 strategy=kind)
  f = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=causal, segment_ids=jnp.asarray(ids),
      implementation=implementation, context_parallel=cpc)
  go = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)))(
      *jax.vjp(f, q, k, v)))
  with jax.set_mesh(mesh), backend_spy() as spy:
    compiled = go.lower(q, k_, v, do).compile()
    out, grads = compiled(q, k_, v, do)
  want, _, g = ref.attention(q, k_, v, ref.Case(
      h**-0.5, is_causal=causal, q_segment_ids=ids, kv_segment_ids=ids),
                             dout=do)
  for name, got, exp in zip(("out", "dq", "dk", "dv"), (out,) + grads,
                            (want, g["q"], g["k"], g["v"])):
    ref.assert_close(got, exp, jnp.bfloat16, name)
  return spy, ffi_calls(compiled.as_text())


ODD_KINDS = ("ring", "all_gather", "ulysses", "hybrid", "auto")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kind", ODD_KINDS)
def test_odd_length_with_cuda_blocks(kind, causal):
  """Every strategy at the machine's largest cp on a length no layout
  divides, cuDNN in every block."""
  cp = max(GPUS, 2)
  if GPUS < 2 or (kind == "hybrid" and (cp < 4 or cp % 2)):
    pytest.skip(f"needs 2 NVIDIA GPUs (hybrid: 4); found {GPUS}")
  spy, calls = odd_length_run(kind, cp, None, causal)
  assert spy.xla_blocks == 0 and not spy.cudnn_fallbacks, spy
  assert any(t.startswith("jax_ring_sdpa_fwd") for t in calls), calls


@pytest.mark.slow
def test_odd_length_harness_on_cpu():
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  spy, calls = odd_length_run("hybrid", 4, "xla", causal=False)
  assert spy.xla_blocks > 0 and calls == {}, (spy, calls)


# ---------------------------------------------------------------------------
# Natural-order inputs on two GPUs: the ring's two-device schedule


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_natural_inputs_on_two_gpus_run_the_two_device_schedule(kv_heads):
  """The default ``ContextParallel()`` on natural-order bf16 arrays over
  two GPUs, causal: the ring's two-device schedule (no permutation of the
  inputs: at most 5 permutes a forward, no all-gather) with cuDNN in every
  block, output and gradients against the float64 reference."""
  if GPUS < 2:
    pytest.skip(f"needs 2 NVIDIA GPUs; found {GPUS}")
  s, n, h = 2 * 1000, 8, 128
  q, k, v, do = (x.astype(jnp.bfloat16) for x in ref.random_qkv(
      11, 1, s, s, n, kv_heads, h))
  mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
  f = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True,
      context_parallel=jax_ring.ContextParallel(axis="cp"))
  go = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)))(
      *jax.vjp(f, q, k, v)))
  with jax.set_mesh(mesh), backend_spy() as spy:
    out, grads = go(q, k, v, do)
    forward = jax.jit(f).lower(q, k, v).compile().as_text()
  assert spy.xla_blocks == 0 and not spy.cudnn_fallbacks, spy
  # The dual-chunk permutation would add 8 permutes and the ring's K/V
  # all-gather; XLA may combine the schedule's 5.
  assert 1 <= len(re.findall(r"collective-permute(?:-start)?\(", forward)) <= 5
  assert "all-gather" not in forward
  assert any(t.startswith("jax_ring_sdpa_fwd") for t in ffi_calls(forward))
  want, _, g = ref.attention(q, k, v, ref.Case(h**-0.5, is_causal=True),
                             dout=do)
  for name, got, exp in zip(("out", "dq", "dk", "dv"), (out,) + grads,
                            (want, g["q"], g["k"], g["v"])):
    ref.assert_close(got, exp, jnp.bfloat16, name)
