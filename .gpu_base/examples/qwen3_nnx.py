"""The dense Qwen3 decoder of `examples/qwen3.py`, written with `flax.nnx`.

Same architecture, config (`qwen3.Qwen3Config`, `qwen3.get_config`) and pipeline
annotations: the blocks are grouped into `n_stages` ``pj.annotate("PP")`` regions,
the embedding joins the first region and the final norm, head and loss the last.

piper-jax trains a pure function of a parameter pytree, and an NNX model becomes one
with `nnx.split`:

    graphdef, state = nnx.split(model)          # or `init(config, rng)`
    step = pj.compile(loss_fn(graphdef), tx, directives, state, batch)
    state = step.params(train_state)            # an nnx.State again
    nnx.update(model, state)                    # back into the module

`loss_fn(graphdef)(state, batch)` rebuilds the module inside the trace with
`nnx.merge(graphdef, state)` and runs it. `nnx.State` is a registered pytree whose
leaves are the parameter arrays (`Param` variables flatten to their values), so
`pj.compile`, `step.init` and `step.params` take and return it unchanged; no
conversion to a plain dict is needed. The state must hold only parameters: a module
that keeps `nnx.Rngs` (dropout) would put integer RNG counters and keys in it, so
split those off (`nnx.split(model, nnx.Param, ...)`) and pass only the `Param` state.

Tensor parallelism is not wired here: piper-jax reads Flax linen's partitioning boxes
(`nn.with_partitioning`); use `examples/qwen3.py` with `tp_axis` for `pj.shard_tensor`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import piper_jax as pj

try:
  from examples.qwen3 import (INIT_STD, Qwen3Config, apply_rope, causal_attention,
                              get_config, random_batch, rope_tables)
except ImportError:  # run from examples/ as a script
  from qwen3 import (INIT_STD, Qwen3Config, apply_rope, causal_attention, get_config,
                     random_batch, rope_tables)

__all__ = ["Qwen3", "get_config", "init", "loss_fn", "random_batch"]

_List = getattr(nnx, "List", list)  # flax >= 0.12 wants module lists wrapped


def _linear(cfg: Qwen3Config, n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=nnx.initializers.normal(INIT_STD), rngs=rngs)


def _norm(cfg: Qwen3Config, n: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(n, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     rngs=rngs)


class Attention(nnx.Module):
  """Causal grouped-query attention with QK-norm and rotary embeddings."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hd = cfg.d_model, cfg.head_dim
    self.q = _linear(cfg, d, cfg.n_heads * hd, rngs)
    self.k = _linear(cfg, d, cfg.n_kv_heads * hd, rngs)
    self.v = _linear(cfg, d, cfg.n_kv_heads * hd, rngs)
    self.o = _linear(cfg, cfg.n_heads * hd, d, rngs)
    self.q_norm, self.k_norm = _norm(cfg, hd, rngs), _norm(cfg, hd, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    b, t, _ = x.shape
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = self.q_norm(self.q(x).reshape(b, t, h, hd))
    k = self.k_norm(self.k(x).reshape(b, t, kv, hd))
    v = self.v(x).reshape(b, t, kv, hd)
    cos, sin = rope_tables(t, hd, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = causal_attention(cfg, q, k, v)
    return self.o(y.reshape(b, t, h * hd))


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    self.gate = _linear(cfg, cfg.d_model, cfg.intermediate, rngs)
    self.up = _linear(cfg, cfg.d_model, cfg.intermediate, rngs)
    self.down = _linear(cfg, cfg.intermediate, cfg.d_model, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    self.input_norm, self.post_attn_norm = _norm(cfg, cfg.d_model, rngs), _norm(cfg, cfg.d_model,
                                                                                rngs)
    self.attn, self.mlp = Attention(cfg, rngs=rngs), MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.input_norm(x))
    return x + self.mlp(self.post_attn_norm(x))


def _run(block: Block, x: jax.Array) -> jax.Array:
  return block(x)


class Qwen3(nnx.Module):
  """Dense Qwen3 decoder: tokens [B, T] -> logits [B, T, vocab]."""

  def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype,
                           embedding_init=nnx.initializers.normal(INIT_STD), rngs=rngs)
    self.blocks = _List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
    self.final_norm = _norm(cfg, cfg.d_model, rngs)
    self.head = None if cfg.tie_embeddings else _linear(cfg, cfg.d_model, cfg.vocab_size, rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for first, end in self.cfg.stage_bounds:
      with pj.annotate("PP"):
        for i in range(first, end):
          x = (nnx.remat(_run)(self.blocks[i], x) if self.cfg.remat else self.blocks[i](x))
    x = self.final_norm(x)
    return self.embed.attend(x) if self.head is None else self.head(x)


def init(config: Qwen3Config, rng: jax.Array | int = 0) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, state) of a fresh model: `nnx.split(Qwen3(config, rngs=nnx.Rngs(rng)))`."""
  return nnx.split(Qwen3(config, rngs=nnx.Rngs(rng)))


def loss_fn(graphdef: nnx.GraphDef) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
  """`loss(state, batch)`: mean token cross-entropy in float32 of the model
  `nnx.merge(graphdef, state)`; `state` is what `nnx.split` gave (or its trained copy)."""

  def loss(state, batch):
    model = nnx.merge(graphdef, state)
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]).mean()

  return loss
