"""The block-kernel contract against the float64 reference, on small tiles.

Small tiles (bq=16, bk=8) and odd lengths make every case cross several
partial tiles, so tile pruning, padding and the online softmax are all on the
path. The public API is tested on its own in test_api.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
from jax_ring._src.core import kernel
import reference as ref
from helpers import TILES, check_kernel, run_kernel

B, T, S, N, K, H = 2, 37, 29, 4, 2, 16
SCALE = 0.3


def _lengths(lo, hi):
  return np.array([lo, hi], np.int32)


CASES = {
    "full": ref.Case(SCALE),
    "causal": ref.Case(SCALE, is_causal=True),
    # q starts 11 tokens after kv: the diagonal is offset downwards.
    "causal_q_after_kv": ref.Case(SCALE, is_causal=True, q_offset=11),
    # kv starts after q: the first rows see nothing (fully masked).
    "causal_kv_after_q": ref.Case(SCALE, is_causal=True, kv_offset=9),
    "window": ref.Case(SCALE, window=(5, 3)),
    "window_causal_offset": ref.Case(SCALE, is_causal=True, window=(7, 0),
                                     q_offset=20, kv_offset=13),
    "padding": ref.Case(SCALE, q_lengths=_lengths(30, 37),
                        kv_lengths=_lengths(17, 29)),
    "segments": ref.Case(SCALE, q_segment_ids=ref.random_segments(1, B, T, 4),
                         kv_segment_ids=ref.random_segments(1, B, S, 4)),
    "soft_cap": ref.Case(SCALE * 8, soft_cap=3.0),
    "dense": ref.Case(SCALE, dense=np.random.default_rng(2).random(
        (1, N, T, S)) > 0.4),
    "everything": ref.Case(
        SCALE, is_causal=True, window=(9, 0), soft_cap=4.0, q_offset=6,
        q_segment_ids=ref.random_segments(3, B, T, 3),
        kv_segment_ids=ref.random_segments(3, B, S, 3),
        kv_lengths=_lengths(22, 29)),
}


# Cases that another default test checks as they are, against the
# reference (-m slow runs them here too): causal_q_after_kv in
# test_gqa_groups, window_causal_offset in test_lse_cotangent, everything
# in test_dtypes[everything-float32], causal_kv_after_q in
# test_fully_masked_rows_are_zero_with_finite_grads.
ELSEWHERE = ("causal_q_after_kv", "window_causal_offset", "everything",
             "causal_kv_after_q")


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in ELSEWHERE else n
    for n in CASES])
def test_mask_cases_match_reference(name):
  q, k, v, do = ref.random_qkv(hash(name) % 1000, B, T, S, N, K, H)
  check_kernel(q, k, v, do, CASES[name])


# MHA by default; groups of 2 are every other test's shape (N = 4, K = 2).
@pytest.mark.parametrize("groups", [
    1, *(pytest.param(g, marks=pytest.mark.slow) for g in (2, 4, 8))])
def test_gqa_groups(groups):
  kh = 2
  q, k, v, do = ref.random_qkv(groups, B, T, S, kh * groups, kh, H)
  check_kernel(q, k, v, do, CASES["causal_q_after_kv"])


# Each dtype on "everything" (a causal mask among the rest) in the
# default run, float16 (bfloat16's path) and "causal" alone with -m slow.
@pytest.mark.parametrize("dtype", [
    jnp.float32, jnp.bfloat16,
    pytest.param(jnp.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [
    pytest.param("causal", marks=pytest.mark.slow), "everything"])
def test_dtypes(dtype, name):
  q, k, v, do = ref.random_qkv(5, B, T, S, N, K, H, dtype)
  out, _ = check_kernel(q, k, v, do, CASES[name])
  assert out.dtype == dtype


@pytest.mark.parametrize("bias_shape", [
    (B, N, T, S), (1, 1, T, S),
    *(pytest.param(s, marks=pytest.mark.slow)
      for s in ((1, N, T, S), (B, 1, T, S)))])
def test_bias_and_its_gradient(bias_shape):
  q, k, v, do = ref.random_qkv(7, B, T, S, N, K, H)
  bias = jax.random.normal(jax.random.key(8), bias_shape)
  check_kernel(q, k, v, do, CASES["causal"], bias=bias)


def test_lse_cotangent():
  q, k, v, do = ref.random_qkv(9, B, T, S, N, K, H)
  dlse = jax.random.normal(jax.random.key(10), (B, T, N))
  check_kernel(q, k, v, do, CASES["window_causal_offset"], dlse=dlse)


# tiles2 (a query tile past T: tiles0's one; key tiles of 3: tiles1's
# partial ones) with -m slow.
@pytest.mark.parametrize("tiles", [
    dict(block_q=37, block_kv=29), dict(block_q=5, block_kv=7),
    pytest.param(dict(block_q=64, block_kv=3), marks=pytest.mark.slow)])
def test_tile_sizes_do_not_change_the_result(tiles):
  q, k, v, do = ref.random_qkv(11, B, T, S, N, K, H)
  check_kernel(q, k, v, do, CASES["everything"], **tiles)


def test_fully_masked_rows_are_zero_with_finite_grads():
  """Zero where no key is seen, finite gradients, and all of it the
  reference's (this mask case's check)."""
  q, k, v, do = ref.random_qkv(12, B, T, S, N, K, H)
  case = CASES["causal_kv_after_q"]  # rows p_q < 9 see no key
  out, lse, grads = run_kernel(q, k, v, do, case)
  assert np.all(np.asarray(out[:, :9]) == 0)
  assert np.all(np.asarray(lse[:, :9]) == jax_ring.MASK_VALUE)
  assert np.all(np.asarray(grads[0][:, :9]) == 0)
  for g in grads[:3]:
    assert np.all(np.isfinite(np.asarray(g)))
  r_out, r_lse, r_g = ref.attention(q, k, v, case, dout=do)
  ref.assert_close(out, r_out, q.dtype, "out")
  ref.assert_close(lse, r_lse, q.dtype, "lse")
  for name, grad in zip("qkv", grads):
    ref.assert_close(grad, r_g[name], q.dtype, "d" + name)


def test_backward_from_external_global_out_and_lse():
  """The ring's use: KV split in two blocks, partial results merged, then
  each block's backward is given the *merged* out and lse."""
  q, k, v, do = ref.random_qkv(13, B, T, S, N, K, H)
  case = ref.Case(SCALE, is_causal=True, q_offset=S - T + 20)
  cfg = ref.config(case, **TILES)
  cut = 13
  halves = [(slice(0, cut), 0), (slice(cut, S), cut)]
  parts = []
  for sl, off in halves:
    mask = jax_ring.BlockMask(q_offset=case.q_offset, kv_offset=off)
    parts.append(kernel.attention(q, k[:, sl], v[:, sl], None, mask, cfg))
  (o1, l1), (o2, l2) = parts
  lse = jnp.logaddexp(l1, l2)
  out = (o1 * jnp.exp(l1 - lse)[..., None] + o2 * jnp.exp(l2 - lse)[..., None])
  dq = 0
  dks, dvs = [], []
  for sl, off in halves:
    mask = jax_ring.BlockMask(q_offset=case.q_offset, kv_offset=off)
    g = kernel.attention_backward(q, k[:, sl], v[:, sl], None, mask, out, lse,
                                  do, None, cfg)
    dq = dq + g[0]
    dks.append(g[1])
    dvs.append(g[2])
  r_out, r_lse, r_g = ref.attention(q, k, v, case, dout=do)
  ref.assert_close(out, r_out, q.dtype, "merged out")
  ref.assert_close(lse, r_lse, q.dtype, "merged lse")
  ref.assert_close(dq, r_g["q"], q.dtype, "dq")
  ref.assert_close(jnp.concatenate(dks, 1), r_g["k"], q.dtype, "dk")
  ref.assert_close(jnp.concatenate(dvs, 1), r_g["v"], q.dtype, "dv")


