"""The block-kernel contract: two primitives, their custom VJP and dispatch.

Every attention computation, on one device or as one block of a
context-parallel strategy, goes through these two functions:

* :func:`attention` ``(q, k, v, bias, mask, config) -> (out, lse)``
* :func:`attention_backward`
  ``(q, k, v, bias, mask, out, lse, dout, dlse, config) -> (dq, dk, dv, dbias)``

(Strategies, which define their own VJPs, call the variants :func:`forward`,
:func:`backward` and :func:`attention_backward_dkv`, which returns dK/dV
stacked; these take a block's mask with what its backend computed ahead,
:func:`prepare`, which the public two refuse.)

Shapes: ``q (B, T, N, H)``, ``k (B, S, K, H)``, ``v (B, S, K, Hv)`` with
``N % K == 0`` (Hv, the value head dim, may differ from H: multi-head
latent attention), ``bias (B|1, N|1, T, S)`` or None, ``out (B, T, N, Hv)``
in q's dtype, ``lse (B, T, N)`` float32. ``mask`` is a ``core.mask.BlockMask``;
``config`` a ``core.config.AttentionConfig`` whose
``implementation`` is already resolved.

``lse`` is the natural-log logsumexp of the scaled, capped, biased and masked
logits; a fully masked row has ``out = 0`` and ``lse = MASK_VALUE`` (-1e30,
finite: see ``core/mask.py``). The backward takes *any* ``out``/``lse``, in
particular the global ones of a ring after merging, and an optional
cotangent of ``lse`` (None = zero), so ``lse`` is differentiable too.

Each function binds a ``jax.extend.core.Primitive`` whose operands are
``q, k, v, [bias], *mask_arrays`` (the mask pytree is flattened; its treedef
and any offsets given as Python ints are static params). Lowerings are per
platform: the pure-JAX backend everywhere, and on CUDA the backend that
``config.implementation`` names (cuDNN once built; see ``core/registry.py``).
Batching folds a vmapped axis into B when the offsets are unbatched, and
otherwise maps the primitive over it. The contract in full: docs/design.md,
"The block-kernel contract".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_ring._src.core import registry, vma
from jax_ring._src.core.config import AttentionConfig
from jax_ring._src.core.mask import BlockMask


_fwd_p = Primitive("jax_ring_attention_fwd")
_fwd_p.multiple_results = True
_bwd_p = Primitive("jax_ring_attention_bwd")
_bwd_p.multiple_results = True


# --- operand packing -------------------------------------------------------

def _pack(bias, mask, *extra):
  """Operands ``[bias], *extra, *mask_arrays`` and the mask's static params.

  Offsets given as Python ints stay static (``mask_static``), so that a
  backend that needs a compile-time diagonal (cuDNN) can see them; traced
  offsets and every array travel as operands.
  """
  leaves, tree = jax.tree.flatten(mask.as_operands())
  static = tuple((i, x) for i, x in enumerate(leaves) if isinstance(x, int))
  arrays = [x for x in leaves if not isinstance(x, int)]
  head = [] if bias is None else [bias]
  operands = head + [x for x in extra if x is not None] + arrays
  return operands, dict(mask_tree=tree, mask_static=static)


def _unpack_mask(arrays, mask_tree, mask_static):
  leaves = list(arrays)
  for i, x in mask_static:  # ascending i: each insert lands at its index
    leaves.insert(i, x)
  return jax.tree.unflatten(mask_tree, leaves)


def _unpack_fwd(args, mask_tree, mask_static, has_bias):
  q, k, v, *rest = args
  bias = rest.pop(0) if has_bias else None
  return q, k, v, bias, _unpack_mask(rest, mask_tree, mask_static)


def _unpack_bwd(args, mask_tree, mask_static, has_bias, has_dlse):
  q, k, v, *rest = args
  bias = rest.pop(0) if has_bias else None
  out, lse, dout = rest[:3]
  rest = rest[3:]
  dlse = rest.pop(0) if has_dlse else None
  mask = _unpack_mask(rest, mask_tree, mask_static)
  return q, k, v, bias, out, lse, dout, dlse, mask


# --- primitive rules --------------------------------------------------------

def _fwd_impl(*args, config, mask_tree, mask_static, has_bias, backend=None):
  q, k, v, bias, mask = _unpack_fwd(args, mask_tree, mask_static, has_bias)
  return (backend or registry.get(None)).forward(q, k, v, bias, mask,
                                                 config)


def _bwd_impl(*args, config, mask_tree, mask_static, has_bias, has_dlse,
              stack_dkv, backend=None):
  q, k, v, bias, out, lse, dout, dlse, mask = _unpack_bwd(
      args, mask_tree, mask_static, has_bias, has_dlse)
  backend = backend or registry.get(None)
  call = (q, k, v, bias, mask, out, lse, dout, dlse, config)
  if stack_dkv:
    dq, dkv, dbias = backend.backward_stacked(*call)
    grads = (dq, dkv)
  else:
    dq, dk, dv, dbias = backend.backward(*call)
    grads = (dq, dk, dv)
  return grads + (() if dbias is None else (dbias,))


def _platform_lowering(impl, platform):
  """Lower with the configured backend if it lowers on ``platform``
  (``None``: the default rule, for backends that lower everywhere)."""

  def rule(ctx, *args, config, **params):
    backend = registry.for_platform(config.implementation, platform)
    fn = functools.partial(impl, config=config, backend=backend, **params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

  return rule


# Output types copy the input avals (`update`), which keeps their sharding and
# the manual axes they vary over inside shard_map; `vma.match` has made
# those equal across operands before binding.
def _fwd_abstract(*args, config, mask_tree, mask_static, has_bias):
  del config, mask_tree, mask_static, has_bias
  q, v = args[0], args[2]
  return (q.update(shape=q.shape[:3] + v.shape[3:]),
          q.update(shape=q.shape[:3], dtype=jnp.float32))


def _bwd_abstract(*args, config, mask_tree, mask_static, has_bias, has_dlse,
                  stack_dkv):
  del config, mask_tree, mask_static, has_dlse
  q, k = args[:2]
  dkv = (k.update(shape=(2,) + k.shape),) if stack_dkv else (
      k.update(), args[2].update())
  return (q.update(),) + dkv + ((args[3].update(),) if has_bias else ())


for _p, _impl, _abstract, _static in (
    (_fwd_p, _fwd_impl, _fwd_abstract,
     ("config", "mask_tree", "mask_static", "has_bias")),
    (_bwd_p, _bwd_impl, _bwd_abstract,
     ("config", "mask_tree", "mask_static", "has_bias", "has_dlse",
      "stack_dkv"))):
  _p.def_impl(jax.jit(_impl, static_argnames=_static))
  _p.def_abstract_eval(_abstract)
  # Every platform: a backend registered for all of them (platform None),
  # else xla; on CUDA, also the CUDA backends (cuDNN).
  mlir.register_lowering(_p, _platform_lowering(_impl, None))
  mlir.register_lowering(_p, _platform_lowering(_impl, "cuda"),
                         platform="cuda")


def _batch_rule(prim, leading, args, dims, **params):
  """Fold the vmapped axis into B, or map over it if an offset is batched.

  ``leading[i]`` is what operand i's axis 0 is: "B" (batch), "B|1" (batch
  or a broadcast 1: bias, dense mask) or "scalar" (offsets).
  """
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  if any(kind == "scalar" and d is not None
         for kind, d in zip(leading, dims)):
    batched = [d is not None for d in dims]

    def one(xs):
      it = iter(xs)
      return prim.bind(*[next(it) if bt else a
                         for a, bt in zip(args, batched)], **params)
    outs = lax.map(one, [a for a, bt in zip(args, batched) if bt])
    return outs, [0] * len(outs)

  b = args[0].shape[1] if dims[0] is not None else args[0].shape[0]
  folded = []
  for a, d, kind in zip(args, dims, leading):
    if kind == "scalar" or (d is None and kind == "B|1" and a.shape[0] == 1):
      folded.append(a)  # shared by every vmapped instance
      continue
    if d is None:
      a = jnp.broadcast_to(a[None], (size,) + a.shape)
    a = jnp.broadcast_to(a, (size, b) + a.shape[2:])
    folded.append(a.reshape((size * b,) + a.shape[2:]))
  outs = prim.bind(*folded, **params)
  return [o.reshape((size, -1) + o.shape[1:]) for o in outs], [0] * len(outs)


def _leading_kinds(params, num_args, extra):
  kinds = ["B", "B", "B"] + (["B|1"] if params["has_bias"] else []) + extra
  tree = params["mask_tree"]
  static = {i for i, _ in params["mask_static"]}
  probe = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
  by_field = {
      getattr(probe, f): k for f, k in (
          ("q_offset", "scalar"), ("kv_offset", "scalar"),
          ("q_segment_ids", "B"), ("kv_segment_ids", "B"),
          ("q_lengths", "B"), ("kv_lengths", "B"), ("dense", "B|1"))
      if getattr(probe, f) is not None}
  kinds += [by_field[i] for i in range(tree.num_leaves) if i not in static]
  assert len(kinds) == num_args
  return kinds


def _unprepared(args, dims, params):
  """The operands, dims and params without the mask's ``prepared`` leaves
  (the mask's last, so the operands' last): a batched call computes its
  own."""
  tree = params["mask_tree"]
  probe = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
  drop = len(jax.tree.leaves(probe.prepared))
  if not drop:
    return args, dims, params
  tree = jax.tree.structure(dataclasses.replace(probe, prepared=None))
  return args[:-drop], dims[:-drop], dict(params, mask_tree=tree)


def _fwd_batch(args, dims, **params):
  args, dims, params = _unprepared(args, dims, params)
  kinds = _leading_kinds(params, len(args), [])
  return _batch_rule(_fwd_p, kinds, args, dims, **params)


def _bwd_batch(args, dims, **params):
  # The bias gradient is per vmapped instance, so a shared bias cannot stay
  # shared here: give it a full batch and reduce dbias back afterwards.
  args, dims, params = _unprepared(args, dims, params)
  extra = ["B", "B", "B"] + (["B"] if params["has_dlse"] else [])
  kinds = _leading_kinds(params, len(args), extra)
  bias_b = None
  if params["has_bias"]:
    bias, d = args[3], dims[3]
    bias_b = bias.shape[0] if d is None else jnp.moveaxis(bias, d, 0).shape[1]
    kinds[3] = "B"
  # Under vmap the stacked dK/dV come from separate ones (the batch rule
  # folds the vmapped axis into B, the stacked buffer's axis 1).
  stack = params.pop("stack_dkv")
  outs, out_dims = _batch_rule(_bwd_p, kinds, args, dims, stack_dkv=False,
                               **params)
  outs = list(outs)
  if bias_b == 1:
    outs[3] = outs[3].sum(1, keepdims=True)
  if stack:
    outs[1:3] = [jnp.stack(outs[1:3], 1)]
  return outs, out_dims[:len(outs)]


batching.primitive_batchers[_fwd_p] = _fwd_batch
batching.primitive_batchers[_bwd_p] = _bwd_batch


# --- the contract -----------------------------------------------------------

def forward(q, k, v, bias, mask: BlockMask, config: AttentionConfig):
  """Block forward ``(out, lse)`` without a VJP of its own: for callers that
  define theirs (every strategy does). Unlike :func:`attention` it binds no
  custom VJP, so it also runs in an eager ``shard_map``."""
  return _forward(q, k, v, bias, mask, config)


def _forward(q, k, v, bias, mask, config):
  args, params = _pack(bias, mask)
  operands = vma.match(q, k, v, *args)
  return tuple(_fwd_p.bind(*operands, config=config,
                           has_bias=bias is not None, **params))


def prepare(q, k, v, mask: BlockMask, config: AttentionConfig, lse=None):
  """What ``config``'s backend computes ahead of this block's call
  (``registry.Backend.prepare``; ``lse (B, T, N)`` given: the
  backward's), for the call's ``mask.prepared``; None where it has
  nothing. For a caller that branches before the block: computed before
  the branch, it is not launched after the branch's wait for the
  device."""
  fn = registry.get(config.implementation).prepare
  return None if fn is None else fn(q, k, v, mask, config, lse)


def _refuse_prepared(mask: BlockMask, name: str) -> None:
  """A mask given to the public contract carries no ``prepared``: only a
  strategy, which computed it from the same block (:func:`prepare`),
  may give one, to :func:`forward` and :func:`backward`."""
  if mask.prepared is not None:
    raise ValueError(f"{name}: mask.prepared must be None (the library "
                     "fills it for its own blocks); got "
                     f"{type(mask.prepared).__name__}")


def attention_backward(q, k, v, bias, mask: BlockMask, out, lse, dout, dlse,
                       config: AttentionConfig):
  """Block backward from given out/lse: ``(dq, dk, dv, dbias or None)``."""
  _refuse_prepared(mask, "attention_backward")
  return backward(q, k, v, bias, mask, out, lse, dout, dlse, config)


def backward(q, k, v, bias, mask: BlockMask, out, lse, dout, dlse,
             config: AttentionConfig):
  """:func:`attention_backward` for strategies: ``mask`` may carry what
  the backend prepared for this block (:func:`prepare`)."""
  grads = _bind_bwd(q, k, v, bias, mask, out, lse, dout, dlse, config, False)
  return tuple(grads) + ((None,) if bias is None else ())


def attention_backward_dkv(q, k, v, bias, mask: BlockMask, out, lse, dout,
                           dlse, config: AttentionConfig):
  """As :func:`attention_backward`, with dK/dV in the layout the ring sends
  K/V in (``strategies.kv``): ``(dq, dkv, dbias or None)``, ``dkv`` stacked
  ``(2, B, S, K, H)`` when K and V have one shape (a backend that can
  writes them there: cuDNN; the others are stacked after), else the pair
  ``(dk, dv)``."""
  if k.shape != v.shape:
    dq, dk, dv, dbias = backward(q, k, v, bias, mask, out, lse, dout, dlse,
                                 config)
    return dq, (dk, dv), dbias
  grads = _bind_bwd(q, k, v, bias, mask, out, lse, dout, dlse, config, True)
  return tuple(grads) + ((None,) if bias is None else ())


def _bind_bwd(q, k, v, bias, mask, out, lse, dout, dlse, config, stack_dkv):
  args, params = _pack(bias, mask, out, lse, dout, dlse)
  return _bwd_p.bind(*vma.match(q, k, v, *args), config=config,
                     has_bias=bias is not None, has_dlse=dlse is not None,
                     stack_dkv=stack_dkv, **params)


def attention(q, k, v, bias, mask: BlockMask, config: AttentionConfig,
              sinks=None):
  """Block forward: ``(out, lse)``. Differentiable in q, k, v, bias, lse
  and ``sinks``: ``(N,)`` logits that join every row's softmax with no
  value (:func:`fold_sinks`), or None."""
  _refuse_prepared(mask, "attention")
  # Python-int offsets bypass the custom VJP's pytree: it would turn them
  # into traced arrays, and cuDNN needs them static.
  static = tuple((f, int(getattr(mask, f))) for f in ("q_offset", "kv_offset")
                 if isinstance(getattr(mask, f), (int, np.integer)))
  mask = dataclasses.replace(mask, **{f: None for f, _ in static})
  if mask.same_ids:
    # One id array for both sides stays one through the pytree flattening
    # below, as the static fact "same ids" (kv ids None).
    mask = dataclasses.replace(mask, kv_segment_ids=None)
  return _attention(q, k, v, bias, mask, sinks, static, config)


def fold_sinks(out, lse, sinks):
  """``(out', lse')``: the attention of ``(out (B, T, N, H), lse (B, T,
  N))`` with one more logit per head, ``sinks (N,)``, that has no value:
  ``lse' = logaddexp(lse, s)``, ``out' = out exp(lse - lse')``. A fully
  masked row (``lse = MASK_VALUE``) gives ``lse' = s`` and ``out' = 0``; a
  sink of +inf gives NaN rows, a NaN sink NaN rows.

  Given ``out'`` and ``lse'``, the block backward is already exact for the
  keys (``p = exp(z - lse')``, ``delta = rowsum(dout out') - dlse``); the
  sink's own gradient is :func:`sinks_grad`."""
  s = sinks.astype(jnp.float32)
  # A sink of +inf is an infinite logit: its rows are NaN, as jax.nn's
  # softmax makes a row with one (logaddexp would give them zeros).
  folded = jnp.where(jnp.isposinf(s), jnp.nan, jnp.logaddexp(lse, s))
  scale = jnp.exp(lse - folded)[..., None]
  return (out.astype(jnp.float32) * scale).astype(out.dtype), folded


def sinks_grad(sinks, out, lse, dout, dlse):
  """``d sinks (N,)`` float32, from the folded ``out``/``lse`` and their
  cotangents: ``sum over rows of exp(s - lse) (dlse - rowsum(dout out))``.
  Summed over the rows given: a strategy adds the devices' sums."""
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  weight = jnp.exp(sinks.astype(jnp.float32) - lse)
  return -jnp.sum(weight * delta, axis=tuple(range(lse.ndim - 1)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, bias, mask, sinks, static, config):
  out, lse = _forward(q, k, v, bias, dataclasses.replace(mask, **dict(static)),
                      config)
  return (out, lse) if sinks is None else fold_sinks(out, lse, sinks)


def _attention_fwd(q, k, v, bias, mask, sinks, static, config):
  q, k, v, bias, mask, sinks = jax.tree.map(
      lambda p: p.value, (q, k, v, bias, mask, sinks),
      is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
  out, lse = _forward(q, k, v, bias, dataclasses.replace(mask, **dict(static)),
                      config)
  if sinks is not None:
    out, lse = fold_sinks(out, lse, sinks)
  return (out, lse), (q, k, v, bias, mask, sinks, out, lse)


def _attention_bwd(static, config, res, cts):
  q, k, v, bias, mask, sinks, out, lse = res
  mask = dataclasses.replace(mask, **dict(static))
  dout, dlse = cts
  if isinstance(dout, SymbolicZero):
    dout = jnp.zeros_like(out)
  if isinstance(dlse, SymbolicZero):
    dlse = None
  dq, dk, dv, dbias = backward(q, k, v, bias, mask, out, lse, dout, dlse,
                               config)
  dsinks = None if sinks is None else sinks_grad(
      sinks, out, lse, dout, dlse).astype(sinks.dtype)
  return dq, dk, dv, dbias, None, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
