"""The example GPT (Flax) trains to the same numbers under pipelines x ZeRO as on one device."""

import math
import re

import jax
import optax
import pytest

import piper_jax as pj
from examples import gpt
from models import assert_same_run

pytestmark = pytest.mark.timeout(300)


def _gpt(n_stages, tied=False, **kw):
  kw.setdefault("n_layers", max(2, n_stages))
  config = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=2,
                         n_stages=n_stages, tie_embeddings=tied, **kw)
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


def test_gpt_uneven_stages_1f1b(monkeypatch):
  # balanced_stage_layers gives the last stage (head and loss) fewer blocks.
  config, loss, params = _gpt(2, n_layers=4, stage_layers=(3, 1))
  assert config.stage_bounds == [(0, 3), (3, 4)]
  import models
  monkeypatch.setattr(models, "random_batch", _batches(config))
  assert_same_run(loss, params, pj.strategies.pipeline(2, 2, "1f1b"), batch_size=8)


def test_balanced_stage_layers():
  big = gpt.get_config("1.3b")
  assert gpt.balanced_stage_layers(big, 2) == (13, 11)
  assert gpt.balanced_stage_layers(big, 4) == (7, 7, 6, 4)
  assert gpt.balanced_stage_layers(gpt.get_config("268m"), 2) == (10, 6)
  assert gpt.balanced_stage_layers(big, 1) == (24,)
  with pytest.raises(ValueError, match="stage_layers"):
    gpt.get_config("tiny", n_stages=2, stage_layers=(4, 1))


def test_attention_implementation():
  import dataclasses
  import jax.numpy as jnp
  bf16 = gpt.get_config("268m", dtype=jnp.bfloat16)
  on_gpu = jax.default_backend() == "gpu"
  assert gpt.attention_implementation(bf16) == ("cudnn" if on_gpu else "xla")
  assert gpt.attention_implementation(gpt.get_config("268m")) == "xla"  # fp32
  assert gpt.attention_implementation(dataclasses.replace(bf16, tp_axis="tp")) == "xla"
  assert gpt.attention_implementation(dataclasses.replace(bf16, attention="cudnn")) == "cudnn"
  with pytest.raises(ValueError, match="attention='flash': use None, 'xla', 'xla\\+remat' or 'cudnn'"):
    dataclasses.replace(bf16, attention="flash")


def test_recomputed_attention_keeps_no_scores():
  # "xla+remat" stores q, k and v for the backward, not the T x T probabilities: the
  # planner's estimate made on a CPU then counts what cuDNN's fused attention keeps.
  import optax
  def activations(attention):
    config = gpt.GPTConfig(vocab_size=64, seq_len=128, d_model=32, n_heads=2, n_stages=2,
                           n_layers=2, attention=attention)
    model = gpt.GPT(config)
    params = jax.eval_shape(lambda: gpt.init_params(model, jax.random.PRNGKey(0)))
    batch = jax.eval_shape(lambda: gpt.random_batch(config, jax.random.PRNGKey(0), 8))
    est = pj.strategies.estimate(gpt.loss_fn(model), optax.sgd(0.1), params, batch,
                                 pj.strategies.pipeline(2, 2, "1f1b"), 2, remat=False)
    return est.memory.activations
  full, recomputed = activations("xla"), activations("xla+remat")
  scores = 2 * 2 * 128 * 128 * 4  # a layer's probabilities: heads x T x T fp32, per sequence
  assert full - recomputed >= scores, (full, recomputed)
  # cuDNN asked for where there is none (planning a GPU on a CPU) traces the same.
  if jax.default_backend() != "gpu":
    assert activations("cudnn") == recomputed


def test_gpt_tied_embeddings_gpipe(monkeypatch):
  # Attention recomputed in the backward: a checkpointed call inside a region.
  config, loss, params = _gpt(2, tied=True, attention="xla+remat")
  import models
  monkeypatch.setattr(models, "random_batch", _batches(config))
  assert_same_run(loss, params, pj.strategies.pipeline(2, 4, "gpipe"), batch_size=8)


def test_gpt_zero_bubble_4_stages(monkeypatch):
  # Regression: some weight gradients of a GPT region are literals in the backward jaxpr.
  config, loss, params = _gpt(4)
  import models
  monkeypatch.setattr(models, "random_batch", _batches(config))
  # eps=1e-6: block 1's MLP has weight gradients at rounding level (1e-5 of the leaf's
  # mean), which Adam's default eps turns into full-size steps of either sign; the SGD
  # step still checks every gradient at 1e-5.
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-6, weight_decay=0.1))
  assert_same_run(loss, params, pj.strategies.pipeline(4, 2, "zb"), batch_size=4, tx=tx)