def test_stacked_dkv_backward_matches_the_reference_and_vmaps():
  """``attention_backward_dkv`` (the ring's layout) gives the reference's
  dK/dV stacked, the same bits as stacking ``attention_backward``'s, and
  under vmap (offsets folded or mapped) the same as per instance."""
  q, k, v, do = ref.random_qkv(21, 3 * B, T, S, N, K, H)
  case = ref.Case(SCALE, is_causal=True, q_offset=S - T + 7)
  cfg = ref.config(case, **TILES)
  out, lse = ref.attention(q, k, v, case)
  out, lse = out.astype(q.dtype), lse.astype(jnp.float32)
  _, _, r_g = ref.attention(q, k, v, case, dout=do)

  def both(q, k, v, out, lse, do, qo):
    mask = jax_ring.BlockMask(q_offset=qo)
    dq, dkv, _ = kernel.attention_backward_dkv(q, k, v, None, mask, out, lse,
                                               do, None, cfg)
    pair = kernel.attention_backward(q, k, v, None, mask, out, lse, do, None,
                                     cfg)
    return dq, dkv, pair[0], jnp.stack(pair[1:3])

  split = lambda x: x.reshape(3, B, *x.shape[1:])
  args = [split(x) for x in (q, k, v, out, lse, do)]
  # Per instance (eagerly); their rows together against the reference's.
  wants = [both(*(a[i] for a in args), case.q_offset) for i in range(3)]
  rows = lambda j, axis: jnp.concatenate([w[j] for w in wants], axis)
  dq, dkv, dq2, dkv2 = rows(0, 0), rows(1, 1), rows(2, 0), rows(3, 1)
  assert dkv.shape == (2,) + k.shape
  np.testing.assert_array_equal(np.asarray(dkv), np.asarray(dkv2))
  np.testing.assert_array_equal(np.asarray(dq), np.asarray(dq2))
  ref.assert_close(dq, r_g["q"], q.dtype, "dq")
  ref.assert_close(dkv[0], r_g["k"], q.dtype, "dk")
  ref.assert_close(dkv[1], r_g["v"], q.dtype, "dv")

  for qo in (jnp.asarray(case.q_offset, jnp.int32),
             jnp.full((3,), case.q_offset, jnp.int32)):
    axes = (0,) * 6 + (None if qo.ndim == 0 else 0,)
    got = jax.jit(jax.vmap(both, axes))(*args, qo)
    for i, want in enumerate(wants):
      for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b),
                                   rtol=1e-5, atol=1e-5)


