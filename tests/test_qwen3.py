"""The Qwen3 examples (dense and MoE in linen, dense in NNX) train to one device's numbers
under PP, DP x TP and DP x EP, and their presets have the published shapes."""

import jax
import numpy as np
import optax
import pytest

import piper_jax as pj
from examples import qwen3
from models import assert_same_run

pytestmark = pytest.mark.timeout(240)

# tests/test_parallel.py's MOE_TX, for every model here: Adam with eps=1e-8 moves an
# element whose gradient is at rounding level by a full step of that noise (a rarely
# routed expert's; in the dense tiny model one q-kernel element of block 0 has a first
# gradient of 2e-9 against 1e-2 elsewhere, and its two-step difference from one device
# was 4e-4). eps=1e-6 keeps the comparison about the gradients, which assert_same_run
# also checks directly with a plain SGD step.
TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-6, weight_decay=0.1))


def _model(name, **overrides):
  config = qwen3.get_config(name, **overrides)
  model = qwen3.make_model(config)
  params = jax.jit(lambda rng: qwen3.init_params(model, rng))(jax.random.PRNGKey(0))
  return config, model, params


def _split_piece_shapes(state):
  return [x.addressable_shards[0].data.shape for x in state.params.split]


def _n_params(name, **overrides):
  model = qwen3.make_model(qwen3.get_config(name, **overrides))
  shapes = jax.eval_shape(lambda rng: qwen3.init_params(model, rng), jax.random.PRNGKey(0))
  return qwen3.count_params(shapes), shapes


def test_presets_have_published_shapes():
  # Shapes only (jax.eval_shape): no parameter is made.
  n, p = _n_params("qwen3-1.7b")
  assert abs(n / 1.7e9 - 1) < 0.05, n                  # 1.72e9
  assert "head" not in p                                # tied
  assert p["block_0"]["attn"]["q"]["kernel"].shape == (2048, 16 * 128)
  assert p["block_0"]["attn"]["k"]["kernel"].shape == (2048, 8 * 128)
  assert p["block_0"]["attn"]["q_norm"]["scale"].shape == (128,)
  assert p["block_27"]["mlp"]["gate"]["kernel"].shape == (2048, 6144)
  n, p = _n_params("qwen3-8b")
  assert abs(n / 8.2e9 - 1) < 0.05, n                  # 8.19e9
  assert p["head"]["kernel"].shape == (4096, 151936)   # untied
  assert p["block_35"]["attn"]["o"]["kernel"].shape == (32 * 128, 4096)
  # Qwen3-30B-A3B at its 48 layers: 30.5e9 parameters; the 4-GPU preset keeps 8.
  n, p = _n_params("qwen3-30b-a3b-4gpu", n_layers=48)
  assert abs(n / 30.5e9 - 1) < 0.05, n
  assert p["block_0"]["moe"]["experts"]["w_gate"].shape == (128, 2048, 768)
  assert p["block_0"]["moe"]["router"]["kernel"].shape == (2048, 128)
  n8, _ = _n_params("qwen3-30b-a3b-4gpu")
  assert qwen3.get_config("qwen3-30b-a3b-4gpu").n_layers == 8 and 5e9 < n8 < 6e9
  assert qwen3.get_config("qwen3-8b").seq_len == 4096
  # Active matmul weights of the 48 layers (flops_per_token / 6 less the attention term):
  # 3.0e9 (Qwen's 3.3e9 counts the embedding too).
  cfg = qwen3.get_config("qwen3-30b-a3b-4gpu", n_layers=48)
  active = qwen3.flops_per_token(cfg) / 6 - 2 * 48 * 4096 * 32 * 128
  assert abs((active + 2048 * 151936) / 3.3e9 - 1) < 0.05, active


