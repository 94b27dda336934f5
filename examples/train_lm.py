"""Train a byte-level decoder-only LM at long context with jax_ring.

The text is the Python standard library's own source, read from this
machine (no download): every ``.py`` file is one document, batches are
random windows of the concatenated files, so a window may pack the end
of one file and the start of the next (``segment_ids``, positions restart).

  python examples/train_lm.py                  # CPU: 8 simulated devices,
                                               # data=2 x context=4, ring,
                                               # dual_chunk; about 2
                                               # minutes on 2 cores
  python examples/train_lm.py --run-dir runs/a # write to runs/a
  python examples/train_lm.py --run-dir runs/a --resume
                                               # continue from its last
                                               # checkpoint, same losses
  python examples/train_lm.py --preset 1b --mesh data=1,context=2   # 2 GPUs

On GPUs the compute dtype defaults to bfloat16, so ``implementation=None``
picks the cuDNN backend. Under ``jax.distributed`` (one process per host)
add ``--distributed``; see docs/design.md.

The run directory (``run_dir.py``): without ``--run-dir`` each run writes
to a new directory of its own under the system's temp directory, printed
at start. A fresh run refuses a ``--run-dir`` that holds an earlier run's
checkpoints/, losses.json or loss_curve.png, naming ``--resume`` (continue
it) and ``--overwrite`` (delete them first). Checkpoints carry checksums,
verified on ``--resume`` (``checkpoints.py``); a NaN or infinite loss or
weight stops training with an error naming the step, and is never saved.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import sys
import sysconfig
import time
import typing

import numpy as np

import run_dir  # first: it names a missing dependency
import checkpoints

# What a run writes in its run directory (see run_dir.py).
OUTPUTS = ("checkpoints", "losses.json", "loss_curve.png")

# Model presets: the model's shape and the defaults that go with it.
PRESETS = {
    # 0.85M params, the CPU default: loss 5.54 at step 1 (about ln 256 =
    # 5.55, the uniform guess) -> 2.8 nats/byte over the last 10 of 80
    # steps (about 2 minutes on 2 cores).
    "tiny": dict(model=dict(embed_dim=128, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=32, mlp_dim=384),
                 seq=2048, batch_per_data=1, lr=3e-3, steps=80),
    # ~25M params: a single GPU or a long CPU run.
    "small": dict(model=dict(embed_dim=512, num_layers=8, num_heads=8,
                             num_kv_heads=2, head_dim=64, mlp_dim=1536),
                  seq=8192, batch_per_data=2, lr=1e-3, steps=500),
    # 35k params, 64 tokens: for tests and smoke runs.
    "micro": dict(model=dict(embed_dim=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, mlp_dim=64),
                  seq=64, batch_per_data=2, lr=3e-3, steps=4),
    # ~1.0B params, 32k context: GPUs (bfloat16, cuDNN), remat per block.
    "1b": dict(model=dict(embed_dim=2048, num_layers=16, num_heads=16,
                          num_kv_heads=4, head_dim=128, mlp_dim=8192,
                          remat=True),
               seq=32768, batch_per_data=1, lr=3e-4, steps=300),
    # Llama-3.2-1B's shape (1.24B params, tied 128256-token embeddings),
    # random weights, byte tokens: for throughput and memory on GPUs.
    "llama3.2-1b": dict(model=dict(vocab_size=128256, embed_dim=2048,
                                   num_layers=16, num_heads=32,
                                   num_kv_heads=8, head_dim=64, mlp_dim=8192,
                                   rope_max_wavelength=500000.0,
                                   tie_word_embeddings=True, remat=True),
                        seq=65536, batch_per_data=1, lr=3e-4, steps=300),
    # Llama-3-8B's shape (8.03B params, untied 128256-token embeddings),
    # random weights, byte tokens: pair with --shard-weights (FSDP) on GPUs.
    "llama3-8b": dict(model=dict(vocab_size=128256, embed_dim=4096,
                                 num_layers=32, num_heads=32, num_kv_heads=8,
                                 head_dim=128, mlp_dim=14336,
                                 rope_max_wavelength=500000.0, remat=True),
                      seq=65536, batch_per_data=1, lr=3e-4, steps=300),
}


def field_choices(field: str) -> tuple[str, ...]:
  """The values ContextParallel's Literal field allows, read from the
  library, so new strategies appear here without editing the example."""
  import jax_ring
  hint = typing.get_type_hints(jax_ring.ContextParallel)[field]
  return tuple(a for a in typing.get_args(hint) if isinstance(a, str)) or (
      tuple(a for arg in typing.get_args(hint)
            for a in typing.get_args(arg) if isinstance(a, str)))


def add_process_flags(p: argparse.ArgumentParser):
  p.add_argument("--cpu-devices", type=run_dir.POSITIVE, default=8,
                 help="simulated CPU devices (per process)")
  p.add_argument("--distributed", action="store_true",
                 help="jax.distributed.initialize (one process per host)")
  p.add_argument("--coordinator-address", default=None)
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
  p.add_argument("--mesh", default=None,
                 help="axis=size,... over data, context, tensor; default "
                 "data=2,context=4 on 8 devices, else context=<all devices>")
  p.add_argument("--strategy", default="ring",
                 choices=field_choices("strategy"),
                 help="context-parallel strategy")
  p.add_argument("--load-balance", default="dual_chunk",
                 choices=field_choices("load_balance") + ("none",),
                 help="token layout; none = contiguous shards")
  p.add_argument("--loop", choices=["scan", "unrolled"], default=None,
                 help="ring loop form (default: the library's)")
  p.add_argument("--seq", type=run_dir.POSITIVE, default=None,
                 help="sequence length")
  p.add_argument("--batch", type=run_dir.POSITIVE, default=None,
                 help="global batch")
  p.add_argument("--steps", type=run_dir.POSITIVE, default=None)
  p.add_argument("--lr", type=run_dir.POSITIVE_FLOAT, default=None,
                 help="peak learning rate")
  p.add_argument("--warmup", type=run_dir.NON_NEGATIVE, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="compute dtype; default bfloat16 on GPU, else float32")
  p.add_argument("--implementation", choices=["xla", "cudnn"], default=None)
  p.add_argument("--sliding-window", type=int, default=None)
  p.add_argument("--soft-cap", type=float, default=None)
  p.add_argument("--remat", action=argparse.BooleanOptionalAction,
                 default=None, help="rematerialise each block")
  p.add_argument("--vocab-chunk", type=run_dir.POSITIVE, default=None,
                 help="the loss takes the vocabulary this many entries at a "
                 "time (jax_ring.models.lm_loss)")
  p.add_argument("--remat-attention", action="store_true",
                 help="rematerialise each block but its attention (whose "
                 "q, k, v, output and logsumexp are kept)")
  p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction,
                 default=True,
                 help="run the blocks as one lax.scan: the step compiles "
                 "one block, not one a layer (--no-scan-layers: unrolled)")
  p.add_argument("--shard-weights", action="store_true",
                 help="FSDP: split weights and optimizer state over the data "
                 "and context axes (default: replicated on each)")
  run_dir.add_flags(p, "train_lm")
  add_process_flags(p)
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  run_dir.check_flags(p, args)
  preset = PRESETS[args.preset]
  for name in ("seq", "steps", "lr"):
    if getattr(args, name) is None:
      setattr(args, name, preset[name])
  args.load_balance = None if args.load_balance == "none" else args.load_balance
  return args


def setup_jax(args):
  """Process-level setup; must run before jax touches a device."""
  import jax
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.distributed:
    # CPU collectives across processes go through gloo (TCP).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator_address, args.num_processes,
                               args.process_id)


# --------------------------------------------------------------------------
# Data: the standard library's source as bytes, windows keyed by step.


class Corpus:
  """Every ``.py`` file of the standard library, concatenated, as bytes,
  with the file index (from 1) of each byte as its document id."""

  def __init__(self, root: str | None = None):
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(f.parts))
    chunks = [np.frombuffer(f.read_bytes(), np.uint8) for f in files]
    chunks = [c for c in chunks if c.size]
    if not chunks:
      raise RuntimeError(f"no Python source found under {root}")
    self.tokens = np.concatenate(chunks)
    self.doc_ids = np.repeat(np.arange(1, len(chunks) + 1, dtype=np.int32),
                             [c.size for c in chunks])
    self.num_files = len(chunks)

  def batch(self, step: int, seed: int, batch: int, seq: int):
    """Global ``(tokens, segment_ids)``, ``(batch, seq)`` each: a pure
    function of (seed, step), so a resumed run sees the same data."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, self.tokens.size - seq, batch)
    idx = starts[:, None] + np.arange(seq)
    return self.tokens[idx].astype(np.int32), self.doc_ids[idx]


