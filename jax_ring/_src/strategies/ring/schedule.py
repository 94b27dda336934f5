"""The ring's schedule over one mesh axis: its loops, where each step's K/V
come from, and :func:`ring_attention`, called inside the user's shard_map.

Shapes, per device: ``q (B, T, N, H)``, ``k (B, T, K, H)``, ``v (B, T, K,
Hv)`` with ``T = S_total / cp`` local tokens; C = T / 2 under the dual-chunk
layout.

Each device keeps its queries; at step i it holds the K/V of device
``src = (r - i) % cp``, stacked as one ``(2, B, T, K, H)`` buffer (the pair
``(k, v)`` when Hv != H: ``strategies.kv``) with the kv segment ids
(``blocks.held_kv``). The K/V come from the previous device,
one ``ppermute`` per step, issued before the step's compute
(``kv_sends="neighbour"``), or from one all-gather of every device's K/V
that step 0, on the own K/V, overlaps (``"gather"``); by default the gather
while the gathered K/V fit ``config.GATHER_KV_MAX_BYTES``, else the
neighbour sends (:func:`_sends`), whose loop peels the last step so that
no send is wasted. Causal steps after the first pick their block with a
``lax.cond`` on ``src < r`` (``blocks`` has the blocks; ``striped`` those
of the striped layout). Packed rows on contiguous shards under the
default sends run the steps up to the last one some document reaches
(``reach``, :func:`reached.reached_loop`), each fetching its K/V in its
own branch. Partial results merge in float32 and the output is cast to
the input dtype once, at the end.

The backward is given the global ``out`` and ``lse``; dq accumulates
locally. dK/dV travel with the K/V as float32 running sums (neighbour
sends), or each step's part goes straight back to its owner in the
kernel's dtype and the owner sums in float32 (gathered K/V, unrolled).

The per-step tables (blocks, sends, wire dtypes): docs/design.md, "Ring";
why each choice: docs/decisions.md, "K/V sends", "Loop forms" and "Wire
dtypes".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._src.core import config, validate
from jax_ring._src.core.config import (AttentionConfig, ContextParallel,
                                       KvSends, Loop, ShardPlan)
from jax_ring._src.core.mask import TokenMask
from jax_ring._src.strategies import base, kv as kv_lib, layout, ulysses
from jax_ring._src.strategies.layout import LoadBalance
from jax_ring._src.strategies.ring import blocks, reach, striped
from jax_ring._src.strategies.ring import pair as two
from jax_ring._src.strategies.ring.reached import (as_f32, merge_rows,
                                                   reached_loop, shift)


def _send_next(x, plan: ShardPlan):
  """Every array of ``x`` to the next device on the ring."""
  return shift(x, plan, 1)


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


def _beyond_plan(plan: ShardPlan) -> ShardPlan:
  """The plan of ``plan.beyond`` (Ulysses), on the ring's axis."""
  return ShardPlan(plan.axis_name, plan.cp_size, plan.load_balance)


def _beyond_bwd(q, k, v, tm, out, lse, dout, cfg, plan):
  """``plan.beyond``'s backward as the reached loop holds it: ``(dq,
  dK/dV)``, the latter in K/V's moving form (``kv.pack``)."""
  dq, dk, dv = ulysses.backward(q, k, v, tm, out, lse, dout, cfg,
                                _beyond_plan(plan))
  return dq, kv_lib.pack(dk, dv)


def _skips(plan: ShardPlan, tm: TokenMask, cfg: AttentionConfig) -> bool:
  """Whether the ring skips the steps no document reaches
  (:func:`reached.reached_loop`): packed rows, more than one device, and the
  options of :func:`reach.skips_steps`."""
  return (tm.q_segment_ids is not None and plan.cp_size > 1 and
          reach.skips_steps(plan.load_balance, plan.loop, plan.kv_sends,
                            cfg.local_window))


