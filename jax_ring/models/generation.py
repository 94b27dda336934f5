"""Generation for :class:`~jax_ring.models.Decoder`: a prefill that fills a
KV cache where its tokens already are, and a decode step compiled once per
batch shape and cache size, its cache donated and updated in place.

Shapes: B rows, P prompt slots (the longest prompt, padded to a multiple
of 2 D), D devices the sequence is split over (1 without context
parallelism), C = D * L cache slots, L per device, K kv heads, H head dim,
V vocabulary.

**The cache** (:class:`KVCache`): per layer ``k (B, K, C, H)`` and ``v``,
kv-head-major (``decode_attention(kv_layout="bksh")``) so that a decode
step's two products over the cache read it as one batched matrix each, and
``positions (B, C)`` int32, the position of the token in each slot
(-1: empty), shared by the layers. Its slots are split over the context
axes as the model's tokens are: device d holds slots ``[d L, (d + 1) L)``.

* Prefill runs the model's forward over the prompts in the training layout
  (the ``ContextParallel``'s load balance): device d computes the K/V of
  its P / D prompt tokens, and they go to its own first P / D slots, with
  their positions; padding's slots stay empty. Nothing moves.
* Decode step t (0, 1, ...) writes every row's new token into device
  ``t mod D``, local slot ``P / D + t // D``: appends rotate over the
  devices, so each holds about as many tokens as the others and their
  reads stay balanced, and one append writes one slot of one device.
* Each layer's decode attention is :func:`jax_ring.decode_attention`,
  masked by the slots' positions (causal, the layer's window, its sinks):
  per layer and step, each device's B x N x (H + 2) float32 values are
  merged over the devices (one all-reduce for small batches); the cache
  never moves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_ring._src.core import registry
from jax_ring._src.strategies.layout import reorder_for_load_balance
from jax_ring.flax.attention import (BATCH, HEAD_DIM, KV_HEADS, LENGTH,
                                     constrain, split_devices)
from jax_ring.flax.data import reorder_size
from jax_ring.flax.lora import LoRA
from jax_ring.models.config import DecoderConfig
from jax_ring.models.decoder import Decoder
from jax_ring.models.sampling import Sampling, check_count, is_int


# Each device's slots are a multiple of this: XLA's GPU matrix products may
# pad a reduced length that is not, copying the whole cache at every layer
# and step (docs/decisions.md, "Decoding").
SLOT_ALIGN = 1024
# generate's decode steps a call: the host's cost of a call (its arguments
# and launches) is paid once for them (measured: docs/performance.md,
# "Decoding").
TOKENS_PER_CALL = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Every layer's cached keys and values and the slots' positions.

  Attributes:
    k: per layer ``(B, K, C, H)``.
    v: per layer ``(B, K, C, H)``.
    positions: ``(B, C)`` int32; -1 marks an empty slot.
    lengths: ``(B,)`` int32, each row's prompt length: decode step t's
      token is at position ``lengths + t``.
    prompt_slots: P / D, the slots of each device the prompt fills (static).
    devices: D, the pieces the slots are split into (static).
  """

  k: list
  v: list
  positions: jax.Array
  lengths: jax.Array
  prompt_slots: int = dataclasses.field(metadata=dict(static=True))
  devices: int = dataclasses.field(metadata=dict(static=True))

  @property
  def capacity(self) -> int:
    return self.positions.shape[1]


