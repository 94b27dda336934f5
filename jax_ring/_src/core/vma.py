"""Varying manual axes: the shard_map typing that custom code must respect.

Inside ``shard_map`` (with its default type checking) every value records
the mesh axes it varies over. jax's own primitives first make all operands
vary over the union of their axes; loop carries must keep one type from
iteration to iteration. Our primitive and our loops do the same with these
two helpers. Outside shard_map every set is empty and they do nothing.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
  """Mesh axes that ``x`` varies over (empty outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax 0.10+: the manual axis type
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def vary(x, axes: frozenset):
  """``x``, cast to vary over ``axes`` as well (a no-op if it already does)."""
  missing = tuple(sorted(axes - varying_axes(x), key=str))
  return lax.pcast(x, missing, to="varying") if missing else x


def match(*operands):
  """All operands, each made to vary over the union of their axes."""
  axes = frozenset().union(*map(varying_axes, operands))
  return [vary(x, axes) for x in operands]


def like(tree, *refs):
  """Every leaf of ``tree`` made to vary over the axes of ``refs``: for
  loop-carry initial values built from constants."""
  axes = frozenset().union(*map(varying_axes, refs))
  return jax.tree.map(lambda x: vary(x, axes), tree)
