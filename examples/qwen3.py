"""Qwen3 and Qwen3-MoE shaped decoders in Flax linen, annotated for piper-jax.

Qwen3 (dense): pre-norm RMSNorm blocks; grouped-query attention (`n_heads` query
heads sharing `n_kv_heads` key/value heads of `head_dim`) with QK-norm (an RMSNorm
over each head of q and k, before the rotary embedding) and rotary position
embeddings (`rope_theta`, Qwen's rotate-half convention); a SwiGLU MLP
(down(silu(gate(x)) * up(x)), no biases); a final RMSNorm and a head that is the
token embedding when `tie_embeddings` (Qwen3-1.7B) or a separate matrix (Qwen3-8B).
The cross-entropy is computed in float32 whatever `dtype` is.

Qwen3-MoE (`Qwen3MoEConfig`, `Qwen3MoE`): each block's MLP is a top-k routed mixture
of `n_experts` fine-grained SwiGLU experts of width `moe_intermediate`: a softmax
router in float32, the top `top_k` probabilities renormalised (Qwen3's
norm_topk_prob), an optional shared expert every token goes through, and an auxiliary
load-balancing loss (`router_aux_coef` times n_experts * sum_e f_e * P_e, below).

piper-jax annotations, as in `examples/gpt.py`:

* pipeline: the blocks are grouped into `n_stages` ``pj.annotate("PP")`` regions (equal,
  or `stage_layers` blocks each). The embedding is not annotated and joins the first
  region; the final norm, head and loss join the last. Parameter names do not depend
  on `n_stages` (``block_0`` ... at the top level).
* tensor parallel: with `tp_axis` set, q/k/v/gate/up kernels carry the partitioning
  names (None, tp) (column parallel, heads outermost) and o/down (tp, None) (row
  parallel): Megatron's layout, which `pj.shard_tensor(..., axis=tp_axis)` splits.
  Query heads h*G .. h*G+G-1 use key/value head h, so halving both head lists keeps
  every group on one device (`n_kv_heads` must be divisible by the TP degree).
* expert parallel, `examples/moe.py`'s contract: the expert computation, and only
  it, runs inside ``pj.annotate("EP")`` on tokens already dispatched to
  [experts, capacity, d_model], with weights that have a leading expert axis. Router,
  dispatch and combine stay in the block's PP region.

Dispatch here is by gather/scatter of token indices rather than `examples/moe.py`'s
one-hot einsums: those build [tokens, top_k, experts, capacity] arrays, which at
Qwen3-30B-A3B's 128 experts x top-8 are ~10^9 elements per 4k-token microbatch.
`capacity_factor=None` routes dropless (capacity = the tokens a device routes), so
results do not depend on how the batch is grouped, as the tests need.

The load-balancing loss is computed per sequence and averaged over the batch (and
over the layers): f_e is the fraction of the sequence's tokens routed to expert e
(counting each of the top_k choices, as Qwen's `load_balancing_loss_func`, so it is
top_k when balanced), P_e the mean router probability of e over the sequence. Per
sequence makes the loss a mean over the batch's leading axis, which piper-jax
requires of a loss (microbatches and data-parallel replicas average to the batch's
loss); a loss over all tokens of a (micro)batch would depend on how the batch is
split, so no strategy could reproduce one device's numbers.

The running aux loss is carried from block to block beside the hidden states, and
crosses pipeline stage boundaries as a value of its own; dense models carry none, and
MoE models with `router_aux_coef=0` compute none.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import piper_jax as pj

try:
  from examples.gpt import (_dense, _dense_init, causal_attention, check_stages,
                            count_params, stage_bounds)
  from examples.gpt import random_batch as _gpt_random_batch
except ImportError:  # run from examples/ as a script
  from gpt import (_dense, _dense_init, causal_attention, check_stages, count_params,
                   stage_bounds)
  from gpt import random_batch as _gpt_random_batch

__all__ = [
    "PRESETS",
    "Qwen3",
    "Qwen3Config",
    "Qwen3MoE",
    "Qwen3MoEConfig",
    "count_params",
    "flops_per_token",
    "get_config",
    "init_params",
    "loss_fn",
    "make_model",
    "random_batch",
    "rope_tables",
]

INIT_STD = 0.02  # Qwen's initializer_range, for every matrix


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Qwen3 hyperparameters.

  Attributes:
    vocab_size: number of tokens.
    seq_len: sequence length of the batches (`random_batch`, `init_params`).
    d_model: width of the residual stream (Qwen's hidden_size).
    n_layers: number of blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads; must divide n_heads (grouped-query attention).
    head_dim: width of every head (Qwen3: 128, not d_model / n_heads).
    intermediate: SwiGLU hidden width of the dense MLP.
    rope_theta: base of the rotary embedding's frequencies.
    norm_eps: RMSNorm epsilon.
    n_stages, stage_layers: pipeline regions, as in `examples.gpt.GPTConfig`.
    tie_embeddings: use the token embedding as the output head.
    dtype: compute dtype (the loss, router and norms' statistics are float32).
    param_dtype: parameter dtype.
    attention: `jax.nn.dot_product_attention`'s implementation ("xla", "cudnn"), or
      "xla+remat" (`examples.gpt.causal_attention`); None picks cuDNN for bf16/fp16
      on NVIDIA GPUs and XLA elsewhere. "cudnn" on a host without it (planning GPUs
      on a laptop) traces XLA's attention with cuDNN's memory ("xla+remat").
    tp_axis: when set, Megatron partitioning names along this axis (module docstring).
    remat: checkpoint every block (`nn.remat`): its backward recomputes it from its input,
      the one value the forward keeps for it (dense blocks only).
  """

  vocab_size: int
  seq_len: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  intermediate: int
  rope_theta: float = 1e6
  norm_eps: float = 1e-6
  n_stages: int = 1
  stage_layers: tuple[int, ...] | None = None
  tie_embeddings: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention: str | None = None
  tp_axis: str | None = None
  remat: bool = False

  def __post_init__(self):
    check_stages(self)
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding)")

  @property
  def stage_bounds(self) -> list[tuple[int, int]]:
    """[first block, end) of every pipeline region."""
    return stage_bounds(self)


