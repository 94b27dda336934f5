"""Hugging Face checkpoints (``config.json`` plus ``*.safetensors``) in and out
of :class:`~jax_ring.models.llama.Llama`.

Loading checks every tensor's file, dtype and shape from the safetensors
headers before it reads any data, then places each tensor on the mesh as it
is read: the host holds one checkpoint tensor (and its transposed copy) at a
time, and each process copies only its own devices' shards, so an 8B model
loads into FSDP x context shards on hosts with far less memory than the
model. Saving gathers one parameter at a time and writes files of at most
``max_shard_bytes`` with the usual ``model.safetensors.index.json``, and
the ``config.json`` it was loaded with, changed only where the model is.

Supported ``model_type``: ``llama`` (Llama 2, 3, 3.1, 3.2), ``qwen2``
(Qwen2, Qwen2.5) and ``mistral``. Options no layer here implements
(attention or MLP biases on Llama, per-layer sliding windows, RoPE scalings
other than Llama 3's, quantization) are refused with the key that asks for
them. Every error about a file names it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jax_ring.flax.attention import Llama3RopeScaling
from jax_ring.models.llama import Llama, LlamaConfig

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Tensors some checkpoints carry that hold nothing the model needs.
_IGNORED = ("rotary_emb.inv_freq",)
# safetensors dtypes read as weights. Integer and 8-bit float tensors are
# quantized weights (or not weights): cast to float without their scales
# they would load as silently wrong numbers.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _read_json(file: pathlib.Path) -> dict:
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


def _fields_from_hf(hf: dict) -> dict[str, Any]:
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
  return LlamaConfig(**_fields_from_hf(hf), hf_config=json.dumps(hf),
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


def _config_to_save(cfg: LlamaConfig, extra_config: dict | None,
                    dtype_name: str) -> dict:
  """``save_pretrained``'s ``config.json``: the loaded one
  (``cfg.hf_config``), then ``extra_config``, then each field the model
  determines, where the model differs from what those say (a field the
  model agrees with keeps the loaded spelling, and a field the loaded one
  lacked stays absent); then the stored dtype. A model not loaded writes
  all of :func:`config_to_hf`."""
  ours = config_to_hf(cfg)
  loaded = {} if cfg.hf_config is None else json.loads(cfg.hf_config)
  theirs = config_to_hf(LlamaConfig(**_fields_from_hf(loaded))) if (
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

class Tensor(NamedTuple):
  """One parameter of ``Llama(cfg)`` and its checkpoint tensor."""
  key: tuple  # the parameter's path in the model
  name: str  # the Hugging Face tensor name
  shape: tuple  # the tensor's shape in the checkpoint
  implied_by: str  # the config.json fields that give that shape
  to_ours: Callable  # checkpoint array -> parameter
  to_hf: Callable  # parameter -> checkpoint array


def tensor_map(cfg: LlamaConfig) -> Iterator[Tensor]:
  """A :class:`Tensor` for every parameter of ``Llama(cfg)``."""
  e, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  m, v = cfg.intermediate_size, cfg.vocab_size
  hf_field = dict(vocab_size=v, hidden_size=e, intermediate_size=m,
                  num_attention_heads=n, num_key_value_heads=k, head_dim=h)
  fields = lambda *keys: ", ".join(f"{f}={hf_field[f]}" for f in keys)
  same = lambda x: x
  t = lambda x: x.T
  heads_in = lambda m: (lambda x: x.T.reshape(e, m, h),
                        lambda x: x.reshape(e, m * h).T)
  yield Tensor(("embed",), "model.embed_tokens.weight", (v, e),
               fields("vocab_size", "hidden_size"), same, same)
  for i in range(cfg.num_layers):
    hf = f"model.layers.{i}."
    ours = ("layers", i)
    for norm, hf_norm in (("attn_norm", "input_layernorm"),
                          ("mlp_norm", "post_attention_layernorm")):
      yield Tensor(ours + (norm, "scale"), hf + hf_norm + ".weight", (e,),
                   fields("hidden_size"), same, same)
    for name, heads, heads_key in (("q", n, "num_attention_heads"),
                                   ("k", k, "num_key_value_heads"),
                                   ("v", k, "num_key_value_heads")):
      yield Tensor(ours + ("attn", f"w{name}"),
                   hf + f"self_attn.{name}_proj.weight", (heads * h, e),
                   fields(heads_key, "head_dim", "hidden_size"),
                   *heads_in(heads))
      if cfg.qkv_bias:
        yield Tensor(ours + ("attn", f"b{name}"),
                     hf + f"self_attn.{name}_proj.bias", (heads * h,),
                     fields(heads_key, "head_dim"),
                     lambda x, m=heads: x.reshape(m, h),
                     lambda x, m=heads: x.reshape(m * h))
    yield Tensor(ours + ("attn", "wo"), hf + "self_attn.o_proj.weight",
                 (e, n * h),
                 fields("hidden_size", "num_attention_heads", "head_dim"),
                 lambda x: x.T.reshape(n, h, e),
                 lambda x: x.reshape(n * h, e).T)
    for name, shape in (("gate", (m, e)), ("up", (m, e)), ("down", (e, m))):
      yield Tensor(ours + ("mlp", f"w_{name}"), hf + f"mlp.{name}_proj.weight",
                   shape, fields("intermediate_size", "hidden_size"), t, t)
  yield Tensor(("final_norm", "scale"), "model.norm.weight", (e,),
               fields("hidden_size"), same, same)
  if not cfg.tie_word_embeddings:
    yield Tensor(("unembed",), "lm_head.weight", (v, e),
                 fields("vocab_size", "hidden_size"), t, t)


# --- the safetensors files ---------------------------------------------------

def _open(file: pathlib.Path, stack: contextlib.ExitStack):
  """``file`` open for reading (closed with ``stack``); a ValueError naming
  it when it is not a safetensors file (truncated, say)."""
  from safetensors import safe_open
  try:
    return stack.enter_context(safe_open(file, framework="numpy"))
  except Exception as e:  # safetensors' own error type is not public
    raise ValueError(f"{file}: not a readable safetensors file: {e}") from e


def _locate(path: pathlib.Path, stack: contextlib.ExitStack
            ) -> dict[str, tuple[pathlib.Path, Any]]:
  """Tensor name -> (its file, that file open): by the index's
  ``weight_map`` when there is one (each file must hold what it is mapped
  to), else by each ``*.safetensors`` file's own list (a name in two files
  is an error)."""
  index = path / INDEX
  found = {}
  if index.exists():
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: no 'weight_map' object")
    handles, holds = {}, {}
    for name, file in weight_map.items():
      file = path / file
      if file not in handles:
        if not file.is_file():
          raise FileNotFoundError(f"{index} maps {name} to {file.name}, "
                                  f"which does not exist ({file})")
        handles[file] = _open(file, stack)
        holds[file] = set(handles[file].keys())
      if name not in holds[file]:
        raise ValueError(f"{index} maps {name} to {file.name}, which does "
                         f"not hold it ({file})")
      found[name] = file, handles[file]
    return found
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {path}")
  for file in files:
    fh = _open(file, stack)
    for name in fh.keys():
      if name in found:
        raise ValueError(f"{name} is in two files, {found[name][0]} and "
                         f"{file}; which one is meant is unknown (an {INDEX} "
                         "would say)")
      found[name] = file, fh
  return found


def _check(tensor: Tensor, file: pathlib.Path, fh) -> None:
  """``tensor``'s dtype and shape in ``file``, from its header."""
  header = fh.get_slice(tensor.name)
  dtype, shape = header.get_dtype(), tuple(header.get_shape())
  if dtype not in _FLOAT_DTYPES:
    raise ValueError(f"{tensor.name} in {file} has dtype {dtype}, not a "
                     "16-, 32- or 64-bit float: integer and 8-bit "
                     "(quantized) tensors are not loaded, as cast to float "
                     "they are not the weights; dequantize the checkpoint "
                     "first")
  if shape != tensor.shape:
    raise ValueError(f"{tensor.name} in {file} has shape {shape}; "
                     f"config.json ({tensor.implied_by}) implies "
                     f"{tensor.shape}")


