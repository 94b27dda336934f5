"""A workaround shared by the Flax, LM-example and multi-process tests: with
full Python tracebacks in HLO locations (jax's default), XLA:CPU's
``PropagateCallMetadata`` (run when calls are inlined) can take minutes on a
context-parallel program: the compile looks like a hang. It depends on the
stacks recorded while tracing (deep under pytest), so it comes and goes with
unrelated code changes. Innermost-frame locations avoid it; they change
nothing but debug metadata.

Import ``short_locations`` into a test module to apply it there (autouse).
Better: set it once in ``conftest.py``.
"""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def short_locations():
  name = "jax_include_full_tracebacks_in_locations"
  old = getattr(jax.config, name)
  jax.config.update(name, False)
  yield
  jax.config.update(name, old)
