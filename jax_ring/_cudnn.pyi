"""Type stub of the compiled extension ``jax_ring._cudnn`` (``csrc/ffi.cc``):
the cuDNN fused-attention XLA FFI handlers, built with
``JAX_RING_CUDNN=ON pip install``."""

from typing import Any


def registrations() -> dict[str, dict[str, Any]]:
  """``{target: {"initialize": capsule, "execute": capsule}}`` for
  ``jax.ffi.register_ffi_target``: ``jax_ring_sdpa_fwd``,
  ``jax_ring_sdpa_bwd``, ``jax_ring_sdpa_bwd_dkv`` and the packed calls
  that write into buffers they are given (aliased), ``jax_ring_sdpa_fwd_into``
  and ``jax_ring_sdpa_bwd_into``."""

def use_graphs(on: bool) -> None:
  """Whether a cuDNN call run again on the same device pointers replays as
  one CUDA graph (``csrc/graphs.h``; on by default) or runs cuDNN's
  execute."""

def graph_counts() -> tuple[int, int, int]:
  """(graphs launched, graphs recorded, plans whose launches could not be
  recorded) in this process."""

def cudnn_version() -> int:
  """The version of the cuDNN library loaded (e.g. 91900 for 9.19.0)."""

def workspace_bytes(backward: bool, bf16: bool, device: int, b: int, t: int,
                    s: int, n: int, k: int, h: int, hv: int, slots: int,
                    row_start: int, col_start: int, right_bound: int,
                    left_bound: int, padding: bool, scale: float,
                    softcap: float, ragged_len: int = 0) -> int:
  """The workspace of one call's cuDNN graph (q ``(b, t, n, h)``, k ``(b, s,
  k, h)``, v ``(b, s, k, hv)``; ``ragged_len``: each virtual batch's rows
  and keys, 0 for the row's), built and cached on local GPU ``device`` as
  for a run; raises ``RuntimeError`` if cuDNN rejects it."""
