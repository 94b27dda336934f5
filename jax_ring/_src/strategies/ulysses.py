"""Ulysses (all-to-all) attention over one mesh axis, inside the user's
shard_map.

Shapes: per device ``q (B, T, N, H)``, ``k, v (B, T, K, H)``, T = S / cp
local tokens of S, where cp is the size of the mesh axis; needs N % cp == 0.
Keys may be another length than queries (``jax.nn``'s top-left causal
alignment), which no other strategy serves.

One ``all_to_all`` per operand swaps sequence sharding for head sharding:
every device then holds the *whole* sequence for N / cp query heads and the
kv heads they read, runs one ordinary block-kernel call on it with an
offset-0 ``BlockMask``, and a second ``all_to_all`` swaps back. Under a
load-balance layout a static permutation restores natural order after the
first all-to-all and is undone before the second, so causal and window
masks hold in plain global positions and padding lengths apply unchanged;
segment ids are all-gathered and permuted the same way. Every device does
the same work whatever the layout.

K and V travel stacked (a pair when their head dims differ:
``strategies.kv``), and each kv head is repeated ``rep = lcm(K, cp) /
K`` times first (:func:`kv_repeat`), so that each device's query heads
and the kv heads they read arrive together; the backward sums the ``rep``
copies of dK/dV in float32. The backward all-to-alls its inputs again from
the sequence-sharded residual that every strategy keeps.

What moves at each step, the communication volume against the ring's, and
why the backward does not keep head-sharded copies: docs/design.md,
"Ulysses".
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_ring._src.core import kernel, validate
from jax_ring._src.core.config import (AttentionConfig, ContextParallel,
                                       ShardPlan)
from jax_ring._src.core.mask import BlockMask, TokenMask
from jax_ring._src.strategies import base, kv as kv_lib
from jax_ring._src.strategies.layout import (LoadBalance,
                                             reorder_for_load_balance,
                                             reorder_from_load_balance)


# --- moving between sequence and head sharding -------------------------------

def kv_repeat(kv_heads: int, cp_size: int) -> int:
  """How many copies of each kv head the all-to-all sends: lcm(K, cp) / K,
  so that the K * rep heads split evenly over cp devices and each device's
  N / cp query heads read only its own K * rep / cp."""
  return math.lcm(kv_heads, cp_size) // kv_heads


def to_heads(x, plan: ShardPlan, seq_axis: int):
  """Sequence-sharded, layout order -> whole sequence in natural order,
  heads (axis ``seq_axis + 1``) sharded."""
  x = lax.all_to_all(x, plan.axis_name, seq_axis + 1, seq_axis, tiled=True)
  if plan.load_balance:
    x = reorder_from_load_balance(x, plan.cp_size, seq_axis=seq_axis,
                                  layout=plan.load_balance)
  return x


def to_tokens(x, plan: ShardPlan, seq_axis: int):
  """Inverse of :func:`to_heads`."""
  if plan.load_balance:
    x = reorder_for_load_balance(x, plan.cp_size, seq_axis=seq_axis,
                                 layout=plan.load_balance)
  return lax.all_to_all(x, plan.axis_name, seq_axis, seq_axis + 1, tiled=True)


def kv_to_heads(k, v, plan: ShardPlan):
  """K/V of ``(B, S, K * rep / cp, H|Hv)``, each head repeated,
  head-sharded, in the moving form (``kv_lib.pack``)."""
  rep = kv_repeat(k.shape[2], plan.cp_size)
  move = lambda x, ax: to_heads(
      jnp.repeat(x, rep, axis=ax + 1) if rep > 1 else x, plan, ax)
  return kv_lib.along(move, kv_lib.pack(k, v), 1)


def kv_grads_to_tokens(dk, dv, k, v, plan: ShardPlan):
  """Inverse of :func:`kv_to_heads` for the gradients: ``(dk, dv)`` in
  ``k``'s and ``v``'s shapes and dtypes, each head's ``rep`` copies summed
  in float32 (each copy holds the grads of the query heads it served)."""
  kh = k.shape[2]
  rep = kv_repeat(kh, plan.cp_size)

  def move(x, ax):
    x = to_tokens(x, plan, ax)
    if rep > 1:
      x = x.astype(jnp.float32).reshape(
          x.shape[:ax + 1] + (kh, rep) + x.shape[-1:]).sum(ax + 2)
    return x

  dkv = kv_lib.along(move, kv_lib.pack(dk, dv), 1)
  return dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


def _block_mask(tm: TokenMask, plan: ShardPlan) -> BlockMask:
  """The full-sequence, natural-order mask of the one kernel call."""
  q_ids = kv_ids = None

  def gather(ids):  # (I, B, L) local -> (I, B, L * cp), natural order
    ids = lax.all_gather(ids, plan.axis_name, axis=2, tiled=True)
    if plan.load_balance:
      ids = reorder_from_load_balance(ids, plan.cp_size, seq_axis=2,
                                      layout=plan.load_balance)
    return ids

  if tm.q_segment_ids is not None:
    # Same ids gather once and stay one array (kv None) for the kernel;
    # two of one length gather as one stack.
    if tm.same_ids:
      q_ids = gather(tm.q_segment_ids[None])[0]
    elif tm.q_segment_ids.shape == tm.kv_segment_ids.shape:
      q_ids, kv_ids = gather(jnp.stack([tm.q_segment_ids,
                                        tm.kv_segment_ids]))
    else:  # T != S
      q_ids = gather(tm.q_segment_ids[None])[0]
      kv_ids = gather(tm.kv_segment_ids[None])[0]
  return BlockMask(q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                   q_lengths=tm.q_lengths, kv_lengths=tm.kv_lengths)


# --- the strategy -------------------------------------------------------------

def forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plan: ShardPlan):
  """Local shards in, ``(out (B, T, N, H), lse (B, T, N) f32)`` out, both in
  the shards' layout."""
  kv = kv_to_heads(k, v, plan)
  out, lse = kernel.forward(to_heads(q, plan, 1), kv[0], kv[1], None,
                            _block_mask(tm, plan), cfg)
  return to_tokens(out, plan, 1), to_tokens(lse, plan, 1)


def backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plan: ShardPlan):
  """``(dq, dk, dv)`` on local shards from the global ``out``/``lse``."""
  q_h, out_h, dout_h = q_out_dout_to_heads(q, out, dout, plan)
  kv = kv_to_heads(k, v, plan)
  dq, dk, dv, _ = kernel.backward(
      q_h, kv[0], kv[1], None, _block_mask(tm, plan), out_h,
      to_heads(lse, plan, 1), dout_h, None, cfg)
  dq = to_tokens(dq, plan, 1)
  return (dq.astype(q.dtype),) + kv_grads_to_tokens(dk, dv, k, v, plan)


def q_out_dout_to_heads(q, out, dout, plan: ShardPlan):
  """``q``, ``out`` and ``dout`` head-sharded, in q's dtype: one all-to-all
  for the three where they share a shape (head dims alike), else three."""
  out, dout = out.astype(q.dtype), dout.astype(q.dtype)
  if q.shape != out.shape:
    return tuple(to_heads(x, plan, 1) for x in (q, out, dout))
  stacked = to_heads(jnp.stack([q, out, dout]), plan, 2)
  return stacked[0], stacked[1], stacked[2]


def plan(cpc: ContextParallel, sizes, backward_kv) -> ShardPlan:
  """Ulysses' plan on ``cpc.ulysses_axis`` (``backward_kv`` is the ring's)."""
  del backward_kv
  return ShardPlan(cpc.ulysses_axis, sizes[cpc.ulysses_axis],
                   cpc.load_balance)


def check(cpc: ContextParallel, sizes, q_shape, k_shape) -> None:
  """Local shards ``q_shape``, ``k_shape`` that Ulysses serves (any T, S)."""
  del k_shape
  cp = sizes[cpc.ulysses_axis]
  validate.ring_options(cpc.load_balance, None, q_shape[1], cp)
  validate.ulysses_heads(q_shape[2], cpc.ulysses_axis, cp)


STRATEGY = base.Strategy("ulysses", forward, backward, plan, check)


def ulysses_attention(query, key, value, *, axis_name: str, is_causal=False,
                      load_balance: LoadBalance | None = None,
                      segment_ids=None, query_seq_lengths=None,
                      key_value_seq_lengths=None, local_window_size=None,
                      scale=None, logits_soft_cap=None, implementation=None,
                      sinks=None, padding_segment_id=None):
  """Exact attention over a sequence sharded along ``axis_name``, by all-to-all.

  Call it inside ``shard_map`` on the local shards: ``query (B, T, N, H)``,
  ``key``/``value (B, T, K, H)``, T = S / cp tokens each, where cp is the
  size of ``axis_name``; N must be divisible by cp. What moves where, and
  when this beats :func:`ring_attention`: docs/design.md, "Ulysses".

  Args:
    axis_name: the mesh axis the sequence is sharded over.
    is_causal: causal mask in global positions.
    load_balance: ``None`` (contiguous shards) or ``"dual_chunk"`` (the
      sequence was put in that layout with
      :func:`jax_ring.reorder_for_load_balance`). Ulysses does the same work
      on every device either way; this only says where the tokens are.
    segment_ids: packed documents, this device's ``(B, T)`` ids (or a
      ``(q_ids, kv_ids)`` pair) in the shards' layout. Documents may cross
      shard boundaries.
    query_seq_lengths: ``(B,)`` int, the same on every device: queries at
      global (natural-order) position ``>=`` it output 0.
    key_value_seq_lengths: ``(B,)`` int: keys at global position ``>=`` it
      are ignored.
    local_window_size: ``w`` or ``(left, right)`` in global positions, as in
      ``jax.nn.dot_product_attention``.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    logits_soft_cap: Gemma-2 soft cap, as in ``dot_product_attention``.
    implementation: block backend, as in ``dot_product_attention``.
    sinks: ``(N,)`` float, one logit per local query head that joins
      every row's softmax with no value, as in ``dot_product_attention``.
    padding_segment_id: an id of ``segment_ids`` that marks padding
      (TransformerEngine's and MaxText's 0, say): its rows output 0 with
      zero gradient, and no token sees its keys. Default None: every id,
      0 included, is a document.

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  validate.one_axis_name("ulysses_attention", axis_name)
  cpc = ContextParallel(axis=axis_name, strategy="ulysses",
                        load_balance=load_balance)
  return base.run(
      STRATEGY, cpc, query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      sinks=sinks, padding_segment_id=padding_segment_id)
