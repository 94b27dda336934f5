"""cuDNN backend against the float64 reference and jax.nn's cuDNN path.

GPU only: on a machine without a GPU every test here is skipped (the CPU
suite checks the cuDNN mask mapping in test_cudnn_band.py). On a GPU the
extension must be built (JAX_RING_CUDNN=ON pip install ...), else they fail.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
from jax_ring._src.backends import cudnn
from jax_ring._src.backends.cudnn import packed
from jax_ring._src.core import kernel
import helpers
import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu",
                                 reason="needs an NVIDIA GPU")]

B, T, S, N, K, H = 2, 197, 229, 8, 2, 64
SCALE = 0.125
LENGTHS = dict(q_lengths=np.array([150, 197], np.int32),
               kv_lengths=np.array([90, 229], np.int32))
CASES = {
    "full": ref.Case(SCALE),
    "causal": ref.Case(SCALE, is_causal=True),
    "causal_q_after_kv": ref.Case(SCALE, is_causal=True, q_offset=40),
    "causal_kv_after_q": ref.Case(SCALE, is_causal=True, kv_offset=31),
    "window": ref.Case(SCALE, window=(17, 5)),
    "window_causal_offset": ref.Case(SCALE, is_causal=True, window=(50, 0),
                                     q_offset=70, kv_offset=9),
    "padding": ref.Case(SCALE, **LENGTHS),
    "padding_causal_offset": ref.Case(SCALE, is_causal=True, q_offset=12,
                                      **LENGTHS),
    "soft_cap": ref.Case(SCALE * 4, soft_cap=2.0),
    "soft_cap_causal": ref.Case(SCALE * 4, soft_cap=2.0, is_causal=True),
    "soft_cap_window_offset": ref.Case(SCALE * 4, soft_cap=2.0,
                                       is_causal=True, window=(50, 0),
                                       q_offset=70, kv_offset=9),
}


def test_extension_is_loaded():
  assert cudnn.LOAD_ERROR is None, cudnn.LOAD_ERROR


def run(q, k, v, do, case, implementation="cudnn"):
  cfg = ref.config(case).replace(implementation=implementation)
  mask = ref.block_mask(case)

  def f(q, k, v):
    # lse as aux, so its cotangent is a symbolic zero: a concrete zero
    # would send the backward to xla (cuDNN has no lse-cotangent input).
    out, vjp, lse = jax.vjp(
        lambda q, k, v: kernel.attention(q, k, v, None, mask, cfg), q, k, v,
        has_aux=True)
    return out, lse, vjp(do)

  hlo = jax.jit(f).lower(q, k, v).as_text()
  if implementation == "cudnn":
    assert "jax_ring_sdpa_fwd" in hlo and "jax_ring_sdpa_bwd" in hlo
  return jax.jit(f)(q, k, v)


def check(q, k, v, do, case):
  out, lse, (dq, dk, dv) = run(q, k, v, do, case)
  r_out, r_lse, r_g = ref.attention(q, k, v, case, dout=do)
  dt = q.dtype
  ref.assert_close(out, r_out, dt, "out")
  ref.assert_close(lse, r_lse, dt, "lse")
  for name, got in (("q", dq), ("k", dk), ("v", dv)):
    ref.assert_close(got, r_g[name], dt, "d" + name)


@pytest.mark.parametrize("name", list(CASES))
def test_mask_cases(name):
  q, k, v, do = ref.random_qkv(1, B, T, S, N, K, H, jnp.bfloat16)
  check(q, k, v, do, CASES[name])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("groups", [1, 2, 4, 8])
def test_dtypes_heads_gqa(dtype, head_dim, groups):
  q, k, v, do = ref.random_qkv(2, 1, 160, 160, 2 * groups, 2, head_dim, dtype)
  check(q, k, v, do, ref.Case(head_dim**-0.5, is_causal=True))


def test_backward_from_external_global_out_and_lse():
  q, k, v, do = ref.random_qkv(3, B, T, S, N, K, H, jnp.bfloat16)
  case = ref.Case(SCALE, is_causal=True, q_offset=S - T)
  cfg = ref.config(case).replace(implementation="cudnn")
  cut = 101
  parts = [(slice(0, cut), 0), (slice(cut, S), cut)]
  outs = [kernel.attention(q, k[:, sl], v[:, sl], None,
                           jax_ring.BlockMask(q_offset=S - T, kv_offset=off),
                           cfg) for sl, off in parts]
  (o1, l1), (o2, l2) = outs
  lse = jnp.logaddexp(l1, l2)
  out = (o1 * jnp.exp(l1 - lse)[..., None] +
         o2 * jnp.exp(l2 - lse)[..., None]).astype(q.dtype)
  grads = [kernel.attention_backward(
      q, k[:, sl], v[:, sl], None,
      jax_ring.BlockMask(q_offset=S - T, kv_offset=off), out, lse, do, None,
      cfg) for sl, off in parts]
  r_out, r_lse, r_g = ref.attention(q, k, v, case, dout=do)
  ref.assert_close(out, r_out, q.dtype, "merged out")
  ref.assert_close(grads[0][0] + grads[1][0], r_g["q"], q.dtype, "dq")
  ref.assert_close(jnp.concatenate([g[1] for g in grads], 1), r_g["k"],
                   q.dtype, "dk")
  ref.assert_close(jnp.concatenate([g[2] for g in grads], 1), r_g["v"],
                   q.dtype, "dv")


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(),
                                dict(local_window_size=(64, 0),
                                     is_causal=True)],
                         ids=["causal", "full", "window"])
def test_matches_jax_nn_cudnn(kw):
  q, k, v, do = ref.random_qkv(4, 2, 256, 256, 8, 8, 128, jnp.bfloat16)

  def grads(fn):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(do)

  ours = jax.jit(lambda: grads(lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, implementation="cudnn", **kw)))()
  theirs = jax.jit(lambda: grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, implementation="cudnn", **kw)))()
  for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
    ref.assert_close(a, np.asarray(b.astype(jnp.float32)), q.dtype, name)


def test_default_implementation_lowers_to_the_ffi_call():
  q, k, v, _ = ref.random_qkv(5, 1, 128, 128, 4, 4, 64, jnp.bfloat16)
  loss = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True).astype(jnp.float32).sum()
  hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().as_text()
  assert "jax_ring_sdpa_fwd" in hlo and "jax_ring_sdpa_bwd" in hlo


def test_workspace_of_the_recorded_calls():
  """The traced forward and backward calls are recorded, and each one's
  graph reports its workspace (built as for a run)."""
  q, k, v, _ = ref.random_qkv(6, 1, 1024, 1024, 4, 2, 64, jnp.bfloat16)
  loss = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True).astype(jnp.float32).sum()
  jax.clear_caches()
  with cudnn.recording() as calls:
    jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v)
  assert [c["backward"] for c in calls] == [False, True]
  sizes = [cudnn.workspace_bytes(c) for c in calls]
  assert all(isinstance(x, int) and x >= 0 for x in sizes), sizes


@pytest.mark.parametrize("name", ["causal", "causal_kv_after_q",
                                  "padding_causal_offset"])
def test_stacked_dkv_backward_writes_the_same_grads(name):
  """The ring's backward target writes dK/dV into one stacked buffer: the
  same bits as the two-buffer target (masked columns included)."""
  q, k, v, do = ref.random_qkv(11, B, T, S, N, K, H, jnp.bfloat16)
  case = CASES[name]
  cfg = ref.config(case).replace(implementation="cudnn")
  mask = ref.block_mask(case)
  out, lse = kernel.attention(q, k, v, None, mask, cfg)

  def both(q, k, v):
    args = (q, k, v, None, mask, out, lse, do, None, cfg)
    dq, dkv, _ = kernel.attention_backward_dkv(*args)
    pair = kernel.attention_backward(*args)
    return dq, dkv, pair[0], jnp.stack(pair[1:3])

  assert "jax_ring_sdpa_bwd_dkv" in jax.jit(both).lower(q, k, v).as_text()
  dq, dkv, dq2, dkv2 = jax.jit(both)(q, k, v)
  np.testing.assert_array_equal(np.asarray(dkv), np.asarray(dkv2))
  np.testing.assert_array_equal(np.asarray(dq), np.asarray(dq2))
  _, _, r_g = ref.attention(q, k, v, case, dout=do)
  ref.assert_close(dkv[0], r_g["k"], q.dtype, "dk")
  ref.assert_close(dkv[1], r_g["v"], q.dtype, "dv")


def test_calls_run_inside_cuda_graph_conditionals():
  """The handlers may be traced into command buffers: a lax.switch over
  cuDNN forward and backward calls, compiled with conditionals as CUDA-graph
  nodes (no host round trip), gives bit for bit what it gives with command
  buffers off, and matches the float64 reference."""
  q, k, v, do = ref.random_qkv(9, 1, 320, 320, 4, 2, 64, jnp.bfloat16)
  cases = [ref.Case(SCALE, is_causal=True), ref.Case(SCALE)]

  def f(q, k, v, i):
    branch = lambda causal: lambda q, k, v: jax.vjp(
        lambda q, k, v: jax_ring.dot_product_attention(
            q, k, v, scale=SCALE, is_causal=causal), q, k, v)[1](do)
    return jax.lax.switch(i, [branch(True), branch(False)], q, k, v)

  graphs = jax.jit(f, compiler_options={
      "xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,CONDITIONAL",
      "xla_gpu_graph_min_graph_size": 1})
  plain = jax.jit(f, compiler_options={"xla_gpu_enable_command_buffer": ""})
  for i, case in enumerate(cases):
    got, want = graphs(q, k, v, i), plain(q, k, v, i)
    _, _, r_g = ref.attention(q, k, v, case, dout=do)
    for name, a, b in zip("qkv", got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      ref.assert_close(a, r_g[name], q.dtype, "d" + name)


def test_memory_analysis_counts_the_workspace():
  """XLA allocates each call's workspace (its last result), so the compiled
  program's temporaries hold at least the backward's workspace."""
  q, k, v, _ = ref.random_qkv(10, 1, 4096, 4096, 8, 8, 128, jnp.bfloat16)
  loss = lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True).astype(jnp.float32).sum()
  jax.clear_caches()
  with cudnn.recording() as calls:
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
  need = max(cudnn.workspace_bytes(c) for c in calls if c["backward"])
  assert need > 0
  assert compiled.memory_analysis().temp_size_in_bytes >= need


def test_packed_backward_workspace_is_bounded_by_the_rows():
  """Packed documents run as ragged virtual batches of their length class;
  the backward's workspace stays that of the dense call (the rows'
  tokens), not the virtual batches' total."""
  q, k, v, _ = ref.random_qkv(8, 1, 8192, 8192, 4, 4, 128, jnp.bfloat16)
  ids = jnp.repeat(jnp.arange(3, dtype=jnp.int32),
                   jnp.array([3000, 4000, 1192]),
                   total_repeat_length=8192)[None]

  def backward_workspace(**kw):
    loss = lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn",
        **kw).astype(jnp.float32).sum()
    jax.clear_caches()
    with cudnn.recording() as calls:
      jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v)
    return max(cudnn.workspace_bytes(c) for c in calls if c["backward"])

  dense, packed = backward_workspace(), backward_workspace(segment_ids=ids)
  assert packed <= 2 * dense + (64 << 20), (packed, dense)


