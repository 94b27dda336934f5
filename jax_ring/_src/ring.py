"""Ring attention over one mesh axis, called inside the user's shard_map.

Shapes, per device: ``q (B, T, N, H)``, ``k, v (B, T, K, H)`` with
``T = S_total / cp`` local tokens; C = T / 2 under the dual-chunk layout.

K and V are stacked into one ``(2, B, T, K, H)`` buffer and passed to the
next device with one ``ppermute`` per step (K and V as two operands of the
permute measured 3% slower, forward+backward on 4xH200 at 16k). The send
for step i+1 is issued before step i's block compute (they do not depend
on each other, so XLA can overlap them; whether it does depends on its
cost model: docs/decisions.md, "Scheduler"), and the last step is peeled so
that no permute is wasted.
Partial results merge through their softmax statistics in float32; the output
is cast to the input dtype once, at the end.

Where step i's K/V comes from (``kv_sends``; by default "gather" while the
gathered K/V fit ``config.GATHER_KV_MAX_BYTES``, else "neighbour"):

=========  ==================================  ============================
kv_sends   step i's K/V on device r            dK/dV of the held K/V
=========  ==================================  ============================
neighbour  device r - 1's step i-1 K/V         travel with it; a last
           (each send waits for the one        permute returns them
           before: a chain)                    (cp sends)
gather     slice r - i of one all-gather of    each step's part goes
           every device's K/V, which step 0    straight back, a permute by
           (own K/V) can overlap               -i (unrolled; cp-1 sends),
                                               or as "neighbour" (scan)
=========  ==================================  ============================

Both move the same K/V bytes. "gather" moves them as one collective
(NCCL's all-gather uses every link at once) and holds cp x the local K/V
through the pass; on 4xH200 it was faster than the chain of sends at every
length measured, 16k to 256k tokens, so the default takes it up to a memory
cap (docs/decisions.md, "K/V sends").

Schedule on device r, step i, holding the KV of device ``src = (r - i) % cp``
(causal; without a causal mask every step is "full"; striped below):

==========  =====================  ==========================================
layout      step                   branch (a ``lax.cond`` on src < r)
==========  =====================  ==========================================
dual_chunk  0 (own KV)             diagonal: local causal over 2C x 2C
dual_chunk  i > 0, src < r         half-KV: all 2C queries x first KV chunk
dual_chunk  i > 0, src > r         half-Q: second query chunk x all 2C keys
contiguous  0 (own KV)             diagonal: local causal
contiguous  i > 0, src < r         full
contiguous  i > 0, src > r         skip (above the diagonal)
==========  =====================  ==========================================

Under dual_chunk every step after the first costs the same C x 2C block on
every device. The local order [chunk r, chunk 2N-1-r] is increasing in global
position, so the diagonal step is exactly a local causal mask. On GPUs the
``lax.cond`` runs as a conditional node of the CUDA graph that holds the
step's cuDNN calls, so choosing a branch costs no host round trip.

Padding lengths are global positions; because every block's chunks are in
increasing global order, the valid tokens of a block are a prefix of it, so
each block gets a local prefix length (a runtime operand, which cuDNN takes
as its sequence lengths) and static offsets.

Windows: see :mod:`jax_ring._src.ring_blocks`; the striped layout:
:mod:`jax_ring._src.ring_striped`.

Backward (custom VJP), with neighbour sends: dq accumulates locally; (K, V)
and their dK/dV accumulators travel the ring together, each block's
backward is given the global ``out`` and ``lse``, and a final permute
returns dK/dV to their owners (the other sends: the table above). What
goes on the wire:

==============  ===========================  ================================
sends           what travels                 dtype
==============  ===========================  ================================
neighbour       running dK/dV sums           float32: a 16-bit sum would
                                             round at every hop
gather          one step's dK/dV part, to    K/V's dtype, as the block
(unrolled)      its owner, which sums the    kernel returned it (nothing
                parts in float32             rounds); float32 where a step
                                             adds several calls (window
                                             pairs)
==============  ===========================  ================================

16-bit parts halve the backward's bytes on the wire and skip a float32
stacking copy per step; at 16k tokens on 4xH200 the float32 sends had
been what the backward waited on (docs/decisions.md, "Wire dtypes"). With
gathered K/V the backward runs the own step last,
so that the last part's send hides behind it, except where the backward
gathers K/V itself (the automatic path's ``backward_kv="gather"``): there
the own step runs first, beside the gather.
"""

from __future__ import annotations

