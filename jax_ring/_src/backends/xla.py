"""Pure-JAX blockwise backend (``implementation="xla"``): flash attention
in lax.

Shapes: B batch, T query length, S key length, N query heads, K kv heads,
G = N // K query heads per kv head, H the query/key head dim, Hv the
value (and output) head dim; bq, bk the tile sizes.

Forward: ``lax.map`` over query tiles; inside, a ``fori_loop`` over the kv
tiles that the causal/window mask leaves visible (its bounds may be traced,
so a ring step's offsets prune tiles too). The online softmax keeps a running
max ``m``, denominator ``l`` and accumulator in float32 per query row. Peak
memory is one ``(B, K, G, bq, bk)`` tile of scores plus O(T + S) arrays.

Backward: ``lax.scan`` over kv tiles (carrying dq, and dbias if any), and a
``fori_loop`` over the visible query tiles. It recomputes ``p = exp(s - lse)``
from the *given* ``lse`` and uses ``delta = rowsum(dout * out) - dlse`` from
the *given* ``out``: the block backward of a ring step is handed the global,
merged ``out`` and ``lse``, and then this is exactly that block's share of
the global gradient.

GQA never repeats K/V: queries are viewed as ``(B, T, K, G, H)`` and
contracted against ``(B, S, K, H)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._src.core import mask as mask_lib, registry, vma
from jax_ring._src.core.config import AttentionConfig
from jax_ring._src.core.mask import MASK_VALUE, BlockMask


def _cdiv(a, b):
  return -(-a // b)


def _pad(x, axis, size, value=0):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _precision(dtype):
  # float32 inputs get true float32 products (no TF32 on GPU); 16-bit inputs
  # use the native MXU/tensor-core path with float32 accumulation.
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def einsum(spec, a, b):
  """``jnp.einsum`` with float32 results: 16-bit operands on the tensor
  cores, float32 ones at full precision. Every product of this backend and
  of the cuDNN backend's dense band tiles."""
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32,
                    precision=_precision(a.dtype))


