"""``config.json`` of a Hugging Face checkpoint in and out of
:class:`~jax_ring.models.llama.LlamaConfig`.

Supported ``model_type``: ``llama`` (Llama 2, 3, 3.1, 3.2), ``qwen2``
(Qwen2, Qwen2.5) and ``mistral``. Options no layer here implements
(attention or MLP biases on Llama, per-layer sliding windows, RoPE scalings
other than Llama 3's, quantization) are refused with the key that asks for
them. Saving writes back every field the checkpoint was loaded with,
changed only where the model changed.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jax_ring.flax.attention import Llama3RopeScaling
from jax_ring.models.llama import LlamaConfig


CONFIG = "config.json"


def read_json(file: pathlib.Path) -> dict:
  """The JSON object in ``file``; a ValueError naming the file when it is
  not one (the parser's error as ``__cause__``). A key given twice is an
  error, not the last one silently."""
  def pairs(items):
    out = {}
    for key, value in items:
      if key in out:
        raise ValueError(f"key {key!r} appears twice")
      out[key] = value
    return out
  try:
    data = json.loads(file.read_text(encoding="utf-8"),
                      object_pairs_hook=pairs)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError included
    raise ValueError(f"{file}: not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"{file}: a JSON object expected, not "
                     f"{type(data).__name__}")
  return data


# --- config.json -------------------------------------------------------------

def _count(hf: dict, key: str, default=None) -> int:
  """``hf[key]`` (``default`` when absent or null), a positive int."""
  value = hf.get(key)
  value = default if value is None else value
  if value is None:
    raise ValueError(f"config.json has no {key!r}")
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"config.json: {key} must be a positive integer, not "
                     f"{value!r}")
  return value


def fields_from_hf(hf: dict) -> dict[str, Any]:
  """The :class:`LlamaConfig` fields a ``config.json`` dict sets."""
  kind = hf.get("model_type")
  if kind not in ("llama", "qwen2", "mistral"):
    raise ValueError(f"model_type {kind!r} is not supported; jax_ring "
                     "reads 'llama', 'qwen2' and 'mistral' checkpoints")
  if hf.get("quantization_config"):
    method = (hf["quantization_config"].get("quant_method")
              if isinstance(hf["quantization_config"], dict) else None)
    raise ValueError(f"config.json sets quantization_config (quant_method "
                     f"{method!r}): quantized checkpoints are not loaded; "
                     "dequantize it first")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ValueError(f"config.json sets {key}=true, which this model does "
                       "not implement")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r}: only 'silu' (SwiGLU)")
  window = None
  if kind == "mistral":
    window = hf.get("sliding_window")
  elif kind == "qwen2":
    if hf.get("use_sliding_window"):
      raise ValueError("config.json sets use_sliding_window=true: Qwen2's "
                       "per-layer sliding windows are not implemented")
    sliding = [i for i, t in enumerate(hf.get("layer_types") or ())
               if t != "full_attention"]
    if sliding:
      raise ValueError(f"config.json's layer_types asks for "
                       f"{hf['layer_types'][sliding[0]]!r} at layer "
                       f"{sliding[0]}: per-layer sliding windows are not "
                       "implemented")
  rope = dict(hf.get("rope_parameters") or {})
  rope.update(hf.get("rope_scaling") or {})
  theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  scaling = None
  if rope_type == "llama3":
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")
               if k not in rope]
    if missing:
      raise ValueError(f"config.json: rope type 'llama3' without {missing}")
    scaling = Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope["original_max_position_embeddings"]))
  elif rope_type != "default":
    raise ValueError(f"rope type {rope_type!r} is not supported (only "
                     "'default' and 'llama3')")
  hidden, heads = _count(hf, "hidden_size"), _count(hf, "num_attention_heads")
  kv_heads = _count(hf, "num_key_value_heads", heads)
  if heads % kv_heads:
    raise ValueError(f"config.json: num_attention_heads={heads} is not a "
                     f"multiple of num_key_value_heads={kv_heads}")
  positions = hf.get("max_position_embeddings")
  return dict(
      vocab_size=_count(hf, "vocab_size"), hidden_size=hidden,
      intermediate_size=_count(hf, "intermediate_size"),
      num_layers=_count(hf, "num_hidden_layers"), num_heads=heads,
      num_kv_heads=kv_heads,
      head_dim=_count(hf, "head_dim", hidden // heads or None),
      rope_theta=float(theta), rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_position_embeddings=(None if positions is None else
                               _count(hf, "max_position_embeddings")),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=kind == "qwen2", sliding_window=window, model_type=kind)


def config_from_hf(hf: dict, **options) -> LlamaConfig:
  """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict, which
  it keeps (``hf_config``) for ``save_pretrained`` to write back.

  ``options`` sets the fields that say how the model runs (dtype,
  param_dtype, implementation, context_parallel, rules, param_rules,
  remat). Both spellings of RoPE settings are read: ``rope_theta`` and
  ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5). Raises a
  ValueError naming the key for what this model cannot be."""
  return LlamaConfig(**fields_from_hf(hf), hf_config=json.dumps(hf),
                     **options)


def config_to_hf(cfg: LlamaConfig) -> dict:
  """The ``config.json`` fields the model determines, as transformers
  reads them back as the same model (``save_pretrained`` adds the loaded
  checkpoint's other fields)."""
  if cfg.logits_soft_cap is not None:
    raise ValueError("logits_soft_cap has no place in a Llama-family "
                     "checkpoint; save a model without it")
  if cfg.sliding_window is not None and cfg.model_type != "mistral":
    raise ValueError(f"sliding_window is saved only as model_type "
                     f"'mistral'; this config's is {cfg.model_type!r}")
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    rope.update(rope_type="llama3", factor=s.factor,
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=(
                    s.original_max_position_embeddings))
  hf = dict(
      model_type=cfg.model_type,
      architectures=[{"llama": "LlamaForCausalLM",
                      "qwen2": "Qwen2ForCausalLM",
                      "mistral": "MistralForCausalLM"}[cfg.model_type]],
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps,
      tie_word_embeddings=cfg.tie_word_embeddings,
      rope_theta=cfg.rope_theta, rope_scaling=(
          None if cfg.rope_scaling is None else rope),
      rope_parameters=rope)
  if cfg.max_position_embeddings is not None:
    hf["max_position_embeddings"] = cfg.max_position_embeddings
  if cfg.model_type == "llama":
    hf.update(attention_bias=False, mlp_bias=False)
  if cfg.model_type == "mistral":
    hf["sliding_window"] = cfg.sliding_window
  if cfg.model_type == "qwen2":
    hf.update(use_sliding_window=False, sliding_window=None,
              layer_types=["full_attention"] * cfg.num_layers)
  return hf


_ABSENT = object()


def config_to_save(cfg: LlamaConfig, extra_config: dict | None,
                    dtype_name: str) -> dict:
  """``save_pretrained``'s ``config.json``: the loaded one
  (``cfg.hf_config``), then ``extra_config``, then each field the model
  determines, where the model differs from what those say (a field the
  model agrees with keeps the loaded spelling, and a field the loaded one
  lacked stays absent); then the stored dtype. A model not loaded writes
  all of :func:`config_to_hf`."""
  ours = config_to_hf(cfg)
  loaded = {} if cfg.hf_config is None else json.loads(cfg.hf_config)
  theirs = config_to_hf(LlamaConfig(**fields_from_hf(loaded))) if (
      loaded) else {}
  hf = loaded | dict(extra_config or {})
  for key, value in ours.items():
    if (theirs.get(key, _ABSENT) == value
        and hf.get(key, _ABSENT) == loaded.get(key, _ABSENT)):
      continue
    hf[key] = value
  # transformers 5 writes "dtype", 4 "torch_dtype"; 5 reads both.
  for key in ("torch_dtype", "dtype"):
    if key in hf or (key == "torch_dtype" and "dtype" not in hf):
      hf[key] = dtype_name
  return hf


# --- the tensor map ----------------------------------------------------------
