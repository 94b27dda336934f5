"""One decoder for Llama 2/3, Qwen2/2.5, Mistral, Qwen3, Gemma 2 and Gemma 3
(text) in Flax NNX, built on :class:`jax_ring.flax.Attention`, so that its
attention runs on one device or context-parallel from one config field;
:class:`~jax_ring.models.config.DecoderConfig` says what each family adds.

Shapes::

  B batch, S sequence (in the batch's token layout), E hidden size,
  M MLP width, V vocabulary, N query heads, K kv heads, H head dim

Parameters (logical axes; ``jax_ring.flax.logical_rules`` names the first
six, ``model_rules`` adds ``mlp``, ``vocab`` and ``norm``), with their
Hugging Face tensors (``L.`` is ``model.layers.i.``, T transposed, the
``(E, N*H)`` side split into heads):

========================  =======  =======================================
name                      shape    Hugging Face tensor
========================  =======  =======================================
embed                     (V, E)   model.embed_tokens.weight
layers[i].attn_norm       (E,)     L.input_layernorm.weight
layers[i].attn.wq         (E,N,H)  L.self_attn.q_proj.weight, T
layers[i].attn.wk, wv     (E,K,H)  L.self_attn.k_proj.weight, v_proj, T
layers[i].attn.wo         (N,H,E)  L.self_attn.o_proj.weight, T
layers[i].attn.bq, bk, bv (N,H)    L.self_attn.q_proj.bias, ... (Qwen2)
layers[i].attn.q_norm, k  (H,)     L.self_attn.q_norm.weight, ... (Qwen3,
                                   Gemma 3)
layers[i].attn_post_norm  (E,)     L.post_attention_layernorm.weight
                                   (Gemma)
layers[i].mlp_norm        (E,)     L.post_attention_layernorm.weight;
                                   L.pre_feedforward_layernorm (Gemma)
layers[i].mlp_post_norm   (E,)     L.post_feedforward_layernorm (Gemma)
layers[i].mlp.w_gate      (E, M)   L.mlp.gate_proj.weight, T
layers[i].mlp.w_up        (E, M)   L.mlp.up_proj.weight, T
layers[i].mlp.w_down      (M, E)   L.mlp.down_proj.weight, T
final_norm                (E,)     model.norm.weight
unembed                   (E, V)   lm_head.weight, T (absent when tied)
========================  =======  =======================================

Reading and writing Hugging Face checkpoints is in ``hf_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ring._src import cp_dispatch
from jax_ring.flax.attention import (EMBED, Attention, constrain, rms_norm,
                                     sharded_param)
from jax_ring.flax.lora import dense
from jax_ring.models.config import DecoderConfig


MLP, VOCAB, NORM = "mlp", "vocab", "norm"
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


class RMSNorm(nnx.Module):
  """``x / sqrt(mean(x^2) + eps) * w``, in float32, with ``w`` the scale,
  or ``1 + scale`` (initialised to 0) under ``cfg.zero_centered_norm``."""

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    init = (jax.nn.initializers.zeros if cfg.zero_centered_norm else
            jax.nn.initializers.ones)
    self.scale = sharded_param(rngs, init, (cfg.hidden_size,), (NORM,), cfg)
    self.eps, self.dtype = cfg.rms_norm_eps, cfg.dtype
    self.zero_centered = cfg.zero_centered_norm

  def __call__(self, x):
    return rms_norm(x, self.scale[...], eps=self.eps,
                    zero_centered=self.zero_centered).astype(self.dtype)


class GatedMLP(nnx.Module):
  """``(act(x W_gate) * x W_up) W_down``: SwiGLU with ``silu``, GeGLU with
  a GeLU (``cfg.hidden_act``)."""

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    init = jax.nn.initializers.lecun_normal()
    e, m = cfg.hidden_size, cfg.intermediate_size
    self.w_gate = sharded_param(rngs, init, (e, m), (EMBED, MLP), cfg)
    self.w_up = sharded_param(rngs, init, (e, m), (EMBED, MLP), cfg)
    self.w_down = sharded_param(rngs, init, (m, e), (MLP, EMBED), cfg)
    self.cfg = cfg

  def __call__(self, x):
    dt, rules = self.cfg.dtype, self.cfg.rules
    act = ACTIVATIONS[self.cfg.hidden_act]
    h = (act(dense(self, "w_gate", "bse,em->bsm", x, dt))
         * dense(self, "w_up", "bse,em->bsm", x, dt))
    h = constrain(h, ("batch", "length", MLP), rules)
    return constrain(dense(self, "w_down", "bsm,me->bse", h, dt),
                     ("batch", "length", EMBED), rules)


class Block(nnx.Module):
  """A decoder block: attention, then the gated MLP, each in a residual
  branch that opens with a norm and, under ``cfg.sandwich_norm``, closes
  with one too (Gemma's)."""

  def __init__(self, cfg: DecoderConfig, layer: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg, rngs=rngs)
    self.attn = Attention(cfg.attention(layer), rngs=rngs)
    self.mlp_norm = RMSNorm(cfg, rngs=rngs)
    self.mlp = GatedMLP(cfg, rngs=rngs)
    if cfg.sandwich_norm:
      self.attn_post_norm = RMSNorm(cfg, rngs=rngs)
      self.mlp_post_norm = RMSNorm(cfg, rngs=rngs)
    self.sandwich = cfg.sandwich_norm

  def __call__(self, x, positions, segment_ids, context_parallel=None):
    out = self.attn.attend(*self.project(x, positions), segment_ids,
                           context_parallel)
    return self.finish(x, out)

  def project(self, x, positions):
    return self.attn.project(self.attn_norm(x), positions)

  def finish(self, x, out):
    """The block after its attention: ``x`` plus the output projection of
    ``out``, then the MLP with its residual."""
    return self.mlp_residual(self.attn_residual(x, out))

  def attn_residual(self, x, out):
    """``x`` plus the output projection of the attention's ``out``."""
    y = self.attn.output(out)
    return x + (self.attn_post_norm(y) if self.sandwich else y)

  def mlp_residual(self, x):
    """``x`` plus the MLP of its norm."""
    y = self.mlp(self.mlp_norm(x))
    return x + (self.mlp_post_norm(y) if self.sandwich else y)


class Decoder(nnx.Module):
  """Token ids ``(B, S)`` -> logits ``(B, S, V)`` float32 (``Llama`` is the
  same class).

  Example (one device)::

    model = Decoder(DecoderConfig(vocab_size=256, hidden_size=64,
                                  intermediate_size=128, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=16),
                    rngs=nnx.Rngs(0))
    logits = model(tokens, positions)          # positions: (B, S) int

  With ``context_parallel`` and ``rules`` set, build and call it under
  ``jax.set_mesh(mesh)`` on batches from ``jax_ring.flax.prepare_lm_batch``
  (their token order is the load-balance layout; positions travel with the
  tokens, and restart at 0 per packed document as Hugging Face's
  ``position_ids`` do).
  """

  def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = jax.nn.initializers.normal(0.02)
    self.embed = sharded_param(rngs, init, (cfg.vocab_size, cfg.hidden_size),
                               (VOCAB, EMBED), cfg)
    self.layers = nnx.List([Block(cfg, i, rngs=rngs)
                            for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.unembed = sharded_param(rngs, init,
                                   (cfg.hidden_size, cfg.vocab_size),
                                   (EMBED, VOCAB), cfg)

  def embed_tokens(self, inputs):
    """Token ids ``(B, S)`` -> ``(B, S, E)`` in ``cfg.dtype``."""
    cfg = self.cfg
    # The table as the activations' rules lay it out (whole, under FSDP):
    # a lookup into an embed-sharded table would be replicated first.
    table = constrain(self.embed[...], (VOCAB, EMBED), cfg.rules)
    x = jnp.take(table, inputs, axis=0).astype(cfg.dtype)
    if cfg.scale_embeddings:  # sqrt(E) rounded to the dtype, as Gemma's
      x = x * jnp.asarray(math.sqrt(cfg.hidden_size), cfg.dtype)
    return x

  def hidden_states(self, inputs, positions, segment_ids=None):
    """``(B, S, E)`` after the final norm, in ``cfg.dtype``, in the token
    order of ``inputs``.

    Natural-order inputs to a context-parallel model whose
    ``ContextParallel`` has a load-balance layout (``inputs="natural"``,
    the default) are laid out once here, the activations, positions and
    segment ids together, and every layer's attention takes them as laid
    out; the final hidden states go back to natural order. Each layer then
    permutes nothing (its attention alone would permute q, k, v and ids
    and its output back, in the forward and again in the backward)."""
    cfg = self.cfg
    x = constrain(self.embed_tokens(inputs), ("batch", "length", EMBED),
                  cfg.rules)
    into, back, cp = _carried_layout(cfg.context_parallel, x.shape[1])
    x, positions = into(x), into(positions)
    segment_ids = _map_ids(into, segment_ids)
    step = lambda remat, block, x, pick=None: _run_block(
        remat, block, x, positions, segment_ids, cp, pick)
    split = len(self.layers) - cfg.remat_skip
    blocks = list(self.layers)[:split]
    if groups := cfg.scanned_groups():
      x, blocks = _scan_blocks(blocks, cfg.layer_period(), groups,
                               functools.partial(step, cfg.remat), x,
                               in_place=bool(cfg.remat))
    for block in blocks:
      x = step(cfg.remat, block, x)
    for block in list(self.layers)[split:]:  # remat_skip: kept whole
      x = step(False, block, x)
    return back(self.final_norm(x))

  def output_weights(self):
    """``(E, V)``: ``unembed``, or ``embed`` transposed when tied."""
    if self.cfg.tie_word_embeddings:
      return self.embed[...].T
    return self.unembed[...]

  def __call__(self, inputs, positions, segment_ids=None):
    """Args: inputs ``(B, S)`` int token ids; positions ``(B, S)`` int;
    segment_ids ``(B, S)`` int packed-document ids or None."""
    logits = self.logits(self.hidden_states(inputs, positions, segment_ids))
    return constrain(logits, ("batch", "length", VOCAB), self.cfg.rules)

  def logits(self, x):
    """Final hidden states ``(..., E)`` -> float32 logits ``(..., V)``
    (soft-capped where the family caps them)."""
    cfg = self.cfg
    logits = (x @ self.output_weights().astype(cfg.dtype)).astype(jnp.float32)
    return soft_cap(logits, cfg.final_logits_soft_cap)


def _carried_layout(cp, length: int):
  """``(into, back, cp')``: for natural-order inputs of a ``cp`` that
  permutes them (``cp.permutes``) on the mesh in scope, the permutations
  into its layout and back along axis 1 (the attention's own) and ``cp``
  with ``inputs="load_balanced"``; else identities and None, the layers
  using their own config: also where ``length`` is not a multiple of two
  chunks a device (the attention pads such a length before it permutes)."""
  same = lambda x: x
  mesh = jax.sharding.get_abstract_mesh()
  if cp is None or not cp.permutes or mesh.empty or any(
      a not in mesh.axis_names for a in cp.axes):
    return same, same, None  # the attention permutes (or names the error)
  if length % (2 * math.prod(mesh.shape[a] for a in cp.axes)):
    return same, same, None
  into, back = cp_dispatch.permutations(cp, mesh)
  return into, back, dataclasses.replace(cp, inputs="load_balanced")


def _map_ids(f, segment_ids):
  """``f`` on segment ids: None, one array, or a (query, key) pair."""
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    return type(segment_ids)(f(s) for s in segment_ids)
  return f(segment_ids)


def _run_block(remat, block: Block, x, positions, segment_ids, cp=None,
               pick=None):
  """One block on ``x (B, S, E)``, recomputing in the backward what
  ``remat`` (``DecoderConfig.remat``) says; ``cp``: the attention's
  ``ContextParallel`` in place of the layer's own, or None; ``pick``: a
  :class:`_Pick` of some of the block's weights (with ``remat``)."""
  r = functools.partial(_remat, pick=pick)
  if remat in ("attention", "attention_residual"):
    q, k, v = r(lambda b, *a: b.project(*a), block, x, positions)
    out = block.attn.attend(q, k, v, segment_ids, cp)
    if remat == "attention":
      return r(lambda b, *a: b.finish(*a), block, x, out)
    x = r(lambda b, *a: b.attn_residual(*a), block, x, out)
    return r(lambda b, *a: b.mlp_residual(*a), block, x)
  if remat:
    return r(lambda b, *a: b(*a, context_parallel=cp), block, x, positions,
             segment_ids)
  return block(x, positions, segment_ids, cp)


class _Pick(typing.NamedTuple):
  """The weights of ``which`` (an nnx filter) of one scanned block: group
  ``index``'s of ``states``, one ``nnx.State`` a group."""
  which: typing.Any
  index: jax.Array
  states: list

  def state(self):
    """Group ``index``'s state: a ``lax.switch`` (a copy of one block's
    weights), not a slice of weights stacked beforehand."""
    return jax.lax.switch(self.index,
                          [lambda s=s: s for s in self.states])


def _remat(fn, block: Block, *args, pick: _Pick | None = None):
  """``fn(block, *args)`` under ``jax.checkpoint``. Only the block's random
  streams' counts (LoRA dropout) come back out: its weights are read, never
  written (``nnx.remat`` would write them all back, which fails for weights
  of an outer trace, such as frozen ones beside trained adapters). With
  ``pick``, its weights are picked inside the checkpoint, so that the
  backward picks them again rather than keeping each group's copy."""
  if pick is None:
    graph, state = nnx.split(block)
    merge = lambda state: nnx.merge(graph, state)
  else:
    graph, _, state = nnx.split(block, pick.which, ...)
    merge = lambda state: nnx.merge(graph, pick.state(), state)

  def pure(state, *args):
    inner = merge(state)
    return fn(inner, *args), nnx.state(inner, nnx.RngState)

  out, rng_state = jax.checkpoint(pure)(state, *args)
  nnx.update(block, rng_state)
  return out


def _scan_blocks(blocks: list, period: int, groups: int, step, x,
                 in_place: bool = False):
  """``(x, the blocks left)``: ``step(block, x, pick)`` over the first
  ``groups`` (``DecoderConfig.scanned_groups()``) groups of ``period``
  blocks as one ``lax.scan`` whose body runs one group, over the groups'
  weights stacked here, at each call (a copy of those weights; their
  gradients unstack in the backward). The blocks past the last group are
  left to the caller.

  ``in_place`` (``step`` rematerialises, passing ``pick`` to ``_remat``):
  the frozen base weights of blocks with LoRA adapters (``nnx.Param``
  beside ``nnx.LoRAParam``) are not stacked; each checkpointed part of a
  block picks its group's from the blocks themselves (a
  :class:`_Pick`), in the forward and again in the backward, so no copy
  of the base outlives a block's step (a frozen 8B base: 16 GB less)."""
  lora = in_place and bool(jax.tree.leaves(nnx.state(blocks[0],
                                                     nnx.LoRAParam)))
  frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)) if lora \
      else nnx.Nothing
  graphs, kept, stacked = [], [], []
  for j in range(period):  # the j-th block of every group
    split = [nnx.split(blocks[g * period + j], frozen, ...)
             for g in range(groups)]
    graphs.append(split[0][0])
    kept.append([s for _, s, _ in split])
    stacked.append(jax.tree.map(lambda *w: jnp.stack(w),
                                *(rest for _, _, rest in split)))

  def body(x, xs):
    index, group = xs
    rng_states = []
    for graph, states, rest in zip(graphs, kept, group):
      pick = _Pick(frozen, index, states) if lora else None
      # Outside the checkpointed parts (the attention's sinks), the block
      # reads the picked weights as any others.
      block = nnx.merge(graph, pick.state() if pick else states[0], rest)
      x = step(block, x, pick)
      rng_states.append(nnx.state(block, nnx.RngState))
    return x, rng_states

  # A block's random streams (LoRA dropout) count their draws: the counts
  # come back out of the scan, so that the next call draws afresh, as the
  # unscanned blocks do.
  x, rng_states = jax.lax.scan(body, x, (jnp.arange(groups), stacked))
  for j, states in enumerate(rng_states):
    for g in range(groups):
      nnx.update(blocks[g * period + j], jax.tree.map(lambda s: s[g], states))
  return x, blocks[groups * period:]


def soft_cap(logits, cap: float | None):
  """``cap * tanh(logits / cap)``; ``logits`` when ``cap`` is None."""
  return logits if cap is None else cap * jnp.tanh(logits / cap)
