"""Expert parallel (shard) and tensor parallel (shard_tensor), alone and with PP x DP x ZeRO.

Each run must give the numbers of one device (the MoE model routes dropless, so
grouping tokens differently cannot change the result), and each device must hold
only its piece of the expert / tensor-parallel parameters.
"""

import jax
import numpy as np
import pytest

import optax

import piper_jax as pj
from examples import gpt
from models import assert_same_run, moe_gpt as _moe, tp_gpt as _tp_gpt
from piper_jax.lowering import collectives_in_conditionals

# Adam moves a weight whose gradient is at rounding level (an expert that few tokens
# reach) by a full step of that noise with eps=1e-8; eps=1e-6 keeps the comparison
# about the gradients, which assert_same_run also checks directly.
MOE_TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-6, weight_decay=0.1))

pytestmark = pytest.mark.timeout(300)


def _split_piece_shapes(state):
  """Per split buffer: the shape of one device's piece."""
  return [x.addressable_shards[0].data.shape for x in state.params.split]


@pytest.mark.parametrize("n,zero", [(2, 3), (4, 0)])
def test_expert_parallel(n, zero, batches_of):
  # EP 2 in blocks of a 4-device ZeRO-3 group (the other parameters are gathered over
  # all 4), and EP 4 over the whole group.
  config, loss, params = _moe(shared_expert=(n == 4))
  batches_of(config)
  directives = [pj.replicate({}, [0, 1, 2, 3], zero=zero), pj.shard({"EP": "*"}, list(range(n)))]
  step, state = assert_same_run(loss, params, directives, batch_size=8, tx=MOE_TX)
  assert step.plan.mesh.axis_names == ("dp", "ep", "pp") and step.plan.mesh.size("ep") == n
  # [1 rank, 1 device, experts / n, ...] per device: the experts are partitioned, and
  # under ZeRO-3 sharded again over the 2 copies of each expert group.
  copies = 4 // n if zero == 3 else 1
  assert {s[2] for s in _split_piece_shapes(state)} == {config.n_experts // n // copies}
  a2a = [x for x in step.plan.graph.nodes.values() if x.kind.value == "all_to_all"]
  assert len(a2a) == 2 * 2 * config.n_layers  # in and out of every expert F and B


def test_expert_parallel_zero2_bf16_shards_the_masters():
  # ZeRO-2 with bf16 compute (the distributed optimizer): the experts' fp32 pieces are
  # sharded over their 2 copies too and gathered as the step starts; the numbers are
  # those of the replicated-parameter ZeRO-2.
  import jax.numpy as jnp
  import models
  config, loss, params = _moe(dtype=jnp.bfloat16, param_dtype=jnp.float32)
  batches = [gpt.random_batch(config, jax.random.PRNGKey(i), 8, pattern_seed=1) for i in range(2)]
  directives = [pj.replicate({}, [0, 1, 2, 3], zero=2), pj.shard({"EP": "*"}, [0, 1])]
  losses, got, step, state = models.piper_run(loss, params, batches, MOE_TX, directives)
  assert step.layout.shards_masters
  assert {s[2] for s in _split_piece_shapes(state)} == {config.n_experts // 2 // 2}
  want_losses, want, _, _ = models.piper_run(loss, params, batches, MOE_TX, directives,
                                             options=pj.LoweringOptions(shard_masters=False))
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                         got, want)
  models.assert_same_bf16_run(loss, params, batches, directives, MOE_TX, losses, got)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_pp2_x_ep2_x_dp2_zero1(schedule, batches_of):
  # 2 pipeline ranks x 4 devices each; experts split over blocks of 2 of them, the blocks
  # replicate each other (expert data parallel), other parameters are ZeRO-1 over all 4.
  # DualPipeV runs with remat (the pipelines' default): the regions around the experts
  # store fewer residuals (28 -> 23 on the first stage) and B remakes the rest; 1F1B
  # runs with remat=False, so that both settings are tested, and with 8 microbatches in
  # the one loop over ticks: all-to-alls, split expert weights and ZeRO-1 inside it.
  n_stages = 2 if schedule == "1f1b" else 4
  n_mb = 8 if schedule == "1f1b" else 4
  config, loss, params = _moe(n_stages)
  batches_of(config)
  directives = pj.strategies.pipeline(n_stages, n_mb, schedule, dp=4, zero=1)
  directives.append(pj.shard({"EP": "*"}, [0, 2, 1, 3]))
  step, state = assert_same_run(loss, params, directives, batch_size=4 * n_mb, tx=MOE_TX,
                                remat=schedule == "dualpipev")
  assert step.plan.mesh.size("ep") == 2 and step.plan.mesh.n_pp == 2
  assert step.tick_loop  # the experts' all-to-alls run in the loop's tasks
  assert {s[2] for s in _split_piece_shapes(state)} == {config.n_experts // 2}
  slots = {x.shape for x in state.params.slots["float32"]}
  moments = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.shape in slots]
  # Stacked slots [pp, dp, chunk] hold one rank's chunk per device; slots spread over
  # all 8 devices (the embedding's, uneven over the ranks) an eighth of the whole.
  held = lambda x: x.addressable_shards[0].data
  assert moments and all(held(x).shape[:2] == (1, 1) if x.ndim == 3 else
                         held(x).size * 8 == x.size for x in moments)
  # The experts' optimizer state is sharded over the 2 copies of each expert group too.
  experts = state.params.split[0]
  moments = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.shape == experts.shape]
  assert moments and all(x.addressable_shards[0].data.shape[2] == experts.shape[2] // 2
                         for x in moments)


