"""The fine-tuning example: its default run (a tiny random Llama, tokenizer
and toy data made in the run dir, data=2 x context=4 ring) trains, and its
final/ reads back in jax_ring and in transformers with the same logits;
--resume continues the uninterrupted run exactly, and a fresh run refuses
its directory; tiny Qwen3 and Gemma 3 checkpoints made by transformers
fine-tune unchanged and save back as the same architecture; packing and
the loss mask put the loss on response tokens only, in the load-balance
layout; every bad data line is named by file:line, every token id out of
the model's vocabulary by its source; no weight that is not finite is
written to final/."""

import codecs
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ring
from jax_ring import flax as jrf, models

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import finetune  # noqa: E402
from helpers import TOLERANCE, relative_error  # noqa: E402

DP, CP = 2, 4
SEQ = 64
# The small run: 100 demo examples, 6 steps, checkpoints after 3 and 6.
FLAGS = ["--seq", str(SEQ), "--examples", "100", "--steps", "6",
         "--warmup", "2", "--checkpoint-every", "3", "--quiet"]


def needs_devices():
  if len(jax.devices()) < DP * CP:
    pytest.skip(f"needs {DP * CP} devices")


def run(run_dir, *extra):
  return finetune.train(finetune.parse_args(
      ["--run-dir", str(run_dir), *FLAGS, *extra]))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  """The uninterrupted default run (no --model, no --data)."""
  needs_devices()
  return run(tmp_path_factory.mktemp("whole"))


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
  """The default run with ``--lora 4`` (and dropout), 3 steps: the one run
  of the example in the default lane."""
  needs_devices()
  return run(tmp_path_factory.mktemp("lora"), "--lora", "4",
             "--lora-dropout", "0.1", "--steps", "3", "--checkpoint-every",
             "3")


@pytest.fixture(scope="module")
def lora_final(lora):
  """The LoRA run's final/ read by jax_ring: one load for the tests that
  read it (none changes it)."""
  return models.load_pretrained(lora["final"], implementation="xla")


# Under -m slow, the full fine-tuning run's tests (``whole``). The default
# lane runs the example with --lora (``lora``): its final/ read by
# transformers in test_lora_run_saves_a_checkpoint_transformers_reads, the
# same step builder (train_lm.make_train_step, there with a rest state);
# every weight trained under the ring and FSDP as on one device:
# test_train_lm.py::test_context_parallel_training_matches_single_device;
# our checkpoints' save/load round trip: test_checkpoint_errors.py.
@pytest.mark.slow
def test_default_run_trains_and_saves_a_checkpoint_transformers_reads(whole):
  losses = whole["losses"]
  assert len(losses) == 6 and np.isfinite(losses).all()
  # From about ln V = ln 386 = 5.96 (the 0.02-std random model); 5.19 seen.
  assert losses[-1] < losses[0] - 0.3, losses
  final = whole["final"]
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"} <= {f.name for f in final.iterdir()}

  # jax_ring reads back exactly the trained weights.
  ours = models.load_pretrained(final, implementation="xla")
  trained = jax.tree.leaves(whole["state"]["params"])
  loaded = jax.tree.leaves(nnx.state(ours, nnx.Param))
  assert len(trained) == len(loaded) == 2 * 9 + 3
  for a, b in zip(trained, loaded, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  assert_transformers_reads(final, ours)


def assert_transformers_reads(final, ours):
  """transformers reads the checkpoint ``final`` with the example's tokens
  and with ``ours``' logits (jax_ring's model of it) on a real example."""
  tok = transformers.AutoTokenizer.from_pretrained(final)
  encoder = finetune.Encoder(final)
  record = {"prompt": "Reverse the words: fox ice ship\n",
            "response": "Reversed: ship ice fox"}
  (ids, tgt), = encoder([record])
  assert tok(record["prompt"])["input_ids"] == ids[~tgt].tolist()
  assert tok(record["response"])["input_ids"] == ids[tgt][:-1].tolist()
  assert ids[-1] == tok.eos_token_id
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      final, attn_implementation="eager")
  with torch.no_grad():
    want = hf(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
  got = ours(jnp.asarray(ids[None]), jnp.arange(len(ids))[None])
  assert relative_error(got, want) <= TOLERANCE
  assert json.loads((final / "config.json").read_text())["eos_token_id"] == (
      tok.eos_token_id)


def test_sample_is_the_models_greedy_continuation(lora, lora_final):
  """``finetune.sample``, which the run prints before and after training
  (not under --quiet): the generator's greedy text, up to EOS."""
  from jax_ring.models import generation
  encoder = finetune.Encoder(lora["final"])
  model = lora_final
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,))
  text = finetune.sample(model, mesh, encoder, finetune.DEMO_PROMPT, 6)
  ids = encoder.prefix + encoder.tok.encode(
      finetune.DEMO_PROMPT, add_special_tokens=False).ids
  with jax.set_mesh(mesh):  # sample's mesh: its compiled programs again
    new, = generation.generate(model, [ids], max_new_tokens=6,
                               stop_tokens=[encoder.eos])
  assert text == encoder.tok.decode(new, skip_special_tokens=True)


