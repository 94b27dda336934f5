"""The language-model loss: mean next-token cross-entropy, over the whole
vocabulary or over chunks of it.

Chunked, the logits ``z = soft_cap(x W)`` are taken ``chunk`` vocabulary
entries at a time with a running logsumexp, so that at most ``(B, S,
chunk)`` of them are live. Its gradient is written out (a custom VJP), in
one of two forms chosen by whether the output weights ``W`` are being
differentiated (``jax.custom_vjp``'s symbolic zeros say so at trace time):

- ``W`` trained: the forward takes one product a chunk (``x W_c``); the
  backward recomputes it and takes ``dx`` and ``dW_c`` from
  ``d = g (softmax(z) - onehot(label)) z'``: four products a chunk.
- ``W`` frozen (LoRA; a frozen head): the forward also sums
  ``sum_v p_v z'_v W_v`` over the chunks as it goes (``p`` the softmax, kept
  with the running maximum), so the backward is elementwise:
  ``dx = g (sum_v p_v z'_v W_v - z'_label W_label)``. Two products a chunk
  in place of three (the forward, the recompute and ``dx``).

``z'`` is the soft cap's slope ``1 - tanh(y / cap)^2`` (1 without a cap).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_ring.flax.attention import EMBED, constrain
from jax_ring.models.decoder import VOCAB, Decoder, soft_cap

_LOW = -1e30  # padded vocabulary entries: finite, so gradients stay 0


def lm_loss(model: Decoder, batch, *, vocab_chunk: int | None = None
            ) -> jax.Array:
  """Mean next-token cross-entropy over ``batch.loss_mask``, for a
  ``jax_ring.flax.LMBatch`` in any token layout (a masked mean does not
  depend on the order, so nothing is reordered back).

  Args:
    model: the :class:`Decoder`.
    batch: its ``inputs``, ``positions``, ``segment_ids``, ``labels`` and
      ``loss_mask`` (``(B, S)`` each).
    vocab_chunk: None: the float32 logits ``(B, S, V)`` are made whole.
      An int: the vocabulary is taken this many entries at a time, with a
      running logsumexp, and at most ``(B, S, vocab_chunk)`` logits are
      live (at 64k tokens and Llama 3's 128256 entries, 33.6 GB whole in
      float32). Its backward recomputes each chunk's logits where the
      output weights are trained; where they are frozen (LoRA) the forward
      gathers the hidden states' gradient as it goes, and nothing is
      recomputed.
  """
  if vocab_chunk is not None and (not isinstance(vocab_chunk, int)
                                  or vocab_chunk < 1):
    raise ValueError(f"vocab_chunk must be None or a positive int; got "
                     f"{vocab_chunk!r}")
  if vocab_chunk is None:
    logits = model(batch.inputs, batch.positions, batch.segment_ids)
    target = jnp.take_along_axis(logits, batch.labels[..., None], -1)[..., 0]
    ce = jax.nn.logsumexp(logits, -1) - target
  else:
    cfg = model.cfg
    x = model.hidden_states(batch.inputs, batch.positions, batch.segment_ids)
    ce = chunked_cross_entropy(x, model.output_weights().astype(x.dtype),
                               batch.labels, vocab_chunk, cfg.rules,
                               cfg.final_logits_soft_cap)
  mask = batch.loss_mask
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def chunked_cross_entropy(x, w, labels, chunk: int, rules=(), cap=None):
  """``logsumexp(z) - z[label]`` per token, ``(B, S)`` float32, with ``z =
  soft_cap(x @ w, cap)`` over vocabulary chunks of ``chunk`` entries (the
  last one padded). ``x (B, S, E)``, ``w (E, V)`` of ``x``'s dtype,
  ``labels (B, S)`` int; a label outside ``[0, V)`` adds no target."""
  spec = _Spec(w.shape[1], chunk, rules, cap)

  @jax.custom_vjp
  def ce(x, w, labels):
    lse, target, _ = _forward(spec, x, w, labels, False)
    return lse - target

  def ce_fwd(x, w, labels):
    frozen = not w.perturbed
    x, w, labels = x.value, w.value, labels.value
    lse, target, dx_unit = _forward(spec, x, w, labels, frozen)
    return lse - target, ((dx_unit,) if frozen else (x, w, labels, lse))

  def ce_bwd(res, g):
    if isinstance(g, SymbolicZero):
      return None, None, None
    if len(res) == 1:  # the output weights frozen
      (dx_unit,) = res
      return (g[..., None] * dx_unit).astype(x.dtype), None, None
    return (*_backward(spec, *res, g), None)

  ce.defvjp(ce_fwd, ce_bwd, symbolic_zeros=True)
  return ce(x, w, labels)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """The vocabulary ``v``, its ``chunk``, the logits' sharding ``rules``
  and soft ``cap``."""
  v: int
  chunk: int
  rules: tuple
  cap: float | None

  @property
  def n(self) -> int:
    return -(-self.v // self.chunk)

  def chunks(self, w):
    """``w (E, V)`` padded to ``(n, E, chunk)``, with each chunk's first
    entry ``(n,)``."""
    e = w.shape[0]
    w = jnp.pad(w, ((0, 0), (0, self.n * self.chunk - self.v)))
    starts = jnp.arange(self.n, dtype=jnp.int32) * self.chunk
    return jnp.moveaxis(w.reshape(e, self.n, self.chunk), 1, 0), starts

  def logits(self, x, wc, start):
    """The chunk's ``z`` (``_LOW`` past the vocabulary) and ``z'``."""
    y = constrain((x @ wc).astype(jnp.float32), ("batch", "length", VOCAB),
                  self.rules)
    z = soft_cap(y, self.cap)
    slope = 1.0 if self.cap is None else 1.0 - jnp.square(z / self.cap)
    ids = start + jnp.arange(self.chunk, dtype=jnp.int32)
    return jnp.where(ids < self.v, z, _LOW), slope

  def at_label(self, values, labels, start):
    """``values[..., label - start]`` where the label is in the chunk, else
    0."""
    local = labels - start
    hit = jnp.take_along_axis(
        values, jnp.clip(local, 0, self.chunk - 1)[..., None], -1)[..., 0]
    return jnp.where((local >= 0) & (local < self.chunk) & (labels < self.v),
                     hit, 0.0)


def _forward(spec: _Spec, x, w, labels, gather_dx: bool):
  """``(lse, target, dx_unit)``: ``dx_unit`` (``gather_dx`` only, else
  None) is ``d ce / dx`` for a unit cotangent, float32."""
  def step(carry, chunk_in):
    m, total, target, slope_at, acc = carry
    wc, start = chunk_in
    z, slope = spec.logits(x, wc, start)
    # The running maximum only keeps exp() in range.
    new_m = jnp.maximum(m, z.max(-1))
    scale = jnp.exp(m - new_m)
    p = jnp.exp(z - new_m[..., None])
    total = total * scale + p.sum(-1)
    target = target + spec.at_label(z, labels, start)
    if gather_dx:
      if spec.cap is not None:
        slope_at = slope_at + spec.at_label(slope, labels, start)
      acc = acc * scale[..., None] + constrain(
          jnp.einsum("bsc,ec->bse", (p * slope).astype(x.dtype), wc,
                     preferred_element_type=jnp.float32),
          ("batch", "length", EMBED), spec.rules)
    return (new_m, total, target, slope_at, acc), None

  zeros = jnp.zeros(labels.shape, jnp.float32)
  acc = jnp.zeros(x.shape if gather_dx else (), jnp.float32)
  slope_at = zeros if spec.cap is not None else jnp.ones((), jnp.float32)
  (m, total, target, slope_at, acc), _ = jax.lax.scan(
      step, (jnp.full(labels.shape, _LOW), zeros, zeros, slope_at, acc),
      spec.chunks(w))
  lse = m + jnp.log(total)
  if not gather_dx:
    return lse, target, None
  # The label's own term, - z'_label W_label.
  valid = ((labels >= 0) & (labels < spec.v))[..., None]
  w_label = jnp.take(w, jnp.clip(labels, 0, spec.v - 1), axis=1)  # (E, B, S)
  w_label = jnp.moveaxis(w_label, 0, -1).astype(jnp.float32)
  return lse, target, acc / total[..., None] - jnp.where(
      valid, slope_at[..., None] * w_label, 0.0)


def _backward(spec: _Spec, x, w, labels, lse, g):
  """``(dx, dw)`` from ``d = g (softmax(z) - onehot(label)) z'``, the
  chunks' logits recomputed."""
  def step(dx, chunk_in):
    wc, start = chunk_in
    z, slope = spec.logits(x, wc, start)
    onehot = ((jnp.arange(spec.chunk) == (labels - start)[..., None])
              & (labels < spec.v)[..., None])
    d = ((jnp.exp(z - lse[..., None]) - onehot) * slope
         * g[..., None]).astype(x.dtype)
    dx = dx + jnp.einsum("bsc,ec->bse", d, wc,
                         preferred_element_type=jnp.float32)
    return dx, jnp.einsum("bse,bsc->ec", x, d,
                          preferred_element_type=jnp.float32)

  dx, dw = jax.lax.scan(step, jnp.zeros(x.shape, jnp.float32),
                        spec.chunks(w))
  dw = jnp.moveaxis(dw, 0, 1).reshape(w.shape[0], -1)[:, :spec.v]
  return dx.astype(x.dtype), dw.astype(w.dtype)
