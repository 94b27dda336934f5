"""Generation against transformers' own ``generate``: tiny random float32
checkpoints (Llama with Llama 3's RoPE scaling, Qwen2, Mistral with a
window shorter than prompt + output, Gemma 2 with its soft caps and a
sliding layer) give transformers' greedy tokens, token
for token, on one device and with the cache split over the context axis of
a data=2 x context=4 mesh; prefill and decode logits equal the full
forward's; sampling is reproducible; bad calls are refused by name."""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jax_ring
from jax_ring import models
from jax_ring.models import generation as gen
from helpers import TOLERANCE, collectives, relative_error

V = 61
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(**COMMON, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8)),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    # prompt 9 + 7 new tokens against a window of 5
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=5,
                                                  head_dim=16),
    # soft caps that bite, query_pre_attn_scalar, a window on one layer of 2
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON, head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}
PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 35, 8], [27, 18, 28]]
NEW = 7


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (path, transformers' greedy continuation of each prompt)."""
  out = {}
  for i, (name, make) in enumerate(CONFIGS.items()):
    torch.manual_seed(i)
    hf = transformers.AutoModelForCausalLM.from_config(make()).eval()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW,
                        min_new_tokens=NEW, do_sample=False,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    out[name] = (path, want)
  return out


def cp_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  return jax.make_mesh((2, 4), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


# Mistral (its window) on one device; Qwen2's greedy tokens against
# transformers' in test_a_tiny_temperature_is_greedy_and_options_are_named;
# Llama 3, Gemma 2 and the cache sharded under -m slow (Gemma 2, whose
# window and soft caps the split must respect, with the cache sharded in
# the default run: test_several_tokens_a_call_give_the_same_tokens).
@pytest.mark.parametrize("name, cache", [
    pytest.param(name, cache, marks=pytest.mark.slow if (
        cache == "sharded" or name != "mistral") else ())
    for name in CONFIGS for cache in ("one_device", "sharded")])
def test_greedy_tokens_equal_transformers(name, cache, checkpoints):
  path, want = checkpoints[name]
  if cache == "one_device":
    got = gen.generate(models.load_pretrained(path), PROMPTS,
                       max_new_tokens=NEW)
  else:
    mesh = cp_mesh()
    with jax.set_mesh(mesh):
      model = models.load_pretrained(
          path, mesh=mesh, rules=models.model_rules(),
          context_parallel=jax_ring.ContextParallel(axis="context"))
      got = gen.generate(model, PROMPTS, max_new_tokens=NEW)
  assert got == want


# Gemma 2 under -m slow: the spare row is the step's for every family.
@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
@pytest.mark.sample(1)
def test_one_prompt_gives_transformers_tokens(name, checkpoints):
  """Batch 1 on one device, where the step carries a spare query row
  through the layers: transformers' greedy tokens."""
  path, want = checkpoints[name]
  got = gen.generate(models.load_pretrained(path), PROMPTS[:1],
                     max_new_tokens=NEW)
  assert got == want[:1]


def test_a_checkpoint_loads_in_its_own_dtype(checkpoints, tmp_path):
  """As transformers 5 loads (``dtype="auto"``): config.json's dtype, else
  the tensors'; the loaded weights hold the checkpoint's bytes; asking for
  another param_dtype is heard."""
  import json
  from safetensors import safe_open
  path, _ = checkpoints["llama3"]
  model = models.load_pretrained(path)
  assert (model.cfg.dtype, model.cfg.param_dtype) == (jnp.float32,) * 2
  bf16 = tmp_path / "bf16"
  models.save_pretrained(model, bf16, dtype=jnp.bfloat16)
  config = json.loads((bf16 / "config.json").read_text())
  for key in ("dtype", "torch_dtype"):  # the tensors' dtype decides
    config.pop(key, None)
  (bf16 / "config.json").write_text(json.dumps(config))
  for loaded in (models.load_pretrained(bf16),
                 models.load_pretrained(bf16, dtype=jnp.float32)):
    assert loaded.cfg.param_dtype == jnp.bfloat16
    leaves = jax.tree.leaves(nnx.state(loaded, nnx.Param))
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
    with safe_open(bf16 / "model.safetensors", "np") as f:
      stored = sum(f.get_slice(n).get_dtype() == "BF16" and
                   2 * np.prod(f.get_slice(n).get_shape()) for n in f.keys())
    assert sum(x.nbytes for x in leaves) == stored
  assert models.load_pretrained(bf16).cfg.dtype == jnp.bfloat16
  wide = models.load_pretrained(bf16, param_dtype=jnp.float32)
  assert (wide.cfg.dtype, wide.cfg.param_dtype) == (jnp.bfloat16,
                                                    jnp.float32)


def test_a_generator_casts_wide_weights_once(checkpoints, monkeypatch):
  """float32 weights, bfloat16 compute: the generator holds the matrices
  in bfloat16 (norms as stored), and its logits are the same bits as a
  generator that casts them in every step."""
  path, _ = checkpoints["llama3"]
  model = models.load_pretrained(path, dtype=jnp.bfloat16,
                                 param_dtype=jnp.float32)
  once = gen.Generator(model)
  assert {jnp.dtype(x.dtype) for x in jax.tree.leaves(once._leaves)} >= {
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
  got, _ = once.prefill(PROMPTS, max_new_tokens=2)
  monkeypatch.setattr(gen, "CAST_AT_USE", frozenset())
  every_step = gen.Generator(model)
  assert {x.dtype for x in jax.tree.leaves(every_step._leaves)} == {
      jnp.dtype(jnp.float32)}
  want, _ = every_step.prefill(PROMPTS, max_new_tokens=2)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_one_row_step_projects_two_rows(checkpoints):
  """At batch 1 every product with a layer's weights sees two rows (one
  of them the spare), so none is a one-row product; only the logits'
  product takes the one row kept. (Qwen2's prefill of one prompt:
  test_one_prompt_gives_transformers_tokens compiles it.)"""
  generator = gen.Generator(models.load_pretrained(checkpoints["qwen2"][0]))
  cfg = generator.cfg
  _, cache = generator.prefill(PROMPTS[:1], max_new_tokens=NEW)
  text = generator.lower_step(cache, [3]).as_text()
  lhs = re.findall(r"dot_general.*?: \(tensor<([0-9x]+)xf32>", text)
  # rows: the left operand's size less its last (contracted) dimension
  one_row = [s for s in lhs
             if np.prod([int(d) for d in s.split("x")[:-1]]) == 1]
  # 4 attention and 3 MLP products a layer, and the logits'
  assert len(lhs) >= 7 * cfg.num_layers + 1, lhs
  assert one_row == ["1x32"], one_row


# Under -m slow: the step hands decode_implementation to decode_attention,
# whose kernel test_decode_pallas.py checks against the reference.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2"])  # head dims of 16
def test_the_pallas_decode_kernel_gives_the_same_tokens(name, checkpoints):
  """``Generator(decode_implementation="pallas")`` on one device
  (interpreted off GPUs), a window, soft caps: transformers' greedy
  tokens."""
  path, want = checkpoints[name]
  got = gen.Generator(models.load_pretrained(path),
                      decode_implementation="pallas").generate(
                          PROMPTS, max_new_tokens=NEW)
  assert got == want


@pytest.mark.parametrize("data, context, rows", [
    (2, 4, 2), (1, 2, 1), pytest.param(1, 4, 1, marks=pytest.mark.slow)],
                         ids=["dp2_cp4_b2", "dp1_cp2_b1", "dp1_cp4_b1"])
@pytest.mark.sample(1)
def test_a_step_over_the_context_axis_moves_only_the_merge(data, context,
                                                           rows, checkpoints):
  """The cache split over 2 or 4 devices: a decode step's only collectives
  are each layer's merge of its attention, one all-reduce; the new token's
  activations are not split over the context axis (one token cannot be,
  nor one row's spare), so no norm or projection needs one. (Gemma 2 on
  2 x 4: test_several_tokens_a_call_give_the_same_tokens' prefill.)"""
  if len(jax.devices()) < data * context:
    pytest.skip(f"needs {data * context} devices")
  mesh = jax.make_mesh((data, context), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * context])
  with jax.set_mesh(mesh):
    generator = gen.Generator(models.load_pretrained(
        checkpoints["gemma2"][0], mesh=mesh, rules=models.model_rules(),
        context_parallel=jax_ring.ContextParallel(axis="context")))
    cfg = generator.cfg
    _, cache = generator.prefill(PROMPTS[:rows], max_new_tokens=NEW)
    hlo = generator.lower_step(cache, [3, 4][:rows]).compile().as_text()
  assert collectives(hlo) == {"all-gather": 0, "reduce-scatter": 0,
                              "all-reduce": cfg.num_layers,
                              "collective-permute": 0, "all-to-all": 0}


# Under -m slow: the split cache in the default layout gives transformers'
# tokens in test_several_tokens_a_call_give_the_same_tokens; each layout's
# attention is tested in its own module (hybrid: test_flax.py's
# test_context_parallel_layer_equals_single_device[hybrid_packed];
# striped: test_first_call.py's
# test_natural_inputs_are_exact_by_default[ring-striped]).
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    "hybrid", "striped", "contiguous", "context_of_one"])
def test_other_layouts_give_the_same_tokens(layout, checkpoints):
  """The prompt in the striped layout, contiguous, over a pair of axes
  (Ulysses inside a ring, data=2 x ring=2 x ulysses=2), or on a context
  axis of one device beside a data axis: the cache's slots follow the
  tokens, and the greedy tokens are transformers'."""
  cp_mesh()  # skips without 8 devices
  path, want = checkpoints["mistral"]
  if layout == "context_of_one":
    mesh = jax.make_mesh((2, 1), ("data", "context"),
                         devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules, cpc = models.model_rules(), jax_ring.ContextParallel(
        axis="context")
  elif layout == "hybrid":
    mesh = jax.make_mesh((2, 2, 2), ("data", "ring", "ulysses"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rules = models.model_rules(context=("ring", "ulysses"))
    cpc = jax_ring.ContextParallel(axis=("ulysses", "ring"),
                                   strategy="hybrid")
  else:
    mesh, rules = cp_mesh(), models.model_rules()
    cpc = jax_ring.ContextParallel(
        axis="context", load_balance=None if layout == "contiguous" else
        layout)
  with jax.set_mesh(mesh):
    model = models.load_pretrained(path, mesh=mesh, rules=rules,
                                   context_parallel=cpc)
    assert gen.generate(model, PROMPTS, max_new_tokens=NEW) == want


# Under -m slow: the split cache's tokens are transformers' in
# test_several_tokens_a_call_give_the_same_tokens, its attention the
# reference's in test_decode.py.
@pytest.mark.slow
def test_prefill_and_decode_logits_equal_the_full_forward(checkpoints):
  """With the cache split over 4 devices: the logits after the prompt and
  after each decoded token equal the full forward's at those positions."""
  mesh = cp_mesh()
  path, want = checkpoints["mistral"]
  whole = models.load_pretrained(path)
  seq = np.array([p + w for p, w in zip(PROMPTS, want)][:1])
  full = np.asarray(whole(seq, np.arange(seq.shape[1])[None]))[0]
  with jax.set_mesh(mesh):
    model = models.load_pretrained(
        path, mesh=mesh, rules=models.model_rules(),
        context_parallel=jax_ring.ContextParallel(axis="context"))
    generator = gen.Generator(model)
    logits, cache = generator.prefill(PROMPTS[:1], max_new_tokens=NEW)
    got = [np.asarray(logits)[0]]
    for step, token in enumerate(want[0][:-1]):
      logits, cache = generator.step(cache, [token], step)
      got.append(np.asarray(logits)[0])
  n = len(PROMPTS[0])
  assert relative_error(np.stack(got), full[n - 1:n - 1 + NEW]) < TOLERANCE


def test_sampling_is_reproducible_and_top_k_1_is_greedy(checkpoints):
  path, want = checkpoints["qwen2"]
  model = models.load_pretrained(path)
  hot = gen.Sampling(temperature=1.5, top_k=20, top_p=0.9)
  run = lambda sampling, seed: gen.generate(
      model, PROMPTS, max_new_tokens=NEW, sampling=sampling, seed=seed)
  assert run(hot, 3) == run(hot, 3)
  assert run(hot, 3) != run(hot, 4)
  # top_k=1: the draw of generate's steps, jitted, on the prompts' logits
  # (not a decode program of its own): the first greedy tokens.
  logits, _ = gen.Generator(model).prefill(PROMPTS, max_new_tokens=NEW)
  one = jax.jit(gen.Sampling(temperature=1.0, top_k=1).draw)
  assert one(logits, jax.random.key(5)).tolist() == [w[0] for w in want]


@pytest.mark.parametrize("kw", [dict(top_p=0.5), dict(top_p=0.9),
                                dict(top_k=3), dict(top_k=2, top_p=0.8)],
                         ids=str)
@pytest.mark.sample(2)
def test_filtered_tokens_are_transformers_warpers(kw):
  """The tokens the draw is made from are those transformers' TopK and
  TopP warpers keep (temperature 0.7), on random logits; on a row of ties
  (four equal logits) the nucleus has transformers' count."""
  from transformers.generation import logits_process as lp
  logits = np.random.default_rng(4).normal(size=(5, 11)).astype(np.float32)
  ties = np.array([[1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]], np.float32)
  sampling = gen.Sampling(0.7, **kw)
  warpers = [lp.TemperatureLogitsWarper(0.7)] + (
      [lp.TopKLogitsWarper(kw["top_k"])] if "top_k" in kw else []) + (
      [lp.TopPLogitsWarper(kw["top_p"])] if "top_p" in kw else [])
  for x in (logits, ties):
    theirs = torch.tensor(x)
    for w in warpers:
      theirs = w(None, theirs)
    ours = np.isfinite(np.asarray(sampling.filter(jax.numpy.asarray(x))))
    theirs = np.isfinite(theirs.numpy())
    if x is logits:
      np.testing.assert_array_equal(ours, theirs)
    else:
      assert ours.sum() == theirs.sum(), (ours, theirs)


def test_stop_tokens_end_a_row_and_are_kept(checkpoints):
  path, want = checkpoints["qwen2"]
  got = gen.generate(models.load_pretrained(path), PROMPTS,
                     max_new_tokens=NEW, stop_tokens=[want[0][2]])
  first = want[0].index(want[0][2])
  assert got[0] == want[0][:first + 1]
  stop_1 = [i for i, t in enumerate(want[1]) if t == want[0][2]]
  assert got[1] == want[1][:stop_1[0] + 1] if stop_1 else want[1]


def test_several_tokens_a_call_give_the_same_tokens(checkpoints):
  """``tokens_per_call`` steps as one program: transformers' greedy tokens
  with the cache split over the context axis (Gemma 2: its window and soft
  caps; 7 tokens: the prefill's and two calls of 3), the same draws as one
  token a call with sampling (8 a call: the last call's steps past
  max_new_tokens dropped), stops at the same token inside a call, and
  ``on_tokens`` sees every step in order."""
  path, want = checkpoints["gemma2"]
  mesh = cp_mesh()
  with jax.set_mesh(mesh):
    model = models.load_pretrained(
        path, mesh=mesh, rules=models.model_rules(),
        context_parallel=jax_ring.ContextParallel(axis="context"))
    steps = []
    got = gen.generate(model, PROMPTS, max_new_tokens=NEW, tokens_per_call=3,
                       on_tokens=lambda step, _: steps.append(step))
  assert got == want and steps == list(range(NEW))
  # 8 a call: test_sampling_is_reproducible_and_top_k_1_is_greedy's program
  generator = gen.Generator(models.load_pretrained(checkpoints["qwen2"][0]))
  hot = gen.Sampling(temperature=1.5, top_k=20, top_p=0.9)
  run = lambda n, **kw: generator.generate(
      PROMPTS, max_new_tokens=NEW, sampling=hot, seed=3, tokens_per_call=n,
      **kw)
  one = run(1)
  assert run(8) == one
  stop = one[0][3]  # inside the first call of 8 (or earlier)
  first = one[0].index(stop)
  assert run(8, stop_tokens=[stop])[0] == one[0][:first + 1]


def test_a_tiny_temperature_is_greedy_and_options_are_named(checkpoints):
  """Logits over a temperature of 2e-38 overflow float32 unless shifted
  first: the tokens must be the greedy ones. NumPy numbers are numbers;
  a seed, stop tokens or sampling of another kind are named."""
  path, want = checkpoints["qwen2"]
  generator = gen.Generator(models.load_pretrained(path))
  run = lambda **kw: generator.generate(PROMPTS, max_new_tokens=NEW, **kw)
  assert run(seed=np.int64(1)) == want
  # The draw of generate's steps, jitted, on the prompts' logits (not a
  # decode program of its own): the first greedy tokens.
  tiny = gen.Sampling(np.float32(2e-38), top_k=np.int64(5), top_p=0.5)
  logits, _ = generator.prefill(PROMPTS, max_new_tokens=NEW)
  drawn = jax.jit(tiny.draw)(logits, jax.random.key(1))
  assert drawn.tolist() == [w[0] for w in want]
  for kw, error, message in (
      (dict(seed=2**32), ValueError, "seed must be an int in [0, 2**32); "
       "got 4294967296"),
      (dict(seed=None), ValueError, "seed must be an int in [0, 2**32); got "
       "None"),
      (dict(stop_tokens=5), TypeError, "stop_tokens must be a list of int "
       "token ids; got 5"),
      (dict(stop_tokens=[1.5]), ValueError, "stop_tokens must be a list of "
       "int token ids; got float64 (1,)"),
      (dict(sampling=None), TypeError, "sampling must be a jax_ring.models."
       "generation.Sampling; got None"),
      (dict(tokens_per_call=0), ValueError, "tokens_per_call must be an int "
       ">= 1; got 0")):
    with pytest.raises(error, match="^" + re.escape(message)):
      run(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=True), "temperature must be a finite number >= 0"),
    (dict(top_k=0), "top_k must be None or an int >= 1; got 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]; got 0.0"),
    # Below float32's smallest normal number the division by it is 0 / 0.
    (dict(temperature=1e-39, top_p=0.9), "temperature must be 0 (greedy) or "
     "at least 1.175e-38"),
])
def test_sampling_parameters_out_of_range_are_named(kw, message):
  with pytest.raises(ValueError, match="^" + re.escape(message)):
    gen.Sampling(**kw)


