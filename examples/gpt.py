"""A small GPT in Flax linen, used by the examples, tests and benchmarks.

The transformer blocks are divided into `n_stages` contiguous groups (equal, or
`stage_layers` blocks each), each run inside ``pj.annotate("PP")``, so the compiler
sees one pipeline region per group (PP=0, PP=1, ...). The embedding and the head
are not annotated: the compiler joins them to the first and the last region;
`balanced_stage_layers` gives the last stage fewer blocks to make up for the head.

Parameter names do not depend on `n_stages` (blocks are ``block_0`` ...
``block_{n_layers-1}`` at the top level), so the same parameters run under any
number of stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import piper_jax as pj

__all__ = [
    "GPT",
    "GPTConfig",
    "PRESETS",
    "balanced_stage_layers",
    "count_params",
    "flops_per_token",
    "get_config",
    "init_params",
    "loss_fn",
    "random_batch",
]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """GPT hyperparameters.

  Attributes:
    vocab_size: number of tokens.
    seq_len: sequence length (and number of learned positions).
    d_model: width of the residual stream.
    n_layers: number of transformer blocks.
    n_heads: number of attention heads; must divide d_model.
    mlp_ratio: MLP hidden width as a multiple of d_model.
    n_stages: number of pipeline regions; must divide n_layers unless
      stage_layers is given.
    stage_layers: blocks in each pipeline region (n_stages numbers >= 1 summing
      to n_layers); None splits them equally.
    tie_embeddings: use the token embedding as the output head.
    dtype: compute dtype (the loss is always computed in float32).
    param_dtype: parameter dtype.
    attention: `jax.nn.dot_product_attention`'s implementation ("xla", "cudnn"), or
      "xla+remat" (XLA's, its scores recomputed in the backward: a fused kernel's
      memory without one); None picks cuDNN for bf16/fp16 on GPU and XLA elsewhere.
      "cudnn" on a host without it (planning GPUs on a laptop) runs "xla+remat".
    tp_axis: when set, the attention and MLP weights carry Flax partitioning
      names (`nn.with_partitioning`) in Megatron's layout: qkv and fc split by
      columns (heads), out and proj by rows, along this name - what
      `pj.shard_tensor(..., axis=tp_axis)` splits.
  """

  vocab_size: int
  seq_len: int
  d_model: int
  n_layers: int
  n_heads: int
  mlp_ratio: int = 4
  n_stages: int = 1
  stage_layers: tuple[int, ...] | None = None
  tie_embeddings: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention: str | None = None
  tp_axis: str | None = None

  def __post_init__(self):
    check_stages(self)
    if self.d_model % self.n_heads:
      raise ValueError(
          f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def stage_bounds(self) -> list[tuple[int, int]]:
    """[first block, end) of every pipeline region."""
    return stage_bounds(self)


def check_stages(config) -> None:
  """Checks a config's `attention` and its blocks per pipeline stage (`n_layers`,
  `n_stages`, `stage_layers`, which it stores as a tuple); for every example model."""
  if config.attention not in (None, "xla", "xla+remat", "cudnn"):
    raise ValueError(f"attention={config.attention!r}: use None, 'xla', 'xla+remat' or 'cudnn'")
  if config.stage_layers is not None:
    layers = tuple(config.stage_layers)
    object.__setattr__(config, "stage_layers", layers)  # hashable, like the rest
    if (len(layers) != config.n_stages or min(layers, default=0) < 1
        or sum(layers) != config.n_layers):
      raise ValueError(
          f"stage_layers={layers} must give each of the n_stages={config.n_stages} "
          f"stages at least one block, {config.n_layers} (n_layers) in all")
  elif config.n_stages < 1 or config.n_layers % config.n_stages:
    raise ValueError(
        f"n_layers={config.n_layers} must be divisible by n_stages={config.n_stages}; "
        f"pick n_stages among the divisors of n_layers, or give stage_layers")


def stage_bounds(config) -> list[tuple[int, int]]:
  """[first block, end) of every pipeline region of a config checked by `check_stages`."""
  layers = config.stage_layers or (config.n_layers // config.n_stages,) * config.n_stages
  ends = [sum(layers[:s + 1]) for s in range(config.n_stages)]
  return [(e - n, e) for e, n in zip(ends, layers)]


PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4),
    "268m": dict(
        vocab_size=32768, seq_len=1024, d_model=1024, n_layers=16, n_heads=16),
    "1.3b": dict(
        vocab_size=32768, seq_len=1024, d_model=2048, n_layers=24, n_heads=16),
}


def get_config(name: str, **overrides) -> GPTConfig:
  """The preset `name` ("tiny", "268m", "1.3b") with `overrides` applied."""
  if name not in PRESETS:
    raise ValueError(f"unknown GPT preset {name!r}; choose one of {list(PRESETS)}")
  return GPTConfig(**{**PRESETS[name], **overrides})


def _dense_init(std: float) -> Callable:
  return nn.initializers.normal(stddev=std)


def _dense(cfg: GPTConfig, features: int, std: float, name: str, split: str | None = None,
           use_bias: bool = True) -> nn.Dense:
  """A Dense layer; under `cfg.tp_axis`, split by "columns" or "rows" (Megatron)."""
  kernel_init, bias_init = _dense_init(std), nn.initializers.zeros_init()
  if cfg.tp_axis and split == "columns":
    kernel_init = nn.with_partitioning(kernel_init, (None, cfg.tp_axis))
    bias_init = nn.with_partitioning(bias_init, (cfg.tp_axis,))
  elif cfg.tp_axis and split == "rows":
    kernel_init = nn.with_partitioning(kernel_init, (cfg.tp_axis, None))
  return nn.Dense(features, use_bias=use_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                  kernel_init=kernel_init, bias_init=bias_init, name=name)


def causal_attention(cfg, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal `jax.nn.dot_product_attention` of [batch, seq, heads, head_dim] arrays with
  `attention_implementation(cfg)`."""
  impl = attention_implementation(cfg)
  if impl == "cudnn" and jax.default_backend() != "gpu":
    # Asked for cuDNN where there is none (a plan for GPUs made on a laptop): XLA's
    # attention with cuDNN's memory, the same function.
    impl = "xla+remat"
  if impl == "xla+remat":
    # Only q, k and v are kept for the backward, as a fused kernel keeps them, not the
    # T x T probabilities: memory estimated on a CPU then matches cuDNN's on a GPU.
    attend = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    return jax.checkpoint(attend)(q, k, v)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def attention_implementation(cfg: GPTConfig, platform: str | None = None) -> str:
  """`cfg.attention`, or by default cuDNN's fused attention for bf16/fp16 on GPU, else XLA;
  `platform` ("gpu", "cpu"): the one the model will run on (None: this machine's).

  (`jax.nn.dot_product_attention` itself defaults to XLA's, which materializes the
  scores.) cuDNN needs a head dim that is a multiple of 8, at most 128.
  """
  if cfg.attention is not None:
    return cfg.attention
  half = jnp.dtype(cfg.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  fits = cfg.head_dim % 8 == 0 and cfg.head_dim <= 128
  # Regions under shard_tensor are evaluated piece by piece, primitive by primitive;
  # the cuDNN call has no such rule, XLA's attention does.
  plain = cfg.tp_axis is None
  nvidia = (platform == "gpu" if platform is not None else
            jax.default_backend() == "gpu" and "NVIDIA" in jax.devices()[0].device_kind)
  return "cudnn" if half and fits and plain and nvidia else "xla"


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    batch, seq, _ = x.shape
    # Heads outermost in the qkv columns, so that splitting them splits heads.
    qkv = _dense(cfg, 3 * cfg.d_model, 0.02, "qkv", "columns")(x)
    qkv = qkv.reshape(batch, seq, cfg.n_heads, 3, cfg.head_dim)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    y = causal_attention(cfg, q, k, v).reshape(batch, seq, cfg.d_model)
    # GPT-2: scale residual projections down with depth.
    return _dense(cfg, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers), "out", "rows")(y)


