"""Summary of a GPU-lane run (``benchmarks/gpu_tests.sh``): counts, time,
versions, and the context-parallel cases' errors and cuDNN calls, as
``results/gpu_tests_<count>x<GPU>.txt``.

  python benchmarks/gpu_tests.py --junit gpu_tests.xml \\
      --record gpu_cases.jsonl --seconds 312 [--out DIR]

``--junit`` is pytest's ``--junitxml`` report; ``--record`` the lines that
``tests/test_gpu_cp.py`` appends under ``JAX_RING_TEST_RECORD``. A lane run
in parts (``LANE_SHARD=i/n``, one machine) is merged by giving each part's
files and seconds, in the same order; each part's record also holds the
machine's environment (one ``{"environment": ...}`` line, appended here),
so that the summary can be written on another machine. A part whose
report pytest never wrote (stopped in its shutdown) is named as such, its
recorded cases' errors still summarised:

  python benchmarks/gpu_tests.py --junit p1.xml p2.xml \\
      --record p1.jsonl p2.jsonl --seconds 300 280
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time
import xml.etree.ElementTree as ET

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import common  # noqa: E402

def outcomes(junit: pathlib.Path) -> list[tuple[str, str, str, str]]:
  """(module, test id, outcome, message) of every test case in the report;
  outcome is passed, failed, error or skipped."""
  out = []
  for tc in ET.parse(junit).getroot().iter("testcase"):
    module = tc.get("classname", "").rpartition(".")[2] or "?"
    outcome, message = "passed", ""
    for tag in ("failure", "error", "skipped"):
      node = tc.find(tag)
      if node is not None:
        outcome = "failed" if tag == "failure" else tag
        message = ((node.get("message") or "").splitlines() or [""])[0][:160]
    out.append((module, tc.get("name", ""), outcome, message))
  return out


def summary(results, records, seconds, env, command, missing=()) -> str:
  """``seconds``: the wall time of each part (one, unless merged);
  ``missing``: the junit reports that pytest never wrote."""
  counts = collections.Counter(o for _, _, o, _ in results)
  wall = f"{sum(seconds):.0f} s" + (
      "" if len(seconds) == 1 else " in " + str(len(seconds)) +
      " parts, one after another on one machine (" +
      " + ".join(f"{s:.0f}" for s in seconds) + " s)")
  lines = [
      "jax_ring GPU lane",
      f"command: {command}",
      f"date: {env.get('date') or time.strftime('%Y-%m-%d')}",
      f"devices: {env['device_count']} x {env['device']}; jax {env['jax']}; "
      f"cuDNN {env.get('cudnn', 'not loaded')}; jax_ring {env['jax_ring']}",
      f"wall time: {wall}",
      "totals: " + ", ".join(f"{counts[k]} {k}" for k in (
          "passed", "failed", "error", "skipped"))]
  if missing:
    lines.append("no junit report in " + ", ".join(missing) + " (pytest "
                 "stopped before writing it): the totals leave out those "
                 "tests; the errors below still hold their recorded "
                 "context-parallel cases")
  lines += ["", "by module:"]
  by_module = collections.defaultdict(collections.Counter)
  for module, _, outcome, _ in results:
    by_module[module][outcome] += 1
  for module, c in sorted(by_module.items()):
    lines.append(f"  {module}: " + ", ".join(
        f"{n} {k}" for k, n in sorted(c.items())))
  cp = [(name, o) for m, name, o, _ in results if m == "test_gpu_cp"
        and name.startswith("test_cuda_blocks")]
  if cp:
    c = collections.Counter(o for _, o in cp)
    lines += ["", f"context-parallel cases with cuDNN blocks: {len(cp)}, of "
              "which " + ", ".join(f"{c[k]} {k}" for k in (
                  "passed", "failed", "error", "skipped"))]
    for label, index in (("by cp x strategy", (0, 1)), ("by mask", (2,)),
                         ("by layout", (3,)), ("by entry", (4,))):
      tally = collections.defaultdict(collections.Counter)
      for name, o in cp:
        parts = name[name.index("[") + 1:-1].split("-")
        tally["-".join(parts[i] for i in index)][o] += 1
      lines.append(f"  {label}: " + "; ".join(
          f"{k} {c['passed']}/{sum(c.values())}"
          for k, c in sorted(tally.items())))
  if records:
    lines += ["", "largest error / tolerance over the passed cases, by "
              "dtype (error = max|got - float64| / max(1, max|float64|)):"]
    worst, tolerance = collections.defaultdict(dict), {}
    for r in records:
      dtype = r["case"].rsplit("_", 1)[1]
      tolerance[dtype] = r["tolerance"]
      for name, err in r["errors"].items():
        worst[dtype][name] = max(worst[dtype].get(name, 0.0), err)
    for dtype, errs in sorted(worst.items()):
      tol = tolerance[dtype]
      lines.append(f"  {dtype} (tolerance {tol:g}): " + ", ".join(
          f"{k} {v:.2e} ({v / tol:.2f})" for k, v in errs.items()))
    fwd = sorted(sum(n for t, n in r["ffi_calls"].items() if "fwd" in t)
                 for r in records)
    bwd = sorted(sum(n for t, n in r["ffi_calls"].items() if "bwd" in t)
                 for r in records)
    lines.append(f"cuDNN FFI calls per compiled program: forward "
                 f"{fwd[0]}-{fwd[-1]}, backward {bwd[0]}-{bwd[-1]}; case "
                 f"times {min(r['seconds'] for r in records):.1f}-"
                 f"{max(r['seconds'] for r in records):.1f} s")
    phases = collections.Counter()
    for r in records:
      phases.update(r.get("phases", {}))
    if phases:
      lines.append("case time by phase, summed over the cases: " + ", ".join(
          f"{k} {v:.0f} s" for k, v in phases.items()))
  failed = [(n, m) for _, n, o, m in results if o in ("failed", "error")]
  if failed:
    lines += ["", "failed:"] + [f"  {n}: {m}" for n, m in failed]
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--junit", type=pathlib.Path, nargs="+", required=True)
  p.add_argument("--record", type=pathlib.Path, nargs="*", default=[])
  p.add_argument("--seconds", type=float, nargs="+", required=True)
  p.add_argument("--command", default="python -m pytest tests -m gpu")
  p.add_argument("--out", type=pathlib.Path, default=common.RESULTS)
  args = p.parse_args(argv)
  if len(args.seconds) != len(args.junit):
    p.error(f"--seconds needs one value per --junit report; got "
            f"{len(args.seconds)} for {len(args.junit)}")
  lines = [json.loads(line) for path in args.record if path.exists()
           for line in path.read_text().split("\n") if line]
  records = [r for r in lines if "environment" not in r]
  recorded = [r["environment"] for r in lines if "environment" in r]
  if recorded:  # the machine the parts ran on (merged elsewhere)
    env = recorded[0]
  else:
    env = dict(common.environment(), date=time.strftime("%Y-%m-%d"))
    if args.record:  # kept with the cases, for a merge on another machine
      with open(args.record[0], "a") as f:
        f.write(json.dumps(dict(environment=env)) + "\n")
  missing = [str(path) for path in args.junit if not path.exists()]
  results = [r for path in args.junit if path.exists()
             for r in outcomes(path)]
  text = summary(results, records, args.seconds, env, args.command, missing)
  kind = common.device_kind(env["device"], env["platform"])
  path = args.out / f"gpu_tests_{env['device_count']}x{kind}.txt"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  print(text + f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
