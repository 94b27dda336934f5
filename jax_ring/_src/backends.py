"""Backend registry and the ``implementation=`` choice.

A backend implements the block-kernel contract (``forward``, ``backward``
with the signatures of ``xla_backend``) for one lowering platform, and says
which calls it cannot serve. ``implementation=None`` picks the most recently
registered backend that serves the call, else ``"xla"``; an explicit name that
cannot serve raises a ``ValueError`` naming the option it lacks. The
pure-JAX ``"xla"`` backend serves everything on every platform. The cuDNN
backend (``cudnn.py``) registers itself when its extension is built.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from jax_ring._src import xla_backend
from jax_ring._src.config import AttentionConfig


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  forward: Callable  # (q, k, v, bias, mask, config) -> (out, lse)
  backward: Callable  # (q, k, v, bias, mask, out, lse, dout, dlse, config)
  # (config, query, key, bias, mask) -> None if served, else the reason.
  unsupported: Callable[..., str | None]
  platform: str | None = None  # the lowering platform; None = all
  # As backward, but -> (dq, dkv stacked (2, B, S, K, H), dbias): dK/dV
  # written where the ring sends them from. None: backward, then a stack.
  backward_dkv: Callable | None = None

  def backward_stacked(self, *args):
    """``(dq, dkv, dbias)`` with dK/dV stacked ``(2, B, S, K, H)``."""
    if self.backward_dkv is not None:
      return self.backward_dkv(*args)
    dq, dk, dv, dbias = self.backward(*args)
    return dq, jnp.stack([dk, dv]), dbias


XLA = Backend("xla", xla_backend.forward, xla_backend.backward,
              lambda *_: None)
_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
  """Add a backend, preferred over those registered before it."""
  _REGISTRY[backend.name] = backend


def get(name: str | None) -> Backend:
  return _REGISTRY.get(name, XLA)


def registered() -> list[Backend]:
  return list(_REGISTRY.values())


def resolve(requested, config: AttentionConfig, query, key, bias, mask) -> str:
  """Name of the backend that runs this call."""
  if requested == "xla":
    return "xla"
  if requested is None:
    for backend in reversed(_REGISTRY.values()):
      if backend.unsupported(config, query, key, bias, mask) is None:
        return backend.name
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
