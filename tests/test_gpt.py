"""The example GPT (Flax) trains to the same numbers under pipelines x ZeRO as on one device."""

import jax
import pytest

import piper_jax as pj
from examples import gpt
from models import assert_same_run

pytestmark = pytest.mark.timeout(300)


def _gpt(n_stages, tied=False):
  config = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=max(2, n_stages), n_heads=2,
                         n_stages=n_stages, tie_embeddings=tied)
  model = gpt.GPT(config)
  return config, gpt.loss_fn(model), gpt.init_params(model, jax.random.PRNGKey(0))


def _batches(config):
  return lambda rng, batch_size: gpt.random_batch(config, rng, batch_size, pattern_seed=1)


@pytest.mark.parametrize("zero", [3])  # ZeRO-1 pipelines: test_strategies, test_parallel
def test_gpt_1f1b_x_dp2(zero, monkeypatch):
  config, loss, params = _gpt(2)
  import models
  monkeypatch.setattr(models, "random_batch", _batches(config))
  assert_same_run(loss, params, pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=zero), batch_size=8)


def test_gpt_tied_embeddings_gpipe(monkeypatch):
  config, loss, params = _gpt(2, tied=True)
  import models
  monkeypatch.setattr(models, "random_batch", _batches(config))
  assert_same_run(loss, params, pj.strategies.pipeline(2, 4, "gpipe"), batch_size=8)


def test_gpt_zero_bubble_4_stages(monkeypatch):
  # Regression: some weight gradients of a GPT region are literals in the backward jaxpr.
  config, loss, params = _gpt(4)
  import models
  monkeypatch.setattr(models, "random_batch", _batches(config))
  assert_same_run(loss, params, pj.strategies.pipeline(4, 2, "zb"), batch_size=4)


def test_train_gpt_example_runs():
  from examples import train_gpt
  # A MoE GPT (make demo runs the dense one) with its experts split over each stage's
  # 2 data-parallel devices.
  out = train_gpt.main(["--strategy", "pp-1f1b", "--stages", "2", "--dp", "2", "--zero", "1",
                        "--microbatches", "2", "--steps", "3", "--batch", "8",
                        "--experts", "4", "--ep", "--quiet"])
  losses = out["losses"]
  assert len(losses) == 3 and all(l == l for l in losses) and losses[-1] < losses[0]


def test_weights_cast_once_per_step_and_mask_recomputed(monkeypatch):
  # With bf16 compute, the bf16 copies of the fp32 weights are made once per step and
  # read by every microbatch's F and B (not cast inside each tick, not stored per
  # microbatch); the causal mask is recomputed in B instead of being stored.
  import jax.numpy as jnp
  import models
  import numpy as np
  config = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2, n_stages=2,
                         dtype=jnp.bfloat16)
  model = gpt.GPT(config)
  params = gpt.init_params(model, jax.random.PRNGKey(0))
  monkeypatch.setattr(models, "random_batch", _batches(config))
  batches = [models.random_batch(jax.random.PRNGKey(i), 8) for i in range(2)]
  tx = models.optimizer()
  ref, _ = models.reference_run(gpt.loss_fn(model), params, batches, tx)
  losses, _, step, state = models.piper_run(gpt.loss_fn(model), params, batches, tx,
                                            pj.strategies.pipeline(2, 2, "1f1b"))
  np.testing.assert_allclose(losses, ref, rtol=2e-2)
  program = step._program
  casts = program.runner.casts[0]
  assert casts and {str(d) for d in casts.values()} == {"bfloat16"}
  ad = program.ad[0]
  assert any(a and a[0] == "param" and a[1] in casts for a in ad.alias)
  assert any(a and a[0] == "recompute" for a in ad.alias)  # the mask
  # No weight-shaped fp32 -> bf16 convert is left in the step (one per buffer instead).
  text = step.lower(state, batches[0]).as_text()
  for i in casts:
    shape = "x".join(map(str, program.model.params[program.model.regions[0].params[i]].shape))
    assert f"(tensor<{shape}xf32>) -> tensor<{shape}xbf16>" not in text
