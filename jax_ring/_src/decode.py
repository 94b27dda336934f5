"""``decode_attention``: a few new query tokens per row against a KV cache,
on one device or with the cache's sequence split over a mesh axis.

Shapes: B batch, T new query tokens per row (1 when decoding one token),
C cache slots (per device inside ``shard_map``), N query heads, K kv
heads, H query/key head dim, Hv value head dim.

Masks are by *position*, not by slot: each slot carries the position of
the token it holds (``key_positions``, negative for an empty slot), so the
cache may hold its tokens in any order on any device (the training
layouts, or a decode step's append wherever it is cheap). Query ``i`` of
row ``b`` sees slot ``j`` when ``key_positions[b, j] >= 0`` and, causal,
``key_positions[b, j] <= query_positions[b, i]``, and within the window
``(left, right)`` of its position.

Each device reads its own slots once: the scores of T x C are small for
decoding, so the local part is one fused pass over K and one over V (no
tiling), giving an unnormalised output, a running max ``m`` and a sum
``l`` per row, in float32. Across the axis the parts merge exactly as the
ring's blocks do, by logsumexp: ``m* = max(m)`` over the devices, then the
sums of ``(o exp(m - m*), l exp(m - m*))``. For decoding's small rows
every device's ``(o, m, l)`` is gathered by all in one all-reduce (D x B x
T x N x (Hv + 2) float32 values, each device's at its index, the rest
zeros) and merged on each; above ``GATHER_BYTES`` of them, a max- and a
sum-all-reduce of one part's size. That, per layer and step, whatever the
cache length, is all that moves: K/V never move. Sinks fold into the
merged row (``kernel.fold_sinks``); a row that sees no slot is 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ring._src.core import kernel, registry, validate
from jax_ring._src.core.config import AttentionConfig, ContextParallel
from jax_ring._src.core.mask import MASK_VALUE


KvLayout = Literal["bskh", "bksh"]
# The merge's parts, all devices' together, up to which they move in one
# collective (see _merge).
GATHER_BYTES = 1 << 20
# (scores, output) products per cache layout: the cache is read once by each.
_PRODUCTS = {"bskh": ("btkgh,bckh->bkgtc", "bkgtc,bckh->btkgh"),
             "bksh": ("btkgh,bkch->bkgtc", "bkgtc,bkch->btkgh")}


def decode_attention(query, key, value, *, query_positions, key_positions,
                     is_causal=True, local_window_size=None, scale=None,
                     logits_soft_cap=None, sinks=None, axis_name=None,
                     context_parallel: ContextParallel | None = None,
                     kv_layout: KvLayout = "bskh",
                     implementation: Literal["xla", "pallas"] | None = None):
  """Attention of ``query`` against the cached ``key``/``value``, masked by
  the tokens' positions.

  Args:
    query: ``(B, T, N, H)``, the new tokens.
    key: ``(B, C, K, H)``, the cache's keys (N % K == 0, never repeated);
      ``(B, K, C, H)`` with ``kv_layout="bksh"``.
    value: ``(B, C, K, Hv)``, or ``(B, K, C, Hv)``.
    query_positions: ``(B, T)`` int, each new token's position.
    key_positions: ``(B, C)`` int, the position of the token in each slot;
      negative: an empty slot.
    is_causal: a slot is visible only at positions ``<=`` the query's.
    local_window_size: ``w`` or ``(left, right)`` in positions.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    logits_soft_cap: ``c``: logits become ``c tanh(logits / c)``.
    sinks: ``(N,)`` float, one logit per head with no value.
    axis_name: inside ``shard_map``: the mesh axis (or tuple of axes) the
      cache's slots are split over (C is then the local count); the
      queries and their positions are the same on every device of it.
    context_parallel: on global arrays (eagerly or under ``jax.jit``): the
      cache's C is split over ``context_parallel.axis`` of the mesh in
      scope (a pair of axes: over both, ring-major, as the training
      layouts split tokens), and each device attends to its own slots.
    kv_layout: ``"bskh"`` (the cache as ``dot_product_attention`` takes
      K/V) or ``"bksh"`` (kv-head-major: with B > 1, the layout each of
      the two products reads as one batched matrix; a ``"bskh"`` cache is
      transposed, which XLA may do by copying it whole).
    implementation: each device's part: ``"xla"`` (two products and a
      softmax) or ``"pallas"`` (one kernel, pallas_decode.py). None: the
      Pallas kernel on GPUs where it serves the part's shapes, else XLA;
      :func:`explain_decode` says which, and why.

  Returns:
    ``(B, T, N, Hv)`` in the query's dtype.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  if kv_layout not in _PRODUCTS:
    raise ValueError(f"kv_layout must be 'bskh' or 'bksh'; got {kv_layout!r}")
  for name, x, dims in (("query", query, "(B, T, N, H)"),
                        ("key", key, kv_layout), ("value", value, kv_layout)):
    if x.ndim != 4:
      raise ValueError(f"decode_attention: {name} must have rank 4, "
                       f"{dims}; got shape {tuple(x.shape)}")
  as_bskh = lambda x: x if kv_layout == "bskh" else jax.ShapeDtypeStruct(
      (x.shape[0], x.shape[2], x.shape[1]) + x.shape[3:], x.dtype)
  try:
    validate.qkv(query, as_bskh(key), as_bskh(value))
  except ValueError as e:
    if kv_layout == "bskh":
      raise
    raise ValueError(f"{e} (key and value shown as (B, C, K, H); "
                     f"kv_layout='bksh' takes them as (B, K, C, H))") from None
  q_pos, kv_pos = (_positions(name, x, s) for name, x, s in (
      ("query_positions", query_positions, query.shape[:2]),
      ("key_positions", key_positions, as_bskh(key).shape[:2])))
  scale, cap = validate.scalar_options(scale, logits_soft_cap)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  window = validate.window(local_window_size, None, None)
  if window is not None:  # int32 positions: a wider side bounds nothing
    window = tuple(min(w, 2**31 - 1) for w in window)
  band = AttentionConfig(scale=scale, is_causal=bool(is_causal),
                         local_window=window).band
  if sinks is not None:
    sinks = validate.sinks(sinks, query.shape[2])
  if axis_name is not None and context_parallel is not None:
    raise ValueError("decode_attention takes axis_name (inside shard_map) or "
                     "context_parallel (on global arrays), not both")
  local = _local_part(implementation, kv_layout, axis_name, context_parallel,
                      band=band, scale=scale, cap=cap)
  if context_parallel is None:
    return _attend(local, query, key, value, q_pos, kv_pos, sinks, axis_name)
  return _context_parallel(local, query, key, value, q_pos, kv_pos, sinks,
                           context_parallel, 1 if kv_layout == "bskh" else 2)


