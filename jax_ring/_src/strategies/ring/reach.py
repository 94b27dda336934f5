"""Which ring steps packed rows need. A step whose blocks pair no document's
queries with its keys adds nothing, so the ring skips it: its K/V are not
sent and its block does not run.

Every device all-gathers the ring's query and kv ids (``(cp, B, T)``
int32 each) and looks, for each pair of chunks that a step pairs and the
mask lets meet (causal: the kv chunk earlier), whether they share an id:
each query chunk's ids sorted, each kv chunk's looked up in them, a step at
a time for every device at once. Exact for any ids, documents in any
order or an id in several runs. A step is needed if some row of some
device needs it, over the whole mesh: a ``pmax`` over the mesh's other
axes (data-parallel rows differ) makes the ``(cp,)`` mask the same on
every device, so every device takes the same branches (a collective
inside a branch runs on all devices or none).
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


def _meets(plan: ShardPlan, causal: bool, step: int, a: int, b: int):
  """``(cp,)`` bool, static: on which devices r step ``step`` pairs local
  query chunk ``a`` with kv chunk ``b`` of device ``r - step`` under the
  mask (causal: the kv chunk earlier)."""
  cp = plan.cp_size
  return np.asarray([not causal or layout.chunk_ids(plan, (r - step) % cp)[b]
                     < layout.chunk_ids(plan, r)[a] for r in range(cp)])


def needed_steps(tm: TokenMask, plan: ShardPlan, causal: bool) -> jax.Array:
  """``(cp,)`` bool, the same on every device: whether ring step ``i`` can
  pair a query with a key of its document (step 0, the own K/V, always).
  Call inside ``shard_map`` (or a partition rule) on this device's ids
  (``tm``'s, packed). Each step looks every device's chunk pairs up at
  once: ``(cp, B, C)`` int32 at a time."""
  cp = plan.cp_size
  b, t = tm.q_segment_ids.shape
  chunks = len(layout.chunk_ids(plan, 0))
  every = lambda ids: lax.all_gather(ids.astype(jnp.int32), plan.axis_name
                                     ).reshape(cp, b, chunks, t // chunks)
  q = jnp.sort(every(tm.q_segment_ids), -1)
  kv = every(tm.kv_ids())
  find = jax.vmap(jax.vmap(functools.partial(jnp.searchsorted,
                                             method="sort")))
  need = [jnp.ones((), bool)]
  for step in range(1, cp):
    hit = jnp.zeros((), bool)
    for x in range(chunks):
      for y in range(chunks):
        meets = _meets(plan, causal, step, x, y)
        if not meets.any():
          continue
        qs, ks = q[:, :, x], jnp.roll(kv[:, :, y], step, axis=0)  # r - step
        at = jnp.minimum(find(qs, ks), t // chunks - 1)
        found = (jnp.take_along_axis(qs, at, -1) == ks).any((1, 2))
        hit |= (found & meets).any()
    need.append(hit)
  need = jnp.stack(need).astype(jnp.int32)
  manual = jax.sharding.get_abstract_mesh().manual_axes  # in shard_map
  others = tuple(sorted((set(plan.mesh_axes) | set(manual)) -
                        {plan.axis_name}))
  if others:
    need = lax.pmax(vma.vary(need, frozenset(others)) if manual else need,
                    others)
  return need > 0
