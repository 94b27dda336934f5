"""What our cuDNN handlers compute on packed documents (ragged virtual
batches), written in jnp, so that the packed path's bookkeeping (slots,
offsets, calls of SLOTS documents, the stats' gather and scatter, the
merge of the calls) runs on CPU against the float64 reference.

Each virtual batch ``i`` of row ``i // SLOTS`` attends its query rows
``[q_start, q_start + q_len)`` to its keys ``[kv_start, kv_start +
kv_len)``, read from the ragged offsets, under cuDNN's top-left band
within the batch; stats are ``(B * SLOTS, N, T)``. Everything a call does
not write is NaN, so a result that leaks an unwritten row fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _slots(q, k, operands, slots):
  """Per virtual batch: its row, (BM, T) query positions and validity,
  (BM, S) key positions and validity."""
  b, t, n, h = q.shape
  s, kh = k.shape[1:3]
  q_len, kv_len, rq, rk = operands[:4]
  bi = jnp.arange(b * slots) // slots
  q_start = rq[:-1] // (n * h) - bi * t
  kv_start = rk[:-1] // (kh * h) - bi * s
  a, c = jnp.arange(t)[None], jnp.arange(s)[None]
  return (bi[:, None], q_start[:, None] + a, a < q_len[:, None],
          kv_start[:, None] + c, c < kv_len[:, None])


def _probs(q, k, slots_, attrs, stats=None):
  """Scores' probabilities (BM, N, T, S) per virtual batch and the lse."""
  bi, qpos, qok, kpos, kok = slots_
  assert attrs["row_start"] == 0 and attrs["col_start"] == 0, attrs
  assert float(attrs["softcap"]) == 0.0, attrs
  t, s = qpos.shape[1], kpos.shape[1]
  qs = q[bi, jnp.clip(qpos, 0, q.shape[1] - 1)]
  ks = k[bi, jnp.clip(kpos, 0, k.shape[1] - 1)]
  ks = jnp.repeat(ks, q.shape[2] // k.shape[2], axis=2)
  logits = jnp.einsum("bqnh,bknh->bnqk", qs, ks, precision=HIGHEST,
                      preferred_element_type=jnp.float32) * attrs["scale"]
  a, c = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  allowed = qok[:, None, :, None] & kok[:, None, None, :]
  if attrs["right_bound"] >= 0:
    allowed &= c <= a + attrs["right_bound"]
  if attrs["left_bound"] >= 1:
    allowed &= c > a - attrs["left_bound"]
  logits = jnp.where(allowed, logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, -1) if stats is None else stats
  return jnp.where(allowed, jnp.exp(logits - lse[..., None]), 0.0), lse, qs, ks


def _scatter(shape, dtype, bi, pos, ok, x):
  rows = jnp.where(ok, pos, shape[1])  # out of range: dropped
  return jnp.full(shape, jnp.nan, dtype).at[bi, rows].set(
      x.astype(dtype), mode="drop")


def sdpa(name, results, q, k, v, *operands, **attrs):
  """Stands in for ``ffi.sdpa`` on the packed calls (``slots > 0``)."""
  slots = attrs["slots"]
  assert slots > 0, "only the packed calls"
  if name == "jax_ring_sdpa_fwd":
    sl = _slots(q, k, operands, slots)
    bi, qpos, qok, kpos, kok = sl
    p, lse, _, _ = _probs(q, k, sl, attrs)
    vs = v[bi, jnp.clip(kpos, 0, v.shape[1] - 1)]
    vs = jnp.repeat(vs, q.shape[2] // k.shape[2], axis=2)
    out = jnp.einsum("bnqk,bknh->bqnh", p, vs, precision=HIGHEST)
    stats = jnp.where(qok[:, None, :], lse, jnp.nan)
    return (_scatter(results[0].shape, results[0].dtype, bi, qpos, qok, out),
            stats.astype(jnp.float32))
  assert name == "jax_ring_sdpa_bwd", name
  out, stats, dout, *rest = operands
  sl = _slots(q, k, rest, slots)
  bi, qpos, qok, kpos, kok = sl
  p, _, qs, ks = _probs(q, k, sl, attrs, stats=stats)
  g = q.shape[2] // k.shape[2]
  vs = jnp.repeat(v[bi, jnp.clip(kpos, 0, v.shape[1] - 1)], g, axis=2)
  os_ = out[bi, jnp.clip(qpos, 0, q.shape[1] - 1)].astype(jnp.float32)
  do = dout[bi, jnp.clip(qpos, 0, q.shape[1] - 1)].astype(jnp.float32)
  delta = jnp.sum(do * os_, -1)  # (BM, T, N)
  dp = jnp.einsum("bqnh,bknh->bnqk", do, vs, precision=HIGHEST)
  ds = p * (dp - jnp.swapaxes(delta, 1, 2)[..., None])
  dq = jnp.einsum("bnqk,bknh->bqnh", ds, ks, precision=HIGHEST) * attrs[
      "scale"]

  def per_kv_head(x):  # (BM, S, N, H) -> (BM, S, K, H)
    return x.reshape(x.shape[:2] + (k.shape[2], g, x.shape[3])).sum(3)

  dk = per_kv_head(jnp.einsum("bnqk,bqnh->bknh", ds, qs,
                              precision=HIGHEST)) * attrs["scale"]
  dv = per_kv_head(jnp.einsum("bnqk,bqnh->bknh", p, do, precision=HIGHEST))
  return (_scatter(q.shape, q.dtype, bi, qpos, qok, dq),
          _scatter(k.shape, k.dtype, bi, kpos, kok, dk),
          _scatter(v.shape, v.dtype, bi, kpos, kok, dv))
