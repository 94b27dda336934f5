"""Which ring steps packed rows need. A step whose blocks pair no document's
queries with its keys adds nothing, so the ring skips it: its K/V are not
sent and its block does not run.

Every device all-gathers the ring's query and kv ids (``(cp, B, T)``
int32 each; one array where they are the same ids) and numbers the
distinct ids of each row by their table slots (:func:`idtable.slots`);
two ``(B, S, G)`` bool tables (``(B, 2S, G)`` for two id arrays) mark
which of the G = cp x chunks query chunks, and which kv chunks, hold
each id, and one reduction finds the (query chunk, kv chunk) pairs that
share one. A step is needed where some pair it makes (and the mask lets
meet: causal, the kv chunk earlier) shares an id. Exact for documents in
any order or an id in several runs. Where a row's ids spread over more
values than the row has tokens, the slots (clipped) give some different
ids one slot: the test may then mark steps that no document needs, never
miss one. So no sort and no branch on the ids (on a GPU, a branch test
is a wait for the device). A step is needed if some row of some device
needs it, over the whole mesh: a ``pmax`` over the mesh's other axes
(data-parallel rows differ) makes the ``(cp,)`` mask the same on every
device, so every device takes the same branches (a collective inside a
branch runs on all devices or none).

On contiguous shards it also finds how far documents cross shard
boundaries (:func:`_crossing_rows`): under a causal mask a document that
crosses into a shard holds its first rows, and the part of it that the
next shard's queries reach, the previous shard's last rows. Where only
step 1 is needed and those rows fit one of :func:`tail_sizes`, the step
sends only the last rows of each shard and pairs them with the first
rows (``reached.reached_loop``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ring._src.core import idtable, vma
from jax_ring._src.core.config import ShardPlan
from jax_ring._src.core.mask import TokenMask
from jax_ring._src.strategies import layout


def _pairs(plan: ShardPlan, causal: bool) -> np.ndarray:
  """``(cp, G, G)`` bool, static: which (query chunk, kv chunk) pairs step
  ``i`` makes and the mask lets meet (causal: the kv chunk earlier),
  chunks numbered ``r * chunks + x`` (device r's local chunk x)."""
  cp = plan.cp_size
  ids = [layout.chunk_ids(plan, r) for r in range(cp)]
  chunks = len(ids[0])
  out = np.zeros((cp, cp * chunks, cp * chunks), bool)
  for step in range(cp):
    for r in range(cp):
      src = (r - step) % cp
      for x in range(chunks):
        for y in range(chunks):
          out[step, r * chunks + x, src * chunks + y] = (
              not causal or ids[src][y] < ids[r][x])
  return out


def skips_steps(load_balance, loop, kv_sends, window) -> bool:
  """Whether the ring, given these options, skips the steps no document
  of a packed row reaches: contiguous shards, the unrolled loop, the
  default K/V sends (a named ``kv_sends`` keeps its loop) and no window.
  Not under dual-chunk: there a document that crosses a chunk boundary
  reaches a device on each side, so most steps run, unoverlapped
  (measured slower than the gathered K/V: docs/decisions.md, "Packed rows
  on the ring")."""
  return (load_balance is None and loop == "unrolled" and kv_sends is None
          and window is None)


# A step-1 tail is the shard's length ``t`` over one of these (rounded up).
# Each size is a branch of the program, whose work XLA prepares at every
# run, taken or not, in every layer: one size (docs/decisions.md, "One
# step-1 tail").
TAIL_DIVISORS = (4,)


def tail_sizes(t: int, cp: int, beyond: bool = False) -> tuple[int, ...]:
  """The static sizes, in tokens, of a step that pairs only the first query
  rows of each shard with the last kv rows of the shard before it: ``t /
  d`` (rounded up) for each ``d`` of ``TAIL_DIVISORS`` below ``t``, and
  ``t`` where cp == 2 and not ``beyond``. Otherwise a branch of its own
  runs what the tails leave (:func:`branch`): the path over every step,
  stopped after step 1 (step 1 on whole shards), or, ``beyond``, another
  strategy."""
  sizes = {-(-t // d) for d in TAIL_DIVISORS} | {t}
  return tuple(sorted(sizes if cp == 2 and not beyond else sizes - {t}))


def last_step(need):
  """``()`` int32: the last step ``need (cp,)`` marks (0: none after the
  own)."""
  return jnp.max(jnp.where(need, jnp.arange(need.shape[0]), 0))


def branch(need, rows, t: int, cp: int, beyond: bool = False):
  """``()`` int32, the branch ``reached.reached_loop`` takes: 0, no step
  after the own; ``1 + i``, step 1 only on ``tail_sizes(t, cp,
  beyond)[i]`` rows, the smallest that holds ``rows``; ``1 +
  len(tail_sizes(...))`` (where cp > 2 or ``beyond``), what the tails
  leave: a step after step 1 that ``need (cp,)`` marks, or more crossing
  rows than any size holds."""
  last = last_step(need)
  sizes = tail_sizes(t, cp, beyond)
  index = 1 + jnp.searchsorted(jnp.asarray(sizes, jnp.int32), rows,
                               method="compare_all")
  if cp > 2 or beyond:
    index = jnp.where(last > 1, 1 + len(sizes), index)
  return jnp.where(last > 0, index, 0)


def _crossing_rows(number, held, plan: ShardPlan, causal: bool, t: int):
  """``()`` int32: on contiguous shards, the fewest rows ``s`` such that
  every query another device's keys can reach is among its shard's first
  ``s`` rows and every key another device's queries can reach among its
  shard's last ``s`` rows (0: no document leaves its shard). ``number (B,
  2, S)`` numbers the query and kv ids, ``held(side) (B, n, cp)`` marks
  the shards that hold each number."""
  b, cp = number.shape[0], plan.cp_size
  dev = np.arange(cp)
  meet = dev[None] < dev[:, None] if causal else dev[None] != dev[:, None]
  rows = jnp.arange(b)[:, None]
  pos = np.arange(t)

  def reached(side, other, meets):  # (B, cp, t): tokens another shard meets
    hit = held(other)[rows, number[:, side]].reshape(b, cp, t, cp)
    return (hit & meets[None, :, None, :]).any(-1)

  first = jnp.where(reached(0, 1, meet), pos + 1, 0).max()
  last = jnp.where(reached(1, 0, meet.T), t - pos, 0).max()
  return jnp.maximum(first, last).astype(jnp.int32)


def _of_gathered(q_ids, kv_ids, plan: ShardPlan, causal: bool,
                 rows: bool):
  """``(cp,)`` int32 needed steps, then (``rows``) the crossing rows, from
  every device's ids ``(B, cp, T)`` (device-major, in the shards'
  layout); ``kv_ids`` None: the query ids (numbered once)."""
  cp = plan.cp_size
  b, _, t = q_ids.shape
  g = cp * len(layout.chunk_ids(plan, 0))
  pair = q_ids if kv_ids is None else jnp.concatenate([q_ids, kv_ids], 1)
  ids = pair.reshape(b, -1)  # queries, then keys
  n = ids.shape[1]
  # Equal ids, equal slots; ids a table cannot place may share one (clipped).
  number, _ = idtable.slots(ids)
  number = (jnp.stack([number, number], 1) if kv_ids is None else
            number.reshape(b, 2, n // 2))
  chunk = np.arange(cp * t) // (cp * t // g)  # r * chunks + x
  at = jnp.arange(b)[:, None]
  chunk_start = np.append(True, chunk[1:] != chunk[:-1])[None]

  def held(side):  # (B, n, G): set at each run's first token in a chunk
    num = number[:, side]
    new = idtable.run_starts(num) | chunk_start
    return jnp.zeros((b, n, g), bool).at[
        at, jnp.where(new, num, n), chunk[None]].set(True, mode="drop")

  tables = [held(0)]  # one table where the keys' ids are the queries'
  tables.append(tables[0] if kv_ids is None else held(1))
  shared = (tables[0][:, :, :, None] & tables[1][:, :, None, :]).any((0, 1))
  need = (shared[None] & _pairs(plan, causal)).any((1, 2))
  need = need.at[0].set(True).astype(jnp.int32)
  if rows:
    need = jnp.append(need, _crossing_rows(
        number, lambda side: tables[side], plan, causal, t))
  return need


def needed_steps(tm: TokenMask, plan: ShardPlan, causal: bool,
                 rows: bool = False):
  """``(cp,)`` bool, the same on every device: whether ring step ``i`` can
  pair a query with a key of its document (step 0, the own K/V, always).
  With ``rows`` (contiguous shards only), also ``_crossing_rows``, the same
  on every device. Call inside ``shard_map`` (or a partition rule) on this
  device's ids (``tm``'s, packed). The gathered ids numbered a row, then
  two ``(B, S, G)`` bool tables (S: the global length; 2S for query and kv
  ids apart)."""
  cp = plan.cp_size
  b, t = tm.q_segment_ids.shape
  every = lambda ids: lax.all_gather(ids.astype(jnp.int32), plan.axis_name
                                     ).reshape(cp, b, t).transpose(1, 0, 2)
  need = _of_gathered(every(tm.q_segment_ids),
                      None if tm.same_ids else every(tm.kv_ids()), plan,
                      causal, rows)
  manual = jax.sharding.get_abstract_mesh().manual_axes  # in shard_map
  others = tuple(sorted((set(plan.mesh_axes) | set(manual)) -
                        {plan.axis_name}))
  if others:
    need = lax.pmax(vma.vary(need, frozenset(others)) if manual else need,
                    others)
  return (need[:cp] > 0, need[cp]) if rows else need > 0


def steps_of_rows(segment_ids, cp_size: int, causal: bool,
                  beyond: bool = False) -> dict:
  """What the ring on contiguous shards runs for natural-order rows
  ``segment_ids (B, S)`` (host ints, S divisible by ``cp_size``): the
  last needed step, the crossing rows, the shard length T, the branch
  (``branch``) with, where it is step 1 alone, its size, and whether
  (``beyond``: another strategy takes what the tails leave) that strategy
  runs the pass, and whether the ids' table numbers every row's ids
  (``numbered``; else different ids may share a slot, and the test marks
  more steps). Computed as the call computes it, on the host's CPU."""
  ids = np.asarray(segment_ids, np.int32)
  b, s = ids.shape
  t = s // cp_size
  plan = ShardPlan("cp", cp_size, None)
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    gathered = jnp.asarray(ids).reshape(b, cp_size, t)
    need = _of_gathered(gathered, None, plan, causal, True)
    index = int(branch(need[:cp_size] > 0, need[cp_size], t, cp_size,
                       beyond))
    last = int(last_step(need[:cp_size] > 0))
    numbered = bool(idtable.slots(jnp.asarray(ids))[1])
  sizes = tail_sizes(t, cp_size, beyond)
  size = sizes[index - 1] if 0 < index <= len(sizes) else None
  handed = beyond and index == 1 + len(sizes)
  return dict(last=last, rows=int(need[cp_size]), shard=t, branch=index,
              size=t if size is None and last == 1 and not handed else size,
              beyond=handed, numbered=numbered)
