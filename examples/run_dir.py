"""The examples' run directory: where a run writes, and what a fresh run
may replace. Shared by ``train_lm.py`` and ``finetune.py``.

The contract:

* Without ``--run-dir``, each run writes to a new directory of its own,
  ``<temp dir>/jax_ring_<example>-<random>``, made at start and printed;
  two runs never share it. ``--resume`` therefore needs ``--run-dir``, and
  so does ``--distributed`` (every process must write the same directory).
* A fresh run (no ``--resume``) refuses a run directory that holds any of
  the paths the example writes (an empty directory aside), before it
  deletes or writes anything; the error names ``--resume`` and
  ``--overwrite``.
* ``--overwrite`` deletes exactly those paths first, naming each. Anything
  else in the directory is never touched, and a path the run reads (a
  ``--model`` or ``--data`` inside the run directory) is never one the run
  deletes or writes.
* ``--resume`` continues from the last checkpoint (``checkpoints.py``
  verifies it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile


def _missing(modules) -> list[str]:
  """Which of ``modules`` this Python cannot import."""
  out = []
  for name in modules:
    try:
      found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
      found = False
    if not found:
      out.append(name)
  return out


# Every example imports this module first: a missing dependency is named
# here, with the extra that installs it, not deep inside an import.
MISSING = _missing(("flax", "optax", "orbax.checkpoint", "tokenizers",
                    "safetensors", "tqdm"))
if MISSING:
  raise SystemExit(f"the examples need {', '.join(MISSING)}, which this "
                   f"Python lacks: pip install -e \".[examples]\" (from the "
                   f"repository root)")


def number(kind, low, *, above: bool = False, high=None):
  """An argparse ``type``: ``kind`` (int or float) at least ``low`` (more
  than ``low`` if ``above``) and at most ``high``; anything else is the
  flag's error (exit status 2), not a run that quietly does another
  thing."""
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"not {kind.__name__}: {text!r}")
    if value != value or value in (float("inf"), float("-inf")):
      raise argparse.ArgumentTypeError(f"must be a finite number; got {text}")
    if (value <= low if above else value < low) or (
        high is not None and value > high):
      bound = (f"> {low}" if above else f">= {low}") + (
          f" and <= {high}" if high is not None else "")
      raise argparse.ArgumentTypeError(f"must be {bound}; got {text}")
    return value
  parse.__name__ = kind.__name__  # argparse names the type in errors
  return parse


POSITIVE = number(int, 1)
NON_NEGATIVE = number(int, 0)
POSITIVE_FLOAT = number(float, 0.0, above=True)


def add_flags(p: argparse.ArgumentParser, example: str) -> None:
  """The run-directory and checkpoint flags of ``example``."""
  p.add_argument("--run-dir", default=None, help=(
      f"where checkpoints/ and the results go; default: a new directory "
      f"per run, {tempfile.gettempdir()}/jax_ring_{example}-<random>, "
      f"printed at start (multi-host: a directory every host can write)"))
  p.add_argument("--resume", action="store_true",
                 help="continue from the last checkpoint in --run-dir")
  p.add_argument("--overwrite", action="store_true",
                 help="a fresh run into a --run-dir that holds an earlier "
                 "run's results deletes them first (otherwise it refuses)")
  p.add_argument("--checkpoint-every", type=POSITIVE, default=25)
  p.add_argument("--stop-after", type=POSITIVE, default=None,
                 help="stop after this step, as if interrupted")


def check_inputs(p: argparse.ArgumentParser, model: str | None,
                 **files: str | None) -> None:
  """Refuse (``p.error``) a ``--model`` that is no checkpoint directory
  (no config.json) and each input file (``files``: flag name without its
  dashes -> path) that is not there."""
  if model and not os.path.isfile(os.path.join(model, "config.json")):
    p.error(f"--model {model}: no config.json there (a local Hugging Face "
            "checkpoint directory)")
  for flag, path in files.items():
    if path and not os.path.isfile(path):
      p.error(f"--{flag.replace('_', '-')} {path}: no such file")


def check_flags(p: argparse.ArgumentParser, args) -> None:
  """Refuse (``p.error``: exit status 2) flag combinations the contract
  rules out."""
  if args.resume and args.overwrite:
    p.error("--resume continues the run in --run-dir; --overwrite deletes "
            "it: pass one of them")
  if args.run_dir is None and args.resume:
    p.error("--resume needs --run-dir: without it each run writes to a new "
            "directory of its own")
  if args.run_dir is None and getattr(args, "distributed", False):
    p.error("--distributed needs --run-dir, a directory every process can "
            "write")


def prepare(args, example: str, outputs, inputs=()) -> pathlib.Path:
  """Make ``args.run_dir`` ready for the run, or refuse; sets
  ``args.run_dir`` to the directory's path (a new one when it is None).

  Args:
    args: the run's flags: ``run_dir``, ``resume``, ``overwrite``.
    example: the example's name, for the default directory's name.
    outputs: the paths the run writes, relative to the run directory.
    inputs: paths the run reads (``--model``, ``--data``); none of them may
      be, or lie inside, an output.

  Raises:
    SystemExit: a fresh run into a directory holding outputs (without
      ``--overwrite``), ``--resume`` into a missing directory, a run
      directory that is a file, or an input that is an output.
  """
  import jax
  lead = jax.process_index() == 0
  made = args.run_dir is None
  run = pathlib.Path(tempfile.mkdtemp(prefix=f"jax_ring_{example}-") if made
                     else args.run_dir)
  args.run_dir = str(run)
  if lead:
    print(f"run directory: {run}" + (" (new; --run-dir chooses one)"
                                     if made else ""), file=sys.stderr,
          flush=True)
  for path in (pathlib.Path(p).resolve() for p in inputs if p is not None):
    for out in outputs:
      if (run / out).resolve() in (path, *path.parents):
        raise SystemExit(f"{path} is read by this run but lies in "
                         f"{run / out}, which it writes: move it or choose "
                         f"another --run-dir")
  if run.exists() and not run.is_dir():
    raise SystemExit(f"--run-dir {run} is not a directory")
  if args.resume:
    if not run.is_dir():
      raise SystemExit(f"--resume: {run} does not exist")
    return run
  present = [out for out in outputs if _holds_something(run / out)]
  if present and not args.overwrite:
    raise SystemExit(
        f"{run} holds an earlier run's {', '.join(present)}: pass --resume "
        f"to continue that run, or --overwrite to delete them and start "
        f"afresh (or choose another --run-dir)")
  if lead:
    for out in present:
      print(f"--overwrite: deleting {run / out}", file=sys.stderr, flush=True)
      if (run / out).is_dir() and not (run / out).is_symlink():
        shutil.rmtree(run / out)
      else:
        (run / out).unlink()
  sync("run directory prepared")
  return run


def _holds_something(path: pathlib.Path) -> bool:
  """``path`` exists and is not an empty directory."""
  if path.is_symlink() or path.is_file():
    return True
  return path.is_dir() and any(path.iterdir())


def sync(name: str) -> None:
  """Wait here for every process (a no-op in a single process)."""
  import jax
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
