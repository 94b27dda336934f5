"""The cuDNN backend: the block-kernel contract on cuDNN's fused flash
attention, through our XLA FFI handlers (``ffi``), with a block's mask
mapped onto cuDNN's band (``band``) and packed documents onto ragged
virtual batches sized by their length class (``packed``). It registers as
``"cudnn"`` when the extension is built (``JAX_RING_CUDNN=ON pip
install``).

Rows that see no key get ``out = 0`` and ``lse = MASK_VALUE``, whatever
cuDNN wrote. A soft cap is a cuDNN score modifier; cuDNN then takes the
band inside the modifier and has no padding mask, so soft cap with padding
is not served.

The value head dim Hv may differ from the query/key head dim H (multi-head
latent attention: H = 192, Hv = 128): ``out`` and ``dout`` are ``(B, T, N,
Hv)``. cuDNN writes dK/dV into one stacked buffer (:func:`backward_dkv`)
only when H == Hv.

Not served (the registry picks ``"xla"``): float32 (cuDNN computes in
16-bit; we do not cast silently), bias, dense masks, soft cap with padding
or segment ids, segment ids with padding lengths, with a window between
different id arrays or with a causal diagonal before the keys' start
(kv_offset < q_offset), traced offsets, head dims outside cuDNN's
(:func:`unsupported_head_dims`), and a backward with an ``lse`` cotangent
(cuDNN's backward has no input for it; that call alone runs on ``xla``).
How each mask maps onto cuDNN: docs/design.md, "The cuDNN backend".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src.backends import xla
from jax_ring._src.backends.cudnn import band, ffi, packed, passes, tiles
from jax_ring._src.backends.cudnn.ffi import (LOAD_ERROR, attrs,
                                              graph_counts, no_ragged,
                                              recording, sdpa, use_graphs,
                                              version, workspace_bytes)
from jax_ring._src.core import registry
from jax_ring._src.core.mask import MASK_VALUE


__all__ = ["LOAD_ERROR", "backward", "backward_dkv",
           "forward", "graph_counts", "recording", "unsupported",
           "unsupported_head_dims", "use_graphs", "version",
           "workspace_bytes"]


def _packed(q, k, mask):
  """The module that runs a packed block: one handler a pass where it
  serves the shapes, else the calls' switch and loop."""
  return passes if passes.ENABLED and passes.serves(
      q, k, mask.same_ids) else packed


def prepare(q, k, v, mask, config, lse=None):
  """``passes.Prepared`` where this block runs as one packed pass (``lse``
  given: the backward's), else None: the registry's ``prepare``."""
  if (mask.q_segment_ids is None or unsupported(config, q, k, v, None, mask)
      or tiles.direct(q, k, v, mask, config)
      or _packed(q, k, mask) is not passes):
    return None
  bnd = band.band(config, mask.q_offset, mask.kv_offset, q.shape[1],
                  k.shape[1])
  return None if bnd.empty else passes.prepare(q, k, v, mask, config, bnd,
                                               lse)


def forward(q, k, v, bias, mask, config):
  """``(out (B, T, N, Hv), lse (B, T, N) float32)``: the block-kernel
  forward (``core/kernel.py``)."""
  if unsupported(config, q, k, v, bias, mask):
    # The strategy resolved cudnn on a representative block; this one (say,
    # a ring block whose q and kv ids differ under a band) it cannot serve.
    return xla.forward(q, k, v, bias, mask, config)
  b, t, n, _ = q.shape
  s = k.shape[1]
  out_shape = jax.ShapeDtypeStruct((b, t, n, v.shape[3]), q.dtype)
  bnd = band.band(config, mask.q_offset, mask.kv_offset, t, s)
  if bnd.empty:
    return (jnp.zeros(out_shape.shape, out_shape.dtype),
            jnp.full((b, t, n), MASK_VALUE, jnp.float32))
  if mask.q_segment_ids is not None:
    if tiles.direct(q, k, v, mask, config):
      return tiles.direct_forward(q, k, v, mask, config)
    return _packed(q, k, mask).forward(q, k, v, mask, config, bnd)
  seq_q, seq_kv, padding = band.window_lengths(mask, bnd, b, t, s)
  rows = t - bnd.row_start
  out, stats = sdpa(
      "jax_ring_sdpa_fwd",
      (out_shape, jax.ShapeDtypeStruct((b, n, rows), jnp.float32)),
      q, k, v, seq_q, seq_kv, *no_ragged(), **attrs(config, bnd, padding))
  lse = jnp.pad(jnp.swapaxes(stats, 1, 2), ((0, 0), (bnd.row_start, 0), (0, 0)))
  if band.rows_may_be_empty(bnd, padding, t, s):
    valid = band.row_valid(bnd, seq_q, seq_kv, t)
    out = jnp.where(valid[:, :, None, None], out, 0)
    lse = jnp.where(valid[:, :, None], lse, MASK_VALUE)
  return out, lse


def backward(q, k, v, bias, mask, out, lse, dout, dlse, config):
  """``(dq, dk, dv, None)``, each like its input: the block-kernel backward
  (``core/kernel.py``)."""
  dq, (dk, dv) = _backward(q, k, v, bias, mask, out, lse, dout, dlse, config,
                           stack=False)
  return dq, dk, dv, None


def backward_dkv(q, k, v, bias, mask, out, lse, dout, dlse, config):
  """As :func:`backward`, with dK/dV written by cuDNN into one stacked
  ``(2, B, S, K, H)`` buffer (the ring's wire layout): no stacking copy.
  Only for K and V of one shape (H == Hv); the kernel calls
  :func:`backward` otherwise."""
  if k.shape != v.shape:
    raise ValueError(f"stacked dK/dV need key and value of one shape; got "
                     f"key {k.shape} and value {v.shape}")
  dq, dkv = _backward(q, k, v, bias, mask, out, lse, dout, dlse, config,
                      stack=True)
  return dq, dkv, None


