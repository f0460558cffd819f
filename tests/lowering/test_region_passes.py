"""A GPT's region passes, read from the compiled program (`lowering/regions.py`): the
residuals F stores and B recomputes, zero-bubble's handover from BI to BW, and weight
gradients written in fp32 where they sum over microbatches."""

import jax
import pytest

import piper_jax as pj
from piper_jax.precision import widen
from models import assert_same_run
from test_gpt import _batches, _bf16_gpt_run, _gpt

pytestmark = pytest.mark.timeout(300)


def test_zero_bubble_slim_carry(monkeypatch):
  # ZB's handover: BW redoes the casts that made LayerNorm's f32 cotangents and takes the
  # bf16 values from BI instead; fewer bytes handed over, the same run (fp32).
  import jax.numpy as jnp
  import models
  config, loss, params = _gpt(2)
  monkeypatch.setattr(models, "random_batch", _batches(config))
  step, _ = assert_same_run(loss, params, pj.strategies.pipeline(2, 2, "zb"), batch_size=4)
  _, bf16_loss, bf16_params = _gpt(2, dtype=jnp.bfloat16)
  bf16 = pj.compile(bf16_loss, models.optimizer(), pj.strategies.pipeline(2, 2, "zb"), bf16_params,
                    models.random_batch(jax.random.PRNGKey(0), 4))
  prog = bf16._program
  slim = prog.split[1]
  assert slim.carry and not any(a.dtype == jnp.float32 and a.ndim == 3
                                for a in slim.carry_avals)


def test_cheap_residuals_are_recomputed_not_stored(monkeypatch):
  # With bf16 compute, the bf16 copies of the weights (and the causal mask) are
  # recomputed in B from the parameters, and elementwise chains (GELU's intermediates,
  # LayerNorm's) from what F stores instead: one MLP hidden array per
  # block where the vjp keeps several (`remat=True`).
  import models
  from piper_jax.lowering import regions
  loss_fn, params, batches = _bf16_gpt_run(monkeypatch)
  tx = models.optimizer()
  losses, got, step, _ = models.piper_run(loss_fn, params, batches, tx,
                                          pj.strategies.pipeline(2, 2, "1f1b"), remat=True)
  ad = step._program.ad[0]
  recomputed = [v for a, v in zip(ad.alias, ad.res_vars) if a and a[0] == "recompute"]
  assert any(str(v.aval.dtype) == "bfloat16" and v.aval.ndim == 2 for v in recomputed)
  hidden = lambda avals: sum(tuple(a.shape[-1:]) == (128,) and a.ndim == 3 for a in avals)
  n_blocks = 1  # per stage
  assert hidden(ad.stored_avals) <= n_blocks < hidden(ad.res_avals)
  default = regions.analyze_region(step._program.runner, 0)  # remat=False
  assert hidden(default.stored_avals) > n_blocks
  nbytes = lambda avals: sum(a.size * a.dtype.itemsize for a in avals)
  assert nbytes(ad.stored_avals) < nbytes([v.aval for a, v in zip(ad.alias, ad.res_vars) if a is None
                                           or a[0] == "recompute"]) / 2
  # The SGD step of 1F1B with remat (the pipelines' default): test_pipeline_weights_unpacked_once.
  models.assert_same_bf16_run(loss_fn, params, batches, pj.strategies.pipeline(2, 2, "1f1b"), tx,
                              losses, got, sgd=False, remat=True)


def test_wide_weight_gradients(monkeypatch):
  # Where gradients sum over microbatches, a bf16 matmul's weight gradient is a GEMM that
  # writes fp32 (no bf16 rounding, no convert before the sum): the run is no farther from
  # one device's in fp32 than one device's own bf16 run. Under ZB the GEMMs are in BW;
  # B and BI bind through the same hook (`split.prepare`).
  import re
  import numpy as np
  import models
  loss_fn, params, batches = _bf16_gpt_run(monkeypatch)
  tx = models.optimizer()
  directives = pj.strategies.pipeline(2, 2, "zb")
  wide, wide_params, step, state = models.piper_run(loss_fn, params, batches, tx, directives)
  for split in step._program.split.values():
    assert len(split.prepare.wide) >= 4  # qkv, attention out, MLP in and out per block
  # (On the CPU the GEMM's bf16 operands are widened first: XLA's CPU runtime has no
  # bf16 x bf16 -> f32 dot. The same sums, since a bf16 GEMM accumulates in fp32.)
  f32_dots = len(re.findall(
      r"stablehlo\.dot_general .*\(tensor<[\dx]+xf32>, tensor<[\dx]+xf32>\) -> tensor<[\dx]+xf32>",
      step.lower(state, batches[0]).as_text()))
  assert f32_dots >= 4
  models.assert_same_bf16_run(loss_fn, params, batches, directives, tx, wide, wide_params)
  fp32 = jax.tree_util.tree_map(lambda x: x.astype(np.float32), params)
  _, ref_params = models.reference_run(widen(loss_fn), fp32, batches, tx)
  _, plain_params = models.reference_run(loss_fn, params, batches, tx)
  err = lambda got: max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b))))
                        for a, b in zip(jax.tree_util.tree_leaves(got),
                                        jax.tree_util.tree_leaves(ref_params)))
  assert err(wide_params) <= err(plain_params) * 1.5, (err(wide_params), err(plain_params))