@dataclasses.dataclass(frozen=True)
class Qwen3MoEConfig(Qwen3Config):
  """Qwen3 hyperparameters plus the experts'.

  Attributes:
    n_experts: routed experts per layer.
    top_k: experts per token.
    moe_intermediate: SwiGLU hidden width of each expert.
    shared_intermediate: width of a shared SwiGLU expert every token goes through
      (Qwen2-MoE / DeepSeek style); 0: none (Qwen3-MoE has none).
    norm_topk_prob: renormalise the top_k probabilities to sum to 1 (Qwen3: yes).
    capacity_factor: expert buffer size relative to an even split of the tokens a
      device routes; None = dropless (capacity = all of them).
    router_aux_coef: weight of the load-balancing loss (Qwen3-MoE: 1e-3).
    (`intermediate` is unused: every block's MLP is the mixture.)
  """

  intermediate: int = 0
  n_experts: int = 128
  top_k: int = 8
  moe_intermediate: int = 768
  shared_intermediate: int = 0
  norm_topk_prob: bool = True
  capacity_factor: float | None = None
  router_aux_coef: float = 1e-3

  def __post_init__(self):
    super().__post_init__()
    if not 1 <= self.top_k <= self.n_experts:
      raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
    if self.remat:
      # A checkpointed block is one equation to piper-jax: its EP region would be hidden.
      raise ValueError("remat=True checkpoints whole blocks, which would hide a MoE block's "
                       "EP region; train the MoE without remat")


_VOCAB = 151936  # Qwen3's tokenizer (padded)