# --------------------------------------------------------------------------
# Model, optimizer, step.


# data: batch; context: the sequence (the ring axis of "hybrid"); ulysses:
# the sequence's inner axis for "hybrid" only; tensor: heads and MLP width.
MESH_AXES = ("data", "context", "ulysses", "tensor")


def parse_mesh(spec: str | None, num_devices: int) -> dict[str, int]:
  if spec is None:
    return ({"data": 2, "context": 4} if num_devices == 8 else
            {"data": 1, "context": num_devices})
  shape = {}
  for item in spec.split(","):
    name, _, size = item.partition("=")
    if name not in MESH_AXES or not size.isdigit():
      raise SystemExit(f"--mesh: expected axis=size with axis in "
                       f"{', '.join(MESH_AXES)}; got {item!r}")
    if name in shape:
      raise SystemExit(f"--mesh {spec}: axis {name!r} given twice")
    shape[name] = int(size)
  if math.prod(shape.values()) != num_devices:
    raise SystemExit(f"--mesh {spec} has {math.prod(shape.values())} devices;"
                     f" jax sees {num_devices}")
  return shape


def make_optimizer(lr: float, warmup: int, steps: int):
  """AdamW, warmup then cosine decay to lr/10, global-norm clipping."""
  import optax
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(optax.warmup_cosine_decay_schedule(
          0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10),
                  b2=0.95, weight_decay=0.1))


