"""Every optax optimizer gives one device's numbers under DP ZeRO-1, ZeRO-3 and 1F1B."""

import jax
import numpy as np
import optax
import pytest

import piper_jax as pj
from models import assert_same_run, init_mlp, mlp_loss, moe_gpt, tp_gpt
from piper_jax.lowering.buffers import Buffers
from piper_jax.lowering.optimizer import packed_update_reason

pytestmark = pytest.mark.timeout(240)


def _no_decay_on_vectors(params):
  return jax.tree_util.tree_map(lambda x: x.ndim > 1, params)


def _labels(params):
  return jax.tree_util.tree_map(lambda x: "matrix" if x.ndim > 1 else "vector", params)


# name -> (optimizer, whether it may update the packed buffers). Large decay and
# learning rates, so that a mask applied to the wrong leaves moves them far.
OPTIMIZERS = {
    "sgd": (optax.sgd(1.0), True),
    "adam": (optax.adam(1e-2), True),
    "adamw": (optax.adamw(1e-2, weight_decay=0.5), True),
    "adamw_mask": (optax.adamw(1e-2, weight_decay=0.5, mask=_no_decay_on_vectors), False),
    "lion": (optax.lion(1e-3, weight_decay=0.5), True),
    "multi_transform": (optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.3)}, _labels), False),
    "adafactor": (optax.adafactor(1e-2, min_dim_size_to_factor=4), False),
    "muon": (optax.contrib.muon(1e-2), False),
}
STRATEGIES = {
    "dp_zero1": lambda: pj.strategies.data_parallel(4, zero=1),
    "dp_zero3": lambda: pj.strategies.data_parallel(4, zero=3),
    "1f1b": lambda: pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_one_device(name, strategy):
  tx, packed = OPTIMIZERS[name]
  loss, params = mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2)
  # The plain-SGD check of each strategy's gradients runs with "sgd".
  step, _ = assert_same_run(loss, params, STRATEGIES[strategy](), tx=tx, check_sgd=name == "sgd")
  assert (step.leaf_update is None) == packed, step.leaf_update


def test_leaf_dependent_optimizers_are_named():
  params = init_mlp(jax.random.PRNGKey(0), 1)
  reason = packed_update_reason(OPTIMIZERS["adamw_mask"][0], params)
  assert "differ from leaf to leaf" in reason and "stage0" in reason
  assert "per-leaf norm" in packed_update_reason(optax.lars(1e-2), params)
  assert packed_update_reason(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                              params) is None


def test_a_mask_that_reads_paths_is_checked_on_the_buffers_too():
  # Every leaf of this model is a kernel, so on the user's tree the mask is all True
  # and the update uniform; on the packed buffers (paths "slots", "shared") it is all
  # False, which would leave every parameter frozen, were the buffers not checked.
  params = {"kernel_a": np.ones((4, 4), np.float32), "kernel_b": np.ones((4, 2), np.float32)}
  by_path = lambda t: jax.tree_util.tree_map_with_path(
      lambda p, _: "kernel" in jax.tree_util.keystr(p), t)
  tx = optax.masked(optax.sgd(1.0), by_path)
  assert packed_update_reason(tx, params) is None
  shapes = Buffers(slots={"float32": [jax.ShapeDtypeStruct((2, 2, 12), np.float32)]}, shared={})
  assert "packed buffers" in packed_update_reason(tx, params, shapes)
  assert packed_update_reason(optax.sgd(1.0), params, shapes) is None
  loss = lambda p, b: ((b["x"][:, :4] @ p["kernel_a"] @ p["kernel_b"]) ** 2).mean()
  batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8,), np.int32)}
  step = pj.compile(loss, tx, pj.strategies.data_parallel(4, zero=1), params, batch)
  assert step.leaf_update is not None
  state, _ = step(step.init(params), batch)
  grads = jax.grad(loss)(params, batch)
  got = step.params(state)
  for k in params:
    np.testing.assert_allclose(got[k], params[k] - grads[k], rtol=1e-6, atol=1e-7)


MASKED = optax.chain(optax.clip_by_global_norm(0.5),
                     optax.adamw(1e-2, eps=1e-6, weight_decay=0.5, mask=_no_decay_on_vectors))


@pytest.mark.parametrize("kind", ["ep_x_zero2", "tp_x_dp", "dualpipev_zero2"])
def test_masked_adamw_under_split_and_pipelined_strategies(kind, batches_of):
  if kind == "dualpipev_zero2":
    loss, params = mlp_loss(4), init_mlp(jax.random.PRNGKey(0), 4)
    directives = pj.strategies.pipeline(4, 4, "dualpipev", dp=2, zero=2)
  else:
    if kind == "ep_x_zero2":
      config, loss, params = moe_gpt()
      directives = [pj.replicate({}, [0, 1, 2, 3], zero=2), pj.shard({"EP": "*"}, [0, 1])]
    else:
      config, loss, params = tp_gpt()
      directives = [pj.replicate({}, [0, 1, 2, 3]), pj.shard_tensor({}, [0, 1])]
    batches_of(config)
  step, state = assert_same_run(loss, params, directives, tx=MASKED, batch_size=8)
  assert step.leaf_update is not None
  # The state round-trips through the canonical (checkpoint) layout.
  again = step.from_canonical(step.canonical(state))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b),
                         step.canonical(again), step.canonical(state))
