"""How ``generate`` draws each next token from a decode step's logits
(:class:`Sampling`), and the checks of its counts."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn from the logits: ``temperature`` 0 is
  greedy (argmax); otherwise softmax(logits / temperature) over the
  ``top_k`` most likely tokens (None: all) whose cumulative probability
  first reaches ``top_p`` (1: all)."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float = 1.0

  def __post_init__(self):
    t, k, p = self.temperature, self.top_k, self.top_p
    if not (is_number(t) and math.isfinite(t) and t >= 0):
      raise ValueError(f"temperature must be a finite number >= 0; got {t!r}")
    tiny = float(np.finfo(np.float32).tiny)
    if 0 < t < tiny:  # logits / t would be 0 / 0 at the best token
      raise ValueError(f"temperature must be 0 (greedy) or at least "
                       f"{tiny:.4g}, float32's smallest normal number, by "
                       f"which the logits are divided; got {t!r}")
    if k is not None and not (is_int(k) and k >= 1):
      raise ValueError(f"top_k must be None or an int >= 1; got {k!r}")
    if not (is_number(p) and 0 < p <= 1):
      raise ValueError(f"top_p must be in (0, 1]; got {p!r}")
    # Python numbers: the jitted sampler takes the record as a static key.
    object.__setattr__(self, "temperature", float(t))
    object.__setattr__(self, "top_k", None if k is None else int(k))
    object.__setattr__(self, "top_p", float(p))

  def filter(self, logits):
    """The logits ``(B, V)`` a token is drawn from (softmax of them), for a
    temperature above 0: over the temperature, -inf outside the top k
    (ties with the k-th kept, as transformers' TopK) and outside the
    nucleus (the most likely tokens, ties by id, up to the first whose
    cumulative probability reaches top_p: exactly that many)."""
    # Shifted first, so that a tiny temperature tends to greedy rather than
    # overflowing: the best logit stays 0 and the others fall to -inf.
    logits = (logits - logits.max(-1, keepdims=True)) / self.temperature
    if self.top_k is not None and self.top_k < logits.shape[-1]:
      kth = lax.top_k(logits, self.top_k)[0][:, -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p < 1:
      order = jnp.argsort(-logits, -1, stable=True)
      probs = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), -1)
      above = jnp.cumsum(probs, -1) - probs  # the mass ranked above each
      keep = jnp.zeros(logits.shape, bool).at[
          jnp.arange(logits.shape[0])[:, None], order].set(above < self.top_p)
      logits = jnp.where(keep, logits, -jnp.inf)
    return logits

  def draw(self, logits, key):
    """``(B,)`` int32 next tokens from ``logits (B, V)``: the argmax at
    temperature 0, else a draw from :meth:`filter`'s logits; -1 for a row
    whose logits hold NaN (there is no distribution to draw from), which
    ``generate`` names."""
    nan = jnp.isnan(logits).any(-1)
    if self.temperature == 0:
      tokens = jnp.argmax(logits, -1)
    else:
      tokens = jax.random.categorical(key, self.filter(logits))
    return jnp.where(nan, -1, tokens).astype(jnp.int32)


def is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_count(name: str, x) -> None:
  if not (is_int(x) and x >= 1):
    raise ValueError(f"{name} must be an int >= 1; got {x!r}")


def is_number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not (
      isinstance(x, (bool, np.bool_)))