PRESETS: dict[str, dict] = {
    # For tests: everything small, 2 layers (one block per stage of a 2-stage pipeline).
    "qwen3-tiny": dict(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4,
                       n_kv_heads=2, head_dim=16, intermediate=128),
    # Qwen3-1.7B (HF config): tied embeddings; 1.72e9 parameters.
    "qwen3-1.7b": dict(vocab_size=_VOCAB, seq_len=4096, d_model=2048, n_layers=28, n_heads=16,
                       n_kv_heads=8, head_dim=128, intermediate=6144, tie_embeddings=True),
    # Qwen3-8B: untied; 8.19e9 parameters.
    "qwen3-8b": dict(vocab_size=_VOCAB, seq_len=4096, d_model=4096, n_layers=36, n_heads=32,
                     n_kv_heads=8, head_dim=128, intermediate=12288),
    # For tests: 8 experts top-2, dropless.
    "qwen3-moe-tiny": dict(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, n_experts=8, top_k=2,
                           moe_intermediate=32),
    # Qwen3-30B-A3B's shapes (d_model 2048, 32/4 heads of 128, 128 experts top-8 of width
    # 768, untied; 48 layers, 30.5e9 parameters, 3.3e9 active) cut to 8 layers, which is
    # what 4 x 80 GB trains with Adam under any strategy. A layer holds 623M parameters
    # (604M of them experts), the embedding and head 311M each: 8 layers are 5.6e9, i.e.
    # 90 GB of fp32 weights, gradients and two Adam moments (16 B each). Plain DP 4 with
    # ZeRO-1 then keeps 45 GB of weights and gradients + 22 GB of moments per card, EP 4
    # or PP 4 about 23 GB, leaving room for the activations (the fp32 logits of a 4k-token
    # microbatch alone are 2.5 GB). 16 layers (10.6e9, 170 GB) would still fit EP 4 or
    # PP 4 but not DP 4, and all 48 (490 GB) fit no 4-card strategy.
    # capacity 1.25: dropless would give every expert a buffer of all the tokens.
    "qwen3-30b-a3b-4gpu": dict(vocab_size=_VOCAB, seq_len=4096, d_model=2048, n_layers=8,
                               n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128, top_k=8,
                               moe_intermediate=768, capacity_factor=1.25),
}


def get_config(name: str, **overrides) -> Qwen3Config:
  """The preset `name` with `overrides` applied; MoE presets give a `Qwen3MoEConfig`."""
  if name not in PRESETS:
    raise ValueError(f"unknown Qwen3 preset {name!r}; choose one of {list(PRESETS)}")
  cls = Qwen3MoEConfig if "n_experts" in PRESETS[name] else Qwen3Config
  return cls(**{**PRESETS[name], **overrides})


# -- layers ------------------------------------------------------------------------

def _norm(cfg: Qwen3Config, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    name=name)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin [seq_len, head_dim] in float32 (Qwen/Llama rotate-half layout)."""
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates x [batch, seq, heads, head_dim] by position (in float32)."""
  half = x.shape[-1] // 2
  xf = x.astype(jnp.float32)
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos[None, :, None] + rotated * sin[None, :, None]).astype(x.dtype)


