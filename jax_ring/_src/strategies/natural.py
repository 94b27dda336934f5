"""Natural-order inputs that keep their order: where a call of
``inputs="natural"`` arrays runs on contiguous shards as they are, instead
of permuting them into its ``load_balance`` layout and the output back.

* No causal mask (any window, ids or lengths): a query's work does not
  grow with its position, so contiguous shards already balance it (the
  packed ring's reach test even prefers them); the layout would only cost
  its permutation.
* The ring over two devices, causal, no window, ids or lengths: its
  two-device schedule balances contiguous shards (``ring.pair``).

Elsewhere (a causal mask on more devices, or with a window, ids or
lengths) the layout's balance is worth its permutation.
"""

from __future__ import annotations

from jax_ring._src.core.config import ContextParallel
from jax_ring._src.strategies.ring import pair

_ORDER = "contiguous shards: nothing to permute"
_FULL = dict(
    load_balance=(None, "no causal mask: contiguous shards balance the "
                  "work, so natural-order inputs are not permuted into a "
                  "layout"),
    inputs=("natural", _ORDER))
_TWO = dict(
    load_balance=(None, "contiguous shards: on a ring of two devices the "
                  "two-device schedule balances causal work (device 0 "
                  "computes device 1's late query rows against its own "
                  "keys), so natural-order inputs are not permuted into "
                  "'dual_chunk'"),
    kv_sends=("pair", "the ring's two-device schedule: device 0's K/V go "
              "to device 1 once a pass, beside compute"),
    inputs=("natural", _ORDER))
_TWO["backward_kv"] = _TWO["kv_sends"]


def kept(cpc: ContextParallel, cp_size: int, is_causal: bool, window,
         masked: bool) -> dict:
  """``{}`` where ``cpc``'s natural-order inputs are permuted into its
  layout; else what ``explain`` reports of the call on contiguous shards
  (``{option: (value, why)}``). ``cp_size``: the ring axis' size;
  ``masked``: segment ids or padding lengths."""
  if not cpc.permutes:
    return {}
  if not is_causal:
    return _FULL
  if pair.serves(cpc, cp_size, window, masked):
    return _TWO
  return {}
