"""Context-parallel attention on all local GPUs against "theoretic": the
single-GPU cuDNN time for the full sequence divided by the number of GPUs
(the convention of ring-flash-attention), measured in the same process.

  python benchmarks/ring_attention.py [--seq 16384 ...] [--kv-heads 32 8]

B=1, N=32, D=128, bf16, causal and non-causal. ``--api`` variants run the
public API under ``jax.jit`` (``dot_product_attention`` with a
``ContextParallel``), the way a model calls it: ``ring``, ``all_gather``,
``ulysses`` and ``auto`` on arrays already in the dual-chunk layout
(``inputs="load_balanced"``), and ``<name>_natural`` with the default
``inputs="natural"`` on natural-order arrays (``ring_natural`` is
``ContextParallel()`` itself). ``--loops`` adds ``ring_attention`` inside
``shard_map`` on laid-out arrays: ``unrolled`` and ``scan`` with
``--kv-sends``, by default jax_ring's; ``neighbour`` and ``gather`` =
unrolled with that ``kv_sends``; a suffix ``@nocc`` or ``@while`` compiles
the variant with those CUDA-graph command buffers, see ``common.GRAPHS``.
Efficiency = theoretic time / variant time (forward; forward+backward).
Each row also records, in points of forward+backward efficiency, what
natural-order inputs cost (``natural_cost``: ring minus ring_natural) and
how far ``auto`` is below the fastest of its candidates (``auto_gap``:
the best of ring, all_gather and ulysses minus auto), and checks every
variant's output and gradients (the worst of dq, dk, dv) against the
single-GPU results (max relative error). Writes
benchmarks/results/ring_attention_<count>x<gpu>.json.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS",
                      "--xla_gpu_enable_latency_hiding_scheduler=true")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ring  # noqa: E402
from common import (GRAPHS, jit_variant, random_qkv,  # noqa: E402
                    rel_err, ring_args, ring_kwargs, shape_args, time_fn,
                    write)


API = ["ring", "ring_natural", "all_gather", "ulysses", "auto",
       "auto_natural"]
CANDIDATES = ("ring", "all_gather", "ulysses")  # what auto chooses from


def report(rows, a):
  names = a.api + a.loops
  write("ring_attention", rows,
        ["seq", "kv_heads", "causal", "load_balance", "single_fwd_tflops"] +
        [f"{v}_{c}" for v in names for c in ("fwd_eff", "fwdbwd_eff")] +
        ["natural_cost", "auto_gap", "max_rel_err", "grad_max_rel_err"],
        extra=dict(dtype="bfloat16", batch=1, head_dim=a.head_dim,
                   **ring_kwargs(a),
                   efficiency="(single-GPU cuDNN time / cp) / ring time"),
        mode=a.mode)


def main():
  p = argparse.ArgumentParser()
  shape_args(p, [16384, 32768, 65536, 131072, 262144])
  p.add_argument("--causal-only", action="store_true")
  p.add_argument("--implementation", default="cudnn")
  p.add_argument("--causal-layout", default="dual_chunk",
                 help="load balance of the causal rows: dual_chunk or striped")
  forms = ["unrolled", "scan", "neighbour", "gather"]
  p.add_argument("--api", nargs="*", default=API, choices=API + [
      f"{n}_natural" for n in CANDIDATES[1:]],
                 help="public-API variants under jit (see above)")
  p.add_argument("--loops", nargs="*", default=[],
                 choices=forms + [f"{f}@{g}" for f in forms for g in GRAPHS],
                 help="ring variants, timed side by side; neighbour, "
                 "gather = unrolled with that kv_sends; '@nocc'/'@while' "
                 "compiles with those command buffers (common.GRAPHS)")
  ring_args(p)
  a = p.parse_args()
  cp = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("cp",))
  sharded = NamedSharding(mesh, P(None, "cp"))
  rows = []
  for s in a.seq:
    for kh in a.kv_heads:
      for causal in (True,) if a.causal_only else (True, False):
        q, k, v, do = random_qkv(s + kh, s, a.heads, kh, a.head_dim)
        flops = 4 * s * s * a.heads * a.head_dim * (0.5 if causal else 1.0)
        row = dict(seq=s, cp=cp, heads=a.heads, kv_heads=kh, causal=causal)

        single = lambda q, k, v: jax_ring.dot_product_attention(
            q, k, v, is_causal=causal, implementation=a.implementation)
        f1 = jax.jit(single)
        fb1 = jax.jit(lambda q, k, v, do: jax.vjp(single, q, k, v)[1](do))
        want, want_g = f1(q, k, v), fb1(q, k, v, do)
        t1, tb1 = time_fn(f1, q, k, v), time_fn(fb1, q, k, v, do)
        row["single_fwd_ms"], row["single_fwdbwd_ms"] = t1 * 1e3, tb1 * 1e3
        row["single_fwd_tflops"] = flops / t1 / 1e12

        lb = a.causal_layout if causal else None
        row["load_balance"] = lb
        re_ = lambda x: jax_ring.reorder_for_load_balance(
            x, cp, layout=lb) if lb else x
        un_ = lambda x: jax_ring.reorder_from_load_balance(
            x, cp, layout=lb) if lb else x
        laid = [jax.device_put(re_(x), sharded) for x in (q, k, v, do)]
        natural = [jax.device_put(x, sharded) for x in (q, k, v, do)]
        variants = {}
        for name in a.api:
          strategy, nat, _ = name.partition("_natural")
          cpc = jax_ring.ContextParallel(
              axis="cp", strategy=strategy, load_balance=lb,
              inputs="natural" if nat or not lb else "load_balanced",
              **(ring_kwargs(a) if strategy == "ring" else {}))
          fn = lambda q, k, v, cpc=cpc: jax_ring.dot_product_attention(
              q, k, v, is_causal=causal, implementation=a.implementation,
              context_parallel=cpc)
          variants[name] = (fn, "", natural if nat else laid,
                            (lambda x: x) if nat else un_)
        for loop in a.loops:
          form = loop.partition("@")[0]
          kw = dict(ring_kwargs(a), loop=form)
          if form in ("neighbour", "gather"):
            kw.update(loop="unrolled", kv_sends=form)
          ring = jax.shard_map(
              lambda q, k, v, kw=kw: jax_ring.ring_attention(
                  q, k, v, axis_name="cp", is_causal=causal, load_balance=lb,
                  implementation=a.implementation, **kw),
              mesh=mesh, in_specs=(P(None, "cp"),) * 3,
              out_specs=P(None, "cp"))
          variants[loop] = (ring, loop, laid, un_)
        errs = []
        for name, (fn, variant, xs, back) in variants.items():
          fr = jit_variant(fn, variant)
          fbr = jit_variant(lambda q, k, v, do, fn=fn: jax.vjp(
              fn, q, k, v)[1](do), variant)
          errs.append((rel_err(back(fr(*xs[:3])), want),
                       max(rel_err(back(g), w)
                           for g, w in zip(fbr(*xs), want_g))))
          tr, tbr = time_fn(fr, *xs[:3]), time_fn(fbr, *xs)
          row[f"{name}_fwd_ms"], row[f"{name}_fwdbwd_ms"] = tr * 1e3, tbr * 1e3
          row[f"{name}_fwd_eff"] = t1 / cp / tr
          row[f"{name}_fwdbwd_eff"] = tb1 / cp / tbr
        row["max_rel_err"] = max(e for e, _ in errs)
        row["grad_max_rel_err"] = max(g for _, g in errs)
        eff = lambda n: 100 * row.get(f"{n}_fwdbwd_eff", np.nan)
        row["natural_cost"] = eff("ring") - eff("ring_natural")
        row["auto_gap"] = max(eff(n) for n in CANDIDATES) - eff("auto")
        rows.append(row)
        print(row, flush=True)
        report(rows, a)  # after every row: a run cut short keeps its rows


if __name__ == "__main__":
  main()
