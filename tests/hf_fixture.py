"""Tiny Hugging Face Qwen3 checkpoints made the same way on every machine (numpy's
random numbers, not JAX's initialisers), and the tokens their logits are compared on:
`tests/fixtures/make_hf_logits.py` stores what `transformers` computes for them in
`tests/fixtures/hf_logits.npz`, which `tests/test_hf.py` compares examples/hf.py's
loading with where `transformers` is not installed."""

import os

import jax
import numpy as np

from examples import hf, qwen3

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf_logits.npz")

# name -> (preset, overrides): dense and MoE, tied and untied, head_dim != d_model / heads.
CASES = {
    "dense_untied": ("qwen3-tiny", dict(head_dim=24, tie_embeddings=False)),
    "dense_tied": ("qwen3-tiny", dict(tie_embeddings=True)),
    "moe_untied": ("qwen3-moe-tiny", dict(tie_embeddings=False)),
    "moe_tied": ("qwen3-moe-tiny", dict(tie_embeddings=True, head_dim=24)),
}


def write_checkpoint(directory: str, case: str) -> qwen3.Qwen3Config:
  """Writes case `case`'s checkpoint into `directory`; returns its config."""
  preset, overrides = CASES[case]
  config = qwen3.get_config(preset, vocab_size=64, attention="xla", **overrides)
  shapes = jax.eval_shape(lambda: qwen3.init_params(qwen3.make_model(config),
                                                    jax.random.PRNGKey(0)))
  rng = np.random.default_rng(sorted(CASES).index(case))
  # Norm scales away from 1 and weights large enough that a misplaced tensor shows.
  fill = lambda s: (1 + 0.3 * rng.standard_normal(s.shape) if len(s.shape) == 1
                    else 0.2 * rng.standard_normal(s.shape)).astype(np.float32)
  hf.save(directory, config, jax.tree_util.tree_map(fill, shapes))
  return config


def tokens(config: qwen3.Qwen3Config) -> np.ndarray:
  """Two sequences of 16 tokens."""
  return np.random.default_rng(7).integers(0, config.vocab_size, (2, 16)).astype(np.int32)