def build(args, devices=None):
  """Mesh, model config, initial (params, opt_state), the jitted step, on
  ``devices`` (default: all of them)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import jax_ring
  from jax_ring import flax as jrf
  from lm_model import ModelConfig, Transformer, loss_fn, model_rules

  devices = jax.devices() if devices is None else devices
  shape = parse_mesh(args.mesh, len(devices))
  mesh = jax.make_mesh(tuple(shape.values()), tuple(shape),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                       devices=devices)
  hybrid = args.strategy == "hybrid"
  if hybrid != ("ulysses" in shape):
    raise SystemExit("--strategy hybrid needs a ulysses axis in --mesh (e.g. "
                     "data=2,context=2,ulysses=2), and only hybrid uses one")
  # The sequence is sharded over these axes (ring-major for hybrid).
  seq_axes = tuple(a for a in ("context", "ulysses") if a in shape)
  cpc = None
  if math.prod(shape[a] for a in seq_axes) > 1:
    cpc = jax_ring.ContextParallel(
        axis=("ulysses", "context") if hybrid else "context",
        strategy=args.strategy, load_balance=args.load_balance,
        loop=args.loop, inputs="load_balanced")  # prepare_lm_batch lays out
  if cpc is not None:  # the layout's split, named by its flag
    devices_cp = math.prod(shape[a] for a in seq_axes)
    parts = devices_cp * (2 if args.load_balance == "dual_chunk" else 1)
    if args.seq % parts:
      raise SystemExit(
          f"--seq {args.seq} must be a multiple of {parts}: the "
          f"{args.load_balance or 'contiguous'} layout over {devices_cp} "
          "devices of the sequence")
  seq = seq_axes if len(seq_axes) > 1 else (seq_axes or (None,))[0]
  preset = PRESETS[args.preset]
  gpu = jax.default_backend() == "gpu"
  dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
  model_kw = dict(preset["model"])
  if args.remat is not None:
    model_kw["remat"] = args.remat
  if args.remat_attention:
    model_kw["remat"] = "attention"
  model_kw["scan_layers"] = args.scan_layers
  rules = model_rules(data="data" if "data" in shape else None, context=seq,
                      tensor="tensor" if "tensor" in shape else None)
  # FSDP: weights (and Adam's moments) split over the data and context axes.
  fsdp = tuple(a for a in ("data",) + seq_axes if shape.get(a, 1) > 1)
  cfg = ModelConfig(
      **model_kw, dtype=dtype, sliding_window=args.sliding_window,
      logits_soft_cap=args.soft_cap, implementation=args.implementation,
      context_parallel=cpc, rules=rules,
      param_rules=(jrf.fsdp_rules(rules, fsdp) if args.shard_weights and fsdp
                   else None))
  batch = args.batch or preset["batch_per_data"] * shape.get("data", 1)
  if batch % shape.get("data", 1):
    raise SystemExit(f"--batch {batch} must be divisible by the data axis "
                     f"size {shape['data']}")

  tx = make_optimizer(args.lr, args.warmup, args.steps)
  with jax.set_mesh(mesh):
    # Parameters are created from the seed one array at a time, each placed
    # as its sharding says (flax eager sharding): one compiled program per
    # distinct array shape. Created under one jit, every layer's arrays are
    # one program, which XLA:GPU compiles for minutes at 32 layers.
    model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
  state, train_step, graphdef = make_train_step(
      model, tx, functools.partial(loss_fn, vocab_chunk=args.vocab_chunk),
      mesh)
  spec = jax.P("data" if "data" in shape else None, seq)
  return dict(mesh=mesh, cfg=cfg, spec=spec, batch=batch, state=state,
              train_step=train_step, graphdef=graphdef)


def make_train_step(model, tx, loss_fn, mesh, trainable=None):
  """The train state of ``model`` and its jitted step.

  Args:
    model: an NNX module whose arrays are already placed on ``mesh``.
    tx: the optax optimizer.
    loss_fn: ``(model, batch) -> scalar loss``.
    mesh: the device mesh.
    trainable: an nnx filter of what trains (default ``nnx.Param``;
      ``nnx.LoRAParam`` for LoRA): gradients and optimizer state exist for
      it alone; the rest of the model (frozen weights, dropout streams)
      rides along in ``state["rest"]``.

  Returns:
    ``(state, train_step, graphdef)``: ``state`` is ``{"params",
    "opt_state"}`` (and ``"rest"`` where the model holds more);
    ``train_step(state, batch) -> (state, loss)``;
    ``model_of(graphdef, state)`` is the model again.
  """
  import jax
  import optax
  from flax import nnx

  trainable = nnx.Param if trainable is None else trainable
  replicated = jax.NamedSharding(mesh, jax.P())
  with jax.set_mesh(mesh):
    graphdef, params, rest = nnx.split(model, trainable, ...)
    # Eagerly, each moment is made where its parameter is (zeros_like keeps
    # the sharding: split under FSDP); under jit it would come out
    # replicated. The rest (the step count) is replicated over the mesh.
    opt_state = jax.tree.map(
        lambda x: x if isinstance(x.sharding, jax.NamedSharding) else
        jax.device_put(x, replicated), tx.init(params))
  state = {"params": params, "opt_state": opt_state}
  if jax.tree.leaves(rest):
    state["rest"] = rest
  # The step keeps every array where it found it: the restored state of a
  # resumed run has the same shardings, so the same program runs.
  state_sh = jax.tree.map(lambda x: x.sharding, state)

  def step(state, batch):
    def loss_of(params):
      # The rest's variables made afresh in this trace (a copy of the
      # tree): the call may then update them, as nnx refuses to write a
      # variable of an outer trace.
      model = model_of(graphdef, jax.tree.map(
          lambda x: x, dict(state, params=params)))
      # What the call changed outside the trainable arrays (the dropout
      # streams' counts) comes out, so that the next step draws afresh.
      return loss_fn(model, batch), nnx.split(model, trainable, ...)[2]

    (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(
        state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new = {"params": params, "opt_state": opt_state}
    return (new | {"rest": rest} if "rest" in state else new), loss

  gpu = jax.default_backend() == "gpu"
  train_step = jax.jit(step, out_shardings=(state_sh, replicated),
                       donate_argnums=(0,) if gpu else ())
  return state, train_step, graphdef


def model_of(graphdef, state):
  """The model of a train state (``make_train_step``'s)."""
  from flax import nnx
  return nnx.merge(graphdef, state["params"],
                   *([state["rest"]] if "rest" in state else []))


# --------------------------------------------------------------------------
# The record saved with each checkpoint (checkpoints.py).


def _run_record(args, built) -> dict:
  """What must match for --resume to continue the same trajectory."""
  return dict(preset=args.preset, seq=args.seq, batch=built["batch"],
              steps=args.steps, lr=args.lr, warmup=args.warmup,
              seed=args.seed, dtype=str(built["cfg"].dtype),
              sliding_window=args.sliding_window, soft_cap=args.soft_cap)


# --------------------------------------------------------------------------
# The loop.


class StepClock:
  """Training throughput from the times at which steps *finish*.

  The time a step call takes on the host says little about the device:
  where dispatch is asynchronous it returns at once, and where it waits
  (on one H100 the fine-tuning step's call returned after about a step's
  time) it ends with its step. The loop reads each step's loss one step
  late and ticks here when it has it, so the intervals between ticks are
  the step times either way. The first tick of a run ends the compiling
  step and starts the clock; so does the first tick after :meth:`pause`
  (a checkpoint's copy to host memory is reported on its own, not as a
  slow step; the read of a run's last step, already there where the call
  waits, times nothing).

  ``smoothed``: tokens/s over an exponential moving average of the intervals
  (what the progress bar shows; a weight of 0.1 spans about the last 10
  steps, whose cost varies with how documents pack into each window);
  ``steady``: tokens/s at the median interval (what
  ``benchmarks/lm_training.py`` reports, so the two compare).
  """

  def __init__(self, tokens_per_step: int, smoothing: float = 0.1):
    self.tokens, self.smoothing = tokens_per_step, smoothing
    self.last, self.ema, self.intervals = None, None, []

  def tick(self, now: float | None = None) -> None:
    now = time.perf_counter() if now is None else now
    if self.last is not None:
      dt = now - self.last
      self.intervals.append(dt)
      self.ema = dt if self.ema is None else (
          self.smoothing * dt + (1 - self.smoothing) * self.ema)
    self.last = now

  def pause(self) -> None:
    """Leave the time until the next tick out of the step times."""
    self.last = None

  @property
  def smoothed(self) -> float | None:
    return self.tokens / self.ema if self.ema else None

  @property
  def median_step_s(self) -> float | None:
    return float(np.median(self.intervals)) if self.intervals else None

  @property
  def steady(self) -> float | None:
    return self.tokens / self.median_step_s if self.intervals else None


def _progress(total: int, done: int, enabled: bool):
  """A tqdm bar over steps, opened once the compiling step has finished so
  that its rate and eta are the steady ones."""
  from tqdm.auto import tqdm
  return tqdm(total=total, initial=done, unit="step", disable=not enabled,
              dynamic_ncols=True, smoothing=0.1)


def _dir_bytes(path: str) -> int:
  return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*")
             if f.is_file())


