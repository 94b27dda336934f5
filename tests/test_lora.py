"""LoRA (jax_ring.models.add_lora, save_adapter, load_adapter, merge_lora)
against PEFT itself, on tiny transformers checkpoints (float32, CPU):
PEFT loads our adapters and gives our logits; adapters PEFT trained load
into ours with PEFT's logits; our merge equals PEFT's ``merge_and_unload``;
context-parallel on packed rows with FSDP, the adapters' gradients equal
torch's through PEFT."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import flax as jrf, models
from jax_ring.models import lora
from helpers import relative_error
from hf_models import (CONFIGS, V, assert_logits_close, hf_logits,
                         mesh_2x4, packed_batch, torch_loss_and_grads)

FAMILIES = ("llama3", "qwen3", "gemma3")


@pytest.fixture(scope="module")
def peft():
  """peft, imported when a test asks (it imports much of torch and
  transformers, about 11 s): in the one worker running this file."""
  return pytest.importorskip("peft")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> a directory holding a random transformers checkpoint."""
  out = {}
  for i, name in enumerate(FAMILIES):
    torch.manual_seed(10 + i)
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
      for p in model.parameters():
        p.normal_(0.0, 0.2)
    out[name] = tmp_path_factory.mktemp(name)
    model.save_pretrained(out[name])
  return out


def hf_model(path):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, attn_implementation="eager")
  return model.eval()


def randomize(model, seed):
  """Every adapter's A and B random (B starts at zero); drawn by NumPy,
  so that no shape costs a compile."""
  for n, (_, adapter) in enumerate(sorted(lora.adapters(model).items())):
    for j, var in enumerate((adapter.a, adapter.b)):
      rng = np.random.default_rng(seed * 1000 + 2 * n + j)
      x = (0.3 * rng.standard_normal(var.shape)).astype(var.dtype)
      var.set_value(jax.device_put(x, var.get_value().sharding))


def tokens_of(seed, shape=(2, 23)):
  return np.random.default_rng(seed).integers(1, V, shape)


def our_logits(model, tokens):
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions)))


# Llama 3 by default: save_adapter and merge_lora hold no per-family code;
# each family's adapters against PEFT's in test_an_adapter_peft_trained_
# loads_into_ours, its merged checkpoint in transformers in test_models.py::
# test_our_checkpoint_loads_in_transformers.
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.sample(1)
def test_peft_reads_our_adapter_and_our_merge_equals_its_own(
    name, checkpoints, tmp_path, peft):
  """Every linear module adapted (rank 8, alpha 12: the rank PEFT trains
  below, so that those tests reuse these eager programs), the adapters
  random:
  PEFT loads what save_adapter wrote and its logits equal ours; then
  merge_lora + save_pretrained write exactly PEFT's merge_and_unload
  weights, which transformers' forward turns into the same logits."""
  path = checkpoints[name]
  ours = models.load_pretrained(path, implementation="xla")
  models.add_lora(ours, rank=8, alpha=12, rngs=nnx.Rngs(0), base_dtype=None)
  randomize(ours, 1)
  tokens = tokens_of(2)
  want = our_logits(ours, tokens)
  models.save_adapter(ours, tmp_path / "adapter")
  config = json.loads((tmp_path / "adapter" / "adapter_config.json")
                      .read_text())
  assert (config["r"], config["lora_alpha"]) == (8, 12.0)
  theirs = peft.PeftModel.from_pretrained(hf_model(path),
                                          tmp_path / "adapter").eval()
  assert_logits_close(hf_logits(theirs, tokens), want, name)

  merged = theirs.merge_and_unload().state_dict()
  models.merge_lora(ours)
  assert not lora.adapters(ours)
  assert_logits_close(our_logits(ours, tokens), want, "merged")
  models.save_pretrained(ours, tmp_path / "merged")
  saved = load_file(tmp_path / "merged" / "model.safetensors")
  for key, x in saved.items():
    assert relative_error(x, merged[key].numpy()) <= 1e-6, key


# (family, PEFT's LoraConfig fields): a list of modules with rsLoRA, a
# regular expression over one layer, a list over one layer, "all-linear".
# Each family once in the default run; "layers" with -m slow (an adapter on
# one layer loads in "regex"; the scanned model's refusal of one in
# test_lora_errors_name_what_is_wrong).
PEFT_CASES = [
    ("llama3", dict(target_modules=["q_proj", "v_proj", "down_proj"],
                    use_rslora=True)),
    ("gemma3", dict(target_modules=r".*layers\.1\.(self_attn\.[ko]_proj|mlp"
                    r"\.up_proj)")),
    pytest.param("llama3", dict(target_modules=["k_proj", "gate_proj"],
                                layers_to_transform=[0]),
                 marks=pytest.mark.slow),
    ("qwen3", dict(target_modules="all-linear")),
]


