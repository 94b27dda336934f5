"""The example's model: ``jax_ring.models.Llama`` (RMSNorm, RoPE, SwiGLU,
GQA, on ``jax_ring.flax.Attention``) in the shapes of the example's presets,
and its masked next-token loss.

Shapes: B batch, S sequence (in the batch's token layout), E embed, M MLP
width, V vocabulary. Logical axes beyond the attention layer's: ``mlp``,
``vocab``, ``norm`` (see :func:`model_rules`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

import jax_ring
from jax_ring import models

model_rules = models.model_rules
loss_fn = models.lm_loss


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape and options of the example's model (frozen, hashable),
  in the presets' terms; :meth:`llama` is the model's own config.

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
  tie_word_embeddings: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  implementation: str | None = None
  context_parallel: jax_ring.ContextParallel | None = None
  rules: tuple = ()
  param_rules: tuple | None = None  # the weights' (FSDP); None: rules
  remat: bool | str = False  # True, False or "attention" (LlamaConfig)
  scan_layers: bool = True  # the blocks as one lax.scan (LlamaConfig)

  def llama(self) -> models.LlamaConfig:
    return models.LlamaConfig(
        vocab_size=self.vocab_size, hidden_size=self.embed_dim,
        intermediate_size=self.mlp_dim, num_layers=self.num_layers,
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, rope_theta=self.rope_max_wavelength,
        tie_word_embeddings=self.tie_word_embeddings,
        sliding_window=self.sliding_window,
        logits_soft_cap=self.logits_soft_cap, dtype=self.dtype,
        param_dtype=self.param_dtype, implementation=self.implementation,
        context_parallel=self.context_parallel, rules=self.rules,
        param_rules=self.param_rules, remat=self.remat,
        scan_layers=self.scan_layers)

  def num_params(self) -> int:
    return self.llama().num_params()


def Transformer(cfg: ModelConfig, *, rngs):  # noqa: N802 (a model class)
  """Token ids ``(B, S)`` -> logits ``(B, S, V)`` float32."""
  return models.Llama(cfg.llama(), rngs=rngs)
