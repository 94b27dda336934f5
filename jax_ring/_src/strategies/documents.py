"""A document order for packed rows under contiguous shards: whole documents
moved within the row so that every device's causal work is about even.

A packed row's documents may come in any order (each attends only within
itself, and positions restart per document), so reordering whole
documents changes no output, only which device holds which. In the user's
order a few long documents can put most of the quadratic work on one or
two devices (``explain``'s ``balance``); in this order each device's
share is about even (measured against the step time: docs/decisions.md,
"Layouts"). Where it costs the most-loaded device at most
``ALIGNED_SLACK`` more work, the order also ends every shard on a
document's end, so that no document crosses a shard and the ring on
contiguous shards needs no step after each device's own block.

Host NumPy, for the input pipeline, before the data reaches any device:
the permutation moves tokens, and moving them on the devices would cost an
all-to-all of every array a step.
"""

from __future__ import annotations

import numpy as np

# How much more work the most-loaded shard may take, over the evenest order
# found, in an order where no document crosses a shard: such a row needs no
# ring step after each device's own block (the ring's reach test), and a
# step is a block, a send and a merge of its own.
ALIGNED_SLACK = 0.02


def runs(row):
  """``(starts, lengths)`` of the row's runs of equal ids."""
  edge = np.flatnonzero(row[1:] != row[:-1]) + 1
  starts = np.concatenate([[0], edge])
  return starts, np.diff(np.append(starts, row.size))


def id_in_two_runs(row) -> tuple[int, int] | None:
  """``(id, runs)`` of the first id of ``row`` (ids by value) that is more
  than one run of tokens, or None where each id is one run (a document)."""
  starts, _ = runs(row)
  found, count = np.unique(row[starts], return_counts=True)
  if (count > 1).any():
    return found[count > 1][0].item(), int(count[count > 1][0])
  return None


def _order(lengths, cp_size: int, capacity: int) -> list[int]:
  """The documents' order: shard by shard, a cut every ``capacity`` tokens,
  each cut's work (all tokens before it) aimed at its share of the row's
  total, which no order changes. While the heaviest document that can
  still meet the cut fits before it, it goes next; then the document whose
  head, crossing the cut, brings the work closest to the target (or the
  closest whole one). A token's work is its offset in its document + 1, so
  a document split at a cut leaves its light head before it and its heavy
  tail after. Chosen among distinct lengths, so O(documents x lengths)."""
  sizes, which = np.unique(lengths, return_inverse=True)
  work = sizes * (sizes + 1) / 2
  share = (lengths * (lengths + 1) / 2).sum() / cp_size
  stacks = [list(np.flatnonzero(which == u)[::-1]) for u in range(sizes.size)]
  count = np.asarray([len(x) for x in stacks])
  order, pos, done = [], 0, 0.0
  for d in range(1, cp_size):
    cut, target = d * capacity, d * share
    while pos < cut and count.any():
      room, short = cut - pos, target - done
      rest = room - sizes
      # What the tokens left before the cut can still take: at least one
      # pair each, at most one document's head over all of them.
      able = (count > 0) & (sizes <= room) & (short - work >= rest) & (
          short - work <= rest * (rest + 1) / 2)
      if able.any():
        u = int(np.flatnonzero(able)[np.argmax(work[able])])
      else:
        miss = np.where(sizes > room, np.abs(short - room * (room + 1) / 2),
                        np.abs(short - work))
        u = int(np.argmin(np.where(count > 0, miss, np.inf)))
      order.append(int(stacks[u].pop()))
      count[u] -= 1
      pos, done = pos + sizes[u], done + work[u]
  return order + [int(i) for x in stacks for i in reversed(x)]


def _binned(lengths, cp_size: int, capacity: int) -> list[int]:
  """The documents' order from bins: the longest first, each to the
  least-loaded device with room for it whole; each device's documents
  longest first, and those no device could hold whole poured into the
  space left, crossing a cut where they must."""
  work, room = np.zeros(cp_size), np.full(cp_size, capacity)
  where = np.full(lengths.size, -1)
  longest = np.argsort(-lengths, kind="stable")
  for i in longest:
    fits = np.flatnonzero(room >= lengths[i])
    if fits.size:
      d = fits[np.argmin(work[fits])]
      where[i], room[d] = d, room[d] - lengths[i]
      work[d] += lengths[i] * (lengths[i] + 1) / 2
  spill = [i for i in longest if where[i] < 0]
  order, pos = [], 0
  for d in range(cp_size):
    for i in longest[where[longest] == d]:
      order.append(int(i))
      pos += lengths[i]
    while spill and pos < (d + 1) * capacity:
      order.append(int(spill[0]))
      pos += lengths[spill.pop(0)]
  return order + spill


def exact_subset(pool, lengths, room: int) -> list[int] | None:
  """Documents of ``pool`` whose lengths sum to ``room`` exactly (a
  subset sum over bit sets: bit ``x`` of ``reach`` is set where some of
  the documents seen so far sum to ``x``), or None where none do."""
  reach, seen, keep = 1, [], (1 << (room + 1)) - 1
  for i in pool:
    seen.append(reach)
    reach = (reach | reach << int(lengths[i])) & keep
  if not reach >> room & 1:
    return None
  chosen = []
  for i, before in zip(reversed(pool), reversed(seen)):
    if not before >> room & 1:  # ``room`` needs document i
      chosen.append(i)
      room -= int(lengths[i])
  return chosen


