"""The package's shape, read from its source with ``ast``: the layers and
their direction, no hidden contracts (names computed at run time, other
modules' private names, tests importing tests), and the size limits."""

import ast
import functools
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "jax_ring"
SRC = PACKAGE / "_src"

# Each layer, and the layers its modules may import (besides their own).
LAYERS = {
    "core": set(),
    "backends": {"core"},
    "strategies": {"core"},
    # api and the paths it calls (one_device, cp_dispatch, padding),
    # partition, auto, decode
    "top": {"core", "strategies"},
    "root": {"core", "backends", "strategies", "top"},  # jax_ring/__init__
    "flax": {"core", "strategies", "top", "root"},
    "models": {"core", "strategies", "top", "root", "flax"},
    "maxtext": {"core", "strategies", "top", "root"},
}
# What only the optional add-ons (jax_ring.flax, jax_ring.models,
# jax_ring.maxtext) may use.
ADD_ON_DEPENDENCIES = ("flax", "safetensors", "tokenizers", "optax", "orbax",
                       "transformers", "torch", "maxtext")


def library_files():
  return sorted(p for p in PACKAGE.rglob("*.py"))


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
  """The layer of a ``jax_ring`` module; None: not one of ours."""
  parts = module.split(".")
  if parts[0] != "jax_ring":
    return None
  if len(parts) == 1 or parts[1] == "_cudnn":
    return "root" if len(parts) == 1 else "backends"
  if parts[1] in ("flax", "models", "maxtext"):
    return parts[1]
  if len(parts) == 2:  # jax_ring._src: the package marker
    return "core"
  return parts[2] if parts[2] in LAYERS else "top"


def is_module(dotted: str) -> bool:
  """One of our modules: a package, a Python file or a compiled module
  (described by its ``.pyi`` stub)."""
  path = ROOT.joinpath(*dotted.split("."))
  return (path.is_dir() or path.with_suffix(".py").exists() or
          path.with_suffix(".pyi").exists())


def is_package(dotted: str) -> bool:
  return ROOT.joinpath(*dotted.split(".")).is_dir()


