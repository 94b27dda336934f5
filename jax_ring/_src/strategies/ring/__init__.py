"""The ring: each device keeps its queries and the K/V shards travel round
the devices (``schedule``); which query rows meet which K/V rows at a step,
under which static mask (``blocks``; ``striped`` for the striped layout)."""

from jax_ring._src.strategies.ring.schedule import (STRATEGY, backward, check,
                                                    forward, plan,
                                                    ring_attention)


__all__ = ["STRATEGY", "backward", "check", "forward", "plan",
           "ring_attention"]
