"""Hugging Face checkpoints (``config.json`` plus ``*.safetensors``) in and out
of :class:`~jax_ring.models.decoder.Decoder`.

Loading checks every tensor's file, dtype and shape from the safetensors
headers before it reads any data, then places each tensor on the mesh as it
is read: the host holds one checkpoint tensor (and its transposed copy) at a
time, and each process copies only its own devices' shards, so an 8B model
loads into FSDP x context shards on hosts with far less memory than the
model. Saving gathers one parameter at a time and writes files of at most
``max_shard_bytes`` with the usual ``model.safetensors.index.json``, and
the ``config.json`` it was loaded with, changed only where the model is.

The ``config.json`` side is ``hf_config``. Every error about a file names
it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jax_ring.models import hf_config
from jax_ring.models.hf_config import CONFIG
from jax_ring.models.config import DecoderConfig
from jax_ring.models.decoder import Decoder


INDEX = "model.safetensors.index.json"
# Tensors some checkpoints carry that hold nothing the model needs.
_IGNORED = ("rotary_emb.inv_freq",)
# safetensors dtypes read as weights. Integer and 8-bit float tensors are
# quantized weights (or not weights): cast to float without their scales
# they would load as silently wrong numbers.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class Tensor(NamedTuple):
  """One parameter of ``Decoder(cfg)`` and its checkpoint tensor."""
  key: tuple  # the parameter's path in the model
  name: str  # the Hugging Face tensor name
  shape: tuple  # the tensor's shape in the checkpoint
  implied_by: str  # the config.json fields that give that shape
  to_ours: Callable  # checkpoint array -> parameter
  to_hf: Callable  # parameter -> checkpoint array


def tensor_map(cfg: DecoderConfig) -> Iterator[Tensor]:
  """A :class:`Tensor` for every parameter of ``Decoder(cfg)``."""
  e, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  m, v = cfg.intermediate_size, cfg.vocab_size
  hf_field = dict(vocab_size=v, hidden_size=e, intermediate_size=m,
                  num_attention_heads=n, num_key_value_heads=k, head_dim=h)
  fields = lambda *keys: ", ".join(f"{f}={hf_field[f]}" for f in keys)
  same = lambda x: x
  t = lambda x: x.T
  heads_in = lambda m: (lambda x: x.T.reshape(e, m, h),
                        lambda x: x.reshape(e, m * h).T)
  # Ours -> theirs: Gemma's post_attention_layernorm closes the attention
  # branch; Llama's opens the MLP one.
  norms = (dict(attn_norm="input_layernorm",
                attn_post_norm="post_attention_layernorm",
                mlp_norm="pre_feedforward_layernorm",
                mlp_post_norm="post_feedforward_layernorm")
           if cfg.sandwich_norm else
           dict(attn_norm="input_layernorm",
                mlp_norm="post_attention_layernorm"))
  yield Tensor(("embed",), "model.embed_tokens.weight", (v, e),
               fields("vocab_size", "hidden_size"), same, same)
  for i in range(cfg.num_layers):
    hf = f"model.layers.{i}."
    ours = ("layers", i)
    for norm, hf_norm in norms.items():
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
      if cfg.qk_norm and name != "v":
        yield Tensor(ours + ("attn", f"{name}_norm"),
                     hf + f"self_attn.{name}_norm.weight", (h,),
                     fields("head_dim"), same, same)
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
    weight_map = hf_config.read_json(index).get("weight_map")
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


# config.json's dtype names and safetensors' dtype codes -> numpy dtypes.
_DTYPES = {"float32": jnp.float32, "float": jnp.float32, "F32": jnp.float32,
           "bfloat16": jnp.bfloat16, "BF16": jnp.bfloat16,
           "float16": jnp.float16, "half": jnp.float16, "F16": jnp.float16,
           "float64": jnp.float64, "F64": jnp.float64}


def _stored_dtype(path: pathlib.Path, hf: dict, files: dict):
  """The checkpoint's dtype: ``config.json``'s ``dtype`` (transformers 5)
  or ``torch_dtype`` (older), else the most common of its floating
  tensors' (ties: the wider). float64 loads as float32."""
  name = hf.get("dtype") or hf.get("torch_dtype")
  if name is not None and name != "auto":
    if name not in _DTYPES:
      raise ValueError(f"{path / CONFIG}: dtype {name!r} is none of "
                       f"{sorted(n for n in _DTYPES if n.islower())}")
    dtype = _DTYPES[name]
  else:
    codes = [fh.get_slice(n).get_dtype() for n, (_, fh) in files.items()]
    codes = [c for c in codes if c in _DTYPES] or ["F32"]
    dtype = _DTYPES[max(set(codes), key=lambda c: (
        codes.count(c), np.dtype(_DTYPES[c]).itemsize))]
  return jnp.float32 if dtype == jnp.float64 else dtype


def _differ(files: dict, a: str, b: str) -> bool:
  """Whether tensors ``a`` and ``b`` are both in ``files`` and differ (in
  shape, dtype or any bit)."""
  if a not in files or b not in files:
    return False
  x, y = (files[n][1].get_tensor(n) for n in (a, b))
  return x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes()


