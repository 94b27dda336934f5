"""The test session itself: the simulated devices later issues rely on."""

import jax


def test_eight_simulated_cpu_devices():
  assert len(jax.devices("cpu")) == 8