def imports(tree: ast.AST, module: str):
  """(imported module, names) of every import statement, relative ones
  resolved against ``module``; ``from pkg import sub`` imports ``pkg.sub``
  where that is one of our modules."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        yield a.name, ()
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # a package's ``from . import`` is from itself
        parts = module.split(".")
        parts = parts[:len(parts) - node.level + is_package(module)]
        base = ".".join(parts + [base]).rstrip(".")
      names = tuple(a.name for a in node.names)
      subs = [n for n in names if is_module(f"{base}.{n}")]
      for n in subs:
        yield f"{base}.{n}", ()
      if len(subs) < len(names):
        yield base, tuple(n for n in names if n not in subs)


def parsed(path):
  return ast.parse(path.read_text(), str(path))


@pytest.mark.parametrize("path", library_files(),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_down_the_layers(path):
  module = module_name(path)
  own = layer(module)
  for target, _ in imports(parsed(path), module):
    other = layer(target)
    if other is None or other == own:
      continue
    if not is_module(target):
      continue
    assert other in LAYERS[own], (
        f"{module} ({own}) imports {target} ({other}); {own} may import "
        f"{sorted(LAYERS[own])}")


def import_graph() -> dict[str, set[str]]:
  """Each ``jax_ring`` module -> the ``jax_ring`` modules it imports, at
  module level or inside a function alike. ``from pkg import name``, where
  ``pkg/__init__.py`` re-exports ``name``, imports ``pkg`` (:func:`imports`):
  the package's ``__init__`` is a module like any other. Importing
  ``pkg.sub`` also runs ``pkg/__init__`` first, but that is no edge here:
  Python runs a package's ``__init__`` before its submodules whoever
  imports them, so a package re-exporting its own submodules would
  otherwise close a cycle with each of them, none importing another."""
  graph = {}
  for path in library_files():
    module = module_name(path)
    graph[module] = {target for target, _ in imports(parsed(path), module)
                     if layer(target) is not None and is_module(target) and
                     target != module}
  return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """The modules of one cycle of ``graph``, the first repeated at the end,
  or None."""
  done, path = set(), []

  def visit(node):
    if node in path:
      return path[path.index(node):] + [node]
    if node in done:
      return None
    path.append(node)
    for target in sorted(graph.get(node, ())):
      found = visit(target)
      if found:
        return found
    path.pop()
    done.add(node)
    return None

  return next(filter(None, map(visit, sorted(graph))), None)


def test_the_cycle_finder_finds_one():
  assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
      "a", "b", "c", "a"]
  assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_modules_import_each_other():
  found = cycle(import_graph())
  assert found is None, (
      f"an import cycle: {' -> '.join(found)}; move what one module needs "
      f"from the other to where it belongs")


def test_the_implementation_imports_no_add_on_dependency():
  for path in SRC.rglob("*.py"):
    for target, _ in imports(parsed(path), module_name(path)):
      assert target.split(".")[0] not in ADD_ON_DEPENDENCIES, (path, target)


def test_no_module_is_imported_by_a_computed_name():
  for path in library_files():
    text = path.read_text()
    for pattern in ("import_module", "__import__", "importlib"):
      assert pattern not in text, (path, pattern)


@functools.cache
def python_files():
  dirs = ("jax_ring", "tests", "examples", "benchmarks")
  return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def our_modules(tree, module):
  """Local names bound to our modules (jax_ring's, the tests', the
  examples' and benchmarks')."""
  ours = {p.stem for p in python_files()} | {"jax_ring"}
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] in ours:
          names.add((a.asname or a.name).split(".")[0])
    elif isinstance(node, ast.ImportFrom) and node.module:
      if node.module.split(".")[0] in ours or node.level:
        for a in node.names:
          names.add(a.asname or a.name)
  return names


@pytest.mark.parametrize("path", python_files(),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_names(path):
  tree = parsed(path)
  module = module_name(path)
  for target, names in imports(tree, module):
    if target.split(".")[0] == "jax_ring" or target.startswith("test"):
      private = [n for n in names if n.startswith("_") and n != "_cudnn"]
      assert not private, f"{path}: from {target} import {private}"
  modules = our_modules(tree, module)
  for node in ast.walk(tree):
    # ``_src`` is a package, not a name (``jax_ring._src.core.config``).
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and
        not node.attr.startswith("__") and node.attr != "_src" and
        isinstance(node.value, ast.Name) and node.value.id in modules):
      raise AssertionError(f"{path}:{node.lineno}: "
                           f"{node.value.id}.{node.attr}")


def test_no_test_module_imports_another():
  tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
  for path in (ROOT / "tests").glob("*.py"):
    for target, _ in imports(parsed(path), path.stem):
      assert target.split(".")[0] not in tests, (path.name, target)


def test_library_files_and_functions_stay_small():
  for path in library_files():
    text = path.read_text()
    assert text.count("\n") <= 500, (path, text.count("\n"))
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        assert length <= 80, f"{path}:{node.lineno} {node.name}: {length}"


# A GPU's name or a time next to a number: a measurement, which goes stale
# in code; docs/performance.md holds them, with the command behind each.
MEASURED = re.compile(r"[0-9]x?H[12]00|\bH[12]00\b|\d\s*(ms|us|µs)\b|"
                      r"\d(\.\d+)?\s*%")


def test_library_docstrings_and_comments_carry_no_measurements():
  for path in library_files():
    text = path.read_text()
    prose = [t.string for t in tokenize.generate_tokens(
        io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
        prose.append(ast.get_docstring(node) or "")
    for words in prose:
      found = MEASURED.search(words)
      assert not found, f"{path}: {found.group(0)!r} in {words[:200]!r}"
