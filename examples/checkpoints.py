"""The examples' checkpoints (orbax): the train state, written in a
background thread, with a JSON record that lets a resume check it first.

Each step directory (``<run dir>/checkpoints/<step>``, the state after
that many steps) holds two orbax items, committed together:

* ``state``: the train state (``StandardSave``).
* ``meta``: JSON: ``record`` (the run's settings that must match for
  ``--resume``), ``losses`` (one per step so far), and ``arrays``: per leaf
  of the state, in tree-flatten order, its path, shape, dtype and
  checksum.

:func:`save` refuses a state holding a NaN or an infinity. :func:`restore`
reads ``meta`` alone first and compares the settings, then the arrays'
paths, shapes and dtypes, each with a message naming what differs (saved
vs now), before orbax reads any array; then it restores the state and
recomputes its checksums. Any failure is a ``SystemExit`` naming the step.

Why a checksum of our own: orbax's array data (tensorstore's OCDBT,
zstd-compressed) carries no content checksum, so a flipped bit in it
often restores silently as a different number.

The checksum of a leaf is two sums, modulo 2**32, over the leaf's bit
patterns read as unsigned words (32-bit words; narrower dtypes widened, a
64-bit value as two words): ``sum`` of the words, and ``mix`` of
``fmix32(word + 0x9E3779B9 * index)`` (MurmurHash3's finaliser; ``index``
the word's position in row-major order). Both are computed on the devices,
where the arrays are, in one jitted pass; integer addition modulo 2**32 is
exact in any order, so the sums are the same bits whatever the mesh,
sharding, process count or reduction order (a resume may use another
mesh). Changing any one word always changes ``mix`` (``fmix32`` is a
bijection) and any single bit changes ``sum`` too; unrelated damage to
several words goes unseen with a chance of about 2**-32 per leaf. A
sha256 of the bytes would instead need every array gathered to one host.
"""

from __future__ import annotations

import functools
import os


def manager(run_dir: str):
  """Orbax's manager of ``<run_dir>/checkpoints``, writing in a background
  thread (its default), keeping the last two steps; the loop decides which
  steps to save."""
  import orbax.checkpoint as ocp
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(run_dir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=2,
                                           enable_async_checkpointing=True))


def save(mngr, step: int, state, record: dict, losses: list[float]) -> None:
  """Start saving ``state`` as checkpoint ``step`` (orbax copies it to host
  memory, then writes in the background).

  Raises:
    SystemExit: ``state`` holds a non-finite value (nothing is saved).
  """
  import orbax.checkpoint as ocp
  arrays = fingerprint(state)
  bad = [a for a in arrays if a["nonfinite"]]
  if bad:
    raise SystemExit(
        f"step {step}: the train state holds non-finite values ("
        + ", ".join(f"{a['path']}: {a['nonfinite']} entries" for a in bad[:3])
        + ("..." if len(bad) > 3 else "")
        + "); training stopped, nothing of this step saved; "
        + last_checkpoint(mngr))
  for a in arrays:
    del a["nonfinite"]
  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      meta=ocp.args.JsonSave({"record": record, "losses": losses,
                              "arrays": arrays})), force=True)


def last_checkpoint(mngr) -> str:
  """Names the last checkpoint, for messages that stop a run."""
  step = mngr.latest_step()
  return (f"the last checkpoint is step {step} in {mngr.directory}"
          if step is not None else "no checkpoint was saved")


