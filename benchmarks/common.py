"""Shared benchmark plumbing: timing, environment record, JSON + table out."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_ring

RESULTS = pathlib.Path(__file__).parent / "results"


def shape_args(parser, seq):
  """The attention benchmarks' flags: ``--seq`` (default ``seq``),
  ``--kv-heads`` (32 8), ``--heads`` (32), ``--head-dim`` (128), B = 1;
  and ``--mode``, the run's name in the results file."""
  parser.add_argument("--seq", type=int, nargs="+", default=list(seq))
  parser.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8])
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--mode", default="default",
                      help="this run's name in the results file (the file "
                      "keeps its other modes)")


def ring_args(parser):
  """The ring's tuning flag ``--kv-sends``; read it back as
  ``ring_attention`` keywords with :func:`ring_kwargs`."""
  from jax_ring._src.core.config import KV_SENDS
  parser.add_argument("--kv-sends", default=None, choices=KV_SENDS,
                      help="default: jax_ring's (gather up to 2 GiB)")


def ring_kwargs(args) -> dict:
  return dict(kv_sends=args.kv_sends)


# XLA's CUDA-graph ("command buffer") settings a benchmark variant may be
# compiled with, by the name after its "@" (``--loops unrolled@nocc``). With
# no "@", XLA's default, which in jax 0.11.2 is FUSION, CUBLAS, CUBLASLT,
# CUSTOM_CALL, CUDNN, CONDITIONAL and DYNAMIC_SLICE_FUSION (from XLA's log):
#   nocc   the default less CUSTOM_CALL: jax_ring's cuDNN calls run outside
#          graphs, and so does every lax.cond around one (a host round trip
#          each), as before the handlers were made graph-compatible
#   while  the default plus WHILE: a scan's loop runs as a CUDA-graph node
_DEFAULT = "FUSION,CUBLAS,CUBLASLT,CUDNN,CONDITIONAL,DYNAMIC_SLICE_FUSION"
GRAPHS = {"nocc": _DEFAULT, "while": _DEFAULT + ",CUSTOM_CALL,WHILE"}


def jit_variant(fn, variant: str):
  """``jax.jit(fn)``, compiled with the command buffers that ``variant``'s
  "@" suffix names (see GRAPHS)."""
  _, _, graphs = variant.partition("@")
  if not graphs:
    return jax.jit(fn)
  return jax.jit(fn, compiler_options={
      "xla_gpu_enable_command_buffer": GRAPHS[graphs]})


_CALLS = re.compile(r"(?:to_apply|body|condition|calls|true_computation|"
                    r"false_computation)=%?([\w.\-]+)|branch_computations="
                    r"\{([^}]*)\}")
_LAUNCH = (" fusion(", " custom-call(", " all-reduce(", " all-gather(",
           " all-to-all(", " collective-permute(", " reduce-scatter(",
           " copy(", " sort(", " scatter(", " gather(")


def _computations(hlo: str):
  """A compiled program's text as ``(body, calls, fused)``: each
  computation's instruction lines, the computations each one calls, and
  those that are fusions' own (they launch nothing themselves)."""
  body, calls, name = {}, {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" ") and "(" in line:
      name = line.split("(")[0].split()[-1].lstrip("%")
      body[name], calls[name] = [], set()
    elif name is not None and line.startswith(" "):
      body[name].append(line)
      for one, many in _CALLS.findall(line):
        calls[name].update([one] if one else [
            c.strip().lstrip("%") for c in many.split(",") if c.strip()])
  fused = {c for lines in body.values() for line in lines if " fusion(" in line
           for c in _CALLS.findall(line) for c in c if c}
  return body, calls, fused


def program_summary(hlo: str) -> dict:
  """Counts in a compiled GPU program's text (``compiled.as_text()``):
  XLA's command buffers (CUDA graphs: computations named
  ``command_buffer``, and all they call, run on the device without the
  host), and, inside them and outside, the instructions that launch work
  (fusions, custom calls, collectives, copies, sorts), while loops and
  conditionals (outside a graph, each loop test and branch is read back
  by the host). Only command buffers written into the text are seen:
  jax 0.11.2's XLA forms its command buffers from the compiled thunks,
  after the text, so there ``graphs`` and the ``_in_graphs`` counts stay
  0 even where graphs run (``profile_packed_4xH200.json``,
  ``ulysses_4_cmdbuf``: idle 3.17 to 0.88 ms with the conditional and
  while command buffers on, ``graphs`` 0); the other counts are the
  program's, in graphs or not."""
  body, calls, fused = _computations(hlo)
  graph = {n for n in body if "command_buffer" in n}
  todo = list(graph)
  while todo:
    for callee in calls.get(todo.pop(), ()):
      if callee in body and callee not in graph:
        graph.add(callee)
        todo.append(callee)
  out = dict(graphs=sum("command_buffer" in n for n in body))
  for key, ops in (("launches", _LAUNCH), ("whiles", (" while(",)),
                   ("conditionals", (" conditional(",))):
    for where in ("", "_in_graphs"):
      out[key + where] = sum(
          any(op in line for op in ops) for n, lines in body.items()
          if (n in graph) == bool(where) and n not in fused
          for line in lines)
  return out


