"""``install`` / ``uninstall``: MaxText's attention and its batch reorder
replaced by jax_ring's, and restored.

Two MaxText functions are replaced while installed:

* ``maxtext.layers.attention_op.AttentionOp.apply_attention``: a call that
  jax_ring serves (``_read.fallback_reason``) runs
  ``jax_ring.dot_product_attention`` and returns ``(out, None, None)``,
  as MaxText's fused kernels do; any other runs MaxText's own method,
  and its reason is logged once.
* ``maxtext.utils.max_utils.reorder_causal_load_balanced``: the input
  pipeline's load-balance reorder, so that the batch's layout is exactly
  the one jax_ring reads (``dual_chunk_swap`` is jax_ring's
  ``dual_chunk``, ``striped`` its ``striped``), on every platform:
  MaxText's own imports TransformerEngine on GPUs.

Each change of state clears jax's compilation caches: a program traced
with one attention is never reused with the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from jax_ring._src.api import dot_product_attention
from jax_ring._src.strategies.layout import (reorder_for_load_balance,
                                             reorder_from_load_balance)
from jax_ring.maxtext import _read

log = logging.getLogger("jax_ring.maxtext")

# The batch fields MaxText's reorder permutes along the sequence.
SEQUENCE_FIELDS = ("inputs", "targets", "inputs_position",
                   "targets_position", "inputs_segmentation",
                   "targets_segmentation", "corruption_mask",
                   "targets_loss_mask")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What ``install`` was asked for."""
  strategy: str = "auto"
  implementation: str | None = None


class _State:
  settings: Settings | None = None  # None: not installed
  originals: dict = {}
  said: set = set()


def install(strategy: str = "auto", implementation: str | None = None):
  """Run every MaxText ``AttentionOp`` call that jax_ring serves through
  jax_ring, with everything read from MaxText's config and the call (see
  ``jax_ring.maxtext``). Idempotent; a second call with other arguments
  replaces the first's.

  Args:
    strategy: jax_ring's context-parallel strategy over the one context
      axis: ``"auto"``, ``"ring"``, ``"all_gather"`` or ``"ulysses"``
      (MaxText's ``usp`` sharding, over two axes, always runs jax_ring's
      ``hybrid``).
    implementation: the block kernel: ``None`` (cuDNN where it serves,
      else the pure-JAX one), ``"cudnn"`` or ``"xla"``.
  """
  from jax_ring._src.core.config import ContextParallel
  ContextParallel(axis="context", strategy=strategy)  # checks the name
  if strategy == "hybrid":
    raise ValueError("strategy='hybrid' is chosen by MaxText's usp sharding "
                     "(two context axes), not by install")
  if implementation not in (None, "xla", "cudnn"):
    raise ValueError(f"implementation must be None, 'xla' or 'cudnn'; got "
                     f"{implementation!r}")
  from maxtext.layers import attention_op
  from maxtext.utils import max_utils
  settings = Settings(strategy, implementation)
  if _State.settings == settings:
    return
  if _State.settings is None:
    _State.originals = {
        "apply": attention_op.AttentionOp.apply_attention,
        "reorder": max_utils.reorder_causal_load_balanced}
  attention_op.AttentionOp.apply_attention = _apply_attention(
      _State.originals["apply"], settings)
  max_utils.reorder_causal_load_balanced = _reorder
  _State.settings = settings
  _State.said = set()
  jax.clear_caches()


def uninstall():
  """Restore MaxText's own attention and reorder (a no-op when not
  installed)."""
  if _State.settings is None:
    return
  from maxtext.layers import attention_op
  from maxtext.utils import max_utils
  attention_op.AttentionOp.apply_attention = _State.originals["apply"]
  max_utils.reorder_causal_load_balanced = _State.originals["reorder"]
  _State.settings = None
  jax.clear_caches()


@contextlib.contextmanager
def installed(strategy: str = "auto", implementation: str | None = None):
  """``install(...)`` for the ``with`` block, then the state before it."""
  before = _State.settings
  install(strategy, implementation)
  try:
    yield
  finally:
    if before is None:
      uninstall()
    else:
      install(before.strategy, before.implementation)


