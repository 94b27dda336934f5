"""The LM example: context parallelism trains like one device (loss and
gradients at step 0, losses over 5 optimizer steps), with the weights
replicated or FSDP-sharded, and --resume continues
the uninterrupted run's loss trajectory exactly (a fresh run into its
directory is refused; tests/test_run_dir.py has the rest of the run
directory's faults, other settings among them)."""

import pathlib
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jax_ring
import reference as ref
from jax_ring import flax as jrf

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import lm_model  # noqa: E402
import train_lm  # noqa: E402

DP, CP = 2, 4
SEQ, BATCH, STEPS = 64, 4, 5
SHAPE = dict(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp_dim=64)
# float32, max error relative to the largest magnitude of the single-device
# value. Step 0 differs only by summation order (ring merges, the sharded
# loss sum): the library's float32 tolerance (measured: <= 7e-7 on every
# gradient). Over 5 Adam steps m / sqrt(v) can amplify the differences of
# near-zero gradient entries, hence a looser bound on the losses (measured:
# equal to float32 precision).
STEP0_TOL = ref.TOLERANCES[jnp.dtype(jnp.float32)]  # 2e-5
STEPS_TOL = 1e-4


def make_mesh():
  if len(jax.devices()) < DP * CP:
    pytest.skip(f"needs {DP * CP} devices")
  return Mesh(np.array(jax.devices()[:DP * CP]).reshape(DP, CP),
              ("data", "context"))


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


# The FSDP case in the default run (its weights move too); -m slow adds
# the replicated one.
@pytest.mark.parametrize("shard_weights", [
    pytest.param(False, marks=pytest.mark.slow), True],
    ids=["replicated", "fsdp"])
def test_context_parallel_training_matches_single_device(shard_weights):
  mesh = make_mesh()
  cpc = jax_ring.ContextParallel(axis="context", strategy="ring",
                                 load_balance="dual_chunk", loop="scan")
  rules = lm_model.model_rules()
  fsdp = ("data", "context")
  cp_cfg = lm_model.ModelConfig(
      **SHAPE, implementation="xla", context_parallel=cpc, rules=rules,
      param_rules=jrf.fsdp_rules(rules, fsdp) if shard_weights else None)
  one_cfg = lm_model.ModelConfig(**SHAPE, implementation="xla")
  with jax.set_mesh(mesh):
    cp_model = lm_model.Transformer(cp_cfg, rngs=nnx.Rngs(0))
  # The same parameters: the context-parallel model's, copied into the
  # one-device model's shapes (its initialisers, each a compile, not run).
  one_model = nnx.eval_shape(
      lambda: lm_model.Transformer(one_cfg, rngs=nnx.Rngs(1)))
  cp_gdef, cp_params = nnx.split(cp_model)
  one_gdef, one_params = nnx.split(one_model)
  split = [x for x in jax.tree.leaves(cp_params) if fsdp in x.sharding.spec]
  # wq, wk, wv, wo, 3 MLP weights per block; embed, unembed.
  assert len(split) == (2 * 7 + 2 if shard_weights else 0)
  nnx.replace_by_pure_dict(
      one_params, jax.device_get(nnx.to_pure_dict(cp_params)))

  # Real text (the json package's source: the whole standard library's
  # takes seconds to read), packed into 3 documents per row.
  tokens, _ = train_lm.Corpus(
      pathlib.Path(sysconfig.get_paths()["stdlib"]) / "json").batch(
          0, 0, BATCH, SEQ)
  ids = ref.random_segments(1, BATCH, SEQ, 3)
  natural = jax.tree.map(jnp.asarray, jrf.make_lm_batch(tokens, ids))
  with jax.set_mesh(mesh):
    sharded = jrf.prepare_lm_batch(tokens, ids, mesh=mesh,
                                   spec=P("data", "context"),
                                   context_parallel=cpc)
  assert sharded.inputs.sharding.spec == P("data", "context")

  tx = train_lm.make_optimizer(3e-3, 2, STEPS)

  def run(gdef, params, batch):
    def loss_of(p):
      return lm_model.loss_fn(nnx.merge(gdef, p), batch)

    def step(params, opt_state):
      loss, grads = jax.value_and_grad(loss_of)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss, grads

    opt_state = tx.init(params)
    # Compiled once: the same executable runs the steps and is inspected.
    step = jax.jit(step).lower(params, opt_state).compile()
    losses, first_grads = [], None
    for _ in range(STEPS):
      params, opt_state, loss, grads = step(params, opt_state)
      losses.append(float(loss))
      first_grads = grads if first_grads is None else first_grads
    return np.array(losses), nnx.to_pure_dict(first_grads), step

  want_losses, want_grads, _ = run(one_gdef, one_params, natural)
  with jax.set_mesh(mesh):
    got_losses, got_grads, cp_step = run(cp_gdef, cp_params, sharded)
    hlo = cp_step.as_text()
  assert "collective-permute" in hlo  # the ring ran

  assert rel_err(got_losses[0], want_losses[0]) <= STEP0_TOL, (
      got_losses[0], want_losses[0])
  flat_got = jax.tree_util.tree_leaves_with_path(got_grads)
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
  # 9 per block; embed, unembed, final norm
  assert len(flat_got) == len(flat_want) == 2 * 9 + 3
  for path, g in flat_got:
    err = rel_err(g, flat_want[path])
    assert err <= STEP0_TOL, f"grad {jax.tree_util.keystr(path)}: {err:.3g}"
  # It trains: from about ln 256 = 5.55 (the uniform guess, with the
  # model's 0.02-std initialisation) to below 5.35 in 5 steps.
  assert want_losses[-1] < want_losses[0] - 0.2
  err = rel_err(got_losses, want_losses)
  assert err <= STEPS_TOL, (err, got_losses, want_losses)


