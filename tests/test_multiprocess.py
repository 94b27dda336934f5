"""Multi-process runs on localhost under ``jax.distributed``: 2 processes x 2
CPU devices (the ring test; 4 in the LM example's) with gloo collectives,
or 2 processes x 1 or 2 GPUs (NCCL; ``-m gpu``).

* Ring attention with the context axis spanning both processes, against the
  float64 reference.
* The LM example launched as 2 processes trains like the same example in
  one process with 8 devices."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref

NUM_PROCESSES = 2
TIMEOUT_S = 240
HERE = pathlib.Path(__file__).parent
EXAMPLES = HERE.parent / "examples"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(command, cpu=True):
  """Run ``command(process_id, port)`` as NUM_PROCESSES processes; fail on a
  non-zero exit or after TIMEOUT_S."""
  port = _free_port()
  env = dict(os.environ)
  # On CPUs, this process's XLA flags (tests/conftest.py's cheaper compiles:
  # the same numbers) less a device count: each process sets its own. On
  # GPUs, XLA's defaults.
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if cpu and not
           f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
  procs = [subprocess.Popen(
      [sys.executable] + command(i, port), env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(NUM_PROCESSES)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"processes did not finish in {TIMEOUT_S} s")
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, (
        f"process {i} exited {p.returncode}:\n{log[-4000:]}")
  return logs


@pytest.mark.parametrize("setup", [
    "cpu", pytest.param("gpu", marks=pytest.mark.gpu),
    pytest.param("gpu2", marks=pytest.mark.gpu)])
def test_ring_across_two_processes_matches_reference(setup, tmp_path):
  """cpu: 2 x 2 CPU devices, float32, pure-JAX blocks; gpu: 2 x 1 GPU and
  gpu2: 2 x 2 GPUs, bfloat16, cuDNN blocks (its FFI calls in both compiled
  programs)."""
  platform = setup.rstrip("0123456789")
  local = {"cpu": 2, "gpu": 1, "gpu2": 2}[setup]
  if platform == "gpu" and _gpus() < NUM_PROCESSES * local:
    pytest.skip(f"needs {NUM_PROCESSES * local} NVIDIA GPUs")
  out = tmp_path / "result.npz"
  launch(lambda i, port: [str(HERE / "multiprocess_worker.py"), str(i),
                          str(NUM_PROCESSES), str(port), str(out), setup],
         cpu=platform == "cpu")

  r = np.load(out)
  assert int(r["num_devices"]) == NUM_PROCESSES * local
  q, k, v, do, ids = (r[n] for n in ("q", "k", "v", "do", "ids"))
  dtype = np.float32 if platform == "cpu" else jnp.bfloat16
  case = ref.Case(q.shape[-1]**-0.5, is_causal=True, q_segment_ids=ids,
                  kv_segment_ids=ids)
  want_out, _, grads = ref.attention(q, k, v, case, dout=do)
  for path in ("shard_map", "jit"):
    assert (int(r[f"{path}_cudnn_calls"]) > 0) == (platform == "gpu"), path
    ref.assert_close(r[f"{path}_out"], want_out, dtype, f"{path} out")
    for name in ("q", "k", "v"):
      ref.assert_close(r[f"{path}_d{name}"], grads[name], dtype,
                       f"{path} d{name}")


def _gpus() -> int:
  import jax
  return len(jax.devices("gpu")) if jax.default_backend() == "gpu" else 0


@pytest.mark.slow
def test_example_under_jax_distributed_trains_like_one_process(tmp_path):
  """train_lm.py --distributed: each process builds the global batch and
  places its own shards; losses equal the single-process run's up to the
  summation order of cross-process reductions (float32)."""
  sys.path.insert(0, str(EXAMPLES))
  import train_lm
  flags = ["--preset", "micro", "--steps", "3", "--loop", "scan", "--quiet"]
  launch(lambda i, port: [
      str(EXAMPLES / "train_lm.py"), *flags, "--run-dir", str(tmp_path / "mp"),
      "--distributed", "--cpu-devices", "4", "--num-processes",
      str(NUM_PROCESSES), "--process-id", str(i), "--coordinator-address",
      f"localhost:{port}"])
  got = json.loads((tmp_path / "mp" / "losses.json").read_text())["losses"]
  want = train_lm.train(train_lm.parse_args(
      flags + ["--run-dir", str(tmp_path / "sp")]))["losses"]
  assert len(got) == len(want) == 3
  np.testing.assert_allclose(got, want, rtol=1e-5)
