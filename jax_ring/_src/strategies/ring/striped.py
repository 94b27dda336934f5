"""The ring's blocks under the striped layout (``load_balance="striped"``).

Token i is on device i mod N, as local token i // N. Every step is one
block of all T queries against all T held keys. Local query a of device r
is global ``a N + r``, held key b of device src is ``b N + src``, so with
``d = r - src`` (traced, in (-N, N)) the global distance is ``p_q - p_k =
(a - b) N + d``. A mask that keeps ``-right <= p_q - p_k <= left`` (causal:
right = 0; no window: left = inf) keeps ``lo <= a - b <= hi`` with
``lo = ceil((-right - d) / N)``, ``hi = floor((left - d) / N)``: a static
``BlockMask`` with ``kv_offset - q_offset = lo`` under a local causal mask
and window ``(hi - lo, 0)`` (none when hi is infinite; skipped when
hi < lo). Only a few distinct bands arise from the 2N - 1 values of d, so
a ``lax.switch`` on a small table indexed by d picks one (the band stays a
compile-time constant for cuDNN); the unrolled loop's switch holds only
the bands of d in {i, i - N}. Without a causal mask or window every block
is full. Padding: device r's valid tokens under a global length L are a
prefix of ``ceil((L - r) / N)``, given as local prefix lengths shifted by
the block's offsets.

Shapes and the held ``kv`` as in :mod:`jax_ring._src.strategies.ring.blocks`.
The table of bands per step, the balance against dual-chunk and packed
documents: docs/design.md, "Ring" ("Striped steps").
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ring._src.core import kernel, vma
from jax_ring._src.core.config import AttentionConfig
from jax_ring._src.core.mask import BlockMask, TokenMask
from jax_ring._src.strategies.ring import blocks


@dataclasses.dataclass(frozen=True)
class _Band:
  """Static mask of a striped block: offsets, and the causal flag and
  window of its local band (the default is the unmasked, full block)."""

  q_offset: int = 0
  kv_offset: int = 0
  is_causal: bool = False
  window: tuple[int, int] | None = None


def striped_band(cfg: AttentionConfig, n: int, t: int, d: int):
  """The ``_Band`` of a striped block whose KV comes from device src =
  r - d, or None if no (query, key) pair of it is visible.

  Local query a is global a n + r and held key b is b n + src, so
  ``p_q - p_k = (a - b) n + d``, and the global band ``-right <= p_q - p_k
  <= left`` is the band ``lo <= a - b <= hi`` below. With offsets whose
  difference is -lo, ``p_q - p_k`` of the block is ``a - b - lo``: a local
  causal mask with window ``(hi - lo, 0)``.
  """
  if not cfg.positional:
    return _Band()
  left, right = cfg.band
  lo = -((right + d) // n)  # ceil((-right - d) / n)
  hi = None if left is None else (left - d) // n  # floor((left - d) / n)
  # a - b lies in [1 - t, t - 1]: a bound at or past that is no bound.
  lo = max(lo, 1 - t)
  if hi is not None and hi >= t - 1:
    hi = None
  if lo > t - 1 or (hi is not None and hi < lo):
    return None
  if lo == 1 - t and hi is None:
    return _Band()
  # Non-negative offsets (q_offset = -lo when lo < 0) keep the shifted
  # lengths below non-negative too.
  return _Band(q_offset=max(0, -lo), kv_offset=max(0, lo), is_causal=True,
               window=None if hi is None else (hi - lo, 0))


def distances(step, n: int):
  """The values d = r - src can take at ``step`` (a Python int when the
  loop is unrolled: src = r - step or r - step + n; traced in a scan)."""
  if isinstance(step, int):
    return (0,) if step == 0 else (step, step - n)
  return tuple(d for d in range(1 - n, n) if d)


def _striped_prefix(lengths, device, n: int, t: int):
  """Valid tokens of ``device``'s striped shard under global ``lengths
  (B,)``: local a is valid iff a n + device < L, a prefix of
  ceil((L - device) / n) tokens."""
  if lengths is None:
    return None
  return jnp.clip((lengths - device + n - 1) // n, 0, t)


def _striped_call(fn, skip, q, tm: TokenMask, kv, r, src, ds, cfg, plan,
                  own=False):
  """``fn(kv, mask, config)`` for all local queries against the held KV of
  device ``src``: a ``lax.switch`` over the distinct bands of the
  distances ``ds`` it may be at (none when there is one), ``skip()`` where
  nothing is visible. ``own``: step 0 with one id array."""
  n, t = plan.cp_size, q.shape[1]
  bands = {d: striped_band(cfg, n, t, d) for d in ds}
  distinct = list(dict.fromkeys(bands.values()))
  q_len = _striped_prefix(tm.q_lengths, r, n, t)
  kv_len = _striped_prefix(tm.kv_lengths, src, n, t)
  q_seg = tm.q_segment_ids
  shift = lambda x, offset: None if x is None else x + offset

  def branch(band, kv):
    if band is None:
      return skip()
    mask = BlockMask(
        q_offset=band.q_offset, kv_offset=band.kv_offset,
        q_segment_ids=q_seg, kv_segment_ids=q_seg if own else kv[1],
        q_lengths=shift(q_len, band.q_offset),
        kv_lengths=shift(kv_len, band.kv_offset))
    return fn(kv, mask, cfg.replace(is_causal=band.is_causal,
                                    local_window=band.window))

  if len(distinct) == 1:
    return branch(distinct[0], kv)
  table = np.zeros(2 * n - 1, np.int32)
  for d, band in bands.items():
    table[d + n - 1] = distinct.index(band)
  index = jnp.asarray(table)[r - src + n - 1]
  return lax.switch(index, [functools.partial(branch, b) for b in distinct],
                    kv)


def striped_fwd(q, tm, kv, r, src, ds, cfg, plan, own=False):
  """(out in q's dtype, lse f32) of one striped step (16-bit inside the
  switch, for the reason the comment above ``blocks.kind_fwd`` gives)."""
  b, t, n, h = q.shape[:3] + kv[0][1].shape[3:]

  def fwd(kv, mask, c):
    return kernel.forward(q, kv[0][0], kv[0][1], None, mask, c)

  skip = lambda: blocks.masked(b, t, n, h, (q, kv[0][0]), q.dtype)
  return _striped_call(fwd, skip, q, tm, kv, r, src, ds, cfg, plan, own)


def striped_bwd(q, tm, kv, r, src, ds, out, lse, dout, cfg, plan,
                 own=False):
  """(dq, dK/dV in the held kv's form) of one striped step, in the
  kernel's dtypes (q's, k's)."""

  def bwd(kv, mask, c):
    dq, dkv, _ = kernel.attention_backward_dkv(
        q, kv[0][0], kv[0][1], None, mask, out, lse, dout, None, c)
    return dq, dkv

  skip = lambda: vma.like(
      (jnp.zeros_like(q), blocks.dkv_zeros(kv, dtype=kv[0][0].dtype)),
      q, kv[0][0], out, dout)
  return _striped_call(bwd, skip, q, tm, kv, r, src, ds, cfg, plan, own)
