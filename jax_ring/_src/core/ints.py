"""Checks of Python integers, below both ``config`` (whose
``ContextParallel`` checks its fields when made) and ``validate`` (which
checks calls against that config): a leaf, importing nothing of ours."""

from __future__ import annotations

import numpy as np


def is_int(x) -> bool:
  """A Python or NumPy int, not a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def positive_int(name: str, value, none_ok: bool = False):
  """``value``: a positive Python or NumPy int (not a bool), as an int; or
  None where ``none_ok``. Else a ``ValueError`` naming ``name``."""
  if (value is None and none_ok) or (is_int(value) and value >= 1):
    return value if value is None else int(value)
  raise ValueError(f"{name} must be {'None or ' * none_ok}a positive int; "
                   f"got {value!r}")
