"""Hybrid Ulysses x ring attention (Ulysses inside, the ring outside; often
called USP) over two mesh axes, inside the user's shard_map.

Shapes: U the size of the ulysses axis, R the size of the ring axis;
per device ``q (B, T, N, H)``, ``k, v (B, T, K, H)``, T = S / (R U) local
tokens of S; needs N % U == 0.

The sequence is sharded ring-major, ``P(None, (ring_axis, ulysses_axis))``,
so the device at ``(r, u)`` holds sub-shard ``r U + u`` and *ring shard* r
(S / R tokens) is its ulysses group's U sub-shards in u order. Load balance
is a ring-level choice: the global sequence is in
``reorder_for_load_balance(x, R)`` (cp_size = R, not R U) or contiguous;
within a ring shard the tokens are contiguous, so the ulysses level needs
no reorder.

Forward: one Ulysses all-to-all per operand over the ulysses axis (the
helpers of ``ulysses``, on a contiguous plan) turns T tokens x all heads
into the whole ring shard (T U tokens) x N / U query heads and the kv heads
they read (each repeated ``lcm(K, U) / K`` times); the segment ids are
all-gathered over the ulysses axis, and padding lengths, global positions,
pass unchanged. The ring (``ring.forward``, in the call's layout, loop and
sends) then runs on those head-sharded ring shards as it would on R
devices holding all heads, and a second all-to-all brings ``out`` and
``lse`` back. The backward does the same around ``ring.backward`` and sums
the copies of dK/dV in float32.

The layout table, the communication volume and which axis to put where:
docs/design.md, "Hybrid".
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_ring._src.core import validate
from jax_ring._src.core.config import (AttentionConfig, ContextParallel,
                                       KvSends, Loop, ShardPlan)
from jax_ring._src.core.mask import TokenMask
from jax_ring._src.strategies import base, ring, ulysses
from jax_ring._src.strategies.layout import LoadBalance


Plans = tuple[ShardPlan, ShardPlan]  # (ulysses plan, ring plan)


# --- validators ---------------------------------------------------------------

def axis_pair(axis_name) -> tuple[str, str]:
  """``axis_name`` must be ``(ulysses_axis, ring_axis)``: two distinct axis
  names (whether they are bound is checked by ``validate.mesh_axis``)."""
  ok = (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2 and
        all(isinstance(a, str) for a in axis_name) and
        axis_name[0] != axis_name[1])
  if not ok:
    raise ValueError(
        "hybrid_attention needs axis_name = (ulysses_axis, ring_axis), two "
        f"distinct mesh axis names; got {axis_name!r}")
  return (axis_name[0], axis_name[1])


# --- the ulysses level ------------------------------------------------------

def _ring_mask(tm: TokenMask, plan: ShardPlan) -> TokenMask:
  """The ring shard's TokenMask: ids all-gathered over the ulysses axis,
  lengths (global positions) unchanged.

  Same ids (kv None) are gathered once and stay "same" for the ring, which
  tells the cuDNN backend that queries and keys are the same tokens.
  """
  q_ids, kv_ids = tm.q_segment_ids, tm.kv_segment_ids
  gather = lambda x, axis: lax.all_gather(x, plan.axis_name, axis=axis,
                                          tiled=True)
  if q_ids is not None:
    if tm.same_ids:
      q_ids = gather(q_ids, 1)
    else:
      ids = gather(jnp.stack([q_ids, kv_ids]), 2)
      q_ids, kv_ids = ids[0], ids[1]
  return TokenMask(q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                   q_lengths=tm.q_lengths, kv_lengths=tm.kv_lengths)


# --- the strategy -------------------------------------------------------------

def forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plans: Plans):
  """Local shards in, ``(out (B, T, N, H), lse (B, T, N) f32)`` out, both in
  the shards' layout."""
  uplan, rplan = plans
  kv = ulysses.kv_to_heads(k, v, uplan)
  out, lse = ring.forward(ulysses.to_heads(q, uplan, 1), kv[0], kv[1],
                           _ring_mask(tm, uplan), cfg, rplan)
  return (ulysses.to_tokens(out, uplan, 1),
          ulysses.to_tokens(lse, uplan, 1))


def backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plans: Plans):
  """``(dq, dk, dv)`` on local shards from the global ``out``/``lse``."""
  uplan, rplan = plans
  q_h, out_h, dout_h = ulysses.q_out_dout_to_heads(q, out, dout, uplan)
  kv = ulysses.kv_to_heads(k, v, uplan)
  dq, dk, dv = ring.backward(
      q_h, kv[0], kv[1], _ring_mask(tm, uplan), out_h,
      ulysses.to_heads(lse, uplan, 1), dout_h, cfg, rplan)
  dq = ulysses.to_tokens(dq, uplan, 1)
  return (dq.astype(q.dtype),) + ulysses.kv_grads_to_tokens(dk, dv, k, v,
                                                            uplan)


def plan(cpc: ContextParallel, sizes, backward_kv) -> Plans:
  """(Ulysses' plan, contiguous; the ring's, in ``cpc``'s layout)."""
  return (ShardPlan(cpc.ulysses_axis, sizes[cpc.ulysses_axis]),
          ring.plan(cpc, sizes, backward_kv))


def check(cpc: ContextParallel, sizes, q_shape, k_shape) -> None:
  """Local shards ``q_shape``, ``k_shape`` that the hybrid serves."""
  u = sizes[cpc.ulysses_axis]
  validate.self_attention("hybrid", q_shape, k_shape)
  validate.ulysses_heads(q_shape[2], cpc.ulysses_axis, u)
  # The ring sees the ulysses group's gathered T * U tokens.
  ring.check(cpc, sizes, (q_shape[0], q_shape[1] * u) + tuple(q_shape[2:]),
             (k_shape[0], k_shape[1] * u) + tuple(k_shape[2:]))


STRATEGY = base.Strategy("hybrid", forward, backward, plan, check)


def hybrid_attention(query, key, value, *, axis_name: tuple[str, str],
                     is_causal=False, load_balance: LoadBalance | None = None,
                     segment_ids=None, query_seq_lengths=None,
                     key_value_seq_lengths=None, local_window_size=None,
                     scale=None, logits_soft_cap=None, implementation=None,
                     sinks=None, padding_segment_id=None,
                     loop: Loop | None = None,
                     kv_sends: KvSends | None = None):
  """Exact attention over a sequence sharded over a ulysses and a ring axis.

  Call it inside ``shard_map`` with the sequence sharded ring-major,
  ``P(None, (ring_axis, ulysses_axis))``, on the local shards
  ``query (B, T, N, H)``, ``key``/``value (B, T, K, H)``, T = S / (R U)
  tokens each, where U and R are the sizes of the two axes; N must be
  divisible by U. The layout and what moves where: docs/design.md,
  "Hybrid".

  Args:
    axis_name: ``(ulysses_axis, ring_axis)``: all-to-all over the first
      (best inside a node), ring over the second.
    is_causal: causal mask in global positions.
    load_balance: ``None`` (contiguous) or ``"dual_chunk"``: the global
      sequence was put in that layout with
      ``jax_ring.reorder_for_load_balance(x, R)``, with cp_size = R, the
      ring axis size.
    segment_ids: packed documents, this device's ``(B, T)`` ids (or a
      ``(q_ids, kv_ids)`` pair) in the shards' layout. Documents may cross
      shard boundaries.
    query_seq_lengths, key_value_seq_lengths: ``(B,)`` padding lengths in
      global natural-order positions (the same on every device).
    local_window_size: ``w`` or ``(left, right)`` in global positions.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    logits_soft_cap: Gemma-2 soft cap, as in ``dot_product_attention``.
    implementation: block backend, as in ``dot_product_attention``.
    sinks: ``(N,)`` float, one logit per local query head that joins
      every row's softmax with no value, as in ``dot_product_attention``.
    padding_segment_id: an id of ``segment_ids`` that marks padding
      (TransformerEngine's and MaxText's 0, say): its rows output 0 with
      zero gradient, and no token sees its keys. Default None: every id,
      0 included, is a document.
    loop: the ring's loop form, ``"scan"`` or ``"unrolled"``; default from
      ``NVTE_FUSED_RING_ATTENTION_USE_SCAN`` as in :func:`ring_attention`.
    kv_sends: the ring's K/V sends, as in :func:`ring_attention` (its size
      rule counts the ulysses group's K/V).

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  cpc = ContextParallel(axis=axis_pair(axis_name), strategy="hybrid",
                        load_balance=load_balance, loop=loop,
                        kv_sends=kv_sends)
  return base.run(
      STRATEGY, cpc, query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      sinks=sinks, padding_segment_id=padding_segment_id)
