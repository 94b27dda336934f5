"""The host beside GPU 0: one forward+backward of a packed row, called back
to back as strategies.py times it, traced with jax.profiler; the host
threads' events (XLA's thunks, branch tests, command-buffer updates and
launches, the handlers' reads) and GPU 0's kernels, merged in time order.

  python benchmarks/host_trace.py --strategy ring_contiguous \\
      --mix lognormal_balanced --heads 32 --kv-heads 8 --out FILE
  python benchmarks/host_trace.py --read FILE

Writes the timeline into ``--out`` as the section ``--mode`` (a ``#``
line naming the run, then one line an event: microseconds from the first
event, duration, where, name; events under 0.5 us left out), replacing a
section of that name and keeping the others, and prints, for each
section, GPU 0's busy and idle time a call and its idle stretches over
``--gap`` us, each with the host events that ran inside it: what the GPU
waited for. ``--read`` prints that summary of a file written before. No
``--strategy``: one GPU.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile


def record(a) -> None:
  import jax
  import jax_ring
  sys.path.insert(0, os.path.dirname(__file__))
  from common import random_qkv
  from strategies import mix_ids, setup
  ids, cpc = mix_ids(a.mix, a.seq), None
  args = random_qkv(0, a.seq, a.heads, a.kv_heads, 128)  # q, k, v, dout
  if a.strategy:
    cpc, sh, to, _ = setup(a.strategy, jax.device_count(), "dual_chunk")
    args = tuple(jax.device_put(to(x), sh) for x in args)
    ids = None if ids is None else jax.device_put(to(ids), sh)
  attn = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, context_parallel=cpc)
  # As strategies.py times it: the cotangent an argument, laid out as the
  # output is (a constant one, as jax.grad of a sum gives, XLA may lay out
  # otherwise and copy).
  step = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
  for _ in range(3):
    jax.block_until_ready(step(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(a.calls):
        out = step(*args)
      jax.block_until_ready(out)
    path = next(os.path.join(r, f) for r, _, fs in os.walk(tmp)
                for f in fs if f.endswith(".trace.json.gz"))
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name"
                       else e["pid"]: e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  procs, threads = meta("process_name"), meta("thread_name")
  rows = []
  for e in events:
    if e.get("ph") != "X" or e.get("dur", 0) < 0.5:
      continue
    proc, thread = procs.get(e["pid"], ""), threads.get(
        (e["pid"], e.get("tid")), "")
    if "GPU" in proc:
      if "/device:GPU:0" not in proc or not thread.lower().startswith(
          "stream"):
        continue
      where = "G0 " + thread[:10]
    else:
      where = "H " + thread[:14]
    rows.append((e["ts"], e["dur"], where, e["name"][:110]))
  rows.sort()
  sections = read_sections(a.out) if os.path.exists(a.out) else {}
  sections[a.mode] = (
      f"# {a.mode}: {' '.join(sys.argv)}; {jax.devices()[0].device_kind} x "
      f"{jax.device_count()}, jax {jax.__version__}",
      [f"{ts - rows[0][0]:10.1f} {d:8.1f} {w:26} {n}\n"
       for ts, d, w, n in rows])
  with open(a.out, "w") as f:
    for head, lines in sections.values():
      f.write(head + "\n")
      f.writelines(lines)


def read_sections(path: str) -> dict:
  """``{mode: (header line, event lines)}`` of a timeline file."""
  sections, mode = {}, None
  with open(path) as f:
    for line in f:
      if line.startswith("# "):
        mode = line[2:].split(":")[0]
        sections[mode] = (line.rstrip("\n"), [])
      elif mode is not None:
        sections[mode][1].append(line)
  return sections


def summary(path: str, calls: int, gap_us: float) -> None:
  for head, lines in read_sections(path).values():
    print(head)
    summarise(lines, calls, gap_us)


def summarise(lines, calls: int, gap_us: float) -> None:
  rows = []
  for line in lines:
    ts, d = map(float, line.split()[:2])
    rows.append((ts, ts + d, line[20:46].strip(), line[47:].strip()))
  gpu = [r for r in rows if r[2].startswith("G0")]
  if not gpu:
    print("no GPU 0 kernels in this run")
    return
  busy = idle = 0.0
  end, stretches = gpu[0][0], []
  for b, e, _, name in gpu:
    if b > end:
      idle += b - end
      if b - end > gap_us:
        stretches.append((end, b, name))
    busy, end = busy + e - b, max(end, e)
  print(f"GPU 0 over {calls} calls: {(end - gpu[0][0]) / calls:.0f} us a "
        f"call, busy {busy / calls:.0f}, idle {idle / calls:.0f}")
  for b, e, name in stretches:
    host = [r[3][:40] for r in rows if r[2].startswith("H") and
            b <= r[0] < e and r[1] - r[0] >= 10]
    print(f"  idle {e - b:7.1f} us at {b:9.1f} before {name[:40]}: "
          + "; ".join(host[:6]))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--mix", default="equal64")
  p.add_argument("--seq", type=int, default=32768)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--strategy", default=None,
                 help="a strategies.py name, over every local GPU")
  p.add_argument("--calls", type=int, default=3)
  p.add_argument("--gap", type=float, default=100.0)
  p.add_argument("--mode", default="default",
                 help="this run's section in the --out file")
  p.add_argument("--out", help="write the timeline here")
  p.add_argument("--read", help="summarise a timeline written before")
  a = p.parse_args()
  if not (a.out or a.read):
    p.error("give --out or --read")
  if a.out:
    record(a)
  summary(a.read or a.out, a.calls, a.gap)


if __name__ == "__main__":
  main()