def test_tensor_parallel(batches_of):
  # TP 2 x DP 2 with ZeRO-3 for the parameters that are not split.
  config, loss, params = _tp_gpt()
  batches_of(config)
  directives = [pj.replicate({}, [0, 1, 2, 3], zero=3), pj.shard_tensor({}, [0, 1])]
  step, state = assert_same_run(loss, params, directives, batch_size=8)
  # qkv/fc columns and out/proj rows: each device holds half of every split weight,
  # and ZeRO-3 shards that half again over the 2 data-parallel copies.
  names = {s.name: s for s in step.plan.model.params}
  assert names["block_0/attn/qkv/kernel/value"].names == (None, "tp")
  split = step.layout.split
  assert all(step.plan.model.params[p].names[d] == "tp" for p, d in split.items())
  assert (1, 1, config.d_model // 2, 3 * config.d_model // 2) in set(_split_piece_shapes(state))
  # The canonical layout (checkpoints) puts the pieces back together.
  again = step.from_canonical(step.canonical(state))
  jax.tree_util.tree_map(np.testing.assert_array_equal, step.params(again), step.params(state))


def test_tp2_x_pp2_x_dp2(batches_of):
  config, loss, params = _tp_gpt(n_stages=2)
  batches_of(config)
  directives = pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=1)
  directives.append(pj.shard_tensor({}, [0, 2, 1, 3]))
  step, _ = assert_same_run(loss, params, directives, batch_size=8)
  assert step.plan.mesh.axis_names == ("dp", "tp", "pp") and step.plan.mesh.n_data == 2


def test_pp2_x_ep2_x_tp2(batches_of):
  # A MoE GPT with Megatron names on its attention and shared expert: per stage, 4
  # devices = EP 2 x TP 2. TP groups are consecutive devices of a stage's group, EP
  # groups stride over them: stage 0 runs on [0, 2, 4, 6], TP [0, 2], EP [0, 4].
  config, loss, params = _moe(n_stages=2, tp_axis="tp", shared_expert=True)
  batches_of(config)
  directives = pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=1)
  directives += [pj.shard_tensor({}, [0, 2, 1, 3]), pj.shard({"EP": "*"}, [0, 4, 1, 5])]
  step, state = assert_same_run(loss, params, directives, batch_size=8, tx=MOE_TX)
  mesh = step.plan.mesh
  assert mesh.axis_names == ("dp", "ep", "tp", "pp") and dict(mesh.inner) == {"ep": 2, "tp": 2}
  kinds = {k for _, _, k in step.layout.split_positions}
  assert kinds == {"ep", "tp"}
  # All-to-alls after each slot's switch, all-reduces between its phases: none inside.
  hlo = step.lower(state, gpt.random_batch(config, jax.random.PRNGKey(0), 8)).compile().as_text()
  assert collectives_in_conditionals(hlo) == []


def _plan(loss, params, config, directives, batch=8, n_devices=8):
  return pj.plan(loss, directives, params, gpt.random_batch(config, jax.random.PRNGKey(0), batch),
                 n_devices)


def _raises(fn, *patterns):
  with pytest.raises(pj.PlanError) as info:
    fn()
  for p in patterns:
    assert __import__("re").search(p, str(info.value)), str(info.value)


