"""What jax_ring runs for one call of MaxText's ``AttentionOp``, read from
MaxText's config, the op and the call's arguments, never from the user.

What is read, and from where:

=============================  ==========================================
jax_ring argument              MaxText source
=============================  ==========================================
``scale``                      always 1: MaxText folds ``1/sqrt(head_dim)``
                               (or ``query_pre_attn_scalar``) into the
                               query, and every MaxText kernel runs with 1
``is_causal``                  ``attention_type``: ``full`` is not causal;
                               ``global``, ``local_sliding``, ``mla`` are
``local_window_size``          ``local_sliding``: ``sliding_window_size``
                               ``w`` keys, ``(w - 1, 0)``
``logits_soft_cap``            the op's ``attn_logits_soft_cap``
``sinks``                      the call's ``sinks`` ``(N,)``
``segment_ids``                ``decoder_segment_ids`` (and
                               ``decoder_segment_ids_kv``): every id is a
                               document, 0 (MaxText's padding) included,
                               as MaxText's ``dot_product`` attends
``ContextParallel.axis``       the mesh axes that the logical axis
                               ``activation_q_length`` maps to under the
                               rules in force (size-one axes dropped): one
                               axis, or ``context_sharding`` then
                               ``ulysses_context_sharding`` (``usp``:
                               jax_ring's hybrid)
``ContextParallel`` layout     what MaxText's input pipeline did to the
                               batch: ``context_parallel_load_balance``
                               and ``context_parallel_reorder_strategy``
                               (``auto``: striped for packed ring training
                               on GPUs, else dual_chunk_swap), over
                               ``mesh.shape[context_sharding]`` devices
=============================  ==========================================

A call jax_ring does not serve (:func:`fallback_reason`) runs MaxText's
own code. A config that cannot be read unambiguously is a ``ValueError``
naming its key.
"""

from __future__ import annotations

import dataclasses
import math

from jax_ring._src.core.config import ContextParallel

# MaxText's ReorderStrategy values -> jax_ring's layouts.
LAYOUTS = {"dual_chunk_swap": "dual_chunk", "striped": "striped"}
# AttentionType values jax_ring serves, and whether each is causal.
CAUSAL = {"global": True, "local_sliding": True, "mla": True, "full": False}
# AttentionOp kernels that read a cache or page table: MaxText's own path.
OWN_KERNELS = ("paged", "vllm_rpa", "vllm_batched_rpa")


@dataclasses.dataclass(frozen=True)
class Layout:
  """The order MaxText's input pipeline left the batch's sequence in:
  ``name`` (``None``: natural order) over ``cp_size`` devices."""
  name: str | None
  cp_size: int


@dataclasses.dataclass(frozen=True)
class Plan:
  """A served call: the static arguments of
  ``jax_ring.dot_product_attention`` besides the arrays, and the layout
  the arrays arrive in. ``natural``: the arrays' layout is not the one
  ``context_parallel`` runs on, so the call brings them to natural order
  first (and the output back), with :attr:`layout`."""
  is_causal: bool
  local_window_size: tuple[int, int] | None
  logits_soft_cap: float | None
  context_parallel: ContextParallel
  layout: Layout
  natural: bool


def fallback_reason(op, call: dict, key, value) -> str | None:
  """Why MaxText's own code runs this call (a short reason, logged once),
  or None when jax_ring serves it. ``call``: apply_attention's keyword
  arguments."""
  mode = call.get("model_mode")
  checks = (
      (mode != "train", f"model_mode={mode!r} (jax_ring serves training)"),
      (op.attention_kernel in OWN_KERNELS,
       f"attention={op.attention_kernel!r}"),
      (_attention_type(op) not in CAUSAL,
       f"attention_type={_attention_type(op)!r}"),
      (getattr(op, "is_absorbed_mqa", False), "use_mla_absorbed_mqa"),
      (bool(getattr(op.config, "moba", False)), "moba"),
      (op.attention_kernel == "cudnn_flash_te" and op.dropout_rate > 0,
       "attention dropout (cudnn_flash_te with dropout_rate > 0)"),
      (call.get("use_ragged_attention"), "ragged attention"),
      (call.get("previous_chunk") is not None, "chunked prefill"),
      (call.get("bidirectional_mask") is not None, "a bidirectional mask"),
      (call.get("indexer_mask") is not None, "an indexer mask"),
      (call.get("compressed_mask") is not None, "a compressed mask"),
      (call.get("record_max_logits"), "record_max_logits"),
      (call.get("lengths") is not None, "per-row lengths (decode)"),
      (bool(call.get("pad_kv_total")) or bool(call.get("compress_ratio")),
       "compressed attention"),
      (not _plain(key) or not _plain(value), "a quantized KV cache"),
  )
  return next((why for bad, why in checks if bad), None)


