"""The one float64 reference every backend and strategy is compared against,
the tolerance table, and the test-input makers.

The reference is plain NumPy in float64: it materialises the (B, N, T, S)
score matrix, repeats K/V for GQA, and writes the gradients out by hand, so
that it shares no code (and no bug) with jax_ring.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_ring

# Max error allowed, relative to the largest magnitude of the expected array:
# |actual - expected| <= TOL[dtype] * max(1, max|expected|), elementwise.
# The floor of 1 is the scale of the unit-normal inputs: a gradient that is
# zero in exact arithmetic (one visible key) comes out as a cancellation
# residue of that scale times the dtype's epsilon.
# float32 is exact up to summation order. The 16-bit rows are set by the
# backend's own rounding of p and dS to the input dtype before the matmuls
# (as flash attention does), i.e. a few units of 2^-8 (bf16) or 2^-11 (f16).
TOLERANCES = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.float16): 4e-3,
    jnp.dtype(jnp.bfloat16): 3e-2,
}


def relative_error(actual, expected) -> float:
  """max |actual - expected| / max(1, max |expected|), the measure that
  ``TOLERANCES`` bounds."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  expected = np.asarray(expected, np.float64)
  return float(np.abs(actual - expected).max() /
               max(np.abs(expected).max(), 1.0))


def assert_close(actual, expected, dtype, name=""):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  scale = max(np.abs(expected).max(), 1.0)
  err = relative_error(actual, expected)
  assert err <= TOLERANCES[jnp.dtype(dtype)], (
      f"{name}: max error {err:.3g} x max|expected| ({scale:.3g}) exceeds "
      f"{TOLERANCES[jnp.dtype(dtype)]} for {jnp.dtype(dtype)}")


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem in reference terms (global positions)."""

  scale: float
  is_causal: bool = False
  window: tuple[int, int] | None = None
  soft_cap: float | None = None
  q_offset: int = 0
  kv_offset: int = 0
  q_segment_ids: np.ndarray | None = None
  kv_segment_ids: np.ndarray | None = None
  q_lengths: np.ndarray | None = None
  kv_lengths: np.ndarray | None = None
  dense: np.ndarray | None = None  # bool, broadcastable (B, N, T, S)


def visibility(case: Case, b, n, t, s):
  """(B, N, T, S) bool: which keys each query sees."""
  pq = case.q_offset + np.arange(t)[:, None]
  pk = case.kv_offset + np.arange(s)[None, :]
  vis = np.ones((b, n, t, s), bool)
  if case.is_causal:
    vis &= pk <= pq
  if case.window is not None:
    left, right = case.window
    vis &= (pk >= pq - left) & (pk <= pq + right)
  if case.q_segment_ids is not None:
    vis &= (case.q_segment_ids[:, None, :, None] ==
            case.kv_segment_ids[:, None, None, :])
  if case.q_lengths is not None:
    vis &= pq[None, None] < case.q_lengths[:, None, None, None]
  if case.kv_lengths is not None:
    vis &= pk[None, None] < case.kv_lengths[:, None, None, None]
  if case.dense is not None:
    vis &= np.broadcast_to(case.dense, vis.shape)
  return vis


def attention(q, k, v, case: Case, *, bias=None, dout=None, dlse=None,
              sinks=None):
  """Float64 attention of q (B,T,N,H), k (B,S,K,H), v (B,S,K,Hv).
  Returns out (B,T,N,Hv), lse (B,T,N) and, when
  ``dout`` is given, the grads dict {q, k, v, bias, sinks} of
  ``sum(out * dout) + sum(lse * dlse)``. ``sinks (N,)``: per head, one more
  logit in every row's softmax, with no value."""
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
             for x in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  z = np.einsum("btnh,bsnh->bnts", q, kr, optimize=True) * case.scale
  tcap = None
  if case.soft_cap is not None:
    tcap = np.tanh(z / case.soft_cap)
    z = case.soft_cap * tcap
  if bias is not None:
    z = z + np.asarray(jnp.asarray(bias, jnp.float32), np.float64)
  vis = visibility(case, b, n, t, s)
  seen = vis.any(-1)
  m = np.where(seen, np.where(vis, z, -np.inf).max(-1), 0.0)
  sink = None
  if sinks is not None:  # (B, N, T): the sink's logit in every row
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None],
                           m.shape)
    m = np.where(seen, np.maximum(m, sink), sink)
    seen = np.ones_like(seen)  # every row sees the sink
  e = np.where(vis, np.exp(np.where(vis, z, 0.0) - m[..., None]), 0.0)
  l = e.sum(-1) + (0.0 if sink is None else np.exp(sink - m))
  p = e / np.where(seen, l, 1.0)[..., None]
  out = np.einsum("bnts,bsnh->btnh", p, vr, optimize=True)
  lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)),
                 jax_ring.MASK_VALUE).transpose(0, 2, 1)
  if dout is None:
    return out, lse
  do = np.asarray(jnp.asarray(dout, jnp.float32), np.float64)
  dv = np.einsum("bnts,btnh->bsnh", p, do, optimize=True)
  dp = np.einsum("btnh,bsnh->bnts", do, vr, optimize=True)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  if dlse is not None:
    ds = ds + p * np.asarray(dlse, np.float64).transpose(0, 2, 1)[..., None]
  grads = {}
  if sink is not None:  # d lse / d s = p_s; d out / d s = -p_s out
    p_sink = np.exp(sink - lse.transpose(0, 2, 1))
    d_lse = 0.0 if dlse is None else np.asarray(
        dlse, np.float64).transpose(0, 2, 1)
    grads["sinks"] = (p_sink * (d_lse - (dp * p).sum(-1))).sum((0, 2))
  if bias is not None:
    axes = tuple(i for i in range(2) if np.shape(bias)[i] == 1)
    grads["bias"] = ds.sum(axis=axes, keepdims=True)
  if tcap is not None:
    ds = ds * (1 - tcap**2)
  ds = ds * case.scale
  grads["q"] = np.einsum("bnts,bsnh->btnh", ds, kr, optimize=True)
  sum_groups = lambda x: x.reshape(b, s, kh, g, x.shape[-1]).sum(3)
  grads["k"] = sum_groups(np.einsum("bnts,btnh->bsnh", ds, q, optimize=True))
  grads["v"] = sum_groups(dv)
  return out, lse, grads