def test_soft_cap_with_padding_falls_back_with_a_reason():
  q, k, v, _ = ref.random_qkv(7, 2, 64, 64, 4, 4, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="logits_soft_cap with padding"):
    jax_ring.dot_product_attention(
        q, k, v, logits_soft_cap=2.0, implementation="cudnn",
        key_value_seq_lengths=np.array([30, 64], np.int32))


def test_float32_falls_back_to_xla_and_explicit_cudnn_says_why():
  q, k, v, _ = ref.random_qkv(6, 1, 64, 64, 4, 4, 64, jnp.float32)
  hlo = jax.jit(jax_ring.dot_product_attention).lower(q, k, v).as_text()
  assert "jax_ring_sdpa_fwd" not in hlo
  with pytest.raises(ValueError, match="does not support dtype float32"):
    jax_ring.dot_product_attention(q, k, v, implementation="cudnn")


P_T = 301  # odd; documents of random lengths


def _striped(seed, r, src, cp=2):
  """Query ids of device r and key ids of device src in the striped layout
  of packed global ids: a striped ring step's block."""
  ids = ref.random_segments(seed, B, P_T * cp, 9)
  return ids[:, r::cp], ids[:, src::cp]


PACKED = {
    # name: (q ids, kv ids or None = the same array, case kwargs)
    "same_full": (ref.random_segments(8, B, P_T, 6), None, {}),
    "same_causal": (ref.random_segments(9, B, P_T, 9), None,
                    dict(is_causal=True)),
    # Ids spread far apart: decided by the sort's branch (fits.by_sort).
    "same_window_causal": (ref.spread(ref.random_segments(10, B, P_T, 4)),
                           None, dict(is_causal=True, window=(40, 0))),
    "different_full": (ref.spread(ref.random_segments(11, B, P_T, 5)),
                       ref.spread(ref.random_segments(12, B, P_T, 7)), {}),
    # The striped ring's steps: keys of the next device (strict diagonal,
    # kv_offset 1) and of the previous one (inclusive).
    "striped_causal_next": (*_striped(16, 0, 1), dict(is_causal=True,
                                                      kv_offset=1)),
    "striped_causal_previous": (*_striped(17, 1, 0), dict(is_causal=True)),
    # Many documents in a row (31 and 61; 50; 80), the window and the
    # striped steps among them: in several length classes and
    # loops of calls.
    "many_causal": (np.arange(P_T, dtype=np.int32)[None].repeat(B, 0) //
                    np.array([[10], [5]], np.int32), None,
                    dict(is_causal=True)),
    "many_window_causal": (ref.random_segments(18, B, P_T, 50), None,
                           dict(is_causal=True, window=(7, 0))),
    # Documents of 40 and 33 tokens, seeing forward: the 64-token tiles.
    "short_full": (np.arange(P_T, dtype=np.int32)[None].repeat(B, 0) //
                   np.array([[40], [33]], np.int32), None, {}),
    "many_striped_causal_next": (
        *(ids[:, r::2] for ids in [ref.random_segments(19, B, 2 * P_T, 80)]
          for r in (0, 1)), dict(is_causal=True, kv_offset=1)),
}