def _kv_loop(plan: ShardPlan):
  """The loop that brings each step's K/V (``plan.kv_sends``)."""
  return dict(neighbour=_ring_loop, gather=_gathered_loop)[plan.kv_sends]


def _sends(plan: ShardPlan, k, v) -> ShardPlan:
  """``plan`` with its K/V sources decided by one size rule: the gathered
  K/V (cp x this device's) fit ``GATHER_KV_MAX_BYTES``. Then
  ``kv_sends=None`` becomes "gather" (else "neighbour"), and a backward
  marked ``backward_kv="gather"`` gathers (else it sends K/V around)."""
  fits = plan.cp_size * kv_lib.nbytes(k, v) <= config.GATHER_KV_MAX_BYTES
  return dataclasses.replace(
      plan, kv_sends=plan.kv_sends or ("gather" if fits else "neighbour"),
      backward_kv="gather" if plan.backward_kv == "gather" and fits else
      "ring")


def step_call(fn, plan, causal, r, src, *args):
  """``fn(kind, *args)`` for a step after the first: a lax.cond on whether
  the held KV comes from an earlier device."""
  before, after = _kinds(plan, causal)
  if before == after:
    return fn(before, *args)
  return lax.cond(src < r, functools.partial(fn, before),
                  functools.partial(fn, after), *args)


def _tail_of(plan: ShardPlan, cfg: AttentionConfig, r):
  """(kv chunks, meets) of step 1's tail on contiguous shards: device
  ``r - 1``'s chunk, and whether this device's queries may see its keys
  (causal: only where it is earlier, so not on device 0)."""
  src = (r - 1) % plan.cp_size
  return layout.chunk_ids(plan, src), (src < r if cfg.is_causal else True)


def _add(carry, part):
  """``carry + part`` over a (dq, dkv) pair, in float32; None is the empty
  sum."""
  if carry is None:
    return as_f32(part)
  return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, part)


def block_cfgs(cfg: AttentionConfig):
  """(off-diagonal, diagonal) block configs: index with ``kind == "diag"``."""
  return cfg.replace(is_causal=False), cfg


def forward(q, k, v, tm: TokenMask, cfg: AttentionConfig, plan: ShardPlan):
  """(out in q's dtype, lse f32) of this device's queries."""
  if two.applies(plan, tm, cfg, q.shape[1]):
    return two.forward(q, k, v, cfg, plan)
  skips = _skips(plan, tm, cfg)
  plan = _sends(plan, k, v)
  r = lax.axis_index(plan.axis_name)
  src_of = lambda step: (r - step) % plan.cp_size
  kv0 = blocks.held_kv(k, v, tm)
  if plan.load_balance == "striped":
    first = lambda kv, _: as_f32(striped.striped_fwd(q, tm, kv, r, r, (0,),
                                                     cfg, plan, tm.same_ids))

    def later(step, kv, carry):
      ds = striped.distances(step, plan.cp_size)
      part = striped.striped_fwd(q, tm, kv, r, src_of(step), ds, cfg, plan)
      return base.merge(*carry, *part)
  elif cfg.local_window is not None:
    first = lambda kv, _: blocks.window_fwd(q, tm, kv, r, r, cfg, plan, None)
    later = lambda step, kv, carry: blocks.window_fwd(
        q, tm, kv, r, src_of(step), cfg, plan, carry)
  else:
    cfgs = block_cfgs(cfg)
    qc = layout.chunk_ids(plan, r)
    # The carry is float32 from the first step (a scan's carry keeps its
    # type); the steps' parts come in q's dtype, and the merge widens them.
    first = lambda kv, _: as_f32(blocks.kind_fwd(
        "diag" if cfg.is_causal else "full", q, tm, kv, qc, qc, cfgs,
        tm.same_ids))

    def later(step, kv, carry):
      src = src_of(step)
      kc = layout.chunk_ids(plan, src)
      part = step_call(lambda kind, kv: blocks.kind_fwd(
          kind, q, tm, kv, qc, kc, cfgs), plan, cfg.is_causal, r, src, kv)
      return base.merge(*carry, *part)

  if skips:
    def tail(size, kv, first):
      return merge_rows(first, blocks.tail_fwd(
          q, tm, kv, qc, *_tail_of(plan, cfg, r), size, cfgs[0]))

    kind = "diag" if cfg.is_causal else "full"
    out, lse = reached_loop(
        plan, lambda kv, ready: blocks.kind_fwd(kind, q, tm, kv, qc, qc, cfgs,
                                                tm.same_ids, ready),
        later, tail, k, v, tm, cfg.is_causal, plan.beyond and functools.partial(
            ulysses.forward, q, k, v, tm, cfg, _beyond_plan(plan)),
        prepare=lambda kv: blocks.prepare_own(kind, q, tm, kv, qc, cfgs))
  else:
    out, lse = _kv_loop(plan)(plan, first, later, kv0, None)
  return out.astype(q.dtype), lse


