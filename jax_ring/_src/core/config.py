"""The static configuration that travels through every jax_ring layer.

Everything that changes the traced program of a block call (mask kind,
window, scale, soft cap, backend, block sizes) lives in
:class:`AttentionConfig`: a frozen, hashable dataclass that is passed as a
single ``config=`` through the public API, the custom VJP and the
primitives' static parameters. Runtime values (segment ids, lengths,
diagonal offsets) are *not* here: they travel as operands in
:class:`jax_ring._src.core.mask.BlockMask`.

Above the block: :class:`ContextParallel`, how a call splits the sequence
across devices; :class:`ShardPlan`, the static facts of one call on local
shards; the closed choices (``Literal`` types) and :func:`ring_choices`,
which checks the ring's; ``GATHER_KV_MAX_BYTES``; and
``NVTE_FUSED_RING_ATTENTION_USE_SCAN``, the one environment variable
jax_ring reads, only in :meth:`ContextParallel.with_environment`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, get_args

from jax_ring._src.core import ints


Implementation = Literal["xla", "cudnn"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)

# Defaults for the pure-JAX blockwise backend. 512 x 512 float32 logits per
# (kv head, group) is 1 MiB: large enough for matmul efficiency on CPU, small
# enough that a 32k-token sequence never holds more than a block row of
# scores at once.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static attention options, hashable so that it can be a primitive param.

  Attributes:
    scale: multiplier of ``q @ k^T``.
    is_causal: key position ``p_k`` is visible to query position ``p_q`` only
      if ``p_k <= p_q``. Positions are *global*: local index plus the
      block's offset (see ``BlockMask``), so one flag serves both a single
      device (offsets 0, top-left aligned like ``jax.nn``) and a ring step.
    local_window: ``(left, right)``: ``p_q - left <= p_k <= p_q + right``,
      the same meaning as ``jax.nn.dot_product_attention(local_window_size=)``.
    logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``
      (Gemma-2), applied after scaling and before bias and masking.
    implementation: the resolved backend; before dispatch (and, in the
      automatic path, until the partition rule sees the shards), the
      requested one, ``None`` for the best available.
    block_q: query rows per block in the blockwise backend.
    block_kv: key rows per block in the blockwise backend.
  """

  scale: float
  is_causal: bool = False
  local_window: tuple[int, int] | None = None
  logits_soft_cap: float | None = None
  implementation: Implementation | None = None
  block_q: int = DEFAULT_BLOCK_Q
  block_kv: int = DEFAULT_BLOCK_KV

  def replace(self, **changes) -> "AttentionConfig":
    return dataclasses.replace(self, **changes)

  @property
  def band(self) -> tuple[int | None, int | None]:
    """``(left, right)``: query position ``p_q`` sees key positions
    ``p_q - left <= p_k <= p_q + right``; None bounds nothing. The one place
    where ``is_causal`` (``right <= 0``) and ``local_window`` combine;
    every backend and strategy reads its mask of position from here."""
    left, right = self.local_window or (None, None)
    if self.is_causal:
      right = 0 if right is None else min(right, 0)
    return left, right

  @property
  def positional(self) -> bool:
    """Whether the mask depends on positions (causal or a window)."""
    return self.band != (None, None)


# Token layouts of the shards (``layout`` says who holds what); None in a
# ``load_balance`` field means contiguous shards.
LoadBalance = Literal["dual_chunk", "striped"]
LOAD_BALANCES: tuple[str, ...] = get_args(LoadBalance)

# What ContextParallel.strategy takes: a key of the STRATEGIES table
# (strategies/__init__.py), or "auto".
StrategyName = Literal["ring", "all_gather", "ulysses", "hybrid", "auto"]
STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)

# Where the ring's step-i K/V comes from: passed on by the previous device
# ("neighbour": each send waits for the one before; two K/V blocks held),
# or from one all-gather of every device's K/V ("gather": cp x the memory).
# None (the default): "gather" while the gathered K/V stay within
# GATHER_KV_MAX_BYTES, else "neighbour".
KvSends = Literal["neighbour", "gather"]
Loop = Literal["scan", "unrolled"]
# How the caller's arrays order the sequence (ContextParallel.inputs).
Inputs = Literal["natural", "load_balanced"]
INPUTS: tuple[str, ...] = get_args(Inputs)
KV_SENDS: tuple[str, ...] = get_args(KvSends)

def ring_choices(load_balance, loop, kv_sends=None) -> None:
  """The ring's three choices, each None or one of its kind: checked by
  ``ContextParallel`` when made and by the ring's call validators."""
  if load_balance is not None and load_balance not in LOAD_BALANCES:
    raise ValueError(f"load_balance must be None, 'dual_chunk' or 'striped'; "
                     f"got {load_balance!r}")
  if loop not in (None, "scan", "unrolled"):
    raise ValueError(f"loop must be None, 'scan' or 'unrolled'; got {loop!r}")
  if kv_sends is not None and kv_sends not in KV_SENDS:
    raise ValueError(f"kv_sends must be None or one of {KV_SENDS}; got "
                     f"{kv_sends!r}")