def _backward(q, k, v, bias, mask, out, lse, dout, dlse, config, stack):
  """(dq, dK/dV): a stacked (2, B, S, K, H) array if ``stack``, else a
  (dk, dv) pair."""
  pack = (lambda dk, dv: jnp.stack([dk, dv])) if stack else (
      lambda dk, dv: (dk, dv))
  # No lse-cotangent input in cuDNN's backward; other options as forward.
  if dlse is not None or unsupported(config, q, k, v, bias, mask):
    dq, dk, dv, _ = xla.backward(q, k, v, bias, mask, out, lse, dout,
                                         dlse, config)
    return dq, pack(dk, dv)
  b, t, _, _ = q.shape
  s = k.shape[1]
  bnd = band.band(config, mask.q_offset, mask.kv_offset, t, s)
  if bnd.empty:
    return jnp.zeros_like(q), pack(jnp.zeros_like(k), jnp.zeros_like(v))
  if mask.q_segment_ids is not None:
    dq, dk, dv = (
        tiles.direct_backward(q, k, v, mask, out, lse, dout, config)
        if tiles.direct(q, k, v, mask, config) else _packed(q, k, mask)
        .backward(q, k, v, mask, out, lse, dout, config, bnd))
    return dq, pack(dk, dv)
  seq_q, seq_kv, padding = band.window_lengths(mask, bnd, b, t, s)
  stats = jnp.swapaxes(lse[:, bnd.row_start:], 1, 2).astype(jnp.float32)
  grads = (jax.ShapeDtypeStruct((2,) + k.shape, k.dtype),) if stack else (
      jax.ShapeDtypeStruct(k.shape, k.dtype),
      jax.ShapeDtypeStruct(v.shape, v.dtype))
  dq, *dkv = sdpa(
      "jax_ring_sdpa_bwd_dkv" if stack else "jax_ring_sdpa_bwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),) + grads,
      q, k, v, out, stats, dout, seq_q, seq_kv, *no_ragged(),
      **attrs(config, bnd, padding))
  dkv = dkv[0] if stack else tuple(dkv)
  if band.rows_may_be_empty(bnd, padding, t, s):
    valid = band.row_valid(bnd, seq_q, seq_kv, t)[:, :, None, None]
    dq = jnp.where(valid, dq, 0)
  if padding or bnd.col_start:
    keep = band.col_valid(bnd, seq_kv, s)[:, :, None, None]
    dkv = jax.tree.map(lambda x: jnp.where(keep, x, 0), dkv)
  return dq, dkv


def unsupported(config, query, key, value, bias, mask) -> str | None:
  """Why cuDNN cannot serve this call, or None."""
  if jax.default_backend() != "gpu":
    return f"platform {jax.default_backend()!r} (cuDNN needs an NVIDIA GPU)"
  if query.dtype not in (jnp.bfloat16, jnp.float16):
    return (f"dtype {query.dtype} (cuDNN takes bfloat16 or float16; float32 "
            "runs on implementation='xla')")
  why = unsupported_head_dims(query.shape[-1], value.shape[-1])
  if why:
    return why
  for name, x in (("bias", bias), ("mask", mask.dense)):
    if x is not None:
      return name
  for name in ("q_offset", "kv_offset"):
    if not isinstance(getattr(mask, name), (int, np.integer)):
      return f"a traced {name} (cuDNN's diagonal is fixed when it compiles)"
  if mask.q_segment_ids is not None:
    why = packed.unsupported_ids(config, query, key, value, mask)
    if why:
      return why
  if config.logits_soft_cap is not None:
    t, s = query.shape[1], key.shape[1]
    bnd = band.band(config, mask.q_offset, mask.kv_offset, t, s)
    if band.needs_padding(mask, bnd, t, s):
      return ("logits_soft_cap with padding lengths (cuDNN's score modifier "
              "excludes its padding mask)")
  return None


def unsupported_head_dims(h: int, hv: int) -> str | None:
  """Why cuDNN cannot take query/key head dim ``h`` with value head dim
  ``hv``, or None. The rule is cuDNN frontend 1.32's for 16-bit SDPA on
  Hopper (``sdpa_support_surface.h``, and the backward's check in
  ``scaled_dot_product_flash_attention.h``): each a multiple of 8 and at
  most 256 (the backward's bound), in any pair; and on cuDNN 9.11-9.12
  ``128 < h <= 192`` with ``64 < hv <= 128`` only where h = 192 or hv =
  128."""
  dims = f"query/key head dim {h} with value head dim {hv}"
  if h % 8 or hv % 8 or h > 256 or hv > 256:
    return f"{dims} (cuDNN needs each a multiple of 8, at most 256)"
  if (91100 <= (version() or 0) < 91300 and 128 < h <= 192 and
      64 < hv <= 128 and h != 192 and hv != 128):
    return (f"{dims} on cuDNN {version()} (9.11-9.12 take 128 < H <= 192 "
            "with 64 < Hv <= 128 only as H = 192 or Hv = 128)")
  return None


if LOAD_ERROR is None:
  ffi.register_targets()
  registry.register(registry.Backend("cudnn", forward, backward, unsupported,
                                     platform="cuda",
                                     backward_dkv=backward_dkv,
                                     prepare=prepare))
else:
  registry.UNAVAILABLE["cudnn"] = LOAD_ERROR
