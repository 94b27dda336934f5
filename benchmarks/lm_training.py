"""examples/train_lm.py on GPUs: tokens/s, model FLOPs utilisation, and the
longest sequence whose training step fits on 1 GPU against N GPUs with
context parallelism, measured in one process.

  python benchmarks/lm_training.py                       # 1b preset, all GPUs
  python benchmarks/lm_training.py --preset tiny --cpu   # plumbing check, CPU

**Throughput.** The example's own jitted step (AdamW, remat per block,
bfloat16, cuDNN) on the example's own data, timed over ``--steps`` steps
after one compiling step. MFU = model FLOPs / (step time x devices x peak):

  model FLOPs per token = 6 P + 6 L S Hq D     (causal attention: half of
                                                 the usual 12 L S Hq D)

with P the parameters in matrix products (the embedding table, a lookup,
is left out; the unembedding is in), L layers, S the sequence, Hq query
heads of size D. Remat's extra forward is not counted, by convention.
The rows are packed files (each its own document), so a query sees far
fewer keys than S / 2: ``work_mfu`` counts 12 L Hq D times the keys each
query sees in the timed rows instead (``mean_keys`` on average), the work
the steps must do, over their summed time; ``mfu`` is the unpacked row's
convention, at the median step.
``--peak-tflops`` defaults to the H100/H200 SXM datasheet's dense bf16
989 TFLOP/s.

**Longest sequence.** A step at the longest fitting length would take many
minutes (attention is quadratic), so "fits" is decided at compile time:
XLA's memory analysis of the step (arguments + outputs - donated aliases +
temporaries) against the device's allocator limit. The peak grows about
linearly in S, so two compiles give a line and its root; secant and
bisection steps then compile until a fitting length and a failing one a
granule above it are both found. The measured peak of
the throughput run checks the analysis against the allocator. cuDNN's
workspace is in the analysis: XLA allocates it as one result of each call.

**The schedule decides the memory.** XLA's latency-hiding scheduler (on by
default in jax 0.11) moves work to overlap collectives, and it may use the
device's memory to do so: on 2 H200s at 64k tokens the step's temporaries
were 20.5 GB with it and 6.1 GB without (1 GPU: 11.6 GB). With it the
peak is not the length's need, so ``--lean`` (the scheduler off) is how
to search for the longest length; throughput is measured with the default.
``--shard-weights`` (FSDP over the context axis) is passed with
``--example-args``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def model_flops_per_token(cfg, seq: int, documents=None) -> float:
  """6 P + the attention's FLOPs per token: those of one causal row of
  ``seq`` tokens (6 L S Hq D), or, given ``documents = (counts, tokens)``
  (the token counts of the documents packed in ``tokens`` row tokens),
  12 L Hq D times the keys a query sees on average (its own document's
  earlier tokens and itself)."""
  from common import causal_keys
  # The embedding table is a lookup; tied, the same table is also the
  # unembedding, a product.
  lookup = 0 if cfg.llama().tie_word_embeddings else (
      cfg.vocab_size * cfg.embed_dim)
  matmul_params = cfg.num_params() - lookup
  per_key = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  if documents is None:
    return 6 * matmul_params + per_key * seq / 2
  counts, tokens = documents
  return 6 * matmul_params + per_key * causal_keys(counts) / tokens


# Kernel families of a training step's trace (names as cuDNN, cuBLAS,
# CUTLASS, XLA's Triton GEMMs and NCCL give them).
MATMUL = ("gemm", "cutlass", "nvjet", "xmma", "cublas")


def step_kind(name: str) -> str:
  from profile_ring import kind
  k = kind(name)
  if k == "other" and any(m in name.lower() for m in MATMUL):
    return "matmul"
  return k


def profile(run, seq: int, steps: int, out_dir: str) -> dict:
  """Where a training step's time goes, per step and averaged over GPUs,
  from a ``jax.profiler`` trace of ``steps`` steps (after one untraced):
  wall, busy and idle time, and attention, matmul, NCCL (all, and with
  nothing else running) and other kernels; the top kernels of GPU 0."""
  import glob

  import jax
  from profile_ring import gpu_events, summarise

  b = run.built
  state = b["state"]
  with jax.set_mesh(b["mesh"]):
    state, loss = b["train_step"](state, run.batch(seq, 0))
    float(loss)
    trace_dir = os.path.join(out_dir, f"trace_{run.devices}gpu_{seq}")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for step in range(1, steps + 1):
        state, loss = b["train_step"](state, run.batch(seq, step))
      float(loss)
  b["state"] = state
  path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                   recursive=True)[0]
  mean, detail, _ = summarise(gpu_events(path), steps, step_kind,
                              ("attn", "matmul", "comm", "other"))
  mean["top_kernels"] = [
      dict(ms=round(t, 3), per_step=n, kind=step_kind(name), name=name[:100])
      for t, n, name in detail[:30]]
  return dict(devices=run.devices, seq=seq, steps=steps, **mean)


def peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes -
          m.alias_size_in_bytes + m.temp_size_in_bytes)


class Run:
  """One mesh: the example's model, optimizer state and step, built once;
  batches of any length are fed to the same jitted step."""

  def __init__(self, argv: list[str], devices, packed: bool = True):
    import train_lm
    self.packed, self.devices = packed, len(devices)
    self.args = train_lm.parse_args(argv)
    self.built = train_lm.build(self.args, devices)
    self.corpus = train_lm.Corpus()

  def batch(self, seq: int, step: int = 0):
    import jax_ring.flax as jrf
    b = self.built
    tokens, seg = self.corpus.batch(step, self.args.seed, b["batch"], seq)
    return jrf.prepare_lm_batch(tokens, seg if self.packed else None,
                                mesh=b["mesh"], spec=b["spec"],
                                context_parallel=b["cfg"].context_parallel)

  def documents(self, seq: int, step: int) -> np.ndarray:
    """The token counts of the documents :meth:`batch` feeds at ``step``
    (a row each, unpacked)."""
    from common import row_documents
    b = self.built["batch"]
    if not self.packed:
      return np.full(b, seq)
    return row_documents(self.corpus.batch(step, self.args.seed, b, seq)[1])

  def compile(self, seq: int):
    import jax
    with jax.set_mesh(self.built["mesh"]):
      return self.built["train_step"].lower(self.built["state"],
                                            self.batch(seq)).compile()

  def compile_peak(self, seq: int) -> dict:
    """The step's peak at ``seq``: XLA's analysis, which counts cuDNN's
    workspaces (each call's is one of its results)."""
    t0 = time.perf_counter()
    try:
      compiled = self.compile(seq)
    except RuntimeError as e:  # no cuDNN graph this long: it cannot run
      return dict(seq=seq, peak=float("inf"), error=str(e)[:300],
                  compile_s=time.perf_counter() - t0)
    row = dict(seq=seq, peak=peak_bytes(compiled))
    # Which backend ran is decided per shard at compile time; the count
    # shows it.
    row["cudnn_calls"] = compiled.as_text().count(
        'custom_call_target="jax_ring_sdpa_')
    return dict(row, compile_s=time.perf_counter() - t0)

  def throughput(self, seq: int, steps: int) -> dict:
    import jax
    b = self.built
    state, times = b["state"], []
    with jax.set_mesh(b["mesh"]):
      for step in range(steps + 1):
        batch = self.batch(seq, step)
        t0 = time.perf_counter()
        state, loss = b["train_step"](state, batch)
        loss = float(loss)  # waits for the step
        if step:
          times.append(time.perf_counter() - t0)
    b["state"] = state  # the old one was donated
    stats = jax.devices()[0].memory_stats() or {}
    t = sorted(times)[len(times) // 2]
    return dict(seq=seq, step_s=t, tokens_per_s=b["batch"] * seq / t,
                loss=loss, peak_bytes_in_use=stats.get("peak_bytes_in_use"),
                step_times_s=times)

  def work(self, seq: int, times, peak_flops: float) -> dict:
    """The work of :meth:`throughput`'s timed steps (1 to ``len(times)``;
    step 0 compiles): their documents, the keys a query saw on average,
    and ``work_mfu``, the FLOPs the steps had to do over the time they
    took, all steps together (a packed step's work, and so its time,
    follows its documents)."""
    from common import causal_keys
    cfg, tokens = self.built["cfg"], self.built["batch"] * seq
    rows = [self.documents(seq, step) for step in range(1, len(times) + 1)]
    flops = sum(model_flops_per_token(cfg, seq, (c, tokens)) * tokens
                for c in rows)
    return dict(documents=int(sum(c.size for c in rows)),
                mean_keys=sum(map(causal_keys, rows)) / (tokens * len(rows)),
                work_mfu=flops / sum(times) / peak_flops)


def longest(run: Run, limit: int, probe: tuple[int, int], granule: int,
            max_compiles: int = 8, on_compile=lambda rec: None):
  """(longest fitting length, bytes per token, compile records): secant
  steps on the peak-vs-length line, alternating with bisection once the
  answer is bracketed, rounded to ``granule``, until a fitting
  length and a failing one a granule above it are both compiled.
  ``on_compile(records)`` runs after each compile (to save progress)."""
  peaks, rec = {}, []

  def at(s):
    if s not in peaks:
      rec.append(run.compile_peak(s))
      peaks[s] = rec[-1]["peak"]
      print("  compiled", rec[-1], "limit", limit, flush=True)
      on_compile(rec)
    return peaks[s]

  for s in probe:
    at(s)
  while True:
    fit = max((s for s, p in peaks.items() if p <= limit), default=0)
    over = min((s for s, p in peaks.items() if p > limit), default=None)
    if over is not None and over - fit <= granule:
      break
    if len(rec) >= max_compiles:  # report the longest one known to fit
      break
    a, b = sorted(peaks, key=lambda s: abs(peaks[s] - limit))[:2]
    slope = (peaks[b] - peaks[a]) / (b - a)
    s = (int((a + (limit - peaks[a]) / slope) // granule * granule)
         if slope > 0 else fit + granule)
    if over is not None and len(rec) % 2:  # bisect every other step
      s = (fit + over) // 2 // granule * granule
    s = max(s, fit + granule)
    if over is not None:
      s = min(s, over - granule)
    at(s)
  s1, s2 = sorted(peaks)[-2:]
  return fit, (peaks[s2] - peaks[s1]) / (s2 - s1), rec


def main():
  # Both meshes measured against the same allocator limit (before jax starts).
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="1b")
  p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072],
                 help="throughput lengths (each on the CP mesh; the first "
                 "also on one device)")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--strategy", default="ring")
  p.add_argument("--granule", type=int, default=16384)
  p.add_argument("--probe", type=int, nargs=2, default=[65536, 131072])
  p.add_argument("--peak-tflops", type=float, default=989.0)
  p.add_argument("--skip-longest", action="store_true")
  p.add_argument("--skip-throughput", action="store_true",
                 help="only the longest-length search")
  p.add_argument("--example-args", default="",
                 help="more flags for examples/train_lm.py, e.g. "
                 "--example-args=--no-remat")
  p.add_argument("--mode", default="default",
                 help="this run's name in the results file (other modes "
                 "stay)")
  p.add_argument("--no-packing", action="store_true",
                 help="batches without segment ids (one stream per row)")
  p.add_argument("--analyse", type=int, nargs="+", default=None,
                 help="only compile at these lengths on both meshes and "
                 "record XLA's memory analysis (arguments, temporaries)")
  p.add_argument("--lean", action="store_true",
                 help="XLA's latency-hiding scheduler off (the memory-lean "
                 "schedule, for the longest-length search)")
  p.add_argument("--devices", type=int, nargs="+", default=None,
                 help="mesh sizes to run (default: 1 and all devices)")
  p.add_argument("--runs", nargs="+", default=None, metavar="DEVICES:SEQ",
                 help="throughput rows in this order, each a mesh size and a "
                 "length (replaces --devices and --seq): e.g. weak scaling "
                 "1:32768 2:65536 4:131072, strong 1:65536 2:65536 4:65536")
  p.add_argument("--skip-analysis", action="store_true",
                 help="no compile of XLA's memory analysis after a mesh's "
                 "first row (one compile fewer a mesh)")
  p.add_argument("--append", action="store_true",
                 help="keep the rows and profiles this mode already holds in "
                 "the results file (one machine's run split over several "
                 "commands); the new rows follow them")
  p.add_argument("--cpu", action="store_true",
                 help="simulated CPU devices (plumbing check only)")
  p.add_argument("--profile", metavar="DIR", default=None,
                 help="after each mesh's throughput, trace 3 steps at the "
                 "first --seq into DIR and record where the time goes")
  a = p.parse_args()
  if a.lean:  # read when jax's GPU backend starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_"
                               "enable_latency_hiding_scheduler=false").strip()

  import jax
  if a.cpu:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
  sys.path.insert(0, str(ROOT / "benchmarks"))
  from common import environment, results_path, write

  n = jax.device_count()
  common_argv = (["--preset", a.preset, "--quiet", "--strategy", a.strategy]
                 + shlex.split(a.example_args))
  meshes = {d: ["--mesh", f"data=1,context={d}"] for d in a.devices or (1, n)}
  rows, longest_rows, runs, profiles = [], [], {}, []
  kept, path = {}, results_path("lm_training", environment())
  if a.append and path.exists():
    kept = json.loads(path.read_text())["runs"].get(a.mode, {})

  def report():
    cfg = next(iter(runs.values())).built["cfg"]
    extra = dict(preset=a.preset, params=cfg.num_params(),
                 strategy=a.strategy, peak_tflops=a.peak_tflops,
                 work_mfu="the timed steps' FLOPs (12 L Hq D x the keys "
                 "each query sees, for 6 L S Hq D) / their summed time / "
                 "(devices x peak)",
                 mfu="model FLOPs/token (6P + 6 L S Hq D) x tokens/s / "
                 "(devices x peak)", longest=longest_rows,
                 memory_fraction=os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
                 example_args=a.example_args,
                 profile=kept.get("profile", []) + profiles,
                 commands=kept.get("commands", []) + [shlex.join(sys.argv)])
    if len(longest_rows) == 2 and all(r["longest_seq"] for r in longest_rows):
      extra["longest_ratio"] = (longest_rows[1]["longest_seq"] /
                                longest_rows[0]["longest_seq"])
    write("lm_training", kept.get("rows", []) + rows,
          ["devices", "seq", "step_s", "tokens_per_s", "mfu", "work_mfu",
           "loss"],
          extra=extra, mode=a.mode)
    return extra

  if a.analyse:
    rows = []
    for devices, mesh_argv in meshes.items():
      run = runs[devices] = Run(common_argv + mesh_argv,
                                jax.devices()[:devices], not a.no_packing)
      for seq in a.analyse:
        t0 = time.perf_counter()
        m = run.compile(seq).memory_analysis()
        rows.append(dict(devices=devices, seq=seq, packed=not a.no_packing,
                         argument_gb=m.argument_size_in_bytes / 1e9,
                         temp_gb=m.temp_size_in_bytes / 1e9,
                         compile_s=time.perf_counter() - t0))
        print(rows[-1], flush=True)
    write("lm_training", rows,
          ["devices", "seq", "packed", "argument_gb", "temp_gb"],
          extra=dict(preset=a.preset, strategy=a.strategy,
                     example_args=a.example_args),
          mode=f"memory_{a.strategy}_{a.mode}")
    return

  # Throughput first (both meshes), then the compile-only length search, so
  # that a run cut short keeps the most useful numbers (JSON after each).
  if a.runs:
    try:
      plan = [tuple(int(x) for x in r.split(":")) for r in a.runs]
    except ValueError:
      p.error(f"--runs takes DEVICES:SEQ pairs; got {a.runs}")
    meshes = {d: ["--mesh", f"data=1,context={d}"] for d, _ in plan}
  else:
    plan = [(d, seq) for d in meshes for seq in (
        [] if a.skip_throughput else a.seq[:1] if d == 1 else a.seq)]
  for devices, seq in plan:
    if devices not in runs:
      runs[devices] = Run(common_argv + meshes[devices],
                          jax.devices()[:devices], not a.no_packing)
    run = runs[devices]
    cfg = run.built["cfg"]
    first = not any(r["devices"] == devices for r in rows)
    before = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
    t0 = time.perf_counter()
    r = run.throughput(seq, a.steps)
    peak = devices * a.peak_tflops * 1e12
    r.update(devices=devices, params=cfg.num_params(), bytes_in_use_before=
             before, mfu=model_flops_per_token(cfg, seq) *
             r["tokens_per_s"] / peak, wall_s=time.perf_counter() - t0,
             **run.work(seq, r["step_times_s"], peak))
    if first and not a.skip_analysis:  # against the allocator's peak
      r["analysed_peak_bytes"] = run.compile_peak(seq)["peak"]
    rows.append(r)
    print(r, flush=True)
    report()
    if a.profile and first:
      profiles.append(profile(run, seq, 3, a.profile))
      print({k: v for k, v in profiles[-1].items() if k != "top_kernels"},
            flush=True)
      report()
  extra = {}
  if not a.skip_longest:
    for devices, run in runs.items():
      limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
      if not limit:
        break
      row = dict(devices=devices, longest_seq=None, bytes_limit=limit)
      longest_rows.append(row)

      def save(rec, row=row):  # a run cut short keeps its compiles
        row["compiles"] = list(rec)
        report()

      best, slope, _ = longest(run, limit, tuple(a.probe), a.granule,
                               on_compile=save)
      row.update(longest_seq=best, bytes_per_token=slope)
      print(row, flush=True)
      extra = report()
    if "longest_ratio" in extra:
      print(f"longest sequence: {longest_rows[0]['longest_seq']} on 1 device,"
            f" {longest_rows[1]['longest_seq']} on {n}: "
            f"{extra['longest_ratio']:.2f}x")


if __name__ == "__main__":
  main()
