"""The compiled extension ``jax_ring._cudnn`` and its XLA FFI handlers,
``jax_ring_sdpa_fwd``, ``jax_ring_sdpa_bwd``, ``jax_ring_sdpa_bwd_dkv``
(dK/dV stacked) and the packed calls that write into given buffers,
``jax_ring_sdpa_fwd_into`` and ``jax_ring_sdpa_bwd_into`` (``csrc/``):
loading it, registering its targets with jax, and one traced call of a
handler (:func:`sdpa`), whose cuDNN graph is built at trace time for the
size of its workspace. :func:`recording` collects the calls traced inside
it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib import xla_client

from jax_ring._src.backends.cudnn.band import Band


# How to build it, named wherever its absence is reported.
BUILD_HINT = ("build it on a machine with CUDA and cuDNN with "
              "JAX_RING_CUDNN=ON pip install --no-build-isolation -e . "
              "(README, Install)")

try:
  from jax_ring import _cudnn
  LOAD_ERROR = None
except ImportError as e:  # not built: a CPU install, or a failed build
  _cudnn = None
  # Python's message for a missing module inside a package being imported
  # speaks of a circular import; say what it means.
  LOAD_ERROR = (f"the cuDNN extension (jax_ring._cudnn) is not built; "
                f"{BUILD_HINT}" if "_cudnn" in str(e) and (
                    "cannot import name" in str(e) or "No module" in str(e))
                else f"the cuDNN extension did not load: {e}")


def attrs(config, bnd: Band, padding: bool, slots: int = 0,
          ragged_len: int = 0):
  """The handlers' attributes. ``slots``: virtual batches a row (packed
  documents); ``ragged_len``: each one's rows and keys (0: the row's)."""
  return dict(scale=np.float32(config.scale), row_start=bnd.row_start,
              col_start=bnd.col_start, right_bound=bnd.right_bound,
              left_bound=bnd.left_bound, padding=padding,
              softcap=np.float32(config.logits_soft_cap or 0.0), slots=slots,
              ragged_len=ragged_len)


# The cuDNN calls traced inside ``recording()`` (else None): each one's
# handler, q/k/v shapes, dtype and attributes, enough to rebuild its graph.
RECORD: list | None = None


def _note(name, q_shape, k_shape, v_shape, dtype, attrs) -> dict:
  """One cuDNN call of handler ``name`` as :func:`workspace_bytes` reads
  it, noted in the active recording."""
  call = dict(backward=name.startswith("jax_ring_sdpa_bwd"),
              q=tuple(q_shape), k=tuple(k_shape), v=tuple(v_shape),
              dtype=jnp.dtype(dtype).name,
              **{a: x.item() if hasattr(x, "item") else x
                 for a, x in attrs.items()})
  if RECORD is not None:
    RECORD.append(call)
  return call


def sdpa(name, results, q, k, v, *operands, aliases=None, **attrs):
  """``jax.ffi.ffi_call`` of handler ``name`` on ``q (B, T, N, H), k (B, S,
  K, H), v (B, S, K, Hv)`` and the other ``operands``, noted in the active
  recording. ``aliases`` maps operand indices (q is 0) to the results they
  become (the ``_into`` handlers write into those buffers).

  The call's cuDNN graph is built here, at trace time, for its workspace
  size: XLA allocates the workspace as one more (discarded) result, so the
  handler allocates nothing, a compiled program's memory analysis counts
  it, and the call can be traced into a CUDA graph (command buffer)."""
  call = _note(name, q.shape, k.shape, v.shape, q.dtype, attrs)
  workspace = jax.ShapeDtypeStruct((workspace_bytes(call),), jnp.uint8)
  return jax.ffi.ffi_call(name, (*results, workspace),
                          input_output_aliases=aliases)(q, k, v, *operands,
                                                        **attrs)[:-1]


def sdpa_pass(name, results, q, k, v, *operands, calls, aliases=None,
              **attrs):
  """``jax.ffi.ffi_call`` of a packed pass (``jax_ring_sdpa_{fwd,bwd}_pass``,
  see ``passes.py``), which runs some of ``calls`` (each a one-row call's
  attributes, as :func:`attrs` gives them) on each row: its workspace is
  the largest of theirs, and each is noted in the active recording."""
  one = lambda x: (1,) + tuple(x.shape[1:])
  need = max((workspace_bytes(_note(name, one(q), one(k), one(v), q.dtype,
                                    at)) for at in calls), default=0)
  workspace = jax.ShapeDtypeStruct((need,), jnp.uint8)
  return jax.ffi.ffi_call(name, (*results, workspace),
                          input_output_aliases=aliases)(q, k, v, *operands,
                                                        **attrs)[:-1]


def uninitialized(shape: tuple[int, ...], dtype):
  """A ``shape`` array of ``dtype`` whose contents are undefined, for a
  buffer that is written only where it is read: on CUDA, one XLA
  allocates and no kernel writes (``jax_ring_uninitialized``); on other
  platforms (where only the tests' replays of the handlers run), NaN, so
  that a read of an unwritten element shows."""
  out = jax.ShapeDtypeStruct(shape, dtype)
  return jax.lax.platform_dependent(
      cuda=lambda: jax.ffi.ffi_call("jax_ring_uninitialized", out)(),
      default=lambda: jnp.full(shape, jnp.nan, dtype))


@contextlib.contextmanager
def recording():
  """Collect the cuDNN calls traced inside (a list of dicts, for
  :func:`workspace_bytes`). Tracing happens once per input shapes: call
  ``jax.clear_caches()`` first to see a function traced before."""
  global RECORD
  outer, RECORD = RECORD, []
  try:
    yield RECORD
  finally:
    RECORD = outer


def _loaded():
  """The extension, or a ``RuntimeError`` saying why it is not loaded."""
  if _cudnn is None:
    raise RuntimeError(f"the cuDNN extension is not loaded: {LOAD_ERROR}")
  return _cudnn


def workspace_bytes(call: dict, device: int = 0) -> int:
  """cuDNN's workspace for one recorded call, from its graph (built and
  cached as at run time, on local GPU ``device``)."""
  (b, t, n, h), (_, s, k, _), hv = call["q"], call["k"], call["v"][3]
  return _loaded().workspace_bytes(
      call["backward"], call["dtype"] == "bfloat16", device, b, t, s, n, k,
      h, hv, call["slots"], call["row_start"], call["col_start"],
      call["right_bound"], call["left_bound"], call["padding"],
      call["scale"], call["softcap"], call.get("ragged_len", 0))


def no_ragged():
  """Placeholder ragged-offset operands (q, k, v, out) of an unpacked call
  (built at trace time: creating arrays at import would start jax's
  backends)."""
  return (jnp.zeros((1,), jnp.int32),) * 4


def version() -> int | None:
  """cuDNN's version as the extension reports it; None when not loaded."""
  return None if _cudnn is None else _cudnn.cudnn_version()


def use_graphs(on: bool) -> None:
  """Whether the extension replays a cuDNN call it has run before on the
  same pointers as one CUDA graph (``csrc/graphs.h``; on by default) or
  always runs cuDNN's execute: the switch of an A/B measurement. Results
  are the same either way."""
  _loaded().use_graphs(on)


def graph_counts() -> dict[str, int]:
  """This process's CUDA-graph replays so far: graphs ``launched``,
  ``recorded``, and plans found ``unsupported`` (which then execute)."""
  return dict(zip(("launched", "recorded", "unsupported"),
                  _loaded().graph_counts()))


def register_targets() -> None:
  """Register the handlers with jax (CUDA), once the extension loaded.
  Stages: "initialize" builds the handle and plan before XLA runs or
  records the program; "execute" launches cuDNN, and may be traced into a
  command buffer (it allocates nothing and never syncs), except a packed
  pass's (``_pass``), which reads the counts of its calls first."""
  traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
  for name, stages in _cudnn.registrations().items():
    # A packed pass reads its classes' counts when it runs: never recorded.
    jax.ffi.register_ffi_target(
        name, stages, platform="CUDA",
        traits=xla_client.CustomCallTargetTraits.DEFAULT
        if name.endswith("_pass") else traits)
