"""Ring attention on simulated CPU meshes against the float64 reference."""

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from helpers import (B, H, K, N, S, case_id, check, check_public_call,
                     collectives, layout_vjp, mesh, rank_coded_qkv,
                     run_shard_map)

# The neighbour ring unless a test names other sends (the default,
# kv_sends=None, would gather these small K/V: tested on its own below).
run_ring = functools.partial(run_shard_map, jax_ring.ring_attention,
                             kv_sends="neighbour")


# Padding that leaves whole chunks (and, for the kv side, whole devices'
# shards) empty, so that rows see nothing at some steps and keys at others.
Q_LENGTHS = np.array([S - 7, 13], np.int32)
KV_LENGTHS = np.array([S - 3, 29], np.int32)


def _default_lane(cp, causal, load_balance, loop):
  """The default run's share of the full matrix, at cp = 4: the contiguous
  ring causal and scanned, the dual-chunk unmasked and unrolled. The
  default run has the rest elsewhere: the dual-chunk ring causal in both
  loop forms in test_loop_forms_agree_and_env_var_selects_scan, the
  striped ring scanned in test_ring_packed_segments_cross_shard_boundaries,
  cp = 2 in test_ring_gqa_mqa_and_soft_cap and
  test_ring_windows_and_padding, cp = 8 in test_any_length.py (rank-coded
  shards make a misplaced shard show at any cp). The rest runs with ``-m
  slow``."""
  if cp != 4:
    return False
  if load_balance is None:
    return causal and loop == "scan"
  return load_balance == "dual_chunk" and not causal and loop == "unrolled"


@pytest.mark.parametrize(
    "cp, causal, load_balance, loop",
    [pytest.param(*c, marks=() if _default_lane(*c) else pytest.mark.slow)
     for c in itertools.product([2, 4, 8], [True, False],
                                [None, "dual_chunk", "striped"],
                                ["scan", "unrolled"])],
    ids=case_id)
def test_ring_matches_reference(cp, causal, load_balance, loop):
  q, k, v, do = rank_coded_qkv(cp, cp, load_balance=load_balance)
  got = run_ring(q, k, v, do, cp, is_causal=causal,
                 load_balance=load_balance, loop=loop)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=causal))


# A window's chunk pairs compile one static band per chunk distance, so the
# larger rings and the dual-chunk scans (the slowest programs to compile
# here) run with ``-m slow``; the default run keeps a causal window
# (contiguous) and padding (dual-chunk, on 2 devices: the lengths empty
# chunks as on 4, which -m slow adds); the striped ring's window with
# padding is test_automatic_path_under_jit_matches_reference's
# dp2_cp4_unrolled_striped_packed_window_pad, its two-sided bands
# test_striped_bands_match_global_positions; the dual-chunk ring's causal
# window is test_value_head_dim.py's window_gather (and test_flax.py's
# ring_packed_window_cap_sinks).
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "cp, load_balance, causal, window, loop",
    [pytest.param(2, "dual_chunk", True, (5, 0), "unrolled", marks=_SLOW),
     pytest.param(4, "dual_chunk", True, (5, 0), "unrolled", marks=_SLOW),
     pytest.param(4, "dual_chunk", True, (13, 0), "scan", marks=_SLOW),
     (2, None, True, (7, 0), "scan"),
     pytest.param(4, None, False, (9, 4), "unrolled", marks=_SLOW),
     pytest.param(2, "dual_chunk", False, (3, 11), "unrolled", marks=_SLOW),
     pytest.param(4, "dual_chunk", False, (3, 11), "scan", marks=_SLOW),
     (2, "dual_chunk", True, None, "unrolled"),
     pytest.param(4, "dual_chunk", True, None, "unrolled", marks=_SLOW),
     pytest.param(4, None, True, None, "scan", marks=_SLOW),
     pytest.param(8, "dual_chunk", True, (4, 0), "unrolled", marks=_SLOW),
     pytest.param(4, "striped", True, (5, 0), "unrolled", marks=_SLOW),
     pytest.param(4, "striped", False, (3, 7), "scan", marks=_SLOW),
     pytest.param(8, "striped", True, (13, 0), "scan", marks=_SLOW),
     pytest.param(4, "striped", True, None, "unrolled", marks=_SLOW),
     pytest.param(4, "striped", False, None, "scan", marks=_SLOW)],
    ids=["n2_dual_causal_w5", "n4_dual_causal_w5", "n4_dual_causal_w13_scan",
         "n2_contig_w7",
         "n4_contig_full_w9_4", "n2_dual_full_w3_11",
         "n4_dual_full_w3_11_scan",
         "n2_dual_causal_pad_only", "n4_dual_causal_pad_only",
         "n4_contig_causal_pad_only_scan",
         "n8_dual_causal_w4", "n4_striped_causal_w5", "n4_striped_full_w3_7",
         "n8_striped_causal_w13_scan", "n4_striped_causal_pad_only",
         "n4_striped_full_pad_only_scan"])
def test_ring_windows_and_padding(cp, load_balance, causal, window, loop):
  """Sliding windows (chunk pairs outside are skipped) and padding lengths
  in global positions, alone and together."""
  q, k, v, do = rank_coded_qkv(20 + cp, cp, load_balance=load_balance)
  kw = dict(is_causal=causal, load_balance=load_balance, loop=loop,
            local_window_size=window)
  case = ref.Case(H**-0.5, is_causal=causal, window=window)
  if window is not None:
    check(run_ring(q, k, v, do, cp, **kw), q, k, v, do, case)
  lengths = dict(query_seq_lengths=jnp.asarray(Q_LENGTHS),
                 key_value_seq_lengths=jnp.asarray(KV_LENGTHS))
  check(run_ring(q, k, v, do, cp, **kw, **lengths), q, k, v, do,
        dataclasses.replace(case, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS))


# MQA in the default run, on 2 devices (heads need no more); K = N (one
# query head a kv head) and striped with -m slow (GQA, K = 2, is every
# other test's).
@pytest.mark.parametrize("kv_heads, load_balance, cp",
                         [(1, "dual_chunk", 2), (4, "dual_chunk", 4),
                          (1, "striped", 4)])
@pytest.mark.sample(1)
def test_ring_gqa_mqa_and_soft_cap(kv_heads, load_balance, cp):
  q, k, v, do = rank_coded_qkv(11, cp, kv_heads, load_balance)
  got = run_ring(q, k, v, do, cp, is_causal=True, load_balance=load_balance,
                 logits_soft_cap=3.0)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True, soft_cap=3.0))


# -m slow: the ring's bf16 values (and output dtype) are in the default run
# with test_dkv_parts_go_back_in_the_kernels_dtype[cond].
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.slow
def test_ring_16_bit(dtype):
  q, k, v, do = (x.astype(dtype) for x in rank_coded_qkv(12, 4))
  got = run_ring(q, k, v, do, 4, is_causal=True, load_balance="dual_chunk")
  assert got[0].dtype == dtype
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True))


