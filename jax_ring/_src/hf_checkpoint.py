"""Hugging Face checkpoints (``config.json`` plus ``*.safetensors``) in and out
of :class:`~jax_ring._src.llama.Llama`.

Loading places each tensor on the mesh as it is read: the host holds one
checkpoint tensor (and its transposed copy) at a time, and each process
copies only its own devices' shards, so an 8B model loads into FSDP x
context shards on hosts with far less memory than the model. Saving
gathers one parameter at a time and writes files of at most
``max_shard_bytes`` with the usual ``model.safetensors.index.json``.

Supported ``model_type``: ``llama`` (Llama 2, 3, 3.1, 3.2), ``qwen2``
(Qwen2, Qwen2.5) and ``mistral``. Options no layer here implements
(attention or MLP biases on Llama, per-layer sliding windows, RoPE scalings
other than Llama 3's) are refused with the key that asks for them.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Callable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jax_ring._src.flax_attention import Llama3RopeScaling
from jax_ring._src.llama import Llama, LlamaConfig

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Tensors some checkpoints carry that hold nothing the model needs.
_IGNORED = ("rotary_emb.inv_freq",)


# --- config.json -------------------------------------------------------------

def config_from_hf(hf: dict, **options) -> LlamaConfig:
  """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict.

  ``options`` sets the fields that say how the model runs (dtype,
  param_dtype, implementation, context_parallel, rules, param_rules,
  remat). Both spellings of RoPE settings are read: ``rope_theta`` and
  ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5)."""
  kind = hf.get("model_type")
  if kind not in ("llama", "qwen2", "mistral"):
    raise ValueError(f"model_type {kind!r} is not supported; jax_ring reads "
                     "'llama', 'qwen2' and 'mistral' checkpoints")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ValueError(f"config.json sets {key}=true, which this model does "
                       "not implement")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act {hf['hidden_act']!r}: only 'silu' (SwiGLU)")
  window = None
  if kind == "mistral":
    window = hf.get("sliding_window")
  elif kind == "qwen2" and hf.get("use_sliding_window"):
    raise ValueError("config.json sets use_sliding_window=true: Qwen2's "
                     "per-layer sliding windows are not implemented")
  rope = dict(hf.get("rope_parameters") or {})
  rope.update(hf.get("rope_scaling") or {})
  theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  scaling = None
  if rope_type == "llama3":
    scaling = Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope["original_max_position_embeddings"]))
  elif rope_type != "default":
    raise ValueError(f"rope type {rope_type!r} is not supported (only "
                     "'default' and 'llama3')")
  heads = hf["num_attention_heads"]
  return LlamaConfig(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      rope_theta=float(theta), rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=kind == "qwen2", sliding_window=window, model_type=kind,
      **options)


def config_to_hf(cfg: LlamaConfig) -> dict:
  """The ``config.json`` dict transformers reads back as the same model."""
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
  if cfg.model_type == "llama":
    hf.update(attention_bias=False, mlp_bias=False)
  if cfg.model_type == "mistral":
    hf["sliding_window"] = cfg.sliding_window
  if cfg.model_type == "qwen2":
    hf.update(use_sliding_window=False, sliding_window=None)
  return hf


# --- the tensor map ----------------------------------------------------------

def tensor_map(cfg: LlamaConfig) -> Iterator[tuple[tuple, str, Callable,
                                                   Callable]]:
  """(parameter path, Hugging Face name, HF array -> ours, ours -> HF) for
  every parameter of ``Llama(cfg)``."""
  e, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  same = lambda x: x
  t = lambda x: x.T
  heads_in = lambda m: (lambda x: x.T.reshape(e, m, h),
                        lambda x: x.reshape(e, m * h).T)
  yield ("embed",), "model.embed_tokens.weight", same, same
  for i in range(cfg.num_layers):
    hf = f"model.layers.{i}."
    ours = ("layers", i)
    for norm, hf_norm in (("attn_norm", "input_layernorm"),
                          ("mlp_norm", "post_attention_layernorm")):
      yield ours + (norm, "scale"), hf + hf_norm + ".weight", same, same
    for name, m in (("q", n), ("k", k), ("v", k)):
      yield (ours + ("attn", f"w{name}"), hf + f"self_attn.{name}_proj.weight",
             *heads_in(m))
      if cfg.qkv_bias:
        yield (ours + ("attn", f"b{name}"), hf + f"self_attn.{name}_proj.bias",
               lambda x, m=m: x.reshape(m, h), lambda x, m=m: x.reshape(m * h))
    yield (ours + ("attn", "wo"), hf + "self_attn.o_proj.weight",
           lambda x: x.T.reshape(n, h, e), lambda x: x.reshape(n * h, e).T)
    for name in ("gate", "up", "down"):
      yield ours + ("mlp", f"w_{name}"), hf + f"mlp.{name}_proj.weight", t, t
  yield ("final_norm", "scale"), "model.norm.weight", same, same
  if not cfg.tie_word_embeddings:
    yield ("unembed",), "lm_head.weight", t, t


def _files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> the safetensors file that holds it."""
  from safetensors import safe_open
  index = path / INDEX
  if index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    return {name: path / f for name, f in weight_map.items()}
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {path}")
  names = {}
  for f in files:
    with safe_open(f, framework="numpy") as fh:
      names.update(dict.fromkeys(fh.keys(), f))
  return names


# --- load and save -----------------------------------------------------------

