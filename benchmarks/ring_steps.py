"""One device's share of a dual-chunk causal ring, on one GPU, sends left out.

  python benchmarks/ring_steps.py [--cp 4] [--seq 16384 32768 ...]
      [--variants graphs nocc static]

Device ``r`` of a ``cp``-way ring (``--rank``, default 1) runs cp block
calls: the causal diagonal on its own K/V, then cp - 1 steps, each a
``lax.cond`` between half-KV and half-Q on ``src < r`` (``ring/schedule.py``'s
schedule table), merged in float32; the backward runs the same blocks from
the global out and lse, and sends each step's dK/dV part back to its owner.
Here the same calls run from the ring's own block functions
(``ring/blocks.py``), with every step's K/V an input, the K/V device ``src``
holds in the dual-chunk layout: no collective, and ``r`` a run-time operand,
so every ``lax.cond`` is a real branch. The result is device r's rows of the
full attention (checked against the single-GPU call) and its time is what a
ring step costs besides communication: the block kernels, the merge, and the
launch and branch overhead per step.

Variants, compiled side by side in one process (common.GRAPHS):

========  =================================================================
graphs    XLA's default command buffers; they take jax_ring's cuDNN calls
          (the FFI handlers are command-buffer compatible), so each cond is
          a CUDA-graph conditional node: no host round trip
nocc      the default less CUSTOM_CALL: the cuDNN calls, and each cond
          around them, run outside graphs (a host round trip per cond)
static    the branches chosen at trace time (r a Python int): no cond, the
          floor for this schedule
pair      ``--cp 2`` only: device r's share of the two-device schedule on
          contiguous shards (``ring/pair.py``), r static; what it receives
          is an input (the other device's arrays, computed beforehand)
========  =================================================================

``pair``'s row checks the forward against the single-GPU rows of the
contiguous shard; its backward runs on stand-in received arrays (the
device's own, of the same shapes), so only its time is recorded.

Efficiency = theoretic / time, theoretic = the single-GPU call over the
full sequence / cp (ring-flash-attention's convention, as in
ring_attention.py): the ceiling a ring with perfectly hidden sends reaches.
"""

from __future__ import annotations

import argparse
import glob
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_ring
from jax_ring._src.core import kernel
from jax_ring._src.core.config import AttentionConfig, ShardPlan
from jax_ring._src.core.mask import BlockMask, TokenMask
from jax_ring._src.strategies import base, layout
from jax_ring._src.strategies.ring import blocks, pair, schedule
from common import (jit_variant, random_qkv, rel_err, shape_args,
                    time_fn, write)

VARIANTS = ("graphs", "nocc", "static")
PAIR = "pair"


def _steps(kvs, r, cp, tm):
  """Device r's steps, the own first: ``(plan, kind, src, held kv)``; kind
  None after the first unless r is a Python int: chosen at run time."""
  plan = ShardPlan("cp", cp, load_balance="dual_chunk")
  for step in range(cp):
    src = (r - step) % cp
    kind = "diag" if step == 0 else None
    if step and isinstance(r, int):
      kind = "half_kv" if src < r else "half_q"
    yield plan, kind, src, blocks.held_kv(*kvs[step], tm)


def device_forward(q, kvs, r, *, cp, cfg):
  """(out f32, lse) of device ``r``'s queries ``q (B, T, N, H)`` from
  ``kvs``: step i's (k, v), each ``(B, T, K, H)``, those of device
  ``(r - i) % cp`` (dual-chunk layout). ``r`` traced: a cond per step."""
  cfgs, tm = schedule.block_cfgs(cfg), TokenMask()
  carry = None
  for plan, kind, src, kv in _steps(kvs, r, cp, tm):
    qc, kc = layout.chunk_ids(plan, r), layout.chunk_ids(plan, src)
    if kind is not None:
      part = blocks.kind_fwd(kind, q, tm, kv, qc, kc, cfgs)
    else:
      part = schedule.step_call(lambda kind, kv: blocks.kind_fwd(
          kind, q, tm, kv, qc, kc, cfgs), plan, True, r, src, kv)
    carry = (schedule.as_f32(part) if carry is None else
             base.merge(*carry, *part))
  return carry


def device_backward(q, kvs, r, out, lse, dout, *, cp, cfg):
  """(dq f32, [dK/dV part of step i, stacked (2, B, T, K, H) float32]):
  device r's dq and what it sends back to each step's owner (widened to
  float32 here, as the owner does on receipt)."""
  cfgs, tm = schedule.block_cfgs(cfg), TokenMask()
  dq, parts = 0.0, []
  grads = (out, lse, dout)
  for plan, kind, src, kv in _steps(kvs, r, cp, tm):
    qc, kc = layout.chunk_ids(plan, r), layout.chunk_ids(plan, src)
    if kind is not None:
      dq_i, part = blocks.kind_bwd(kind, q, tm, kv, qc, kc, *grads, cfgs)
    else:
      dq_i, part = schedule.step_call(lambda kind, kv: blocks.kind_bwd(
          kind, q, tm, kv, qc, kc, *grads, cfgs), plan, True, r, src, kv)
    dq = dq + dq_i.astype(jnp.float32)
    parts.append(part.astype(jnp.float32))
  return dq, parts


