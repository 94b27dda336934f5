"""``strategy="auto"``: pick a context-parallel strategy from a cost model.

The model is deliberately simple, so a user can check a decision by hand
(``jax_ring.explain`` prints it). The forward and the backward are separate
programs (two partition rules) that share one token layout and one
residual (the local q, k, v and the global out and lse), so each pass picks
its own strategy. Per device, for one layer:

* compute: ``F = 2 B S^2 N (H + Hv) / cp`` FLOPs forward (Hv the value
  head dim; halved when causal, scaled by the window's share of keys),
  ``2.5 F`` backward, at a throughput that depends on the length ``L`` of
  each kernel call (``FWD_*``, ``BWD_*``: T = S / cp for the ring and
  all-gather, S for Ulysses' one call);
* communication: the bytes each strategy moves, over ``P2P_GBS`` for a
  neighbour permute and ``COLLECTIVE_GBS`` for all-gather and all-to-all;
* overlap: the ring's time is its own step's compute, then cp - 1 steps
  of ``max(compute, comm)`` each, plus ``STEP_US`` per step (launches,
  predicates, merges); the all-gather and Ulysses add their communication
  to their compute; on two devices ``COLLECTIVE_GBS_2`` and ``STEP_US_2``
  replace those constants;
* balance: the ring and the all-gather compute each device's own rows, so
  they wait for the most-loaded device: their compute is scaled by its
  work over the mean (:func:`_imbalance`: (2 cp - 1) / cp on contiguous
  shards under a causal mask; the ring on two devices balances them).
  Ulysses computes every row for some heads, so it is even in any layout.

Ulysses is a candidate only when the local query heads divide by cp,
all-gather only without the striped layout and without segment ids (its
packed block pairs a device's documents with the whole row's), and
Ulysses alone for T != S. The smallest modelled time wins each pass; ties
keep the order ring, all_gather, ulysses. A pair of axes means
``hybrid``. :func:`explain` also states every default the call applies,
so nothing the library chooses is hidden.

The formulas: docs/design.md, "The automatic strategy"; how the constants
were fit and where the picks miss: docs/decisions.md, "The automatic path".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_ring._src import padding
from jax_ring._src.core import config, validate
from jax_ring._src.core.config import ContextParallel
from jax_ring._src.strategies import documents, layout, natural
from jax_ring._src.strategies.ring import reach

# The model's constants: kernel throughput (TFLOP/s as a function of the
# call length L), link bandwidths (GB/s) and the ring's per-step overhead
# (microseconds), the last two also for two devices (one peer each); how
# they were fit: docs/decisions.md, "The automatic path", "auto on two".
FWD_TFLOPS, FWD_L_HALF, FWD_L_SLOW = 610.0, 750.0, 1.5e6
BWD_TFLOPS, BWD_L_HALF = 540.0, 1250.0
P2P_GBS, COLLECTIVE_GBS, STEP_US = 100.0, 400.0, 250.0
COLLECTIVE_GBS_2, STEP_US_2 = 150.0, 100.0
PASSES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``auto`` picks for each pass, the modelled milliseconds of every
  candidate (``{strategy: {"forward": ms, "backward": ms}}``), a one-line
  reason, and the defaults the call applies (``{option: (value, why)}``;
  empty from :func:`estimate`, filled by :func:`explain`)."""

  forward: str
  backward: str
  times_ms: dict
  reason: str
  defaults: dict = dataclasses.field(default_factory=dict)

  def __str__(self):
    lines = [f"strategy: forward {self.forward}, backward {self.backward}",
             f"  why: {self.reason}"]
    lines += [f"  {k} = {v!r}: {why}" for k, (v, why) in
              self.defaults.items()]
    return "\n".join(lines)


