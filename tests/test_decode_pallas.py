"""``decode_attention(implementation="pallas")``: the Pallas kernel (on a
CPU, interpreted) against the float64 reference, forward and gradients,
for every mask it serves; rows that see nothing and NaN; the calls it
refuses, by name. The split cache runs it on GPUs (the GPU lane)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
import reference as ref
from helpers import lowering_for_gpus
from jax_ring._src.backends import pallas_decode

# 256 slots (two of the kernel's blocks) in no particular order, a quarter
# empty; T = 3 new tokens; GQA 4:2; Hv unlike H.
B, T, C, N, K, H, HV = 2, 3, 256, 4, 2, 32, 16
RNG = np.random.default_rng(1)
KV_POS = np.stack([RNG.permutation(C) for _ in range(B)]).astype(np.int32)
KV_POS[RNG.random((B, C)) < 0.25] = -1
Q_POS = np.array([[200, 201, 202], [256, 257, 258]], np.int32)
SINKS = np.array([0.5, -1.0, 1.5, 0.0], np.float32)
CASES = {  # name -> (options, causal, window (left, right))
    "causal": (dict(), True, None),
    "window_cap_sinks": (dict(local_window_size=(40, 0), logits_soft_cap=2.0,
                              sinks=SINKS), True, (40, 0)),
    "two_sided": (dict(is_causal=False, local_window_size=(30, 20)), False,
                  (30, 20)),
}


def visible(q_pos, causal, window):
  d = KV_POS[:, None, :] - q_pos[:, :, None]
  vis = np.broadcast_to(KV_POS[:, None, :] >= 0, d.shape).copy()
  if causal:
    vis &= d <= 0
  if window:
    vis &= (d >= -window[0]) & (d <= window[1])
  return vis


def call(q, k, v, kw, q_pos=Q_POS):
  return jax_ring.decode_attention(
      q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), query_positions=q_pos,
      key_positions=KV_POS, kv_layout="bksh", implementation="pallas", **kw)


# The kernel's cases: here (interpreted off GPUs), and compiled for the GPU
# in its lane (``-m gpu``).
LANES = pytest.mark.parametrize("lane", [
    "here", pytest.param("gpu", marks=pytest.mark.gpu)])


# In the default run, the causal band with a window, soft cap and sinks
# (the kernel's every option); causal alone and two-sided with -m slow.
@LANES
@pytest.mark.parametrize("name", ["window_cap_sinks", "causal", "two_sided"])
@pytest.mark.sample(1)
def test_pallas_matches_reference_with_gradients(name, lane):
  kw, causal, window = CASES[name]
  q, k, v, dout = ref.random_qkv(3, B, T, C, N, K, H, hv=HV)
  case = ref.Case(H**-0.5, dense=visible(Q_POS, causal, window)[:, None],
                  soft_cap=kw.get("logits_soft_cap"))
  want, _, grads = ref.attention(q, k, v, case, sinks=kw.get("sinks"),
                                 dout=dout)
  out, got = _vjp(lambda q, k, v: call(q, k, v, kw), q, k, v, dout)
  ref.assert_close(out, want, jnp.float32)
  for x, name in zip(got, "qkv"):
    ref.assert_close(x, grads[name], jnp.float32, "d" + name)


def _vjp(f, q, k, v, dout):
  """``f``'s output and ``(dq, dk, dv)`` of ``sum(f * dout)``: one
  program (forward and backward compiled once)."""
  @jax.jit
  def both(q, k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(dout)

  return both(q, k, v)


@LANES
def test_bfloat16_cache(lane):
  q, k, v, _ = ref.random_qkv(4, B, T, C, N, K, H, jnp.bfloat16, hv=HV)
  out = call(q, k, v, {})
  assert out.dtype == jnp.bfloat16
  case = ref.Case(H**-0.5, dense=visible(Q_POS, True, None)[:, None])
  ref.assert_close(out, ref.attention(q, k, v, case)[0], jnp.bfloat16)


@LANES
def test_no_visible_slot_is_zero_and_nan_propagates(lane):
  q, k, v, _ = ref.random_qkv(5, B, T, C, N, K, H, hv=HV)
  q_pos = Q_POS.copy()
  q_pos[0, 0] = -5  # sees no slot
  out = np.asarray(call(q.at[1, 0, 2, 0].set(jnp.nan), k, v, {}, q_pos))
  np.testing.assert_array_equal(out[0, 0], 0.0)
  nan = np.isnan(out)
  assert nan[1, 0, 2].all() and nan.sum() == HV


@LANES
def test_uneven_split_of_the_slots(monkeypatch, lane):
  """Five blocks of slots over two programs of three blocks each: the
  last program's block past the cache is masked, not read twice. A 1M
  cache over 4 GPUs (2056 blocks a device, 8 x 257) takes 33 programs a
  kv head on 132 SMs."""
  assert pallas_decode.splits(1, 8, 2056 * 128, 132) == (33, 63)
  assert pallas_decode.splits(B, K, 640, 1) == (1, 5)
  monkeypatch.setattr(pallas_decode, "WAVES", 8)
  assert pallas_decode.splits(B, K, 640, 1) == (2, 3)
  monkeypatch.setattr(pallas_decode, "splits", lambda *_: (2, 3))  # GPUs
  rng = np.random.default_rng(8)
  kv_pos = np.stack([rng.permutation(640) for _ in range(B)]).astype(
      np.int32)
  kv_pos[rng.random((B, 640)) < 0.25] = -1
  q_pos = np.array([[500, 501, 502], [637, 638, 639]], np.int32)
  q, k, v, _ = ref.random_qkv(9, B, T, 640, N, K, H, hv=HV)
  vis = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])
  want, _ = ref.attention(q, k, v, ref.Case(H**-0.5, dense=vis[:, None]))
  # The forward alone: the gradient is the XLA path's whatever the split
  # (test_pallas_matches_reference_with_gradients).
  out = jax.jit(lambda q, k, v: jax_ring.decode_attention(
      q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), query_positions=q_pos,
      key_positions=kv_pos, kv_layout="bksh", implementation="pallas"))(
          q, k, v)
  ref.assert_close(out, want, jnp.float32)


@pytest.mark.gpu
def test_one_program_a_row_on_gpus():
  """A cache of one block (128 slots): one program a row and kv head, so
  no merge of parts (the CPU cases above always run that way). A row
  that sees no slot is zero; a NaN query's row is NaN."""
  c = pallas_decode.BLOCK
  kv_pos = KV_POS[:, :c]
  q_pos = np.array([[-5, 100, 101], [126, 127, 128]], np.int32)
  sms = getattr(jax.devices()[0], "core_count", 1)
  assert pallas_decode.splits(B, K, c, sms)[0] == 1
  q, k, v, dout = ref.random_qkv(10, B, T, c, N, K, H, hv=HV)
  q = q.at[1, 2, 3, 0].set(jnp.nan)
  vis = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])
  want, _ = ref.attention(q, k, v, ref.Case(H**-0.5, dense=vis[:, None]))
  out = np.asarray(jax_ring.decode_attention(
      q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), query_positions=q_pos,
      key_positions=kv_pos, kv_layout="bksh", implementation="pallas"))
  np.testing.assert_array_equal(out[0, 0], 0.0)
  assert np.isnan(out[1, 2, 3]).all() and np.isnan(out).sum() == HV
  keep = ~np.isnan(np.asarray(want))
  ref.assert_close(np.where(keep, out, 0.0), np.where(keep, want, 0.0),
                   jnp.float32)