@pytest.mark.parametrize("name, smallest, path", [
    (name, smallest, path) for name in PACKED for smallest in (32, 16)
    for path in ("pass", "calls")] + [
        (name, 32, path) for name in PACKED
        for path in ("tiles", "tiles_pallas", "tiles_direct")])
def test_packed_documents_through_ragged_offsets(name, smallest, path,
                                                 monkeypatch):
  """Packed rows through the length classes' ragged calls (SMALLEST = 16:
  classes 16, 64, 256, 301; 32: 32, 128, 301; class 0's menu and loops of
  calls), every served mask, against the float64 reference: one handler a
  pass without tiles, the calls' switch and loop, and the
  pass with its tiles' branch (which takes the rows of one id array whose
  documents all fit a tile: ``many_causal``, ``many_window_causal``,
  ``short_full``) as XLA's products (``tiles``) or as the Pallas kernels
  (``tiles_pallas``: 128-token tiles too, taking every longer
  document); and the Pallas tiles of 64 with no switch (``tiles_direct``,
  ``tiles.DIRECT``: every block, one id array or two, at its offsets)."""
  import ragged_cudnn
  from jax_ring._src.backends.cudnn import passes, tiles
  monkeypatch.setattr(packed, "SMALLEST", smallest)
  monkeypatch.setattr(passes, "ENABLED", path != "calls")
  if path == "tiles_pallas":  # every block of one id array, any lengths
    monkeypatch.setattr(tiles, "KERNEL", "pallas")
    monkeypatch.setattr(tiles, "SIZES", (32, 64, 128))
    monkeypatch.setattr(tiles, "PALLAS_REACH", P_T)
  elif path == "tiles":  # the XLA form (the default's where Pallas is not)
    monkeypatch.setattr(tiles, "KERNEL", "xla")
  elif path == "tiles_direct":
    monkeypatch.setattr(tiles, "DIRECT", True)
    monkeypatch.setattr(tiles, "SIZES", (64,))
  else:
    monkeypatch.setattr(tiles, "SIZES", ())
  one_handler = path != "calls"
  q_ids, kv_ids, kw = PACKED[name]
  q, k, v, do = ref.random_qkv(13, B, P_T, P_T, N, K, 128, jnp.bfloat16)
  case = ref.Case(128**-0.5, q_segment_ids=q_ids,
                  kv_segment_ids=q_ids if kv_ids is None else kv_ids, **kw)
  cfg = ref.config(case).replace(implementation="cudnn")
  # Ids are arguments, not constants that XLA could fold the check into.
  ids = (jnp.asarray(q_ids), None if kv_ids is None else jnp.asarray(kv_ids))

  def f(q, k, v, ids):
    q_ids, kv_ids = ids
    mask = jax_ring.BlockMask(
        q_offset=case.q_offset, kv_offset=case.kv_offset, q_segment_ids=q_ids,
        kv_segment_ids=q_ids if kv_ids is None else kv_ids)
    out, vjp, lse = jax.vjp(
        lambda q, k, v: kernel.attention(q, k, v, None, mask, cfg), q, k, v,
        has_aux=True)
    return out, lse, vjp(do)

  hlo = jax.jit(f).lower(q, k, v, ids).as_text()
  one_array = kv_ids is None and not kw.get("kv_offset")
  direct = path == "tiles_direct"
  assert ("jax_ring_sdpa_fwd" in hlo and "jax_ring_sdpa_bwd" in hlo) != direct
  assert ("jax_ring_sdpa_fwd_pass" in hlo) == (one_handler and not direct)
  if (path == "tiles_pallas" and one_array) or direct:
    assert "jax_ring_band_tiles" in hlo
  # Which branch runs: cuDNN (one call, or several) wherever the ids fit.
  mask = jax_ring.BlockMask(
      q_offset=case.q_offset, kv_offset=case.kv_offset, q_segment_ids=ids[0],
      kv_segment_ids=ids[0] if kv_ids is None else ids[1])
  shift = packed.diagonal_shift(cfg, mask)
  fits = packed.layout(mask.q_segment_ids, mask.kv_ids(), shift)
  calls = packed.calls(packed.documents(
      mask.q_segment_ids, mask.kv_ids(), shift, same=kv_ids is None), P_T,
                       P_T)
  assert bool(fits) and int(calls) >= 1
  if kv_ids is None and not kw.get("kv_offset"):
    assert int(calls) == ragged_cudnn.expected_calls(q_ids, smallest, P_T)
  out, lse, (dq, dk, dv) = jax.jit(f)(q, k, v, ids)
  r_out, r_lse, r_g = ref.attention(q, k, v, case, dout=do)
  ref.assert_close(out, r_out, q.dtype, "out")
  ref.assert_close(lse, r_lse, q.dtype, "lse")
  for gname, got in (("q", dq), ("k", dk), ("v", dv)):
    ref.assert_close(got, r_g[gname], q.dtype, "d" + gname)