def defaults(*, batch, seq, kv_heads, head_dim, dtype_bytes, load_balance,
             loop, kv_sends, kv_chunk_heads, value_head_dim=None,
             inputs="natural") -> dict:
  """``{option: (value, why)}``: what a context-parallel call with these
  global shapes and ``ContextParallel`` fields (None = unset) runs with."""
  gathered = _kv_bytes(batch, seq, kv_heads, head_dim, value_head_dim,
                       dtype_bytes)
  fits = gathered <= config.GATHER_KV_MAX_BYTES
  size = (f"the gathered K/V, {gathered / 2**20:.0f} MiB, "
          f"{'fit' if fits else 'exceed'} GATHER_KV_MAX_BYTES "
          f"({config.GATHER_KV_MAX_BYTES / 2**30:g} GiB)")
  env = ContextParallel().with_environment().loop
  return {
      "load_balance": (load_balance, "as given (ContextParallel's default "
                       "'dual_chunk' balances causal work)"),
      "loop": (loop or env, "as given" if loop else
               f"from {config.RING_LOOP_ENV} (unset or 0: unrolled, "
               "another integer: scan)"),
      "kv_sends": (kv_sends or ("gather" if fits else "neighbour"),
                   "as given" if kv_sends else f"ring: {size}"),
      "backward_kv": ("gather" if fits else "ring",
                      f"the automatic path's ring backward gathers K/V, or "
                      f"sends them around again: {size}"),
      "kv_chunk_heads": (kv_chunk_heads or kv_heads, "as given" if
                         kv_chunk_heads else "all-gather: every kv head at "
                         "once"),
      "implementation": (None, "per shard: cuDNN where it serves the "
                         "shard's dtype and mask, else the pure-JAX kernel"),
      "inputs": (inputs, "natural order: q, k, v and the segment ids are "
                 f"permuted into {load_balance!r} and the output back, "
                 "inside the call (" + _MOVES[load_balance] + ")" if
                 inputs == "natural" and load_balance else
                 "in the layout already: nothing is permuted" if load_balance
                 else "contiguous shards: nothing to permute"),
  }


# How natural inputs move into each layout (cp_dispatch.permutations).
_MOVES = {"dual_chunk": "each chunk sent once, by two ppermutes an array; "
                        "gathered whole over a pair of axes",
          "striped": "one all-to-all an array"}


def _kv_bytes(batch, seq, kv_heads, head_dim, value_head_dim, dtype_bytes):
  """Bytes of K and V (value head dim None: the same as K's)."""
  return batch * seq * kv_heads * (head_dim + (value_head_dim or head_dim)
                                   ) * dtype_bytes


def _tflops(length, backward):
  if backward:
    return BWD_TFLOPS * length / (length + BWD_L_HALF)
  return FWD_TFLOPS * length / (length + FWD_L_HALF) / (1 + length /
                                                          FWD_L_SLOW)


def _imbalance(cp, seq, is_causal, window, load_balance) -> float:
  """The most-loaded device's work over the mean where each device
  computes its own rows: 1 unless the shards are contiguous under a causal
  mask; then query i sees min(i, w) + 1 keys (w the window's left reach,
  or every earlier key), summed over each shard in closed form: the
  measure of ``layout.work_balance`` for one document, which the model
  takes every row to be, with a window too and without a pass over S."""
  if load_balance is not None or not is_causal:
    return 1.0
  w = seq if window is None else window[0]

  def seen(n):  # keys seen by queries 0 .. n - 1
    m = min(n, w + 1)
    return n + m * (m - 1) / 2 + w * (n - m)

  t = seq // cp
  work = [seen((r + 1) * t) - seen(r * t) for r in range(cp)]
  return max(work) / (sum(work) / cp)


def _pass_ms(backward, *, batch, seq, heads, kv_heads, head_dim, cp, share,
             dtype_bytes, load_balance, cross, value_head_dim=None,
             packed=False, imbalance=1.0, ring_imbalance=1.0) -> dict:
  """Modelled milliseconds of each candidate for one pass (``cross``:
  T != S, which only Ulysses serves; ``packed``: segment ids, which
  all-gather does not serve well, see the module doc; ``imbalance``,
  ``ring_imbalance``: all-gather's and the ring's most-loaded device over
  the mean)."""
  work, sends = (2.5, 3) if backward else (1.0, 1)
  dims = head_dim + (value_head_dim or head_dim)  # q k^T, then p v
  flops = work * 2 * batch * seq * seq * heads * dims * share / cp
  gathered = _kv_bytes(batch, seq, kv_heads, head_dim, value_head_dim,
                       dtype_bytes)
  frac = (cp - 1) / cp
  coll_gbs, step_us = ((COLLECTIVE_GBS_2, STEP_US_2) if cp == 2 else
                       (COLLECTIVE_GBS, STEP_US))
  compute = imbalance * flops / (_tflops(seq / cp, backward) * 1e12)
  ring = compute * ring_imbalance / imbalance
  per_step = max(ring / cp, sends * gathered / cp / (P2P_GBS * 1e9))
  times = {} if cross else {"ring": (ring / cp + (cp - 1) * per_step +
                                    cp * step_us * 1e-6)}
  # All-gather computes contiguous ranges.
  if load_balance != "striped" and not cross and not packed:
    times["all_gather"] = compute + frac * sends * gathered / (
        coll_gbs * 1e9)
  if heads % cp == 0:
    # q and out (and dout, dq), then k and v (and dk, dv): H + Hv each.
    elements = (heads + max(kv_heads, cp)) * dims * (2 if backward else 1)
    a2a = frac / cp * batch * seq * dtype_bytes * elements
    times["ulysses"] = (flops / (_tflops(seq, backward) * 1e12) +
                        a2a / (coll_gbs * 1e9))
  return {k: v * 1e3 for k, v in times.items()}


