"""The GPU benchmarks, checked where CI can run them: the longest-sequence
search of ``benchmarks/lm_training.py``, the kernel-interval sums of
``benchmarks/profile_ring.py``, the one-device ring steps of
``benchmarks/ring_steps.py`` against the reference, and dry runs of the
attention benchmarks on all 8 simulated devices (the 8-GPU issue runs them
unchanged on 8 GPUs)."""

import functools
import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import common  # noqa: E402
import finetune_models  # noqa: E402
import host_trace  # noqa: E402
import lm_training  # noqa: E402
import profile_host  # noqa: E402
import profile_ring  # noqa: E402
import ring_attention  # noqa: E402
import ring_steps  # noqa: E402
import strategies  # noqa: E402


class FakeRun:
  """Peak bytes = fixed + per_token * seq (+ a step, to be non-linear)."""

  def __init__(self, fixed, per_token, jump_at=None, jump=0):
    self.fixed, self.per_token = fixed, per_token
    self.jump_at, self.jump = jump_at, jump
    self.compiled = []

  def compile_peak(self, seq):
    self.compiled.append(seq)
    extra = self.jump if self.jump_at and seq >= self.jump_at else 0
    peak = self.fixed + self.per_token * seq + extra
    return dict(seq=seq, peak=peak, compile_s=0.0)


@pytest.mark.parametrize("fixed, per_token, jump_at, jump", [
    (10e9, 180e3, None, 0),      # linear: the line's root is the answer
    (20e9, 1.3e6, None, 0),
    (10e9, 180e3, 300_000, 8e9),  # a step in the curve: bisection finds it
    (10e9, 180e3, 400_000, float("inf")),  # no cuDNN graph from 400k on
])
def test_longest_finds_the_last_fitting_granule(fixed, per_token, jump_at,
                                                jump):
  limit, granule = 134e9, 16384
  run = FakeRun(fixed, per_token, jump_at, jump)
  saved = []
  best, _, rec = lm_training.longest(run, limit, (65536, 131072), granule,
                                     on_compile=lambda r: saved.append(len(r)))
  assert saved == list(range(1, len(rec) + 1))  # progress after each compile
  fits = lambda s: run.compile_peak(s)["peak"] <= limit
  assert best % granule == 0 and fits(best) and not fits(best + granule)
  assert len(rec) <= 8


def test_interval_sums():
  per = {"gpu0": [(0, 10, "ncclSendRecv", "Stream #2"),
                  (5, 20, "sm90_fmha_fwd", "Stream #1"),
                  (25, 30, "loop_fusion", "Stream #1"),
                  (40, 50, "ncclKernel", "Stream #2")]}
  mean, detail, timeline = profile_ring.summarise(per, calls=1)
  us = {k: round(v * 1e3, 6) for k, v in mean.items()}  # ms -> us
  assert us == dict(wall_ms=50, busy_ms=35, attn_ms=15, comm_ms=20,
                    comm_only_ms=15, other_ms=5, idle_ms=15)
  assert detail[0] == (0.015, 1, "sm90_fmha_fwd")
  assert [(t, d, st, k) for t, d, st, k, _ in timeline] == [
      (0, 10, "Stream #2", "comm"), (5, 15, "Stream #1", "attn"),
      (25, 5, "Stream #1", "other"), (40, 10, "Stream #2", "comm")]


def test_gaps_count_the_idle_stretches_over_a_length():
  spans = [(0, 10), (5, 20), (25, 30), (90, 95), (96, 100)]
  assert profile_ring.gaps(spans, 4) == (2, 65)  # 20-25 and 30-90
  assert profile_ring.gaps(spans, 10) == (1, 60)
  assert profile_ring.gaps([], 1) == (0, 0.0)