def test_traced_offsets_equal_static_offsets():
  q, k, v, do = ref.random_qkv(14, B, T, S, N, K, H)
  case = CASES["window_causal_offset"]
  cfg = ref.config(case, **TILES)

  @jax.jit
  def f(qo, ko):
    return kernel.attention(q, k, v, None,
                            jax_ring.BlockMask(q_offset=qo, kv_offset=ko), cfg)

  out, lse = f(case.q_offset, case.kv_offset)
  r_out, r_lse = ref.attention(q, k, v, case)
  ref.assert_close(out, r_out, q.dtype, "out")
  ref.assert_close(lse, r_lse, q.dtype, "lse")


def test_int_offsets_stay_static_params_through_the_vjp():
  q, k, v, do = ref.random_qkv(20, B, T, S, N, K, H)
  cfg = ref.config(CASES["causal"], **TILES)
  mask = jax_ring.BlockMask(q_offset=5, kv_offset=2)
  loss = lambda q: jnp.sum(kernel.attention(q, k, v, None, mask, cfg)[0] * do)
  jaxpr = jax.make_jaxpr(jax.grad(loss))(q)
  eqns = [e for e in jaxpr.jaxpr.eqns
          if e.primitive.name.startswith("jax_ring_attention")]
  assert {e.primitive.name for e in eqns} == {"jax_ring_attention_fwd",
                                              "jax_ring_attention_bwd"}
  for e in eqns:
    assert dict(e.params["mask_static"]) == {0: 5, 1: 2}, e.params


def test_vmap_folds_into_batch_and_maps_over_offsets():
  q, k, v, do = ref.random_qkv(15, 3 * B, T, S, N, K, H)
  case = CASES["segments"]
  cfg = ref.config(case, **TILES)
  seg_q = jnp.asarray(np.concatenate([case.q_segment_ids] * 3))
  seg_k = jnp.asarray(np.concatenate([case.kv_segment_ids] * 3))
  split = lambda x: x.reshape(3, B, *x.shape[1:])

  def loss(q, k, v, sq, sk, qo):
    mask = jax_ring.BlockMask(q_offset=qo, q_segment_ids=sq,
                              kv_segment_ids=sk)
    out, lse = kernel.attention(q, k, v, None, mask, cfg)
    return jnp.sum(out * do[:B]) + jnp.sum(lse)

  grad = jax.grad(loss, argnums=(0, 1, 2))
  one = jax.jit(grad)  # per instance: one program for the six
  # Offsets unbatched (fold into B) and batched (map over the axis).
  for qo in (jnp.zeros((), jnp.int32), jnp.array([0, 3, 5], jnp.int32)):
    in_axes = (0, 0, 0, 0, 0, None if qo.ndim == 0 else 0)
    got = jax.jit(jax.vmap(grad, in_axes))(split(q), split(k), split(v),
                                           split(seg_q), split(seg_k), qo)
    for i in range(3):
      qi = qo if qo.ndim == 0 else qo[i]
      want = one(split(q)[i], split(k)[i], split(v)[i], split(seg_q)[i],
                 split(seg_k)[i], qi)
      for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b),
                                   rtol=1e-5, atol=1e-5)