def estimate(*, batch, seq, heads, kv_heads, head_dim, cp, is_causal=True,
             window=None, dtype_bytes=2, load_balance=None,
             kv_seq=None, value_head_dim=None, packed=False) -> Choice:
  """Model the candidates for one layer's forward and backward, per
  device; ``kv_seq`` (default ``seq``): the key length S;
  ``value_head_dim`` (default ``head_dim``): Hv; ``packed``: rows with
  segment ids."""
  share = 0.5 if is_causal else 1.0
  if window is not None:
    share = min(share, (sum(window) + 1) / seq)
  imbalance = _imbalance(cp, seq, is_causal, window, load_balance)
  ring_even = cp == 2 and window is None and not packed  # ring.pair
  kw = dict(batch=batch, seq=seq, heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, cp=cp, share=share, dtype_bytes=dtype_bytes,
            load_balance=load_balance, value_head_dim=value_head_dim,
            cross=kv_seq is not None and kv_seq != seq, packed=packed,
            imbalance=imbalance, ring_imbalance=1.0 if ring_even else imbalance)
  by_pass = {p: _pass_ms(p == "backward", **kw) for p in PASSES}
  picks, why = {}, []
  for p, times in by_pass.items():
    order = sorted(times, key=times.get)  # stable: ties keep the order
    picks[p] = order[0]
    runner = order[1] if len(order) > 1 else order[0]
    why.append(f"{p} {order[0]} {times[order[0]]:.3f} ms (next {runner} "
               f"{times[runner]:.3f})")
  times_ms = {s: {p: by_pass[p][s] for p in PASSES} for s in by_pass[PASSES[0]]}
  reason = "; ".join(why) + (f" (cp={cp}, S={seq}, N={heads}, K={kv_heads}, "
                             f"causal={is_causal}; times modelled from H200 "
                             "measurements)") + (
      "; segment ids: no all-gather (its packed blocks pair each device's "
      "documents with the whole row's)" if packed else "") + (
      f"; contiguous shards: {'' if ring_even else 'the ring and '}"
      f"all-gather wait for the last, "
      f"{imbalance:.2f}x the mean causal work" if imbalance > 1 else "")
  return Choice(picks["forward"], picks["backward"], times_ms, reason)


def resolve(cpc: ContextParallel, mesh, q_shape, local_heads, kv_heads=None,
            *, kv_seq=None, value_head_dim=None, backward: bool = False,
            **mask) -> ContextParallel:
  """``cpc`` with ``auto`` replaced by the modelled choice for the forward
  pass, or for the backward one; ``mask``: :func:`estimate`'s
  ``is_causal``, ``window`` and ``packed``."""
  if cpc.strategy != "auto":
    return cpc
  if cpc.is_hybrid:
    return dataclasses.replace(cpc, strategy="hybrid")
  b, s, _, h = q_shape
  choice = estimate(batch=b, seq=s, heads=local_heads,
                    kv_heads=kv_heads or local_heads, head_dim=h,
                    cp=mesh.shape[cpc.axis],
                    load_balance=cpc.load_balance, kv_seq=kv_seq,
                    value_head_dim=value_head_dim, **mask)
  return dataclasses.replace(
      cpc, strategy=choice.backward if backward else choice.forward)