def branch_launches(hlo: str) -> list[list[int]]:
  """For each conditional of a compiled program's entry computation, in
  order, the launching instructions (as :func:`program_summary` counts
  them) that each branch holds, with all it calls. XLA prepares every
  branch's work at every run of the program, taken or not."""
  body, calls, fused = _computations(hlo)
  entry = next((line.split("(")[0].split()[-1].lstrip("%")
                for line in hlo.splitlines() if line.startswith("ENTRY")), None)

  def launches(name, seen):
    if name in seen or name in fused or name not in body:
      return 0
    seen.add(name)
    own = sum(any(op in line for op in _LAUNCH) for line in body[name])
    return own + sum(launches(c, seen) for c in calls[name])

  out = []
  for line in body.get(entry, ()):
    if " conditional(" in line:
      names = [c for one, many in _CALLS.findall(line)
               for c in ([one] if one else [
                   x.strip().lstrip("%") for x in many.split(",")])]
      out.append([launches(n, set()) for n in names])
  return out


def loop_contents(hlo: str) -> list[dict]:
  """For each while loop of a compiled program's entry computation (a
  ``lax.scan`` over layers is one), what its body runs at every trip,
  with all it calls: launching instructions (as :func:`program_summary`
  counts them), sorts and scatters (a packed row's document analysis, the
  same at every layer) and conditionals (each a host wait a trip, outside
  a command buffer); ``trips`` where XLA knows the count. Work that XLA
  hoisted out of the loop (it depends on no carried value) is not here."""
  body, calls, fused = _computations(hlo)
  entry = next((line.split("(")[0].split()[-1].lstrip("%")
                for line in hlo.splitlines() if line.startswith("ENTRY")), None)

  def reach(name, seen):
    if name in body and name not in seen:
      seen.add(name)
      for c in calls[name]:
        reach(c, seen)
    return seen

  out = []
  for line in body.get(entry, ()):
    loop = re.search(r" while\(.*body=%?([\w.\-]+)", line)
    if not loop:
      continue
    trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
    inside = [l for n in reach(loop.group(1), set()) if n not in fused
              for l in body[n]]
    count = lambda *ops: sum(any(op in l for op in ops) for l in inside)
    out.append(dict(trips=int(trips.group(1)) if trips else None,
                    launches=count(*_LAUNCH), sorts=count(" sort("),
                    scatters=count(" scatter("),
                    conditionals=count(" conditional(")))
  return out


def traced(fn, args, calls: int, read):
  """``read(path)`` of a jax.profiler trace (its ``.trace.json.gz``) of
  ``calls`` runs of ``fn(*args)``, after one run outside it."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    return read(next(os.path.join(r, f) for r, _, fs in os.walk(tmp)
                     for f in fs if f.endswith(".trace.json.gz")))


def random_qkv(seed, seq, heads, kv_heads, head_dim, dtype=jnp.bfloat16):
  """Random ``q, k, v, dout`` of batch 1 (never zeros: see METHOD)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q_shape, kv_shape = (1, seq, heads, head_dim), (1, seq, kv_heads, head_dim)
  return (jax.random.normal(ks[0], q_shape, dtype),
          jax.random.normal(ks[1], kv_shape, dtype),
          jax.random.normal(ks[2], kv_shape, dtype),
          jax.random.normal(ks[3], q_shape, dtype))


def lognormal_lengths(rng, seq, median=300, sigma=1.0, cap=8192):
  """Document lengths of one packed row of ``seq`` tokens: drawn from a
  lognormal of ``median`` tokens and ``sigma``, capped at ``cap``, the last
  cut to fit (fine-tuning data's long-tailed mix)."""
  lengths = []
  while sum(lengths) < seq:
    lengths.append(int(min(cap, max(1, rng.lognormal(np.log(median),
                                                      sigma)))))
  lengths[-1] -= sum(lengths) - seq
  return lengths


def document_ids(lengths) -> np.ndarray:
  """``(1, sum(lengths))`` int32 segment ids of one row packed with
  documents of these ``lengths``: 0, 1, ... in order."""
  return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None]


