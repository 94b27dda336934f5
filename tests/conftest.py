"""Test setup, before jax initialises its backends:

* 8 simulated CPU devices, so that the context-parallel tests run on one
  machine;
* on GPUs, no preallocation of GPU memory (the multi-process test starts
  more jax processes on the same GPUs);
* on a machine without a CUDA plugin, XLA:CPU compiles without LLVM's
  expensive optimisations, as one LLVM module rather than parts compiled
  in parallel (on 2 cores shared by the test workers the parts cost more
  than they gain: 3-14% of a file's CPU time), and (jax 0.10, where the
  flag is known) with its older fusion code generator: the tests' programs
  are tiny and compiling them is most of the suite's time (the sum of the
  test times halves). The float semantics are the same; only the
  generated code is slower.

jax's other defaults stand, full Python tracebacks in HLO locations
included: ``test_compile_default_flags.py`` guards the compile they once
stalled (see ``jax_ring/_src/__init__.py``).
"""

import collections
import hashlib
import importlib.util
import os

import jax
import pytest  # importing jax starts no backend: XLA_FLAGS is read later

if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
  # XLA aborts on a flag it does not know: the emitter flag only where known.
  known = jax.__version_info__[:2] == (0, 10)
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (
      os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
      "--xla_llvm_disable_expensive_passes=true",
      "--xla_cpu_parallel_codegen_split_count=1",
      "--xla_cpu_use_fusion_emitters=false" if known else None)))

# On GPUs, the 2-process test starts two more jax processes beside this one:
# each takes memory as it needs it rather than 75% of every GPU at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax.config.update("jax_num_cpu_devices", 8)


# The files with the most work first, in this order (``--dist loadfile``
# hands whole files to the workers as they free up): the run then ends on
# short files rather than on one long file alone.
SLOWEST_MODULES = ("test_ring.py", "test_generate.py", "test_finetune.py",
                   "test_models.py", "test_cudnn_band.py",
                   "test_cudnn_tiles.py", "test_lora.py",
                   "test_never_silent.py", "test_first_call.py",
                   "test_any_length.py", "test_multiprocess.py",
                   "test_readme.py", "test_train_lm.py",
                   "test_compile_default_flags.py")


def pytest_addoption(parser):
  parser.addoption(
      "--lane-shard", metavar="I/N", default=None,
      help="run only the I-th (from 1) of N interleaved parts of the "
      "selected tests: a long lane split over jobs of limited time")


def lane_shard(option: str | None, ids: list[str]) -> set[int]:
  """The indices, among the selected tests' ``ids``, of ``--lane-shard
  I/N``'s part: every N-th in the order of the ids' hashes, so that parts
  are of one size (within one test) and each mixes the lane (the lane's
  neighbours differ in one option, such as the entry point)."""
  if option is None:
    return set(range(len(ids)))
  try:
    i, n = (int(x) for x in option.split("/"))
  except ValueError:
    i = n = 0
  if not 1 <= i <= n:
    raise pytest.UsageError(f"--lane-shard takes I/N with 1 <= I <= N; got "
                            f"{option!r}")
  order = sorted(range(len(ids)),
                 key=lambda j: hashlib.sha1(ids[j].encode()).hexdigest())
  return set(order[i - 1::n])


_SAMPLED = collections.Counter()


def pytest_itemcollected(item):  # as collected, before -m deselects
  """``@pytest.mark.sample(k)`` on a parametrized test: its first ``k``
  cases (in its parametrize order, those not marked slow or gpu) run in
  the default run, the others are marked slow (``-m slow`` runs them). For
  matrices whose cases repeat one path with another option: the first
  cases are the distinct ones."""
  mark = item.get_closest_marker("sample")
  if mark is None or any(item.get_closest_marker(m) for m in ("slow", "gpu")):
    return
  function = (item.path, item.originalname)
  _SAMPLED[function] += 1
  if _SAMPLED[function] > mark.args[0]:
    item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(SLOWEST_MODULES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  keep = lane_shard(config.getoption("--lane-shard"),
                    [item.nodeid for item in items])
  if len(keep) < len(items):
    config.hook.pytest_deselected(
        items=[x for i, x in enumerate(items) if i not in keep])
    items[:] = [x for i, x in enumerate(items) if i in keep]
