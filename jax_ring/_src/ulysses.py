"""Ulysses (all-to-all) attention over one mesh axis, inside the user's shard_map.

Shapes: B batch, S global sequence length, T = S / cp local tokens, N query
heads, K kv heads (N % K == 0), H head dim; cp is the size of the mesh axis.
Per device the inputs are ``q (B, T, N, H)``, ``k, v (B, T, K, H)``.

One ``all_to_all`` per operand swaps sequence sharding for head sharding:
every device then holds the *whole* sequence for N / cp query heads and the
kv heads they read, runs one ordinary block-kernel call on it, and a second
``all_to_all`` swaps back. What device r holds (contiguous layout; under
``dual_chunk`` "before" is chunks r and 2cp-1-r of 2cp, see ``layout``):

====  ======  =========================  ====================================
cp    device  before: tokens, all heads  after: all S tokens, query heads
====  ======  =========================  ====================================
2     0       [0, S/2)                   [0, N/2)
2     1       [S/2, S)                   [N/2, N)
4     r       [r S/4, (r+1) S/4)         [r N/4, (r+1) N/4)
====  ======  =========================  ====================================

Gathered along the sequence, the chunks arrive in device order. Under
``dual_chunk`` that is the layout's chunk order [0, 2cp-1, 1, 2cp-2, ...],
so a static chunk permutation restores natural order before the kernel and
its inverse is applied after: causal and window masks then hold in plain
global positions (offset-0 ``BlockMask``), and padding lengths, which are
global positions, apply unchanged. Packed segment ids are (B, T) int32, tiny
next to the activations, so they are all-gathered and permuted the same way.

KV heads. The kernel needs each device's query heads and the kv heads they
read to arrive together. K and V are stacked into one ``(2, B, T, K, H)``
buffer and each kv head is repeated ``rep = lcm(K, cp) / K`` times before
the all-to-all, so that the K * rep heads split evenly over cp devices, each
device's N / cp query heads reading only its own K * rep / cp kv heads (N is
a multiple of lcm(K, cp) since it is one of K and of cp). So:

* ``cp | K`` (e.g. K = N): rep = 1, each device gets K / cp kv heads;
* ``K | cp`` (GQA with K < cp, MQA): rep = cp / K, each device gets one;
* otherwise (e.g. K = 6, cp = 4): rep = cp / gcd(K, cp).

The cost is a factor ``rep`` on the KV bytes of both all-to-alls (and on the
KV the kernel reads); the backward sums the ``rep`` copies of dK/dV, in
float32.

Communication, per device, per call, elements sent (each all-to-all sends
the (cp-1)/cp of its operand that belongs to other devices; K' = K * rep):

=========  ================================  ==========================
pass       all-to-alls (operands)            elements, x (cp-1)/cp
=========  ================================  ==========================
forward    q; (k, v); out; lse               B S H (2N + 2K') / cp
                                             + B S N / cp
backward   (q, out, dout); (k, v); lse;      B S H (4N + 4K') / cp
           dq; (dk, dv)                      + B S N / cp
=========  ================================  ==========================

plus 2 B S int32 ids (x (cp-1)/cp, one all-gather) with ``segment_ids``. A ring sends
about 2 B S K H per device in the forward however large cp is; Ulysses sends
about 2 B S (N + K') H / cp. So Ulysses moves less when kv heads are many
(K close to N: at MHA it is 2/cp of the ring's) and less still as cp grows;
with few kv heads (K << N) the ring moves less. The all-to-alls sit on the
critical path (the kernel needs all of its input), while the ring hides its
permutes behind block compute: Ulysses wants fast all-to-all links (NVLink
within a node). In exchange it runs one full-sequence kernel call per
device, the most efficient shape for the backend, and every device does the
same causal work whatever the layout. It needs cp <= N (cp | N).

Why the backward re-gathers instead of saving head-sharded residuals: the
forward returns the sequence-sharded ``(out, lse)``, the same residual that
every strategy's backward takes, so that strategies share one custom-VJP
and partitioning shape; keeping the head-sharded copies would save the
q, k, v, out, lse all-to-alls of the backward at the cost of holding them
(K' / K times the kv) alongside the inputs until the backward runs. When
forward and backward are compiled together, XLA may merge the backward's
(k, v) all-to-all with the forward's anyway (XLA:CPU does): same operands.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_ring._src import kernel, shard_call, validate
from jax_ring._src.config import AttentionConfig, ShardPlan
from jax_ring._src.layout import (LoadBalance, reorder_for_load_balance,
                                  reorder_from_load_balance)
from jax_ring._src.mask import BlockMask, TokenMask


# --- moving between sequence and head sharding -------------------------------

def kv_repeat(kv_heads: int, cp_size: int) -> int:
  """How many copies of each kv head the all-to-all sends (module doc)."""
  return math.lcm(kv_heads, cp_size) // kv_heads


def _to_heads(x, plan: ShardPlan, seq_axis: int):
  """Sequence-sharded, layout order -> whole sequence in natural order,
  heads (axis ``seq_axis + 1``) sharded."""
  x = lax.all_to_all(x, plan.axis_name, seq_axis + 1, seq_axis, tiled=True)
  if plan.load_balance:
    x = reorder_from_load_balance(x, plan.cp_size, seq_axis=seq_axis,
                                  layout=plan.load_balance)
  return x


def _to_tokens(x, plan: ShardPlan, seq_axis: int):
  """Inverse of :func:`_to_heads`."""
  if plan.load_balance:
    x = reorder_for_load_balance(x, plan.cp_size, seq_axis=seq_axis,
                                 layout=plan.load_balance)
  return lax.all_to_all(x, plan.axis_name, seq_axis, seq_axis + 1, tiled=True)


def _stacked_kv_to_heads(k, v, plan: ShardPlan):
  """(2, B, S, K * rep / cp, H): K/V, each head repeated, head-sharded."""
  kv = jnp.stack([k, v])
  rep = kv_repeat(k.shape[2], plan.cp_size)
  if rep > 1:
    kv = jnp.repeat(kv, rep, axis=3)
  return _to_heads(kv, plan, 2)


def _block_mask(tm: TokenMask, plan: ShardPlan) -> BlockMask:
  """The full-sequence, natural-order mask of the one kernel call."""
  q_ids = kv_ids = None
  if tm.q_segment_ids is not None:
    # Same ids gather once and stay one array (kv None) for the kernel.
    ids = (tm.q_segment_ids[None] if tm.same_ids else
           jnp.stack([tm.q_segment_ids, tm.kv_segment_ids]))
    ids = lax.all_gather(ids, plan.axis_name, axis=2, tiled=True)
    if plan.load_balance:
      ids = reorder_from_load_balance(ids, plan.cp_size, seq_axis=2,
                                      layout=plan.load_balance)
    q_ids, kv_ids = ids[0], (None if tm.same_ids else ids[1])
  return BlockMask(q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                   q_lengths=tm.q_lengths, kv_lengths=tm.kv_lengths)


# --- the strategy -------------------------------------------------------------

def _forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plan: ShardPlan):
  """Local shards in, ``(out (B, T, N, H), lse (B, T, N) f32)`` out, both in
  the shards' layout."""
  kv = _stacked_kv_to_heads(k, v, plan)
  out, lse = kernel.forward(_to_heads(q, plan, 1), kv[0], kv[1], None,
                            _block_mask(tm, plan), cfg)
  return _to_tokens(out, plan, 1), _to_tokens(lse, plan, 1)


