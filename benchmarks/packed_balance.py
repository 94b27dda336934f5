"""How evenly each load-balance layout spreads the causal attention work of
packed rows over the context devices: the most-loaded device's work over
the mean (1.0 = even; the step waits for the most loaded).

  python benchmarks/packed_balance.py            # S 32k and 128k, cp 2 4 8

A row is a sequence of documents, each attending causally to itself. A
query at offset p of its document sees p + 1 keys, which is its work; a
device's work is the sum over its tokens in the layout. The measure is
the library's own (``work_balance``, on jax_ring's layout
permutations; None: contiguous shards): counts of visible (query, key)
pairs, not timings. Mixes per row: ``equal-n``, n documents of S / n tokens; and
``lognormal``, lengths drawn from a lognormal of median 300 tokens and
sigma 1, capped at 8,192, filling the row (the last cut to fit), over
``--rows`` random rows (mean, 90th percentile and worst row reported).
``documents``: contiguous shards after ``jax_ring.balance_documents``
reorders each row's documents for the cp devices; ``documents_whole``,
the share of rows that order leaves with no document across a shard (the
contiguous ring then runs no step after each device's own block), and
``documents_ms``, its mean time a row on this CPU (one core, NumPy).

  python benchmarks/packed_balance.py --seq 65536 1048576 --cp 4 8 \
      --docs 64 --rows 20 --mode long_rows
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

import jax_ring
from jax_ring._src.strategies import documents
from jax_ring._src.strategies.layout import work_balance

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import document_ids, lognormal_lengths, write  # noqa: E402

LAYOUTS = ("dual_chunk", "striped", None, "documents")


def imbalance(lengths, cp, layout) -> tuple[float, bool, float]:
  """One row of documents of these ``lengths``: jax_ring's own measure
  (``"documents"``: contiguous, in ``balance_documents``' order), whether
  no document crosses a shard, and the seconds the order took (0 for the
  layouts)."""
  ids, seconds = document_ids(lengths), 0.0
  if layout == "documents":
    start = time.perf_counter()
    order = jax_ring.balance_documents(ids, cp)
    seconds = time.perf_counter() - start
    ids, layout = np.take_along_axis(ids, order, 1), None
  whole = not documents.crosses_a_cut(documents.runs(ids[0])[1],
                                      ids.shape[1] // cp)
  return work_balance(ids, cp, layout), whole, seconds


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
  p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
  p.add_argument("--docs", type=int, nargs="+",
                 default=[1, 8, 64, 256, 1024, 4096])
  p.add_argument("--rows", type=int, default=100)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--mode", default="default")
  a = p.parse_args()
  rows = []
  for seq in a.seq:
    for cp in a.cp:
      rng = np.random.default_rng(a.seed)
      mixes = [(f"equal-{n}", [[seq // n] * n]) for n in a.docs
               if seq % n == 0]
      mixes.append(("lognormal", [lognormal_lengths(rng, seq)
                                  for _ in range(a.rows)]))
      for mix, batch in mixes:
        row = dict(seq=seq, cp=cp, mix=mix, rows=len(batch))
        for layout in LAYOUTS:
          got = [imbalance(x, cp, layout) for x in batch]
          if layout == "documents":
            ordered = got
          r = np.array([g[0] for g in got])
          name = layout or "contiguous"
          row[name] = float(r.mean())
          if len(batch) > 1:
            row[f"{name}_p90"] = float(np.quantile(r, 0.9))
            row[f"{name}_max"] = float(r.max())
        row["documents_whole"] = float(np.mean([g[1] for g in ordered]))
        row["documents_ms"] = 1e3 * float(np.mean([g[2] for g in ordered]))
        rows.append(row)
  write("packed_balance", rows,
        ["seq", "cp", "mix", "dual_chunk", "dual_chunk_max", "striped",
         "striped_max", "contiguous", "documents", "documents_max",
         "documents_whole", "documents_ms"], mode=a.mode,
        extra=dict(work="visible (query, key) pairs of causal attention "
                   "within each document", measure="most-loaded device "
                   "over the mean; lognormal: mean over rows, _p90 and "
                   "_max over rows", lognormal="median 300, sigma 1, "
                   "cap 8192, seed " + str(a.seed)))


if __name__ == "__main__":
  main()
