"""Rows of short packed documents as dense band tiles, in XLA: the packed
pass's branch for blocks whose documents all fit one tile.

A block of one id array (its keys are its queries, at equal offsets)
whose every document (run of equal ids) holds at most ``P`` tokens pairs
each tile of ``P`` queries with the keys of its own tile and the one
before, and the one after where the band reaches forward: two tokens of
one document are fewer than ``P`` apart, so no visible key lies further.
A tile is one dense product of ``P`` queries by ``W = 2P`` (or ``3P``)
keys, masked by ids, the band and the row's end: ``W`` keys a query
whatever the number of documents, where cuDNN's ragged calls pay for
every document's tile and statistics (design.md, packed documents).

Shapes: q ``(B, T, N, H)``, k ``(B, T, K, H)``, v ``(B, T, K, Hv)``, ids
``(B, T)``; a tile's logits ``(B, K, T / P, N / K, P, W)`` float32 (the
heads first, so that every product's batch dimensions lead). The
numerics are the ``xla`` backend's: float32 logits and statistics, the
probabilities cast to the values' dtype for their product, the backward
from the given (global) ``out`` and ``lse``; a row that sees no key gives
zeros and ``MASK_VALUE``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ring._src.backends.cudnn import tiles_pallas
from jax_ring._src.backends.xla import einsum
from jax_ring._src.core.mask import MASK_VALUE

# Tile sizes P, smallest first: a block's longest document picks the first
# that holds it.
DEFAULT_SIZES = (32, 64)
SIZES = DEFAULT_SIZES
# The most bytes a block's float32 logits may take at the largest size;
# above, the pass has no tile branch (unless the Pallas form runs them).
MAX_LOGIT_BYTES = 1 << 30
# The tiles' form on GPUs: "pallas" (tiles_pallas.py: no logits written
# out, and each tile reads only the tiles its documents reach) where
# tiles_pallas.supports the operands, else "xla" (this module's products).
# Elsewhere "xla". See docs/decisions.md for the measured choice.
DEFAULT_KERNEL = "pallas"
KERNEL = DEFAULT_KERNEL
# The Pallas form's largest size takes documents of up to this many tokens
# (its tiles need not hold a document); longer ones go to the handler.
PALLAS_REACH = 128
# Where True, a packed block that the Pallas form takes at SIZES[-1] runs
# it, whatever its documents' lengths and layout and whether its queries
# and keys share one id array, with no switch on them (so no wait for the
# host at a branch): :func:`direct`. Off by default: docs/decisions.md,
# the packed tiles as Pallas kernels.
DIRECT = False


def _pallas(q, k, v, p: int) -> bool:
  on = jax.default_backend() == "gpu" or tiles_pallas.INTERPRET
  return KERNEL == "pallas" and on and tiles_pallas.supports(q, k, v, p)


def _ahead(config) -> bool:
  """Whether a query may see later keys (the band's right bound)."""
  right = config.band[1]
  return right is None or right > 0


def serves(q, k, mask, config, v=None) -> bool:
  """Whether the block can take tiles (static): one id array at equal
  offsets, and its logits at ``SIZES[-1]`` within ``MAX_LOGIT_BYTES``
  unless the Pallas form takes every size with ``v`` (none with no
  ``SIZES``)."""
  b, t, n, _ = q.shape
  one_array = (mask.same_ids and k.shape[1] == t and
               isinstance(mask.q_offset, (int, np.integer)) and
               mask.q_offset == mask.kv_offset)
  if not SIZES or not one_array:
    return False
  if v is not None and all(_pallas(q, k, v, p) for p in SIZES):
    return True
  width = (3 if _ahead(config) else 2) * SIZES[-1]
  return 4 * b * t * n * width <= MAX_LOGIT_BYTES


def direct(q, k, v, mask, config) -> bool:
  """Whether a packed block runs the Pallas tiles at ``SIZES[-1]`` with no
  switch (static; :data:`DIRECT`): any ids, one array or two, at static
  offsets."""
  static = all(isinstance(x, (int, np.integer))
               for x in (mask.q_offset, mask.kv_offset))
  return bool(DIRECT and SIZES and static and
              _pallas(q, k, v, SIZES[-1]))


def _direct(mask) -> dict:
  return dict(one_run=False, kv_ids=mask.kv_segment_ids,
              shift=int(mask.kv_offset - mask.q_offset))


def direct_forward(q, k, v, mask, config):
  """:func:`forward` of a :func:`direct` block."""
  return tiles_pallas.forward(q, k, v, mask.q_segment_ids, config,
                              SIZES[-1], **_direct(mask))


def direct_backward(q, k, v, mask, out, lse, dout, config):
  """:func:`backward` of a :func:`direct` block."""
  return tiles_pallas.backward(q, k, v, mask.q_segment_ids, out, lse, dout,
                               config, SIZES[-1], **_direct(mask))


def limits(q, k, v) -> tuple[int, ...]:
  """The longest document each size of ``SIZES`` takes (static): the size
  itself, but ``PALLAS_REACH`` for the largest where the Pallas form runs
  these operands."""
  if SIZES and _pallas(q, k, v, SIZES[-1]):
    return SIZES[:-1] + (max(SIZES[-1], PALLAS_REACH),)
  return SIZES


def size_index(longest, most: tuple[int, ...]):
  """``()`` int32: the index of the first size whose limit in ``most``
  (:func:`limits`) takes a document of ``longest`` tokens; ``len(most)``
  if none does."""
  return jnp.searchsorted(jnp.asarray(most, jnp.int32), longest,
                          method="compare_all").astype(jnp.int32)


def _tiled(x, p: int):
  """``(B, T, ...)`` -> ``(B, T / P, P, ...)``, T padded with zeros to a
  multiple of ``p``."""
  b, t = x.shape[:2]
  nt = -(-t // p)
  x = jnp.pad(x, [(0, 0), (0, nt * p - t)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(b, nt, p, *x.shape[2:])


def _windows(x, axis: int, ahead: bool):
  """Tiles on ``axis``, their rows on ``axis + 1`` -> each tile's window
  on ``axis + 1``: the previous tile's rows, its own (and the next one's
  if ``ahead``), zeros past the row's ends."""
  edge = [(0, 0)] * x.ndim
  edge[axis] = (1, 1)
  padded = jnp.pad(x, edge)
  nt = x.shape[axis]
  take = lambda i: lax.slice_in_dim(padded, i, i + nt, axis=axis)
  return jnp.concatenate([take(0), x] + ([take(2)] if ahead else []),
                         axis + 1)


def _from_windows(xw, ahead: bool, t: int):
  """The adjoint of :func:`_kv`: ``(B, K, T / P, W, D)`` summed back onto
  ``(B, T, K, D)``."""
  b, kh, nt, _, d = xw.shape
  parts = jnp.split(xw, 3 if ahead else 2, axis=3)
  edge = [(0, 0), (0, 0), (0, 1), (0, 0), (0, 0)]
  out = parts[1] + jnp.pad(parts[0], edge)[:, :, 1:]  # tile i's previous
  if ahead:
    out = out + jnp.pad(parts[2], [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0)]
                        )[:, :, :nt]
  out = jnp.moveaxis(out, 1, 3)  # (B, T / P, P, K, D)
  return out.reshape(b, -1, kh, d)[:, :t]


def _kv(x, p: int, ahead: bool):
  """Keys or values ``(B, T, K, D)`` -> their windows
  ``(B, K, T / P, W, D)``."""
  return _windows(jnp.moveaxis(_tiled(x, p), 3, 1), 2, ahead)


def _visible(ids, config, p: int, t: int):
  """``(B, 1, T / P, 1, P, W)`` bool: query ``i`` of a tile sees key ``j``
  of its window (same id, inside the band and the row)."""
  ahead = _ahead(config)
  qid = _tiled(ids, p)
  kid = _windows(qid, 1, ahead)
  nt = qid.shape[1]
  q_pos = jnp.arange(nt * p, dtype=jnp.int32).reshape(nt, p)
  k_pos = (jnp.arange(nt, dtype=jnp.int32)[:, None] - 1) * p + jnp.arange(
      kid.shape[2], dtype=jnp.int32)[None]
  rel = k_pos[:, None, :] - q_pos[:, :, None]  # (T / P, P, W)
  keep = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] < t)
  left, right = config.band
  if left is not None:
    keep &= rel >= -left
  if right is not None:
    keep &= rel <= right
  vis = (qid[:, :, :, None] == kid[:, :, None, :]) & keep[None]
  return vis[:, None, :, None]


def _queries(x, p: int, kh: int):
  """``(B, T, N, D)`` -> ``(B, K, T / P, N / K, P, D)``, T padded: the
  heads lead, so every product's batch dimensions (B, K, T / P) lead in
  each operand and no product needs its operands moved."""
  b, t, n, d = x.shape
  x = _tiled(x, p).reshape(b, -1, p, kh, n // kh, d)
  return jnp.transpose(x, (0, 3, 1, 4, 2, 5))


def _rows(x, p: int, kh: int):
  """Per-row statistics ``(B, T, N)`` -> ``(B, K, T / P, N / K, P)``."""
  return _queries(x[..., None], p, kh)[..., 0]


def _unqueries(x, t: int):
  """The inverse of :func:`_queries`, with any trailing axes:
  ``(B, K, T / P, N / K, P, ...)`` -> ``(B, T, N, ...)``."""
  b, kh, nt, g, p = x.shape[:5]
  x = jnp.transpose(x, (0, 2, 4, 1, 3, *range(5, x.ndim)))
  return x.reshape(b, nt * p, kh * g, *x.shape[5:])[:, :t]


def forward(q, k, v, ids, config, p: int):
  """``(out (B, T, N, Hv), lse (B, T, N) float32)`` of the block whose
  documents each hold at most ``p`` tokens (at most :func:`limits`' for
  ``p`` where the Pallas form runs)."""
  if _pallas(q, k, v, p):
    return tiles_pallas.forward(q, k, v, ids, config, p)
  t, kh, ahead = q.shape[1], k.shape[2], _ahead(config)
  vis = _visible(ids, config, p, t)
  s = einsum("bkigph,bkijh->bkigpj", _queries(q, p, kh),
             _kv(k, p, ahead)) * config.scale
  s = jnp.where(vis, s, MASK_VALUE)
  m = s.max(-1)
  e = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
  l = e.sum(-1)
  o = einsum("bkigpj,bkijh->bkigph", e.astype(v.dtype), _kv(v, p, ahead))
  seen = l != 0  # a NaN logit makes l NaN, kept
  o = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASK_VALUE)
  return (_unqueries(o, t).astype(q.dtype),
          _unqueries(lse[..., None], t)[..., 0])


def backward(q, k, v, ids, out, lse, dout, config, p: int):
  """``(dq, dk, dv)`` of the block, from the given ``out`` and ``lse``."""
  if _pallas(q, k, v, p):
    return tiles_pallas.backward(q, k, v, ids, out, lse, dout, config, p)
  t, kh, ahead = q.shape[1], k.shape[2], _ahead(config)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  qt, dot = _queries(q, p, kh), _queries(dout, p, kh)
  kw, vw = _kv(k, p, ahead), _kv(v, p, ahead)
  vis = _visible(ids, config, p, t)
  s = einsum("bkigph,bkijh->bkigpj", qt, kw) * config.scale
  lse_t = _rows(lse.astype(jnp.float32), p, kh)
  # exp(-inf) = 0 exactly for hidden entries, whatever lse is.
  pr = jnp.exp(jnp.where(vis, s - lse_t[..., None], -jnp.inf))
  dvw = einsum("bkigpj,bkigph->bkijh", pr.astype(dout.dtype), dot)
  dp = einsum("bkigph,bkijh->bkigpj", dot, vw)
  ds = (pr * (dp - _rows(delta, p, kh)[..., None]) * config.scale).astype(
      q.dtype)
  dq = einsum("bkigpj,bkijh->bkigph", ds, kw)
  dkw = einsum("bkigpj,bkigph->bkijh", ds, qt)
  return (_unqueries(dq, t).astype(q.dtype),
          _from_windows(dkw, ahead, t).astype(k.dtype),
          _from_windows(dvw, ahead, t).astype(v.dtype))
