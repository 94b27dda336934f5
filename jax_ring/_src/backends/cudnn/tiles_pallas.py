"""The tiles of :mod:`tiles` as Pallas (Triton) kernels, for documents of
any length: each query tile reads only the key tiles its documents reach
(:func:`ranges`), with no logits written out between the products (XLA's
form writes every tile's float32 logits, probabilities and their
gradients whole, over a fixed window of ``W`` keys a query).

Shapes as :mod:`tiles`: q ``(B, T, N, H)``, k ``(B, T, K, H)``, v ``(B,
T, K, Hv)``, ids ``(B, T)`` (each id one run of tokens, as the packed
pass's layout check finds, or any layout), tiles of ``P`` tokens (a T
that is no multiple of P is padded to one, the padding masked). Operands
are read in place as ``(B, T, heads x dim)`` matrices, ``lse`` and
``delta`` as ``(B, T, N)`` float32: nothing is transposed.

* **Forward**, grid ``(B, N, T / P)``: program ``(b, n, i)`` holds query
  tile ``i`` of head ``n`` and loops over its key tiles (kv head ``n //
  G``): float32 logits, masked by ids, the band and the row's end, a
  running max and sum as flash attention keeps them, the probabilities
  cast to v's dtype for their product, float32 accumulation.
* **dQ**, grid ``(B, N, T / P)``: the same key tiles, the probabilities
  recomputed from the given (global) ``lse``, as the XLA form does.
* **dK, dV**, grid ``(B, K, T / P)``: program ``(b, k, j)`` loops over
  the query tiles that reach key tile ``j`` and, in each, the G query
  heads of kv head ``k``, summing in float32.

A visible NaN logit makes its query row's out and lse NaN (the forward
keeps a flag, as a running max may skip NaN), as in ``jax.nn``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_ring._src.core import vma
from jax_ring._src.core.mask import MASK_VALUE

# Triton's software pipelining of the kernels' loops over tiles (1: none):
# loads of the next tile issued while this one's products run.
NUM_STAGES = 1


def supports(q, k, v, p: int) -> bool:
  """Whether the kernels take these operands (static): 16-bit floats, head
  dims and ``p`` powers of two of at least 16."""
  pow2 = lambda d: d >= 16 and not d & (d - 1)
  return (q.dtype in (jnp.bfloat16, jnp.float16) and
          q.dtype == k.dtype == v.dtype and pow2(q.shape[3]) and
          pow2(v.shape[3]) and pow2(p))


def _at(i, p):
  return pl.ds(pl.multiple_of(i * p, p), p)


def _tile(ref, i, p, col, width):
  """Rows ``[i p, (i + 1) p)``, columns ``[col w, (col + 1) w)`` of a
  ``(T, heads x w)`` ref."""
  return ref[_at(i, p), pl.ds(pl.multiple_of(col * width, width), width)]


def _column(ref, i, p, head):
  """``(P, 1)``: head ``head``'s statistics for tile ``i`` of a ``(T, N)``
  ref."""
  return ref[_at(i, p), pl.ds(head, 1)]


def _visible(qi, kj, qid, kid, p, t, band):
  """``(P, P)`` bool: row ``r`` of query tile ``qi`` sees column ``c`` of
  key tile ``kj`` (the same id, both before the row's padding, inside the
  band)."""
  q_pos = qi * p + lax.broadcasted_iota(jnp.int32, (p, p), 0)
  k_pos = kj * p + lax.broadcasted_iota(jnp.int32, (p, p), 1)
  vis = (qid[:, None] == kid[None, :]) & (k_pos < t) & (q_pos < t)
  left, right = band
  if left is not None:
    vis &= k_pos - q_pos >= -left
  if right is not None:
    vis &= k_pos - q_pos <= right
  return vis


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _spans(ids, one_run: bool):
  """``(start, end)``, each ``(B, T)`` int32: the first position of each
  token's id and one past its last. ``one_run``: each id is one run of
  tokens (its run's ends); else any layout (sorted by id, each group's
  ends)."""
  b, t = ids.shape
  ones = jnp.ones((b, 1), bool)
  if one_run:
    pos = jnp.arange(t, dtype=jnp.int32)
    change = ids[:, 1:] != ids[:, :-1]
    start = lax.cummax(jnp.where(jnp.concatenate([ones, change], 1), pos, 0),
                       axis=1)
    end = lax.cummin(jnp.where(jnp.concatenate([change, ones], 1), pos + 1,
                               t), axis=1, reverse=True)
    return start, end
  order = jnp.argsort(ids, axis=1, stable=True).astype(jnp.int32)
  change = jnp.take_along_axis(ids, order[:, 1:], 1) != jnp.take_along_axis(
      ids, order[:, :-1], 1)
  idx = jnp.arange(t, dtype=jnp.int32)
  # Each sorted index's group's first and last sorted index; positions
  # ascend inside a group (a stable sort), so these hold its ends.
  lo = lax.cummax(jnp.where(jnp.concatenate([ones, change], 1), idx, 0),
                  axis=1)
  hi = lax.cummin(jnp.where(jnp.concatenate([change, ones], 1), idx, t - 1),
                  axis=1, reverse=True)
  bi = jnp.arange(b)[:, None]
  back = lambda x: jnp.zeros((b, t), jnp.int32).at[bi, order].set(x)
  return (back(jnp.take_along_axis(order, lo, 1)),
          back(jnp.take_along_axis(order, hi, 1) + 1))


def ranges(ids, p: int, band, one_run: bool = True):
  """Each query tile's key tiles and each key tile's query tiles, as
  inclusive bounds ``(q_lo, q_hi, k_lo, k_hi)``, each ``(B, ceil(T /
  P))`` int32: the tiles from the first token to the last of the ids
  the tile holds, within ``band`` (left, right: how far a key may lie
  before or after its query; None: any). No visible (query, key) pair
  lies outside them; ``one_run`` (each id one run of tokens, as the
  packed pass's layout check finds) only makes them cheaper to find."""
  b, t = ids.shape
  nt = -(-t // p)
  start, end = _spans(ids, one_run)
  pad = ((0, 0), (0, nt * p - t))
  lo = jnp.pad(start, pad, constant_values=t).reshape(b, nt, p).min(-1) // p
  hi = (jnp.pad(end, pad).reshape(b, nt, p).max(-1) - 1) // p
  first = jnp.arange(nt, dtype=jnp.int32) * p
  last = jnp.minimum(first + p, t) - 1
  left, right = band
  span = lambda x: jnp.clip(x, 0, t - 1) // p
  q_lo, q_hi, k_lo, k_hi = lo, hi, lo, hi
  if left is not None:  # keys at most `left` before their query
    q_lo = jnp.maximum(q_lo, span(first - left))
    k_hi = jnp.minimum(k_hi, span(last + left))
  if right is not None:  # keys at most `right` after their query
    q_hi = jnp.minimum(q_hi, span(last + right))
    k_lo = jnp.maximum(k_lo, span(first - right))
  return q_lo, q_hi, k_lo, k_hi


def _fwd_kernel(q_ref, k_ref, v_ref, id_ref, lo_ref, hi_ref, o_ref, lse_ref,
                *, p, t, g, h, hv, scale, band):
  n, i = pl.program_id(1), pl.program_id(2)
  kh = n // g
  q, qid = q_ref[...], id_ref[_at(i, p)]

  def step(j, carry):  # key tile j, the softmax running as flash's
    acc, top, total, bad = carry
    s = _dot(q, _tile(k_ref, j, p, kh, h).T) * scale
    vis = _visible(i, j, qid, id_ref[_at(j, p)], p, t, band)
    bad = jnp.maximum(bad, jnp.where(vis & jnp.isnan(s), 1.0, 0.0).max(1))
    s = jnp.where(vis, s, MASK_VALUE)
    new = jnp.maximum(top, s.max(axis=1))
    alpha = jnp.exp(top - new)
    e = jnp.where(vis, jnp.exp(s - new[:, None]), 0.0)
    v = _tile(v_ref, j, p, kh, hv)
    return (acc * alpha[:, None] + _dot(e.astype(v.dtype), v), new,
            total * alpha + e.sum(axis=1), bad)

  zeros = jnp.zeros((p,), jnp.float32)
  acc, top, total, bad = lax.fori_loop(
      lo_ref[i], hi_ref[i] + 1, step,
      (jnp.zeros((p, hv), jnp.float32), zeros + MASK_VALUE, zeros, zeros))
  seen = total != 0  # a NaN logit makes it NaN, kept
  out = jnp.where(seen[:, None], acc / jnp.where(seen, total, 1.0)[:, None],
                  0.0)
  lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)),
                  MASK_VALUE)
  o_ref[...] = jnp.where(bad[:, None] > 0, jnp.nan, out).astype(o_ref.dtype)
  lse_ref[_at(i, p), pl.ds(n, 1)] = jnp.where(bad > 0, jnp.nan, lse)[:, None]