def test_dense_1f1b_tied(batches_of):
  # 2 stages of one block each; the tied embedding is read by the first stage (lookup)
  # and the last (head): its gradient is the sum of both. Blocks checkpointed (remat):
  # each region's forward keeps only its blocks' inputs for the backward.
  config, model, params = _model("qwen3-tiny", n_stages=2, tie_embeddings=True, remat=True)
  assert "head" not in params
  batches_of(config)
  step, _ = assert_same_run(qwen3.loss_fn(model), params, pj.strategies.pipeline(2, 2, "1f1b"),
                            batch_size=8, tx=TX)
  assert step.plan.mesh.n_pp == 2
  kept = {}
  for remat in (False, True):
    m = qwen3.make_model(qwen3.get_config("qwen3-tiny", n_stages=2, remat=remat))
    shapes = jax.eval_shape(lambda: qwen3.init_params(m, jax.random.PRNGKey(0)))
    batch = jax.eval_shape(lambda: qwen3.random_batch(m.config, jax.random.PRNGKey(0), 8))
    kept[remat] = pj.strategies.estimate(qwen3.loss_fn(m), TX, shapes, batch,
                                         pj.strategies.pipeline(2, 2, "1f1b"), 2,
                                         remat=False).memory.activations
  assert kept[True] < kept[False] / 2, kept
  with pytest.raises(ValueError, match="hide a MoE block's EP region"):
    qwen3.get_config("qwen3-moe-tiny", remat=True)


