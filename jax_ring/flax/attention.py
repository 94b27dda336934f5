"""The Flax NNX attention layer: projections, RoPE, GQA, masks, and a call to
``jax_ring.dot_product_attention`` (context-parallel when configured).

Shapes::

  B batch, S sequence (this array's order: natural, or the load-balance
  layout under context parallelism), E embed, N query heads, K kv heads
  (N % K == 0), H head dim

Sharding is written with MaxText-style *logical* axis names; one table of
rules maps them onto mesh axes, and the same rules serve parameters (as
flax ``out_sharding``/``sharding_rules`` metadata) and activations (as
sharding constraints), unless ``param_rules`` gives the weights their own
(FSDP, below):

===========  ==========================  =========================
logical      on                          typical mesh axis
===========  ==========================  =========================
batch        activations                 ``"data"`` (or data, fsdp)
length       activations                 the context axis (axes)
heads        wq, wo, q, out              ``"tensor"`` or None
kv_heads     wk, wv, k, v                ``"tensor"`` or None
head_dim     everything with H           None
embed        wq, wk, wv, wo, x, y        None (weights: see below)
===========  ==========================  =========================

FSDP (ZeRO-3), as MaxText shards weights over its data and context axes:
``param_rules=fsdp_rules(rules, ("data", "context"))`` maps the weights'
``embed`` dimension onto those axes, so each device keeps 1/(data x
context) of every weight, and of its optimizer state; XLA all-gathers a
layer's weights where they are used and reduce-scatters their gradients
(context parallelism alone replicates them on every context device).

Positions are an input, not ``arange(S)``: under load balancing the
token order is not the sequence order, so each token's position travels
with it (restarting at 0 per packed document, as MaxText's do: RoPE sees
only differences within a document). The masks need none:
``dot_product_attention`` knows the layout from its ``ContextParallel``,
and packing comes through ``segment_ids`` (in the same layout).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ring._src.api import dot_product_attention
from jax_ring._src.decode import decode_attention
from jax_ring._src.core.config import ContextParallel
from jax_ring._src.strategies import layout
from jax_ring.flax.lora import dense


BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM, EMBED = (
    "batch", "length", "heads", "kv_heads", "head_dim", "embed")
LOGICAL_AXES = (BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM, EMBED)

# ((logical name, mesh axis or axes or None), ...), as flax spells them.
LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def logical_rules(*, batch="data", length="context", heads=None,
                  kv_heads=None, head_dim=None, embed=None,
                  **extra) -> LogicalRules:
  """Rules for every logical axis of the layer (plus ``extra`` names, for
  the rest of a model), in flax's tuple-of-pairs form, e.g.
  ``logical_rules(batch="data", length="context", heads="tensor",
  kv_heads="tensor")``; ``length=("context", "ulysses")`` for ``"hybrid"``.
  """
  named = dict(batch=batch, length=length, heads=heads, kv_heads=kv_heads,
               head_dim=head_dim, embed=embed, **extra)
  return tuple(named.items())


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3's RoPE frequency scaling (Hugging Face ``rope_type="llama3"``):
  wavelengths longer than ``original_max_position_embeddings /
  low_freq_factor`` are stretched by ``factor``, those shorter than ``... /
  high_freq_factor`` kept, and the band between interpolated smoothly."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Linear RoPE scaling (position interpolation; Hugging Face
  ``rope_type="linear"``, Gemma 3's global layers): every frequency is
  divided by ``factor``, as if positions were ``factor`` times closer."""

  factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling


