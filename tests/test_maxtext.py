"""jax_ring inside an unmodified MaxText: with ``jax_ring.maxtext`` installed,
a MaxText model's logits and every parameter gradient equal MaxText's own
``dot_product`` attention (float32, highest matmul precision), for every
strategy, layout and attention variant that MaxText's config expresses;
MaxText's trainer gives the same losses; uninstalling restores MaxText's
program. Needs MaxText (Python >= 3.12, jax 0.11: ``.ci/run`` runs this
module in a second environment)."""

import json
import logging
import os
import types
from unittest import mock

import jax
import numpy as np
import pytest

if os.environ.get("JAX_RING_MAXTEXT_TESTS") == "required":
  import maxtext  # noqa: F401  (.ci/run's MaxText job: no silent skip)
else:
  pytest.importorskip("maxtext", reason="MaxText needs Python >= 3.12 and "
                      "jax >= 0.11 (.ci/run runs this module in "
                      ".venv-maxtext)")

import jax_ring.maxtext  # noqa: E402
import maxtext_models as mm  # noqa: E402
from jax_ring.maxtext import _read  # noqa: E402

TOL = 2e-5  # float32, over max(1, max|expected|): the suite's tolerance


def assert_equal_to(got, want, tol=TOL, skip=()):
  """Logits and every gradient leaf within ``tol`` (leaves whose path
  names one of ``skip`` left to the caller)."""
  errors = mm.relative_errors(got, want)
  leaves = [(jax.tree_util.keystr(k), e) for k, e in
            jax.tree_util.tree_leaves_with_path(errors)
            if not any(s in jax.tree_util.keystr(k) for s in skip)]
  assert len(leaves) > 3, leaves  # the logits and the weights
  worst = max(leaves, key=lambda x: x[1])
  assert worst[1] <= tol, worst


class Case(types.SimpleNamespace):
  """A built model, its batch, its jitted step and MaxText's answer."""


def case(layout, dtype=None, documents=3, padding=5, params=None,
         **overrides):
  """MaxText's model for ``overrides`` (with ``params`` cast to ``dtype``
  in place of its own, if given) and batch in ``layout``."""
  jax_ring.maxtext.uninstall()
  config, mesh, model = mm.build(dtype, **overrides)
  graph, own, rest = mm.split(model)
  params = own if params is None else jax.tree.map(
      lambda p, x: x.astype(p.dtype), own, params)
  run = mm.step(config, mesh, graph)
  args = (params, rest, *mm.batch(config, layout=layout, documents=documents,
                                  padding=padding))
  return Case(config=config, run=run, args=args, want=run(*args))


def served(caplog, strategy, run, args):
  """``run(*args)`` with jax_ring installed, and the plans it logged."""
  with caplog.at_level(logging.WARNING, logger="jax_ring.maxtext"):
    with jax_ring.maxtext.installed(strategy):
      got = run(*args)
  plans = [r.getMessage() for r in caplog.records
           if "attention ContextParallel" in r.getMessage()]
  assert plans, [r.getMessage() for r in caplog.records]
  return got, plans


@pytest.fixture(scope="module")
def llama():
  """GQA 4/2, packed rows ending in id-0 padding, in MaxText's default
  layout (context_parallel_load_balance: dual_chunk_swap)."""
  return case("dual_chunk")


@pytest.fixture(scope="module")
def gemma2():
  """Gemma 2: alternating sliding-window and global layers, logits soft
  caps, tied embeddings; otherwise :func:`llama`'s (GQA 4/2, packed rows,
  dual_chunk_swap)."""
  return case("dual_chunk", **mm.GEMMA2)


# All-gather and Ulysses reach MaxText by the same door as the ring (only
# the strategy's name differs); the main suite checks each strategy.
# By default: auto on this layout in test_gemma2_window_and_soft_cap.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "ring", "all_gather",
                                      "ulysses"])
def test_every_strategy_equals_maxtexts_dot_product(llama, caplog, strategy):
  got, plans = served(caplog, strategy, llama.run, llama.args)
  assert_equal_to(got, llama.want)
  assert all("axis='context'" in p and "load_balance='dual_chunk'" in p and
             "inputs='load_balanced'" in p and f"strategy='{strategy}'" in p
             for p in plans), plans


def test_uninstall_restores_maxtexts_program(gemma2):
  jax_ring.maxtext.uninstall()
  stock = gemma2.run.lower(*gemma2.args)
  with jax_ring.maxtext.installed():
    ours = gemma2.run.lower(*gemma2.args)
    jax_ring.maxtext.install()  # idempotent
    assert gemma2.run.lower(*gemma2.args) == ours
  assert ours != stock
  assert gemma2.run.lower(*gemma2.args) == stock
  jax_ring.maxtext.install("ring")
  jax_ring.maxtext.uninstall()
  assert gemma2.run.lower(*gemma2.args) == stock