def load_pretrained(path, *, mesh: jax.sharding.Mesh | None = None,
                    **options) -> Llama:
  """A :class:`Llama` with the weights of a local Hugging Face checkpoint.

  Args:
    path: a directory with ``config.json`` and one or several
      ``*.safetensors`` (with ``model.safetensors.index.json`` when sharded).
    mesh: where the weights go, sharded by ``options["param_rules"]`` (or
      ``rules``), replicated without rules; needed when rules are given.
      None: the default device.
    **options: :class:`LlamaConfig` fields that say how the model runs
      (dtype, param_dtype, implementation, context_parallel, rules,
      param_rules, remat).

  Returns:
    The model; call it under ``jax.set_mesh(mesh)`` when sharded.
  """
  from safetensors import safe_open
  path = pathlib.Path(path)
  cfg = config_from_hf(json.loads((path / CONFIG).read_text()), **options)
  if cfg.rules and mesh is None:
    raise ValueError("load_pretrained: rules are given, so a mesh is needed "
                     "to place the weights (mesh=...)")
  files = _files(path)
  expected = {name for _, name, _, _ in tensor_map(cfg)}
  missing = sorted(expected - files.keys())
  extra = sorted(n for n in files.keys() - expected
                 if not n.endswith(_IGNORED) and not (
                     cfg.tie_word_embeddings and n == "lm_head.weight"))
  if missing or extra:
    raise ValueError(f"checkpoint {path} does not match its config.json: "
                     f"missing {missing[:8]}, unexpected {extra[:8]}")

  build = lambda: Llama(cfg, rngs=nnx.Rngs(0))
  if mesh is not None:
    with jax.set_mesh(mesh):
      abstract = nnx.eval_shape(build)
  else:
    abstract = nnx.eval_shape(build)
  graphdef, state = nnx.split(abstract)
  specs = nnx.get_partition_spec(state) if cfg.rules else None
  flat = dict(nnx.to_flat_state(state))
  flat_specs = dict(nnx.to_flat_state(specs)) if specs is not None else {}
  handles = {}
  try:
    for key, name, to_ours, _ in tensor_map(cfg):
      f = files[name]
      if f not in handles:
        handles[f] = safe_open(f, framework="numpy").__enter__()
      var = flat[key]
      want = var.get_value() if hasattr(var, "get_value") else var.value
      x = np.asarray(to_ours(handles[f].get_tensor(name)))
      if x.shape != want.shape:
        raise ValueError(f"{name}: shape {x.shape} in the checkpoint, "
                         f"{want.shape} expected from config.json")
      x = x.astype(want.dtype)
      if mesh is None:
        value = jax.device_put(x)
      else:  # without rules: whole on every device of the mesh
        spec = flat_specs.get(key, jax.P())
        spec = spec.get_value() if hasattr(spec, "get_value") else getattr(
            spec, "value", spec)
        sharding = NamedSharding(mesh, spec)
        value = jax.make_array_from_callback(x.shape, sharding,
                                             lambda i, x=x: x[i])
      _set(var, value)
      del x
  finally:
    for fh in handles.values():
      fh.__exit__(None, None, None)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _set(var, value):
  if hasattr(var, "set_value"):
    var.set_value(value)
  else:
    var.value = value


def _host(x) -> np.ndarray:
  """The whole array on this host (gathered across processes)."""
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def save_pretrained(model: Llama, path, *, dtype=None,
                    max_shard_bytes: int = 2 * 2**30,
                    extra_config: dict | None = None) -> pathlib.Path:
  """Write ``model`` as a Hugging Face checkpoint transformers loads.

  Args:
    model: a :class:`Llama` (sharded or not).
    path: the directory (created).
    dtype: the stored dtype (e.g. ``jnp.bfloat16``); default the weights'.
    max_shard_bytes: the largest ``*.safetensors`` file; more than one
      comes with ``model.safetensors.index.json``.
    extra_config: more ``config.json`` keys, e.g. the base checkpoint's
      token ids (``bos_token_id``, ``eos_token_id``) and
      ``max_position_embeddings``, which the model itself does not hold;
      the architecture's own keys win.

  Process 0 writes; every process must call it (the gathers are
  collective). Returns ``path``.
  """
  from safetensors.numpy import save_file
  path = pathlib.Path(path)
  cfg = model.cfg
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  value = lambda v: v.get_value() if hasattr(v, "get_value") else v.value
  entries = list(tensor_map(cfg))
  # Files planned from the shapes, so that each name knows the count.
  files, size = [[]], 0
  for entry in entries:
    x = value(flat[entry[0]])
    nbytes = math.prod(x.shape) * np.dtype(dtype or x.dtype).itemsize
    if files[-1] and size + nbytes > max_shard_bytes:
      files.append([])
      size = 0
    files[-1].append(entry)
    size += nbytes
  writer = jax.process_index() == 0
  if writer:
    path.mkdir(parents=True, exist_ok=True)
  weight_map, total = {}, 0
  for i, group in enumerate(files):
    name = ("model.safetensors" if len(files) == 1 else
            f"model-{i + 1:05d}-of-{len(files):05d}.safetensors")
    tensors = {}
    for key, hf_name, _, to_hf in group:
      x = _host(value(flat[key]))
      tensors[hf_name] = np.ascontiguousarray(to_hf(x).astype(dtype or
                                                            x.dtype))
      total += tensors[hf_name].nbytes
      weight_map[hf_name] = name
    if writer:
      save_file(tensors, path / name, metadata={"format": "pt"})
    del tensors
  if writer:
    hf = dict(extra_config or {}) | config_to_hf(cfg)
    hf["torch_dtype"] = np.dtype(
        dtype or value(flat[entries[0][0]]).dtype).name
    (path / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    if len(files) > 1:
      (path / INDEX).write_text(json.dumps(dict(
          metadata=dict(total_size=total), weight_map=weight_map), indent=2))
  return path
