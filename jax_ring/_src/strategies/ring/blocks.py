"""The ring's blocks: which query rows meet which held K/V rows at a step,
and under which static mask. The schedule that calls them is in
:mod:`jax_ring._src.strategies.ring.schedule`; partial results merge with
``base.merge``.

Shapes, per device: ``q (B, T, N, H)``, ``out (B, T, N, Hv)``; the held
``kv`` is what travels the ring: (K/V in their moving form, stacked ``(2, B,
T, K, H)`` or the ``(k, v)`` pair when the head dims differ (``strategies.kv``),
and the kv segment ids ``(B, T)`` or None; see :func:`held_kv`). dK/dV come
in the same form: in the kernel's dtype from one call per step
(``kind_bwd``), float32 from window pairs, which add several calls. C = T / 2
under the dual-chunk layout.

With a sliding window (contiguous and dual_chunk) the schedule works per
(query chunk, kv chunk) pair: the pair's distance in chunks, ``k = q_chunk -
kv_chunk``, is traced, but only a few values of k can touch the window, so a
``lax.switch`` over them gives each branch a *static* band (offset ``k * C``,
the window) and sends every other distance to a skip branch: work outside
the window is never done, and the cuDNN band stays a compile-time constant.

The striped layout's blocks are in :mod:`jax_ring._src.strategies.ring.striped`;
the step kinds, in tables: docs/design.md, "Ring".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._src.core import kernel, vma
from jax_ring._src.core.config import AttentionConfig, ShardPlan
from jax_ring._src.core.mask import MASK_VALUE, BlockMask, TokenMask
from jax_ring._src.strategies import base, kv as kv_lib, layout


def held_kv(k, v, tm: TokenMask):
  """What travels the ring: (K/V in their moving form, ``kv_lib.pack``, the
  kv segment ids or None); K and V index as ``kv[0][0]``, ``kv[0][1]``."""
  return kv_lib.pack(k, v), tm.kv_ids()


def dkv_zeros(kv, rows=None, dtype=jnp.float32):
  """Zeros shaped like the dK/dV of the held kv (``rows`` of its T)."""
  return kv_lib.zeros(kv[0], rows, dtype)



# --- what one block works on ------------------------------------------------
#
# ``kv`` is what travels the ring: (K/V, the kv segment ids (B, T) or None),
# see held_kv. A block is a set of query chunks of this
# device against a set of kv chunks of the source device.

@dataclasses.dataclass(frozen=True)
class _Block:
  """The query rows, k/v rows and BlockMask of one block call; ``rows`` and
  ``cols`` are the slices of the local q and of the held kv it covers."""

  q_rows: jax.Array
  kv_rows: tuple[jax.Array, jax.Array]
  mask: BlockMask
  rows: slice
  cols: slice


def _cut(x, sl):
  return x if x is None or sl == slice(None) else x[:, sl]


def _block(q, tm: TokenMask, kv, qc, kc, rows, cols, c, q_offset=0,
           own=False, ready=None):
  """A block of query chunks ``qc`` (local rows ``rows``) against kv chunks
  ``kc`` (held rows ``cols``). Offsets are static: 0, or ``q_offset`` for a
  window pair; lengths become local prefixes shifted by the same offset.
  ``own``: the held KV is this device's, and the ids are the same.
  ``ready``: the mask's ``prepared`` (:func:`prepare_own`)."""
  (k, v), kv_seg = (kv[0][0], kv[0][1]), kv[1]
  q_len = layout.prefix(tm.q_lengths, qc, c)
  q_seg = _cut(tm.q_segment_ids, rows)
  # One array for both sides tells a backend the ids are the same tokens'.
  same = q_seg is not None and own and rows == cols
  mask = BlockMask(
      q_offset=q_offset,
      q_segment_ids=q_seg,
      kv_segment_ids=q_seg if same else _cut(kv_seg, cols),
      q_lengths=None if q_len is None else q_len + q_offset,
      kv_lengths=layout.prefix(tm.kv_lengths, kc, c), prepared=ready)
  return _Block(q[:, rows], (k[:, cols], v[:, cols]), mask, rows, cols)


def _kind_block(kind, q, tm, kv, qc, kc, own=False, ready=None):
  """The block of a no-window step kind (diag, full, half_kv, half_q)."""
  c = q.shape[1] // len(qc)
  rows = cols = slice(None)
  if kind == "half_q":
    rows, qc = slice(c, None), qc[1:]
  if kind == "half_kv":
    cols, kc = slice(0, c), kc[:1]
  return _block(q, tm, kv, qc, kc, rows, cols, c, own=own, ready=ready)