def test_logits_holding_nan_draw_no_token(checkpoints):
  """A row whose logits hold NaN has no distribution: the sampler marks it
  (greedy, top-k and nucleus alike) and generate names the step and row,
  where it used to return token 0."""
  logits = jnp.asarray([[0.0, 1.0, 2.0], [0.5, jnp.nan, 0.1]])
  samplings = (gen.Sampling(), gen.Sampling(1.0, top_p=0.5),
               gen.Sampling(0.7, top_k=2))
  # One program (as generate draws, jitted), not each operation eagerly.
  drawn = jax.jit(lambda x, key: [s.draw(x, key) for s in samplings])(
      logits, jax.random.key(0))
  for sampling, tokens in zip(samplings, drawn):
    assert tokens[1] == -1 and 0 <= tokens[0] <= 2, (sampling, tokens)
  path, _ = checkpoints["qwen2"]
  model = models.load_pretrained(path)
  model.embed[...] = model.embed[...].at[27].set(jnp.nan)  # row 1's first
  with pytest.raises(ValueError, match=re.escape(
      "generate: step 0: the logits of row(s) [1] hold NaN")):
    gen.generate(model, PROMPTS, max_new_tokens=2)


def test_bad_prompts_steps_and_caches_are_named(checkpoints):
  path, _ = checkpoints["qwen2"]
  generator = gen.Generator(models.load_pretrained(path))
  with pytest.raises(ValueError, match=re.escape(
      "prompt token ids must be in [0, 61); prompt 0 holds 1..61")):
    generator.prefill([[1, 61]], max_new_tokens=2)
  with pytest.raises(ValueError, match=re.escape(  # not wrapped into int32
      "prompt token ids must be in [0, 61); prompt 1 holds 2..4294967297")):
    generator.prefill([[1], np.array([2**32 + 1, 2])], max_new_tokens=2)
  with pytest.raises(TypeError, match="prompts must be a list of token-id "
                     "lists; got"):
    generator.prefill([1, 2], max_new_tokens=2)
  with pytest.raises(ValueError, match=re.escape(
      "prompts must be a non-empty list of non-empty token lists")):
    generator.prefill([[1], []], max_new_tokens=2)
  # test_one_prompt_gives_transformers_tokens' prefill, compiled once
  _, cache = generator.prefill(PROMPTS[:1], max_new_tokens=2)
  assert cache.capacity == gen.SLOT_ALIGN
  with pytest.raises(ValueError, match=re.escape(
      "step 1015 is past the cache: it holds 1015 new tokens per device")):
    generator.step(cache, [3], gen.SLOT_ALIGN - 9)
  with pytest.raises(ValueError, match=re.escape(
      "tokens must be 1 int ids in [0, 61)")):
    generator.step(cache, [3, 4], 0)
  with pytest.raises(ValueError, match=re.escape(
      "prompt 0 must be a list of int token ids; got float64")):
    generator.prefill([[1.7, 2.0]], max_new_tokens=2)
  with pytest.raises(ValueError, match=re.escape(
      "step must be an int >= 0; got '0'")):
    generator.step(cache, [3], "0")
  parallel = models.load_pretrained(path, context_parallel=jax_ring.
                                    ContextParallel(axis="context"))
  with pytest.raises(ValueError, match=re.escape(
      "the model is context-parallel over 'context', which the mesh in "
      "scope {} lacks")):
    gen.Generator(parallel).prefill([[1, 2]], max_new_tokens=2)
  # Its shapes alone (no weights drawn): both calls are refused first.
  other = nnx.eval_shape(lambda: models.Decoder(models.DecoderConfig(
      vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=3,
      num_heads=4, num_kv_heads=2, head_dim=8), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=re.escape(
      "the cache is not this model's: it needs 3 layers of (1, 2, 1024, 8); "
      "got 2 of (1, 2, 1024, 8)")):
    gen.Generator(other).step(cache, [3], 0)
  with pytest.raises(ValueError, match=re.escape(
      "decode_implementation must be None, 'xla' or one of ['pallas']; got "
      "'triton'")):
    gen.Generator(other, decode_implementation="triton")


# Under -m slow: the Generator it drives is tested above.
@pytest.mark.slow
def test_the_example_streams_what_generate_returns(tmp_path, capsys):
  """examples/generate.py on a checkpoint laid out as examples/finetune.py
  writes one (weights, tokenizer.json, EOS in config.json), with the cache
  split over 4 devices: it prints the prompt and the greedy continuation
  that jax_ring.models.generate gives (the function); with the prompt
  read from a text file, the same text, the prompt not echoed (both at 2
  tokens a call and at the default). Without --model it says first that
  its model is random."""
  cp_mesh()
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
  import finetune
  import generate as example  # examples/generate.py
  model_dir = example.demo_model(tmp_path)
  prompt = "Reverse the words: fox owl\n"
  args = example.parse_args(["--model", str(model_dir), "--context", "4",
                             "--max-new-tokens", "6", "--tokens-per-call",
                             "2", prompt])
  text, = example.generate(args)
  printed = capsys.readouterr()
  assert printed.out == prompt + text + "\n"
  assert re.search(r"first token after \d+\.\d\d s \(prefill of [\d,]+ "
                   r"tokens, compiles included\); 3 more tokens, "
                   r"\d+\.\d ms a token \(mean\)", printed.err), printed.err
  encoder = finetune.Encoder(model_dir)
  ids = encoder.prefix + encoder.tok.encode(prompt,
                                            add_special_tokens=False).ids
  want, = gen.generate(models.load_pretrained(model_dir), [ids],
                       max_new_tokens=6, stop_tokens=[encoder.eos])
  assert text == encoder.tok.decode(want, skip_special_tokens=True)
  (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
  assert example.generate(example.parse_args([
      "--model", str(model_dir), "--context", "4", "--max-new-tokens", "6",
      "--prompt-file", str(tmp_path / "prompt.txt")])) == [text]
  assert capsys.readouterr().out == text + "\n"  # the file is not echoed
  example.generate(example.parse_args(["--context", "4", "--max-new-tokens",
                                       "2", prompt]))
  assert capsys.readouterr().err.startswith(
      "no --model: a tiny Llama of random weights (untrained)")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_bfloat16_generation_on_a_gpu():
  """bfloat16 on a GPU (the prefill's attention on cuDNN, the decode's
  products on the GPU's matrix units), a sliding layer and a global one:
  prefill and 8 decode steps give the full forward's logits, to
  bfloat16's rounding."""
  import jax.numpy as jnp
  cfg = models.DecoderConfig(
      vocab_size=V, hidden_size=256, intermediate_size=512, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=64, sliding_window=100,
      layer_types=("sliding_attention", "full_attention"),
      dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  model = models.Decoder(cfg, rngs=nnx.Rngs(0))
  prompt = np.random.default_rng(0).integers(0, V, 500).tolist()
  generator = gen.Generator(model)
  logits, cache = generator.prefill([prompt], max_new_tokens=8)
  got, seq = [logits[0]], list(prompt)
  for step in range(7):
    token = int(jnp.argmax(logits[0]))
    seq.append(token)
    logits, cache = generator.step(cache, [token], step)
    got.append(logits[0])
  full = model(np.array([seq]), np.arange(len(seq))[None])[0]
  assert relative_error(np.stack(got).astype(np.float32),
                        np.asarray(full[len(prompt) - 1:], np.float32)) < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                    reason="needs 2 or more GPUs")
def test_cache_over_every_gpu_generates_as_one_gpu():
  """The same random weights on one GPU and with the prompt and cache
  split over every GPU (context=GPUs): in float32, the same greedy tokens;
  in bfloat16 (the prefill on cuDNN), the same logits at every decoded
  position to bfloat16's rounding, the one-GPU tokens fed to both."""
  import jax.numpy as jnp
  gpus = jax.device_count()
  prompts = [np.random.default_rng(1).integers(0, V, n).tolist()
             for n in (1500, 931)]
  for dtype in (jnp.float32, jnp.bfloat16):
    cfg = models.DecoderConfig(
        vocab_size=V, hidden_size=256, intermediate_size=512, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=64, sliding_window=300,
        layer_types=("sliding_attention", "full_attention"), dtype=dtype,
        param_dtype=dtype)
    one = models.Decoder(cfg, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((1, gpus), ("data", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
      split = models.Decoder(cfg.replace(
          rules=models.model_rules(),
          context_parallel=jax_ring.ContextParallel(axis="context")),
          rngs=nnx.Rngs(1))
      state = nnx.state(split)
      nnx.replace_by_pure_dict(state, jax.tree.map(
          lambda x, into: jax.device_put(x, into.sharding),
          nnx.to_pure_dict(nnx.state(one)), nnx.to_pure_dict(state)))
      nnx.update(split, state)
    if dtype == jnp.float32:
      want = gen.generate(one, prompts, max_new_tokens=8)
      with jax.set_mesh(mesh):
        assert gen.generate(split, prompts, max_new_tokens=8) == want
      continue
    logits, cache = gen.Generator(one).prefill(prompts, max_new_tokens=8)
    with jax.set_mesh(mesh):
      generator = gen.Generator(split)
      got, got_cache = generator.prefill(prompts, max_new_tokens=8)
      for step in range(8):
        assert relative_error(np.asarray(got, np.float32), np.asarray(
            logits, np.float32)) < 3e-2, step
        tokens = np.asarray(jnp.argmax(logits, -1))
        logits, cache = gen.Generator(one).step(cache, tokens, step)
        got, got_cache = generator.step(got_cache, tokens, step)
