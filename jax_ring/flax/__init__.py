"""jax_ring for Flax NNX models (``pip install jax-ring[flax]``).

* :class:`Attention` and its :class:`AttentionLayerConfig`: a drop-in
  attention layer (projections, q/k norms, RoPE with Llama 3's or linear
  scaling, GQA, causal/packed/sliding masks, soft cap) that calls
  :func:`jax_ring.dot_product_attention`, context-parallel when
  configured, sharded through MaxText-style logical axis rules
  (:func:`logical_rules`; weights FSDP-sharded with :func:`fsdp_rules`).
* :func:`attention_fn`: jax_ring (and context parallelism) as the
  ``attention_fn`` of flax's own ``nnx.MultiHeadAttention`` and linen
  ``MultiHeadDotProductAttention``, keeping their weights.
* Language-model batches for context parallelism: :func:`make_lm_batch`,
  :func:`reorder_batch`, :func:`order_documents`, :func:`shard_batch`,
  :func:`prepare_lm_batch`, :func:`reorder_size`.
"""

from jax_ring.flax.adapter import attention_fn
from jax_ring.flax.attention import (LOGICAL_AXES, Attention,
                                     AttentionLayerConfig, LinearRopeScaling,
                                     Llama3RopeScaling, apply_rope,
                                     constrain, fsdp_rules, logical_rules,
                                     rms_norm)
from jax_ring.flax.data import (LMBatch, document_positions, make_lm_batch,
                                order_documents, prepare_lm_batch,
                                reorder_batch, reorder_size, shard_batch)


__all__ = [
    "Attention",
    "AttentionLayerConfig",
    "LMBatch",
    "LOGICAL_AXES",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "apply_rope",
    "attention_fn",
    "constrain",
    "document_positions",
    "fsdp_rules",
    "logical_rules",
    "make_lm_batch",
    "order_documents",
    "prepare_lm_batch",
    "reorder_batch",
    "reorder_size",
    "rms_norm",
    "shard_batch",
]
