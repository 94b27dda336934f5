"""examples/finetune.py with the demo's random weights in the shapes of
released checkpoints: tokens/s, model FLOPs utilisation and peak memory,
at 32k tokens on one GPU or longer split over ``--context`` GPUs.

  python benchmarks/finetune_models.py [--models llama3.2-1b gemma3-1b
                                       qwen3-1.7b] [--seq 32768] [--steps 8]
  python benchmarks/finetune_models.py --context 4 --seq 131072 --mode cp4

Each model runs in a process of its own, which adds its row to the
results file (its peak memory is then its own; the parent never touches a
GPU): ``finetune.py --demo-model M --seq S --context C --batch 1 --steps N
--vocab-chunk 8192`` (C: ``--context``, default 1; more flags with
``--example-args``) (the demo's data and tokenizer, the weights random in
the released config.json's shapes, bfloat16, cuDNN), on examples of
``--doc-words`` demo words each (about ten documents per 32k row: one
cuDNN call serves up to 16 a row; a row of more, such as the demo's own
examples of about 30 tokens with ``--doc-words 0``, runs as a loop of
such calls).

Each row records:
  tokens_per_s    the example's own, at the median step interval;
  step_intervals_s  every interval between two steps' ends (the first
                  step compiles; the interval ending at the last is left
                  out, see ``StepClock``);
  dispatch_s      how long each step call took to return, the compiling
                  one aside (about a step's time where the host does not
                  run ahead of the device);
  model_mfu       model FLOPs / (step time x C x peak), the usual convention:
                  per token 6 P + 6 L S Hq D, each row one causal sequence
                  of S tokens, every weight trained (the figure other
                  frameworks report; more work than packed or LoRA rows do);
  work_mfu        the work's FLOPs / (step time x C x peak): per token 6 P
                  (P: the parameters in matrix products; a tied table
                  counts once, as the output layer) plus, per layer, 12 Hq
                  D times the keys a query sees on average in the rows
                  trained on (its own document's earlier tokens, within W
                  on a sliding layer); with ``--example-args="--lora R"``
                  4 P (the frozen weights get no gradient) plus 6 times the
                  adapters' parameters; peak ``--peak-tflops``, the
                  H100/H200 SXM datasheet's dense bf16 989 TFLOP/s;
  peak_gb         the allocator's ``peak_bytes_in_use`` on the first GPU;
  profile         with ``--profile N``: where N steps' time goes (the third
                  to the (N + 2)-th, traced by ``jax.profiler``, the host
                  waiting for the steps before; their intervals count the
                  trace's cost, the median little): per step, the matrix
                  products', attention's and other kernels' time, idle
                  time, and the top kernels
                  (``lm_training.profile``'s families).

Writes benchmarks/results/finetune_models_<count>x<gpu>.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


MODELS = ["llama3.2-1b", "gemma3-1b", "qwen3-1.7b", "llama3.1-8b"]
DEFAULT_MODELS = MODELS[:3]


def lora_params(cfg, rank: int) -> int:
  """The parameters of rank-``rank`` adapters on every linear layer:
  ``r (in + out)`` for each of q, k, v, o, gate, up and down."""
  e, m = cfg.hidden_size, cfg.intermediate_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_layer = (e + q) * 2 + (e + kv) * 2 + (e + m) * 3
  return rank * per_layer * cfg.num_layers


def flops_per_token(cfg, doc_lengths, tokens: int, lora: int | None = None
                    ) -> float:
  """The work of a training step, per token of ``tokens`` row tokens whose
  documents have ``doc_lengths``: 6 P (forward, input and weight
  gradients) plus the attention's 12 Hq D per key a query sees (its own
  document's earlier keys, within the window on a sliding layer). With
  LoRA of rank ``lora``: the frozen base has no weight gradients, 4 P,
  and the adapters 6 P_lora."""
  from common import causal_keys
  lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
  keys = sum(causal_keys(doc_lengths, cfg.attention(layer).sliding_window)
             for layer in range(cfg.num_layers))
  base = cfg.num_params() - lookup
  matmuls = (6 * base if lora is None else
             4 * base + 6 * lora_params(cfg, lora))
  return matmuls + 12 * cfg.num_heads * cfg.head_dim * keys / tokens


def model_flops_per_token(cfg, seq: int) -> float:
  """The usual convention: 6 P + 6 L S Hq D a token (every weight trained,
  each row one causal sequence of ``seq`` tokens, windows ignored)."""
  lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
  return (6 * (cfg.num_params() - lookup)
          + 6 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim)


def long_records(path: str, words: int, count: int) -> str:
  """``count`` prompt/response records of ``words`` demo words each (a few
  thousand tokens: a 32k row then packs about ten documents)."""
  import random
  import finetune
  rng = random.Random(0)
  with open(path, "w") as f:
    for _ in range(count):
      w = [rng.choice(finetune.WORDS) for _ in range(words)]
      f.write(json.dumps({"prompt": "Reverse the words: " + " ".join(w) +
                          "\n", "response": " ".join(w[::-1])}) + "\n")
  return path


def one(model: str, seq: int, steps: int, peak_tflops: float,
        doc_words: int, context: int = 1, extra: str = "",
        base: str | None = None, profile: int = 0) -> dict:
  """Run the example once, in this process; the result row. ``base``: a
  checkpoint of ``model``'s shapes made before (``--make-base``), read
  instead of making the demo's (the data must then be ``doc_words``')."""
  import finetune
  import jax
  from jax_ring import models
  with tempfile.TemporaryDirectory() as run:
    data = ["--data", long_records(f"{run}.jsonl", doc_words,
                                   (steps + 2) * seq // doc_words)
            ] if doc_words else ["--examples", str(max(2000, steps * seq // 12))]
    which = ["--model", base] if base else ["--demo-model", model]
    args = finetune.parse_args([
        *which, "--seq", str(seq), "--context", str(context),
        "--batch", "1", "--steps", str(steps), "--vocab-chunk", "8192",
        "--lr", "1e-4", "--run-dir", run, "--quiet", *data,
        *shlex.split(extra)])
    dispatch = []  # seconds each train_step call took to return
    loop = finetune.train_lm.train_loop
    trace_dir = f"{run}.trace"

    def timed_loop(args, *, train_step, **kw):
      def step(*a):
        if profile and len(dispatch) in (2, 2 + profile):
          jax.block_until_ready(a)  # the steps before, done
          (jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
           if len(dispatch) == 2 else jax.profiler.stop_trace())
        t0 = time.perf_counter()
        out = train_step(*a)
        dispatch.append(time.perf_counter() - t0)
        return out
      return loop(args, train_step=step, **kw)

    finetune.train_lm.train_loop = timed_loop
    result = finetune.train(args)
    cfg = models.config_from_hf(json.loads(
        (result["model_dir"] / "config.json").read_text()))
  from common import row_documents
  summary = kernel_summary(trace_dir, profile) if profile else None
  rows = [result["data"].row(i)[1] for i in range(steps)]  # segment ids
  segments = np.concatenate(rows)
  lengths = row_documents(rows)
  lora = getattr(args, "lora", None)
  per_token = flops_per_token(cfg, lengths, segments.size, lora)
  model_per_token = model_flops_per_token(cfg, seq)
  tokens_per_s = result["tokens_per_s"]
  stats = jax.devices()[0].memory_stats() or {}
  return dict(model=model, seq=seq, context=context, steps=steps,
              params=cfg.num_params(), lora_rank=lora,
              tokens_per_s=tokens_per_s,
              step_intervals_s=result["step_intervals_s"],
              dispatch_s=dispatch[1:],
              documents=int(lengths.size),
              mean_document=float(lengths.mean()),
              fill=float((segments > 0).mean()),
              step_s=seq / tokens_per_s,
              model_mfu=tokens_per_s * model_per_token / (
                  context * peak_tflops * 1e12),
              work_mfu=tokens_per_s * per_token / (
                  context * peak_tflops * 1e12),
              flops_per_token=per_token,
              peak_gb=stats.get("peak_bytes_in_use", 0) / 1e9,
              final_loss=float(result["losses"][-1]),
              **({"profile": summary} if profile else {}))


def kernel_summary(trace_dir: str, steps: int) -> dict:
  """Per step, from the trace in ``trace_dir`` of ``steps`` steps: the
  kernel families' time (``lm_training.step_kind``), idle time and the
  top kernels of the first GPU."""
  from lm_training import step_kind
  from profile_ring import gpu_events, summarise
  path = glob.glob(f"{trace_dir}/**/*trace.json.gz", recursive=True)[0]
  mean, detail, _ = summarise(gpu_events(path), steps, step_kind,
                              ("attn", "matmul", "comm", "other"))
  shutil.rmtree(trace_dir)
  mean["top_kernels"] = [
      dict(ms=round(t, 3), per_step=n, kind=step_kind(name), name=name[:100])
      for t, n, name in detail[:40]]
  return mean


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--models", nargs="+", choices=MODELS,
                 default=DEFAULT_MODELS)
  p.add_argument("--seq", type=int, default=32768)
  p.add_argument("--steps", type=int, default=8,
                 help="steps; the first compiles, the rest are timed")
  p.add_argument("--peak-tflops", type=float, default=989.0)
  p.add_argument("--doc-words", type=int, default=1500,
                 help="words per example of the data (0: the demo's own "
                 "short examples, hundreds per row)")
  p.add_argument("--context", type=int, default=1,
                 help="GPUs the sequence is split over (context parallel)")
  p.add_argument("--example-args", default="",
                 help="more flags for examples/finetune.py, e.g. "
                 "--example-args='--remat attention'")
  p.add_argument("--base", default=None, metavar="DIR",
                 help="read this checkpoint of the (one) model's shapes, "
                 "made by --make-base (its DIR/base_model), instead of "
                 "making the demo's in every run (an 8B model's takes "
                 "minutes)")
  p.add_argument("--make-base", default=None, metavar="DIR",
                 help="write the demo's checkpoint of --models' (one) "
                 "model under DIR (DIR/base_model, printed), then stop")
  p.add_argument("--profile", type=int, default=0, metavar="N",
                 help="trace N steps (from the third) and record where "
                 "their time goes")
  p.add_argument("--mode", default="default")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)
  a = p.parse_args()
  # The model's weights leave less than jax's default 75% of the GPU to the
  # step (an 8B model's bf16 base is 16 GB), as in lm_training.py.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  if a.profile and a.steps < a.profile + 3:
    p.error(f"--profile {a.profile} traces steps 3 to {a.profile + 2}: "
            f"--steps must be at least {a.profile + 3}; got {a.steps}")
  if not a.one and (a.base or a.make_base) and len(a.models) != 1:
    p.error("--base and --make-base take one model (--models M)")
  if a.make_base:
    import finetune
    args = finetune.parse_args(["--demo-model", a.models[0], "--run-dir",
                                a.make_base, "--quiet"])
    print(finetune.make_demo(pathlib.Path(a.make_base), args)[0])
    return
  if a.one:  # the child: run, then add its row to the results file
    record([one(a.one, a.seq, a.steps, a.peak_tflops, a.doc_words,
                a.context, a.example_args, a.base, a.profile)
            | dict(doc_words=a.doc_words)], a)
    return
  failed = []
  for model in a.models:  # this process never touches a GPU
    done = subprocess.run(
        [sys.executable, __file__, "--one", model, "--seq", str(a.seq),
         "--steps", str(a.steps), "--peak-tflops", str(a.peak_tflops),
         "--doc-words", str(a.doc_words), "--mode", a.mode,
         "--context", str(a.context), "--example-args=" + a.example_args,
         "--profile", str(a.profile),
         *(["--base", a.base] if a.base else [])])
    if done.returncode:
      failed.append(model)
  if failed:
    sys.exit(f"failed: {failed}")


def record(rows, a):
  """Write ``rows`` as mode ``a.mode``, keeping that mode's rows of models
  not run this time (a run of one model beside an earlier run of the
  others)."""
  from common import results_path, environment, write
  path = results_path("finetune_models", environment())
  if path.exists():
    old = json.loads(path.read_text())["runs"].get(a.mode, {}).get("rows", [])
    ran = {r["model"] for r in rows}
    rows = sorted([r for r in old if r["model"] not in ran] + rows,
                  key=lambda r: MODELS.index(r["model"]))
  write("finetune_models", rows,
        ["model", "seq", "context", "params", "tokens_per_s", "step_s",
         "model_mfu", "work_mfu", "peak_gb", "final_loss"],
        extra=dict(command=f"finetune.py --demo-model M --seq S --context "
                   f"{a.context} --batch 1 --steps N --vocab-chunk 8192 "
                   f"{a.example_args}".strip(),
                   peak_tflops=a.peak_tflops),
        mode=a.mode)


if __name__ == "__main__":
  main()
