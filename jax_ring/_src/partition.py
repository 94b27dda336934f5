"""The automatic path: context parallelism under ``jax.jit`` on sharded arrays.

``dot_product_attention(..., context_parallel=ContextParallel(axis="cp"))``
binds :func:`attention`: a custom VJP over two ``custom_partitioning``
functions, a strategy's forward ``(q, k, v, *mask) -> (out, lse)`` and its
backward ``(q, k, v, out, lse, dout, *mask) -> (dq, dk, dv)``. Their
partition rules run where the mesh is first known: they decide ``auto``
for their own pass, check what needs the mesh's sizes, and run the strategy
(ring, all-gather, Ulysses, hybrid) on each shard, with the sequence
dimension sharded over the context axis (or axes), the batch over whatever
axes it already has (data, fsdp), the heads over theirs (tensor), head_dim
never. The block backend is chosen here too, on the shards' shapes. A
Shardy sharding rule names the factors for propagation;
``infer_sharding_from_operands`` serves GSPMD.

The mask operands are the fields of a ``TokenMask`` that are present; which
ones are present is part of the cache key of the partitioned functions.
The table of operand shardings, and why the backward gathers K/V:
docs/design.md, "Partitioning under jax.jit".
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ring._src import auto
from jax_ring._src.core import kernel, validate
from jax_ring._src.core.config import ContextParallel
from jax_ring._src.core.mask import TokenMask
from jax_ring._src.strategies import STRATEGIES, base


_FIELDS = tuple(f.name for f in dataclasses.fields(TokenMask))
_LENGTHS = frozenset({"q_lengths", "kv_lengths"})


def _axes(mesh, arg_shapes, cpc: ContextParallel, cfg, backward: bool,
          present: tuple[str, ...]):
  """(batch axes, head axes, sequence axes) of q's sharding, the strategy
  and its plan, for the forward pass or the backward one (``present``: the
  mask operands given, segment ids among them). The mesh is first
  known here, so the shape checks that need its sizes, and the ``auto``
  choice (made per pass), are made here."""
  q_shape, k_shape = arg_shapes[0], arg_shapes[1]
  b, _, n, _ = q_shape.shape
  k = k_shape.shape[2]
  # A replicated operand may come as a GSPMDSharding, which has no spec.
  spec = tuple(getattr(q_shape.sharding, "spec", ())) + (None,) * 4
  names = lambda axes: set(axes if isinstance(axes, tuple) else (axes,))
  size = lambda axes: math.prod(mesh.shape[a] for a in names(axes) if a)
  # Batch and heads keep their axes where those split them evenly (and, for
  # Ulysses, leave whole heads per device); otherwise they are gathered.
  free = lambda axes: not set(cpc.axes) & names(axes)
  batch = spec[0] if b % size(spec[0]) == 0 and free(spec[0]) else None
  heads = spec[2] if (n % size(spec[2]) == 0 and k % size(spec[2]) == 0 and
                      free(spec[2])) else None
  u = mesh.shape[cpc.ulysses_axis]
  if cpc.strategy != "ring" and (n // size(heads)) % u and n % u == 0:
    heads = None
  tp = size(heads)
  local_heads = n // tp
  asked = cpc
  cpc = auto.resolve(cpc, mesh, q_shape.shape, local_heads,
                     kv_heads=max(1, k // tp), kv_seq=k_shape.shape[1],
                     value_head_dim=arg_shapes[2].shape[3],
                     backward=backward, is_causal=cfg.is_causal,
                     window=cfg.local_window,
                     packed="q_segment_ids" in present)
  validate.cp_shapes(cpc, mesh.shape, q_shape.shape, k_shape.shape,
                     local_heads)
  beyond = None
  if auto.ring_first(asked, cpc, packed="q_segment_ids" in present,
                     window=cfg.local_window,
                     same_length=q_shape.shape[1] == k_shape.shape[1]):
    cpc, beyond = dataclasses.replace(cpc, strategy="ring"), "ulysses"
  strategy = STRATEGIES[cpc.strategy]
  # The ring's backward is lowered apart from its forward, so its K/V sends
  # cannot merge with the forward's (as they do inside one shard_map
  # program): it gathers K/V once instead, up to the ring's size cap.
  plan = strategy.plan(cpc, mesh.shape, "gather" if backward else "ring")
  if beyond:
    plan = dataclasses.replace(plan, beyond=beyond)
  return batch, heads, cpc.sequence_axes, strategy, plan


def _shardings(mesh, batch, heads, cp_axis, present):
  """Shardings of the token arrays, the lse and the mask operands;
  ``cp_axis`` is the sequence's axis, or axes (major first)."""
  tok = NamedSharding(mesh, P(batch, cp_axis, heads, None))
  stat = NamedSharding(mesh, P(batch, cp_axis, heads))
  masks = tuple(NamedSharding(mesh, P(batch) if f in _LENGTHS else
                              P(batch, cp_axis)) for f in present)
  return tok, stat, masks


