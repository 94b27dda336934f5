"""The backend registry: the one owner of which backend runs a block.

A backend implements the block-kernel contract (``forward``, ``backward``
with the signatures of ``backends/xla.py``) for one lowering platform, and
says which calls it cannot serve. Backends register themselves when the
``jax_ring._src.backends`` package is imported; this module imports none.
``implementation=None`` picks the most recently registered backend that
serves the call, else ``"xla"`` (which serves everything, everywhere); an
explicit name that cannot serve raises a ``ValueError`` naming the option
it lacks. At lowering, a backend of another platform gives way to ``"xla"``
(:func:`for_platform`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from jax_ring._src.core.config import AttentionConfig


FALLBACK = "xla"


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  forward: Callable  # (q, k, v, bias, mask, config) -> (out, lse)
  backward: Callable  # (q, k, v, bias, mask, out, lse, dout, dlse, config)
  # (config, query, key, value, bias, mask) -> None if served, else the
  # reason.
  unsupported: Callable[..., str | None]
  platform: str | None = None  # the lowering platform; None = all
  # As backward, but -> (dq, dkv stacked (2, B, S, K, H), dbias): dK/dV
  # written where the ring sends them from. None: backward, then a stack.
  backward_dkv: Callable | None = None
  # (q, k, v, mask, config, lse or None) -> what forward (lse None) or
  # backward computes before its call, to come back as ``mask.prepared``,
  # or None. None: nothing.
  prepare: Callable | None = None

  def backward_stacked(self, *args):
    """``(dq, dkv, dbias)`` with dK/dV stacked ``(2, B, S, K, H)``."""
    if self.backward_dkv is not None:
      return self.backward_dkv(*args)
    dq, dk, dv, dbias = self.backward(*args)
    return dq, jnp.stack([dk, dv]), dbias


# name -> backend, in registration order (the last is preferred).
BACKENDS: dict[str, Backend] = {}
# Backends this install has but cannot load, and why (a request for one is
# refused with the reason): filled by the backend modules.
UNAVAILABLE: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
  """A kernel for each device's part of ``decode_attention``:
  ``local(q, k, v, q_pos, kv_pos, *, band, scale, cap, interpret)`` with
  the contract of ``decode._local`` (the kv-head-major cache), for the
  shapes ``supports`` accepts; ``interpret`` runs it where it has no
  lowering (a CPU: exact, slow). ``supports(q_shape, k_shape, v_shape,
  layout)``: why it cannot serve one device's part of these shapes, or
  None (``decode_attention`` asks before every call)."""

  name: str
  local: Callable
  supports: Callable


# name -> decode kernel ("xla", decode.py's own products, is not here).
DECODE_KERNELS: dict[str, DecodeKernel] = {}


def register(backend: Backend) -> None:
  """Add a backend, preferred over those registered before it."""
  BACKENDS[backend.name] = backend


def get(name: str | None) -> Backend:
  """The backend named ``name``; ``None`` or an unknown name: the fallback."""
  return BACKENDS.get(name) or BACKENDS[FALLBACK]


def for_platform(name: str | None, platform: str) -> Backend:
  """The backend that lowers a block resolved to ``name`` on ``platform``:
  that one, unless it lowers only on another platform."""
  backend = get(name)
  return backend if backend.platform in (None, platform) else get(FALLBACK)


def resolve(requested, config: AttentionConfig, query, key, value, bias,
            mask) -> str:
  """Name of the backend that runs this call."""
  if requested == FALLBACK:
    return FALLBACK
  if requested is None:
    for backend in reversed(BACKENDS.values()):
      if backend.unsupported(config, query, key, value, bias, mask) is None:
        return backend.name
    return FALLBACK
  if requested not in BACKENDS:
    why = UNAVAILABLE.get(requested, f"the jax_ring {requested} extension "
                          "is not built or not loaded")
    raise ValueError(
        f"implementation={requested!r} is not available in this install: "
        f"{why}")
  reason = BACKENDS[requested].unsupported(config, query, key, value, bias,
                                           mask)
  if reason is not None:
    raise ValueError(f"implementation={requested!r} does not support "
                     f"{reason}")
  return requested
