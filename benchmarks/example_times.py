"""Wall time of each example as the README runs it, on this machine:

  python benchmarks/example_times.py      # -> results/example_times_<n>x<kind>.json

Each command runs in a fresh temporary directory (its run directories
land there), one after the other, with the machine otherwise idle; the
table gives seconds and whether it exited 0.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
# The README's commands (section "Run"), without arguments.
COMMANDS = ("quickstart.py", "train_lm.py", "finetune.py", "generate.py")


def main():
  rows = []
  for script in COMMANDS:
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.perf_counter()
      done = subprocess.run([sys.executable, str(EXAMPLES / script)],
                            cwd=tmp, capture_output=True, text=True)
      seconds = time.perf_counter() - t0
    rows.append(dict(command=f"python examples/{script}", seconds=seconds,
                     exit_code=done.returncode))
    print(rows[-1], flush=True)
    if done.returncode:
      print(done.stderr[-2000:], file=sys.stderr)
  write("example_times", rows, ["command", "seconds", "exit_code"],
        dict(cpus=os.cpu_count()))


if __name__ == "__main__":
  main()