def row_documents(segment_ids) -> np.ndarray:
  """The token counts of the documents of ``segment_ids`` (rows of ids,
  each id one document within its row; 0 is padding), row after row."""
  counts = (np.bincount(np.asarray(r))[1:] for r in segment_ids)
  return np.concatenate([c[c > 0] for c in counts])


def causal_keys(lengths, window: int | None = None) -> float:
  """The keys the queries of documents of ``lengths`` tokens see, summed:
  each query its own document's earlier tokens and itself, the last
  ``window`` of them where a window is given."""
  n = np.asarray(lengths, np.float64)
  full = np.minimum(n, window) if window else n
  return float(np.sum(full * (full + 1) / 2 + (n - full) * (window or 0)))


def rel_err(got, want) -> float:
  """max |got - want| / max |want|, in float32: the benchmarks' error of a
  sharded result against the single-GPU one."""
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def time_fn(fn, *args, repeats=5, min_batch_s=0.05, long_call_s=0.5):
  """Median seconds per call over `repeats` batches of async calls, each
  batch synchronised once, after a warm-up (compilation, cuDNN plan builds).
  Batches last about `min_batch_s`, so short kernels do not time the host;
  a call of over `long_call_s` (the 512k single-GPU baseline takes seconds)
  is timed over 3 batches of one. Under PGLE (``JAX_ENABLE_PGLE=true
  JAX_PGLE_PROFILING_RUNS=1``) a second warm-up call follows: the first is
  profiled and the second recompiles with the measured costs."""
  for _ in range(2 if jax.config.jax_enable_pgle else 1):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = time.perf_counter() - t0
  calls = int(min(50, max(1, min_batch_s / once)))
  samples = []
  for _ in range(3 if once > long_call_s else repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls)
  return float(np.median(samples))


def environment():
  dev = jax.devices()[0]
  env = dict(device=dev.device_kind, platform=dev.platform,
             device_count=jax.device_count(),
             jax=jax.__version__, jax_ring=jax_ring.__version__,
             pgle=bool(jax.config.jax_enable_pgle),
             xla_flags=os.environ.get("XLA_FLAGS", ""))
  try:
    from jax_ring._src.backends import cudnn
    if cudnn.version() is not None:
      env["cudnn"] = int(cudnn.version())
  except Exception:  # pragma: no cover - informational only
    pass
  return env


def device_kind(device: str, platform: str) -> str:
  """A short GPU name for file names: "NVIDIA H200" -> "H200", "NVIDIA
  H100 80GB HBM3" -> "H100"; "CPU" for the host."""
  if platform == "cpu":
    return "CPU"
  words = [w for w in device.split() if w.upper() not in ("NVIDIA", "TESLA")]
  return words[0] if words else device.replace(" ", "_")


def results_path(name: str, env: dict) -> pathlib.Path:
  """``results/<name>_<count>x<kind>.json``: one current file per benchmark,
  device kind and device count."""
  kind = device_kind(env["device"], env["platform"])
  return RESULTS / f"{name}_{env['device_count']}x{kind}.json"


def packed_path_args(p) -> None:
  """``--packed-path``: how a packed cuDNN block runs its calls."""
  p.add_argument("--packed-path", default="pass", choices=PACKED_PATHS,
                 help="one handler a block pass where it serves the shapes, "
                 "rows of short documents as band tiles (pass, the "
                 "library's default: Pallas kernels where they take the "
                 "operands), the same with the tiles as XLA products "
                 "(xla-tiles), with Pallas tiles of up to 128 tokens taking "
                 "every longer document (pallas), every packed block "
                 "through Pallas tiles of the last size with no switch "
                 "(pallas-direct, tiles.DIRECT), without the tiles "
                 "(handler), the pass with every class's calls at their "
                 "most virtual batches (pass-fixed, passes.MENUS off), or "
                 "the calls' switch and loop (calls)")
  tile_sizes_arg(p)


def tile_sizes_arg(p) -> None:
  p.add_argument("--tile-sizes", type=int, nargs="+", default=None,
                 help="the tile sizes of the pass, xla-tiles, pallas and "
                 "pallas-direct paths (default: the library's, 32 64 128 "
                 "for pallas, 64 for pallas-direct)")
  p.add_argument("--pallas-stages", type=int, default=None,
                 help="the Pallas tiles' pipeline stages "
                 "(tiles_pallas.NUM_STAGES; default: the library's)")


PACKED_PATHS = ("pass", "xla-tiles", "pallas", "pallas-direct", "handler",
                "pass-fixed", "calls")


