"""How fast can the ring move its KV? A ring-neighbour ``ppermute`` of one
buffer against the same bytes split into parts (a collective-permute per
part, issued together: XLA may run them as one NCCL group), and against a
bidirectional exchange (half the parts to the next device, half to the
previous).

  python benchmarks/permute_bandwidth.py [--mib 64 128 256] [--parts 1 2 4 8]

The ring's forward sends one stacked K/V buffer per step: 64 MiB at 16k
MHA tokens on 4 GPUs, 128 MiB at 32k. Its profile (profile_ring.py) showed
those sends at about 150 GB/s of NCCL kernel time, while the backward's
pair of sends (K/V and float32 dK/dV, one NCCL kernel per step) moved
faster, and the automatic path, where the pair ran as two kernels, moved
the same bytes about a third slower. This measures which layout of the same
bytes goes fastest; GB/s = bytes sent per device / median time
(device-synchronised batches, see common.time_fn). ``lax.ppermute`` of a
tuple lowers to one collective-permute per leaf, so "parts" is that.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common import time_fn, write


def exchange(x, mode: str, parts: int, cp: int):
  """``x`` (local, bf16) to the ring neighbour(s) in the given layout."""
  nxt = [(j, (j + 1) % cp) for j in range(cp)]
  prv = [(j, (j - 1) % cp) for j in range(cp)]
  pieces = jnp.split(x, parts, axis=0)
  if mode == "parts":
    return lax.ppermute(tuple(pieces), "cp", nxt)
  if mode == "bidirectional":  # half the parts each way
    half = len(pieces) // 2
    return (lax.ppermute(tuple(pieces[:half]), "cp", nxt),
            lax.ppermute(tuple(pieces[half:]), "cp", prv))
  raise ValueError(mode)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mib", type=int, nargs="+", default=[64, 128, 256])
  p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--mode", default="default",
                 help="this run's name in the results file, e.g. per NCCL_* "
                 "setting (which the JSON records)")
  a = p.parse_args()
  cp = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("cp",))
  rows = []
  for mib in a.mib:
    rows_per_dev = mib * 2**20 // 2 // 4096  # bf16 rows of 4096
    x = jax.device_put(
        jax.random.normal(jax.random.key(mib), (cp * rows_per_dev, 4096),
                          jnp.bfloat16), NamedSharding(mesh, P("cp")))
    for mode in ("parts", "bidirectional"):
      for parts in a.parts:
        if mode == "bidirectional" and parts == 1:
          continue
        f = jax.jit(jax.shard_map(
            lambda x, mode=mode, parts=parts: exchange(x, mode, parts, cp),
            mesh=mesh, in_specs=P("cp"), out_specs=P("cp")))
        got = jax.tree.leaves(f(x))
        # Check: device r's first part arrived at r + 1 (one-way modes).
        if mode != "bidirectional":
          want = np.roll(np.asarray(x, np.float32).reshape(cp, rows_per_dev,
                                                           4096), 1, 0)
          first = np.asarray(got[0], np.float32).reshape(cp, -1, 4096)
          assert np.array_equal(first, want[:, :first.shape[1]]), mode
        t = time_fn(f, x)
        row = dict(mib=mib, mode=mode, parts=parts, ms=t * 1e3,
                   gb_per_s=mib * 2**20 / t / 1e9)
        rows.append(row)
        print(row, flush=True)
  nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
  write("permute_bandwidth", rows,
        ["mib", "mode", "parts", "ms", "gb_per_s"],
        extra=dict(cp=cp, dtype="bfloat16", nccl_env=nccl), mode=a.mode)


if __name__ == "__main__":
  main()
