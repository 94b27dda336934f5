"""A small decoder-only language model (RMSNorm, RoPE, SwiGLU, GQA) in Flax
NNX, built on ``jax_ring.flax.Attention``, and its masked next-token loss.

Shapes: B batch, S sequence (in the batch's token layout), E embed, M MLP
width, V vocabulary. Logical axes beyond the attention layer's: ``mlp``,
``vocab``, ``norm`` (map them in the rules too; see :func:`model_rules`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jax_ring
from jax_ring import flax as jrf

MLP, VOCAB, NORM = "mlp", "vocab", "norm"


def model_rules(*, data="data", context="context", tensor=None):
  """Logical -> mesh axis rules for the whole model: batch over ``data``,
  sequence over ``context``, heads and the MLP width over ``tensor``
  (Megatron-style: column-parallel in, row-parallel out), the rest
  replicated."""
  return jrf.logical_rules(batch=data, length=context, heads=tensor,
                           kv_heads=tensor, mlp=tensor, vocab=None, norm=None)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape and options of :class:`Transformer` (frozen, hashable).

  ``context_parallel`` and ``rules`` are passed to every attention layer;
  with ``rules=()`` the model is a plain single-device model.
  """

  vocab_size: int = 256
  embed_dim: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 384
  sliding_window: int | None = None
  logits_soft_cap: float | None = None
  rope_max_wavelength: float = 10_000.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  implementation: str | None = None
  context_parallel: jax_ring.ContextParallel | None = None
  rules: tuple = ()
  param_rules: tuple | None = None  # the weights' (FSDP); None: rules
  remat: bool = False

  def attention(self) -> jrf.AttentionLayerConfig:
    return jrf.AttentionLayerConfig(
        embed_dim=self.embed_dim, num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        is_causal=True, sliding_window=self.sliding_window,
        logits_soft_cap=self.logits_soft_cap,
        rope_max_wavelength=self.rope_max_wavelength, dtype=self.dtype,
        param_dtype=self.param_dtype, implementation=self.implementation,
        context_parallel=self.context_parallel, rules=self.rules,
        param_rules=self.param_rules)

  def num_params(self) -> int:
    e, m, v = self.embed_dim, self.mlp_dim, self.vocab_size
    attn = e * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    return 2 * v * e + e + self.num_layers * (attn + 3 * e * m + 2 * e)


def _param(rngs, init, shape, axes, cfg: ModelConfig):
  value = init(rngs.params(), shape, cfg.param_dtype)
  if not cfg.rules:
    return nnx.Param(value)
  rules = cfg.rules if cfg.param_rules is None else cfg.param_rules
  return nnx.Param(value, out_sharding=axes, sharding_rules=rules)


class RMSNorm(nnx.Module):
  """``x / rms(x) * scale``, in float32."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.scale = _param(rngs, jax.nn.initializers.ones, (cfg.embed_dim,),
                        (NORM,), cfg)
    self.dtype = cfg.dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (x32 * self.scale[...]).astype(self.dtype)


class SwiGLU(nnx.Module):
  """``(silu(x W_gate) * x W_up) W_down``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    init = jax.nn.initializers.lecun_normal()
    e, m = cfg.embed_dim, cfg.mlp_dim
    self.w_gate = _param(rngs, init, (e, m), ("embed", MLP), cfg)
    self.w_up = _param(rngs, init, (e, m), ("embed", MLP), cfg)
    self.w_down = _param(rngs, init, (m, e), (MLP, "embed"), cfg)
    self.cfg = cfg

  def __call__(self, x):
    dt, rules = self.cfg.dtype, self.cfg.rules
    h = jax.nn.silu(x @ self.w_gate[...].astype(dt)) * (
        x @ self.w_up[...].astype(dt))
    h = jrf.constrain(h, ("batch", "length", MLP), rules)
    return jrf.constrain(h @ self.w_down[...].astype(dt),
                         ("batch", "length", "embed"), rules)


class Block(nnx.Module):
  """Pre-norm decoder block: attention and SwiGLU, each with a residual."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg, rngs=rngs)
    self.attn = jrf.Attention(cfg.attention(), rngs=rngs)
    self.mlp_norm = RMSNorm(cfg, rngs=rngs)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x, positions, segment_ids):
    x = x + self.attn(self.attn_norm(x), positions, segment_ids)
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Token ids ``(B, S)`` -> logits ``(B, S, V)`` float32."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, jax.nn.initializers.normal(1.0),
                        (cfg.vocab_size, cfg.embed_dim), (VOCAB, "embed"),
                        cfg)
    self.blocks = nnx.List([Block(cfg, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg, rngs=rngs)
    self.unembed = _param(rngs, jax.nn.initializers.lecun_normal(),
                          (cfg.embed_dim, cfg.vocab_size), ("embed", VOCAB),
                          cfg)

  def __call__(self, inputs, positions, segment_ids=None):
    cfg = self.cfg
    x = jnp.take(self.embed[...], inputs, axis=0).astype(cfg.dtype)
    x = jrf.constrain(x, ("batch", "length", "embed"), cfg.rules)
    for block in self.blocks:
      if cfg.remat:
        x = nnx.remat(lambda b, *a: b(*a))(block, x, positions, segment_ids)
      else:
        x = block(x, positions, segment_ids)
    x = self.final_norm(x)
    logits = x @ self.unembed[...].astype(cfg.dtype)
    return jrf.constrain(logits.astype(jnp.float32),
                         ("batch", "length", VOCAB), cfg.rules)


def loss_fn(model: Transformer, batch: jrf.LMBatch):
  """Mean next-token cross-entropy over ``batch.loss_mask``. Every array is
  in the same (possibly load-balanced) token order, and a masked mean does
  not depend on the order, so nothing is reordered back."""
  logits = model(batch.inputs, batch.positions, batch.segment_ids)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.labels)
  mask = batch.loss_mask
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
