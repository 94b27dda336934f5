"""One process of the multi-process test (tests/test_multiprocess.py): joins
a ``jax.distributed`` job on localhost with 4 CPU devices, runs ring
attention on a mesh whose context axis spans every process, and (process 0)
saves the gathered results for the test to compare with the reference.

  python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz
"""

import sys

import jax

LOCAL_DEVICES = 4


def main(process_id, num_processes, port, out_path):
  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  # CPU collectives across processes: gloo over TCP (jaxlib's default on
  # CPU, set explicitly so that the test states what it relies on).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # See tests/conftest.py: keeps XLA's compile from stalling.
  jax.config.update("jax_include_full_tracebacks_in_locations", False)
  jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes,
                             process_id=process_id, initialization_timeout=60)

  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_ring
  from test_ring import rank_coded_qkv
  import reference as ref

  cp = jax.device_count()
  assert cp == LOCAL_DEVICES * num_processes, jax.devices()
  # Devices in process order: ring neighbours r -> r+1 cross the process
  # boundary at r = 3 and at the wrap-around.
  mesh = Mesh(np.array(jax.devices()), ("cp",))
  owners = sorted({d.process_index for d in mesh.devices.flat})
  assert owners == list(range(num_processes)), owners

  q, k, v, do = rank_coded_qkv(21, cp)  # same seed: same global arrays
  ids = ref.random_segments(22, q.shape[0], q.shape[1], 5)
  sharding = NamedSharding(mesh, P(None, "cp"))

  def put(x):
    x = np.asarray(jax_ring.reorder_for_load_balance(x, cp))
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  q_, k_, v_, do_, ids_ = (put(x) for x in (q, k, v, do, ids))
  spec = P(None, "cp")
  ring = jax.shard_map(
      lambda q, k, v, ids: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, load_balance="dual_chunk",
          segment_ids=ids, loop="unrolled", implementation="xla"),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
  cpc = jax_ring.ContextParallel(axis="cp", load_balance="dual_chunk",
                                 loop="scan")
  auto = lambda q, k, v, ids: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, context_parallel=cpc,
      implementation="xla")

  results = {}
  for name, f in (("shard_map", ring), ("jit", auto)):

    @jax.jit
    def go(q, k, v, do, ids, f=f):
      out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
      return (out,) + vjp(do)

    got = go(q_, k_, v_, do_, ids_)
    for key, x in zip(("out", "dq", "dk", "dv"), got):
      full = multihost_utils.process_allgather(x, tiled=True)
      results[f"{name}_{key}"] = np.asarray(
          jax_ring.reorder_from_load_balance(full, cp))
  if process_id == 0:
    np.savez(out_path, q=q, k=k, v=v, do=do, ids=ids,
             num_devices=jax.device_count(), **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