def restore(mngr, state, record: dict):
  """``(step, state, losses)`` of the last checkpoint, checked as the module
  docstring says.

  Args:
    mngr: from :func:`manager`.
    state: the run's initial train state: the shapes, dtypes and shardings
      to restore to.
    record: the run's settings; they must equal the checkpoint's.

  Raises:
    SystemExit: no checkpoint; other settings or arrays than the
      checkpoint's (naming each difference, saved vs now); a checkpoint
      that cannot be read or whose checksums differ (naming the step).
  """
  import jax
  import orbax.checkpoint as ocp
  step = mngr.latest_step()
  where = f"--resume: checkpoint step {step} in {mngr.directory}"
  if step is None:
    raise SystemExit(f"--resume: no checkpoint in {mngr.directory}")
  try:
    meta = mngr.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # noqa: BLE001 (orbax raises many kinds)
    raise SystemExit(f"{where}: its record cannot be read ({e!r})") from e
  saved = meta["record"]
  diff = [f"{k}: saved {saved[k]!r}, now {v!r}" if k in saved else
          f"{k}: not saved, now {v!r}" for k, v in record.items()
          if k not in saved or saved[k] != v]
  diff += [f"{k}: saved {v!r}, now absent" for k, v in saved.items()
           if k not in record]
  if diff:
    raise SystemExit(f"{where} was made with other settings: "
                     + "; ".join(diff))
  if "arrays" not in meta:
    raise SystemExit(f"{where} has no checksums (written by an older "
                     f"version of this example): it cannot be verified; "
                     f"start afresh with --overwrite")
  diff = _layout_diff(meta["arrays"], state)
  if diff:
    raise SystemExit(f"{where} holds other arrays than this run's: {diff}")
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  try:
    state = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
  except Exception as e:  # noqa: BLE001
    why = repr(e)  # TensorStore's own specs run to thousands of characters
    raise SystemExit(f"{where} cannot be read ({why[:300]}"
                     f"{' ...' if len(why) > 300 else ''})") from e
  for want, got in zip(meta["arrays"], fingerprint(state), strict=True):
    if (want["sum"], want["mix"]) != (got["sum"], got["mix"]):
      others = [s for s in mngr.all_steps() if s != step]
      raise SystemExit(
          f"{where} is corrupt: {got['path']} reads back with checksum "
          f"{got['sum']}/{got['mix']}, saved {want['sum']}/{want['mix']}. "
          + (f"Delete {mngr.directory / str(step)} to resume from step "
             f"{max(others)}." if others else "No earlier checkpoint."))
  return step, state, list(meta["losses"])


def _layout_diff(saved: list[dict], state) -> str:
  """The first difference between the saved arrays' paths, shapes and
  dtypes and ``state``'s, or ''."""
  import jax
  now = [dict(path=jax.tree_util.keystr(p), shape=list(x.shape),
              dtype=str(x.dtype))
         for p, x in jax.tree_util.tree_leaves_with_path(state)]
  for a, b in zip(saved, now):
    for key in ("path", "shape", "dtype"):
      if a[key] != b[key]:
        return (f"{b['path']}: saved {key} {a[key]}, now {b[key]}" if
                key != "path" else f"saved {a['path']}, now {b['path']}")
  if len(saved) != len(now):
    return f"saved {len(saved)} arrays, now {len(now)}"
  return ""


def fingerprint(tree) -> list[dict]:
  """Per leaf of ``tree`` (tree-flatten order): ``path``, ``shape``,
  ``dtype``, the checksums ``sum`` and ``mix`` (hex strings; see the module
  docstring) and ``nonfinite``, its count of NaN and infinite entries."""
  import jax
  import numpy as np
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  sums = jax.device_get(_sums_jit()([x for _, x in leaves]))
  return [dict(path=jax.tree_util.keystr(p), shape=list(x.shape),
               dtype=str(x.dtype), sum=f"{int(np.asarray(s)):08x}",
               mix=f"{int(np.asarray(m)):08x}", nonfinite=int(np.asarray(n)))
          for (p, x), (s, m, n) in zip(leaves, sums, strict=True)]


@functools.cache
def _sums_jit():
  import jax
  return jax.jit(lambda leaves: [_leaf_sums(x) for x in leaves])


def _fmix32(h):
  import jax.numpy as jnp
  h ^= h >> 16
  h *= jnp.uint32(0x85EBCA6B)
  h ^= h >> 13
  h *= jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _leaf_sums(x):
  """``(sum, mix, nonfinite)`` of one array, as the module docstring says,
  in one (variadic) reduction, which compiles faster than three."""
  import jax
  import jax.numpy as jnp
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # dropout's key
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  elif x.dtype.itemsize >= 4:  # 8-byte values gain a trailing axis of 2
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    words = jax.lax.bitcast_convert_type(
        x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
  # Row-major positions from iotas: elementwise, so sharded like the words.
  index, stride = jnp.zeros(words.shape, jnp.uint32), 1
  for axis in reversed(range(words.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * (
        jnp.uint32(stride % 2**32))
    stride *= words.shape[axis]
  nonfinite = (~jnp.isfinite(x) if jnp.issubdtype(x.dtype, jnp.inexact)
               else jnp.zeros(x.shape, bool))
  if words.ndim > x.ndim:  # a count per value, not per word
    nonfinite = jnp.stack([nonfinite, jnp.zeros_like(nonfinite)], -1)
  return jax.lax.reduce(
      (words, _fmix32(words + index * jnp.uint32(0x9E3779B9)),
       nonfinite.astype(jnp.uint32)),
      (jnp.uint32(0),) * 3,
      lambda a, b: tuple(p + q for p, q in zip(a, b, strict=True)),
      tuple(range(words.ndim)))
