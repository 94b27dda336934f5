"""Public single-device API: a drop-in superset of jax.nn.dot_product_attention."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_ring._src import backends, kernel, partition, validate
from jax_ring._src import cudnn  # noqa: F401  (registers cuDNN when built)
from jax_ring._src.config import (AttentionConfig, ContextParallel,
                                  loop_from_environment)
from jax_ring._src.mask import BlockMask, TokenMask


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale=None, is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          segment_ids=None, logits_soft_cap=None,
                          implementation=None, return_residual=False,
                          context_parallel: ContextParallel | None = None):
  """Scaled dot-product attention, memory-efficient and differentiable.

  Every argument that ``jax.nn.dot_product_attention`` has means the same
  here; ``segment_ids`` and ``logits_soft_cap`` are additions, and the
  residual (logsumexp) is differentiable. Shapes::

    B batch, T query length, S key length, N query heads,
    K key/value heads (N % K == 0; K < N is GQA, K == 1 is MQA), H head dim

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``.
    key: ``(B, S, K, H)`` or ``(S, K, H)``. K/V are never repeated for GQA.
    value: same shape as ``key``.
    bias: additive, broadcastable to ``(B, N, T, S)``; differentiable.
    mask: boolean, broadcastable to ``(B, N, T, S)``; True = attend.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned).
    query_seq_lengths: ``(B,)`` int; queries at or past it output 0.
    key_value_seq_lengths: ``(B,)`` int; keys at or past it are ignored.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends keys
      ``i - left <= j <= i + right``.
    segment_ids: packed documents, ``(B, T)`` int (needs T == S) or a
      ``(q_ids (B, T), kv_ids (B, S))`` pair; tokens attend only within
      their own segment id.
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)`` after
      scaling, before bias and masks (Gemma 2).
    implementation: ``None`` (best available), ``"xla"`` (pure-JAX
      blockwise) or ``"cudnn"``.
    return_residual: also return the logsumexp ``(B, T, N)`` float32.
    context_parallel: a :class:`ContextParallel`: under ``jax.jit`` with q, k,
      v sharded on the sequence dimension over its ``axis`` (NamedSharding),
      run that strategy on each shard. Inputs must be in its load-balance
      layout. Serves every option except ``bias``, ``mask`` and
      ``return_residual``.

  Returns:
    ``(B, T, N, H)`` in the input dtype (and the logsumexp if asked). Rows
    that see no key (fully masked) are 0 with zero gradient; ``jax.nn``
    gives the mean of V there instead.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  validate.qkv(query, key, value)
  validate.scalar_options(scale, logits_soft_cap)
  validate.implementation(implementation)
  window = validate.window(local_window_size)
  b, t, n, h = query.shape
  s = key.shape[1]
  target = (b, n, t, s)
  if unbatched:
    bias = _add_batch(bias)
    mask = _add_batch(mask)

  if bias is not None:
    bias = jnp.asarray(bias)
    validate.broadcastable("bias", bias, target)
    bias = _broadcast_ts(bias, t, s)
  dense = None
  if mask is not None:
    dense = jnp.asarray(mask)
    validate.bool_mask(dense)
    validate.broadcastable("mask", dense, target)
    dense = _broadcast_ts(dense, t, s)
  for name, lengths in (("query_seq_lengths", query_seq_lengths),
                        ("key_value_seq_lengths", key_value_seq_lengths)):
    if lengths is not None:
      validate.seq_lengths(name, jnp.asarray(lengths), b)
  q_ids = kv_ids = None
  if segment_ids is not None:
    q_ids, kv_ids = validate.segment_ids(segment_ids, query.shape, key.shape)

  config = AttentionConfig(
      scale=float(1.0 / math.sqrt(h) if scale is None else scale),
      is_causal=bool(is_causal), local_window=window,
      logits_soft_cap=None if logits_soft_cap is None else float(
          logits_soft_cap))
  block_mask = BlockMask(q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                         q_lengths=query_seq_lengths,
                         kv_lengths=key_value_seq_lengths, dense=dense)
  if context_parallel is not None:
    validate.context_parallel(context_parallel, query, key, bias=bias,
                              mask=mask, return_residual=return_residual)
    # The loop form is read from the environment here, at the edge, once.
    context_parallel = dataclasses.replace(
        context_parallel, loop=context_parallel.loop or loop_from_environment())
    i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    tm = TokenMask(q_segment_ids=i32(q_ids),
                   kv_segment_ids=None if kv_ids is q_ids else i32(kv_ids),
                   q_lengths=i32(query_seq_lengths),
                   kv_lengths=i32(key_value_seq_lengths))
    # The backend is resolved on each shard (partition.py): its limits are
    # per call. A request is checked here, on a one-token block, so that
    # what does not depend on the length fails at trace time.
    if implementation is not None:
      one = lambda x: jax.ShapeDtypeStruct(x.shape[:1] + (1,) + x.shape[2:],
                                           x.dtype)
      backends.resolve(implementation, config, one(query), one(key), None,
                       block_mask)
    config = config.replace(implementation=implementation)
    out = partition.attention(query, key, value, tm, config, context_parallel)
    return out[0] if unbatched else out
  config = config.replace(implementation=backends.resolve(
      implementation, config, query, key, bias, block_mask))
  out, lse = kernel.attention(query, key, value, bias, block_mask, config)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def _add_batch(x):
  return None if x is None else jnp.asarray(x)[None]


def _broadcast_ts(x, t, s):
  """Materialise T and S (the blockwise tiles slice them); keep B|1, N|1."""
  return jnp.broadcast_to(x, x.shape[:2] + (t, s))
