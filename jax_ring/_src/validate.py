"""Trace-time validators. Each raises ``ValueError`` naming the argument and
the shapes involved; each message is pinned by a unit test."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src.config import IMPLEMENTATIONS, KV_SENDS, LOAD_BALANCES

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                jnp.dtype(jnp.float16))


def qkv(query, key, value) -> None:
  """Layout ``q (B, T, N, H)``, ``k, v (B, S, K, H)``, one float dtype."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 (B, T, N, H) or 3 (T, N, H); got shape "
          f"{tuple(x.shape)}")
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape; got key "
                     f"{tuple(key.shape)} and value {tuple(value.shape)}")
  if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
    raise ValueError(
        f"query and key must agree on batch (dim 0) and head_dim (dim 3); got "
        f"query {tuple(query.shape)} and key {tuple(key.shape)}")
  n, k = query.shape[2], key.shape[2]
  if n % k:
    raise ValueError(
        f"query heads ({n}) must be divisible by key/value heads ({k}); got "
        f"query {tuple(query.shape)} and key {tuple(key.shape)}")
  dtypes = (query.dtype, key.dtype, value.dtype)
  if len(set(dtypes)) != 1:
    raise ValueError(
        f"query, key and value must have one dtype; got query {query.dtype}, "
        f"key {key.dtype}, value {value.dtype}")
  if query.dtype not in FLOAT_DTYPES:
    raise ValueError(
        f"query, key and value must be float32, bfloat16 or float16; got "
        f"{query.dtype}")


def window(local_window_size) -> tuple[int, int] | None:
  """``int | (left, right) | None`` -> ``(left, right) | None``."""
  if local_window_size is None:
    return None
  pair = local_window_size
  if isinstance(pair, (int, np.integer)):
    pair = (pair, pair)
  ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and
        all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and
            w >= 0 for w in pair))
  if not ok:
    raise ValueError(
        "local_window_size must be a non-negative int or a (left, right) pair "
        f"of non-negative ints; got {local_window_size!r}")
  return int(pair[0]), int(pair[1])


def scalar_options(scale, logits_soft_cap) -> None:
  if scale is not None and not (isinstance(scale, (int, float)) and
                                math.isfinite(scale)):
    raise ValueError(f"scale must be a finite Python number; got {scale!r}")
  if logits_soft_cap is not None and not (
      isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0 and
      math.isfinite(logits_soft_cap)):
    raise ValueError(
        f"logits_soft_cap must be a positive finite number; got "
        f"{logits_soft_cap!r}")


def implementation(impl) -> None:
  if impl is not None and impl not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of "
                     f"{IMPLEMENTATIONS}; got {impl!r}")


def broadcastable(name, x, target) -> None:
  """``bias``/``mask``: 4-D and broadcastable to ``(B, N, T, S)``."""
  if x.ndim != 4 or any(d not in (1, t) for d, t in zip(x.shape, target)):
    raise ValueError(
        f"{name} must be 4-D and broadcastable to (B, N, T, S) = "
        f"{tuple(target)}; got shape {tuple(x.shape)}")


def bool_mask(mask) -> None:
  if mask.dtype != jnp.bool_:
    raise ValueError(
        f"mask must be a boolean array (True = attend); got dtype {mask.dtype}"
        f" with shape {tuple(mask.shape)}. Pass additive masks as bias.")


def seq_lengths(name, lengths, batch) -> None:
  if lengths.ndim != 1 or lengths.shape[0] != batch or not jnp.issubdtype(
      lengths.dtype, jnp.integer):
    raise ValueError(f"{name} must be an int array of shape (B,) = "
                     f"({batch},); got {lengths.dtype} {tuple(lengths.shape)}")


def segment_ids(ids, q_shape, kv_shape):
  """``(B, T)`` array (needs T == S) or a ``(q_ids, kv_ids)`` pair."""
  b, t = q_shape[:2]
  s = kv_shape[1]
  if isinstance(ids, (tuple, list)):
    if len(ids) != 2:
      raise ValueError(f"segment_ids pair must be (q_ids, kv_ids); got "
                       f"{len(ids)} items")
    q_ids, kv_ids = (jnp.asarray(x) for x in ids)
  else:
    q_ids = kv_ids = jnp.asarray(ids)
  expect = f"(B, T) = {(b, t)} for queries and (B, S) = {(b, s)} for keys"
  for x, want in ((q_ids, (b, t)), (kv_ids, (b, s))):
    if tuple(x.shape) != want or not jnp.issubdtype(x.dtype, jnp.integer):
      got = (f"{q_ids.dtype} {tuple(q_ids.shape)} and {kv_ids.dtype} "
             f"{tuple(kv_ids.shape)}")
      raise ValueError(f"segment_ids must be int arrays of shape {expect}; "
                       f"got {got}")
  return q_ids, kv_ids


def mesh_axis(axis_name) -> int:
  """Size of ``axis_name``, which must be bound (inside shard_map)."""
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError:
    raise ValueError(
        f"axis_name {axis_name!r} is not a mesh axis bound here: call "
        "this strategy inside shard_map over a mesh with that axis") from None


def ulysses_heads(num_heads: int, axis_name: str, cp_size: int) -> None:
  """Ulysses splits query heads over the axis: N % cp == 0."""
  if num_heads % cp_size:
    raise ValueError(
        f"ulysses_attention splits query heads over axis {axis_name!r}: query "
        f"heads ({num_heads}) must be divisible by its size ({cp_size})")


