"""jax_ring inside the attention layers of two model families, against
transformers' own modules: gpt-oss (learned sinks, a sliding window on
alternate layers, q/k/v/o biases, GQA) and DeepSeek-V3 (multi-head latent
attention: low-rank q and kv, a rope/no-rope split of the head, a query-key
head dim of 24 and a value head dim of 16, YaRN's softmax scale).

Each layer is written here in jnp from the module's own weights, with
``jax_ring.dot_product_attention`` as its attention, and compared with the
module run by transformers' eager attention (its float32 weights, in
float64 arithmetic) on the mask the model builds for that layer and the
cos/sin of the model's rotary class: the output and the gradient of
``sum(out * cotangent)`` with respect to the hidden states and every
weight (the sinks' included), on one device and under ``jax.jit``
context-parallel on a data=2 x cp=4 mesh, at float32's tolerance.

The semantics matched here, read from transformers:
* a sliding window ``W`` lets query ``i`` see keys ``i - W < j <= i``
  (``masking_utils.sliding_window_overlay``): ``local_window_size=(W-1,
  0)``, checked against the mask itself;
* a gpt-oss sink is one more logit per head in every row's softmax, not
  scaled, with no value: ``sinks=``;
* DeepSeek-V3's scale is ``qk_head_dim ** -0.5`` times YaRN's
  ``mscale(factor, mscale_all_dim) ** 2``: ``scale=``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec as P
from transformers import masking_utils
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.gpt_oss import modeling_gpt_oss

import jax_ring
import reference as ref
from helpers import collectives

B, S, D = 2, 32, 48  # S divisible by 2 * cp for the dual-chunk layout
CP = 4
# gpt-oss's sliding_window (layer 0; layer 1 is full): it spans three of the
# 4-token chunks of a 4-way dual-chunk split.
WINDOW = 11


def gpt_oss():
  config = transformers.GptOssConfig(
      hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, sliding_window=WINDOW, num_hidden_layers=2,
      num_local_experts=2, num_experts_per_tok=1, intermediate_size=16,
      vocab_size=8)
  assert config.layer_types[0] == "sliding_attention"
  return (config, modeling_gpt_oss.GptOssAttention,
          modeling_gpt_oss.GptOssRotaryEmbedding)


def deepseek_v3():
  config = transformers.DeepseekV3Config(
      hidden_size=D, num_attention_heads=4, num_key_value_heads=4,
      q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=16,
      qk_rope_head_dim=8, v_head_dim=16, attention_bias=True,
      num_hidden_layers=1, first_k_dense_replace=1, intermediate_size=16,
      moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1,
      n_group=1, topk_group=1, vocab_size=8, max_position_embeddings=4 * 16,
      rope_parameters=dict(
          rope_type="yarn", rope_theta=10000.0, factor=4.0,
          original_max_position_embeddings=16, mscale=1.0,
          mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))
  assert config.rope_interleave
  return (config, modeling_deepseek_v3.DeepseekV3Attention,
          modeling_deepseek_v3.DeepseekV3RotaryEmbedding)


MODELS = {"gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3}


# -- the layers in jnp -----------------------------------------------------

def linear(p, name, x):
  y = x @ p[name + ".weight"].T
  return y + p[name + ".bias"] if name + ".bias" in p else y


def rms_norm(x, weight, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * weight


def rotate(x1, x2, cos, sin):
  """The pair (x1, x2) rotated by the angle whose cos/sin are given
  (B, S, H/2), over every head."""
  cos, sin = cos[:, :, None], sin[:, :, None]
  return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def gpt_oss_layer(module, p, x, cos, sin, cp):
  """GptOssAttention.forward. Its rope rotates the halves of the head
  (dims i and i + H/2) and its cos/sin are H/2 wide."""
  b, s, _ = x.shape
  h = module.head_dim
  q, k, v = (linear(p, name, x).reshape(b, s, -1, h)
             for name in ("q_proj", "k_proj", "v_proj"))
  q, k = (jnp.concatenate(rotate(y[..., :h // 2], y[..., h // 2:], cos, sin),
                          -1) for y in (q, k))
  window = module.sliding_window
  out = jax_ring.dot_product_attention(
      q, k, v, is_causal=True, scale=module.scaling, sinks=p["sinks"],
      local_window_size=None if window is None else (window - 1, 0),
      implementation="xla", context_parallel=cp)
  return linear(p, "o_proj", out.reshape(b, s, -1))


def deepseek_v3_layer(module, p, x, cos, sin, cp):
  """DeepseekV3Attention.forward with q_lora and ``rope_interleave``: the
  rope rotates the pairs (2i, 2i + 1) and writes them back as halves, on
  the first half of the model's (doubled) cos/sin."""
  b, s, _ = x.shape
  n, nope, rope = (module.num_heads, module.qk_nope_head_dim,
                   module.qk_rope_head_dim)
  q = linear(p, "q_b_proj", rms_norm(
      linear(p, "q_a_proj", x), p["q_a_layernorm.weight"],
      module.q_a_layernorm.variance_epsilon)).reshape(b, s, n, nope + rope)
  latent, k_rot = jnp.split(linear(p, "kv_a_proj_with_mqa", x),
                            [module.kv_lora_rank], -1)
  latent = rms_norm(latent, p["kv_a_layernorm.weight"],
                    module.kv_a_layernorm.variance_epsilon)
  cos, sin = cos[..., :rope // 2], sin[..., :rope // 2]
  interleaved = lambda y: jnp.concatenate(
      rotate(y[..., 0::2], y[..., 1::2], cos, sin), -1)
  q = jnp.concatenate([q[..., :nope], interleaved(q[..., nope:])], -1)
  k_rot = interleaved(k_rot[:, :, None])  # one rope key, shared by the heads
  k_nope, v = jnp.split(linear(p, "kv_b_proj", latent).reshape(b, s, n, -1),
                        [nope], -1)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (b, s, n, rope))], -1)
  out = jax_ring.dot_product_attention(  # value's head dim is not key's
      q, k, v, is_causal=True, scale=module.scaling, implementation="xla",
      context_parallel=cp)
  return linear(p, "o_proj", out.reshape(b, s, -1))