def train(args) -> dict:
  """Run (or resume) training; returns the losses and throughput."""
  import jax

  import jax_ring.flax as jrf

  run_dir.prepare(args, "train_lm", OUTPUTS)
  built = build(args)
  mesh = built["mesh"]
  corpus = functools.cache(Corpus)  # read once, after a resume's checks

  def batch_at(step):
    tokens, seg = corpus().batch(step, args.seed, built["batch"], args.seq)
    return jrf.prepare_lm_batch(
        tokens, seg, mesh=mesh, spec=built["spec"],
        context_parallel=built["cfg"].context_parallel)

  def banner(start):
    cfg = built["cfg"]
    return (f"jax_ring train_lm: {cfg.num_params() / 1e6:.2f}M params "
            f"({args.preset}), {corpus().tokens.size / 1e6:.1f}M bytes of "
            f"Python source in {corpus().num_files} files\n"
            f"  mesh {dict(mesh.shape)} on {jax.device_count()} "
            f"{jax.devices()[0].platform} devices ({jax.process_count()} "
            f"process(es)), strategy {args.strategy}, load balance "
            f"{args.load_balance}, batch {built['batch']} x seq {args.seq}, "
            f"{cfg.dtype.name}"
            + (f", resuming at step {start}" if start else ""))

  return train_loop(args, mesh=mesh, state=built["state"],
                    train_step=built["train_step"],
                    record=_run_record(args, built), batch_at=batch_at,
                    tokens_per_step=built["batch"] * args.seq, banner=banner)


