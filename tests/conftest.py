"""Test setup, before jax initialises its backends:

* 8 simulated CPU devices, so that the context-parallel tests run on one
  machine;
* on GPUs, no preallocation of GPU memory (the multi-process test starts
  more jax processes on the same GPUs).

jax's other defaults stand, full Python tracebacks in HLO locations
included: ``test_compile_default_flags.py`` guards the compile they once
stalled (see ``jax_ring/_src/__init__.py``).
"""

import os

import jax

# On GPUs, the 2-process test starts two more jax processes beside this one:
# each takes memory as it needs it rather than 75% of every GPU at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax.config.update("jax_num_cpu_devices", 8)
