"""The simulated CPU devices that the context-parallel tests rely on."""

import jax


def test_eight_simulated_cpu_devices():
  assert len(jax.devices("cpu")) == 8
