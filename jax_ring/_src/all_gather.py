"""All-gather (Llama 3) attention over one mesh axis, inside the user's shard_map.

Shapes: B batch, S global sequence length, T = S / cp local tokens, N query
heads, K kv heads (N % K == 0), H head dim; cp is the size of the mesh axis;
C the length of a query chunk: C = T / 2 under ``dual_chunk``, C = T for
contiguous shards. Per device the inputs are ``q (B, T, N, H)``,
``k, v (B, T, K, H)``.

K and V are stacked into one ``(2, B, T, K, H)`` buffer and all-gathered
once along the sequence; queries stay where they are. The gathered chunks
arrive in device order, so under ``dual_chunk`` a static chunk permutation
(as in ``ulysses``) puts the whole KV in natural order. Each of the device's
query chunks then runs one block-kernel call against the kv rows it can see
(causal: every key up to the end of the chunk), with *global* offsets: the
query chunk of global id g starts at ``q_offset = g * C`` and the kv slice at
``kv_offset`` = its first row. What device r computes (causal, dual_chunk;
kv ranges in units of C = S / 2cp):

====  ======  ===========================  ==========================
cp    device  query chunk (global id)      kv rows seen, in chunks
====  ======  ===========================  ==========================
2     0       0; 3                         [0, 1); [0, 4)
2     1       1; 2                         [0, 2); [0, 3)
4     0       0; 7                         [0, 1); [0, 8)
4     1       1; 6                         [0, 2); [0, 7)
4     2       2; 5                         [0, 3); [0, 6)
4     3       3; 4                         [0, 4); [0, 5)
====  ======  ===========================  ==========================

Every device sees 2cp + 1 kv chunks in all (5 for cp = 2, 9 for cp = 4), so
the causal work is balanced; with contiguous shards device r's one chunk
sees ``[0, (r + 1) T)`` and the last device does the most. Without a causal
mask every chunk sees all S keys. With a window ``(left, right)`` (global
positions; right is 0 under a causal mask) chunk g sees only
``[max(0, gC - left), min(S, (g + 1)C + right))``: work outside the window is
never done. With packed documents (one ``segment_ids`` array for queries
and keys) under a plain causal mask, a chunk's call is two: against its own kv rows (causal, same ids and
positions) and against the rows before them (no position mask), merged by
logsumexp; cuDNN's ragged path serves both, and not a causal band between
different query and key ids.

Static masks for cuDNN. The device index ``r = axis_index`` is traced, but
cuDNN's band (causal diagonal, window) must be a compile-time constant. So
the calls sit in a ``lax.switch`` over r with one branch per device, and in
branch d the chunk ids, offsets and slice bounds are Python ints: every call
is a static ``BlockMask``. Padding lengths (global positions, as
``BlockMask`` wants them with global offsets) and segment ids are runtime
operands, which cuDNN takes. The program holds cp branches of up to 2 calls;
each device runs one. When the mask does not depend on position (no causal
mask, no window) there is no switch: one call of all T local queries against
all S keys, with offset 0 and the queries' padding length turned into a
local prefix length (the local chunks are in increasing global order, so
their valid tokens are a prefix). The two chunks of a ``dual_chunk`` device
are two calls that need no merge: each sees its whole kv range in one call.

Backward (custom VJP). Each call's backward takes the global ``out``/``lse``
rows of its query chunk and gives that chunk's dq and dK/dV over its kv
slice; the slices are added into one float32 ``(2, B, S, K, H)`` buffer, put
back in layout order, and ``psum_scatter`` (reduce-scatter) sums the cp
devices' contributions and leaves each device its own T rows. dK/dV go on
the wire in float32: each key's gradient is a sum over every device's
queries, and a reduce-scatter adds partial sums hop by hop in the wire
dtype, so 16-bit would round at every hop (the ring keeps its travelling
dK/dV in float32 for the same reason).

Re-gather or keep. The residuals are the local shards and the global
``out``/``lse``, as for every strategy, and the backward gathers K/V again
(as TransformerEngine does) rather than saving the gathered
``(2, B, S, K, H)``: that would hold cp times the local KV per layer from
the forward to the backward, the activation memory context parallelism
exists to cut; the price is a second all-gather of the same size. Whether
the second gather stays separate is XLA's call: compiled with the forward
and no rematerialisation, XLA:CPU merges the two (same operands), so the
gathered KV does live until the backward; under ``jax.checkpoint`` the
forward is recomputed in the backward and its gather and this one become
one there. (An optimization barrier tying K/V to ``dout`` would force the
re-gather without remat, but under remat it would add a third gather.)

Communication per device per call, elements (each collective sends the
(cp - 1) / cp of its operand that belongs to other devices):

=========  ========================================  ====================
pass       collectives                               elements, x (cp-1)/cp
=========  ========================================  ====================
forward    all-gather (k, v)                         2 B S K H
backward   all-gather (k, v); reduce-scatter         2 B S K H
           (dk, dv) in float32                       + 2 B S K H (f32)
=========  ========================================  ====================

plus B S int32 kv segment ids (one all-gather per pass) with
``segment_ids``. The ring sends the same volume, in cp - 1 permutes hidden
behind block compute; here the gather is one collective on the critical
path, hidden only behind other work (other layers, or the previous head
group below). It wins when that collective is cheap and the per-step
overhead of a ring is not: GQA/MQA with few kv heads (K << N, so 2 B S K H
is small next to the attention's compute), and short sequences or large cp,
where each ring step's block is too small to hide its permute and the cp
small kernel calls cost more than one or two large ones. The ring wins at long
sequences with many kv heads, where the full KV per device would not fit or
the gather could not be hidden.

Memory. Each device holds the full sequence's K/V, ``2 B S K H`` elements,
during the forward and again in the backward (plus the float32 dK/dV
accumulator of the same shape). ``kv_chunk_heads = g`` gathers one group of
g kv heads at a time, with the N g / K query heads that read them, and
concatenates the results over heads: each group's gather, compute and (in
the backward) reduce-scatter are independent of the others, so XLA may
overlap group i + 1's gather with group i's compute, and the full-sequence
buffers are g / K of the above. A Python loop leaves the schedule to XLA,
which may start several gathers early, so the peak falls with g but not
always in proportion; a scan would force the bound but serialise
communication and compute.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from jax_ring._src import kernel, shard_call, validate
from jax_ring._src.config import AttentionConfig, ShardPlan
from jax_ring._src.layout import (LoadBalance, reorder_for_load_balance,
                                  reorder_from_load_balance)
from jax_ring._src.mask import BlockMask, TokenMask
from jax_ring._src.ring_blocks import chunk_ids, merge, prefix


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


def _head_groups(num_heads: int, kv_heads: int, kv_chunk_heads):
  """(query-head slice, kv-head slice) per group; query head n reads kv
  head n // (N / K), so a group's query heads are contiguous too."""
  g = kv_chunk_heads or kv_heads
  per = num_heads // kv_heads
  return [(slice(i * per, (i + g) * per), slice(i, i + g))
          for i in range(0, kv_heads, g)]


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