def test_program_summary_counts_work_in_and_out_of_graphs():
  """Launches, loops and branches of a compiled program, inside XLA's
  command buffers (and what they call) and outside; a fusion's own
  computation launches nothing."""
  import jax
  import jax.numpy as jnp

  def f(x, n):
    y = jax.lax.fori_loop(0, n, lambda i, c: c * 2, x)
    return jax.lax.cond(n > 3, lambda: y + 1, lambda: y - 1)

  got = common.program_summary(
      jax.jit(f).lower(jnp.ones(3), 5).compile().as_text())
  assert (got["graphs"], got["whiles"], got["conditionals"]) == (0, 1, 1)
  assert got["launches"] > 0 and got["launches_in_graphs"] == 0
  graph = """%command_buffer.2 (p: s32[]) -> s32[] {
  %c = s32[] conditional(%p), branch_computations={%a, %b}
}
%a (p: s32[]) -> s32[] {
  %f = s32[] fusion(%p), kind=kLoop, calls=%fc
}
%b (p: s32[]) -> s32[] {
  %g = s32[] custom-call(%p)
}
%fc (p: s32[]) -> s32[] {
  %h = s32[] gather(%p)
}
ENTRY %main (p: s32[]) -> s32[] {
  %w = s32[] while(%p), condition=%c, body=%b2
  %x = f32[2] custom-call(%p), custom_call_target="t"
}"""
  assert common.program_summary(graph) == dict(
      graphs=1, launches=1, launches_in_graphs=2, whiles=1,
      whiles_in_graphs=0, conditionals=0, conditionals_in_graphs=1)


def test_training_step_families_split_matmuls_from_other_kernels():
  """lm_training's profile: matmuls are their own family, and NCCL time
  under a matmul is not exposed."""
  per = {"gpu0": [(0, 10, "ncclSendRecv", "Stream #2"),
                  (5, 20, "nvjet_tst_192x192_64x4", "Stream #1"),
                  (25, 30, "loop_fusion", "Stream #1"),
                  (40, 50, "cudnn_generated_fort_native_sdpa", "Stream #1")]}
  mean, _, _ = profile_ring.summarise(per, 1, lm_training.step_kind,
                                      ("attn", "matmul", "comm", "other"))
  us = {k: round(v * 1e3, 6) for k, v in mean.items()}
  assert us == dict(wall_ms=50, busy_ms=35, attn_ms=10, matmul_ms=15,
                    comm_ms=10, comm_only_ms=5, other_ms=5, idle_ms=15)


@pytest.mark.slow
def test_compile_peak_of_the_example_step_on_cpu():
  """The real step (micro preset, ring on 4 devices): XLA's peak, and no
  cuDNN call compiled on CPU."""
  import jax
  run = lm_training.Run(["--preset", "micro", "--quiet", "--mesh",
                         "data=1,context=4"], jax.devices()[:4])
  row = run.compile_peak(256)
  assert row["cudnn_calls"] == 0 and row["peak"] > 0


TINY = ["--seq", "128", "--kv-heads", "2", "--heads", "8", "--head-dim", "16",
        "--implementation", "xla"]


def dry_run(module, args, tmp_path, monkeypatch) -> list[dict]:
  """``module.main()`` on the command line ``args``; its JSON rows. One
  call per timing batch: many queued 8-device programs with collectives
  can abort XLA:CPU on this 2-core machine (seen: in the timing loop)."""
  monkeypatch.setattr(common, "RESULTS", tmp_path)
  monkeypatch.setattr(module, "time_fn", functools.partial(
      common.time_fn, repeats=1, min_batch_s=0))
  monkeypatch.setattr(sys, "argv", [module.__name__] + args)
  module.main()
  (path,) = tmp_path.glob("*.json")
  return json.loads(path.read_text())["runs"]["default"]["rows"]


@pytest.mark.slow
def test_strategies_benchmark_on_8_devices(tmp_path, monkeypatch):
  """Every default strategy for 8 devices (hybrid 2x4 and 4x2 included),
  and the all-gather by head groups, runs and matches the single-device
  output; auto is timed."""
  import jax
  assert jax.device_count() == 8
  names = strategies.default_strategies(8)
  assert {"hybrid_2x4", "hybrid_4x2", "auto"} <= set(names)
  names.insert(2, "all_gather_g1")  # kv_chunk_heads=1
  names[1:1] = ["ring_neighbour", "ring_gather"]  # "ring": kv_sends=None
  (row,) = dry_run(strategies, TINY + ["--strategies", *names], tmp_path,
                   monkeypatch)
  for name in names:
    assert row[f"{name}_max_rel_err"] < 1e-2, (name, row)
    assert row[f"{name}_fwd_ms"] > 0 and row[f"{name}_fwdbwd_ms"] > 0
  assert row["auto_pick"].count("/") == 1


