"""The data of examples/finetune.py: JSON-lines records -> ``(tokens,
targets)`` examples, tokenized with a checkpoint's own ``tokenizer.json`` ->
rows of packed documents. The formats, and what each check refuses:
finetune.py's docstring."""

from __future__ import annotations

import codecs
import json
import pathlib

import numpy as np


def read_records(path) -> tuple[list[dict], list[str]]:
  """The examples of a JSON-lines file and where each is (``path:line``).

  Raises:
    SystemExit: naming ``path:line``, for a line that is not UTF-8, starts
      with a byte-order mark (one opening the file is skipped), is not
      JSON, not a JSON object, lacks the keys of either kind of example, or
      holds a prompt, response, role or content that is not a string.
  """
  records, sources = [], []
  with open(path, "rb") as f:
    for i, raw in enumerate(f, 1):
      where = f"{path}:{i}"
      if i == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
      try:
        line = raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError as e:
        raise SystemExit(f"{where}: not UTF-8: byte 0x{raw[e.start]:02x} at "
                         f"column {e.start + 1}") from None
      if line.startswith("\ufeff"):
        raise SystemExit(f"{where}: a byte-order mark (U+FEFF) starts the "
                         "line; only the file's first line may carry one")
      if line.strip():
        records.append(_check_record(line, where))
        sources.append(where)
  if not records:
    raise SystemExit(f"{path}: no examples")
  return records, sources


def _check_record(line: str, where: str) -> dict:
  """One line's example, checked (see read_records)."""
  try:
    r = json.loads(line)
  except json.JSONDecodeError as e:
    raise SystemExit(f"{where}: not JSON: {e.msg} at column {e.colno}"
                     ) from None
  if not isinstance(r, dict):
    raise SystemExit(f"{where}: expected a JSON object, got "
                     f"{_json_type(r)}")
  if not ({"prompt", "response"} <= r.keys() or "messages" in r):
    raise SystemExit(f"{where}: expected prompt and response, or "
                     f"messages; got keys {sorted(r)}")
  if "messages" not in r:
    fields = [(k, r[k]) for k in ("prompt", "response")]
  elif not isinstance(r["messages"], list):
    raise SystemExit(f"{where}: messages must be a list, got "
                     f"{_json_type(r['messages'])}")
  else:
    fields = []
    for j, m in enumerate(r["messages"]):
      if not isinstance(m, dict) or not {"role", "content"} <= m.keys():
        raise SystemExit(f"{where}: every message needs a role and a "
                         f"content; messages[{j}] is {json.dumps(m)[:80]}")
      fields += [(f"messages[{j}].{k}", m[k]) for k in ("role", "content")]
  for name, value in fields:
    if not isinstance(value, str):
      raise SystemExit(f"{where}: {name} must be a string, got "
                       f"{_json_type(value)}")
  return r


def _json_type(value) -> str:
  """JSON's name for the type of a parsed value."""
  if isinstance(value, bool):
    return str(value).lower()
  return {dict: "an object", list: "an array", str: "a string",
          type(None): "null", int: "a number", float: "a number"}[type(value)]


def pieces(record: dict) -> list[tuple[str, bool, bool]]:
  """``(text, is target, ends a turn)`` pieces of a record, in order (the
  prefix and the EOS are tokens, not text, and not here)."""
  if "messages" not in record:
    return [(record["prompt"], False, False), (record["response"], True, True)]
  out = []
  for m in record["messages"]:
    out += [(f"<|{m['role']}|>\n", False, False),
            (m["content"], m["role"] == "assistant", True)]
  return out


