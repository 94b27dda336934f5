"""Backend registry and the ``implementation=`` choice.

A backend declares which options it cannot serve. ``implementation=None``
picks the first registered backend (in preference order) that serves the
call; an explicit name that cannot serve raises a ``ValueError`` naming the
option it lacks. The pure-JAX ``"xla"`` backend serves everything and is
always last. The cuDNN backend registers itself here once its extension is
built and loaded (see csrc/).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jax_ring._src.config import AttentionConfig


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  # (config, query, key, bias, mask) -> None if served, else the reason.
  unsupported: Callable[..., str | None]


_XLA = Backend("xla", lambda *_: None)
_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
  """Add a backend, preferred over those registered before it."""
  _REGISTRY[backend.name] = backend


def resolve(requested, config: AttentionConfig, query, key, bias, mask) -> str:
  """Name of the backend that runs this call."""
  preference = [*reversed(_REGISTRY.values()), _XLA]
  if requested is None:
    return next(b.name for b in preference
                if b.unsupported(config, query, key, bias, mask) is None)
  if requested == "xla":
    return "xla"
  if requested not in _REGISTRY:
    raise ValueError(
        f"implementation={requested!r} is not available in this install: the "
        f"jax_ring {requested} extension is not built or not loaded")
  reason = _REGISTRY[requested].unsupported(config, query, key, bias, mask)
  if reason is not None:
    raise ValueError(f"implementation={requested!r} does not support "
                     f"{reason}")
  return requested