# The most K/V bytes (all devices' stacked K/V, as one device holds them
# after a gather) that the ring gathers rather than passes around: 128k
# tokens of 32 kv heads x 128 at bf16. The gather is the default below it;
# the cap bounds the longest sequences' memory, whose sends hide behind
# compute anyway (a step's work grows as T^2, its K/V as T). Why:
# docs/decisions.md, "K/V sends".
GATHER_KV_MAX_BYTES = 2 * 2**30


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """How ``dot_product_attention`` splits the sequence across devices.

  Every field has a default that the measurements favour
  (docs/performance.md); ``jax_ring.explain`` prints the ones it applies.

  Attributes:
    axis: the mesh axis the sequence dimension is sharded over; for
      ``"hybrid"`` a pair ``(ulysses_axis, ring_axis)``, with the sequence
      sharded ring-major: ``P(None, (ring_axis, ulysses_axis))``.
    strategy: ``"ring"``, ``"all_gather"``, ``"ulysses"``, ``"hybrid"`` or
      ``"auto"`` (chosen per call and per pass, forward and backward, by a
      cost model of the shapes and the mesh; see ``jax_ring.explain``, and
      docs/performance.md for how close its picks come).
    load_balance: ``"dual_chunk"`` (the default: every device does the same
      causal work), ``"striped"`` (token i on device i mod cp: needs only
      S % cp == 0, and matches pipelines that stripe; a little slower than
      dual-chunk: docs/decisions.md, "Layouts") or ``None`` (contiguous
      shards: right for non-causal attention, unbalanced for causal).
      Whatever the layout, ``inputs`` says how the arrays are ordered.
    loop: the ring's ``"unrolled"`` or ``"scan"`` loop, as in
      ``ring_attention``; ``None`` reads
      ``NVTE_FUSED_RING_ATTENTION_USE_SCAN`` (default unrolled).
    kv_chunk_heads: ``"all_gather"`` only: gather this many kv heads at a
      time, so that one group's gathered K/V is live at once (a memory
      bound, not a speed-up: docs/decisions.md, "All-gather head
      groups").
    kv_sends: the ring's K/V sends, as in ``ring_attention``: ``None``
      (gather up to 2 GiB, else neighbour), ``"gather"`` or
      ``"neighbour"``.
    inputs: ``"natural"`` (the default): the arrays hold the sequence in
      its natural order, and the call permutes q, k, v and the segment ids
      into the ``load_balance`` layout and the output back, inside its
      compiled program (dual-chunk over one axis: each chunk sent once, by
      two ppermutes an array; striped: one all-to-all an array; a pair of
      axes: gathered whole; ``jax_ring.explain`` lists them). Two cases
      permute nothing and run the natural-order shards as they are: a
      call without a causal mask (contiguous shards balance its work),
      and the ring over two devices, causal, with no window, segment ids
      or padding lengths (its two-device schedule balances them: device 0
      computes device 1's late query rows against its own keys).
      ``"load_balanced"``: the arrays are already in the layout
      (``jax_ring.reorder_for_load_balance`` with cp_size the axis size,
      for a pair of axes the ring axis size;
      ``jax_ring.flax.prepare_lm_batch`` puts batches so), and nothing is
      permuted: the fast path for a model whose every layer attends.
      Contiguous shards (``load_balance=None``) are natural order either
      way. Natural-order (and contiguous) sequences of any length are
      served: the call appends masked padding up to a multiple of the
      context devices (twice the ring's for dual-chunk), cut from the
      output (``explain`` reports it); arrays already in a layout must
      divide.

  Every field is checked when the object is made: a choice that is not
  one is a ``ValueError`` naming the choices.
  """

  axis: str | tuple[str, str] = "cp"
  strategy: StrategyName = "ring"
  load_balance: LoadBalance | None = "dual_chunk"
  loop: Loop | None = None
  kv_chunk_heads: int | None = None
  kv_sends: KvSends | None = None
  inputs: Inputs = "natural"

  def __post_init__(self):
    _check_fields(self)

  @property
  def permutes(self) -> bool:
    """Whether a call permutes natural-order inputs into the layout."""
    return self.inputs == "natural" and self.load_balance is not None

  # -- the axes: a pair means hybrid (Ulysses inside a ring) ---------------

  @property
  def is_hybrid(self) -> bool:
    """A pair of axes: Ulysses over the first, the ring over the second."""
    return isinstance(self.axis, tuple)

  @property
  def axes(self) -> tuple[str, ...]:
    """The context axes, as given: ``(axis,)`` or ``(ulysses, ring)``."""
    return self.axis if self.is_hybrid else (self.axis,)

  @property
  def ulysses_axis(self) -> str:
    """The axis Ulysses' all-to-all runs over (the one axis if not hybrid)."""
    return self.axes[0]

  @property
  def ring_axis(self) -> str:
    """The axis the ring runs over (the one axis if not hybrid)."""
    return self.axes[-1]

  @property
  def sequence_axes(self) -> str | tuple[str, str]:
    """The sequence dimension's sharding: the axis, or ring-major
    ``(ring_axis, ulysses_axis)`` for a pair."""
    return (self.ring_axis, self.ulysses_axis) if self.is_hybrid else self.axis

  def with_environment(self) -> "ContextParallel":
    """``loop=None`` replaced by what ``NVTE_FUSED_RING_ATTENTION_USE_SCAN``
    says, read as TransformerEngine reads it (an integer: non-zero is
    ``"scan"``, 0 or unset ``"unrolled"``; anything else is a
    ``ValueError`` naming it): the one place that reads it, at the edge of
    both entry points."""
    if self.loop is not None:
      return self
    text = os.environ.get(RING_LOOP_ENV, "0")
    try:
      scan = int(text) != 0
    except ValueError:
      raise ValueError(f"{RING_LOOP_ENV} must be an integer, as "
                       f"TransformerEngine reads it (0: the unrolled ring, "
                       f"non-zero: the scan); got {text!r}") from None
    return dataclasses.replace(self, loop="scan" if scan else "unrolled")


