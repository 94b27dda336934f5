"""strategy="auto": the cost model's decisions, checked against a table of
cases and against the strategies measured on 4x H200; and ContextParallel
validation."""

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from helpers import B, H, S, check, rank_coded_qkv

RESULTS = pathlib.Path(__file__).parents[1] / "benchmarks" / "results"


def measured(name, mode="default"):
  """One run of a stored benchmark results file."""
  return json.loads((RESULTS / f"{name}.json").read_text())["runs"][mode]

# (S, N, K, cp, causal) -> (forward pick, backward pick), and why.
CASES = [
    # Many kv heads, short sequence: Ulysses' all-to-all beats 7 ring hops.
    ((8192, 32, 32, 8, True), ("ulysses", "ulysses")),
    # 12 query heads cannot split over 8 devices: Ulysses is not a candidate,
    # and gathering 12 heads once beats 7 exposed-overhead ring steps.
    ((8192, 12, 12, 8, True), ("all_gather", "all_gather")),
    # One kv head: gathering it costs less than the ring's step overheads.
    ((65536, 6, 1, 4, True), ("all_gather", "all_gather")),
    # GQA, very long: one whole-length forward call runs slower per FLOP
    # than the ring's short ones; the backward's does not, and there
    # Ulysses' fewer bytes win.
    ((1048576, 32, 8, 8, True), ("ring", "ulysses")),
]


@pytest.mark.parametrize("case, want", CASES,
                         ids=["mha_8k_cp8", "n12_cp8", "n6_k1_64k_cp4",
                              "gqa_1m_cp8"])
def test_auto_decisions_match_the_table(case, want):
  s, n, k, cp, causal = case
  choice = jax_ring.explain((1, s, n, 128), (1, s, k, 128), cp_size=cp,
                            is_causal=causal)
  assert (choice.forward, choice.backward) == want, choice.reason
  for p, pick in zip(("forward", "backward"), want):
    assert f"{p} {pick}" in choice.reason
    times = {name: t[p] for name, t in choice.times_ms.items()}
    assert min(times, key=times.get) == pick


@pytest.mark.parametrize("seq, sends", [(32768, "gather"),
                                        (262144, "neighbour")])
def test_explain_states_every_default_it_applies(seq, sends, monkeypatch):
  """The K/V sends follow the one size rule (2 B S K H bytes against
  GATHER_KV_MAX_BYTES: 128 MiB and 4 GiB here), the loop comes from the
  environment, and options the caller set are reported as given."""
  monkeypatch.delenv("NVTE_FUSED_RING_ATTENTION_USE_SCAN", raising=False)
  choice = jax_ring.explain((1, seq, 32, 128), (1, seq, 32, 128), cp_size=4,
                            is_causal=True)
  d = {k: v for k, (v, _) in choice.defaults.items()}
  assert d == dict(load_balance="dual_chunk", loop="unrolled", kv_sends=sends,
                   backward_kv="gather" if sends == "gather" else "ring",
                   kv_chunk_heads=32, implementation=None, inputs="natural")
  assert f"kv_sends = {sends!r}" in str(choice)
  monkeypatch.setenv("NVTE_FUSED_RING_ATTENTION_USE_SCAN", "1")
  given = jax_ring.explain(
      (1, seq, 32, 128), (1, seq, 32, 128), cp_size=4,
      context_parallel=jax_ring.ContextParallel(kv_sends="gather",
                                                kv_chunk_heads=8))
  assert given.defaults["loop"][0] == "scan"
  assert given.defaults["kv_sends"] == ("gather", "as given")
  assert given.defaults["kv_chunk_heads"] == (8, "as given")


def test_auto_is_within_5_percent_of_the_fastest_measured():
  """Every shape of the stored 4x H200 run: the modelled forward pick's
  measured forward, the backward pick's backward (forward+backward minus
  forward), and their sum are each within 5% of the fastest strategy's."""
  data = measured("strategies_4xH200")
  assert data["device_count"] == 4 and len(data["rows"]) >= 10
  candidates = ("ring", "all_gather", "ulysses")  # hybrid needs two axes
  for row in data["rows"]:
    choice = jax_ring.explain(
        (1, row["seq"], row["heads"], 128), (1, row["seq"], row["kv_heads"],
                                             128),
        cp_size=row["cp"], is_causal=row["causal"])
    fwd = {c: row[f"{c}_fwd_ms"] for c in candidates}
    bwd = {c: row[f"{c}_fwdbwd_ms"] - fwd[c] for c in candidates}
    both = {c: row[f"{c}_fwdbwd_ms"] for c in candidates}
    where = (row["seq"], row["kv_heads"], choice.reason)
    assert fwd[choice.forward] <= 1.05 * min(fwd.values()), where
    assert bwd[choice.backward] <= 1.05 * min(bwd.values()), where
    assert (fwd[choice.forward] + bwd[choice.backward] <=
            1.05 * min(both.values())), where