def test_bad_shard_directives():
  config, loss, params = _moe()
  plan = lambda d: _plan(loss, params, config, d)
  # An EP region must see [experts, ...] tensors only: the PP region has none.
  _raises(lambda: plan([pj.replicate({}, [0, 1]), pj.shard({"PP": 0}, [0, 1])]),
          r"directive 1 \{\"op\": \"shard\"", "lacks the expert axis|reads the batch")
  # 4 experts over 3 devices.
  _raises(lambda: plan([pj.replicate({}, [0, 1, 2]), pj.shard({"EP": "*"}, [0, 1, 2])]),
          "directive 1", "4 experts of region .* do not divide over 3 devices")
  # Devices outside the region's group, and a block that is not aligned.
  _raises(lambda: plan([pj.replicate({}, [0, 1, 2, 3]), pj.shard({"EP": "*"}, [1, 2])]),
          "directive 1", "not a shard group", "consecutive devices")
  _raises(lambda: plan([pj.replicate({}, [0, 1]), pj.shard({"EP": "*"}, [4, 5])]),
          "none of devices")
  # One device is no group; MB/PASS in a shard filter; two group sizes for one kind.
  _raises(lambda: plan([pj.replicate({}, [0, 1]), pj.shard({"EP": "*"}, [1, 5])]),
          "only device 1 of \\[1, 5\\]", "at least two")
  _raises(lambda: plan([pj.replicate({}, [0, 1]), pj.shard({"EP": "*", "PASS": "F"}, [0, 1])]),
          "drop MB and PASS")
  _raises(lambda: plan([pj.replicate({"EP": 0}, [0, 1, 2, 3]), pj.replicate({"EP": 1}, [0, 1, 2, 3]),
                        pj.replicate({"PP": 0}, [0, 1, 2, 3]),
                        pj.shard({"EP": 0}, [0, 1]), pj.shard({"EP": 1}, [0, 1, 2, 3])]),
          r"directive 4 ", "shard over groups of 4 devices but directive 3 uses 2")
  # shard and shard_tensor on the same region.
  _raises(lambda: plan([pj.replicate({}, [0, 1]), pj.shard({"EP": "*"}, [0, 1]),
                        pj.shard_tensor({"EP": 0}, [0, 1])]),
          r"directive 2 \{\"op\": \"shard_tensor\"", "not both")


def test_bad_shard_tensor_directives():
  config, loss, params = _tp_gpt()
  plan = lambda d: _plan(loss, params, config, d)
  # 16 columns of out/proj rows over 3 devices do not divide.
  _raises(lambda: plan([pj.replicate({}, [0, 1, 2]), pj.shard_tensor({}, [0, 1, 2])]),
          r"directive 1 \{\"op\": \"shard_tensor\"", "does not divide over 3 devices")
  # A partitioning name no parameter has.
  _raises(lambda: plan([pj.replicate({}, [0, 1]), pj.shard_tensor({}, [0, 1], axis="model")]),
          "no parameter .* partitioning name 'model'")
  # With shard_tensor over consecutive devices, expert groups must stride over them.
  mconfig, mloss, mparams = _moe(tp_axis="tp")
  _raises(lambda: _plan(mloss, mparams, mconfig, [pj.replicate({}, [0, 1, 2, 3]),
                                                 pj.shard_tensor({}, [0, 1]),
                                                 pj.shard({"EP": "*"}, [0, 1])]),
          r"directive 2 \{\"op\": \"shard\"", "2 devices at stride 2")
  # A model without partitioning names has nothing for shard_tensor to split.
  plain, ploss, pparams = _moe()
  _raises(lambda: _plan(ploss, pparams, plain, [pj.replicate({}, [0, 1]),
                                               pj.shard_tensor({}, [0, 1])]),
          "no parameter")


def test_stage_of_several_regions_runs_in_one_tick():
  # A stage cut into 3 regions per layer by its EP regions still runs each microbatch's
  # F (and B) in one tick: 1F1B over 2 ranks x 4 microbatches takes 2 (m + p - 1) ticks.
  config, loss, params = _moe(n_stages=2, n_layers=4)
  plan = _plan(loss, params, config, pj.strategies.pipeline(2, 4, "1f1b"), batch=8)
  assert len(plan.model.regions) == 2 * (2 * 2 + 1)
  assert len(plan.ticks) == 2 * (4 + 2 - 1)
  for tick in plan.ticks:
    for tasks in tick:
      assert len({(t.mb, t.pass_) for t in tasks}) <= 2  # at most one F and one B
