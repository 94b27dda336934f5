"""jax_ring.models against the implementation users trust: tiny random Llama,
Qwen2, Mistral, Qwen3, Gemma 2 and Gemma 3 checkpoints written by
transformers itself, loaded into ``jax_ring.models.Decoder``, logits
compared in float32 with transformers' own forward (torch, CPU), on one
device and context-parallel on 8 simulated devices (ring, auto, Ulysses),
packed documents against transformers run per document, gradients of the
loss against torch's; our checkpoints read back by transformers."""

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
from jax_ring.models.hf_checkpoint import tensor_map
from jax_ring.models.loss import chunked_cross_entropy
from helpers import relative_error
from hf_models import (CONFIGS, GRAD_TOLERANCE, NEW_FAMILIES, V,
                       assert_logits_close,
                       hf_logits, mesh_2x4, packed_batch, packed_rows,
                       torch_loss_and_grads)


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


# Qwen3 and Gemma 3 by default; the other four against transformers on one
# device in test_edited_configs_read_as_transformers_reads_them (edits
# that leave each model as it is), under -m slow here.
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in ("qwen3", "gemma3") else
                 pytest.mark.slow) for name in CONFIGS])
def test_one_device_matches_transformers(name, checkpoints):
  path, hf = checkpoints[name]
  model = models.load_pretrained(path, implementation="xla")
  tokens = np.random.default_rng(1).integers(0, V, (2, 29))
  positions = np.broadcast_to(np.arange(29), tokens.shape)
  got = model(jnp.asarray(tokens), jnp.asarray(positions))
  assert_logits_close(got, hf_logits(hf, tokens))


def context_parallel_model(name, strategy, checkpoints, **options):
  """(mesh, its ContextParallel, the model loaded onto data=2 x
  context=4, FSDP weights; ``options``: more DecoderConfig fields)."""
  mesh = mesh_2x4()
  cpc = jax_ring.ContextParallel(axis="context", strategy=strategy,
                                 inputs="load_balanced")
  rules = models.model_rules()
  model = models.load_pretrained(
      checkpoints[name][0], mesh=mesh, implementation="xla",
      context_parallel=cpc, rules=rules,
      param_rules=jrf.fsdp_rules(rules, ("data", "context")), **options)
  return mesh, cpc, model


# Gemma 2 under Ulysses in the default run; every family x strategy with
# -m slow. (The three older families have 6 query heads, which Ulysses
# cannot split over 4 devices.) (The ring and auto on packed documents:
# test_gradients_match_torch's llama3 and gemma2 cases; each family's own
# layers: test_one_device_matches_transformers.)
STRATEGY_CASES = [pytest.param("llama3", "ring", marks=pytest.mark.slow),
                  pytest.param("qwen2", "auto", marks=pytest.mark.slow),
                  pytest.param("mistral", "ring", marks=pytest.mark.slow),
                  pytest.param("gemma3", "ring", marks=pytest.mark.slow),
                  ("gemma2", "ulysses"),
                  pytest.param("qwen3", "auto", marks=pytest.mark.slow)]
STRATEGY_CASES += [pytest.param(name, strategy, marks=pytest.mark.slow)
                   for name in NEW_FAMILIES
                   for strategy in ("ring", "auto", "ulysses")
                   if (name, strategy) not in (("gemma2", "ulysses"),
                                               ("qwen3", "auto"),
                                               ("gemma3", "ring"))]


@pytest.mark.parametrize("name, strategy", STRATEGY_CASES)
def test_context_parallel_matches_transformers_per_document(
    name, strategy, checkpoints):
  """data=2 x context=4, packed documents whose positions restart at 0
  (transformers' ``position_ids`` convention) and a whole row; the
  reference runs each document through transformers on its own."""
  hf = checkpoints[name][1]
  mesh, cpc, model = context_parallel_model(name, strategy, checkpoints)
  tokens, ids, docs = packed_batch(2)
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
    assert_logits_close(got[row, start:stop], want, (row, start, stop))


# llama3's two layers alike, scanned: one group a layer. Gemma 2's windows
# and soft caps in the default run; Gemma 3 under the ring with -m slow
# (the ring: llama3's case; its window: test_flax.py's
# test_context_parallel_layer_equals_single_device).
GRADIENT_CASES = [("gemma2", "auto", False), ("llama3", "ring", True),
                  pytest.param("gemma3", "ring", False,
                               marks=pytest.mark.slow),
                  pytest.param("qwen3", "ulysses", False,
                               marks=pytest.mark.slow)]


