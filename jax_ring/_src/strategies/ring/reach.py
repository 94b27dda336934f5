"""Which ring steps packed rows need. A step whose blocks pair no document's
queries with its keys adds nothing, so the ring skips it: its K/V are not
sent and its block does not run.

Every device all-gathers the ring's query and kv ids (``(cp, B, T)``
int32 each) and looks, for each pair of chunks that a step pairs and the
mask lets meet (causal: the kv chunk earlier), whether they share an id:
each query chunk's ids sorted, each kv chunk's looked up in them (``(pairs,
B, C)`` int32 arrays, ``pairs`` at most cp² times the chunks a device
holds, squared). Exact for any ids, documents in any order or an id in
several runs. A step is needed if some row of some device needs it, over
the whole mesh: a ``pmax`` over the other manual axes (data-parallel rows
differ) makes the ``(cp,)`` mask the same on every device, so every device
takes the same branches (a collective inside a branch runs on all devices
or none).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ring._src.core import vma
from jax_ring._src.core.config import ShardPlan
from jax_ring._src.core.mask import TokenMask
from jax_ring._src.strategies import layout


def _pairs(plan: ShardPlan, causal: bool):
  """Static ``(step, device, q chunk, src, kv chunk)`` index arrays of
  every chunk pair a step > 0 meets that the mask lets meet (chunks as
  local indices)."""
  cp = plan.cp_size
  rows = []
  for step in range(1, cp):
    for r in range(cp):
      src = (r - step) % cp
      for a, qa in enumerate(layout.chunk_ids(plan, r)):
        for b, kb in enumerate(layout.chunk_ids(plan, src)):
          if not causal or kb < qa:
            rows.append((step, r, a, src, b))
  return np.asarray(rows, np.int32).reshape(-1, 5).T


def needed_steps(tm: TokenMask, plan: ShardPlan, causal: bool) -> jax.Array:
  """``(cp,)`` bool, the same on every device: whether ring step ``i`` can
  pair a query with a key of its document (step 0, the own K/V, always).
  Call inside ``shard_map`` on this device's ids (``tm``'s, packed)."""
  cp = plan.cp_size
  b, t = tm.q_segment_ids.shape
  chunks = len(layout.chunk_ids(plan, 0))
  every = lambda ids: lax.all_gather(ids.astype(jnp.int32), plan.axis_name
                                     ).reshape(cp, b, chunks, t // chunks)
  q = jnp.sort(every(tm.q_segment_ids), -1)
  kv = every(tm.kv_ids())
  step, r, a, src, c = _pairs(plan, causal)
  qs, ks = q[r, :, a], kv[src, :, c]  # (pairs, B, C)
  find = jax.vmap(jax.vmap(functools.partial(jnp.searchsorted,
                                             method="sort")))
  at = jnp.minimum(find(qs, ks), t // chunks - 1)
  hit = (jnp.take_along_axis(qs, at, -1) == ks).any((1, 2))
  need = jnp.zeros((cp,), jnp.int32).at[step].max(hit.astype(jnp.int32))
  manual = jax.sharding.get_abstract_mesh().manual_axes  # in shard_map
  others = tuple(sorted((set(plan.mesh_axes) | set(manual)) -
                        {plan.axis_name}))
  if others:
    need = lax.pmax(vma.vary(need, frozenset(others)) if manual else need,
                    others)
  return (need > 0).at[0].set(True)
