"""``dot_product_attention``: a drop-in superset of
``jax.nn.dot_product_attention``, on one device or context-parallel. The
front door only: it checks the arguments, picks the path and calls it
(``one_device``, or ``cp_dispatch`` for ``context_parallel``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ring._src import cp_dispatch, one_device
from jax_ring._src.core import validate
from jax_ring._src.core.config import ContextParallel
from jax_ring._src.strategies import base


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale=None, is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          segment_ids=None, logits_soft_cap=None,
                          implementation=None, return_residual=False,
                          sinks=None, padding_segment_id=None,
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
    value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``: Hv may differ from H
      (multi-head latent attention); the output takes it.
    bias: additive, broadcastable to ``(B, N, T, S)``; differentiable.
    mask: boolean, broadcastable to ``(B, N, T, S)``; True = attend.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned).
    query_seq_lengths: ``(B,)`` int; queries at or past it output 0.
    key_value_seq_lengths: ``(B,)`` int; keys at or past it are ignored.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends keys
      ``i - left <= j <= i + right``.
    segment_ids: packed documents, ``(B, T)`` int (needs T == S) or a
      ``(q_ids (B, T), kv_ids (B, S))`` pair (``(T,)``, ``(S,)`` with an
      unbatched query); tokens attend only within their own segment id.
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)`` after
      scaling, before bias and masks (Gemma 2).
    implementation: ``None`` (best available), ``"xla"`` (pure-JAX
      blockwise) or ``"cudnn"``.
    return_residual: also return the logsumexp ``(B, T, N)`` float32.
    sinks: ``(N,)`` float, differentiable: per head, a logit that joins
      every row's softmax with no value (gpt-oss).
    padding_segment_id: an id of ``segment_ids`` marking padding (0 in
      TransformerEngine and MaxText): its rows are rows that see no key,
      and no token sees its keys. None (default): 0 is a document too.
    context_parallel: a :class:`ContextParallel`: on the mesh in scope
      (``jax.set_mesh``, or q's ``NamedSharding``), split the sequence over
      its ``axis`` and run that strategy on each shard, eagerly or under
      ``jax.jit`` (the same numbers), natural order in and out by default
      (``ContextParallel.inputs``), T and S of any length (padded inside
      the call). Needs T == S, except with ``"ulysses"``.
      Serves every option except ``bias``, ``mask`` and ``return_residual``.

  Returns:
    ``(B, T, N, Hv)`` in the input dtype (and the logsumexp if asked). Rows
    that see no key (fully masked) are 0 with zero gradient; ``jax.nn``
    gives the mean of V there instead.
  """
  q_rank = jnp.ndim(query)
  query, key, value = (_batched(x) for x in (query, key, value))
  segment_ids = _batched_ids(segment_ids) if q_rank == 3 else segment_ids
  tm, config = base.prepare(
      query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      cp_size=1)
  bias, dense = _bias_and_mask(bias, mask, query.shape, key.shape)
  if sinks is not None:
    sinks = validate.sinks(sinks, query.shape[2])
  validate.padding_segment_id(padding_segment_id, segment_ids)
  unbatch = (lambda x: x[0]) if q_rank == 3 else (lambda x: x)
  # The path: split over the mesh in scope, or one block call.
  if context_parallel is not None:
    mesh, lengths = validate.context_parallel(
        context_parallel, query, key, bias=bias, mask=mask,
        return_residual=return_residual)
    return unbatch(cp_dispatch.attention(
        query, key, value, tm, sinks, config, context_parallel, mesh,
        lengths, padding_segment_id))
  out, lse = one_device.attention(query, key, value, bias, dense, tm, config,
                                  sinks, padding_segment_id)
  return (unbatch(out), unbatch(lse)) if return_residual else unbatch(out)


def _bias_and_mask(bias, mask, q_shape, k_shape):
  """``bias`` and the boolean ``mask``, checked broadcastable to ``(B, N,
  T, S)`` and materialised along T and S (the blockwise tiles slice them);
  None stays None."""
  (b, t, n, _), s = q_shape, k_shape[1]
  if bias is not None:
    bias = validate.broadcastable("bias", jnp.asarray(bias), (b, n, t, s))
    bias = _broadcast_ts(bias, t, s)
  if mask is not None:
    mask = jnp.asarray(mask)
    validate.bool_mask(mask)
    mask = _broadcast_ts(validate.broadcastable("mask", mask, (b, n, t, s)),
                         t, s)
  return bias, mask


def _batched_ids(segment_ids):
  """Segment ids of an unbatched call: ``(T,)`` (or a pair) -> ``(1, T)``."""
  return jax.tree.map(lambda x: x[None] if jnp.ndim(x) == 1 else x,
                      segment_ids)


def _batched(x):
  """``(T, N, H)`` -> ``(1, T, N, H)``; other ranks as they are."""
  x = jnp.asarray(x)
  return x[None] if x.ndim == 3 else x


def _broadcast_ts(x, t, s):
  """Materialise T and S (the blockwise tiles slice them); keep B|1, N|1."""
  return jnp.broadcast_to(x, x.shape[:2] + (t, s))