def use_packed_path(path: str, sizes=None, stages=None) -> dict:
  """Make packed cuDNN blocks run as ``path`` (see packed_path_args), with
  tile sizes ``sizes`` where it has tiles and the Pallas tiles in
  ``stages`` pipeline stages (None: the library's); returns what is in
  force, for the results file."""
  from jax_ring._src.backends.cudnn import passes, tiles, tiles_pallas
  if stages is not None:
    tiles_pallas.NUM_STAGES = stages
  passes.ENABLED = path != "calls"
  passes.MENUS = path != "pass-fixed"
  tiles.KERNEL = "xla" if path == "xla-tiles" else tiles.DEFAULT_KERNEL
  if path in ("pallas", "pallas-direct"):
    tiles.KERNEL, tiles.PALLAS_REACH = "pallas", 1 << 30
  tiles.DIRECT = path == "pallas-direct"
  default = {"pass": tiles.DEFAULT_SIZES, "pass-fixed": tiles.DEFAULT_SIZES,
             "xla-tiles": tiles.DEFAULT_SIZES,
             "pallas": (32, 64, 128), "pallas-direct": (64,)}
  tiles.SIZES = (tuple(sizes) if sizes and path in default
                 else default.get(path, ()))
  return dict(packed_path=path, pass_menus=passes.MENUS,
              tile_kernel=tiles.KERNEL,
              tile_sizes=list(tiles.SIZES), tile_direct=tiles.DIRECT,
              pallas_stages=tiles_pallas.NUM_STAGES)


def tail_args(p) -> None:
  """``--tail-divisors``: the contiguous ring's step-1 tail sizes, set
  with :func:`use_tail_divisors` before anything is traced."""
  p.add_argument("--tail-divisors", type=int, nargs="*", default=None,
                 help="reach.TAIL_DIVISORS, the shard length over each tail "
                 "size (default: the library's); given alone, no tails")


def prepare_own_arg(p) -> None:
  """``--prepare-own``: where the ring's own packed block prepares its
  pass, set with :func:`use_prepare_own` before anything is traced."""
  p.add_argument("--prepare-own", choices=("on", "off"), default="on",
                 help="on (the library's default): the own block's pass "
                 "tables and branch index are computed before the reach "
                 "test's branch (ring.reached.PREPARE_OWN); off: inside "
                 "the block's call, in the branch")


def use_prepare_own(flag: str) -> bool:
  """Set ``reached.PREPARE_OWN`` from ``--prepare-own``; returns it, for
  the results file."""
  from jax_ring._src.strategies.ring import reached
  reached.PREPARE_OWN = flag == "on"
  return reached.PREPARE_OWN


def use_tail_divisors(divisors) -> tuple:
  """Set ``reach.TAIL_DIVISORS`` (None: keep the library's); returns the
  divisors in force, for the results file."""
  from jax_ring._src.strategies.ring import reach
  if divisors is not None:
    reach.TAIL_DIVISORS = tuple(divisors)
  return reach.TAIL_DIVISORS


def write(name, rows, columns, extra=None, mode="default", path=None,
          show=True):
  """Print ``rows`` (dicts) as a table of ``columns`` (unless not
  ``show``) and record them as ``mode`` of this benchmark's results file
  (:func:`results_path`): the file keeps its other modes (a benchmark's
  flag comparisons, a memory search beside a throughput run) and the run
  replaces its own mode's record, so a benchmark may write after each row
  and keep what it measured if it is stopped. With
  ``JAX_RING_RESULTS_COPY`` set to a folder, the file is also copied
  there. Returns the path."""
  env = environment()
  widths = [max(len(c), 10) for c in columns]
  if show:
    print(" ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
      cells = [r.get(c, "") for c in columns]
      print(" ".join((f"{v:.3f}" if isinstance(v, float) else str(v)).rjust(w)
                     for v, w in zip(cells, widths)))
  path = pathlib.Path(path) if path else results_path(name, env)
  data = json.loads(path.read_text()) if path.exists() else {}
  runs = data.get("runs", {})
  runs[mode] = {**env, "date": time.strftime("%Y-%m-%d"), **(extra or {}),
               "rows": rows}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(dict(
      benchmark=name, device=env["device"], device_count=env["device_count"],
      runs=dict(sorted(runs.items()))), indent=2) + "\n")
  copy = os.environ.get("JAX_RING_RESULTS_COPY")  # a folder, if set
  if copy and pathlib.Path(copy).resolve() != path.parent.resolve():
    shutil.copy(path, copy)
  if show:
    print(f"wrote {path} ({mode})" + (f", copied to {copy}" if copy else ""))
  return path