def test_strategies_mixes_are_packed_rows_compared_with_one_document():
  """strategies.py --mixes: each mix's ids cover the row in runs; a packed
  row's efficiency is divided by one document's at the same shape."""
  ids = np.asarray(strategies.mix_ids("equal4", 16))
  assert ids.tolist() == [[0] * 4 + [1] * 4 + [2] * 4 + [3] * 4]
  lognormal = np.asarray(strategies.mix_ids("lognormal", 5000))
  assert lognormal.shape == (1, 5000) and np.all(np.diff(lognormal) >= 0)
  assert strategies.mix_ids("one", 16) is None
  with pytest.raises(ValueError, match="equal3"):
    strategies.mix_ids("equal3", 16)
  rows = [dict(seq=8, kv_heads=2, mix="one", ring_fwdbwd_eff=0.8),
          dict(seq=8, kv_heads=2, mix="equal4", ring_fwdbwd_eff=0.4)]
  strategies.versus_one(rows, ["ring", "auto"])
  assert rows[1]["ring_fwdbwd_eff_vs_one"] == 0.5
  assert "ring_fwdbwd_eff_vs_one" not in rows[0]


@pytest.mark.slow
def test_ring_benchmark_on_8_devices(tmp_path, monkeypatch):
  loops = ("unrolled", "scan", "neighbour", "gather")
  (row,) = dry_run(ring_attention, TINY + ["--causal-only", "--loops",
                                           *loops], tmp_path, monkeypatch)
  for loop in loops:
    assert row[f"{loop}_max_rel_err"] < 1e-2, (loop, row)
    assert row[f"{loop}_grad_max_rel_err"] < 1e-2, (loop, row)
    assert all(row[f"{loop}_{p}_eff"] > 0 for p in ("fwd", "fwdbwd"))


@pytest.mark.slow
def test_ring_steps_benchmark_dry_run(tmp_path, monkeypatch):
  variants = ("graphs", "static")  # "nocc" is a GPU flag
  (row,) = dry_run(ring_steps, TINY[:2] + TINY[4:] + [
      "--kv-heads", "2", "--variants", *variants], tmp_path, monkeypatch)
  for v in variants:
    assert row[f"{v}_max_rel_err"] < 1e-2 and row[f"{v}_dq_max_rel_err"] < 1e-2
    assert row[f"{v}_fwd_eff"] > 0 and row[f"{v}_fwdbwd_eff"] > 0


@pytest.mark.parametrize("variant", [
    "cond", pytest.param("static", marks=pytest.mark.slow)])
def test_ring_steps_are_one_device_of_the_ring(variant):
  """ring_steps.py's device-r blocks, for every r of a 4-way dual-chunk
  ring (r traced, so each step is a real lax.cond; or r static):
  each device's rows of out and dq are the float64 reference's, and the
  dK/dV parts they send back, summed at their owners, are the reference's
  dK/dV. Every device holds different random rows, so a wrong source
  device or chunk shows."""
  import jax
  import jax.numpy as jnp
  import reference as ref
  import jax_ring
  cp, h = 4, 16
  q, k, v, do = ref.random_qkv(31, 2, 8 * 13, 8 * 13, 4, 2, h)
  case = ref.Case(h ** -0.5, is_causal=True)
  want, _, want_g = ref.attention(q, k, v, case, dout=do)
  cfg = ref.config(case)
  shards = lambda x: jnp.split(jax_ring.reorder_for_load_balance(
      x, cp, layout="dual_chunk"), cp, 1)
  dkv = [0.0] * cp
  static = variant == "static"

  def run(qr, kvs, rank, dr):
    out, lse = ring_steps.device_forward(qr, kvs, rank, cp=cp, cfg=cfg)
    return out, ring_steps.device_backward(
        qr, kvs, rank, out.astype(qr.dtype), lse, dr, cp=cp, cfg=cfg)

  run = jax.jit(run, static_argnums=2 if static else ())
  for r in range(cp):
    qr, kvs, dr = ring_steps.device_inputs(q, k, v, do, cp, r)
    out, (dq, parts) = run(qr, kvs, r if static else jnp.int32(r), dr)
    ref.assert_close(out, shards(want)[r], q.dtype, f"out of device {r}")
    ref.assert_close(dq, shards(want_g["q"])[r], q.dtype, f"dq of {r}")
    for step, part in enumerate(parts):
      dkv[(r - step) % cp] = dkv[(r - step) % cp] + part
  for name, i in (("k", 0), ("v", 1)):
    got = jax_ring.reorder_from_load_balance(
        jnp.concatenate([d[i] for d in dkv], 1), cp, layout="dual_chunk")
    ref.assert_close(got, want_g[name], q.dtype, "d" + name)


