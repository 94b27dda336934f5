"""Trace-time validators. Each raises ``ValueError`` naming the argument and
the shapes involved; each message is pinned by a unit test."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_ring._src.core import config, ints
from jax_ring._src.core import mesh as mesh_lib
from jax_ring._src.core.config import IMPLEMENTATIONS, ContextParallel


FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                jnp.dtype(jnp.float16))


def qkv(query, key, value) -> None:
  """Layout ``q (B, T, N, H)``, ``k (B, S, K, H)``, ``v (B, S, K, Hv)``,
  one float dtype; the value head dim Hv may differ from H. T, S and B may
  be 0 (the output is then empty or zero); heads and head dims may not."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 (B, T, N, H) or 3 (T, N, H); got shape "
          f"{tuple(x.shape)}")
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"key and value must agree on batch, sequence and heads "
                     f"(dims 0-2; only the head dim may differ); got key "
                     f"{tuple(key.shape)} and value {tuple(value.shape)}")
  if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
    raise ValueError(
        f"query and key must agree on batch (dim 0) and head_dim (dim 3); got "
        f"query {tuple(query.shape)} and key {tuple(key.shape)}")
  n, k, h = query.shape[2], key.shape[2], query.shape[3]
  if not (n and k and h):
    raise ValueError(
        f"query heads, key/value heads and head_dim must be positive; got "
        f"query {tuple(query.shape)} and key {tuple(key.shape)}")
  if not value.shape[3]:
    raise ValueError(f"value's head_dim must be positive; got value "
                     f"{tuple(value.shape)}")
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


def window(local_window_size, q_len: int | None, kv_len: int | None):
  """``int | (left, right) | None`` -> ``(left, right) | None`` for global
  lengths T = ``q_len`` and S = ``kv_len``.

  A side at least as long as the sequence bounds nothing (``left >= T - 1``
  or ``right >= S - 1``) and is clamped there, so windows of any size stay
  exact in int32 position arithmetic; a window that bounds neither side is
  ``None``. Lengths None: only the form is checked.
  """
  if local_window_size is None:
    return None
  pair = local_window_size
  if ints.is_int(pair):
    pair = (pair, pair)
  ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and
        all(ints.is_int(w) and w >= 0 for w in pair))
  if not ok:
    raise ValueError(
        "local_window_size must be a non-negative int or a (left, right) pair "
        f"of non-negative ints; got {local_window_size!r}")
  if q_len is None or kv_len is None:
    return int(pair[0]), int(pair[1])
  most = (max(q_len - 1, 0), max(kv_len - 1, 0))
  if all(int(w) >= m for w, m in zip(pair, most)):
    return None
  return tuple(min(int(w), m) for w, m in zip(pair, most))


def _number(name, x) -> float | None:
  """A Python or NumPy real scalar, or a concrete 0-d array, as a float.
  The option is static (it shapes the compiled program), so a traced value
  is a ``TypeError``."""
  if x is None:
    return None
  if isinstance(x, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a concrete number: it is compiled into the program; "
        f"got a traced {x.dtype} array of shape {tuple(x.shape)} (pass it "
        "as a static argument of jax.jit, or close over it)")
  if isinstance(x, bool) or not (
      isinstance(x, (int, float, np.integer, np.floating)) or
      (hasattr(x, "shape") and np.shape(x) == () and
       np.issubdtype(np.asarray(x).dtype, np.number) and
       not np.issubdtype(np.asarray(x).dtype, np.complexfloating))):
    raise TypeError(f"{name} must be a real number; got {x!r}")
  return float(x)


def scalar_options(scale, logits_soft_cap) -> tuple[float | None,
                                                     float | None]:
  """``(scale, logits_soft_cap)`` as floats (None where not given)."""
  scale = _number("scale", scale)
  cap = _number("logits_soft_cap", logits_soft_cap)
  if scale is not None and not math.isfinite(scale):
    raise ValueError(f"scale must be finite; got {scale!r}")
  if cap is not None and not (cap > 0 and math.isfinite(cap)):
    raise ValueError(
        f"logits_soft_cap must be a positive finite number; got {cap!r}")
  return scale, cap


