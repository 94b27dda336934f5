"""The one config of :class:`~jax_ring.models.decoder.Decoder`: a decoder of
attention and gated-MLP blocks whose fields say what each family adds to a
Llama block, so that one model definition is Llama 2/3, Qwen2/2.5, Mistral,
Qwen3, Gemma 2 and Gemma 3 (text).

=====================  =====  =====  =======  =====  =======  =======
field                  llama  qwen2  mistral  qwen3  gemma2   gemma3
=====================  =====  =====  =======  =====  =======  =======
qkv_bias               .      yes    .        .      .        .
qk_norm                .      .      .        yes    .        yes
sliding layers         none   some   all      some   some     some
local_rope_theta       .      .      .        .      .        yes
zero_centered_norm     .      .      .        .      yes      yes
sandwich_norm          .      .      .        .      yes      yes
scale_embeddings       .      .      .        .      yes      yes
query_pre_attn_scalar  .      .      .        .      yes      yes
logits_soft_cap        .      .      .        .      yes      .
final_logits_soft_cap  .      .      .        .      yes      yes
hidden_act             silu   silu   silu     silu   gelu_t   gelu_t
=====================  =====  =====  =======  =====  =======  =======

(``some``: the layers ``layer_types`` names; ``gelu_t``: the tanh GeLU,
``"gelu_pytorch_tanh"``.) ``hf_config.py`` maps ``config.json`` onto these
fields and back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from jax_ring._src.core.config import ContextParallel
from jax_ring.flax.attention import (AttentionLayerConfig, RopeScaling,
                                     logical_rules)


ModelType = Literal["llama", "qwen2", "mistral", "qwen3", "gemma2",
                    "gemma3_text"]
LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES = ("full_attention", "sliding_attention")
Activation = Literal["silu", "gelu_pytorch_tanh", "gelu"]
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


def model_rules(*, data="data", context="context", tensor=None):
  """Logical -> mesh axis rules for the whole model: batch over ``data``,
  sequence over ``context``, heads and the MLP width over ``tensor``
  (column-parallel in, row-parallel out), the rest replicated. For FSDP
  weights pass ``jax_ring.flax.fsdp_rules(rules, (data, context))`` as
  ``param_rules``."""
  return logical_rules(batch=data, length=context, heads=tensor,
                       kv_heads=tensor, mlp=tensor, vocab=None, norm=None)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Shape and options of :class:`~jax_ring.models.Decoder` (frozen,
  hashable). ``LlamaConfig`` is the same class.

  The first block mirrors a Hugging Face ``config.json`` (see
  ``hf_config.config_from_hf``); the second says how the model runs.

  Attributes:
    vocab_size: V.
    hidden_size: E.
    intermediate_size: M.
    num_layers: decoder blocks.
    num_heads: N.
    num_kv_heads: K (N % K == 0).
    head_dim: H.
    rope_theta: the RoPE base (of every layer, unless ``local_rope_theta``).
    rope_scaling: a ``Llama3RopeScaling`` or ``LinearRopeScaling`` of the
      RoPE frequencies, or None.
    rms_norm_eps: RMSNorm's epsilon (the q/k norms' too).
    max_position_embeddings: the context the model is meant for, or None
      (not known). Nothing here limits positions by it; a checkpoint
      records it for other tools.
    tie_word_embeddings: the output projection is ``embed`` transposed.
    qkv_bias: q, k, v projections have biases (Qwen2).
    sliding_window: ``W``: a sliding layer's query sees itself and the
      ``W - 1`` keys before it (``local_window_size=(W - 1, 0)``, so that a
      ring skips the blocks the window never reaches); None: no layer
      slides.
    layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer;
      None: every layer slides when ``sliding_window`` is set (Mistral),
      none otherwise.
    local_rope_theta: the RoPE base of the sliding layers, which then take
      no ``rope_scaling`` (Gemma 3's local layers); None: they use
      ``rope_theta`` and ``rope_scaling`` as the others do.
    logits_soft_cap: attention logits ``c * tanh(logits / c)`` after the
      scale (Gemma 2's 50), or None.
    final_logits_soft_cap: the same on the output logits (Gemma 2's 30),
      or None.
    query_pre_attn_scalar: the softmax scale is its ``-1/2`` power (Gemma);
      None: ``head_dim ** -0.5``.
    qk_norm: an RMSNorm over the head dim on q and k before RoPE (Qwen3,
      Gemma 3).
    zero_centered_norm: every RMSNorm multiplies by ``1 + weight``, its
      weight stored centred on 0 (Gemma).
    sandwich_norm: norms after the attention and after the MLP as well as
      before them, each inside its residual branch (Gemma 2 and 3).
    scale_embeddings: the embedding lookup is multiplied by ``sqrt(E)`` in
      ``dtype`` (Gemma).
    hidden_act: the gated MLP's activation, ``act(x W_gate) * x W_up``:
      ``"silu"`` (SwiGLU), ``"gelu_pytorch_tanh"`` (GeGLU with the tanh
      GeLU, Gemma's) or ``"gelu"`` (the exact one).
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
      ``"attention_``     as ``"attention"``, and the residual stream
      ``residual"``       after the attention is kept too (``E`` values a
                          token a layer more), so the output projection
                          is not recomputed either
      ==================  ==============================================

      A policy on names cannot do the last: the attention is a custom-VJP
      call, whose residuals a ``jax.checkpoint`` policy does not see, so
      the block is split around it instead.
    remat_skip: the last ``remat_skip`` blocks are not rematerialised
      (every activation of theirs is kept), spending memory the others
      leave free to save their recompute; needs ``remat``. They run
      unrolled after the scanned groups, which are counted over the other
      blocks (``scanned_groups()``).
    scan_layers: run the blocks as one ``lax.scan`` over groups of
      ``layer_period()`` layers (the blocks past the last whole group
      after it), so that the compiled program holds one group: it compiles,
      and XLA prepares it at each run, once rather than once a layer. The
      weights keep their per-layer layout (checkpoints, generation) and
      are stacked at each call, a copy of the scanned layers' weights;
      with ``remat``, a LoRA model's frozen base (``nnx.Param`` beside
      ``nnx.LoRAParam``) is picked in place instead, a block at a time.
      The unrolled blocks' numbers, up to float rounding (the loop's
      fusions differ). ``False`` unrolls the blocks, each its own copy
      in the program.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int | None = None
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  sliding_window: int | None = None
  layer_types: tuple[LayerType, ...] | None = None
  local_rope_theta: float | None = None
  logits_soft_cap: float | None = None
  final_logits_soft_cap: float | None = None
  query_pre_attn_scalar: float | None = None
  qk_norm: bool = False
  zero_centered_norm: bool = False
  sandwich_norm: bool = False
  scale_embeddings: bool = False
  hidden_act: Activation = "silu"
  model_type: ModelType = "llama"
  hf_config: str | None = dataclasses.field(default=None, repr=False)
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  implementation: Literal["xla", "cudnn"] | None = None
  context_parallel: ContextParallel | None = None
  rules: tuple = ()
  param_rules: tuple | None = None
  remat: bool | Literal["attention", "attention_residual"] = False
  remat_skip: int = 0
  scan_layers: bool = True

  def __post_init__(self):
    if self.remat not in (False, True, "attention", "attention_residual"):
      raise ValueError(f"remat must be False, True, 'attention' or "
                       f"'attention_residual'; got "
                       f"{self.remat!r}")
    if (isinstance(self.remat_skip, bool) or
        not isinstance(self.remat_skip, (int, np.integer)) or
        not 0 <= self.remat_skip <= self.num_layers):
      raise ValueError(f"remat_skip must be an int in [0, num_layers="
                       f"{self.num_layers}]; got {self.remat_skip!r}")
    if self.remat_skip and not self.remat:
      raise ValueError(f"remat_skip={self.remat_skip} needs remat (True or "
                       "'attention'); with remat=False no block is "
                       "rematerialised")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act must be one of {ACTIVATIONS}; got "
                       f"{self.hidden_act!r}")
    if self.layer_types is not None:
      if not isinstance(self.layer_types, tuple):
        raise ValueError(f"layer_types must be a tuple (hashable); got "
                         f"{type(self.layer_types).__name__}")
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"layer_types has {len(self.layer_types)} entries "
                         f"for num_layers={self.num_layers}")
      for i, kind in enumerate(self.layer_types):
        if kind not in LAYER_TYPES:
          raise ValueError(f"layer_types[{i}] is {kind!r}; each must be one "
                           f"of {LAYER_TYPES}")
      if "sliding_attention" in self.layer_types and (
          self.sliding_window is None):
        raise ValueError("layer_types has sliding_attention layers but "
                         "sliding_window is None")

  def replace(self, **changes) -> "DecoderConfig":
    return dataclasses.replace(self, **changes)

  def is_sliding(self, layer: int) -> bool:
    """Whether layer ``layer`` attends through the sliding window."""
    if self.sliding_window is None:
      return False
    return (self.layer_types is None
            or self.layer_types[layer] == "sliding_attention")

  def attention(self, layer: int) -> AttentionLayerConfig:
    """Layer ``layer``'s attention: its window and RoPE, the model's
    other options."""
    sliding = self.is_sliding(layer)
    local = sliding and self.local_rope_theta is not None
    scale = (None if self.query_pre_attn_scalar is None else
             float(self.query_pre_attn_scalar) ** -0.5)
    return AttentionLayerConfig(
        embed_dim=self.hidden_size, num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        is_causal=True, sliding_window=self.sliding_window if sliding else None,
        logits_soft_cap=self.logits_soft_cap, scale=scale,
        rope_max_wavelength=self.local_rope_theta if local else self.rope_theta,
        rope_scaling=None if local else self.rope_scaling,
        qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
        qk_norm_eps=self.rms_norm_eps,
        zero_centered_norm=self.zero_centered_norm, dtype=self.dtype,
        param_dtype=self.param_dtype, implementation=self.implementation,
        context_parallel=self.context_parallel, rules=self.rules,
        param_rules=self.param_rules)

  def layer_period(self) -> int:
    """The fewest layers ``p`` after which the layers' attention repeats:
    layer ``l`` attends as layer ``l - p`` for every ``l >= p`` (1: every
    layer alike; Gemma 3's five sliding layers and one global: 6)."""
    kinds = [self.attention(layer) for layer in range(self.num_layers)]
    return next(p for p in range(1, self.num_layers + 1)
                if all(kinds[l] == kinds[l - p]
                       for l in range(p, self.num_layers)))

  def scanned_groups(self) -> int:
    """How many groups of ``layer_period()`` blocks the layer scan runs
    (``scan_layers``): the whole groups among the first ``num_layers -
    remat_skip`` blocks, or 0 where fewer than two (nothing is scanned)."""
    groups = (self.num_layers - self.remat_skip) // self.layer_period()
    return groups if self.scan_layers and groups >= 2 else 0

  def num_params(self) -> int:
    e, m, v = self.hidden_size, self.intermediate_size, self.vocab_size
    n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
    attn = (e * h * (2 * n + 2 * k) + (n + 2 * k) * h * self.qkv_bias
            + 2 * h * self.qk_norm)
    norms = e * (4 if self.sandwich_norm else 2)
    embeddings = v * e * (1 if self.tie_word_embeddings else 2)
    return embeddings + e + self.num_layers * (attn + 3 * e * m + norms)
