"""The tiles of :mod:`tiles` as Pallas (Triton) kernels, for documents of
any length: each query tile reads only the key tiles its documents reach
(:func:`ranges`), with no logits written out between the products (XLA's
form writes every tile's float32 logits, probabilities and their
gradients whole, over a fixed window of ``W`` keys a query).

Shapes: q ``(B, T, N, H)``, k ``(B, S, K, H)``, v ``(B, S, K, Hv)``,
the queries' ids ``(B, T)`` and the keys' ``(B, S)`` (one array for both
where T = S, each id one run of tokens as the packed pass's layout check
finds, or any layout), a key's global position less a query's their
local one's plus a static ``shift`` (the mask's ``kv_offset -
q_offset``), tiles of ``P`` tokens (a T or S that is no multiple of P is
padded to one, the padding masked). Operands are read in place as ``(B,
T, heads x dim)`` matrices, ``lse`` and ``delta`` as ``(B, T, N)``
float32: nothing is transposed.

* **Forward**, grid ``(B, N, T / P)``: program ``(b, n, i)`` holds query
  tile ``i`` of head ``n`` and loops over its key tiles (kv head ``n //
  G``): float32 logits, masked by ids, the band and the row's end, a
  running max and sum as flash attention keeps them, the probabilities
  cast to v's dtype for their product, float32 accumulation.
* **dQ**, grid ``(B, N, T / P)``: the same key tiles, the probabilities
  recomputed from the given (global) ``lse``, as the XLA form does.
* **dK, dV**, grid ``(B, K, S / P)``: program ``(b, k, j)`` loops over
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
# Run the kernels interpreted, on any backend (tests on the CPU): the
# default of forward's and backward's ``interpret``.
INTERPRET = False


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


def _visible(qi, kj, qid, kid, p, tq, ts, shift, band):
  """``(P, P)`` bool: row ``r`` of query tile ``qi`` sees column ``c`` of
  key tile ``kj`` (the same id, neither past its side's length ``tq`` or
  ``ts``, inside the band; a key's global position less a query's is
  their local one's plus ``shift``)."""
  q_pos = qi * p + lax.broadcasted_iota(jnp.int32, (p, p), 0)
  k_pos = kj * p + lax.broadcasted_iota(jnp.int32, (p, p), 1)
  vis = (qid[:, None] == kid[None, :]) & (k_pos < ts) & (q_pos < tq)
  d = k_pos - q_pos + shift
  left, right = band
  if left is not None:
    vis &= d >= -left
  if right is not None:
    vis &= d <= right
  return vis


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _spans(x_ids, y_ids, one_run: bool):
  """``(start, end)``, each ``(B, Tx)`` int32: for each token of
  ``x_ids``, the first position in ``y_ids`` of its id and one past the
  last (``Ty`` and 0 where ``y_ids`` lacks it). ``one_run``: ``x_ids`` is
  ``y_ids`` and each id one run of tokens (its run's ends); else any
  layout (``y_ids`` sorted by id, each id's group found by bisection)."""
  b, t = x_ids.shape
  if one_run:
    ones = jnp.ones((b, 1), bool)
    pos = jnp.arange(t, dtype=jnp.int32)
    change = x_ids[:, 1:] != x_ids[:, :-1]
    start = lax.cummax(jnp.where(jnp.concatenate([ones, change], 1), pos, 0),
                       axis=1)
    end = lax.cummin(jnp.where(jnp.concatenate([change, ones], 1), pos + 1,
                               t), axis=1, reverse=True)
    return start, end
  ty = y_ids.shape[1]
  # A stable sort: positions ascend inside each id's group.
  order = jnp.argsort(y_ids, axis=1, stable=True).astype(jnp.int32)
  ys = jnp.take_along_axis(y_ids, order, 1)
  find = lambda side: jax.vmap(lambda y, x: jnp.searchsorted(
      y, x, side=side).astype(jnp.int32))(ys, x_ids)
  lo, hi = find("left"), find("right")
  first = jnp.take_along_axis(order, jnp.minimum(lo, ty - 1), 1)
  last = jnp.take_along_axis(order, jnp.maximum(hi - 1, 0), 1)
  found = hi > lo
  return jnp.where(found, first, ty), jnp.where(found, last + 1, 0)


def ranges(ids, p: int, band, one_run: bool = True, kv_ids=None,
           shift: int = 0):
  """Each query tile's key tiles ``(B, ceil(T / P))`` and each key tile's
  query tiles ``(B, ceil(S / P))``, as inclusive bounds ``(q_lo, q_hi,
  k_lo, k_hi)`` int32: the other side's tiles from the first token to the
  last of the ids the tile holds, within ``band`` (left, right: how far a
  key may lie before or after its query, by global position; a key's
  global position less a query's is their local one's plus ``shift``;
  None: any). ``ids (B, T)`` are the queries', ``kv_ids (B, S)`` the
  keys' (None: the same). No visible (query, key) pair lies outside
  them; ``one_run`` (one id array, each id one run of tokens, as the
  packed pass's layout check finds) only makes them cheaper to find."""
  same = kv_ids is None
  ids = ids.astype(jnp.int32)
  kv_ids = ids if same else kv_ids.astype(jnp.int32)
  (b, tq), ts = ids.shape, kv_ids.shape[1]
  q_start, q_end = _spans(ids, kv_ids, one_run and same)
  k_start, k_end = (q_start, q_end) if same else _spans(kv_ids, ids, False)

  def tiles_of(start, end, t, other):  # min and max over each tile
    nt = -(-t // p)
    pad = ((0, 0), (0, nt * p - t))
    lo = jnp.pad(start, pad, constant_values=other).reshape(b, nt, p)
    hi = jnp.pad(end, pad).reshape(b, nt, p).max(-1) - 1
    first = jnp.arange(nt, dtype=jnp.int32) * p
    return lo.min(-1) // p, hi // p, first, jnp.minimum(first + p, t) - 1

  q_lo, q_hi, fq, lq = tiles_of(q_start, q_end, tq, ts)
  k_lo, k_hi, fk, lk = tiles_of(k_start, k_end, ts, tq)
  in_k = lambda x: jnp.clip(x, 0, ts - 1) // p
  in_q = lambda x: jnp.clip(x, 0, tq - 1) // p
  left, right = band
  if left is not None:  # keys at most `left` before their query
    q_lo = jnp.maximum(q_lo, in_k(fq - shift - left))
    k_hi = jnp.minimum(k_hi, in_q(lk + shift + left))
  if right is not None:  # keys at most `right` after their query
    q_hi = jnp.minimum(q_hi, in_k(lq - shift + right))
    k_lo = jnp.maximum(k_lo, in_q(fk + shift - right))
  return q_lo, q_hi, k_lo, k_hi


def _fwd_kernel(q_ref, k_ref, v_ref, qid_ref, kid_ref, lo_ref, hi_ref, o_ref,
                lse_ref, *, p, tq, ts, shift, g, h, hv, scale, band):
  n, i = pl.program_id(1), pl.program_id(2)
  kh = n // g
  q, qid = q_ref[...], qid_ref[_at(i, p)]

  def step(j, carry):  # key tile j, the softmax running as flash's
    acc, top, total, bad = carry
    s = _dot(q, _tile(k_ref, j, p, kh, h).T) * scale
    vis = _visible(i, j, qid, kid_ref[_at(j, p)], p, tq, ts, shift, band)
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


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qid_ref,
               kid_ref, lo_ref, hi_ref, dq_ref, *, p, tq, ts, shift, g, h, hv,
               scale, band):
  n, i = pl.program_id(1), pl.program_id(2)
  kh = n // g
  q, do, qid = q_ref[...], do_ref[...], qid_ref[_at(i, p)]
  lse, delta = _column(lse_ref, i, p, n), _column(delta_ref, i, p, n)

  def step(j, acc):
    k = _tile(k_ref, j, p, kh, h)
    vis = _visible(i, j, qid, kid_ref[_at(j, p)], p, tq, ts, shift, band)
    _, ds = _grads(q, k, _tile(v_ref, j, p, kh, hv), do, lse, delta, vis,
                   scale)
    return acc + _dot(ds, k)

  dq_ref[...] = lax.fori_loop(lo_ref[i], hi_ref[i] + 1, step, jnp.zeros(
      (p, h), jnp.float32)).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qid_ref,
                kid_ref, lo_ref, hi_ref, dk_ref, dv_ref, *, p, tq, ts, shift,
                g, h, hv, scale, band):
  kh, j = pl.program_id(1), pl.program_id(2)
  k, v, kid = k_ref[...], v_ref[...], kid_ref[_at(j, p)]

  def step(i, carry):  # query tile i, each of kv head kh's G heads
    dk, dv = carry
    vis = _visible(i, j, qid_ref[_at(i, p)], kid, p, tq, ts, shift, band)
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
  interpret = INTERPRET if interpret is None else interpret

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