def train_loop(args, *, mesh, state, train_step, record: dict, batch_at,
               tokens_per_step: int, banner) -> dict:
  """Run (or resume) the steps of a training run; shared with
  ``finetune.py``.

  Args:
    args: the run's flags: ``run_dir`` (made ready by
      ``run_dir.prepare``), ``resume``, ``steps``, ``stop_after``,
      ``checkpoint_every``, ``quiet``.
    mesh: the device mesh.
    state: the initial train state (replaced by the checkpoint's on
      ``--resume``).
    train_step: ``(state, batch) -> (state, loss)``.
    record: what must match for ``--resume`` (saved with each checkpoint,
      compared before the restore; see checkpoints.py).
    batch_at: ``step -> batch`` on the mesh, a pure function of the step
      so that a resumed run sees the same data.
    tokens_per_step: for the throughput.
    banner: ``start step -> str``, printed (process 0) before the loop.

  Returns:
    The losses, the start step, the final state, throughput and
    checkpoint figures.

  Raises:
    SystemExit: a NaN or infinite loss or train state, naming the step
      (nothing of it or later is saved; the last checkpoint is whole);
      on ``--resume``, a checkpoint that does not match or verify.
  """
  import jax

  lead = jax.process_index() == 0
  manager = checkpoints.manager(args.run_dir)
  start, losses = 0, []
  if args.resume:
    with jax.set_mesh(mesh):  # as the saves: the checksums compile once
      start, state, losses = checkpoints.restore(manager, state, record)
  elif manager.all_steps():  # run_dir.prepare refuses before this
    raise SystemExit(f"{manager.directory} holds checkpoints "
                     f"{manager.all_steps()}: pass --resume or --overwrite")
  if lead:
    print(banner(start), flush=True)
  show = lead and not args.quiet
  stop = min(args.steps, args.stop_after or args.steps)
  clock, bar, pending = StepClock(tokens_per_step), None, None
  saves = dict(count=0, blocked_s=0.0, bytes=0, final_wait_s=0.0)
  if show and start < stop:
    print("compiling the training step...", file=sys.stderr, flush=True)

  def finish(loss):
    """Read a dispatched step's loss (this waits for that step); a NaN or
    infinity stops the run before anything after it is saved."""
    nonlocal bar
    losses.append(float(loss))
    if not math.isfinite(losses[-1]):
      raise SystemExit(f"step {len(losses)}: the loss is {losses[-1]}; "
                       f"training stopped, nothing of this step saved; "
                       + checkpoints.last_checkpoint(manager))
    clock.tick()
    if bar is None:
      bar = _progress(args.steps, len(losses), show)
    else:
      bar.update(1)
    rate = clock.smoothed
    bar.set_postfix_str(f"loss {losses[-1]:.3f}" + (
        f", {rate / 1e3:.1f}k tok/s" if rate else ""), refresh=False)

  try:
    with jax.set_mesh(mesh):
      for step in range(start, stop):
        state, loss = train_step(state, batch_at(step))
        if pending is not None:  # the previous step, while this one runs
          finish(pending)
        pending = loss
        last = step + 1 == stop
        if last or (step + 1) % args.checkpoint_every == 0:
          # The checkpoint records this step's loss too. No interval is
          # timed here: where the step call waits for its step, the tick
          # just above already did, and this one would time nothing.
          clock.pause()
          finish(pending)
          pending = None
          # Orbax copies the state to host memory here, then writes it in a
          # background thread: the loop waits only for the copy (and for
          # the state's checksums, a few numbers).
          t0 = time.perf_counter()
          checkpoints.save(manager, step + 1, state, record, losses)
          saves["blocked_s"] += time.perf_counter() - t0
          saves["count"] += 1
          clock.pause()
  finally:  # also when stopped: the last good checkpoint is written whole
    if bar is not None:
      bar.close()
    t0 = time.perf_counter()
    manager.wait_until_finished()  # only the last write can still run
    saves["final_wait_s"] = time.perf_counter() - t0
    if manager.latest_step() is not None and lead:
      saves["bytes"] = _dir_bytes(os.path.join(
          str(manager.directory), str(manager.latest_step())))
    manager.close()
  return dict(losses=losses, start=start, state=state,
              tokens_per_s=clock.steady, smoothed_tokens_per_s=clock.smoothed,
              median_step_s=clock.median_step_s,
              step_intervals_s=list(clock.intervals), checkpoints=saves)


