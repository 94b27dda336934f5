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

Packed documents (segment ids) use ragged offsets, not a copy into a padded
batch: each row's runs of equal query ids become up to ``SLOTS`` virtual
batches ``b * SLOTS + j`` that start, in place, at the run's first query
and at the first key with that id, with the run's and the key range's
lengths as sequence lengths. The mask then applies inside each document:

==========================  ================================================
query and kv ids            served masks
==========================  ================================================
one array (same ids)        all: causal/window bands hold per document,
                            because its queries and keys are the same tokens
two different arrays        none (non-causal, no window): a ring's
                            off-diagonal blocks
two arrays, or one with     causal, no window, keys at or after the queries
kv_offset > q_offset        (kv_offset >= q_offset): the striped ring's
                            steps (see below)
==========================  ================================================

A causal mask between two id arrays keeps key b for query a iff ``b <= a -
shift`` (``shift = kv_offset - q_offset``) within a document. Each slot
then starts its queries at ``kv_start + shift``, its first key's diagonal,
and is served by the plain top-left causal mask: the rows before it see no
key of their document (out 0, lse MASK_VALUE, dq 0). That is exact when no
document's first key lies before its first query's diagonal (``kv_start +
shift >= q_start``), which the striped layout guarantees (a document's
local start moves by at most one token between devices, in the direction
of the shift) and which ``fits`` checks at run time.

Whether a row's ids fit (at most ``SLOTS`` runs, each id one contiguous run
on both sides) is only known at run time, so a ``lax.cond`` sends a batch
that does not fit to the ``xla`` backend. The stats of the ragged graph are
``(B * SLOTS, N, T)``, gathered back to ``(B, T, N)``.