def test_results_file_per_benchmark_kind_and_count_keeps_other_modes(
    tmp_path, monkeypatch):
  """``common.write``: one file per benchmark x device kind x count; a run
  replaces its own mode's record and keeps the others."""
  env = dict(device="NVIDIA H200", platform="gpu", device_count=2,
             xla_flags="--a")
  monkeypatch.setattr(common, "environment", lambda: dict(env))
  monkeypatch.setattr(common, "RESULTS", tmp_path)
  assert common.device_kind("NVIDIA H100 80GB HBM3", "gpu") == "H100"
  assert common.device_kind("cpu", "cpu") == "CPU"
  path = common.write("bench", [dict(a=1.0)], ["a"])
  assert path == tmp_path / "bench_2xH200.json"
  # A benchmark's own field wins over the environment's of the same name.
  common.write("bench", [dict(a=2.0)], ["a"], mode="flags",
               extra=dict(xla_flags="--b"))
  common.write("bench", [dict(a=3.0)], ["a"])  # replaces "default"
  data = json.loads(path.read_text())
  assert data["runs"]["flags"]["xla_flags"] == "--b"
  assert data["runs"]["default"]["xla_flags"] == "--a"
  assert data["benchmark"] == "bench" and data["device_count"] == 2
  assert {m: r["rows"] for m, r in data["runs"].items()} == {
      "default": [dict(a=3.0)], "flags": [dict(a=2.0)]}


