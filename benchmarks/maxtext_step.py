"""A MaxText model's training step (forward + backward of the loss) with
its own attention kernels and with jax_ring installed, side by side in one
run, on plain and on packed rows, each checked against MaxText's
``dot_product`` attention.

The model is MaxText 0.2.5's, built from its ``base.yml`` as its trainer
builds it: a Llama-3-style decoder (``--layers`` layers, 2048 wide, 16
query and 8 kv heads of 128, MLP 8192, vocabulary 32768), bf16 compute
with float32 weights (MaxText's defaults), its remat and layer scan.
Rows: ``plain`` (one document a row, segment ids all 1, as MaxText's
pipeline marks unpacked rows) or ``packed`` (long-tailed document lengths,
positions restarting at each). Kernels: ``jax_ring``
(``jax_ring.maxtext.install()``), and MaxText's ``cudnn_flash_jax``,
``flash`` (tokamax's Triton kernel on GPUs) and ``dot_product``.

Exactness: at ``--check-seq`` tokens each kernel's logits are compared
with ``dot_product``'s (bf16; ``error`` = max |diff| / max |dot_product|);
a kernel is ``exact`` when ``error <= --tolerance``. Time: the median step
(``common.time_fn``); ``mfu``: MaxText's own FLOP count of the step
(``calculate_tflops_training_per_device``: every row causal over its whole
length) over the time and the GPU's dense bf16 peak; ``work_mfu``: the
same with the attention FLOPs of the documents actually attended.

On a GPU machine without a package index (``bash
benchmarks/maxtext_wheels.sh`` here, then ``. benchmarks/gpu_setup.sh``
there)::

  python benchmarks/maxtext_step.py --seq 32768 --check-seq 8192
"""

from __future__ import annotations

import argparse
import os
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning

import common
import jax_ring.maxtext
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils, maxtext_utils_nnx
from maxtext.utils import model_creation_utils
import maxtext

PEAK_TFLOPS = 989.0  # H100 / H200 dense bf16
KERNELS = ("jax_ring", "cudnn_flash_jax", "flash", "dot_product")
MODEL = dict(base_emb_dim=2048, base_num_query_heads=16, base_num_kv_heads=8,
             head_dim=128, base_mlp_dim=8192, vocab_size=32768,
             dtype="bfloat16", hardware="gpu",
             skip_jax_distributed_system="true", enable_checkpointing="false",
             per_device_batch_size=1, run_name="maxtext_step")


def config_for(kernel: str, seq: int, layers: int):
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs",
                      "base.yml")
  keys = dict(MODEL, max_target_length=seq, base_num_decoder_layers=layers,
              attention="dot_product" if kernel == "jax_ring" else kernel)
  return pyconfig.initialize([None, base] +
                             [f"{k}={v}" for k, v in keys.items()])


def rows(kind: str, seq: int, seed=0):
  """(tokens, positions, segment ids, document lengths) of one row."""
  rng = np.random.default_rng(seed)
  lengths = ([seq] if kind == "plain" else
             common.lognormal_lengths(rng, seq, median=1024, cap=seq // 2))
  ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None]
  positions = np.concatenate([np.arange(n) for n in lengths])[None]
  tokens = rng.integers(0, MODEL["vocab_size"], (1, seq))
  as_int = lambda x: jnp.asarray(x, jnp.int32)
  return as_int(tokens), as_int(positions), as_int(ids), lengths


def step_fn(config, mesh, graph):
  """jitted (params, rest, tokens, positions, ids) -> (loss, grads,
  logits): next-token cross entropy within documents."""

  def loss(params, rest, tokens, positions, ids):
    model = nnx.merge(graph, params, rest)
    logits = model(tokens, positions, decoder_segment_ids=ids,
                   enable_dropout=False)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    same = (ids[:, 1:] == ids[:, :-1]).astype(jnp.float32)
    return jnp.sum(nll * same) / jnp.sum(same), logits

  grad = jax.value_and_grad(loss, has_aux=True)
  jitted = jax.jit(grad)

  def run(*args):
    with jax.set_mesh(mesh), partitioning.axis_rules(
        config.logical_axis_rules):
      return jitted(*args)

  return run


def measure(kernel, kind, seq, layers, params_of):
  """One row of the table: time, MFU and logits for ``kernel``."""
  config = config_for(kernel, seq, layers)
  mesh = maxtext_utils.get_mesh_from_config(config)
  with jax.set_mesh(mesh):
    model = model_creation_utils.from_config(
        config, mesh=mesh, rngs=maxtext_utils_nnx.create_nnx_rngs(config))
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  params = params_of(params)
  tokens, positions, ids, lengths = rows(kind, seq)
  if kernel == "jax_ring":
    jax_ring.maxtext.install()
  else:
    jax_ring.maxtext.uninstall()
  run = step_fn(config, mesh, graph)
  args = (params, rest, tokens, positions, ids)
  (_, logits), _ = run(*args)
  seconds = common.time_fn(run, *args, repeats=5)
  total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(
      config, log=False)
  causal_row = seq * (seq + 1) / 2
  work = weights + attention * common.causal_keys(lengths) / causal_row
  return dict(kernel=kernel, rows=kind, seq=seq, documents=len(lengths),
              ms=1e3 * seconds, mfu=total / seconds / PEAK_TFLOPS,
              work_mfu=work / seconds / PEAK_TFLOPS,
              tflops_step=total, work_tflops_step=work), logits


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seq", type=int, nargs="+", default=[32768])
  p.add_argument("--check-seq", type=int, default=8192,
                 help="the length of the check against dot_product (0: none)")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--kernels", nargs="+", default=list(KERNELS),
                 choices=KERNELS)
  p.add_argument("--rows", nargs="+", default=["plain", "packed"],
                 choices=("plain", "packed"))
  p.add_argument("--tolerance", type=float, default=5e-2)
  p.add_argument("--mode", default="default")
  args = p.parse_args()
  first = {}

  def params_of(params):  # every kernel runs the first model's weights
    if "params" not in first:
      first["params"] = params
    return first["params"]

  extra = dict(model=dict(MODEL, layers=args.layers),
               maxtext=metadata.version("maxtext"), check_seq=args.check_seq,
               tolerance=args.tolerance, peak_tflops=PEAK_TFLOPS,
               packed_lengths="lognormal, median 1024, sigma 1, cap seq/2")
  columns = ("kernel", "rows", "seq", "documents", "ms", "mfu", "work_mfu",
             "error", "exact")
  table = []
  for seq in sorted(set([args.check_seq] + args.seq) - {0}):
    for kind in args.rows:
      # dot_product (the reference) first, and only at the checked length.
      want = None
      order = ["dot_product"] + [k for k in args.kernels if k != "dot_product"]
      for kernel in order:
        if kernel == "dot_product" and seq != args.check_seq:
          continue
        if kernel not in args.kernels and seq != args.check_seq:
          continue
        row, logits = measure(kernel, kind, seq, args.layers, params_of)
        if kernel == "dot_product":
          want = logits
        if want is not None:
          row["error"] = common.rel_err(logits, want)
          row["exact"] = bool(row["error"] <= args.tolerance)
        table.append(row)
        print(row, flush=True)
        common.write("maxtext_step", table, columns, mode=args.mode,
                     extra=extra, show=False)
  common.write("maxtext_step", table, columns, mode=args.mode, extra=extra)


if __name__ == "__main__":
  main()