def _grads(q, k, v, do, lse, delta, vis, scale):
  """One (query tile, key tile) pair's probabilities ``(P, P)`` float32 and
  logit gradients ``(P, P)`` in q's dtype, from the global lse."""
  s = _dot(q, k.T) * scale
  pr = jnp.exp(jnp.where(vis, s - lse, -jnp.inf))
  dp = _dot(do, v.T)
  return pr, (pr * (dp - delta) * scale).astype(q.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, id_ref,
               lo_ref, hi_ref, dq_ref, *, p, t, g, h, hv, scale, band):
  n, i = pl.program_id(1), pl.program_id(2)
  kh = n // g
  q, do, qid = q_ref[...], do_ref[...], id_ref[_at(i, p)]
  lse, delta = _column(lse_ref, i, p, n), _column(delta_ref, i, p, n)

  def step(j, acc):
    k = _tile(k_ref, j, p, kh, h)
    vis = _visible(i, j, qid, id_ref[_at(j, p)], p, t, band)
    _, ds = _grads(q, k, _tile(v_ref, j, p, kh, hv), do, lse, delta, vis,
                   scale)
    return acc + _dot(ds, k)

  dq_ref[...] = lax.fori_loop(lo_ref[i], hi_ref[i] + 1, step, jnp.zeros(
      (p, h), jnp.float32)).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, id_ref,
                lo_ref, hi_ref, dk_ref, dv_ref, *, p, t, g, h, hv, scale,
                band):
  kh, j = pl.program_id(1), pl.program_id(2)
  k, v, kid = k_ref[...], v_ref[...], id_ref[_at(j, p)]

  def step(i, carry):  # query tile i, each of kv head kh's G heads
    dk, dv = carry
    vis = _visible(i, j, id_ref[_at(i, p)], kid, p, t, band)
    for n in range(g):
      head = kh * g + n
      q, do = _tile(q_ref, i, p, head, h), _tile(do_ref, i, p, head, hv)
      pr, ds = _grads(q, k, v, do, _column(lse_ref, i, p, head),
                      _column(delta_ref, i, p, head), vis, scale)
      dk = dk + _dot(ds.T, q)
      dv = dv + _dot(pr.astype(do.dtype).T, do)
    return dk, dv

  dk, dv = lax.fori_loop(lo_ref[j], hi_ref[j] + 1, step, (
      jnp.zeros((p, k.shape[1]), jnp.float32),
      jnp.zeros((p, v.shape[1]), jnp.float32)))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(kernel, grid, ins, outs, interpret, **params):
  """``pallas_call`` of ``kernel`` over ``grid`` ``(B, heads, T / P)``.
  ``ins``/``outs``: ``(array or ShapeDtypeStruct, block)`` pairs, block
  ``None`` for a row's whole ``(T, ...)``, else ``(width, head_of)``: the
  ``(P, width)`` tile at (tile, ``head_of(program's head)``)."""
  p = params["p"]

  def spec(x, block):
    if block is None:
      return pl.BlockSpec((None,) + x.shape[1:],
                          lambda b, n, i: (b,) + (0,) * (len(x.shape) - 1))
    width, head_of = block
    return pl.BlockSpec((None, p, width),
                        lambda b, n, i: (b, i, head_of(n)))

  operands = vma.match(*(x for x, _ in ins))
  mat = getattr(jax.typeof(operands[0]), "mat", None)
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype, **(
      {} if mat is None else dict(manual_axis_type=mat))) for x, _ in outs]
  return pl.pallas_call(
      functools.partial(kernel, **params), grid=grid,
      in_specs=[spec(x, blk) for x, blk in ins],
      out_specs=[spec(x, blk) for x, blk in outs], out_shape=shapes,
      compiler_params=plgpu.CompilerParams(num_warps=4 if p <= 64 else 8,
                                           num_stages=NUM_STAGES),
      interpret=interpret, name="jax_ring_band_tiles")(*operands)