@pytest.mark.parametrize("fill", [float("nan"), float("-inf")])
@pytest.mark.parametrize("name", ["many_window_causal",
                                  "many_striped_causal_next"])
def test_the_pass_backward_reads_no_stats_past_a_documents_rows(
    name, fill, monkeypatch):
  """The pass's backward leaves its stats undefined past each document's
  rows in its virtual batch (``ffi.uninitialized``): cuDNN does not read
  them, so with them NaN or -inf the packed rows stay exact."""
  from jax_ring._src.backends.cudnn import ffi
  monkeypatch.setattr(ffi, "uninitialized",
                      lambda shape, dtype: jnp.full(shape, fill, dtype))
  test_packed_documents_through_ragged_offsets(name, 16, "pass", monkeypatch)


def test_packed_causal_api_default_picks_cudnn():
  q, k, v, _ = ref.random_qkv(14, 1, 256, 256, 4, 4, 64, jnp.bfloat16)
  ids = jnp.asarray(ref.random_segments(15, 1, 256, 3))
  hlo = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids)).lower(q, k, v).as_text()
  assert "jax_ring_sdpa_fwd" in hlo


@pytest.mark.parametrize("where", ["q_nan", "k_nan", "k_inf"])
def test_non_finite_inputs_propagate_as_in_jax_nn(where):
  """cuDNN's blocks: the rows whose visible logits hold a NaN or an Inf are
  NaN, exactly jax.nn's rows (causal, packed documents), never zeros."""
  q, k, v, _ = ref.random_qkv(5, 2, 128, 128, 8, 2, 64, jnp.bfloat16)
  q, k = np.array(q.astype(jnp.float32)), np.array(k.astype(jnp.float32))
  if where == "q_nan":
    q[0, 40, 3, 7] = np.nan
  else:
    k[1, 70, 1, 2] = np.nan if where == "k_nan" else np.inf
  q, k = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
  ids = jnp.asarray(np.repeat([1, 2], 64)[None].repeat(2, 0), jnp.int32)
  ours = jax.jit(lambda q, k, v: jax_ring.dot_product_attention(
      q, k, v, is_causal=True, segment_ids=ids, implementation="cudnn"))(
          q, k, v)
  theirs = jax.nn.dot_product_attention(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
      is_causal=True, mask=(ids[:, :, None] == ids[:, None, :])[:, None],
      implementation="xla")
  nan_ours = np.isnan(np.asarray(ours.astype(jnp.float32)))
  nan_theirs = np.isnan(np.asarray(theirs))
  assert nan_theirs.any()
  np.testing.assert_array_equal(nan_ours, nan_theirs)


