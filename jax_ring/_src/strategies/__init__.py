"""Context-parallel strategies on local shards (inside ``shard_map``): the
ring, the all-gather, Ulysses and the hybrid, each a :class:`Strategy`
record (``base``) in :data:`STRATEGIES`, the table that the ``jit`` path,
``auto`` and the tests use. A strategy calls blocks through
``core.kernel`` and never a backend; ``layout`` holds the load-balance
token orders they share."""

from jax_ring._src.strategies import all_gather, hybrid, ring, ulysses
from jax_ring._src.strategies.base import Strategy


STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (ring.STRATEGY, all_gather.STRATEGY,
                        ulysses.STRATEGY, hybrid.STRATEGY)}