class RingPrograms:
  """A causal ring on 4 devices (xla blocks; rank-coded inputs in the
  layout), called in a user's ``shard_map`` or through the automatic path
  (jit + NamedSharding), compiled once for every test that reads it: the
  forward alone (its HLO, and its traced jaxpr's text) and forward+backward
  (its HLO, and its output and grads in natural order)."""

  CP = 4

  def __init__(self):
    self._cache = {}

  def _program(self, path, loop, kv_sends, load_balance):
    cp = self.CP
    q, k, v, do = rank_coded_qkv(15, cp, load_balance=load_balance)
    args = [jax_ring.reorder_for_load_balance(x, cp, layout=load_balance)
            for x in (q, k, v, do)]
    spec = P(None, "cp")
    kw = dict(is_causal=True, implementation="xla")
    if path == "shard_map":
      attn = jax.shard_map(
          lambda q, k, v: jax_ring.ring_attention(
              q, k, v, axis_name="cp", load_balance=load_balance, loop=loop,
              kv_sends=kv_sends, **kw),
          mesh=mesh(cp), in_specs=(spec,) * 3, out_specs=spec)
    else:
      args = [jax.device_put(x, NamedSharding(mesh(cp), spec)) for x in args]
      attn = lambda q, k, v: jax_ring.dot_product_attention(
          q, k, v, context_parallel=jax_ring.ContextParallel(
              axis="cp", load_balance=load_balance, loop=loop,
              kv_sends=kv_sends, inputs="load_balanced"), **kw)
    return (q, k, v, do), args, attn

  def _once(self, key, make):
    # The cap on gathered K/V (a test may patch it) is part of the program.
    key += (jax_ring._src.core.config.GATHER_KV_MAX_BYTES,)
    if key not in self._cache:
      self._cache[key] = make()
    return self._cache[key]

  def forward(self, path, loop="unrolled", kv_sends="neighbour",
              load_balance="dual_chunk"):
    """``(hlo, jaxpr)``: the forward's compiled HLO and traced jaxpr."""
    def make():
      _, args, attn = self._program(path, loop, kv_sends, load_balance)
      traced = jax.jit(attn).trace(*args[:3])
      return traced.lower().compile().as_text(), str(traced.jaxpr)
    return self._once(("forward", path, loop, kv_sends, load_balance), make)

  def both(self, path, loop="unrolled", kv_sends="neighbour",
           load_balance="dual_chunk"):
    """``(hlo, inputs, (out, grads))`` of forward+backward; the inputs and
    results in natural order."""
    def make():
      inputs, args, attn = self._program(path, loop, kv_sends, load_balance)

      def go(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

      compiled = jax.jit(go).lower(*args).compile()
      back = lambda x: jax_ring.reorder_from_load_balance(
          x, self.CP, layout=load_balance)
      out, grads = compiled(*args)
      return (compiled.as_text(), inputs,
              (back(out), tuple(back(g) for g in grads)))
    return self._once(("both", path, loop, kv_sends, load_balance), make)


@pytest.fixture(scope="module")
def ring_programs():
  return RingPrograms()


# The unrolled dual-chunk form's forward is test_backward_sends_no_kv_a_
# second_time[shard_map]'s too; the default run has both loop forms and
# both layouts, the other pairs -m slow.
@pytest.mark.parametrize("loop, load_balance", [
    ("unrolled", "dual_chunk"), ("scan", "striped"), ("scan", "dual_chunk"),
    ("unrolled", "striped")], ids=["unrolled-dual_chunk", "scan-striped",
                                   "scan-dual_chunk", "unrolled-striped"])
@pytest.mark.sample(2)
def test_forward_permutes_stacked_kv_only(loop, load_balance, ring_programs):
  cp = 4
  hlo, jaxpr = ring_programs.forward("shard_map", loop,
                                     load_balance=load_balance)
  permutes = re.findall(r"collective-permute(?:-start)?\(", hlo)
  # Unrolled: one permute per step but the last. Scan: the first step's,
  # one in the loop body, none for the peeled last step.
  assert len(permutes) == (cp - 1 if loop == "unrolled" else 2), permutes
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  # Each permute moves the stacked (2, B, T, K, H) KV buffer.
  t = S // cp
  assert re.search(rf"f32\[2,{B},{t},{K},{H}\][^\n]*collective-permute", hlo)
  # Block calls traced: step 0's, then a two-way branch per later step
  # (dual_chunk: half-KV / half-Q; striped: inclusive / strict band), in
  # the scan's body once and in the peeled last step.
  calls = jaxpr.count("jax_ring_attention_fwd")
  assert calls == (1 + 2 * (cp - 1) if loop == "unrolled" else 5), calls


def check_causal(got, inputs):
  check(got, *inputs, ref.Case(H**-0.5, is_causal=True))


@pytest.mark.parametrize("path", ["shard_map", "automatic",
                                  "automatic_large_kv"])
@pytest.mark.sample(2)
def test_backward_sends_no_kv_a_second_time(path, ring_programs,
                                            monkeypatch):
  """Forward+backward, cp = 4, unrolled: 3 stacked-KV permutes forward and
  4 dK/dV permutes backward. Under shard_map the backward's K/V sends are
  the forward's (XLA merges them); the automatic path lowers its backward
  apart, so it gathers K/V once there instead of sending them again, up to
  GATHER_KV_MAX_BYTES of gathered K/V; past that it sends them again.
  Exact throughout."""
  if path == "automatic_large_kv":
    monkeypatch.setattr(jax_ring._src.core.config, "GATHER_KV_MAX_BYTES", 0)
  path = path.removesuffix("_large_kv")
  fwd = collectives(ring_programs.forward(path)[0])
  hlo, inputs, got = ring_programs.both(path)
  counts = collectives(hlo)
  assert (fwd["collective-permute"], fwd["all-gather"]) == (3, 0), fwd
  large = jax_ring._src.core.config.GATHER_KV_MAX_BYTES == 0
  assert counts["all-gather"] == int(path == "automatic" and not large), (
      counts)
  assert counts["collective-permute"] == (10 if large else 7), counts
  check_causal(got, inputs)


# The dual-chunk ring unrolled (cp = 2 and 4) with -m slow: its gathered
# sends are test_gathered_kv_sends_collectives[shard_map]'s, exact.
@pytest.mark.parametrize("cp, causal, load_balance, extra", [
    pytest.param(2, True, "dual_chunk", {}, marks=pytest.mark.slow),
    pytest.param(4, True, "dual_chunk", {}, marks=pytest.mark.slow),
    (4, True, "dual_chunk", dict(loop="scan")),
    (4, True, None, {}),
    pytest.param(8, True, "striped", {}, marks=pytest.mark.slow),
    (4, False, None, dict(loop="scan", local_window_size=(20, 9))),
    (8, True, "dual_chunk", dict(query_seq_lengths=jnp.asarray(Q_LENGTHS),
                                 key_value_seq_lengths=jnp.asarray(
                                     KV_LENGTHS))),
], ids=["n2", "n4", "n4_scan", "n4_contiguous", "n8_striped",
        "n4_window_scan", "n8_padding"])
@pytest.mark.sample(2)
def test_gathered_kv_sends_match_reference(cp, causal, load_balance, extra):
  """kv_sends="gather": each step's K/V from one all-gather, dK/dV parts
  straight back to their owners (unrolled) or along the ring (scan). GQA
  (K < N) throughout."""
  q, k, v, do = rank_coded_qkv(40 + cp, cp, load_balance=load_balance)
  case = ref.Case(H**-0.5, is_causal=causal,
                  window=extra.get("local_window_size"))
  if "query_seq_lengths" in extra:
    case = dataclasses.replace(case, q_lengths=Q_LENGTHS,
                               kv_lengths=KV_LENGTHS)
  kw = dict(loop="unrolled", kv_sends="gather") | extra
  got = run_ring(q, k, v, do, cp, is_causal=causal, load_balance=load_balance,
                 **kw)
  check(got, q, k, v, do, case)


# -m slow: the automatic path's own backward gather is test_backward_sends_
# no_kv_a_second_time[automatic]'s (its sends the forward's neighbours).
@pytest.mark.parametrize("path", ["shard_map", "automatic"])
@pytest.mark.sample(1)
def test_gathered_kv_sends_collectives(path, ring_programs):
  """cp = 4, unrolled, kv_sends="gather". Forward: one all-gather, no
  permute. Forward+backward: 3 dK/dV parts sent back, with no final
  return. The backward's K/V come from the forward's gather (shard_map: one
  program) or from a gather of its own (the automatic path's backward is a
  partitioned call of its own). Exact."""
  fwd = collectives(ring_programs.forward(path, kv_sends="gather")[0])
  hlo, inputs, got = ring_programs.both(path, kv_sends="gather")
  both = collectives(hlo)
  assert (fwd["collective-permute"], fwd["all-gather"]) == (0, 1), fwd
  assert both["collective-permute"] == 3, both
  assert both["all-gather"] == 1 + (path == "automatic"), both
  check_causal(got, inputs)


# -m slow: MQA (the ring's is test_ring_gqa_mqa_and_soft_cap's default
# case); the pair's schedule moves K/V the same whatever their heads.
@pytest.mark.parametrize("kv_heads", [K, pytest.param(1, marks=_SLOW)],
                         ids=["gqa", "mqa"])
def test_two_device_contiguous_ring_matches_reference(kv_heads):
  """Contiguous shards on a ring of two, causal: ``ring.pair``'s balanced
  schedule (device 0 takes device 1's late rows against its keys)."""
  q, k, v, do = rank_coded_qkv(5, 2, kv_heads=kv_heads)
  got = run_ring(q, k, v, do, 2, is_causal=True, load_balance=None)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True))