def ring_first(asked: ContextParallel, picked: ContextParallel, *,
               packed: bool, window, same_length: bool) -> bool:
  """Whether the automatic path, having picked Ulysses (``picked``) for a
  pass of packed rows on contiguous shards, runs the ring's own block and its
  reach test first, and Ulysses only where documents cross a shard boundary
  by more than the ring's step-1 tails hold or reach past the previous shard
  (``ShardPlan.beyond``). The model sees no document lengths; the reach test
  sees them at run time. Only where the ring skips steps
  (``reach.skips_steps``), on one axis, in self-attention."""
  return (asked.strategy == "auto" and not asked.is_hybrid and
          picked.strategy == "ulysses" and packed and same_length and
          reach.skips_steps(asked.load_balance, asked.loop, asked.kv_sends,
                            window))


def _ring_first_noted(choice: Choice, cpc: ContextParallel, packed: bool,
                      window, same_length: bool) -> tuple[Choice, bool]:
  """``(choice, first)``: whether :func:`ring_first` holds for either
  pass's pick, and ``choice`` with that said in its reason."""
  first = any(ring_first(cpc.with_environment(),
                         dataclasses.replace(cpc, strategy=pick),
                         packed=packed, window=window,
                         same_length=same_length)
              for pick in (choice.forward, choice.backward))
  if first:
    most = (f"1/{min(reach.TAIL_DIVISORS)} of a shard"
            if reach.TAIL_DIVISORS else "none")
    choice = dataclasses.replace(choice, reason=choice.reason + (
        "; packed rows on contiguous shards: a pass that picks ulysses runs "
        "each device's own block and the ring's reach test first, and "
        "Ulysses only where documents cross a shard boundary by more than "
        f"the ring's step-1 tails hold ({most}) or reach past the previous "
        "shard"))
  return choice, first


def explain(query_shape, key_shape, *, cp_size, is_causal=False,
            local_window_size=None, dtype_bytes=2,
            context_parallel: ContextParallel | None = None,
            value_shape=None, segment_ids=None) -> Choice:
  """What ``ContextParallel(strategy="auto")`` picks, for the forward and
  for the backward pass, for global shapes ``query (B, T, N, H)``,
  ``key (B, S, K, H)`` and ``value (B, S, K, Hv)`` (default: key's) on
  ``cp_size`` devices (a ``(ulysses, ring)`` pair of
  sizes for a pair of axes), the modelled time of each candidate (see the
  module docstring), and every default the call applies, given
  ``context_parallel`` (default ``ContextParallel(strategy="auto")``).
  Arguments are checked as the call checks them: what it would refuse,
  this refuses with the same ``ValueError``. ``print(explain(...))`` shows
  it all. A strategy other than ``"auto"`` is what runs, for both passes;
  the modelled times are still given. With a pair of sizes and no
  ``context_parallel``: ``ContextParallel(axis=("ulysses", "ring"),
  strategy="auto")``. ``segment_ids`` (B, T), host ints of packed rows in
  natural order, each document one run: the attention work's balance over
  the devices in each layout the strategy takes (``balance``; the
  most-loaded device over the mean), whether cuDNN's packed path
  serves them (``cudnn_packed``: not where an id is two runs of tokens),
  their attention work over each row's as one document (``work``), and,
  where the ring may run, which of its steps these rows run
  (``ring_steps``)."""
  pair = isinstance(cp_size, (tuple, list))
  cpc = context_parallel or ContextParallel(
      axis=("ulysses", "ring") if pair else "cp", strategy="auto")
  value_shape = key_shape if value_shape is None else value_shape
  sizes = validate.explain_args(query_shape, key_shape, cp_size, dtype_bytes,
                                cpc, value_shape)
  b, t, n, h = query_shape
  s, hv = key_shape[1], value_shape[3]
  window = validate.window(local_window_size, t, s)
  run_t, run_s = validate.padded_lengths(cpc, sizes, t, s)
  defaults_ = defaults(
      batch=b, seq=s, kv_heads=key_shape[2], head_dim=h,
      dtype_bytes=dtype_bytes, load_balance=cpc.load_balance, loop=cpc.loop,
      kv_sends=cpc.kv_sends, kv_chunk_heads=cpc.kv_chunk_heads,
      value_head_dim=hv, inputs=cpc.inputs)
  if (run_t, run_s) != (t, s):
    defaults_["padding"] = padding.explained(
        (t, s), (run_t, run_s), validate.sequence_unit(cpc, sizes),
        cpc.load_balance == "dual_chunk")
  defaults_.update(natural.kept(cpc, sizes.get(cpc.ring_axis), is_causal,
                                window, segment_ids is not None))
  if segment_ids is not None:
    defaults_["balance"] = _balance(segment_ids, query_shape, cpc, sizes,
                                    run_t, is_causal)
    defaults_["cudnn_packed"] = _one_run_each(np.asarray(segment_ids))
    defaults_["work"] = _work(np.asarray(segment_ids), is_causal)
  if 0 in (b, run_t, run_s):
    return Choice("none", "none", {}, "no tokens: nothing runs", defaults_)
  if cpc.is_hybrid:
    return Choice("hybrid", "hybrid", {}, f"a pair of axes {cpc.axis!r} "
                  f"(sizes {tuple(sizes.values())}): Ulysses inside a ring",
                  defaults_)
  choice = estimate(batch=b, seq=run_t, heads=n, kv_heads=key_shape[2],
                    head_dim=h, cp=sizes[cpc.axis], is_causal=is_causal,
                    window=window, dtype_bytes=dtype_bytes,
                    load_balance=cpc.load_balance, kv_seq=run_s,
                    value_head_dim=hv, packed=segment_ids is not None)
  if cpc.strategy != "auto":  # what the user named runs
    choice = dataclasses.replace(
        choice, forward=cpc.strategy, backward=cpc.strategy,
        reason=f"strategy {cpc.strategy!r} as given; auto would model: "
        f"{choice.reason}")
  choice, first = _ring_first_noted(choice, cpc, segment_ids is not None,
                                    window, run_t == run_s)
  if segment_ids is not None and cpc.strategy in ("ring", "auto"):
    defaults_["ring_steps"] = _ring_steps(
        segment_ids, cpc, sizes[cpc.axis], run_t, is_causal,
        reach.skips_steps(cpc.load_balance, defaults_["loop"][0],
                          cpc.kv_sends, window), first)
  return dataclasses.replace(choice, defaults=defaults_)


