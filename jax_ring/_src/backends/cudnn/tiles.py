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
``(B, T)``; a tile's logits ``(B, T / P, K, N / K, P, W)`` float32. The
numerics are the ``xla`` backend's: float32 logits and statistics, the
probabilities cast to the values' dtype for their product, the backward
from the given (global) ``out`` and ``lse``; a row that sees no key gives
zeros and ``MASK_VALUE``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_ring._src.backends.xla import einsum
from jax_ring._src.core.mask import MASK_VALUE

# Tile sizes P, smallest first: a block's longest document picks the first
# that holds it.
DEFAULT_SIZES = (32, 64)
SIZES = DEFAULT_SIZES
# The most bytes a block's float32 logits may take at the largest size;
# above, the pass has no tile branch.
MAX_LOGIT_BYTES = 1 << 30


def _ahead(config) -> bool:
  """Whether a query may see later keys (the band's right bound)."""
  right = config.band[1]
  return right is None or right > 0


def serves(q, k, mask, config) -> bool:
  """Whether the block can take tiles (static): one id array at equal
  offsets, and its logits at ``SIZES[-1]`` within ``MAX_LOGIT_BYTES``
  (none with no ``SIZES``)."""
  b, t, n, _ = q.shape
  one_array = (mask.same_ids and k.shape[1] == t and
               isinstance(mask.q_offset, (int, np.integer)) and
               mask.q_offset == mask.kv_offset)
  if not SIZES or not one_array:
    return False
  width = (3 if _ahead(config) else 2) * SIZES[-1]
  return 4 * b * t * n * width <= MAX_LOGIT_BYTES


def size_index(longest):
  """``()`` int32: the index in ``SIZES`` of the first tile that holds a
  document of ``longest`` tokens; ``len(SIZES)`` if none does."""
  return jnp.searchsorted(jnp.asarray(SIZES, jnp.int32), longest,
                          method="compare_all").astype(jnp.int32)


def _windows(x, p: int, ahead: bool):
  """``(B, T, ...)`` -> ``(B, T / P, W, ...)``: each tile's rows after the
  previous tile's (and before the next one's if ``ahead``), zeros past the
  row's ends; T padded to a multiple of ``p``."""
  b, t = x.shape[:2]
  nt = -(-t // p)
  x = jnp.pad(x, [(0, 0), (0, nt * p - t)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(b, nt, p, *x.shape[2:])
  edge = [(0, 0), (1, 1)] + [(0, 0)] * (x.ndim - 2)
  padded = jnp.pad(x, edge)
  parts = [padded[:, :nt], x] + ([padded[:, 2:]] if ahead else [])
  return jnp.concatenate(parts, 2)


def _from_windows(xw, p: int, ahead: bool, t: int):
  """The adjoint of :func:`_windows`: ``(B, T / P, W, ...)`` summed back
  onto ``(B, T, ...)``."""
  b, nt = xw.shape[:2]
  parts = jnp.split(xw, 3 if ahead else 2, axis=2)
  edge = [(0, 0), (0, 1)] + [(0, 0)] * (xw.ndim - 2)
  out = parts[1] + jnp.pad(parts[0], edge)[:, 1:]  # tile i's previous: i - 1
  if ahead:
    out = out + jnp.pad(parts[2], [(0, 0), (1, 0)] + edge[2:])[:, :nt]
  return out.reshape(b, nt * p, *xw.shape[3:])[:, :t]


def _visible(ids, config, p: int, t: int):
  """``(B, T / P, 1, 1, P, W)`` bool: query ``i`` of a tile sees key ``j``
  of its window (same id, inside the band and the row)."""
  ahead = _ahead(config)
  nt = -(-t // p)
  qid = jnp.pad(ids, [(0, 0), (0, nt * p - t)]).reshape(-1, nt, p)
  kid = _windows(ids, p, ahead)
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
  return vis[:, :, None, None]


def _queries(x, p: int, kh: int):
  """``(B, T, N, D)`` -> ``(B, T / P, P, K, N / K, D)``, T padded."""
  b, t, n, d = x.shape
  nt = -(-t // p)
  x = jnp.pad(x, [(0, 0), (0, nt * p - t), (0, 0), (0, 0)])
  return x.reshape(b, nt, p, kh, n // kh, d)


def _rows(x, p: int, kh: int):
  """Per-row statistics ``(B, T, N)`` -> ``(B, T / P, K, N / K, P)``."""
  return jnp.moveaxis(_queries(x[..., None], p, kh)[..., 0], 2, -1)


def forward(q, k, v, ids, config, p: int):
  """``(out (B, T, N, Hv), lse (B, T, N) float32)`` of the block whose
  documents each hold at most ``p`` tokens."""
  b, t, n, _ = q.shape
  kh, hv, ahead = k.shape[2], v.shape[3], _ahead(config)
  vis = _visible(ids, config, p, t)
  s = einsum("bipkgh,bijkh->bikgpj", _queries(q, p, kh),
              _windows(k, p, ahead)) * config.scale
  s = jnp.where(vis, s, MASK_VALUE)
  m = s.max(-1)
  e = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
  l = e.sum(-1)
  o = einsum("bikgpj,bijkh->bikgph", e.astype(v.dtype),
              _windows(v, p, ahead))
  seen = l != 0  # a NaN logit makes l NaN, kept
  o = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASK_VALUE)
  nt = o.shape[1]
  out = jnp.moveaxis(o, 4, 2).reshape(b, nt * p, n, hv)[:, :t]
  lse = jnp.moveaxis(lse, 4, 2).reshape(b, nt * p, n)[:, :t]
  return out.astype(q.dtype), lse


def backward(q, k, v, ids, out, lse, dout, config, p: int):
  """``(dq, dk, dv)`` of the block, from the given ``out`` and ``lse``."""
  b, t, n, h = q.shape
  kh, ahead = k.shape[2], _ahead(config)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  qt, dot = _queries(q, p, kh), _queries(dout, p, kh)
  kw, vw = _windows(k, p, ahead), _windows(v, p, ahead)
  vis = _visible(ids, config, p, t)
  s = einsum("bipkgh,bijkh->bikgpj", qt, kw) * config.scale
  lse_t = _rows(lse.astype(jnp.float32), p, kh)
  # exp(-inf) = 0 exactly for hidden entries, whatever lse is.
  pr = jnp.exp(jnp.where(vis, s - lse_t[..., None], -jnp.inf))
  dvw = einsum("bikgpj,bipkgh->bijkh", pr.astype(dout.dtype), dot)
  dp = einsum("bipkgh,bijkh->bikgpj", dot, vw)
  ds = (pr * (dp - _rows(delta, p, kh)[..., None]) * config.scale).astype(
      q.dtype)
  dq = einsum("bikgpj,bijkh->bipkgh", ds, kw)
  dkw = einsum("bikgpj,bipkgh->bijkh", ds, qt)
  dq = dq.reshape(b, -1, n, h)[:, :t].astype(q.dtype)
  return (dq, _from_windows(dkw, p, ahead, t).astype(k.dtype),
          _from_windows(dvw, p, ahead, t).astype(v.dtype))
