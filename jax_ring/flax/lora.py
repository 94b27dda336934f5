"""Low-rank adapters (LoRA) on a layer's weights, with PEFT's semantics:
``y = x W + (dropout(x) A) B * scale``, ``scale = alpha / r`` (or
``alpha / sqrt(r)`` with rsLoRA).

A weight ``W`` whose dims are ``in + out`` (``in`` contracted with ``x``:
``(E,)`` for ``wq (E, N, H)``, ``(N, H)`` for ``wo (N, H, E)``) gets

* ``a``: ``in + (r,)``, PEFT's ``lora_A`` (initialised as PEFT does:
  Kaiming-uniform with ``a = sqrt(5)``, i.e. ``U(-1/sqrt(fan_in),
  1/sqrt(fan_in))``);
* ``b``: ``(r,) + out``, PEFT's ``lora_B`` (zeros, so a new adapter
  changes nothing),

both ``nnx.LoRAParam`` (a subclass of ``nnx.Param``: ``nnx.LoRAParam``
as a filter selects the adapters alone, for gradients and optimizer
state), sharded like ``W``'s own dims (``r`` unsplit). The adapter of
``module.<name>`` is ``module.<name>_lora``; :func:`dense` is the product
every layer uses, with or without one. The low-rank term is computed in
the layer's compute dtype, as ``W`` is, from ``x`` ``(..., in)`` through
``(..., r)``: ``2 r (in + out)`` FLOPs a token, never ``W``-sized.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P


def suffix(name: str) -> str:
  """The attribute holding the adapter of weight ``name``."""
  return f"{name}_lora"


class LoRA(nnx.Module):
  """The adapter of one weight (module docstring). ``rank`` r, ``alpha``,
  ``dropout`` (rate on the adapter's input, active unless the module is in
  eval mode: ``model.eval()``), ``rslora``: scale ``alpha / sqrt(r)``.
  ``axes``: the weight's logical axes (``in`` then ``out``) and ``rules``
  their mesh rules (``()``: unsharded), kept as the adapters' metadata;
  ``sharding``: the weight's own, where a ``NamedSharding`` places ``a``
  and ``b`` on its mesh by the same dims."""

  def __init__(self, in_shape: tuple, out_shape: tuple, *, rank: int,
               alpha: float, dropout: float = 0.0, rslora: bool = False,
               dtype=jnp.float32, axes: tuple | None = None, rules=(),
               sharding=None, rngs: nnx.Rngs):
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    fan_in = math.prod(in_shape)
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(rngs.params(), in_shape + (rank,), dtype, -bound,
                           bound)
    b = jnp.zeros((rank,) + out_shape, dtype)
    n = len(in_shape)
    if isinstance(sharding, NamedSharding):
      spec = tuple(sharding.spec) + (None,) * (n + len(out_shape)
                                               - len(sharding.spec))
      a = jax.device_put(a, NamedSharding(sharding.mesh, P(*spec[:n], None)))
      b = jax.device_put(b, NamedSharding(sharding.mesh, P(None, *spec[n:])))
    if axes is None or not rules:
      self.a, self.b = nnx.LoRAParam(a), nnx.LoRAParam(b)
    else:
      self.a = nnx.LoRAParam(a, out_sharding=tuple(axes[:n]) + (None,),
                             sharding_rules=rules)
      self.b = nnx.LoRAParam(b, out_sharding=(None,) + tuple(axes[n:]),
                             sharding_rules=rules)
    self.rank, self.alpha, self.rslora = rank, float(alpha), bool(rslora)
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

  def dropout_active(self) -> bool:
    return self.dropout is not None and not self.dropout.deterministic

  def __call__(self, x, spec: str, dtype):
    """The low-rank term of ``einsum(spec, x, W)`` (same shape)."""
    lhs, w_dims, out = _split_spec(spec)
    ins = "".join(c for c in w_dims if c in lhs)
    outs = w_dims[len(ins):]
    rows = "".join(c for c in out if c not in w_dims)
    r = next(c for c in "rzyxwvutq" if c not in spec)
    if self.dropout is not None:
      x = self.dropout(x)
    h = jnp.einsum(f"{lhs},{ins}{r}->{rows}{r}", x, self.a[...].astype(dtype))
    h = h * jnp.asarray(self.scale, dtype)
    return jnp.einsum(f"{rows}{r},{r}{outs}->{out}", h,
                      self.b[...].astype(dtype))

  def delta(self):
    """``A B * scale``, the weight's change, float32 in ``W``'s shape."""
    a = self.a[...].astype(jnp.float32)
    b = self.b[...].astype(jnp.float32)
    return jnp.tensordot(a, b, axes=1) * self.scale


def _split_spec(spec: str) -> tuple[str, str, str]:
  inputs, out = spec.replace(" ", "").split("->")
  lhs, w_dims = inputs.split(",")
  return lhs, w_dims, out


def dense(module: nnx.Module, name: str, spec: str, x, dtype):
  """``einsum(spec, x, module.<name>)`` in ``dtype``, plus the low-rank
  term of the weight's adapter where it has one. ``spec``'s weight dims
  are the contracted ones, then the output's (``"bse,enh->bsnh"``)."""
  y = jnp.einsum(spec, x, getattr(module, name)[...].astype(dtype))
  adapter = getattr(module, suffix(name), None)
  return y if adapter is None else y + adapter(x, spec, dtype)