# --------------------------------------------------------------------------
# Report.


def ascii_curve(losses, width=60, height=10) -> str:
  """The loss curve as text: bucket means, one column per bucket."""
  cols = np.array_split(np.asarray(losses, float), min(width, len(losses)))
  ys = np.array([c.mean() for c in cols])
  lo, hi = ys.min(), ys.max()
  rows = np.round((ys - lo) / max(hi - lo, 1e-9) * (height - 1)).astype(int)
  lines = []
  for r in range(height - 1, -1, -1):
    label = f"{lo + (hi - lo) * r / (height - 1):7.3f} |"
    lines.append(label + "".join("*" if v == r else " " for v in rows))
  lines.append(" " * 8 + "+" + "-" * len(ys))
  last = f"step {len(losses)}"
  lines.append(" " * 9 + "step 1" + last.rjust(max(len(ys) - 6, len(last) + 2)))
  return "\n".join(lines)


def report(result, args, *, unit: str = "nats/byte", title: str | None = None):
  """Print the curve and figures; write losses.json and loss_curve.png
  (``unit``: the loss's, for the labels; ``title``: the plot's)."""
  losses = result["losses"]
  print(f"\nloss curve ({unit}):\n" + ascii_curve(losses))
  k = min(10, len(losses))
  print(f"final loss {np.mean(losses[-k:]):.4f} (mean of the last {k} steps)")
  if result["tokens_per_s"]:
    print(f"throughput {result['tokens_per_s']:,.0f} tokens/s at the median "
          f"step, {result['median_step_s']:.3f} s, of "
          f"{len(result['step_intervals_s'])} steps after compilation (the statistic of "
          f"benchmarks/lm_training.py)")
  c = result["checkpoints"]
  if c["count"]:
    print(f"checkpoints: {c['count']} saved in the background, "
          f"{c['bytes'] / 1e9:.2f} GB each on disk; saving held the loop "
          f"{c['blocked_s']:.1f} s in all (checksums, copies to host "
          f"memory); the last write finished {c['final_wait_s']:.1f} s "
          f"after the last step")
  os.makedirs(args.run_dir, exist_ok=True)
  with open(os.path.join(args.run_dir, "losses.json"), "w") as f:
    json.dump({"losses": losses, "tokens_per_s": result["tokens_per_s"],
               "median_step_s": result["median_step_s"],
               "checkpoints": c}, f)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed (pip install 'jax-ring[examples]'): "
          "no PNG; losses are in " + os.path.join(args.run_dir, "losses.json"))
    return
  fig, ax = plt.subplots(figsize=(6, 3.5))
  steps = np.arange(1, len(losses) + 1)
  ax.plot(steps, losses, alpha=0.35, label="loss")
  ema, smooth = losses[0], []
  for x in losses:
    ema = 0.9 * ema + 0.1 * x
    smooth.append(ema)
  ax.plot(steps, smooth, label="moving average (0.9)")
  ax.legend()
  ax.set(xlabel="step", ylabel=f"loss ({unit})", title=title or (
      f"train_lm {args.preset}, seq {args.seq}, {args.strategy}"))
  ax.grid(alpha=0.3)
  path = os.path.join(args.run_dir, "loss_curve.png")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"saved {path}")


def main(argv=None):
  # XLA's C++ log, read once when jax's backend starts: on GPUs each compile
  # of the step logs thousands of harmless "Invalid stack_frame_id" warnings
  # (XLA re-parsing its own HLO metadata; not the traceback locations, which
  # setup_jax already trims). Level 2 drops XLA's info and warning lines,
  # its other warnings too (e.g. a rematerialisation that missed the memory
  # limit), and keeps errors. A value you set is kept (0 shows everything).
  # Set here rather than at import, so importing this module (the tests,
  # benchmarks/lm_training.py) leaves the process's logging alone.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # Process-level flags first: jax's devices must be set up before anything
  # (importing jax_ring included) may touch them.
  process_flags = argparse.ArgumentParser(add_help=False)
  add_process_flags(process_flags)
  setup_jax(process_flags.parse_known_args(argv)[0])
  args = parse_args(argv)
  result = train(args)
  import jax
  if jax.process_index() == 0:
    report(result, args)


if __name__ == "__main__":
  main()
