"""What every head- or gather-based strategy (Ulysses, all-gather) must do
the same way, parametrized over them: the 2/4/8-device matrix against the
float64 reference, the forward's lse residual in the shards' layout, and a
data x cp mesh with packed documents. (The ring's versions sit with its
other tests.)"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
import reference as ref
from jax_ring._src.strategies import (STRATEGIES, all_gather as ag,
                                      ulysses as uly)
from jax_ring._src.core.config import STRATEGY_NAMES
from jax_ring._src.core.mask import TokenMask
from helpers import (B, H, S, SPEC, case_id, check, coded_qkv, layout_vjp,
                     mesh, run_shard_map)

# The entries of the library's STRATEGIES table covered here: name -> (its
# shard_map entry, cp of the lse test, seed, load balance of the 2-D test).
# All-gather compiles cp branches, so its lse test runs at 2.
COVERED = {"ulysses": (uly.ulysses_attention, 4, 50, "dual_chunk"),
           "all_gather": (ag.all_gather_attention, 2, 60, None)}


def test_the_table_holds_every_strategy_the_config_names():
  """``ContextParallel.strategy``'s names are the table's keys and "auto";
  each record is filed under its own name."""
  assert set(STRATEGY_NAMES) == set(STRATEGIES) | {"auto"}
  assert all(s.name == name for name, s in STRATEGIES.items())


# K = 2 kv heads: Ulysses at cp = 2 splits them (rep 1), at cp = 4 and 8
# repeats them (rep 2 and 4, one kv head per device).
def _default_lane(name, cp, causal, load_balance):
  """At cp = 4: Ulysses causal on both layouts, all-gather causal on
  dual-chunk shards and unmasked on contiguous ones. The default run has
  the rest elsewhere: Ulysses unmasked in
  test_ulysses_window_and_padding_lengths (a mask is one local call's:
  window_5_3 has none causal); all-gather unmasked on dual-chunk shards
  is, as on contiguous ones, one call over the whole gathered K/V
  (test_kernel_calls_are_static_and_see_only_visible_kv[full]), its
  values, with a window, test_all_gather_windows_and_padding's
  dual_full_w5_3; all-gather causal on contiguous shards is
  test_all_gather_mqa_and_soft_cap's. cp = 2 and 8 with ``-m slow``: the
  same paths over more or fewer devices (coded chunks make a misplaced
  chunk show at any cp); all-gather at cp = 2 is test_all_gather.py's
  (16-bit, kv_chunk_heads), Ulysses at cp = 8 test_any_length.py's."""
  if cp != 4:
    return False
  if name == "ulysses":
    return causal
  return causal == (load_balance == "dual_chunk")


@pytest.mark.parametrize(
    "name, cp, causal, load_balance",
    [pytest.param(*c, marks=() if _default_lane(*c) else pytest.mark.slow)
     for c in itertools.product(COVERED, [2, 4, 8], [True, False],
                                [None, "dual_chunk"])],
    ids=case_id)
def test_matches_reference(name, cp, causal, load_balance):
  q, k, v, do = coded_qkv(cp, cp, 2)
  got = run_shard_map(COVERED[name][0], q, k, v, do, cp, is_causal=causal,
                      load_balance=load_balance)
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=causal))


@pytest.mark.parametrize("name", list(COVERED))
def test_forward_lse_in_the_shards_layout(name):
  """The record's ``forward``: its lse (the backward's residual), per local
  row."""
  strategy, (_, cp, seed, _) = STRATEGIES[name], COVERED[name]
  q, k, v, _ = coded_qkv(seed, cp, 2)
  case = ref.Case(H**-0.5, is_causal=True)
  # ShardPlan("cp", cp, "dual_chunk"): the default ContextParallel's plan.
  plan = strategy.plan(jax_ring.ContextParallel(strategy=name), {"cp": cp},
                       "ring")
  f = jax.jit(jax.shard_map(
      lambda q, k, v: strategy.forward(q, k, v, TokenMask(), ref.config(case),
                                       plan),
      mesh=mesh(cp), in_specs=(SPEC,) * 3, out_specs=(SPEC, SPEC)))
  to = lambda x: jax_ring.reorder_for_load_balance(x, cp)
  out, lse = f(to(q), to(k), to(v))
  r_out, r_lse = ref.attention(q, k, v, case)
  ref.assert_close(out, to(r_out), q.dtype, "out")
  ref.assert_close(lse, to(r_lse), q.dtype, "lse")


# One strategy in the default run, both with -m slow.
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
    for i, n in enumerate(COVERED)])
def test_2d_mesh_data_by_cp_packed(name):
  """Batch on a data axis, sequence on cp: values vary over both axes."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  attention, _, seed, load_balance = COVERED[name]
  dp, cp = 2, 4
  m = jax.sharding.Mesh(np.array(jax.devices()[:dp * cp]).reshape(dp, cp),
                        ("data", "cp"))
  q, k, v, do = coded_qkv(seed + 30, cp, 2)
  seg = ref.random_segments(seed + 31, B, S, 4)
  spec = jax.sharding.PartitionSpec("data", "cp")
  f = jax.shard_map(
      lambda q, k, v, seg: attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance=load_balance,
          segment_ids=seg, implementation="xla"),
      mesh=m, in_specs=(spec,) * 4, out_specs=spec)
  got = layout_vjp(f, cp, load_balance, q, k, v, do, jnp.asarray(seg))
  check(got, q, k, v, do, ref.Case(H**-0.5, is_causal=True, q_segment_ids=seg,
                                   kv_segment_ids=seg))
