"""Hybrid Ulysses x ring attention ("USP": Ulysses inside, ring outside) over
a 2-D context layout, inside the user's shard_map.

Shapes: B batch, S global sequence length, N query heads, K kv heads
(N % K == 0), H head dim; U the size of the ulysses axis, R the size of the
ring axis; T = S / (R U) local tokens. Per device the inputs are
``q (B, T, N, H)``, ``k, v (B, T, K, H)``.

Layout. The sequence is sharded over both axes, ring-major: shard spec
``P(None, (ring_axis, ulysses_axis))``, so the device at ``(r, u)`` holds
sub-shard ``r U + u`` and *ring shard* r (S / R tokens) is the concatenation
of its ulysses group's U sub-shards in u order. Load balance is a ring-level
choice: the user puts the global sequence in
``reorder_for_load_balance(x, R)`` (dual_chunk with cp_size = R, not R U) or
leaves it contiguous; within a ring shard the tokens are contiguous (in
layout order), so the ulysses level needs no reorder. For U = 2, R = 2
(dual_chunk: ring shard r is chunks r and 2R-1-r of 2R = 4 chunks of S/4):

======  ======  =============  =============  ==============================
device  (r, u)  dual_chunk     contiguous     after the all-to-all on U
======  ======  =============  =============  ==============================
0       (0, 0)  [0, S/4)       [0, S/4)       ring shard 0, heads [0, N/2)
1       (0, 1)  [3S/4, S)      [S/4, S/2)     ring shard 0, heads [N/2, N)
2       (1, 0)  [S/4, S/2)     [S/2, 3S/4)    ring shard 1, heads [0, N/2)
3       (1, 1)  [S/2, 3S/4)    [3S/4, S)      ring shard 1, heads [N/2, N)
======  ======  =============  =============  ==============================

Ring shard 0 is ``[0, S/4) + [3S/4, S)`` under dual_chunk and ``[0, S/2)``
contiguous. With U = 4 each chunk of a dual_chunk ring shard is split over
two devices; that is harmless: no compute happens before the all-to-all.

Forward, per device: one Ulysses all-to-all per operand over the ulysses
axis (``ulysses``'s helpers, plan ``(ulysses_axis, U, contiguous)``) turns
``T`` tokens x all heads into the whole ring shard (T U tokens) x N / U query
heads and the kv heads they read (each kv head repeated
``rep = lcm(K, U) / K`` times first, as in ``ulysses``; K' = K rep); the
segment ids are all-gathered over the ulysses axis; padding lengths are
global positions and pass unchanged. Then the ring (``ring._forward``, plan
``(ring_axis, R, load_balance, loop)``) runs on those head-sharded ring
shards exactly as it would on R devices holding all heads, and a second
all-to-all brings ``out`` and ``lse`` back to the token-sharded layout. The
backward does the same around ``ring._backward`` and sums the ``rep`` copies
of dK/dV in float32.

Communication per device per call, elements (all-to-alls on U send
(U - 1) / U of their operand; the ring's permutes go to one neighbour on R):

=========  ===============================  ================================
pass       all-to-all on U, x (U - 1) / U   ring permutes on R
=========  ===============================  ================================
forward    q; (k, v); out; lse:             R - 1 of the stacked KV,
           B T H (2N + 2K') + B T N         2 B T K' H each
backward   (q, out, dout); (k, v); lse;     R - 1 of the KV (2 B T K' H) and
           dq; (dk, dv):                    R of dK/dV (2 B T K' H, float32)
           B T H (4N + 4K') + B T N
=========  ===============================  ================================

plus, with ``segment_ids``, one all-gather on U of the ``(B, T)`` int32 ids
per pass (of the stacked q/kv ids when they differ) and the ring shard's kv
ids riding with each KV permute.

Why Ulysses inside and the ring outside. The all-to-all sits on the critical
path and every device of the group talks to every other: it wants the fast
all-to-all links inside a node (NVLink), so make the ulysses axis the minor
mesh axis, the GPUs of one node: ``Mesh(devices.reshape(R, U), ("ring",
"ulysses"))``. The ring sends to one neighbour and hides each permute behind
a block compute, so it tolerates the slower links between nodes; and against
a plain ring over all R U devices it makes R - 1 hops instead of R U - 1,
each moving the same 2 B T K' H elements (K' = K when U | K) but hidden
behind a (T U) x (T U) block on N / U heads: U times the compute per hop.
Ulysses alone needs U | N, so heads cap its degree; the ring axis has no
such cap. Work is balanced: the devices of a ulysses group do the same work
(same tokens, different heads), and dual_chunk balances the ring level.
"""