def kv_chunk_heads(kv_chunk_heads, kv_heads: int) -> None:
  """``kv_chunk_heads``: None, or a positive int dividing the kv heads."""
  if kv_chunk_heads is None:
    return
  if (not isinstance(kv_chunk_heads, (int, np.integer)) or
      isinstance(kv_chunk_heads, bool) or kv_chunk_heads < 1 or
      kv_heads % kv_chunk_heads):
    raise ValueError(
        f"kv_chunk_heads must be None or a positive int dividing the "
        f"key/value heads ({kv_heads}); got {kv_chunk_heads!r}")


def ring_choices(load_balance, loop, kv_sends=None) -> None:
  if load_balance is not None and load_balance not in LOAD_BALANCES:
    raise ValueError(f"load_balance must be None, 'dual_chunk' or 'striped'; "
                     f"got {load_balance!r}")
  if loop not in (None, "scan", "unrolled"):
    raise ValueError(f"loop must be None, 'scan' or 'unrolled'; got {loop!r}")
  if kv_sends is not None and kv_sends not in KV_SENDS:
    raise ValueError(f"kv_sends must be None or one of {KV_SENDS}; got "
                     f"{kv_sends!r}")


def strategy_layout(strategy: str, load_balance) -> None:
  """All-gather computes contiguous chunk ranges: no striped layout."""
  if strategy == "all_gather" and load_balance == "striped":
    raise ValueError(
        "strategy 'all_gather' does not support load_balance='striped' (each "
        "device's calls are contiguous key ranges); use 'dual_chunk' or None")


def ring_options(load_balance, loop, local_len, cp_size,
                 kv_sends=None) -> None:
  """Layout and loop of local shards of ``local_len`` tokens on cp_size
  devices. ``"striped"`` needs only S % cp_size == 0, which local shards
  already are; ``"dual_chunk"`` also needs an even local length."""
  ring_choices(load_balance, loop, kv_sends)
  if load_balance == "dual_chunk" and local_len % 2:
    raise ValueError(
        f"load_balance='dual_chunk' needs the global sequence length "
        f"({local_len * cp_size}) divisible by 2 * cp_size = {2 * cp_size}; "
        f"the local query length is {local_len}")


def context_parallel(cp, query, key, *, bias, mask, return_residual) -> None:
  """What the automatic context-parallel path serves."""
  from jax_ring._src.config import ContextParallel  # avoid an import cycle
  if not isinstance(cp, ContextParallel):
    raise ValueError(f"context_parallel must be a jax_ring.ContextParallel; "
                     f"got {cp!r}")
  from jax_ring._src.config import STRATEGIES
  if cp.strategy not in STRATEGIES:
    raise ValueError(f"context_parallel.strategy must be one of "
                     f"{STRATEGIES}; got {cp.strategy!r}")
  pair = (isinstance(cp.axis, tuple) and len(cp.axis) == 2 and
          all(isinstance(a, str) for a in cp.axis) and cp.axis[0] != cp.axis[1])
  if cp.strategy == "hybrid" and not pair:
    raise ValueError(f"context_parallel.axis must be a pair (ulysses_axis, "
                     f"ring_axis) of distinct axis names for strategy "
                     f"'hybrid'; got {cp.axis!r}")
  if cp.strategy != "hybrid" and not isinstance(cp.axis, str):
    raise ValueError(f"context_parallel.axis must be one axis name for "
                     f"strategy {cp.strategy!r}; got {cp.axis!r}")
  ring_choices(cp.load_balance, cp.loop, cp.kv_sends)
  kv_chunk_heads(cp.kv_chunk_heads, key.shape[2])
  unsupported = [name for name, value in (("bias", bias), ("mask", mask))
                 if value is not None]
  if return_residual:
    unsupported.append("return_residual")
  if unsupported:
    raise ValueError(
        f"context_parallel does not support {', '.join(unsupported)}: they "
        f"are not sharded along the sequence; got query "
        f"{tuple(query.shape)}, key {tuple(key.shape)}")
  mesh_axes(cp.axis, query)


def _mesh_in_scope(x):
  """The mesh that a call on ``x`` runs on, as far as tracing can see it:
  the one of ``jax.set_mesh``, else the one ``x``'s sharding names (jit
  arguments placed with a ``NamedSharding`` carry it in their type)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", mesh)
  return mesh


def mesh_axes(axis, query) -> None:
  """The context-parallel axis (or both axes of a hybrid pair) exist on the
  mesh in scope. Without this check a wrong name fails inside XLA's
  partitioner, and a call with no mesh at all runs on one device, silently
  without context parallelism."""
  mesh = _mesh_in_scope(query)
  names = axis if isinstance(axis, tuple) else (axis,)
  if mesh.empty:
    raise ValueError(
        f"context_parallel.axis {axis!r} needs a mesh, and none is in scope: "
        f"query {tuple(query.shape)} is not placed on a mesh and no "
        f"jax.set_mesh is active; shard q, k, v's sequence dimension over "
        f"{axis!r} with a NamedSharding, or call under jax.set_mesh(mesh)")
  missing = [a for a in names if a not in mesh.axis_names]
  if missing:
    raise ValueError(
        f"context_parallel.axis {axis!r}: {', '.join(map(repr, missing))} "
        f"is not an axis of the mesh in scope, whose axes are "
        f"{tuple(mesh.axis_names)} (sizes {tuple(mesh.axis_sizes)}); got "
        f"query {tuple(query.shape)}")