class MLP(nn.Module):
  """Two-layer MLP with gelu."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    h = nn.gelu(_dense(cfg, cfg.mlp_ratio * cfg.d_model, 0.02, "fc", "columns")(x))
    return _dense(cfg, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers), "proj", "rows")(h)


class Block(nn.Module):
  """Pre-LN transformer block; subclasses swap the MLP (`mlp_cls`)."""

  config: GPTConfig
  mlp_cls: ClassVar[type] = MLP

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    ln = lambda name: nn.LayerNorm(
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)
    x = x + CausalSelfAttention(cfg, name="attn")(ln("ln1")(x))
    x = x + self.mlp_cls(cfg, name="mlp")(ln("ln2")(x))
    return x


class GPT(nn.Module):
  """Decoder-only transformer: tokens [B, T] -> logits [B, T, vocab].

  Subclasses swap the block (`block_cls`), as `examples.moe.MoEGPT` does.
  """

  config: GPTConfig
  block_cls: ClassVar[type] = Block

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(
        cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
        param_dtype=cfg.param_dtype, embedding_init=_dense_init(0.02),
        name="embed")
    pos_embed = nn.Embed(
        cfg.seq_len, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
        embedding_init=_dense_init(0.01), name="pos_embed")
    x = embed(tokens) + pos_embed(jnp.arange(tokens.shape[1]))[None]

    for first, end in cfg.stage_bounds:
      with pj.annotate("PP"):
        for i in range(first, end):
          x = self.block_cls(cfg, name=f"block_{i}")(x)

    x = nn.LayerNorm(
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="ln_f")(x)
    if cfg.tie_embeddings:
      return embed.attend(x)
    return nn.Dense(
        cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
        param_dtype=cfg.param_dtype, kernel_init=_dense_init(0.02),
        name="head")(x)


def init_params(model: GPT, rng: jax.Array) -> Any:
  """The model's parameters (the "params" collection), initialised from `rng`."""
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  return model.init(rng, tokens)["params"]