def _local_part(implementation, kv_layout, axis_name, context_parallel,
                **options):
  """Each device's part as ``implementation`` computes it; a kernel's
  gradient is the XLA path's."""
  xla_local = functools.partial(_local, layout=kv_layout, **options)
  if implementation is None:
    return _default_local(xla_local, kv_layout, **options)
  if implementation == "xla":
    return xla_local
  return _kernel_local(implementation, xla_local, kv_layout, axis_name,
                       context_parallel, **options)


def _kernel_local(implementation, xla_local, kv_layout, axis_name,
                  context_parallel, **options):
  """The registered kernel ``implementation`` as the local part (its
  gradient ``xla_local``'s), or a ValueError naming why it cannot be."""
  _check_implementation(implementation, kv_layout)
  kern = registry.DECODE_KERNELS[implementation]
  interpret = jax.default_backend() != "gpu"
  if interpret and (axis_name, context_parallel) != (None, None):
    raise ValueError(
        f"decode_attention: implementation={implementation!r} runs "
        f"interpreted off GPUs, which jax cannot do inside shard_map "
        f"(axis_name or context_parallel); implementation='xla' can")
  return _with_kernel(kern, xla_local, interpret=interpret, **options)


def _with_kernel(kern, xla_local, *, interpret=False, **options):
  """Decode kernel ``kern`` as the local part, once it has accepted the
  shapes each device holds (:func:`_refuse_unserved`); its gradient
  ``xla_local``'s."""
  part = _xla_gradient(functools.partial(kern.local, interpret=interpret,
                                         **options), xla_local)

  def local(q, k, v, q_pos, kv_pos):
    _refuse_unserved(kern, q.shape, k.shape, v.shape)
    return part(q, k, v, q_pos, kv_pos)

  return local


