"""``config.json`` of a Hugging Face checkpoint in and out of
:class:`~jax_ring.models.config.DecoderConfig`.

Supported ``model_type``: ``llama`` (Llama 2, 3, 3.1, 3.2), ``qwen2``
(Qwen2, Qwen2.5), ``mistral``, ``qwen3``, ``gemma2`` and ``gemma3_text``
(Gemma 3's text models, the 1B one among them). Each ``config.json`` key
that changes the model is read as transformers reads it (its defaults where
the key is absent); a value no layer here implements (attention or MLP
biases, a RoPE type other than default, linear and llama3, bidirectional
attention, quantization, ...) is a ValueError naming the key. Saving writes
back every field the checkpoint was loaded with, changed only where the
model changed.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Literal, NamedTuple

from jax_ring.flax.attention import LinearRopeScaling, Llama3RopeScaling
from jax_ring.models.config import ACTIVATIONS, LAYER_TYPES, DecoderConfig


CONFIG = "config.json"


class Family(NamedTuple):
  """What a ``model_type`` is, in :class:`DecoderConfig` terms."""
  architecture: str  # the transformers class a checkpoint names
  fixed: dict  # DecoderConfig fields the model_type decides
  # Which layers slide: none, all when sliding_window is set (Mistral), or
  # those layer_types names.
  windows: Literal["none", "all", "per_layer"]
  defaults: dict  # transformers' defaults for keys a config.json may lack


_LLAMA = dict(qkv_bias=False, qk_norm=False, zero_centered_norm=False,
              sandwich_norm=False, scale_embeddings=False)
_GEMMA = dict(qkv_bias=False, zero_centered_norm=True, sandwich_norm=True,
              scale_embeddings=True)
_GEMMA_DEFAULTS = dict(head_dim=256, tie_word_embeddings=True,
                       sliding_window=4096, query_pre_attn_scalar=256,
                       hidden_activation="gelu_pytorch_tanh")
FAMILIES = {
    "llama": Family("LlamaForCausalLM", _LLAMA, "none", {}),
    "qwen2": Family("Qwen2ForCausalLM", _LLAMA | dict(qkv_bias=True),
                    "per_layer", dict(sliding_window=4096,
                                      max_window_layers=28)),
    "mistral": Family("MistralForCausalLM", _LLAMA, "all",
                      dict(sliding_window=4096)),
    "qwen3": Family("Qwen3ForCausalLM", _LLAMA | dict(qk_norm=True),
                    "per_layer", dict(head_dim=128, sliding_window=4096,
                                      max_window_layers=28)),
    "gemma2": Family("Gemma2ForCausalLM", _GEMMA | dict(qk_norm=False),
                     "per_layer", _GEMMA_DEFAULTS | dict(
                         attn_logit_softcapping=50.0,
                         final_logit_softcapping=30.0,
                         sliding_window_pattern=2)),
    "gemma3_text": Family("Gemma3ForCausalLM", _GEMMA | dict(qk_norm=True),
                          "per_layer", _GEMMA_DEFAULTS | dict(
                              rope_theta=1_000_000.0,
                              rope_local_base_freq=10_000.0,
                              sliding_window_pattern=6)),
}
_NAMES = ", ".join(repr(k) for k in FAMILIES)


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


# --- config.json -> DecoderConfig --------------------------------------------

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


def _float(hf: dict, key: str, default: float) -> float:
  """``hf[key]`` (``default`` where absent) as a float, or a ValueError
  naming the key."""
  value = hf.get(key, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"config.json: {key} must be a number, not {value!r}")
  return float(value)


def _positive(hf: dict, key: str, default, *, optional: bool = False):
  """``hf[key]`` (``default`` where absent) as a positive finite float;
  null is None where ``optional``; else a ValueError naming the key (0
  would divide by zero or cap every logit to 0)."""
  value = hf.get(key, default)
  if value is None and optional:
    return None
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or
      not 0 < value < float("inf")):
    allowed = "a positive number or null" if optional else "a positive number"
    raise ValueError(f"config.json: {key} must be {allowed}, not {value!r}")
  return float(value)


def _family(hf: dict) -> tuple[str, Family]:
  kind = hf.get("model_type")
  if kind not in FAMILIES:
    hint = (" (the multimodal Gemma 3: its text model, model_type "
            "'gemma3_text', is read)" if kind == "gemma3" else "")
    raise ValueError(f"model_type {kind!r} is not supported{hint}; jax_ring "
                     f"reads {_NAMES} checkpoints")
  return kind, FAMILIES[kind]


def _refuse_unimplemented(hf: dict, kind: str) -> None:
  """A ValueError naming the first key whose value asks for what no layer
  here implements (Qwen2's biases are fixed: transformers ignores its
  attention_bias and mlp_bias)."""
  if hf.get("quantization_config"):
    method = (hf["quantization_config"].get("quant_method")
              if isinstance(hf["quantization_config"], dict) else None)
    raise ValueError(f"config.json sets quantization_config (quant_method "
                     f"{method!r}): quantized checkpoints are not loaded; "
                     "dequantize it first")
  for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
    if hf.get(key) and not (kind == "qwen2" and key.endswith("bias")):
      raise ValueError(f"config.json sets {key}=true, which this model does "
                       "not implement")
  ropes = [hf, hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}]
  ropes += [r for r in ropes[2].values() if isinstance(r, dict)]
  for rope in ropes:
    if rope.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
      raise ValueError(f"config.json sets partial_rotary_factor="
                       f"{rope['partial_rotary_factor']}: RoPE on part of "
                       "the head dim is not implemented")
  if hf.get("attention_dropout"):
    raise ValueError(f"config.json sets attention_dropout="
                     f"{hf['attention_dropout']}: attention dropout is not "
                     "implemented (set it to 0.0)")


def _activation(hf: dict, family: Family) -> str:
  key = ("hidden_activation" if "hidden_activation" in family.defaults
         else "hidden_act")
  act = hf.get(key) or family.defaults.get(key, "silu")
  act = {"swish": "silu"}.get(act, act)  # one function in transformers
  if act not in ACTIVATIONS:
    raise ValueError(f"config.json: {key} {act!r} is not supported (only "
                     f"{', '.join(map(repr, ACTIVATIONS))})")
  return act


def _windows(hf: dict, kind: str, family: Family, layers: int
             ) -> tuple[int | None, tuple | None]:
  """(sliding_window, layer_types) as :class:`DecoderConfig` holds them:
  the window None when no layer slides, the types None when every layer
  does the same."""
  window = hf.get("sliding_window", family.defaults.get("sliding_window"))
  types = hf.get("layer_types")
  if family.windows == "none":
    window, types = None, None
  elif family.windows == "all":
    if types is not None:
      raise ValueError(f"config.json sets layer_types, which transformers' "
                       f"{kind!r} ignores (every layer slides when "
                       "sliding_window is set); remove it")
  elif kind in ("qwen2", "qwen3"):
    window = window if hf.get("use_sliding_window") else None
    start = hf.get("max_window_layers", family.defaults["max_window_layers"])
    types = types or ["sliding_attention" if window and i >= start
                      else "full_attention" for i in range(layers)]
  else:  # Gemma: alternating local and global layers
    # Only Gemma 3 reads the pattern; transformers' Gemma 2 alternates.
    pattern = (_count(hf, "sliding_window_pattern",
                      family.defaults["sliding_window_pattern"])
               if kind == "gemma3_text" else
               family.defaults["sliding_window_pattern"])
    types = types or ["sliding_attention" if (i + 1) % pattern
                      else "full_attention" for i in range(layers)]
  if window is not None and (isinstance(window, bool) or not isinstance(
      window, int) or window < 1):
    raise ValueError(f"config.json: sliding_window must be a positive "
                     f"integer or null, not {window!r}")
  if types is None:
    return window, None
  if not isinstance(types, list) or len(types) != layers:
    raise ValueError(f"config.json: layer_types must be a list of "
                     f"num_hidden_layers={layers} entries; got {types!r}")
  for i, t in enumerate(types):
    if t not in LAYER_TYPES:
      raise ValueError(f"config.json: layer_types[{i}] is {t!r}; only "
                       f"{LAYER_TYPES} are implemented")
    if t == "sliding_attention" and window is None:
      raise ValueError(f"config.json: layer_types[{i}] is "
                       "'sliding_attention' but the sliding window is off "
                       "(sliding_window null, or use_sliding_window false)")
  if "sliding_attention" not in types:
    return None, None
  return window, (None if "full_attention" not in types else tuple(types))


def _scaling(rope: dict, where: str):
  """The RoPE scaling ``rope`` (a rope_parameters dict) asks for."""
  kind = rope.get("rope_type", rope.get("type", "default"))
  needs = dict(llama3=("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
               linear=("factor",), default=())
  if kind not in needs:
    raise ValueError(f"{where}: rope type {kind!r} is not supported (only "
                     "'default', 'linear' and 'llama3')")
  missing = [k for k in needs[kind] if k not in rope]
  if missing:
    raise ValueError(f"{where}: rope type {kind!r} without {missing}")
  if kind == "linear":
    return LinearRopeScaling(factor=float(rope["factor"]))
  if kind == "llama3":
    return Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope["original_max_position_embeddings"]))
  return None


def _rope(hf: dict, kind: str, family: Family) -> dict[str, Any]:
  """``rope_theta``, ``rope_scaling`` and ``local_rope_theta``, from either
  spelling: ``rope_theta``/``rope_scaling`` (and Gemma 3's
  ``rope_local_base_freq``) of transformers 4, ``rope_parameters`` of 5
  (per layer type for Gemma 3)."""
  params = dict(hf.get("rope_parameters") or {})
  theta = family.defaults.get("rope_theta", 10_000.0)
  if kind != "gemma3_text":
    # As PreTrainedConfig.convert_rope_params_to_dict and
    # standardize_rope_params: rope_scaling, where given, replaces
    # rope_parameters; the dict's rope_theta wins and the top-level one
    # only fills a gap; a top-level original_max_position_embeddings wins.
    params = dict(hf.get("rope_scaling") or params)
    params.setdefault("rope_theta", _float(hf, "rope_theta", theta))
    if (params.get("rope_type", params.get("type")) == "llama3" and
        hf.get("original_max_position_embeddings") is not None):
      params["original_max_position_embeddings"] = hf[
          "original_max_position_embeddings"]
    return dict(rope_theta=_float(params, "rope_theta", theta),
                rope_scaling=_scaling(params, "config.json"))
  # As Gemma3TextConfig.convert_rope_params_to_dict.
  if params and not {"full_attention", "sliding_attention"} >= params.keys():
    raise ValueError("config.json: gemma3_text's rope_parameters must be "
                     "keyed by layer type (full_attention, "
                     f"sliding_attention); got keys {sorted(params)}")
  full = dict(params.get("full_attention") or {})
  full.update(hf.get("rope_scaling") or {})
  local = dict(params.get("sliding_attention") or {})
  theta = float(full.get("rope_theta", hf.get("rope_theta", theta)))
  local_theta = float(local.get("rope_theta", hf.get(
      "rope_local_base_freq", family.defaults["rope_local_base_freq"])))
  scaling = _scaling(full, "config.json: rope_parameters['full_attention']")
  if _scaling(local, "config.json: rope_parameters['sliding_attention']"):
    raise ValueError("config.json: rope_parameters['sliding_attention'] "
                     "scales RoPE, which the sliding layers here do not "
                     "implement (only their rope_theta)")
  same = local_theta == theta and scaling is None
  return dict(rope_theta=theta, rope_scaling=scaling,
              local_rope_theta=None if same else local_theta)


def fields_from_hf(hf: dict) -> dict[str, Any]:
  """The :class:`DecoderConfig` fields a ``config.json`` dict sets."""
  kind, family = _family(hf)
  _refuse_unimplemented(hf, kind)
  d = family.defaults
  hidden, heads = _count(hf, "hidden_size"), _count(hf, "num_attention_heads")
  kv_heads = _count(hf, "num_key_value_heads", heads)
  if heads % kv_heads:
    raise ValueError(f"config.json: num_attention_heads={heads} is not a "
                     f"multiple of num_key_value_heads={kv_heads}")
  layers = _count(hf, "num_hidden_layers")
  window, types = _windows(hf, kind, family, layers)
  rope = _rope(hf, kind, family)
  if not window:
    rope["local_rope_theta"] = None
  gemma = "query_pre_attn_scalar" in d
  caps = {}
  for ours, key in (("logits_soft_cap", "attn_logit_softcapping"),
                    ("final_logits_soft_cap", "final_logit_softcapping")):
    caps[ours] = _positive(hf, key, d.get(key), optional=True) if gemma \
        else None
  if kind == "gemma3_text" and caps["logits_soft_cap"] is not None:
    raise ValueError("config.json sets attn_logit_softcapping, which "
                     "transformers' Gemma 3 does not apply; set it to null")
  positions = hf.get("max_position_embeddings")
  return dict(
      vocab_size=_count(hf, "vocab_size"), hidden_size=hidden,
      intermediate_size=_count(hf, "intermediate_size"),
      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
      head_dim=_count(hf, "head_dim", d.get("head_dim",
                                            hidden // heads or None)),
      rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6),
      max_position_embeddings=(None if positions is None else
                               _count(hf, "max_position_embeddings")),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                      d.get("tie_word_embeddings", False))),
      sliding_window=window, layer_types=types, **rope, **caps,
      query_pre_attn_scalar=(_positive(hf, "query_pre_attn_scalar",
                                       d["query_pre_attn_scalar"])
                             if gemma else None),
      hidden_act=_activation(hf, family), model_type=kind, **family.fixed)


def config_from_hf(hf: dict, **options) -> DecoderConfig:
  """A :class:`DecoderConfig` from a Hugging Face ``config.json`` dict,
  which it keeps (``hf_config``) for ``save_pretrained`` to write back.

  ``options`` sets the fields that say how the model runs (dtype,
  param_dtype, implementation, context_parallel, rules, param_rules,
  remat). Both spellings of RoPE settings are read: ``rope_theta`` and
  ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5). Raises a
  ValueError naming the key for what this model cannot be."""
  return DecoderConfig(**fields_from_hf(hf), hf_config=json.dumps(hf),
                       **options)


# --- DecoderConfig -> config.json --------------------------------------------

def _check_expressible(cfg: DecoderConfig, family: Family) -> None:
  """A ValueError naming the first field that ``cfg.model_type`` cannot
  write (transformers would read back another model)."""
  kind = cfg.model_type
  for field, value in family.fixed.items():
    if getattr(cfg, field) != value:
      raise ValueError(f"{field}={getattr(cfg, field)} cannot be saved as "
                       f"model_type {kind!r} (whose {field} is {value})")
  gemma = "query_pre_attn_scalar" in family.defaults
  only = dict(logits_soft_cap=kind == "gemma2",
              final_logits_soft_cap=gemma,
              query_pre_attn_scalar=gemma,
              local_rope_theta=kind == "gemma3_text")
  for field, allowed in only.items():
    if getattr(cfg, field) is not None and not allowed:
      raise ValueError(f"{field} has no place in a {kind!r} checkpoint; "
                       "save a model without it, or as a model_type that "
                       "has it")
  if cfg.sliding_window is not None and family.windows == "none":
    raise ValueError(f"sliding_window has no place in a {kind!r} "
                     "checkpoint ('mistral' has one for every layer)")
  if cfg.layer_types is not None and family.windows != "per_layer":
    raise ValueError(f"layer_types has no place in a {kind!r} checkpoint: "
                     "its layers all slide or none does")


def _rope_to_hf(theta: float, scaling) -> dict:
  rope = {"rope_type": "default", "rope_theta": theta}
  if isinstance(scaling, LinearRopeScaling):
    rope.update(rope_type="linear", factor=scaling.factor)
  elif scaling is not None:
    rope.update(rope_type="llama3", factor=scaling.factor,
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=(
                    scaling.original_max_position_embeddings))
  return rope


def config_to_hf(cfg: DecoderConfig) -> dict:
  """The ``config.json`` fields the model determines, as transformers
  reads them back as the same model (``save_pretrained`` adds the loaded
  checkpoint's other fields)."""
  kind = cfg.model_type
  family = FAMILIES[kind]
  _check_expressible(cfg, family)
  full = _rope_to_hf(cfg.rope_theta, cfg.rope_scaling)
  hf = dict(
      model_type=kind, architectures=[family.architecture],
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      rms_norm_eps=cfg.rms_norm_eps,
      tie_word_embeddings=cfg.tie_word_embeddings,
      rope_theta=cfg.rope_theta,
      rope_scaling=None if cfg.rope_scaling is None else full,
      rope_parameters=full)
  if cfg.max_position_embeddings is not None:
    hf["max_position_embeddings"] = cfg.max_position_embeddings
  types = [("sliding_attention" if cfg.is_sliding(i) else "full_attention")
           for i in range(cfg.num_layers)]
  if kind in ("gemma2", "gemma3_text"):
    # transformers' Gemma builds a sliding mask even where no layer uses
    # it, and refuses a null window: its default stands in.
    hf.update(hidden_activation=cfg.hidden_act, attention_bias=False,
              query_pre_attn_scalar=(cfg.query_pre_attn_scalar
                                     or cfg.head_dim),
              attn_logit_softcapping=cfg.logits_soft_cap,
              final_logit_softcapping=cfg.final_logits_soft_cap,
              sliding_window=cfg.sliding_window or
              family.defaults["sliding_window"],
              layer_types=types, use_bidirectional_attention=False)
  else:
    hf["hidden_act"] = cfg.hidden_act
  if kind == "gemma3_text":
    local = (full if cfg.local_rope_theta is None else
             _rope_to_hf(cfg.local_rope_theta, None))
    hf.update(rope_local_base_freq=local["rope_theta"], rope_parameters=dict(
        full_attention=full, sliding_attention=local))
  if kind == "llama":
    hf.update(attention_bias=False, mlp_bias=False)
  if kind == "mistral":
    hf["sliding_window"] = cfg.sliding_window
  if kind in ("qwen2", "qwen3"):
    hf.update(use_sliding_window=cfg.sliding_window is not None,
              sliding_window=cfg.sliding_window, layer_types=types)
  if kind == "qwen3":
    hf["attention_bias"] = False
  return hf


_ABSENT = object()


def config_to_save(cfg: DecoderConfig, extra_config: dict | None,
                   dtype_name: str) -> dict:
  """``save_pretrained``'s ``config.json``: the loaded one
  (``cfg.hf_config``), then ``extra_config``, then each field the model
  determines, where the model differs from what those say (a field the
  model agrees with keeps the loaded spelling, and a field the loaded one
  lacked stays absent); then the stored dtype. A model not loaded writes
  all of :func:`config_to_hf`."""
  ours = config_to_hf(cfg)
  loaded = {} if cfg.hf_config is None else json.loads(cfg.hf_config)
  theirs = config_to_hf(DecoderConfig(**fields_from_hf(loaded))) if (
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
  # What is written must read back as this model (an extra key such as
  # max_window_layers or sliding_window_pattern can change the layers).
  back = fields_from_hf(hf)
  differ = [k for k in back if _normal(back[k]) != _normal(getattr(cfg, k))]
  if differ:
    raise ValueError(
        "save_pretrained: config.json would read back as another model ("
        + ", ".join(f"{k} {back[k]!r}, the model's {getattr(cfg, k)!r}"
                    for k in differ)
        + f"); extra_config sets {sorted(extra_config or {})}")
  return hf


def _normal(value):
  """Lists as tuples, for comparing a field read from JSON."""
  return tuple(value) if isinstance(value, list) else value
