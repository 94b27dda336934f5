"""Transfers that overlap compute by construction: XLA scheduling groups.

XLA's latency-hiding scheduler has no cost for a custom call, so on its own
it may finish a collective (``all-gather-done``) before an independent
cuDNN call that could have hidden it, and the transfer runs alone
(docs/performance.md, the ring's per-step profile). Every op traced
inside :func:`group` carries one ``_scheduling_group_id``, and XLA
schedules a group's async collective around the group's compute: the
transfer starts, the compute runs, the transfer is waited for. A group must not depend on its own collective's
result (the compute is what hides it), and every op between two of its
ops must be in it too (the context puts the whole traced block in).
Off-GPU the attribute changes nothing.

Off unless ``JAX_RING_SCHEDULING_GROUPS=1``: XLA refuses some groups at
compile time (a fusion of two groups' ops, a gap), and these have not yet
been compiled on several GPUs; the benchmarks time both settings.
"""

from __future__ import annotations

import contextlib
import itertools
import os

from jax.experimental.xla_metadata import set_xla_metadata

_IDS = itertools.count(1)


def group():
  """A context whose traced ops form one new scheduling group."""
  if os.environ.get("JAX_RING_SCHEDULING_GROUPS") != "1":
    return contextlib.nullcontext()
  return set_xla_metadata(_scheduling_group_id=next(_IDS))