def _check_fields(cp: ContextParallel) -> None:
  """When a ``ContextParallel`` is made: each field a valid choice."""
  if cp.strategy not in STRATEGY_NAMES:
    raise ValueError(f"context_parallel.strategy must be one of "
                     f"{STRATEGY_NAMES}; got {cp.strategy!r}")
  pair = (isinstance(cp.axis, tuple) and len(cp.axis) == 2 and
          all(isinstance(a, str) for a in cp.axis) and cp.axis[0] != cp.axis[1])
  if cp.strategy in ("hybrid", "auto") and cp.is_hybrid:
    if not pair:
      raise ValueError(f"context_parallel.axis must be one axis name or a "
                       f"pair (ulysses_axis, ring_axis) of distinct axis "
                       f"names; got {cp.axis!r}")
  elif cp.strategy == "hybrid":
    raise ValueError(f"context_parallel.axis must be a pair (ulysses_axis, "
                     f"ring_axis) of distinct axis names for strategy "
                     f"'hybrid'; got {cp.axis!r}")
  elif not isinstance(cp.axis, str):
    raise ValueError(f"context_parallel.axis must be one axis name for "
                     f"strategy {cp.strategy!r}; got {cp.axis!r}")
  ring_choices(cp.load_balance, cp.loop, cp.kv_sends)
  ints.positive_int("context_parallel.kv_chunk_heads", cp.kv_chunk_heads,
                    True)
  if cp.inputs not in INPUTS:
    raise ValueError(f"context_parallel.inputs must be one of {INPUTS}; got "
                     f"{cp.inputs!r}")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """Static facts of one context-parallel call on local shards (inside
  ``shard_map``), shared by every strategy's forward and backward.

  Attributes:
    axis_name: the mesh axis the sequence is sharded over.
    cp_size: its size.
    load_balance: the token layout of the shards (``None`` = contiguous).
    loop: the ring's loop form; other strategies ignore it.
    kv_chunk_heads: all-gather only: gather this many kv heads at a time.
    backward_kv: where the ring's backward gets each step's K/V: ``"ring"``
      sends them around again (inside one ``shard_map`` program XLA merges
      those sends with the forward's), ``"gather"`` all-gathers them once
      (set by the automatic path, whose backward is a program of its own;
      the ring keeps it up to ``GATHER_KV_MAX_BYTES``, the size rule of
      ``kv_sends=None``).
    kv_sends: the ring's K/V sends (``ContextParallel``).
    mesh_axes: every axis of the mesh the program runs on, where the call
      knows them (the automatic path); the ring's run-time choice of steps
      agrees over them (``ring.reach``). Inside a user's ``shard_map`` its
      manual axes serve.
    beyond: the ring only, packed rows on contiguous shards: the strategy
      that runs the whole pass instead where documents cross a shard
      boundary by more than the ring's step-1 tails hold, or reach past
      the previous shard (``ring.reach``; set by the automatic path).
  """

  axis_name: str
  cp_size: int
  load_balance: LoadBalance | None = None
  loop: Loop = "unrolled"
  kv_chunk_heads: int | None = None
  backward_kv: Literal["ring", "gather"] = "ring"
  kv_sends: KvSends | None = None
  mesh_axes: tuple[str, ...] = ()
  beyond: Literal["ulysses"] | None = None


# TransformerEngine's switch between its two ring loop forms, honoured for
# users coming from TE; read by ``ContextParallel.with_environment`` only.
RING_LOOP_ENV = "NVTE_FUSED_RING_ATTENTION_USE_SCAN"
