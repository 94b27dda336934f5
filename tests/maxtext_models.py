"""Tiny MaxText models on the 8 simulated devices, built through MaxText's
own config and model factory, and what the MaxText tests compare: the
logits and every parameter's gradient of one batch, under MaxText's mesh
and logical axis rules, as its trainer runs them."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning

import jax_ring

import maxtext  # test_maxtext.py skips without it
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils, maxtext_utils_nnx
from maxtext.utils import model_creation_utils

BASE_YML = os.path.join(os.path.dirname(maxtext.__file__), "configs",
                        "base.yml")
T = 64  # tokens a row: divides 2 * context for every layout
# A 2-layer Llama-style model, float32 at the highest matmul precision,
# 2 rows over fsdp 2 x context 4. "hardware=gpu": MaxText lets only GPU
# configs name the striped layout; the devices are the CPU's either way.
SMALL = dict(
    run_name="t", enable_checkpointing="false", base_emb_dim=64,
    base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
    base_mlp_dim=128, base_num_decoder_layers=2, vocab_size=256,
    max_target_length=T, per_device_batch_size=0.25, dtype="float32",
    weight_dtype="float32", matmul_precision="highest",
    attention="dot_product", ici_fsdp_parallelism=2,
    ici_context_parallelism=4, hardware="gpu",
    skip_jax_distributed_system="true", scan_layers="true",
    enable_dropout="false")
GEMMA2 = dict(
    decoder_block="gemma2", base_num_decoder_layers=1,  # local + global
    attn_logits_soft_cap=50.0, sliding_window_size=8,
    final_logits_soft_cap=30.0, use_post_attn_norm="true",
    use_post_ffw_norm="true", logits_via_embedding="true",
    mlp_activations='["gelu","linear"]')


def argv(**overrides):
  """MaxText's command line for :data:`SMALL` with ``overrides``."""
  keys = {**SMALL, **overrides}
  return [None, BASE_YML] + [f"{k}={v}" for k, v in keys.items()]


def build(dtype=None, **overrides):
  """(config, mesh, model) as MaxText's factory makes them; ``dtype``
  (e.g. float64, which MaxText's config refuses to name) replaces the
  config's compute and weight dtypes after it is read."""
  config = pyconfig.initialize(argv(**overrides))
  if dtype is not None:
    for key in ("dtype", "weight_dtype", "grad_dtype", "mu_dtype"):
      config._flat_config[key] = jnp.dtype(dtype)
  mesh = maxtext_utils.get_mesh_from_config(config)
  with jax.set_mesh(mesh):
    model = model_creation_utils.from_config(
        config, mesh=mesh, rngs=maxtext_utils_nnx.create_nnx_rngs(config))
  return config, mesh, model


def batch(config, *, layout=None, documents=3, padding=5, seed=0):
  """(tokens, positions, segment ids) of ``config``'s global batch: random
  tokens; ``documents`` packed documents a row of random lengths with
  positions restarting at each, then ``padding`` tokens of id 0 (MaxText's
  padding id) unless 0; ``documents=None``: no segment ids. Put in
  ``layout`` over the context devices as MaxText's pipeline would."""
  rng = np.random.default_rng(seed)
  b, t = config.global_batch_size_to_train_on, config.max_target_length
  tokens = rng.integers(0, config.vocab_size, (b, t))
  if documents is None:
    ids, positions = None, np.tile(np.arange(t), (b, 1))
  else:
    ids = np.zeros((b, t), np.int64)
    positions = np.zeros((b, t), np.int64)
    for row in range(b):
      cuts = np.sort(rng.choice(np.arange(1, t - padding), documents - 1,
                                replace=False))
      bounds = [0, *cuts, t - padding]
      for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        ids[row, lo:hi] = d + 1
        positions[row, lo:hi] = np.arange(hi - lo)
      positions[row, t - padding:] = np.arange(padding)
  arrays = [jnp.asarray(x, jnp.int32) if x is not None else None
            for x in (tokens, positions, ids)]
  if layout is not None:
    cp = config.ici_context_parallelism
    arrays = [None if x is None else jax_ring.reorder_for_load_balance(
        x, cp, layout=layout) for x in arrays]
  return tuple(arrays)


def split(model):
  """(graph, parameters, the rest): the parameters are differentiated."""
  return nnx.split(model, nnx.Param, ...)


def step(config, mesh, graph):
  """A jitted ``(params, rest, tokens, positions, ids) -> (logits,
  d(sum(sin(logits)))/d(params))`` under MaxText's mesh and rules."""

  def logits(params, rest, tokens, positions, ids):
    model = nnx.merge(graph, params, rest)
    return model(tokens, positions, decoder_segment_ids=ids,
                 enable_dropout=False)

  def both(params, rest, *data):  # one forward: d sum(sin(l)) = cos(l) dl
    out, pullback = jax.vjp(lambda p: logits(p, rest, *data), params)
    return out, pullback(jnp.cos(out))[0]

  jitted = jax.jit(both)

  def run(*args):
    with jax.set_mesh(mesh), partitioning.axis_rules(
        config.logical_axis_rules):
      return jax.block_until_ready(jitted(*args))

  run.lower = lambda *args: _lowered(jitted, config, mesh, *args)
  return run


def _lowered(jitted, config, mesh, *args):
  with jax.set_mesh(mesh), partitioning.axis_rules(config.logical_axis_rules):
    return jitted.lower(*args).as_text()


def relative_errors(got, want):
  """Per leaf: max |got - want| / max(1, max |want|), in float64."""
  def one(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))
  return jax.tree.map(one, got, want)
