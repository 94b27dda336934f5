"""cuDNN backend: the block-kernel contract on cuDNN's fused flash attention.

The C++ side (``csrc/``) holds two XLA FFI handlers, ``jax_ring_sdpa_fwd``
and ``jax_ring_sdpa_bwd``; this module registers them with jax when the
extension ``jax_ring._cudnn`` is built (``JAX_RING_CUDNN=ON pip install``),
maps a block's mask onto cuDNN's, and registers the ``"cudnn"`` backend.

Mask mapping. With static offsets, query ``i`` sees key ``j`` of the block
iff ``lower <= j - i <= upper``, where ``d = q_offset - kv_offset``,
``upper = d + min(right, 0 if causal)`` and ``lower = d - left``. cuDNN's
top-left band keeps ``i' - left_bound < j' <= i' + right_bound`` and needs
``right_bound >= 0`` and ``left_bound >= 1``, so a diagonal that leaves the
block is shifted back into it by skipping rows and columns:

==========================  ================================================
``row_start = max(0, -upper)``  rows above it see no key (output 0)
``col_start = max(0, lower + row_start)``  keys left of it are never seen
``right_bound = upper + row_start - col_start``  (>= 0)
``left_bound = col_start - lower - row_start + 1``  (>= 1)
==========================  ================================================

The handlers start their q/out/dq pointers at ``row_start`` and their
k/v/dk/dv pointers at ``col_start``, so nothing is copied. Padding lengths
(global positions) become per-batch lengths of that window. Rows that see no
key get ``out = 0`` and ``lse = MASK_VALUE`` here, whatever cuDNN wrote.

A soft cap is a cuDNN score modifier; cuDNN then takes the band inside the
modifier and has no padding mask, so soft cap with padding is not served.

Not served (the dispatcher uses ``"xla"``): float32 (cuDNN computes in
16-bit; we do not cast silently), bias, dense masks, segment ids, soft cap
with padding, traced offsets, head_dim not a multiple of 8 or above 256, and a backward
with an ``lse`` cotangent (cuDNN's backward has no input for it; that call
alone runs on ``xla``).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src import backends, xla_backend
from jax_ring._src.xla_backend import MASK_VALUE

try:
  _cudnn = importlib.import_module("jax_ring._cudnn")
  LOAD_ERROR = None
except ImportError as e:  # not built: a CPU install, or a failed build
  _cudnn = None
  LOAD_ERROR = str(e)

_NONE = 1 << 62  # "no bound" while computing the band


@dataclasses.dataclass(frozen=True)
class Band:
  """cuDNN's view of one block's causal/window mask (see module doc)."""

  row_start: int = 0
  col_start: int = 0
  right_bound: int = -1  # < 0: none
  left_bound: int = 0  # < 1: none
  empty: bool = False  # no query sees any key


def band(config, q_offset: int, kv_offset: int, t: int, s: int) -> Band:
  d = q_offset - kv_offset
  right = 0 if config.is_causal else _NONE
  left = _NONE
  if config.local_window is not None:
    left, r = config.local_window
    right = min(right, r)
  if right == _NONE and left == _NONE:
    return Band()
  upper = d + right if right != _NONE else _NONE
  lower = d - left if left != _NONE else -_NONE
  row = max(0, -upper) if upper != _NONE else 0
  col = max(0, lower + row) if lower != -_NONE else 0
  if row >= t or col >= s:
    return Band(empty=True)
  return Band(
      row_start=row, col_start=col,
      right_bound=upper + row - col if upper != _NONE else -1,
      left_bound=col - lower - row + 1 if lower != -_NONE else 0)


def _needs_padding(mask, bnd: Band, t, s) -> bool:
  """Whether cuDNN's padding mask (per-batch lengths) must be on."""
  rows, cols = t - bnd.row_start, s - bnd.col_start
  # cuDNN refuses a left bound with more rows than keys unless padded.
  return (mask.q_lengths is not None or mask.kv_lengths is not None or
          (bnd.left_bound >= 1 and rows > cols))


def _window_lengths(mask, bnd: Band, b, t, s):
  """Per-batch (B,) int32 lengths of the shifted window, and whether the
  padding mask is needed at all."""
  rows, cols = t - bnd.row_start, s - bnd.col_start
  seq_q = jnp.full((b,), rows, jnp.int32)
  seq_kv = jnp.full((b,), cols, jnp.int32)
  if mask.q_lengths is not None:
    seq_q = jnp.clip(mask.q_lengths - mask.q_offset - bnd.row_start, 0, rows)
  if mask.kv_lengths is not None:
    seq_kv = jnp.clip(mask.kv_lengths - mask.kv_offset - bnd.col_start, 0,
                      cols)
  return seq_q, seq_kv, _needs_padding(mask, bnd, t, s)


def _rows_may_be_empty(bnd: Band, padding, t, s):
  """Statically: can some row see no key (so its output must be zeroed)?"""
  rows, cols = t - bnd.row_start, s - bnd.col_start
  # The last row's first visible key is rows - left_bound.
  return (padding or bnd.row_start > 0 or
          (bnd.left_bound >= 1 and rows - bnd.left_bound >= cols))


