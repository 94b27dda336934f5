"""Property tests: random shapes, tiles and masks against the reference."""

import dataclasses

import hypothesis.strategies as st
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings

import reference as ref
from helpers import check_kernel


@st.composite
def problems(draw):
  b = draw(st.integers(1, 2))
  t, s = draw(st.integers(1, 33)), draw(st.integers(1, 33))
  kh, g = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
  h = draw(st.sampled_from([8, 16]))
  case = ref.Case(
      scale=draw(st.floats(0.05, 1.0)),
      is_causal=draw(st.booleans()),
      window=draw(st.none() | st.tuples(st.integers(0, 12),
                                        st.integers(0, 12))),
      soft_cap=draw(st.none() | st.floats(1.0, 20.0)),
      q_offset=draw(st.integers(0, 20)), kv_offset=draw(st.integers(0, 20)))
  if draw(st.booleans()):
    nseg = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    case = dataclasses.replace(
        case, q_segment_ids=ref.random_segments(seed, b, t, nseg),
        kv_segment_ids=ref.random_segments(seed + 1, b, s, nseg))
  tiles = dict(block_q=draw(st.integers(1, 40)),
               block_kv=draw(st.integers(1, 40)))
  return (b, t, s, kh * g, kh, h), case, tiles, draw(st.integers(0, 2**16))


def _matches_reference(problem):
  shape, case, tiles, seed = problem
  q, k, v, do = ref.random_qkv(seed, *shape[:3], *shape[3:], jnp.float32)
  check_kernel(q, k, v, do, case, **tiles)


def _examples(n):
  """``n`` random problems; each is a fresh compile (2-3 s here)."""
  return settings(max_examples=n, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])


test_random_problems_match_reference = _examples(4)(
    given(problems())(_matches_reference))
test_many_random_problems_match_reference = pytest.mark.slow(_examples(60)(
    given(problems())(_matches_reference)))
