"""Tiny transformers configurations of every family jax_ring.models reads,
and what tests against transformers share: its logits, its loss and
gradients per packed document, packed rows, the 2 x 4 mesh."""

import jax
import numpy as np
import torch
import transformers

from helpers import TOLERANCE, relative_error

V = 97
# float32 gradients against torch's, relative to each weight's largest.
GRAD_TOLERANCE = 2e-5
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=80,
              num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2)
NEW = COMMON | dict(num_attention_heads=4)
CONFIGS = {
    # Llama 3's frequency scaling, with wavelengths on both sides of its
    # cut-offs at these positions (original context 16).
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16)),
    # q/k/v biases and tied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(**COMMON,
                                              tie_word_embeddings=True),
    # A sliding window shorter than the sequence.
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=9,
                                                  head_dim=8),
    # The families with per-layer windows: 4 query heads (2 kv), so that
    # Ulysses splits them over context=4; one sliding layer (window 9, the
    # documents up to 19 tokens and a whole row of 64) and one global.
    # Qwen3: q/k norms, an explicit head_dim.
    "qwen3": lambda: transformers.Qwen3Config(
        **NEW, head_dim=12, use_sliding_window=True, sliding_window=9,
        layer_types=["sliding_attention", "full_attention"]),
    # Soft caps small enough to bite on these logits (Gemma 2's own are 50
    # and 30), a softmax scale from query_pre_attn_scalar, sandwich norms,
    # (1 + w) norms, the embedding times sqrt(E), GeLU-tanh, tied.
    "gemma2": lambda: transformers.Gemma2Config(
        **NEW, head_dim=16, query_pre_attn_scalar=12, sliding_window=9,
        attn_logit_softcapping=4.0, final_logit_softcapping=5.0),
    # Gemma 2's block with q/k norms, no caps, and a RoPE per layer type:
    # linear scaling on the global layer, its own base on the local one.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **NEW, head_dim=16, query_pre_attn_scalar=12, sliding_window=9,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0,
                                rope_theta=100_000.0),
            sliding_attention=dict(rope_type="default", rope_theta=1e4))),
}
NEW_FAMILIES = ("qwen3", "gemma2", "gemma3")


def mesh_2x4():
  return jax.make_mesh((2, 4), ("data", "context"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def assert_logits_close(got, want, where=None):
  """Within 1e-4 of transformers' logits, absolute, and within TOLERANCE
  of the largest (3e-6 and 8e-7 seen)."""
  err = float(np.abs(np.asarray(got) - want).max())
  assert err <= 1e-4, (err, where)
  assert relative_error(got, want) <= TOLERANCE, where


def hf_logits(model, tokens, positions=None):
  with torch.no_grad():
    pos = None if positions is None else torch.tensor(positions)
    return model(torch.tensor(tokens), position_ids=pos).logits.numpy()


def packed_rows(seed, b, s):
  """(tokens, segment ids from 1, [(row, start, stop)] documents): odd
  document lengths, crossing the shards of a 4-way dual-chunk split."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (b, s))
  ids = np.zeros((b, s), np.int32)
  docs = []
  for row in range(b):
    start, doc = 0, 1
    while start < s:
      stop = min(s, start + (int(rng.integers(5, 20)) | 1))
      ids[row, start:stop] = doc
      docs.append((row, start, stop))
      start, doc = stop, doc + 1
  return tokens, ids, docs


def packed_batch(seed):
  """Two rows of 64 tokens: row 0 packed documents, row 1 one document
  (unpacked: longer than every window, across every shard)."""
  tokens, ids, docs = packed_rows(seed, 2, 64)
  ids[1] = 1
  docs = [d for d in docs if d[0] == 0] + [(1, 0, 64)]
  return tokens, ids, docs


def torch_loss_and_grads(hf, tokens, docs):
  """transformers' mean next-token cross-entropy over the documents, each
  run on its own, and its gradients by tensor name."""
  hf.zero_grad()
  total, count = 0.0, 0
  for row, start, stop in docs:
    x = torch.tensor(tokens[row:row + 1, start:stop])
    logits = hf(x).logits[0]
    total = total + torch.nn.functional.cross_entropy(
        logits[:-1], x[0, 1:], reduction="sum")
    count += stop - start - 1
  loss = total / count
  loss.backward()
  grads = {k: p.grad.numpy() for k, p in hf.named_parameters()
           if p.grad is not None}  # frozen ones have none
  return float(loss.detach()), grads
