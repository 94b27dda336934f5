"""The ring over the steps packed rows reach (contiguous shards, default
K/V sends): :func:`reached_loop`, which :mod:`schedule`'s forward and
backward run where :mod:`reach` can say which steps documents need.

Shapes, per device: ``k (B, T, K, H)``, ``v (B, T, K, Hv)``, the kv ids
``(B, T)``; the own K/V are held as the pair ``((k, v), ids)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ring._src.core.config import ShardPlan
from jax_ring._src.strategies import base, kv as kv_lib
from jax_ring._src.strategies.ring import reach

# Whether the own block's backend operands (``kernel.prepare``: a packed
# cuDNN pass's tables and branch index) are computed before the reach
# test's branch, where given (else inside the block's call, in the branch).
PREPARE_OWN = True


def shift(x, plan: ShardPlan, by: int):
  """Every array of ``x`` from each device j to device j + by (mod cp)."""
  perm = [(j, (j + by) % plan.cp_size) for j in range(plan.cp_size)]
  return jax.tree.map(lambda a: lax.ppermute(a, plan.axis_name, perm), x)


def as_f32(x):
  return jax.tree.map(lambda a: a.astype(jnp.float32), x)


def merge_rows(first, part):
  """``first = (out, lse)`` with ``part``, the ``(out, lse)`` of its first
  rows against other keys, merged in (float32, kept in out's dtype)."""
  out, lse = first
  n = part[1].shape[1]
  o, l = base.merge(out[:, :n].astype(jnp.float32), lse[:, :n], *part)
  # Slices, not ``.at[:, :n]``: with n the whole shard that is a scatter
  # of no indices, which jax 0.11's shard_map partitioner crashes on.
  put = lambda a, b: lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), 0,
                                                     1)
  return put(out, o), put(lse, l)


def reached_loop(plan, own, later, tail, k, v, tm, causal, beyond=None,
                 alone=None, prepare=None):
  """``own(kv, ready)`` on the own K/V (held as the pair ``(k, v)``, not
  stacked), then what ``(need (cp,), rows) = reach.needed_steps(tm, ...)``
  asks for (the same on every device; on contiguous shards documents
  reach a prefix of the steps, and a step no document reaches adds
  nothing), picked by a ``lax.cond`` and, past it, one ``lax.switch``:

  * no step after the own (the cond's first branch, the own block alone):
    documents that all stay inside their shards cost one block and one
    branch test;
  * step 1 only, the crossing rows within a size of ``reach.tail_sizes``:
    ``tail(size, kv, first)`` with the last ``size`` rows of device
    ``r - 1``'s K/V and ids (one permute of those rows), which adds its
    block into the first ``size`` rows of the own block's results;
  * else, given ``beyond`` (another strategy's whole pass, in the own
    block's structure; falsy: none), that;
  * else ``later(step, kv, carry)`` for steps ``1 .. m``, ``m`` the last
    step ``need`` marks, each fetching its K/V (``blocks.held_kv``'s form)
    straight from device ``r - step`` in one permute, two K/V held at a
    time. These steps nest, one ``lax.cond`` on ``step < m`` each, and a
    branch that stops casts the float32 carry back rather than passing it
    through (a conditional copies an operand it returns).

  A GPU's host reads a branch test after all the work queued before it,
  and the device then waits for what the host launches next. So the
  reach test runs first, and ``prepare(kv)`` with it (``ready``, the own
  block's backend operands, ``kernel.prepare``; None: none): the small
  kernels that build them run before the wait, not after it, and the
  branch starts with the block's own work.
  ``alone``: ``(own_alone, settle)``, the own block as the first branch
  runs it and what puts the second's results in that form (the backward:
  dK/dV as the pair, :func:`kv.unpack`, not stacked to be split again);
  default ``own``. Returns in the own block's dtypes."""
  cp = plan.cp_size
  need, rows = reach.needed_steps(tm, plan, causal, rows=True)
  last, ids = reach.last_step(need), tm.kv_ids()
  t = k.shape[1]
  handed = bool(beyond)
  sizes = reach.tail_sizes(t, cp, handed)
  index = reach.branch(need, rows, t, cp, handed)
  own_alone, settle = alone or (own, lambda x: x)
  held0 = ((k, v), ids)
  ready = prepare(held0) if prepare and PREPARE_OWN else None

  def with_steps():
    first = own(held0, ready)
    dtypes = jax.tree.map(lambda a: a.dtype, first)
    finish = lambda carry: jax.tree.map(lambda a, t: a.astype(t), carry,
                                        dtypes)

    def from_step(step, carry):
      held = (kv_lib.pack(k, v), ids)  # packed inside the step's branch
      carry = later(step, shift(held, plan, step), carry)
      if step == cp - 1:
        return finish(carry)
      return lax.cond(last > step, functools.partial(from_step, step + 1),
                      finish, carry)

    def cut(size, first):
      end = slice(t - size, None)
      held = (kv_lib.pack(k[:, end], v[:, end]), ids[:, end])
      return tail(size, shift(held, plan, 1), first)

    branches = [functools.partial(cut, n) for n in sizes]
    if handed:
      branches.append(lambda _: finish(beyond()))
    elif cp > 2:  # documents reach past the previous shard, or past sizes
      branches.append(lambda first: from_step(1, as_f32(first)))
    return settle(lax.switch(index - 1, branches, first))

  return lax.cond(index == 0, lambda: own_alone(held0, ready), with_steps)
