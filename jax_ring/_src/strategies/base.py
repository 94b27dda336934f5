"""What every context-parallel strategy shares: its record
(:class:`Strategy`), the front that validates a call on local shards and
runs it (:func:`run`), the custom VJP that ties a forward to its backward
(:func:`differentiable`), and the merge of partial results (:func:`merge`).

A strategy works on local shards inside ``shard_map``: ``forward(q, k, v,
tm, cfg, plan) -> (out, lse)`` and ``backward(q, k, v, tm, out, lse, dout,
cfg, plan) -> (dq, dk, dv)``, with ``tm`` a :class:`TokenMask` of runtime
operands, ``cfg`` the :class:`AttentionConfig` (backend resolved) and
``plan`` its static :class:`ShardPlan` (a pair for hybrid). The backward
takes the *global* ``out``/``lse``: every strategy keeps the same residual.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_ring._src.core import kernel, registry, validate, vma
from jax_ring._src.core.config import AttentionConfig, ContextParallel
from jax_ring._src.core.mask import TokenMask


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One context-parallel strategy, as both entry points use it.

  Attributes:
    name: its ``ContextParallel.strategy`` name.
    forward: ``(q, k, v, tm, cfg, plan) -> (out, lse)`` on local shards.
    backward: ``(q, k, v, tm, out, lse, dout, cfg, plan) -> (dq, dk, dv)``.
    plan: ``(cpc, sizes, backward_kv) -> plan``: the static plan of a call
      on mesh axes of ``sizes`` (``{axis: size}``); ``backward_kv`` is
      ``"ring"`` or ``"gather"`` (``ShardPlan.backward_kv``).
    check: ``(cpc, sizes, q_shape, k_shape) -> None``: the checks of a call
      on local shards of those shapes; raises ``ValueError``.
  """

  name: str
  forward: Callable[..., tuple[Any, Any]]
  backward: Callable[..., tuple[Any, Any, Any]]
  plan: Callable[..., Any]
  check: Callable[..., None]

  @functools.cached_property
  def attention(self):
    """``(q, k, v, tm, sinks, cfg, plan) -> out``, differentiable."""
    return differentiable(self.forward, self.backward)


def drop_padding(out, q_ids, padding_segment_id):
  """``out (B, T, N, Hv)`` with the rows whose query id is
  ``padding_segment_id`` set to 0 (and their gradient stopped there): the
  padding convention of ``padding_segment_id``. Padding keys need nothing
  more: a real token's id differs from theirs, so the segment mask already
  hides them. ``None``: ``out`` as it is."""
  if padding_segment_id is None:
    return out
  return jnp.where((q_ids == padding_segment_id)[:, :, None, None], 0, out)


def run(strategy: Strategy, cpc: ContextParallel, query, key, value, *,
        segment_ids, lengths, local_window_size, is_causal, scale,
        logits_soft_cap, implementation, sinks=None,
        padding_segment_id=None):
  """The front of the ``shard_map`` entry points: ``strategy`` on local
  shards ``query (B, T, N, H)``, ``key``/``value (B, T, K, H)`` of a
  sequence split over ``cpc``'s axes, validated before anything runs.
  ``sinks (N,)`` (this device's heads) are typed to vary as the shards do,
  so that their gradient is summed over the devices that used them."""
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  sizes = {a: validate.mesh_axis(a) for a in cpc.axes}
  cpc = cpc.with_environment()
  tm, cfg = prepare(
      query, key, value, segment_ids=segment_ids, lengths=lengths,
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      cp_size=math.prod(sizes.values()))
  cfg = resolve(implementation, cfg, query, key, value, tm)
  strategy.check(cpc, sizes, query.shape, key.shape)
  if sinks is not None:
    sinks = vma.like(validate.sinks(sinks, query.shape[2]), query, key, value)
  validate.padding_segment_id(padding_segment_id, segment_ids)
  out = strategy.attention(query, key, value, tm, sinks, cfg,
                           strategy.plan(cpc, sizes, "ring"))
  return drop_padding(out, tm.q_segment_ids, padding_segment_id)