LAYERS = {"gpt_oss": gpt_oss_layer, "deepseek_v3": deepseek_v3_layer}


# -- transformers' side ----------------------------------------------------

def hf_case(name, layer_idx=0, seed=0):
  """A random layer, random hidden states and cotangent, and transformers'
  result in float64: (module, params (float32 jnp), x, ct, cos, sin, out,
  grads {"x": dx, param name: dparam})."""
  config, attention, rotary = MODELS[name]()
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  module = attention(config, layer_idx).eval()
  with torch.no_grad():
    for pname, w in module.named_parameters():
      if pname.endswith("layernorm.weight"):
        w.copy_(1.0 + 0.2 * torch.randn_like(w))
      elif pname == "sinks":  # around the logits' scale: a real share
        w.copy_(torch.randn_like(w))
      else:
        w.copy_(0.2 * torch.randn_like(w))
  params = {k: jnp.asarray(w.detach().numpy())
            for k, w in module.named_parameters()}
  x = torch.randn(B, S, D)
  ct = torch.randn(B, S, D)
  positions = torch.arange(S)[None].expand(B, S)
  cos, sin = rotary(config)(x, positions)  # float32, as the model has them

  module.double()
  x64 = x.double().requires_grad_()
  make_mask = (masking_utils.create_sliding_window_causal_mask
               if getattr(module, "sliding_window", None)
               else masking_utils.create_causal_mask)
  mask = make_mask(config=config, inputs_embeds=x64, attention_mask=None,
                   cache=None, position_ids=positions)
  out, _ = module(x64, position_embeddings=(cos.double(), sin.double()),
                  attention_mask=mask)
  (out * ct.double()).sum().backward()
  grads = {"x": x64.grad.numpy()}
  grads.update((k, w.grad.numpy()) for k, w in module.named_parameters())
  as_jnp = lambda t: jnp.asarray(t.numpy())
  return (module, params, as_jnp(x), as_jnp(ct), as_jnp(cos), as_jnp(sin),
          out.detach().numpy(), grads)


def check(got_out, got_grads, want_out, want_grads):
  """Output, d hidden states and every weight's gradient at float32's
  tolerance (``reference.TOLERANCES``)."""
  ref.assert_close(got_out, want_out, jnp.float32, "out")
  for k, want in want_grads.items():
    ref.assert_close(got_grads[k], want, jnp.float32, "d" + k)