@pytest.mark.parametrize("strategy", ["ring", "auto"])
def test_natural_inputs_on_two_devices_are_not_permuted(strategy):
  """The default ``ContextParallel()`` on natural-order arrays over two
  devices, causal, at a length that needs padding, value head dim unlike
  the key's: exact, forward and gradients; its programs run the
  two-device schedule (a forward permutes device 1's late rows to device
  0, device 0's K and V to device 1 and the cross (out, lse) back: 5
  permutes, no all-gather), not the dual-chunk permutation; ``explain``
  says so. ``auto`` runs contiguous shards too (its ring is that
  schedule), and no permute where it picks Ulysses."""
  m, cpc = mesh(2), jax_ring.ContextParallel(axis="cp", strategy=strategy)
  check_public_call(cpc, m, (B, N, K, H, 24), t=S - 3, s=S - 3, docs=None,
                    seed=6)
  x = jnp.ones((1, S, N, H))
  f = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, context_parallel=cpc)
  why = jax_ring.explain(x.shape, x.shape, cp_size=2, is_causal=True,
                         context_parallel=cpc)
  with jax.set_mesh(m):
    hlo = jax.jit(f).lower(x, x, x).compile().as_text()
  if why.forward == "ring":  # auto: Ulysses' all-to-alls instead
    assert collectives(hlo) == {**collectives(""), "collective-permute": 5}
  else:
    assert collectives(hlo)["collective-permute"] == 0, collectives(hlo)
  assert why.defaults["load_balance"][0] is None
  assert why.defaults["inputs"][1] == "contiguous shards: nothing to permute"


def test_natural_inputs_without_a_causal_mask_are_not_permuted():
  """No causal mask, natural-order arrays, the default layout: contiguous
  shards balance the work, so the call runs them as they are (a two-sided
  window, padding to a multiple of 2): exact, and its forward program
  holds no permute, only the ring's K/V gather. On 2 devices: the point
  needs no more (the contiguous ring on 4 is test_ring_matches_reference's
  and test_ring_skips_steps_no_document_reaches')."""
  m = mesh(2)
  check_public_call(jax_ring.ContextParallel(axis="cp"), m, (B, N, K, H),
                    t=S - 5, s=S - 5, docs=None, seed=8, is_causal=False,
                    local_window_size=(9, 4))
  x = jnp.ones((1, S, N, H))
  f = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, context_parallel=jax_ring.ContextParallel(axis="cp"))
  with jax.set_mesh(m):
    hlo = jax.jit(f).lower(x, x, x).compile().as_text()
  assert collectives(hlo) == {**collectives(""), "all-gather": 1}
  why = jax_ring.explain(x.shape, x.shape, cp_size=2,
                         context_parallel=jax_ring.ContextParallel(axis="cp"))
  assert why.defaults["load_balance"][0] is None


_WINDOW_PART = (dict(local_window_size=(20, 0)),
                ("f32", f"2,{B},{S // 2},{K},{H}"))


# On 2 devices (the dtype's point needs no more): that each owner gets its
# part back at cp = 4 is test_gathered_kv_sends_collectives[shard_map]'s.
@pytest.mark.parametrize("extra, part, values", [
    ({}, ("bf16", f"2,{B},{S // 2},{K},{H}"), True),
    (*_WINDOW_PART, False),
    pytest.param(*_WINDOW_PART, True, marks=_SLOW),
], ids=["cond", "window", "window_values"])
def test_dkv_parts_go_back_in_the_kernels_dtype(extra, part, values):
  """kv_sends="gather", unrolled, bf16, cp = 2: each step's dK/dV part goes
  back to its owner in bf16, as the block kernel returned it (nothing
  rounds): the held kv's (2, B, T, K, H); in float32 where a step adds
  several calls (window pairs). The owner sums in float32; the grads hold
  bf16 tolerance against the float64 reference (for the window, a slow
  compile, with ``-m slow``; the gathered ring's window values, float32,
  are checked in the default run by test_value_head_dim.py's
  window_gather)."""
  cp = 2
  q, k, v, do = (x.astype(jnp.bfloat16) for x in rank_coded_qkv(
      21, cp, load_balance="dual_chunk"))
  kw = dict(is_causal=True, load_balance="dual_chunk", loop="unrolled",
            kv_sends="gather") | extra
  spec = P(None, "cp")
  attn = jax.shard_map(
      lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="cp",
                                              implementation="xla", **kw),
      mesh=mesh(cp), in_specs=(spec,) * 3, out_specs=spec)

  def go(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(do)

  # One lowering, read and (for the values) compiled; the inputs in the
  # layout. The program as lowered: XLA:CPU widens 16-bit collectives to
  # float32 when it compiles (GPUs send bf16 as it is).
  args = [jax_ring.reorder_for_load_balance(x, cp) for x in (q, k, v, do)]
  lowered = jax.jit(go).lower(*args)
  hlo = lowered.compiler_ir("hlo").as_hlo_text()
  sent = re.findall(r"(\w+)\[([\d,]+)\][^\n]* collective-permute\(", hlo)
  assert sent == [part] * (cp - 1), sent
  if not values:
    return
  out, grads = lowered.compile()(*args)
  back = lambda x: jax_ring.reorder_from_load_balance(x, cp)
  assert out.dtype == jnp.bfloat16
  check((back(out), tuple(back(g) for g in grads)), q, k, v, do, ref.Case(
      H**-0.5, is_causal=True, window=extra.get("local_window_size")))


# The values with -m slow: those of either sends, named, are
# test_gathered_kv_sends_collectives[shard_map]'s and
# test_backward_sends_no_kv_a_second_time[shard_map]'s.
@pytest.mark.parametrize("cap, values", [
    (None, False), (0, False), pytest.param(None, True, marks=_SLOW),
    pytest.param(0, True, marks=_SLOW)],
    ids=["None", "0", "None_values", "0_values"])
def test_default_kv_sends_gather_up_to_the_cap(cap, values, monkeypatch):
  """kv_sends=None: one K/V all-gather while cp x the local stacked K/V fit
  GATHER_KV_MAX_BYTES (these do: 12 KiB in all), else the neighbour ring
  (the sends of the forward as emitted: the choice is the library's);
  exact either way."""
  if cap is not None:
    monkeypatch.setattr(jax_ring._src.core.config, "GATHER_KV_MAX_BYTES", cap)
  cp = 4
  q, k, v, do = rank_coded_qkv(19, cp)
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance="dual_chunk",
          loop="unrolled", implementation="xla"),
      mesh=mesh(cp), in_specs=(spec,) * 3, out_specs=spec)
  emitted = jax.jit(f).lower(q, k, v).as_text()
  counts = [len(re.findall(rf"stablehlo\.{op}\b", emitted))
            for op in ("all_gather", "collective_permute")]
  assert counts == ([1, 0] if cap is None else [0, cp - 1]), counts
  if values:
    check(layout_vjp(f, cp, "dual_chunk", q, k, v, do), q, k, v, do,
          ref.Case(H**-0.5, is_causal=True))