def _pack(tm: TokenMask):
  """(names of the present fields, their arrays)."""
  present = tuple(f for f in _FIELDS if getattr(tm, f) is not None)
  return present, tuple(getattr(tm, f) for f in present)


@functools.lru_cache(maxsize=None)
def _functions(present: tuple[str, ...]):
  """The (forward, backward) custom_partitioning pair for one set of mask
  operands."""
  # Factors: t the query sequence, s the key sequence (T != S: Ulysses); h
  # the query/key head dim, d the value's (and the output's).
  rule = "".join(", b" if f in _LENGTHS else ", b t" if f == "q_segment_ids"
                 else ", b s" for f in present)
  n = len(present)

  def split(args):
    body, rest = args[:len(args) - n], args[len(args) - n:]
    return body, TokenMask(**dict(zip(present, rest)))

  def local(cfg, q, k, v, tm: TokenMask):
    """``cfg`` with the backend resolved on these arrays: the shards in a
    partition rule (a backend's limits are per call), else the whole."""
    return base.resolve(cfg.implementation, cfg, q, k, v, tm)

  # -- forward: (q, k, v, *mask operands) -> (out, lse)
  @functools.partial(custom_partitioning, static_argnums=(0, 1, 2))
  def fwd(cfg, cpc, scope, *args):
    (q, k, v), tm = split(args)
    return kernel.forward(q, k, v, None, tm.block_mask(),
                          local(cfg, q, k, v, tm))

  def fwd_partition(cfg, cpc, scope, mesh, arg_shapes, result_shape):
    mesh = _concrete(mesh, scope, arg_shapes)
    batch, heads, seq, strategy, plan = _axes(mesh, arg_shapes, cpc, cfg,
                                              False, present)
    tok, stat, masks = _shardings(mesh, batch, heads, seq, present)

    def lowered(*args):
      (q, k, v), tm = split(args)
      return strategy.forward(q, k, v, tm, local(cfg, q, k, v, tm), plan)

    return mesh, _on_auto(mesh, lowered), (tok, stat), (tok, tok, tok) + masks

  def fwd_infer(cfg, cpc, scope, mesh, arg_shapes, result_shape):
    mesh = _concrete(mesh, scope, arg_shapes)
    batch, heads, seq, _, _ = _axes(mesh, arg_shapes, cpc, cfg, False, present)
    tok, stat, _ = _shardings(mesh, batch, heads, seq, present)
    return tok, stat

  fwd.def_partition(
      partition=fwd_partition, infer_sharding_from_operands=fwd_infer,
      sharding_rule=f"b t n h, b s k h, b s k d{rule} -> b t n d, b t n")

  # -- backward: (q, k, v, out, lse, dout, *mask operands) -> (dq, dk, dv)
  @functools.partial(custom_partitioning, static_argnums=(0, 1, 2))
  def bwd(cfg, cpc, scope, *args):
    (q, k, v, out, lse, dout), tm = split(args)
    return kernel.backward(q, k, v, None, tm.block_mask(), out, lse, dout,
                           None, local(cfg, q, k, v, tm))[:3]

  def bwd_partition(cfg, cpc, scope, mesh, arg_shapes, result_shape):
    mesh = _concrete(mesh, scope, arg_shapes)
    batch, heads, seq, strategy, plan = _axes(mesh, arg_shapes, cpc, cfg,
                                              True, present)
    tok, stat, masks = _shardings(mesh, batch, heads, seq, present)

    def lowered(*args):
      (q, k, v, out, lse, dout), tm = split(args)
      return strategy.backward(q, k, v, tm, out, lse, dout,
                                local(cfg, q, k, v, tm), plan)

    return (mesh, _on_auto(mesh, lowered), (tok, tok, tok),
            (tok, tok, tok, tok, stat, tok) + masks)

  def bwd_infer(cfg, cpc, scope, mesh, arg_shapes, result_shape):
    mesh = _concrete(mesh, scope, arg_shapes)
    batch, heads, seq, _, _ = _axes(mesh, arg_shapes, cpc, cfg, True, present)
    tok, _, _ = _shardings(mesh, batch, heads, seq, present)
    return tok, tok, tok

  bwd.def_partition(
      partition=bwd_partition, infer_sharding_from_operands=bwd_infer,
      sharding_rule=("b t n h, b s k h, b s k d, b t n d, b t n, b t n d"
                     f"{rule} -> b t n h, b s k h, b s k d"))
  return fwd, bwd