@pytest.mark.parametrize("name", ["causal", "window", "padding", "packed"])
def test_sinks_fold_around_cudnn_blocks(name):
  """Sinks on one device: cuDNN's forward and backward run (both FFI calls
  in the program), the sink folded outside them, equal to the float64
  reference in every gradient, the sinks' included."""
  ids = ref.random_segments(7, B, T, 3)
  kw, case = {
      "causal": (dict(is_causal=True), ref.Case(SCALE, is_causal=True)),
      "window": (dict(local_window_size=(17, 5)),
                 ref.Case(SCALE, window=(17, 5))),
      "padding": (dict(query_seq_lengths=LENGTHS["q_lengths"],
                       key_value_seq_lengths=LENGTHS["kv_lengths"]),
                  ref.Case(SCALE, **LENGTHS)),
      "packed": (dict(is_causal=True, segment_ids=ids),
                 ref.Case(SCALE, is_causal=True, q_segment_ids=ids,
                          kv_segment_ids=ids)),
  }[name]
  t = T
  s = T if name == "packed" else S
  q, k, v, do = ref.random_qkv(8, B, t, s, N, K, H, jnp.bfloat16)
  sinks = jnp.linspace(-1.0, 2.0, N, dtype=jnp.float32)
  f = jax.jit(lambda q, k, v, sk: jax.vjp(
      lambda q, k, v, sk: jax_ring.dot_product_attention(
          q, k, v, sinks=sk, scale=SCALE, implementation="cudnn", **kw),
      q, k, v, sk)[1](do))
  hlo = f.lower(q, k, v, sinks).as_text()
  assert "jax_ring_sdpa_fwd" in hlo and "jax_ring_sdpa_bwd" in hlo
  out = jax_ring.dot_product_attention(q, k, v, sinks=sinks, scale=SCALE,
                                       implementation="cudnn", **kw)
  dq, dk, dv, ds = f(q, k, v, sinks)
  r_out, _, r_g = ref.attention(q, k, v, case, dout=do, sinks=sinks)
  ref.assert_close(out, r_out, jnp.bfloat16, "out")
  for what, got in (("q", dq), ("k", dk), ("v", dv), ("sinks", ds)):
    ref.assert_close(got, r_g[what], jnp.bfloat16, "d" + what)