def test_auto_takes_no_all_gather_for_packed_rows():
  """Segment ids take all-gather out of the candidates: on the stored
  2-GPU packed run its forward took 2.1-2.2x the faster of the ring's and
  Ulysses' at 64k. The picks' measured step is within 15% of the fastest
  (the same ring forward measured 7.7 and 9.8 ms in two columns of that
  run); auto's own pick there, all-gather forward, was 1.39-1.47x."""
  data = measured("strategies_2xH100", "packed")
  rows = [r for r in data["rows"] if r["mix"] != "one"]
  assert len(rows) == 4
  for row in rows:
    choice = jax_ring.explain(
        (1, row["seq"], row["heads"], 128),
        (1, row["seq"], row["kv_heads"], 128), cp_size=row["cp"],
        is_causal=True, segment_ids=np.zeros((1, row["seq"]), np.int32))
    assert "all_gather" not in choice.times_ms and "segment ids" in (
        choice.reason)
    fwd = {c: row[f"{c}_fwd_ms"] for c in ("ring", "ulysses")}
    if row["auto_pick"].startswith("all_gather"):  # the run's own picks
      assert row["auto_fwd_ms"] > 2 * min(fwd.values())
    both = {c: row[f"{c}_fwdbwd_ms"] for c in ("ring", "ulysses")}
    step = fwd[choice.forward] + both[choice.backward] - fwd[choice.backward]
    assert step <= 1.15 * min(both.values()), (row["seq"], row["mix"])


@pytest.mark.parametrize("name, mode", [
    ("strategies_2xH200", "default"),
    ("ring_attention_2xH200", "cp2_no_barrier"),
    ("ring_attention_2xH200", "cp2_no_barrier_128k"),
    ("strategies_4xH200", "auto_timed"),
    ("strategies_8xH200", "default"), ("strategies_8xH200", "512k")])
def test_auto_training_step_is_within_5_percent_on_other_runs(name, mode):
  """The stored runs the model was not fitted to (2 and 8 GPUs, and a
  second 4-GPU run): the forward pick's measured forward plus the backward
  pick's backward is within 5% of the fastest strategy's forward+backward.
  (Per pass the 8-GPU forward misses: 7.9% at 128k MHA, see
  docs/decisions.md.)"""
  data = measured(name, mode)
  assert len(data["rows"]) >= 2
  for row in data["rows"]:
    candidates = [c for c in ("ring", "all_gather", "ulysses")
                  if f"{c}_fwdbwd_ms" in row]
    choice = jax_ring.explain(
        (1, row["seq"], row["heads"], 128),
        (1, row["seq"], row["kv_heads"], 128), cp_size=row["cp"],
        is_causal=row["causal"])
    fwd = {c: row[f"{c}_fwd_ms"] for c in candidates}
    both = {c: row[f"{c}_fwdbwd_ms"] for c in candidates}
    step = fwd[choice.forward] + both[choice.backward] - fwd[choice.backward]
    assert step <= 1.05 * min(both.values()), (row["seq"], row["kv_heads"],
                                               choice.reason)


def _auto_on_4_devices(seed):
  """Causal auto attention through the automatic path on a 4-device mesh:
  (the inputs q, k, v, do; them placed in the dual-chunk layout; the
  attention function; the inverse reorder)."""
  cp = 4
  m = Mesh(np.array(jax.devices()[:cp]), ("cp",))
  q, k, v, do = rank_coded_qkv(seed, cp)
  to = lambda x: jax_ring.reorder_for_load_balance(x, cp)
  back = lambda x: jax_ring.reorder_from_load_balance(x, cp)
  tok = NamedSharding(m, P(None, "cp"))
  args = [jax.device_put(to(x), tok) for x in (q, k, v, do)]
  cpc = jax_ring.ContextParallel(axis="cp", strategy="auto", loop="scan",
                                 inputs="load_balanced")
  attn = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, context_parallel=cpc, implementation="xla")

  @jax.jit
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(do)

  return (q, k, v, do), args, attn, fwd_bwd, back