import dataclasses
import functools
import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._src import ring_blocks as blocks
from jax_ring._src import ring_striped as striped
from jax_ring._src import config, shard_call, validate
from jax_ring._src.config import (AttentionConfig, KvSends, Loop, ShardPlan,
                                  loop_from_environment)
from jax_ring._src.layout import LoadBalance
from jax_ring._src.mask import TokenMask


# Re-exported: the merge and the chunk layout are the ring's vocabulary.
merge, chunk_ids = blocks.merge, blocks.chunk_ids


def _shift(x, plan: ShardPlan, by: int):
  """Every array of ``x`` from each device j to device j + by (mod cp)."""
  perm = [(j, (j + by) % plan.cp_size) for j in range(plan.cp_size)]
  return jax.tree.map(lambda a: lax.ppermute(a, plan.axis_name, perm), x)


def _send_next(x, plan: ShardPlan):
  """Every array of ``x`` to the next device on the ring."""
  return _shift(x, plan, 1)


def _kinds(plan: ShardPlan, causal: bool):
  """(kind if src < r, kind if src > r) for the steps after the first."""
  if not causal:
    return "full", "full"
  if plan.load_balance == "dual_chunk":
    return "half_kv", "half_q"
  return "full", "skip"


# --- the loop ---------------------------------------------------------------

def _ring_loop(plan, first, later, kv, carry):
  """Run ``first(kv, carry)`` on the own KV, then ``later(step, kv, carry)``
  on each received one. Each step's KV send is issued before its compute;
  the last step is peeled so that it sends nothing."""
  cp = plan.cp_size
  if cp == 1:
    return first(kv, carry)
  nxt = _send_next(kv, plan)
  carry = first(kv, carry)
  kv = nxt
  if plan.loop == "scan":
    def body(state, step):
      kv, carry = state
      nxt = _send_next(kv, plan)
      return (nxt, later(step, kv, carry)), None

    (kv, carry), _ = lax.scan(body, (kv, carry), jnp.arange(1, cp - 1))
  else:
    for step in range(1, cp - 1):
      nxt = _send_next(kv, plan)
      carry = later(step, kv, carry)
      kv = nxt
  return later(cp - 1, kv, carry)


def _gathered_loop(plan, first, later, kv, carry, own_last=False):
  """``_ring_loop``'s steps with each step's KV read from one all-gather of
  every device's (``kv_sends="gather"``, and the automatic path's backward:
  see ``ShardPlan``); the first step, on the own KV, can overlap the
  gather. The gathered K/V (cp x this device's) live through the loop.
  ``own_last`` (unrolled): the own step runs after the others instead,
  so that it hides the last dK/dV part's send."""
  if plan.cp_size == 1:
    return first(kv, carry)
  every = jax.tree.map(lambda a: lax.all_gather(a, plan.axis_name), kv)
  r = lax.axis_index(plan.axis_name)
  held = lambda step: jax.tree.map(lambda a: lax.dynamic_index_in_dim(
      a, (r - step) % plan.cp_size, 0, keepdims=False), every)
  if plan.loop == "scan":
    carry, _ = lax.scan(lambda c, step: (later(step, held(step), c), None),
                        first(kv, carry), jnp.arange(1, plan.cp_size))
    return carry
  if not own_last:
    carry = first(kv, carry)
  for step in range(1, plan.cp_size):
    carry = later(step, held(step), carry)
  return first(kv, carry) if own_last else carry


def _kv_loop(plan: ShardPlan):
  """The loop that brings each step's K/V (``plan.kv_sends``)."""
  return dict(neighbour=_ring_loop, gather=_gathered_loop)[plan.kv_sends]


def _sends(plan: ShardPlan, k) -> ShardPlan:
  """``plan`` with its K/V sources decided by one size rule: the gathered
  stacked K/V (cp x this device's) fit ``GATHER_KV_MAX_BYTES``. Then
  ``kv_sends=None`` becomes "gather" (else "neighbour"), and a backward
  marked ``backward_kv="gather"`` gathers (else it sends K/V around)."""
  fits = 2 * plan.cp_size * k.size * k.dtype.itemsize <= (
      config.GATHER_KV_MAX_BYTES)
  return dataclasses.replace(
      plan, kv_sends=plan.kv_sends or ("gather" if fits else "neighbour"),
      backward_kv="gather" if plan.backward_kv == "gather" and fits else
      "ring")


def _step_call(fn, plan, causal, r, src, *args):
  """``fn(kind, *args)`` for a step after the first: a lax.cond on whether
  the held KV comes from an earlier device."""
  before, after = _kinds(plan, causal)
  if before == after:
    return fn(before, *args)
  return lax.cond(src < r, functools.partial(fn, before),
                  functools.partial(fn, after), *args)


