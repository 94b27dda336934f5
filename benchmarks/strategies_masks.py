"""GPU check: every strategy with masks (packed documents, windows, padding) on
4 GPUs against one GPU, forward and grads (relative to max|expected|).
Writes $OUT/gpu_masks.json (stored as results/strategies_masks_<gpu>.json)."""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
import sys, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, "tests")
import reference as ref
import jax_ring
cp = jax.device_count()
B, S, N, K, H = 2, 8192, 8, 2, 128
q, k, v, do = ref.random_qkv(1, B, S, S, N, K, H, jnp.bfloat16)
ids = jnp.asarray(ref.random_segments(2, B, S, 7))
lens = dict(query_seq_lengths=jnp.array([S - 1000, 5000], jnp.int32), key_value_seq_lengths=jnp.array([S - 300, 4100], jnp.int32))
configs = {"causal_packed": dict(is_causal=True, segment_ids=ids),
           "causal_window_padding": dict(is_causal=True, local_window_size=(1500, 0), **lens),
           "full_window_packed": dict(local_window_size=(700, 300), segment_ids=ids)}
rows = []
def grads(f, *a):
  out, vjp = jax.vjp(f, *a)
  return (out,) + vjp(do_)
for cname, kw in configs.items():
  single = lambda q, k, v: jax_ring.dot_product_attention(q, k, v, **kw)
  do_ = do
  want = jax.jit(lambda q, k, v: grads(single, q, k, v))(q, k, v)
  for strat, lb in (("ring", "dual_chunk"), ("ring", "striped"), ("all_gather", "dual_chunk"), ("ulysses", "dual_chunk"), ("hybrid", "dual_chunk")):
    try:
      if strat == "hybrid":
        mesh = Mesh(np.array(jax.devices()).reshape(2, cp // 2), ("ring", "ulysses")); spec = P(None, ("ring", "ulysses")); rs = 2; axis = ("ulysses", "ring")
      else:
        mesh = Mesh(np.array(jax.devices()), ("cp",)); spec = P(None, "cp"); rs = cp; axis = "cp"
      to = lambda x: jax_ring.reorder_for_load_balance(x, rs, layout=lb)
      back = lambda x: jax_ring.reorder_from_load_balance(x, rs, layout=lb)
      sh = NamedSharding(mesh, spec)
      cpc = jax_ring.ContextParallel(axis=axis, strategy=strat, load_balance=lb)
      kw2 = dict(kw)
      if "segment_ids" in kw2: kw2["segment_ids"] = jax.device_put(to(kw2["segment_ids"]), sh)
      f = lambda q, k, v: jax_ring.dot_product_attention(q, k, v, context_parallel=cpc, **kw2)
      do_ = jax.device_put(to(do), sh)
      args = [jax.device_put(to(x), sh) for x in (q, k, v)]
      fn = jax.jit(lambda q, k, v: grads(f, q, k, v))
      got = [back(x) for x in fn(*args)]
      errs = {n: float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))) / max(1.0, float(jnp.max(jnp.abs(w.astype(jnp.float32)))))) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
      row = dict(config=cname, strategy=strat, load_balance=lb, **errs)
    except Exception as e:
      row = dict(config=cname, strategy=strat, load_balance=lb, error=f"{type(e).__name__}: {e}"[:400])
    rows.append(row); print(row, flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, count=cp, jax=jax.__version__, shapes=dict(B=B, S=S, N=N, K=K, H=H, dtype="bfloat16"), rows=rows), open(os.environ.get("OUT", ".") + "/gpu_masks.json", "w"), indent=1)
