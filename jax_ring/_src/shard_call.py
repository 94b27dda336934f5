"""The shared front of every context-parallel strategy called on local shards.

``ring_attention`` and its siblings take the same options as
``dot_product_attention`` (minus bias and dense masks, which cannot be
sharded along the sequence). This module validates them once, in one place,
ties a strategy's forward and backward into one differentiable function
(:func:`differentiable`), and turns the options into the two things a
strategy's forward and backward need:
a :class:`~jax_ring._src.mask.TokenMask` of runtime operands and an
:class:`~jax_ring._src.config.AttentionConfig` with its backend resolved.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_ring._src import backends, validate
from jax_ring._src.config import AttentionConfig
from jax_ring._src.mask import TokenMask


def prepare(query, key, value, *, segment_ids, lengths, local_window_size,
            is_causal, scale, logits_soft_cap, implementation, cp_size):
  """Validated ``(TokenMask, AttentionConfig)`` for local shards
  ``query (B, T, N, H)``, ``key``/``value (B, S, K, H)`` of a sequence
  split over ``cp_size`` devices.

  ``lengths`` is the ``(query_seq_lengths, key_value_seq_lengths)`` pair,
  ``(B,)`` each, in global positions.
  """
  validate.qkv(query, key, value)
  scale, logits_soft_cap = validate.scalar_options(scale, logits_soft_cap)
  validate.implementation(implementation)
  window = validate.window(local_window_size, query.shape[1] * cp_size,
                           key.shape[1] * cp_size)
  b = query.shape[0]
  q_len, kv_len = (None if x is None else jnp.asarray(x) for x in lengths)
  for name, x in (("query_seq_lengths", q_len),
                  ("key_value_seq_lengths", kv_len)):
    if x is not None:
      validate.seq_lengths(name, x, b)
  q_ids = kv_ids = None
  if segment_ids is not None:
    q_ids, kv_ids = validate.segment_ids(segment_ids, query.shape, key.shape)
    kv_ids = None if kv_ids is q_ids else kv_ids  # one array: "same ids"
  tm = TokenMask(q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                 q_lengths=q_len, kv_lengths=kv_len).as_int32()
  cfg = AttentionConfig(
      scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else scale,
      is_causal=bool(is_causal), local_window=window,
      logits_soft_cap=logits_soft_cap)
  return tm, resolve(implementation, cfg, query, key, tm)


def resolve(implementation, cfg: AttentionConfig, query, key,
            tm: TokenMask) -> AttentionConfig:
  """``cfg`` with the backend that serves blocks of these local shards
  (``implementation`` requested, or ``None`` for the best available),
  judged on a representative block: static offsets, the same operand
  kinds. Shard shapes, not global ones: a backend's limits are per call."""
  return cfg.replace(implementation=backends.resolve(
      implementation, cfg, query, key, None, tm.block_mask()))


def differentiable(forward, backward):
  """``f(q, k, v, tm, cfg, plan) -> out`` with a custom VJP, from a
  strategy's pair on local shards: ``forward(q, k, v, tm, cfg, plan) ->
  (out, lse)`` and ``backward(q, k, v, tm, out, lse, dout, cfg, plan) ->
  (dq, dk, dv)``. Every strategy keeps the same residual: the local shards
  and the global ``out``/``lse``. ``cfg`` and ``plan`` are static."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
  def f(q, k, v, tm, cfg, plan):
    return forward(q, k, v, tm, cfg, plan)[0]

  def f_fwd(q, k, v, tm, cfg, plan):
    out, lse = forward(q, k, v, tm, cfg, plan)
    return out, (q, k, v, tm, out, lse)

  def f_bwd(cfg, plan, res, dout):
    q, k, v, tm, out, lse = res
    grads = backward(q, k, v, tm, out, lse, dout.astype(q.dtype), cfg, plan)
    return (*grads, jax.tree.map(lambda _: None, tm))

  f.defvjp(f_fwd, f_bwd)
  return f
