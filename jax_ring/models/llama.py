"""A Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral) in Flax NNX, built on
:class:`jax_ring.flax.Attention`, so that its attention runs on one device or
context-parallel from one config field.

Shapes::

  B batch, S sequence (in the batch's token layout), E hidden size,
  M MLP width, V vocabulary, N query heads, K kv heads, H head dim

Parameters (logical axes; ``jax_ring.flax.logical_rules`` names the first
six, :func:`model_rules` adds ``mlp``, ``vocab`` and ``norm``):

=====================  ======  ===========================================
name                   shape   Hugging Face tensor
=====================  ======  ===========================================
embed                  (V, E)  model.embed_tokens.weight
layers[i].attn_norm    (E,)    model.layers.i.input_layernorm.weight
layers[i].attn.wq      (E,N,H) model.layers.i.self_attn.q_proj.weight, T
layers[i].attn.wk, wv  (E,K,H) ...k_proj.weight, ...v_proj.weight, T
layers[i].attn.wo      (N,H,E) ...o_proj.weight, T
layers[i].attn.bq, ..  (N,H)   ...q_proj.bias (Qwen2), k_proj, v_proj
layers[i].mlp_norm     (E,)    model.layers.i.post_attention_layernorm...
layers[i].mlp.w_gate   (E, M)  model.layers.i.mlp.gate_proj.weight, T
layers[i].mlp.w_up     (E, M)  ...up_proj.weight, T
layers[i].mlp.w_down   (M, E)  ...down_proj.weight, T
final_norm             (E,)    model.norm.weight
unembed                (E, V)  lm_head.weight, T (absent when tied)
=====================  ======  ===========================================

(T: transposed; the (E, N*H) side is split into heads.) Reading and writing
Hugging Face checkpoints is in ``hf_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ring._src.core.config import ContextParallel
from jax_ring.flax.attention import (EMBED, Attention, AttentionLayerConfig,
                                     Llama3RopeScaling, constrain,
                                     logical_rules, sharded_param)


MLP, VOCAB, NORM = "mlp", "vocab", "norm"
ModelType = Literal["llama", "qwen2", "mistral"]


def model_rules(*, data="data", context="context", tensor=None):
  """Logical -> mesh axis rules for the whole model: batch over ``data``,
  sequence over ``context``, heads and the MLP width over ``tensor``
  (column-parallel in, row-parallel out), the rest replicated. For FSDP
  weights pass ``jax_ring.flax.fsdp_rules(rules, (data, context))`` as
  ``param_rules``."""
  return logical_rules(batch=data, length=context, heads=tensor,
                       kv_heads=tensor, mlp=tensor, vocab=None, norm=None)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and options of :class:`Llama` (frozen, hashable).

  The first block mirrors a Hugging Face ``config.json`` (see
  ``hf_checkpoint.config_from_hf``); the second says how the model runs.

  Attributes:
    vocab_size: V.
    hidden_size: E.
    intermediate_size: M.
    num_layers: decoder blocks.
    num_heads: N.
    num_kv_heads: K (N % K == 0).
    head_dim: H.
    rope_theta: the RoPE base.
    rope_scaling: Llama 3's frequency scaling, or None.
    rms_norm_eps: RMSNorm's epsilon.
    max_position_embeddings: the context the model is meant for, or None
      (not known). Nothing here limits positions by it; a checkpoint
      records it for other tools.
    tie_word_embeddings: the output projection is ``embed`` transposed.
    qkv_bias: q, k, v projections have biases (Qwen2).
    sliding_window: every layer attends to this many keys (Mistral), or
      None.
    logits_soft_cap: attention logits soft cap (Gemma 2's), or None; no
      Llama-family checkpoint has one, so ``save_pretrained`` refuses it.
    model_type: the Hugging Face architecture a checkpoint is written as.
    hf_config: the ``config.json`` this config was read from, as JSON text
      (hashable), or None. ``save_pretrained`` writes its fields back,
      changed only where the fields above differ from it.
    dtype: compute dtype (bfloat16 lets ``implementation=None`` pick cuDNN).
    param_dtype: the weights' dtype.
    implementation: the attention backend (``None``: best available).
    context_parallel: a ``jax_ring.ContextParallel`` for every attention
      layer, or None.
    rules: logical -> mesh axis rules (:func:`model_rules`); ``()`` for an
      unsharded model.
    param_rules: the weights' own rules (FSDP); None: ``rules``.
    remat: what the backward recomputes (activation checkpointing):

      ==================  ==============================================
      ``False``           nothing: every activation is kept
      ``True``            each block, whole: only its input is kept
      ``"attention"``     each block but its attention: the attention's
                          q, k, v, output and logsumexp are kept, so its
                          forward never runs twice (the projections,
                          norms and MLP are recomputed)
      ==================  ==============================================

      A policy on names cannot do the last: the attention is a custom-VJP
      call, whose residuals a ``jax.checkpoint`` policy does not see, so
      the block is split around it instead.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: Llama3RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int | None = None
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  sliding_window: int | None = None
  logits_soft_cap: float | None = None
  model_type: ModelType = "llama"
  hf_config: str | None = dataclasses.field(default=None, repr=False)
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  implementation: Literal["xla", "cudnn"] | None = None
  context_parallel: ContextParallel | None = None
  rules: tuple = ()
  param_rules: tuple | None = None
  remat: bool | Literal["attention"] = False

  def __post_init__(self):
    if self.remat not in (False, True, "attention"):
      raise ValueError(f"remat must be False, True or 'attention'; got "
                       f"{self.remat!r}")

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  def attention(self) -> AttentionLayerConfig:
    return AttentionLayerConfig(
        embed_dim=self.hidden_size, num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        is_causal=True, sliding_window=self.sliding_window,
        logits_soft_cap=self.logits_soft_cap,
        rope_max_wavelength=self.rope_theta, rope_scaling=self.rope_scaling,
        qkv_bias=self.qkv_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, implementation=self.implementation,
        context_parallel=self.context_parallel, rules=self.rules,
        param_rules=self.param_rules)

  def num_params(self) -> int:
    e, m, v = self.hidden_size, self.intermediate_size, self.vocab_size
    n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
    attn = e * h * (2 * n + 2 * k) + (n + 2 * k) * h * self.qkv_bias
    embeddings = v * e * (1 if self.tie_word_embeddings else 2)
    return embeddings + e + self.num_layers * (attn + 3 * e * m + 2 * e)


class RMSNorm(nnx.Module):
  """``x / sqrt(mean(x^2) + eps) * scale``, in float32."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.scale = sharded_param(rngs, jax.nn.initializers.ones,
                               (cfg.hidden_size,), (NORM,), cfg)
    self.eps, self.dtype = cfg.rms_norm_eps, cfg.dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) +
                              self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class SwiGLU(nnx.Module):
  """``(silu(x W_gate) * x W_up) W_down``."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    init = jax.nn.initializers.lecun_normal()
    e, m = cfg.hidden_size, cfg.intermediate_size
    self.w_gate = sharded_param(rngs, init, (e, m), (EMBED, MLP), cfg)
    self.w_up = sharded_param(rngs, init, (e, m), (EMBED, MLP), cfg)
    self.w_down = sharded_param(rngs, init, (m, e), (MLP, EMBED), cfg)
    self.cfg = cfg

  def __call__(self, x):
    dt, rules = self.cfg.dtype, self.cfg.rules
    h = jax.nn.silu(x @ self.w_gate[...].astype(dt)) * (
        x @ self.w_up[...].astype(dt))
    h = constrain(h, ("batch", "length", MLP), rules)
    return constrain(h @ self.w_down[...].astype(dt),
                     ("batch", "length", EMBED), rules)


class Block(nnx.Module):
  """Pre-norm decoder block: attention and SwiGLU, each with a residual."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg, rngs=rngs)
    self.attn = Attention(cfg.attention(), rngs=rngs)
    self.mlp_norm = RMSNorm(cfg, rngs=rngs)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x, positions, segment_ids):
    x = x + self.attn(self.attn_norm(x), positions, segment_ids)
    return x + self.mlp(self.mlp_norm(x))

  def project(self, x, positions):
    return self.attn.project(self.attn_norm(x), positions)

  def finish(self, x, out):
    """The block after its attention: ``x`` plus the output projection of
    ``out``, then the MLP with its residual."""
    x = x + self.attn.output(out)
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """Token ids ``(B, S)`` -> logits ``(B, S, V)`` float32.

  Example (one device)::

    model = Llama(LlamaConfig(vocab_size=256, hidden_size=64,
                              intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16),
                  rngs=nnx.Rngs(0))
    logits = model(tokens, positions)          # positions: (B, S) int

  With ``context_parallel`` and ``rules`` set, build and call it under
  ``jax.set_mesh(mesh)`` on batches from ``jax_ring.flax.prepare_lm_batch``
  (their token order is the load-balance layout; positions travel with the
  tokens, and restart at 0 per packed document as Hugging Face's
  ``position_ids`` do).
  """

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = jax.nn.initializers.normal(0.02)
    self.embed = sharded_param(rngs, init, (cfg.vocab_size, cfg.hidden_size),
                               (VOCAB, EMBED), cfg)
    self.layers = nnx.List([Block(cfg, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.unembed = sharded_param(rngs, init,
                                   (cfg.hidden_size, cfg.vocab_size),
                                   (EMBED, VOCAB), cfg)

  def hidden_states(self, inputs, positions, segment_ids=None):
    """``(B, S, E)`` after the final norm, in ``cfg.dtype``."""
    cfg = self.cfg
    # The table as the activations' rules lay it out (whole, under FSDP):
    # a lookup into an embed-sharded table would be replicated first.
    table = constrain(self.embed[...], (VOCAB, EMBED), cfg.rules)
    x = jnp.take(table, inputs, axis=0).astype(cfg.dtype)
    x = constrain(x, ("batch", "length", EMBED), cfg.rules)
    for block in self.layers:
      if cfg.remat == "attention":
        q, k, v = nnx.remat(lambda b, *a: b.project(*a))(block, x, positions)
        out = block.attn.attend(q, k, v, segment_ids)
        x = nnx.remat(lambda b, *a: b.finish(*a))(block, x, out)
      elif cfg.remat:
        x = nnx.remat(lambda b, *a: b(*a))(block, x, positions, segment_ids)
      else:
        x = block(x, positions, segment_ids)
    return self.final_norm(x)

  def output_weights(self):
    """``(E, V)``: ``unembed``, or ``embed`` transposed when tied."""
    if self.cfg.tie_word_embeddings:
      return self.embed[...].T
    return self.unembed[...]

  def __call__(self, inputs, positions, segment_ids=None):
    """Args: inputs ``(B, S)`` int token ids; positions ``(B, S)`` int;
    segment_ids ``(B, S)`` int packed-document ids or None."""
    cfg = self.cfg
    x = self.hidden_states(inputs, positions, segment_ids)
    logits = x @ self.output_weights().astype(cfg.dtype)
    return constrain(logits.astype(jnp.float32), ("batch", "length", VOCAB),
                     cfg.rules)


def lm_loss(model: Llama, batch, *, vocab_chunk: int | None = None
            ) -> jax.Array:
  """Mean next-token cross-entropy over ``batch.loss_mask``, for a
  ``jax_ring.flax.LMBatch`` in any token layout (a masked mean does not
  depend on the order, so nothing is reordered back).

  Args:
    model: the :class:`Llama`.
    batch: its ``inputs``, ``positions``, ``segment_ids``, ``labels`` and
      ``loss_mask`` (``(B, S)`` each).
    vocab_chunk: None: the float32 logits ``(B, S, V)`` are made whole.
      An int: the vocabulary is taken this many entries at a time, with a
      running logsumexp, and each chunk's logits are recomputed in the
      backward, so at most ``(B, S, vocab_chunk)`` of them are live (at 64k
      tokens and Llama 3's 128256 entries, 33.6 GB whole in float32).
  """
  if vocab_chunk is not None and (not isinstance(vocab_chunk, int)
                                  or vocab_chunk < 1):
    raise ValueError(f"vocab_chunk must be None or a positive int; got "
                     f"{vocab_chunk!r}")
  if vocab_chunk is None:
    logits = model(batch.inputs, batch.positions, batch.segment_ids)
    target = jnp.take_along_axis(logits, batch.labels[..., None], -1)[..., 0]
    ce = jax.nn.logsumexp(logits, -1) - target
  else:
    x = model.hidden_states(batch.inputs, batch.positions, batch.segment_ids)
    ce = _chunked_cross_entropy(x, model.output_weights().astype(x.dtype),
                                batch.labels, vocab_chunk, model.cfg.rules)
  mask = batch.loss_mask
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _chunked_cross_entropy(x, w, labels, chunk: int, rules):
  """``logsumexp(x @ w) - (x @ w)[label]`` per token, ``(B, S)`` float32,
  over vocabulary chunks of ``chunk`` entries (the last one padded)."""
  e, v = w.shape
  n = -(-v // chunk)
  w = jnp.pad(w, ((0, 0), (0, n * chunk - v)))
  w = jnp.moveaxis(w.reshape(e, n, chunk), 1, 0)  # (n, E, chunk)
  starts = jnp.arange(n, dtype=jnp.int32) * chunk
  low = jnp.float32(-1e30)  # padded entries: finite, so gradients stay 0

  @jax.checkpoint
  def step(carry, chunk_in):
    m, total, target = carry
    wc, start = chunk_in
    logits = constrain((x @ wc).astype(jnp.float32),
                       ("batch", "length", VOCAB), rules)
    ids = start + jnp.arange(chunk, dtype=jnp.int32)
    logits = jnp.where(ids < v, logits, low)
    # The running maximum only keeps exp() in range; its gradient cancels.
    new_m = jax.lax.stop_gradient(jnp.maximum(m, logits.max(-1)))
    total = total * jnp.exp(m - new_m) + jnp.exp(
        logits - new_m[..., None]).sum(-1)
    local = labels - start
    inside = (local >= 0) & (local < chunk)
    hit = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[..., None],
                              -1)[..., 0]
    return (new_m, total, target + jnp.where(inside, hit, 0.0)), None

  zeros = jnp.zeros(labels.shape, jnp.float32)
  (m, total, target), _ = jax.lax.scan(
      step, (jnp.full(labels.shape, low), zeros, zeros), (w, starts))
  return m + jnp.log(total) - target
