"""The mask description of the block-kernel contract, and the one mask builder.

A block call sees a query block and a key/value block that may be slices of a
longer sequence held elsewhere (a ring step). The static half of the mask
(causal, window) is in :class:`~jax_ring._src.core.config.AttentionConfig`; the
runtime half is a :class:`BlockMask`:

=================  ===========  ==============================================
field              shape        meaning
=================  ===========  ==============================================
``q_offset``       ``()``       global position of this query block's row 0
``kv_offset``      ``()``       global position of this kv block's row 0
``q_segment_ids``  ``(B, T)``   packed-document id of each query token
``kv_segment_ids`` ``(B, S)``   packed-document id of each key token; None
                                with q ids set: the same ids (T == S), which
                                a backend may exploit (cuDNN's ragged path)
``q_lengths``      ``(B,)``     queries at global position ``>= q_lengths``
                                are padding (output 0)
``kv_lengths``     ``(B,)``     keys at global position ``>= kv_lengths``
                                are padding (never attended)
``dense``          ``(B|1, N|1, T, S)``  arbitrary boolean mask, True = keep
``prepared``       pytree       what the block's backend computes ahead of
                                the call (``kernel.prepare``), set by a
                                strategy that branches before the block;
                                None: the backend computes it in the call
=================  ===========  ==============================================

Query ``i`` sees key ``j`` iff every present condition holds, with global
positions ``p_q = q_offset + i`` and ``p_k = kv_offset + j``:

* causal: ``p_k <= p_q``; window ``(L, R)``: ``p_q - L <= p_k <= p_q + R``;
* segments: ``q_segment_ids[b, i] == kv_segment_ids[b, j]``;
* lengths: ``p_q < q_lengths[b]`` and ``p_k < kv_lengths[b]``;
* dense: ``dense[b, n, i, j]``.

So "this Q chunk starts at global token a, this KV chunk at token b" is
``BlockMask(q_offset=a, kv_offset=b)``, and windows, segments and lengths
compose with it. Offsets may be Python ints or traced int32 scalars.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


Array = Any

# Finite stand-in for log(0): the logit of a hidden entry and the lse of a
# fully masked row. It is finite so that ring merges, which subtract lse
# values, never form -inf - (-inf) = NaN; a fully masked row then merges as
# "weight 0" against any real row, and as zeros against another masked row.
MASK_VALUE = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """Runtime mask operands of one block call. See the module docstring."""

  q_offset: Array = 0
  kv_offset: Array = 0
  q_segment_ids: Array | None = None
  kv_segment_ids: Array | None = None
  q_lengths: Array | None = None
  kv_lengths: Array | None = None
  dense: Array | None = None
  prepared: Any = None

  @property
  def same_ids(self) -> bool:
    """Queries and keys carry one id array (kv ids None, or the very same
    array): the static fact that lets a backend treat them as the same
    tokens. The one test of it for a block; ``TokenMask.of`` makes it."""
    return (self.kv_segment_ids is None or
            self.kv_segment_ids is self.q_segment_ids)

  def kv_ids(self):
    """The kv segment ids (the query's when they are the same)."""
    return self.q_segment_ids if self.same_ids else self.kv_segment_ids

  def as_operands(self) -> "BlockMask":
    """Offsets as Python ints (static) or int32 scalars (traced), ids and
    lengths as int32, dense as bool."""
    cast = lambda x, dt: None if x is None else jnp.asarray(x, dt)
    offset = lambda x: int(x) if isinstance(x, (int, np.integer)) else cast(
        x, jnp.int32)
    return BlockMask(
        q_offset=offset(self.q_offset),
        kv_offset=offset(self.kv_offset),
        q_segment_ids=cast(self.q_segment_ids, jnp.int32),
        kv_segment_ids=None if self.same_ids else cast(self.kv_segment_ids,
                                                       jnp.int32),
        q_lengths=cast(self.q_lengths, jnp.int32),
        kv_lengths=cast(self.kv_lengths, jnp.int32),
        dense=cast(self.dense, jnp.bool_),
        prepared=self.prepared,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMask:
  """Per-token mask operands of a context-parallel call, on local shards.

  Segment ids are this device's ``(B, T)`` query ids and ``(B, T)`` kv ids,
  in the shard's layout (they travel with the tokens); kv ids None with query
  ids set means the same ids (one array), a fact that, unlike array
  identity, survives pytree flattening (custom_vjp, cond, partitioning).
  Lengths are ``(B,)`` in *global* natural-order positions, the same on every
  device. A strategy turns them into one ``BlockMask`` per block call.
  """

  q_segment_ids: Array | None = None
  kv_segment_ids: Array | None = None
  q_lengths: Array | None = None
  kv_lengths: Array | None = None

  @classmethod
  def of(cls, q_ids, kv_ids, q_lengths, kv_lengths) -> "TokenMask":
    """The int32 operands; one array for both sides (``kv_ids is q_ids``)
    becomes kv ids None, the encoding of "same ids"."""
    return cls(q_segment_ids=q_ids,
               kv_segment_ids=None if kv_ids is q_ids else kv_ids,
               q_lengths=q_lengths, kv_lengths=kv_lengths).as_int32()

  @property
  def same_ids(self) -> bool:
    """Packed documents whose queries and keys carry the same ids."""
    return self.q_segment_ids is not None and self.kv_segment_ids is None

  def kv_ids(self):
    """The kv segment ids (the query's when they are the same)."""
    return self.q_segment_ids if self.same_ids else self.kv_segment_ids

  def as_int32(self) -> "TokenMask":
    """Every array as int32."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), self)

  def block_mask(self) -> BlockMask:
    """One block call over the whole (unsharded) sequence: global
    positions, offsets 0, the same ids kept as one array."""
    return BlockMask(q_segment_ids=self.q_segment_ids,
                     kv_segment_ids=self.kv_segment_ids,
                     q_lengths=self.q_lengths, kv_lengths=self.kv_lengths)


def block_visibility(mask: BlockMask, config, *, q_start, kv_start, block_q,
                     block_kv, q_len, kv_len, heads):
  """Boolean visibility of one (query block, kv block) tile.

  Args:
    mask: the block call's ``BlockMask`` (operands already padded to whole
      blocks along T and S).
    config: the ``AttentionConfig`` (``is_causal``, ``local_window``).
    q_start, kv_start: local index of the tile's first query / key row.
    block_q, block_kv: tile size.
    q_len, kv_len: true (unpadded) local lengths T and S; rows past them are
      the backend's block padding and are always hidden.
    heads: ``(K, G)``, kv heads and query heads per kv head.

  Returns:
    bool array broadcastable to ``(B, K, G, block_q, block_kv)``.
  """
  qi = q_start + jnp.arange(block_q, dtype=jnp.int32)
  kj = kv_start + jnp.arange(block_kv, dtype=jnp.int32)
  vis = (qi < q_len)[:, None] & (kj < kv_len)[None, :]
  pq = (mask.q_offset + qi)[:, None]
  pk = (mask.kv_offset + kj)[None, :]
  left, right = config.band
  if right is not None:
    vis &= pk <= pq + right
  if left is not None:
    vis &= pk >= pq - left
  vis = vis[None, None, None]  # (1, 1, 1, bq, bk)

  if mask.q_segment_ids is not None:
    kv_ids = mask.kv_ids()
    sq = jax.lax.dynamic_slice_in_dim(mask.q_segment_ids, q_start, block_q, 1)
    sk = jax.lax.dynamic_slice_in_dim(kv_ids, kv_start, block_kv, 1)
    vis = vis & (sq[:, :, None] == sk[:, None, :])[:, None, None]
  if mask.q_lengths is not None:
    ok = pq[None, :, :] < mask.q_lengths[:, None, None]
    vis = vis & ok[:, None, None]
  if mask.kv_lengths is not None:
    ok = pk[None, :, :] < mask.kv_lengths[:, None, None]
    vis = vis & ok[:, None, None]
  if mask.dense is not None:
    d = jax.lax.dynamic_slice_in_dim(mask.dense, q_start, block_q, 2)
    d = jax.lax.dynamic_slice_in_dim(d, kv_start, block_kv, 3)
    vis = vis & group_heads(d, heads)
  return vis


def group_heads(x, heads):
  """``(B|1, N|1, ...)`` -> ``(B|1, K|1, G|1, ...)`` matching grouped logits."""
  k, g = heads
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], k, g, *x.shape[2:])


def kv_block_range(config, mask: BlockMask, q_start, block_q, block_kv,
                   num_kv_blocks):
  """``[lo, hi)`` of kv blocks that causal/window masks leave visible.

  Only the static mask kinds prune whole blocks; segments, lengths and dense
  masks are applied inside the tile. Works with traced offsets.
  """
  lo, hi = 0, num_kv_blocks
  shift = mask.q_offset - mask.kv_offset  # p_q - p_k for local i == j
  first_q = q_start + shift  # kv-local index of the tile's first query
  last_q = first_q + block_q - 1
  left, right = config.band
  if left is not None:
    lo = jnp.maximum(0, jnp.floor_divide(first_q - left, block_kv))
  if right is not None:
    hi = jnp.minimum(num_kv_blocks,
                     jnp.floor_divide(last_q + right, block_kv) + 1)
  return lo, hi


def q_block_range(config, mask: BlockMask, kv_start, block_q, block_kv,
                  num_q_blocks):
  """``[lo, hi)`` of query blocks that can see the kv tile at ``kv_start``."""
  lo, hi = 0, num_q_blocks
  shift = mask.kv_offset - mask.q_offset  # p_k - p_q for local j == i
  first_k = kv_start + shift  # q-local index of the tile's first key
  last_k = first_k + block_kv - 1
  # A query sees key k only if p_k - right <= p_q <= p_k + left.
  left, right = config.band
  if left is not None:
    hi = jnp.minimum(num_q_blocks,
                     jnp.floor_divide(last_k + left, block_q) + 1)
  if right is not None:
    lo = jnp.maximum(0, jnp.floor_divide(first_k - right, block_q))
  return lo, hi
