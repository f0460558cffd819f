"""A mixture-of-experts GPT (Qwen3-MoE style) in Flax linen, for expert parallelism.

Each block's MLP is a top-k routed mixture of experts: a router picks `top_k` of
`n_experts` experts per token (probabilities renormalised over the chosen ones),
tokens are dispatched into an `[experts, capacity, d_model]` buffer, the experts
run on it, and the results are combined back with the router weights; an optional
shared expert sees every token.

The contract with `pj.shard`: the expert computation, and only it, runs inside
``pj.annotate("EP")``, on tokens already dispatched to `[experts, capacity,
d_model]`, with weights that have a leading expert axis; experts never mix inside
it. The compiler then keeps 1/n of the experts on each of n devices and moves the
dispatched tokens by all-to-all before and after the region. The router, dispatch
and combine stay outside (in the block's PP region).

`capacity_factor=None` is dropless (each expert can take every token), so the
result does not depend on how the batch is grouped: the tests compare it with one
device. With a factor, capacity is ceil(factor * tokens * top_k / n_experts) per
group of tokens a device routes, and tokens over it are dropped.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

import piper_jax as pj

try:
  from examples.gpt import GPT, MLP, Block, GPTConfig, _dense_init
except ImportError:  # run from examples/ as a script
  from gpt import GPT, MLP, Block, GPTConfig, _dense_init

__all__ = ["MoEConfig", "MoEGPT", "PRESETS", "flops_per_token", "get_config"]


@dataclasses.dataclass(frozen=True)
class MoEConfig(GPTConfig):
  """GPT hyperparameters plus the experts'.

  Attributes:
    n_experts: experts per MoE layer.
    top_k: experts per token.
    capacity_factor: expert buffer size relative to an even split; None = dropless.
    shared_expert: add a dense MLP every token goes through (Qwen2-MoE / DeepSeek).
    (the others as in `GPTConfig`; `mlp_ratio` sizes each expert's hidden layer)
  """

  n_experts: int = 4
  top_k: int = 2
  capacity_factor: float | None = None
  shared_expert: bool = False


PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4),
    # The Piper paper's "1B" MoE: 16 layers, d_model 1024, 16 heads, 4 experts top-2, seq 512.
    "1b": dict(vocab_size=32768, seq_len=512, d_model=1024, n_layers=16, n_heads=16,
               capacity_factor=1.25),
}


def get_config(name: str, **overrides) -> MoEConfig:
  """The preset `name` ("tiny", "1b") with `overrides` applied."""
  if name not in PRESETS:
    raise ValueError(f"unknown MoE preset {name!r}; choose one of {list(PRESETS)}")
  return MoEConfig(**{**PRESETS[name], **overrides})


class Experts(nn.Module):
  """The experts' MLPs on dispatched tokens [experts, capacity, d_model] (the EP region)."""

  config: MoEConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    e, d, f = cfg.n_experts, cfg.d_model, cfg.mlp_ratio * cfg.d_model
    w_in = self.param("w_in", _dense_init(0.02), (e, d, f), cfg.param_dtype)
    w_out = self.param("w_out", _dense_init(0.02 / math.sqrt(2 * cfg.n_layers)), (e, f, d),
                       cfg.param_dtype)
    with pj.annotate("EP"):
      h = nn.gelu(jnp.einsum("ecd,edf->ecf", x, w_in.astype(cfg.dtype)))
      return jnp.einsum("ecf,efd->ecd", h, w_out.astype(cfg.dtype))


class MoE(nn.Module):
  """Top-k routing, dispatch, experts, combine; tokens [B, T, d] -> [B, T, d]."""

  config: MoEConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    b, t, d = x.shape
    n, e, k = b * t, cfg.n_experts, cfg.top_k
    tokens = x.reshape(n, d)
    logits = nn.Dense(e, use_bias=False, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                      kernel_init=_dense_init(0.02), name="router")(tokens)
    top_p, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    cap = n if cfg.capacity_factor is None else max(1, math.ceil(cfg.capacity_factor * n * k / e))
    chosen = jax.nn.one_hot(top_i, e, dtype=jnp.int32)                         # [n, k, e]
    # Slot of each (token, choice) in its expert's buffer, in token order.
    slot = (jnp.cumsum(chosen.reshape(n * k, e), axis=0).reshape(n, k, e) - 1) * chosen
    kept = chosen * (slot < cap)
    place = jax.nn.one_hot(slot, cap, dtype=x.dtype) * kept[..., None].astype(x.dtype)
    dispatch = jnp.sum(place, axis=1)                                          # [n, e, cap]
    combine = jnp.sum(place * top_p[..., None, None].astype(x.dtype), axis=1)
    routed = jnp.einsum("nec,nd->ecd", dispatch, tokens)
    out = jnp.einsum("nec,ecd->nd", combine, Experts(cfg, name="experts")(routed))
    out = out.reshape(b, t, d)
    if cfg.shared_expert:
      out = out + MLP(cfg, name="shared")(x)
    return out


class MoEBlock(Block):
  """Pre-LN transformer block with an MoE MLP."""

  mlp_cls = MoE


class MoEGPT(GPT):
  """Decoder-only MoE transformer: tokens [B, T] -> logits [B, T, vocab].

  Blocks are grouped into `n_stages` ``pj.annotate("PP")`` regions as in `GPT`;
  each block's experts are a ``pj.annotate("EP")`` region inside its stage.
  """

  config: MoEConfig
  block_cls = MoEBlock


def flops_per_token(config: MoEConfig) -> float:
  """Training FLOPs per token (6 N_active + attention), counting top_k experts per token."""
  d, L = config.d_model, config.n_layers
  per_block = 4 * d * d + config.top_k * 2 * config.mlp_ratio * d * d + d * config.n_experts
  if config.shared_expert:
    per_block += 2 * config.mlp_ratio * d * d
  return 6.0 * (L * per_block + d * config.vocab_size) + 12.0 * L * d * config.seq_len
