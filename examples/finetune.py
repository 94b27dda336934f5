"""Supervised fine-tuning (SFT) of a local Hugging Face checkpoint at long
context with jax_ring.

Examples (a prompt and its response, or a chat) are tokenized with the
checkpoint's own ``tokenizer.json`` and packed into rows of ``--seq``
tokens; the loss is on the responses only. The sequence is split over
``--context`` devices (ring attention by default); the other devices split
the batch, and weights and optimizer state are FSDP-sharded over all of
them. Nothing is ever downloaded.

  python examples/finetune.py            # CPU: 8 simulated devices, data=2 x
                                         # context=4; makes a tiny random
                                         # Llama, its tokenizer and a toy
                                         # dataset in the run directory;
                                         # about a minute on 2 cores, then
                                         # its answer before and after
  python examples/finetune.py --run-dir runs/sft --resume
                                         # continue from the last checkpoint
  python examples/finetune.py --model /path/to/Llama-3.2-1B --data my.jsonl \\
      --seq 65536 --context 2            # GPUs: bfloat16 (cuDNN), remat
  python examples/finetune.py --lora 16 --model /path/to/Llama-3.1-8B \\
      --data my.jsonl --seq 65536        # LoRA (rank 16, every linear layer)
                                         # on one GPU: writes adapter/ too
  python examples/finetune.py --model /path/to/gemma-3-1b-it --data my.jsonl \\
      --seq 32768 --context 2 --vocab-chunk 32768
                                         # 32k-token rows over 2 GPUs; the
                                         # 262k vocabulary's logits a chunk
                                         # at a time
  python examples/finetune.py --demo-model qwen3-1.7b --seq 32768 \\
      --context 2 --vocab-chunk 32768    # the demo on random weights in
                                         # Qwen3-1.7B's shapes (or
                                         # gemma3-1b's, llama3.2-1b's)

``--model`` is a local checkpoint directory as transformers saves it
(config.json, *.safetensors, tokenizer.json) of a Llama, Qwen2, Mistral,
Qwen3, Gemma 2 or Gemma 3 text model; ``--seq`` is the sequence length,
the tokens of a packed row, split over ``--context`` devices.

Data (``--data``): JSON lines, each one example, either

  {"prompt": "...", "response": "..."}       loss on the response
  {"messages": [{"role": "user", "content": "..."},
                {"role": "assistant", "content": "..."}, ...]}
                                             loss on the assistant turns

An example is ``[prefix] prompt response EOS``. The prefix is what the
tokenizer itself puts before a text (Llama's BOS; nothing for Qwen). EOS is
``eos_token_id`` of config.json, else ``eos_token`` of
tokenizer_config.json; without either, a newline ends a response or a turn.
Prompt and response are tokenized apart, so the loss starts exactly at the
response; write your model's own template into the prompt to use it. A
chat is rendered Zephyr-style, each turn ``<|role|>\\n`` content EOS, with
the loss on the assistant's content and its EOS (the model learns to stop).
Examples longer than ``--seq`` keep their first ``--seq`` tokens (and are
dropped if no response token is left). Rows are packed greedily in a
shuffled order: segment ids 1, 2, ... per example, 0 for padding;
positions restart per example.

The data is checked as it is read, each error naming ``file:line``: UTF-8
only (a UTF-8 byte-order mark opening the file is accepted and skipped; one
on a later line is refused), one JSON object per line (blank lines
skipped), string prompts, responses, roles and contents. Every token id,
the EOS and the tokenizer's prefix included, must be below the model's
``vocab_size`` (config.json): a tokenizer from a larger model is refused,
naming the id and where it came from (``file:line``, or e.g.
``eos_token_id of config.json``).

The demo's data: "Reverse the words: ..." prompt/response records and
"Sort: ..." chats (some of two turns) over 32 words; its model: a 0.15M
parameter Llama (hidden 64, 2 layers, 4 query / 2 kv heads of 16) with a
byte-level BPE tokenizer trained on that data. ``--demo-model`` gives the
demo random weights in the shapes of a published checkpoint instead (its
``config.json`` as released, its vocabulary, saved in bfloat16), with the
same tokenizer and data: the model's cost without downloading it.

Written to ``--run-dir`` (default: a new directory per run, printed at
start): checkpoints/ (orbax, in the background, with checksums verified on
``--resume``), losses.json, loss_curve.png (with matplotlib), and final/:
the fine-tuned model as a Hugging Face checkpoint (safetensors) with the
tokenizer files, which ``transformers.AutoModelForCausalLM.from_pretrained``
reads; for the demo, also base_model/ and demo.jsonl. A fresh run refuses
a directory that holds any of these (``--resume`` continues that run,
``--overwrite`` deletes them first; see ``run_dir.py``). A NaN or infinite
loss or weight stops training with an error naming the step: final/ is
written only from a finished run's finite weights.

With ``--lora RANK`` the base weights stay frozen in the checkpoint's
dtype (bfloat16 on GPUs) and only adapters train (float32, Adam state for
them alone); adapter/ holds them in PEFT's format
(``peft.PeftModel.from_pretrained(base, "adapter")`` loads it), and final/
is the base with the adapters merged in.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import pathlib
import random
import shutil

import run_dir  # first: it names a missing dependency
import checkpoints
import train_lm
from sft_data import Encoder, SFTData, pack, pieces, read_records

# The defaults of the demo (no --model) and of a real checkpoint.
# 600 steps: the tiny model then reverses a prompt's words (150 did not).
DEMO = dict(seq=512, batch_per_data=2, steps=600, lr=3e-3, lora_lr=1e-2,
            examples=2000)
# The demo's sample prompt, greedy before and after training.
DEMO_PROMPT = "Reverse the words: owl sun lamp\n"
# steps: one epoch
MODEL = dict(seq=4096, batch_per_data=1, steps=None, lr=2e-5, lora_lr=2e-4)
# Files next to the weights that travel to final/ unchanged.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")


# The demo's random models: None, the tiny Llama sized to the demo's
# tokenizer; else a released checkpoint's config.json (as published,
# transformers 4's spelling), whose shapes the random weights take.
DEMO_MODELS = {
    "tiny-llama": None,
    "llama3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"],
        vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=500_000.0, rope_scaling=dict(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, attention_dropout=0.0),
    "llama3.1-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"],
        vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=500_000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, attention_dropout=0.0),
    "qwen3-1.7b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"],
        vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, rope_scaling=None,
        max_position_embeddings=40960, max_window_layers=28,
        use_sliding_window=False, sliding_window=None,
        tie_word_embeddings=True, attention_bias=False,
        attention_dropout=0.0),
    "gemma3-1b": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
        vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling=None, sliding_window=512, sliding_window_pattern=6,
        max_position_embeddings=32768, attn_logit_softcapping=None,
        final_logit_softcapping=None, tie_word_embeddings=True,
        attention_bias=False, attention_dropout=0.0),
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None, help="a local Hugging Face "
                 "checkpoint directory (config.json, *.safetensors, "
                 "tokenizer.json) of a Llama, Qwen2, Mistral, Qwen3, Gemma 2 "
                 "or Gemma 3 text model (model_type llama, qwen2, mistral, "
                 "qwen3, gemma2, gemma3_text); default: the demo's random "
                 "model, made in --run-dir")
  p.add_argument("--demo-model", default="tiny-llama",
                 choices=list(DEMO_MODELS), help="the demo's random model "
                 "(without --model): a tiny Llama, or the shapes of a "
                 "released checkpoint (default: %(default)s)")
  p.add_argument("--data", default=None, help="JSON lines of examples; "
                 "default: a toy dataset made in --run-dir")
  p.add_argument("--context", type=run_dir.POSITIVE, default=None,
                 help="context-parallel degree; the other devices form "
                 "the data axis (default 4 on 8 devices, else all devices)")
  strategies = tuple(s for s in train_lm.field_choices("strategy")
                     if s != "hybrid")
  p.add_argument("--strategy", default="ring", choices=strategies)
  p.add_argument("--seq", type=run_dir.POSITIVE, default=None,
                 help="the sequence length: tokens per packed row, split "
                 "over --context devices (a multiple of 2 x --context; "
                 "default 512 for the demo, 4096 with --model)")
  p.add_argument("--batch", type=run_dir.POSITIVE, default=None,
                 help="rows per step")
  p.add_argument("--steps", type=run_dir.POSITIVE, default=None,
                 help="default: 150 for the demo, one epoch of --data else")
  p.add_argument("--lr", type=run_dir.POSITIVE_FLOAT, default=None,
                 help="peak learning rate")
  p.add_argument("--warmup", type=run_dir.NON_NEGATIVE, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--examples", type=run_dir.POSITIVE, default=DEMO["examples"],
                 help="size of the demo dataset")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="compute dtype; default bfloat16 on GPU, else float32 "
                 "(weights and Adam stay float32)")
  p.add_argument("--save-dtype", choices=["float32", "bfloat16"],
                 default=None, help="of final/; default the checkpoint's")
  p.add_argument("--implementation", choices=["xla", "cudnn"], default=None)
  p.add_argument("--remat", choices=["none", "block", "attention",
                                     "attention_residual"],
                 default=None, help="what the backward recomputes: nothing, "
                 "each block, each block but its attention, or also not its "
                 "output projection (default: attention on GPUs, none on "
                 "CPUs; see DecoderConfig.remat)")
  p.add_argument("--remat-skip", type=run_dir.NON_NEGATIVE, default=0,
                 metavar="N",
                 help="the last N blocks keep their activations (no remat): "
                 "memory left free at this length spent on less recompute "
                 "(DecoderConfig.remat_skip)")
  p.add_argument("--vocab-chunk", type=run_dir.POSITIVE, default=None,
                 help="the loss takes the vocabulary this many entries at a "
                 "time, so the float32 logits are never whole (default: "
                 "whole)")
  p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction,
                 default=True,
                 help="run the blocks as one lax.scan, so the step compiles "
                 "one group of layers, over a stacked copy of their trained "
                 "weights (with --lora and a remat, the frozen base is not "
                 "copied; DecoderConfig.scan_layers; --no-scan-layers: "
                 "unrolled)")
  p.add_argument("--lora", type=run_dir.POSITIVE, default=None,
                 metavar="RANK", help="train LoRA adapters of this rank on "
                 "every linear layer instead of every weight: the base stays "
                 "frozen (bfloat16 on GPUs), gradients and Adam state are the "
                 "adapters' alone; writes adapter/ (PEFT's format) and final/ "
                 "(the adapters merged in)")
  p.add_argument("--lora-alpha", type=run_dir.POSITIVE_FLOAT, default=None,
                 help="LoRA's alpha (the adapters' scale is alpha / RANK; "
                 "default 2 x RANK)")
  p.add_argument("--lora-dropout", type=float, default=0.0,
                 help="dropout on the adapters' inputs (default 0)")
  run_dir.add_flags(p, "finetune")
  train_lm.add_process_flags(p)
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  args = p.parse_args(argv)
  run_dir.check_flags(p, args)
  if args.model and not args.data:
    p.error("--model needs --data (JSON lines; see --help)")
  run_dir.check_inputs(p, args.model, data=args.data)
  if args.model and args.demo_model != "tiny-llama":
    p.error("--demo-model makes the demo's model; --model names yours: "
            "pass one of them")
  if args.lora is None and (args.lora_alpha is not None
                            or args.lora_dropout):
    p.error("--lora-alpha and --lora-dropout need --lora RANK")
  if not 0.0 <= args.lora_dropout < 1.0:
    p.error(f"--lora-dropout must be in [0, 1); got {args.lora_dropout}")
  defaults = MODEL if args.model else DEMO
  if args.lora and args.lr is None:
    args.lr = defaults["lora_lr"]
  for name in ("seq", "lr"):
    if getattr(args, name) is None:
      setattr(args, name, defaults[name])
  if args.steps is None:
    args.steps = defaults["steps"]  # None with --model: set from the data
  return args


# --------------------------------------------------------------------------
# The demo: a toy task, a byte-level BPE tokenizer and a random Llama.

WORDS = ("red blue green gold fox dog cat owl fish bird tree leaf river lake "
         "stone sand cloud rain snow wind fire ice sun moon star sky road "
         "door book lamp ship bell").split()
SPECIAL = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")


def demo_records(n: int, seed: int) -> list[dict]:
  """Reverse a list of words (prompt/response records) or sort it (chats,
  some two turns long, so that a user turn sits between two losses)."""
  rng = random.Random(seed)
  words = lambda: rng.sample(WORDS, rng.randint(3, 8))
  out = []
  for i in range(n):
    if i % 2 == 0:
      w = words()
      out.append({"prompt": f"Reverse the words: {' '.join(w)}\n",
                  "response": f"Reversed: {' '.join(w[::-1])}"})
      continue
    chat = [{"role": "system", "content": "You sort words."}]
    for _ in range(rng.randint(1, 2)):
      w = words()
      chat += [{"role": "user", "content": f"Sort: {' '.join(w)}"},
               {"role": "assistant",
                "content": f"Sorted: {' '.join(sorted(w))}"}]
    out.append({"messages": chat})
  return out


def train_tokenizer(texts, vocab_size: int = 512):
  """A byte-level BPE (GPT-2's, Llama 3's kind: any text encodes) trained in
  memory on ``texts``; its first special token is the EOS."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def make_demo(run: pathlib.Path, args) -> tuple[pathlib.Path, str]:
  """Write the demo's data (unless --data) and checkpoint in the run
  directory ``run``; a resumed run keeps the ones it started with. Returns
  (model dir, data file)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jax_ring import models
  base, data = run / "base_model", args.data or run / "demo.jsonl"
  if args.resume:  # a resumed run writes nothing before its checks
    missing = [str(p) for p in (base / "config.json", pathlib.Path(data))
               if not p.exists()]
    if missing:
      raise SystemExit(f"--resume: {run} is not a run of the demo's model "
                       f"with this data ({', '.join(missing)} absent); pass "
                       "the --model and --data the run started with")
    return base, str(data)
  if jax.process_index() == 0:
    run.mkdir(parents=True, exist_ok=True)
    if not args.data:
      with open(data, "w") as f:
        for r in demo_records(args.examples, args.seed):
          f.write(json.dumps(r) + "\n")
  run_dir.sync("demo data")
  texts = ["".join(t for t, _, _ in pieces(r)) for r in read_records(data)[0]]
  tok = train_tokenizer(texts)
  shapes = DEMO_MODELS[args.demo_model]
  if shapes is None:
    cfg = models.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64,
        intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16)
  else:  # the released vocabulary holds the demo tokenizer's ids; made
    # in bfloat16, the dtype it is saved in
    cfg = models.config_from_hf(shapes, param_dtype=jnp.bfloat16)
  models.save_pretrained(models.Decoder(cfg, rngs=nnx.Rngs(args.seed)), base,
                         dtype=None if shapes is None else jnp.bfloat16)
  if jax.process_index() == 0:
    tok.save(str(base / "tokenizer.json"))
    eos = SPECIAL[0]
    hf = json.loads((base / "config.json").read_text())
    hf["eos_token_id"] = tok.token_to_id(eos)
    (base / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (base / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token=eos,
        pad_token=eos), indent=2) + "\n")
  run_dir.sync("demo checkpoint")
  return base, str(data)


# --------------------------------------------------------------------------
# Model, step, loop.


def layout(args) -> tuple[dict[str, int], int]:
  """The mesh shape ``{"data": D, "context": C}`` and the rows per step."""
  import jax
  n = jax.device_count()
  context = args.context or (4 if n == 8 else n)
  if context < 1 or n % context:
    raise SystemExit(f"--context {context} does not divide the {n} devices")
  if args.seq % (2 * context):
    raise SystemExit(f"--seq {args.seq} must be a multiple of 2 x --context "
                     f"= {2 * context} (the dual-chunk layout)")
  shape = {"data": n // context, "context": context}
  defaults = MODEL if args.model else DEMO
  batch = args.batch or defaults["batch_per_data"] * shape["data"]
  if batch % shape["data"]:
    raise SystemExit(f"--batch {batch} must be divisible by the data axis "
                     f"size {shape['data']}")
  return shape, batch


def build(args, model_dir, shape: dict[str, int]):
  """The mesh, the model loaded onto it, its train state and jitted step."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import jax_ring
  from jax_ring import flax as jrf
  from jax_ring import models

  mesh = jax.make_mesh(tuple(shape.values()), tuple(shape),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  gpu = jax.default_backend() == "gpu"
  # Batches are put in the layout once (prepare_lm_batch), not per layer.
  cpc = (jax_ring.ContextParallel(axis="context", strategy=args.strategy,
                                  inputs="load_balanced")
         if shape["context"] > 1 else None)
  rules = models.model_rules(data="data", context="context")
  fsdp = tuple(a for a in shape if shape[a] > 1)
  remat = args.remat or ("attention" if gpu else "none")
  # Full fine-tuning keeps float32 master weights; LoRA's frozen base stays
  # in the checkpoint's dtype, cast to bfloat16 on GPUs (add_lora).
  model = models.load_pretrained(
      model_dir, mesh=mesh,
      dtype=jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32")),
      param_dtype=None if args.lora else jnp.float32,
      implementation=args.implementation,
      context_parallel=cpc, rules=rules,
      param_rules=jrf.fsdp_rules(rules, fsdp) if fsdp else None,
      remat={"none": False, "block": True}.get(remat, remat),
      remat_skip=args.remat_skip, scan_layers=args.scan_layers)
  trainable = None
  if args.lora:
    with jax.set_mesh(mesh):
      models.add_lora(
          model, rank=args.lora, alpha=args.lora_alpha or 2.0 * args.lora,
          dropout=args.lora_dropout, base_dtype=jnp.bfloat16 if gpu else None,
          rngs=nnx.Rngs(params=args.seed, dropout=args.seed + 1))
    trainable = nnx.LoRAParam
  tx = train_lm.make_optimizer(args.lr, args.warmup, args.steps)
  state, train_step, graphdef = train_lm.make_train_step(
      model, tx, functools.partial(models.lm_loss,
                                   vocab_chunk=args.vocab_chunk), mesh,
      trainable=trainable)
  return dict(mesh=mesh, cfg=model.cfg, state=state, train_step=train_step,
              graphdef=graphdef)


def _sha256(path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def outputs(args) -> tuple[str, ...]:
  """What a run writes in its run directory (see run_dir.py)."""
  return train_lm.OUTPUTS + ("final",) + (("adapter",) if args.lora else ()) + (
      () if args.model else ("base_model",) + (
          () if args.data else ("demo.jsonl",)))


def train(args) -> dict:
  """Fine-tune (or resume); returns train_lm.train_loop's result plus the
  data, the model directory, final/ (None if stopped early) and the
  model's graphdef (``train_lm.model_of(graphdef, state)``)."""
  import jax

  from jax_ring import flax as jrf
  from jax_ring import models

  run = run_dir.prepare(args, "finetune", outputs(args),
                        inputs=(args.model, args.data))
  shape, batch = layout(args)  # the flags' checks, before any write
  model_dir, data_path = ((pathlib.Path(args.model), args.data)
                          if args.model else make_demo(run, args))
  encoder = Encoder(model_dir)
  records, where = read_records(data_path)
  data = SFTData(encoder(records, where), args.seq, args.seed)
  # The sample printed before and after training: the first prompt.
  prompt = DEMO_PROMPT if not (args.model or args.data) else next(
      (r["prompt"] for r in records if "prompt" in r), None)
  del records, where
  if args.steps is None:  # one epoch
    args.steps = max(1, len(data.rows(0)) // batch)
  built = build(args, model_dir, shape)
  mesh, cfg = built["mesh"], built["cfg"]

  def batch_at(step):
    tokens, seg, targets = data.batch(step, batch)
    return jrf.prepare_lm_batch(tokens, seg, mesh=mesh,
                                spec=jax.P("data", "context"),
                                context_parallel=cfg.context_parallel,
                                targets=targets)

  def banner(start):
    epochs = args.steps * batch / len(data.rows(0))
    return (f"jax_ring finetune: {model_dir} ({cfg.num_params() / 1e6:.2f}M "
            f"params), {len(data.examples)} examples from {data_path} "
            f"({data.truncated} truncated to --seq, {data.dropped} dropped: "
            f"no response left)\n  {len(data.rows(0))} rows of {args.seq} "
            f"tokens per epoch, {data.fill():.0%} filled; {args.steps} steps "
            f"of {batch} rows = {epochs:.1f} epochs\n"
            f"  mesh {dict(mesh.shape)} on {jax.device_count()} "
            f"{jax.devices()[0].platform} devices, strategy {args.strategy}, "
            f"{cfg.dtype.name}" + (f", remat {cfg.remat}" if cfg.remat
                                   else "")
            + (f", resuming at step {start}" if start else ""))

  record = dict(model=str(model_dir), data_sha256=_sha256(data_path),
                tokenizer_sha256=_sha256(encoder.path), seq=args.seq,
                batch=batch, steps=args.steps, lr=args.lr,
                warmup=args.warmup, seed=args.seed, dtype=str(cfg.dtype),
                # the demo's own flags (a resumed demo keeps its files)
                demo_model=None if args.model else args.demo_model,
                lora=args.lora and dict(rank=args.lora, alpha=args.lora_alpha,
                                        dropout=args.lora_dropout),
                examples=None if args.model or args.data else args.examples)
  # Every process samples (the programs span them all); one prints.
  show = prompt is not None and not args.quiet
  if show:  # the weights before the loop, which donates them
    before = sample(train_lm.model_of(built["graphdef"], built["state"]),
                    mesh, encoder, prompt)
  result = train_lm.train_loop(
      args, mesh=mesh, state=built["state"], train_step=built["train_step"],
      record=record, batch_at=batch_at,
      tokens_per_step=batch * args.seq, banner=banner)
  if show:
    after = sample(train_lm.model_of(built["graphdef"], result["state"]),
                   mesh, encoder, prompt)
    if jax.process_index() == 0:
      print(f"sample (greedy): {prompt!r}\n  before training: {before!r}"
            f"\n  after training:  {after!r}")
  final = None
  if len(result["losses"]) == args.steps:  # not when stopped early
    final = run / "final"
    model = train_lm.model_of(built["graphdef"], result["state"])
    if args.lora:
      adapter = run / "adapter"
      if jax.process_index() == 0 and adapter.exists():
        shutil.rmtree(adapter)
      run_dir.sync("adapter cleared")
      models.save_adapter(model, adapter,
                          base_model_name_or_path=str(model_dir))
      models.merge_lora(model)
    save_final(model, model_dir, final, args.save_dtype)
  return dict(result, data=data, model_dir=model_dir, final=final,
              graphdef=built["graphdef"])


def sample(model, mesh, encoder, prompt: str, max_new_tokens: int = 24
           ) -> str:
  """``model``'s greedy continuation of ``prompt`` (tokenized as the data
  is, up to EOS), as text."""
  import jax

  from jax_ring.models import generation
  model.eval()  # LoRA dropout off (on this copy of the model)
  ids = encoder.prefix + encoder.tok.encode(prompt,
                                            add_special_tokens=False).ids
  with jax.set_mesh(mesh):
    new, = generation.generate(
        model, [ids], max_new_tokens=max_new_tokens,
        stop_tokens=[] if encoder.eos is None else [encoder.eos])
  return encoder.tok.decode(new, skip_special_tokens=True)


def save_final(model, model_dir: pathlib.Path, final: pathlib.Path,
               save_dtype: str | None):
  """``model`` as a Hugging Face checkpoint in ``final``, in the base
  checkpoint's dtype unless ``save_dtype``, with the base's tokenizer files
  and the config.json keys this library does not write (token ids, ...).

  Raises:
    SystemExit: a weight that is NaN or infinite in that dtype, naming it;
      nothing is written then (an existing ``final`` is left as it is).
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jax_ring import models
  base = json.loads((model_dir / "config.json").read_text())
  dtype = save_dtype or base.get("torch_dtype") or base.get("dtype")
  dtype = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(
      dtype, jnp.float32)
  weights = jax.tree.map(lambda x: x.astype(dtype),
                         nnx.state(model, nnx.Param))
  bad = [a for a in checkpoints.fingerprint(weights) if a["nonfinite"]]
  if bad:
    raise SystemExit(
        f"{final} not written: {bad[0]['path']} has {bad[0]['nonfinite']} "
        f"non-finite entries in {jnp.dtype(dtype).name}"
        + (f" ({len(bad) - 1} more weights too)" if len(bad) > 1 else ""))
  if jax.process_index() == 0 and final.exists():
    shutil.rmtree(final)
  run_dir.sync("final cleared")
  models.save_pretrained(model, final, dtype=dtype, extra_config={
      k: v for k, v in base.items() if k not in ("torch_dtype", "dtype")})
  if jax.process_index() == 0:
    for name in TOKENIZER_FILES:
      if (model_dir / name).exists():
        shutil.copy(model_dir / name, final / name)


def main(argv=None):
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as train_lm.main
  process_flags = argparse.ArgumentParser(add_help=False)
  train_lm.add_process_flags(process_flags)
  train_lm.setup_jax(process_flags.parse_known_args(argv)[0])
  args = parse_args(argv)
  result = train(args)
  import jax
  if jax.process_index() == 0:
    train_lm.report(result, args, unit="nats/token", title=(
        f"finetune {result['model_dir'].name}, seq {args.seq}, "
        f"{args.strategy}"))
    run, done = pathlib.Path(args.run_dir), len(result["losses"])
    print(f"\nin {run}:\n  checkpoints/  orbax, the last after step {done}"
          f"\n  losses.json" + ("\n  loss_curve.png"
                                if (run / "loss_curve.png").exists() else ""))
    if result["final"] is None:
      print(f"  final/        not written: stopped after step {done} of "
            f"{args.steps} (--resume continues)")
    else:
      if args.lora:
        print(f"  adapter/      the LoRA adapters, PEFT's format: {run}/adapter")
      print(f"  final/        the fine-tuned model, Hugging Face safetensors "
            f"with the tokenizer: {result['final']}")

if __name__ == "__main__":
  main()