Not served (the dispatcher uses ``"xla"``): float32 (cuDNN computes in
16-bit; we do not cast silently), bias, dense masks, soft cap with padding
or segment ids, segment ids with padding lengths, with a window between
different id arrays or with a causal diagonal before the keys' start
(kv_offset < q_offset), traced offsets, head_dim not a multiple of 8 or above
256, and a backward with an ``lse`` cotangent (cuDNN's backward has no input
for it; that call alone runs on ``xla``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib import xla_client

from jax_ring._src import backends, xla_backend
from jax_ring._src.xla_backend import MASK_VALUE

try:
  _cudnn = importlib.import_module("jax_ring._cudnn")
  LOAD_ERROR = None
except ImportError as e:  # not built: a CPU install, or a failed build
  _cudnn = None
  LOAD_ERROR = str(e)

_NONE = 1 << 62  # "no bound" while computing the band

# Packed documents per batch row that the ragged path serves. Its stats
# buffer is SLOTS x the dense one, and rows with more documents fall back
# to xla at run time.
SLOTS = 16


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


def _attrs(config, bnd: Band, padding: bool, slots: int = 0):
  return dict(scale=np.float32(config.scale), row_start=bnd.row_start,
              col_start=bnd.col_start, right_bound=bnd.right_bound,
              left_bound=bnd.left_bound, padding=padding,
              softcap=np.float32(config.logits_soft_cap or 0.0), slots=slots)


# The cuDNN calls traced inside ``recording()`` (else None): each one's
# handler, q/k shapes, dtype and attributes, enough to rebuild its graph.
_RECORD: list | None = None


def _sdpa(name, results, q, k, *operands, **attrs):
  """``jax.ffi.ffi_call`` of handler ``name`` (q and k lead the operands),
  noted in the active recording.

  The call's cuDNN graph is built here, at trace time, for its workspace
  size: XLA allocates the workspace as one more (discarded) result, so the
  handler allocates nothing, a compiled program's memory analysis counts
  it, and the call can be traced into a CUDA graph (command buffer)."""
  call = dict(backward=name.startswith("jax_ring_sdpa_bwd"), q=q.shape,
              k=k.shape, dtype=jnp.dtype(q.dtype).name,
              **{a: x.item() if hasattr(x, "item") else x
                 for a, x in attrs.items()})
  if _RECORD is not None:
    _RECORD.append(call)
  workspace = jax.ShapeDtypeStruct((workspace_bytes(call),), jnp.uint8)
  return jax.ffi.ffi_call(name, (*results, workspace))(q, k, *operands,
                                                        **attrs)[:-1]


@contextlib.contextmanager
def recording():
  """Collect the cuDNN calls traced inside (a list of dicts, for
  :func:`workspace_bytes`). Tracing happens once per input shapes: call
  ``jax.clear_caches()`` first to see a function traced before."""
  global _RECORD
  outer, _RECORD = _RECORD, []
  try:
    yield _RECORD
  finally:
    _RECORD = outer


def workspace_bytes(call: dict, device: int = 0) -> int:
  """cuDNN's workspace for one recorded call, from its graph (built and
  cached as at run time, on local GPU ``device``)."""
  if _cudnn is None:
    raise RuntimeError(f"the cuDNN extension is not loaded: {LOAD_ERROR}")
  (b, t, n, h), (_, s, k, _) = call["q"], call["k"]
  return _cudnn.workspace_bytes(
      call["backward"], call["dtype"] == "bfloat16", device, b, t, s, n, k,
      h, call["slots"], call["row_start"], call["col_start"],
      call["right_bound"], call["left_bound"], call["padding"],
      call["scale"], call["softcap"])


def _no_ragged():
  """Placeholder ragged-offset operands of an unpacked call (built at trace
  time: creating arrays at import would start jax's backends)."""
  return (jnp.zeros((1,), jnp.int32),) * 2


# --- packed documents: ragged virtual batches --------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Docs:
  """Up to SLOTS documents per row. (B, M) int32 starts and lengths of each
  slot's query run and key range; ``slot (B, T)`` of each query token."""

  q_start: jax.Array
  q_len: jax.Array
  kv_start: jax.Array
  kv_len: jax.Array
  slot: jax.Array
  fits: jax.Array  # () bool: every row fits the slots, ids contiguous


def _documents(q_ids, kv_ids, shift: int | None = None) -> _Docs:
  """The slots of each row; ``shift``: a causal mask between two id arrays
  (``b <= a - shift``, see the module doc), whose slots start their queries
  at their first key's diagonal."""
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  new = jnp.concatenate([jnp.ones((b, 1), bool),
                         q_ids[:, 1:] != q_ids[:, :-1]], 1)
  slot = jnp.cumsum(new, 1, dtype=jnp.int32) - 1
  j = jnp.arange(SLOTS, dtype=jnp.int32)[None, :, None]
  in_slot = slot[:, None, :] == j  # (B, M, T)
  q_len = in_slot.sum(-1, dtype=jnp.int32)
  q_start = jnp.where(in_slot, jnp.arange(t, dtype=jnp.int32), t).min(-1)
  ids = jnp.take_along_axis(q_ids, jnp.minimum(q_start, t - 1), 1)  # (B, M)
  q_count = (q_ids[:, None, :] == ids[:, :, None]).sum(-1, dtype=jnp.int32)
  hit = kv_ids[:, None, :] == ids[:, :, None]  # (B, M, S)
  kv_len = hit.sum(-1, dtype=jnp.int32)
  pos = jnp.arange(s, dtype=jnp.int32)
  kv_start = jnp.where(hit, pos, s).min(-1)
  kv_last = jnp.where(hit, pos, -1).max(-1)
  used = q_len > 0
  fits = (jnp.all(slot[:, -1] < SLOTS) & jnp.all(~used | (q_count == q_len))
          & jnp.all(~used | (kv_len == 0) | (kv_last - kv_start + 1 == kv_len)))
  # Unused slots: empty, starting at the row's end.
  q_start = jnp.where(used, q_start, t)
  kv_len = jnp.where(used, kv_len, 0)
  kv_start = jnp.where(kv_len > 0, kv_start, s)
  if shift is not None:
    keys = kv_len > 0
    diagonal = kv_start + shift
    fits &= jnp.all(~keys | (diagonal >= q_start))
    first = jnp.where(keys, jnp.clip(diagonal, q_start, q_start + q_len),
                      q_start)
    q_start, q_len = first, q_start + q_len - first
  return _Docs(q_start, q_len, kv_start, kv_len, jnp.minimum(slot, SLOTS - 1),
               fits)


def _offsets(start, rows, heads, h):
  """(B * M + 1,) element offsets of each slot's first row in a BSHD buffer
  of ``rows`` rows per batch; the last entry is the buffer's end."""
  b = start.shape[0]
  first = (jnp.arange(b, dtype=jnp.int32)[:, None] * rows + start)
  return jnp.append(first.reshape(-1) * heads * h, b * rows * heads * h)


def _doc_rows(docs: _Docs, q, k):
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  return (docs.q_len.reshape(-1), docs.kv_len.reshape(-1),
          _offsets(docs.q_start, t, n, h), _offsets(docs.kv_start, s, kh, h))


def _doc_index(docs: _Docs, t):
  """(batch, slot, row-in-document) indices of each query token, (B, T)."""
  bi = jnp.arange(docs.slot.shape[0])[:, None]
  row = jnp.arange(t)[None, :] - jnp.take_along_axis(docs.q_start, docs.slot,
                                                     1)
  return bi, docs.slot, row


def _doc_row_valid(docs: _Docs, t):
  """(B, T): the query lies in its slot (at or after the slot's start) and
  its document has keys (bands keep the slot's diagonal)."""
  _, _, row = _doc_index(docs, t)
  return (jnp.take_along_axis(docs.kv_len, docs.slot, 1) > 0) & (row >= 0)


def _doc_col_valid(docs: _Docs, s):
  """(B, S): the key lies in some slot's key range."""
  j = jnp.arange(s)[None, None, :]
  inside = (j >= docs.kv_start[:, :, None]) & (
      j < (docs.kv_start + docs.kv_len)[:, :, None])
  return inside.any(1)


def _diagonal_shift(config, mask) -> int | None:
  """``kv_offset - q_offset`` of a causal mask (no window) that the slots
  must carry (two id arrays, or unequal offsets); None otherwise."""
  same = mask.kv_segment_ids is None or (
      mask.kv_segment_ids is mask.q_segment_ids)
  if not config.is_causal or config.local_window is not None or (
      same and mask.q_offset == mask.kv_offset):
    return None
  return mask.kv_offset - mask.q_offset


def _packed_slots(config, mask, bnd: Band) -> tuple[_Docs, Band]:
  """The slots of a packed call and the band cuDNN applies inside each."""
  shift = _diagonal_shift(config, mask)
  docs = _documents(mask.q_segment_ids, mask.kv_ids(), shift)
  return docs, bnd if shift is None else Band(right_bound=0)


def _packed_forward(q, k, v, docs: _Docs, config, bnd: Band):
  b, t, n, _ = q.shape
  out, stats = _sdpa(
      "jax_ring_sdpa_fwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((b * SLOTS, n, t), jnp.float32)),
      q, k, v, *_doc_rows(docs, q, k), **_attrs(config, bnd, False, SLOTS))
  bi, slot, row = _doc_index(docs, t)
  valid = _doc_row_valid(docs, t)
  row = jnp.where(valid, row, 0)
  lse = stats.reshape(b, SLOTS, n, t)[bi, slot, :, row]  # (B, T, N)
  return (jnp.where(valid[:, :, None, None], out, 0),
          jnp.where(valid[:, :, None], lse, MASK_VALUE))


def _packed_backward(q, k, v, docs: _Docs, out, lse, dout, config, bnd: Band):
  b, t, n, _ = q.shape
  bi, slot, row = _doc_index(docs, t)
  valid = _doc_row_valid(docs, t)
  row = jnp.where(valid, row, t)  # rows before their slot: dropped
  stats = jnp.zeros((b, SLOTS, n, t), jnp.float32).at[bi, slot, :, row].set(
      lse.astype(jnp.float32), mode="drop").reshape(b * SLOTS, n, t)
  dq, dk, dv = _sdpa(
      "jax_ring_sdpa_bwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
      q, k, v, out, stats, dout, *_doc_rows(docs, q, k),
      **_attrs(config, bnd, False, SLOTS))
  rows = valid[:, :, None, None]
  cols = _doc_col_valid(docs, k.shape[1])[:, :, None, None]
  return (jnp.where(rows, dq, 0), jnp.where(cols, dk, 0),
          jnp.where(cols, dv, 0))


def forward(q, k, v, bias, mask, config):
  if unsupported(config, q, k, bias, mask):
    # The strategy resolved cudnn on a representative block; this one (say,
    # a ring block whose q and kv ids differ under a band) it cannot serve.
    return xla_backend.forward(q, k, v, bias, mask, config)
  b, t, n, _ = q.shape
  s = k.shape[1]
  bnd = band(config, mask.q_offset, mask.kv_offset, t, s)
  if bnd.empty:
    return jnp.zeros_like(q), jnp.full((b, t, n), MASK_VALUE, jnp.float32)
  if mask.q_segment_ids is not None:
    docs, bnd = _packed_slots(config, mask, bnd)
    return jax.lax.cond(
        docs.fits, lambda: _packed_forward(q, k, v, docs, config, bnd),
        lambda: xla_backend.forward(q, k, v, None, mask, config))
  seq_q, seq_kv, padding = _window_lengths(mask, bnd, b, t, s)
  rows = t - bnd.row_start
  out, stats = _sdpa(
      "jax_ring_sdpa_fwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((b, n, rows), jnp.float32)),
      q, k, v, seq_q, seq_kv, *_no_ragged(), **_attrs(config, bnd, padding))
  lse = jnp.pad(jnp.swapaxes(stats, 1, 2), ((0, 0), (bnd.row_start, 0), (0, 0)))
  if _rows_may_be_empty(bnd, padding, t, s):
    valid = _row_valid(bnd, seq_q, seq_kv, t)
    out = jnp.where(valid[:, :, None, None], out, 0)
    lse = jnp.where(valid[:, :, None], lse, MASK_VALUE)
  return out, lse


def backward(q, k, v, bias, mask, out, lse, dout, dlse, config):
  dq, (dk, dv) = _backward(q, k, v, bias, mask, out, lse, dout, dlse, config,
                           stack=False)
  return dq, dk, dv, None


def backward_dkv(q, k, v, bias, mask, out, lse, dout, dlse, config):
  """As :func:`backward`, with dK/dV written by cuDNN into one stacked
  ``(2, B, S, K, H)`` buffer (the ring's wire layout): no stacking copy."""
  dq, dkv = _backward(q, k, v, bias, mask, out, lse, dout, dlse, config,
                      stack=True)
  return dq, dkv, None


def _backward(q, k, v, bias, mask, out, lse, dout, dlse, config, stack):
  """(dq, dK/dV): a stacked (2, B, S, K, H) array if ``stack``, else a
  (dk, dv) pair."""
  pack = (lambda dk, dv: jnp.stack([dk, dv])) if stack else (
      lambda dk, dv: (dk, dv))
  # No lse-cotangent input in cuDNN's backward; other options as forward.
  if dlse is not None or unsupported(config, q, k, bias, mask):
    dq, dk, dv, _ = xla_backend.backward(q, k, v, bias, mask, out, lse, dout,
                                         dlse, config)
    return dq, pack(dk, dv)
  b, t, _, _ = q.shape
  s = k.shape[1]
  bnd = band(config, mask.q_offset, mask.kv_offset, t, s)
  if bnd.empty:
    return jnp.zeros_like(q), pack(jnp.zeros_like(k), jnp.zeros_like(v))
  if mask.q_segment_ids is not None:
    docs, bnd = _packed_slots(config, mask, bnd)
    dq, dk, dv = jax.lax.cond(
        docs.fits,
        lambda: _packed_backward(q, k, v, docs, out, lse, dout, config, bnd),
        lambda: xla_backend.backward(q, k, v, None, mask, out, lse, dout,
                                     None, config)[:3])
    return dq, pack(dk, dv)
  seq_q, seq_kv, padding = _window_lengths(mask, bnd, b, t, s)
  stats = jnp.swapaxes(lse[:, bnd.row_start:], 1, 2).astype(jnp.float32)
  grads = (jax.ShapeDtypeStruct((2,) + k.shape, k.dtype),) if stack else (
      jax.ShapeDtypeStruct(k.shape, k.dtype),
      jax.ShapeDtypeStruct(v.shape, v.dtype))
  dq, *dkv = _sdpa(
      "jax_ring_sdpa_bwd_dkv" if stack else "jax_ring_sdpa_bwd",
      (jax.ShapeDtypeStruct(q.shape, q.dtype),) + grads,
      q, k, v, out, stats, dout, seq_q, seq_kv, *_no_ragged(),
      **_attrs(config, bnd, padding))
  dkv = dkv[0] if stack else tuple(dkv)
  if _rows_may_be_empty(bnd, padding, t, s):
    dq = jnp.where(_row_valid(bnd, seq_q, seq_kv, t)[:, :, None, None], dq, 0)
  if padding or bnd.col_start:
    keep = _col_valid(bnd, seq_kv, s)[:, :, None, None]
    dkv = jax.tree.map(lambda x: jnp.where(keep, x, 0), dkv)
  return dq, dkv


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
  for name, value in (("bias", bias), ("mask", mask.dense)):
    if value is not None:
      return name
  for name in ("q_offset", "kv_offset"):
    if not isinstance(getattr(mask, name), (int, np.integer)):
      return f"a traced {name} (cuDNN's diagonal is fixed when it compiles)"
  if mask.q_segment_ids is not None:
    why = _packed_unsupported(config, query, key, mask)
    if why:
      return why
  if config.logits_soft_cap is not None:
    t, s = query.shape[1], key.shape[1]
    bnd = band(config, mask.q_offset, mask.kv_offset, t, s)
    if _needs_padding(mask, bnd, t, s):
      return ("logits_soft_cap with padding lengths (cuDNN's score modifier "
              "excludes its padding mask)")
  return None


def _packed_unsupported(config, query, key, mask) -> str | None:
  """Why the ragged path cannot serve these segment ids, or None."""
  t, s = query.shape[1], key.shape[1]
  same = mask.kv_segment_ids is None or (
      mask.kv_segment_ids is mask.q_segment_ids)
  if mask.q_lengths is not None or mask.kv_lengths is not None:
    return "segment_ids with padding lengths"
  if config.logits_soft_cap is not None:
    return "segment_ids with logits_soft_cap"
  if config.local_window is not None and not (
      same and t == s and mask.q_offset == mask.kv_offset):
    return ("segment_ids with a window between different query and key ids "
            "or offsets")
  shift = _diagonal_shift(config, mask)
  if shift is not None and shift < 0:
    return ("segment_ids with a causal diagonal before the first key "
            "(kv_offset < q_offset)")
  b, n, h, kh = query.shape[0], query.shape[2], query.shape[3], key.shape[2]
  if max(b * t * n * h, b * s * kh * h) >= 2**31:
    return "segment_ids on buffers of 2**31 elements or more"
  return None


if _cudnn is not None:
  # Stages: "initialize" builds the handle and plan before XLA runs or
  # records the program; "execute" launches cuDNN, and may be traced into a
  # command buffer (it allocates nothing and never syncs).
  _TRAITS = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
  for _name, _stages in _cudnn.registrations().items():
    jax.ffi.register_ffi_target(_name, _stages, platform="CUDA",
                                traits=_TRAITS)
  backends.register(backends.Backend("cudnn", forward, backward, unsupported,
                                     platform="cuda",
                                     backward_dkv=backward_dkv))
