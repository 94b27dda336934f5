"""The examples' run directory and checkpoints (examples/run_dir.py,
examples/checkpoints.py), through ``train_lm.train_loop`` with a toy state
and step (no model to compile): a fresh run never deletes or writes over
an earlier run's results unless ``--overwrite``; a NaN loss or state stops
the run naming the step and is never saved; ``--resume`` compares the
settings and the arrays before restoring and verifies the checksums after,
naming the step, and continues the uninterrupted run bit for bit; the
default run directory is new per run."""

import hashlib
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import checkpoints  # noqa: E402
import finetune  # noqa: E402
import generate  # noqa: E402
import run_dir  # noqa: E402
import train_lm  # noqa: E402

RECORD = {"seed": 0}


def toy_state(cols=16):
  """Random bits (incompressible, so orbax writes them verbatim) and a
  float array, split over the devices."""
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  rows = jax.NamedSharding(mesh, jax.P("x"))
  bits = jax.random.bits(jax.random.key(0), (8, 256), jnp.uint32)
  return mesh, {"w": jax.device_put(bits.view(jnp.int32), rows),
                "f": jax.device_put(jnp.ones((8, cols)), rows)}


@jax.jit
def toy_step(state, batch):
  """``batch = (loss factor, state factor)``: the loss is the sum of ``f``
  times the first, the new ``f`` the old times the second."""
  return ({"w": state["w"] + 1, "f": state["f"] * batch[1]},
          jnp.sum(state["f"]) * batch[0])


def run(path, *flags, poison=None, record=RECORD, cols=16, step=toy_step):
  """``train_lm.train_loop`` for 4 steps (checkpoints after 2 and 4) of the
  toy step; ``poison = (step, (loss factor, state factor))`` feeds that
  batch at that (1-based) step, ones elsewhere."""
  args = train_lm.parse_args(["--steps", "4", "--checkpoint-every", "2",
                              "--run-dir", str(path), "--quiet", *flags])
  run_dir.prepare(args, "test", train_lm.OUTPUTS)
  mesh, state = toy_state(cols)

  def batch_at(step):
    return jnp.array(poison[1] if poison and step + 1 == poison[0] else
                     (1.0, 1.0))

  return train_lm.train_loop(args, mesh=mesh, state=state,
                             train_step=step, record=record,
                             batch_at=batch_at, tokens_per_step=1,
                             banner=lambda start: "toy")


def steps(path) -> list[int]:
  return sorted(int(p.name) for p in (path / "checkpoints").iterdir()
                if p.name.isdigit())


def contents(path) -> dict[str, str]:
  return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
          for f in sorted(path.rglob("*")) if f.is_file()}


def test_a_fresh_run_refuses_an_earlier_runs_results_until_overwrite(
    tmp_path, capsys):
  run(tmp_path)
  (tmp_path / "notes.txt").write_text("the user's")
  before = contents(tmp_path)
  assert steps(tmp_path) == [2, 4]
  with pytest.raises(SystemExit, match="checkpoints.*--resume.*--overwrite"):
    run(tmp_path)
  assert contents(tmp_path) == before  # nothing deleted, nothing written
  capsys.readouterr()
  result = run(tmp_path, "--overwrite")
  assert result["start"] == 0 and len(result["losses"]) == 4
  assert f"deleting {tmp_path / 'checkpoints'}" in capsys.readouterr().err
  assert (tmp_path / "notes.txt").read_text() == "the user's"
  assert steps(tmp_path) == [2, 4]


def test_a_flipped_bit_in_a_checkpoint_fails_the_resume_naming_the_step(
    tmp_path):
  saved = np.asarray(run(tmp_path, "--stop-after", "3")["state"]["w"])
  assert steps(tmp_path) == [2, 3]
  # The bytes of w's first row, as orbax wrote them; flip one bit.
  needle, hits = saved.tobytes()[100:116], 0
  for f in (tmp_path / "checkpoints" / "3" / "state").rglob("*"):
    data = bytearray(f.read_bytes()) if f.is_file() else b""
    if (at := data.find(needle)) >= 0:
      data[at + 7] ^= 0x08
      f.write_bytes(data)
      hits += 1
  assert hits
  with pytest.raises(SystemExit, match=r"step 3 .* corrupt: \['w'\].*"
                     r"resume from step 2"):
    run(tmp_path, "--resume")


