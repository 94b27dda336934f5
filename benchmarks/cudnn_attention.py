"""jax_ring's cuDNN backend against jax.nn's cuDNN path, same process; and
the cost of attention sinks and of a value head dim unlike the keys'.

  python benchmarks/cudnn_attention.py [--seq 4096 8192 ...] [--tables
      default sinks mla packed empty]

Tables (each its own mode in the results file; ``--mode X`` names the
default table X and the others X_sinks, X_mla):

``default``  B=1, D=128 (``--head-dim``), bf16; N=32 query heads
             (``--heads``) with 32 (MHA) or 8 (GQA) kv heads
             (``--kv-heads``); causal and non-causal; jax_ring against
             jax.nn, both ``implementation="cudnn"``.
``sinks``    jax_ring with attention sinks (one learned logit per head)
             against without, causal, at ``--sinks-seq``, for N=64 K=8
             D=64 (gpt-oss) and N=32 K=8 D=128. The ratio is the sinks
             time over the plain one (> 1: sinks slower).
``mla``      head dims (H, Hv) = (192, 128) (DeepSeek-V3's multi-head latent
             attention) against (128, 128), causal, N = K = ``--mla-heads``,
             at ``--mla-seq``; jax_ring, and jax.nn where it accepts the
             shape (a cell says "not accepted" where it raises, and the
             row keeps its message).

``packed``   a row of ``--packed-seq`` tokens packed with
             ``--packed-docs`` equal documents (segment ids, causal), and
             one row of lognormal lengths (median 300 tokens, capped at
             8,192), N=16 K=8 D=128 (Qwen3-1.7B's heads): jax_ring's
             packed call against the same equal documents as a dense
             batch of equal rows (one call), and the row as one causal
             document. FLOPs are the documents' own (a query sees its
             document's earlier keys). ``--plot RESULTS_JSON`` draws the
             table as a PNG beside the file.

``empty``    what empty virtual batches cost one packed call: in a row of
             ``--packed-seq`` tokens (N=16 K=8 D=128, causal in each), n
             documents of L tokens called as M >= n virtual batches of L,
             the M - n empty ones at the row's end; the forward and the
             backward handlers timed apart (GPU only: it calls them
             directly). If M >> n costs little, each length class could
             run one static call sized for its most documents.

FLOPs: 2*S^2*N*(H + Hv) forward and 2*S^2*N*(4H + 3Hv) forward+backward
(the backward recomputes the logits: 2.5x the forward when H = Hv), halved
for causal. ``--implementation xla`` runs every table on the pure-JAX
kernels (a CPU dry run). Writes
benchmarks/results/cudnn_attention_<count>x<gpu>.json.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_ring
from common import (PACKED_PATHS, causal_keys, document_ids,
                    lognormal_lengths, random_qkv, shape_args, time_fn,
                    tile_sizes_arg, use_packed_path, write)

TABLES = ("default", "sinks", "mla", "packed", "empty")
SINK_SHAPES = ((64, 8, 64), (32, 8, 128))  # (N, K, D): gpt-oss; Llama-like
MLA_DIMS = ((192, 128), (128, 128))


def step_fns(impl_fn):
  """(jitted forward, jitted forward+backward) of ``impl_fn(*args)``; the
  backward takes the grads of every argument."""
  fwd = jax.jit(impl_fn)

  @jax.jit
  def fwd_bwd(*args):
    *args, do = args
    out, vjp = jax.vjp(impl_fn, *args)
    return vjp(do)

  return fwd, fwd_bwd


def flops(s, n, h, hv, causal):
  """(forward, forward+backward) FLOPs of one attention call."""
  half = 0.5 if causal else 1.0
  return (2 * s * s * n * (h + hv) * half,
          2 * s * s * n * (4 * h + 3 * hv) * half)


def timed(row, name, fn, args, do, fl):
  """Time ``fn(*args)`` forward and forward+backward into ``row`` as
  ``<name>_{fwd,fwdbwd}_{ms,tflops}``. A call that raises at trace time
  (a library that does not accept the shape) is recorded as "not accepted"
  with its message in ``<name>_error``."""
  try:
    jax.eval_shape(fn, *args)
  except (ValueError, TypeError, NotImplementedError) as e:
    row[f"{name}_fwd_ms"] = row[f"{name}_fwdbwd_ms"] = "not accepted"
    row[f"{name}_error"] = f"{type(e).__name__}: {e}"
    return
  fwd, fwd_bwd = step_fns(fn)
  for part, t, f in (("fwd", time_fn(fwd, *args), fl[0]),
                     ("fwdbwd", time_fn(fwd_bwd, *args, do), fl[1])):
    row[f"{name}_{part}_ms"] = t * 1e3
    row[f"{name}_{part}_tflops"] = f / t / 1e12


def ratio(row, over, under, key):
  """``row[over] / row[under]`` for both passes, where both were timed."""
  for part in ("fwd", "fwdbwd"):
    a, b = row.get(f"{over}_{part}_ms"), row.get(f"{under}_{part}_ms")
    if isinstance(a, float) and isinstance(b, float):
      row[f"{part}_{key}"] = a / b


def qkv(seed, s, n, kh, h, hv=None):
  """Random bf16 ``q, k (head dim h), v, dout (head dim hv, default h)``."""
  q, k, v, do = random_qkv(seed, s, n, kh, h)
  if hv is not None and hv != h:
    _, _, v, do = random_qkv(seed + 1, s, n, kh, hv)
  return q, k, v, do


def default_table(a):
  rows = []
  for s in a.seq:
    for kh in a.kv_heads:
      for causal in (True, False):
        q, k, v, do = qkv(s + kh, s, a.heads, kh, a.head_dim)
        fl = flops(s, a.heads, a.head_dim, a.head_dim, causal)
        row = dict(seq=s, heads=a.heads, kv_heads=kh, causal=causal)
        for name, mod in (("jax_ring", jax_ring), ("jax_nn", jax.nn)):
          fn = lambda q, k, v, mod=mod: mod.dot_product_attention(
              q, k, v, is_causal=causal, implementation=a.implementation)
          timed(row, name, fn, (q, k, v), do, fl)
        ratio(row, "jax_nn", "jax_ring", "ratio")
        rows.append(row)
        print(row, flush=True)
  return rows, ["seq", "kv_heads", "causal", "jax_ring_fwd_tflops",
                "jax_nn_fwd_tflops", "fwd_ratio", "jax_ring_fwdbwd_tflops",
                "jax_nn_fwdbwd_tflops", "fwdbwd_ratio"], dict(
      head_dim=a.head_dim,
      ratio="jax.nn time / jax_ring time (>1: jax_ring faster)")


def sinks_table(a):
  rows = []
  for n, kh, d in SINK_SHAPES:
    for s in a.sinks_seq:
      q, k, v, do = qkv(s + n, s, n, kh, d)
      sinks = jnp.linspace(-1.0, 2.0, n, dtype=jnp.float32)
      fl = flops(s, n, d, d, True)
      row = dict(seq=s, heads=n, kv_heads=kh, head_dim=d, causal=True)
      attend = lambda q, k, v, sk=None: jax_ring.dot_product_attention(
          q, k, v, sinks=sk, is_causal=True, implementation=a.implementation)
      timed(row, "plain", attend, (q, k, v), do, fl)
      timed(row, "sinks", attend, (q, k, v, sinks), do, fl)
      ratio(row, "sinks", "plain", "ratio")
      rows.append(row)
      print(row, flush=True)
  return rows, ["seq", "heads", "kv_heads", "head_dim", "plain_fwd_ms",
                "sinks_fwd_ms", "fwd_ratio", "plain_fwdbwd_ms",
                "sinks_fwdbwd_ms", "fwdbwd_ratio"], dict(
      ratio="sinks time / plain time (>1: sinks slower); target: "
            "fwd+bwd <= 1.03",
      sinks="(N,) float32, one logit per head; fwd+bwd includes d sinks")


def mla_table(a):
  rows = []
  n = a.mla_heads
  for s in a.mla_seq:
    row = dict(seq=s, heads=n, kv_heads=n, causal=True)
    for h, hv in MLA_DIMS:
      q, k, v, do = qkv(s + h, s, n, n, h, hv)
      fl = flops(s, n, h, hv, True)
      for lib, mod in (("jax_ring", jax_ring), ("jax_nn", jax.nn)):
        fn = lambda q, k, v, mod=mod: mod.dot_product_attention(
            q, k, v, is_causal=True, implementation=a.implementation)
        timed(row, f"{lib}_{h}_{hv}", fn, (q, k, v), do, fl)
    (h, hv), (h0, hv0) = MLA_DIMS
    ratio(row, f"jax_ring_{h}_{hv}", f"jax_ring_{h0}_{hv0}", "ratio")
    ratio(row, f"jax_nn_{h}_{hv}", f"jax_ring_{h}_{hv}", "nn_ratio")
    rows.append(row)
    print(row, flush=True)
  names = [f"{lib}_{h}_{hv}" for h, hv in MLA_DIMS
           for lib in ("jax_ring", "jax_nn")]
  columns = ["seq"] + [f"{x}_fwd_ms" for x in names] + ["fwd_ratio"] + [
      f"{x}_fwdbwd_ms" for x in names] + ["fwdbwd_ratio"]
  return rows, columns, dict(
      ratio=f"jax_ring time at {MLA_DIMS[0]} / at {MLA_DIMS[1]} (H, Hv)",
      nn_ratio="jax.nn time / jax_ring time at the same head dims, where "
               "jax.nn accepts them")


def packed_rows(seq, docs, seed=0):
  """The packed table's rows: ``(mix, (1, seq) int32 ids, lengths)`` for
  each count in ``docs`` of equal documents (``equal``), then one row of
  lognormal lengths (median 300 tokens, sigma 1, capped at 8,192; the
  last document cut to fit)."""
  import numpy as np
  for n in docs:
    if seq % n == 0:
      lengths = np.full(n, seq // n)
      yield "equal", document_ids(lengths), lengths
  lengths = np.array(lognormal_lengths(np.random.default_rng(seed), seq))
  yield "lognormal", document_ids(lengths), lengths


def packed_table(a):
  from jax_ring._src.backends.cudnn import packed, passes, tiles
  rows, s, n, kh, d = [], a.packed_seq, 16, 8, 128
  q, k, v, do = qkv(s, s, n, kh, d)
  impl = None if a.implementation == "cudnn" else "xla"
  dense = {}  # the yardstick: the row as one causal document
  timed(dense, "one_document", lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, implementation=impl), (q, k, v), do,
        flops(s, n, d, d, True))
  for mix, ids, lengths in packed_rows(s, a.packed_docs):
    work = causal_keys(lengths) / (s * s / 2)
    fl = tuple(f * work for f in flops(s, n, d, d, True))
    row = dict(seq=s, heads=n, kv_heads=kh, mix=mix, documents=len(lengths),
               longest=int(lengths.max()), work=work,
               cudnn_calls=int(packed.calls(packed.documents(
                   jnp.asarray(ids), jnp.asarray(ids), same=True), s, s)),
               tile=next((p for p, most in zip(tiles.SIZES, tiles.limits(
                   q, k, v)) if most >= lengths.max()), 0))
    if impl or not (passes.ENABLED and tiles.serves(q, k, jax_ring.BlockMask(
        q_segment_ids=jnp.asarray(ids)), jax_ring.AttentionConfig(
            scale=d**-0.5, is_causal=True), v)):
      row["tile"] = 0
    if row["tile"]:
      row["cudnn_calls"] = 0
    seg = jnp.asarray(ids)
    timed(row, "packed", lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=seg, implementation=impl),
          (q, k, v), do, fl)
    if mix == "equal":  # the same documents as a batch of equal rows
      batch = lambda x: x.reshape((len(lengths), -1) + x.shape[2:])
      timed(row, "batch", lambda q, k, v: jax_ring.dot_product_attention(
          q, k, v, is_causal=True, implementation=impl),
            tuple(map(batch, (q, k, v))), batch(do), fl)
      ratio(row, "packed", "batch", "packed_over_batch")
    row.update(dense)
    rows.append(row)
    print(row, flush=True)
  return rows, ["mix", "documents", "longest", "tile", "cudnn_calls",
                "packed_fwdbwd_ms", "batch_fwdbwd_ms",
                "fwdbwd_packed_over_batch", "packed_fwdbwd_tflops",
                "one_document_fwdbwd_ms"], dict(
      packed_over_batch="packed row time / the same documents as a dense "
      "batch of equal rows, one call (target <= 1.25)",
      work="the documents' causal work over the whole row's", mixes=
      "equal: documents of seq / documents tokens; lognormal: median 300, "
      "sigma 1, cap 8192, seed 0", tile="the tile size of the dense band "
      "tiles the pass takes (every document fits it), 0: its handler")


def empty_table(a):
  import numpy as np
  from jax_ring._src.backends.cudnn import ffi, packed
  from jax_ring._src.backends.cudnn.band import Band
  from jax_ring._src.core.config import AttentionConfig
  s, n, kh, d = a.packed_seq, 16, 8, 128
  q, k, v, do = qkv(0, s, n, kh, d)
  cfg = AttentionConfig(scale=d ** -0.5, is_causal=True)
  rows = []
  for length, docs in ((512, 64), (128, 256), (32, 1024), (4096, 8)):
    for m in (docs, 2 * docs, 4 * docs, 16 * docs):
      start = np.full((1, m), s, np.int32)
      size = np.zeros((1, m), np.int32)
      start[0, :docs], size[0, :docs] = np.arange(docs) * length, length
      start, size = jnp.asarray(start), jnp.asarray(size)
      r = packed.call_rows(packed.Call(start, size, start, size, None, None),
                           q, k, v)
      at = ffi.attrs(cfg, Band(right_bound=0), False, m, length)
      fwd = jax.jit(lambda q, k, v, r, m=m, at=at: ffi.sdpa(
          "jax_ring_sdpa_fwd", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                jax.ShapeDtypeStruct((m, n, length),
                                                     jnp.float32)),
          q, k, v, *r, **at))
      bwd = jax.jit(lambda q, k, v, o, st, do, r, at=at: ffi.sdpa(
          "jax_ring_sdpa_bwd", tuple(jax.ShapeDtypeStruct(x.shape, x.dtype)
                                     for x in (q, k, v)),
          q, k, v, o, st, do, *r, **at))
      out, stats = fwd(q, k, v, r)
      rows.append(dict(seq=s, length=length, documents=docs, batches=m,
                       fwd_ms=time_fn(fwd, q, k, v, r) * 1e3,
                       bwd_ms=time_fn(bwd, q, k, v, out, stats, do, r) * 1e3))
      print(rows[-1], flush=True)
  return rows, ["length", "documents", "batches", "fwd_ms", "bwd_ms"], dict(
      heads=n, kv_heads=kh, head_dim=d, empty="batches - documents empty "
      "virtual batches of the same length, at the row's end")


def plot_packed(path, mode="packed"):
  """The packed ``mode`` of a results file as a PNG beside it
  (``<stem>_packed.png``, the mode in its title): forward+backward ms
  against documents a row, packed and as a dense batch."""
  import json
  import pathlib
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  path = pathlib.Path(path)
  runs = json.loads(path.read_text())["runs"]
  mode = mode if mode in runs else f"{mode}_packed"
  run = runs[mode]
  rows = [r for r in run["rows"] if r.get("mix") == "equal"]
  if not rows:
    raise SystemExit(f"{path} ({mode}) holds no rows of equal documents "
                     "of this form of the table (`mix`): rerun it")
  docs = [r["documents"] for r in rows]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(docs, [r["packed_fwdbwd_ms"] for r in rows], "o-",
          label="packed row")
  ax.plot(docs, [r["batch_fwdbwd_ms"] for r in rows], "s--",
          label="same documents as a dense batch")
  for r in run["rows"]:
    if r.get("mix") == "lognormal":
      ax.plot([r["documents"]], [r["packed_fwdbwd_ms"]], "^",
              label="lognormal mix, packed")
  ax.set(xscale="log", yscale="log", xlabel="documents in a row of "
         f"{rows[0]['seq']} tokens", ylabel="forward+backward ms",
         title=f"{run['device']}, N=16 K=8 D=128, bf16, causal ({mode})")
  ax.legend()
  out = path.with_name(f"{path.stem}_packed.png")
  fig.savefig(out, dpi=120, bbox_inches="tight")
  print(f"wrote {out}")


def main():
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  shape_args(p, [4096, 8192, 16384, 32768, 65536])
  p.add_argument("--tables", nargs="+", choices=TABLES, default=["default"])
  p.add_argument("--sinks-seq", type=int, nargs="+",
                 default=[8192, 16384, 32768, 65536])
  p.add_argument("--mla-seq", type=int, nargs="+",
                 default=[4096, 8192, 16384, 32768])
  p.add_argument("--mla-heads", type=int, default=32)
  p.add_argument("--packed-seq", type=int, default=32768)
  p.add_argument("--packed-docs", type=int, nargs="+",
                 default=[1, 8, 64, 256, 1024, 4096])
  p.add_argument("--packed-paths", nargs="+", default=["pass"],
                 choices=PACKED_PATHS, help="the packed table's form of a "
                 "block pass (common.packed_path_args); with several, each "
                 "its own mode (<mode>_<path>), one after the other")
  tile_sizes_arg(p)
  p.add_argument("--plot", metavar="RESULTS_JSON", default=None,
                 help="only draw that file's packed table as a PNG beside "
                 "it (needs matplotlib)")
  p.add_argument("--implementation", default="cudnn", choices=("cudnn",
                                                               "xla"),
                 help="what both libraries are asked for (xla: a CPU dry "
                 "run)")
  p.add_argument("--cudnn-graphs", choices=("on", "off"), default="on",
                 help="replay a cuDNN call run before on the same pointers "
                 "as one CUDA graph (on, the library's default) or always "
                 "run cuDNN's execute")
  a = p.parse_args()
  if a.plot:
    return plot_packed(a.plot, "packed" if a.mode == "default" else a.mode)
  builders = dict(default=default_table, sinks=sinks_table, mla=mla_table,
                  packed=packed_table, empty=empty_table)
  from jax_ring._src.backends import cudnn
  graphs = {}
  if a.implementation == "cudnn" and cudnn.LOAD_ERROR is None:
    cudnn.use_graphs(a.cudnn_graphs == "on")
    graphs = dict(cudnn_graphs=a.cudnn_graphs)
  runs = [(t, None) for t in a.tables if t != "packed"] + (
      [("packed", p) for p in a.packed_paths] if "packed" in a.tables else [])
  for table, path in runs:
    packed = {} if path is None else use_packed_path(
        path, a.tile_sizes, a.pallas_stages)
    rows, columns, extra = builders[table](a)
    mode = a.mode if table == "default" else (
        table if a.mode == "default" else f"{a.mode}_{table}")
    if path is not None and len(a.packed_paths) > 1:
      mode = f"{mode}_{path}"
    write("cudnn_attention", rows, columns,
          extra=dict(dtype="bfloat16", batch=1,
                     implementation=a.implementation, **packed, **graphs,
                     **({"graph_counts": cudnn.graph_counts()} if graphs
                        else {}),
                     flops="2*S^2*N*(H+Hv) fwd, 2*S^2*N*(4H+3Hv) fwd+bwd "
                           "(x0.5 causal)", **extra),
          mode=mode)


if __name__ == "__main__":
  main()