@pytest.mark.parametrize("name, strategy, scan", GRADIENT_CASES)
def test_gradients_match_torch(name, strategy, scan, checkpoints):
  """The loss and every weight's gradient, context-parallel on packed
  documents, against torch's on transformers run per document, the
  blocks unrolled or (``scan``) scanned. (The tokens avoid the pad id:
  transformers' embedding keeps that row out of its gradient,
  ``padding_idx``; the model here does not.)"""
  hf = checkpoints[name][1]
  mesh, cpc, model = context_parallel_model(name, strategy, checkpoints,
                                            scan_layers=scan)
  tokens, ids, docs = packed_batch(7)
  tokens = np.maximum(tokens, 1)
  batch = jrf.prepare_lm_batch(tokens, ids, mesh=mesh,
                               spec=P("data", "context"), context_parallel=cpc)
  gdef, params = nnx.split(model)
  with jax.set_mesh(mesh):
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: models.lm_loss(nnx.merge(gdef, p), batch)))(params)
  want_loss, want = torch_loss_and_grads(hf, tokens, docs)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  flat = dict(nnx.to_flat_state(grads))
  tensors = list(tensor_map(model.cfg))
  assert {t.name for t in tensors} == want.keys()  # tied: listed once
  for t in tensors:
    got = t.to_hf(np.asarray(flat[t.key].get_value()))
    assert relative_error(got, want[t.name]) <= GRAD_TOLERANCE, t.name


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


@pytest.mark.parametrize("name", ["llama3", "qwen2", *NEW_FAMILIES])
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


def test_extra_config_that_changes_the_model_is_refused(checkpoints,
                                                        tmp_path):
  """Qwen2 with its windows given by max_window_layers (no layer_types):
  an extra_config max_window_layers would make transformers read another
  model back, so save_pretrained names it and writes nothing."""
  path, _ = checkpoints["qwen2"]
  hf = json.loads((path / "config.json").read_text())
  hf.pop("layer_types", None)
  hf.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
  base = tmp_path / "base"
  base.mkdir()
  (base / "config.json").write_text(json.dumps(hf))
  (base / "model.safetensors").symlink_to(path / "model.safetensors")
  model = models.load_pretrained(base)
  with pytest.raises(ValueError, match=re.escape(
      "save_pretrained: config.json would read back as another model "
      "(sliding_window None, the model's 5, layer_types None, the model's "
      "('full_attention', 'sliding_attention')); extra_config sets "
      "['max_window_layers']")):
    models.save_pretrained(model, tmp_path / "out",
                           extra_config={"max_window_layers": 2})
  assert not (tmp_path / "out").exists()
  models.save_pretrained(model, tmp_path / "out",
                         extra_config={"eos_token_id": 3})


# Under -m slow: test_gradients_match_torch checks lm_loss against torch's
# mean next-token cross-entropy.
@pytest.mark.slow
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


