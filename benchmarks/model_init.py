"""How long the example's model takes to make its weights: eagerly, one
array at a time (``examples/train_lm.py``'s way), against the whole model
under one ``nnx.jit``, each in a process of its own with a time bound.

  python benchmarks/model_init.py --preset llama3-8b [--bound 100]

Each row: seconds from the call to the arrays being ready (compiling
included) and the allocator's peak; a process that passes ``--bound``
(its start included) or fails is recorded as not finished, with why. Writes benchmarks/results/model_init_<kind>.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def one(preset: str, how: str) -> dict:
  """Make the preset's model ``how`` ("eager" or "jit") in this process."""
  sys.path.insert(0, str(ROOT / "examples"))
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import lm_model
  import train_lm
  cfg = lm_model.ModelConfig(**train_lm.PRESETS[preset]["model"],
                             dtype=jnp.bfloat16)
  make = lambda: lm_model.Transformer(cfg, rngs=nnx.Rngs(0))
  t0 = time.perf_counter()
  model = make() if how == "eager" else nnx.jit(make)()
  jax.block_until_ready(nnx.state(model))
  stats = jax.devices()[0].memory_stats() or {}
  return dict(preset=preset, how=how, seconds=time.perf_counter() - t0,
              finished=True, params=cfg.num_params(),
              peak_gb=stats.get("peak_bytes_in_use", 0) / 1e9)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="llama3-8b")
  p.add_argument("--bound", type=float, default=100.0,
                 help="seconds a way may take before it is stopped")
  p.add_argument("--mode", default="default")
  p.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.one:
    print(json.dumps(one(*a.one)))
    return
  sys.path.insert(0, str(ROOT / "benchmarks"))
  from common import write
  rows = []
  for how in ("eager", "jit"):
    cmd = [sys.executable, __file__, "--one", a.preset, how]
    try:
      out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                           timeout=a.bound).stdout
      rows.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:  # the bound covers the process's start
      rows.append(dict(preset=a.preset, how=how, seconds=None,
                       finished=False, note=f"not done after {a.bound} s"))
    except subprocess.CalledProcessError as e:
      rows.append(dict(preset=a.preset, how=how, seconds=None,
                       finished=False, note=e.stderr.strip()[-300:]))
  write("model_init", rows, ["preset", "how", "seconds", "finished",
                             "peak_gb"], extra=dict(bound_s=a.bound),
        mode=a.mode)


if __name__ == "__main__":
  main()
