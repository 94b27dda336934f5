"""What the host costs a packed row's attention over every local GPU: the
time of one forward+backward a call and of ``--layers`` of them in one
program (as a model's layers run), and, from a jax.profiler trace, XLA's
host stages at each run of each program: ``Thunks::Prepare`` and
``Thunks::Initialize`` (every thunk of the program, in every branch of
every conditional, taken or not) and ``GpuExecutable::ExecuteThunks``
(launches and host waits), and the time from a run's start to GPU 0's
first kernel. Also the program's launches
(``common.program_summary``) and, for each conditional of its entry, the
launches each branch holds (``common.branch_launches``). Printed and
written to ``results/profile_host_<n>x<GPU>.json``.

  python benchmarks/profile_host.py --strategy ring_contiguous \\
      --mix lognormal_balanced --seq 65536 --heads 32 --kv-heads 8

``--tail-divisors 16 4 2`` sets the contiguous ring's step-1 tail sizes
(``reach.TAIL_DIVISORS``: the shard length over each) before the
programs are traced, to weigh their branches; ``--tail-divisors`` alone
leaves none (at cp > 2 the switch is then: no step, or the path over
every step, or, under ``auto``, Ulysses). ``--strategy
auto_contiguous`` is ``auto`` on contiguous shards (the ring first, then
Ulysses past its tails). ``--scan`` runs the layers as a ``lax.scan``
over one layer's program, as a model that scans its layers holds them:
XLA then prepares one layer's work a run, not ``--layers`` copies.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ring

sys.path.insert(0, os.path.dirname(__file__))
from common import (branch_launches, loop_contents,  # noqa: E402
                    packed_path_args, program_summary, random_qkv,
                    tail_args, time_fn, traced, use_packed_path,
                    use_tail_divisors, write)
from strategies import mix_ids, setup  # noqa: E402

STAGES = ("Thunks::Prepare", "Thunks::Initialize",
          "GpuExecutable::ExecuteThunks")


def host_stages(trace_path: str) -> dict:
  """Each of ``STAGES``: its mean duration in ms over the runs and devices
  of the trace (every device's thread records its own), and its count;
  and ``to_first_kernel_ms``, the mean time from device 0's
  ``ExecuteThunks`` to GPU 0's first kernel of that run (None without GPU
  events)."""
  with gzip.open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  gpu0 = {e["pid"] for e in events if e.get("ph") == "M" and e.get(
      "name") == "process_name" and e["args"]["name"] == "/device:GPU:0"}
  durs, starts = collections.defaultdict(list), []
  kernels = sorted(e["ts"] for e in events
                   if e.get("ph") == "X" and e.get("pid") in gpu0)
  for e in events:  # a device thread's events may lead with "[i] "
    name = e.get("name", "").split("] ", 1)[-1]
    if e.get("ph") == "X" and name in STAGES:
      durs[name].append(e["dur"] / 1e3)
      if e["name"] == "[0] " + STAGES[-1]:
        starts.append(e["ts"])
  out = {}
  for stage in STAGES:
    key = stage.split("::")[1].lower()
    out[f"{key}_ms"] = float(np.mean(durs[stage])) if durs[stage] else None
    out[f"{key}_count"] = len(durs[stage])
  gaps = [kernels[i] - t for t in starts
          if (i := bisect.bisect_left(kernels, t)) < len(kernels)]
  out["to_first_kernel_ms"] = float(np.mean(gaps)) / 1e3 if gaps else None
  return out


def programs(strategy, mix, s, n, kh, layers, scan=False):
  """(one forward+backward, ``layers`` of them chained in one program,
  their arguments) over every local device. ``scan``: the layers as a
  ``lax.scan`` over one layer's program (as models that scan their layers
  hold them), not ``layers`` copies of it."""
  q, k, v, _ = random_qkv(0, s, n, kh, 128)
  ids = mix_ids(mix, s)
  cpc, sh, to, _ = setup(strategy, jax.device_count(), "dual_chunk")
  q, k, v = (jax.device_put(to(x), sh) for x in (q, k, v))
  ids = None if ids is None else jax.device_put(to(ids), sh)

  def grads(q, k, v, ids):
    loss = lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids,
        context_parallel=cpc).astype(jnp.float32).sum()
    return jax.grad(loss, (0, 1, 2))(q, k, v)

  def stacked(q, k, v, ids):
    def layer(carry, _):  # each layer's queries depend on the last one's
      q, total = carry
      dq, dk, dv = grads(q, k, v, ids)
      total += dk.astype(jnp.float32).sum() + dv.astype(jnp.float32).sum()
      return ((q + 1e-3 * dq).astype(q.dtype), total), None

    carry = (q, jnp.zeros((), jnp.float32))
    if scan:
      return jax.lax.scan(layer, carry, None, length=layers)[0]
    for _ in range(layers):
      carry = layer(carry, None)[0]
    return carry

  return jax.jit(grads), jax.jit(stacked), (q, k, v, ids)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--strategy", default="ring_contiguous")
  p.add_argument("--mix", default="lognormal_balanced")
  p.add_argument("--seq", type=int, default=65536)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--scan", action="store_true",
                 help="the layers as a lax.scan over one layer's program")
  p.add_argument("--calls", type=int, default=4)
  tail_args(p)
  p.add_argument("--mode", default="default")
  packed_path_args(p)
  a = p.parse_args()
  packed = use_packed_path(a.packed_path, a.tile_sizes, a.pallas_stages)
  divisors = use_tail_divisors(a.tail_divisors)
  one, many, args = programs(a.strategy, a.mix, a.seq, a.heads, a.kv_heads,
                             a.layers, a.scan)
  rows = []
  for name, fn, per in (("one", one, 1),
                        ("scan" if a.scan else "layers", many, a.layers)):
    compiled = fn.lower(*args).compile()
    hlo = compiled.as_text()
    ms = time_fn(compiled, *args) * 1e3
    row = dict(program=name, attention_calls=per, ms=ms,
               ms_per_attention=ms / per,
               **traced(compiled, args, a.calls if per == 1 else 1,
                        host_stages),
               **program_summary(hlo), branches=branch_launches(hlo),
               loops=loop_contents(hlo))
    rows.append(row)
    print(f"{name}: {row}")
    # Written after each program: the layers' one compiles for minutes.
    write("profile_host", rows, ["program", "attention_calls", "ms",
                                 "ms_per_attention", "prepare_ms",
                                 "initialize_ms", "to_first_kernel_ms",
                                 "executethunks_ms", "launches"],
          dict(strategy=a.strategy, mix=a.mix, seq=a.seq, heads=a.heads,
               kv_heads=a.kv_heads, head_dim=128, dtype="bfloat16",
               **packed, tail_divisors=divisors,
               scan=a.scan,
               xla_flags=os.environ.get("XLA_FLAGS", "")), mode=a.mode)


if __name__ == "__main__":
  main()