@dataclasses.dataclass(frozen=True)
class AttentionLayerConfig:
  """Static options of :class:`Attention` (frozen, hashable).

  Attributes:
    embed_dim: E, the model width.
    num_heads: N query heads.
    num_kv_heads: K key/value heads; ``K < N`` is GQA, ``K == 1`` MQA.
    head_dim: H (even, for RoPE).
    is_causal: causal mask in sequence order.
    sliding_window: ``W``: a query sees ``W`` keys, itself and the ``W - 1``
      before it (and, if not causal, ``W - 1`` after), the Mistral/Gemma
      convention; ``None`` for full attention.
    logits_soft_cap: Gemma-2 soft cap ``c * tanh(logits / c)``.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    rope_max_wavelength: RoPE base (``theta``).
    rope_scaling: a :class:`Llama3RopeScaling` or
      :class:`LinearRopeScaling`, or None (plain RoPE).
    qkv_bias: add a learned bias to q, k and v (Qwen2).
    qk_norm: an RMSNorm over the head dim on q and on k, each with its own
      ``(H,)`` weight, after the projections and before RoPE (Qwen3,
      Gemma 3).
    qk_norm_eps: its epsilon.
    zero_centered_norm: the q/k norms multiply by ``1 + weight`` (Gemma's
      form, the weight stored centred on 0 and initialised to 0), rather
      than by ``weight``.
    sinks: a learned logit per query head, ``(N,)``, initialised to 0,
      that joins every row's softmax with no value (gpt-oss); see
      ``jax_ring.dot_product_attention(sinks=)``.
    dtype: compute dtype of projections and attention (bfloat16 lets
      ``implementation=None`` pick cuDNN on a GPU).
    param_dtype: dtype of the weights.
    implementation: ``None`` (best available), ``"xla"`` or ``"cudnn"``.
    context_parallel: a ``jax_ring.ContextParallel``, or ``None`` for
      attention on whatever device holds the whole sequence. Its axis (both
      axes, for ``"hybrid"``) must be what ``rules`` maps ``length`` onto.
    rules: logical axis -> mesh axis (see :func:`logical_rules`). Empty:
      no sharding annotations (a single-device layer that needs no mesh).
      Otherwise every logical axis of the layer must be named, and the
      layer must be built and called under ``jax.set_mesh(mesh)``.
    param_rules: the weights' own rules (see :func:`fsdp_rules`); ``None``:
      ``rules``.
  """

  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  is_causal: bool = True
  sliding_window: int | None = None
  logits_soft_cap: float | None = None
  scale: float | None = None
  rope_max_wavelength: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  qkv_bias: bool = False
  qk_norm: bool = False
  qk_norm_eps: float = 1e-6
  zero_centered_norm: bool = False
  sinks: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  implementation: Literal["xla", "cudnn"] | None = None
  context_parallel: ContextParallel | None = None
  rules: LogicalRules = ()
  param_rules: LogicalRules | None = None

  def __post_init__(self):
    for name in ("embed_dim", "num_heads", "num_kv_heads", "head_dim",
                 "sliding_window"):  # NumPy ints, as elsewhere
      if isinstance(getattr(self, name), np.integer):
        object.__setattr__(self, name, int(getattr(self, name)))
    for name in ("embed_dim", "num_heads", "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
          f"({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE; got {self.head_dim}")
    if self.sliding_window is not None and (
        not isinstance(self.sliding_window, int) or self.sliding_window < 1):
      raise ValueError(f"sliding_window must be None or an int >= 1; got "
                       f"{self.sliding_window!r}")
    if self.param_rules is not None and not self.rules:
      raise ValueError("param_rules needs rules (the activations' sharding)")
    # Empty rules mean "unsharded"; param_rules, once given, must be whole.
    for field, given in (("rules", bool(self.rules)),
                         ("param_rules", self.param_rules is not None)):
      named = {name for name, _ in getattr(self, field) or ()}
      missing = [a for a in LOGICAL_AXES if a not in named]
      if given and missing:
        raise ValueError(
            f"{field} must map every logical axis of the layer "
            f"{LOGICAL_AXES}; missing {missing}")
    if self.rules:
      cp = self.context_parallel
      length = dict(self.rules)[LENGTH]
      if cp is not None and _axis_set(length) != _axis_set(cp.axes):
        raise ValueError(
            f"rules map 'length' to {length!r} but context_parallel.axis is "
            f"{cp.axis!r}; the sequence must be sharded over the context "
            "axis (axes)")

  @property
  def local_window_size(self) -> tuple[int, int] | None:
    """``sliding_window`` as ``dot_product_attention``'s (left, right)."""
    if self.sliding_window is None:
      return None
    w = self.sliding_window - 1
    return (w, 0) if self.is_causal else (w, w)


def fsdp_rules(rules: LogicalRules, axes) -> LogicalRules:
  """``rules`` for weights, with ``embed`` sharded over ``axes`` (a mesh
  axis or a tuple of them, usually the batch and context axes): FSDP, for
  ``param_rules``. The activations keep ``rules``: there ``embed`` stays
  whole, since ``batch`` and ``length`` already use those axes."""
  return tuple((name, axes if name == EMBED else mesh)
               for name, mesh in rules)