def test_fsdp_splits_the_optimizer_moments_as_their_weights():
  """--shard-weights: Adam's two moments of each weight lie as the weight
  does (split over data x context), not whole on every device."""
  make_mesh()
  built = train_lm.build(train_lm.parse_args(
      ["--preset", "micro", "--mesh", f"data={DP},context={CP}",
       "--shard-weights"]))
  params = jax.tree.leaves(built["state"]["params"])
  opt = [x for x in jax.tree.leaves(built["state"]["opt_state"]) if x.ndim]
  assert len(opt) == 2 * len(params)  # mu and nu, in the params' order
  for i, x in enumerate(opt):
    w = params[i % len(params)]
    assert x.shape == w.shape and x.sharding.is_equivalent_to(
        w.sharding, x.ndim), (i, x.sharding, w.sharding)
  assert sum(("data", "context") in w.sharding.spec for w in params) == 16
  # The rest (the step count) on the whole mesh, as the step expects.
  rest = [x for x in jax.tree.leaves(built["state"]["opt_state"])
          if not x.ndim]
  assert rest and all(x.sharding.mesh == built["mesh"] and
                      x.sharding.spec == P() for x in rest)


# The loop and its checkpoints are train_lm's for both examples: the
# default run resumes them on a toy step in
# test_run_dir.py::test_a_resume_continues_the_uninterrupted_run; this
# example's own run end to end only here, under -m slow.
@pytest.mark.slow
def test_resume_continues_the_uninterrupted_trajectory(tmp_path):
  make_mesh()

  def run(run_dir, *extra):
    args = train_lm.parse_args(
        ["--preset", "micro", "--steps", "4", "--checkpoint-every", "2",
         "--loop", "scan", "--run-dir", str(run_dir), "--quiet", *extra])
    return train_lm.train(args)

  whole = run(tmp_path / "a")
  first = run(tmp_path / "b", "--stop-after", "3")  # saved at 2 and 3
  resumed = run(tmp_path / "b", "--resume")
  assert len(whole["losses"]) == 4 and len(first["losses"]) == 3
  assert resumed["start"] == 3
  np.testing.assert_array_equal(resumed["losses"], whole["losses"])
  for a, b in zip(jax.tree.leaves(resumed["state"]),
                  jax.tree.leaves(whole["state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A fresh run refuses the directory, before building anything.
  with pytest.raises(SystemExit, match="--resume.*--overwrite"):
    run(tmp_path / "b")
  assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()
                ) == ["3", "4"]


def test_step_clock_reports_the_rate_at_which_steps_finish():
  """Ticks at step completions: the first tick (the compiling step's end)
  only starts the clock, and so does the first after a pause (a checkpoint
  save); the smoothed rate follows the recent intervals; the steady rate is
  the median's (an outlier step does not move it)."""
  clock = train_lm.StepClock(tokens_per_step=1000, smoothing=0.5)
  for t in (30.0, 31.0, 32.0, 33.0, 38.0, 39.0, 40.0):
    clock.tick(t)
    if t == 32.0:
      assert clock.steady == 1000.0 and clock.smoothed == 1000.0
  clock.pause()  # a save held the loop from 40 s to 47 s
  clock.tick(48.0)
  clock.tick(49.0)
  assert clock.intervals == [1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0]
  assert clock.median_step_s == 1.0 and clock.steady == 1000.0
  # EMA of the intervals: 1, 1, 1, 3, 2, 1.5, 1.25
  assert abs(clock.smoothed - 1000 / 1.25) < 1e-9