def _folding(fn):
  """``fn`` (arrays whose dim 0 is the batch B -> a tuple of such arrays)
  with a batching rule: under ``jax.vmap`` the mapped axis folds into B, so
  V mapped calls are one call of V x B rows (the partitioned functions have
  no batching rule of their own). Operands the map leaves out are
  broadcast along it. Nested maps fold one after another."""
  folded = jax.custom_batching.custom_vmap(fn)

  @folded.def_vmap
  def rule(axis_size, in_batched, *args):
    args = [a if mapped else jax.numpy.broadcast_to(a, (axis_size,) + a.shape)
            for a, mapped in zip(args, in_batched)]
    b = args[0].shape[1]  # every operand's and result's batch
    outs = folded(*(a.reshape((axis_size * b,) + a.shape[2:]) for a in args))
    outs = tuple(o.reshape((axis_size, b) + o.shape[1:]) for o in outs)
    return outs, (True,) * len(outs)

  return folded


def _concrete(mesh, scope, arg_shapes):
  """The mesh a partition rule runs on: XLA's, or, where XLA passes an
  empty one, ``scope`` (the abstract mesh in scope at trace time) on the
  program's devices. XLA does so when nothing in the program is placed on
  a mesh: arrays made outside ``jax.set_mesh``, called under it. The
  operands' shardings then list the program's devices in mesh order."""
  if not mesh.empty:
    return mesh
  devices = getattr(arg_shapes[0].sharding, "_device_assignment", None)
  if scope.empty or devices is None or len(devices) != scope.size:
    raise ValueError(
        "context_parallel: the call's arrays are on no mesh; place q, k, v "
        "with a NamedSharding, or call it under jax.set_mesh(mesh)")
  return jax.sharding.Mesh(np.array(devices).reshape(scope.axis_sizes),
                           scope.axis_names, axis_types=scope.axis_types)


def _on_auto(mesh, body):
  """A rule's ``body``, traced on ``mesh``'s axes all Auto. On Explicit
  axes (the caller's ``jax.set_mesh``, still in effect while XLA runs the
  rule) each op of the body would carry a sharding of its own, which jax
  0.11's XLA keeps inside the partitioned body as custom calls that no
  CPU implements."""
  auto = jax.sharding.AxisType.Auto
  on_auto = mesh.abstract_mesh.update_axis_types(
      {name: auto for name in mesh.axis_names})

  def traced(*args):
    with jax.sharding.use_abstract_mesh(on_auto):
      return body(*args)

  return traced


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def attention(q, k, v, tm: TokenMask, sinks, cfg, cpc: ContextParallel):
  """Context-parallel attention of global arrays. Returns ``out``. The
  ``sinks`` (or None) fold into the merged global ``(out, lse)``, outside
  the partitioned calls: XLA reduces the sinks' gradient over the shards."""
  return forward(q, k, v, tm, sinks, cfg, cpc)[0]


def forward(q, k, v, tm, sinks, cfg, cpc):
  """``(out, residuals)``; the residuals' last entry is the global lse."""
  present, ops = _pack(tm)
  fwd, _ = _functions(present)
  scope = jax.sharding.get_abstract_mesh()
  out, lse = _folding(functools.partial(fwd, cfg, cpc, scope))(q, k, v, *ops)
  if sinks is not None:
    out, lse = kernel.fold_sinks(out, lse, sinks)
  return out, (q, k, v, tm, sinks, out, lse)


def backward(cfg, cpc, res, dout):
  """``(dq, dk, dv, None for the token mask, dsinks)`` from
  :func:`forward`'s residuals."""
  q, k, v, tm, sinks, out, lse = res
  present, ops = _pack(tm)
  _, bwd = _functions(present)
  dout = dout.astype(q.dtype)
  scope = jax.sharding.get_abstract_mesh()
  dq, dk, dv = _folding(functools.partial(bwd, cfg, cpc, scope))(
      q, k, v, out, lse, dout, *ops)
  dsinks = None if sinks is None else kernel.sinks_grad(
      sinks, out, lse, dout, None).astype(sinks.dtype)
  return dq, dk, dv, jax.tree.map(lambda _: None, tm), dsinks


attention.defvjp(forward, backward)
