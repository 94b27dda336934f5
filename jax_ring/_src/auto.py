"""``strategy="auto"``: pick a context-parallel strategy from a cost model.

The model is deliberately simple and written down here, so a user can check
a decision by hand (``jax_ring.explain`` prints it). Per device, for one
training step of one attention layer (forward + backward):

* compute: ``F = 4 B S^2 N H / cp`` FLOPs per forward (halved when causal,
  scaled by the window's share of keys), times 3.5 for forward + backward,
  at a throughput that grows with the length ``L`` of each kernel call:
  ``peak * L / (L + L_HALF)`` (fit to cuDNN on an H200: 271 TFLOP/s at 4k
  tokens, 580 at 32k, causal). The ring and all-gather make calls of the
  local length T = S / cp; Ulysses one call of the whole S.
* communication, in bytes ``e`` per element of K/V (2 for 16-bit), G = the
  gathered KV bytes ``2 B S K H e``:

  ==========  ===========================================  =============
  strategy    bytes per device (forward + backward)         hidden?
  ==========  ===========================================  =============
  ring        (cp - 1)/cp * G * (1 + 3): KV, then KV and   yes, behind
              float32 dK/dV, one neighbour at a time        each step
  all_gather  (cp - 1)/cp * G * (2 + 2): two gathers and   no
              a float32 reduce-scatter
  ulysses     (cp - 1)/cp^2 * 2 B S H e * (4N + 6K'):      no
              q, kv, out there and back, twice
  ==========  ===========================================  =============

  over ``P2P_GBS`` for a neighbour permute and ``COLLECTIVE_GBS`` for the
  all-to-all and all-gather (all links at once). The ring also pays
  ``STEP_US`` of launch/branch/merge overhead per step and direction, and
  its per-step time is ``max(compute, comm)``; the others add their
  communication to their compute.

Ulysses is a candidate only when the local query heads divide by cp, and
all-gather only without the striped layout. The
smallest modelled time wins; ties keep the order ring, all_gather, ulysses.
A pair of axes means ``hybrid``. The constants come from the measurements in
``benchmarks/results`` (4x H200, NVLink); on other machines the model keeps
its shape but the crossover points move.
"""

from __future__ import annotations

import dataclasses

from jax_ring._src.config import ContextParallel

PEAK_TFLOPS = 640.0
L_HALF = 5000.0
P2P_GBS = 150.0
COLLECTIVE_GBS = 300.0
STEP_US = 40.0


@dataclasses.dataclass(frozen=True)
class Choice:
  """The strategy ``auto`` picks, the modelled milliseconds of each
  candidate, and a one-line reason."""

  strategy: str
  times_ms: dict
  reason: str


def _tflops(length):
  return PEAK_TFLOPS * length / (length + L_HALF)


def estimate(*, batch, seq, heads, kv_heads, head_dim, cp, is_causal=True,
             window=None, dtype_bytes=2, load_balance=None) -> Choice:
  """Model the candidates for one layer's forward + backward, per device."""
  share = 0.5 if is_causal else 1.0
  if window is not None:
    share = min(share, (sum(window) + 1) / seq)
  flops = 3.5 * 4 * batch * seq * seq * heads * head_dim * share / cp
  t_local = seq / cp
  gathered = 2 * batch * seq * kv_heads * head_dim * dtype_bytes
  frac = (cp - 1) / cp
  times = {}
  steps = max(cp - 1, 0)
  compute = flops / (_tflops(t_local) * 1e12)
  per_step_comm = gathered / cp * 4 / (P2P_GBS * 1e9)  # fwd + bwd bytes
  per_step = max(compute / cp, per_step_comm)
  times["ring"] = compute / cp + steps * per_step + 2 * cp * STEP_US * 1e-6
  if load_balance != "striped":  # all-gather computes contiguous ranges
    times["all_gather"] = compute + frac * gathered * 4 / (
        COLLECTIVE_GBS * 1e9)
  if heads % cp == 0:
    kv_rep = max(kv_heads, cp)
    a2a = (frac / cp * 2 * batch * seq * head_dim * dtype_bytes *
           (4 * heads + 6 * kv_rep))
    times["ulysses"] = (flops / (_tflops(seq) * 1e12) +
                        a2a / (COLLECTIVE_GBS * 1e9))
  times = {k: v * 1e3 for k, v in times.items()}
  best = min(times, key=times.get)
  order = sorted(times, key=times.get)
  runner = order[1] if len(order) > 1 else best
  reason = (f"{best} is modelled fastest: {times[best]:.3f} ms vs {runner} "
            f"{times[runner]:.3f} ms (cp={cp}, S={seq}, N={heads}, "
            f"K={kv_heads}, causal={is_causal})")
  return Choice(best, times, reason)


def resolve(cpc: ContextParallel, mesh, q_shape, local_heads, kv_heads=None,
            **mask) -> ContextParallel:
  """``cpc`` with ``auto`` replaced by the modelled choice."""
  if cpc.strategy != "auto":
    return cpc
  if isinstance(cpc.axis, tuple):
    return dataclasses.replace(cpc, strategy="hybrid")
  b, s, _, h = q_shape
  choice = estimate(batch=b, seq=s, heads=local_heads,
                    kv_heads=kv_heads or local_heads, head_dim=h,
                    cp=mesh.shape[cpc.axis],
                    load_balance=cpc.load_balance, **mask)
  return dataclasses.replace(cpc, strategy=choice.strategy)


def explain(query_shape, key_shape, *, cp_size, is_causal=False,
            local_window_size=None, dtype_bytes=2) -> Choice:
  """What ``ContextParallel(strategy="auto")`` picks for global shapes
  ``query (B, S, N, H)`` and ``key (B, S, K, H)`` on ``cp_size`` devices,
  and the modelled time of each candidate (see the module docstring)."""
  from jax_ring._src import validate
  window = validate.window(local_window_size)
  b, s, n, h = query_shape
  return estimate(batch=b, seq=s, heads=n, kv_heads=key_shape[2],
                  head_dim=h, cp=cp_size, is_causal=is_causal,
                  window=window, dtype_bytes=dtype_bytes)