def implementation(impl) -> None:
  if impl is not None and impl not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be None or one of "
                     f"{IMPLEMENTATIONS}; got {impl!r}")


def broadcastable(name, x, target):
  """``bias``/``mask`` of rank <= 4, broadcastable to ``(B, N, T, S)`` once
  leading 1s are added (as ``jax.nn`` does); returns it 4-D."""
  if x.ndim <= 4:
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if x.ndim != 4 or any(d not in (1, t) for d, t in zip(x.shape, target)):
    raise ValueError(
        f"{name} must be broadcastable to (B, N, T, S) = {tuple(target)}, "
        f"with leading dims added as needed; got shape {tuple(x.shape)}")
  return x


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


def sinks(x, num_heads: int):
  """``sinks``: a float array of shape ``(N,)``, one logit per query head;
  returned as an array."""
  x = jnp.asarray(x)
  if x.shape != (num_heads,) or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"sinks must be a float array of shape (N,) = "
                     f"({num_heads},), one logit per query head; got "
                     f"{x.dtype} {tuple(x.shape)}")
  return x


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


def padding_segment_id(value, segment_ids) -> None:
  """``padding_segment_id``: None, or an int id given with segment ids."""
  if value is None:
    return
  if not ints.is_int(value):
    raise ValueError(f"padding_segment_id must be None or an int segment "
                     f"id; got {value!r}")
  if segment_ids is None:
    raise ValueError(f"padding_segment_id={value} needs segment_ids: it "
                     f"names which of their ids marks padding")


def one_axis_name(function: str, axis_name) -> None:
  """``axis_name`` of a one-axis ``shard_map`` entry point: one name. A
  tuple is refused rather than read as one of its axes."""
  if not isinstance(axis_name, str):
    raise ValueError(
        f"{function}: axis_name must be one mesh axis name; got "
        f"{axis_name!r}. To split the sequence over two axes, use "
        f"hybrid_attention(axis_name=(ulysses_axis, ring_axis)), or a mesh "
        f"with one context axis")


def mesh_axis(axis_name) -> int:
  """Size of ``axis_name``, which must be bound (inside shard_map)."""
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError:
    bound = tuple(jax.sharding.get_abstract_mesh().axis_names)
    where = (f"the mesh here has axes {bound}" if bound else
             "no mesh axis is bound here")
    raise ValueError(
        f"axis_name {axis_name!r} is not a mesh axis bound here ({where}): "
        "call this strategy inside shard_map over a mesh with that "
        "axis") from None


def ulysses_heads(num_heads: int, axis_name: str, cp_size: int,
                  why: str = "") -> None:
  """Ulysses splits query heads over the axis: N % cp == 0. ``why``: what
  made the call Ulysses, leading the message."""
  if num_heads % cp_size:
    raise ValueError(
        f"{why}ulysses_attention splits query heads over axis {axis_name!r}: "
        f"query heads ({num_heads}) must be divisible by its size "
        f"({cp_size})")


def kv_chunk_heads(kv_chunk_heads, kv_heads: int) -> None:
  """``kv_chunk_heads``: None, or a positive int dividing the kv heads."""
  if kv_chunk_heads is None:
    return
  if (not ints.is_int(kv_chunk_heads) or kv_chunk_heads < 1 or
      kv_heads % kv_chunk_heads):
    raise ValueError(
        f"kv_chunk_heads must be None or a positive int dividing the "
        f"key/value heads ({kv_heads}); got {kv_chunk_heads!r}")


def strategy_layout(strategy: str, load_balance) -> None:
  """All-gather computes contiguous chunk ranges: no striped layout."""
  if strategy == "all_gather" and load_balance == "striped":
    raise ValueError(
        "strategy 'all_gather' does not support load_balance='striped' (each "
        "device's calls are contiguous key ranges); use 'dual_chunk' or None")