def _position_dependent(cfg: AttentionConfig) -> bool:
  return cfg.is_causal or cfg.local_window is not None


def _device_calls(d: int, tm: TokenMask, kv_ids, cfg: AttentionConfig,
                  plan: ShardPlan, t: int) -> list[_Call]:
  """Device d's calls, all static: query chunk g of C tokens against the kv
  rows its causal mask and window leave visible (module doc)."""
  s = t * plan.cp_size
  chunks = chunk_ids(plan, d)
  c = t // len(chunks)
  left, right = cfg.local_window or (s, s)
  if cfg.is_causal:
    right = min(right, 0)
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
  if not _position_dependent(cfg):
    c = t // len(chunk_ids(plan, 0))
    q_len = prefix(tm.q_lengths, chunk_ids(plan, r), c)  # traced r is fine
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
      rows[key] = merge(*rows[key], *part) if key in rows else (
          part[0].astype(jnp.float32), part[1])
    return tuple(jnp.concatenate(x, 1) for x in zip(*rows.values()))

  return _on_device(calls_fwd, r, tm, kv_ids, cfg, plan, q.shape[1])


def _backward_group(q, kv, kv_ids, tm, out, lse, dout, cfg, plan, r):
  """(dq, dK/dV f32 over the whole gathered sequence (2, B, S, K, H))."""
  s = kv.shape[2]

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
      part = part.astype(jnp.float32)
      dkv = dkv + jnp.pad(part, [(0, 0), (0, 0), (c.cols.start,
                                                  s - c.cols.stop),
                                 (0, 0), (0, 0)])
    return jnp.concatenate(list(dqs.values()), 1).astype(q.dtype), dkv

  return _on_device(calls_bwd, r, tm, kv_ids, cfg, plan, q.shape[1])