def _devices(cfg: DecoderConfig) -> int:
  """D: how many pieces the sequence is split into, on the mesh in scope
  (``jax.set_mesh``)."""
  cp = cfg.context_parallel
  if cp is None:
    return 1
  mesh = jax.sharding.get_abstract_mesh()
  missing = [a for a in cp.axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(
        f"the model is context-parallel over {cp.axis!r}, which the mesh in "
        f"scope {dict(mesh.shape)} lacks: generate under "
        f"jax.set_mesh(mesh), as the model is called")
  return math.prod(mesh.shape[a] for a in cp.axes)


def _layout(cfg: DecoderConfig, x, seq_axis=1):
  """``x`` in the model's token layout: its load balance where its
  ``ContextParallel`` takes ``inputs="load_balanced"``, else natural order
  (the attention permutes natural inputs itself)."""
  cp = cfg.context_parallel
  if cp is None or cp.load_balance is None or cp.inputs != "load_balanced":
    return x
  return reorder_for_load_balance(
      x, reorder_size(cp, jax.sharding.get_abstract_mesh()),
      seq_axis=seq_axis, layout=cp.load_balance)


def _cache_spec(cfg: DecoderConfig, x):
  """``x (B, S, K, H)`` -> the cache's ``(B, K, S, H)``, sharded as it."""
  return constrain(jnp.swapaxes(x, 1, 2), (BATCH, KV_HEADS, LENGTH, HEAD_DIM),
                   cfg.rules)


class _Graph:
  """A model's graph and the structure of its arrays, the static argument
  of the jitted prefill and step. Hashed once, and one object per graph
  (:meth:`of`), so that a call compares it by identity: a ``GraphDef``'s
  hash and an ``nnx.State``'s flattening walk the whole model, costing a
  decode step more host time than its launches."""

  _interned: dict = {}

  def __init__(self, graphdef, treedef):
    self.graphdef, self.treedef = graphdef, treedef
    self._hash = hash((graphdef, treedef))

  @classmethod
  def of(cls, graphdef, treedef) -> "_Graph":
    return cls._interned.setdefault((graphdef, treedef),
                                    cls(graphdef, treedef))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, _Graph) and (
        self.graphdef, self.treedef) == (other.graphdef, other.treedef))

  def merge(self, leaves) -> Decoder:
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("slots_per_device",))
def _prefill(graph: _Graph, leaves, tokens, positions, lengths, last, *,
             slots_per_device: int):
  """Forward over the prompts (layout order), the cache, and the logits
  of each row's token at layout index ``last (B,)``."""
  model = graph.merge(leaves)
  cfg = model.cfg
  b, p = tokens.shape
  d = _devices(cfg)
  x = model.embed_tokens(tokens)
  ks, vs = [], []
  for block in model.layers:
    q, k, v = block.project(x, positions)
    x = block.finish(x, block.attn.attend(q, k, v))
    ks.append(k)
    vs.append(v)
  x = model.final_norm(x)

  def place(y, fill=0):
    """``(B, P, ...)`` -> ``(B, C, ...)``: device d's P / D rows into its
    first slots."""
    rest = y.shape[2:]
    pieces = y.reshape((b, d, p // d) + rest)
    full = jnp.full((b, d, slots_per_device) + rest, fill, y.dtype)
    full = lax.dynamic_update_slice_in_dim(full, pieces, 0, 2)
    return full.reshape((b, d * slots_per_device) + rest)

  cache = KVCache([_cache_spec(cfg, place(k)) for k in ks],
                  [_cache_spec(cfg, place(v)) for v in vs],
                  place(jnp.where(positions < lengths[:, None], positions, -1),
                        -1), lengths, p // d, d)
  return model.logits(x[jnp.arange(b), last]), cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,),
                   static_argnames=("implementation",))
def _step(graph: _Graph, leaves, cache: KVCache, tokens, step, *,
          implementation=None):
  """Decode step ``step``: each row's ``tokens (B,)``, at position
  ``lengths + step``, appended in device ``step mod D``'s next slot; the
  next logits ``(B, V)`` and the cache."""
  model = graph.merge(leaves)
  d = _devices(model.cfg)
  slots = cache.capacity // d
  slot = (step % d) * slots + cache.prompt_slots + step // d
  positions = cache.lengths + step
  kv_pos = lax.dynamic_update_slice_in_dim(cache.positions,
                                           positions[:, None], slot, 1)
  x, rows = _two_rows(model.embed_tokens(tokens[:, None]), model.cfg)
  query_positions = jnp.repeat(positions[:, None], rows, 1)
  ks, vs = [], []
  for i, block in enumerate(model.layers):
    q, k, v = block.project(x, query_positions)
    k, v = (lax.dynamic_update_slice_in_dim(
        c[i], jnp.swapaxes(x[:, :1], 1, 2), slot, 2)
            for c, x in ((cache.k, k), (cache.v, v)))
    out = block.attn.decode(q, k, v, query_positions, kv_pos,
                            kv_layout="bksh", implementation=implementation)
    x = block.finish(x, out)
    ks.append(k)
    vs.append(v)
  x = model.final_norm(x)
  return model.logits(x[:, 0]), KVCache(ks, vs, kv_pos, cache.lengths,
                                          cache.prompt_slots, cache.devices)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,),
                   static_argnames=("implementation", "sampling", "count"))