def device_inputs(q, k, v, dout, cp, r):
  """Device r's q and dout, and the K/V it holds at each step, cut from the
  full ``(B, S, ., H)`` arrays in natural order."""
  re_ = lambda x: jnp.split(jax_ring.reorder_for_load_balance(
      x, cp, layout="dual_chunk"), cp, 1)
  qs, ks, vs, ds = map(re_, (q, k, v, dout))
  kvs = [(ks[(r - i) % cp], vs[(r - i) % cp]) for i in range(cp)]
  return qs[r], kvs, ds[r]


def _fns(variant, cp, cfg, rank):
  """(forward, forward+backward) of one variant, jitted."""
  pick = (lambda r: rank) if variant == "static" else (lambda r: r)

  def fwd(q, kvs, r):
    out, lse = device_forward(q, kvs, pick(r), cp=cp, cfg=cfg)
    return out.astype(q.dtype), lse

  def fwd_bwd(q, kvs, r, dout):
    out, lse = fwd(q, kvs, r)
    return device_backward(q, kvs, pick(r), out, lse, dout, cp=cp, cfg=cfg)

  tag = "@nocc" if variant == "nocc" else ""  # the rest: XLA's graphs
  return jit_variant(fwd, tag), jit_variant(fwd_bwd, tag)


def _mailbox(received, sent):
  """``send`` for ``pair.device_*``: the received arrays, in call order;
  what is sent is appended to ``sent`` (returned, so XLA keeps the work
  that only the other device reads)."""
  it = iter(received)

  def send(x, to_first):
    sent.append(x)
    return next(it)
  return send


def pair_fns(cfg, rank):
  """(forward, forward+backward) of device ``rank``'s share of the
  two-device schedule, jitted; ``received``: what its sends bring, in
  order (forward: the late q, the K/V, the cross result; backward: the
  late (q, out, lse, dout), the K/V, the dq part, the dK/dV part)."""
  first = rank == 0

  def fwd(q, k, v, received):
    sent = []
    out = pair.device_forward(q, k, v, cfg, first, _mailbox(received, sent))
    return out, sent

  def fwd_bwd(q, k, v, dout, received, received_bwd):
    (out, lse), sent = fwd(q, k, v, received)
    grads = pair.device_backward(q, k, v, out, lse, dout, cfg, first,
                                 _mailbox(received_bwd, sent))
    return grads, sent

  return jax.jit(fwd), jax.jit(fwd_bwd)


def pair_inputs(q, k, v, dout, rank, cfg):
  """Device ``rank``'s contiguous shards, what its forward receives (the
  other device's late q and K/V, and device 0's cross result), and
  stand-ins of the backward's transfers (its own arrays' shapes)."""
  halves = lambda x: jnp.split(x, 2, 1)
  (q0, q1), (k0, k1), (v0, v1), (d0, d1) = map(halves, (q, k, v, dout))
  c = q0.shape[1] // 2
  cross = cfg.replace(is_causal=False)
  part0 = kernel.forward(q1[:, c:], k0, v0, None, BlockMask(), cross)
  mine = ((q0, k0, v0, d0), (q1, k1, v1, d1))[rank]
  other = ((q0, k0, v0), (q1, k1, v1))[1 - rank]
  received = (other[0][:, c:], other[1:], part0)
  qm, km, vm, dm = mine
  lse = jnp.zeros(qm.shape[:3], jnp.float32)
  stand_in = ((qm[:, c:], qm[:, c:], lse[:, c:], dm[:, c:]), (km, vm),
              qm[:, :c], (km, vm))
  return mine, received, stand_in


def profile(name, fn, args, out_dir, calls=3) -> dict:
  """profile_ring's kernel-time columns (per call) of ``calls`` calls of
  ``fn``, prefixed with ``name``; its optimized HLO and GPU 0's kernel
  timeline go to ``out_dir``."""
  import profile_ring
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"hlo_{name}.txt").write_text(fn.lower(*args).compile().as_text())
  trace = out / f"trace_{name}"
  with jax.profiler.trace(str(trace), create_perfetto_trace=True):
    for _ in range(calls):
      res = fn(*args)
    jax.block_until_ready(res)
  path = glob.glob(os.path.join(trace, "**", "perfetto_trace.json.gz"),
                   recursive=True)[0]
  mean, _, timeline = profile_ring.summarise(profile_ring.gpu_events(path),
                                             calls)
  with open(out / f"timeline_{name}.txt", "w") as f:
    f.write("start_us  dur_us  stream  kind  kernel (all calls)\n")
    for t, d, st, k, n in timeline:
      f.write(f"{t:9.1f} {d:8.1f}  {st}  {k}  {n}\n")
  return {f"{name}_{k}": v for k, v in mean.items()}