class _Tiling:
  """Tile sizes, padded lengths and padded operands for one block call."""

  def __init__(self, q, k, v, config: AttentionConfig):
    b, self.t, n, self.h = q.shape
    self.s, kh, self.hv = k.shape[1], k.shape[2], v.shape[3]
    self.heads = (kh, n // kh)
    self.bq = min(config.block_q, self.t)
    self.bk = min(config.block_kv, self.s)
    self.nq = _cdiv(self.t, self.bq)
    self.nk = _cdiv(self.s, self.bk)
    self.tp, self.sp = self.nq * self.bq, self.nk * self.bk

  def pad_q(self, x, value=0):  # (B, T, ...) -> (B, Tp, ...)
    return _pad(x, 1, self.tp, value)

  def pad_kv(self, x):  # (B, S, ...) -> (B, Sp, ...)
    return _pad(x, 1, self.sp)

  def pad_mask(self, m: BlockMask) -> BlockMask:
    dense = m.dense
    if dense is not None:
      dense = _pad(_pad(dense, 2, self.tp), 3, self.sp)
    kv_ids = None if m.q_segment_ids is None else m.kv_ids()
    return BlockMask(m.q_offset, m.kv_offset, self.pad_q(m.q_segment_ids),
                     self.pad_kv(kv_ids), m.q_lengths, m.kv_lengths, dense)

  def pad_bias(self, bias):
    return None if bias is None else _pad(_pad(bias, 2, self.tp), 3, self.sp)

  def visibility(self, m, config, q_start, kv_start):
    return mask_lib.block_visibility(
        m, config, q_start=q_start, kv_start=kv_start, block_q=self.bq,
        block_kv=self.bk, q_len=self.t, kv_len=self.s, heads=self.heads)

  def bias_tile(self, bias, q_start, kv_start):
    tile = lax.dynamic_slice_in_dim(bias, q_start, self.bq, 2)
    tile = lax.dynamic_slice_in_dim(tile, kv_start, self.bk, 3)
    return mask_lib.group_heads(tile, self.heads)


def _scores(config, qi, kj, bias_tile):
  """Logits of one tile, ``(B, K, G, bq, bk)`` float32, and tanh(s/cap)."""
  s = einsum("bqkgh,bskh->bkgqs", qi, kj) * config.scale
  t = None
  if config.logits_soft_cap is not None:
    t = jnp.tanh(s / config.logits_soft_cap)
    s = config.logits_soft_cap * t
  if bias_tile is not None:
    s = s + bias_tile.astype(jnp.float32)
  return s, t


def _rows(x, tiling):
  """``(B, T, N)`` -> ``(B, Tp, K, G)`` for per-row statistics."""
  return x.reshape(x.shape[0], x.shape[1], *tiling.heads)


def _slice_rows(x, start, size):
  """Slice ``(B, Tp, K, G)`` rows and lay them out as ``(B, K, G, bq)``."""
  return jnp.moveaxis(lax.dynamic_slice_in_dim(x, start, size, 1), 1, -1)


def forward(q, k, v, bias, mask: BlockMask, config: AttentionConfig):
  """Blockwise attention forward. See ``kernel.attention`` for the contract.

  Returns:
    ``out`` (B, T, N, Hv) in q.dtype and ``lse`` (B, T, N) float32.
  """
  tl = _Tiling(q, k, v, config)
  b, n = q.shape[0], q.shape[2]
  kh, g = tl.heads
  qg = tl.pad_q(q).reshape(b, tl.tp, kh, g, tl.h)
  k, v = tl.pad_kv(k), tl.pad_kv(v)
  mask, bias = tl.pad_mask(mask), tl.pad_bias(bias)

  def q_tile(i):
    q_start = i * tl.bq
    qi = lax.dynamic_slice_in_dim(qg, q_start, tl.bq, 1)

    def kv_step(j, carry):
      m, l, acc = carry
      kv_start = j * tl.bk
      kj = lax.dynamic_slice_in_dim(k, kv_start, tl.bk, 1)
      vj = lax.dynamic_slice_in_dim(v, kv_start, tl.bk, 1)
      btile = None if bias is None else tl.bias_tile(bias, q_start, kv_start)
      s, _ = _scores(config, qi, kj, btile)
      vis = tl.visibility(mask, config, q_start, kv_start)
      s = jnp.where(vis, s, MASK_VALUE)
      m_new = jnp.maximum(m, s.max(-1))
      # `where`, not just MASK_VALUE: while a row has seen only hidden keys,
      # m_new == MASK_VALUE and exp(s - m_new) would be 1 for them.
      p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
      alpha = jnp.exp(m - m_new)
      l = alpha * l + p.sum(-1)
      pv = einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), vj)
      return m_new, l, alpha[..., None] * acc + pv

    stats_shape = (b, kh, g, tl.bq)
    init = vma.like((jnp.full(stats_shape, MASK_VALUE, jnp.float32),
                     jnp.zeros(stats_shape, jnp.float32),
                     jnp.zeros(stats_shape + (tl.hv,), jnp.float32)),
                    qi, k, v, *jax.tree.leaves(mask), *jax.tree.leaves(bias))
    lo, hi = mask_lib.kv_block_range(config, mask, q_start, tl.bq, tl.bk,
                                     tl.nk)
    m, l, acc = lax.fori_loop(lo, hi, kv_step, init)
    # l == 0: no visible key (zeros). A NaN reaching the row's logits makes
    # l NaN, and `!=` keeps it (`l > 0` would turn the row into zeros).
    seen = l != 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None],
                    0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASK_VALUE)
    out = jnp.moveaxis(out, 3, 1).reshape(b, tl.bq, n, tl.hv)
    lse = jnp.moveaxis(lse, 3, 1).reshape(b, tl.bq, n)
    return out.astype(q.dtype), lse

  outs, lses = lax.map(q_tile, jnp.arange(tl.nq))
  out = jnp.moveaxis(outs, 0, 1).reshape(b, tl.tp, n, tl.hv)[:, :tl.t]
  lse = jnp.moveaxis(lses, 0, 1).reshape(b, tl.tp, n)[:, :tl.t]
  return out, lse