def _backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plan: ShardPlan):
  """``(dq, dk, dv)`` on local shards from the global ``out``/``lse``."""
  # q, out and dout share shape and dtype: one all-to-all for the three.
  q_out_do = _to_heads(jnp.stack([q, out.astype(q.dtype),
                                  dout.astype(q.dtype)]), plan, 2)
  kv = _stacked_kv_to_heads(k, v, plan)
  dq, dk, dv, _ = kernel.attention_backward(
      q_out_do[0], kv[0], kv[1], None, _block_mask(tm, plan), q_out_do[1],
      _to_heads(lse, plan, 1), q_out_do[2], None, cfg)
  dq = _to_tokens(dq, plan, 1)
  dkv = _to_tokens(jnp.stack([dk, dv]), plan, 2)
  b, t, kh, h = k.shape
  rep = kv_repeat(kh, plan.cp_size)
  if rep > 1:  # each copy holds the grads of the query heads it served
    dkv = dkv.astype(jnp.float32).reshape(2, b, t, kh, rep, h).sum(4)
  return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


# Ulysses attention on local shards: (B, T, N, H) in q's dtype.
ulysses = shard_call.differentiable(_forward, _backward)


def ulysses_attention(query, key, value, *, axis_name: str, is_causal=False,
                      load_balance: LoadBalance | None = None,
                      segment_ids=None, query_seq_lengths=None,
                      key_value_seq_lengths=None, local_window_size=None,
                      scale=None, logits_soft_cap=None, implementation=None):
  """Exact attention over a sequence sharded along ``axis_name``, by all-to-all.

  Call it inside ``shard_map`` on the local shards: ``query (B, T, N, H)``,
  ``key``/``value (B, T, K, H)``, T = S / cp tokens each, where cp is the
  size of ``axis_name``; N must be divisible by cp. See the module docstring
  for what moves where, and when this beats :func:`ring_attention`.

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

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  cp = validate.mesh_axis(axis_name)
  tm, cfg = shard_call.prepare(
      query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      cp_size=cp)
  validate.ring_options(load_balance, None, query.shape[1], cp)
  validate.ulysses_heads(query.shape[2], axis_name, cp)
  return ulysses(query, key, value, tm, cfg, ShardPlan(axis_name, cp,
                                                         load_balance))