# -m slow: its parts run by default (the layout read from MaxText's rule:
# test_the_batch_layout_is_read_as_maxtexts_pipeline_makes_it; the plan
# passes the layout's name through as in test_gemma2_window_and_soft_cap;
# the striped ring on packed rows: tests/test_ring.py).
@pytest.mark.slow
def test_striped_layout_read_from_maxtexts_auto_rule(caplog):
  # MaxText's 'auto' reorder: striped for packed ring training on GPUs.
  c = case("striped", packing="true", context_parallel_strategy="ring",
           base_num_kv_heads=4)
  got, plans = served(caplog, "ring", c.run, c.args)
  assert_equal_to(got, c.want)
  assert all("load_balance='striped'" in p for p in plans), plans


def test_natural_order_mqa_with_sinks(caplog):
  # Unpacked rows, marked as MaxText's pipeline marks them: every id 1.
  c = case(None, documents=1, padding=0,
           context_parallel_load_balance="false", base_num_kv_heads=1,
           attention_sink="true")
  got, plans = served(caplog, "auto", c.run, c.args)
  assert_equal_to(got, c.want)
  assert all("inputs='natural'" in p for p in plans), plans


def test_gemma2_window_and_soft_cap(gemma2, caplog):
  """Gemma 2, by the default strategy, in MaxText's default layout. Its
  tied-embedding gradient is held to float32 MaxText's like every other
  leaf, or, where float32 MaxText's drifts from float64 MaxText's by more
  than the tolerance (it can), within 1e-4 of float64 MaxText's."""
  got, plans = served(caplog, "auto", gemma2.run, gemma2.args)
  assert_equal_to(got, gemma2.want, skip=("token_embedder",))
  assert all("axis='context'" in p and "load_balance='dual_chunk'" in p and
             "inputs='load_balanced'" in p and "strategy='auto'" in p
             for p in plans), plans
  embedding = lambda out: out[1]["token_embedder"]["embedding"][...]
  if mm.relative_errors(embedding(got), embedding(gemma2.want)) <= TOL:
    return
  with jax.enable_x64(True):
    exact = case("dual_chunk", dtype=np.float64, params=gemma2.args[0],
                 **mm.GEMMA2)
  error = mm.relative_errors(embedding(got), embedding(exact.want))
  assert error <= 1e-4, error


def in_process(trainer, argv):
  """``trainer(argv)``, a MaxText trainer's entry point, in this process
  (where MaxText is imported already, so no second import: 12 CPU-s);
  what MaxText sets in jax's config and the environment put back after,
  and jax_ring uninstalled."""
  names = ("jax_default_prng_impl", "jax_use_shardy_partitioner",
           "jax_remove_size_one_mesh_axis_from_type")
  before = {name: getattr(jax.config, name) for name in names}
  try:
    with mock.patch.dict(os.environ):
      trainer(argv)
  except SystemExit as e:  # absl's app.run exits when main returns
    assert e.code in (None, 0), e.code
  finally:
    jax_ring.maxtext.uninstall()
    for name, value in before.items():
      jax.config.update(name, value)