def test_loop_forms_agree_and_env_var_selects_scan(ring_programs,
                                                  monkeypatch):
  # The unrolled form: test_backward_sends_no_kv_a_second_time[shard_map]'s
  # program (and values). Two programs, which XLA may fuse apart: equal to
  # float32 rounding (jax 0.11's CPU code differs by 1 ulp in 6 of 6,144
  # gradient entries; 0.10's is bitwise equal).
  _, inputs, scan = ring_programs.both("shard_map", "scan")
  _, _, unrolled = ring_programs.both("shard_map", "unrolled")
  for a, b in zip(jax.tree.leaves(scan), jax.tree.leaves(unrolled)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-6)
  # The default run's dual-chunk ring, causal, in both loop forms.
  check_causal(scan, inputs)
  monkeypatch.setenv("NVTE_FUSED_RING_ATTENTION_USE_SCAN", "1")
  assert jax_ring.ContextParallel().with_environment().loop == "scan"
  monkeypatch.setenv("NVTE_FUSED_RING_ATTENTION_USE_SCAN", "0")
  assert jax_ring.ContextParallel().with_environment().loop == "unrolled"
  # Read as TransformerEngine reads it: an integer, non-zero is the scan.
  monkeypatch.setenv("NVTE_FUSED_RING_ATTENTION_USE_SCAN", "2")
  assert jax_ring.ContextParallel().with_environment().loop == "scan"
  for text in ("true", "", "1.0"):
    monkeypatch.setenv("NVTE_FUSED_RING_ATTENTION_USE_SCAN", text)
    with pytest.raises(ValueError, match="^NVTE_FUSED_RING_ATTENTION_USE_SCAN "
                       "must be an integer"):
      jax_ring.ContextParallel().with_environment()


