"""Every context-parallel strategy on all local GPUs, side by side, against
"theoretic": the single-GPU cuDNN time for the full sequence divided by the
number of GPUs, measured in the same process (ring-flash-attention's
convention).

  python benchmarks/strategies.py [--seq 32768 ...] [--kv-heads 32 8]

B=1, N=32, D=128, bf16, causal, dual-chunk layout. Each strategy runs
through the automatic path (jit + NamedSharding + ContextParallel), the way
a model calls it. Names: ``ring`` (unrolled, ``--kv-sends``: by default
jax_ring's), ``ring_scan``, ``ring_neighbour`` and ``ring_gather``
(unrolled, that ``kv_sends``), ``all_gather``,
``all_gather_gG`` (K/V gathered G kv heads at a time, ``kv_chunk_heads``),
``ulysses``, ``hybrid_UxR`` (U ulysses x R ring devices), ``auto``; the
default is ring, all_gather, ulysses, every hybrid with U, R >= 2 (2x2 on 4
GPUs; 2x4 and 4x2 on 8) and auto, timed like the others; the row records
auto's forward/backward picks and its time over the fastest other
strategy's, for the forward and for forward+backward.

``--mixes`` adds packed rows (segment ids, causal within each document):
``one`` (the default: one causal document, no ids), ``lognormal``
(median 300 tokens, sigma 1, capped at 8,192) and ``equalN`` (N equal
documents); ``<mix>_balanced``: its documents in
``jax_ring.balance_documents``' order for contiguous shards over every
local GPU (for hybrid, not its ring's size). A name ending
``_contiguous`` (``ring_contiguous``) runs that strategy on contiguous
shards instead of the dual-chunk layout. A packed row's efficiency is
against the single GPU on the same ids; ``<name>_fwdbwd_eff_vs_one``
divides it by the strategy's efficiency on one document of the same
length (target >= 0.9). ``--tail-divisors`` sets the contiguous ring's
step-1 tail sizes (``common.tail_args``). Writes
benchmarks/results/strategies_<count>x<gpu>.json (``--mode``: the run's name
there).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re

os.environ.setdefault("XLA_FLAGS",
                      "--xla_gpu_enable_latency_hiding_scheduler=true")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ring  # noqa: E402
from common import (document_ids, lognormal_lengths,  # noqa: E402
                    packed_path_args, random_qkv, rel_err, ring_args,
                    ring_kwargs, shape_args, tail_args, time_fn,
                    prepare_own_arg, use_packed_path, use_prepare_own,
                    use_tail_divisors, write)

def default_strategies(cp: int) -> list[str]:
  hybrids = [f"hybrid_{u}x{cp // u}" for u in range(2, cp // 2 + 1)
             if cp % u == 0]
  return ["ring", "all_gather", "ulysses"] + hybrids + ["auto"]


def setup(name, cp, lb, **ring):
  """(ContextParallel, token sharding, reorder, inverse) for a strategy
  name (see the module docstring) under load balance ``lb`` (None for a
  name ending ``_contiguous``); ``ring``: the ring's tuning
  (``kv_sends``), for ring and hybrid."""
  if name.endswith("_contiguous"):
    name, lb = name.removesuffix("_contiguous"), None
  if name.startswith("hybrid"):
    u, r = ((cp // 2, 2) if name == "hybrid" else
            map(int, name.split("_")[1].split("x")))
    if u * r != cp:
      raise ValueError(f"{name}: {u} x {r} != {cp} devices")
    mesh = Mesh(np.array(jax.devices()).reshape(r, u), ("ring", "ulysses"))
    spec, ring_size = P(None, ("ring", "ulysses")), r
    cpc = jax_ring.ContextParallel(axis=("ulysses", "ring"),
                                   strategy="hybrid", load_balance=lb,
                                   inputs="load_balanced", **ring)
  else:
    mesh = Mesh(np.array(jax.devices()), ("cp",))
    spec, ring_size = P(None, "cp"), cp
    strategy, scan, _ = name.partition("_scan")
    if strategy in ("ring_neighbour", "ring_gather"):
      strategy, ring = "ring", dict(ring, kv_sends=strategy[5:])
    grouped = re.fullmatch(r"(\w+)_g(\d+)", strategy)  # all_gather_g<G>
    cpc = jax_ring.ContextParallel(
        axis="cp", strategy=grouped[1] if grouped else strategy,
        load_balance=lb, loop="scan" if scan else "unrolled",
        kv_chunk_heads=int(grouped[2]) if grouped else None,
        inputs="load_balanced", **ring)
  to = lambda x: (jax_ring.reorder_for_load_balance(x, ring_size, layout=lb)
                  if lb else x)
  back = lambda x: (jax_ring.reorder_from_load_balance(x, ring_size, layout=lb)
                    if lb else x)
  return cpc, NamedSharding(mesh, spec), to, back


def mix_ids(mix: str, seq: int):
  """``(1, seq)`` int32 segment ids of a ``--mixes`` name (None: ``one``)."""
  if mix.endswith("_balanced"):
    ids = np.asarray(mix_ids(mix.removesuffix("_balanced"), seq))
    order = jax_ring.balance_documents(ids, jax.device_count())
    return jnp.asarray(np.take_along_axis(ids, order, 1))
  if mix == "one":
    return None
  if mix == "lognormal":
    lengths = lognormal_lengths(np.random.default_rng(0), seq)
  elif mix.startswith("equal") and seq % int(mix[5:]) == 0:
    lengths = [seq // int(mix[5:])] * int(mix[5:])
  else:
    raise ValueError(f"--mixes {mix!r}: one, lognormal or equalN (N "
                     f"dividing {seq})")
  return jnp.asarray(document_ids(lengths))


def measure(row, name, cp, causal, q, k, v, do, want, t1, tb1, ring,
            ids=None):
  """Time one strategy's forward and forward+backward into ``row``."""
  cpc, sh, to, back = setup(name, cp, "dual_chunk" if causal else None,
                            **ring)
  args = [jax.device_put(to(x), sh) for x in (q, k, v, do)]
  seg = None if ids is None else jax.device_put(to(ids), sh)
  attn = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=causal, segment_ids=seg, context_parallel=cpc)
  f = jax.jit(attn)
  fb = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
  row[f"{name}_max_rel_err"] = rel_err(back(f(*args[:3])), want)
  t, tb = time_fn(f, *args[:3]), time_fn(fb, *args)
  row[f"{name}_fwd_ms"], row[f"{name}_fwdbwd_ms"] = t * 1e3, tb * 1e3
  row[f"{name}_fwd_eff"] = t1 / cp / t
  row[f"{name}_fwdbwd_eff"] = tb1 / cp / tb


