"""Test session setup: 8 simulated CPU devices, so that the context-parallel
tests run on one machine. It must run before jax initialises its backends."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