def _row_valid(bnd: Band, seq_q, seq_kv, t):
  """(B, T) bool: the row sees at least one key."""
  i = jnp.arange(t, dtype=jnp.int32)[None, :] - bnd.row_start
  first = jnp.zeros_like(i)
  last = seq_kv[:, None] - 1
  if bnd.left_bound >= 1:
    first = jnp.maximum(first, i - bnd.left_bound + 1)
  if bnd.right_bound >= 0:
    last = jnp.minimum(last, i + bnd.right_bound)
  return (i >= 0) & (i < seq_q[:, None]) & (first <= last)


def _col_valid(bnd: Band, seq_kv, s):
  j = jnp.arange(s, dtype=jnp.int32)[None, :] - bnd.col_start
  return (j >= 0) & (j < seq_kv[:, None])


def _attrs(config, bnd: Band, padding: bool):
  return dict(scale=np.float32(config.scale), row_start=bnd.row_start,
              col_start=bnd.col_start, right_bound=bnd.right_bound,
              left_bound=bnd.left_bound, padding=padding,
              softcap=np.float32(config.logits_soft_cap or 0.0))


def forward(q, k, v, bias, mask, config):
  del bias  # not served (see unsupported)
  b, t, n, _ = q.shape
  s = k.shape[1]
  bnd = band(config, mask.q_offset, mask.kv_offset, t, s)
  if bnd.empty:
    return jnp.zeros_like(q), jnp.full((b, t, n), MASK_VALUE, jnp.float32)
  seq_q, seq_kv, padding = _window_lengths(mask, bnd, b, t, s)
  rows = t - bnd.row_start
  out, stats = jax.ffi.ffi_call(
      "jax_ring_sdpa_fwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((b, n, rows), jnp.float32)),
  )(q, k, v, seq_q, seq_kv, **_attrs(config, bnd, padding))
  lse = jnp.pad(jnp.swapaxes(stats, 1, 2), ((0, 0), (bnd.row_start, 0), (0, 0)))
  if _rows_may_be_empty(bnd, padding, t, s):
    valid = _row_valid(bnd, seq_q, seq_kv, t)
    out = jnp.where(valid[:, :, None, None], out, 0)
    lse = jnp.where(valid[:, :, None], lse, MASK_VALUE)
  return out, lse


def backward(q, k, v, bias, mask, out, lse, dout, dlse, config):
  if dlse is not None:  # cuDNN's backward has no lse-cotangent input
    return xla_backend.backward(q, k, v, bias, mask, out, lse, dout, dlse,
                                config)
  b, t, _, _ = q.shape
  s = k.shape[1]
  bnd = band(config, mask.q_offset, mask.kv_offset, t, s)
  if bnd.empty:
    return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), None
  seq_q, seq_kv, padding = _window_lengths(mask, bnd, b, t, s)
  stats = jnp.swapaxes(lse[:, bnd.row_start:], 1, 2).astype(jnp.float32)
  dq, dk, dv = jax.ffi.ffi_call(
      "jax_ring_sdpa_bwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
  )(q, k, v, out, stats, dout, seq_q, seq_kv, **_attrs(config, bnd, padding))
  if _rows_may_be_empty(bnd, padding, t, s):
    dq = jnp.where(_row_valid(bnd, seq_q, seq_kv, t)[:, :, None, None], dq, 0)
  if padding or bnd.col_start:
    keep = _col_valid(bnd, seq_kv, s)[:, :, None, None]
    dk, dv = jnp.where(keep, dk, 0), jnp.where(keep, dv, 0)
  return dq, dk, dv, None


def unsupported(config, query, key, bias, mask) -> str | None:
  """Why cuDNN cannot serve this call, or None."""
  if jax.default_backend() != "gpu":
    return f"platform {jax.default_backend()!r} (cuDNN needs an NVIDIA GPU)"
  if query.dtype not in (jnp.bfloat16, jnp.float16):
    return (f"dtype {query.dtype} (cuDNN takes bfloat16 or float16; float32 "
            "runs on implementation='xla')")
  h = query.shape[-1]
  if h % 8 or h > 256:
    return f"head_dim {h} (cuDNN needs a multiple of 8, at most 256)"
  for name, value in (("bias", bias), ("mask", mask.dense),
                      ("segment_ids", mask.q_segment_ids)):
    if value is not None:
      return name
  for name in ("q_offset", "kv_offset"):
    if not isinstance(getattr(mask, name), (int, np.integer)):
      return f"a traced {name} (cuDNN's diagonal is fixed when it compiles)"
  if config.logits_soft_cap is not None:
    t, s = query.shape[1], key.shape[1]
    bnd = band(config, mask.q_offset, mask.kv_offset, t, s)
    if _needs_padding(mask, bnd, t, s):
      return ("logits_soft_cap with padding lengths (cuDNN's score modifier "
              "excludes its padding mask)")
  return None


if _cudnn is not None:
  for _name, _capsule in _cudnn.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
  backends.register(backends.Backend("cudnn", forward, backward, unsupported,
                                     platform="cuda"))