class Encoder:
  """Records -> ``(tokens, targets)`` int32 / bool arrays, with the
  checkpoint's ``tokenizer.json`` (see the module docstring for the
  prefix and the EOS).

  Every id it yields lies in ``[0, vocab_size)``, the model's (config.json;
  unchecked where config.json has no ``vocab_size``): construction checks
  the prefix and the EOS, each call the examples' ids.

  Raises:
    SystemExit: an id out of the vocabulary, naming it, ``vocab_size`` and
      where it came from (``eos_token_id of config.json``, the example's
      ``file:line``, ...).
  """

  def __init__(self, model_dir):
    from tokenizers import Tokenizer
    model_dir = pathlib.Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.exists():
      raise SystemExit(f"{model_dir} has no tokenizer.json")
    try:
      self.path, self.tok = path, Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception
      raise SystemExit(f"{path}: not a tokenizer the tokenizers library "
                       f"reads ({str(e)[:200]})") from None
    self.config = model_dir / "config.json"
    try:
      hf = json.loads(self.config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # absent, not UTF-8, not JSON
      raise SystemExit(f"{self.config}: not a readable JSON file "
                       f"({str(e)[:200]})") from None
    self.vocab_size = hf.get("vocab_size")
    # The tokens the tokenizer's own post-processor adds before a text.
    plain = self.tok.encode("a", add_special_tokens=False).ids
    full = self.tok.encode("a", add_special_tokens=True).ids
    self.prefix = full[:full.index(plain[0])] if plain[0] in full else []
    self.check_ids(self.prefix, f"the prefix {path} adds to a text")
    self.eos, source = _eos_id(model_dir, hf, self.tok)
    # What ends a response or a chat turn: EOS, else a newline.
    self.end = ([self.eos] if self.eos is not None else
                self.tok.encode("\n", add_special_tokens=False).ids)
    self.check_ids(self.end, source if self.eos is not None else
                   f"the newline of {path}")

  def check_ids(self, ids, source: str) -> None:
    """Refuse any of ``ids`` outside ``[0, vocab_size)``, naming
    ``source``."""
    ids = np.asarray(ids)
    if self.vocab_size is None or not ids.size:
      return
    bad = ids[(ids < 0) | (ids >= self.vocab_size)]
    if bad.size:
      raise SystemExit(
          f"{source}: token id {int(bad[0])} is outside the model's "
          f"vocabulary (vocab_size {self.vocab_size} in {self.config}); "
          f"{self.path} has {self.tok.get_vocab_size()} tokens: is it the "
          f"model's own tokenizer?")

  def __call__(self, records, sources=None
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The examples of ``records``; ``sources[i]`` (default ``example
    i``) names record ``i`` in errors, e.g. ``file:line``."""
    split = [pieces(r) for r in records]
    flat = self.tok.encode_batch([t for p in split for t, _, _ in p],
                                 add_special_tokens=False)
    out, k = [], 0
    for i, p in enumerate(split):
      ids, tgt = list(self.prefix), [False] * len(self.prefix)
      for (_, target, ends), enc in zip(p, flat[k:k + len(p)]):
        ids += enc.ids
        tgt += [target] * len(enc.ids)
        if ends:  # a response or a chat turn; a prompt runs into its response
          ids += self.end
          tgt += [target] * len(self.end)
      k += len(p)
      out.append((np.asarray(ids, np.int32), np.asarray(tgt, bool)))
      self.check_ids(out[-1][0], sources[i] if sources else f"example {i}")
    return out


def _eos_id(model_dir: pathlib.Path, hf: dict, tok) -> tuple[int | None, str]:
  """The EOS id (None: no EOS) and where it came from."""
  eos, source = hf.get("eos_token_id"), "eos_token_id of config.json"
  if isinstance(eos, list):
    eos = eos[0] if eos else None
  if eos is None and (model_dir / "tokenizer_config.json").exists():
    name = json.loads((model_dir / "tokenizer_config.json").read_text()).get(
        "eos_token")
    name = name.get("content") if isinstance(name, dict) else name
    eos = tok.token_to_id(name) if name else None
    source = f"eos_token {name!r} of tokenizer_config.json"
  return eos, source


def pack(lengths, seq: int) -> list[list[int]]:
  """Greedy packing in the given order: each example (its index) goes into
  the current row if it fits, else starts the next one. Every length must
  be at most ``seq``."""
  rows, room = [], 0
  for i, n in enumerate(lengths):
    if n > room:
      rows.append([])
      room = seq
    rows[-1].append(i)
    room -= n
  return rows


class SFTData:
  """Packed rows of examples; the rows of a step are a pure function of
  (seed, step), so a resumed run sees the same data.

  Epoch ``e`` packs the examples in a shuffled order (seeded by (seed,
  e)); steps walk through epoch 0's rows, then epoch 1's, and so on.
  """

  def __init__(self, examples, seq: int, seed: int):
    self.seq, self.seed = seq, seed
    kept = [(t[:seq], m[:seq]) for t, m in examples]
    self.truncated = sum(len(t) > seq for t, _ in examples)
    self.examples = [(t, m) for t, m in kept if m[1:].any()]
    self.dropped = len(kept) - len(self.examples)
    if not self.examples:
      raise SystemExit("no example has a response token left to learn")
    self._epochs = []

  def rows(self, epoch: int) -> list[list[int]]:
    while len(self._epochs) <= epoch:
      e = len(self._epochs)
      order = np.random.default_rng([self.seed, e]).permutation(
          len(self.examples))
      packed = pack([len(self.examples[i][0]) for i in order], self.seq)
      self._epochs.append([[int(order[j]) for j in row] for row in packed])
    return self._epochs[epoch]

  def row(self, index: int):
    """The ``index``-th row of the stream: (tokens, segment ids, targets),
    ``(seq,)`` each."""
    epoch = 0
    while index >= len(self.rows(epoch)):
      index -= len(self.rows(epoch))
      epoch += 1
    tokens = np.zeros(self.seq, np.int32)
    seg = np.zeros(self.seq, np.int32)
    targets = np.zeros(self.seq, bool)
    start = 0
    for doc, i in enumerate(self.rows(epoch)[index], 1):
      t, m = self.examples[i]
      tokens[start:start + len(t)], targets[start:start + len(t)] = t, m
      seg[start:start + len(t)] = doc
      start += len(t)
    return tokens, seg, targets

  def batch(self, step: int, batch: int):
    """Global ``(tokens, segment_ids, targets)``, ``(batch, seq)`` each."""
    rows = [self.row(step * batch + i) for i in range(batch)]
    return tuple(np.stack(x) for x in zip(*rows))

  def fill(self) -> float:
    """The fraction of epoch 0's row tokens that are examples."""
    rows = self.rows(0)
    used = sum(len(self.examples[i][0]) for row in rows for i in row)
    return used / (len(rows) * self.seq)
