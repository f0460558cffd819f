"""Each region's GEMMs by shape (`ir.Gemm`), which the planner costs one by one on a
card it knows: attention's products told apart, causal or not."""

import jax
import jax.numpy as jnp
import pytest

import piper_jax as pj
from piper_jax.lowering.trace import trace_loss

pytestmark = pytest.mark.timeout(60)

B, T, H, N, D = 2, 16, 4, 8, 24  # batch, sequence, heads, head dim, model width


def _gemms(causal: bool, checkpointed: bool = False):
  def attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

  if checkpointed:  # as a model stands in for cuDNN's attention on a CPU
    attend = jax.checkpoint(attend)

  def loss(params, batch):
    with pj.annotate("PP"):
      x = batch["x"] @ params["w_in"]
      qkv = (x @ params["w_qkv"]).reshape(B, T, 3, H, N)
      y = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(B, T, H * N)
    return jnp.mean((y @ params["w_out"]) ** 2)

  params = {"w_in": jnp.ones((D, D)), "w_qkv": jnp.ones((D, 3 * H * N)),
            "w_out": jnp.ones((H * N, D))}
  spec = trace_loss(loss, params, {"x": jnp.ones((B, T, D))}).spec
  (region,) = spec.regions
  return region


@pytest.mark.parametrize("checkpointed", [False, True])
def test_causal_attentions_products_are_told_from_the_layers(checkpointed):
  region = _gemms(causal=True, checkpointed=checkpointed)
  by = {(g.m, g.k, g.n, g.attention): g for g in region.gemms}
  # The layers: rows are the batch's tokens.
  assert by[(B * T, D, D, False)].count == 1
  assert by[(B * T, D, 3 * H * N, False)].count == 1
  assert by[(B * T, H * N, D, False)].count == 1
  # Scores and values: one T x T product per sequence and head each, causal.
  attention = [g for g in region.gemms if g.attention]
  assert sum(g.count for g in attention) == 2 * B * H and all(g.causal for g in attention)
  # Under the checkpoint the backward runs attention's products again, not the layers'.
  assert all(g.recomputed == checkpointed for g in attention)
  assert not any(g.recomputed for g in region.gemms if not g.attention)
  assert sum(g.count * g.flops for g in region.gemms) == pytest.approx(region.flops)
  # A microbatch of half the rows: the layers' products get half the rows, attention's
  # half as many products of the same size.
  half = [g.at(0.5) for g in region.gemms]
  assert {g.m for g in half if not g.attention} == {B * T // 2}
  assert sum(g.count for g in half if g.attention) == B * H


def test_attention_without_a_causal_mask_is_not_halved():
  region = _gemms(causal=False)
  assert not any(g.causal for g in region.gemms)


def _step_ms(checkpointed: bool, layer_checkpointed: bool = False) -> float:
  """The H200 planner's step of a 1-device plan of `_gemms`' model."""
  import optax

  def attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

  attend = jax.checkpoint(attend) if checkpointed else attend
  layer = lambda x, w: x @ w
  layer = jax.checkpoint(layer) if layer_checkpointed else layer

  def loss(params, batch):
    with pj.annotate("PP"):
      x = layer(batch["x"], params["w_in"])
      qkv = (x @ params["w_qkv"]).reshape(B, T, 3, H, N)
      y = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(B, T, H * N)
    return jnp.mean((y @ params["w_out"]) ** 2)

  params = {"w_in": jnp.ones((D, D)), "w_qkv": jnp.ones((D, 3 * H * N)),
            "w_out": jnp.ones((H * N, D))}
  costs = pj.strategies.CostModel.for_accelerator("H200")
  est = pj.strategies.estimate(loss, optax.sgd(0.1), params, {"x": jnp.ones((B, T, D))},
                               pj.strategies.data_parallel(1), 1, costs=costs)
  return est.compute_time * 1e3


def test_a_fused_attentions_recomputed_scores_cost_nothing_more_on_a_card():
  # cuDNN's backward recomputes the scores inside the kernel whose rate the card holds;
  # on a CPU the same attention stands in under a checkpoint: one cost either way, so
  # that a laptop's table is the GPU host's. A checkpointed layer costs its GEMM again.
  assert _step_ms(checkpointed=True) == pytest.approx(_step_ms(checkpointed=False), rel=1e-9)
  assert _step_ms(checkpointed=False, layer_checkpointed=True) > _step_ms(checkpointed=False)
