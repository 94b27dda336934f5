"""Where a packed row's forward+backward time goes: a jax.profiler trace
of ``jax_ring.dot_product_attention`` on a row of documents, summarised
from its kernel events (the per-call mean over GPUs of wall, busy,
attention, NCCL and other kernels, idle; GPU 0's events and its waits,
the idle stretches of over 20 us that a host round trip leaves; the
program's launches, loops and conditionals in and out of CUDA graphs
(``common.program_summary``); then GPU 0's kernels by time), printed and
written to ``results/profile_packed_<n>x<GPU>.json`` (``--mode`` names
the run; ``XLA_FLAGS`` is recorded).

  python benchmarks/profile_packed.py --docs 1 64 4096 [--seq 32768]
  python benchmarks/profile_packed.py --strategy ulysses --mixes lognormal \
      --seq 65536 --heads 32

``--docs N`` is the mix ``equalN``; ``--mixes`` takes strategies.py's
names. ``--strategy`` runs the row over every local GPU as strategies.py
does (the automatic path; dual-chunk layout, or contiguous shards for a
name ending ``_contiguous``); without it, on one GPU. ``--dense`` adds
the equal mixes' documents as a dense batch of equal rows (one GPU), the
packed table's baseline. ``--timeline DIR``
and ``--hlo DIR`` write GPU 0's kernels in time order and the compiled
program of each row there.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ring

sys.path.insert(0, os.path.dirname(__file__))
from common import (packed_path_args, program_summary, random_qkv,  # noqa: E402
                    traced, use_packed_path, write)
from profile_ring import gaps, gpu_events, summarise  # noqa: E402
from strategies import mix_ids, setup  # noqa: E402

GAP_US = 20.0


def profiled(step, args, calls: int, timeline_path=None):
  """(the per-call means of ``summarise`` with GPU 0's launches and its
  waits of over GAP_US added, the kernels by time) of ``calls`` calls of
  the compiled ``step``; GPU 0's kernel timeline written to
  ``timeline_path`` if given."""
  per = traced(step, args, calls, gpu_events)
  mean, detail, timeline = summarise(per, calls)
  if timeline_path:
    with open(timeline_path, "w") as f:
      f.writelines(f"{t:10.1f} {d:8.1f} {st[:12]:12} {k:5} {n}\n"
                   for t, d, st, k, n in timeline)
  # Each host round trip of a run-time branch or loop test leaves a wait.
  evs = [(b, e) for b, e, _, _ in next(iter(sorted(per.items())))[1]]
  waits, waited = gaps(evs, GAP_US)
  mean.update(events=len(evs) / calls, waits=waits / calls,
              waits_ms=waited / 1e3 / calls)
  return mean, detail


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--docs", type=int, nargs="+", default=[])
  p.add_argument("--mixes", nargs="+", default=[])
  p.add_argument("--seq", type=int, default=32768)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--strategy", default=None,
                 help="a strategies.py name, over every local GPU")
  p.add_argument("--calls", type=int, default=5)
  p.add_argument("--top", type=int, default=14)
  p.add_argument("--mode", default="default")
  p.add_argument("--timeline", default=None, metavar="DIR",
                 help="write GPU 0's kernel timeline of each row there")
  p.add_argument("--dense", action="store_true",
                 help="also the equal mixes' documents as a dense batch of "
                 "equal rows, on one GPU")
  p.add_argument("--hlo", default=None, metavar="DIR",
                 help="write each row's compiled program text there")
  packed_path_args(p)
  a = p.parse_args()
  for folder in (a.hlo, a.timeline):
    if folder:
      os.makedirs(folder, exist_ok=True)
  packed = use_packed_path(a.packed_path, a.tile_sizes, a.pallas_stages)
  rows = []
  s, n, kh, d = a.seq, a.heads, a.kv_heads, 128
  mixes = [f"equal{x}" for x in a.docs] + a.mixes or ["equal1", "equal64",
                                                      "equal4096"]
  cp = jax.device_count() if a.strategy else 1
  q, k, v, _ = random_qkv(0, s, n, kh, d)
  runs = [(mix, False) for mix in mixes] + [
      (mix, True) for mix in mixes if a.dense and mix.startswith("equal")]
  for mix, dense in runs:
    ids = mix_ids(mix, s)
    docs = 1 if ids is None else len(np.unique(np.asarray(ids)))
    cpc, args = None, (q, k, v)
    if dense:  # the same documents as a batch of equal rows
      args = tuple(x.reshape((docs, -1) + x.shape[2:]) for x in args)
      ids = None
    elif a.strategy:
      cpc, sh, to, _ = setup(a.strategy, cp, "dual_chunk")
      args = tuple(jax.device_put(to(x), sh) for x in args)
      ids = None if ids is None else jax.device_put(to(ids), sh)
    loss = lambda q, k, v, ids=ids, cpc=cpc: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids,
        context_parallel=cpc).astype(jnp.float32).sum()
    step = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile()
    program = program_summary(step.as_text())
    name = f"{a.mode}_{mix}{'_dense' if dense else ''}"
    if a.hlo:
      with open(os.path.join(a.hlo, f"hlo_{name}.txt"), "w") as f:
        f.write(step.as_text())
    mean, detail = profiled(step, args, a.calls, a.timeline and os.path.join(
        a.timeline, f"timeline_{name}.txt"))
    top = [dict(ms=ms, count=count, name=name)
           for ms, count, name in detail[:a.top]]
    where = "dense batch" if dense else a.strategy or "one GPU"
    rows.append(dict(mix=mix, documents=docs, seq=s, cp=1 if dense else cp,
                     strategy=where, **mean,
                     program=program, top_kernels=top))
    print(f"\n{mix}, {docs} documents, {where}: " + ", ".join(
        f"{key} {val:.3f}" for key, val in mean.items()) + f"; {program}")
    for ms, count, name in detail[:a.top]:
      print(f"  {ms:8.3f} ms {count:4d}x  {name}")
  write("profile_packed", rows, ["mix", "documents", "strategy", "wall_ms",
                                 "busy_ms", "attn_ms", "comm_ms", "other_ms",
                                 "idle_ms", "events", "waits", "waits_ms"],
        dict(heads=n, kv_heads=kh, head_dim=d, dtype="bfloat16",
             calls=a.calls, **packed,
             waits=f"GPU 0's idle stretches over {GAP_US} us "
             "a call"), mode=a.mode)


if __name__ == "__main__":
  main()