def test_gpu_lane_summary_counts_outcomes_errors_and_calls(tmp_path):
  """benchmarks/gpu_tests.py on a hand-made report: totals, the CP cases
  by strategy, the worst error against its dtype's tolerance, the calls."""
  import gpu_tests
  ids = ["n2-ring_gather_scan-packed-striped-jit-mha8x8_h128_t512_bfloat16",
         "n2-ulysses-window-dual_chunk-shard_map-gqa8x2_h64_t1000_float16"]
  junit = tmp_path / "report.xml"
  junit.write_text(
      '<testsuites><testsuite>'
      f'<testcase classname="tests.test_gpu_cp" '
      f'name="test_cuda_blocks_match_reference[{ids[0]}]"/>'
      f'<testcase classname="tests.test_gpu_cp" '
      f'name="test_cuda_blocks_match_reference[{ids[1]}]">'
      '<failure message="AssertionError: dk: max error 5e-3">x</failure>'
      '</testcase>'
      '<testcase classname="tests.test_cudnn" name="test_mask_cases[full]"/>'
      '<testcase classname="tests.test_cudnn" name="test_x">'
      '<skipped message="needs an NVIDIA GPU"/></testcase>'
      '</testsuite></testsuites>')
  record = tmp_path / "cases.jsonl"
  record.write_text(json.dumps(dict(
      case=ids[0], seconds=2.5, ffi_calls={"jax_ring_sdpa_fwd": 3,
                                           "jax_ring_sdpa_bwd_dkv": 2},
      errors=dict(out=3e-3, dq=6e-3, dk=4e-3, dv=1e-3), tolerance=3e-2)) +
                    "\n")
  path = gpu_tests.main(["--junit", str(junit), "--record", str(record),
                         "--seconds", "12", "--out", str(tmp_path)])
  text = path.read_text()
  assert path.name == "gpu_tests_8xCPU.txt"
  assert "totals: 2 passed, 1 failed, 0 error, 1 skipped" in text
  assert "test_cudnn: 1 passed, 1 skipped" in text
  assert ("context-parallel cases with cuDNN blocks: 2, of which 1 passed, "
          "1 failed, 0 error, 0 skipped") in text
  assert "n2-ring_gather_scan 1/1; n2-ulysses 0/1" in text
  assert "bfloat16 (tolerance 0.03): out 3.00e-03 (0.10), dq 6.00e-03" in text
  assert "forward 3-3, backward 2-2" in text
  assert f"{ids[1]}]: AssertionError: dk: max error 5e-3" in text
  # Parts of one lane, merged elsewhere with the environment a part's
  # record holds (the first run appended this machine's).
  env = json.loads(record.read_text().splitlines()[-1])["environment"]
  part = tmp_path / "part.jsonl"
  part.write_text(record.read_text().splitlines()[0] + "\n" + json.dumps(
      dict(environment=dict(env, device="NVIDIA H100 80GB HBM3",
                            platform="gpu", device_count=4,
                            date="2026-01-02"))) + "\n")
  path = gpu_tests.main([
      "--junit", str(junit), str(junit), "--record", str(part),
      "--seconds", "12", "30", "--out", str(tmp_path)])
  text = path.read_text()
  assert path.name == "gpu_tests_4xH100.txt" and "date: 2026-01-02" in text
  assert "totals: 4 passed, 2 failed, 0 error, 2 skipped" in text
  assert "wall time: 42 s in 2 parts, one after another on one machine " \
      "(12 + 30 s)" in text
  with pytest.raises(SystemExit):
    gpu_tests.main(["--junit", str(junit), "--seconds", "1", "2"])
  # A part whose report was never written: named, its records still read.
  gone = tmp_path / "never_written.xml"
  text = gpu_tests.main([
      "--junit", str(junit), str(gone), "--record", str(part),
      "--seconds", "12", "30", "--out", str(tmp_path)]).read_text()
  assert "totals: 2 passed, 1 failed, 0 error, 1 skipped" in text
  assert f"no junit report in {gone} (pytest stopped" in text
  assert "bfloat16 (tolerance 0.03): out 3.00e-03 (0.10)" in text


@pytest.mark.parametrize("name, kind", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attn"),
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32", "matmul"),
    ("ncclDevKernel_AllGather_RING_LL", "comm"),
    ("loop_multiply_reduce_fusion_3", "other")])
def test_training_profile_kernel_families(name, kind):
  assert lm_training.step_kind(name) == kind


@pytest.mark.parametrize("preset, params, matmul_params", [
    # The checkpoints' published sizes; tied: the table is also the
    # unembedding (a product), untied: the input table is a lookup.
    ("llama3.2-1b", 1_235_814_400, 1_235_814_400),
    ("llama3-8b", 8_030_261_248, 8_030_261_248 - 128256 * 4096)])