@pytest.mark.parametrize("name, fields", PEFT_CASES,
                         ids=["rslora", "regex", "layers", "all_linear"])
def test_an_adapter_peft_trained_loads_into_ours(name, fields, checkpoints,
                                                 tmp_path, peft):
  """PEFT adds adapters (rank 8, alpha 16), trains them three Adam steps
  and saves them; load_adapter puts them on our base model (which has
  none) and its logits equal PEFT's. Adapters on some layers only need
  a model whose layers are not stacked (``scan_layers=False``)."""
  path = checkpoints[name]
  torch.manual_seed(0)
  theirs = peft.get_peft_model(hf_model(path), peft.LoraConfig(
      r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", **fields))
  theirs.train()
  opt = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad],
                         lr=3e-2)
  x = torch.tensor(tokens_of(5, (2, 17)))
  for _ in range(3):
    opt.zero_grad()
    theirs(x, labels=x).loss.backward()
    opt.step()
  theirs.eval()
  theirs.save_pretrained(tmp_path / "adapter")
  ours = models.load_pretrained(path, implementation="xla")
  if "layers_to_transform" in fields:  # layers a scanned model stacks
    with pytest.raises(ValueError, match="scan_layers=False"):
      models.load_adapter(ours, tmp_path / "adapter")
    ours = models.load_pretrained(path, implementation="xla",
                                  scan_layers=False)
  models.load_adapter(ours, tmp_path / "adapter")
  assert lora.adapters(ours)
  tokens = tokens_of(6)
  assert_logits_close(our_logits(ours, tokens), hf_logits(theirs, tokens),
                      name)


# (strategy, family): Ulysses splits the query heads over the context axis,
# so it runs Qwen3 (4 query heads; Llama 3's 6 do not split four ways).
LORA_GRAD_CASES = [("ring", "llama3"),
                   pytest.param("all_gather", "llama3",
                                marks=pytest.mark.slow),
                   pytest.param("ulysses", "qwen3", marks=pytest.mark.slow)]


@pytest.mark.parametrize("strategy, name", LORA_GRAD_CASES)
def test_adapter_gradients_under_context_parallelism_equal_peft(
    strategy, name, checkpoints, tmp_path, peft):
  """Llama 3 (its two layers alike: scanned, one compiled block; Qwen3
  under Ulysses) on data=2 x context=4, FSDP weights, packed documents:
  the loss and the gradients with respect to the adapters alone
  (nnx.LoRAParam; nothing else gets one) equal torch's through PEFT, run
  per document. Each adapter is sharded like its weight's dims. (Windows
  under the ring, unrolled: test_models.py's test_gradients_match_torch.)"""
  path = checkpoints[name]
  mesh = mesh_2x4()
  cpc = jax_ring.ContextParallel(axis="context", strategy=strategy,
                                 inputs="load_balanced")
  rules = models.model_rules()
  ours = models.load_pretrained(
      path, mesh=mesh, implementation="xla", context_parallel=cpc,
      rules=rules, param_rules=jrf.fsdp_rules(rules, ("data", "context")))
  with jax.set_mesh(mesh):
    models.add_lora(ours, rank=4, alpha=8, rngs=nnx.Rngs(0), base_dtype=None)
    randomize(ours, 3)
  adapter = ours.layers[0].attn.wq_lora
  w_spec = tuple(ours.layers[0].attn.wq.sharding.spec)
  assert w_spec[0] == ("data", "context")  # FSDP
  assert tuple(adapter.a.sharding.spec) == (w_spec[0], None)
  models.save_adapter(ours, tmp_path / "adapter")
  theirs = peft.PeftModel.from_pretrained(
      hf_model(path), tmp_path / "adapter", is_trainable=True)

  tokens, ids, docs = packed_batch(7)
  batch = jrf.prepare_lm_batch(tokens, ids, mesh=mesh,
                               spec=P("data", "context"), context_parallel=cpc)
  with jax.set_mesh(mesh):
    loss, grads = nnx.jit(nnx.value_and_grad(
        lambda m: models.lm_loss(m, batch),
        argnums=nnx.DiffState(0, nnx.LoRAParam)))(ours)
  want_loss, want = torch_loss_and_grads(theirs, tokens, docs)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  flat = dict(nnx.to_flat_state(grads))
  assert all(key[-2].endswith("_lora") for key in flat), list(flat)[:3]
  checked = 0
  for (i, module), adapter in lora.adapters(ours).items():
    owner = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj",
                                            "o_proj")) else "mlp"
    base = f"base_model.model.model.layers.{i}.{owner}.{module}"
    parent, name = lora.MODULES[module]
    prefix = ("layers", i, parent, f"{name}_lora")
    r = adapter.rank
    got_a = np.asarray(flat[prefix + ("a",)].get_value()).reshape(-1, r).T
    got_b = np.asarray(flat[prefix + ("b",)].get_value()).reshape(r, -1).T
    assert relative_error(got_a, want[f"{base}.lora_A.default.weight"]) <= 2e-5
    assert relative_error(got_b, want[f"{base}.lora_B.default.weight"]) <= 2e-5
    checked += 1
  assert checked == 2 * 7