def test_the_automatic_path_tells_auto_of_segment_ids(monkeypatch):
  """Each pass's pick is made knowing the call has segment ids (and
  without them, not): what keeps all-gather from packed rows."""
  from jax_ring._src import auto
  seen, real = [], auto.estimate
  monkeypatch.setattr(auto, "estimate", lambda **kw: seen.append(
      kw["packed"]) or real(**kw))
  m = Mesh(np.array(jax.devices()[:2]), ("cp",))
  tok = NamedSharding(m, P(None, "cp"))
  x = jax.device_put(jnp.ones((1, 16, 2, 8), jnp.bfloat16), tok)
  ids = jax.device_put(jnp.repeat(jnp.arange(4), 4)[None], tok)
  cpc = jax_ring.ContextParallel(axis="cp", strategy="auto")
  for segment_ids, want in ((ids, True), (None, False)):
    seen.clear()
    loss = lambda q: jax_ring.dot_product_attention(
        q, x, x, is_causal=True, segment_ids=segment_ids,
        context_parallel=cpc, implementation="xla").sum()
    jax.jit(jax.grad(loss)).lower(x).compile()
    assert seen and set(seen) == {want}


def _check_auto(inputs, fwd_bwd, args, back):
  out, grads = fwd_bwd(*args)
  check((back(out), tuple(back(g) for g in grads)), *inputs,
        ref.Case(H**-0.5, is_causal=True))


# Slow: the same call (_auto_on_4_devices) against the reference is
# test_auto_may_run_different_strategies_per_pass's; auto's own picks on
# dual-chunk inputs, test_first_call.py::test_natural_inputs_are_exact_by_
# default[auto-dual_chunk].
@pytest.mark.slow
def test_auto_through_the_automatic_path_matches_reference():
  inputs, args, _, fwd_bwd, back = _auto_on_4_devices(60)
  _check_auto(inputs, fwd_bwd, args, back)


@pytest.mark.parametrize("kw, message", [
    (dict(strategy="zigzag"),
     "context_parallel.strategy must be one of ('ring', 'all_gather', "
     "'ulysses', 'hybrid', 'auto'); got 'zigzag'"),
    (dict(strategy="hybrid", axis="cp"),
     "context_parallel.axis must be a pair (ulysses_axis, ring_axis) of "
     "distinct axis names for strategy 'hybrid'; got 'cp'"),
    (dict(strategy="ring", axis=("a", "b")),
     "context_parallel.axis must be one axis name for strategy 'ring'; got "
     "('a', 'b')"),
    (dict(strategy="all_gather", kv_chunk_heads=3),
     "kv_chunk_heads must be None or a positive int dividing the key/value "
     "heads (2); got 3"),
    (dict(kv_sends="direct"),
     "kv_sends must be None or one of ('neighbour', 'gather'); got 'direct'"),
])
def test_context_parallel_errors(kw, message):
  """Refused when the ContextParallel is made, or (what needs the shapes)
  when it is called."""
  q = jnp.ones((B, S, 4, H))
  k = jnp.ones((B, S, 2, H))
  with pytest.raises(ValueError, match=re.escape(message)):
    cpc = jax_ring.ContextParallel(**kw)
    jax_ring.dot_product_attention(q, k, k, context_parallel=cpc)


def _cp_mesh():
  """A 4-device mesh whose only axis is "cp", as ``jax.make_mesh`` gives."""
  return jax.make_mesh((4,), ("cp",))


@pytest.mark.parametrize("where", ["set_mesh", "sharded_inputs"])
def test_an_axis_missing_from_the_mesh_is_named(where):
  """ContextParallel(axis="seq") with a mesh whose only axis is "cp": a
  ValueError at trace time naming the axis and the mesh's axes, whether
  the mesh comes from jax.set_mesh or from the inputs' sharding."""
  m = _cp_mesh()
  q = jax.device_put(jnp.ones((B, S, 4, H)), NamedSharding(m, P(None, "cp")))
  cpc = jax_ring.ContextParallel(axis="seq")
  f = jax.jit(lambda q: jax_ring.dot_product_attention(
      q, q, q, is_causal=True, context_parallel=cpc, implementation="xla"))
  message = ("context_parallel.axis 'seq': 'seq' is not an axis of the mesh "
             "in scope, whose axes are ('cp',) (sizes (4,)); got query "
             f"({B}, {S}, 4, {H})")
  with pytest.raises(ValueError, match=re.escape(message)):
    if where == "set_mesh":
      with jax.set_mesh(m):
        f(q)
    else:
      f(q)


