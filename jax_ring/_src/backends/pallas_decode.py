"""Decode attention as one Pallas (Triton) kernel: each device's part of
``decode_attention`` in one pass over its cache, split over the slots.

Shapes: B batch, T new query tokens, N query heads, K kv heads (G = N / K
query heads share each), C slots (a multiple of ``BLOCK``), H and Hv head
dims (powers of two, at least 16); the cache is kv-head-major, ``k (B, K,
C, H)``, ``v (B, K, C, Hv)``.

The grid is ``(B K, S)``: program ``(b k, s)`` holds the T x G query rows
of kv head k (padded to ``ROWS``, the smallest row count Triton's matrix
product takes) and streams its share of the slots (``steps`` blocks,
:func:`splits`), ``BLOCK`` at a time: scores in float32, the mask by
position (``key_positions >= 0`` and the band), a running max and sum,
and the output accumulated in
float32, the probabilities cast to the cache's dtype for the second
product, as the XLA path casts them. Each K/V block is read once for its
G heads. S is picked so that about ``WAVES`` programs per SM run (every
SM streams at batch 1). The S partial ``(o, m, l)`` merge by logsumexp in
XLA, as devices merge (S = 1, a short cache: no merge): the result is
``decode._local``'s, unnormalised.

A visible NaN logit makes its row's ``m`` and ``l`` NaN (a running max
may skip NaN), so the row's output is NaN, as in ``jax.nn``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_ring._src.core import registry, vma
from jax_ring._src.core.mask import MASK_VALUE

ROWS = 16  # query rows a program holds, at least: Triton's smallest dot
BLOCK = 128  # slots a step of a program's loop reads
WAVES = 2  # programs per SM the split aims for


def supports(q_shape, k_shape, v_shape, layout: str) -> str | None:
  """Why the kernel cannot serve these shapes, or None."""
  if layout != "bksh":
    return "kv_layout='bskh' (the kernel reads a kv-head-major cache)"
  c = k_shape[2]
  if c == 0 or c % BLOCK:
    return f"{c} cache slots per device, not a multiple of {BLOCK}"
  for name, d in (("key", k_shape[3]), ("value", v_shape[3])):
    if d < 16 or d & (d - 1):  # Triton's tensors: powers of two
      return f"a {name} head dim of {d}, not a power of two >= 16"
  rows = q_shape[1] * (q_shape[2] // k_shape[1])
  if rows > 128:
    return f"{rows} query rows per kv head (T x N / K), more than 128"
  return None


def splits(b: int, k: int, c: int, sms: int) -> tuple[int, int]:
  """``(S, steps)``: S programs per row and kv head, each reading ``steps``
  blocks of ``BLOCK`` slots, about ``WAVES x sms`` programs in all (at
  most one per block). ``S x steps`` may pass the cache's ``c / BLOCK``
  blocks: a program's blocks past the end re-read the last one, masked."""
  blocks = c // BLOCK
  want = max(1, min(blocks, WAVES * sms // (b * k)))
  steps = -(-blocks // want)
  return -(-blocks // steps), steps


def _kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, o_ref, m_ref, l_ref, *,
            scale, cap, band, steps, blocks, unroll):
  q = q_ref[...]  # (R, H)
  q_pos = qp_ref[...]  # (R,)
  left, right = band
  rows = q.shape[0]
  # float32 caches: full float32 products, as the XLA path's HIGHEST.
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  dot = functools.partial(jnp.dot, precision=precision,
                          preferred_element_type=jnp.float32)

  def step(i, carry):
    o, m, l, bad = carry
    at = pl.program_id(1) * steps + i  # this program's i-th block
    sl = pl.ds(pl.multiple_of(jnp.minimum(at, blocks - 1) * BLOCK, BLOCK),
               BLOCK)
    k, v, kv_pos = k_ref[sl, :], v_ref[sl, :], kp_ref[sl]
    s = dot(q, k.T) * scale
    if cap is not None:
      s = cap * jnp.tanh(s / cap)
    d = kv_pos[None, :] - q_pos[:, None]
    vis = (kv_pos[None, :] >= 0) & (at < blocks)
    if right is not None:
      vis &= d <= right
    if left is not None:
      vis &= d >= -left
    # As a float: Triton reduces numbers, not booleans.
    bad = jnp.maximum(bad, jnp.where(vis & jnp.isnan(s), 1.0, 0.0).max(1))
    s = jnp.where(vis, s, MASK_VALUE)
    top = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - top)
    p = jnp.where(vis, jnp.exp(s - top[:, None]), 0.0)
    o = o * alpha[:, None] + dot(p.astype(v.dtype), v)
    return o, top, l * alpha + p.sum(axis=1), bad

  init = (jnp.zeros((rows, v_ref.shape[-1]), jnp.float32),
          jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.float32))
  if unroll:  # interpreted: a scan's carry would lose shard_map's typing
    carry = init
    for i in range(steps):
      carry = step(i, carry)
    o, m, l, bad = carry
  else:
    o, m, l, bad = lax.fori_loop(0, steps, step, init)
  o_ref[...] = o
  m_ref[...] = jnp.where(bad > 0, jnp.nan, m)
  l_ref[...] = jnp.where(bad > 0, jnp.nan, l)


def local(q, k, v, q_pos, kv_pos, *, band, scale, cap, interpret=False):
  """``decode._local`` for a kv-head-major cache: ``(o (B, T, N, Hv)``
  unnormalised, ``m, l (B, T, N))`` in float32, for shapes
  :func:`supports` accepts (decode_attention checks them first)."""
  b, t, n, h = q.shape
  kh, c, hv = k.shape[1], k.shape[2], v.shape[-1]
  g = n // kh
  rows = t * g
  padded = max(ROWS, 1 << (rows - 1).bit_length())
  # Rows of kv head k: (t, g) for its G heads, padded.
  qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(
      b, kh, rows, h)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
  rp = jnp.pad(jnp.repeat(q_pos, g, axis=1), ((0, 0), (0, padded - rows)))
  # The GPU's multiprocessors (none to fill when interpreted).
  s, steps = splits(b, kh, c, getattr(jax.devices()[0], "core_count", 1))
  head = lambda i, j: (i // kh, i % kh, 0, 0)  # programs index the slots
  kernel = functools.partial(_kernel, scale=scale, cap=cap, band=band,
                             steps=steps, blocks=c // BLOCK,
                             unroll=interpret)
  operands = vma.match(qr, k, v, rp, kv_pos)
  # Inside shard_map the results vary as the operands do.
  mat = getattr(jax.typeof(operands[1]), "mat", None)
  out = lambda *shape: jax.ShapeDtypeStruct(
      shape, jnp.float32, **({} if mat is None else dict(
          manual_axis_type=mat)))
  o, m, l = pl.pallas_call(
      kernel, grid=(b * kh, s),
      in_specs=[
          pl.BlockSpec((None, None, padded, h), lambda i, j: (
              i // kh, i % kh, 0, 0)),
          pl.BlockSpec((None, None, c, h), head),
          pl.BlockSpec((None, None, c, hv), head),
          pl.BlockSpec((None, padded), lambda i, j: (i // kh, 0)),
          pl.BlockSpec((None, c), lambda i, j: (i // kh, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, padded, hv), lambda i, j: (
              i // kh, i % kh, j, 0, 0)),
          pl.BlockSpec((None, None, None, padded), lambda i, j: (
              i // kh, i % kh, j, 0)),
          pl.BlockSpec((None, None, None, padded), lambda i, j: (
              i // kh, i % kh, j, 0)),
      ],
      out_shape=[out(b, kh, s, padded, hv), out(b, kh, s, padded),
                 out(b, kh, s, padded)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="jax_ring_decode_attention",
  )(*operands)
  if s == 1:  # one program a row's slots: nothing to merge
    o, m, l = (x[:, :, 0, :rows] for x in (o, m, l))
  else:
    top = m.max(axis=2, keepdims=True)  # NaN stays NaN
    alpha = jnp.exp(m - top)
    o = (o * alpha[..., None]).sum(2)[:, :, :rows]
    l = (l * alpha).sum(2)[:, :, :rows]
    m = top[:, :, 0, :rows]
  # (B, K, T G, ...) -> (B, T, N, ...)
  back = lambda x: jnp.moveaxis(
      x.reshape((b, kh, t, g) + x.shape[3:]), 2, 1).reshape(
          (b, t, n) + x.shape[3:])
  return back(o), back(m), back(l)


registry.DECODE_KERNELS["pallas"] = registry.DecodeKernel("pallas", local,
                                                         supports)