def versus_one(rows, names):
  """Each packed row's ``<name>_fwdbwd_eff_vs_one``: its efficiency over
  the same strategy's on one document of the same seq and kv heads."""
  one = {(r["seq"], r["kv_heads"]): r for r in rows if r["mix"] == "one"}
  for r in rows:
    base = one.get((r["seq"], r["kv_heads"]))
    for n in names:
      key = f"{n}_fwdbwd_eff"
      if r["mix"] != "one" and base and key in r and key in base:
        r[f"{key}_vs_one"] = r[key] / base[key]


def report(rows, a):
  versus_one(rows, a.strategies)
  cols = ["seq", "kv_heads", "mix"]
  for n in a.strategies:
    cols += [f"{n}_fwd_eff", f"{n}_fwdbwd_eff"]
    if len(a.mixes) > 1:
      cols.append(f"{n}_fwdbwd_eff_vs_one")
  write("strategies", rows,
        cols + ["auto_pick", "best_fwd", "auto_vs_best_fwd", "best_fwdbwd",
                "auto_vs_best_fwdbwd"],
        extra=dict(dtype="bfloat16", batch=1, head_dim=a.head_dim,
                   **a.packed,
                   tail_divisors=a.tail_divisors,
                   prepare_own=a.prepare_own,
                   **ring_kwargs(a),
                   efficiency="(single-GPU cuDNN time / cp) / strategy time",
                   path="automatic (jit + NamedSharding + ContextParallel)"),
        mode=a.mode)


def main():
  p = argparse.ArgumentParser()
  shape_args(p, [16384, 32768, 65536, 131072, 262144])
  p.add_argument("--strategies", nargs="+", default=None,
                 help="names as above (default: see the module docstring)")
  ring_args(p)
  p.add_argument("--mixes", nargs="+", default=["one"],
                 help="one, lognormal, equalN (see the module docstring)")
  p.add_argument("--implementation", default="cudnn",
                 help="single-GPU baseline backend (xla for a CPU dry run)")
  packed_path_args(p)
  tail_args(p)
  prepare_own_arg(p)
  a = p.parse_args()
  a.packed = use_packed_path(a.packed_path, a.tile_sizes,
                             a.pallas_stages)
  a.tail_divisors = use_tail_divisors(a.tail_divisors)
  a.prepare_own = use_prepare_own(a.prepare_own)
  cp = jax.device_count()
  a.strategies = a.strategies or default_strategies(cp)
  causal = True
  rows = []
  for s in a.seq:
    for kh, mix in itertools.product(a.kv_heads, a.mixes):
      q, k, v, do = random_qkv(s + kh, s, a.heads, kh, a.head_dim)
      ids = mix_ids(mix, s)
      row = dict(seq=s, cp=cp, heads=a.heads, kv_heads=kh, causal=causal,
                 mix=mix, documents=1 if ids is None else len(np.unique(ids)))
      single = lambda q, k, v, ids=ids: jax_ring.dot_product_attention(
          q, k, v, is_causal=causal, segment_ids=ids,
          implementation=a.implementation)
      f1 = jax.jit(single)
      fb1 = jax.jit(lambda q, k, v, do: jax.vjp(single, q, k, v)[1](do))
      want = f1(q, k, v).astype(jnp.float32)
      t1, tb1 = time_fn(f1, q, k, v), time_fn(fb1, q, k, v, do)
      row["single_fwd_ms"], row["single_fwdbwd_ms"] = t1 * 1e3, tb1 * 1e3
      for name in a.strategies:
        try:
          measure(row, name, cp, causal, q, k, v, do, want, t1, tb1,
                  ring_kwargs(a), ids)
        except Exception as e:  # a strategy that fails is reported, not hidden
          row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
      choice = jax_ring.explain(
          q.shape, k.shape, cp_size=cp, is_causal=causal,
          segment_ids=None if ids is None else np.asarray(ids))
      row["auto_pick"] = f"{choice.forward}/{choice.backward}"
      if ids is not None:
        row["balance"] = choice.defaults["balance"][0]
      measured = [n for n in a.strategies
                  if f"{n}_fwdbwd_ms" in row and n != "auto"]
      for t in ("fwd", "fwdbwd"):
        best = min(measured, key=lambda n: row[f"{n}_{t}_ms"])
        row[f"best_{t}"] = best
        if f"auto_{t}_ms" in row:  # auto itself, timed like the others
          row[f"auto_vs_best_{t}"] = row[f"auto_{t}_ms"] / row[
              f"{best}_{t}_ms"]
      rows.append(row)
      print(row, flush=True)
      report(rows, a)  # after every row: a run cut short keeps its rows


if __name__ == "__main__":
  main()