def _f32(x):
  return jax.tree.map(lambda a: a.astype(jnp.float32), x)


def _add(carry, part):
  """``carry + part`` over a (dq, dkv) pair, in float32; None is the empty
  sum."""
  if carry is None:
    return _f32(part)
  return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, part)


def _cfgs(cfg: AttentionConfig):
  """(off-diagonal, diagonal) block configs: index with ``kind == "diag"``."""
  return cfg.replace(is_causal=False), cfg


def _forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plan: ShardPlan):
  """(out in q's dtype, lse f32) of this device's queries."""
  plan = _sends(plan, k)
  r = lax.axis_index(plan.axis_name)
  src_of = lambda step: (r - step) % plan.cp_size
  kv0 = blocks.held_kv(k, v, tm)
  if plan.load_balance == "striped":
    first = lambda kv, _: _f32(striped.striped_fwd(q, tm, kv, r, r, (0,),
                                                   cfg, plan, tm.same_ids))

    def later(step, kv, carry):
      ds = striped.distances(step, plan.cp_size)
      part = striped.striped_fwd(q, tm, kv, r, src_of(step), ds, cfg, plan)
      return blocks.merge(*carry, *part)
  elif cfg.local_window is not None:
    first = lambda kv, _: blocks.window_fwd(q, tm, kv, r, r, cfg, plan, None)
    later = lambda step, kv, carry: blocks.window_fwd(
        q, tm, kv, r, src_of(step), cfg, plan, carry)
  else:
    cfgs = _cfgs(cfg)
    qc = blocks.chunk_ids(plan, r)
    # The carry is float32 from the first step (a scan's carry keeps its
    # type); the steps' parts come in q's dtype, and the merge widens them.
    first = lambda kv, _: _f32(blocks.kind_fwd(
        "diag" if cfg.is_causal else "full", q, tm, kv, qc, qc, cfgs,
        tm.same_ids))

    def later(step, kv, carry):
      src = src_of(step)
      kc = blocks.chunk_ids(plan, src)
      part = _step_call(lambda kind, kv: blocks.kind_fwd(
          kind, q, tm, kv, qc, kc, cfgs), plan, cfg.is_causal, r, src, kv)
      return blocks.merge(*carry, *part)

  out, lse = _kv_loop(plan)(plan, first, later, kv0, None)
  return out.astype(q.dtype), lse


def _backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plan: ShardPlan):
  """(dq, dk, dv) of this device's shards, given the global out and lse."""
  plan = _sends(plan, k)
  r = lax.axis_index(plan.axis_name)
  src_of = lambda step: (r - step) % plan.cp_size
  grads = (out, lse, dout)
  # Neighbour sends carry running dK/dV sums (float32); gathered K/V (a
  # static shift: unrolled only) send each step's part straight back to its owner,
  # a permute by -step, as the step returned it, and the owner sums in
  # float32. A step returns what its kernel call gave (K/V's dtype: one call
  # per step, nothing rounds, 16-bit halves the bytes), float32 where it
  # adds several calls (window pairs).
  parts_back = plan.kv_sends == "gather" and plan.loop == "unrolled"
  if plan.load_balance == "striped":
    first_bwd = lambda kv: striped.striped_bwd(
        q, tm, kv, r, r, (0,), *grads, cfg, plan, tm.same_ids)
    step_bwd = lambda step, kv: striped.striped_bwd(
        q, tm, kv, r, src_of(step), striped.distances(step, plan.cp_size),
        *grads, cfg, plan)
  elif cfg.local_window is not None:
    step_bwd = lambda step, kv: blocks.window_bwd(
        q, tm, kv, r, src_of(step), *grads, cfg, plan)
    first_bwd = lambda kv: blocks.window_bwd(q, tm, kv, r, r, *grads, cfg,
                                             plan)
  else:
    cfgs = _cfgs(cfg)
    qc = blocks.chunk_ids(plan, r)
    first_bwd = lambda kv: blocks.kind_bwd(
        "diag" if cfg.is_causal else "full", q, tm, kv, qc, qc, *grads, cfgs,
        tm.same_ids)

    def step_bwd(step, kv):
      src = src_of(step)
      kc = blocks.chunk_ids(plan, src)
      # In the kernel's dtypes; the float32 sums widen them after the cond.
      return _step_call(lambda kind, kv: blocks.kind_bwd(
          kind, q, tm, kv, qc, kc, *grads, cfgs), plan, cfg.is_causal, r,
                        src, kv)


  # Neighbour sends: the carry is (dq, dkv), and dkv belongs to the KV held
  # at this step, so it moves with it after the step's compute.
  def later(step, kv, carry):
    dq, dkv = carry
    dkv = _send_next(dkv, plan)
    dq_i, part = step_bwd(step, kv)
    return dq + dq_i, dkv + part.astype(jnp.float32)

  def later_parts(step, kv, carry):
    dq_i, part = step_bwd(step, kv)
    back = _shift(part, plan, -step)  # made on device r + step
    return _add(carry, (dq_i, back))

  loop = _gathered_loop if plan.backward_kv == "gather" else _kv_loop(plan)
  kv0 = blocks.held_kv(k, v, tm)
  own = lambda kv, carry: _add(carry, first_bwd(kv))
  if parts_back:
    # The own step's part stays here: run last, it hides the last part's
    # send. Not where this backward gathers K/V itself (the automatic
    # path): there the own step runs first, beside the gather.
    dq, dkv = loop(plan, own, later_parts, kv0, None,
                   own_last=plan.backward_kv == "ring")
  else:
    dq, dkv = loop(plan, own, later, kv0, None)
    if plan.cp_size > 1:
      dkv = _send_next(dkv, plan)  # back to the owner
  return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