# Below this share of a row's work as one document, explain's ``work``
# entry suggests sharding the batch rather than the sequence.
SHORT_WORK = 0.05


def _work(ids, is_causal) -> tuple[float, str]:
  """explain's ``work`` entry: the rows' attention work, over what each
  row costs as one document (``(B, T)`` ids checked by :func:`_balance`
  first; an id's tokens attend to each other wherever they lie), and
  what that means for splitting their sequence."""
  t = ids.shape[1]
  if ids.size == 0:
    return 0.0, "no tokens"
  pairs = lambda n: n * (n + 1) / 2 if is_causal else n * n
  share = float(np.mean([pairs(np.unique(row, return_counts=True)[1]).sum()
                         for row in ids]) / pairs(t))
  kind = "causal" if is_causal else "full"
  why = (f"the documents' {kind} attention work is {100 * share:.1f}% of "
         f"each row's as one document")
  if share < SHORT_WORK:
    why += ("; a packed block has a fixed cost (index work, the host's "
            "waits) that does not shrink with its work, so splitting these "
            "rows' sequence gains little: where a row fits one device, shard "
            "the batch over the devices instead (docs/performance.md, "
            "'Packed rows on four GPUs')")
  return round(share, 4), why


def _one_run_each(ids) -> tuple[bool, str]:
  """explain's ``cudnn_packed`` entry: whether every row's ids are runs of
  one id each, which cuDNN's packed path needs (``(B, T)`` ids checked
  by :func:`_balance` first)."""
  if ids.size == 0:
    return True, "no tokens"
  for r, row in enumerate(ids):
    twice = documents.id_in_two_runs(row)
    if twice is not None:
      return False, (
          f"row {r}: id {twice[0]} is {twice[1]} "
          "separate runs of tokens; cuDNN's packed path takes each id as "
          "one run, so blocks holding such rows run on the pure-JAX "
          "kernel (exact, slower)")
  return True, ("every id is one run of tokens: cuDNN's packed path serves "
                "these rows (16-bit inputs on a GPU)")


def _padded(ids, run_t, is_causal):
  """Rows ``ids (B, T)`` padded to ``run_t`` as the call pads them:
  causal, the last document extended; else a document of its own."""
  pad = [(0, 0), (0, run_t - ids.shape[1])]
  return np.pad(ids, pad, mode="edge") if is_causal else np.pad(
      ids, pad, constant_values=ids.max() + 1)


