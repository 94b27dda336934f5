"""Models users already have, on jax_ring attention
(``pip install jax-ring[models]``).

* :class:`Llama` and :class:`LlamaConfig`: the Llama family (Llama 2/3,
  Qwen2/2.5, Mistral) in Flax NNX, context-parallel from one config field;
  :func:`model_rules` for its sharding; :func:`lm_loss`.
* :func:`load_pretrained` and :func:`save_pretrained`: local Hugging Face
  checkpoints (``config.json`` + ``*.safetensors``), placed on the mesh
  tensor by tensor; :func:`config_from_hf`, :func:`config_to_hf`.
"""

from jax_ring.models.hf_checkpoint import load_pretrained, save_pretrained
from jax_ring.models.hf_config import config_from_hf, config_to_hf
from jax_ring.models.llama import Llama, LlamaConfig, lm_loss, model_rules


__all__ = [
    "Llama",
    "LlamaConfig",
    "config_from_hf",
    "config_to_hf",
    "lm_loss",
    "load_pretrained",
    "model_rules",
    "save_pretrained",
]
