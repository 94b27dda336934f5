"""Language-model batches for context parallelism: positions, labels and loss
masks from token ids, the load-balance reorder applied to all of them at
once, and placement on the mesh.

Shapes: B batch, S sequence.

The loss is computed in the reordered layout: a masked mean over tokens does
not depend on their order, so nothing is ever put back. What must hold is
that every per-token array (inputs, positions, segment ids, labels, loss
mask) went through the *same* permutation, which is why one function
reorders the whole batch. Labels are built in natural order (the next token
of the sequence), *then* reordered with the rest.

Everything here is NumPy, on the host: it is the input pipeline, it runs
before the data exists on any device, and under ``jax.distributed`` every
process builds the same global batch and places only its own shards.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ring._src.core.config import ContextParallel, LoadBalance
from jax_ring._src.strategies.documents import balance_documents
from jax_ring._src.strategies.layout import reorder_for_load_balance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LMBatch:
  """A next-token-prediction batch; every field is ``(B, S)``.

  Attributes:
    inputs: int32 token ids fed to the model.
    positions: int32 position of each token in its document (restarts at 0
      where the segment id changes); what RoPE takes.
    segment_ids: int32 document ids (packed documents attend only within
      their id; 0 is padding, by MaxText's convention), or None.
    labels: int32 the next token in sequence order (0 where there is none).
    loss_mask: float32, 1 where ``labels`` is a real next token of the same
      document, 0 at a document's last token, on padding and at the end of
      the row.
  """

  inputs: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray | None
  labels: np.ndarray
  loss_mask: np.ndarray


def document_positions(segment_ids) -> np.ndarray:
  """``(B, S)`` position of each token within its run of equal segment ids,
  e.g. ids ``[1 1 1 2 2 0 0]`` -> ``[0 1 2 0 1 0 1]``."""
  ids = np.asarray(segment_ids)
  idx = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  new = np.ones(ids.shape, bool)
  new[:, 1:] = ids[:, 1:] != ids[:, :-1]
  start = np.maximum.accumulate(np.where(new, idx, 0), axis=1)
  return (idx - start).astype(np.int32)


def make_lm_batch(tokens, segment_ids=None, *, pad_id: int | None = None,
                  targets=None) -> LMBatch:
  """Build a batch in natural (sequence) order.

  Args:
    tokens: ``(B, S)`` int token ids.
    segment_ids: ``(B, S)`` int ids of packed documents (0 = padding), or
      None for one document per row.
    pad_id: without segment ids, tokens equal to it are padding.
    targets: ``(B, S)`` bool, the tokens the loss predicts (e.g. the
      responses of supervised fine-tuning data, not their prompts), or None
      for every token.

  Returns:
    An :class:`LMBatch` of NumPy arrays. The label of position ``i`` is
    token ``i + 1``; no loss where ``i + 1`` starts another document, is
    padding, is not a target, or is past the row's end.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be (B, S); got shape {tokens.shape}")
  if segment_ids is not None:
    segment_ids = np.asarray(segment_ids, np.int32)
    if segment_ids.shape != tokens.shape:
      raise ValueError(f"segment_ids must have the shape of tokens "
                       f"{tokens.shape}; got {segment_ids.shape}")
    real = segment_ids != 0
    positions = document_positions(segment_ids)
  else:
    real = (np.ones(tokens.shape, bool) if pad_id is None
            else tokens != pad_id)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32),
                                tokens.shape)
  labels = np.zeros(tokens.shape, np.int32)
  labels[:, :-1] = tokens[:, 1:]
  mask = np.zeros(tokens.shape, bool)
  mask[:, :-1] = real[:, :-1] & real[:, 1:]
  if segment_ids is not None:
    mask[:, :-1] &= segment_ids[:, :-1] == segment_ids[:, 1:]
  if targets is not None:
    targets = np.asarray(targets, bool)
    if targets.shape != tokens.shape:
      raise ValueError(f"targets must have the shape of tokens "
                       f"{tokens.shape}; got {targets.shape}")
    mask[:, :-1] &= targets[:, 1:]
  return LMBatch(inputs=tokens.astype(np.int32),
                 positions=np.ascontiguousarray(positions, np.int32),
                 segment_ids=segment_ids, labels=labels,
                 loss_mask=mask.astype(np.float32))