def test_a_hybrid_axis_missing_from_the_mesh_is_named():
  m = jax.make_mesh((2, 2), ("ulysses", "cp"))
  q = jax.device_put(jnp.ones((B, S, 4, H)),
                     NamedSharding(m, P(None, ("cp", "ulysses"))))
  cpc = jax_ring.ContextParallel(axis=("ulysses", "ring"), strategy="hybrid")
  with pytest.raises(ValueError, match=re.escape(
      "context_parallel.axis ('ulysses', 'ring'): 'ring' is not an axis of "
      "the mesh in scope, whose axes are ('ulysses', 'cp')")):
    jax_ring.dot_product_attention(q, q, q, context_parallel=cpc)


@pytest.mark.parametrize("under_jit", [False, True])
def test_no_mesh_at_all_is_an_error_not_a_silent_single_device_run(
    under_jit):
  """Unsharded inputs and no jax.set_mesh: without the check this ran on
  one device, without context parallelism, and said nothing."""
  q = jnp.ones((B, S, 4, H))
  cpc = jax_ring.ContextParallel(axis="cp")
  f = lambda q: jax_ring.dot_product_attention(
      q, q, q, is_causal=True, context_parallel=cpc, implementation="xla")
  with pytest.raises(ValueError, match=re.escape(
      f"context_parallel.axis 'cp' needs a mesh, and none is in scope: query "
      f"({B}, {S}, 4, {H}) is not placed on a mesh and no jax.set_mesh is "
      f"active")):
    (jax.jit(f) if under_jit else f)(q)


def test_auto_may_run_different_strategies_per_pass(monkeypatch):
  """The forward and the backward are partitioned separately and share
  the layout and the residual, so a pass may take its own strategy: here
  Ulysses forward (all-to-alls) and the ring backward (permutes), equal to
  the reference."""
  from jax_ring._src import auto
  real = auto.estimate
  monkeypatch.setattr(auto, "estimate", lambda **kw: dataclasses.replace(
      real(**kw), forward="ulysses", backward="ring"))
  inputs, args, attn, fwd_bwd, back = _auto_on_4_devices(61)
  fwd_hlo = jax.jit(attn).lower(*args[:3]).compile().as_text()
  assert "all-to-all" in fwd_hlo and "collective-permute" not in fwd_hlo
  compiled = fwd_bwd.lower(*args).compile()  # run and inspected once
  hlo = compiled.as_text()
  assert "all-to-all" in hlo and "collective-permute" in hlo
  _check_auto(inputs, compiled, args, back)


# Rows of 48 tokens over 4 devices (shards of 12): documents inside the
# shards, documents crossing boundaries by one row (step 1 on the last row
# of each shard), and one document over the whole row (past every tail).
@pytest.mark.parametrize("lengths, beyond, hv", [
    pytest.param((6,) * 8, False, None, marks=pytest.mark.slow),
    ((11, 2, 10, 1, 1, 10, 1, 1, 11), False, None),
    pytest.param((S,), True, None, marks=pytest.mark.slow), ((S,), True, 24)],
    ids=["inside", "crossing", "one_document", "one_document_hv24"])
