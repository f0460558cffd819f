"""`check` fails real strategy bugs in float32 and bfloat16, on 2 and 8 devices.

Each bug is planted through what `check` compares, the step it is given: a step compiled
from a wrong loss or optimizer (and recompiled with that bug for the SGD check), judged
against the right loss and optimizer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import piper_jax as pj
from piper_jax.check import check
from models import N_CLASSES, init_mlp, optimizer, random_batch

pytestmark = pytest.mark.timeout(300)

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
# Per device count: a strategy with microbatches, data parallel ZeRO and its batch size.
STRATEGIES = {
    1: ([pj.split(2), pj.place({}, [0])], 1, 16),  # accumulation on one device (or GPU)
    2: ([pj.split(2)] + pj.strategies.data_parallel(2, zero=1), 2, 16),  # (directives, dp, batch)
    8: (pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=1), 4, 16),
}


def tied_loss(dtype, weighted: bool = False, cut_tie: bool = False):
  """A two-stage MLP whose classifier is its embedding's transpose, computed in `dtype`.

  `weighted`: each row's loss is scaled by the batch's "w" (1 is the right loss; 0 drops
  rows, 2 counts them twice). `cut_tie`: the classifier's use of the tied weight gets no
  gradient (a wrong tied-weight sum).
  """

  def loss(params, batch):
    c = lambda x: x.astype(dtype)
    x = jnp.tanh(c(batch["x"]) @ c(params["embed"]))
    for s in range(2):
      with pj.annotate("PP"):
        p = params[f"stage{s}"]
        x = x + jnp.tanh(x @ c(p["w"]) + c(p["b"]))
    embed = jax.lax.stop_gradient(params["embed"]) if cut_tie else params["embed"]
    logits = (x @ c(embed[:N_CLASSES].T)).astype(jnp.float32)
    rows = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.mean(rows * batch["w"]) if weighted else jnp.mean(rows)

  return loss


def _batch(size, weights=None):
  b = random_batch(jax.random.PRNGKey(1), size)
  return {**b, "w": jnp.ones((size,)) if weights is None else jnp.asarray(weights, jnp.float32)}


class _Planted:
  """A step compiled with `bug(optimizer)` that says it was compiled with `optimizer`."""

  def __init__(self, step, bug):
    self._step, self._bug = step, bug

  def __getattr__(self, name):
    return getattr(self._step, name)

  def __call__(self, state, batch):
    return self._step(state, batch)

  def with_optimizer(self, tx):
    return self._step.with_optimizer(self._bug(tx))


@functools.lru_cache(maxsize=None)
def _weighted_step(n_devices, dtype):
  directives, _, size = STRATEGIES[n_devices]
  return pj.compile(tied_loss(DTYPES[dtype], weighted=True), optimizer(), directives,
                    init_mlp(jax.random.PRNGKey(0), 2, tied=True), _batch(size),
                    devices=jax.devices()[:n_devices])


def _check(step, n_devices, dtype, weights=None, sgd=True):
  _, _, size = STRATEGIES[n_devices]
  return check(step, init_mlp(jax.random.PRNGKey(0), 2, tied=True), _batch(size, weights),
               loss_fn=tied_loss(DTYPES[dtype]), optimizer=optimizer(), sgd=sgd)


# On an accelerator: `JAX_PLATFORMS=cuda pytest tests/test_check_catches.py -k "1-fp32 or 1-bf16"`.
CASES = [(n, d) for n in STRATEGIES for d in DTYPES if n <= len(jax.devices())]


@pytest.mark.parametrize("n_devices,dtype", CASES)
def test_a_correct_strategy_passes(n_devices, dtype):
  report = _check(_weighted_step(n_devices, dtype), n_devices, dtype)
  assert report.passed, str(report)
  # On a GPU, float32 products run at its TF32 default and are judged as reduced precision.
  assert report.precision in ((dtype,) if dtype == "bf16" else ("fp32", "tf32"))


@pytest.mark.parametrize("n_devices,dtype", CASES)
@pytest.mark.parametrize("weight", [0.0, 2.0], ids=["dropped", "doubled"])
def test_a_dropped_or_doubled_microbatch_fails(n_devices, dtype, weight):
  _, dp, size = STRATEGIES[n_devices]
  # The rows of one microbatch of one replica, as if it were left out or counted twice.
  rows = size // (dp * 2)
  weights = np.ones(size)
  weights[:rows] = weight
  report = _check(_weighted_step(n_devices, dtype), n_devices, dtype, weights)
  assert not report.passed, str(report)
  assert any(f.startswith("gradient of") for f in report.failures), report.failures


def _scaled_by_dp(dp):
  return lambda tx: optax.chain(optax.scale(float(dp)), tx)


def _frozen(tx):
  mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: jax.tree_util.keystr(path) == "['stage1']['w']", params)
  return optax.chain(tx, optax.masked(optax.set_to_zero(), mask))


def _stale_shard(tx):
  """ZeRO's shard of ['stage0']['w'] on the second replica never written back."""

  def update(updates, state, params=None):
    updates, state = tx.update(updates, state, params)
    stale = lambda path, u: (u.at[u.shape[0] // 2:].set(0)
                             if jax.tree_util.keystr(path) == "['stage0']['w']" else u)
    return jax.tree_util.tree_map_with_path(stale, updates), state

  return optax.GradientTransformation(tx.init, update)


BUGS = {"scaled_by_dp": None, "frozen_leaf": _frozen, "stale_zero_shard": _stale_shard}


@pytest.mark.parametrize("n_devices,dtype", CASES)
@pytest.mark.parametrize("bug", list(BUGS))
def test_optimizer_side_bugs_fail(n_devices, dtype, bug):
  directives, dp, size = STRATEGIES[n_devices]
  if bug == "scaled_by_dp" and dp == 1:
    pytest.skip("one device has no data-parallel size to scale by")
  plant = BUGS[bug] or _scaled_by_dp(dp)
  step = pj.compile(tied_loss(DTYPES[dtype]), plant(optimizer()), directives,
                    init_mlp(jax.random.PRNGKey(0), 2, tied=True), _batch(size),
                    devices=jax.devices()[:n_devices])
  report = _check(_Planted(step, plant), n_devices, dtype)
  assert not report.passed, str(report)
  if bug == "frozen_leaf":
    assert report.frozen == ("['stage1']['w']",)
  elif bug == "stale_zero_shard":
    assert "['stage0']['w']" in " ".join(report.failures)
  else:  # Adam hides the scale; the SGD step shows it
    assert any(f.startswith("gradient of") for f in report.failures)


@pytest.mark.parametrize("n_devices,dtype", CASES)
def test_a_wrong_tied_weight_sum_fails(n_devices, dtype):
  directives, _, size = STRATEGIES[n_devices]
  step = pj.compile(tied_loss(DTYPES[dtype], cut_tie=True), optimizer(), directives,
                    init_mlp(jax.random.PRNGKey(0), 2, tied=True), _batch(size),
                    devices=jax.devices()[:n_devices])
  report = _check(step, n_devices, dtype)
  assert not report.passed
  assert any("['embed']" in f for f in report.failures), str(report)