def _gathered_ids(tm: TokenMask, plan: ShardPlan):
  if tm.q_segment_ids is None:
    return None
  return _gather(tm.kv_ids(), plan, 1)


def _forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plan: ShardPlan):
  """Local shards in, ``(out (B, T, N, H) in q's dtype, lse (B, T, N) f32)``
  out, both in the shards' layout."""
  r = lax.axis_index(plan.axis_name)
  kv_ids = _gathered_ids(tm, plan)
  outs, lses = [], []
  for qh, kh in _head_groups(q.shape[2], k.shape[2], plan.kv_chunk_heads):
    kv = _gather(jnp.stack([k[:, :, kh], v[:, :, kh]]), plan, 2)
    o, l = _forward_group(q[:, :, qh], kv, kv_ids, tm, cfg, plan, r)
    outs.append(o)
    lses.append(l)
  return jnp.concatenate(outs, 2).astype(q.dtype), jnp.concatenate(lses, 2)


def _backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plan: ShardPlan):
  """``(dq, dk, dv)`` on local shards from the global ``out``/``lse``."""
  r = lax.axis_index(plan.axis_name)
  kv_ids = _gathered_ids(tm, plan)
  dout = dout.astype(q.dtype)
  dqs, dks, dvs = [], [], []
  for qh, kh in _head_groups(q.shape[2], k.shape[2], plan.kv_chunk_heads):
    kv = _gather(jnp.stack([k[:, :, kh], v[:, :, kh]]), plan, 2)
    dq, dkv = _backward_group(q[:, :, qh], kv, kv_ids, tm, out[:, :, qh],
                              lse[:, :, qh], dout[:, :, qh], cfg, plan, r)
    dkv = _scatter_sum(dkv, plan, 2)  # (2, B, T, g, H) f32, own rows
    dqs.append(dq)
    dks.append(dkv[0])
    dvs.append(dkv[1])
  cat = lambda xs, dtype: jnp.concatenate(xs, 2).astype(dtype)
  return cat(dqs, q.dtype), cat(dks, k.dtype), cat(dvs, v.dtype)


# All-gather attention on local shards: (B, T, N, H) in q's dtype.
all_gather = shard_call.differentiable(_forward, _backward)


def all_gather_attention(query, key, value, *, axis_name: str,
                         is_causal=False,
                         load_balance: LoadBalance | None = None,
                         segment_ids=None, query_seq_lengths=None,
                         key_value_seq_lengths=None, local_window_size=None,
                         scale=None, logits_soft_cap=None,
                         implementation=None,
                         kv_chunk_heads: int | None = None):
  """Exact attention over a sequence sharded along ``axis_name``, by
  all-gathering K/V.

  Call it inside ``shard_map`` on the local shards: ``query (B, T, N, H)``,
  ``key``/``value (B, T, K, H)``, T = S / cp tokens each, where cp is the
  size of ``axis_name``. See the module docstring for what moves where, the
  memory it takes, and when this beats :func:`ring_attention`.

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
    kv_chunk_heads: gather and compute ``kv_chunk_heads`` kv heads at a time
      (with their query heads), bounding the full-sequence KV held per device
      to that many heads; must divide K. ``None``: all K at once.

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
  validate.self_attention("all_gather", query.shape, key.shape)
  validate.ring_options(load_balance, None, query.shape[1], cp)
  validate.strategy_layout("all_gather", load_balance)
  validate.kv_chunk_heads(kv_chunk_heads, key.shape[2])
  return all_gather(query, key, value, tm, cfg, ShardPlan(
      axis_name, cp, load_balance,
      kv_chunk_heads=None if kv_chunk_heads is None else int(kv_chunk_heads)))