@pytest.mark.parametrize("directives,batch_size", [
    (pj.strategies.pipeline(2, 2, "zb"), 4),
    ([pj.split(4)] + pj.strategies.data_parallel(2, zero=1), 8),  # off here by default
], ids=["zb", "accumulation-dp2"])
def test_gpt_remat(directives, batch_size, monkeypatch):
  # remat=True: B (ZB's BI and BW) recompute elementwise residuals from the values F
  # stores in their place; the same run as one device in fp32.
  config, loss, params = _gpt(2)
  import models
  monkeypatch.setattr(models, "random_batch", _batches(config))
  step, _ = assert_same_run(loss, params, directives, batch_size=batch_size, remat=True)
  assert step.options.remat is True


def test_train_example_runs():
  from examples import train
  # A MoE GPT (make demo runs the dense one) with its experts split over each stage's
  # 2 data-parallel devices.
  out = train.main(["--strategy", "pp-1f1b", "--stages", "2", "--dp", "2", "--zero", "1",
                    "--microbatches", "2", "--steps", "3", "--batch", "8",
                    "--experts", "4", "--ep", "--quiet"])
  losses = out["losses"]
  assert len(losses) == 3 and all(l == l for l in losses) and losses[-1] < losses[0]


def _bf16_gpt_run(monkeypatch):
  """(loss, fp32 params, 2 batches of 8) of a 2-stage GPT that computes in bf16."""
  import jax.numpy as jnp
  import models
  config, loss, params = _gpt(2, dtype=jnp.bfloat16)
  monkeypatch.setattr(models, "random_batch", _batches(config))
  return loss, params, [models.random_batch(jax.random.PRNGKey(i), 8) for i in range(2)]


def _same_as_without_casts(loss_fn, params, batches, tx, directives, losses, got, sgd=True,
                           options=pj.LoweringOptions()):
  """Checks a run with weights cast once (`losses`, final params `got`, lowered with
  `options`) against the same run casting in every task (1e-6) and against one device
  (`assert_same_bf16_run`, with its SGD step unless `sgd` is False); returns the step
  without casts."""
  import dataclasses
  import numpy as np
  import models
  plain, want, plain_step, _ = models.piper_run(
      loss_fn, params, batches, tx, directives,
      options=dataclasses.replace(options, cast_weights=False))
  np.testing.assert_allclose(losses, plain, rtol=1e-6)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                         got, want)
  models.assert_same_bf16_run(loss_fn, params, batches, directives, tx, losses, got, sgd=sgd)
  return plain_step


@pytest.mark.parametrize("zero", [1, 3])  # ZeRO-2: test_parallel's expert-parallel ZeRO-2
def test_bf16_weight_copies_made_once(zero, monkeypatch):  # ZeRO-1: DP; ZeRO-3: 1F1B x DP2
  # fp32 master weights that the model only reads as bf16 are cast once per step (ZeRO-1/2
  # and ZeRO-3: all-gathered as bf16) instead of in every task; the numbers do not change.
  import numpy as np
  import models
  loss_fn, params, batches = _bf16_gpt_run(monkeypatch)
  tx = models.optimizer()
  directives = (pj.strategies.data_parallel(8, zero=zero) if zero < 3 else
                pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=3))
  losses, got, step, state = models.piper_run(loss_fn, params, batches, tx, directives)
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
  cast = {names[p] for p in step.layout.cast}
  assert "['block_0']['attn']['qkv']['kernel']" in cast
  assert not any("ln" in n for n in cast)  # LayerNorm computes in fp32 from its fp32 params
  # Cast leaves sit in slots of their own, all-gathered in bf16 only.
  hlo = step.lower(state, batches[0]).as_text()
  gathered = {"f32": 0, "bf16": 0}
  for dims, dt in re.findall(r"all_gather.*-> tensor<([\dx]+)x(f32|bf16)>", hlo):
    gathered[dt] += math.prod(int(d) for d in dims.split("x"))
  assert gathered["bf16"] > 20 * gathered["f32"], gathered
  if zero == 1:
    # ZeRO-1/2 (Megatron's distributed optimizer): the fp32 parameters are sharded like
    # the optimizer state and gathered (cast slots in bf16) as the step starts.
    assert step.layout.shards_masters
    for x in jax.tree_util.tree_leaves(state.params):
      assert all(s.data.size * 8 == x.size for s in x.addressable_shards), x.sharding
    # The canonical layout (checkpoints) restores them: the next step is the same.
    again = step.from_canonical(step.canonical(state))
    (a, la), (b, lb) = step(state, batches[0]), step(again, batches[0])
    assert float(la) == float(lb)
    jax.tree_util.tree_map(np.testing.assert_array_equal, step.params(a), step.params(b))
  # The SGD step once per path: ZeRO-3's bf16 gathers here; the distributed optimizer's
  # in test_parallel's expert-parallel ZeRO-2 test.
  plain_step = _same_as_without_casts(loss_fn, params, batches, tx, directives, losses, got,
                                      sgd=zero == 3)
  # Without casts ZeRO-1 keeps its fp32 parameters whole; a pipeline's ZeRO-3 still
  # gathers them (fp32) as the step starts.
  assert not plain_step.layout.cast and plain_step.layout.shards_masters == (zero == 3)


