"""Which ring steps packed rows need. A step whose blocks pair no document's
queries with its keys adds nothing, so the ring skips it: its K/V are not
sent and its block does not run.

Every device all-gathers the ring's query and kv ids (``(cp, B, T)``
int32 each) and numbers the distinct ids of each row (one sort); two
``(B, 2S, G)`` bool tables mark which of the G = cp x chunks query
chunks, and which kv chunks, hold each id, and one reduction finds the
(query chunk, kv chunk) pairs that share one. A step is needed where
some pair it makes (and the mask lets meet: causal, the kv chunk
earlier) shares an id. Exact for any ids, documents in any order or an
id in several runs. A step is needed if some row of some device needs
it, over the whole mesh: a ``pmax`` over the mesh's other axes
(data-parallel rows differ) makes the ``(cp,)`` mask the same on every
device, so every device takes the same branches (a collective inside a
branch runs on all devices or none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ring._src.core import vma
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


def needed_steps(tm: TokenMask, plan: ShardPlan, causal: bool) -> jax.Array:
  """``(cp,)`` bool, the same on every device: whether ring step ``i`` can
  pair a query with a key of its document (step 0, the own K/V, always).
  Call inside ``shard_map`` (or a partition rule) on this device's ids
  (``tm``'s, packed). One sort of the gathered ids a row, then two
  ``(B, 2S, G)`` bool tables (S: the global length)."""
  cp = plan.cp_size
  b, t = tm.q_segment_ids.shape
  g = cp * len(layout.chunk_ids(plan, 0))
  every = lambda ids: lax.all_gather(ids.astype(jnp.int32), plan.axis_name
                                     ).reshape(cp, b, t).transpose(1, 0, 2)
  ids = jnp.concatenate([every(tm.q_segment_ids), every(tm.kv_ids())],
                        1).reshape(b, -1)  # (B, 2S): queries, then keys
  n = ids.shape[1]
  _, number = jax.vmap(lambda row: jnp.unique(row, return_inverse=True,
                                              size=n))(ids)
  number = number.reshape(b, 2, n // 2)
  chunk = np.arange(n // 2) // (n // (2 * g))  # r * chunks + x
  rows = jnp.arange(b)[:, None]
  held = lambda side: jnp.zeros((b, n, g), bool).at[
      rows, number[:, side], chunk[None]].set(True)
  shared = (held(0)[:, :, :, None] & held(1)[:, :, None, :]).any((0, 1))
  need = (shared[None] & _pairs(plan, causal)).any((1, 2))
  need = need.at[0].set(True).astype(jnp.int32)
  manual = jax.sharding.get_abstract_mesh().manual_axes  # in shard_map
  others = tuple(sorted((set(plan.mesh_axes) | set(manual)) -
                        {plan.axis_name}))
  if others:
    need = lax.pmax(vma.vary(need, frozenset(others)) if manual else need,
                    others)
  return need > 0