def test_vmap_bias_gradient_is_per_instance():
  q, k, v, do = ref.random_qkv(16, B, T, S, N, K, H)
  cfg = ref.config(CASES["causal"], **TILES)
  bias = jax.random.normal(jax.random.key(17), (1, N, T, S))
  scales = jnp.array([0.5, 1.0, 2.0])

  def loss(c, bias):
    out, _ = kernel.attention(q * c, k, v, bias, jax_ring.BlockMask(), cfg)
    return jnp.sum(out * do)

  grad = jax.grad(loss, argnums=1)
  got = jax.jit(jax.vmap(grad, (0, None)))(scales, bias)
  one = jax.jit(grad)  # per instance: one program for the three
  for i, c in enumerate(scales):
    np.testing.assert_allclose(np.asarray(got[i]), np.asarray(one(c, bias)),
                               rtol=1e-5, atol=1e-6)


def test_runs_are_bitwise_deterministic():
  """Two runs of one program, forward and backward."""
  q, k, v, do = ref.random_qkv(18, B, T, S, N, K, H)
  case = CASES["everything"]
  cfg = ref.config(case, **TILES)

  @jax.jit
  def run(q, k, v, mask):
    out, vjp = jax.vjp(lambda q, k, v: kernel.attention(q, k, v, None, mask,
                                                        cfg), q, k, v)
    return out, vjp((do, jnp.zeros_like(out[1])))

  a, b = (run(q, k, v, ref.block_mask(case)) for _ in range(2))
  chex.assert_trees_all_equal(a, b, strict=True)


def test_eager_primitive_matches_jit():
  q, k, v, do = ref.random_qkv(19, B, T, S, N, K, H)
  cfg = ref.config(CASES["causal"], **TILES)
  eager = kernel.attention(q, k, v, None, jax_ring.BlockMask(), cfg)
  jitted = jax.jit(functools.partial(kernel.attention, config=cfg))(
      q, k, v, None, jax_ring.BlockMask())
  chex.assert_trees_all_equal(eager, jitted)


def test_vmap_leaves_a_prepared_mask_to_the_backend():
  """A block mask carrying its backend's ``prepared`` operands (one
  block's, not a vmapped batch's) drops them under vmap, forward and
  backward: the batched call prepares its own, and the results are the
  call's without them."""
  q, k, v, do = ref.random_qkv(16, 3 * B, T, S, N, K, H)
  case = CASES["segments"]
  cfg = ref.config(case, **TILES)
  ids = [jnp.asarray(np.concatenate([x] * 3)).reshape(3, B, -1)
         for x in (case.q_segment_ids, case.kv_segment_ids)]
  split = lambda x: x.reshape(3, B, *x.shape[1:])

  def both(prepared, q, k, v, do, sq, sk):
    mask = jax_ring.BlockMask(q_segment_ids=sq, kv_segment_ids=sk,
                              prepared={"ids": sq[:1]} if prepared else None)
    out, lse = kernel.forward(q, k, v, None, mask, cfg)
    return out, kernel.backward(q, k, v, None, mask, out, lse, do, None,
                                cfg)[:3]

  args = tuple(map(split, (q, k, v, do))) + tuple(ids)
  got, want = (jax.jit(jax.vmap(functools.partial(both, p)))(*args)
               for p in (True, False))
  chex.assert_trees_all_equal(got, want)


def test_the_public_contract_refuses_a_prepared_mask():
  """``mask.prepared`` is the library's, computed from the same block for
  its own calls: ``jax_ring.attention`` and ``attention_backward`` refuse
  a mask that carries one, before anything runs."""
  q, k, v, do = ref.random_qkv(17, B, T, S, N, K, H)
  cfg = ref.config(CASES["causal"], **TILES)
  mask = jax_ring.BlockMask(prepared={"index": jnp.zeros((), jnp.int32)})
  with pytest.raises(ValueError, match=r"attention: mask\.prepared"):
    jax_ring.attention(q, k, v, None, mask, cfg)
  out = jnp.zeros(q.shape, q.dtype)
  lse = jnp.zeros(q.shape[:3], jnp.float32)
  with pytest.raises(ValueError, match=r"attention_backward: mask\.prep"):
    jax_ring.attention_backward(q, k, v, None, mask, out, lse, do, None,
                                cfg)