def value_and_grads(layer, module, cp):
  """``f(params, x, cos, sin, ct) -> out, {"x": dx, name: dparam}``,
  jitted: one compile for the output and every gradient."""
  def f(params, x, cos, sin, ct):
    out, vjp = jax.vjp(lambda p, x: layer(module, p, x, cos, sin, cp),
                       params, x)
    d_params, dx = vjp(ct)
    return out, d_params | {"x": dx}
  return jax.jit(f)


# -- the tests -------------------------------------------------------------

def test_semantics_read_from_transformers():
  """transformers' sliding mask for W is (W - 1, 0) in jax_ring's terms;
  DeepSeek-V3's scale carries YaRN's mscale squared."""
  config, _, _ = gpt_oss()
  config._attn_implementation = "eager"
  mask = masking_utils.create_sliding_window_causal_mask(
      config=config, inputs_embeds=torch.zeros(1, S, D), attention_mask=None,
      cache=None)
  i, j = np.arange(S)[:, None], np.arange(S)[None]
  np.testing.assert_array_equal(mask[0, 0].numpy() == 0,
                                (j <= i) & (j >= i - (WINDOW - 1)))
  config, attention, _ = deepseek_v3()
  mscale = 0.1 * np.log(4.0) + 1.0  # yarn_get_mscale(factor, mscale_all_dim)
  np.testing.assert_allclose(attention(config, 0).scaling,
                             24**-0.5 * mscale**2, rtol=1e-12)


# gpt-oss's full layer with -m slow: its code is the sliding layer's, and a
# layer with no window is DeepSeek-V3's.
@pytest.mark.parametrize("name, layer_idx", [
    pytest.param("gpt_oss", 0, id="gpt_oss_sliding"),
    pytest.param("gpt_oss", 1, id="gpt_oss_full", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 0, id="deepseek_v3")])
def test_one_device_matches_transformers(name, layer_idx):
  module, params, x, ct, cos, sin, want, want_grads = hf_case(name, layer_idx)
  out, grads = value_and_grads(LAYERS[name], module, None)(params, x, cos,
                                                           sin, ct)
  check(out, grads, want, want_grads)


# gpt-oss under auto in the default run, the rest with -m slow (the ring
# with sinks and a window, forward and gradients, in the default run:
# test_flax.py's test_context_parallel_layer_equals_single_device
# [ring_packed_window_cap_sinks]; DeepSeek-V3's value head dim split over
# devices: test_value_head_dim.py's test_ring_moves_k_and_v_apart).
@pytest.mark.parametrize("name, strategy", [
    pytest.param(name, strategy, marks=() if (name, strategy) == (
        "gpt_oss", "auto") else pytest.mark.slow)
    for strategy in ("ring", "auto") for name in MODELS])
def test_context_parallel_under_jit_matches_transformers(name, strategy):
  """data=2 x cp=4, the hidden states and the rope's cos/sin in the
  dual-chunk layout; weights replicated. gpt-oss: its sliding layer."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  module, params, x, ct, cos, sin, want, want_grads = hf_case(name)
  mesh = jax.make_mesh((2, CP), ("data", "cp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  place = lambda a: jax.device_put(jax_ring.reorder_for_load_balance(a, CP),
                                   NamedSharding(mesh, P("data", "cp")))
  f = value_and_grads(LAYERS[name], module, jax_ring.ContextParallel(
      axis="cp", strategy=strategy, inputs="load_balanced"))
  args = (params, *map(place, (x, cos, sin, ct)))
  with jax.set_mesh(mesh):
    compiled = f.lower(*args).compile()
    out, grads = compiled(*args)
  # The attention ran on the shards: the ring passes K/V blocks (or their
  # gradients) between neighbours; auto picks its own collectives.
  ops = collectives(compiled.as_text())
  seq_ops = ops["collective-permute"] + (
      0 if strategy == "ring" else ops["all-to-all"] + ops["all-gather"])
  assert seq_ops > 0, ops
  back = lambda a: jax_ring.reorder_from_load_balance(a, CP)
  check(back(out), grads | {"x": back(grads["x"])}, want, want_grads)
