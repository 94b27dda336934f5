"""jax_ring's implementation (the public names are in ``jax_ring``).

Importing it tells jax that jax_ring is library code, as jax's own modules
are: the operations jax_ring traces carry the location of the user's code
that called it, not jax_ring's lines (in HLO metadata and jax's "created at"
notes; exception tracebacks keep every frame).

That is also what keeps context-parallel compiles finite under jax's default
flags. The automatic path's ``custom_partitioning`` bodies (``partition.py``)
are traced on XLA's compile thread, where jax_ring's are the only non-jax
frames on the stack. XLA copies each partitioned body into the program
without remapping its stack-frame ids (jaxlib's custom partitioner,
``InlineHloComputation``), so they name frames of an unrelated call stack,
or none. ``WhileLoopSimplifier`` inlines the loops that run once, and its
``PropagateCallMetadata`` concatenates a loop's stack onto every
instruction inside it, nested loops and conditionals included; with those
stacks unrelated, nothing is shared and they grow level after level. How
long that took depended on how the ids happened to line up: a hybrid Qwen2
compiled in 4 s from one stack depth, had not finished after 80 s from one
frame deeper, nor after 5 minutes from 8 deeper. Without jax_ring's frames
the bodies carry no stack frames.
``tests/test_compile_default_flags.py`` checks it.
"""

import os

try:
  from jax.extend.source_info_util import register_exclusion
except ImportError:  # jax.extend promises no compatibility across releases
  register_exclusion = None

if register_exclusion is not None:
  register_exclusion(os.path.dirname(os.path.dirname(__file__)) + os.sep)
