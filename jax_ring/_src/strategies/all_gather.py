"""All-gather attention over one mesh axis (the approach of Llama 3's
context parallelism), inside the user's shard_map.

Shapes: per device ``q (B, T, N, H)``, ``k, v (B, T, K, H)``, T = S / cp
local tokens of S; C the length of a query chunk: T / 2 under
``dual_chunk``, T for contiguous shards. The striped layout is refused
(each call reads a contiguous key range).

Forward: K and V, stacked ``(2, B, T, K, H)`` (or as a pair when their
head dims differ: ``strategies.kv``), are all-gathered once along the
sequence and put in natural order; the queries stay. Each of the
device's query chunks runs one block-kernel call against the key rows its
causal mask and window leave visible, with global offsets (query chunk g
starts at ``q_offset = g C``), so every device sees 2cp + 1 chunks under
``dual_chunk``. The device index is traced but cuDNN's band must be
static, so the calls sit in a ``lax.switch`` over the device, one branch
each, with Python-int offsets and slices; without a mask of position there
is one call of all T queries against all S keys. Packed documents under a
plain causal mask take two calls per chunk, merged by logsumexp.

Backward: K/V are gathered again (not kept from the forward); each call's
backward from the global ``out``/``lse`` adds its dK/dV into one float32
``(2, B, S, K, H)`` buffer, which a ``psum_scatter`` in float32 sums over
devices, leaving each its own T rows. ``kv_chunk_heads = g`` runs all of it
g kv heads at a time, so one group's gathered K/V is live at once.

Tables (the calls per device, what moves, communication volume), memory
and when it beats the ring: docs/design.md, "All-gather".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._src.core import kernel, validate
from jax_ring._src.core.config import (AttentionConfig, ContextParallel,
                                       ShardPlan)
from jax_ring._src.core.mask import BlockMask, TokenMask
from jax_ring._src.strategies import base, kv as kv_lib, layout
from jax_ring._src.strategies.layout import (LoadBalance,
                                             reorder_for_load_balance,
                                             reorder_from_load_balance)


# --- moving the whole sequence ------------------------------------------------

def _gather(x, plan: ShardPlan, seq_axis: int):
  """Local shards in layout order -> the whole sequence in natural order."""
  x = lax.all_gather(x, plan.axis_name, axis=seq_axis, tiled=True)
  if plan.load_balance == "dual_chunk":
    x = reorder_from_load_balance(x, plan.cp_size, seq_axis=seq_axis)
  return x


def _scatter_sum(x, plan: ShardPlan, seq_axis: int):
  """Transpose of :func:`_gather`: sum over devices, keep own shard."""
  if plan.load_balance == "dual_chunk":
    x = reorder_for_load_balance(x, plan.cp_size, seq_axis=seq_axis)
  return lax.psum_scatter(x, plan.axis_name, scatter_dimension=seq_axis,
                          tiled=True)


def _gather_kv(k, v, plan: ShardPlan):
  """Local K/V -> the whole sequence's, natural order, in the moving form."""
  return kv_lib.along(lambda x, ax: _gather(x, plan, ax),
                      kv_lib.pack(k, v), 1)


def _by_head_group(fn, plan: ShardPlan, q_parts, k, v):
  """``fn(kv, *q_parts)`` where ``kv`` is the whole sequence's K/V
  (:func:`_gather_kv`), once over all K kv heads, or, with
  ``kv_chunk_heads = g``, for each of the K / g groups of g kv heads with
  the N g / K query heads that read them (query head n reads kv head
  n // (N / K), so a group's query heads are contiguous), as a
  ``lax.map``: one group's gathered K/V live at a time, and the program
  holds one group's calls. ``q_parts`` are split along axis 2 (heads); the
  results, each with heads on axis 2, are put back in head order."""
  groups = k.shape[2] // (plan.kv_chunk_heads or k.shape[2])
  if groups == 1:
    return fn(_gather_kv(k, v, plan), *q_parts)
  split = lambda x: jnp.moveaxis(
      x.reshape(x.shape[:2] + (groups, -1) + x.shape[3:]), 2, 0)
  join = lambda x: jnp.moveaxis(x, 0, 2).reshape(
      x.shape[1:3] + (-1,) + x.shape[4:])
  out = lax.map(lambda a: fn(_gather_kv(a[0], a[1], plan), *a[2:]),
                tuple(split(x) for x in (k, v, *q_parts)))
  return jax.tree.map(join, out)


# --- which calls a device makes -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Call:
  """One kernel call: local query ``rows`` against natural-order kv
  ``cols`` (static bounds) under ``mask``; ``causal=False`` where every key
  of ``cols`` precedes every query (no mask of position is left)."""

  rows: slice
  cols: slice
  mask: BlockMask
  causal: bool = True

  def config(self, cfg: AttentionConfig) -> AttentionConfig:
    return cfg if self.causal else cfg.replace(is_causal=False)


def _cut(x, sl):
  return None if x is None else x[:, sl]


