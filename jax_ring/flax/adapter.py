"""jax_ring as the ``attention_fn`` of flax's own attention modules.

Existing Flax code keeps its layer and its weights and gets jax_ring
attention (and context parallelism) by changing one argument::

  layer = nnx.MultiHeadAttention(
      num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
      attention_fn=jax_ring.flax.attention_fn(
          is_causal=True, context_parallel=jax_ring.ContextParallel("cp")))

and the same for ``flax.linen.MultiHeadDotProductAttention``.

The arguments flax passes on each call are handled as follows:

==========================  ==========================================
flax argument               what the adapter does
==========================  ==========================================
query, key, value           ``[batch..., T|S, N, H]``; several batch
                            dims are flattened into one and restored
mask                        cast to bool (flax masks are often float)
                            and passed on; under ``context_parallel``
                            a ``ValueError``: use ``is_causal`` /
                            ``local_window_size`` here instead
bias                        passed on; a ``ValueError`` under
                            ``context_parallel``, as ``mask``
is_causal (nnx's call)      OR'd with this ``is_causal``
dtype, promote_dtype        q, k, v cast as flax casts them
                            (``promote_dtype((q, k, v), dtype=dtype)``:
                            to ``dtype`` if given, else their common
                            float type); the output has that dtype
dropout_rate                ``0``, or any rate with
                            ``deterministic=True``; else ``ValueError``
deterministic               see ``dropout_rate``
dropout_rng,                ignored (they only matter with dropout)
broadcast_dropout
precision                   must be ``None`` (jax_ring picks the matmul
                            precision: HIGHEST for float32)
module                      must be ``None``: flax passes it only to
                            sow the attention weights
                            (``sow_weights=True``), which jax_ring
                            never materialises
force_fp32_for_softmax      accepted: the softmax is always float32
einsum_dot_general,         must be ``None`` (they replace the einsums,
qk_attn_weights_einsum,     e.g. AQT quantisation, which jax_ring's
attn_weights_value_einsum   kernels do not call)
sinks (jax_ring's own)      ``(N,)`` float, passed on: for your own
                            modules, which hold the sink logits as a
                            parameter; flax's layers have none (for a
                            layer with learned sinks, use
                            :class:`jax_ring.flax.Attention`)
anything else               ``TypeError`` naming it
==========================  ==========================================

(linen drops keywords that ``attention_fn``'s signature does not name, so
a keyword that a newer linen adds never reaches this function; nnx passes
every keyword, and an unknown one raises.)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax.nnx.nn import dtypes

from jax_ring._src.api import dot_product_attention
from jax_ring._src.core import validate
from jax_ring._src.core.config import ContextParallel


# Everything nnx.dot_product_attention and linen's dot_product_attention
# take. linen passes only the keywords that attention_fn's signature names
# (it filters with inspect.signature), so each must be named, not **kwargs.
FLAX_ARGUMENTS = (
    "query", "key", "value", "bias", "mask", "broadcast_dropout",
    "dropout_rng", "dropout_rate", "deterministic", "dtype", "precision",
    "module", "promote_dtype", "is_causal", "force_fp32_for_softmax",
    "einsum_dot_general", "qk_attn_weights_einsum",
    "attn_weights_value_einsum")


def attention_fn(*, is_causal=False, local_window_size=None,
                 logits_soft_cap=None, implementation=None,
                 context_parallel: ContextParallel | None = None):
  """A flax ``attention_fn`` that calls :func:`jax_ring.dot_product_attention`.

  Shapes are flax's: jax_ring's with any number of batch dims (batch...,
  flattened to B), T query length, S key length, N heads, H head dim.

  The options are fixed when the module is built; the module docstring
  says how each argument flax passes is served (packed documents have
  none: use :class:`jax_ring.flax.Attention`).

  Args:
    is_causal: query ``i`` attends keys ``j <= i``, in sequence order also
      under context parallelism (the replacement for
      ``nnx.make_causal_mask``).
    local_window_size: ``w`` or ``(left, right)``: query ``i`` attends keys
      ``i - left <= j <= i + right``.
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)``.
    implementation: ``None`` (best available), ``"xla"`` or ``"cudnn"``.
    context_parallel: a :class:`jax_ring.ContextParallel`: under
      ``jax.jit``, with the module's inputs sharded on the sequence
      dimension over its axis in its load-balance layout, each device
      attends with its shard (see ``jax_ring.dot_product_attention``).

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None, ...)`` with
    flax's signature and ``sinks=None``, returning ``[batch..., T, N, Hv]``.
  """
  window = validate.window(local_window_size, None, None)
  validate.scalar_options(None, logits_soft_cap)
  validate.implementation(implementation)
  if context_parallel is not None and not isinstance(context_parallel,
                                                     ContextParallel):
    raise ValueError(f"context_parallel must be a jax_ring.ContextParallel; "
                     f"got {context_parallel!r}")
  this_is_causal = bool(is_causal)  # the inner is_causal is flax's

  def jax_ring_attention(query, key, value, bias=None, mask=None,
                         broadcast_dropout=True, dropout_rng=None,
                         dropout_rate=0.0, deterministic=False, dtype=None,
                         precision=None, module=None, promote_dtype=None,
                         is_causal=False, force_fp32_for_softmax=False,
                         einsum_dot_general=None, qk_attn_weights_einsum=None,
                         attn_weights_value_einsum=None, sinks=None, **unknown):
    del broadcast_dropout, dropout_rng, force_fp32_for_softmax
    if module is not None:
      raise ValueError(
          "jax_ring.flax.attention_fn: module is given, i.e. the layer was "
          "built with sow_weights=True, which asks for the attention "
          "weights; jax_ring never materialises them (build it without "
          "sow_weights)")
    _check_flax_options(unknown, dropout_rate, deterministic, precision,
                        einsum_dot_general=einsum_dot_general,
                        qk_attn_weights_einsum=qk_attn_weights_einsum,
                        attn_weights_value_einsum=attn_weights_value_einsum)
    if context_parallel is not None:
      _check_unsharded(mask=mask, bias=bias)
    promote = promote_dtype or dtypes.promote_dtype
    query, key, value = promote((query, key, value), dtype=dtype)
    if mask is not None:
      mask = jnp.asarray(mask).astype(jnp.bool_)
    batch = query.shape[:-3]
    bias, mask = (_like_query(x, batch) for x in (bias, mask))
    if len(batch) > 1:  # jax_ring takes one batch dim: flatten, restore
      if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(
            f"query, key and value must have the same batch dims; got query "
            f"{query.shape}, key {key.shape}, value {value.shape}")
      query, key, value = (x.reshape((-1,) + x.shape[-3:])
                           for x in (query, key, value))
    out = dot_product_attention(
        query, key, value, bias, mask, is_causal=this_is_causal or is_causal,
        local_window_size=window, logits_soft_cap=logits_soft_cap,
        implementation=implementation, sinks=sinks,
        context_parallel=context_parallel)
    return out.reshape(batch + out.shape[1:]) if len(batch) > 1 else out

  return jax_ring_attention


def _check_flax_options(unknown, dropout_rate, deterministic, precision,
                        **replacements):
  """What jax_ring cannot do raises, rather than being silently skipped."""
  if unknown:
    raise TypeError(
        f"jax_ring.flax.attention_fn got unknown argument(s) "
        f"{sorted(unknown)}; it serves flax's {FLAX_ARGUMENTS}")
  if dropout_rate > 0 and not deterministic:
    raise ValueError(
        f"jax_ring.flax.attention_fn has no attention dropout: dropout_rate "
        f"must be 0 (or deterministic=True); got dropout_rate={dropout_rate!r}"
        f" with deterministic={deterministic!r}")
  if precision is not None:
    raise ValueError(
        f"jax_ring.flax.attention_fn: precision must be None (jax_ring picks "
        f"the matmul precision: HIGHEST for float32); got {precision!r}")
  for name, value in replacements.items():
    if value is not None:
      raise ValueError(
          f"jax_ring.flax.attention_fn: {name} must be None (jax_ring's "
          f"kernels do their own matmuls); got {value!r}")


def _check_unsharded(**dense):
  """A dense mask or bias cannot be served under context parallelism."""
  for name, x in dense.items():
    if x is not None:
      raise ValueError(
          f"jax_ring.flax.attention_fn: {name} of shape "
          f"{tuple(jnp.shape(x))} cannot be served under context_parallel "
          f"(a dense {name} is not sharded along the sequence); call the "
          f"module without {name}= and pass is_causal=True or "
          f"local_window_size= to attention_fn instead")


def _like_query(x, batch):
  """A mask or bias broadcastable to ``[batch..., N, T, S]`` (flax allows
  fewer dims) -> the ``[B, N, T, S]`` (or, unbatched, ``[N, T, S]``) form
  that jax_ring takes, one batch dim for several. Batch dims that are all 1
  become one 1: nothing is materialised over the batch."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.ndim > len(batch) + 3:
    return x  # jax_ring names the shape it cannot broadcast
  x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)
  if len(batch) <= 1:
    return x
  if all(d == 1 for d in x.shape[:-3]):
    return x.reshape((1,) + x.shape[-3:])
  x = jnp.broadcast_to(x, batch + x.shape[-3:])
  return x.reshape((math.prod(batch),) + x.shape[-3:])