@pytest.mark.sample(1)
def test_auto_runs_the_ring_first_on_packed_contiguous_rows(
    lengths, beyond, hv, monkeypatch):
  """Packed rows on contiguous shards, where the model picks Ulysses (as it
  does for packed rows: it sees no document lengths): each pass runs each
  device's own block and the ring's reach test, and Ulysses only where the
  documents reach past what the ring's step-1 tails hold. Exact on every
  branch, forward and gradients, also with a value head dim unlike the
  key's (dK/dV as a pair); the program holds both strategies."""
  from jax_ring._src import auto
  from jax_ring._src.strategies.ring import reach
  real, cp = auto.estimate, 4
  monkeypatch.setattr(auto, "estimate", lambda **kw: dataclasses.replace(
      real(**kw), forward="ulysses", backward="ulysses"))
  ids = np.broadcast_to(np.repeat(np.arange(len(lengths)), lengths)[None],
                        (B, S)).astype(np.int32)
  assert reach.steps_of_rows(ids, cp, True, beyond=True)["beyond"] == beyond
  m = Mesh(np.array(jax.devices()[:cp]), ("cp",))
  tok = NamedSharding(m, P(None, "cp"))
  q, k, v, do = (rank_coded_qkv(62, cp) if hv is None else
                 ref.random_qkv(63, B, S, S, 4, 2, H, hv=hv))
  args = [jax.device_put(x, tok) for x in (q, k, v, do, jnp.asarray(ids))]
  cpc = jax_ring.ContextParallel(axis="cp", strategy="auto",
                                 load_balance=None, inputs="load_balanced")

  @jax.jit
  def fwd_bwd(q, k, v, do, ids):
    out, vjp = jax.vjp(lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids, context_parallel=cpc,
        implementation="xla"), q, k, v)
    return out, vjp(do)

  compiled = fwd_bwd.lower(*args).compile()
  hlo = compiled.as_text()
  assert "all-to-all" in hlo and "collective-permute" in hlo
  out, grads = compiled(*args)
  check((out, grads), q, k, v, do, ref.Case(
      H**-0.5, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids))


def test_auto_weighs_the_load_of_contiguous_shards():
  """On contiguous shards under a causal mask the last device sees every
  key: the ring's and all-gather's compute is scaled by its work over the
  mean, (2 cp - 1) / cp, and Ulysses (even by heads) is not. On the stored
  4 x H100 run of one 64k document, the all-gather's forward on contiguous
  shards (auto's pick there before this weight) took 1.7x Ulysses'; the
  model now picks Ulysses for that forward."""
  def times(seq, lb, **kw):
    choice = jax_ring.explain(
        (1, seq, 32, 128), (1, seq, 8, 128), cp_size=4,
        context_parallel=jax_ring.ContextParallel(strategy="auto",
                                                   load_balance=lb), **kw)
    return choice, {s: t["forward"] for s, t in choice.times_ms.items()}

  contiguous, t_c = times(65536, None, is_causal=True)
  dual, t_d = times(65536, "dual_chunk", is_causal=True)
  assert (dual.forward, contiguous.forward) == ("all_gather", "ulysses")
  assert "wait for the last, 1.75x the mean causal work" in contiguous.reason
  assert "wait for the last" not in dual.reason
  assert t_c["ulysses"] == t_d["ulysses"]
  # Two devices: the ring balances contiguous shards (ring.pair), so only
  # the all-gather's compute is scaled there.
  two = {lb: jax_ring.explain(
      (1, 65536, 32, 128), (1, 65536, 8, 128), cp_size=2, is_causal=True,
      context_parallel=jax_ring.ContextParallel(
          strategy="auto", load_balance=lb)).times_ms
         for lb in (None, "dual_chunk")}
  assert two[None]["ring"] == two["dual_chunk"]["ring"]
  assert (two[None]["all_gather"]["forward"] >
          1.4 * two["dual_chunk"]["all_gather"]["forward"])
  got = measured("strategies_4xH100", "composite_4_one")["rows"][0]
  one = [r for r in measured("strategies_4xH100", "crossing_4")["rows"]
         if r["mix"] == "one"][0]
  assert got["auto_contiguous_fwd_ms"] > 1.5 * one["ulysses_fwd_ms"]
  # Compute-bound (1M tokens): the ratio tends to 7/4; a window of 256
  # keys leaves the shards nearly even; without a causal mask they are.
  _, long_c = times(1 << 20, None, is_causal=True)
  _, long_d = times(1 << 20, "dual_chunk", is_causal=True)
  assert 1.70 < long_c["all_gather"] / long_d["all_gather"] <= 1.75
  _, win_c = times(1 << 20, None, is_causal=True, local_window_size=(255, 0))
  _, win_d = times(1 << 20, "dual_chunk", is_causal=True,
                   local_window_size=(255, 0))
  assert 1.0 <= win_c["all_gather"] / win_d["all_gather"] < 1.001
  _, full_c = times(65536, None, is_causal=False)
  _, full_d = times(65536, "dual_chunk", is_causal=False)
  assert full_c == full_d