@pytest.mark.parametrize("cp", [2, 4])
def test_reorder_round_trips_and_places_chunks(cp):
  x = jnp.arange(2 * 4 * cp).reshape(2, 4 * cp)
  y = jax_ring.reorder_for_load_balance(x, cp)
  np.testing.assert_array_equal(jax_ring.reorder_from_load_balance(y, cp), x)
  chunks = np.asarray(y[0]).reshape(2 * cp, 2) // 2  # chunk id of each token
  want = [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
  np.testing.assert_array_equal(chunks[:, 0], want)


@pytest.mark.parametrize("cp", [2, 4])
def test_striped_reorder_round_trips_and_places_tokens(cp):
  """Token i lands on device i % cp as local token i // cp, along any
  sequence axis."""
  s = 3 * cp  # divisible by cp but not by 2 cp: striped, not dual_chunk
  x = jnp.arange(2 * s * 3).reshape(2, s, 3)
  y = jax_ring.reorder_for_load_balance(x, cp, layout="striped")
  np.testing.assert_array_equal(
      jax_ring.reorder_from_load_balance(y, cp, layout="striped"), x)
  shards = np.asarray(y[0, :, 0]).reshape(cp, s // cp) // 3  # token ids
  want = np.arange(s).reshape(s // cp, cp).T  # device r: r, r + cp, ...
  np.testing.assert_array_equal(shards, want)
  z = jax_ring.reorder_for_load_balance(jnp.swapaxes(x, 0, 1), cp,
                                        seq_axis=0, layout="striped")
  np.testing.assert_array_equal(jnp.swapaxes(z, 0, 1), y)
  with pytest.raises(ValueError, match=re.escape(
      f"sequence length {s + 1} (axis 1 of shape (1, {s + 1})) must be "
      f"divisible by cp_size = {cp} for the striped load balance")):
    jax_ring.reorder_for_load_balance(jnp.ones((1, s + 1)), cp,
                                      layout="striped")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_striped_bands_match_global_positions(n):
  """Each striped block's static band, read with BlockMask semantics, keeps
  exactly the (query, key) pairs the global mask keeps, for every d."""
  from jax_ring._src.strategies.ring import striped as ring_striped

  for t, causal, window in itertools.product(
      [1, 2, 5], [True, False], [None, (0, 0), (5, 0), (3, 7), (1, 12)]):
    cfg = jax_ring.AttentionConfig(1.0, is_causal=causal, local_window=window)
    for d in range(1 - n, n):
      m = np.arange(t)[:, None] - np.arange(t)[None, :]  # a - b
      dist = m * n + d  # p_q - p_k in global positions
      want = np.ones_like(m, bool)
      if causal:
        want &= dist >= 0
      if window is not None:
        want &= (-window[1] <= dist) & (dist <= window[0])
      band = ring_striped.striped_band(cfg, n, t, d)
      got = np.zeros_like(want)
      if band is not None:
        local = m + band.q_offset - band.kv_offset  # local p_q - p_k
        got = np.ones_like(want)
        if band.is_causal:
          got &= local >= 0
        if band.window is not None:
          got &= local <= band.window[0]
        assert got.any(), (t, causal, window, d, band)  # else it is a skip
      np.testing.assert_array_equal(got, want, err_msg=str(
          (t, causal, window, d, band)))


def test_errors():
  q = jnp.ones((1, 6, 2, 8))
  with pytest.raises(ValueError, match=re.escape(
      "axis_name 'cp' is not a mesh axis bound here (no mesh axis is bound "
      "here)")):
    jax_ring.ring_attention(q, q, q, axis_name="cp")
  other = jax.shard_map(lambda x: jax_ring.ring_attention(
      x, x, x, axis_name="cp"), mesh=jax.make_mesh(
          (2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
          devices=jax.devices()[:2]), in_specs=P(None, "seq"),
      out_specs=P(None, "seq"))
  with pytest.raises(ValueError, match=re.escape(  # names the mesh's axes
      "axis_name 'cp' is not a mesh axis bound here (the mesh here has axes "
      "('seq',))")):
    other(jnp.ones((1, 8, 2, 8)))
  spec = P(None, "cp")
  f = jax.shard_map(lambda x: jax_ring.ring_attention(
      x, x, x, axis_name="cp", load_balance="dual_chunk"),
                    mesh=mesh(2), in_specs=spec, out_specs=spec)
  with pytest.raises(ValueError, match=re.escape(
      "load_balance='dual_chunk' needs the global sequence length (6) "
      "divisible by 2 * cp_size = 4; the local query length is 3")):
    f(q)
  with pytest.raises(ValueError, match="divisible by 2 \\* cp_size = 4"):
    jax_ring.reorder_for_load_balance(q, 2)
  for kw, message in [
      (dict(load_balance="zigzag"),
       "load_balance must be None, 'dual_chunk' or 'striped'; got 'zigzag'"),
      (dict(kv_sends="direct"),
       "kv_sends must be None or one of ('neighbour', 'gather'); "
       "got 'direct'")]:
    g = jax.shard_map(lambda x, kw=kw: jax_ring.ring_attention(
        x, x, x, axis_name="cp", **kw),
                      mesh=mesh(2), in_specs=spec, out_specs=spec)
    with pytest.raises(ValueError, match=re.escape(message)):
      g(q)
  # Striped needs only S % cp == 0: S = 6 on cp = 2 runs.
  h = jax.jit(jax.shard_map(lambda x: jax_ring.ring_attention(
      x, x, x, axis_name="cp", is_causal=True, load_balance="striped",
      implementation="xla"), mesh=mesh(2), in_specs=spec, out_specs=spec))
  assert h(q).shape == q.shape


# -m slow: the ring on a data x cp mesh in a user's shard_map is
# test_data_parallel_rows_that_reach_different_steps[shard_map]'s.
@pytest.mark.slow
def test_2d_mesh_data_by_cp_with_heads_unsharded():
  """Batch on a data axis, sequence on cp: the ring runs per data shard."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  dp, cp = 2, 4
  m = Mesh(np.array(jax.devices()[:dp * cp]).reshape(dp, cp), ("data", "cp"))
  q, k, v, do = rank_coded_qkv(15, cp)
  spec = P("data", "cp")
  f = jax.shard_map(
      lambda q, k, v: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance="dual_chunk",
          implementation="xla"),
      mesh=m, in_specs=(spec,) * 3, out_specs=spec)
  got = layout_vjp(f, cp, "dual_chunk", q, k, v, do)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True))


# The dual-chunk ring unrolled and the striped one scanned in the default
# run; -m slow adds the other loop forms, the contiguous ring (its packed
# rows are test_ring_skips_steps_no_document_reaches') and the gathered K/V
# (test_automatic_path_picks_the_backend_on_shard_shapes' packed rows).
@pytest.mark.parametrize(
    "load_balance, kv_sends, loop",
    [pytest.param(*c, marks=() if default else pytest.mark.slow)
     for i, (lb, sends) in enumerate([
         (None, "neighbour"), ("dual_chunk", "neighbour"),
         ("striped", "neighbour"), ("dual_chunk", "gather")])
     for loop, default in (("scan", i == 2), ("unrolled", i == 1))
     for c in [(lb, sends, loop)]],
    ids=[f"{name}-{loop}" for name in ("contiguous", "dual_chunk", "striped",
                                       "dual_chunk_gather")
         for loop in ("scan", "unrolled")])
def test_ring_packed_segments_cross_shard_boundaries(load_balance, kv_sends,
                                                     loop):
  cp = 4
  q, k, v, do = rank_coded_qkv(16, cp, load_balance=load_balance)
  ids = ref.random_segments(17, B, S, 5)  # 5 documents of random lengths
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance=load_balance,
          segment_ids=ids, loop=loop, kv_sends=kv_sends,
          implementation="xla"),
      mesh=mesh(cp), in_specs=(spec,) * 4, out_specs=spec)
  got = layout_vjp(f, cp, load_balance, q, k, v, do, jnp.asarray(ids))
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True, q_segment_ids=ids,
                                   kv_segment_ids=ids))


@pytest.mark.parametrize(
    "segments, dp, loop, window_and_padding, load_balance, ring_options", [
        # -m slow: the automatic path's plain dual-chunk ring is
        # test_automatic_path_picks_the_backend_on_shard_shapes' (and
        # test_sinks.py's ring-4), the scan test_loop_forms_agree...'s.
        pytest.param(False, 2, "scan", False, "dual_chunk", {}, marks=_SLOW),
        pytest.param(True, 2, "unrolled", False, "dual_chunk", {},
                     marks=_SLOW),  # as default_sends, below
        pytest.param(True, 2, "scan", True, "dual_chunk", {}, marks=_SLOW),
        (True, 2, "unrolled", True, "striped", {}),
        (True, 2, "unrolled", False, "dual_chunk", dict(kv_sends=None)),
        pytest.param(True, 2, "unrolled", True, "dual_chunk",
                     dict(kv_sends=None), marks=_SLOW)],
    ids=["dp2_cp4_scan", "dp2_cp4_unrolled_packed",
         "dp2_cp4_scan_packed_window_pad",
         "dp2_cp4_unrolled_striped_packed_window_pad",
         "dp2_cp4_unrolled_packed_default_sends",
         "dp2_cp4_unrolled_packed_window_pad_default_sends"])
@pytest.mark.sample(1)
def test_automatic_path_under_jit_matches_reference(segments, dp, loop,
                                                    window_and_padding,
                                                    load_balance,
                                                    ring_options):
  """jit + NamedSharding (data x cp), no shard_map in user code; the
  neighbour ring unless ``ring_options`` say otherwise (the default,
  ``kv_sends=None``, gathers these small K/V)."""
  cp = 4
  if len(jax.devices()) < dp * cp:
    pytest.skip(f"needs {dp * cp} devices")
  m = Mesh(np.array(jax.devices()[:dp * cp]).reshape(dp, cp), ("data", "cp"))
  q, k, v, do = rank_coded_qkv(18, cp, load_balance=load_balance)
  ids = jnp.asarray(ref.random_segments(19, B, S, 4))
  re_ = lambda x: jax_ring.reorder_for_load_balance(x, cp,
                                                    layout=load_balance)
  un_ = lambda x: jax_ring.reorder_from_load_balance(x, cp,
                                                     layout=load_balance)
  tok = jax.sharding.NamedSharding(m, P("data", "cp"))
  args = [jax.device_put(re_(x), tok) for x in (q, k, v, do)]
  seg = jax.device_put(re_(ids), tok) if segments else None
  ring_options = dict(kv_sends="neighbour") | ring_options
  cpc = jax_ring.ContextParallel(axis="cp", load_balance=load_balance,
                                 loop=loop, inputs="load_balanced",
                                 **ring_options)

  extra = {}
  if window_and_padding:
    extra = dict(local_window_size=(9, 0),
                 query_seq_lengths=jnp.asarray(Q_LENGTHS),
                 key_value_seq_lengths=jnp.asarray(KV_LENGTHS))

  def attn(q, k, v, seg):
    return jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=seg, context_parallel=cpc,
        implementation="xla", **extra)

  @jax.jit
  def go(q, k, v, do, seg):
    out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, seg), q, k, v)
    return out, vjp(do)

  # One compile serves both the values and the structural check.
  compiled = go.lower(*args, seg).compile()
  out, grads = compiled(*args, seg)
  fwd_hlo = collectives(jax.jit(attn).lower(*args[:3], seg).compile()
                        .as_text())
  if cpc.kv_sends == "neighbour":
    assert fwd_hlo["collective-permute"] and not fwd_hlo["all-gather"]
  else:  # K/V (and their segment ids) gathered, nothing passed around
    assert fwd_hlo["all-gather"] and not fwd_hlo["collective-permute"]
  # The backward, lowered apart from the forward, gathers K/V once.
  hlo = compiled.as_text()
  assert "collective-permute" in hlo and "all-gather" in hlo
  case = ref.Case(H**-0.5, is_causal=True,
                  q_segment_ids=np.asarray(ids) if segments else None,
                  kv_segment_ids=np.asarray(ids) if segments else None)
  if window_and_padding:
    case = dataclasses.replace(case, window=(9, 0), q_lengths=Q_LENGTHS,
                               kv_lengths=KV_LENGTHS)
  check((un_(out), tuple(un_(g) for g in grads)), q, k, v, do, case)


def test_automatic_path_rejects_a_length_the_layout_cannot_split():
  m = mesh(4)
  q = jax.device_put(jnp.ones((1, 20, 2, 8)),
                     jax.sharding.NamedSharding(m, P(None, "cp")))
  # Arrays already in the layout must divide (natural ones are padded:
  # tests/test_any_length.py).
  cpc = jax_ring.ContextParallel(axis="cp", load_balance="dual_chunk",
                                 loop="scan", inputs="load_balanced")
  f = jax.jit(lambda q: jax_ring.dot_product_attention(
      q, q, q, is_causal=True, context_parallel=cpc, implementation="xla"))
  with pytest.raises(ValueError, match=re.escape(
      "load_balance='dual_chunk' needs the global sequence length (20) "
      "divisible by 2 * cp_size = 8")):
    f(q)


def test_automatic_path_picks_the_backend_on_shard_shapes(monkeypatch):
  """A backend whose limit is per call (cuDNN's ragged buffers under
  2**31 elements, say) serves the shards of a sequence longer than it
  takes whole: the choice is made on each shard, not on the global array."""
  from jax_ring._src.core import registry
  from jax_ring._src.backends import xla
  cp, traced = 2, []  # two shards make the point
  limit = S // cp  # takes one shard's length, not the whole sequence

  def forward(q, *args):
    traced.append(q.shape[1])
    return xla.forward(q, *args)

  def backward(q, *args):
    traced.append(q.shape[1])
    return xla.backward(q, *args)

  monkeypatch.setitem(registry.BACKENDS, "bounded", registry.Backend(
      "bounded", forward, backward,
      lambda cfg, q, k, *_: None if q.shape[1] <= limit else "too long"))
  m = mesh(cp)
  q, k, v, do = rank_coded_qkv(21, cp, load_balance="dual_chunk")
  ids = jnp.asarray(ref.random_segments(22, B, S, 3))
  re_ = lambda x: jax_ring.reorder_for_load_balance(x, cp)
  tok = jax.sharding.NamedSharding(m, P(None, "cp"))
  args = [jax.device_put(re_(x), tok) for x in (q, k, v, do, ids)]
  cpc = jax_ring.ContextParallel(axis="cp", load_balance="dual_chunk",
                                 inputs="load_balanced")

  @jax.jit
  def go(q, k, v, do, seg):
    attn = lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=seg, context_parallel=cpc)
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(do)

  out, grads = go(*args)
  assert traced and max(traced) <= limit, traced
  un_ = lambda x: jax_ring.reorder_from_load_balance(x, cp)
  case = ref.Case(H**-0.5, is_causal=True, q_segment_ids=np.asarray(ids),
                  kv_segment_ids=np.asarray(ids))
  check((un_(out), tuple(un_(g) for g in grads)), q, k, v, do, case)


def _docs(lengths, ids=None):
  ids = np.arange(len(lengths)) if ids is None else np.asarray(ids)
  return np.repeat(ids, lengths)[None].astype(np.int32)


# Shards of 12: documents that cross a boundary by one row each side
# (12), and by up to two (12, 24); ``reach.tail_sizes(12, 4)`` is (3,), so
# step 1 sends the last 3 rows of each shard (with the divisors 16, 4, 2:
# the last 1 and 3 rows).
CROSS_ONE = _docs((11, 2, 10, 1, 1, 10, 1, 1, 11))
CROSS_FEW = _docs((10, 3, 10, 3, 10, 3, 9))


# Packed rows on contiguous shards under the defaults skip the steps no
# document reaches (``ring.reach``): documents that stay inside shards, ones
# that cross a boundary (by a row, a few rows, or most of a shard), one
# that spans the row, and an id in two runs (shards 0 and 3); exact
# whichever steps run. At cp = 2 (shards of 24) step 1 is the last, and
# without a causal mask it runs on whole shards.
# One in the default run (no causal mask: every step), the rest under -m
# slow: documents inside the shards (no step) are
# test_data_parallel_rows_that_reach_different_steps', step 1 on the tails
# test_ring_hands_the_own_block_what_its_backend_prepares' and
# test_ring_crossing_rows_with_padding_and_value_head_dim's.
@pytest.mark.parametrize("ids, causal, cp", [
    (CROSS_FEW, False, 4),
    (_docs((6,) * 8), True, 4),
    pytest.param(_docs((5, 11, 9, 7, 4, 12)), True, 4, marks=_SLOW),
    (CROSS_ONE, True, 4), pytest.param(CROSS_FEW, True, 4, marks=_SLOW),
    (_docs((S,)), True, 4),
    pytest.param(_docs((6,) * 8, [7, 3, 5, 1, 0, 2, 6, 7]), True, 4,
                 marks=_SLOW),
    (_docs((6,) * 8, [7, 3, 5, 1, 0, 2, 6, 7]), False, 4),
    (CROSS_FEW, True, 2), pytest.param(CROSS_FEW, False, 2, marks=_SLOW)],
    ids=["cross_few_full", "inside", "cross", "cross_one", "cross_few", "one",
         "an_id_twice", "an_id_twice_full", "cross_few_cp2",
         "cross_few_full_cp2"])
@pytest.mark.sample(1)
def test_ring_skips_steps_no_document_reaches(ids, causal, cp):
  _check_packed_ring(ids, causal, cp)


def _check_packed_ring(ids, causal, cp, kv_ids=None):
  """The ring on contiguous shards of packed rows ``ids`` (and keys'
  ``kv_ids``, default the same; xla blocks, inside a user's shard_map),
  output and gradients against the reference; returns ``(f, q, k, v, do,
  ids)``, the ids ``(B, S)`` or the pair, as ``f`` takes them."""
  q, k, v, do = rank_coded_qkv(16, cp, load_balance=None)
  qi = np.broadcast_to(ids, (B, S))
  ki = qi if kv_ids is None else np.broadcast_to(kv_ids, (B, S))
  ids = jnp.asarray(qi) if kv_ids is None else (jnp.asarray(qi),
                                                jnp.asarray(ki))
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=causal, segment_ids=ids,
          implementation="xla"),
      mesh=mesh(cp), in_specs=(spec, spec, spec, jax.tree.map(
          lambda _: spec, ids)), out_specs=spec)
  got = layout_vjp(f, cp, None, q, k, v, do, ids)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=causal, q_segment_ids=qi,
                                   kv_segment_ids=ki))
  return f, q, k, v, do, ids


def _needed_steps(cp, load_balance, causal, rows=False, two=False):
  """``ids (B, S) -> (cp, cp)``: each device's mask of needed ring steps;
  with ``rows``, also ``(cp,)``: each device's crossing rows. ``two``: the
  ids given as query and kv ids apart (numbered together)."""
  from jax_ring._src.core.config import ShardPlan
  from jax_ring._src.core.mask import TokenMask
  from jax_ring._src.strategies.ring import reach
  plan = ShardPlan("cp", cp, load_balance)
  masks = (lambda ids: TokenMask(q_segment_ids=ids, kv_segment_ids=ids + 0)
           if two else TokenMask.of(ids, ids, None, None))
  return jax.jit(jax.shard_map(
      lambda ids: jax.tree.map(lambda x: x[None], reach.needed_steps(
          masks(ids), plan, causal, rows)),
      mesh=mesh(cp), in_specs=P(None, "cp"), out_specs=P("cp")))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_crossing_rows(causal, monkeypatch):
  """The rows documents cross at shard boundaries (shards of 12), the same
  on every device; a row's batch mate that crosses further sets them; and
  the branch they pick, with three tail sizes (1, 3, 6): none, step 1 on
  1 or 3 rows, or the path over every step (a later step is needed, or
  documents cross by more than the largest size: that path stops after
  step 1). Ids spread wider than a row's tokens (documents inside the
  shards) share table slots, so they count as one document: more steps
  and rows, never fewer. Not under a causal mask, the queries that reach
  the next shard are a shard's last rows, so the first rows that hold
  them are the whole shard, and the step back (3, at cp = 4) is needed."""
  from jax_ring._src.strategies.ring import reach
  monkeypatch.setattr(reach, "TAIL_DIVISORS", (16, 4, 2))
  cp = 4
  f = _needed_steps(cp, None, causal, rows=True)
  cases = [(_docs((6,) * 8), 0, 0), (CROSS_ONE, 1, 12), (CROSS_FEW, 2, 12),
           (_docs((5, 11, 9, 7, 4, 12)), 8, 12), (_docs((S,)), 12, 12),
           (ref.spread(_docs((6,) * 8)), 12, 12)]
  branches = [0, 1, 2, 4, 4, 4] if causal else [0, 4, 4, 4, 4, 4]
  for (ids, want, want_full), branch in zip(cases, branches):
    for other in (_docs((6,) * 8), ids):
      need, rows = f(jnp.asarray(np.concatenate([ids, other])))
      assert (np.asarray(rows) == (want if causal else want_full)).all(), (
          ids, rows)
      got = reach.branch(need[0], rows[0], S // cp, cp)
      assert got == branch, (ids, got)


def test_ring_hands_what_its_tails_leave_to_another_strategy(monkeypatch):
  """With a strategy beyond the ring (the automatic path's Ulysses), the
  step-1 tails (here 1/16, 1/4 and 1/2 of a shard) stop short of a whole
  shard at every cp, and rows they do not hold, or that need a later
  step, take that strategy's branch; alone, the ring at cp = 2 runs step
  1 on whole shards instead."""
  from jax_ring._src.strategies.ring import reach
  monkeypatch.setattr(reach, "TAIL_DIVISORS", (16, 4, 2))
  for cp, ids, beyond, size in (
      (2, _docs((S,)), True, None), (2, _docs((S,)), False, S // 2),
      (2, CROSS_FEW, True, 2), (4, CROSS_FEW, True, 3),
      (4, _docs((5, 11, 9, 7, 4, 12)), True, None)):
    got = reach.steps_of_rows(ids, cp, True, beyond=beyond)
    assert (got["beyond"], got["size"]) == (beyond and size is None, size), (
        cp, got)


def test_ring_crossing_rows_with_padding_and_value_head_dim():
  """Step 1 on a shard's last rows only (CROSS_FEW: 3 of 12), with padding
  lengths inside the rows sent (row 1's keys end at 23: 2 of shard 1's
  last 3) and queries that end mid-shard, and a value head dim unlike the
  key's (K and V travel as a pair): forward and gradients as the float64
  reference's."""
  cp, hv = 4, 24
  ids = np.broadcast_to(CROSS_FEW, (B, S))
  q_len, kv_len = np.array([S, 30], np.int32), np.array([S - 2, 23], np.int32)
  q, k, v, do = ref.random_qkv(11, B, S, S, 4, 2, H, hv=hv)
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, segment_ids=ids,
          query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
          implementation="xla"),
      mesh=mesh(cp), in_specs=(spec,) * 4, out_specs=spec)
  got = layout_vjp(f, cp, None, q, k, v, do, jnp.asarray(ids))
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True, q_segment_ids=ids,
                                   kv_segment_ids=ids, q_lengths=q_len,
                                   kv_lengths=kv_len))


# Natural-order ids (each a row of S = 48); shards of 12 (contiguous) or
# chunks of 6 (dual-chunk). Ids in any order, and one id in two runs.
@pytest.mark.parametrize("load_balance, cases", [
    (None, [(_docs((6,) * 8), [1, 0, 0, 0]),
            (_docs((5, 11, 9, 7, 4, 12)), [1, 1, 0, 0]),  # crosses 12, 24
            (_docs((6,) * 8, [7, 3, 5, 1, 0, 2, 6, 4]), [1, 0, 0, 0]),
            (_docs((6,) * 8, [7, 3, 5, 1, 0, 2, 6, 7]), [1, 0, 0, 1]),
            (_docs((S,)), [1, 1, 1, 1]),
            # ids a table cannot place: one slot for ids 1-7, every step
            (ref.spread(_docs((6,) * 8)), [1, 1, 1, 1])]),
    ("dual_chunk", [(_docs((6,) * 8), [1, 0, 0, 0]),
                    (_docs((5, 11, 9, 7, 4, 12)), [1, 1, 1, 1])])],
    ids=["contiguous", "dual_chunk"])
def test_ring_reach_marks_the_steps_documents_cross(load_balance, cases):
  cp = 4
  f = _needed_steps(cp, load_balance, True)
  for ids, want in cases:
    if load_balance:
      ids = np.asarray(jax_ring.reorder_for_load_balance(ids, cp))
    got = np.asarray(f(jnp.asarray(ids))).reshape(cp, cp)
    assert (got == np.asarray(want, bool)[None]).all(), (ids, got)


def test_ring_reach_test_branches_on_nothing():
  """The reach test numbers the ids with no branch (on a GPU each branch's
  test is a wait for the device): no ``cond`` in its program, for rows
  the ids' table places and for ids spread too wide for it alike."""
  f = _needed_steps(4, None, True, rows=True)
  for ids in (_docs((6,) * 8), ref.spread(_docs((6,) * 8))):
    text = str(jax.make_jaxpr(f)(jnp.asarray(ids)))
    assert "cond[" not in text and "switch" not in text, text


# Contiguous shards causal and dual-chunk ones unmasked in the default run;
# with -m slow the others, whose marks test_ring_crossing_rows[full] and
# test_ring_reach_marks_the_steps_documents_cross[dual_chunk] check.
@pytest.mark.parametrize("causal, load_balance", [
    (True, None), (False, "dual_chunk"), (False, None),
    (True, "dual_chunk")], ids=["causal-None", "full-dual_chunk",
                                "full-None", "causal-dual_chunk"])
@pytest.mark.sample(2)
def test_ring_reach_equals_a_set_intersection(load_balance, causal):
  """Random rows of few ids (so ids recur in several runs and chunks), two
  rows a batch: the mask of needed steps is, step by step, whether some
  chunk pair that the step makes and the mask lets meet shares an id;
  the same with the ids given as query and kv ids apart."""
  from jax_ring._src.core.config import ShardPlan
  from jax_ring._src.strategies import layout
  cp = 4
  f = _needed_steps(cp, load_balance, causal)
  f_two = _needed_steps(cp, load_balance, causal, two=True)
  order = [layout.chunk_ids(ShardPlan("cp", cp, load_balance), r)
           for r in range(cp)]  # each device's chunks, in global order
  n = len(order[0])
  rng = np.random.default_rng(7)

  def needed(chunks, step):
    return step == 0 or any(
        (not causal or order[(r - step) % cp][y] < order[r][x]) and
        np.intersect1d(row[r * n + x], row[(r - step) % cp * n + y]).size
        for row in chunks for r in range(cp) for x in range(n)
        for y in range(n))

  for distinct in (2, 5, 40):
    ids = np.sort(rng.integers(0, distinct, (2, S)), 1)
    ids = np.where(rng.random((2, S)) < 0.05, rng.integers(0, distinct,
                                                           (2, S)), ids)
    chunks = ids.reshape(2, cp * n, -1)  # the shards' chunks, in order
    want = [needed(chunks, step) for step in range(cp)]
    for g in (f, f_two):
      got = np.asarray(g(jnp.asarray(ids, jnp.int32))).reshape(cp, cp)
      assert (got == np.asarray(want)[None]).all(), (distinct, got, want)


@pytest.mark.parametrize("entry", ["shard_map", "jit"])
@pytest.mark.sample(1)
def test_data_parallel_rows_that_reach_different_steps(entry):
  """On a data x cp mesh each data shard's rows may reach different ring
  steps (here: documents inside the shards, and one over the whole row):
  every device still takes the same branches (a permute in a branch runs
  on all devices or none), through a user's shard_map and under jit, and
  the result is the reference's."""
  ids = np.concatenate([_docs((6,) * 8), _docs((S,))])
  q, k, v, do = ref.random_qkv(3, 2, S, S, 4, 2, H)
  m = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "cp"))
  spec = P("data", "cp")
  if entry == "shard_map":
    f = jax.shard_map(
        lambda q, k, v, i: jax_ring.ring_attention(
            q, k, v, axis_name="cp", is_causal=True, segment_ids=i,
            implementation="xla"), mesh=m, in_specs=(spec,) * 4,
        out_specs=spec)
  else:
    cpc = jax_ring.ContextParallel(axis="cp", strategy="ring",
                                   load_balance=None)
    f = lambda q, k, v, i: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=i, implementation="xla",
        context_parallel=cpc)
    q, k, v, do = (jax.device_put(x, jax.sharding.NamedSharding(m, spec))
                   for x in (q, k, v, do))
  def both(q, k, v, i, do):
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, i), q, k, v)
    return out, vjp(do)

  step = jax.jit(both).lower(q, k, v, jnp.asarray(ids), do).compile()
  hlo = step.as_text()
  # The steps' K/V move only inside branches: every all-gather is of ids.
  assert "conditional" in hlo
  assert all(" s32[" in line or "pred[" in line for line in hlo.splitlines()
             if " all-gather(" in line), hlo
  check(step(q, k, v, jnp.asarray(ids), do), q, k, v, do, ref.Case(
      H**-0.5, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids))