def _read(tensor: Tensor, file: pathlib.Path, fh) -> np.ndarray:
  try:
    return fh.get_tensor(tensor.name)
  except Exception as e:  # safetensors' own error type is not public
    raise ValueError(f"{file}: {tensor.name} is not readable: {e}") from e


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
    The model, its config keeping ``config.json`` (``cfg.hf_config``); call
    it under ``jax.set_mesh(mesh)`` when sharded.

  Raises:
    ValueError: naming the file (and the tensor) for a config this model
      cannot be, JSON or safetensors that do not parse, tensors missing,
      left over, found in two files, of integer or 8-bit dtypes, or of
      shapes other than ``config.json`` implies; all found (from the
      safetensors headers) before any tensor is read.
    FileNotFoundError: no ``config.json``, no ``*.safetensors``, or a file
      the index names is absent.
  """
  path = pathlib.Path(path)
  hf = _read_json(path / CONFIG)
  try:
    fields = _fields_from_hf(hf)
  except ValueError as e:
    raise ValueError(f"{path / CONFIG}: {e}") from e
  cfg = LlamaConfig(**fields, hf_config=json.dumps(hf), **options)
  if cfg.rules and mesh is None:
    raise ValueError("load_pretrained: rules are given, so a mesh is needed "
                     "to place the weights (mesh=...)")
  with contextlib.ExitStack() as stack:
    files = _locate(path, stack)
    tensors = list(tensor_map(cfg))
    expected = {t.name for t in tensors}
    missing = sorted(expected - files.keys())
    extra = sorted(n for n in files.keys() - expected
                   if not n.endswith(_IGNORED) and not (
                       cfg.tie_word_embeddings and n == "lm_head.weight"))
    if missing or extra:
      raise ValueError(f"checkpoint {path} does not match its config.json: "
                       f"missing {missing[:8]}, unexpected {extra[:8]}")
    for t in tensors:
      _check(t, *files[t.name])
    return _place(cfg, tensors, files, mesh)


def _place(cfg: LlamaConfig, tensors: list[Tensor], files: dict, mesh):
  """The model, each tensor read from its file and put where it goes."""
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
  for t in tensors:
    var = flat[t.key]
    want = _value(var)
    x = np.asarray(t.to_ours(_read(t, *files[t.name]))).astype(want.dtype)
    if mesh is None:
      value = jax.device_put(x)
    else:  # without rules: whole on every device of the mesh
      spec = flat_specs.get(t.key, jax.P())
      spec = spec.get_value() if hasattr(spec, "get_value") else getattr(
          spec, "value", spec)
      value = jax.make_array_from_callback(
          x.shape, NamedSharding(mesh, spec), lambda i, x=x: x[i])
    if hasattr(var, "set_value"):
      var.set_value(value)
    else:
      var.value = value
    del x
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _value(var):
  return var.get_value() if hasattr(var, "get_value") else var.value


def _host(x) -> np.ndarray:
  """The whole array on this host (gathered across processes)."""
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def _new_file_mode() -> int:
  """The mode ``open(path, "w")`` gives a new file: 0o666 less the umask
  (read from /proc where Linux shows it, since setting it to read it is
  not thread-safe)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return 0o666 & ~int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return 0o666 & ~mask


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
    extra_config: more ``config.json`` keys (e.g. ``bos_token_id``,
      ``eos_token_id``, ``pad_token_id``), over those of the loaded
      checkpoint; the architecture's own keys win.

  ``config.json`` holds every field of the checkpoint the model was loaded
  from (``model.cfg.hf_config``), changed only where the model differs from
  it; a model not loaded gets the fields :func:`config_to_hf` gives. Files
  get the mode any new file of the user's gets (0o666 less the umask).
  Process 0 writes; every process must call it (the gathers are
  collective). Returns ``path``.
  """
  from safetensors.numpy import save_file
  path = pathlib.Path(path)
  cfg = model.cfg
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  tensors = list(tensor_map(cfg))
  stored = np.dtype(dtype or _value(flat[tensors[0].key]).dtype)
  hf = _config_to_save(cfg, extra_config, stored.name)  # errors before I/O
  # Files planned from the shapes, so that each name knows the count.
  files, size = [[]], 0
  for t in tensors:
    x = _value(flat[t.key])
    nbytes = math.prod(x.shape) * np.dtype(dtype or x.dtype).itemsize
    if files[-1] and size + nbytes > max_shard_bytes:
      files.append([])
      size = 0
    files[-1].append(t)
    size += nbytes
  writer = jax.process_index() == 0
  if writer:
    path.mkdir(parents=True, exist_ok=True)
  mode = _new_file_mode()
  weight_map, total = {}, 0
  for i, group in enumerate(files):
    name = ("model.safetensors" if len(files) == 1 else
            f"model-{i + 1:05d}-of-{len(files):05d}.safetensors")
    arrays = {}
    for t in group:
      x = _host(_value(flat[t.key]))
      arrays[t.name] = np.ascontiguousarray(t.to_hf(x).astype(dtype or
                                                              x.dtype))
      total += arrays[t.name].nbytes
      weight_map[t.name] = name
    if writer:
      save_file(arrays, path / name, metadata={"format": "pt"})
      # safetensors writes a private temporary file (mode 0600) and renames
      # it into place.
      os.chmod(path / name, mode)
    del arrays
  if writer:
    (path / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    if len(files) > 1:
      (path / INDEX).write_text(json.dumps(dict(
          metadata=dict(total_size=total), weight_map=weight_map), indent=2))
  return path
