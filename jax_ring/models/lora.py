"""LoRA fine-tuning of a :class:`~jax_ring.models.decoder.Decoder`, in the
format PEFT reads and writes.

* :func:`add_lora` puts an adapter (``jax_ring.flax.lora.LoRA``) on the
  named Hugging Face modules of every layer; train ``nnx.LoRAParam``
  alone (``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``,
  ``nnx.DiffState(0, nnx.LoRAParam)``), so that gradients and optimizer
  state exist for the adapters only.
* :func:`save_adapter` writes PEFT's ``adapter_config.json`` and
  ``adapter_model.safetensors``; :func:`load_adapter` reads them (PEFT's
  own included), adding the adapters the file holds.
* :func:`merge_lora` folds the adapters into the weights, after which
  ``save_pretrained`` writes a plain checkpoint.

PEFT's names and shapes, for layer ``i`` and module ``m`` (its weight
``W`` is ``(out_features, in_features)``; ours is ``in + out``, see
``jax_ring.models.decoder``)::

  base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight
  base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_A.weight
      lora_A (r, in_features)  = a.reshape(in_features, r).T
      lora_B (out_features, r) = b.reshape(r, out_features).T

Supported ``adapter_config.json``: ``peft_type`` LORA, ``bias`` none, no
DoRA, no ``modules_to_save``, ``rank_pattern``/``alpha_pattern`` empty,
``fan_in_fan_out`` false; which layers and modules carry an adapter is
read from the tensors themselves (so ``target_modules`` as a list, a
regular expression or ``"all-linear"``, and ``layers_to_transform``, all
load). Anything else is a ``ValueError`` naming the key.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ring.flax.lora import LoRA, suffix
from jax_ring.models import hf_config
from jax_ring.models.decoder import Decoder
from jax_ring.models.hf_checkpoint import gather_to_host, new_file_mode

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# Hugging Face module name -> (the block's submodule, the weight).
MODULES = {
    "q_proj": ("attn", "wq"), "k_proj": ("attn", "wk"),
    "v_proj": ("attn", "wv"), "o_proj": ("attn", "wo"),
    "gate_proj": ("mlp", "w_gate"), "up_proj": ("mlp", "w_up"),
    "down_proj": ("mlp", "w_down"),
}
ALL_LINEAR = tuple(MODULES)
# Dims of each weight contracted with its input (the rest are its output).
_IN_DIMS = {"wo": 2}
_HF_PARENT = {"attn": "self_attn", "mlp": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?"
                  r"(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])\.weight$")


def _check_stackable(cfg, adapted: set, what: str) -> None:
  """A ValueError unless the (layer, module) pairs ``adapted`` are alike in
  the layers a scanned model stacks into one array (the j-th layer of each
  group of ``cfg.layer_period()``; see ``decoder._scan_blocks``)."""
  period, groups = cfg.layer_period(), cfg.scanned_groups()
  for j in range(period):
    stacked = [g * period + j for g in range(groups)]
    kinds = {frozenset(m for i, m in adapted if i == layer)
             for layer in stacked}
    if len(kinds) > 1:
      raise ValueError(
          f"{what} differ across layers {stacked}, which the model stacks "
          "(scan_layers=True) and so must be adapted alike: build it with "
          "scan_layers=False")


def _weight(model: Decoder, layer: int, module: str):
  """(the submodule that holds ``module``'s weight, the weight's name)."""
  parent, name = MODULES[module]
  return getattr(model.layers[layer], parent), name


def _check_targets(targets) -> tuple[str, ...]:
  if isinstance(targets, str):
    targets = ALL_LINEAR if targets == "all-linear" else (targets,)
  targets = tuple(targets)
  unknown = sorted(set(targets) - set(MODULES))
  if unknown or not targets:
    raise ValueError(f"targets must name some of {list(MODULES)} (or be "
                     f"'all-linear'); got {list(targets)}")
  return targets


def _new_adapter(model: Decoder, layer: int, module: str, *, rank, alpha,
                 dropout, rslora, rngs) -> LoRA:
  owner, name = _weight(model, layer, module)
  w = getattr(owner, name)
  n = _IN_DIMS.get(name, 1)
  meta = w.get_metadata() if hasattr(w, "get_metadata") else {}
  axes, rules = meta.get("out_sharding"), meta.get("sharding_rules") or ()
  return LoRA(w.shape[:n], w.shape[n:], rank=rank, alpha=alpha,
              dropout=dropout, rslora=rslora, axes=axes, rules=rules,
              sharding=getattr(w.get_value(), "sharding", None), rngs=rngs)


def add_lora(model: Decoder, *, rank: int, alpha: float,
             dropout: float = 0.0,
             targets: Iterable[str] | str = ALL_LINEAR,
             rslora: bool = False, base_dtype=jnp.bfloat16,
             layers: Iterable[int] | None = None,
             rngs: nnx.Rngs) -> Decoder:
  """Add LoRA adapters to ``model`` in place (and return it).

  Args:
    model: a :class:`Decoder`, built or loaded under the mesh it runs on
      (each adapter is sharded like the dims of its weight).
    rank: r, a positive int.
    alpha: the scale's numerator: the term is ``x A B * alpha / r``.
    dropout: the rate on each adapter's input (PEFT's ``lora_dropout``),
      active until ``model.eval()``.
    targets: Hugging Face module names (``q_proj``, ``k_proj``, ``v_proj``,
      ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``), or
      ``"all-linear"`` (all seven, the default).
    rslora: scale by ``alpha / sqrt(r)`` (PEFT's ``use_rslora``).
    base_dtype: the dtype every other floating parameter is cast to (the
      frozen base: bfloat16 by default, halving its memory); None keeps
      them. Adapters are float32.
    layers: the layer indices to adapt (default all).
    rngs: ``nnx.Rngs`` with ``params`` (and ``dropout`` when
      ``dropout > 0``).

  A weight that already has an adapter is a ``ValueError``.
  """
  if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or (
      rank < 1):
    raise ValueError(f"add_lora: rank must be a positive int; got {rank!r}")
  for name, value in (("alpha", alpha), ("dropout", dropout)):
    if isinstance(value, bool) or not isinstance(value, (int, float,
                                                         np.number)):
      raise TypeError(f"add_lora: {name} must be a number; got {value!r}")
  if not 0.0 <= float(dropout) < 1.0:
    raise ValueError(f"add_lora: dropout must be in [0, 1); got {dropout!r}")
  targets = _check_targets(targets)
  layers = (range(model.cfg.num_layers) if layers is None else
            sorted(set(int(i) for i in layers)))
  if any(not 0 <= i < model.cfg.num_layers for i in layers):
    raise ValueError(f"add_lora: layers must be in [0, "
                     f"{model.cfg.num_layers}); got {list(layers)}")
  _check_stackable(model.cfg, {(i, m) for i in layers for m in targets},
                   "add_lora: layers")
  for i in layers:
    for module in targets:
      owner, name = _weight(model, i, module)
      if hasattr(owner, suffix(name)):
        raise ValueError(f"add_lora: layer {i}'s {module} already has an "
                         "adapter")
  if base_dtype is not None:
    _cast_base(model, base_dtype)
  for i in layers:
    for module in targets:
      owner, name = _weight(model, i, module)
      setattr(owner, suffix(name), _new_adapter(
          model, i, module, rank=int(rank), alpha=alpha, dropout=dropout,
          rslora=rslora, rngs=rngs))
  return model


def _cast_base(model: Decoder, dtype) -> None:
  """Every floating ``nnx.Param`` that is not an adapter, cast to
  ``dtype`` (keeping its sharding)."""
  for _, var in nnx.iter_graph(model):
    if (isinstance(var, nnx.Param) and not isinstance(var, nnx.LoRAParam)
        and jnp.issubdtype(var.dtype, jnp.floating)):
      var.set_value(var.get_value().astype(dtype))


def adapters(model: Decoder) -> dict[tuple[int, str], LoRA]:
  """``(layer, Hugging Face module name) -> its adapter``, for every
  adapter the model holds."""
  found = {}
  for i in range(model.cfg.num_layers):
    for module in MODULES:
      owner, name = _weight(model, i, module)
      adapter = getattr(owner, suffix(name), None)
      if adapter is not None:
        found[(i, module)] = adapter
  return found


def merge_lora(model: Decoder) -> Decoder:
  """Fold every adapter into its weight (``W + A B * scale``, computed in
  float32, stored in ``W``'s dtype) and remove the adapters, in place;
  returns ``model``. Afterwards ``save_pretrained`` writes a plain
  checkpoint that equals PEFT's ``merge_and_unload()``."""
  for (i, module), adapter in adapters(model).items():
    owner, name = _weight(model, i, module)
    w = getattr(owner, name)
    merged = w.get_value().astype(jnp.float32) + adapter.delta()
    w.set_value(merged.astype(w.dtype))
    delattr(owner, suffix(name))
  return model


def _hf_name(layer: int, module: str, which: str) -> str:
  parent = _HF_PARENT[MODULES[module][0]]
  return (f"base_model.model.model.layers.{layer}.{parent}.{module}."
          f"lora_{which}.weight")


def save_adapter(model: Decoder, path, *,
                 base_model_name_or_path: str | None = None) -> pathlib.Path:
  """Write the model's adapters as PEFT does: ``adapter_config.json`` and
  ``adapter_model.safetensors`` (float32) in the directory ``path``
  (created). All adapters must share one rank, alpha, dropout and scaling
  rule (as :func:`add_lora` makes them). Process 0 writes; every process
  must call it. Returns ``path``."""
  from safetensors.numpy import save_file
  found = adapters(model)
  if not found:
    raise ValueError("save_adapter: the model has no adapters (add_lora or "
                     "load_adapter first)")
  kinds = {(a.rank, a.alpha, a.rslora,
            0.0 if a.dropout is None else float(a.dropout.rate))
           for a in found.values()}
  if len(kinds) > 1:
    raise ValueError("save_adapter: PEFT's format holds one (rank, alpha, "
                     f"use_rslora, dropout); the adapters have {sorted(kinds)}")
  (rank, alpha, rslora, dropout), = kinds
  arrays = {}
  for (i, module), adapter in found.items():
    a, b = (gather_to_host(v.get_value()).astype(np.float32)
            for v in (adapter.a, adapter.b))
    arrays[_hf_name(i, module, "A")] = np.ascontiguousarray(
        a.reshape(-1, rank).T)
    arrays[_hf_name(i, module, "B")] = np.ascontiguousarray(
        b.reshape(rank, -1).T)
  layers = sorted({i for i, _ in found})
  config = dict(
      peft_type="LORA", task_type="CAUSAL_LM",
      base_model_name_or_path=base_model_name_or_path, r=rank,
      lora_alpha=alpha, lora_dropout=dropout, use_rslora=rslora,
      target_modules=sorted({m for _, m in found}), bias="none",
      fan_in_fan_out=False, use_dora=False, modules_to_save=None,
      layers_to_transform=(None if len(layers) == model.cfg.num_layers
                           else layers),
      rank_pattern={}, alpha_pattern={}, init_lora_weights=True,
      inference_mode=True)
  path = pathlib.Path(path)
  if jax.process_index() == 0:
    path.mkdir(parents=True, exist_ok=True)
    save_file(arrays, path / WEIGHTS, metadata={"format": "pt"})
    mode = new_file_mode()
    (path / WEIGHTS).chmod(mode)
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
  return path


# adapter_config.json keys whose other values change the model.
_MUST_BE = {"peft_type": ("LORA",), "bias": ("none",), "use_dora": (False,),
            "fan_in_fan_out": (False,), "modules_to_save": (None, []),
            "rank_pattern": ({}, None), "alpha_pattern": ({}, None)}


def load_adapter(model: Decoder, path, *, rngs: nnx.Rngs | None = None
                 ) -> Decoder:
  """Read the PEFT adapter in directory ``path`` into ``model``, in place
  (returns it): adds the adapters the file holds where the model has none
  (so that a base model loads any adapter; ``rngs`` seeds their dropout,
  default ``nnx.Rngs(0)``) and sets their values. Each tensor's shape is
  checked against the model before any is set; an unsupported
  configuration, an unknown tensor or a shape that does not fit is a
  ``ValueError`` naming the file and the key."""
  from safetensors.numpy import load_file
  path = pathlib.Path(path)
  config = hf_config.read_json(path / CONFIG)
  for key, allowed in _MUST_BE.items():
    if config.get(key, allowed[0]) not in allowed:
      raise ValueError(f"{path / CONFIG}: {key}={config[key]!r} is not "
                       f"supported (only {allowed[0]!r})")
  try:
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path / CONFIG}: needs int 'r' and number "
                     f"'lora_alpha' ({e})") from None
  rslora = bool(config.get("use_rslora", False))
  dropout = float(config.get("lora_dropout") or 0.0)
  file = path / WEIGHTS
  if not file.exists():
    raise ValueError(f"{path}: no {WEIGHTS}")
  tensors = load_file(file)
  found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
  for key, x in tensors.items():
    m = _KEY.match(key)
    if m is None or m.group(3) not in MODULES or (
        _HF_PARENT[MODULES[m.group(3)][0]] != m.group(2)):
      raise ValueError(f"{file}: {key} is not a LoRA tensor of a module "
                       f"jax_ring adapts ({list(MODULES)})")
    layer = int(m.group(1))
    if layer >= model.cfg.num_layers:
      raise ValueError(f"{file}: {key} is for layer {layer}; the model has "
                       f"{model.cfg.num_layers}")
    found.setdefault((layer, m.group(3)), {})[m.group(4)] = x
  planned = {}
  for (i, module), pair in sorted(found.items()):
    owner, name = _weight(model, i, module)
    w = getattr(owner, name)
    n = _IN_DIMS.get(name, 1)
    fan_in, fan_out = int(np.prod(w.shape[:n])), int(np.prod(w.shape[n:]))
    want = dict(A=(rank, fan_in), B=(fan_out, rank))
    for which in "AB":
      got = pair.get(which)
      if got is None or tuple(got.shape) != want[which]:
        raise ValueError(
            f"{file}: {_hf_name(i, module, which)} must be "
            f"{want[which]} (r={rank}); got "
            f"{None if got is None else tuple(got.shape)}")
    existing = getattr(owner, suffix(name), None)
    if existing is not None and existing.rank != rank:
      raise ValueError(f"{file}: rank {rank}, but layer {i}'s {module} "
                       f"already has an adapter of rank {existing.rank}")
    planned[(i, module)] = (pair["A"].T.reshape(w.shape[:n] + (rank,)),
                            pair["B"].T.reshape((rank,) + w.shape[n:]))
  _check_stackable(model.cfg, set(planned) | set(adapters(model)),
                   f"{file}: its adapters")
  rngs = nnx.Rngs(0) if rngs is None else rngs
  for (i, module), (a, b) in planned.items():
    owner, name = _weight(model, i, module)
    adapter = getattr(owner, suffix(name), None)
    if adapter is None:
      adapter = _new_adapter(model, i, module, rank=rank, alpha=alpha,
                             dropout=dropout, rslora=rslora, rngs=rngs)
      setattr(owner, suffix(name), adapter)
    adapter.alpha, adapter.rslora = alpha, rslora
    for var, x in ((adapter.a, a), (adapter.b, b)):
      old = var.get_value()
      var.set_value(jax.device_put(jnp.asarray(x, old.dtype), old.sharding))
  return model