def _say(message: str):
  """Log ``message`` once per install."""
  if message not in _State.said:
    _State.said.add(message)
    log.warning(message)


def _apply_attention(original, settings: Settings):
  """MaxText's ``apply_attention`` as jax_ring serves it."""

  @functools.wraps(original)
  def apply_attention(self, query, key, value, decoder_segment_ids,
                      segment_positions, lengths, model_mode, *args,
                      **kwargs):
    call = dict(zip(("use_ragged_attention", "previous_chunk",
                     "bidirectional_mask", "sinks", "indexer_mask",
                     "compressed_mask", "record_max_logits",
                     "decoder_segment_ids_kv", "pad_kv_total",
                     "compress_ratio"), args), **kwargs)
    call.update(lengths=lengths, model_mode=model_mode)
    why = _read.fallback_reason(self, call, key, value)
    if why is not None:
      _say(f"jax_ring.maxtext: MaxText's own attention runs where {why}")
      return original(self, query, key, value, decoder_segment_ids,
                      segment_positions, lengths, model_mode, *args,
                      **kwargs)
    layout = _read.batch_layout(self.config, self.mesh)
    plan = _read.plan(self, strategy=settings.strategy, layout=layout)
    _say(f"jax_ring.maxtext: attention {plan.context_parallel}")
    ids = decoder_segment_ids
    kv_ids = call.get("decoder_segment_ids_kv")
    if ids is not None and kv_ids is not None:
      ids = (ids, kv_ids)
    out = _attend(plan, settings, query, key, value, ids, call.get("sinks"))
    return out, None, None

  return apply_attention


def _attend(plan: _read.Plan, settings: Settings, query, key, value,
            segment_ids, sinks):
  """``jax_ring.dot_product_attention`` on MaxText's arrays, in the layout
  they arrive in, on the mesh in scope (MaxText's trainer runs its steps
  under ``jax.set_mesh``)."""
  to = back = lambda x: x
  if plan.natural:  # a layout over another device count than the call's
    cp, name = plan.layout.cp_size, plan.layout.name
    to = functools.partial(reorder_from_load_balance, cp_size=cp,
                           layout=name)
    back = functools.partial(reorder_for_load_balance, cp_size=cp,
                             layout=name)
    query, key, value = map(to, (query, key, value))
    segment_ids = jax.tree.map(to, segment_ids)

  def run(ids):
    return dot_product_attention(
        query, key, value, scale=1.0, is_causal=plan.is_causal,
        local_window_size=plan.local_window_size,
        logits_soft_cap=plan.logits_soft_cap, segment_ids=ids,
        sinks=sinks, implementation=settings.implementation,
        context_parallel=plan.context_parallel)

  def attend():
    if not isinstance(segment_ids, jax.Array) or not plan.is_causal:
      return run(segment_ids)
    # MaxText marks every row, packed or not: rows of one id (unpacked
    # data) run the kernel without ids, which is the same attention (and
    # on cuDNN a plain causal pass, not a packed one).
    one = jnp.all(segment_ids == segment_ids[:, :1])
    return jax.lax.cond(one, lambda: run(None), lambda: run(segment_ids))

  return back(attend())


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _reorder(batch, cp_size, reorder_strategy, hardware="tpu"):
  """MaxText's ``reorder_causal_load_balanced``, by jax_ring's layouts:
  the same arguments, ``hardware`` unused (the layout does not depend on
  it)."""
  del hardware
  strategy = _read.LAYOUTS.get(str(getattr(reorder_strategy, "value",
                                           reorder_strategy)).lower())
  if strategy is None:
    raise ValueError(f"context_parallel_reorder_strategy={reorder_strategy!r}"
                     f": jax_ring reorders {sorted(_read.LAYOUTS)}")
  return {k: reorder_for_load_balance(v, cp_size, layout=strategy)
          if k in SEQUENCE_FIELDS else v for k, v in batch.items()}