def self_attention(strategy: str, q_shape, k_shape) -> None:
  """The ring and the all-gather place keys by the queries' positions: they
  serve T == S only (context parallelism's self-attention). Ulysses
  gathers whole sequences and serves any T, S."""
  if q_shape[1] != k_shape[1] and strategy != "ulysses":
    raise ValueError(
        f"strategy {strategy!r} needs the query and key sequences equally "
        f"long (self-attention); got query {tuple(q_shape)} and key "
        f"{tuple(k_shape)}. Use strategy 'ulysses' for T != S")


def ring_options(load_balance, loop, local_len, cp_size,
                 kv_sends=None, name="query") -> None:
  """Layout and loop of local shards of ``local_len`` tokens (of the
  ``name`` sequence) on cp_size devices. ``"striped"`` needs only S %
  cp_size == 0, which local shards already are; ``"dual_chunk"`` also
  needs an even local length."""
  config.ring_choices(load_balance, loop, kv_sends)
  if load_balance == "dual_chunk" and local_len % 2:
    raise ValueError(
        f"load_balance='dual_chunk' needs the global sequence length "
        f"({local_len * cp_size}) divisible by 2 * cp_size = {2 * cp_size}; "
        f"the local {name} length is {local_len}")


def context_parallel(cp, query, key, *, bias, mask, return_residual):
  """What the automatic context-parallel path serves, on the mesh in scope
  (returned): every check that the partition rule would make, made here
  at trace time, so that it surfaces as a ``ValueError``."""
  cp_given(cp, key.shape[2])
  unsupported = [name for name, value in (("bias", bias), ("mask", mask))
                 if value is not None]
  if return_residual:
    unsupported.append("return_residual")
  if unsupported:
    raise ValueError(
        f"context_parallel does not support {', '.join(unsupported)}: they "
        f"are not sharded along the sequence; got query "
        f"{tuple(query.shape)}, key {tuple(key.shape)}")
  mesh = mesh_axes(cp, query)
  sizes = {a: mesh.shape[a] for a in mesh.axis_names}
  lengths = padded_lengths(cp, sizes, query.shape[1], key.shape[1])
  cp_shapes(cp, sizes, query.shape, key.shape, query.shape[2], lengths)
  return mesh, lengths


def ring_size(cp, sizes) -> int:
  """The devices the load-balance layout spreads a sequence over: the ring
  axis of a pair, else the one axis."""
  return sizes[cp.ring_axis] if cp.is_hybrid else sizes[cp.axis]


def sequence_unit(cp, sizes) -> int:
  """What a sequence length must divide by under ``cp`` on a mesh of axis
  ``sizes``: every context device's share equal and, for the dual-chunk
  layout, two equal chunks per ring device."""
  total = math.prod(sizes[a] for a in cp.axes)
  return math.lcm(total, 2 * ring_size(cp, sizes)) if (
      cp.load_balance == "dual_chunk") else total


