"""Segment ids as slots of a table, with no sort: each row's id ``x`` at
slot ``x - lo`` (``lo`` the row's least id), exact wherever a row's ids
lie within as many values as it has tokens, as packing's ids 0, 1, 2,
... do in any order (padding id 0 included). Where they do not (ids
spread far apart), clipped ids share slots: callers that need exact
numbers branch on ``known`` to a sort; a caller for which merged ids
only cost work (the ring's reach test) takes the slots as they are.
Also where a row's runs of equal ids start, which the table's users
scatter from (one update a run, not a token)."""

from __future__ import annotations

import jax.numpy as jnp


def run_starts(ids):
  """``(B, N)`` bool: whether each token of ``ids (B, N)`` starts a run of
  equal ids (every row's first token does)."""
  return jnp.concatenate([jnp.ones_like(ids[:, :1], bool),
                          ids[:, 1:] != ids[:, :-1]], 1)


def slots(ids):
  """``(slot (B, N) int32, known () bool)`` for ``ids (B, N)``: each
  id's slot in a table of ``N`` (clipped into ``[0, N)``) and whether no
  id was clipped, so that equal slots mean equal ids."""
  n = ids.shape[1]
  if jnp.iinfo(ids.dtype).bits < 32:  # widened losslessly, to hold N
    ids = ids.astype(jnp.int32)
  # In the ids' own dtype: a difference past its range wraps below zero
  # (signed) and is not known; none is lost to a narrower cast.
  d = ids - ids.min(1, keepdims=True)
  known = jnp.all((d >= 0) & (d < n))
  return jnp.clip(d, 0, n - 1).astype(jnp.int32), known