def main():
  p = argparse.ArgumentParser()
  shape_args(p, [16384, 32768, 65536])
  p.add_argument("--cp", type=int, default=4)
  p.add_argument("--rank", type=int, default=1)
  p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                 choices=VARIANTS + (PAIR,))
  p.add_argument("--implementation", default="cudnn")
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="also profile each variant at the first shape: "
                 "kernel-time columns in the row, HLO and timelines in DIR")
  a = p.parse_args()
  rows = []
  for s in a.seq:
    for kh in a.kv_heads:
      q, k, v, do = random_qkv(s + kh, s, a.heads, kh, a.head_dim)
      flops = 2 * s * s * a.heads * a.head_dim
      cfg = AttentionConfig(scale=a.head_dim ** -0.5, is_causal=True,
                            implementation=a.implementation)
      single = lambda q, k, v: jax_ring.dot_product_attention(
          q, k, v, is_causal=True, implementation=a.implementation)
      f1 = jax.jit(single)
      fb1 = jax.jit(lambda q, k, v, do: jax.vjp(single, q, k, v)[1](do))
      t1, tb1 = time_fn(f1, q, k, v), time_fn(fb1, q, k, v, do)
      want = np.split(np.asarray(jax_ring.reorder_for_load_balance(
          f1(q, k, v), a.cp, layout="dual_chunk")), a.cp, 1)[a.rank]
      want_dq = np.split(np.asarray(jax_ring.reorder_for_load_balance(
          fb1(q, k, v, do)[0], a.cp, layout="dual_chunk")), a.cp, 1)[a.rank]
      row = dict(seq=s, cp=a.cp, rank=a.rank, heads=a.heads, kv_heads=kh,
                 single_fwd_ms=t1 * 1e3, single_fwdbwd_ms=tb1 * 1e3,
                 single_fwd_tflops=flops / t1 / 1e12)
      qr, kvs, dr = device_inputs(q, k, v, do, a.cp, a.rank)
      r = jnp.int32(a.rank)
      got = {}
      if PAIR in a.variants:
        if a.cp != 2:
          p.error("--variants pair needs --cp 2")
        (qm, km, vm, dm), received, stand_in = pair_inputs(
            q, k, v, do, a.rank, cfg)
        f, fb = pair_fns(cfg, a.rank)
        out = f(qm, km, vm, received)[0][0]
        tf = time_fn(f, qm, km, vm, received)
        tfb = time_fn(fb, qm, km, vm, dm, received, stand_in)
        want_rows = np.split(np.asarray(f1(q, k, v)), 2, 1)[a.rank]
        row.update({f"{PAIR}_fwd_ms": tf * 1e3, f"{PAIR}_fwdbwd_ms": tfb * 1e3,
                    f"{PAIR}_fwd_eff": t1 / a.cp / tf,
                    f"{PAIR}_fwdbwd_eff": tb1 / a.cp / tfb,
                    f"{PAIR}_max_rel_err": rel_err(out, want_rows)})
      for variant in (v for v in a.variants if v != PAIR):
        f, fb = _fns(variant, a.cp, cfg, a.rank)
        out = f(qr, kvs, r)[0]
        dq = fb(qr, kvs, r, dr)[0]
        got[variant] = (out, dq)
        tf, tfb = time_fn(f, qr, kvs, r), time_fn(fb, qr, kvs, r, dr)
        row.update({f"{variant}_fwd_ms": tf * 1e3,
                    f"{variant}_fwdbwd_ms": tfb * 1e3,
                    f"{variant}_fwd_eff": t1 / a.cp / tf,
                    f"{variant}_fwdbwd_eff": tb1 / a.cp / tfb,
                    f"{variant}_max_rel_err": rel_err(out, want),
                    f"{variant}_dq_max_rel_err": rel_err(dq, want_dq)})
        if a.profile and not rows:
          row.update(profile(f"{variant}_fwd", f, (qr, kvs, r), a.profile))
          row.update(profile(f"{variant}_fwdbwd", fb, (qr, kvs, r, dr),
                             a.profile))
      if {"graphs", "nocc"} <= set(got):
        # The same kernels in the same order: command buffers should
        # change no bit (recorded, not asserted: a GPU-only fact).
        for i, name in enumerate(("out", "dq")):
          row[f"graphs_{name}_equal_nocc"] = bool(jnp.array_equal(
              got["graphs"][i], got["nocc"][i]))
      rows.append(row)
      print(row, flush=True)
  cols = ["seq", "kv_heads", "single_fwd_ms"] + [
      f"{v}_{m}" for v in a.variants for m in ("fwd_eff", "fwdbwd_eff")]
  write("ring_steps", rows, cols,
        extra=dict(dtype="bfloat16", batch=1, head_dim=a.head_dim,
                   implementation=a.implementation,
                   efficiency="single-GPU time / cp over device r's steps "
                   "(no sends)"), mode=a.mode)


if __name__ == "__main__":
  main()