SLIDING = ["sliding_attention", "full_attention"]
UNSUPPORTED = {
    "model_type": ("llama3", dict(model_type="gpt2"),
                   "model_type 'gpt2' is not supported; jax_ring reads "
                   "'llama', 'qwen2', 'mistral', 'qwen3', 'gemma2', "
                   "'gemma3_text' checkpoints"),
    "multimodal_gemma3": ("gemma3", dict(model_type="gemma3"),
                          "model_type 'gemma3' is not supported (the "
                          "multimodal Gemma 3: its text model, model_type "
                          "'gemma3_text', is read)"),
    "rope_type": ("llama3", dict(rope_parameters=dict(rope_type="yarn",
                                                      factor=4.0)),
                  "rope type 'yarn' is not supported (only 'default', "
                  "'linear' and 'llama3')"),
    "local_rope_type": ("gemma3", dict(rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=1e6),
        sliding_attention=dict(rope_type="dynamic", factor=2.0))),
                        "rope_parameters['sliding_attention']: rope type "
                        "'dynamic' is not supported"),
    "attention_bias": ("llama3", dict(attention_bias=True),
                       "config.json sets attention_bias=true, which this "
                       "model does not implement"),
    "bidirectional": ("gemma3", dict(use_bidirectional_attention=True),
                      "config.json sets use_bidirectional_attention=true"),
    "gemma3_soft_cap": ("gemma3", dict(attn_logit_softcapping=50.0),
                        "config.json sets attn_logit_softcapping, which "
                        "transformers' Gemma 3 does not apply"),
    "activation": ("gemma2", dict(hidden_activation="relu"),
                   "hidden_activation 'relu' is not supported"),
    "window_off": ("qwen3", dict(use_sliding_window=False),
                   "layer_types[0] is 'sliding_attention' but the sliding "
                   "window is off"),
    "layer_type": ("gemma2", dict(layer_types=["chunked_attention"] * 2),
                   "layer_types[0] is 'chunked_attention'"),
    "mistral_layer_types": ("mistral", dict(layer_types=SLIDING),
                            "config.json sets layer_types, which "
                            "transformers' 'mistral' ignores"),
    "dropout": ("qwen2", dict(attention_dropout=0.1),
                "config.json sets attention_dropout=0.1"),
    "partial_rotary": ("qwen2", dict(partial_rotary_factor=0.5),
                       "config.json sets partial_rotary_factor=0.5: RoPE on "
                       "part of the head dim is not implemented"),
    "null_eps": ("mistral", dict(rms_norm_eps=None),
                 "config.json: rms_norm_eps must be a number, not None"),
    # A cap of 0 would make every logit 0 (final) or divide by zero.
    "zero_final_cap": ("gemma2", dict(final_logit_softcapping=0),
                       "config.json: final_logit_softcapping must be a "
                       "positive number or null, not 0"),
    "negative_cap": ("gemma2", dict(attn_logit_softcapping=-5.0),
                     "config.json: attn_logit_softcapping must be a positive "
                     "number or null, not -5.0"),
    "zero_scalar": ("gemma2", dict(query_pre_attn_scalar=0),
                    "config.json: query_pre_attn_scalar must be a positive "
                    "number, not 0"),
    "null_scalar": ("gemma3", dict(query_pre_attn_scalar=None),
                    "config.json: query_pre_attn_scalar must be a positive "
                    "number, not None"),
    "zero_pattern": ("gemma3", dict(layer_types=None,
                                    sliding_window_pattern=0),
                     "config.json: sliding_window_pattern must be a positive "
                     "integer, not 0"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_configs_are_named(case, checkpoints):
  """Each config.json value no layer here implements is a ValueError that
  names it, never a silently different model."""
  name, change, message = UNSUPPORTED[case]
  hf = json.loads((checkpoints[name][0] / "config.json").read_text())
  hf.pop("rope_scaling", None)
  with pytest.raises(ValueError, match=re.escape(message)):
    models.config_from_hf(hf | change)


EDITS = {
    # A tied config over a checkpoint with an output layer of its own:
    # transformers keeps the two apart, and so must we.
    "tied_with_its_own_head": ("llama3", dict(tie_word_embeddings=True)),
    # Only Gemma 3 reads sliding_window_pattern; Gemma 2 alternates.
    "gemma2_pattern": ("gemma2", dict(layer_types=None,
                                      sliding_window_pattern=3)),
    # rope_parameters' rope_theta wins over a top-level one.
    "top_level_rope_theta": ("mistral", dict(rope_theta=500_000.0)),
    # rope_scaling replaces rope_parameters (its theta then the default).
    "rope_scaling_replaces": ("mistral", dict(
        rope_parameters=dict(rope_type="default", rope_theta=500_000.0),
        rope_scaling=dict(rope_type="linear", factor=3.0))),
    # Keys transformers' Qwen2 ignores, and silu's other name.
    "qwen2_ignored_keys": ("qwen2", dict(attention_bias=True, mlp_bias=True,
                                         hidden_act="swish")),
    # A top-level original_max_position_embeddings wins for llama3 RoPE.
    "top_level_original_context": ("llama3", dict(
        original_max_position_embeddings=64)),
}


@pytest.mark.parametrize("case", EDITS)
def test_edited_configs_read_as_transformers_reads_them(case, checkpoints,
                                                        tmp_path):
  """config.json edited by hand in ways whose meaning is transformers'
  precedence: the loaded model's logits are transformers' own from the
  same files (positions from 100, where RoPE's base shows)."""
  name, change = EDITS[case]
  src = checkpoints[name][0]
  for f in src.iterdir():
    (tmp_path / f.name).write_bytes(f.read_bytes())
  hf = json.loads((src / "config.json").read_text())
  hf.update(change)
  hf = {k: v for k, v in hf.items() if v is not None}
  (tmp_path / "config.json").write_text(json.dumps(hf))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
  ours = models.load_pretrained(tmp_path, implementation="xla")
  tokens = np.random.default_rng(3).integers(0, V, (1, 21))
  positions = np.arange(100, 121)[None]
  assert_logits_close(ours(jnp.asarray(tokens), jnp.asarray(positions)),
                      hf_logits(theirs, tokens, positions), case)


def test_configs_in_transformers_4_spelling_read_as_transformers_5_does():
  """Gemma 3's config.json as transformers 4 wrote it (rope_theta,
  rope_local_base_freq, rope_scaling, sliding_window_pattern; Gemma-3-1B's
  own), and as transformers 5 rewrites it, give one config; so do Qwen3's
  and Gemma 2's defaults where keys are absent."""
  old = dict(model_type="gemma3_text", vocab_size=V, hidden_size=48,
             intermediate_size=80, num_hidden_layers=7,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             rope_theta=1e6, rope_local_base_freq=1e4,
             rope_scaling=dict(rope_type="linear", factor=8.0),
             sliding_window=512, sliding_window_pattern=6,
             max_position_embeddings=32768)
  new = transformers.Gemma3TextConfig(**old).to_dict()
  ours = models.config_from_hf(old).replace(hf_config=None)
  assert models.config_from_hf(new).replace(hf_config=None) == ours
  assert [ours.is_sliding(i) for i in range(7)] == [True] * 5 + [False, True]
  assert ours.attention(0).rope_max_wavelength == 1e4
  assert ours.attention(0).rope_scaling is None
  assert ours.attention(5).rope_max_wavelength == 1e6
  assert ours.attention(5).rope_scaling == models.LinearRopeScaling(8.0)
  assert ours.attention(0).local_window_size == (511, 0)
  assert ours.attention(5).local_window_size is None
  assert ours.attention(0).scale == 256 ** -0.5
  for kind, cls in (("qwen3", transformers.Qwen3Config),
                    ("gemma2", transformers.Gemma2Config)):
    bare = dict(model_type=kind, vocab_size=V, hidden_size=48,
                intermediate_size=80, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=77)
    assert models.config_from_hf(bare).replace(hf_config=None) == (
        models.config_from_hf(cls(**bare).to_dict()).replace(hf_config=None))


def test_a_config_its_model_type_cannot_write_is_refused(checkpoints):
  cfg = models.load_pretrained(checkpoints["qwen3"][0]).cfg
  with pytest.raises(ValueError, match=re.escape(
      "qk_norm=True cannot be saved as model_type 'llama' (whose qk_norm is "
      "False)")):
    models.config_to_hf(cfg.replace(model_type="llama"))
  with pytest.raises(ValueError, match=re.escape(
      "layer_types has no place in a 'mistral' checkpoint")):
    models.config_to_hf(cfg.replace(model_type="mistral", qk_norm=False))
  gemma3 = models.load_pretrained(checkpoints["gemma3"][0]).cfg
  with pytest.raises(ValueError, match=re.escape(
      "logits_soft_cap has no place in a 'gemma3_text' checkpoint")):
    models.config_to_hf(gemma3.replace(logits_soft_cap=50.0))


def test_a_checkpoint_that_does_not_match_its_config_is_named(checkpoints,
                                                               tmp_path):
  path, _ = checkpoints["llama3"]
  hf = json.loads((path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(hf | dict(
      num_hidden_layers=3)))
  (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
  with pytest.raises(ValueError, match=re.escape(
      "does not match its config.json: missing ['model.layers.2.input_"
      "layernorm.weight'")):
    models.load_pretrained(tmp_path)


@pytest.mark.parametrize("sliding, layers", [
    (1, 5), pytest.param(2, 8, marks=pytest.mark.slow)],
    ids=["period_2", "period_3"])
def test_scanned_layers_run_whole_groups_as_one_scan(sliding, layers):
  """``scan_layers``: the attention here repeats every ``sliding + 1``
  layers (``sliding`` sliding ones, one global), so 5 layers run as one
  scan over 2 groups of 2 then 1 unrolled (8: 2 groups of 3, then 2);
  logits and gradients are the unrolled blocks' up to float32 rounding,
  with each block but its attention rematerialised inside the scan (and
  under -m slow without remat; one layer a group without remat:
  test_gradients_match_torch[llama3-ring-True])."""
  kinds = ("sliding_attention",) * sliding + ("full_attention",)
  cfg = models.DecoderConfig(
      vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=layers,
      num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=5,
      layer_types=(kinds * 3)[:layers], implementation="xla")
  assert cfg.layer_period() == sliding + 1
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 24)))
  positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
  results = {}
  ways = ((False, False), (True, "attention")) + (
      ((True, False),) if layers > 5 else ())
  for scan, remat in ways:
    gdef, params = nnx.split(models.Decoder(
        cfg.replace(scan_layers=scan, remat=remat), rngs=nnx.Rngs(0)))
    logits = lambda p: nnx.merge(gdef, p)(tokens, positions)
    eqns = jax.make_jaxpr(logits)(params).jaxpr.eqns
    assert [e.params["length"] for e in eqns if e.primitive.name == "scan"
            ] == ([2] if scan else [])
    loss = lambda p: jnp.mean(logits(p) ** 2)
    results[scan, remat] = jax.jit(jax.value_and_grad(loss))(params)
  want_loss, want = results.pop((False, False))
  for got_loss, got in results.values():
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert relative_error(np.asarray(a), np.asarray(b)) <= 1e-5