def test_model_presets_have_the_checkpoints_sizes(preset, params,
                                                  matmul_params):
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
  import lm_model
  import train_lm
  cfg = lm_model.ModelConfig(**train_lm.PRESETS[preset]["model"])
  assert cfg.num_params() == params
  seq, llama = 65536, cfg.llama()
  attention = 6 * llama.num_layers * seq * llama.num_heads * llama.head_dim
  assert lm_training.model_flops_per_token(cfg, seq) == (
      6 * matmul_params + attention)
  # The same row as two documents of S / 2: each query sees half the keys.
  work = lm_training.model_flops_per_token(cfg, seq, ([seq // 2] * 2, seq))
  per_key = 12 * llama.num_layers * llama.num_heads * llama.head_dim
  assert work == 6 * matmul_params + per_key * (seq // 2 + 1) / 2


def test_fine_tuning_flops_count_each_documents_keys():
  """6 P per token, plus 12 Hq D per key a query sees in its own document:
  two documents of 3 and 5 tokens, a global layer (all earlier keys) and a
  sliding one of window 2."""
  from jax_ring import models
  cfg = models.DecoderConfig(
      vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=2,
      num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=2,
      layer_types=("full_attention", "sliding_attention"),
      tie_word_embeddings=True)
  keys = (1 + 2 + 3) + (1 + 2 + 3 + 4 + 5) + (1 + 2 + 2) + (1 + 2 + 2 + 2 + 2)
  want = 6 * cfg.num_params() + 12 * 2 * 4 * keys / 10
  assert finetune_models.flops_per_token(cfg, [3, 5], 10) == want


def test_lane_shards_partition_the_selected_tests():
  """``--lane-shard I/N`` (tests/conftest.py): the N parts together hold
  each selected test once, differ in size by at most one, and mix
  neighbouring ids; a bad I/N is a usage error."""
  import conftest
  ids = [f"case[{i}-{'jit' if i % 2 else 'shard_map'}]" for i in range(101)]
  parts = [conftest.lane_shard(f"{i}/3", ids) for i in (1, 2, 3)]
  assert sorted(j for p in parts for j in p) == list(range(101))
  assert {len(p) for p in parts} <= {33, 34}
  assert all(0 < sum(j % 2 for j in p) < len(p) for p in parts)
  assert conftest.lane_shard(None, ids) == set(range(101))
  for bad in ("0/2", "3/2", "two"):
    with pytest.raises(pytest.UsageError, match="--lane-shard takes I/N"):
      conftest.lane_shard(bad, ids)


def test_branch_launches_counts_each_branch_of_the_entrys_conditionals():
  """Each top-level conditional's branches, with the work they call; a
  fusion's own computation launches nothing."""
  hlo = """%a (p: s32[]) -> s32[] {
  %f = s32[] fusion(%p), kind=kLoop, calls=%fc
  %w = s32[] while(%p), condition=%c, body=%b
}
%b (p: s32[]) -> s32[] {
  %g = s32[] custom-call(%p)
  %h = s32[] copy(%g)
}
%c (p: s32[]) -> pred[] {
  %k = pred[] fusion(%p), kind=kLoop, calls=%fc
}
%fc (p: s32[]) -> s32[] {
  %x = s32[] gather(%p)
}
%e (p: s32[]) -> s32[] {
  ROOT %p2 = s32[] parameter(0)
}
ENTRY %main (p: s32[]) -> s32[] {
  %c1 = s32[] conditional(%p, %p, %p), branch_computations={%a, %e}
  %x = f32[2] custom-call(%p), custom_call_target="t"
  %c2 = s32[] conditional(%q, %p, %p), true_computation=%b, false_computation=%e
}"""
  assert common.branch_launches(hlo) == [[4, 0], [2, 0]]


def test_loop_contents_counts_what_a_scan_runs_each_trip():
  """A compiled scan of 3 trips whose body sorts its carry and branches
  on it: the loop's sort and conditional are counted, with its trips."""
  import jax
  import jax.numpy as jnp

  def body(x, _):
    x = jnp.sort(x) * 1.5
    return jax.lax.cond(x[0] > 0, lambda y: y + 1, lambda y: y - 1, x), None

  f = jax.jit(lambda x: jax.lax.scan(body, x, None, length=3)[0])
  hlo = f.lower(jnp.arange(8.0)[::-1]).compile().as_text()
  (loop,) = common.loop_contents(hlo)
  assert loop["trips"] == 3 and loop["sorts"] == 1, loop
  assert loop["conditionals"] == 1 and loop["scatters"] == 0, loop
  assert loop["launches"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("divisors, scan", [(["8"], []), ([], ["--scan"])],
                         ids=["one_tail", "none_scanned"])
def test_profile_host_runs_one_call_and_stacked_layers(tmp_path, monkeypatch,
                                                       divisors, scan):
  """profile_host on 8 CPU devices: both programs run and are timed, the
  tail sizes it is given are the ones traced (and recorded), and the
  ring's switch shows one branch a tail size (or none given, no such
  branch) beside none and every step; the layers unrolled hold each
  layer's work, scanned one layer's. No host stages on CPU: XLA:CPU
  records none."""
  from jax_ring._src.strategies.ring import reach
  monkeypatch.setattr(reach, "TAIL_DIVISORS", reach.TAIL_DIVISORS)
  rows = dry_run(profile_host, ["--seq", "256", "--heads", "4",
                                "--kv-heads", "2", "--layers", "2",
                                "--calls", "1", *scan, "--tail-divisors",
                                *divisors], tmp_path, monkeypatch)
  assert [r["program"] for r in rows] == ["one", "scan" if scan else "layers"]
  assert all(r["ms"] > 0 and r["launches"] > 0 for r in rows)
  assert rows[1]["ms_per_attention"] == rows[1]["ms"] / 2
  assert reach.tail_sizes(32, 8) == ((4,) if divisors else ())
  switch = max(rows[0]["branches"], key=len)
  assert len(switch) == 1 + len(divisors) + 1  # none, tails, every step
  held = rows[1]["launches"] / rows[0]["launches"]
  assert held < 1.5 if scan else held > 1.5, held
  if scan:  # the layers' loop, and what each layer runs in it
    assert any(loop["trips"] == 2 and loop["launches"]
               for loop in rows[1]["loops"]), rows[1]["loops"]


def test_host_stages_reads_each_run_and_its_first_kernel(tmp_path):
  """profile_host's trace reading: stages by name whichever device thread
  records them, and the time from device 0's run to GPU 0's next kernel."""
  import gzip
  meta = lambda pid, name: dict(ph="M", name="process_name", pid=pid,
                                args=dict(name=name))
  x = lambda pid, name, ts, dur=1.0: dict(ph="X", pid=pid, tid=1, name=name,
                                          ts=ts, dur=dur)
  events = [meta(1, "/host:CPU"), meta(2, "/device:GPU:0"),
            meta(3, "/device:GPU:1"),
            x(1, "[0] GpuExecutable::ExecuteThunks", 100, 900),
            x(1, "[1] GpuExecutable::ExecuteThunks", 100, 900),
            x(1, "Thunks::Initialize", 110, 500),
            x(1, "[0] GpuExecutable::ExecuteThunks", 2000, 900),
            x(3, "kernel", 150), x(2, "kernel", 700), x(2, "kernel", 2300)]
  path = tmp_path / "t.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump(dict(traceEvents=events), f)
  got = profile_host.host_stages(str(path))
  assert got["executethunks_count"] == 3 and got["prepare_ms"] is None
  assert got["initialize_ms"] == 0.5 and got["executethunks_ms"] == 0.9
  assert got["to_first_kernel_ms"] == (600 + 300) / 2 / 1e3


def test_causal_keys_count_each_querys_keys():
  """Against a count over a (T, T) mask of two documents, 0 padding."""
  seg = np.array([1, 1, 1, 1, 1, 2, 2, 0, 0])
  lengths = common.row_documents([seg])
  assert list(lengths) == [5, 2]
  # Row after row (each row's ids in order): id 1 of both rows, twice.
  two = np.array([2, 2, 2, 1, 1, 1, 1, 1, 1])
  assert list(common.row_documents([seg, two])) == [5, 2, 6, 3]
  i = np.arange(seg.size)
  for window in (None, 2, 3):
    see = ((seg[:, None] == seg[None]) & (seg[:, None] > 0) &
           (i[None] <= i[:, None]))
    if window:
      see &= i[:, None] - i[None] < window
    assert common.causal_keys(lengths, window) == see.sum()



def test_host_trace_reads_each_run_and_names_what_the_gpu_waited_for(
    tmp_path, capsys):
  """A timeline file of two runs: each summarised apart, its GPU idle
  stretches over the bound with the host events inside them."""
  line = lambda ts, d, where, name: f"{ts:10.1f} {d:8.1f} {where:26} {name}\n"
  run = [line(0, 10, "G0 Stream #1", "a"), line(12, 30, "H python", "wait"),
         line(160, 40, "G0 Stream #1", "b"), line(205, 5, "G0 Stream #1", "c")]
  path = tmp_path / "t.txt"
  path.write_text("# one: cmd\n" + "".join(run) + "# two: cmd\n" +
                  "".join(run[:1]))
  host_trace.summary(str(path), calls=1, gap_us=100)
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "# one: cmd" and out[3] == "# two: cmd"
  assert out[1] == "GPU 0 over 1 calls: 210 us a call, busy 55, idle 155"
  assert out[2].split() == ["idle", "150.0", "us", "at", "10.0", "before",
                            "b:", "wait"]
  assert out[4] == "GPU 0 over 1 calls: 10 us a call, busy 10, idle 0"