def _ring_steps(segment_ids, cpc, cp, run_t, is_causal, skips,
                beyond=False) -> tuple[dict, str]:
  """explain's ``ring_steps`` entry: which ring steps these rows run
  (``reach.steps_of_rows``), where the ring skips the steps no document
  reaches (``skips``: ``reach.skips_steps`` of the call's options);
  ``beyond``: Ulysses takes what the ring's tails leave
  (:func:`ring_first`)."""
  lead = "if the ring runs, " if cpc.strategy == "auto" and not beyond else ""
  if cp == 1:
    return {}, "one device: the ring has no step after the own block"
  if not skips:
    return {}, (f"{lead}every ring step runs: the ring skips steps only on "
                "contiguous shards (load_balance=None) with the unrolled "
                "loop, the default K/V sends and no window")
  ids = np.asarray(segment_ids)
  if ids.size == 0:
    return {}, "no tokens"
  got = reach.steps_of_rows(_padded(ids, run_t, is_causal), cp, is_causal,
                           beyond)
  spread = "" if got["numbered"] else (
      "; the rows' ids spread over more values than a row has tokens, "
      "so the reach test can count different documents as one (more "
      "steps, never fewer): number each row's documents 0, 1, 2, ... "
      "to let it skip")
  if got["beyond"]:
    return got, (
        "each device's own block and the reach test, then Ulysses for the "
        f"whole pass: documents reach {got['last']} shard(s) back and cross "
        f"boundaries by up to {got['rows']} of each shard's {got['shard']} "
        "rows, more than the ring's step 1 takes" + spread)
  if got["last"] == 0:
    why = "no step after each device's own block: no document crosses a shard"
  elif got["size"] is not None:
    why = (f"one step, on the last {got['size']} of each shard's "
           f"{got['shard']} rows: documents cross shard boundaries by at "
           f"most {got['rows']} rows")
  else:
    why = (f"steps 1 to {got['last']}, each sending a whole shard's K/V: "
           f"a document reaches {got['last']} shard(s) back"
           + ("" if is_causal else " (without a causal mask a document "
              "crossing a boundary reaches the step back round the ring)"))
  return got, lead + "the ring runs " + why + spread


def _balance(segment_ids, query_shape, cpc, sizes, run_t, is_causal):
  """explain's ``balance`` entry: ``({layout: most-loaded device's
  attention work over the mean}, why)`` for rows ``segment_ids``, padded
  as the call pads them (causal: the last document extended; else a
  document of its own), naming the evenest layout where the call's own
  leaves a device more than a tenth above the mean."""
  ids = np.asarray(segment_ids)
  if ids.shape != tuple(query_shape[:2]) or ids.dtype.kind not in "iu":
    raise ValueError(f"segment_ids must be (B, T) = {tuple(query_shape[:2])}"
                     f" host ints; got {ids.dtype} of shape {ids.shape}")
  if ids.size == 0:
    return {}, "no tokens"
  ids = _padded(ids, run_t, is_causal)
  ring = validate.ring_size(cpc, sizes)
  layouts = [x for x in ("dual_chunk", "striped", None) if not (  # those
      x == "striped" and cpc.strategy == "all_gather") and ids.shape[1] % (
      2 * ring if x == "dual_chunk" else ring) == 0]  # the rows divide into
  found = {name or "contiguous": round(layout.work_balance(
      ids, ring, name, is_causal), 3) for name in layouts}
  kind = "causal" if is_causal else "full"
  why = (f"the most-loaded of {ring} ring devices' {kind} work over the "
         "mean for these rows (1.0 is even; each step waits for the most "
         "loaded; Ulysses splits heads and is even in any layout)")
  mine, best = cpc.load_balance or "contiguous", min(found, key=found.get)
  if found[mine] > 1.1 and found[best] < found[mine]:
    why += (f"; load_balance={None if best == 'contiguous' else best!r} "
            f"evens these rows best")
  try:  # whole documents reordered (each id one run; rows unpadded)
    if run_t == np.asarray(segment_ids).shape[1]:
      ordered = np.take_along_axis(
          ids, documents.balance_documents(ids, ring), 1)
      whole = all(not documents.crosses_a_cut(documents.runs(r)[1],
                                              r.size // ring)
                  for r in ordered)
      why += (f"; in jax_ring.balance_documents' order, contiguous shards "
              f"give {layout.work_balance(ordered, ring, None, is_causal):.3f}"
              + (", and no document crosses a shard" if whole else ""))
  except ValueError:
    pass
  return found, why