def test_remat_modes_give_the_same_loss_and_gradients(checkpoints):
  """remat=True (whole blocks; the last one kept whole by remat_skip=1),
  "attention" (blocks split around the attention, whose forward runs once)
  and "attention_residual" (the output projection not recomputed either)
  change what is recomputed, not the values. (Unrolled blocks, so that the
  program shows each layer's attention calls and products.)"""
  path, _ = checkpoints["qwen2"]
  tokens, ids, _ = packed_rows(5, 2, 24)
  batch = jax.tree.map(jnp.asarray, jrf.make_lm_batch(tokens, ids))
  results, products = {}, {}
  for remat in (False, True, "attention", "attention_residual"):
    model = models.load_pretrained(path, implementation="xla", remat=remat,
                                   remat_skip=int(remat is True),
                                   scan_layers=False)
    assert model.cfg.num_layers == 2
    gdef, params = nnx.split(model)
    grad = jax.jit(jax.value_and_grad(
        lambda p: models.lm_loss(nnx.merge(gdef, p), batch)))
    results[remat] = grad(params)
    jaxpr = str(jax.make_jaxpr(grad)(params))
    products[remat] = jaxpr.count("dot_general[")
    if remat in ("attention", "attention_residual"):  # one forward a layer
      assert jaxpr.count("jax_ring_attention_fwd") == 2, jaxpr.count(
          "jax_ring_attention_fwd")
    if remat is True:  # the first block recomputed, the skipped one not
      assert jaxpr.count("remat2[") == 1, jaxpr.count("remat2[")
  # The output projection's forward: recomputed in each layer's backward
  # under "attention", not under "attention_residual".
  assert products["attention"] - products["attention_residual"] == 2, products
  for remat in (True, "attention", "attention_residual"):
    np.testing.assert_allclose(results[remat][0], results[False][0],
                               rtol=1e-6)
    for a, b in zip(jax.tree.leaves(results[remat][1]),
                    jax.tree.leaves(results[False][1]), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                 atol=1e-6)