def padded_lengths(cp, sizes, t: int, s: int) -> tuple[int, int]:
  """The query and key lengths a call runs at: T and S rounded up to
  :func:`sequence_unit` where the library lays the sequence out itself
  (natural-order inputs, or contiguous shards), the padding masked; as
  given otherwise (inputs already in a layout must divide: cp_shapes
  says so)."""
  if cp.inputs != "natural" and cp.load_balance is not None:
    return t, s
  unit = sequence_unit(cp, sizes)
  up = lambda n: n if n == 0 else -(-n // unit) * unit
  return up(t), up(s)


def cp_given(cp, kv_heads: int) -> None:
  """At a call: ``cp`` is a ``ContextParallel`` (whose fields it checked
  when it was made) and its ``kv_chunk_heads`` divides the call's kv
  heads."""
  if not isinstance(cp, ContextParallel):
    raise ValueError(f"context_parallel must be a jax_ring.ContextParallel; "
                     f"got {cp!r}")
  kv_chunk_heads(cp.kv_chunk_heads, kv_heads)


def explain_args(query_shape, key_shape, cp_size, dtype_bytes, cp,
                 value_shape) -> dict:
  """``explain``'s arguments, checked as the call they describe checks its
  own; returns the axis sizes (``cp_size``: one size, or a (ulysses, ring)
  pair of sizes for a pair of axes)."""
  shapes = (query_shape, key_shape, value_shape)
  shapes_ok = all(
      isinstance(x, (tuple, list)) and len(x) == 4 and
      all(ints.is_int(d) and d >= 0 for d in x) for x in shapes)
  if not shapes_ok:
    raise ValueError(f"query_shape, key_shape and value_shape must be (B, T, "
                     f"N, H), (B, S, K, H) and (B, S, K, Hv) tuples of "
                     f"non-negative ints; got {query_shape!r}, {key_shape!r} "
                     f"and {value_shape!r}")
  as_array = lambda shape: jax.ShapeDtypeStruct(tuple(shape), jnp.bfloat16)
  qkv(*map(as_array, shapes))
  if dtype_bytes not in (2, 4) or isinstance(dtype_bytes, bool):
    raise ValueError(f"dtype_bytes must be 2 (bfloat16, float16) or 4 "
                     f"(float32); got {dtype_bytes!r}")
  cp_given(cp, key_shape[2])
  axes = cp.axes
  sizes = cp_size if isinstance(cp_size, (tuple, list)) else (cp_size,)
  if len(sizes) != len(axes) or not all(ints.is_int(c) and c > 0
                                        for c in sizes):
    want = ("a pair of positive ints (ulysses, ring) for the axes "
            f"{cp.axis!r}" if len(axes) == 2 else "a positive int")
    raise ValueError(f"cp_size must be {want}; got {cp_size!r}")
  sizes = dict(zip(axes, map(int, sizes)))
  lengths = padded_lengths(cp, sizes, query_shape[1], key_shape[1])
  cp_shapes(cp, sizes, query_shape, key_shape, query_shape[2], lengths)
  return sizes


def cp_shapes(cp, sizes, q_shape, k_shape, local_heads,
              lengths=None) -> None:
  """Global shapes ``q_shape``/``k_shape`` against ``cp`` (a
  ``ContextParallel``) on a mesh of axis ``sizes``: divisibility, layout,
  Ulysses' heads, self-attention. ``lengths``: the (query, key) lengths the
  call runs at once padded (:func:`padded_lengths`; default the shapes').
  ``auto`` is held to what its candidates share (a pair of axes: hybrid's
  checks)."""
  strategy = cp.strategy
  if strategy == "auto" and cp.is_hybrid:
    strategy = "hybrid"
  total = math.prod(sizes[a] for a in cp.axes)
  t, s = lengths or (q_shape[1], k_shape[1])
  for name, shape, n in (("query", q_shape, t), ("key", k_shape, s)):
    if n % total:
      raise ValueError(
          f"context_parallel: the sequence length of {name} "
          f"{tuple(shape)} must be divisible by the {cp.axis!r} axis size "
          f"{total} (inputs='load_balanced': the arrays are in the layout "
          f"already; natural-order inputs are padded)")
  strategy_layout(strategy, cp.load_balance)
  why = ""
  if strategy == "auto" and q_shape[1] != k_shape[1]:
    strategy = "ulysses"  # its one candidate for T != S
    why = (f"strategy 'auto' runs Ulysses where the query length "
           f"({q_shape[1]}) differs from the key length ({k_shape[1]}): ")
  self_attention(strategy, q_shape, k_shape)
  if strategy in ("ulysses", "hybrid"):
    ulysses_heads(local_heads, cp.ulysses_axis, sizes[cp.ulysses_axis], why)
  ring_cp = sizes[cp.ring_axis] if strategy == "hybrid" else total
  ring_options(cp.load_balance, cp.loop, t // ring_cp, ring_cp, cp.kv_sends)
  if s != t:  # Ulysses: the keys take the layout too
    ring_options(cp.load_balance, cp.loop, s // ring_cp, ring_cp,
                 cp.kv_sends, name="key")


def mesh_axes(cp, query):
  """The mesh in scope, on which the context-parallel axis (or both axes of
  a hybrid pair) exist. Without this check a wrong name fails inside XLA's
  partitioner, and a call with no mesh at all runs on one device, silently
  without context parallelism."""
  mesh = mesh_lib.in_scope(query)
  axis, names = cp.axis, cp.axes
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
  return mesh