def test_a_resume_continues_the_uninterrupted_run(tmp_path):
  """--stop-after, then --resume: the losses and the state bit for bit the
  uninterrupted run's (f doubles in step 3, so step 4's loss is the
  restored state's)."""
  poison = (3, (1.0, 2.0))
  whole = run(tmp_path / "whole", poison=poison)
  first = run(tmp_path / "run", "--stop-after", "3", poison=poison)
  assert len(first["losses"]) == 3 and steps(tmp_path / "run") == [2, 3]
  resumed = run(tmp_path / "run", "--resume", poison=poison)
  assert resumed["start"] == 3
  assert resumed["losses"] == whole["losses"] == [128.0] * 3 + [256.0]
  for a, b in zip(jax.tree.leaves(resumed["state"]),
                  jax.tree.leaves(whole["state"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_names_other_settings_and_arrays_before_restoring(tmp_path):
  run(tmp_path)
  with pytest.raises(SystemExit, match="step 4 .*other settings: seed: saved "
                     "0, now 1$"):
    run(tmp_path, "--resume", record={"seed": 1})
  with pytest.raises(SystemExit, match=r"other arrays.*\['f'\]: saved shape "
                     r"\[8, 16\], now \[8, 32\]$"):
    run(tmp_path, "--resume", cols=32)


def test_a_nan_loss_or_state_stops_the_run_naming_the_step(tmp_path):
  with pytest.raises(SystemExit, match="step 3: the loss is nan;.*last "
                     "checkpoint is step 2"):
    run(tmp_path / "loss", poison=(3, (np.nan, 1.0)))
  assert steps(tmp_path / "loss") == [2]
  # A finite loss, but the update makes f infinite: not saved.
  with pytest.raises(SystemExit, match=r"step 2: the train state holds "
                     r"non-finite values \(\['f'\]: 128 entries\).*no "
                     r"checkpoint"):
    run(tmp_path / "state", poison=(2, (1.0, np.inf)))
  assert steps(tmp_path / "state") == []


def test_step_intervals_are_step_times_when_the_step_call_waits(
    tmp_path, monkeypatch):
  """A step call that returns only once its step has run (as measured on an
  H100): each interval is one step's time. Left out: the compiling step,
  the first read after a checkpoint's save, and the read of the step a
  checkpoint saves (already there: it would time nothing)."""
  now = [0.0]

  def waiting_step(state, batch):
    out = jax.block_until_ready(toy_step(state, batch))
    now[0] += 1.0  # the step's time, spent in the call
    return out

  monkeypatch.setattr(train_lm, "time", type(
      "Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
  result = run(tmp_path, "--steps", "6", "--checkpoint-every", "3",
               step=waiting_step)
  assert result["step_intervals_s"] == [1.0, 1.0]  # one per 3-step stretch
  assert result["tokens_per_s"] == 1.0


def test_checksums_are_the_same_on_any_mesh_and_see_one_bit():
  _, state = toy_state()
  host = jax.device_get(state)
  sharded, single = checkpoints.fingerprint(state), checkpoints.fingerprint(
      host)
  assert sharded == single and single[0]["path"] == "['f']"
  flipped = dict(host, w=host["w"].copy())
  flipped["w"][5, 7] ^= 1 << 30
  got = checkpoints.fingerprint(flipped)[1]
  assert got["sum"] != single[1]["sum"] and got["mix"] != single[1]["mix"]
  # Narrow and boolean dtypes, a scalar.
  odd = {"b": jnp.arange(6, dtype=jnp.bfloat16), "m": jnp.array([True]),
         "n": jnp.float32(np.nan)}
  assert [a["nonfinite"] for a in checkpoints.fingerprint(odd)] == [0, 0, 1]


def test_the_default_run_dir_is_new_per_run(capsys):
  args = [train_lm.parse_args(["--quiet"]) for _ in range(2)]
  made = [run_dir.prepare(a, "test", train_lm.OUTPUTS) for a in args]
  assert made[0] != made[1] and all(p.is_dir() for p in made)
  assert str(made[0]) in capsys.readouterr().err
  for p in made:
    p.rmdir()  # empty
  for flags, match in ((["--resume"], "--resume needs --run-dir"),
                       (["--run-dir", "x", "--resume", "--overwrite"],
                        "pass one of them")):
    with pytest.raises(SystemExit) as e:
      train_lm.parse_args(flags)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_a_run_never_writes_over_what_it_reads(tmp_path):
  args = train_lm.parse_args(["--run-dir", str(tmp_path), "--overwrite"])
  with pytest.raises(SystemExit, match="is read by this run but lies in"):
    run_dir.prepare(args, "test", ("final",),
                    inputs=(tmp_path / "final" / "model",))


@pytest.mark.parametrize("script, flags, message", [
    (finetune, ["--steps", "0"], "argument --steps: must be >= 1; got 0"),
    (finetune, ["--lr", "-1"], "argument --lr: must be > 0.0; got -1"),
    (finetune, ["--context", "0"], "argument --context: must be >= 1"),
    (finetune, ["--data", "/no/such.jsonl"],
     "--data /no/such.jsonl: no such file"),
    (train_lm, ["--checkpoint-every", "0"],
     "argument --checkpoint-every: must be >= 1; got 0"),
    (train_lm, ["--batch", "0"], "argument --batch: must be >= 1; got 0"),
    (train_lm, ["--warmup", "-5"], "argument --warmup: must be >= 0"),
    (train_lm, ["--stop-after", "x"], "argument --stop-after: not int: 'x'"),
    (generate, ["--top-k", "3"], "--top-k and --top-p shape sampling: they "
     "need --temperature > 0"),
    (generate, ["--temperature", "1", "--top-p", "1.5"],
     "argument --top-p: must be > 0.0 and <= 1.0; got 1.5"),
    (generate, ["--max-new-tokens", "0"],
     "argument --max-new-tokens: must be >= 1; got 0"),
    (generate, ["--context", "0"], "argument --context: must be >= 1"),
    (generate, ["--model", "/no/dir"], "--model /no/dir: no config.json "
     "there"),
    (generate, ["--temperature", "nan"], "argument --temperature: must be a "
     "finite number; got nan"),
    (generate, ["--temperature", "inf"], "argument --temperature: must be a "
     "finite number; got inf"),
    (generate, ["--seed", "-5"], "argument --seed: must be >= 0 and <= "
     "4294967295; got -5"),
    (generate, ["--prompt-file", "/no/file.txt"],
     "--prompt-file /no/file.txt: no such file"),
    (generate, ["--prompts", "/no/p.jsonl", "--prompt-file", "/no/b.txt"],
     "give prompts on the command line, with --prompts or with "
     "--prompt-file: one of them"),
])
def test_flags_out_of_range_are_the_flags_errors(script, flags, message,
                                                 capsys):
  """A value no run can mean is an argparse error naming the flag (exit
  status 2), never a run that quietly does another thing."""
  with pytest.raises(SystemExit) as e:
    script.parse_args(flags)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_prompts_files_read_as_the_data_files_are(tmp_path):
  """A leading byte-order mark is read past (as finetune.py reads its
  data); bytes that are not UTF-8 are named with the file; a prompt file
  of no text is named."""
  good = tmp_path / "p.jsonl"
  good.write_bytes(b'\xef\xbb\xbf{"prompt": "owl"}\n\n{"prompt": "sun"}\n')
  assert generate.read_prompts(good) == ["owl", "sun"]
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b'{"prompt": "\xff"}\n')
  with pytest.raises(SystemExit, match=re.escape(
      f"{bad}: not UTF-8 text (byte 12: invalid start byte)")):
    generate.read_prompts(bad)
  text = tmp_path / "book.txt"  # --prompt-file: the whole file, one prompt
  text.write_bytes(b"\xef\xbb\xbfowl\n\nsun\n")
  assert generate.read_text(text) == "owl\n\nsun\n"
  text.write_bytes(b" \n")
  with pytest.raises(SystemExit, match=re.escape(f"{text}: no text")):
    generate.read_text(text)


def test_a_mesh_axis_given_twice_is_named():
  with pytest.raises(SystemExit, match=re.escape(
      "--mesh context=4,context=2: axis 'context' given twice")):
    train_lm.parse_mesh("context=4,context=2", 8)


def test_a_resume_writes_nothing_before_its_checks(tmp_path):
  """finetune.py --resume in a directory that is not a run of the demo's
  model with its data (a user's directory; a run started with --data,
  resumed without it): refused, nothing written or replaced."""
  (tmp_path / "demo.jsonl").write_text('{"prompt": "mine", "response": "x"}\n')
  before = contents(tmp_path)
  with pytest.raises(SystemExit, match=re.escape(
      f"--resume: {tmp_path} is not a run of the demo's model with this "
      f"data ({tmp_path / 'base_model' / 'config.json'} absent)")):
    finetune.train(finetune.parse_args(["--run-dir", str(tmp_path),
                                        "--resume", "--quiet"]))
  assert contents(tmp_path) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.jsonl"]


def test_unreadable_tokenizer_or_config_is_named(tmp_path):
  """A model directory whose tokenizer.json or config.json cannot be read
  is an error naming the file, not a traceback."""
  import finetune
  import sft_data
  (tmp_path / "tokenizer.json").write_text("{not json")
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(SystemExit, match=re.escape(
      f"{tmp_path / 'tokenizer.json'}: not a tokenizer the tokenizers "
      "library reads")):
    sft_data.Encoder(tmp_path)
  finetune.train_tokenizer(["owl sun lamp"], vocab_size=300).save(
      str(tmp_path / "tokenizer.json"))
  (tmp_path / "config.json").write_bytes(b"{\"vocab_size\": 30")
  with pytest.raises(SystemExit, match=re.escape(
      f"{tmp_path / 'config.json'}: not a readable JSON file")):
    sft_data.Encoder(tmp_path)
