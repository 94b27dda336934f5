"""docs/api.md is what docs/gen_api.py writes from the public names'
signatures and docstrings: one changed without the page fails here."""

import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def test_the_api_reference_is_current():
  pytest.importorskip("flax")  # jax_ring.flax and jax_ring.models are on it
  gen_api = runpy.run_path(str(ROOT / "docs" / "gen_api.py"))
  assert gen_api["main"](["--check"]) == 0, (
      "docs/api.md is stale: run `python docs/gen_api.py` (the lines that "
      "differ are in the captured stderr)")