# Multi-head latent attention: a value head dim Hv unlike the query/key head
# dim H (DeepSeek-V3: 192 and 128), and another pair cuDNN serves.
HEAD_DIMS = {"h192_v128": (192, 128), "h128_v64": (128, 64)}


def unlike_heads_problem(name, h, hv, seed):
  """(q, k, v, dout of head dims H and Hv, GQA 8 x 2; the reference Case of
  mask ``name``)."""
  ids = ref.random_segments(seed, B, T, 4)
  s = T if name == "packed" else S
  scale = h**-0.5
  case = {
      "causal": ref.Case(scale, is_causal=True),
      "sliding_window": ref.Case(scale, is_causal=True, window=(40, 0)),
      "padding": ref.Case(scale, **LENGTHS),
      "packed": ref.Case(scale, is_causal=True, q_segment_ids=ids,
                         kv_segment_ids=ids),
  }[name]
  return ref.random_qkv(seed, B, T, s, N, K, h, jnp.bfloat16, hv=hv), case


@pytest.mark.parametrize("dims", list(HEAD_DIMS))
@pytest.mark.parametrize("name", ["causal", "sliding_window", "padding",
                                  "packed"])
def test_value_head_dim_unlike_the_keys(name, dims):
  """Forward and every gradient with Hv != H against the float64
  reference, the compiled program holding cuDNN's forward and backward
  calls, each traced with those head dims."""
  h, hv = HEAD_DIMS[dims]
  (q, k, v, do), case = unlike_heads_problem(name, h, hv, 31)
  cfg = ref.config(case).replace(implementation="cudnn")
  # Ids are arguments, not constants that XLA could fold the check into.
  ids = None if case.q_segment_ids is None else jnp.asarray(case.q_segment_ids)

  def f(q, k, v, ids):
    mask = ref.block_mask(case) if ids is None else jax_ring.BlockMask(
        q_segment_ids=ids, kv_segment_ids=ids)
    out, vjp, lse = jax.vjp(
        lambda q, k, v: kernel.attention(q, k, v, None, mask, cfg), q, k, v,
        has_aux=True)
    return out, lse, vjp(do)

  jax.clear_caches()
  with cudnn.recording() as calls:
    compiled = jax.jit(f).lower(q, k, v, ids).compile()
  hlo = compiled.as_text()
  assert "jax_ring_sdpa_fwd" in hlo and "jax_ring_sdpa_bwd" in hlo
  assert {(c["q"][3], c["k"][3], c["v"][3]) for c in calls} == {(h, h, hv)}
  out, lse, (dq, dk, dv) = compiled(q, k, v, ids)
  r_out, r_lse, r_g = ref.attention(q, k, v, case, dout=do)
  assert out.shape == q.shape[:3] + (hv,)
  ref.assert_close(out, r_out, q.dtype, "out")
  ref.assert_close(lse, r_lse, q.dtype, "lse")
  for gname, got in (("q", dq), ("k", dk), ("v", dv)):
    ref.assert_close(got, r_g[gname], q.dtype, "d" + gname)


