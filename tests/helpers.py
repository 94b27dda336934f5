"""What the test modules share (none imports another): shapes, meshes,
coded inputs, the way a strategy runs on a simulated mesh, and the checks
against the float64 reference (``reference.py``), for the context-parallel
strategies, the block kernel and the models."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ring
import reference as ref
from jax_ring._src.core import kernel

# -- the context-parallel tests: shapes, meshes, inputs --------------------

B, S, N, K, H = 2, 48, 4, 2, 16  # S divisible by 2 * cp for cp in 2, 4, 8
# coded_qkv's N = 8 query heads, split over cp in 2, 4, 8 by Ulysses.
CODED_HEADS = 8
SPEC = P(None, "cp")

# Test ids of the (cp, causal, load_balance) matrices.
case_id = lambda x: {None: "contiguous", True: "causal", False: "full"}.get(
    x, str(x))


def lowering_for_gpus(shape=(1,), names=("x",)):
  """A context in which programs trace and lower for CUDA as on NVIDIA
  GPUs, on any machine: an abstract mesh of ``shape`` over ``names`` (Auto
  axes) whose devices are H100s, from which Pallas' Triton lowering reads
  the GPU where none is attached (jax 0.11 reads no other)."""
  gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100",
                                    num_cores=None, platform="cuda")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
      abstract_device=gpu))


def mesh(cp):
  if len(jax.devices()) < cp:
    pytest.skip(f"needs {cp} devices")
  return Mesh(np.array(jax.devices()[:cp]), ("cp",))


def rank_coded_qkv(seed, cp, kv_heads=K, load_balance=None):
  """Random q, k, v, dout (natural order) with the tokens device r holds
  under ``load_balance`` shifted by r / 2, so that a shard landing on the
  wrong device changes the numbers."""
  q, k, v, do = ref.random_qkv(seed, B, S, S, N, kv_heads, H)
  code = ref.shard_code(S, cp, load_balance)
  return q + code, k - code, v + code, do


def coded_qkv(seed, cp, kv_heads, n=CODED_HEADS):
  """Random q, k, v, dout; each of the 2 * cp sequence chunks and each head
  shifted by its own constant, so that a token or head landing in the wrong
  place changes the numbers."""
  q, k, v, do = ref.random_qkv(seed, B, S, S, n, kv_heads, H)
  chunk = (jnp.arange(S) // (S // (2 * cp)) * 0.25)[None, :, None, None]
  head = lambda m: (jnp.arange(m) * 0.1)[None, None, :, None]
  return q + chunk + head(n), k - chunk + head(kv_heads), v + chunk, do


# -- running a strategy on a simulated mesh --------------------------------

def layout_vjp(f, cp, load_balance, q, k, v, do, *extra):
  """``out, (dq, dk, dv)`` of ``f(q, k, v, *extra)`` for global inputs in
  natural order: they enter the load-balance layout, results leave it."""
  to = lambda x: (jax_ring.reorder_for_load_balance(
      x, cp, layout=load_balance) if load_balance else x)
  back = lambda x: (jax_ring.reorder_from_load_balance(
      x, cp, layout=load_balance) if load_balance else x)

  @jax.jit
  def go(q, k, v, do, *extra):
    extra = [to(x) for x in extra]
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, *extra), to(q), to(k),
                       to(v))
    return back(out), tuple(back(g) for g in vjp(to(do)))

  return go(q, k, v, do, *extra)


def run_shard_map(attention, q, k, v, do, cp, **kw):
  """Global inputs in natural order -> ``attention`` (a strategy's
  ``*_attention``, xla blocks) on a 1-D cp mesh -> global output and grads.
  Padding lengths (global, replicated) are closed over."""
  spec = P(None, "cp")
  f = jax.shard_map(
      lambda q, k, v: attention(q, k, v, axis_name="cp", implementation="xla",
                                **kw),
      mesh=mesh(cp), in_specs=(spec,) * 3, out_specs=spec)
  return layout_vjp(f, cp, kw.get("load_balance"), q, k, v, do)


def collectives(hlo):
  """How many of each collective a compiled program runs."""
  ops = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute",
         "all-to-all")
  return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in ops}


def check(got, q, k, v, do, case, lse=None):
  """Output, grads (and ``lse``, where given) against the float64
  reference, at q's tolerance."""
  out, (dq, dk, dv) = got
  r_out, r_lse, g = ref.attention(q, k, v, case, dout=do)
  ref.assert_close(out, r_out, q.dtype, "out")
  if lse is not None:
    ref.assert_close(lse, r_lse, q.dtype, "lse")
  for name, grad in (("q", dq), ("k", dk), ("v", dv)):
    ref.assert_close(grad, g[name], q.dtype, "d" + name)


# -- the block kernel ------------------------------------------------------

TILES = dict(block_q=16, block_kv=8)


def document_ids(seed, b, t, docs):
  """``(B, T)`` segment ids of ``docs`` random documents a row (``t``:
  every token its own; None: no ids)."""
  if docs is None:
    return None
  if docs == t:
    return np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  return ref.random_segments(seed, b, t, docs)


