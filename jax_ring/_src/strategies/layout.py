"""Load-balance layouts: which device holds which tokens of the sequence.

With a causal mask, contiguous sharding gives device N-1 all of the work of
the last rows and device 0 almost none. Two layouts give every device early
and late tokens alike (S tokens, N devices, T = S / N tokens each):

* ``"dual_chunk"`` ("zigzag"): the sequence is cut into 2N chunks and device
  r holds chunks r and 2N-1-r, one early and one late; needs S % 2N == 0;
* ``"striped"``: token i goes to device i mod N, as local token i // N, so
  device r holds tokens r, r+N, r+2N, ...; needs S % N == 0.

Under both, each device's local tokens are in increasing global order, so
the valid tokens under a padding length are a prefix of the shard
(:func:`prefix`; :func:`chunk_ids` names a device's chunks).

``reorder_for_load_balance`` permutes a global array so that plain
contiguous sharding of the sequence axis yields the layout;
``reorder_from_load_balance`` undoes it. Apply the same reorder to q, k, v,
positions, segment ids, labels and loss masks. The table of who holds
what: docs/design.md, "Load-balance layouts and the reorder helpers".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src.core import ints
# The closed choice lives with the other static options, in config.
from jax_ring._src.core.config import LOAD_BALANCES, LoadBalance, ShardPlan


def _dual_chunk_order(cp_size: int) -> np.ndarray:
  """Chunk ids in device order: [0, 2N-1, 1, 2N-2, ...]."""
  return np.stack([np.arange(cp_size), 2 * cp_size - 1 - np.arange(cp_size)],
                  axis=1).reshape(-1)


def _split(x, parts, seq_axis, layout, needs):
  """``x`` with its sequence axis split into ``parts`` equal pieces."""
  s = x.shape[seq_axis]
  if s % parts:
    raise ValueError(
        f"sequence length {s} (axis {seq_axis} of shape {tuple(x.shape)}) "
        f"must be divisible by {needs} = {parts} for the {layout} load "
        "balance")
  return x.reshape(x.shape[:seq_axis] + (parts, s // parts) +
                   x.shape[seq_axis + 1:])


def dual_chunk_swap(x, axis: str, size: int, mesh, *, inverse=False):
  """Natural order <-> the dual-chunk layout along axis 1 of ``x``, split
  over mesh axis ``axis`` of ``size`` devices (the output split as the
  input): each device holds two of the ``2 * size`` chunks, and each moves
  once, in two ppermutes of one chunk a device. (A gather of chunk ids,
  as :func:`reorder_for_load_balance` is, the partitioner turns into an
  all-gather of the whole sequence onto every device.)"""
  last = 2 * size - 1
  other = lambda j: j if j < size else last - j  # chunk j's device, laid out

  def local(y):
    a, b = jnp.split(y, 2, axis=1)  # the device's two chunks
    even = jax.lax.axis_index(axis) % 2 == 0
    pick = lambda p, q: (jnp.where(even, p, q), jnp.where(even, q, p))
    if not inverse:  # device e holds chunks 2e, 2e + 1; device d takes
      # chunk d (of d's parity) and chunk 2N-1-d (of the other)
      r0 = jax.lax.ppermute(a, axis, [(e, other(2 * e)) for e in range(size)])
      r1 = jax.lax.ppermute(b, axis, [(e, other(2 * e + 1))
                                      for e in range(size)])
      return jnp.concatenate(pick(r0, r1), axis=1)
    to_even, to_odd = pick(a, b)  # device e's even chunk, then its odd one
    s0 = jax.lax.ppermute(to_even, axis, [
        (e, (e if e % 2 == 0 else last - e) // 2) for e in range(size)])
    s1 = jax.lax.ppermute(to_odd, axis, [
        (e, (last - e if e % 2 == 0 else e) // 2) for e in range(size)])
    return jnp.concatenate([s0, s1], axis=1)

  spec = jax.sharding.PartitionSpec(None, axis)
  return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec,
                       axis_names={axis})(x)


def explicit_axes(mesh) -> tuple[str, ...]:
  """The mesh's axes of type Explicit (jax 0.10's ``make_mesh`` default)."""
  return tuple(a for a, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == jax.sharding.AxisType.Explicit)


def _reorder(x, cp_size, seq_axis, layout, inverse):
  cp_size = ints.positive_int("cp_size", cp_size)
  x = jnp.asarray(x)
  sharding = getattr(jax.typeof(x), "sharding", None)
  explicit = explicit_axes(sharding.mesh) if sharding is not None else ()
  if explicit:  # the permutation is a gather: placed by the partitioner
    return jax.sharding.auto_axes(
        lambda y: _permute(y, cp_size, seq_axis, layout, inverse),
        axes=explicit, out_sharding=sharding)(x)
  return _permute(x, cp_size, seq_axis, layout, inverse)


def _permute(x, cp_size, seq_axis, layout, inverse):
  seq_axis = seq_axis % x.ndim
  if layout == "dual_chunk":
    chunks = _split(x, 2 * cp_size, seq_axis, layout, "2 * cp_size")
    order = _dual_chunk_order(cp_size)
    if inverse:
      order = np.argsort(order)
    return jnp.take(chunks, order, axis=seq_axis).reshape(x.shape)
  if layout == "striped":
    # Natural order is (T, N) row-major: token a * N + r. Device-major
    # order is (N, T): device r's local token a. A transpose maps one to
    # the other.
    y = _split(x, cp_size, seq_axis, layout, "cp_size")  # (N, T) pieces
    if not inverse:  # natural: read the same memory as (T, N)
      y = y.reshape(x.shape[:seq_axis] + (y.shape[seq_axis + 1], cp_size) +
                    x.shape[seq_axis + 1:])
    return jnp.swapaxes(y, seq_axis, seq_axis + 1).reshape(x.shape)
  raise ValueError(f"layout must be one of {LOAD_BALANCES}; got {layout!r}")


def reorder_for_load_balance(x, cp_size: int, *, seq_axis: int = 1,
                             layout: LoadBalance = "dual_chunk"):
  """Global natural order -> device-major ``layout`` order along seq_axis,
  so that contiguous sharding gives each device its tokens (module doc)."""
  return _reorder(x, cp_size, seq_axis, layout, inverse=False)


def reorder_from_load_balance(x, cp_size: int, *, seq_axis: int = 1,
                              layout: LoadBalance = "dual_chunk"):
  """Inverse of :func:`reorder_for_load_balance`."""
  return _reorder(x, cp_size, seq_axis, layout, inverse=True)


def chunk_ids(plan: ShardPlan, device):
  """Global chunk ids device ``device`` holds, in its local (increasing)
  order; chunks are ``T / len(ids)`` tokens long."""
  if plan.load_balance == "striped":
    # One-token chunks [r, r + N, ...] would be exact but make every
    # chunk-wise caller do T calls; callers must handle striped themselves.
    raise ValueError(
        "load_balance='striped' has no chunk layout (token i is on device "
        "i % cp_size); chunk_ids serves 'dual_chunk' and contiguous shards")
  if plan.load_balance == "dual_chunk":
    return [device, 2 * plan.cp_size - 1 - device]
  return [device]


def prefix(lengths, chunks, c):
  """Valid tokens of a block made of ``chunks`` (increasing global ids, c
  tokens each) under global ``lengths (B,)``: they form a prefix."""
  if lengths is None:
    return None
  return sum(jnp.clip(lengths - ch * c, 0, c) for ch in chunks)


def work_balance(segment_ids, cp_size: int, layout,
                 is_causal: bool = True) -> float:
  """The most-loaded device's attention work over the mean, for packed
  rows ``segment_ids`` (B, S) (host values; each document one run) in
  natural order, split over ``cp_size`` devices in ``layout`` (None:
  contiguous). A token's work is the keys it sees: its offset in its
  document plus 1 (causal), or its document's length. 1.0 is even; a ring
  or all-gather step waits for the most loaded device (Ulysses is
  balanced by heads whatever the layout)."""
  ids = np.asarray(segment_ids)
  b, s = ids.shape
  starts = np.ones((b, s), bool)
  starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
  index = np.broadcast_to(np.arange(s), (b, s))
  offset = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
  if is_causal:
    work = offset + 1
  else:  # each token: its document's length
    run = np.cumsum(starts, axis=1) - 1
    work = np.stack([np.bincount(r)[r] for r in run])
  work = work.astype(np.float32)
  if layout is not None:
    work = np.asarray(reorder_for_load_balance(work, cp_size, layout=layout))
  per_device = work.reshape(b, cp_size, s // cp_size).sum((0, 2))
  return float(per_device.max() / per_device.mean())