def _params(q, k, v, config, p):
  b, t, n, h = q.shape
  return dict(p=p, t=t, g=n // k.shape[2], h=h, hv=v.shape[3],
              scale=float(config.scale), band=config.band)


def _flat(x, tp: int):
  """``(B, T, ...)`` -> ``(B, T_p, prod(...))``, zeros past T."""
  x = x.reshape(x.shape[0], x.shape[1], -1)
  return jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0)))


def _ids(ids, tp: int):
  return _flat(ids.astype(jnp.int32), tp)[..., 0]


def forward(q, k, v, ids, config, p: int, interpret: bool = False,
            one_run: bool = True):
  """``(out (B, T, N, Hv), lse (B, T, N) float32)`` of the block, in
  tiles of ``p``; ``one_run``: each id is one run of tokens (else any
  layout, :func:`ranges`)."""
  b, t, n, _ = q.shape
  prm = _params(q, k, v, config, p)
  hv, nt = prm["hv"], -(-t // p)
  tp, own = nt * p, lambda m: m
  q_lo, q_hi, _, _ = ranges(ids, p, config.band, one_run)
  out, lse = _call(
      _fwd_kernel, (b, n, nt),
      [(_flat(q, tp), (prm["h"], own)), (_flat(k, tp), None),
       (_flat(v, tp), None), (_ids(ids, tp), None), (q_lo, None),
       (q_hi, None)],
      [(jax.ShapeDtypeStruct((b, tp, n * hv), q.dtype), (hv, own)),
       (jax.ShapeDtypeStruct((b, tp, n), jnp.float32), None)],
      interpret, **prm)
  return out[:, :t].reshape(b, t, n, hv), lse[:, :t]


def backward(q, k, v, ids, out, lse, dout, config, p: int,
             interpret: bool = False, one_run: bool = True):
  """``(dq, dk, dv)`` of the block, from the given (global) ``out`` and
  ``lse`` (``one_run`` as :func:`forward`'s)."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  prm = _params(q, k, v, config, p)
  hv, nt = prm["hv"], -(-t // p)
  tp, own = nt * p, lambda m: m
  q_lo, q_hi, k_lo, k_hi = ranges(ids, p, config.band, one_run)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  q, k, v, dout = (_flat(x, tp) for x in (q, k, v, dout))
  rows = [(_flat(lse.astype(jnp.float32), tp), None),
          (_flat(delta, tp), None), (_ids(ids, tp), None)]
  (dq,) = _call(
      _dq_kernel, (b, n, nt),
      [(q, (h, own)), (k, None), (v, None), (dout, (hv, own))] + rows
      + [(q_lo, None), (q_hi, None)],
      [(jax.ShapeDtypeStruct((b, tp, n * h), q.dtype), (h, own))],
      interpret, **prm)
  dk, dv = _call(
      _dkv_kernel, (b, kh, nt),
      [(q, None), (k, (h, own)), (v, (hv, own)), (dout, None)] + rows
      + [(k_lo, None), (k_hi, None)],
      [(jax.ShapeDtypeStruct((b, tp, kh * h), k.dtype), (h, own)),
       (jax.ShapeDtypeStruct((b, tp, kh * hv), v.dtype), (hv, own))],
      interpret, **prm)
  return (dq[:, :t].reshape(b, t, n, h), dk[:, :t].reshape(b, t, kh, h),
          dv[:, :t].reshape(b, t, kh, hv))