def prepare(query, key, value, *, segment_ids, lengths, local_window_size,
            is_causal, scale, logits_soft_cap, implementation, cp_size):
  """Validated ``(TokenMask, AttentionConfig)`` for local shards
  ``query (B, T, N, H)``, ``key``/``value (B, S, K, H)`` of a sequence
  split over ``cp_size`` devices (1: one device, global arrays): the one
  check of the options every entry point shares. The config's backend is
  left as requested (:func:`resolve` picks it on the arrays that run).

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
  tm = TokenMask.of(q_ids, kv_ids, q_len, kv_len)
  cfg = AttentionConfig(
      scale=1.0 / math.sqrt(query.shape[-1]) if scale is None else scale,
      is_causal=bool(is_causal), local_window=window,
      logits_soft_cap=logits_soft_cap, implementation=implementation)
  return tm, cfg


def resolve(implementation, cfg: AttentionConfig, query, key, value,
            tm: TokenMask) -> AttentionConfig:
  """``cfg`` with the backend that serves blocks of these local shards
  (``implementation`` requested, or ``None`` for the best available),
  judged on a representative block: static offsets, the same operand
  kinds. Shard shapes, not global ones: a backend's limits are per call."""
  return cfg.replace(implementation=registry.resolve(
      implementation, cfg, query, key, value, None, tm.block_mask()))


def differentiable(forward, backward):
  """``f(q, k, v, tm, sinks, cfg, plan) -> out`` with a custom VJP, from a
  strategy's pair on local shards: ``forward(q, k, v, tm, cfg, plan) ->
  (out, lse)`` and ``backward(q, k, v, tm, out, lse, dout, cfg, plan) ->
  (dq, dk, dv)``. Every strategy keeps the same residual: the local shards
  and the global ``out``/``lse``. ``sinks`` (or None) fold into the merged
  result once per row (``kernel.fold_sinks``), and the backward takes the
  folded ``out``/``lse``. ``cfg`` and ``plan`` are static."""

  def folded(q, k, v, tm, sinks, cfg, plan):
    out, lse = forward(q, k, v, tm, cfg, plan)
    return (out, lse) if sinks is None else kernel.fold_sinks(out, lse,
                                                              sinks)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
  def f(q, k, v, tm, sinks, cfg, plan):
    return folded(q, k, v, tm, sinks, cfg, plan)[0]

  def f_fwd(q, k, v, tm, sinks, cfg, plan):
    out, lse = folded(q, k, v, tm, sinks, cfg, plan)
    return out, (q, k, v, tm, sinks, out, lse)

  def f_bwd(cfg, plan, res, dout):
    q, k, v, tm, sinks, out, lse = res
    dout = dout.astype(q.dtype)
    grads = backward(q, k, v, tm, out, lse, dout, cfg, plan)
    dsinks = None if sinks is None else kernel.sinks_grad(
        sinks, out, lse, dout, None).astype(sinks.dtype)
    return (*grads, jax.tree.map(lambda _: None, tm), dsinks)

  f.defvjp(f_fwd, f_bwd)
  return f


def merge(out, lse, out_i, lse_i):
  """Merge two partial attentions over disjoint keys, in float32.

  ``out`` moves toward ``out_i`` by the sigmoid of the lse difference (never
  an exp of a large positive number). The new lse is a logaddexp, not the
  equivalent ``lse - log_sigmoid(lse - lse_i)``: with a fully masked side at
  the finite MASK_VALUE = -1e30, that form computes -1e30 + (1e30 + lse_i)
  and loses lse_i to rounding, while logaddexp returns lse_i exactly.
  """
  out_i, lse_i = out_i.astype(jnp.float32), lse_i.astype(jnp.float32)
  out = out - jax.nn.sigmoid(lse_i - lse)[..., None] * (out - out_i)
  return out, jnp.logaddexp(lse, lse_i)
