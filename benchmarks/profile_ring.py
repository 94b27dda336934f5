"""Where a ring step's time goes: a jax.profiler trace of the ring's forward
and forward+backward, summarised per GPU from the trace's kernel events.

  python benchmarks/profile_ring.py --seq 16384 32768 [--kv-heads 32 8]
                                    [--out DIR] [--loop unrolled]

For each shape and pass, per call and averaged over GPUs:

| column      | meaning                                                  |
|-------------|----------------------------------------------------------|
| wall_ms     | first kernel start to last kernel end, per call          |
| busy_ms     | union of all kernel intervals                            |
| attn_ms     | cuDNN attention kernels (names with fmha/flash/sdpa/cudnn)|
| comm_ms     | NCCL kernels (sends/receives of the ring)                |
| comm_only   | NCCL time with no other kernel running (exposed comm)    |
| other_ms    | every other kernel (merges, casts, copies, slicing)      |
| idle_ms     | wall - busy: launch gaps, host waits                     |

The raw Perfetto trace, a per-kernel table of GPU 0 and GPU 0's kernel
timeline (start, duration, stream, kind) are written to ``--out`` for a
closer look.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import sys
import tempfile

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ring
from common import (GRAPHS, environment, jit_variant, random_qkv,
                    results_path, ring_args, ring_kwargs, write)

ATTN = ("fmha", "flash", "sdpa", "cudnn", "attn")


def kind(name: str) -> str:
  n = name.lower()
  if "nccl" in n:
    return "comm"
  if any(a in n for a in ATTN):
    return "attn"
  return "other"


def union(intervals) -> float:
  total, end = 0.0, -np.inf
  for s, e in sorted(intervals):
    if s > end:
      total += e - s
      end = e
    elif e > end:
      total += e - end
      end = e
  return total


def gaps(intervals, over: float) -> tuple[int, float]:
  """``(count, total length)`` of the stretches longer than ``over`` in
  which none of ``intervals`` runs, between the first and the last (a
  GPU waiting, often for the host)."""
  count, total, end = 0, 0.0, None
  for s, e in sorted(intervals):
    if end is not None and s - end > over:
      count, total = count + 1, total + s - end
    end = e if end is None else max(end, e)
  return count, total


def exposed(comm, rest) -> float:
  """Length of ``comm`` intervals not covered by any of ``rest``."""
  return union(list(comm) + list(rest)) - union(rest) if comm else 0.0


def gpu_events(trace_path):
  with gzip.open(trace_path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpus = {pid: n for pid, n in names.items() if "/device:GPU" in n}
  # A GPU's rows are its CUDA streams plus derived rows ("XLA Ops", "XLA
  # Modules") that repeat the same time: keep the streams.
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"
             and e.get("pid") in gpus}
  streams = {k for k, n in threads.items() if n.lower().startswith("stream")}
  per = collections.defaultdict(list)
  for e in events:
    if (e.get("ph") == "X" and e.get("pid") in gpus and "dur" in e and
        (e["pid"], e.get("tid")) in streams):
      per[gpus[e["pid"]]].append((e["ts"], e["ts"] + e["dur"], e["name"],
                                  threads[(e["pid"], e["tid"])]))
  return per


def summarise(per, calls: int, classify=None,
              families=("attn", "comm", "other")):
  """Per call, averaged over GPUs: wall, busy and idle time, the kernel time
  of each family (``classify(name)``, default :func:`kind`), and NCCL time
  with nothing else running; GPU 0's kernels by time and its timeline."""
  classify = classify or kind
  if not per:
    raise SystemExit("no GPU kernel events in the trace (GPUs only)")
  ms = lambda us: us / 1e3 / calls
  rows, detail = [], None
  for gpu, evs in sorted(per.items()):
    by = collections.defaultdict(list)
    for s, e, n, _ in evs:
      by[classify(n)].append((s, e))
    allv = [(s, e) for s, e, _, _ in evs]
    wall = max(e for _, e in allv) - min(s for s, _ in allv)
    busy = union(allv)
    rest = [iv for f in families if f != "comm" for iv in by[f]]
    rows.append(dict(gpu=gpu, wall_ms=ms(wall), busy_ms=ms(busy)))
    for f in families:
      rows[-1][f"{f}_ms"] = ms(union(by[f]))
      if f == "comm":
        rows[-1]["comm_only_ms"] = ms(exposed(by["comm"], rest))
    rows[-1]["idle_ms"] = ms(wall - busy)
    if detail is None:
      t0 = min(s for s, _, _, _ in evs)
      timeline = [(s - t0, e - s, st, classify(n), n[:70])
                  for s, e, n, st in sorted(evs)]
      agg = collections.defaultdict(lambda: [0, 0.0])
      for s, e, n, _ in evs:
        agg[n][0] += 1
        agg[n][1] += e - s
      detail = sorted(((v[1] / 1e3 / calls, v[0] // calls, n[:110])
                       for n, v in agg.items()), reverse=True)
  mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]
          if k != "gpu"}
  return mean, detail, timeline


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--seq", type=int, nargs="+", default=[16384, 32768])
  p.add_argument("--kv-heads", type=int, nargs="+", default=[32])
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--loop", default="unrolled")
  ring_args(p)
  p.add_argument("--path", choices=["shard_map", "auto"], default="shard_map",
                 help="ring_attention in shard_map, or dot_product_attention "
                 "with ContextParallel under jit")
  p.add_argument("--strategy", default="ring",
                 help="with --path auto: any ContextParallel strategy")
  p.add_argument("--kv-chunk-heads", type=int, default=None,
                 help="all_gather: gather this many kv heads at a time")
  p.add_argument("--inputs", default="load_balanced",
                 choices=["load_balanced", "natural"],
                 help="with --path auto: arrays in the dual-chunk layout, or "
                 "in natural order (ContextParallel's default)")
  p.add_argument("--calls", type=int, default=3)
  p.add_argument("--graphs", default="", choices=[""] + list(GRAPHS),
                 help="compile with these command buffers (common.GRAPHS); "
                 "default: XLA's")
  p.add_argument("--out", default=tempfile.mkdtemp())
  a = p.parse_args()
  if a.strategy != "ring" and a.path != "auto":
    p.error("--strategy other than ring needs --path auto")
  os.makedirs(a.out, exist_ok=True)
  variant = f"@{a.graphs}" if a.graphs else ""
  tag = f"-{a.graphs}" if a.graphs else ""  # file names: no "@"
  nat = "_natural" if a.inputs == "natural" else ""
  mesh = Mesh(np.array(jax.devices()), ("cp",))
  sh = NamedSharding(mesh, P(None, "cp"))
  table = []
  for s in a.seq:
    for kh in a.kv_heads:
      q, k, v, do = random_qkv(s, s, a.heads, kh, a.head_dim)
      args = [jax.device_put(x, sh) for x in (q, k, v, do)]
      if a.path == "shard_map":
        ring = jax.shard_map(
            lambda q, k, v: jax_ring.ring_attention(
                q, k, v, axis_name="cp", is_causal=True,
                load_balance="dual_chunk", loop=a.loop, **ring_kwargs(a)),
            mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
      else:
        cpc = jax_ring.ContextParallel(
            axis="cp", strategy=a.strategy, load_balance="dual_chunk",
            loop=a.loop, kv_chunk_heads=a.kv_chunk_heads,
            inputs=a.inputs, **ring_kwargs(a))
        ring = lambda q, k, v: jax_ring.dot_product_attention(
            q, k, v, is_causal=True, context_parallel=cpc)
      fns = {"fwd": (jit_variant(ring, variant), args[:3]),
             "fwdbwd": (jit_variant(lambda q, k, v, do: jax.vjp(
                 ring, q, k, v)[1](do), variant), args)}
      for pas, (fn, xs) in fns.items():
        jax.block_until_ready(fn(*xs))
        jax.block_until_ready(fn(*xs))
        name = f"{a.path}_{a.strategy}{tag}{nat}_{s}_{kh}_{pas}"
        d = os.path.join(a.out, f"trace_{name}")
        with jax.profiler.trace(d, create_perfetto_trace=True):
          for _ in range(a.calls):
            out = fn(*xs)
          jax.block_until_ready(out)
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"),
                         recursive=True)[0]
        mean, detail, timeline = summarise(gpu_events(path), a.calls)
        row = dict(path=a.path, strategy=a.strategy, seq=s, kv_heads=kh,
                   pass_=pas, **mean)
        table.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v)
               for k, v in row.items()}, flush=True)
        with open(os.path.join(a.out, f"kernels_{name}.txt"), "w") as f:
          f.write("ms/call  count/call  kernel (GPU 0)\n")
          for ms, cnt, n in detail:
            f.write(f"{ms:8.3f} {cnt:6d}  {n}\n")
        with open(os.path.join(a.out, f"timeline_{name}.txt"), "w") as f:
          f.write("start_us  dur_us  stream  kind  kernel (GPU 0, all calls)\n")
          for t, d, st, k, n in timeline:
            f.write(f"{t:9.1f} {d:8.1f}  {st[:12]:12s} {k:5s} {n}\n")
  cols = ["path", "strategy", "seq", "kv_heads", "pass_", "wall_ms",
          "busy_ms", "attn_ms",
          "comm_ms", "comm_only_ms", "other_ms", "idle_ms"]
  # Next to the traces; copy it to benchmarks/results/ to keep it.
  out = pathlib.Path(a.out, results_path("profile_ring", environment()).name)
  write("profile_ring", table, cols, path=out,
        mode=f"{a.path}_{a.strategy}{tag}{nat}",
        extra=dict(loop=a.loop, strategy=a.strategy,
                   kv_chunk_heads=a.kv_chunk_heads,
                   command_buffers=a.graphs or "xla default",
                   **ring_kwargs(a), heads=a.heads, head_dim=a.head_dim,
                   dtype="bfloat16", batch=1))


if __name__ == "__main__":
  sys.exit(main())