def _refuse_unserved(kern, q_shape, k_shape, v_shape):
  """A ValueError naming what ``kern`` cannot serve of one device's part
  (kv-head-major shapes), if anything."""
  why = kern.supports(q_shape, k_shape, v_shape, "bksh")
  if why is not None:
    raise ValueError(f"decode_attention(implementation={kern.name!r}) "
                     f"cannot serve {why}; implementation='xla' can")


def _default_local(xla_local, kv_layout, **options):
  """The local part ``implementation=None`` runs: :func:`_choose`'s, from
  the shapes each device holds (known when it is traced)."""

  def local(q, k, v, q_pos, kv_pos):
    name, _ = _choose(q.shape, k.shape, v.shape, kv_layout, None,
                      _platform())
    if name != "xla":
      return _with_kernel(registry.DECODE_KERNELS[name], xla_local,
                          **options)(q, k, v, q_pos, kv_pos)
    return xla_local(q, k, v, q_pos, kv_pos)

  return local


def _platform() -> str:
  """``jax.default_backend()``, with AMD GPUs told apart ("rocm"): the
  decode kernels are built and tested for NVIDIA's."""
  platform = jax.default_backend()
  version = getattr(jax.devices()[0].client, "platform_version", "")
  return "rocm" if platform == "gpu" and "rocm" in version.lower() else platform


def _choose(q_shape, k_shape, v_shape, kv_layout, implementation,
            platform) -> tuple[str, str]:
  """``(kernel, why)`` for one device's part of these (local) shapes."""
  if implementation is not None:
    return implementation, "asked for (implementation=...)"
  if platform != "gpu":
    return "xla", (f"the default on {platform} (the decode kernels are "
                   f"built for NVIDIA GPUs)")
  if not registry.DECODE_KERNELS:
    return "xla", "no decode kernel is available with this jax"
  if kv_layout != "bksh":
    return "xla", ("kv_layout='bskh': the kernels read a kv-head-major "
                   "cache (kv_layout='bksh', as Generator keeps it)")
  whys = []
  for name, kern in registry.DECODE_KERNELS.items():
    why = kern.supports(q_shape, k_shape, v_shape, kv_layout)
    if why is None:
      return name, "it serves these shapes"
    whys.append(f"{name} cannot serve {why}")
  return "xla", "; ".join(whys)


def _check_implementation(implementation, kv_layout):
  if implementation in (None, "xla"):
    return
  if implementation not in registry.DECODE_KERNELS or kv_layout != "bksh":
    raise ValueError(
        f"decode_attention: implementation must be None, 'xla' or one of "
        f"{sorted(registry.DECODE_KERNELS)} (with kv_layout='bksh'); got "
        f"{implementation!r} with kv_layout={kv_layout!r}")


@dataclasses.dataclass(frozen=True)
class DecodeChoice:
  """What :func:`decode_attention` runs for each device's part: ``kernel``
  (``"xla"`` or a decode kernel's name), ``reason``, and the part's
  ``local_key_shape`` ``(B, K, C / devices, H)``."""

  kernel: str
  reason: str
  local_key_shape: tuple[int, ...]

  def __str__(self):
    return (f"decode_attention runs {self.kernel!r} on each device's part "
            f"(key {self.local_key_shape}, kv-head-major): {self.reason}")