# 40: a padded last chunk, Gemma 2's final soft cap on each chunk, in the
# default run; the rest with -m slow.
@pytest.mark.parametrize("name, chunk", [
    pytest.param("llama3", 16, marks=pytest.mark.slow),
    pytest.param("llama3", 97, marks=pytest.mark.slow),
    pytest.param("llama3", 40, marks=pytest.mark.slow),
    ("gemma2", 40)])
def test_vocab_chunked_loss_equals_the_whole_one(name, chunk, checkpoints):
  """The running logsumexp over vocabulary chunks (40: the last chunk is
  padded) gives the whole-vocabulary loss and gradients: with the output
  layer trained, and frozen (its gradient's other form: the hidden states'
  gradient gathered in the forward, two products fewer in the program)."""
  path, _ = checkpoints[name]
  model = models.load_pretrained(path, implementation="xla")
  tokens, ids, _ = packed_rows(6, 2, 24)
  batch = jax.tree.map(jnp.asarray, jrf.make_lm_batch(tokens, ids))
  head = lambda path, _: path[0] in ("embed", "unembed")
  products = {}
  for frozen in (False, True):
    gdef, fixed, params = nnx.split(model, head if frozen else nnx.Not(...),
                                    ...)

    def grad(**kw):
      f = jax.jit(jax.value_and_grad(lambda p: models.lm_loss(
          nnx.merge(gdef, fixed, p), batch, **kw)))
      if kw:
        products[frozen] = str(jax.make_jaxpr(f)(params)).count(
            "dot_general[")
      return f(params)

    if not frozen:  # frozen, the same loss and the other weights' gradients
      whole, g_whole = grad()
      want = dict(nnx.to_flat_state(g_whole))
    chunked, g_chunked = grad(vocab_chunk=chunk)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    got = dict(nnx.to_flat_state(g_chunked))
    assert got.keys() <= want.keys() and (got.keys() == want.keys()) != frozen
    for key, x in got.items():
      np.testing.assert_allclose(np.asarray(x.get_value()),
                                 np.asarray(want[key].get_value()),
                                 rtol=1e-5, atol=1e-6, err_msg=str(key))
  # Trained: one product a chunk forward, three backward (recompute, the
  # hidden states', the weights'); frozen: two forward, none backward.
  assert products[False] - products[True] == 2, products