def backward(q, k, v, bias, mask: BlockMask, out, lse, dout, dlse,
             config: AttentionConfig):
  """Blockwise attention backward from a given (possibly global) out/lse.

  Returns:
    ``dq, dk, dv`` in the input dtypes, and ``dbias`` (bias's shape and
    dtype) or None.
  """
  tl = _Tiling(q, k, v, config)
  b, n = q.shape[0], q.shape[2]
  kh, g = tl.heads
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  qg = tl.pad_q(q).reshape(b, tl.tp, kh, g, tl.h)
  dog = tl.pad_q(dout).reshape(b, tl.tp, kh, g, tl.hv)
  lse_r = _rows(tl.pad_q(lse.astype(jnp.float32), MASK_VALUE), tl)
  delta_r = _rows(tl.pad_q(delta), tl)
  kp, vp = tl.pad_kv(k), tl.pad_kv(v)
  mask, biasp = tl.pad_mask(mask), tl.pad_bias(bias)

  def kv_tile(carry, j):
    kv_start = j * tl.bk
    kj = lax.dynamic_slice_in_dim(kp, kv_start, tl.bk, 1)
    vj = lax.dynamic_slice_in_dim(vp, kv_start, tl.bk, 1)

    def q_step(i, c):
      dq, dbias, dk, dv = c
      q_start = i * tl.bq
      qi = lax.dynamic_slice_in_dim(qg, q_start, tl.bq, 1)
      doi = lax.dynamic_slice_in_dim(dog, q_start, tl.bq, 1)
      lse_i = _slice_rows(lse_r, q_start, tl.bq)
      delta_i = _slice_rows(delta_r, q_start, tl.bq)
      btile = None if biasp is None else tl.bias_tile(biasp, q_start, kv_start)
      s, t = _scores(config, qi, kj, btile)
      vis = tl.visibility(mask, config, q_start, kv_start)
      # exp(-inf) = 0 exactly for hidden entries, whatever lse is.
      p = jnp.exp(jnp.where(vis, s - lse_i[..., None], -jnp.inf))
      dv = dv + einsum("bkgqs,bqkgh->bskh", p.astype(dout.dtype), doi)
      dp = einsum("bqkgh,bskh->bkgqs", doi, vj)
      ds = p * (dp - delta_i[..., None])  # d loss / d (final logits)
      if dbias is not None:
        dbias = _store_dbias(dbias, ds, q_start, kv_start)
      if t is not None:
        ds = ds * (1.0 - t * t)
      ds = (ds * config.scale).astype(q.dtype)
      dq_i = einsum("bkgqs,bskh->bqkgh", ds, kj)
      old = lax.dynamic_slice_in_dim(dq, q_start, tl.bq, 1)
      dq = lax.dynamic_update_slice_in_dim(dq, old + dq_i, q_start, 1)
      dk = dk + einsum("bkgqs,bqkgh->bskh", ds, qi)
      return dq, dbias, dk, dv

    dq, dbias = carry
    zeros = lambda h: vma.like(jnp.zeros((b, tl.bk, kh, h), jnp.float32),
                               *everything)
    lo, hi = mask_lib.q_block_range(config, mask, kv_start, tl.bq, tl.bk,
                                    tl.nq)
    dq, dbias, dk, dv = lax.fori_loop(lo, hi, q_step,
                                      (dq, dbias, zeros(tl.h), zeros(tl.hv)))
    return (dq, dbias), (dk, dv)

  everything = (qg, dog, lse_r, delta_r, kp, vp, *jax.tree.leaves(mask),
                *jax.tree.leaves(biasp))
  dq0 = jnp.zeros((b, tl.tp, kh, g, tl.h), jnp.float32)
  dbias0 = None if biasp is None else jnp.zeros(biasp.shape, jnp.float32)
  dq0, dbias0 = vma.like((dq0, dbias0), *everything)
  (dq, dbias), (dks, dvs) = lax.scan(kv_tile, (dq0, dbias0),
                                     jnp.arange(tl.nk))
  dq = dq.reshape(b, tl.tp, n, tl.h)[:, :tl.t].astype(q.dtype)
  unstack = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, tl.sp, kh, -1)
  dk = unstack(dks)[:, :tl.s].astype(k.dtype)
  dv = unstack(dvs)[:, :tl.s].astype(v.dtype)
  if dbias is not None:
    dbias = dbias[:, :, :tl.t, :tl.s].astype(bias.dtype)
  return dq, dk, dv, dbias


def _store_dbias(dbias, ds, q_start, kv_start):
  """Write one tile's bias gradient, summed over bias's broadcast dims."""
  bb, nb = dbias.shape[:2]
  b, kh, g, bq, bk = ds.shape
  tile = ds.reshape(b, kh * g, bq, bk)
  if bb == 1:
    tile = tile.sum(0, keepdims=True)
  if nb == 1:
    tile = tile.sum(1, keepdims=True)
  # Each (q tile, kv tile) pair is visited once: a plain store suffices.
  zero = jnp.zeros((), jnp.int32)
  return lax.dynamic_update_slice(dbias, tile, (zero, zero, q_start, kv_start))


registry.register(registry.Backend(registry.FALLBACK, forward, backward,
                                   lambda *_: None))
