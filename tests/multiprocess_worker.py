"""One process of the multi-process test (tests/test_multiprocess.py): joins
a ``jax.distributed`` job on localhost, runs ring attention on a mesh whose
context axis spans every process, and (process 0) saves the gathered
results for the test to compare with the reference.

  python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz \
      [cpu|gpu|gpu2]

``cpu``: 2 CPU devices a process (gloo collectives), float32, the pure-JAX
blocks. ``gpu``: the process's own GPU (NCCL), bfloat16 at 512 tokens a
device, ``implementation=None``; the compiled programs must hold cuDNN's FFI
calls. ``gpu2``: as ``gpu``, with two GPUs a process (GPUs 2i and 2i + 1).
"""

import sys

import jax

# setup -> (devices a process, dtype, B, tokens a device, N, K, H)
SETUPS = {"cpu": (2, "float32", 2, 6, 4, 2, 16),
          "gpu": (1, "bfloat16", 1, 512, 8, 2, 64),
          "gpu2": (2, "bfloat16", 1, 512, 8, 2, 64)}


def main(process_id, num_processes, port, out_path, setup="cpu"):
  local, dtype, b, t, n, kh, h = SETUPS[setup]
  platform = setup.rstrip("0123456789")
  if platform == "cpu":
    jax.config.update("jax_num_cpu_devices", local)
    # CPU collectives across processes: gloo over TCP (jaxlib's default on
    # CPU, set explicitly so that the test states what it relies on).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      f"localhost:{port}", num_processes=num_processes, process_id=process_id,
      initialization_timeout=60,
      local_device_ids=(list(range(process_id * local,
                                   (process_id + 1) * local))
                        if platform == "gpu" else None))

  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_ring
  import reference as ref

  cp = jax.device_count()
  assert cp == local * num_processes, jax.devices()
  assert jax.default_backend() == platform, jax.default_backend()
  # Devices in process order: ring neighbours r -> r+1 cross the process
  # boundary at r = local - 1 and at the wrap-around.
  mesh = Mesh(np.array(jax.devices()), ("cp",))
  owners = sorted({d.process_index for d in mesh.devices.flat})
  assert owners == list(range(num_processes)), owners

  s = t * cp
  q, k, v, do = ref.random_qkv(21, b, s, s, n, kh, h)  # same in every process
  code = ref.shard_code(s, cp, "dual_chunk")
  q, k, v, do = (np.asarray(x.astype(dtype)) for x in (q + code, k - code,
                                                       v + code, do))
  ids = ref.random_segments(22, b, s, 5)
  implementation = "xla" if platform == "cpu" else None
  sharding = NamedSharding(mesh, P(None, "cp"))

  def put(x):
    x = np.asarray(jax_ring.reorder_for_load_balance(x, cp))
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  q_, k_, v_, do_, ids_ = (put(x) for x in (q, k, v, do, ids))
  spec = P(None, "cp")
  ring = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance="dual_chunk",
          segment_ids=ids, loop="unrolled", implementation=implementation),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
  cpc = jax_ring.ContextParallel(axis="cp", load_balance="dual_chunk",
                                 inputs="load_balanced",
                                 loop="scan")
  auto = lambda q, k, v, ids: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, context_parallel=cpc,
      implementation=implementation)

  results = {}
  for name, f in (("shard_map", ring), ("jit", auto)):

    @jax.jit
    def go(q, k, v, do, ids, f=f):
      out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
      return (out,) + vjp(do)

    compiled = go.lower(q_, k_, v_, do_, ids_).compile()
    hlo = compiled.as_text()
    results[f"{name}_cudnn_calls"] = hlo.count(
        'custom_call_target="jax_ring_sdpa_')
    got = compiled(q_, k_, v_, do_, ids_)
    for key, x in zip(("out", "dq", "dk", "dv"), got):
      full = multihost_utils.process_allgather(x, tiled=True)
      results[f"{name}_{key}"] = np.asarray(
          jax_ring.reorder_from_load_balance(full, cp), np.float32)
  if process_id == 0:
    f32 = lambda x: x.astype(np.float32)  # exact for bfloat16
    np.savez(out_path, q=f32(q), k=f32(k), v=f32(v), do=f32(do), ids=ids,
             num_devices=jax.device_count(), **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