# Ring attention on local shards; returns this device's output rows.
ring = shard_call.differentiable(_forward, _backward)


def ring_attention(query, key, value, *, axis_name: str, is_causal=False,
                   load_balance: LoadBalance | None = None,
                   segment_ids=None, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None,
                   scale=None, logits_soft_cap=None, implementation=None,
                   loop: Loop | None = None,
                   kv_sends: KvSends | None = None):
  """Exact attention over a sequence sharded along mesh axis ``axis_name``.

  Call it inside ``shard_map`` on the local shards: ``query (B, T, N, H)``,
  ``key``/``value (B, T, K, H)``, T = S_total / cp_size tokens each. With
  a ``load_balance`` layout the global sequence must have been put in that
  layout with :func:`jax_ring.reorder_for_load_balance` (``layout=`` the
  same name; and outputs, labels, positions restored or reordered the same
  way).

  Args:
    axis_name: the mesh axis the sequence is sharded over.
    is_causal: causal mask in global positions.
    load_balance: ``None`` (contiguous shards), ``"dual_chunk"`` or
      ``"striped"`` (see ``jax_ring._src.layout``).
    segment_ids: packed documents, this device's ``(B, T)`` ids (or a
      ``(q_ids, kv_ids)`` pair), in the same layout as the tokens; the kv
      ids travel the ring with K/V. Documents may cross shard boundaries.
    query_seq_lengths, key_value_seq_lengths: ``(B,)`` padding lengths in
      global natural-order positions (the same on every device).
    local_window_size: ``w`` or ``(left, right)`` in global positions;
      chunk pairs outside the window are skipped.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    logits_soft_cap: Gemma-2 soft cap, as in ``dot_product_attention``.
    implementation: block backend, as in ``dot_product_attention``.
    loop: ``"unrolled"`` (the default: the backward reuses the forward's
      K/V sends, and was 0.4-3.8% faster on 8xH200) or ``"scan"`` (one
      step's program, so compiles stay small at large cp; its forward was
      faster on the automatic path on 8xH200 up to 128k tokens). Default
      from ``NVTE_FUSED_RING_ATTENTION_USE_SCAN`` (1 = scan, as in
      TransformerEngine), else ``"unrolled"``.
    kv_sends: where each step's K/V come from. ``None`` (the default):
      ``"gather"`` while cp x the local K/V are at most
      ``GATHER_KV_MAX_BYTES`` (2 GiB), else ``"neighbour"``. ``"gather"``:
      one all-gather of every device's K/V, held through the pass (the
      fastest at every length measured on 4xH200, 16k-256k tokens; name it
      to gather past the cap when memory allows). ``"neighbour"``: each
      step's K/V from the previous device, two K/V blocks held at a time
      (name it to keep memory flat below the cap).

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  cp = validate.mesh_axis(axis_name)
  loop = loop or loop_from_environment()
  tm, cfg = shard_call.prepare(
      query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      cp_size=cp)
  validate.self_attention("ring", query.shape, key.shape)
  validate.ring_options(load_balance, loop, query.shape[1], cp, kv_sends)
  plan = ShardPlan(axis_name, cp, load_balance, loop, kv_sends=kv_sends)
  return ring(query, key, value, tm, cfg, plan)
