"""jax_ring.models against the implementation users trust: tiny random Llama,
Qwen2 and Mistral checkpoints written by transformers itself, loaded into
``jax_ring.models.Llama``, logits compared in float32 with transformers'
own forward (torch, CPU), on one device and context-parallel on 8 simulated
devices; our checkpoints read back by transformers."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ring
from jax_ring import flax as jrf, models
from helpers import TOLERANCE, relative_error

V = 97
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=80,
              num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2)
CONFIGS = {
    # Llama 3's frequency scaling, with wavelengths on both sides of its
    # cut-offs at these positions (original context 16).
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16)),
    # q/k/v biases and tied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(**COMMON,
                                              tie_word_embeddings=True),
    # A sliding window shorter than the sequence.
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=9,
                                                  head_dim=8),
}


def mesh_2x4():
  return jax.make_mesh((2, 4), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (directory, the transformers model), weights random (biases
  and norms too, so that each is checked)."""
  out = {}
  for i, (name, make) in enumerate(CONFIGS.items()):
    torch.manual_seed(i)
    config = make()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
      for p in model.parameters():
        p.normal_(0.0, 0.2)
    model.eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    out[name] = (path, model)
  return out


def hf_logits(model, tokens, positions=None):
  with torch.no_grad():
    pos = None if positions is None else torch.tensor(positions)
    return model(torch.tensor(tokens), position_ids=pos).logits.numpy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_device_matches_transformers(name, checkpoints):
  path, hf = checkpoints[name]
  model = models.load_pretrained(path, implementation="xla")
  tokens = np.random.default_rng(1).integers(0, V, (2, 29))
  positions = np.broadcast_to(np.arange(29), tokens.shape)
  got = model(jnp.asarray(tokens), jnp.asarray(positions))
  assert relative_error(got, hf_logits(hf, tokens)) <= TOLERANCE