def test_sinks_with_value_head_dim_unlike_the_keys():
  """Sinks folded around cuDNN blocks of H = 192, Hv = 128, through the
  public function: every gradient, the sinks' included."""
  (q, k, v, do), case = unlike_heads_problem("causal", 192, 128, 32)
  sinks = jnp.linspace(-1.0, 2.0, N, dtype=jnp.float32)
  attend = lambda q, k, v, sk: jax_ring.dot_product_attention(
      q, k, v, sinks=sk, is_causal=True, implementation="cudnn")
  f = jax.jit(lambda q, k, v, sk: jax.vjp(attend, q, k, v, sk)[1](do))
  hlo = f.lower(q, k, v, sinks).compile().as_text()
  assert "jax_ring_sdpa_fwd" in hlo and "jax_ring_sdpa_bwd" in hlo
  out = jax.jit(attend)(q, k, v, sinks)
  dq, dk, dv, ds = f(q, k, v, sinks)
  r_out, _, r_g = ref.attention(q, k, v, case, dout=do, sinks=sinks)
  ref.assert_close(out, r_out, jnp.bfloat16, "out")
  for what, got in (("q", dq), ("k", dk), ("v", dv), ("sinks", ds)):
    ref.assert_close(got, r_g[what], jnp.bfloat16, "d" + what)


def test_head_dims_cudnn_cannot_take_fall_back_with_a_reason():
  """Hv = 132 (not a multiple of 8): the default runs the pure-JAX blocks,
  an explicit ``implementation="cudnn"`` names both head dims."""
  q, k, v, _ = ref.random_qkv(33, 1, 64, 64, 4, 2, 192, jnp.bfloat16, hv=132)
  hlo = jax.jit(jax_ring.dot_product_attention).lower(q, k, v).as_text()
  assert "jax_ring_sdpa_fwd" not in hlo
  with pytest.raises(ValueError, match="does not support query/key head dim "
                     "192 with value head dim 132"):
    jax_ring.dot_product_attention(q, k, v, implementation="cudnn")


def test_pallas_tiles_inside_shard_map(monkeypatch):
  """The tiles' Pallas kernels inside ``shard_map`` (the ring's and
  Ulysses' blocks are there), one GPU per row of a 1-device mesh: out and
  every gradient equal the float64 reference's."""
  from jax.sharding import PartitionSpec as Spec
  from jax_ring._src.backends.cudnn import tiles
  monkeypatch.setattr(tiles, "KERNEL", "pallas")
  monkeypatch.setattr(tiles, "SIZES", (32, 64, 128))
  ids = np.arange(P_T, dtype=np.int32)[None].repeat(B, 0) // np.array(
      [[100], [37]], np.int32)
  q, k, v, do = ref.random_qkv(21, B, P_T, P_T, N, K, 128, jnp.bfloat16)
  case = ref.Case(128**-0.5, q_segment_ids=ids, kv_segment_ids=ids,
                  is_causal=True)
  mesh = helpers.mesh(1)

  def f(q, k, v, ids, do):
    out, vjp = jax.vjp(lambda q, k, v: jax_ring.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=ids, scale=128**-0.5,
        implementation="cudnn"), q, k, v)
    return out, vjp(do)

  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=Spec("cp"),
                            out_specs=Spec("cp")))
  args = (q, k, v, jnp.asarray(ids), do)
  assert "jax_ring_band_tiles" in g.lower(*args).as_text()
  helpers.check(g(*args), q, k, v, do, case)


@pytest.mark.parametrize("two", [False, True], ids=["one_ids", "two_ids"])
def test_ring_prepares_the_own_packed_pass(monkeypatch, two):
  """The ring on contiguous shards of 2 GPUs, packed rows whose documents
  cross the shards, with one id array and with the keys' own (document 3's
  keys renamed: its queries see none): the own block's pass gets its
  tables and branch index computed before the reach test's branch
  (``mask.prepared``), and out and every gradient equal the float64
  reference's."""
  from jax.sharding import PartitionSpec as Spec
  seen = helpers.prepared_passes(monkeypatch)
  t = 2048
  ids = np.repeat(np.arange(7), [300, 500, 260, 400, 200, 188, 200])[None]
  kv_ids = np.where(ids == 3, 9, ids) if two else ids
  q, k, v, do = ref.random_qkv(22, 1, t, t, 8, 4, 128, jnp.bfloat16)
  case = ref.Case(128**-0.5, q_segment_ids=ids, kv_segment_ids=kv_ids,
                  is_causal=True)
  seg = (jnp.asarray(ids), jnp.asarray(kv_ids)) if two else jnp.asarray(ids)
  spec = Spec(None, "cp")
  f = jax.shard_map(
      lambda q, k, v, s: jax_ring.ring_attention(
          q, k, v, axis_name="cp", is_causal=True, segment_ids=s,
          implementation="cudnn"), mesh=helpers.mesh(2),
      in_specs=(spec,) * 3 + (jax.tree.map(lambda _: spec, seg),),
      out_specs=spec)
  got = helpers.layout_vjp(f, 2, None, q, k, v, do, seg)
  assert set(seen) == {"forward", "backward"}, seen
  helpers.check(got, q, k, v, do, case)