def explain_decode(query_shape, key_shape, value_shape=None, *,
                   kv_layout: KvLayout = "bskh", cp_size: int = 1,
                   implementation: str | None = None,
                   platform: str | None = None) -> DecodeChoice:
  """Which kernel ``decode_attention`` runs for these global shapes (as it
  takes them, in ``kv_layout``; ``value_shape`` default key's) with the
  cache's slots split over ``cp_size`` devices, on ``platform`` (default
  ``jax.default_backend()``, ``"rocm"`` for AMD GPUs), and why. Refuses
  what the call refuses about the layout, the implementation and the
  split, with its ValueError."""
  value_shape = key_shape if value_shape is None else value_shape
  if kv_layout not in _PRODUCTS:
    raise ValueError(f"kv_layout must be 'bskh' or 'bksh'; got {kv_layout!r}")
  for name, shape in (("query", query_shape), ("key", key_shape),
                      ("value", value_shape)):
    if len(shape) != 4:
      raise ValueError(f"explain_decode: {name} must have rank 4; got "
                       f"shape {tuple(shape)}")
  _check_implementation(implementation, kv_layout)
  as_bksh = lambda s: tuple(s) if kv_layout == "bksh" else (
      s[0], s[2], s[1], s[3])
  (b, k, c, h), (_, _, _, hv) = as_bksh(key_shape), as_bksh(value_shape)
  if cp_size < 1 or c % cp_size:
    raise ValueError(f"decode_attention: the cache's slots, key "
                     f"{tuple(key_shape)}, must divide over cp_size "
                     f"{cp_size}")
  local_k, local_v = (b, k, c // cp_size, h), (b, k, c // cp_size, hv)
  if implementation not in (None, "xla"):
    _refuse_unserved(registry.DECODE_KERNELS[implementation],
                     tuple(query_shape), local_k, local_v)
  kernel_, why = _choose(tuple(query_shape), local_k, local_v, kv_layout,
                         implementation, platform or _platform())
  return DecodeChoice(kernel_, why, local_k)


def _xla_gradient(kernel_local, xla_local):
  """``kernel_local``, differentiated as ``xla_local`` (the same function
  of ``q, k, v``; a kernel has no derivative of its own). The positions
  take no cotangent."""

  @jax.custom_vjp
  def local(q, k, v, q_pos, kv_pos):
    return kernel_local(q, k, v, q_pos, kv_pos)

  def forward(q, k, v, q_pos, kv_pos):
    return local(q, k, v, q_pos, kv_pos), (q, k, v, q_pos, kv_pos)

  def backward(res, cotangent):
    q, k, v, q_pos, kv_pos = res
    _, vjp = jax.vjp(lambda q, k, v: xla_local(q, k, v, q_pos, kv_pos),
                     q, k, v)
    return (*vjp(cotangent), None, None)

  local.defvjp(forward, backward)
  return local


def _positions(name, x, shape):
  """``x`` as int32 positions of ``shape``. Values past int32 are refused
  before the cast, which would wrap them: host arrays and device arrays
  alike; a traced 64-bit array (``jax_enable_x64`` under ``jit``) cannot
  be read, so it is refused by its dtype."""
  if not isinstance(x, jax.Array):
    x = np.asarray(x)
  wide = np.issubdtype(x.dtype, np.integer) and np.dtype(x.dtype).itemsize > 4
  if wide and isinstance(x, jax.core.Tracer):
    raise ValueError(f"{name} must be int32 under jit (a traced {x.dtype} "
                     f"array cannot be checked to fit in int32); got "
                     f"{x.dtype} {tuple(x.shape)}")
  if wide and x.size:
    low, high = int(x.min()), int(x.max())
    if low < -2**31 or high >= 2**31:
      raise ValueError(f"{name} must fit in int32; got {low}..{high}")
  x = jnp.asarray(x)
  if x.shape != tuple(shape) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an int array of shape {tuple(shape)}; "
                     f"got {x.dtype} {tuple(x.shape)}")
  return x.astype(jnp.int32)