def _steps_and_draw(graph: _Graph, leaves, cache: KVCache, tokens, step, key,
                    *, implementation=None, sampling: Sampling,
                    count: int = 1):
  """``count`` decode steps in one program: step ``step`` on ``tokens
  (B,)``, the next tokens drawn from its logits with the next of ``key``'s
  splits and fed to step ``step + 1``, and so on: ``(drawn (count, B),
  drawn[-1], cache, step + count, key)``, every one on the device (the
  last row apart, so that the next call takes it with no slicing call).
  A loop of static trip count, so the host launches the steps without
  waiting for any; the draws are those of ``count`` one-step calls."""

  def one(i, carry):
    cache, tokens, step, key, drawn = carry
    logits, cache = _step(graph, leaves, cache, tokens, step,
                          implementation=implementation)
    key, sub = jax.random.split(key)
    tokens = sampling.draw(logits, sub)
    return cache, tokens, step + 1, key, drawn.at[i].set(tokens)

  carry = (cache, tokens, step, key,
           jnp.zeros((count,) + tokens.shape, jnp.int32))
  # One step as it is: XLA keeps a loop of one trip.
  carry = one(0, carry) if count == 1 else lax.fori_loop(0, count, one, carry)
  cache, last, step, key, drawn = carry
  return drawn, last, cache, step, key


def _two_rows(x, cfg: DecoderConfig):
  """``x (B, 1, E)`` -> ``(x, 1)``; for B = 1, ``x`` and a zero row after
  it, ``((1, 2, E), 2)``: the step carries the spare row through every
  layer (its own query, never appended to the cache) and drops it at the
  logits. XLA:GPU lowers a product of one row with a matrix of under 10M
  elements (a 1B model's attention projections) as an elementwise product
  written out whole and then reduced, three passes over the weights and
  two kernels; with two rows it is a matrix product, one pass. The
  barrier keeps XLA from seeing that the spare row starts at zero.

  Not where the model's rules would split two rows (its ``length`` over
  two devices): each device would hold one row, and the layers would
  gather and reduce across them."""
  if x.shape[0] != 1 or split_devices(LENGTH, 2, cfg.rules) > 1:
    return x, 1
  return lax.optimization_barrier(jnp.pad(x, ((0, 0), (0, 1), (0, 0)))), 2


# The weights every layer casts to the compute dtype where it uses them
# (``w[...].astype(dtype)``); norm scales and biases are left as stored.
CAST_AT_USE = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                         "embed", "unembed"})


def _compute_copy(path, x, dtype):
  """``x`` in the compute ``dtype`` where the model casts it there at use
  and it is stored wider (float32 weights, bfloat16 compute): cast once,
  so that a decode step reads half the bytes, with the same numbers."""
  names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
  if (names & CAST_AT_USE and jnp.issubdtype(x.dtype, jnp.floating)
      and jnp.dtype(x.dtype).itemsize > jnp.dtype(dtype).itemsize):
    return x.astype(dtype)
  return x