def test_calls_run_again_replay_as_cuda_graphs():
  """A packed pass run again on the same buffers replays each cuDNN call
  as one CUDA graph (``csrc/graphs.h``: recorded at its second run on the
  same pointers, launched from its third). The graphs read the tables'
  values when they run: new documents of the same length classes (the
  same calls on the same pointers, other lengths and offsets) replay
  exactly. Out and every gradient equal the float64 reference's, replayed,
  with new values, and with the replays switched off."""
  t = 1024
  f = jax.jit(lambda q, k, v, do, ids: (lambda out, pull: (out, pull(do)))(
      *jax.vjp(lambda q, k, v: jax_ring.dot_product_attention(
          q, k, v, is_causal=True, segment_ids=ids, implementation="cudnn"),
               q, k, v)))
  q, k, v, do = ref.random_qkv(23, 1, t, t, 8, 2, 128, jnp.bfloat16)

  def check(lengths, replayed, warm=3):
    """Runs f on documents of ``lengths`` ``warm`` times, results dropped
    (their buffers free for the next run), then once more against the
    reference; ``replayed``: whether that run must launch graphs."""
    ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None])
    for _ in range(warm):
      jax.block_until_ready(f(q, k, v, do, ids))
    launched = cudnn.graph_counts()["launched"]
    got = f(q, k, v, do, ids)
    assert (cudnn.graph_counts()["launched"] > launched) == replayed
    case = ref.Case(128**-0.5, q_segment_ids=ids, kv_segment_ids=ids,
                    is_causal=True)
    helpers.check(got, q, k, v, do, case)

  assert "jax_ring_sdpa_bwd_pass" in f.lower(
      q, k, v, do, jnp.zeros((1, t), jnp.int32)).as_text()
  unsupported = cudnn.graph_counts()["unsupported"]
  check((300, 500, 224), replayed=True)
  # Three documents of class 512 again: the graphs recorded above.
  check((424, 200, 400), replayed=True, warm=0)
  q, k, v, do = ref.random_qkv(24, 1, t, t, 8, 2, 128, jnp.bfloat16)
  check((100, 60, 200, 64, 600), replayed=True)
  try:
    cudnn.use_graphs(False)
    check((300, 500, 224), replayed=False, warm=0)
  finally:
    cudnn.use_graphs(True)
  assert cudnn.graph_counts()["unsupported"] == unsupported


def test_a_block_given_its_pass_ahead_with_two_id_arrays():
  """A block's pass given its tables and index ahead (``kernel.prepare``,
  then ``mask.prepared``: what the ring's own block gets), the ids a
  (query, key) pair (document 3's keys renamed: its queries see none):
  out and every gradient equal the float64 reference's."""
  t = 1024
  ids = np.repeat(np.arange(7), [150, 250, 130, 200, 100, 94, 100])[None]
  kv_ids = np.where(ids == 3, 9, ids)
  q, k, v, do = ref.random_qkv(27, 1, t, t, 8, 2, 128, jnp.bfloat16)
  case = ref.Case(128**-0.5, q_segment_ids=ids, kv_segment_ids=kv_ids,
                  is_causal=True)
  cfg = ref.config(case).replace(implementation="cudnn")
  given = []

  def f(q, k, v, do, ids, kv_ids):
    mask = jax_ring.BlockMask(q_offset=0, kv_offset=0, q_segment_ids=ids,
                              kv_segment_ids=kv_ids)

    def ahead(lse=None):
      given.append(kernel.prepare(q, k, v, mask, cfg, lse))
      return dataclasses.replace(mask, prepared=given[-1])

    out, lse = kernel.forward(q, k, v, None, ahead(), cfg)
    dq, dk, dv, _ = kernel.backward(q, k, v, None, ahead(lse), out, lse, do,
                                    None, cfg)
    return out, (dq, dk, dv)

  args = (q, k, v, do, jnp.asarray(ids), jnp.asarray(kv_ids))
  assert "jax_ring_sdpa_bwd_pass" in jax.jit(f).lower(*args).as_text()
  assert len(given) == 2 and all(x is not None for x in given)
  helpers.check(jax.jit(f)(*args), q, k, v, do, case)