def backward(q, k, v, tm: TokenMask, out, lse, dout, cfg: AttentionConfig,
              plan: ShardPlan):
  """(dq, dk, dv) of this device's shards, given the global out and lse."""
  if two.applies(plan, tm, cfg, q.shape[1]):
    return two.backward(q, k, v, out, lse, dout, cfg, plan)
  skips = _skips(plan, tm, cfg)
  plan = _sends(plan, k, v)
  r = lax.axis_index(plan.axis_name)
  src_of = lambda step: (r - step) % plan.cp_size
  grads = (out, lse, dout)
  # Neighbour sends carry running dK/dV sums (float32); gathered K/V
  # (unrolled) send each step's part to its owner (a permute by -step) in
  # K/V's dtype (window pairs: float32), summed there in float32.
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
    cfgs = block_cfgs(cfg)
    qc = layout.chunk_ids(plan, r)
    kind = "diag" if cfg.is_causal else "full"
    first_bwd = lambda kv, ready=None, pair=False: blocks.kind_bwd(
        kind, q, tm, kv, qc, qc, *grads, cfgs, tm.same_ids, pair, ready)

    def step_bwd(step, kv):
      src = src_of(step)
      kc = layout.chunk_ids(plan, src)
      # In the kernel's dtypes; the float32 sums widen them after the cond.
      return step_call(lambda kind, kv: blocks.kind_bwd(
          kind, q, tm, kv, qc, kc, *grads, cfgs), plan, cfg.is_causal, r,
                        src, kv)

  # Neighbour sends: the carry is (dq, dkv), and dkv belongs to the KV held
  # at this step, so it moves with it after the step's compute.
  def later(step, kv, carry):
    dq, dkv = carry
    dkv = _send_next(dkv, plan)
    dq_i, part = step_bwd(step, kv)
    return dq + dq_i, kv_lib.add(dkv, part)

  def later_parts(step, kv, carry):
    dq_i, part = step_bwd(step, kv)
    back = shift(part, plan, -step)  # made on device r + step
    return _add(carry, (dq_i, back))

  loop = _gathered_loop if plan.backward_kv == "gather" else _kv_loop(plan)
  kv0 = blocks.held_kv(k, v, tm)
  own = lambda kv, carry: _add(carry, first_bwd(kv))
  if skips:
    def tail(size, kv, first):
      dq_i, part = blocks.tail_bwd(q, tm, kv, qc, *_tail_of(plan, cfg, r),
                                   size, *grads, cfgs[0])
      return (kv_lib.add_rows(first[0], dq_i, 0),
              kv_lib.add_last(first[1], shift(part, plan, -1)))

    dq, dkv = reached_loop(
        plan, first_bwd, later_parts, tail, k, v, tm, cfg.is_causal,
        plan.beyond and functools.partial(_beyond_bwd, q, k, v, tm, *grads,
                                          cfg, plan),
        alone=(functools.partial(first_bwd, pair=True),
               lambda got: (got[0], kv_lib.unpack(got[1]))),
        prepare=lambda kv: blocks.prepare_own(kind, q, tm, kv, qc, cfgs, lse))
  elif parts_back:
    # The own step's part stays here: run last, it hides the last part's
    # send; first where this backward gathers K/V, beside the gather.
    dq, dkv = loop(plan, own, later_parts, kv0, None,
                   own_last=plan.backward_kv == "ring")
  else:
    dq, dkv = loop(plan, own, later, kv0, None)
    if plan.cp_size > 1:
      dkv = _send_next(dkv, plan)  # back to the owner
  return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