def _aligned(lengths, cp_size: int, capacity: int) -> list[int] | None:
  """An order whose every cut falls between two documents, so that no
  document crosses a shard, or None where this finds none. The longest
  documents first, down to the shortest ``share``, each to the
  least-loaded shard with room for it whole; then each shard's room,
  largest first, filled exactly by some of the short ones
  (:func:`exact_subset`). Tried with the shortest half, three quarters
  and all but the longest tenth held back; the evenest found."""
  longest = np.argsort(-lengths, kind="stable")
  found = []
  for share in (0.5, 0.75, 0.9):
    held = longest.size - int(np.ceil(longest.size * (1 - share)))
    bins, work = [[] for _ in range(cp_size)], np.zeros(cp_size)
    room = np.full(cp_size, capacity)
    for i in longest[:longest.size - held]:
      fits = np.flatnonzero(room >= lengths[i])
      if not fits.size:
        break
      d = fits[np.argmin(work[fits])]
      bins[d].append(int(i))
      room[d] -= lengths[i]
      work[d] += lengths[i] * (lengths[i] + 1) / 2
    else:
      pool = [int(i) for i in longest[longest.size - held:]]
      for d in np.argsort(-room, kind="stable"):
        fill = exact_subset(pool, lengths, int(room[d]))
        if fill is None:
          break
        bins[d] += fill
        used = set(fill)
        pool = [i for i in pool if i not in used]
      else:
        found.append([i for b in bins for i in b])
  return min(found, key=lambda o: _peak(lengths[o], cp_size, capacity),
             default=None)


def _peak(lengths, cp_size: int, capacity: int) -> float:
  """The most-loaded shard's work for documents of ``lengths`` in this
  order, a cut every ``capacity`` tokens."""
  start = np.cumsum(lengths) - lengths
  cuts = np.arange(cp_size + 1) * capacity
  lo = np.clip(cuts[:-1][None] - start[:, None], 0, lengths[:, None])
  hi = np.clip(cuts[1:][None] - start[:, None], 0, lengths[:, None])
  return float((hi * (hi + 1) - lo * (lo + 1)).sum(0).max() / 2)


def crosses_a_cut(lengths, capacity: int) -> bool:
  """Whether some cut (every ``capacity`` tokens) falls inside a document
  of ``lengths`` in this order."""
  ends = set(np.cumsum(lengths).tolist())
  return any(cut not in ends for cut in range(capacity, int(lengths.sum()),
                                               capacity))


def _row_order(row, cp_size: int):
  starts, lengths = runs(row)
  twice = id_in_two_runs(row)
  if twice is not None:
    raise ValueError(
        f"segment_ids: id {twice[0]} is two runs of tokens in a row; "
        "reordering documents could join two of them into one. Give each "
        "document its own id")
  c = row.size // cp_size
  # The row's own order and two constructions: the evenest, the row's own
  # on a tie; but one where no document crosses a shard if its most-loaded
  # shard is within ALIGNED_SLACK of that and no worse than the row's own.
  own = list(range(lengths.size))
  peak = lambda o: _peak(lengths[o], cp_size, c)
  order = min((own, _order(lengths, cp_size, c), _binned(lengths, cp_size, c)),
              key=peak)
  aligned = (own if not crosses_a_cut(lengths, c) else
             _aligned(lengths, cp_size, c))
  if aligned is not None and peak(aligned) <= min(
      peak(order) * (1 + ALIGNED_SLACK), peak(own)):
    order = aligned
  return np.concatenate([np.arange(starts[i], starts[i] + lengths[i])
                         for i in order])


def balance_documents(segment_ids, cp_size: int) -> np.ndarray:
  """``(B, S)`` int32: an order of each row's tokens (``x[b, order[b]]``)
  that keeps every document whole and in its own order, and spreads the
  documents' causal work over ``cp_size`` contiguous shards; where that
  costs the most-loaded shard at most ``ALIGNED_SLACK`` more work
  than the evenest order found, and no more than the row's own order,
  every shard ends on a document's end (no document crosses a shard).

  Documents are the runs of equal ids; each id must be one run (else a
  ``ValueError``: reordering could join two runs of one id). Apply the
  same order to every per-token array (tokens, positions, segment ids,
  labels, loss masks) and shard the result contiguously
  (``ContextParallel(load_balance=None)``); the loss, a sum over tokens,
  needs nothing put back. ``jax_ring.explain(..., segment_ids=ordered)``
  reports the balance reached.
  """
  ids = np.asarray(segment_ids)
  if ids.ndim != 2:
    raise ValueError(f"segment_ids must be (B, S); got shape {ids.shape}")
  if cp_size < 1 or ids.shape[1] % cp_size:
    raise ValueError(f"cp_size={cp_size} must divide the row's "
                     f"{ids.shape[1]} tokens")
  return np.stack([_row_order(r, cp_size) for r in ids]).astype(np.int32)