def _local(q, k, v, q_pos, kv_pos, *, band, scale, cap, layout):
  """This device's part: ``(o (B, T, N, Hv) unnormalised, m, l (B, T,
  N))`` in float32; ``m = MASK_VALUE`` and ``l = 0`` where no slot is
  visible (a NaN in a visible logit makes the row's ``m`` NaN)."""
  b, t, n, h = q.shape
  kh = k.shape[layout.index("k")]
  scores, output = _PRODUCTS[layout]
  s = _product(scores, q.reshape(b, t, kh, n // kh, h), k) * scale
  if cap is not None:
    s = cap * jnp.tanh(s / cap)
  left, right = band
  d = kv_pos[:, None, :] - q_pos[:, :, None]  # (B, T, C)
  vis = kv_pos[:, None, :] >= 0
  if right is not None:
    vis &= d <= right
  if left is not None:
    vis &= d >= -left
  vis = vis[:, None, None]
  s = jnp.where(vis, s, MASK_VALUE)
  m = s.max(-1, initial=MASK_VALUE)  # C = 0: an empty cache
  p = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
  o = _product(output, p.astype(v.dtype), v)
  rows = lambda x: jnp.moveaxis(x, 3, 1).reshape(b, t, n)
  return o.reshape(b, t, n, v.shape[-1]), rows(m), rows(p.sum(-1))


def _product(spec, a, b):
  """``einsum(spec, a, b)`` in float32. XLA:CPU runs no 16-bit batched
  product with a float32 result, so there the operands are widened first;
  elsewhere they are read as they are (the cache's bytes are the step's
  cost)."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  product = lambda x, y: jnp.einsum(spec, x, y, precision=precision,
                                    preferred_element_type=jnp.float32)
  wide = lambda x, y: product(x.astype(jnp.float32), y.astype(jnp.float32))
  return lax.platform_dependent(a, b, cpu=wide, default=product)


def _attend(local, q, k, v, q_pos, kv_pos, sinks, axis_name):
  """The local part, merged over ``axis_name`` (None: one device), then
  normalised and folded with the sinks."""
  o, m, l = local(q, k, v, q_pos, kv_pos)
  if axis_name is not None:
    for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
      validate.mesh_axis(name)
    o, m, l = _merge(o, m, l, axis_name)
  seen = l != 0
  out = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  if sinks is not None:
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASK_VALUE)
    out, _ = kernel.fold_sinks(out, lse, sinks)
  return out.astype(q.dtype)


def _merge(o, m, l, axis_name):
  """Every device's part ``(o, m, l)`` merged over ``axis_name`` by
  logsumexp. Where all devices' parts together are at most
  ``GATHER_BYTES``, one collective: each device's part at its index of a
  zero (D, B, T, N, Hv + 2), summed over the axis, merged on every device
  (decoding's small rows: a collective's wait costs more than its bytes).
  Larger, a max- then a sum-all-reduce of one part's size (a large batch:
  the bytes cost more than a second wait). The result does not depend on
  the shift ``top`` (it cancels), so its gradient is stopped."""
  d = lax.axis_size(axis_name)
  if d * (o.size + 2 * m.size) * 4 > GATHER_BYTES:
    top = lax.pmax(lax.stop_gradient(m), axis_name)
    alpha = jnp.exp(m - top)
    o, l = lax.psum((o * alpha[..., None], l * alpha), axis_name)
    return o, top, l
  hv = o.shape[-1]
  mine = jnp.concatenate([o, m[..., None], l[..., None]], -1)
  parts = jnp.zeros((d,) + mine.shape, mine.dtype)
  parts = lax.psum(lax.dynamic_update_index_in_dim(
      parts, mine, lax.axis_index(axis_name), 0), axis_name)
  o, m, l = parts[..., :hv], parts[..., hv], parts[..., hv + 1]
  top = lax.stop_gradient(m.max(0))
  alpha = jnp.exp(m - top)
  return (o * alpha[..., None]).sum(0), top, (l * alpha).sum(0)


def _context_parallel(local, q, k, v, q_pos, kv_pos, sinks, cp, seq_axis):
  """:func:`_attend` in a ``shard_map`` manual over ``cp.axis`` alone (batch
  and head axes stay as the arrays have them): the cache's slots split
  over it, the queries the same on each of its devices."""
  if not isinstance(cp, ContextParallel):
    raise ValueError(f"context_parallel must be a jax_ring.ContextParallel; "
                     f"got {cp!r}")
  mesh = validate.mesh_axes(cp, q)
  axes = cp.sequence_axes  # a pair (hybrid): its sequence order, ring-major
  size = math.prod(mesh.shape[a] for a in cp.axes)
  if k.shape[seq_axis] % size:
    raise ValueError(
        f"decode_attention: the cache's slots, key {tuple(k.shape)}, must "
        f"divide over the {cp.axis!r} axis of size {size}")
  if size == 1:  # nothing to merge; XLA refuses a reduction over it
    return _attend(local, q, k, v, q_pos, kv_pos, sinks, None)
  cache, whole = P(*(None,) * seq_axis, axes), P()
  specs = (whole, cache, cache, whole, P(None, axes), whole)
  args = (q, k, v, q_pos, kv_pos, sinks)
  if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
    # On Explicit axes shard_map takes arrays typed as its specs say: put
    # each there (host arrays such as the positions included).
    args = tuple(x if x is None else jax.sharding.reshard(
        x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip(args, specs))
  f = jax.shard_map(
      functools.partial(_attend, local, axis_name=axes), mesh=mesh,
      in_specs=specs, out_specs=whole, axis_names=set(cp.axes))
  return f(*args)
