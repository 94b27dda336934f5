"""load_pretrained and save_pretrained on a tiny checkpoint written here with
numpy: each bad file is a clear error naming the file and the tensor, found
before any tensor is read; save_pretrained writes back the config.json it
loaded, changed only where the model is, in files of the usual mode.
(tests/test_models.py checks the weights against transformers.)"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jax_ring import models
from jax_ring.models.hf_checkpoint import tensor_map

# With fields the model does not hold, which a save must keep.
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"],
              vocab_size=16, hidden_size=8, intermediate_size=12,
              num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-5,
              rope_parameters=dict(rope_type="default", rope_theta=1e4),
              max_position_embeddings=77, pad_token_id=0, bos_token_id=1,
              eos_token_id=[2, 3], dtype="float32",
              custom_field={"kept": True})
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"


def tensors(config=CONFIG):
  rng = np.random.default_rng(0)
  return {t.name: rng.standard_normal(t.shape).astype(np.float32)
          for t in tensor_map(models.config_from_hf(config))}


def write(path, arrays, config=CONFIG):
  """``arrays`` as model.safetensors in ``path``, or as the files a dict
  of file name -> arrays names."""
  path.mkdir(exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  files = arrays if isinstance(next(iter(arrays.values())), dict) else {
      "model.safetensors": arrays}
  for name, part in files.items():
    save_file(part, path / name)
  return path


def raises(error, *parts):
  """pytest.raises for a message holding each of ``parts``, in order."""
  return pytest.raises(error, match=".*".join(map(re.escape, map(str,
                                                                 parts))))


def test_integer_tensors_are_refused_by_name(tmp_path):
  arrays = tensors()
  arrays[Q] = arrays[Q].astype(np.int8)
  path = write(tmp_path, arrays)
  with raises(ValueError, Q, path / "model.safetensors", "dtype I8"):
    models.load_pretrained(path)


def test_a_quantized_config_is_refused_by_name(tmp_path):
  path = write(tmp_path, tensors(), CONFIG | dict(
      quantization_config=dict(quant_method="gptq", bits=4)))
  with raises(ValueError, path / "config.json", "quantization_config",
              "'gptq'"):
    models.load_pretrained(path)


def test_a_tensor_in_two_files_is_refused(tmp_path):
  arrays = tensors()
  first = dict(list(arrays.items())[:3])
  second = {n: x for n, x in arrays.items() if n not in first}
  second["model.norm.weight"] = first["model.norm.weight"] = arrays[
      "model.norm.weight"]
  path = write(tmp_path, {"a.safetensors": first, "b.safetensors": second})
  with raises(ValueError, "model.norm.weight", path / "a.safetensors",
              path / "b.safetensors"):
    models.load_pretrained(path)


def test_an_index_is_checked_against_its_files(tmp_path):
  arrays = tensors()
  path = write(tmp_path, arrays)
  index = tmp_path / "model.safetensors.index.json"
  weight_map = dict.fromkeys(arrays, "model.safetensors")
  index.write_text(json.dumps(dict(weight_map=weight_map | {
      Q: "model-2.safetensors"})))
  with raises(FileNotFoundError, index, Q, "model-2.safetensors"):
    models.load_pretrained(path)
  save_file({"x": arrays[Q]}, path / "model-2.safetensors")
  with raises(ValueError, index, Q, "model-2.safetensors", "not hold it"):
    models.load_pretrained(path)
  index.write_text('{"weight_map": {"%s": "a.safetensors", "%s": '
                   '"b.safetensors"}}' % (Q, Q))
  with raises(ValueError, index, f"key {Q!r} appears twice"):
    models.load_pretrained(path)


def test_a_shape_mismatch_names_the_tensor_and_the_fields(tmp_path):
  """A head count that disagrees with the weights: named before any
  reshape."""
  path = write(tmp_path, tensors(), CONFIG | dict(num_key_value_heads=2))
  with raises(ValueError, K, path / "model.safetensors", "shape (4, 8)",
              "num_key_value_heads=2, head_dim=4, hidden_size=8",
              "implies (8, 8)"):
    models.load_pretrained(path)


def test_unreadable_files_are_named_with_the_cause(tmp_path):
  path = write(tmp_path, tensors())
  weights = path / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-10])
  with raises(ValueError, weights, "not a readable safetensors") as e:
    models.load_pretrained(path)
  assert e.value.__cause__ is not None
  (path / "model.safetensors.index.json").write_text('{"weight_map": {')
  with raises(ValueError, path / "model.safetensors.index.json",
              "not valid JSON") as e:
    models.load_pretrained(path)
  assert isinstance(e.value.__cause__, json.JSONDecodeError)
  (path / "config.json").write_text('{"model_type": "llama",}')
  with raises(ValueError, path / "config.json", "not valid JSON", "line 1"):
    models.load_pretrained(path)
  (path / "config.json").write_text(json.dumps(
      CONFIG | dict(num_attention_heads="2")))
  with raises(ValueError, path / "config.json", "num_attention_heads must "
              "be a positive integer, not '2'"):
    models.load_pretrained(path)


@pytest.fixture
def loaded(tmp_path):
  return models.load_pretrained(write(tmp_path / "base", tensors()))


def new_model(cfg):
  """``Llama(cfg)`` with zero weights, built without running an
  initializer (whose first compiles take seconds)."""
  abstract = nnx.eval_shape(lambda: models.Llama(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  return nnx.merge(graphdef, jax.tree.map(
      lambda x: np.zeros(x.shape, x.dtype), state))


def saved_config(model, path, **kw):
  models.save_pretrained(model, path, **kw)
  return json.loads((path / "config.json").read_text())


def test_save_writes_back_every_field_it_loaded(loaded, tmp_path):
  assert saved_config(loaded, tmp_path / "a") == CONFIG
  assert saved_config(loaded, tmp_path / "b", dtype=jnp.bfloat16,
                      extra_config=dict(eos_token_id=5, vocab_size=99)) == (
                          CONFIG | dict(dtype="bfloat16", eos_token_id=5))


def test_save_changes_only_what_the_model_changed(loaded, tmp_path):
  cfg = loaded.cfg.replace(num_layers=2, rope_theta=5e5)
  model = new_model(cfg)
  want = CONFIG | dict(num_hidden_layers=2, rope_theta=5e5,
                       rope_parameters=dict(rope_type="default",
                                            rope_theta=5e5))
  assert saved_config(model, tmp_path / "out") == want
  again = models.load_pretrained(tmp_path / "out")
  assert again.cfg.replace(hf_config=None) == cfg.replace(hf_config=None)


def test_a_new_model_writes_a_whole_config_in_files_of_the_usual_mode(
    tmp_path):
  cfg = models.config_from_hf(CONFIG).replace(hf_config=None)
  model = new_model(cfg)
  old = os.umask(0o027)
  try:
    models.save_pretrained(model, tmp_path, max_shard_bytes=1000,
                           extra_config=dict(bos_token_id=7))
  finally:
    os.umask(old)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["max_position_embeddings"] == 77
  assert written["bos_token_id"] == 7
  assert models.config_from_hf(written).replace(hf_config=None) == cfg
  files = sorted(tmp_path.iterdir())
  assert len(files) > 3
  for f in files:
    assert oct(f.stat().st_mode & 0o777) == oct(0o640), f
