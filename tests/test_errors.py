"""Every invalid call raises ValueError at trace time with an exact message."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ring
from jax_ring._src.backends import cudnn

Q = jnp.ones((2, 8, 4, 16))
KV = jnp.ones((2, 6, 2, 16))


def call(q=Q, k=KV, v=KV, **kw):
  # Under jit, so the error must come from shapes alone, at trace time.
  return jax.jit(lambda q, k, v: jax_ring.dot_product_attention(q, k, v, **kw))(
      q, k, v)


ERRORS = {
    "rank": (dict(q=jnp.ones((8, 4))),
             "query must have rank 4 (B, T, N, H) or 3 (T, N, H); got shape "
             "(8, 4)"),
    "kv_shape": (dict(v=jnp.ones((2, 7, 2, 16))),
                 "key and value must agree on batch, sequence and heads "
                 "(dims 0-2; only the head dim may differ); got key "
                 "(2, 6, 2, 16) and value (2, 7, 2, 16)"),
    "kv_heads": (dict(v=jnp.ones((2, 6, 1, 16))),
                 "key and value must agree on batch, sequence and heads "
                 "(dims 0-2; only the head dim may differ); got key "
                 "(2, 6, 2, 16) and value (2, 6, 1, 16)"),
    "value_head_dim": (dict(v=jnp.ones((2, 6, 2, 0))),
                       "value's head_dim must be positive; got value "
                       "(2, 6, 2, 0)"),
    "batch": (dict(k=jnp.ones((3, 6, 2, 16)), v=jnp.ones((3, 6, 2, 16))),
              "query and key must agree on batch (dim 0) and head_dim (dim 3);"
              " got query (2, 8, 4, 16) and key (3, 6, 2, 16)"),
    "head_dim": (dict(k=jnp.ones((2, 6, 2, 8)), v=jnp.ones((2, 6, 2, 8))),
                 "query and key must agree on batch (dim 0) and head_dim "
                 "(dim 3); got query (2, 8, 4, 16) and key (2, 6, 2, 8)"),
    "gqa": (dict(k=jnp.ones((2, 6, 3, 16)), v=jnp.ones((2, 6, 3, 16))),
            "query heads (4) must be divisible by key/value heads (3); got "
            "query (2, 8, 4, 16) and key (2, 6, 3, 16)"),
    "dtype_mismatch": (dict(k=KV.astype(jnp.bfloat16)),
                       "query, key and value must have one dtype; got query "
                       "float32, key bfloat16, value float32"),
    "dtype_int": (dict(q=Q.astype(jnp.int32), k=KV.astype(jnp.int32),
                       v=KV.astype(jnp.int32)),
                  "query, key and value must be float32, bfloat16 or float16;"
                  " got int32"),
    "window_negative": (dict(local_window_size=(-1, 2)),
                        "local_window_size must be a non-negative int or a "
                        "(left, right) pair of non-negative ints; got (-1, 2)"),
    "window_float": (dict(local_window_size=2.5),
                     "local_window_size must be a non-negative int or a "
                     "(left, right) pair of non-negative ints; got 2.5"),
    "segment_shape": (dict(segment_ids=jnp.zeros((2, 7), jnp.int32)),
                      "segment_ids must be int arrays of shape (B, T) = (2, 8)"
                      " for queries and (B, S) = (2, 6) for keys; got int32 "
                      "(2, 7) and int32 (2, 7)"),
    "segment_pair": (dict(segment_ids=(jnp.zeros((2, 8), jnp.int32),
                                       jnp.zeros((2, 8), jnp.int32))),
                     "segment_ids must be int arrays of shape (B, T) = (2, 8)"
                     " for queries and (B, S) = (2, 6) for keys; got int32 "
                     "(2, 8) and int32 (2, 8)"),
    "segment_dtype": (dict(segment_ids=(jnp.zeros((2, 8)),
                                        jnp.zeros((2, 6), jnp.int32))),
                      "segment_ids must be int arrays of shape (B, T) = (2, 8)"
                      " for queries and (B, S) = (2, 6) for keys; got float32 "
                      "(2, 8) and int32 (2, 6)"),
    "q_lengths": (dict(query_seq_lengths=jnp.array([3, 4, 5])),
                  "query_seq_lengths must be an int array of shape (B,) = "
                  "(2,); got int32 (3,)"),
    "kv_lengths": (dict(key_value_seq_lengths=jnp.array([3.0, 4.0])),
                   "key_value_seq_lengths must be an int array of shape (B,) ="
                   " (2,); got float32 (2,)"),
    "bias_shape": (dict(bias=jnp.ones((2, 3, 8, 6))),
                   "bias must be broadcastable to (B, N, T, S) = (2, 4, 8, "
                   "6), with leading dims added as needed; got shape (2, 3, "
                   "8, 6)"),
    "mask_dtype": (dict(mask=jnp.ones((1, 1, 8, 6))),
                   "mask must be a boolean array (True = attend); got dtype "
                   "float32 with shape (1, 1, 8, 6). Pass additive masks as "
                   "bias."),
    "mask_shape": (dict(mask=jnp.ones((3, 8, 6), bool)),
                   "mask must be broadcastable to (B, N, T, S) = (2, 4, 8, "
                   "6), with leading dims added as needed; got shape (1, 3, "
                   "8, 6)"),
    "soft_cap": (dict(logits_soft_cap=-1.0),
                 "logits_soft_cap must be a positive finite number; got -1.0"),
    "scale": (dict(scale=float("nan")),
              "scale must be finite; got nan"),
    "implementation": (dict(implementation="triton"),
                       "implementation must be None or one of ('xla', "
                       "'cudnn'); got 'triton'"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_message(name):
  kw, message = ERRORS[name]
  with pytest.raises(ValueError, match="^" + re.escape(message) + r"(\n|$)"):
    call(**kw)


def test_cudnn_unavailable_is_a_clear_error():
  if cudnn.LOAD_ERROR is None:  # built: on a CPU it still cannot serve
    message = ("implementation='cudnn' does not support platform 'cpu' (cuDNN"
               " needs an NVIDIA GPU)")
    if jax.default_backend() == "gpu":
      message = ("implementation='cudnn' does not support dtype float32 "
                 "(cuDNN takes bfloat16 or float16; float32 runs on "
                 "implementation='xla')")
  else:
    message = ("implementation='cudnn' is not available in this install: the "
               "cuDNN extension (jax_ring._cudnn) is not built; build it on a "
               "machine with CUDA and cuDNN with JAX_RING_CUDNN=ON")
  with pytest.raises(ValueError, match="^" + re.escape(message)):
    call(implementation="cudnn")


def test_the_extensions_switches_say_when_it_is_not_loaded():
  """The CUDA-graph replays' switch and counts: a ``RuntimeError`` naming
  the unbuilt extension, or (built) the counts, every one a whole number
  at least 0."""
  from jax_ring._src.backends.cudnn import ffi
  if cudnn.LOAD_ERROR is None:
    counts = ffi.graph_counts()
    assert set(counts) == {"launched", "recorded", "unsupported"}
    assert all(isinstance(n, int) and n >= 0 for n in counts.values())
    return
  for fn in (lambda: ffi.use_graphs(False), ffi.graph_counts):
    with pytest.raises(RuntimeError, match="cuDNN extension is not loaded: "
                       "the cuDNN extension .jax_ring._cudnn. is not built"):
      fn()


def test_errors_are_raised_before_any_compile():
  with pytest.raises(ValueError):
    jax.eval_shape(lambda: jax_ring.dot_product_attention(
        Q, jnp.ones((2, 6, 3, 16)), jnp.ones((2, 6, 3, 16))))


def test_valid_call_passes_validation():
  out = call(segment_ids=(np.zeros((2, 8), np.int32), np.zeros((2, 6),
                                                                  np.int32)),
             local_window_size=3, logits_soft_cap=2.0, scale=1)
  assert out.shape == Q.shape