def test_dropout_draws_afresh_each_call_scanned_or_not(checkpoints):
  """LoRA dropout 0.5: a scanned model and an unrolled one with the same
  adapters (and streams) give the same logits, and a second call draws
  new masks in both; after ``eval()`` the logits are the dropout-free
  ones, and a Generator refuses the model until then."""
  path = checkpoints["llama3"]
  logits = []
  for scan in (False, True):
    model = models.load_pretrained(path, implementation="xla",
                                   scan_layers=scan)
    models.add_lora(model, rank=2, alpha=4, dropout=0.5, targets=["v_proj"],
                    base_dtype=None, rngs=nnx.Rngs(params=0, dropout=1))
    randomize(model, 4)
    tokens = tokens_of(8, (1, 11))
    step = nnx.jit(lambda m, t: m(t, jnp.arange(t.shape[1])[None]))
    with pytest.raises(ValueError, match="model.eval"):
      models.Generator(model)
    logits.append([np.asarray(step(model, jnp.asarray(tokens)))
                   for _ in range(2)])
    model.eval()
    logits[-1].append(np.asarray(step(model, jnp.asarray(tokens))))
    if not scan:  # the reference both eval() logits are compared with
      for adapter in lora.adapters(model).values():
        adapter.dropout = None
      logits[-1].append(np.asarray(step(model, jnp.asarray(tokens))))
  (a1, a2, a_eval, a_plain), (b1, b2, b_eval) = logits
  np.testing.assert_allclose(b1, a1, atol=1e-5)
  np.testing.assert_allclose(b2, a2, atol=1e-5)
  assert np.abs(a1 - a2).max() > 1e-3
  np.testing.assert_allclose(a_eval, a_plain, atol=1e-6)
  np.testing.assert_allclose(b_eval, a_plain, atol=1e-5)


def remat_adapter_grads(path, remat, scan=False):
  """The adapters' gradients (on every linear module of every layer, so
  that every block's recompute shows) of a train step's pattern: the
  adapters differentiated, the frozen rest passed into the jitted step and
  merged inside the gradient's trace; blocks under ``remat``, unrolled
  unless ``scan``. Returns them and the step's jaxpr, as text (under
  "attention")."""
  tokens = jnp.asarray(tokens_of(9, (1, 11)))
  positions = jnp.arange(11)[None]
  model = models.load_pretrained(path, implementation="xla",
                                 scan_layers=scan, remat=remat)
  models.add_lora(model, rank=2, alpha=4, base_dtype=None,
                  rngs=nnx.Rngs(params=0))
  randomize(model, 5)
  graph, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)

  @jax.jit
  def grad(adapters, rest):
    loss = lambda a: jnp.mean(nnx.merge(graph, a, rest)(tokens, positions)
                              ** 2)
    return jax.grad(loss)(adapters)

  return jax.tree.leaves(grad(adapters, rest)), (
      str(jax.make_jaxpr(grad)(adapters, rest)) if remat == "attention"
      else None)


@pytest.fixture(scope="module")
def grads_without_remat(checkpoints):
  return remat_adapter_grads(checkpoints["llama3"], False)[0]


