"""Sequences of any length under context parallelism: natural-order (and
contiguous) inputs whose length no layout divides are padded inside the
call, the padding masked and cut, so every strategy on 2 to 8 devices gives
the float64 reference, output and gradients, for any number of documents
a row; ``explain`` reports the padding; arrays already in a layout must
still divide (tests/test_never_silent.py)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ring
from helpers import check_public_call
from jax_ring._src.core import registry

B, N, K, H = 2, 8, 2, 16
S = 45  # divides by no device count but 1 (nor by 2 x cp)


def _mesh(shape, names, kind=jax.sharding.AxisType.Auto):
  if len(jax.devices()) < int(np.prod(shape)):
    pytest.skip("needs more devices")
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names),
                       devices=jax.devices()[:int(np.prod(shape))])


def _check(cpc, mesh, *, t=S, s=S, docs=5, seed=0, **kw):
  """:func:`helpers.check_public_call` at this module's shapes."""
  check_public_call(cpc, mesh, (B, N, K, H), t=t, s=s, docs=docs, seed=seed,
                    **kw)


# Each family by default, on few devices (the programs grow with them; the
# all-gather's dual-chunk one with ids most); -m slow: 8 devices, the
# striped ring scanned, auto (Ulysses here) and Ulysses, padded by default
# in test_ulysses_query_and_key_lengths_padded_apart_on_explicit_axes.
@pytest.mark.parametrize("strategy, options, shape", [
    ("ring", {}, (4,)), ("all_gather", dict(load_balance=None), (2,)),
    ("hybrid", {}, (2, 2)), ("ring", {}, (8,)),
    ("ring", dict(load_balance="striped", loop="scan"), (8,)),
    ("all_gather", {}, (8,)), ("ulysses", {}, (8,)), ("hybrid", {}, (2, 4)),
    ("auto", dict(load_balance=None), (8,)),
], ids=["ring", "all_gather-contiguous", "hybrid", "ring-8",
        "ring-striped-scan", "all_gather", "ulysses", "hybrid-2x4",
        "auto-contiguous"])
@pytest.mark.sample(3)
def test_every_strategy_at_a_length_no_layout_divides(strategy, options,
                                                      shape):
  names = ("u", "r") if len(shape) == 2 else ("cp",)
  axis = names if len(shape) == 2 else "cp"
  cpc = jax_ring.ContextParallel(axis=axis, strategy=strategy, **options)
  _check(cpc, _mesh(shape, names), docs=17)


# -m slow: the default ring at an odd length with packed documents on 8
# devices is test_every_strategy_at_a_length_no_layout_divides[ring].
@pytest.mark.parametrize("docs, t", [
    (1, 45), pytest.param(45, 45, marks=pytest.mark.slow), (200, 203)],
    ids=["one", "every-token", "200"])
@pytest.mark.slow
def test_documents_a_row_at_odd_lengths(docs, t):
  _check(jax_ring.ContextParallel(), _mesh((8,), ("cp",)), t=t, s=t,
         docs=docs, seed=1)


def test_windows_sinks_and_key_lengths_at_an_odd_length():
  """A two-sided window (the padded keys would be inside it), sinks and
  the caller's own key lengths, on 2 devices (the default ring, whose
  window's chunk pairs grow with the devices), no causal mask."""
  _check(jax_ring.ContextParallel(), _mesh((2,), ("cp",)), docs=None,
         seed=2, is_causal=False, local_window_size=(6, 5),
         key_value_seq_lengths=jnp.asarray([41, 45], jnp.int32),
         sinks=jnp.asarray(np.linspace(-1, 1, N), jnp.float32))


