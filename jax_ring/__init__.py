"""jax_ring: exact long-context attention for JAX, on one device or many.

Public API (everything else lives in ``jax_ring._src``):

* :func:`dot_product_attention`: a drop-in superset of
  ``jax.nn.dot_product_attention``.
* :func:`decode_attention`: new tokens against a KV cache masked by
  position, on one device or with the cache split over a mesh axis;
  :func:`explain_decode`: which kernel it runs, and why.
* Inside ``shard_map``, one function per context-parallel strategy:
  :func:`ring_attention`, :func:`all_gather_attention`,
  :func:`ulysses_attention`, :func:`hybrid_attention`; and the
  load-balance reorder helpers :func:`reorder_for_load_balance`,
  :func:`reorder_from_load_balance`;
  :func:`balance_documents`, an order of packed rows' documents that
  spreads their work over contiguous shards.
* :class:`ContextParallel` for the automatic path, and :func:`explain`:
  what ``strategy="auto"`` picks for the forward and the backward, and why.
* :class:`AttentionConfig`, :class:`BlockMask`, :func:`attention` and
  :func:`attention_backward`: the block-kernel contract that the
  context-parallel strategies build on.
"""

import jax_ring._src.backends  # noqa: F401  (the block backends register)
from jax_ring._src.api import dot_product_attention
from jax_ring._src.auto import explain
from jax_ring._src.decode import decode_attention, explain_decode
from jax_ring._src.core.config import AttentionConfig, ContextParallel
from jax_ring._src.core.kernel import attention, attention_backward
from jax_ring._src.core.mask import MASK_VALUE, BlockMask
from jax_ring._src.strategies.all_gather import all_gather_attention
from jax_ring._src.strategies.documents import balance_documents
from jax_ring._src.strategies.hybrid import hybrid_attention
from jax_ring._src.strategies.layout import (reorder_for_load_balance,
                                             reorder_from_load_balance)
from jax_ring._src.strategies.ring import ring_attention
from jax_ring._src.strategies.ulysses import ulysses_attention


__all__ = [
    "AttentionConfig",
    "BlockMask",
    "ContextParallel",
    "MASK_VALUE",
    "all_gather_attention",
    "attention",
    "attention_backward",
    "balance_documents",
    "decode_attention",
    "dot_product_attention",
    "explain",
    "explain_decode",
    "hybrid_attention",
    "reorder_for_load_balance",
    "reorder_from_load_balance",
    "ring_attention",
    "ulysses_attention",
]
__version__ = "0.1.0"