# "attention" in the default run; True with -m slow (whole blocks
# recomputed, without adapters: test_models.py's
# test_remat_modes_give_the_same_loss_and_gradients).
@pytest.mark.parametrize("remat", ["attention", True])
@pytest.mark.sample(1)
def test_remat_of_unrolled_blocks_reads_frozen_weights_of_an_outer_trace(
    remat, checkpoints, grads_without_remat):
  """Unrolled blocks under a remat mode give the adapters the gradients
  they have without (the remat writes nothing back to the frozen weights
  of the outer trace); and remat="attention" runs one attention forward
  per layer, not two."""
  grads, jaxpr = remat_adapter_grads(checkpoints["llama3"], remat)
  if remat == "attention":  # one attention forward per layer, not two
    assert jaxpr.count("jax_ring_attention_fwd") == 2, jaxpr.count(
        "jax_ring_attention_fwd")
  for got, want in zip(grads, grads_without_remat, strict=True):
    assert relative_error(np.asarray(got), np.asarray(want)) <= 1e-5


def test_a_scanned_step_picks_the_frozen_base_in_place(checkpoints,
                                                      grads_without_remat):
  """Scanned blocks (2 groups) under remat="attention": the adapters get
  the unrolled blocks' gradients, and the frozen base weights are picked
  in place, never stacked (no array of a base weight's shape with a
  leading axis of 2 in the step, where the adapters' stacked ones are):
  stacked, a frozen 8B base is a 16 GB copy."""
  path = checkpoints["llama3"]
  grads, jaxpr = remat_adapter_grads(path, "attention", scan=True)
  for got, want in zip(grads, grads_without_remat, strict=True):
    assert relative_error(np.asarray(got), np.asarray(want)) <= 1e-5
  model = models.load_pretrained(path, implementation="xla")
  assert model.cfg.num_layers == 2
  models.add_lora(model, rank=2, alpha=4, base_dtype=None,
                  rngs=nnx.Rngs(params=0))
  stacked = lambda x: f"f32[2,{','.join(map(str, x.shape))}]"
  block = model.layers[0]
  base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  assert all(stacked(x) in jaxpr for x in
             jax.tree.leaves(nnx.state(block, nnx.LoRAParam)))
  assert not [stacked(x) for x in jax.tree.leaves(nnx.state(block, base))
              if x.ndim >= 2 and stacked(x) in jaxpr]


def test_lora_errors_name_what_is_wrong(checkpoints, tmp_path):
  path = checkpoints["llama3"]
  model = models.load_pretrained(path, implementation="xla")
  with pytest.raises(ValueError, match="targets"):
    models.add_lora(model, rank=2, alpha=4, targets=["qkv"],
                    rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rank"):
    models.add_lora(model, rank=0, alpha=4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="alpha must be a number"):
    models.add_lora(model, rank=2, alpha="16", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no adapters"):
    models.save_adapter(model, tmp_path / "a")
  models.add_lora(model, rank=2, alpha=4, targets=["q_proj"],
                  rngs=nnx.Rngs(0))
  assert model.layers[0].attn.wq[...].dtype == jnp.bfloat16  # the base
  assert model.layers[0].attn.wq_lora.a[...].dtype == jnp.float32
  with pytest.raises(ValueError, match="already has an adapter"):
    models.add_lora(model, rank=2, alpha=4, targets=["q_proj"],
                    rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="merge_lora"):
    models.save_pretrained(model, tmp_path / "plain")
  assert not (tmp_path / "plain").exists()
  models.save_adapter(model, tmp_path / "a")
  config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
  (tmp_path / "a" / "adapter_config.json").write_text(
      json.dumps(config | dict(use_dora=True)))
  with pytest.raises(ValueError, match="use_dora"):
    models.load_adapter(model, tmp_path / "a")
  (tmp_path / "a" / "adapter_config.json").write_text(
      json.dumps(config | dict(r=3)))
  with pytest.raises(ValueError, match=r"lora_A.weight must be \(3, 48\)"):
    models.load_adapter(model, tmp_path / "a")
  # An adapter on layer 0 alone (PEFT's layers_to_transform) cannot go on
  # the layers a scanned model stacks.
  (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
  weights = tmp_path / "a" / "adapter_model.safetensors"
  save_file({k: v for k, v in load_file(weights).items()
             if ".layers.0." in k}, weights)
  with pytest.raises(ValueError, match="scan_layers=False"):
    models.load_adapter(models.load_pretrained(path, implementation="xla"),
                        tmp_path / "a")