def packed_rows(seed, b, s):
  """(tokens, segment ids from 1, [(row, start, stop)] documents): odd
  document lengths, crossing the shards of a 4-way dual-chunk split."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (b, s))
  ids = np.zeros((b, s), np.int32)
  docs = []
  for row in range(b):
    start, doc = 0, 1
    while start < s:
      stop = min(s, start + (int(rng.integers(5, 20)) | 1))
      ids[row, start:stop] = doc
      docs.append((row, start, stop))
      start, doc = stop, doc + 1
  return tokens, ids, docs


@pytest.mark.parametrize("name, strategy", [("llama3", "ring"),
                                            ("qwen2", "auto"),
                                            ("mistral", "ring")])
def test_context_parallel_matches_transformers_per_document(
    name, strategy, checkpoints):
  """data=2 x context=4, packed documents whose positions restart at 0
  (transformers' ``position_ids`` convention); the reference runs each
  document through transformers on its own."""
  path, hf = checkpoints[name]
  mesh = mesh_2x4()
  cpc = jax_ring.ContextParallel(axis="context", strategy=strategy)
  rules = models.model_rules()
  model = models.load_pretrained(
      path, mesh=mesh, implementation="xla", context_parallel=cpc,
      rules=rules, param_rules=jrf.fsdp_rules(rules, ("data", "context")))
  tokens, ids, docs = packed_rows(2, 2, 64)
  batch = jrf.prepare_lm_batch(tokens, ids, mesh=mesh,
                               spec=P("data", "context"), context_parallel=cpc)
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda m, b: m(b.inputs, b.positions, b.segment_ids))(
        model, batch)
  assert logits.sharding.is_equivalent_to(
      NamedSharding(mesh, P("data", "context")), logits.ndim)
  got = np.asarray(jax_ring.reorder_from_load_balance(logits, 4))
  for row, start, stop in docs:
    want = hf_logits(hf, tokens[row:row + 1, start:stop])[0]
    assert relative_error(got[row, start:stop], want) <= TOLERANCE, (
        row, start, stop)


def test_sharded_load_places_each_weight_by_its_rules(checkpoints):
  path, _ = checkpoints["llama3"]
  mesh = mesh_2x4()
  rules = models.model_rules()
  model = models.load_pretrained(
      path, mesh=mesh, rules=rules,
      param_rules=jrf.fsdp_rules(rules, ("data", "context")))
  plain = models.load_pretrained(path)
  wq = model.layers[1].attn.wq[...]
  assert wq.sharding.spec == P(("data", "context"), None, None)
  assert wq.addressable_shards[0].data.shape == (48 // 8, 6, 8)
  np.testing.assert_array_equal(np.asarray(wq),
                                np.asarray(plain.layers[1].attn.wq[...]))
  assert model.embed[...].sharding.spec == P(None, ("data", "context"))


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_our_checkpoint_loads_in_transformers(name, checkpoints, tmp_path):
  """Saved in several files (with the index), read by transformers, the
  same logits as the model it came from; and read back by us bit for
  bit."""
  path, hf = checkpoints[name]
  model = models.load_pretrained(path, implementation="xla")
  out = models.save_pretrained(model, tmp_path / "ours",
                               max_shard_bytes=40_000)
  assert len(list(out.glob("*.safetensors"))) > 1
  assert (out / "model.safetensors.index.json").exists()
  back = transformers.AutoModelForCausalLM.from_pretrained(
      out, attn_implementation="eager")
  want = hf.state_dict()
  assert back.state_dict().keys() == want.keys()
  for key, x in back.state_dict().items():
    assert torch.equal(x, want[key]), key
  tokens = np.random.default_rng(3).integers(0, V, (2, 21))
  np.testing.assert_array_equal(hf_logits(back, tokens),
                                hf_logits(hf, tokens))
  again = models.load_pretrained(out, implementation="xla")
  params = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
  for a, b in zip(params(model), params(again), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_keeps_every_config_field_it_loaded(name, checkpoints,
                                                 tmp_path):
  """The token ids, max_position_embeddings and a field no library knows
  survive load_pretrained then save_pretrained, as transformers reads
  them (its defaults differ)."""
  path, _ = checkpoints[name]
  hf = json.loads((path / "config.json").read_text()) | dict(
      max_position_embeddings=77, pad_token_id=0, bos_token_id=1,
      eos_token_id=[2, 3], custom_field={"kept": True})
  base = tmp_path / "base"
  base.mkdir()
  (base / "config.json").write_text(json.dumps(hf))
  (base / "model.safetensors").symlink_to(path / "model.safetensors")
  out = models.save_pretrained(models.load_pretrained(base), tmp_path / "out")
  assert json.loads((out / "config.json").read_text()) == hf
  back = transformers.AutoConfig.from_pretrained(out)
  assert (back.max_position_embeddings, back.pad_token_id, back.bos_token_id,
          back.eos_token_id) == (77, 0, 1, [2, 3])


def test_loss_is_the_mean_next_token_cross_entropy(checkpoints):
  path, hf = checkpoints["qwen2"]
  model = models.load_pretrained(path, implementation="xla")
  tokens, ids, _ = packed_rows(4, 1, 24)
  batch = jrf.make_lm_batch(tokens, ids)
  loss = models.lm_loss(model, jax.tree.map(jnp.asarray, batch))
  logits = np.asarray(model(batch.inputs, batch.positions, batch.segment_ids),
                      np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + \
      logits.max(-1)
  ce = lse - np.take_along_axis(logits, batch.labels[..., None], -1)[..., 0]
  want = (ce * batch.loss_mask).sum() / batch.loss_mask.sum()
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported; jax_ring "
     "reads 'llama', 'qwen2' and 'mistral' checkpoints"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0)),
     "rope type 'yarn' is not supported (only 'default' and 'llama3')"),
    (dict(attention_bias=True),
     "config.json sets attention_bias=true, which this model does not "
     "implement"),
])
def test_unsupported_configs_are_named(change, message, checkpoints,
                                       tmp_path):
  path, _ = checkpoints["llama3"]
  hf = json.loads((path / "config.json").read_text())
  hf.pop("rope_scaling", None)
  with pytest.raises(ValueError, match=re.escape(message)):
    models.config_from_hf(hf | change)


def test_a_checkpoint_that_does_not_match_its_config_is_named(checkpoints,
                                                               tmp_path):
  path, _ = checkpoints["qwen2"]
  hf = json.loads((path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(hf | dict(
      num_hidden_layers=3)))
  (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
  with pytest.raises(ValueError, match=re.escape(
      "does not match its config.json: missing ['model.layers.2.input_"
      "layernorm.weight'")):
    models.load_pretrained(tmp_path)


def test_remat_modes_give_the_same_loss_and_gradients(checkpoints):
  """remat=True (whole blocks) and "attention" (blocks split around the
  attention, whose forward runs once) change what is recomputed, not the
  values."""
  path, _ = checkpoints["qwen2"]
  tokens, ids, _ = packed_rows(5, 2, 24)
  batch = jax.tree.map(jnp.asarray, jrf.make_lm_batch(tokens, ids))
  results = {}
  for remat in (False, True, "attention"):
    model = models.load_pretrained(path, implementation="xla", remat=remat)
    gdef, params = nnx.split(model)
    grad = jax.jit(jax.value_and_grad(
        lambda p: models.lm_loss(nnx.merge(gdef, p), batch)))
    results[remat] = grad(params)
    if remat == "attention":  # one attention forward per layer, not two
      jaxpr = str(jax.make_jaxpr(grad)(params))
      assert jaxpr.count("jax_ring_attention_fwd") == 2, jaxpr.count(
          "jax_ring_attention_fwd")
  for remat in (True, "attention"):
    np.testing.assert_allclose(results[remat][0], results[False][0],
                               rtol=1e-6)
    for a, b in zip(jax.tree.leaves(results[remat][1]),
                    jax.tree.leaves(results[False][1]), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                 atol=1e-6)


# 40: a padded last chunk, in the default run; 16 and 97 with -m slow.
@pytest.mark.parametrize("chunk", [pytest.param(16, marks=pytest.mark.slow),
                                   pytest.param(97, marks=pytest.mark.slow),
                                   40])
def test_vocab_chunked_loss_equals_the_whole_one(chunk, checkpoints):
  """The running logsumexp over vocabulary chunks (40: the last chunk is
  padded) gives the whole-vocabulary loss and gradients."""
  path, _ = checkpoints["llama3"]
  model = models.load_pretrained(path, implementation="xla")
  tokens, ids, _ = packed_rows(6, 2, 24)
  batch = jax.tree.map(jnp.asarray, jrf.make_lm_batch(tokens, ids))
  gdef, params = nnx.split(model)
  grad = lambda **kw: jax.jit(jax.value_and_grad(
      lambda p: models.lm_loss(nnx.merge(gdef, p), batch, **kw)))(params)
  (whole, g_whole), (chunked, g_chunked) = grad(), grad(vocab_chunk=chunk)
  np.testing.assert_allclose(chunked, whole, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_whole),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)