@pytest.mark.slow
def test_the_default_demo_learns_its_task(tmp_path):
  """The default demo as a user runs it (a process of its own, XLA's own
  compile flags, not this suite's cheap ones: 600 steps, about two minutes
  on 2 cores) reverses the sample prompt's words after training, and
  prints it."""
  needs_devices()  # the demo's mesh: data 2 x context 4
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run(
      [sys.executable, str(EXAMPLES / "finetune.py"), "--run-dir",
       str(tmp_path)], env=env, capture_output=True, text=True, timeout=290)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "after training:  'Reversed: lamp sun owl'" in done.stdout, (
      done.stdout[-2000:])


# Under -m slow: train_loop's resume, which both examples run, continues
# bit for bit in test_run_dir.py::test_a_resume_continues_the_uninterrupted_run
# (other settings and a fresh run refused there too, and the demo's resume
# refused before writing: test_a_resume_writes_nothing_before_its_checks).
@pytest.mark.slow
def test_resume_continues_the_uninterrupted_run(whole, tmp_path):
  first = run(tmp_path, "--stop-after", "4")  # saved after 3 and 4
  resumed = run(tmp_path, "--resume")
  assert len(first["losses"]) == 4 and resumed["start"] == 4
  np.testing.assert_array_equal(resumed["losses"], whole["losses"])
  for a, b in zip(jax.tree.leaves(resumed["state"]),
                  jax.tree.leaves(whole["state"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert ((tmp_path / "final" / "model.safetensors").read_bytes() ==
          (whole["final"] / "model.safetensors").read_bytes())
  # Other settings refuse to resume rather than silently diverging.
  with pytest.raises(SystemExit, match="other settings: lr: saved 0.003, "
                     "now 0.01$"):
    run(tmp_path, "--resume", "--lr", "1e-2")
  with pytest.raises(SystemExit, match="other settings: examples: saved "
                     "100, now 80$"):  # the demo's data is kept: say so
    run(tmp_path, "--resume", "--examples", "80")
  # A fresh run refuses the directory, final/ included, before writing.
  final = (tmp_path / "final" / "model.safetensors").read_bytes()
  with pytest.raises(SystemExit, match="final.*--resume.*--overwrite"):
    run(tmp_path)
  assert (tmp_path / "final" / "model.safetensors").read_bytes() == final


def test_no_model_with_a_weight_that_is_not_finite_is_written(
    lora, lora_final, tmp_path):
  graphdef, params, rest = nnx.split(lora_final, nnx.Param, ...)
  paths, tree = jax.tree_util.tree_flatten_with_path(params)
  leaves = [x for _, x in paths]
  for i, value in ((0, np.nan), (1, np.inf)):
    leaves[i] = leaves[i].at[(0,) * leaves[i].ndim].set(value)
  model = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves), rest)
  with pytest.raises(SystemExit, match=(
      rf"final not written: {re.escape(jax.tree_util.keystr(paths[0][0]))} "
      rf"has 1 non-finite entries in float32 \(1 more weights too\)$")):
    finetune.save_final(model, lora["final"], tmp_path / "final", None)
  assert not (tmp_path / "final").exists()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
  """The demo's tokenizer in a checkpoint directory (no weights needed)."""
  path = tmp_path_factory.mktemp("tok")
  tok = finetune.train_tokenizer(
      ["".join(t for t, _, _ in finetune.pieces(r))
       for r in finetune.demo_records(200, 0)])
  tok.save(str(path / "tokenizer.json"))
  (path / "config.json").write_text(json.dumps(
      {"eos_token_id": tok.token_to_id("<|endoftext|>")}))
  return finetune.Encoder(path)


def test_examples_put_the_loss_on_responses_and_assistant_turns(encoder):
  decode = lambda ids: encoder.tok.decode(list(ids), skip_special_tokens=False)
  eos = encoder.eos
  assert encoder.prefix == [] and eos == 0
  pr = {"prompt": "Reverse the words: red fox\n",
        "response": "Reversed: fox red"}
  chat = {"messages": [
      {"role": "system", "content": "You sort words."},
      {"role": "user", "content": "Sort: owl cat"},
      {"role": "assistant", "content": "Sorted: cat owl"},
      {"role": "user", "content": "Sort: sun ice"},
      {"role": "assistant", "content": "Sorted: ice sun"}]}
  (ids, tgt), (cids, ctgt) = encoder([pr, chat])
  assert decode(ids[~tgt]) == pr["prompt"]
  assert decode(ids[tgt]) == pr["response"] + "<|endoftext|>"
  assert ids[-1] == eos and tgt[-1] and not tgt[:-1][ids[:-1] == eos].any()
  # Zephyr-style turns; only the assistant's content and its EOS are targets.
  assert decode(cids) == (
      "<|system|>\nYou sort words.<|endoftext|><|user|>\nSort: owl cat"
      "<|endoftext|><|assistant|>\nSorted: cat owl<|endoftext|><|user|>\n"
      "Sort: sun ice<|endoftext|><|assistant|>\nSorted: ice sun<|endoftext|>")
  assert decode(cids[ctgt]) == (
      "Sorted: cat owl<|endoftext|>Sorted: ice sun<|endoftext|>")


def test_pack_is_greedy_in_order():
  assert finetune.pack([30, 30, 10, 64, 5], 64) == [[0, 1], [2], [3], [4]]


def test_packed_batch_masks_prompts_and_restarts_positions(encoder):
  needs_devices()
  records = finetune.demo_records(40, 1) + [
      {"prompt": "x " * 100, "response": "y"},           # no response left
      {"prompt": "Reverse: a\n", "response": "b " * 100}]  # truncated
  examples = encoder(records)
  long_demos = sum(len(t) > SEQ for t, _ in examples[:-2])
  data = finetune.SFTData(examples, SEQ, seed=0)
  assert (data.truncated, data.dropped) == (long_demos + 2, 1)
  assert len(data.examples) == len(records) - 1
  np.testing.assert_array_equal(data.examples[-1][0], examples[-1][0][:SEQ])
  tokens, seg, targets = data.batch(0, DP * 2)
  mesh = jax.make_mesh((DP, CP), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  cpc = jax_ring.ContextParallel(axis="context", inputs="load_balanced")
  batch = jrf.prepare_lm_batch(tokens, seg, mesh=mesh, spec=P("data",
                                                              "context"),
                               context_parallel=cpc, targets=targets)
  assert batch.inputs.sharding.spec == P("data", "context")
  # The batch is in the dual-chunk layout; put it back in natural order.
  back = jax.tree.map(
      lambda x: np.asarray(jax_ring.reorder_from_load_balance(x, CP)), batch)
  assert not np.array_equal(np.asarray(batch.positions), back.positions)
  np.testing.assert_array_equal(back.inputs, tokens)
  np.testing.assert_array_equal(back.segment_ids, seg)
  for row in range(tokens.shape[0]):
    packed = data.rows(0)[row]
    start = 0
    for doc, i in enumerate(packed, 1):
      ids, tgt = data.examples[i]
      span = slice(start, start + len(ids))
      np.testing.assert_array_equal(back.inputs[row, span], ids)
      assert (back.segment_ids[row, span] == doc).all()
      np.testing.assert_array_equal(back.positions[row, span],
                                    np.arange(len(ids)))
      # Position j predicts token j + 1: a loss exactly where that token is
      # a target of the same example, with that token as the label.
      want = np.zeros(len(ids), np.float32)
      want[:-1] = tgt[1:]
      np.testing.assert_array_equal(back.loss_mask[row, span], want)
      np.testing.assert_array_equal(back.labels[row, span][:-1], ids[1:])
      start += len(ids)
    assert (back.segment_ids[row, start:] == 0).all()  # padding
    assert (back.loss_mask[row, start:] == 0).all()


def write_lines(path, *lines: bytes):
  path.write_bytes(b"\n".join(lines) + b"\n")
  return path


GOOD = b'{"prompt": "~", "response": "^"}'
BAD_LINES = {
    "syntax": (b'{"prompt": "a", "response": "b"',
               "not JSON: Expecting ',' delimiter at column 32"),
    "encoding": (b'{"prompt": "\xff", "response": "b"}',
                 "not UTF-8: byte 0xff at column 13"),
    "bom": (codecs.BOM_UTF8 + GOOD, r"a byte-order mark \(U\+FEFF\) starts"),
    "array": (b'["a", "b"]', "expected a JSON object, got an array"),
    "keys": (b'{"prompt": "a"}', "expected prompt and response, or messages"),
    "prompt": (b'{"prompt": 1, "response": "b"}',
               "prompt must be a string, got a number"),
    "response": (b'{"prompt": "a", "response": ["b"]}',
                 "response must be a string, got an array"),
    "messages": (b'{"messages": "hi"}',
                 "messages must be a list, got a string"),
    "message": (b'{"messages": [{"role": "user"}]}',
                r"every message needs a role and a content; messages\[0\]"),
    "role": (b'{"messages": [{"role": true, "content": "a"}]}',
             r"messages\[0\].role must be a string, got true"),
    "content": (b'{"messages": [{"role": "user", "content": null}]}',
                r"messages\[0\].content must be a string, got null"),
}


@pytest.mark.parametrize("kind", BAD_LINES)
def test_every_bad_data_line_is_named_by_file_and_line(tmp_path, kind):
  line, message = BAD_LINES[kind]
  path = write_lines(tmp_path / "data.jsonl", GOOD, b"", line)
  with pytest.raises(SystemExit, match=f"^{re.escape(str(path))}:3: {message}"):
    finetune.read_records(path)


def test_a_byte_order_mark_opening_the_file_is_skipped(tmp_path):
  path = write_lines(tmp_path / "data.jsonl", codecs.BOM_UTF8 + GOOD, GOOD)
  records, sources = finetune.read_records(path)
  assert records == [json.loads(GOOD)] * 2
  assert sources == [f"{path}:1", f"{path}:2"]


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_source(
    encoder, tmp_path):
  """A model whose vocabulary is the tokenizer's first 260 ids (bytes and
  special tokens; merges lie above): data with a merge is refused naming
  its line, an EOS beyond the vocabulary naming config.json."""
  (tmp_path / "tokenizer.json").write_bytes(encoder.path.read_bytes())
  config = tmp_path / "config.json"
  config.write_text(json.dumps({"vocab_size": 260, "eos_token_id": 0}))
  short = finetune.Encoder(tmp_path)
  record = {"prompt": "Reverse the words: red fox\n", "response": "x"}
  path = write_lines(tmp_path / "data.jsonl", GOOD,
                     json.dumps(record).encode())
  (ids, _), = encoder([record])
  first, size = int(ids[ids >= 260][0]), encoder.tok.get_vocab_size()
  with pytest.raises(SystemExit, match=(
      rf"^{re.escape(str(path))}:2: token id {first} is outside the "
      rf"model's vocabulary \(vocab_size 260 in {re.escape(str(config))}\); "
      rf".* has {size} tokens: is it the model's own tokenizer\?$")):
    short(*finetune.read_records(path))
  config.write_text(json.dumps({"vocab_size": size, "eos_token_id": size}))
  with pytest.raises(SystemExit, match=(
      rf"^eos_token_id of config.json: token id {size} is outside the "
      rf"model's vocabulary \(vocab_size {size} ")):
    finetune.Encoder(tmp_path)


# Tiny checkpoints of the families with per-layer windows, as transformers
# makes them: one sliding layer (a window of 16 in rows of 64) and one
# global, GQA, q/k norms; Gemma 3's sandwich norms, scaled embedding and
# RoPE per layer type.
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            sliding_window=16, layer_types=["sliding_attention",
                                            "full_attention"])
FAMILIES = {
    "qwen3": lambda **kw: transformers.Qwen3Config(
        **TINY, **kw, use_sliding_window=True),
    "gemma3": lambda **kw: transformers.Gemma3TextConfig(
        **TINY, **kw, query_pre_attn_scalar=8),
}


# Under -m slow: the layers' equality with transformers is test_models.py's,
# the example's round trip of its checkpoint the default run's (over the
# demo's checkpoint, which transformers reads); here a transformers-made one.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_fine_tunes_a_transformers_checkpoint_and_saves_it_back(family,
                                                                tmp_path):
  """A tiny random Qwen3 or Gemma 3 made by transformers, with the demo's
  tokenizer: --model takes it unchanged, three steps under the ring lower
  the loss, and final/ is the same architecture, read back by transformers
  with the logits of the trained weights."""
  needs_devices()
  base = tmp_path / "base"
  tok = finetune.train_tokenizer(
      ["".join(t for t, _, _ in finetune.pieces(r))
       for r in finetune.demo_records(200, 0)])
  eos = tok.token_to_id("<|endoftext|>")
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](
      vocab_size=tok.get_vocab_size(), eos_token_id=eos, pad_token_id=eos,
      bos_token_id=None))
  hf.save_pretrained(base)
  tok.save(str(base / "tokenizer.json"))
  data = write_lines(tmp_path / "data.jsonl", *(
      json.dumps(r).encode() for r in finetune.demo_records(100, 1)))
  result = finetune.train(finetune.parse_args([
      "--run-dir", str(tmp_path / "run"), "--model", str(base), "--data",
      str(data), "--seq", str(SEQ), "--steps", "3", "--warmup", "1",
      "--lr", "3e-3", "--checkpoint-every", "3", "--quiet"]))
  losses = result["losses"]
  assert len(losses) == 3 and losses[-1] < losses[0], losses
  final = result["final"]
  saved = json.loads((final / "config.json").read_text())
  assert saved == json.loads((base / "config.json").read_text())
  ours = models.load_pretrained(final, implementation="xla")
  trained = jax.tree.leaves(result["state"]["params"])
  for a, b in zip(trained, jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  back = transformers.AutoModelForCausalLM.from_pretrained(
      final, attn_implementation="eager")
  (ids, _), = finetune.Encoder(final)(finetune.demo_records(1, 2))
  with torch.no_grad():
    want = back(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
  got = jax.jit(lambda m, x: m(x, jnp.arange(x.shape[1])[None]))(
      ours, jnp.asarray(ids[None]))
  assert relative_error(got, want) <= TOLERANCE


def test_lora_run_writes_an_adapter_peft_merges_into_final(lora):
  """``--lora 4``: only the adapters train (the state's params are
  ``nnx.LoRAParam`` alone, and the loss falls); adapter/ is PEFT's format,
  and PEFT's ``merge_and_unload`` of it over base_model/ equals final/,
  so the base stayed frozen and final/ is the adapters merged in. With
  dropout, so that the step carries the dropout streams in its state and
  the checkpoint writes them (both failed once)."""
  peft = pytest.importorskip("peft")
  result, out = lora, lora["final"].parent
  assert result["losses"][-1] < result["losses"][0]
  trained = nnx.State(result["state"]["params"])
  assert all(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(
      trained, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  base = transformers.AutoModelForCausalLM.from_pretrained(
      out / "base_model")
  merged = peft.PeftModel.from_pretrained(
      base, out / "adapter").merge_and_unload().state_dict()
  from safetensors.numpy import load_file
  final = load_file(result["final"] / "model.safetensors")
  assert final.keys() == merged.keys()
  for key, x in final.items():
    assert relative_error(x, merged[key].numpy()) <= 1e-6, key


def test_lora_run_saves_a_checkpoint_transformers_reads(lora, lora_final):
  """final/ of the LoRA run (the adapters merged in) holds the tokenizer,
  and transformers reads it with jax_ring's tokens and logits on a real
  example."""
  final = lora["final"]
  assert {"config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"} <= {f.name for f in final.iterdir()}
  ours = lora_final
  assert len(jax.tree.leaves(nnx.state(ours, nnx.Param))) == 2 * 9 + 3
  assert_transformers_reads(final, ours)