@pytest.mark.parametrize("change, message", [
    (dict(kv_layout="bskh"), "implementation must be None, 'xla' or one of "
     "['pallas'] (with kv_layout='bksh'); got 'pallas' with "
     "kv_layout='bskh'"),
    (dict(slots=200), "cannot serve 200 cache slots per device, not a "
     "multiple of 128; implementation='xla' can"),
    (dict(implementation="triton"), "implementation must be None, 'xla' or "
     "one of ['pallas']"),
])
def test_calls_it_cannot_serve_are_named(change, message):
  slots = change.pop("slots", C)
  q, k, v, _ = ref.random_qkv(6, B, T, slots, N, K, H)
  layout = change.get("kv_layout", "bksh")
  if layout == "bksh":
    k, v = (jnp.swapaxes(x, 1, 2) for x in (k, v))
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(
      "]", r"\]").replace("(", r"\(").replace(")", r"\)")):
    jax_ring.decode_attention(
        q, k, v, query_positions=Q_POS, key_positions=KV_POS[:, :slots],
        **{"implementation": "pallas", "kv_layout": "bksh", **change})


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off GPUs only")
def test_interpreted_inside_shard_map_is_refused():
  q, k, v, _ = ref.random_qkv(7, B, T, C, N, K, H)
  m = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2],
                    axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(m), pytest.raises(ValueError, match="interpreted off "
                                      "GPUs, which jax cannot do inside "
                                      "shard_map"):
    jax_ring.decode_attention(
        q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
        query_positions=Q_POS, key_positions=KV_POS, kv_layout="bksh",
        implementation="pallas",
        context_parallel=jax_ring.ContextParallel(axis="cp"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_kernel_lowers_to_triton_for_gpus(dtype):
  """The kernel lowered for CUDA, as a GPU runs it, on any machine (1152
  slots: a share of the slots need not be a power of two): every
  operation in it has a Triton lowering (the Triton compiler itself runs
  on GPUs only)."""
  spec = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
  f = jax.jit(lambda *a: pallas_decode.local(
      *a, band=(100, 5), scale=0.125, cap=30.0, interpret=False))
  args = (spec((2, 3, 8, 128)), spec((2, 2, 1152, 128)),
          spec((2, 2, 1152, 64)), spec((2, 3), jnp.int32),
          spec((2, 1152), jnp.int32))
  with lowering_for_gpus():
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1


def test_explain_decode_names_the_kernel_and_why():
  q, k = (1, 1, 32, 64), (1, 1 << 20, 8, 64)  # global, bskh
  kh = (1, 8, 1 << 20, 64)  # the same cache kv-head-major
  pick = lambda *a, **kw: jax_ring.explain_decode(*a, **kw)
  got = pick(q, kh, kv_layout="bksh", cp_size=4, platform="gpu")
  assert (got.kernel, got.local_key_shape) == ("pallas", (1, 8, 1 << 18, 64))
  assert "'pallas'" in str(got)
  for other in ("cpu", "rocm"):
    assert pick(q, kh, kv_layout="bksh", platform=other).kernel == "xla"
  bskh = pick(q, k, cp_size=4, platform="gpu")
  assert bskh.kernel == "xla" and "kv_layout='bskh'" in bskh.reason
  odd = pick(q, (1, 8, 4 * 1000, 64), kv_layout="bksh", cp_size=4,
             platform="gpu")
  assert odd.kernel == "xla" and "1000 cache slots per device" in odd.reason
  with pytest.raises(ValueError, match="cannot serve 1000 cache slots"):
    pick(q, (1, 8, 4000, 64), kv_layout="bksh", cp_size=4,
         implementation="pallas")
  with pytest.raises(ValueError, match="must divide over cp_size 3"):
    pick(q, kh, kv_layout="bksh", cp_size=3)
  with pytest.raises(ValueError, match="implementation must be None"):
    pick(q, k, implementation="pallas")


def test_the_default_on_gpus_is_the_kernel(monkeypatch):
  """``implementation=None`` traced as on a GPU lowers to the kernel where
  it serves the shapes (one Triton call), to XLA's products where not,
  and inside the split cache's shard_map."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  spec = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)

  def lowered(slots):
    f = jax.jit(lambda q, k, v, qp, kp: jax_ring.decode_attention(
        q, k, v, query_positions=qp, key_positions=kp, kv_layout="bksh"))
    with lowering_for_gpus():
      return f.trace(spec((1, 1, 8, 64)), spec((1, 2, slots, 64)),
                     spec((1, 2, slots, 64)), spec((1, 1), jnp.int32),
                     spec((1, slots), jnp.int32)).lower(
                         lowering_platforms=("cuda",)).as_text()

  assert lowered(512).count("__gpu$xla.gpu.triton") == 1
  assert "triton" not in lowered(500)
  # The cache split over two devices: each runs the kernel on its slots.
  split = jax_ring.ContextParallel(axis="cp")
  with lowering_for_gpus((2,), ("cp",)):
    text = jax.jit(lambda q, k, v, qp, kp: jax_ring.decode_attention(
        q, k, v, query_positions=qp, key_positions=kp, kv_layout="bksh",
        context_parallel=split)).trace(
            spec((1, 1, 8, 64)), spec((1, 2, 1024, 64)),
            spec((1, 2, 1024, 64)), spec((1, 1), jnp.int32),
            spec((1, 1024), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1 and "all_reduce" in text