def test_dense_dp2_x_tp2(batches_of):
  # Megatron TP 2 (q/k/v/gate/up by columns, o/down by rows) x DP 2, grouped-query
  # attention's 4 query and 2 key/value heads halved on each device.
  config, model, params = _model("qwen3-tiny", tp_axis="tp")
  batches_of(config)
  directives = [pj.replicate({}, [0, 1, 2, 3]), pj.shard_tensor({}, [0, 1])]
  step, state = assert_same_run(qwen3.loss_fn(model), params, directives, batch_size=8, tx=TX)
  names = {s.name: s.names for s in step.plan.model.params}
  for w in ("attn/q", "attn/k", "attn/v", "mlp/gate", "mlp/up"):
    assert names[f"block_0/{w}/kernel/value"] == (None, "tp"), w
  for w in ("attn/o", "mlp/down"):
    assert names[f"block_1/{w}/kernel/value"] == ("tp", None), w
  assert names["block_0/attn/q_norm/scale"] is None
  assert step.plan.mesh.size("tp") == 2
  pieces = set(_split_piece_shapes(state))
  assert (1, 1, 64, 64 // 2) in pieces and (1, 1, 128 // 2, 64) in pieces, pieces


def test_moe_ep2_x_dp2(batches_of):
  # 8 experts top-2 with a shared expert, dropless; experts split over blocks of 2 of
  # 4 data-parallel devices (ZeRO-1). The loss includes the load-balancing term.
  config, model, params = _model("qwen3-moe-tiny", shared_intermediate=64)
  batches_of(config)
  loss = qwen3.loss_fn(model)
  batch = qwen3.random_batch(config, jax.random.PRNGKey(0), 8, pattern_seed=1)
  logits, aux = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, batch["tokens"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  assert 2.0 <= float(aux) < 2.5  # top_k when balanced, near it at init
  whole = float(jax.jit(loss)(params, batch))
  np.testing.assert_allclose(whole, float(ce) + 1e-3 * float(aux), rtol=1e-6)
  # Dropless routing and the per-sequence aux loss do not depend on the grouping: the
  # loss of the batch is the mean of its quarters' (the data-parallel replicas').
  quarter = jax.jit(lambda p, b: jax.vmap(lambda q: loss(p, q))(
      jax.tree_util.tree_map(lambda x: x.reshape(4, 2, *x.shape[1:]), b)))
  np.testing.assert_allclose(float(np.mean(quarter(params, batch))), whole, rtol=1e-5)
  directives = [pj.replicate({}, [0, 1, 2, 3], zero=1), pj.shard({"EP": "*"}, [0, 1])]
  step, state = assert_same_run(loss, params, directives, batch_size=8, tx=TX)
  assert step.plan.mesh.axis_names == ("dp", "ep", "pp") and step.plan.mesh.size("ep") == 2
  assert {s[2] for s in _split_piece_shapes(state)} == {config.n_experts // 2}
  a2a = [x for x in step.plan.graph.nodes.values() if x.kind.value == "all_to_all"]
  assert len(a2a) == 2 * 2 * config.n_layers  # in and out of every expert F and B


def test_moe_bf16_ep2(batches_of):
  # bf16 compute with fp32 weights (the GPU presets' setting): the experts' weights are
  # cast inside the EP region, so they stay its parameters and split over EP 2 (x DP 2
  # in test_moe_ep2_x_dp2, in fp32).
  import jax.numpy as jnp
  from models import assert_same_bf16_run
  config, model, params = _model("qwen3-moe-tiny", dtype=jnp.bfloat16)
  batches = [qwen3.random_batch(config, jax.random.PRNGKey(i), 8, pattern_seed=1) for i in range(2)]
  directives = [pj.replicate({}, [0, 1], zero=1), pj.shard({"EP": "*"}, [0, 1])]
  assert_same_bf16_run(qwen3.loss_fn(model), params, batches, directives, TX,
                       devices=jax.devices()[:2])


def test_nnx_1f1b(batches_of):
  # The NNX model's state (nnx.split) is the parameter pytree, as it is: the reference
  # is jax.value_and_grad of the same loss on one device.
  from flax import nnx
  from examples import qwen3_nnx
  config = qwen3.get_config("qwen3-tiny", n_stages=2, remat=True)  # blocks under nnx.remat
  graphdef, state = qwen3_nnx.init(config, 0)
  # Plain arrays (nnx.merge/update share the Variables). flax 0.12: nnx.to_pure_dict.
  start = nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()
  loss = qwen3_nnx.loss_fn(graphdef)
  batches_of(config)
  step, train_state = assert_same_run(loss, state, pj.strategies.pipeline(2, 2, "1f1b"),
                                      batch_size=8, tx=TX)
  assert step.plan.mesh.n_pp == 2
  trained = step.params(train_state)
  assert isinstance(trained, nnx.State)
  assert not np.allclose(trained["embed"]["embedding"][...], start["embed"]["embedding"])
  # The same network as the linen model: the NNX weights give the linen model's logits.
  params = {k: v for k, v in start.items() if k != "blocks"}
  params.update({f"block_{i}": b for i, b in start["blocks"].items()})
  tokens = qwen3.random_batch(config, jax.random.PRNGKey(3), 2)["tokens"]
  want, _ = jax.jit(qwen3.Qwen3(config).apply)({"params": params}, tokens)
  _, fresh = qwen3_nnx.init(config, 0)  # the same seed: the weights of `start`
  np.testing.assert_array_equal(fresh["blocks"][1]["mlp"]["down"]["kernel"][...],
                                start["blocks"][1]["mlp"]["down"]["kernel"])
  got = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(fresh, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_moe_1f1b_with_aux_loss(batches_of):
  # The running aux loss crosses the stage boundary (from the first stage's last region
  # to the region after the second stage's experts); no expert parallelism here.
  config, model, params = _model("qwen3-moe-tiny", n_stages=2)
  batches_of(config)
  step, _ = assert_same_run(qwen3.loss_fn(model), params, pj.strategies.pipeline(2, 2, "1f1b"),
                            batch_size=8, tx=TX)
  regions = step.plan.model.regions
  assert [dict(r.tags).get("PP") for r in regions] == [0, 0, 0, 1, 1, 1]
  aux_in = [i for i in regions[-1].inputs if i.spec.shape == ()]
  assert [i.region for i in aux_in] == [2]  # stage 0's running sum, differentiable
  assert aux_in[0].differentiable


def test_train_example_takes_qwen3_presets():
  from examples import train
  # The MoE preset's experts split over each stage's 2 data-parallel devices.
  out = train.main(["--model", "qwen3-moe-tiny", "--strategy", "pp-1f1b", "--stages", "2",
                    "--dp", "2", "--microbatches", "2", "--steps", "3", "--batch", "8",
                    "--ep", "--quiet"])
  losses = out["losses"]
  assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  assert out["step"].plan.mesh.size("ep") == 2
