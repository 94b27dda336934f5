"""The automatic path: ring attention under ``jax.jit`` on sharded arrays.

``dot_product_attention(..., context_parallel=ContextParallel(axis="cp"))``
binds two ``custom_partitioning`` functions, the ring's forward and its
backward, tied by a custom VJP. Their partition rules run the ring of
``ring.py`` on each shard: the sequence dimension sharded over the context
axis, the batch over whatever axes it already has (data, fsdp), the heads
over theirs (tensor), head_dim never. A Shardy sharding rule names the
factors for propagation; ``infer_sharding_from_operands`` serves GSPMD.

==========  =========================  ==========================
operand     shape                      sharding on each shard
==========  =========================  ==========================
q, out      (B, S, N, H)               (batch, cp, heads, -)
k, v        (B, S, K, H)               (batch, cp, heads, -)
lse         (B, S, N)                  (batch, cp, heads)
seg ids     (B, S)                     (batch, cp)
==========  =========================  ==========================
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ring._src import kernel, ring, validate
from jax_ring._src.config import ContextParallel


def _axes(mesh, q_shape, cpc: ContextParallel):
  """(batch axes, head axes) of q's sharding, and the ring config. The mesh
  size is first known here, so the sequence-length checks are made here."""
  cp = mesh.shape[cpc.axis]
  seq = q_shape.shape[1]
  if seq % cp:
    raise ValueError(f"context_parallel: sequence length {seq} of query "
                     f"{tuple(q_shape.shape)} must be divisible by the "
                     f"{cpc.axis!r} axis size {cp}")
  validate.ring_options(cpc.load_balance, cpc.loop, seq // cp, cp)
  sharding = q_shape.sharding
  spec = tuple(sharding.spec) + (None,) * 4 if sharding is not None else ()
  batch, heads = (spec[0], spec[2]) if spec else (None, None)
  return batch, heads, ring.RingConfig(cpc.axis, cp, cpc.load_balance,
                                       cpc.loop)


def _shardings(mesh, batch, heads, cp_axis):
  """Shardings of the token arrays, the lse and the segment ids."""
  tok = NamedSharding(mesh, P(batch, cp_axis, heads, None))
  stat = NamedSharding(mesh, P(batch, cp_axis, heads))
  seq = NamedSharding(mesh, P(batch, cp_axis))
  return tok, stat, seq


@functools.lru_cache(maxsize=None)
def _functions(has_seg: bool):
  """The (forward, backward) custom_partitioning pair for one arity."""
  seg_rule = ", b s, b s" if has_seg else ""

  def split(args):
    n = 2 if has_seg else 0
    body, seg = args[:len(args) - n], args[len(args) - n:]
    return body, (tuple(seg) if has_seg else (None, None))

  # -- forward: (q, k, v[, q_seg, kv_seg]) -> (out, lse)
  @functools.partial(custom_partitioning, static_argnums=(0, 1))
  def fwd(cfgs, cpc, *args):
    (q, k, v), seg = split(args)
    # Unpartitioned (one device): the ring of one, i.e. plain attention.
    return kernel.attention(q, k, v, None, ring._mask(*seg), cfgs[0])

  def fwd_partition(cfgs, cpc, mesh, arg_shapes, result_shape):
    batch, heads, rc = _axes(mesh, arg_shapes[0], cpc)
    tok, stat, seq = _shardings(mesh, batch, heads, cpc.axis)
    arg_sh = (tok, tok, tok) + ((seq, seq) if has_seg else ())

    def lowered(*args):
      (q, k, v), seg = split(args)
      return ring._forward(q, k, v, seg, cfgs, rc)

    return mesh, lowered, (tok, stat), arg_sh

  def fwd_infer(cfgs, cpc, mesh, arg_shapes, result_shape):
    batch, heads, _ = _axes(mesh, arg_shapes[0], cpc)
    tok, stat, _ = _shardings(mesh, batch, heads, cpc.axis)
    return tok, stat

  fwd.def_partition(
      partition=fwd_partition, infer_sharding_from_operands=fwd_infer,
      sharding_rule=f"b s n h, b s k h, b s k h{seg_rule} -> b s n h, b s n")

  # -- backward: (q, k, v, out, lse, dout[, q_seg, kv_seg]) -> (dq, dk, dv)
  @functools.partial(custom_partitioning, static_argnums=(0, 1))
  def bwd(cfgs, cpc, *args):
    (q, k, v, out, lse, dout), seg = split(args)
    return kernel.attention_backward(q, k, v, None, ring._mask(*seg), out,
                                     lse, dout, None, cfgs[0])[:3]

  def bwd_partition(cfgs, cpc, mesh, arg_shapes, result_shape):
    batch, heads, rc = _axes(mesh, arg_shapes[0], cpc)
    tok, stat, seq = _shardings(mesh, batch, heads, cpc.axis)
    arg_sh = (tok, tok, tok, tok, stat, tok) + ((seq, seq) if has_seg else ())

    def lowered(*args):
      (q, k, v, out, lse, dout), seg = split(args)
      return ring._backward(q, k, v, seg, out, lse, dout, cfgs, rc)

    return mesh, lowered, (tok, tok, tok), arg_sh

  def bwd_infer(cfgs, cpc, mesh, arg_shapes, result_shape):
    batch, heads, _ = _axes(mesh, arg_shapes[0], cpc)
    tok, _, _ = _shardings(mesh, batch, heads, cpc.axis)
    return tok, tok, tok

  bwd.def_partition(
      partition=bwd_partition, infer_sharding_from_operands=bwd_infer,
      sharding_rule=("b s n h, b s k h, b s k h, b s n h, b s n, b s n h"
                     f"{seg_rule} -> b s n h, b s k h, b s k h"))
  return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(q, k, v, seg, cfgs, cpc: ContextParallel):
  """Context-parallel attention of global arrays; ``seg`` is (q ids, kv ids)
  or (None, None). Returns ``out``."""
  return _fwd(q, k, v, seg, cfgs, cpc)[0][0]


def _fwd(q, k, v, seg, cfgs, cpc):
  has_seg = seg[0] is not None
  fwd, _ = _functions(has_seg)
  out, lse = fwd(cfgs, cpc, q, k, v, *(seg if has_seg else ()))
  return (out, lse), (q, k, v, seg, out, lse)


def _bwd(cfgs, cpc, res, dout):
  q, k, v, seg, out, lse = res
  has_seg = seg[0] is not None
  _, bwd = _functions(has_seg)
  dq, dk, dv = bwd(cfgs, cpc, q, k, v, out, lse, dout.astype(q.dtype),
                   *(seg if has_seg else ()))
  return dq, dk, dv, (None, None)


def _attention_fwd(q, k, v, seg, cfgs, cpc):
  (out, _), res = _fwd(q, k, v, seg, cfgs, cpc)
  return out, res


attention.defvjp(_attention_fwd, _bwd)
