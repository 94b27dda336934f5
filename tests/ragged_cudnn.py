"""What our cuDNN handlers compute on packed documents (ragged virtual
batches), written in jnp, so that the packed path's bookkeeping (length
classes, offsets, the calls' virtual batches, the stats' gather and
scatter, the calls writing into one buffer) runs on CPU against the float64
reference.

Each virtual batch ``i`` of row ``i // slots`` attends its query rows
``[q_start, q_start + q_len)`` to its keys ``[kv_start, kv_start +
kv_len)``, read from the ragged offsets, under cuDNN's top-left band within
the batch; a batch spans ``ragged_len`` rows and keys (the row's when 0):
rows and keys past it are not seen, as by cuDNN. Stats are ``(B * slots, N,
L)``, NaN past each batch's rows. The ``_into`` handlers write into the
buffers they are given; the others return NaN wherever they do not write,
so a result that leaks an unwritten row fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src.backends.cudnn.packed import RATIO

HIGHEST = jax.lax.Precision.HIGHEST


def _slots(q, k, operands, slots, ragged_len):
  """Per virtual batch: its row, (BM, L) query positions and validity,
  (BM, L) key positions and validity (L: the row's t and s if 0)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1:3]
  q_len, kv_len, rq, rk = operands[:4]
  bi = jnp.arange(b * slots) // slots
  q_start = rq[:-1] // (n * h) - bi * t
  kv_start = rk[:-1] // (kh * h) - bi * s
  a = jnp.arange(ragged_len or t)[None]
  c = jnp.arange(ragged_len or s)[None]
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


def _scatter(base, bi, pos, ok, x):
  rows = jnp.where(ok, pos, base.shape[1])  # out of range: dropped
  return base.at[bi, rows].set(x.astype(base.dtype), mode="drop")


def _nan(shape, dtype):
  return jnp.full(shape, jnp.nan, dtype)


def sdpa(name, results, q, k, v, *operands, aliases=None, **attrs):
  """Stands in for ``ffi.sdpa`` on the packed calls (``slots > 0``)."""
  slots, length = attrs["slots"], attrs.get("ragged_len", 0)
  assert slots > 0, "only the packed calls"
  into = name.endswith("_into")
  if into:
    n_acc = 1 if name.startswith("jax_ring_sdpa_fwd") else 3
    operands, acc = operands[:-n_acc], operands[-n_acc:]
    first = len(operands) + 3
    assert aliases == {first + i: i for i in range(n_acc)}, aliases
  if name.startswith("jax_ring_sdpa_fwd"):
    sl = _slots(q, k, operands, slots, length)
    bi, qpos, qok, kpos, kok = sl
    p, lse, _, _ = _probs(q, k, sl, attrs)
    vs = v[bi, jnp.clip(kpos, 0, v.shape[1] - 1)]
    vs = jnp.repeat(vs, q.shape[2] // k.shape[2], axis=2)
    out = jnp.einsum("bnqk,bknh->bqnh", p, vs, precision=HIGHEST)
    stats = jnp.where(qok[:, None, :], lse, jnp.nan)
    base = acc[0] if into else _nan(results[0].shape, results[0].dtype)
    return (_scatter(base, bi, qpos, qok, out), stats.astype(jnp.float32))
  assert name.startswith("jax_ring_sdpa_bwd"), name
  out, stats, dout, *rest = operands
  sl = _slots(q, k, rest, slots, length)
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
  bases = acc if into else tuple(_nan(x.shape, x.dtype) for x in (q, k, v))
  return (_scatter(bases[0], bi, qpos, qok, dq),
          _scatter(bases[1], bi, kpos, kok, dk),
          _scatter(bases[2], bi, kpos, kok, dv))


def expected_calls(ids, smallest, t):
  """The calls a row of one id array needs, counted in NumPy: documents by
  class (the smallest RATIO^c x ``smallest`` length at least theirs), per
  class the most in a row over that class's virtual batches a call."""
  lengths, top = [min(smallest, t)], t
  while lengths[-1] < top:
    lengths.append(min(lengths[-1] * RATIO, top))
  per_call = [max(1, -(-top // L)) for L in lengths]
  per_call[0] = t  # class 0: one call, its menu reaches T
  counts = np.zeros((ids.shape[0], len(lengths)), int)
  for row, r in enumerate(ids):
    _, n = np.unique(np.cumsum(np.r_[True, r[1:] != r[:-1]]),
                     return_counts=True)
    for length in n:
      counts[row, np.searchsorted(lengths, length)] += 1
  return int(sum(-(-counts[:, c].max() // per_call[c])
                 for c in range(len(lengths))))


def sdpa_pass(name, results, q, k, v, *operands, calls, aliases=None,
              **attrs):
  """Stands in for ``ffi.sdpa_pass``: every call the handler could make
  (each class's chunks of ``M_c`` entries, on slices of the tables and
  the stats as the handler points into them), replayed on all rows at
  once; chunks past a row's documents are empty and write nothing, as the
  handler's calls they stand for are not made. A call of fewer virtual
  batches (its class's menu) reads the start of its chunk, whose entries
  past the row's documents are empty: the same documents."""
  backward = name.startswith("jax_ring_sdpa_bwd")
  assert calls, "a pass names the graphs it may run"
  b, t, n, h = q.shape
  s, kh, hv = k.shape[1], k.shape[2], v.shape[3]
  head = 6 if backward else 3
  if backward:
    out, stats, dout, counts, lens, offs, *acc = operands
  else:
    counts, lens, offs, *acc = operands
  want = {head + 3 + i: i for i in range(len(acc))}
  assert (aliases or {}) == want, (aliases, want)
  lengths, slots, batches = attrs["lengths"], attrs["slots"], attrs["batches"]
  assert counts.shape == (len(lengths),), counts.shape
  ends = attrs["menu_ends"]
  for c, m in enumerate(batches):  # each class's menu ascends to its M_c
    menu = attrs["menu"][ends[c - 1] if c else 0:ends[c]]
    assert list(menu) == sorted(set(menu)) and menu[-1] == m, attrs
  one = dict(scale=attrs["scale"], row_start=0, col_start=0,
             right_bound=attrs["right_bound"], left_bound=attrs["left_bound"],
             padding=False, softcap=0.0)
  sizes = (n * h, kh * h, kh * hv, n * hv)
  rows = (t, s, s, t)
  row = jnp.arange(b, dtype=jnp.int32)[:, None]
  if not acc:  # fresh results: NaN wherever no call writes
    acc = [_nan(x.shape, x.dtype) for x in (results if backward else
                                            results[:1])]
  flat = _nan((b, sum(p * n * L for p, L in zip(slots, lengths))),
              jnp.float32)
  base = sbase = obase = 0
  for p, m, length in zip(slots, batches, lengths):
    for first in range(0, p, m):
      chunk = obase + first // m * (m + 4)
      ragged = [jnp.append((offs[j, :, chunk:chunk + m] +
                            row * rows[j] * sizes[j]).reshape(-1),
                           b * rows[j] * sizes[j]) for j in range(4)]
      e = base + first
      rows_ops = (lens[0, :, e:e + m].reshape(-1),
                  lens[1, :, e:e + m].reshape(-1), *ragged)
      at = dict(one, slots=m, ragged_len=length)
      lo, size = sbase + first * n * length, m * n * length
      if backward:
        st = stats[:, lo:lo + size].reshape(b * m, n, length)
        acc = list(sdpa("jax_ring_sdpa_bwd_into", results[:3], q, k, v, out,
                        st, dout, *rows_ops, *acc,
                        aliases={12: 0, 13: 1, 14: 2}, **at))
      else:
        o, st = sdpa("jax_ring_sdpa_fwd_into", results[:1], q, k, v,
                     *rows_ops, *acc, aliases={9: 0}, **at)
        acc = [o]
        flat = flat.at[:, lo:lo + size].set(st.reshape(b, size))
    base, sbase = base + p, sbase + p * n * length
    obase += p // m * (m + 4)
  return tuple(acc) if backward else (acc[0], flat)