def test_maxtexts_trainer_gives_stock_losses(tmp_path, caplog):
  """Two steps of MaxText's trainer on its synthetic data (the second's
  loss after one update): stock, then through ``python -m
  jax_ring.maxtext.train``'s ``main`` (its plan logged), the same losses.
  (On a CPU MaxText's own reorder runs only with hardware=cpu.)"""
  from maxtext.layers import attention_op
  from maxtext.trainers.pre_train import train
  from maxtext.utils import max_utils
  from jax_ring.maxtext import train as ours
  # (No TensorBoard: closing its writer waits seconds for its thread.)
  keys = mm.argv(hardware="cpu", base_output_directory=tmp_path,
                 dataset_type="synthetic", steps=2,
                 enable_goodput_recording="false",
                 enable_tensorboard="false")[1:]
  metrics = lambda name: f"metrics_file={tmp_path / f'{name}.jsonl'}"
  jax_ring.maxtext.uninstall()
  # MaxText's own functions, not jax_ring's wrappers, whatever ran before.
  assert not hasattr(attention_op.AttentionOp.apply_attention, "__wrapped__")
  assert max_utils.reorder_causal_load_balanced.__module__ == (
      "maxtext.utils.max_utils")
  in_process(train.main, [None, *keys, metrics("stock")])
  with caplog.at_level(logging.WARNING, logger="jax_ring.maxtext"):
    in_process(ours.main, [*keys, metrics("jax_ring")])
  plans = [r.getMessage() for r in caplog.records
           if "attention ContextParallel" in r.getMessage()]
  assert plans and all("load_balance='dual_chunk'" in p for p in plans), (
      [r.getMessage() for r in caplog.records])
  losses = {name: [json.loads(line)["learning/loss"] for line in
                   (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("stock", "jax_ring")}
  assert len(losses["stock"]) == 2, losses
  np.testing.assert_allclose(losses["jax_ring"], losses["stock"], rtol=0,
                             atol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_served_reorder_is_maxtexts(cp):
  """While installed, MaxText's pipeline reorders with jax_ring's layouts:
  dual_chunk_swap equal to MaxText's own (pure-JAX) reorder, striped to
  the order MaxText documents (token i on device i mod cp)."""
  from maxtext.common.common_types import ReorderStrategy
  from maxtext.utils import max_utils
  t = 8 * cp
  batch = {"inputs": np.arange(2 * t).reshape(2, t), "other": np.ones(3)}
  with jax_ring.maxtext.installed():
    dual = max_utils.reorder_causal_load_balanced(
        batch, cp, ReorderStrategy.DUAL_CHUNK_SWAP, "gpu")
    striped = max_utils.reorder_causal_load_balanced(
        batch, cp, ReorderStrategy.STRIPED, "gpu")
  np.testing.assert_array_equal(
      dual["inputs"], max_utils.reorder_sequence(batch["inputs"], cp))
  shards = np.asarray(striped["inputs"][0]).reshape(cp, t // cp)
  np.testing.assert_array_equal(
      shards, np.arange(t).reshape(t // cp, cp).T)
  np.testing.assert_array_equal(striped["other"], batch["other"])


# -- what is read, without a model ----------------------------------------

def op(**fields):
  config = types.SimpleNamespace(moba=False)
  defaults = dict(attention_kernel="dot_product", attention_type="global",
                  is_absorbed_mqa=False, dropout_rate=0.0, config=config)
  return types.SimpleNamespace(**{**defaults, **fields})


TRAIN = dict(model_mode="train")


@pytest.mark.parametrize("fields,call,reason", [
    ({}, dict(model_mode="autoregressive"), "model_mode='autoregressive'"),
    ({}, dict(model_mode="prefill"), "model_mode='prefill'"),
    (dict(attention_kernel="paged"), TRAIN, "attention='paged'"),
    (dict(attention_type="chunk"), TRAIN, "attention_type='chunk'"),
    ({}, dict(TRAIN, previous_chunk=1), "chunked prefill"),
    ({}, dict(TRAIN, bidirectional_mask=1), "bidirectional"),
    ({}, dict(TRAIN, indexer_mask=1), "indexer"),
    ({}, dict(TRAIN, record_max_logits=True), "record_max_logits"),
])
def test_what_maxtext_runs_itself(fields, call, reason):
  array = np.zeros((1, 2))
  assert reason in _read.fallback_reason(op(**fields), call, array, array)


def test_a_served_call_has_no_reason():
  array = np.zeros((1, 2))
  for kind in _read.CAUSAL:
    assert _read.fallback_reason(op(attention_type=kind), TRAIN, array,
                                 array) is None


def layout_config(**fields):
  defaults = dict(context_sharding="context",
                  context_parallel_load_balance=True,
                  context_parallel_reorder_strategy="auto",
                  context_parallel_strategy="all_gather", hardware="gpu",
                  packing=True)
  return types.SimpleNamespace(**{**defaults, **fields})


MESH = types.SimpleNamespace(shape={"fsdp": 2, "context": 4})


@pytest.mark.parametrize("fields,layout", [
    ({}, _read.Layout("dual_chunk", 4)),
    (dict(context_parallel_strategy="ring"), _read.Layout("striped", 4)),
    (dict(context_parallel_strategy="ring", hardware="tpu"),
     _read.Layout("dual_chunk", 4)),
    (dict(context_parallel_reorder_strategy="striped"),
     _read.Layout("striped", 4)),
    (dict(context_parallel_load_balance=False), _read.Layout(None, 1)),
])
def test_the_batch_layout_is_read_as_maxtexts_pipeline_makes_it(fields,
                                                               layout):
  assert _read.batch_layout(layout_config(**fields), MESH) == layout


def test_a_layout_it_cannot_read_names_the_key():
  with pytest.raises(ValueError, match="context_parallel_reorder_strategy"):
    _read.batch_layout(layout_config(context_parallel_reorder_strategy="x"),
                       MESH)
  with pytest.raises(ValueError, match="context_sharding='seq'"):
    _read.batch_layout(layout_config(context_sharding="seq"), MESH)


def test_install_checks_its_arguments():
  with pytest.raises(ValueError, match="strategy"):
    jax_ring.maxtext.install("zigzag")
  with pytest.raises(ValueError, match="hybrid"):
    jax_ring.maxtext.install("hybrid")
  with pytest.raises(ValueError, match="implementation"):
    jax_ring.maxtext.install(implementation="triton")