class Attention(nn.Module):
  """Causal grouped-query attention with QK-norm and rotary embeddings."""

  config: Qwen3Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    b, t, _ = x.shape
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    proj = lambda n, name: _dense(cfg, n * hd, INIT_STD, name, "columns", use_bias=False)(x)
    q = _norm(cfg, "q_norm")(proj(h, "q").reshape(b, t, h, hd))
    k = _norm(cfg, "k_norm")(proj(kv, "k").reshape(b, t, kv, hd))
    v = proj(kv, "v").reshape(b, t, kv, hd)
    # The tables are constants of the trace (no parameters): each region makes its own.
    cos, sin = rope_tables(t, hd, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = causal_attention(cfg, q, k, v)
    return _dense(cfg, cfg.d_model, INIT_STD, "o", "rows", use_bias=False)(
        y.reshape(b, t, h * hd))


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

  config: Qwen3Config
  features: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    dense = lambda n, name, split: _dense(cfg, n, INIT_STD, name, split, use_bias=False)
    h = nn.silu(dense(self.features, "gate", "columns")(x)) * dense(self.features, "up",
                                                                     "columns")(x)
    return dense(cfg.d_model, "down", "rows")(h)


class Block(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)).

  Returns (x, the MLP's load-balancing loss, or None when it has none)."""

  config: Qwen3Config

  def mlp(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    return MLP(self.config, self.config.intermediate, name="mlp")(x), None

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    x = x + Attention(self.config, name="attn")(_norm(self.config, "input_norm")(x))
    y, aux = self.mlp(_norm(self.config, "post_attn_norm")(x))
    return x + y, aux


class Experts(nn.Module):
  """SwiGLU experts on dispatched tokens [experts, capacity, d_model]: the EP region."""

  config: Qwen3MoEConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_intermediate
    w = lambda name, shape: self.param(name, _dense_init(INIT_STD), shape, cfg.param_dtype)
    w_gate, w_up, w_down = w("w_gate", (e, d, f)), w("w_up", (e, d, f)), w("w_down", (e, f, d))
    with pj.annotate("EP"):  # cast inside: the region's weights are parameters, not inputs
      c = lambda a: a.astype(cfg.dtype)
      h = nn.silu(jnp.einsum("ecd,edf->ecf", x, c(w_gate))) * jnp.einsum("ecd,edf->ecf", x, c(w_up))
      return jnp.einsum("ecf,efd->ecd", h, c(w_down))


def _route(cfg: Qwen3MoEConfig, probs: jax.Array):
  """Top-k choices of probs [n, e]: (weights [n, k], expert [n, k], flat buffer slot
  [n, k] into [e * capacity] (e * capacity where dropped), capacity)."""
  n, e, k = probs.shape[0], cfg.n_experts, cfg.top_k
  top_p, top_i = jax.lax.top_k(probs, k)
  if cfg.norm_topk_prob:
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
  cap = n if cfg.capacity_factor is None else max(1, math.ceil(cfg.capacity_factor * n * k / e))
  chosen = jax.nn.one_hot(top_i, e, dtype=jnp.int32)                     # [n, k, e]
  # Slot of each (token, choice) in its expert's buffer, in token order.
  slot = jnp.sum((jnp.cumsum(chosen.reshape(n * k, e), axis=0).reshape(n, k, e) - 1) * chosen,
                 axis=-1)
  dest = jnp.where(slot < cap, top_i * cap + slot, e * cap)
  return top_p, top_i, dest, cap


class MoE(nn.Module):
  """Router, dispatch, experts (EP region), combine; [B, T, d] -> ([B, T, d], aux loss,
  None when `router_aux_coef` is 0)."""

  config: Qwen3MoEConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    b, t, d = x.shape
    n, e, k = b * t, cfg.n_experts, cfg.top_k
    tokens = x.reshape(n, d)
    logits = nn.Dense(e, use_bias=False, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                      kernel_init=_dense_init(INIT_STD), name="router")(tokens)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)           # [n, e]
    top_p, top_i, dest, cap = _route(cfg, probs)
    # Dispatch: buffer slot -> token index (n: an empty slot, gathered as zeros).
    source = jnp.full((e * cap,), n, jnp.int32).at[dest.reshape(-1)].set(
        jnp.arange(n * k, dtype=jnp.int32) // k, mode="drop")
    routed = jnp.take(tokens, source, axis=0, mode="fill", fill_value=0).reshape(e, cap, d)
    y = Experts(cfg, name="experts")(routed).reshape(e * cap, d)
    # Combine: each token's k results (zeros where dropped), weighted.
    picked = jnp.take(y, dest, axis=0, mode="fill", fill_value=0)         # [n, k, d]
    out = jnp.einsum("nk,nkd->nd", top_p.astype(x.dtype), picked).reshape(b, t, d)
    if cfg.shared_intermediate:
      out = out + MLP(cfg, cfg.shared_intermediate, name="shared")(x)
    if not cfg.router_aux_coef:
      return out, None
    # Load balance per sequence: n_experts * sum_e f_e * P_e, mean over the batch.
    frac = jnp.sum(jax.nn.one_hot(top_i, e, dtype=jnp.float32), axis=1).reshape(b, t, e)
    aux = e * jnp.sum(frac.mean(axis=1) * probs.reshape(b, t, e).mean(axis=1), axis=-1)
    return out, aux.mean()


class MoEBlock(Block):
  """Pre-norm block whose MLP is the routed mixture of experts."""

  def mlp(self, x):
    return MoE(self.config, name="moe")(x)


class Qwen3(nn.Module):
  """Decoder: tokens [B, T] -> (logits [B, T, vocab], auxiliary loss: 0 for dense)."""

  config: Qwen3Config
  block_cls: ClassVar[type] = Block

  @nn.compact
  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     embedding_init=_dense_init(INIT_STD), name="embed")
    x = embed(tokens)
    block = nn.remat(self.block_cls) if cfg.remat else self.block_cls
    # The blocks' load-balancing losses, summed and carried from stage to stage (module
    # docstring); None when no block has one.
    aux = None
    for first, end in cfg.stage_bounds:
      with pj.annotate("PP"):
        for i in range(first, end):
          x, a = block(cfg, name=f"block_{i}")(x)
          if a is not None:
            aux = a if aux is None else aux + a
    x = _norm(cfg, "final_norm")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
                        param_dtype=cfg.param_dtype, kernel_init=_dense_init(INIT_STD),
                        name="head")(x)
    return logits, (jnp.zeros((), jnp.float32) if aux is None else aux / cfg.n_layers)