@pytest.fixture
def probe_backend(monkeypatch):
  """In the ``xla`` backend's place, one that computes ahead what it reads
  back: the ``xla`` backend's results from the ids (and, backward, the
  lse) in ``mask.prepared`` where a call has one, so that another block's
  would give wrong numbers; ``seen`` records the directions of the calls
  that had one."""
  from jax_ring._src.backends import xla
  from jax_ring._src.core import registry
  seen = []

  def take(mask, lse=None):
    ready = mask.prepared
    if ready is None:
      return mask, lse
    seen.append("forward" if lse is None else "backward")
    return dataclasses.replace(mask, q_segment_ids=ready["ids"],
                               kv_segment_ids=ready["kv"], prepared=None
                               ), ready.get("lse", lse)

  def forward(q, k, v, bias, mask, config):
    return xla.forward(q, k, v, bias, take(mask)[0], config)

  def backward(q, k, v, bias, mask, out, lse, dout, dlse, config):
    mask, lse = take(mask, lse)
    return xla.backward(q, k, v, bias, mask, out, lse, dout, dlse, config)

  def prepare(q, k, v, mask, config, lse=None):
    ready = {"ids": jax.lax.optimization_barrier(mask.q_segment_ids),
             "kv": mask.kv_ids()}
    return ready if lse is None else dict(ready, lse=lse)

  monkeypatch.setitem(registry.BACKENDS, "xla", registry.Backend(
      "xla", forward, backward, lambda *_: None, prepare=prepare))
  return seen


