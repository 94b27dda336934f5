"""``dot_product_attention``: a drop-in superset of
``jax.nn.dot_product_attention``, on one device or context-parallel."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ring._src import partition
from jax_ring._src.core import kernel, registry, validate
from jax_ring._src.core.config import AttentionConfig, ContextParallel
from jax_ring._src.core.mask import MASK_VALUE, BlockMask, TokenMask
from jax_ring._src.strategies import base, layout


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale=None, is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          segment_ids=None, logits_soft_cap=None,
                          implementation=None, return_residual=False,
                          sinks=None, padding_segment_id=None,
                          context_parallel: ContextParallel | None = None):
  """Scaled dot-product attention, memory-efficient and differentiable.

  Every argument that ``jax.nn.dot_product_attention`` has means the same
  here; ``segment_ids`` and ``logits_soft_cap`` are additions, and the
  residual (logsumexp) is differentiable. Shapes::

    B batch, T query length, S key length, N query heads,
    K key/value heads (N % K == 0; K < N is GQA, K == 1 is MQA), H head dim

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``.
    key: ``(B, S, K, H)`` or ``(S, K, H)``. K/V are never repeated for GQA.
    value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``: Hv may differ from H
      (multi-head latent attention); the output takes it.
    bias: additive, broadcastable to ``(B, N, T, S)``; differentiable.
    mask: boolean, broadcastable to ``(B, N, T, S)``; True = attend.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned).
    query_seq_lengths: ``(B,)`` int; queries at or past it output 0.
    key_value_seq_lengths: ``(B,)`` int; keys at or past it are ignored.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends keys
      ``i - left <= j <= i + right``.
    segment_ids: packed documents, ``(B, T)`` int (needs T == S) or a
      ``(q_ids (B, T), kv_ids (B, S))`` pair (``(T,)``, ``(S,)`` with an
      unbatched query); tokens attend only within their own segment id.
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)`` after
      scaling, before bias and masks (Gemma 2).
    implementation: ``None`` (best available), ``"xla"`` (pure-JAX
      blockwise) or ``"cudnn"``.
    return_residual: also return the logsumexp ``(B, T, N)`` float32.
    sinks: ``(N,)`` float, differentiable: per head, a logit that joins
      every row's softmax with no value (gpt-oss).
    padding_segment_id: an id of ``segment_ids`` marking padding (0 in
      TransformerEngine and MaxText): its rows are rows that see no key,
      and no token sees its keys. None (default): 0 is a document too.
    context_parallel: a :class:`ContextParallel`: on the mesh in scope
      (``jax.set_mesh``, or q's ``NamedSharding``), split the sequence over
      its ``axis`` and run that strategy on each shard, eagerly or under
      ``jax.jit`` (the same numbers), natural order in and out by default
      (``ContextParallel.inputs``), T and S of any length (padded inside
      the call). Needs T == S, except with ``"ulysses"``.
      Serves every option except ``bias``, ``mask`` and ``return_residual``.

  Returns:
    ``(B, T, N, Hv)`` in the input dtype (and the logsumexp if asked). Rows
    that see no key (fully masked) are 0 with zero gradient; ``jax.nn``
    gives the mean of V there instead.
  """
  q_rank = jnp.ndim(query)
  query, key, value = (_batched(x) for x in (query, key, value))
  segment_ids = _batched_ids(segment_ids) if q_rank == 3 else segment_ids
  tm, config = base.prepare(
      query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      cp_size=1)
  bias, dense = _bias_and_mask(bias, mask, query.shape, key.shape)
  if sinks is not None:
    sinks = validate.sinks(sinks, query.shape[2])
  validate.padding_segment_id(padding_segment_id, segment_ids)
  unbatch = (lambda x: x[0]) if q_rank == 3 else (lambda x: x)
  if context_parallel is not None:
    mesh, lengths = validate.context_parallel(
        context_parallel, query, key, bias=bias, mask=mask,
        return_residual=return_residual)
    out = _context_parallel(query, key, value, tm, sinks, config,
                            context_parallel, mesh, implementation, lengths)
    return unbatch(base.drop_padding(out, tm.q_segment_ids, padding_segment_id))
  out, lse = _padding_rows(*_one_device(query, key, value, bias, dense, tm,
                                        config, sinks), tm, sinks,
                           padding_segment_id)
  return (unbatch(out), unbatch(lse)) if return_residual else unbatch(out)


def _padding_rows(out, lse, tm: TokenMask, sinks, padding_segment_id):
  """``(out, lse)`` with the rows of ``padding_segment_id`` as rows that
  see no key: 0, and the logsumexp of none (MASK_VALUE, or the head's
  sink)."""
  if padding_segment_id is None:
    return out, lse
  pad = tm.q_segment_ids == padding_segment_id
  none = (jnp.full(lse.shape, MASK_VALUE, jnp.float32) if sinks is None
          else jnp.broadcast_to(sinks.astype(jnp.float32), lse.shape))
  return (base.drop_padding(out, tm.q_segment_ids, padding_segment_id),
          jnp.where(pad[:, :, None], none, lse))


def _bias_and_mask(bias, mask, q_shape, k_shape):
  """``bias`` and the boolean ``mask``, checked broadcastable to ``(B, N,
  T, S)`` and materialised along T and S (the blockwise tiles slice them);
  None stays None."""
  (b, t, n, _), s = q_shape, k_shape[1]
  if bias is not None:
    bias = validate.broadcastable("bias", jnp.asarray(bias), (b, n, t, s))
    bias = _broadcast_ts(bias, t, s)
  if mask is not None:
    mask = jnp.asarray(mask)
    validate.bool_mask(mask)
    mask = _broadcast_ts(validate.broadcastable("mask", mask, (b, n, t, s)),
                         t, s)
  return bias, mask


def _one_device(query, key, value, bias, dense, tm: TokenMask,
                config: AttentionConfig, sinks):
  """``(out, lse)`` of one block call over the whole arrays, on the backend
  the registry picks for them, with the ``sinks`` folded in."""
  block_mask = BlockMask(q_segment_ids=tm.q_segment_ids,
                         kv_segment_ids=tm.kv_segment_ids,
                         q_lengths=tm.q_lengths, kv_lengths=tm.kv_lengths,
                         dense=dense)
  if 0 in query.shape[:2] + key.shape[1:2]:  # no rows, or no key to see
    empty = (jnp.zeros(_out_shape(query, value), query.dtype),
             jnp.full(query.shape[:3], MASK_VALUE, jnp.float32))
    return empty if sinks is None else kernel.fold_sinks(*empty, sinks)
  config = config.replace(implementation=registry.resolve(
      config.implementation, config, query, key, value, bias, block_mask))
  return kernel.attention(query, key, value, bias, block_mask, config, sinks)


def _padded(query, key, value, tm: TokenMask, config: AttentionConfig,
            t: int, s: int):
  """``(query, key, value, tm)`` at sequence lengths ``t >= T`` and
  ``s >= S`` (:func:`validate.padded_lengths`), zeros appended, such that
  the first T rows of the output, and every real token's gradient, are
  the unpadded call's. A padded query row is cut from the output: its
  cotangent is zero, so it adds to no gradient. Padded keys are hidden
  from the real queries by the causal mask where it does so (T <= S: the
  segment ids, if any, extend each row's last document, adding none);
  else by a segment id of their own where the call has segment ids
  (cuDNN's packed path takes no lengths beside them); else by
  ``kv_lengths`` (natural positions). Only constant pads, reductions and
  elementwise ops: they serve arrays sharded along the sequence on
  Explicit mesh axes too."""
  pad_t, pad_s = t - query.shape[1], s - key.shape[1]
  if not pad_t and not pad_s:
    return query, key, value, tm
  grow = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))
  causal = config.is_causal and query.shape[1] <= key.shape[1]
  ids = [x for x in (tm.q_segment_ids, tm.kv_segment_ids) if x is not None]
  pad_ids = lambda x, n: x
  if ids and causal:  # each row's last id, by a reduction (no slice)
    def pad_ids(x, n):
      if x is None or not n:
        return x
      at = jnp.arange(x.shape[1] + n)
      last = jnp.max(jnp.where(at[None, :x.shape[1]] == x.shape[1] - 1, x,
                               jnp.iinfo(x.dtype).min), axis=1)
      return jnp.where(at[None] < x.shape[1], grow(x, n), last[:, None])
  elif ids:  # an id no real token has
    fresh = _unused_id(ids)
    pad_ids = lambda x, n: None if x is None else jnp.where(
        jnp.arange(x.shape[1] + n)[None] < x.shape[1], grow(x, n), fresh)
  kv_lengths = tm.kv_lengths
  if pad_s and not ids and not causal:
    real = key.shape[1]
    kv_lengths = (jnp.full(key.shape[:1], real, jnp.int32) if kv_lengths is
                  None else jnp.minimum(kv_lengths, real))
  return (grow(query, pad_t), grow(key, pad_s), grow(value, pad_s),
          TokenMask(q_segment_ids=pad_ids(tm.q_segment_ids, pad_t),
                    kv_segment_ids=pad_ids(tm.kv_segment_ids, pad_s),
                    q_lengths=tm.q_lengths, kv_lengths=kv_lengths))


def _unused_id(ids):
  """An id that none of the int arrays ``ids`` holds: above their largest,
  else below their smallest, else (both ends of the dtype taken) one that
  a search by counts finds: a range holding fewer ids than values has a
  half that does too, down to one value that no id holds (the whole
  range holds fewer tokens than values). Reductions only, so that arrays
  sharded along the sequence on Explicit axes serve as they are."""
  dtype = jnp.dtype(ids[0].dtype)
  info, bits = jnp.iinfo(dtype), 8 * dtype.itemsize
  top = functools.reduce(jnp.maximum, [jnp.max(x) for x in ids])
  low = functools.reduce(jnp.minimum, [jnp.min(x) for x in ids])
  unsigned = jnp.dtype(f"uint{bits}")
  flip = (lambda u: u ^ unsigned.type(1 << (bits - 1))) if info.min else (
      lambda u: u)  # order-preserving, signed <-> unsigned

  def search():
    keys = [flip(jax.lax.bitcast_convert_type(x, unsigned)) for x in ids]

    def halve(_, bounds):
      lo, hi = bounds
      mid = lo + (hi - lo) // 2
      held = sum(jnp.sum((u >= lo) & (u <= mid), dtype=jnp.int32)
                 for u in keys)
      free = held.astype(unsigned) < mid - lo + 1
      return jnp.where(free, lo, mid + 1), jnp.where(free, mid, hi)

    lo, _ = jax.lax.fori_loop(0, bits, halve, (
        unsigned.type(0), unsigned.type(np.iinfo(unsigned).max)))
    return jax.lax.bitcast_convert_type(flip(lo), dtype)

  return jnp.where(top < info.max, top + 1, jnp.where(
      low > info.min, low - 1, jax.lax.cond(
          (top == info.max) & (low == info.min), search,
          lambda: jnp.asarray(0, dtype)))).astype(dtype)


def _context_parallel(query, key, value, tm: TokenMask, sinks,
                      config: AttentionConfig, cp: ContextParallel, mesh,
                      implementation, lengths):
  """``partition.attention`` of global arrays on ``mesh`` (validated), the
  same eagerly and under ``jax.jit``, on Auto and Explicit mesh axes, at
  the padded sequence ``lengths`` (:func:`_padded`); the output has T
  rows."""
  cp = cp.with_environment()
  if cp.strategy == "auto" and not cp.is_hybrid and (
      query.shape[1] != key.shape[1]):  # auto's one candidate for T != S,
    cp = dataclasses.replace(cp, strategy="ulysses")  # padded equal or not
  rows = query.shape[1]
  if 0 not in query.shape[:2] + key.shape[1:2]:
    query, key, value, tm = _padded(query, key, value, tm, config, *lengths)
  # The backend is resolved on each shard (partition.py): its limits are
  # per call. A request is checked here, on a one-token block of the
  # padded call's mask, so that what does not depend on the length fails
  # at trace time.
  if implementation is not None:
    one = lambda x: jax.ShapeDtypeStruct(x.shape[:1] + (1,) + x.shape[2:],
                                         x.dtype)
    registry.resolve(implementation, config, one(query), one(key), one(value),
                     None, tm.block_mask())
  config = config.replace(implementation=implementation)
  if 0 in query.shape[:2] + key.shape[1:2]:  # as on one device
    return jnp.zeros(_out_shape(query, value), query.dtype)

  # The sequence goes to the context axes (hybrid: ring-major) whatever the
  # arrays' placement: the partition rule needs a mesh with those axes.
  seq = cp.sequence_axes
  u = P.UNCONSTRAINED

  def placed(q, k, v, tm, sinks):
    scope = jax.sharding.get_abstract_mesh()
    on = lambda x, *spec: jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh if scope.empty else scope, P(*spec)))
    q, k, v = (on(x, u, seq, u, u) for x in (q, k, v))
    tm = TokenMask(**{f: None if x is None else
                      on(x, u) if f.endswith("lengths") else on(x, u, seq)
                      for f, x in vars(tm).items()})
    if sinks is not None:  # on the mesh too, wherever it was made
      sinks = on(sinks, None)
    return q, k, v, tm, sinks

  to, back = _permutations(cp, mesh)

  def call(q, k, v, tm, sinks):
    out = partition.attention(*placed(to(q), to(k), to(v), _tokens(to, tm),
                                      sinks), config, cp)
    return back(out)

  explicit = layout.explicit_axes(mesh)
  if explicit:
    # Arrays whose type names no mesh (plain arrays under jax.set_mesh)
    # are put on it, replicated: the custom VJP's shardings are theirs.
    on = lambda x: x if x is None or not jax.typeof(x).sharding.mesh.empty \
        else jax.sharding.reshard(x, NamedSharding(mesh, P()))
    query, key, value, sinks = map(on, (query, key, value, sinks))
    tm = TokenMask(**{f: on(x) for f, x in vars(tm).items()})
    call = _on_auto_axes(placed, (to, back), config, cp, explicit, query,
                         key, value, sinks)
  # Always a jitted program: outside one (eagerly, and under an eager
  # jax.grad, jax.vjp or jax.checkpoint, whose tracers are no jit's),
  # custom_partitioning would run the unpartitioned body on the whole
  # arrays, which knows nothing of the load-balance layout.
  return jax.jit(call)(query, key, value, tm, sinks)[:, :rows]


def _permutations(cp: ContextParallel, mesh):
  """(into ``cp``'s load-balance layout over the ring axis of ``mesh``,
  back to natural order), along axis 1 of any array: natural-order inputs
  (``ContextParallel.inputs``) are permuted inside the call's program, its
  gradient the inverse permutation. Identities when ``cp`` permutes
  nothing. Dual-chunk over one axis moves each chunk once, by
  ``ppermute`` (:func:`layout.dual_chunk_swap`); striped is a transpose,
  which moves by one all-to-all."""
  size = mesh.shape[cp.ring_axis]
  if not cp.permutes:
    return (lambda x: x), (lambda x: x)
  if cp.load_balance == "dual_chunk" and not cp.is_hybrid and size > 1:
    def swap(x, inverse):
      scope = jax.sharding.get_abstract_mesh()
      return layout.dual_chunk_swap(x, cp.axis, size,
                                    mesh if scope.empty else scope,
                                    inverse=inverse)
    return (functools.partial(swap, inverse=False),
            functools.partial(swap, inverse=True))
  return (functools.partial(layout.reorder_for_load_balance, cp_size=size,
                            layout=cp.load_balance),
          functools.partial(layout.reorder_from_load_balance,
                            cp_size=size, layout=cp.load_balance))


def _tokens(f, tm: TokenMask) -> TokenMask:
  """``f`` applied to the per-token fields (segment ids), not lengths."""
  return TokenMask(**{n: x if x is None or n.endswith("lengths") else f(x)
                      for n, x in vars(tm).items()})


def _on_auto_axes(placed, permutations, config, cp, explicit, query, key,
                  value, sinks):
  """``partition.attention`` for arrays on Explicit mesh axes. The
  partition rule runs on Auto axes, so the forward and the backward each
  run in ``auto_axes``, and what passes between them (the residuals) is on
  the caller's axes: one ``auto_axes`` around the whole custom VJP would
  hand the backward residuals typed on the Auto mesh, which jax refuses
  beside Explicit ones when the two are separate programs (an eager
  ``jax.grad``, ``jax.vjp`` of a jitted call). The ``permutations`` into
  the layout and back run inside each, on Auto axes too."""
  to, back = permutations
  auto = functools.partial(jax.sharding.auto_axes, axes=explicit)
  typed = lambda x: jax.typeof(x).sharding
  q_spec = typed(query).spec
  lse_sharding = NamedSharding(typed(query).mesh, P(*tuple(q_spec)[:3]))
  out_sharding = typed(query)  # (B, T, N, Hv): the query's placement
  grads_sharding = (typed(query), typed(key), typed(value)) + (
      () if sinks is None else (NamedSharding(typed(query).mesh, P()),))

  def forward(q, k, v, tm, sinks):
    out, res = partition.forward(*placed(to(q), to(k), to(v),
                                         _tokens(to, tm), sinks), config, cp)
    return back(out), back(res[-1])  # out, lse

  @jax.custom_vjp
  def call(q, k, v, tm, sinks):
    return auto(forward, out_sharding=(out_sharding, lse_sharding))(
        q, k, v, tm, sinks)[0]

  def call_fwd(q, k, v, tm, sinks):
    out, lse = auto(forward, out_sharding=(out_sharding, lse_sharding))(
        q, k, v, tm, sinks)
    return out, (q, k, v, tm, sinks, out, lse)

  def call_bwd(res, dout):
    q, k, v, tm, sinks, out, lse = res

    def backward(q, k, v, tm, sinks, out, lse, dout):
      q, k, v, tm, sinks = placed(to(q), to(k), to(v), _tokens(to, tm),
                                  sinks)
      dq, dk, dv, _, dsinks = partition.backward(
          config, cp, (q, k, v, tm, sinks, to(out), to(lse)), to(dout))
      return (back(dq), back(dk), back(dv)) + (
          () if sinks is None else (dsinks,))

    grads = auto(backward, out_sharding=grads_sharding)(
        q, k, v, tm, sinks, out, lse, dout)
    return (*grads[:3], jax.tree.map(lambda _: None, tm),
            None if sinks is None else grads[3])

  call.defvjp(call_fwd, call_bwd)
  return call


def _out_shape(query, value):
  """``(B, T, N, Hv)``: the output takes the value's head dim."""
  return query.shape[:3] + value.shape[3:]


def _batched_ids(segment_ids):
  """Segment ids of an unbatched call: ``(T,)`` (or a pair) -> ``(1, T)``."""
  return jax.tree.map(lambda x: x[None] if jnp.ndim(x) == 1 else x,
                      segment_ids)


def _batched(x):
  """``(T, N, H)`` -> ``(1, T, N, H)``; other ranks as they are."""
  x = jnp.asarray(x)
  return x[None] if x.ndim == 3 else x


def _broadcast_ts(x, t, s):
  """Materialise T and S (the blockwise tiles slice them); keep B|1, N|1."""
  return jnp.broadcast_to(x, x.shape[:2] + (t, s))