from __future__ import annotations


import jax.numpy as jnp
from jax import lax

from jax_ring._src import ring, shard_call, ulysses, validate
from jax_ring._src.config import (AttentionConfig, KvSends, Loop,
                                  ShardPlan, loop_from_environment)
from jax_ring._src.layout import LoadBalance
from jax_ring._src.mask import TokenMask

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
  return axis_name[0], axis_name[1]


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

def _forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plans: Plans):
  """Local shards in, ``(out (B, T, N, H), lse (B, T, N) f32)`` out, both in
  the shards' layout."""
  uplan, rplan = plans
  kv = ulysses._stacked_kv_to_heads(k, v, uplan)
  out, lse = ring._forward(ulysses._to_heads(q, uplan, 1), kv[0], kv[1],
                           _ring_mask(tm, uplan), cfg, rplan)
  return (ulysses._to_tokens(out, uplan, 1),
          ulysses._to_tokens(lse, uplan, 1))


def _backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plans: Plans):
  """``(dq, dk, dv)`` on local shards from the global ``out``/``lse``."""
  uplan, rplan = plans
  # q, out and dout share shape and dtype: one all-to-all for the three.
  q_out_do = ulysses._to_heads(jnp.stack([q, out.astype(q.dtype),
                                          dout.astype(q.dtype)]), uplan, 2)
  kv = ulysses._stacked_kv_to_heads(k, v, uplan)
  dq, dk, dv = ring._backward(
      q_out_do[0], kv[0], kv[1], _ring_mask(tm, uplan), q_out_do[1],
      ulysses._to_heads(lse, uplan, 1), q_out_do[2], cfg, rplan)
  dq = ulysses._to_tokens(dq, uplan, 1)
  dkv = ulysses._to_tokens(jnp.stack([dk, dv]), uplan, 2)
  b, t, kh, h = k.shape
  rep = ulysses.kv_repeat(kh, uplan.cp_size)
  if rep > 1:  # each copy holds the grads of the query heads it served
    dkv = dkv.astype(jnp.float32).reshape(2, b, t, kh, rep, h).sum(4)
  return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


# Ulysses x ring on local shards; ``plan`` is (ulysses plan, ring plan).
hybrid = shard_call.differentiable(_forward, _backward)


def hybrid_attention(query, key, value, *, axis_name: tuple[str, str],
                     is_causal=False, load_balance: LoadBalance | None = None,
                     segment_ids=None, query_seq_lengths=None,
                     key_value_seq_lengths=None, local_window_size=None,
                     scale=None, logits_soft_cap=None, implementation=None,
                     loop: Loop | None = None,
                     kv_sends: KvSends | None = None):
  """Exact attention over a sequence sharded over a ulysses and a ring axis.

  Call it inside ``shard_map`` with the sequence sharded ring-major,
  ``P(None, (ring_axis, ulysses_axis))``, on the local shards
  ``query (B, T, N, H)``, ``key``/``value (B, T, K, H)``, T = S / (R U)
  tokens each, where U and R are the sizes of the two axes; N must be
  divisible by U. See the module docstring for the layout and what moves
  where.

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
    loop: the ring's loop form, ``"scan"`` or ``"unrolled"``; default from
      ``NVTE_FUSED_RING_ATTENTION_USE_SCAN`` as in :func:`ring_attention`.
    kv_sends: the ring's K/V sends, as in :func:`ring_attention` (its size
      rule counts the ulysses group's K/V).

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  u_axis, r_axis = axis_pair(axis_name)
  u, r = validate.mesh_axis(u_axis), validate.mesh_axis(r_axis)
  tm, cfg = shard_call.prepare(
      query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      cp_size=u * r)
  validate.self_attention("hybrid", query.shape, key.shape)
  validate.ulysses_heads(query.shape[2], u_axis, u)
  # The ring sees the ulysses group's gathered T * U tokens.
  validate.ring_options(load_balance, loop, query.shape[1] * u, r,
                        kv_sends)
  plans = (ShardPlan(u_axis, u, None),
           ShardPlan(r_axis, r, load_balance, loop or loop_from_environment(),
                     kv_sends=kv_sends))
  return hybrid(query, key, value, tm, cfg, plans)