def _device_calls(d: int, tm: TokenMask, kv_ids, cfg: AttentionConfig,
                  plan: ShardPlan, t: int) -> list[_Call]:
  """Device d's calls, all static: query chunk g of C tokens against the kv
  rows its causal mask and window leave visible (module doc)."""
  s = t * plan.cp_size
  chunks = layout.chunk_ids(plan, d)
  c = t // len(chunks)
  left, right = (s if x is None else x for x in cfg.band)
  # Packed documents under a plain causal mask: the chunk's own kv rows
  # (same ids, same positions) and the rows before them (no position mask)
  # are two calls, each of which cuDNN's ragged path serves; one call of a
  # query chunk against its kv prefix mixes a causal band with other ids,
  # which it does not.
  split = (tm.q_segment_ids is not None and tm.same_ids and cfg.is_causal
           and cfg.local_window is None)
  calls = []
  for a, g in enumerate(chunks):
    rows = slice(a * c, (a + 1) * c)
    cols = slice(max(0, g * c - left), min(s, (g + 1) * c + right))
    lengths = dict(q_lengths=tm.q_lengths, kv_lengths=tm.kv_lengths)
    q_ids = _cut(tm.q_segment_ids, rows)
    if split:
      calls.append(_Call(rows, slice(g * c, (g + 1) * c), BlockMask(
          q_offset=g * c, kv_offset=g * c, q_segment_ids=q_ids, **lengths)))
      if g:
        before = slice(0, g * c)
        calls.append(_Call(rows, before, BlockMask(
            q_offset=g * c, kv_offset=0, q_segment_ids=q_ids,
            kv_segment_ids=_cut(kv_ids, before), **lengths), causal=False))
      continue
    calls.append(_Call(rows, cols, BlockMask(
        q_offset=g * c, kv_offset=cols.start, q_segment_ids=q_ids,
        kv_segment_ids=_cut(kv_ids, cols), **lengths)))
  return calls


def _on_device(fn, r, tm: TokenMask, kv_ids, cfg: AttentionConfig,
               plan: ShardPlan, t: int):
  """``fn(calls)`` for device r's calls: a ``lax.switch`` on r, so that each
  branch's masks are static, unless the mask ignores position."""
  if not cfg.positional:
    c = t // len(layout.chunk_ids(plan, 0))
    # A traced device index r is fine here: no static band.
    q_len = layout.prefix(tm.q_lengths, layout.chunk_ids(plan, r), c)
    return fn([_Call(slice(0, t), slice(0, t * plan.cp_size), BlockMask(
        q_segment_ids=tm.q_segment_ids, kv_segment_ids=kv_ids,
        q_lengths=q_len, kv_lengths=tm.kv_lengths))])
  def branch(d):
    return fn(_device_calls(d, tm, kv_ids, cfg, plan, t))

  return lax.switch(r, [functools.partial(branch, d)
                        for d in range(plan.cp_size)])


# --- the strategy -------------------------------------------------------------

def _forward_group(q, kv, kv_ids, tm, cfg, plan, r):
  """(out, lse) of local ``q`` against the gathered natural-order ``kv``."""

  def calls_fwd(calls):
    rows = {}  # query rows -> (out, lse), merged over that chunk's calls
    for c in calls:
      part = kernel.forward(q[:, c.rows], kv[0][:, c.cols],
                            kv[1][:, c.cols], None, c.mask, c.config(cfg))
      key = (c.rows.start, c.rows.stop)
      rows[key] = base.merge(*rows[key], *part) if key in rows else (
          part[0].astype(jnp.float32), part[1])
    return tuple(jnp.concatenate(x, 1) for x in zip(*rows.values()))

  return _on_device(calls_fwd, r, tm, kv_ids, cfg, plan, q.shape[1])


def _backward_group(q, kv, kv_ids, tm, out, lse, dout, cfg, plan, r):
  """(dq, dK/dV f32 over the whole gathered sequence, in ``kv``'s form)."""
  s = kv[0].shape[1]

  def calls_bwd(calls):
    dqs, dkv = {}, 0.0  # query rows -> dq, summed over that chunk's calls
    for c in calls:
      dq, part, _ = kernel.attention_backward_dkv(
          q[:, c.rows], kv[0][:, c.cols], kv[1][:, c.cols], None, c.mask,
          out[:, c.rows], lse[:, c.rows], dout[:, c.rows], None,
          c.config(cfg))
      key = (c.rows.start, c.rows.stop)
      dq = dq.astype(jnp.float32)
      dqs[key] = dqs[key] + dq if key in dqs else dq
      dkv = kv_lib.add(dkv, kv_lib.along(lambda x, ax: jnp.pad(x, [
          (c.cols.start, s - c.cols.stop) if i == ax else (0, 0)
          for i in range(x.ndim)]), part, 1))
    return jnp.concatenate(list(dqs.values()), 1).astype(q.dtype), dkv

  return _on_device(calls_bwd, r, tm, kv_ids, cfg, plan, q.shape[1])


def _gathered_ids(tm: TokenMask, plan: ShardPlan):
  if tm.q_segment_ids is None:
    return None
  return _gather(tm.kv_ids(), plan, 1)


def forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plan: ShardPlan):
  """Local shards in, ``(out (B, T, N, H) in q's dtype, lse (B, T, N) f32)``
  out, both in the shards' layout."""
  r = lax.axis_index(plan.axis_name)
  kv_ids = _gathered_ids(tm, plan)
  out, lse = _by_head_group(
      lambda kv, q: _forward_group(q, kv, kv_ids, tm, cfg, plan, r),
      plan, (q,), k, v)
  return out.astype(q.dtype), lse


def backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plan: ShardPlan):
  """``(dq, dk, dv)`` on local shards from the global ``out``/``lse``."""
  r = lax.axis_index(plan.axis_name)
  kv_ids = _gathered_ids(tm, plan)

  def group(kv, q, out, lse, dout):
    dq, dkv = _backward_group(q, kv, kv_ids, tm, out, lse, dout, cfg, plan,
                              r)
    # f32, own rows
    dkv = kv_lib.along(lambda x, ax: _scatter_sum(x, plan, ax), dkv, 1)
    return dq, dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)

  return _by_head_group(group, plan, (q, out, lse, dout.astype(q.dtype)),
                        k, v)


# The strategy's record: its plan and its checks.
def plan(cpc: ContextParallel, sizes, backward_kv) -> ShardPlan:
  """The all-gather's plan on ``cpc.axis``."""
  del backward_kv
  chunk = cpc.kv_chunk_heads
  return ShardPlan(cpc.axis, sizes[cpc.axis], cpc.load_balance,
                   kv_chunk_heads=None if chunk is None else int(chunk))


def check(cpc: ContextParallel, sizes, q_shape, k_shape) -> None:
  """Local shards ``q_shape``, ``k_shape`` that the all-gather serves."""
  validate.self_attention("all_gather", q_shape, k_shape)
  validate.ring_options(cpc.load_balance, None, q_shape[1], sizes[cpc.axis])
  validate.strategy_layout("all_gather", cpc.load_balance)
  validate.kv_chunk_heads(cpc.kv_chunk_heads, k_shape[2])


STRATEGY = base.Strategy("all_gather", forward, backward, plan, check)


def all_gather_attention(query, key, value, *, axis_name: str,
                         is_causal=False,
                         load_balance: LoadBalance | None = None,
                         segment_ids=None, query_seq_lengths=None,
                         key_value_seq_lengths=None, local_window_size=None,
                         scale=None, logits_soft_cap=None,
                         implementation=None, sinks=None,
                         padding_segment_id=None,
                         kv_chunk_heads: int | None = None):
  """Exact attention over a sequence sharded along ``axis_name``, by
  all-gathering K/V.

  Call it inside ``shard_map`` on the local shards: ``query (B, T, N, H)``,
  ``key``/``value (B, T, K, H)``, T = S / cp tokens each, where cp is the
  size of ``axis_name``. What moves where, the memory it takes, and when
  this beats :func:`ring_attention`: docs/design.md, "All-gather".

  Args:
    axis_name: the mesh axis the sequence is sharded over.
    is_causal: causal mask in global positions.
    load_balance: ``None`` (contiguous shards) or ``"dual_chunk"`` (the
      sequence was put in that layout with
      :func:`jax_ring.reorder_for_load_balance`), which balances the causal
      work over devices.
    segment_ids: packed documents, this device's ``(B, T)`` ids (or a
      ``(q_ids, kv_ids)`` pair) in the shards' layout; the kv ids are
      gathered with K/V. Documents may cross shard boundaries.
    query_seq_lengths: ``(B,)`` int, the same on every device: queries at
      global (natural-order) position ``>=`` it output 0.
    key_value_seq_lengths: ``(B,)`` int: keys at global position ``>=`` it
      are ignored.
    local_window_size: ``w`` or ``(left, right)`` in global positions; each
      query chunk's call reads only the kv rows its window reaches.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    logits_soft_cap: Gemma-2 soft cap, as in ``dot_product_attention``.
    implementation: block backend, as in ``dot_product_attention``.
    sinks: ``(N,)`` float, one logit per local query head that joins
      every row's softmax with no value, as in ``dot_product_attention``.
    padding_segment_id: an id of ``segment_ids`` that marks padding
      (TransformerEngine's and MaxText's 0, say): its rows output 0 with
      zero gradient, and no token sees its keys. Default None: every id,
      0 included, is a document.
    kv_chunk_heads: gather and compute ``kv_chunk_heads`` kv heads at a time
      (with their query heads), bounding the full-sequence KV held per device
      to that many heads; must divide K. ``None``: all K at once.

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  validate.one_axis_name("all_gather_attention", axis_name)
  validate.kv_chunk_heads(kv_chunk_heads, jnp.shape(key)[-2])
  cpc = ContextParallel(axis=axis_name, strategy="all_gather",
                        load_balance=load_balance,
                        kv_chunk_heads=kv_chunk_heads)
  return base.run(
      STRATEGY, cpc, query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      sinks=sinks, padding_segment_id=padding_segment_id)
