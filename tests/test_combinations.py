"""Combinations users will try, each against one device (fp32, 2 steps + one SGD step).

Already covered elsewhere, so not repeated here: interleaved x DP at ZeRO 1/3, ZB x DP
at ZeRO 1/3, DualPipeV x DP at ZeRO 1/3 (test_schedules::test_schedule_with_dp);
DualPipeV x DP2 ZeRO-2 (test_optimizers::test_masked_adamw_under_split_and_pipelined_strategies
[dualpipev_zero2]); EP with 1F1B and DualPipeV (test_parallel::test_pp2_x_ep2_x_dp2_zero1);
EP x ZeRO-3 without PP (test_parallel::test_expert_parallel[2-3]); TP2 x DP2 at ZeRO-0
(test_optimizers::...[tp_x_dp]) and ZeRO-3 (test_parallel::test_tensor_parallel); TP x 1F1B
(test_parallel::test_tp2_x_pp2_x_dp2); tied parameters with 1F1B and GPipe x DP ZeRO-2
(test_strategies::test_tied_embedding_first_and_last_stage, ::test_tied_embedding_pipeline_x_dp_zero2).
Two cases here stand for two items each: EP x GPipe x DP 4 ZeRO-3 (EP with GPipe, and
EP x PP x ZeRO-3) and TP x ZB with tied embeddings (TP with ZB, and TP with tied ones).
"""

import jax
import numpy as np
import optax
import pytest

import piper_jax as pj
from models import (assert_same_run, init_mlp, mlp_loss, moe_gpt, piper_run, random_batch,
                    reference_run, tp_gpt)

pytestmark = pytest.mark.timeout(300)

# As test_parallel.MOE_TX: eps=1e-6 keeps Adam from turning rounding-level expert
# gradients into full-size steps.
MOE_TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-6, weight_decay=0.1))


def _mlp(n_stages, tied=False):
  return mlp_loss(n_stages, tied), init_mlp(jax.random.PRNGKey(0), n_stages, tied)


# Pipelines x DP 2 over 4 devices, the MLP with one region per stage; 2 microbatches
# (DualPipeV needs 2 * n_ranks = 4).
def _n_mb(schedule):
  return 4 if schedule == "dualpipev" else 2


@pytest.mark.parametrize("schedule,n_stages,zero", [
    ("gpipe", 2, 0), ("gpipe", 2, 1), ("gpipe", 2, 3),
    ("interleaved", 4, 0), ("interleaved", 4, 2),
    ("dualpipev", 4, 0),
    ("zb", 2, 0)])
def test_pipeline_x_dp(schedule, n_stages, zero):
  loss, params = _mlp(n_stages)
  directives = pj.strategies.pipeline(n_stages, _n_mb(schedule), schedule, dp=2, zero=zero)
  step, _ = assert_same_run(loss, params, directives)
  assert step.plan.mesh.n_dp == 2 and step.plan.mesh.zero == zero


# Tied embed/head: ZB and interleaved put the two uses on different ranks, DualPipeV on
# rank 0; ZeRO-3 shards the shared weight over DP.
@pytest.mark.parametrize("schedule,n_stages,dp,zero", [
    ("1f1b", 2, 2, 3), ("zb", 2, 1, 0), ("interleaved", 4, 1, 0), ("dualpipev", 4, 1, 0)])
def test_tied_parameters(schedule, n_stages, dp, zero):
  loss, params = _mlp(n_stages, tied=True)
  directives = pj.strategies.pipeline(n_stages, _n_mb(schedule), schedule, dp=dp, zero=zero)
  assert_same_run(loss, params, directives)


# EP 2 on each pipeline rank: with DP 2 the rank's whole group (stage ranks [0, 2] and
# [1, 3]); with DP 4 (GPipe, ZeRO-3: EP x PP x ZeRO-3 in one) blocks [0, 2] and [1, 3]
# of its groups [0, 2, 4, 6] and [1, 3, 5, 7], each expert's 2 copies sharded by ZeRO-3.
@pytest.mark.parametrize("schedule,n_stages,dp,zero", [
    ("zb", 2, 2, 1), ("interleaved", 4, 2, 1), ("gpipe", 2, 4, 3)])
def test_expert_parallel_x_pipeline(schedule, n_stages, dp, zero, batches_of):
  config, loss, params = moe_gpt(n_stages)
  batches_of(config)
  directives = pj.strategies.pipeline(n_stages, 2, schedule, dp=dp, zero=zero)
  directives.append(pj.shard({"EP": "*"}, [0, 2, 1, 3]))
  step, state = assert_same_run(loss, params, directives, batch_size=4 * dp, tx=MOE_TX)
  assert step.plan.mesh.size("ep") == 2
  # [1 rank, 1 device, experts / 2 (/ 2 copies under ZeRO-3), ...] per device.
  pieces = {x.addressable_shards[0].data.shape[2] for x in state.params.split}
  assert pieces == {config.n_experts // 2 // (2 if zero == 3 else 1)}


@pytest.mark.parametrize("kind", ["alone", "dp2_zero2"])
def test_tensor_parallel_without_pipeline(kind, batches_of):
  config, loss, params = tp_gpt()
  batches_of(config)
  if kind == "alone":  # TP 2, no DP
    directives = [pj.replicate({}, [0, 1]), pj.shard_tensor({}, [0, 1])]
  else:
    directives = [pj.replicate({}, [0, 1, 2, 3], zero=2), pj.shard_tensor({}, [0, 1])]
  step, _ = assert_same_run(loss, params, directives, batch_size=8)
  assert step.plan.mesh.size("tp") == 2


# TP 2 per pipeline rank (stage ranks [0, 2] and [1, 3]). ZB runs with tied embeddings
# (GPTConfig.tie_embeddings): the token embedding on rank 0 is the head on rank 1.
@pytest.mark.parametrize("schedule,n_stages,tied", [("zb", 2, True), ("dualpipev", 4, False)])
def test_tensor_parallel_x_pipeline(schedule, n_stages, tied, batches_of):
  config, loss, params = tp_gpt(n_stages, tie_embeddings=tied)
  batches_of(config)
  directives = pj.strategies.pipeline(n_stages, _n_mb(schedule), schedule, dp=2)
  directives.append(pj.shard_tensor({}, [0, 2, 1, 3]))
  step, _ = assert_same_run(loss, params, directives, batch_size=8)
  assert step.plan.mesh.size("tp") == 2 and step.plan.mesh.n_data == 1


def test_100_steps_loss_curve():
  # 1F1B x DP 2 ZeRO-1 with Adam for 100 steps against one device: the loss curve and
  # the final parameters.
  loss, params = _mlp(2)
  tx = optax.adam(1e-2)
  batches = [random_batch(jax.random.PRNGKey(i), 16) for i in range(100)]
  ref_losses, ref_params = reference_run(loss, params, batches, tx)
  losses, got, _, _ = piper_run(loss, params, batches, tx,
                                pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1))
  assert np.mean(ref_losses[-10:]) < 0.9 * np.mean(ref_losses[:10])  # it trains
  # On CPU the curves agree to 2e-7 relative and the parameters to 2.4e-7 after 100
  # steps; 1e-4 (looser than the 2-step tests' 1e-5) leaves room for other reduction
  # orders, whose rounding-level differences Adam can turn into full-size steps and
  # 100 steps compound.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4),
      got, ref_params)