def block_mask(case: Case) -> jax_ring.BlockMask:
  """The same problem as jax_ring's runtime mask operands."""
  arr = lambda x: None if x is None else jnp.asarray(x)
  return jax_ring.BlockMask(
      q_offset=case.q_offset, kv_offset=case.kv_offset,
      q_segment_ids=arr(case.q_segment_ids),
      kv_segment_ids=arr(case.kv_segment_ids), q_lengths=arr(case.q_lengths),
      kv_lengths=arr(case.kv_lengths), dense=arr(case.dense))


def config(case: Case, **kw) -> jax_ring.AttentionConfig:
  return jax_ring.AttentionConfig(
      scale=case.scale, is_causal=case.is_causal, local_window=case.window,
      logits_soft_cap=case.soft_cap, implementation="xla", **kw)


def random_qkv(seed, b, t, s, n, kh, h, dtype=jnp.float32, hv=None):
  """Fresh normal q, k, v and an output cotangent (never zeros); ``hv``:
  the value (and output) head dim, default ``h``."""
  hv = hv or h
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, hv), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (b, t, n, hv), jnp.float32).astype(dtype)
  return q, k, v, do


def shard_code(s, devices, layout=None, layout_cp=None, step=0.5):
  """(1, S, 1, 1) float32, in natural token order: ``r * step`` on the
  tokens device r holds when the sequence, put in ``layout`` (for
  ``layout_cp`` devices, default ``devices``; None: contiguous), is split
  evenly over ``devices``. Added to test inputs, it makes a shard that
  lands on the wrong device change the numbers."""
  owner = jnp.repeat(jnp.arange(devices), s // devices)[None]  # layout order
  if layout:
    owner = jax_ring.reorder_from_load_balance(owner, layout_cp or devices,
                                               layout=layout)
  return (owner[0] * step).astype(jnp.float32)[None, :, None, None]


def random_segments(seed, b, length, num_segments):
  """Sorted packed-document ids (documents of random lengths) per row."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.integers(0, length, (b, num_segments - 1)), axis=1)
  return (np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(
      np.int32)


def spread(ids):
  """The same documents under ids far apart: more values between a row's
  least and greatest id than it has tokens (ids a table cannot place)."""
  return np.asarray(ids, np.int32) * 1_000_003 - 77
