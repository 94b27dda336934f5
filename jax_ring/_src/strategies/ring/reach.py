"""Which ring steps packed rows need. A step whose blocks pair no document's
queries with its keys adds nothing, so the ring skips it: its K/V are not
sent and its block does not run.

Every device all-gathers the row's query and kv ids (``(cp, B, T)`` int32
each, a few hundred KiB) and computes from them the same ``(cp,)`` bool of
the steps some device needs, so all take the same branches: a collective
inside a branch runs on every device or on none. A step is needed when, on
some device and row, a query chunk and a kv chunk that the step pairs and
the mask lets meet (causal: the kv chunk earlier) share an id: each query
chunk's ids sorted once, each kv chunk's looked up in them. Exact for any
ids, documents in any order or an id in several runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
  need = jnp.zeros((cp,), bool).at[step].max(hit)
  return need.at[0].set(True)
