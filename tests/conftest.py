"""Test setup, before jax initialises its backends:

* 8 simulated CPU devices, so that the context-parallel tests run on one
  machine;
* on GPUs, no preallocation of GPU memory (the multi-process test starts
  more jax processes on the same GPUs);
* innermost-frame HLO locations. With full Python tracebacks (jax's
  default), XLA:CPU's ``PropagateCallMetadata``, run when calls are inlined,
  can take minutes on a context-parallel program traced deep under pytest:
  the compile looks like a hang, and comes and goes with unrelated code
  changes. The setting changes nothing but debug metadata. (The example
  sets it too; see ``examples/train_lm.py``.)
"""

import os

import jax

# On GPUs, the 2-process test starts two more jax processes beside this one:
# each takes memory as it needs it rather than 75% of every GPU at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_include_full_tracebacks_in_locations", False)