def reorder_batch(batch: LMBatch, cp_size: int,
                  load_balance: LoadBalance | None = "dual_chunk") -> LMBatch:
  """Put every field of ``batch`` in the load-balance layout (the same
  permutation for all, taken from ``jax_ring.reorder_for_load_balance``)."""
  if load_balance is None or cp_size == 1:
    return batch
  s = batch.inputs.shape[1]
  perm = np.asarray(reorder_for_load_balance(
      np.arange(s)[None], cp_size, layout=load_balance))[0]
  return jax.tree.map(lambda x: x[:, perm], batch)


def order_documents(batch: LMBatch, cp_size: int) -> LMBatch:
  """Every field of ``batch`` in one order of each row's documents,
  ``jax_ring.balance_documents``': whole documents moved so that
  ``cp_size`` contiguous shards hold about even causal work. Labels and
  loss masks move with their tokens and stay right, since a document's
  tokens stay together and in order; nothing is ever put back. Without
  segment ids (one document a row), the batch as it is."""
  if batch.segment_ids is None or cp_size == 1:
    return batch
  order = balance_documents(batch.segment_ids, cp_size)
  return jax.tree.map(lambda x: np.take_along_axis(x, order, 1), batch)


def shard_batch(batch: LMBatch, mesh: jax.sharding.Mesh, spec: P) -> LMBatch:
  """Place a global host batch on ``mesh`` with ``spec`` (e.g.
  ``P("data", "context")``). Each process copies only the shards of its own
  devices, so this works unchanged under ``jax.distributed``."""
  sharding = NamedSharding(mesh, spec)

  def put(x):
    return jax.make_array_from_callback(x.shape, sharding,
                                        lambda index: x[index])

  return jax.tree.map(put, batch)


def reorder_size(context_parallel: ContextParallel | None,
                 mesh: jax.sharding.Mesh) -> int:
  """The ``cp_size`` a ``ContextParallel``'s layout is built for: the size of
  its axis, or for ``"hybrid"`` (axis = (ulysses, ring)) of the ring axis
  (the load balance is a ring-level choice; see
  ``jax_ring._src.strategies.hybrid``).
  1 without context parallelism."""
  if context_parallel is None:
    return 1
  return mesh.shape[context_parallel.ring_axis]


def prepare_lm_batch(tokens, segment_ids=None, *, mesh: jax.sharding.Mesh,
                     spec: P,
                     context_parallel: ContextParallel | None = None,
                     pad_id: int | None = None, targets=None,
                     even_documents: bool = False) -> LMBatch:
  """:func:`make_lm_batch`, :func:`order_documents` (if asked),
  :func:`reorder_batch`, :func:`shard_batch`.

  Args:
    tokens: ``(B, S)`` global token ids in natural order (host array).
    segment_ids: ``(B, S)`` packed-document ids or None.
    mesh: the device mesh.
    spec: the ``(B, S)`` sharding, e.g. ``P("data", "context")``, or
      ``P("data", ("ring", "ulysses"))`` for ``"hybrid"``.
    context_parallel: the ``jax_ring.ContextParallel`` the model's attention
      uses: with ``inputs="load_balanced"`` its ``load_balance`` and axis
      fix the layout the batch is put in; otherwise (or None) the batch
      stays in natural order.
    pad_id, targets: see :func:`make_lm_batch`.
    even_documents: reorder each row's packed documents for even work over
      the context devices (:func:`order_documents`), for contiguous shards:
      ``context_parallel`` must have ``load_balance=None`` (else a
      ``ValueError``). Each id must be one run.

  Returns:
    An :class:`LMBatch` of global ``jax.Array``s in the layout the
    attention expects.
  """
  batch = make_lm_batch(tokens, segment_ids, pad_id=pad_id, targets=targets)
  if even_documents:
    if context_parallel is None or context_parallel.load_balance is not None:
      raise ValueError(
          "even_documents=True orders documents for contiguous shards: give "
          "context_parallel=ContextParallel(..., load_balance=None); got "
          f"{context_parallel!r}")
    batch = order_documents(batch, reorder_size(context_parallel, mesh))
  if context_parallel is not None and (
      context_parallel.inputs == "load_balanced"):
    batch = reorder_batch(batch, reorder_size(context_parallel, mesh),
                          context_parallel.load_balance)
  return shard_batch(batch, mesh, spec)
