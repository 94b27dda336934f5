"""jax_ring's implementation (the public names are in ``jax_ring``).

Importing it registers jax_ring's package as library code with
``jax.extend.source_info_util.register_exclusion``, as jax's own modules
are: the operations jax_ring traces carry the location of the user's code
that called it, not jax_ring's lines (in HLO metadata and jax's "created
at" notes; exception tracebacks keep every frame). So the automatic path's
``custom_partitioning`` bodies (``partition.py``), which are traced on
XLA's compile thread, carry no stack frames: under jax's default flags
their compile time does not depend on the caller's stack. Why that
matters: docs/decisions.md, "Tests and CI".
``tests/test_compile_default_flags.py`` checks it.
"""

import os


try:
  from jax.extend.source_info_util import register_exclusion
except ImportError:  # jax.extend promises no compatibility across releases
  register_exclusion = None

if register_exclusion is not None:
  register_exclusion(os.path.dirname(os.path.dirname(__file__)) + os.sep)
