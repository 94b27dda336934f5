"""The causal ring on two devices holding contiguous (natural-order) shards,
balanced without permuting the sequence.

Device 0 holds tokens ``[0, T)``, device 1 ``[T, 2T)``; C = T / 2. Under a
causal mask device 1's queries see every key of device 0, so the plain
contiguous ring gives device 1 three times device 0's work, and the
dual-chunk layout costs a permutation of q, k, v and the output (and of
their gradients) on natural-order inputs. Here the cross block (device 1's
queries against device 0's keys, T x T) is split by query rows: device 1
computes its early rows against device 0's K/V, device 0 computes device
1's late rows against its own K/V. Each device then does 2 T^2 of the
4 T^2 (causal halves counted), as under dual-chunk, in two cuDNN calls,
and moves one K/V shard and two query-sized chunks:

====  ==========================================  ===========================
step  compute (rows x keys, mask)                 sends
====  ==========================================  ===========================
1     own rows x own keys (T x T, causal)         before it: device 1's late
                                                  q -> 0, device 0's K/V -> 1
2     cross: device 0: the received rows x own    after it: device 0's
      K/V; device 1: own early rows x received    result (out, lse) -> 1
      K/V (C x T, no mask)
====  ==========================================  ===========================

Device 1 merges its rows' parts (``base.merge``, float32); device 0's rows
are its own block's. The backward runs the same two blocks on the global
``out``/``lse``: step 1 also sends device 1's late ``out``, ``lse`` and
``dout``; after step 2 device 0's dq part of those rows goes to device 1
and device 1's dK/dV part of device 0's keys to device 0, in the kernel's
dtype (the ring's gathered-K/V rule), summed in float32. (An own block
split in two, to hide the last sends behind its early rows, measured
slower: docs/decisions.md.)

Serves (:func:`applies`): two devices, contiguous shards, causal, no
window, no segment ids or padding lengths, T even, not a hybrid's ring.
K and V move as the pair ``(k, v)``: nothing is stacked.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_ring._src.core import kernel
from jax_ring._src.core.config import (AttentionConfig, ContextParallel,
                                       ShardPlan)
from jax_ring._src.core.mask import BlockMask, TokenMask
from jax_ring._src.strategies import base

_TO_FIRST, _TO_SECOND = [(1, 0)], [(0, 1)]


def applies(plan: ShardPlan, tm: TokenMask, cfg: AttentionConfig,
            t: int) -> bool:
  """Whether this schedule runs the pass (see the module doc)."""
  return (plan.cp_size == 2 and plan.load_balance is None and
          plan.beyond is None and cfg.is_causal and
          cfg.local_window is None and t % 2 == 0 and
          all(x is None for x in vars(tm).values()))


def serves(cpc: ContextParallel, cp_size: int, window, masked: bool) -> bool:
  """Whether a causal call of ``cpc`` on natural-order inputs runs this
  schedule on contiguous shards instead of permuting them into dual-chunk
  (``strategies.natural``): the ring or ``auto`` (whose ring is this
  schedule there), one axis of two devices, no window, segment ids or
  padding lengths (``masked``)."""
  return (cpc.load_balance == "dual_chunk" and
          cpc.strategy in ("ring", "auto") and
          not cpc.is_hybrid and cp_size == 2 and window is None and
          not masked)


def _cfgs(cfg: AttentionConfig):
  return cfg, cfg.replace(is_causal=False)  # the own block, the cross one


def _sends(plan: ShardPlan):
  """``send(x, to_first)``: the other device's ``x``, sent to device 0
  (``to_first``) or to device 1; the device it is not sent to gets
  zeros."""
  return lambda x, to_first: lax.ppermute(
      x, plan.axis_name, _TO_FIRST if to_first else _TO_SECOND)


def _branch(first, on_first, on_second, *args):
  """``on_first(*args)`` on device 0, else ``on_second(*args)``: a
  ``lax.cond``, or the one branch for a Python bool."""
  if isinstance(first, bool):
    return (on_first if first else on_second)(*args)
  return lax.cond(first, on_first, on_second, *args)


def forward(q, k, v, cfg: AttentionConfig, plan: ShardPlan):
  """(out in q's dtype, lse f32) of this device's T rows."""
  return device_forward(q, k, v, cfg, lax.axis_index(plan.axis_name) == 0,
                        _sends(plan))


def device_forward(q, k, v, cfg: AttentionConfig, first, send):
  """:func:`forward` of device 0 (``first``: traced, or a Python bool)
  or 1, its transfers made by ``send`` (:func:`_sends`)."""
  c = q.shape[1] // 2
  own, cross = _cfgs(cfg)
  got_q = send(q[:, c:], True)
  got_kv = send((k, v), False)
  mine = kernel.forward(q, k, v, None, BlockMask(), own)
  part = _branch(
      first,
      lambda got_q, got_kv: kernel.forward(got_q, k, v, None, BlockMask(),
                                           cross),
      lambda got_q, got_kv: kernel.forward(q[:, :c], *got_kv, None,
                                           BlockMask(), cross),
      got_q, got_kv)
  back = send(part, False)
  # Device 1's rows: the early ones meet its cross result, the late ones
  # device 0's; device 0's rows are its own block's.
  other = tuple(jnp.concatenate(x, 1) for x in zip(part, back))
  merged = base.merge(*(x.astype(jnp.float32) for x in mine), *other)
  out, lse = (jnp.where(first, a.astype(jnp.float32), b)
              for a, b in zip(mine, merged))
  return out.astype(q.dtype), lse


def backward(q, k, v, out, lse, dout, cfg: AttentionConfig,
             plan: ShardPlan):
  """(dq, dk, dv) of this device's shards, given the global out and lse."""
  return device_backward(q, k, v, out, lse, dout, cfg,
                         lax.axis_index(plan.axis_name) == 0, _sends(plan))


def device_backward(q, k, v, out, lse, dout, cfg: AttentionConfig, first,
                    send):
  """:func:`backward` of device 0 or 1, as :func:`device_forward`."""
  c = q.shape[1] // 2
  own, cross = _cfgs(cfg)
  early = lambda x: x[:, :c]
  late = lambda x: x[:, c:]
  got = send(tuple(map(late, (q, out, lse, dout))), True)
  got_kv = send((k, v), False)
  dq, dk, dv, _ = kernel.backward(q, k, v, None, BlockMask(), out, lse, dout,
                                  None, own)

  def theirs(got, got_kv):  # device 0: device 1's late rows, own K/V
    gq, go, gl, gdo = got
    return kernel.backward(gq, k, v, None, BlockMask(), go, gl, gdo, None,
                           cross)[:3]

  def mine(got, got_kv):  # device 1: own early rows, device 0's K/V
    return kernel.backward(early(q), *got_kv, None, BlockMask(), early(out),
                           early(lse), early(dout), None, cross)[:3]

  dq_x, dk_x, dv_x = _branch(first, theirs, mine, got, got_kv)
  dq_back = send(dq_x, False)
  dk_back, dv_back = send((dk_x, dv_x), True)
  f32 = lambda x: x.astype(jnp.float32)
  dq = f32(dq) + jnp.where(
      first, 0.0, jnp.concatenate([f32(dq_x), f32(dq_back)], 1))
  dk, dv = (f32(d) + jnp.where(first, f32(x) + f32(b), 0.0)
            for d, x, b in ((dk, dk_x, dk_back), (dv, dv_x, dv_back)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