def plan(op, *, strategy: str, layout: Layout) -> Plan:
  """The :class:`Plan` for a call of ``op`` that
  :func:`fallback_reason` lets through, on the batch ``layout``
  (:func:`batch_layout`)."""
  kind = _attention_type(op)
  window = None
  if kind == "local_sliding":
    if not op.sliding_window_size or op.sliding_window_size < 1:
      raise ValueError(
          f"attention_type='local_sliding' needs sliding_window_size >= 1; "
          f"got {op.sliding_window_size!r}")
    window = (int(op.sliding_window_size) - 1, 0)
  cap = op.attn_logits_soft_cap or None
  axes = context_axes(op)
  causal = CAUSAL[kind]
  ring = axes[0]
  ring_size = op.mesh.shape[ring]
  balanced = layout.name is not None and layout.cp_size == ring_size
  if len(axes) == 2:
    axis, strategy = (axes[1], axes[0]), "hybrid"
  else:
    axis, strategy = ring, strategy if ring_size > 1 else "ring"
  # Natural-order batches: dual-chunk balances causal work (permuted
  # inside the call); contiguous shards serve the rest as they are.
  name = layout.name if balanced else (
      "dual_chunk" if causal and ring_size > 1 else None)
  cp = ContextParallel(axis=axis, strategy=strategy, load_balance=name,
                       inputs="load_balanced" if balanced else "natural")
  return Plan(is_causal=causal, local_window_size=window,
              logits_soft_cap=None if cap is None else float(cap),
              context_parallel=cp, layout=layout,
              natural=layout.name is not None and not balanced)


def batch_layout(config, mesh) -> Layout:
  """The layout MaxText's input pipeline put the batch in (its trainer
  wraps the data iterator so): the reorder over
  ``mesh.shape[context_sharding]`` devices when load balancing is on and
  that axis has more than one device, natural order otherwise."""
  axis = config.context_sharding
  if axis not in mesh.shape:
    raise ValueError(
        f"context_sharding={axis!r} is not an axis of MaxText's mesh "
        f"{dict(mesh.shape)}")
  cp = mesh.shape[axis]
  if not getattr(config, "context_parallel_load_balance", False) or cp == 1:
    return Layout(None, 1)
  strategy = _value(config.context_parallel_reorder_strategy)
  if strategy == "auto":
    ring = str(config.context_parallel_strategy).lower() == "ring"
    gpu = config.hardware in ("gpu", "gpu_multiprocess")
    strategy = ("striped" if config.packing and ring and gpu
                else "dual_chunk_swap")
  if strategy not in LAYOUTS:
    raise ValueError(
        f"context_parallel_reorder_strategy={strategy!r}: jax_ring reads "
        f"{sorted(LAYOUTS)} or 'auto'")
  return Layout(LAYOUTS[strategy], cp)


def context_axes(op) -> tuple[str, ...]:
  """The mesh axes (of more than one device) that the query's sequence is
  sharded over, major first: MaxText's ``activation_q_length`` under the
  logical axis rules in force. None such: one axis of one device
  (``context_sharding`` if it is one), a ring of one that shards the
  batch as the caller placed it."""
  from maxtext.common.common_types import Q_LENGTH
  from maxtext.utils import sharding
  config, mesh = op.config, op.mesh
  spec = sharding.logical_to_mesh_axes(
      (Q_LENGTH,), mesh=mesh, rules=sharding.get_logical_axis_rules())[0]
  axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
  axes = tuple(a for a in axes if a is not None and mesh.shape.get(a, 1) > 1)
  if not axes:
    ones = [a for a in mesh.axis_names if mesh.shape[a] == 1]
    if not ones:
      raise ValueError(
          f"logical_axis_rules shard activation_q_length over no axis and "
          f"every axis of MaxText's mesh {dict(mesh.shape)} has more than "
          f"one device; run under MaxText's logical_axis_rules")
    return (config.context_sharding if config.context_sharding in ones
            else ones[0],)
  usp = (config.context_sharding, config.ulysses_context_sharding)
  if len(axes) == 1 or axes == usp:
    return axes
  raise ValueError(
      f"logical_axis_rules shard activation_q_length over {axes} (sizes "
      f"{[mesh.shape[a] for a in axes]}, "
      f"{math.prod(mesh.shape[a] for a in axes)}"
      f" devices); jax_ring serves one axis, or the pair "
      f"(context_sharding, ulysses_context_sharding) = {usp}")


def _attention_type(op) -> str:
  return _value(op.attention_type)


def _value(x) -> str:
  """An enum's value, or the string itself."""
  return str(getattr(x, "value", x)).lower()


def _plain(x) -> bool:
  """An array, not MaxText's quantized ``KVTensor``."""
  return hasattr(x, "shape") and hasattr(x, "dtype") and not hasattr(
      x, "qvalue")
