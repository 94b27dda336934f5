"""Ring attention over one mesh axis, called inside the user's shard_map.

Shapes, per device: ``q (B, T, N, H)``, ``k, v (B, T, K, H)`` with
``T = S_total / cp`` local tokens; C = T / 2 under the dual-chunk layout.

K and V are stacked into one ``(2, B, T, K, H)`` buffer and passed to the
next device with one ``ppermute`` per step. The send for step i+1 is issued
before step i's block compute (they do not depend on each other, so XLA can
overlap them), and the last step is peeled so that no permute is wasted.
Partial results merge through their softmax statistics in float32; the output
is cast to the input dtype once, at the end.

Schedule on device r, step i, holding the KV of device ``src = (r - i) % cp``
(causal; without a causal mask every step is "full"):

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
position, so the diagonal step is exactly a local causal mask.

Backward (custom VJP): dq accumulates locally; (K, V) and their dK/dV
accumulators travel the ring together, each block's backward is given the
global ``out`` and ``lse``, and a final permute returns dK/dV to their
owners. dK/dV travel in float32: they are sums over cp blocks, and summing in
16-bit at every hop would lose the precision the merge keeps (it doubles the
accumulator's bytes on the wire, which overlap the next block's compute).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._src import backends, kernel, validate, vma
from jax_ring._src.config import AttentionConfig, loop_from_environment
from jax_ring._src.layout import LoadBalance
from jax_ring._src.mask import BlockMask
from jax_ring._src.xla_backend import MASK_VALUE

Loop = Literal["scan", "unrolled"]


@dataclasses.dataclass(frozen=True)
class RingConfig:
  """Static ring parameters: the mesh axis, its size, layout and loop form."""

  axis_name: str
  cp_size: int
  load_balance: LoadBalance | None
  loop: Loop


def merge(out, lse, out_i, lse_i):
  """Merge two partial attentions over disjoint keys, in float32.

  The sigmoid form never evaluates exp of a large positive number, so it
  cannot overflow, and with finite MASK_VALUE stand-ins a fully masked
  partial gets weight sigmoid(-huge) = 0 instead of a NaN from inf - inf.
  """
  out_i, lse_i = out_i.astype(jnp.float32), lse_i.astype(jnp.float32)
  out = out - jax.nn.sigmoid(lse_i - lse)[..., None] * (out - out_i)
  lse = lse - jax.nn.log_sigmoid(lse - lse_i)
  return out, lse


def _send_next(x, rc: RingConfig):
  """Every array of ``x`` to the next device on the ring."""
  perm = [(j, (j + 1) % rc.cp_size) for j in range(rc.cp_size)]
  return jax.tree.map(lambda a: lax.ppermute(a, rc.axis_name, perm), x)


def _kinds(rc: RingConfig, causal: bool):
  """(kind if src < r, kind if src > r) for the steps after the first."""
  if not causal:
    return "full", "full"
  if rc.load_balance == "dual_chunk":
    return "half_kv", "half_q"
  return "full", "skip"


# --- one block, forward and backward, by kind -------------------------------
#
# ``kv`` is what travels the ring: (stacked K/V (2, B, T, K, H), the kv
# segment ids (B, T) or None). ``q_seg`` is this device's query segment ids.

def _mask(q_seg, kv_seg):
  if q_seg is None:
    return BlockMask()
  return BlockMask(q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def _halves(kind, q, q_seg, kv):
  """The (q rows, q ids, k, v, kv ids) a block of ``kind`` works on."""
  (k, v), kv_seg = (kv[0][0], kv[0][1]), kv[1]
  c = q.shape[1] // 2
  cut = lambda x, sl: None if x is None else x[:, sl]
  if kind == "half_q":
    return q[:, c:], cut(q_seg, slice(c, None)), k, v, kv_seg
  if kind == "half_kv":
    half = slice(0, c)
    return q, q_seg, k[:, half], v[:, half], cut(kv_seg, half)
  return q, q_seg, k, v, kv_seg


def _block_fwd(kind, q, q_seg, kv, cfgs):
  causal_cfg, full_cfg = cfgs
  b, t, n, h = q.shape
  c = t // 2
  masked = lambda rows: vma.like(
      (jnp.zeros((b, rows, n, h), jnp.float32),
       jnp.full((b, rows, n), MASK_VALUE, jnp.float32)), q, kv[0])
  if kind == "skip":
    return masked(t)
  qq, qs, k, v, ks = _halves(kind, q, q_seg, kv)
  cfg = causal_cfg if kind == "diag" else full_cfg
  o, l = kernel.attention(qq, k, v, None, _mask(qs, ks), cfg)
  o = o.astype(jnp.float32)
  if kind == "half_q":
    zo, zl = masked(c)
    return jnp.concatenate([zo, o], 1), jnp.concatenate([zl, l], 1)
  return o, l


def _block_bwd(kind, q, q_seg, kv, out, lse, dout, cfgs):
  """(dq, dkv) of one block, dq (B, T, N, H) and dkv (2, B, T, K, H), f32."""
  causal_cfg, full_cfg = cfgs
  c = q.shape[1] // 2
  f32 = lambda x: x.astype(jnp.float32)
  if kind == "skip":
    return vma.like((jnp.zeros(q.shape, jnp.float32),
                     jnp.zeros(kv[0].shape, jnp.float32)), q, kv[0], out,
                    dout)
  qq, qs, k, v, ks = _halves(kind, q, q_seg, kv)
  rows = slice(c, None) if kind == "half_q" else slice(None)
  cfg = causal_cfg if kind == "diag" else full_cfg
  dq, dk, dv, _ = kernel.attention_backward(
      qq, k, v, None, _mask(qs, ks), out[:, rows], lse[:, rows],
      dout[:, rows], None, cfg)
  dq, dkv = f32(dq), jnp.stack([f32(dk), f32(dv)])
  if kind == "half_q":
    dq = jnp.concatenate([jnp.zeros_like(dq), dq], 1)
  if kind == "half_kv":
    dkv = jnp.concatenate([dkv, jnp.zeros_like(dkv)], 2)
  return dq, dkv


def _step_kind_call(fn, rc, causal, step, *args):
  """Call ``fn(kind, *args)`` for a step after the first: a lax.cond on
  whether the held KV comes from an earlier device."""
  before, after = _kinds(rc, causal)
  if before == after:
    return fn(before, *args)
  r = lax.axis_index(rc.axis_name)
  src = (r - step) % rc.cp_size
  return lax.cond(src < r, functools.partial(fn, before),
                  functools.partial(fn, after), *args)


def _ring_loop(rc, first, later, kv, carry):
  """Run ``first(kv, carry)`` on the own KV, then ``later(step, kv, carry)``
  on each received one. Each step's KV send is issued before its compute;
  the last step is peeled so that it sends nothing."""
  cp = rc.cp_size
  if cp == 1:
    return first(kv, carry)
  nxt = _send_next(kv, rc)
  carry = first(kv, carry)
  kv = nxt
  if rc.loop == "scan":
    def body(state, step):
      kv, carry = state
      nxt = _send_next(kv, rc)
      return (nxt, later(step, kv, carry)), None

    (kv, carry), _ = lax.scan(body, (kv, carry), jnp.arange(1, cp - 1))
  else:
    for step in range(1, cp - 1):
      nxt = _send_next(kv, rc)
      carry = later(step, kv, carry)
      kv = nxt
  return later(cp - 1, kv, carry)


def _forward(q, k, v, seg, cfgs, rc: RingConfig):
  causal = cfgs[0].is_causal
  first_kind = "diag" if causal else "full"
  q_seg, kv_seg = seg

  def first(kv, carry):
    return _block_fwd(first_kind, q, q_seg, kv, cfgs)

  def later(step, kv, carry):
    part = _step_kind_call(
        lambda kind, kv: _block_fwd(kind, q, q_seg, kv, cfgs), rc, causal,
        step, kv)
    return merge(*carry, *part)

  out, lse = _ring_loop(rc, first, later, (jnp.stack([k, v]), kv_seg), None)
  return out.astype(q.dtype), lse


def _backward(q, k, v, seg, out, lse, dout, cfgs, rc: RingConfig):
  causal = cfgs[0].is_causal
  first_kind = "diag" if causal else "full"
  q_seg, kv_seg = seg

  # The carry is (dq, dkv): dkv belongs to the KV held at this step, so it
  # moves with it after the step's compute.
  def first(kv, carry):
    return _block_bwd(first_kind, q, q_seg, kv, out, lse, dout, cfgs)

  def later(step, kv, carry):
    dq, dkv = carry
    dkv = _send_next(dkv, rc)
    dq_i, dkv_i = _step_kind_call(
        lambda kind, kv: _block_bwd(kind, q, q_seg, kv, out, lse, dout, cfgs),
        rc, causal, step, kv)
    return dq + dq_i, dkv + dkv_i

  dq, dkv = _ring_loop(rc, first, later, (jnp.stack([k, v]), kv_seg), None)
  if rc.cp_size > 1:
    dkv = _send_next(dkv, rc)  # back to the owner
  return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def ring(q, k, v, seg, cfgs: tuple[AttentionConfig, AttentionConfig],
         rc: RingConfig):
  """Ring attention on local shards. ``seg`` is (q ids, kv ids) or
  (None, None); ``cfgs`` the (diagonal, off-diagonal) block configs."""
  return _forward(q, k, v, seg, cfgs, rc)[0]


def _ring_fwd(q, k, v, seg, cfgs, rc):
  out, lse = _forward(q, k, v, seg, cfgs, rc)
  return out, (q, k, v, seg, out, lse)


def _ring_bwd(cfgs, rc, res, dout):
  q, k, v, seg, out, lse = res
  dq, dk, dv = _backward(q, k, v, seg, out, lse, dout.astype(q.dtype), cfgs,
                         rc)
  return dq, dk, dv, (None, None)


ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(query, key, value, *, axis_name: str, is_causal=False,
                   load_balance: LoadBalance | None = None,
                   segment_ids=None, scale=None, logits_soft_cap=None,
                   implementation=None, loop: Loop | None = None):
  """Exact attention over a sequence sharded along mesh axis ``axis_name``.

  Call it inside ``shard_map`` on the local shards: ``query (B, T, N, H)``,
  ``key``/``value (B, T, K, H)``, T = S_total / cp_size tokens each. With
  ``load_balance="dual_chunk"`` the global sequence must have been put in
  that layout with :func:`jax_ring.reorder_for_load_balance` (and outputs,
  labels, positions restored or reordered the same way).

  Args:
    axis_name: the mesh axis the sequence is sharded over.
    is_causal: causal mask in global positions.
    load_balance: ``None`` (contiguous shards) or ``"dual_chunk"``.
    segment_ids: packed documents, this device's ``(B, T)`` ids (or a
      ``(q_ids, kv_ids)`` pair), in the same layout as the tokens; the kv
      ids travel the ring with K/V. Documents may cross shard boundaries.
    scale: logit multiplier; default ``1 / sqrt(H)``.
    logits_soft_cap: Gemma-2 soft cap, as in ``dot_product_attention``.
    implementation: block backend, as in ``dot_product_attention``.
    loop: ``"scan"`` or ``"unrolled"``; default from the environment
      variable ``NVTE_FUSED_RING_ATTENTION_USE_SCAN`` (1 = scan, 0 =
      unrolled, as in TransformerEngine), else ``"unrolled"``.

  Returns:
    ``(B, T, N, H)`` in the input dtype: this device's rows of the output.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  validate.qkv(query, key, value)
  validate.scalar_options(scale, logits_soft_cap)
  validate.implementation(implementation)
  cp = validate.mesh_axis(axis_name)
  validate.ring_options(load_balance, loop, query.shape[1], cp)
  cfg = AttentionConfig(
      scale=float(query.shape[-1]**-0.5 if scale is None else scale),
      is_causal=bool(is_causal),
      logits_soft_cap=None if logits_soft_cap is None else float(
          logits_soft_cap))
  seg = (None, None)
  if segment_ids is not None:
    seg = tuple(jnp.asarray(x, jnp.int32) for x in validate.segment_ids(
        segment_ids, query.shape, key.shape))
  cfg = cfg.replace(implementation=backends.resolve(
      implementation, cfg, query, key, None, _mask(*seg)))
  rc = RingConfig(axis_name, cp, load_balance, loop or loop_from_environment())
  return ring(query, key, value, seg, (cfg, cfg.replace(is_causal=False)), rc)