def _outside_branches(jaxpr, name, inside=False):
  """Whether some ``name`` equation of ``jaxpr`` lies in no cond's
  branch (``inside``: it is in one already)."""
  for eqn in jaxpr.eqns:
    nested = inside or eqn.primitive.name == "cond"
    if eqn.primitive.name == name and not inside:
      return True
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      if _outside_branches(sub, name, nested):
        return True
  return False


@pytest.mark.parametrize("two", [False, True], ids=["one_ids", "two_ids"])
@pytest.mark.sample(1)
def test_ring_hands_the_own_block_what_its_backend_prepares(probe_backend,
                                                            two):
  """Packed rows on the ring's reached loop: the own block's backend
  operands (``kernel.prepare``) are computed before the reach test's
  branch, in no branch of the program, and reach that block's calls, in
  the forward and the backward: a backend that reads the ids and the lse
  from them stays exact, with one id array and with the keys' own (here
  document 2's keys are another's: its queries see none)."""
  f, q, k, v, do, ids = _check_packed_ring(
      CROSS_FEW, True, 4, np.where(CROSS_FEW == 2, 9, CROSS_FEW) if two
      else None)
  assert set(probe_backend) == {"forward", "backward"}
  vjp = lambda *a: jax.vjp(lambda q, k, v: f(q, k, v, a[3]), *a[:3])[1](
      a[4])
  program = jax.make_jaxpr(vjp)(q, k, v, ids, do).jaxpr
  assert _outside_branches(program, "optimization_barrier")