def _params(q, k, v, config, p, shift):
  return dict(p=p, tq=q.shape[1], ts=k.shape[1], shift=int(shift),
              g=q.shape[2] // k.shape[2], h=q.shape[3], hv=v.shape[3],
              scale=float(config.scale), band=config.band)


def _flat(x, tp: int):
  """``(B, T, ...)`` -> ``(B, T_p, prod(...))``, zeros past T."""
  x = x.reshape(x.shape[0], x.shape[1], -1)
  return jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0)))


def _ids(ids, tp: int):
  return _flat(ids.astype(jnp.int32), tp)[..., 0]


def forward(q, k, v, ids, config, p: int, interpret: bool | None = None,
            one_run: bool = True, kv_ids=None, shift: int = 0):
  """``(out (B, T, N, Hv), lse (B, T, N) float32)`` of the block, in
  tiles of ``p``: queries' ``ids``, keys' ``kv_ids`` and ``shift`` as
  :func:`ranges` takes them (``one_run``: one id array, each id one run
  of tokens)."""
  b, t, n, _ = q.shape
  prm = _params(q, k, v, config, p, shift)
  hv, nq = prm["hv"], -(-t // p)
  tqp, tsp, own = nq * p, -(-k.shape[1] // p) * p, lambda m: m
  q_lo, q_hi, _, _ = ranges(ids, p, config.band, one_run, kv_ids, shift)
  kv_ids = ids if kv_ids is None else kv_ids
  out, lse = _call(
      _fwd_kernel, (b, n, nq),
      [(_flat(q, tqp), (prm["h"], own)), (_flat(k, tsp), None),
       (_flat(v, tsp), None), (_ids(ids, tqp), None),
       (_ids(kv_ids, tsp), None), (q_lo, None), (q_hi, None)],
      [(jax.ShapeDtypeStruct((b, tqp, n * hv), q.dtype), (hv, own)),
       (jax.ShapeDtypeStruct((b, tqp, n), jnp.float32), None)],
      interpret, **prm)
  return out[:, :t].reshape(b, t, n, hv), lse[:, :t]


def backward(q, k, v, ids, out, lse, dout, config, p: int,
             interpret: bool | None = None, one_run: bool = True,
             kv_ids=None, shift: int = 0):
  """``(dq, dk, dv)`` of the block, from the given (global) ``out`` and
  ``lse`` (the ids, ``one_run`` and ``shift`` as :func:`forward`'s)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  prm = _params(q, k, v, config, p, shift)
  hv, nq, nk = prm["hv"], -(-t // p), -(-s // p)
  tqp, tsp, own = nq * p, nk * p, lambda m: m
  q_lo, q_hi, k_lo, k_hi = ranges(ids, p, config.band, one_run, kv_ids,
                                  shift)
  kv_ids = ids if kv_ids is None else kv_ids
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  q, dout = _flat(q, tqp), _flat(dout, tqp)
  k, v = _flat(k, tsp), _flat(v, tsp)
  rows = [(_flat(lse.astype(jnp.float32), tqp), None),
          (_flat(delta, tqp), None), (_ids(ids, tqp), None),
          (_ids(kv_ids, tsp), None)]
  (dq,) = _call(
      _dq_kernel, (b, n, nq),
      [(q, (h, own)), (k, None), (v, None), (dout, (hv, own))] + rows
      + [(q_lo, None), (q_hi, None)],
      [(jax.ShapeDtypeStruct((b, tqp, n * h), q.dtype), (h, own))],
      interpret, **prm)
  dk, dv = _call(
      _dkv_kernel, (b, kh, nk),
      [(q, None), (k, (h, own)), (v, (hv, own)), (dout, None)] + rows
      + [(k_lo, None), (k_hi, None)],
      [(jax.ShapeDtypeStruct((b, tsp, kh * h), k.dtype), (h, own)),
       (jax.ShapeDtypeStruct((b, tsp, kh * hv), v.dtype), (hv, own))],
      interpret, **prm)
  return (dq[:, :t].reshape(b, t, n, h), dk[:, :s].reshape(b, s, kh, h),
          dv[:, :s].reshape(b, s, kh, hv))
