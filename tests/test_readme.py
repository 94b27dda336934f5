"""The README's API snippets run as written, in order, in a fresh Python
(jax's default flags, 8 simulated CPU devices from their own first line),
and give what they say: the context-parallel calls equal the one-device
call (its float64 reference, tests/reference.py: no program to compile),
the model's logits are finite and of the batch's shape, generation gives
token ids of the vocabulary, LoRA adds its adapters and writes PEFT's
files."""

import pathlib
import re
import subprocess
import sys
import textwrap

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

HARNESS = textwrap.dedent('''
    import json, sys
    import numpy as np
    blocks = json.load(sys.stdin)
    ns = {}
    exec(blocks[0], ns)
    jax = ns["jax"]
    assert np.isfinite(np.asarray(ns["out"])).all()
    sys.path.insert(0, sys.argv[1])
    import reference as ref
    ids = np.asarray(ns["ids"])
    one_device, _ = ref.attention(
        *(np.asarray(ns[x]) for x in "qkv"), ref.Case(
            ns["H"] ** -0.5, is_causal=True, q_segment_ids=ids,
            kv_segment_ids=ids))
    for block in blocks[1:3]:
      exec(block, ns)
      np.testing.assert_allclose(np.asarray(ns["out"]), one_device,
                                 atol=2e-5, rtol=0)
    exec(blocks[3], ns)
    logits = np.asarray(ns["logits"])
    assert logits.shape == (2, 64, 256) and np.isfinite(logits).all()
    exec(blocks[4], ns)
    new = ns["new_tokens"]
    assert len(new) == 2 and all(1 <= len(r) <= 8 for r in new), new
    assert all(0 <= t < 256 for r in new for t in r), new
    exec(blocks[5], ns)
    from flax import nnx
    adapters = jax.tree.leaves(nnx.state(ns["model"], nnx.LoRAParam))
    assert len(adapters) == 2 * 7 * 2  # a, b of 7 modules in 2 layers
    assert jax.tree.leaves(ns["optimizer"].opt_state)
    with open("tiny-llama-lora/adapter_config.json") as f:
      assert json.load(f)["r"] == 8
    print("snippets:", len(blocks))
''')


def api_snippets():
  text = README.read_text()
  section = text[text.index("## The API at a glance"):
                 text.index("## Which strategy when")]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_snippets_run_as_written(tmp_path):
  import json
  blocks = api_snippets()
  assert len(blocks) == 6, len(blocks)
  done = subprocess.run(
      [sys.executable, "-c", HARNESS, str(README.parent / "tests")],
      input=json.dumps(blocks), text=True, capture_output=True, cwd=tmp_path,
      timeout=240)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "snippets: 6" in done.stdout


def test_every_python_block_of_the_docs_is_one_that_runs():
  """README.md's Python blocks are all API snippets (run above); the docs'
  signatures and tables are marked as text, not Python."""
  text = README.read_text()
  assert len(re.findall(r"```python\n", text)) == len(api_snippets())
  for doc in sorted((README.parent / "docs").glob("*.md")):
    assert "```python" not in doc.read_text(), doc.name