def plan(cpc: ContextParallel, sizes, backward_kv) -> ShardPlan:
  """The ring's plan on ``cpc.ring_axis``."""
  return ShardPlan(cpc.ring_axis, sizes[cpc.ring_axis], cpc.load_balance,
                   cpc.loop, backward_kv=backward_kv, kv_sends=cpc.kv_sends,
                   mesh_axes=tuple(sizes))


def check(cpc: ContextParallel, sizes, q_shape, k_shape) -> None:
  """Local shards ``q_shape``, ``k_shape`` that the ring serves."""
  validate.self_attention("ring", q_shape, k_shape)
  validate.ring_options(cpc.load_balance, cpc.loop, q_shape[1],
                        sizes[cpc.ring_axis], cpc.kv_sends)


STRATEGY = base.Strategy("ring", forward, backward, plan, check)


def ring_attention(query, key, value, *, axis_name: str, is_causal=False,
                   load_balance: LoadBalance | None = None,
                   segment_ids=None, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None,
                   scale=None, logits_soft_cap=None, implementation=None,
                   sinks=None, padding_segment_id=None,
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
      ``"striped"`` (see ``jax_ring._src.strategies.layout``). Contiguous
      shards on two devices, causal, with no window, segment ids or
      lengths, run a balanced two-device schedule (``kv_sends`` and
      ``loop`` do not apply): device 0 computes device 1's late query
      rows against its own keys and returns their (out, lse).
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
    sinks: ``(N,)`` float, one logit per local query head that joins
      every row's softmax with no value, as in ``dot_product_attention``.
    padding_segment_id: an id of ``segment_ids`` that marks padding
      (TransformerEngine's and MaxText's 0, say): its rows output 0 with
      zero gradient, and no token sees its keys. Default None: every id,
      0 included, is a document.
    loop: ``"unrolled"`` (the default: the step index is a Python int, and
      inside one program the backward reuses the forward's K/V sends) or
      ``"scan"`` (one step's program, so the program stays small at large
      cp, but no sends are shared between the passes). Default from
      ``NVTE_FUSED_RING_ATTENTION_USE_SCAN`` (1 = scan, as in
      TransformerEngine), else ``"unrolled"``. Measured: docs/decisions.md,
      "Loop forms".
    kv_sends: where each step's K/V come from. ``None`` (the default):
      ``"gather"`` while cp x the local K/V are at most
      ``GATHER_KV_MAX_BYTES`` (2 GiB), else ``"neighbour"``. ``"gather"``:
      one all-gather of every device's K/V, held through the pass (name it
      to gather past the cap when memory allows). ``"neighbour"``: each
      step's K/V from the previous device, two K/V blocks held at a time
      (name it to keep memory flat below the cap). Measured:
      docs/decisions.md, "K/V sends".

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  validate.one_axis_name("ring_attention", axis_name)
  cpc = ContextParallel(axis=axis_name, strategy="ring",
                        load_balance=load_balance, loop=loop,
                        kv_sends=kv_sends)
  return base.run(
      STRATEGY, cpc, query, key, value, segment_ids=segment_ids,
      lengths=(query_seq_lengths, key_value_seq_lengths),
      local_window_size=local_window_size, is_causal=is_causal, scale=scale,
      logits_soft_cap=logits_soft_cap, implementation=implementation,
      sinks=sinks, padding_segment_id=padding_segment_id)
