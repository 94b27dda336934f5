"""Where a packed row's forward+backward time goes on one GPU: a
jax.profiler trace of ``jax_ring.dot_product_attention`` on a row of
equal documents, summarised from its kernel events (the per-call mean of
wall, busy, attention and other kernels, idle; GPU 0's events and its
waits, the idle stretches of over 20 us that a host round trip leaves;
the program's launches, loops and conditionals in and out of CUDA graphs
(``common.program_summary``); then the kernels by time), printed and
written to ``results/profile_packed_<n>x<GPU>.json`` (``--mode`` names
the run; ``XLA_FLAGS`` is recorded).

  python benchmarks/profile_packed.py --docs 1 64 4096 [--seq 32768]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

import jax_ring

sys.path.insert(0, os.path.dirname(__file__))
from common import (document_ids, program_summary, random_qkv,  # noqa: E402
                    write)
from profile_ring import gaps, gpu_events, summarise  # noqa: E402

GAP_US = 20.0


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--docs", type=int, nargs="+", default=[1, 64, 4096])
  p.add_argument("--seq", type=int, default=32768)
  p.add_argument("--calls", type=int, default=5)
  p.add_argument("--top", type=int, default=14)
  p.add_argument("--mode", default="default")
  a = p.parse_args()
  rows = []
  s, n, kh, d = a.seq, 16, 8, 128
  q, k, v, _ = random_qkv(0, s, n, kh, d)
  for docs in a.docs:
    ids = jnp.asarray(document_ids([s // docs] * docs))
    loss = lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids).astype(jnp.float32).sum()
    step = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
    program = program_summary(step.as_text())
    jax.block_until_ready(step(q, k, v))
    with tempfile.TemporaryDirectory() as tmp:
      with jax.profiler.trace(tmp):
        for _ in range(a.calls):
          out = step(q, k, v)
        jax.block_until_ready(out)
      trace = next(os.path.join(r, f) for r, _, fs in os.walk(tmp)
                   for f in fs if f.endswith(".trace.json.gz"))
      per = gpu_events(trace)
      mean, detail, _ = summarise(per, a.calls)
    # GPU 0's launches, and its waits of over GAP_US (each host round trip
    # of a run-time branch or loop test leaves one), per call.
    evs = [(b, e) for b, e, _, _ in next(iter(sorted(per.items())))[1]]
    waits, waited = gaps(evs, GAP_US)
    mean.update(events=len(evs) / a.calls, waits=waits / a.calls,
                waits_ms=waited / 1e3 / a.calls)
    top = [dict(ms=ms, count=count, name=name)
           for ms, count, name in detail[:a.top]]
    rows.append(dict(documents=docs, seq=s, **mean, program=program,
                     top_kernels=top))
    print(f"\n{docs} documents of {s // docs}: " + ", ".join(
        f"{key} {val:.3f}" for key, val in mean.items()) + f"; {program}")
    for ms, count, name in detail[:a.top]:
      print(f"  {ms:8.3f} ms {count:4d}x  {name}")
  write("profile_packed", rows, ["documents", "wall_ms", "busy_ms",
                                 "attn_ms", "other_ms", "idle_ms", "events",
                                 "waits", "waits_ms"],
        dict(heads=n, kv_heads=kh, head_dim=d, dtype="bfloat16",
             calls=a.calls, waits=f"GPU 0's idle stretches over {GAP_US} us "
             "a call"), mode=a.mode)


if __name__ == "__main__":
  main()