def test_chunked_loss_takes_labels_outside_the_vocabulary_as_no_target():
  """A label outside ``[0, V)`` (past the last chunk's padding or below 0)
  adds no target to the chunked loss, nor to its gradients, with the
  output weights trained or frozen, soft-capped or not."""
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], (2, 7, 16))
  w = jax.random.normal(keys[1], (16, 45)) * 0.5
  g = jax.random.normal(keys[2], (2, 7))
  labels = jnp.asarray(np.random.default_rng(0).integers(0, 45, (2, 7)))
  labels = labels.at[0, 0].set(45).at[0, 1].set(47).at[1, 2].set(-1)
  inside = (labels >= 0) & (labels < 45)
  for cap in (None, 3.0):
    def whole(x, w):
      z = x @ w if cap is None else cap * jnp.tanh(x @ w / cap)
      t = jnp.take_along_axis(z, jnp.clip(labels, 0, 44)[..., None], -1)
      return jax.nn.logsumexp(z, -1) - jnp.where(inside, t[..., 0], 0.0)
    chunked = lambda x, w: chunked_cross_entropy(x, w, labels, 8, (), cap)
    np.testing.assert_allclose(chunked(x, w), whole(x, w), rtol=1e-5)
    grad = lambda f, argnums: jax.jit(jax.grad(
        lambda x, w: jnp.sum(f(x, w) * g), argnums))(x, w)
    for argnums in ((0, 1), 0):  # trained, frozen
      for a, b in zip(jax.tree.leaves(grad(chunked, argnums)),
                      jax.tree.leaves(grad(whole, argnums)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_natural_order_batches_are_laid_out_once(checkpoints):
  """The default ``ContextParallel()`` (natural-order inputs) on a model:
  the logits equal those of the same model fed the batch already laid
  out (``inputs="load_balanced"``), and the program permutes only at the
  model's ends (activations, positions and ids in; hidden states out), not
  around every layer's attention: its collective permutes exceed the
  laid-out program's by the same few whatever the layers."""
  mesh = mesh_2x4()
  tokens, ids, _ = packed_batch(3)
  got, permutes = {}, {}
  for inputs in ("natural", "load_balanced"):
    cpc = jax_ring.ContextParallel(axis="context", strategy="ring",
                                   inputs=inputs)
    model = models.load_pretrained(checkpoints["llama3"][0], mesh=mesh,
                                   implementation="xla", context_parallel=cpc,
                                   rules=models.model_rules())
    batch = jrf.prepare_lm_batch(tokens, ids, mesh=mesh,
                                 spec=P("data", "context"),
                                 context_parallel=cpc)
    f = jax.jit(lambda m, b: m(b.inputs, b.positions, b.segment_ids))
    with jax.set_mesh(mesh):
      logits = f(model, batch)
      hlo = f.lower(model, batch).compile().as_text()
    if inputs == "load_balanced":
      logits = jax_ring.reorder_from_load_balance(logits, 4)
    got[inputs] = np.asarray(logits)
    permutes[inputs] = len(re.findall(r"collective-permute(?:-start)?\(",
                                      hlo))
  np.testing.assert_allclose(got["natural"], got["load_balanced"], atol=1e-5)
  # Two moves an array for the dual-chunk swap: x, positions and ids in,
  # the hidden states out (each layer's own would add ten).
  assert permutes["natural"] - permutes["load_balanced"] <= 8, permutes
