"""Generate text from a local Hugging Face checkpoint with jax_ring, the KV
cache split along the sequence over ``--context`` devices.

  python examples/generate.py            # CPU: a tiny random Llama and the
                                         # fine-tuning demo's tokenizer,
                                         # made in a temporary directory
  python examples/generate.py --model runs/sft/final "Reverse the words: owl sun lamp"
                                         # examples/finetune.py's output
  python examples/generate.py --model DIR --prompts prompts.jsonl \\
      --context 4 --max-new-tokens 256   # a cache split over 4 devices
                                         # (simulated on a CPU)
  python examples/generate.py --model DIR --prompt-file book.txt \\
      --context 4                        # one long prompt from a text file

``--model`` is a directory as transformers saves it (config.json,
*.safetensors, tokenizer.json) of any family ``jax_ring.models`` loads.
Prompts come from the command line, from JSON lines ``{"prompt": "..."}``
(``--prompts``), or, whole, from one UTF-8 text file (``--prompt-file``,
for a long context); each is tokenized as ``examples/finetune.py``
tokenizes a prompt (the tokenizer's own prefix, then the text), and rows
stop at the checkpoint's EOS. With one prompt the text is printed as it is
generated (after the prompt, unless it came from ``--prompt-file``); with
several, each row's once all have ended. ``--temperature 0`` (the
default) is greedy; otherwise ``--top-k``/``--top-p`` sampling from
``--seed``. Nothing is written outside the temporary directory of the
default model, and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import run_dir

DEFAULT_PROMPT = "Reverse the words: owl sun lamp\n"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("prompt", nargs="*", help="prompts (default: one demo "
                 "prompt)")
  p.add_argument("--model", default=None, help="a local Hugging Face "
                 "checkpoint directory; default: a tiny random Llama")
  p.add_argument("--prompts", default=None, help='JSON lines of '
                 '{"prompt": "..."}')
  p.add_argument("--prompt-file", default=None, help="a UTF-8 text file, "
                 "the whole of it one prompt")
  p.add_argument("--max-new-tokens", type=run_dir.POSITIVE, default=32)
  p.add_argument("--temperature", type=run_dir.number(float, 0.0),
                 default=0.0, help="0: greedy")
  p.add_argument("--top-k", type=run_dir.POSITIVE, default=None)
  p.add_argument("--top-p", type=run_dir.number(float, 0.0, above=True,
                                                 high=1.0), default=1.0)
  p.add_argument("--seed", type=run_dir.number(int, 0, high=2**32 - 1),
                 default=0)
  p.add_argument("--context", type=run_dir.POSITIVE, default=1,
                 help="devices the KV cache's sequence is split over (a "
                 "data x context mesh takes the rest; it must divide the "
                 "devices); on a CPU, 8 are simulated (more if --context "
                 "is larger)")
  p.add_argument("--tokens-per-call", type=run_dir.POSITIVE, default=None,
                 help="decode steps run as one program (the host's cost of "
                 "a call paid once for them; tokens are shown that many at "
                 "a time); default: the library's, "
                 "jax_ring.models.generation.TOKENS_PER_CALL")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="default: bfloat16 on GPUs, float32 on a CPU")
  args = p.parse_args(argv)
  if sum(map(bool, (args.prompt, args.prompts, args.prompt_file))) > 1:
    p.error("give prompts on the command line, with --prompts or with "
            "--prompt-file: one of them")
  run_dir.check_inputs(p, args.model, prompts=args.prompts,
                       prompt_file=args.prompt_file)
  if args.temperature == 0 and (args.top_k is not None or args.top_p < 1):
    p.error("--top-k and --top-p shape sampling: they need --temperature "
            "> 0 (0 is greedy)")
  return args


def read_prompts(path) -> list[str]:
  """The ``prompt`` of each JSON line (blank lines skipped; a leading
  byte-order mark too, as finetune.py reads data); a line that is not such
  an object, or bytes that are not UTF-8, are an error naming the file."""
  out = []
  try:
    lines = pathlib.Path(path).read_text(encoding="utf-8-sig").splitlines()
  except UnicodeDecodeError as e:
    raise SystemExit(f"{path}: not UTF-8 text (byte {e.start}: "
                     f"{e.reason})") from None
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise SystemExit(f"{path}:{i}: not JSON ({e.msg})") from None
    if not (isinstance(record, dict) and isinstance(record.get("prompt"),
                                                    str)):
      raise SystemExit(f'{path}:{i}: expected {{"prompt": "..."}}')
    out.append(record["prompt"])
  if not out:
    raise SystemExit(f"{path}: no prompts")
  return out


def read_text(path) -> str:
  """The whole of a UTF-8 text file (a leading byte-order mark dropped); an
  empty file, or bytes that are not UTF-8, are an error naming it."""
  try:
    text = pathlib.Path(path).read_text(encoding="utf-8-sig")
  except UnicodeDecodeError as e:
    raise SystemExit(f"{path}: not UTF-8 text (byte {e.start}: "
                     f"{e.reason})") from None
  if not text.strip():
    raise SystemExit(f"{path}: no text")
  return text


def demo_model(directory: pathlib.Path) -> pathlib.Path:
  """A tiny random Llama and the fine-tuning demo's tokenizer, written to
  ``directory``."""
  import finetune
  args = argparse.Namespace(data=None, resume=False, examples=200, seed=0,
                            demo_model="tiny-llama")
  model_dir, _ = finetune.make_demo(directory, args)
  return model_dir


def main(argv=None):
  args = parse_args(argv)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax
  if args.context > 1:  # simulated on a CPU; ignored where GPUs are
    jax.config.update("jax_num_cpu_devices", max(8, args.context))
  generate(args)


def generate(args) -> list[str]:
  """Load, generate and print; returns each prompt's new text."""
  import jax
  import jax.numpy as jnp

  import finetune
  import jax_ring
  from jax_ring import models
  from jax_ring.models import generation as gen

  if args.prompt_file:
    texts = [read_text(args.prompt_file)]
  elif args.prompts:
    texts = read_prompts(args.prompts)
  else:
    texts = args.prompt or [DEFAULT_PROMPT]
  sampling = gen.Sampling(args.temperature, args.top_k, args.top_p)
  with tempfile.TemporaryDirectory() as tmp:
    if not args.model:  # say what the text comes from before any is shown
      print("no --model: a tiny Llama of random weights (untrained), so the "
            "text below is noise; give --model a fine-tuned run's final/ "
            "(examples/finetune.py) or a Hugging Face checkpoint",
            file=sys.stderr, flush=True)
    model_dir = pathlib.Path(args.model or demo_model(pathlib.Path(tmp)))
    encoder = finetune.Encoder(model_dir)
    prompts = [encoder.prefix + encoder.tok.encode(
        t, add_special_tokens=False).ids for t in texts]
    for i, ids in enumerate(prompts):
      encoder.check_ids(ids, f"prompt {i}")
    gpu = jax.default_backend() == "gpu"
    dtype = getattr(jnp, args.dtype or ("bfloat16" if gpu else "float32"))
    devices = len(jax.devices())
    if devices % args.context:
      raise SystemExit(f"--context {args.context} does not divide the "
                       f"{devices} devices")
    mesh = jax.make_mesh((devices // args.context, args.context),
                         ("data", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    options = {} if args.context == 1 else dict(
        context_parallel=jax_ring.ContextParallel(axis="context",
                                                  inputs="load_balanced"),
        rules=models.model_rules(data=None))
    per_call = args.tokens_per_call or gen.TOKENS_PER_CALL
    with jax.set_mesh(mesh):
      model = models.load_pretrained(model_dir, mesh=mesh, dtype=dtype,
                                     **options)
      # A prompt from a file may be a book: it is not echoed.
      stream = Stream(encoder, prompts, texts, echo=not args.prompt_file,
                      per_call=per_call)
      out = gen.generate(model, prompts, max_new_tokens=args.max_new_tokens,
                         sampling=sampling, seed=args.seed,
                         stop_tokens=[encoder.eos] if encoder.eos is not None
                         else [], on_tokens=stream,
                         tokens_per_call=per_call)
    stream.finish(out)
  return [stream.text(row) for row in range(len(out))]


class Stream:
  """Prints the generated text: one prompt's token by token, several
  prompts' at the end; then, on stderr, the time to the first token
  (prefill, compiles included) and the mean time a token after the first
  decode call (``per_call`` tokens; it holds the step's compile); a last
  call cut short by a stop or by ``--max-new-tokens`` counts its whole
  time for the tokens shown."""

  def __init__(self, encoder, prompts, texts, echo=True, per_call=1):
    self.per_call = per_call
    self.encoder, self.texts, self.echo = encoder, texts, echo
    self.ids = [[] for _ in prompts]
    self.prompt_tokens = sum(map(len, prompts))
    self.done = [False] * len(prompts)
    self.shown = ""
    self.times = [time.perf_counter()]  # the start, then each step's tokens

  def __call__(self, step, tokens):
    self.times.append(time.perf_counter())
    for row, token in enumerate(tokens):
      if self.done[row]:
        continue
      self.ids[row].append(int(token))
      self.done[row] = int(token) == self.encoder.eos
    if len(self.ids) == 1:
      if step == 0 and self.echo:
        print(self.texts[0], end="", flush=True)
      text = self.text(0)
      print(text[len(self.shown):], end="", flush=True)
      self.shown = text

  def text(self, row):
    return self.encoder.tok.decode(self.ids[row], skip_special_tokens=True)

  def finish(self, out):
    if len(out) == 1:
      print()
    else:
      for row, text in enumerate(self.texts):
        print(f"--- {row}: {text!r}\n{self.text(row)}")
    # The first decode call's tokens hold the step's compile.
    after = self.times[1 + self.per_call:]
    decode = (f"; {len(after) - 1} more tokens, "
              f"{(after[-1] - after[0]) / (len(after) - 1) * 1e3:.1f} ms a "
              f"token (mean)" if len(after) > 1 else "")
    print(f"first token after {self.times[1] - self.times[0]:.2f} s (prefill "
          f"of {self.prompt_tokens:,} tokens, compiles included){decode}",
          file=sys.stderr)


if __name__ == "__main__":
  main()