def loss_fn(model: GPT) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
  """`loss(params, batch)`: mean token cross-entropy in float32.

  The mean runs over all tokens of the batch; all sequences have the same
  length, so it is also the mean over the batch's leading axis, and the means
  of equal microbatches average to the batch's.
  """

  def loss(params, batch):
    logits = model.apply({"params": params}, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]).mean()

  return loss


def random_batch(
    config: GPTConfig, rng: jax.Array, batch_size: int, pattern_seed: int = 0,
) -> dict[str, jax.Array]:
  """A synthetic batch whose next tokens are learnable.

  The vocabulary is arranged in one fixed random cycle (from `pattern_seed`);
  each sequence walks that cycle from a random start drawn from `rng`, and
  `targets` are the tokens shifted by one. Next-token prediction is a fixed
  bigram map, so the loss falls quickly from log(vocab_size) towards 0.

  Returns:
    {"tokens": int32 [batch_size, seq_len], "targets": int32 [batch_size, seq_len]}.
  """
  return _random_walk(rng, config.vocab_size, config.seq_len, batch_size, pattern_seed)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_walk(rng, vocab_size: int, seq_len: int, batch_size: int, pattern_seed: int):
  # One compiled program: op by op, the gather over a large vocabulary takes seconds.
  cycle = jax.random.permutation(jax.random.PRNGKey(pattern_seed), vocab_size).astype(jnp.int32)
  start = jax.random.randint(rng, (batch_size, 1), 0, vocab_size)
  walk = cycle[(start + jnp.arange(seq_len + 1)) % vocab_size]
  return {"tokens": walk[:, :-1], "targets": walk[:, 1:]}


def count_params(params: Any) -> int:
  """Total number of parameters in a pytree."""
  return sum(x.size for x in jax.tree_util.tree_leaves(params))


def balanced_stage_layers(config: GPTConfig, n_stages: int) -> tuple[int, ...]:
  """Blocks per pipeline stage that give every stage about the same work.

  The last stage also runs the output head and the loss; they count as
  `head FLOPs / block FLOPs + 1` blocks, the one for the softmax and cross-entropy
  over the vocabulary, which are memory-bound (about a block's time on a GPU). The
  first stage's embedding lookup counts as nothing. With cuDNN's fused attention the
  blocks run faster and an equal split of blocks can be the faster one: measure both.
  """
  d, L, T = config.d_model, config.n_layers, config.seq_len
  block = (4 + 2 * config.mlp_ratio) * d * d + 2 * d * T
  head = d * config.vocab_size / block + 1.0
  if not 1 <= n_stages <= L:
    raise ValueError(f"cannot put {L} blocks in {n_stages} stages of at least one block")
  if n_stages == 1:
    return (L,)
  last = max(1, min(L - n_stages + 1, round((L + head) / n_stages - head)))
  q, r = divmod(L - last, n_stages - 1)
  return tuple(q + (s < r) for s in range(n_stages - 1)) + (last,)


def flops_per_token(config: GPTConfig) -> float:
  """Training FLOPs per token, for MFU.

  PaLM's formula (Chowdhery et al. 2022, appendix B): 6 * N + 12 * L * d * T,
  where N counts the matmul weights (attention and MLP kernels of every block
  and the output head; embedding lookups, biases and norms are left out),
  L = n_layers, d = d_model and T = seq_len. The attention term counts the
  full T x T score and value matmuls, ignoring the causal mask.
  """
  d, L = config.d_model, config.n_layers
  per_block = (4 + 2 * config.mlp_ratio) * d * d
  n_matmul = L * per_block + d * config.vocab_size
  return 6.0 * n_matmul + 12.0 * L * d * config.seq_len