def _read(tensor: Tensor, file: pathlib.Path, fh) -> np.ndarray:
  try:
    return fh.get_tensor(tensor.name)
  except Exception as e:  # safetensors' own error type is not public
    raise ValueError(f"{file}: {tensor.name} is not readable: {e}") from e


# --- load and save -----------------------------------------------------------

def load_pretrained(path, *, mesh: jax.sharding.Mesh | None = None,
                    **options) -> Decoder:
  """A :class:`Decoder` with the weights of a local Hugging Face checkpoint.

  Args:
    path: a directory with ``config.json`` and one or several
      ``*.safetensors`` (with ``model.safetensors.index.json`` when sharded).
    mesh: where the weights go, sharded by ``options["param_rules"]`` (or
      ``rules``), replicated without rules; needed when rules are given.
      None: the default device.
    **options: :class:`DecoderConfig` fields that say how the model runs
      (dtype, param_dtype, implementation, context_parallel, rules,
      param_rules, remat, remat_skip, scan_layers). ``param_dtype`` and
      ``dtype`` default to the checkpoint's own dtype, as transformers
      loads it (``dtype="auto"``): ``config.json``'s ``dtype``
      (``torch_dtype`` in older files), else the stored tensors'; a
      bfloat16 checkpoint loads, and computes, in bfloat16. Training
      that keeps float32 master weights asks for
      ``param_dtype=jnp.float32``.

  Returns:
    The model, its config keeping ``config.json`` (``cfg.hf_config``); call
    it under ``jax.set_mesh(mesh)`` when sharded. The config is read with
    transformers' precedence; a tied config whose checkpoint holds an
    ``lm_head.weight`` unlike the embedding loads untied, as transformers
    loads it.

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
  hf = hf_config.read_json(path / CONFIG)
  try:
    fields = hf_config.fields_from_hf(hf)
  except ValueError as e:
    raise ValueError(f"{path / CONFIG}: {e}") from e
  if options.get("rules") and mesh is None:
    raise ValueError("load_pretrained: rules are given, so a mesh is needed "
                     "to place the weights (mesh=...)")
  with contextlib.ExitStack() as stack:
    files = _locate(path, stack)
    stored = _stored_dtype(path, hf, files)
    options = dict(param_dtype=stored, dtype=stored) | options
    cfg = DecoderConfig(**fields, hf_config=json.dumps(hf), **options)
    if cfg.tie_word_embeddings and _differ(files, "lm_head.weight",
                                           "model.embed_tokens.weight"):
      # As transformers: a tied config whose checkpoint holds another
      # output layer is not tied; that layer is the model's.
      cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
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


def _place(cfg: DecoderConfig, tensors: list[Tensor], files: dict, mesh):
  """The model, each tensor read from its file and put where it goes."""
  build = lambda: Decoder(cfg, rngs=nnx.Rngs(0))
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


def gather_to_host(x) -> np.ndarray:
  """The whole array on this host (gathered across processes)."""
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def new_file_mode() -> int:
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


def save_pretrained(model: Decoder, path, *, dtype=None,
                    max_shard_bytes: int = 2 * 2**30,
                    extra_config: dict | None = None) -> pathlib.Path:
  """Write ``model`` as a Hugging Face checkpoint transformers loads.

  Args:
    model: a :class:`Decoder` (sharded or not).
    path: the directory (created).
    dtype: the stored dtype (e.g. ``jnp.bfloat16``); default the weights'.
    max_shard_bytes: the largest ``*.safetensors`` file; more than one
      comes with ``model.safetensors.index.json``.
    extra_config: more ``config.json`` keys (e.g. ``bos_token_id``,
      ``eos_token_id``, ``pad_token_id``), over those of the loaded
      checkpoint; the architecture's own keys win, and keys that would
      make the file read back as another model are a ValueError.

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
  if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
    raise ValueError("save_pretrained: the model holds LoRA adapters, which a "
                     "plain checkpoint cannot: merge_lora(model) folds them "
                     "into the weights first, or save_adapter(model, path) "
                     "writes them in PEFT's format")
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  tensors = list(tensor_map(cfg))
  stored = np.dtype(dtype or _value(flat[tensors[0].key]).dtype)
  if stored.name not in _DTYPES:  # integers would store truncated weights
    raise ValueError(f"save_pretrained: dtype must be a float dtype, one of "
                     f"bfloat16, float16, float32 or float64; got "
                     f"{stored.name}")
  # Its errors come before any I/O.
  hf = hf_config.config_to_save(cfg, extra_config, stored.name)
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
  mode = new_file_mode()
  weight_map, total = {}, 0
  for i, group in enumerate(files):
    name = ("model.safetensors" if len(files) == 1 else
            f"model-{i + 1:05d}-of-{len(files):05d}.safetensors")
    arrays = {}
    for t in group:
      x = gather_to_host(_value(flat[t.key]))
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
