"""``dot_product_attention`` with ``context_parallel``: global arrays on a
mesh, padded to lengths the layout divides (``padding``), permuted from
natural order into the load-balance layout (``ContextParallel.inputs``;
not where ``strategies.natural`` keeps the order: contiguous shards),
placed on the context axes and bound to ``partition.attention`` in one
jitted program, whose partition rules pick each pass's strategy; the
output comes back in the inputs' order, T rows."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ring._src import one_device, padding, partition
from jax_ring._src.core import registry
from jax_ring._src.core.config import AttentionConfig, ContextParallel
from jax_ring._src.core.mask import TokenMask
from jax_ring._src.strategies import base, layout, natural


def attention(query, key, value, tm: TokenMask, sinks,
              config: AttentionConfig, cp: ContextParallel, mesh, lengths,
              padding_segment_id):
  """``out (B, T, N, Hv)``: ``partition.attention`` of checked, batched
  global arrays on ``mesh`` (``validate.context_parallel``), the same
  eagerly and under ``jax.jit``, on Auto and Explicit mesh axes, run at
  the padded sequence ``lengths`` (:func:`padding.pad`); the rows of
  ``padding_segment_id`` are 0. ``config.implementation`` is the request
  (None: the best available), resolved on each shard."""
  out = _padded_call(query, key, value, tm, sinks, config, cp, mesh, lengths)
  return base.drop_padding(out, tm.q_segment_ids, padding_segment_id)


def _padded_call(query, key, value, tm: TokenMask, sinks,
                 config: AttentionConfig, cp: ContextParallel, mesh,
                 lengths):
  """The call at the padded ``lengths``, its output cut to T rows."""
  cp = cp.with_environment()
  if cp.strategy == "auto" and not cp.is_hybrid and (
      query.shape[1] != key.shape[1]):  # auto's one candidate for T != S,
    cp = dataclasses.replace(cp, strategy="ulysses")  # padded equal or not
  rows = query.shape[1]
  if 0 not in query.shape[:2] + key.shape[1:2]:
    query, key, value, tm = padding.pad(query, key, value, tm, config,
                                        *lengths)
  # The backend is resolved on each shard (partition.py): its limits are
  # per call. A request is checked here, on a one-token block of the
  # padded call's mask, so that what does not depend on the length fails
  # at trace time.
  if config.implementation is not None:
    one = lambda x: jax.ShapeDtypeStruct(x.shape[:1] + (1,) + x.shape[2:],
                                         x.dtype)
    registry.resolve(config.implementation, config, one(query), one(key),
                     one(value), None, tm.block_mask())
  if 0 in query.shape[:2] + key.shape[1:2]:  # as on one device
    return jnp.zeros(one_device.out_shape(query, value), query.dtype)
  if natural.kept(cp, mesh.shape[cp.ring_axis], config.is_causal,
                  config.local_window,
                  any(x is not None for x in vars(tm).values())):
    cp = dataclasses.replace(cp, load_balance=None)  # natural order stays
  return _jitted(query, key, value, tm, sinks, config, cp, mesh)[:, :rows]


def _jitted(query, key, value, tm: TokenMask, sinks, config: AttentionConfig,
            cp: ContextParallel, mesh):
  """``partition.attention`` of padded global arrays, with the sequence
  placed on the context axes and permuted into the layout and back, in a
  jitted program.

  Always a jitted program: outside one (eagerly, and under an eager
  jax.grad, jax.vjp or jax.checkpoint, whose tracers are no jit's),
  custom_partitioning would run the unpartitioned body on the whole
  arrays, which knows nothing of the load-balance layout. On Auto axes
  it is one function per ``(config, cp, mesh)``, so that an eager call
  like an earlier one runs the program compiled then."""
  explicit = layout.explicit_axes(mesh)
  if not explicit:
    return _program(config, cp, mesh)(query, key, value, tm, sinks)
  # Arrays whose type names no mesh (plain arrays under jax.set_mesh) are
  # put on it, replicated: the custom VJP's shardings are theirs.
  on = lambda x: x if x is None or not jax.typeof(x).sharding.mesh.empty \
      else jax.sharding.reshard(x, NamedSharding(mesh, P()))
  query, key, value, sinks = map(on, (query, key, value, sinks))
  tm = TokenMask(**{f: on(x) for f, x in vars(tm).items()})
  run = _on_auto_axes(_placer(cp, mesh), permutations(cp, mesh), config, cp,
                      explicit, query, key, value, sinks)
  return jax.jit(run)(query, key, value, tm, sinks)


@functools.lru_cache(maxsize=64)
def _program(config: AttentionConfig, cp: ContextParallel, mesh):
  """The jitted call of :func:`_jitted` on Auto mesh axes."""
  placed, (to, back) = _placer(cp, mesh), permutations(cp, mesh)

  def call(q, k, v, tm, sinks):
    out = partition.attention(*placed(to(q), to(k), to(v), _tokens(to, tm),
                                      sinks), config, cp)
    return back(out)

  return jax.jit(call)


def _placer(cp: ContextParallel, mesh):
  """``placed(q, k, v, tm, sinks)``: the sequence on the context axes
  (hybrid: ring-major), whatever the arrays' placement: the partition
  rule needs a mesh with those axes."""
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

  return placed


def permutations(cp: ContextParallel, mesh):
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
