"""``dot_product_attention`` without ``context_parallel``: one block call
over the whole arrays, on the backend the registry picks for them, with
the sinks folded in and the rows of ``padding_segment_id`` emptied."""

from __future__ import annotations

import jax.numpy as jnp

from jax_ring._src.core import kernel, registry
from jax_ring._src.core.config import AttentionConfig
from jax_ring._src.core.mask import MASK_VALUE, BlockMask, TokenMask
from jax_ring._src.strategies import base


def attention(query, key, value, bias, dense, tm: TokenMask,
              config: AttentionConfig, sinks, padding_segment_id):
  """``(out (B, T, N, Hv), lse (B, T, N) float32)`` of checked, batched
  arrays: ``bias`` and the boolean ``dense`` mask ``(B|1, N|1, T, S)`` or
  None, ``sinks (N,)`` or None. Rows that see no key, and the rows of
  ``padding_segment_id``, are 0 with the logsumexp of no key (MASK_VALUE,
  or the head's sink)."""
  out, lse = _block(query, key, value, bias, dense, tm, config, sinks)
  return _padding_rows(out, lse, tm, sinks, padding_segment_id)


def out_shape(query, value):
  """``(B, T, N, Hv)``: the output takes the value's head dim."""
  return query.shape[:3] + value.shape[3:]


def _block(query, key, value, bias, dense, tm: TokenMask,
           config: AttentionConfig, sinks):
  """``(out, lse)`` of one block call over the whole arrays, on the backend
  the registry picks for them, with the ``sinks`` folded in."""
  block_mask = BlockMask(q_segment_ids=tm.q_segment_ids,
                         kv_segment_ids=tm.kv_segment_ids,
                         q_lengths=tm.q_lengths, kv_lengths=tm.kv_lengths,
                         dense=dense)
  if 0 in query.shape[:2] + key.shape[1:2]:  # no rows, or no key to see
    empty = (jnp.zeros(out_shape(query, value), query.dtype),
             jnp.full(query.shape[:3], MASK_VALUE, jnp.float32))
    return empty if sinks is None else kernel.fold_sinks(*empty, sinks)
  config = config.replace(implementation=registry.resolve(
      config.implementation, config, query, key, value, bias, block_mask))
  return kernel.attention(query, key, value, bias, block_mask, config, sinks)


def _padding_rows(out, lse, tm: TokenMask, sinks, padding_segment_id):
  """``(out, lse)`` with the rows of ``padding_segment_id`` as rows that
  see no key: 0, and the logsumexp of none (MASK_VALUE, or the head's
  sink)."""
  if padding_segment_id is None:
    return out, lse
  pad = tm.q_segment_ids == padding_segment_id
  none = (jnp.full(lse.shape, MASK_VALUE, jnp.float32) if sinks is None
          else jnp.broadcast_to(sinks.astype(jnp.float32), lse.shape))
  return (base.drop_padding(out, tm.q_segment_ids, padding_segment_id),
          jnp.where(pad[:, :, None], none, lse))