def prepare_own(kind, q, tm, kv, qc, cfgs, lse=None):
  """What the backend of the own block computes ahead of it
  (``kernel.prepare``; with ``lse (B, T, N)``, the backward's), for
  ``kind_fwd``'s and ``kind_bwd``'s ``ready``: a caller that branches
  before the block computes it before the branch. The own block: ``kind``
  "diag" or "full", the held ``kv`` this device's, its mask built as
  those calls build it with ``own=tm.same_ids``. None where the backend
  has nothing."""
  blk = _kind_block(kind, q, tm, kv, qc, qc, own=tm.same_ids)
  return kernel.prepare(blk.q_rows, *blk.kv_rows, blk.mask,
                        cfgs[kind == "diag"], lse)


def _window_pairs(plan: ShardPlan, cfg: AttentionConfig, c: int):
  """(k_min, k_max): the chunk distances q_chunk - kv_chunk whose c x c
  pair can hold a visible (query, key) under the window (and causality)."""
  left, right = cfg.band  # a window: both sides bounded
  k_max = min((left + c - 1) // c, 2 * plan.cp_size)
  k_min = max(-((right + c - 1) // c), -2 * plan.cp_size)
  return k_min, k_max


# --- forward and backward of one block, zero-filled to the full local q ----

def masked(b, rows, n, h, like, dtype=jnp.float32):
  """(out, lse) of ``rows`` query rows that see no key: zeros (``dtype``,
  head dim ``h``: the value's) and MASK_VALUE, varying like the arrays
  ``like``."""
  return vma.like((jnp.zeros((b, rows, n, h), dtype),
                   jnp.full((b, rows, n), MASK_VALUE, jnp.float32)), *like)


def _fwd(blk: _Block, cfg, dtype=None):
  """(out, lse f32) of a block, over the local q rows ``blk.rows`` of t;
  out in ``dtype``, or the kernel's (q's) if None."""
  o, l = kernel.forward(blk.q_rows, *blk.kv_rows, None, blk.mask, cfg)
  return o.astype(dtype or o.dtype), l


def _bwd(blk: _Block, out, lse, dout, cfg, dtype=None, pair=False):
  """(dq of the block rows, dK/dV of the block cols in the moving form, or
  with ``pair`` as the pair ``(dk, dv)``), in ``dtype``, or the kernel's
  (q's, k's) if None."""
  rows = blk.rows
  args = (blk.q_rows, *blk.kv_rows, None, blk.mask, out[:, rows],
          lse[:, rows], dout[:, rows], None, cfg)
  if pair:
    dq, dk, dv, _ = kernel.backward(*args)
    dkv = (dk, dv)
  else:
    dq, dkv, _ = kernel.attention_backward_dkv(*args)
  return dq.astype(dtype or dq.dtype), jax.tree.map(
      lambda x: x.astype(dtype or x.dtype), dkv)


def _place(x, sl, size, axis):
  """Zero-pad ``x`` so that it fills slice ``sl`` of ``size`` along axis."""
  if sl == slice(None):
    return x
  start = sl.start or 0
  pad = [(0, 0)] * x.ndim
  pad[axis] = (start, size - start - x.shape[axis])
  return jnp.pad(x, pad)


# A step's kind_fwd/kind_bwd runs inside a lax.cond (schedule.step_call),
# so its results stay in the kernel's 16-bit dtype: each conversion to
# float32 is left to the merge or the sum after the cond, where XLA fuses
# it. Cast inside a branch, it would be a pass of its own over the block at
# every step (measured: docs/decisions.md, "Wire dtypes").

def kind_fwd(kind, q, tm, kv, qc, kc, cfgs, own=False, ready=None):
  """(out in q's dtype, lse f32) of one step, over all t local rows;
  ``ready``: the own block's :func:`prepare_own`, or None."""
  b, t, n, h = q.shape[:3] + kv[0][1].shape[3:]
  if kind == "skip":
    return masked(b, t, n, h, (q, kv[0][0]), q.dtype)
  blk = _kind_block(kind, q, tm, kv, qc, kc, own, ready)
  o, l = _fwd(blk, cfgs[kind == "diag"])
  if blk.rows != slice(None):  # half_q: the first chunk saw nothing
    zo, zl = masked(b, t - o.shape[1], n, h, (q, kv[0][0]), o.dtype)
    o, l = jnp.concatenate([zo, o], 1), jnp.concatenate([zl, l], 1)
  return o, l


def kind_bwd(kind, q, tm, kv, qc, kc, out, lse, dout, cfgs, own=False,
             pair=False, ready=None):
  """(dq, dK/dV of the held kv) of one step, in the kernel's dtypes (q's,
  k's); dK/dV in the moving form, or with ``pair`` as ``(dk, dv)`` (a step
  whose dK/dV stay on this device: no stacking). ``ready``: the own
  block's :func:`prepare_own` given ``lse``, or None."""
  t = q.shape[1]
  if kind == "skip":
    return vma.like((jnp.zeros_like(q), dkv_zeros(kv, dtype=kv[0][0].dtype)),
                    q, kv[0][0], out, dout)
  blk = _kind_block(kind, q, tm, kv, qc, kc, own, ready)
  dq, dkv = _bwd(blk, out, lse, dout, cfgs[kind == "diag"], pair=pair)
  return _place(dq, blk.rows, t, 1), kv_lib.along(
      lambda x, ax: _place(x, blk.cols, t, ax), dkv, 1)


# --- step 1 on the rows documents cross (contiguous shards) ----------------

def _tail_block(q, tm: TokenMask, kv, qc, kc, size: int):
  """This device's first ``size`` query rows against the held ``kv``: the
  last ``size`` rows of shard ``kc``, cut before they were sent (their
  lengths shift by the rows left out)."""
  t = q.shape[1]
  (k, v), kv_seg = (kv[0][0], kv[0][1]), kv[1]
  q_len = layout.prefix(tm.q_lengths, qc, t)
  kv_len = layout.prefix(tm.kv_lengths, kc, t)
  mask = BlockMask(
      q_segment_ids=_cut(tm.q_segment_ids, slice(0, size)),
      kv_segment_ids=kv_seg,
      q_lengths=None if q_len is None else jnp.minimum(q_len, size),
      kv_lengths=None if kv_len is None else jnp.clip(kv_len - (t - size),
                                                      0, size))
  return _Block(q[:, :size], (k, v), mask, slice(0, size), slice(None))


def tail_fwd(q, tm, kv, qc, kc, meets, size, cfg):
  """(out, lse) of the first ``size`` query rows against the held tail;
  rows that may not meet it (``meets`` False: causal, a later shard) are
  masked, whatever its values."""
  o, l = _fwd(_tail_block(q, tm, kv, qc, kc, size), cfg)
  return jnp.where(meets, o, 0), jnp.where(meets, l, MASK_VALUE)


def tail_bwd(q, tm, kv, qc, kc, meets, size, out, lse, dout, cfg):
  """(dq of the first ``size`` rows, dK/dV of the held tail), zero where
  ``meets`` is False; in the kernel's dtypes."""
  dq, dkv = _bwd(_tail_block(q, tm, kv, qc, kc, size), out, lse, dout, cfg)
  return jax.tree.map(lambda x: jnp.where(meets, x, 0), (dq, dkv))


def _pair_switch(fn, skip, plan, cfg, a, b, tm, kv, r, src, c):
  """``fn(block)`` for query chunk a of device r and kv chunk b of device
  src, switched on their chunk distance; ``skip()`` outside the window."""
  k_min, k_max = _window_pairs(plan, cfg, c)
  qc, kc = layout.chunk_ids(plan, r)[a], layout.chunk_ids(plan, src)[b]
  index = jnp.clip(qc - kc - k_min + 1, 0, k_max - k_min + 2)
  own = src is r and tm.same_ids  # step 0, one id array

  def branch(dist, q, tm, kv):
    rows, cols = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
    return fn(_block(q, tm, kv, [qc], [kc], rows, cols, c, dist * c,
                     own=own))

  branches = ([lambda *_: skip()] +
              [functools.partial(branch, d) for d in range(k_min, k_max + 1)]
              + [lambda *_: skip()])
  return lambda q, tm, kv: lax.switch(index, branches, q, tm, kv)


def window_fwd(q, tm, kv, r, src, cfg, plan, carry):
  """Merge every (query chunk, kv chunk) pair of one step into ``carry``
  (None at the first step: the first pair initialises it)."""
  b, t, n, h = q.shape[:3] + kv[0][1].shape[3:]
  m = len(layout.chunk_ids(plan, 0))
  c = t // m
  outs = []
  for a in range(m):
    part = None if carry is None else (carry[0][:, a * c:(a + 1) * c],
                                       carry[1][:, a * c:(a + 1) * c])
    for bb in range(m):
      f = _pair_switch(lambda blk: _fwd(blk, cfg, jnp.float32),
                       lambda: masked(b, c, n, h, (q, kv[0][0])), plan, cfg, a,
                       bb, tm, kv, r, src, c)
      o = f(q, tm, kv)
      part = o if part is None else base.merge(*part, *o)
    outs.append(part)
  return tuple(jnp.concatenate(x, 1) for x in zip(*outs))


def window_bwd(q, tm, kv, r, src, out, lse, dout, cfg, plan):
  b, t, n, h = q.shape
  m = len(layout.chunk_ids(plan, 0))
  c = t // m
  dqs, dkvs = [0.0] * m, [0.0] * m
  for a in range(m):
    for bb in range(m):
      f = _pair_switch(
          lambda blk: _bwd(blk, out, lse, dout, cfg, jnp.float32),
          lambda: vma.like((jnp.zeros((b, c, n, h), jnp.float32),
                            dkv_zeros(kv, c)), q, kv[0][0], out, dout),
          plan, cfg, a, bb, tm, kv, r, src, c)
      dq, dkv = f(q, tm, kv)
      dqs[a], dkvs[bb] = dqs[a] + dq, kv_lib.add(dkvs[bb], dkv)
  return jnp.concatenate(dqs, 1), kv_lib.concat(dkvs, 1)
