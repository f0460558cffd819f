"""`check`: a correct strategy passes; wrong parameters, a frozen leaf, a wrong gradient fail."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import piper_jax as pj
from piper_jax import check as check_mod
from piper_jax.memory import CompiledMemory
from piper_jax.precision import precision_of
from piper_jax.check import check
from models import init_mlp, mlp_loss, optimizer, random_batch

pytestmark = pytest.mark.timeout(240)

N_STAGES = 2
LOSS = mlp_loss(N_STAGES)


def _setup(directives, tx=None, loss_fn=LOSS):
  params = init_mlp(jax.random.PRNGKey(0), N_STAGES)
  batch = random_batch(jax.random.PRNGKey(1), 16)
  if tx is None and loss_fn is LOSS and directives == pj.strategies.pipeline(N_STAGES, 2, "1f1b"):
    return _pipeline_step(), params, batch
  step = pj.compile(loss_fn, tx or optimizer(), directives, params, batch)
  return step, params, batch


@functools.lru_cache(maxsize=None)
def _pipeline_step():
  """The 1F1B step most tests check (compiled once: its runs start from `init` anew)."""
  params = init_mlp(jax.random.PRNGKey(0), N_STAGES)
  return pj.compile(LOSS, optimizer(), pj.strategies.pipeline(N_STAGES, 2, "1f1b"), params,
                    random_batch(jax.random.PRNGKey(1), 16))


class _Wrapped:
  """A step that answers like `step` except for the attributes given, to fake a wrong one."""

  def __init__(self, step, **overrides):
    self._step = step
    self.__dict__.update(overrides)

  def __getattr__(self, name):
    return getattr(self._step, name)

  def __call__(self, state, batch):
    return self._step(state, batch)


def _params_with(step, key, change):
  """`step.params`, with the leaf named `key` replaced by `change(leaf, initial leaf)`."""

  def params(state):
    out = step.params(state)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: change(x) if jax.tree_util.keystr(path) == key else x, out)

  return params


def test_correct_pipeline_passes_with_tiny_differences():
  step, params, batch = _setup(pj.strategies.pipeline(2, 2, "1f1b"))
  report = step.check(params, batch, steps=2)
  assert report.passed, str(report)
  assert report.failures == () and report.frozen == ()
  assert report.precision == "fp32" and report.reference == "one_device"
  assert report.rtol == 1e-4 and report.loss_rtol == 1e-5
  assert len(report.losses) == len(report.reference_losses) == 2
  assert report.losses[1] < report.losses[0]  # it trained
  assert report.loss_rel_diff < 1e-5
  assert set(report.leaves) == {"['embed']", "['head']", "['stage0']['w']", "['stage0']['b']",
                                "['stage1']['w']", "['stage1']['b']"}
  assert max(report.leaves.values()) < 1e-5
  assert set(report.grad_leaves) == set(report.leaves)
  assert max(report.grad_leaves.values()) < 1e-5
  assert max(report.left_out.values()) < 0.05  # elements at gradient noise: next to none
  worst = report.worst[0]
  assert worst == max(report.leaves.items(), key=lambda kv: kv[1]) and len(report.worst) == 5
  text = str(report)
  assert "PASSED" in text and worst[0] in text and "one SGD step" in text


def test_zero1_against_jit_over_the_same_devices_with_a_batch_iterator():
  step, params, batch = _setup(pj.strategies.data_parallel(4, zero=1))
  batches = iter([random_batch(jax.random.PRNGKey(i), 16) for i in range(3)])
  report = check(step, params, batches, steps=2, reference="jit", sgd=False, loss_fn=LOSS)
  assert report.passed, str(report)
  assert report.reference == "jit" and report.grad_leaves is None
  assert next(batches) is not None  # two of the three were used
  assert report.losses[0] != report.losses[1]
  assert "jax.jit over the same devices" in str(report)


def test_wrong_parameters_fail_naming_the_leaf():
  step, params, batch = _setup(pj.strategies.pipeline(2, 2, "1f1b"))
  wrong = _Wrapped(step, params=_params_with(step, "['stage1']['w']", lambda x: x * 1.01))
  report = check(wrong, params, batch, loss_fn=LOSS)
  assert report.passed is False
  assert report.worst[0][0] == "['stage1']['w']"
  assert report.worst[0][1] == pytest.approx(0.01, rel=5e-2)  # a few elements left out
  assert report.frozen == ()
  assert any("['stage1']['w']" in f for f in report.failures)
  text = str(report)
  assert "FAILED" in text and "['stage1']['w']" in text.split("worst parameters")[1]


def test_frozen_leaf_fails_whatever_the_tolerance():
  step, params, batch = _setup(pj.strategies.pipeline(2, 2, "1f1b"))
  before = params["stage1"]["w"]
  frozen = _Wrapped(step, params=_params_with(step, "['stage1']['w']", lambda x: before))
  report = check(frozen, params, batch, rtol=1.0, sgd=False, loss_fn=LOSS)
  assert report.rtol == report.loss_rtol == 1.0
  assert report.leaves["['stage1']['w']"] < 1.0  # within the tolerance, yet it fails
  assert report.passed is False
  assert report.frozen == ("['stage1']['w']",)
  assert "FROZEN" in str(report) and "frozen" in str(report)


def test_a_bias_that_starts_at_zero_is_compared_at_the_models_scale():
  # ['stage0']['b'] starts at zero, so its norm is its update's (about 0.07 of the
  # model's RMS scale): 0.05% of the update passes at fp32, 5% of it fails.
  step, params, batch = _setup(pj.strategies.pipeline(2, 2, "1f1b"))
  before = params["stage0"]["b"]
  reports = {}
  for fraction in (5e-4, 5e-2):
    nudged = _Wrapped(step, params=_params_with(
        step, "['stage0']['b']", lambda x: x + fraction * (x - before)))
    reports[fraction] = check(nudged, params, batch, sgd=False, loss_fn=LOSS)
  small, large = (reports[f].leaves["['stage0']['b']"] for f in (5e-4, 5e-2))
  assert large / small == pytest.approx(100, rel=1e-2)
  assert small < 5e-4 / 5  # relative to its own norm it would be 5e-4
  assert reports[5e-4].passed, str(reports[5e-4])
  assert reports[5e-2].passed is False
  assert reports[5e-2].worst[0][0] == "['stage0']['b']"


def test_gradient_scale_hidden_by_adam_is_caught_by_sgd():
  # A strategy whose gradients come out twice too large: clipping and Adam normalise the
  # update, so losses and parameters agree; the SGD step does not.
  doubled = lambda tx: optax.chain(optax.scale(2.0), tx)
  step, params, batch = _setup(pj.strategies.pipeline(2, 2, "1f1b"), tx=doubled(optimizer()))
  wrong = _Wrapped(step, with_optimizer=lambda tx: step.with_optimizer(doubled(tx)))
  hidden = check(wrong, params, batch, sgd=False, loss_fn=LOSS, optimizer=optimizer())
  assert hidden.passed, str(hidden)
  report = check(wrong, params, batch, loss_fn=LOSS, optimizer=optimizer())
  assert report.loss_rel_diff < 1e-5
  assert report.passed is False
  # Twice the gradient is 1.0 off relative to the leaf's own; small leaves are
  # measured against the model's RMS gradient, so less, but still far out.
  assert max(report.grad_leaves.values()) == pytest.approx(1.0, rel=1e-4)
  assert min(report.grad_leaves.values()) > 0.1
  assert all(f.startswith("gradient of ") for f in report.failures)
  assert report.worst_grads[0][0] in str(report).split("worst gradients")[1]


def test_bf16_is_judged_against_float32_beside_plain_jax():
  def bf16_loss(params, batch):
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    return LOSS(half, {"x": batch["x"].astype(jnp.bfloat16), "y": batch["y"]}).astype(jnp.float32)

  step, params, batch = _setup(pj.strategies.data_parallel(2), loss_fn=bf16_loss)
  report = check(step, params, batch, loss_fn=bf16_loss)
  assert report.precision == "bf16" and report.rtol == report.loss_rtol == 2.0 ** -8
  assert report.factor == 2.0 and report.slices == 1
  assert report.passed, str(report)
  # Both bf16 runs are off the float32 run by bf16 rounding, not by nothing.
  assert 1e-4 < max(report.plain_grad_leaves.values()) < 5e-2
  assert max(report.grad_leaves.values()) < 2 * max(report.plain_grad_leaves.values()) + 2.0 ** -8
  assert len(report.plain_losses) == 2 and report.plain_loss_rel_diff < 1e-2
  text = str(report)
  assert "float32 run" in text and "plain JAX" in text and "x)" in text
  # An explicit float32 loss is the same truth as the widened one.
  explicit = check(step, params, batch, loss_fn=bf16_loss, fp32_loss_fn=LOSS, sgd=False)
  assert explicit.reference_losses == pytest.approx(report.reference_losses, rel=1e-6)
  # The references can accumulate over slices of the batch; the float32 truth barely moves.
  sliced = check(step, params, batch, loss_fn=bf16_loss, slices=4, sgd=False)
  assert sliced.slices == 4 and sliced.passed, str(sliced)
  assert sliced.reference_losses == pytest.approx(report.reference_losses, rel=1e-5)


def test_precision_of_the_loss():
  params = init_mlp(jax.random.PRNGKey(0), N_STAGES)
  batch = random_batch(jax.random.PRNGKey(1), 16)
  assert precision_of(LOSS, params, batch, "cpu") == "fp32"
  half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  assert precision_of(LOSS, half, batch, "cpu") == "bf16"
  # Float32 matrix products at an accelerator's default precision round their inputs.
  assert precision_of(LOSS, params, batch, "gpu") == "tf32"
  with jax.default_matmul_precision("highest"):
    assert precision_of(LOSS, params, batch, "gpu") == "fp32"


def test_batches_one_repeated_a_list_or_too_few():
  step, params, batch = _setup(pj.strategies.data_parallel(2))
  assert check_mod._batches(step, batch, 3) == [batch] * 3
  other = random_batch(jax.random.PRNGKey(2), 16)
  assert check_mod._batches(step, [batch, other, batch], 2) == [batch, other]
  with pytest.raises(ValueError, match="2 steps need 2 batches, got 1"):
    check_mod._batches(step, [batch], 2)
  with pytest.raises(ValueError, match="pass loss_fn="):
    check(_Wrapped(step, loss_fn=None), params, batch)


def test_train_check_stops_on_a_failed_report(monkeypatch, capsys):
  from examples import train

  failed = check_mod.CheckReport(
      losses=(1.0,), reference_losses=(1.5,), loss_rel_diff=1 / 3, leaves={"['w']": 0.5},
      left_out={"['w']": 0.0}, worst=(("['w']", 0.5),), frozen=(), grad_leaves=None,
      worst_grads=(), rtol=1e-4, loss_rtol=1e-5, precision="fp32", reference="one_device",
      failures=("loss at step 1: 1 vs 1.5",), passed=False)
  seen = {}

  def fake_check(step, params, batch, **kw):
    seen.update(kw, step=step)
    return failed

  monkeypatch.setattr(pj.TrainStep, "check", fake_check)
  with pytest.raises(train.CheckFailed, match="1 failed comparison"):
    train.main(["--strategy", "zero1", "--batch", "8", "--steps", "1", "--quiet",
                "--data", "synthetic", "--check"])
  assert seen["steps"] == 2 and isinstance(seen["step"], pj.TrainStep)
  out = capsys.readouterr().out
  assert "check FAILED" in out and "['w']" in out


@pytest.mark.parametrize("args", [
    ["--model", "qwen3-tiny", "--strategy", "pp-1f1b", "--stages", "2", "--dp", "2",
     "--microbatches", "2", "--dtype", "bfloat16"],
    ["--model", "qwen3-moe-tiny", "--strategy", "zero1", "--dtype", "bfloat16"],
    ["--model", "tiny", "--strategy", "pp-zb", "--stages", "2", "--microbatches", "2",
     "--dtype", "bfloat16"],
    ["--model", "tiny", "--experts", "8", "--ep", "--strategy", "zero1", "--dtype", "bfloat16"],
    ["--model", "qwen3-tiny", "--strategy", "zero3", "--dtype", "float32"],
], ids=["qwen3-1f1b-bf16", "qwen3-moe-zero1-bf16", "gpt-zb-bf16", "gpt-moe-ep-bf16",
        "qwen3-zero3-fp32"])
def test_train_check_passes_correct_strategies(args, capsys):
  from examples import train

  train.main(args + ["--batch", "8", "--steps", "1", "--quiet", "--data", "synthetic",
                     "--check"])
  out = capsys.readouterr().out
  assert "check PASSED" in out
  if "bfloat16" in args:
    assert "against a float32 run" in out


def test_references_take_slices_of_the_batch_to_fit_the_device():
  # Activations, not parameters, take the memory: slices of the batch save it.
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 2048)) * 0.1}
  batch = {"x": jax.random.normal(jax.random.PRNGKey(1), (64, 8))}
  loss = lambda p, b: jnp.mean(jnp.tanh(jnp.tanh(b["x"] @ p["w"]) * 2.0) ** 2)

  class Device:  # a device that says how much memory it has
    def __init__(self, limit):
      self.limit = limit

    def memory_stats(self):
      return {"bytes_limit": self.limit, "bytes_in_use": 0}

  def reference(limit):
    placement = dataclasses.replace(check_mod._placement("one_device", jax.devices()[:1]),
                                    device=Device(limit))
    return check_mod._Reference(loss, optax.adam(1e-2), placement, highest=False)

  sizes = {}
  for n in (1, 64):
    ref = reference(1)
    sizes[n] = CompiledMemory.of(ref._step(n, *ref._shapes(params, batch))).total
  assert sizes[64] < sizes[1]
  assert reference(2 * sizes[1] / 0.9).slices_that_fit(params, batch) == 1
  assert reference(sizes[64] / 0.9 * 1.01).slices_that_fit(params, batch) > 1
  # A sliced reference trains as the whole batch does.
  whole, sliced = reference(1), reference(1)
  a, b = whole.train(params, [batch], 1), sliced.train(params, [batch], 8)
  assert a[0][0][0] == pytest.approx(b[0][0][0], rel=1e-5)  # the first step's loss
  np.testing.assert_allclose(np.concatenate([x.ravel() for x in a[2]]),
                             np.concatenate([x.ravel() for x in b[2]]), rtol=1e-4, atol=1e-7)
