"""The mesh a call runs on, as tracing sees it."""

from __future__ import annotations

import jax


def in_scope(x):
  """The mesh that a call on ``x`` runs on, as far as tracing can see it:
  the one of ``jax.set_mesh``, else the one ``x``'s sharding names (arrays
  placed with a ``NamedSharding`` carry it in their type), else the mesh
  of a ``with mesh:`` block (the older context manager that MaxText and
  many Flax codebases use with ``jax.jit(in_shardings=...)``)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", mesh)
    if mesh.empty and not isinstance(x, jax.core.Tracer):
      mesh = getattr(getattr(x, "sharding", None), "mesh", mesh)
  if mesh.empty:
    mesh = _legacy_mesh() or mesh
  return mesh


def _legacy_mesh():
  """The concrete mesh of an enclosing ``with mesh:`` block, or None. jax
  keeps it only in a private thread-local (the block is deprecated in
  favour of ``jax.set_mesh``), so a jax without it reads as no block."""
  try:
    from jax._src import mesh as jax_mesh
    physical = jax_mesh.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):
    return None
  return None if physical.empty else physical