class Generator:
  """A model's prefill and decode step. The model is split into its graph
  and its arrays once, here, so that each step is one compiled call (a
  module passed to a jitted function is traversed on every call). Use it
  as the model is used: under ``jax.set_mesh`` when it is context-parallel;
  the model's weights are read when it is made. ``decode_implementation``
  is the step's ``decode_attention(implementation=...)``."""

  def __init__(self, model: Decoder, *,
               decode_implementation: Literal["xla", "pallas"] | None = None):
    if decode_implementation not in (None, "xla", *registry.DECODE_KERNELS):
      raise ValueError(
          f"Generator: decode_implementation must be None, 'xla' or one of "
          f"{sorted(registry.DECODE_KERNELS)}; got {decode_implementation!r}")
    if any(isinstance(m, LoRA) and m.dropout_active()
           for _, m in nnx.iter_graph(model)):
      raise ValueError("Generator: the model's LoRA dropout is active (it "
                       "is in training mode): call model.eval() first")
    self.cfg = model.cfg
    self.decode_implementation = decode_implementation
    graphdef, state = nnx.split(model)
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: _compute_copy(path, x, model.cfg.dtype), state)
    self._leaves, treedef = jax.tree.flatten(state)
    self._graph = _Graph.of(graphdef, treedef)

  def prefill(self, prompts: Sequence[Sequence[int]], *,
              max_new_tokens: int):
    """The cache after the ``prompts`` (lists of token ids, of any
    lengths), with room for ``max_new_tokens`` more each (each device's
    slots rounded up to a multiple of ``SLOT_ALIGN``), and the logits
    ``(B, V)`` of each prompt's last token."""
    cfg = self.cfg
    try:
      lengths = np.array([len(p) for p in prompts], np.int32)
    except TypeError:
      raise TypeError(f"prompts must be a list of token-id lists; got "
                      f"{prompts!r:.80}") from None
    if not len(prompts) or lengths.min() < 1:
      raise ValueError(f"prompts must be a non-empty list of non-empty "
                       f"token lists; got lengths {lengths.tolist()}")
    for i, prompt in enumerate(prompts):
      ids = np.asarray(prompt)
      if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt {i} must be a list of int token ids; got "
                         f"{ids.dtype} {ids.shape}")
      if ids.min() < 0 or ids.max() >= cfg.vocab_size:  # before any cast
        raise ValueError(f"prompt token ids must be in [0, "
                         f"{cfg.vocab_size}); prompt {i} holds "
                         f"{ids.min()}..{ids.max()}")
    check_count("max_new_tokens", max_new_tokens)
    d = _devices(cfg)
    unit = 2 * d if cfg.context_parallel is not None else 1
    p = -(-int(lengths.max()) // unit) * unit
    tokens = np.zeros((len(prompts), p), np.int32)
    for row, prompt in zip(tokens, prompts):
      row[:len(prompt)] = prompt
    natural = np.broadcast_to(np.arange(p, dtype=np.int32), tokens.shape)
    order = np.asarray(_layout(cfg, jnp.arange(p)[None]))[0]
    last = np.argsort(order)[lengths - 1].astype(np.int32)
    slots = p // d + -(-max_new_tokens // d)
    slots = -(-slots // SLOT_ALIGN) * SLOT_ALIGN
    tokens, positions = (_layout(cfg, jnp.asarray(x))
                         for x in (tokens, natural))
    return _prefill(self._graph, self._leaves, tokens, positions,
                    jnp.asarray(lengths), jnp.asarray(last),
                    slots_per_device=slots)

  def step(self, cache: KVCache, tokens, step: int):
    """Logits ``(B, V)`` after each row's next token ``tokens (B,)``, the
    ``step``-th (from 0) after its prompt, and the cache with it appended
    (the cache given is donated: use the one returned)."""
    cfg = self.cfg
    tokens = np.asarray(tokens)
    b, d = cache.lengths.shape[0], _devices(cfg)
    want = (b, cfg.num_kv_heads, cache.capacity, cfg.head_dim)
    if (len(cache.k) != cfg.num_layers or
        any(x.shape != want for x in cache.k + cache.v)):
      raise ValueError(
          f"the cache is not this model's: it needs {cfg.num_layers} layers "
          f"of {want}; got {len(cache.k)} of "
          f"{cache.k[0].shape if cache.k else ()}")
    if tokens.shape != (b,) or not np.issubdtype(tokens.dtype, np.integer) or (
        tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
      raise ValueError(f"tokens must be {b} int ids in [0, {cfg.vocab_size})"
                       f"; got {tokens.dtype} {tokens.shape}")
    if d != cache.devices:
      raise ValueError(f"the cache is split into {cache.devices} pieces, "
                       f"and the mesh in scope splits the sequence into {d}")
    if not (is_int(step) and step >= 0):
      raise ValueError(f"step must be an int >= 0; got {step!r}")
    if cache.prompt_slots + step // d >= cache.capacity // d:
      raise ValueError(
          f"step {step} is past the cache: it holds "
          f"{cache.capacity // d - cache.prompt_slots} new tokens per device "
          f"on {d} device(s); prefill with a larger max_new_tokens")
    # NumPy arguments: the jitted call moves them itself, with less host
    # time than a jnp.asarray each.
    return _step(self._graph, self._leaves, cache, tokens.astype(np.int32),
                 np.int32(step), implementation=self.decode_implementation)

  def lower_step(self, cache: KVCache, tokens, step: int = 0):
    """The program :meth:`step` runs for ``cache`` and ``tokens (B,)``,
    lowered, not run (``jax.stages.Lowered``: ``.compile().as_text()``
    shows its kernels and collectives; with the cache split over few
    rows, one all-reduce a layer)."""
    return _step.lower(self._graph, self._leaves, cache,
                       np.asarray(tokens, np.int32), np.int32(step),
                       implementation=self.decode_implementation)

  def generate(self, prompts: Sequence[Sequence[int]], *,
               max_new_tokens: int, sampling: Sampling = Sampling(),
               seed: int = 0, stop_tokens: Sequence[int] = (),
               on_tokens: Callable[[int, np.ndarray], None] | None = None,
               tokens_per_call: int = TOKENS_PER_CALL) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; a row stops
    after one of ``stop_tokens`` (kept in its output). ``on_tokens(step,
    tokens (B,))`` sees each step's tokens as they come (rows already
    stopped included). Returns each row's new tokens.

    ``tokens_per_call`` decode steps run as one program (a loop on the
    device), so the host's cost of a call (its arguments and launches) is
    paid once for them; ``on_tokens`` then sees them together, and up to
    ``2 tokens_per_call - 1`` steps past a stop are computed and dropped.
    The tokens are the same for every value."""
    if not isinstance(sampling, Sampling):
      raise TypeError(f"sampling must be a jax_ring.models.generation."
                      f"Sampling; got {sampling!r:.80}")
    if not (is_int(seed) and 0 <= seed < 2**32):
      raise ValueError(f"seed must be an int in [0, 2**32); got {seed!r}")
    check_count("tokens_per_call", tokens_per_call)
    check_count("max_new_tokens", max_new_tokens)
    try:
      stop = np.asarray(list(stop_tokens))
    except TypeError:
      raise TypeError(f"stop_tokens must be a list of int token ids; got "
                      f"{stop_tokens!r:.80}") from None
    if stop.size and (stop.ndim != 1 or
                      not np.issubdtype(stop.dtype, np.integer)):
      raise ValueError(f"stop_tokens must be a list of int token ids; got "
                       f"{stop.dtype} {stop.shape}")
    n = tokens_per_call
    calls = -(-(max_new_tokens - 1) // n)  # after the prefill's token
    # Room for every step the calls make, past max_new_tokens included.
    logits, cache = self.prefill(prompts, max_new_tokens=calls * n + 1)
    key = jax.random.key(seed)
    out = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    key, sub = jax.random.split(key)
    last = _sample(logits, sub, sampling)  # on the device
    drawn, at, step = last[None], jnp.int32(0), 0
    for call in range(calls + 1):
      # The next call is queued before this one's tokens are read, from
      # the tokens still on the device: the host's work between calls
      # (reading, stopping, streaming) overlaps the GPU's. The tokens'
      # copy to the host is queued first, so that reading them waits for
      # their own call, not for the one queued behind it. A call queued
      # past the last one needed is discarded.
      drawn.copy_to_host_async()
      if call < calls:
        queued, last, cache, at, key = _steps_and_draw(
            self._graph, self._leaves, cache, last, at, key,
            implementation=self.decode_implementation, sampling=sampling,
            count=n)
      for tokens in np.asarray(drawn):
        _check_drawn(tokens, step)
        for row, token in enumerate(tokens):
          if not done[row]:
            out[row].append(int(token))
        if on_tokens is not None:
          on_tokens(step, tokens)
        done |= np.isin(tokens, stop)
        if done.all() or step == max_new_tokens - 1:
          return out
        step += 1
      drawn = queued
    return out


def _check_drawn(tokens, step: int) -> None:
  bad = np.flatnonzero(tokens < 0)
  if bad.size:
    raise ValueError(
        f"generate: step {step}: the logits of row(s) {bad.tolist()} "
        f"hold NaN, so no token can be drawn (a NaN in the weights or "
        f"the prompt's activations; the other rows were fine)")


def generate(model: Decoder, prompts: Sequence[Sequence[int]], **options
             ) -> list[list[int]]:
  """``Generator(model).generate(prompts, **options)``."""
  return Generator(model).generate(prompts, **options)


@functools.partial(jax.jit, static_argnames=("sampling",))
def _sample(logits, key, sampling: Sampling):
  """:meth:`Sampling.draw`, jitted."""
  return sampling.draw(logits, key)