def test_packed_rows_hide_the_padding_by_an_id_of_its_own(monkeypatch):
  """No causal mask to hide padded keys, and segment ids (a pair, under
  jit; arrays and ids placed along the sequence, 12 tokens: 4 devices
  divide it, the layout's 8 do not): the padding is a document of its own,
  not a key length (cuDNN's packed path takes no lengths beside segment
  ids): every block's mask has no lengths."""
  seen = []
  xla = registry.BACKENDS["xla"]

  def spied(*args):
    seen.append((args[4].q_lengths, args[4].kv_lengths))
    return xla.forward(*args)

  monkeypatch.setitem(registry.BACKENDS, "xla",
                      dataclasses.replace(xla, forward=spied))
  _check(jax_ring.ContextParallel(), _mesh((4,), ("cp",)), t=12, s=12,
         docs=3, seed=4, is_causal=False, pair=True, spec=P(None, "cp"))
  assert seen and all(x is None and y is None for x, y in seen), seen


def test_ulysses_query_and_key_lengths_padded_apart_on_explicit_axes():
  """T != S, each padded to its own multiple; eagerly, on Explicit axes
  (jax.make_mesh's default)."""
  cpc = jax_ring.ContextParallel(strategy="ulysses")
  _check(cpc, _mesh((4,), ("cp",), jax.sharding.AxisType.Explicit), t=13,
         s=22, docs=None, seed=3, eager=True)


# -m slow: a pair of ids, non-causal, under jit, is
# test_packed_rows_hide_the_padding_by_an_id_of_its_own's call.
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.sample(0)
def test_a_pair_of_segment_ids_under_jit(causal):
  _check(jax_ring.ContextParallel(), _mesh((4,), ("cp",)), t=13, s=13,
         docs=3, seed=6, pair=True, is_causal=causal)


# -m slow: Ulysses on query and key lengths padded apart is
# test_ulysses_query_and_key_lengths_padded_apart_on_explicit_axes'; what
# explain says, test_explain_reports_the_padding.
@pytest.mark.slow
def test_auto_with_lengths_that_pad_alike_stays_ulysses():
  """T = 5 and S = 7 both run as 8 on 4 devices: auto is still Ulysses,
  as explain says for T != S."""
  cpc = jax_ring.ContextParallel(strategy="auto")
  assert jax_ring.explain((B, 5, N, H), (B, 7, K, H), cp_size=4,
                          context_parallel=cpc).forward == "ulysses"
  _check(cpc, _mesh((4,), ("cp",)), t=5, s=7, docs=None, seed=7)


# -m slow: placed arrays the call pads are in
# test_packed_rows_hide_the_padding_by_an_id_of_its_own (under jit); eager
# calls on Explicit axes that pad, in
# test_ulysses_query_and_key_lengths_padded_apart_on_explicit_axes.
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.slow
def test_packed_rows_sharded_on_explicit_axes(causal):
  """Arrays and segment ids placed along the sequence (12 tokens: 4
  devices divide it, dual-chunk's 8 do not), eagerly on Explicit axes."""
  _check(jax_ring.ContextParallel(), _mesh(
      (4,), ("cp",), jax.sharding.AxisType.Explicit), t=12, s=12, docs=3,
         seed=5, eager=True, spec=P(None, "cp"), is_causal=causal)


def test_explain_reports_the_padding():
  choice = jax_ring.explain((1, 1001, 32, 128), (1, 1001, 8, 128),
                            cp_size=4, is_causal=True)
  added, why = choice.defaults["padding"]
  assert added == {"query": 7, "key": 7}
  assert re.search(r"\(1001, 1001\) run as \(1008, 1008\), multiples of 8 ",
                   why), why
  assert "padding" not in jax_ring.explain((1, 1008, 32, 128),
                                           (1, 1008, 8, 128),
                                           cp_size=4).defaults
  # T = 5 and S = 7 both run as 8 on 4 devices: auto stays Ulysses (as
  # test_auto_with_lengths_that_pad_alike_stays_ulysses runs, -m slow).
  assert jax_ring.explain((B, 5, N, H), (B, 7, K, H), cp_size=4,
                          context_parallel=jax_ring.ContextParallel(
                              strategy="auto")).forward == "ulysses"