class Qwen3MoE(Qwen3):
  """Qwen3-MoE decoder; returns (logits, mean load-balancing loss of the layers)."""

  config: Qwen3MoEConfig
  block_cls = MoEBlock


def make_model(config: Qwen3Config) -> Qwen3:
  """`Qwen3MoE` for a `Qwen3MoEConfig`, else `Qwen3`."""
  return (Qwen3MoE if isinstance(config, Qwen3MoEConfig) else Qwen3)(config)


def init_params(model: Qwen3, rng: jax.Array) -> Any:
  """The model's parameters (the "params" collection), initialised from `rng`."""
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  return model.init(rng, tokens)["params"]


def loss_fn(model: Qwen3, metrics: bool = False) -> Callable[[Any, dict[str, jax.Array]], Any]:
  """`loss(params, batch)`: mean token cross-entropy in float32, plus
  `router_aux_coef` x the load-balancing loss for MoE models.

  Both terms are means over the batch's sequences (all of `seq_len` tokens), so equal
  microbatches and data-parallel replicas average to the batch's loss. `metrics`: the
  loss returns `(loss, {"ce": ..., "load_balance": ...})` (for `pj.compile(...,
  has_aux=True)`), each term apart; a dense model's has only "ce".
  """
  coef = getattr(model.config, "router_aux_coef", 0.0)

  def loss(params, batch):
    logits, aux = model.apply({"params": params}, batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]).mean()
    total = ce + coef * aux if coef else ce
    if not metrics:
      return total
    return total, ({"ce": ce, "load_balance": aux} if coef else {"ce": ce})

  return loss


def random_batch(config: Qwen3Config, rng: jax.Array, batch_size: int,
                 pattern_seed: int = 0) -> dict[str, jax.Array]:
  """A learnable synthetic batch {"tokens", "targets"}: `examples.gpt.random_batch`."""
  return _gpt_random_batch(config, rng, batch_size, pattern_seed)


def flops_per_token(config: Qwen3Config) -> float:
  """Training FLOPs per token: 6 x the matmul weights a token uses (attention, the dense
  MLP or router + top_k experts + shared expert, and the head) + 12 L T (heads x
  head_dim) for the attention scores and values (full T x T, ignoring the mask)."""
  d, L, T = config.d_model, config.n_layers, config.seq_len
  attn = d * config.head_dim * (2 * config.n_heads + 2 * config.n_kv_heads)
  if isinstance(config, Qwen3MoEConfig):
    mlp = (d * config.n_experts + config.top_k * 3 * d * config.moe_intermediate
           + 3 * d * config.shared_intermediate)
  else:
    mlp = 3 * d * config.intermediate
  n_matmul = L * (attn + mlp) + d * config.vocab_size
  return 6.0 * n_matmul + 12.0 * L * T * config.n_heads * config.head_dim
