"""Models users already have, on jax_ring attention
(``pip install jax-ring[models]``).

* :class:`Decoder` and :class:`DecoderConfig`: one decoder for Llama 2/3,
  Qwen2/2.5, Mistral, Qwen3, Gemma 2 and Gemma 3 (text) in Flax NNX, the
  family set by config fields, context-parallel from one of them;
  ``Llama`` and ``LlamaConfig`` are the same classes.
  :func:`model_rules` for its sharding; :func:`lm_loss`.
* :func:`load_pretrained` and :func:`save_pretrained`: local Hugging Face
  checkpoints (``config.json`` + ``*.safetensors``), placed on the mesh
  tensor by tensor; :func:`config_from_hf`, :func:`config_to_hf`.
* LoRA in PEFT's format: :func:`add_lora`, :func:`save_adapter`,
  :func:`load_adapter`, :func:`merge_lora`.
* :class:`Generator` (and :func:`generate`): prefill and a compiled decode
  step over a :class:`KVCache` split along the sequence over the context
  axes; :class:`Sampling`.
"""

from jax_ring.flax.attention import LinearRopeScaling, Llama3RopeScaling
from jax_ring.models.config import DecoderConfig, model_rules
from jax_ring.models.decoder import Decoder
from jax_ring.models.loss import lm_loss
from jax_ring.models.generation import Generator, KVCache, Sampling, generate
from jax_ring.models.hf_checkpoint import load_pretrained, save_pretrained
from jax_ring.models.hf_config import config_from_hf, config_to_hf
from jax_ring.models.lora import (add_lora, load_adapter, merge_lora,
                                  save_adapter)

# The Llama family's names for the same classes.
Llama = Decoder
LlamaConfig = DecoderConfig


__all__ = [
    "Decoder",
    "DecoderConfig",
    "Generator",
    "KVCache",
    "LinearRopeScaling",
    "Llama",
    "Llama3RopeScaling",
    "LlamaConfig",
    "Sampling",
    "add_lora",
    "config_from_hf",
    "config_to_hf",
    "generate",
    "lm_loss",
    "load_adapter",
    "load_pretrained",
    "merge_lora",
    "model_rules",
    "save_adapter",
    "save_pretrained",
]