def check_public_call(cpc, mesh, shape, *, t, s, docs, seed, eager=False,
                      spec=None, pair=False, **kw):
  """Forward and gradients of ``jax_ring.dot_product_attention`` on
  natural-order arrays of ``shape = (B, N, K, H[, Hv])`` at query and key
  lengths ``t``, ``s`` (plain under ``jax.set_mesh``, or placed by
  ``spec`` along the sequence) against the float64 reference. ``docs``:
  documents a row (None: no segment ids; ``t``: every token its own);
  ``pair``: the ids as a (query, key) pair; ``kw``: more of the call's
  options, in the reference's terms too (``local_window_size``, ``is_causal``,
  ``key_value_seq_lengths``, ``sinks``)."""
  b, n, kh, h, *hv = shape
  q, k, v, do = ref.random_qkv(seed, b, t, s, n, kh, h,
                               hv=hv[0] if hv else None)
  ids = document_ids(seed, b, t, docs)
  causal = kw.pop("is_causal", True)
  window = kw.get("local_window_size")
  case = ref.Case(h**-0.5, is_causal=causal, q_segment_ids=ids,
                  kv_segment_ids=ids,
                  kv_lengths=kw.get("key_value_seq_lengths"),
                  window=None if window is None else tuple(window))
  want, _, g = ref.attention(q, k, v, case, dout=do, sinks=kw.get("sinks"))

  put = (lambda x: jnp.asarray(x)) if spec is None else (
      lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)))

  def f(q, k, v, *sinks):
    seg = None if ids is None else (put(ids), put(ids)) if pair else put(ids)
    return jax_ring.dot_product_attention(
        q, k, v, is_causal=causal, segment_ids=seg, context_parallel=cpc,
        **(kw | ({"sinks": sinks[0]} if sinks else {})))

  args = tuple(map(put, (q, k, v))) + ((kw["sinks"],) if "sinks" in kw
                                       else ())
  with jax.set_mesh(mesh):
    vjp = lambda *a: jax.vjp(f, *a)
    out, back = (vjp if eager else jax.jit(vjp))(*args)
    grads = back(put(do))
  ref.assert_close(out, want, jnp.float32, "out")
  for name, x in zip(("q", "k", "v", "sinks"), grads):
    ref.assert_close(x, g[name], jnp.float32, "d" + name)


def run_kernel(q, k, v, do, case, bias=None, dlse=None, **tiles):
  """jax_ring forward and vjp through the contract, jitted."""
  cfg = ref.config(case, **(tiles or TILES))
  mask = ref.block_mask(case)

  @jax.jit
  def f(q, k, v, bias, mask):
    (out, lse), vjp = jax.vjp(
        lambda q, k, v, bias: kernel.attention(q, k, v, bias, mask, cfg),
        q, k, v, bias)
    cts = (do, jnp.zeros_like(lse) if dlse is None else dlse)
    return out, lse, vjp(cts)

  return f(q, k, v, bias, mask)


def check_kernel(q, k, v, do, case, *, bias=None, dlse=None, **tiles):
  """The kernel's output, lse and grads (and dbias) against the float64
  reference; returns ``(out, lse)``."""
  out, lse, (dq, dk, dv, dbias) = run_kernel(q, k, v, do, case, bias, dlse,
                                             **tiles)
  r_out, r_lse, r_g = ref.attention(q, k, v, case, bias=bias, dout=do,
                                    dlse=dlse)
  dt = q.dtype
  ref.assert_close(out, r_out, dt, "out")
  # lse is float32 whatever the input dtype; its error follows the logits'.
  ref.assert_close(lse, r_lse, dt, "lse")
  ref.assert_close(dq, r_g["q"], dt, "dq")
  ref.assert_close(dk, r_g["k"], dt, "dk")
  ref.assert_close(dv, r_g["v"], dt, "dv")
  if bias is not None:
    ref.assert_close(dbias, r_g["bias"], dt, "dbias")
  return out, lse


# -- the models ------------------------------------------------------------

TOLERANCE = 1e-4  # float32 logits, relative to max |logit|


def relative_error(got, want):
  return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def prepared_passes(monkeypatch, name="cudnn") -> list:
  """The passes, "forward" or "backward", whose operands backend ``name``
  (as registered now) prepared ahead of a block (``kernel.prepare``
  returned something), listed as the calls are traced."""
  import dataclasses
  from jax_ring._src.core import registry
  backend, seen = registry.BACKENDS[name], []

  def spy(q, k, v, mask, config, lse):
    got = backend.prepare(q, k, v, mask, config, lse)
    if got is not None:
      seen.append("forward" if lse is None else "backward")
    return got

  monkeypatch.setitem(registry.BACKENDS, name,
                      dataclasses.replace(backend, prepare=spy))
  return seen


def cudnn_blocks_on_the_cpu(monkeypatch):
  """Strategies' blocks on the cudnn backend on the CPU, as on a GPU: no
  option refused, the backend registered (its FFI handlers: whatever the
  test puts in their place), with what it prepares ahead of a block."""
  from jax_ring._src.backends import cudnn
  from jax_ring._src.core import registry
  monkeypatch.setattr(cudnn, "unsupported", lambda *_: None)
  monkeypatch.setitem(registry.BACKENDS, "cudnn", registry.Backend(
      "cudnn", cudnn.forward, cudnn.backward, lambda *_: None,
      prepare=cudnn.prepare))