def _bf16_weight_slices(step, state, batch) -> int:
  """How many bf16 slices as big as a cast leaf the step's program makes: where tasks
  read their weights from the packed cast copies."""
  sizes = {step.layout.home[p].size for p in step.layout.cast}
  hlo = step.lower(state, batch).as_text()
  return sum(int(n) in sizes for n in re.findall(r"stablehlo.slice.*-> tensor<(\d+)xbf16>", hlo))


@pytest.mark.parametrize("schedule,zero", [("1f1b", 0), ("dualpipev", 1)])
def test_pipeline_weights_unpacked_once(schedule, zero, monkeypatch):
  # A pipeline below ZeRO-3 casts the weights it reads as bf16 once per step and
  # unpacks them into arrays of their own before the ticks, which pass them through:
  # no task slices its weights from a packed segment (on GPU a copy per task and tick).
  # The numbers are those of casting in every task. DualPipeV: two stages a rank, and
  # tied embeddings (both uses on rank 0), under ZeRO-1 x DP 2 (masters gathered in bf16).
  import collections
  import jax.numpy as jnp
  import models
  n_stages, tied = (2, False) if schedule == "1f1b" else (4, True)
  config, loss_fn, params = _gpt(n_stages, tied=tied, dtype=jnp.bfloat16)
  monkeypatch.setattr(models, "random_batch", _batches(config))
  batches = [models.random_batch(jax.random.PRNGKey(i), 8) for i in range(2)]
  tx = models.optimizer()
  directives = pj.strategies.pipeline(n_stages, 4, schedule, dp=2 if zero else 1, zero=zero)
  losses, got, step, state = models.piper_run(loss_fn, params, batches, tx, directives)
  layout = step.layout
  assert layout.cast and set(layout.unpacked_pos) == layout.cast
  # Each sliced once, in the unpacking (in fp32, or gathered in bf16 under ZeRO-1/2).
  assert _bf16_weight_slices(step, state, batches[0]) == (len(layout.cast) if zero else 0)
  # Ranks share positions by size: as many as the rank with the most cast leaves has
  # (1F1B: the first rank's embedding and the last rank's head share one).
  per_rank = collections.Counter(layout.home[p].rank for p in layout.cast)
  assert len(layout.unpacked_positions) == max(per_rank.values())
  _same_as_without_casts(loss_fn, params, batches, tx, directives, losses, got,
                         sgd=schedule == "1f1b")


def test_fp32_model_has_no_weight_casts():
  config, loss, params = _gpt(2)
  batch = gpt.random_batch(config, jax.random.PRNGKey(0), 4)
  from piper_jax.lowering.trace import trace_loss
  assert trace_loss(loss, params, batch).param_casts() == {}


def test_weight_casts_seen_inside_remat_and_jit(monkeypatch):
  # Weights a model casts to bf16 inside jax.checkpoint (nn.remat) or jax.jit are cast
  # once per step too; a weight a jit returns as it is keeps its fp32 reads. Same numbers.
  import jax.numpy as jnp
  import optax
  import models
  bf16 = jnp.bfloat16

  def block(p, x):
    h = jnp.tanh(x.astype(bf16) @ p["w"].astype(bf16)).astype(jnp.float32)
    return x + h + jax.jit(lambda b: b)(p["b"])

  def loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["embed"])
    for s, wrap in enumerate([jax.checkpoint, jax.jit]):
      with pj.annotate("PP"):
        x = wrap(block)(params[f"stage{s}"], x)
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  params = models.init_mlp(jax.random.PRNGKey(0), 2)
  batches = [models.random_batch(jax.random.PRNGKey(i), 16) for i in range(2)]
  tx = models.optimizer()
  directives = pj.strategies.data_parallel(8, zero=1)
  losses, got, step, _ = models.piper_run(loss, params, batches, tx, directives)
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
  assert {names[p] for p in step.layout.cast} == {"['stage0']['w']", "['stage1']['w']"}
  # A pipeline below ZeRO-3 casts them once too, and unpacks them once (one per rank).
  pipe = pj.compile(loss, tx, pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1), params,
                    batches[0])
  assert set(pipe.layout.unpacked_pos) == pipe.layout.cast == step.layout.cast
  assert len(pipe.layout.unpacked_positions) == 1  # the two stages' w share a position
  _same_as_without_casts(loss, params, batches, tx, directives, losses, got, sgd=False)


def test_compiled_ops_keep_the_model_names():
  # Regions are re-evaluated equation by equation; each op keeps the Flax scopes it was
  # traced under, so profiles and HLO dumps name a kernel's block and layer.
  config, loss, params = _gpt(2)
  batch = gpt.random_batch(config, jax.random.PRNGKey(0), 8)
  import optax
  step = pj.compile(loss, optax.sgd(0.1), pj.strategies.pipeline(2, 2, "1f1b", dp=4), params, batch)
  text = step.lower(step.init(params), batch).as_text(debug_info=True)
  assert "block_1/mlp" in text and "transpose(jvp(GPT))" in text