def _axis_set(axes) -> frozenset:
  return frozenset(axes if isinstance(axes, tuple) else (axes,))


def rope_frequencies(head_dim: int, max_wavelength: float = 10_000.0,
                     scaling: RopeScaling | None = None):
  """``(H/2,)`` float32 angular frequencies of RoPE: ``theta^(-2i/H)``,
  rescaled by ``scaling`` when given."""
  inv_freq = max_wavelength ** -(
      jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is None:
    return inv_freq
  if isinstance(scaling, LinearRopeScaling):
    return inv_freq / scaling.factor
  old = scaling.original_max_position_embeddings
  wavelength = 2 * jnp.pi / inv_freq
  # Position of each wavelength between the two cut-offs: <= 0 is a long
  # wavelength (divided by factor), >= 1 a short one (kept).
  t = (old / wavelength - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  t = jnp.clip(t, 0.0, 1.0)
  return (1 - t) * inv_freq / scaling.factor + t * inv_freq


def apply_rope(x, positions, max_wavelength: float = 10_000.0,
               scaling: RopeScaling | None = None):
  """Rotary position embedding (rotate-half form, as Hugging Face's Llama
  weights expect), computed in float32.

  Args:
    x: ``(B, S, N, H)``, H even.
    positions: ``(B, S)`` int: each token's position in its document, in the
      same token order as ``x``.
    max_wavelength: the RoPE base.
    scaling: Llama 3's or linear frequency scaling, or None.

  Returns:
    ``x`` rotated, in its dtype.
  """
  inv_freq = rope_frequencies(x.shape[-1], max_wavelength, scaling)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, S, H/2)
  sin, cos = jnp.sin(angle)[:, :, None], jnp.cos(angle)[:, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rms_norm(x, weight, *, eps: float, zero_centered: bool = False):
  """``x / sqrt(mean(x^2) + eps) * w`` over the last axis, in float32, cast
  back to ``x``'s dtype; ``w`` is ``weight``, or ``1 + weight`` when
  ``zero_centered`` (Gemma's form)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
  w = weight.astype(jnp.float32)
  return (x32 * (1.0 + w if zero_centered else w)).astype(x.dtype)


def constrain(x, logical_axes, rules: LogicalRules):
  """Sharding constraint from logical names, under the current mesh
  (``jax.set_mesh``); a dimension with fewer entries than its mesh axes
  have devices stays unsplit. A no-op without rules or without a mesh, so
  that the same code runs on one device. The layers place activations by these
  constraints, so the mesh's axes must be Auto (a ``ValueError`` names the
  Explicit ones)."""
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return x
  explicit = layout.explicit_axes(mesh)
  if explicit:
    raise ValueError(
        f"jax_ring's Flax layers and models shard by logical-axis rules, "
        f"which need mesh axes of type Auto; the mesh in scope has Explicit "
        f"axes {explicit}: make it with jax.make_mesh(..., "
        f"axis_types=(jax.sharding.AxisType.Auto,) * {len(mesh.axis_names)})")
  table = dict(rules)
  spec = jax.sharding.PartitionSpec(*(
      _fewer(table.get(a), n, mesh) for a, n in zip(logical_axes, x.shape)))
  return jax.lax.with_sharding_constraint(x, spec)


def split_devices(logical_axis: str, size: int, rules: LogicalRules) -> int:
  """How many devices :func:`constrain` splits a dimension of ``size``
  named ``logical_axis`` over, under the mesh in scope (1: it stays
  whole)."""
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return 1
  axes = _fewer(dict(rules).get(logical_axis), size, mesh)
  names = () if axes is None else axes if isinstance(axes, tuple) else (
      axes,)
  return math.prod(mesh.shape[a] for a in names)


def _fewer(axes, size: int, mesh):
  """``axes`` for a dimension of ``size``, or None where it has fewer
  entries than they have devices (a decode step's one token over the
  context axis): such a split leaves devices holding only padding, and
  turns each reduction over the others into a masked one plus a
  collective; replicated, every device computes it whole."""
  if axes is None:
    return None
  names = axes if isinstance(axes, tuple) else (axes,)
  return None if size < math.prod(mesh.shape[a] for a in names) else axes


def sharded_param(rngs, init, shape, axes, config):
  """An ``nnx.Param`` initialised by ``init`` in ``config.param_dtype`` and
  annotated with its logical ``axes`` under ``config.param_rules`` (else
  ``config.rules``); a plain one when ``config.rules`` is empty."""
  value = init(rngs.params(), shape, config.param_dtype)
  if not config.rules:
    return nnx.Param(value)
  rules = config.rules if config.param_rules is None else config.param_rules
  return nnx.Param(value, out_sharding=axes, sharding_rules=rules)


class Attention(nnx.Module):
  """Multi-head attention with RoPE, GQA, causal/packed/sliding masks and
  soft cap, context-parallel through ``jax_ring.dot_product_attention``.

  Parameters (logical axes):

  ======  ===========  ==========================
  name    shape        axes
  ======  ===========  ==========================
  wq      (E, N, H)    (embed, heads, head_dim)
  wk, wv  (E, K, H)    (embed, kv_heads, head_dim)
  wo      (N, H, E)    (heads, head_dim, embed)
  bq      (N, H)       (heads, head_dim), if qkv_bias
  bk, bv  (K, H)       (kv_heads, head_dim), if qkv_bias
  q_norm  (H,)         (head_dim,), if qk_norm
  k_norm  (H,)         (head_dim,), if qk_norm
  ======  ===========  ==========================

  Example (mesh data=2 x context=4, inputs in the dual-chunk layout, see
  ``jax_ring.flax.prepare_lm_batch``)::

    cfg = AttentionLayerConfig(
        embed_dim=256, num_heads=8, num_kv_heads=2, head_dim=32,
        context_parallel=jax_ring.ContextParallel(axis="context"),
        rules=logical_rules(batch="data", length="context"))
    with jax.set_mesh(mesh):
      layer = Attention(cfg, rngs=nnx.Rngs(0))
      y = layer(x, positions, segment_ids)
  """

  def __init__(self, config: AttentionLayerConfig, *, rngs: nnx.Rngs):
    self.config = config
    e, n, k, h = (config.embed_dim, config.num_heads, config.num_kv_heads,
                  config.head_dim)
    qkv_init = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))
    out_init = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=2)
    param = lambda init, shape, axes: sharded_param(rngs, init, shape, axes,
                                                    config)
    self.wq = param(qkv_init, (e, n, h), (EMBED, HEADS, HEAD_DIM))
    self.wk = param(qkv_init, (e, k, h), (EMBED, KV_HEADS, HEAD_DIM))
    self.wv = param(qkv_init, (e, k, h), (EMBED, KV_HEADS, HEAD_DIM))
    self.wo = param(out_init, (n, h, e), (HEADS, HEAD_DIM, EMBED))
    if config.qkv_bias:
      zeros = jax.nn.initializers.zeros
      self.bq = param(zeros, (n, h), (HEADS, HEAD_DIM))
      self.bk = param(zeros, (k, h), (KV_HEADS, HEAD_DIM))
      self.bv = param(zeros, (k, h), (KV_HEADS, HEAD_DIM))
    if config.qk_norm:
      norm_init = (jax.nn.initializers.zeros if config.zero_centered_norm
                   else jax.nn.initializers.ones)
      self.q_norm = param(norm_init, (h,), (HEAD_DIM,))
      self.k_norm = param(norm_init, (h,), (HEAD_DIM,))
    if config.sinks:
      self.sinks = param(jax.nn.initializers.zeros, (n,), (HEADS,))

  def __call__(self, x, positions, segment_ids=None):
    """Attention of the tokens ``x`` over themselves.

    Args:
      x: ``(B, S, E)``.
      positions: ``(B, S)`` int, RoPE positions in ``x``'s token order
        (restarting at 0 per packed document).
      segment_ids: ``(B, S)`` int or None: packed documents; a token attends
        only within its id.

    Returns:
      ``(B, S, E)`` in ``config.dtype``.
    """
    return self.output(self.attend(*self.project(x, positions),
                                   segment_ids))

  # __call__'s stages, apart so that a model can remat the projections alone.

  def project(self, x, positions):
    """``x (B, S, E)`` -> q ``(B, S, N, H)``, k, v ``(B, S, K, H)``, with
    bias, q/k norms and RoPE. A ``ValueError`` names an ``x`` or
    ``positions`` of another shape or kind."""
    cfg = self.config
    positions = _check_inputs(x, positions, cfg.embed_dim)
    dt = cfg.dtype
    x = constrain(x.astype(dt), (BATCH, LENGTH, EMBED), cfg.rules)
    q = dense(self, "wq", "bse,enh->bsnh", x, dt)
    k = dense(self, "wk", "bse,ekh->bskh", x, dt)
    v = dense(self, "wv", "bse,ekh->bskh", x, dt)
    if cfg.qkv_bias:
      q, k, v = (y + b[...].astype(dt)
                 for y, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
    if cfg.qk_norm:
      q, k = (rms_norm(y, w[...], eps=cfg.qk_norm_eps,
                       zero_centered=cfg.zero_centered_norm)
              for y, w in ((q, self.q_norm), (k, self.k_norm)))
    q = apply_rope(q, positions, cfg.rope_max_wavelength, cfg.rope_scaling)
    k = apply_rope(k, positions, cfg.rope_max_wavelength, cfg.rope_scaling)
    q = constrain(q, (BATCH, LENGTH, HEADS, HEAD_DIM), cfg.rules)
    k = constrain(k, (BATCH, LENGTH, KV_HEADS, HEAD_DIM), cfg.rules)
    v = constrain(v, (BATCH, LENGTH, KV_HEADS, HEAD_DIM), cfg.rules)
    return q, k, v

  def attend(self, q, k, v, segment_ids=None, context_parallel=None):
    """``jax_ring.dot_product_attention`` with the layer's options, ``(B, S,
    N, H)``; ``context_parallel`` (if given) in place of the config's."""
    cfg = self.config
    return dot_product_attention(
        q, k, v, is_causal=cfg.is_causal, segment_ids=segment_ids,
        scale=cfg.scale, logits_soft_cap=cfg.logits_soft_cap,
        local_window_size=cfg.local_window_size,
        implementation=cfg.implementation,
        sinks=self.sinks[...].astype(jnp.float32) if cfg.sinks else None,
        context_parallel=context_parallel or cfg.context_parallel)

  def decode(self, q, k, v, query_positions, key_positions,
             kv_layout="bskh", implementation=None):
    """``jax_ring.decode_attention`` with the layer's options (its window,
    scale, soft cap, sinks and context parallelism): ``q (B, T, N, H)``
    against a cache ``k``, ``v`` whose slots hold ``key_positions``;
    ``(B, T, N, H)``. ``implementation``: decode_attention's."""
    cfg = self.config
    return decode_attention(
        q, k, v, query_positions=query_positions,
        key_positions=key_positions, is_causal=cfg.is_causal,
        local_window_size=cfg.local_window_size, scale=cfg.scale,
        logits_soft_cap=cfg.logits_soft_cap,
        sinks=self.sinks[...].astype(jnp.float32) if cfg.sinks else None,
        context_parallel=cfg.context_parallel, kv_layout=kv_layout,
        implementation=implementation)

  def output(self, out):
    """``(B, S, N, H)`` -> ``(B, S, E)``: the output projection."""
    cfg = self.config
    y = dense(self, "wo", "bsnh,nhe->bse", out, cfg.dtype)
    return constrain(y, (BATCH, LENGTH, EMBED), cfg.rules)


def _check_inputs(x, positions, embed_dim: int):
  """``x (B, S, embed_dim)`` float and ``positions (B, S)`` int (an
  array, or nested lists of ints); returns ``positions`` as an array."""
  shape = tuple(jnp.shape(x))
  if len(shape) != 3 or shape[2] != embed_dim:
    raise ValueError(f"jax_ring.flax.Attention: x must be (B, S, "
                     f"embed_dim={embed_dim}); got {shape}")
  if isinstance(positions, (list, tuple)):
    try:
      positions = jnp.asarray(positions)
    except (TypeError, ValueError) as e:
      raise ValueError(f"jax_ring.flax.Attention: positions must be an int "
                       f"array of x's (B, S) = {shape[:2]}; got a "
                       f"{type(positions).__name__} that is not one ({e})"
                       ) from None
  p_shape, p_dtype = tuple(jnp.shape(positions)), jnp.result_type(positions)
  if p_shape != shape[:2] or not jnp.issubdtype(p_dtype, jnp.integer):
    raise ValueError(f"jax_ring.flax.Attention: positions must be an int "
                     f"array of x's (B, S) = {shape[:2]}; got {p_dtype} "
                     f"{p_shape}")
  return positions
