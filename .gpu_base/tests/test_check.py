"""`check`: a correct strategy passes; wrong parameters, a frozen leaf, a wrong gradient fail."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import piper_jax as pj
from piper_jax import check as check_mod
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


def test_gradient_scale_hidden_by_adam_is_caught_by_sgd(monkeypatch):
  # A strategy whose gradients come out twice too large: clipping and Adam normalise the
  # update, so losses and parameters agree; the SGD step does not.
  doubled = lambda tx: optax.chain(optax.scale(2.0), tx)
  step, params, batch = _setup(pj.strategies.pipeline(2, 2, "1f1b"), tx=doubled(optimizer()))
  wrong = _Wrapped(step, optimizer=optimizer())
  real_compile = pj.compile
  monkeypatch.setattr(check_mod, "_compile",
                      lambda loss_fn, tx, *a, **k: real_compile(loss_fn, doubled(tx), *a, **k))
  hidden = check(wrong, params, batch, sgd=False, loss_fn=LOSS)
  assert hidden.passed, str(hidden)
  report = check(wrong, params, batch, loss_fn=LOSS)
  assert report.loss_rel_diff < 1e-5
  assert report.passed is False
  # Twice the gradient is 1.0 off relative to the leaf's own; small leaves are
  # measured against the model's RMS gradient, so less, but still far out.
  assert max(report.grad_leaves.values()) == pytest.approx(1.0, rel=1e-4)
  assert min(report.grad_leaves.values()) > 0.1
  assert all(f.startswith("gradient of ") for f in report.failures)
  assert report.worst_grads[0][0] in str(report).split("worst gradients")[1]


def test_bf16_compute_takes_bf16_tolerances():
  def bf16_loss(params, batch):
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    return LOSS(half, {"x": batch["x"].astype(jnp.bfloat16), "y": batch["y"]}).astype(jnp.float32)

  step, params, batch = _setup(pj.strategies.data_parallel(2), loss_fn=bf16_loss)
  report = check(step, params, batch, sgd=False, loss_fn=bf16_loss)
  assert report.precision == "bf16" and report.rtol == report.loss_rtol == 2e-2
  assert report.passed, str(report)
  assert check_mod._precision(LOSS, params, batch, "cpu") == "fp32"
  half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  assert check_mod._precision(LOSS, half, batch, "cpu") == "bf16"
  # Float32 matrix products at an accelerator's default precision round their inputs.
  assert check_mod._precision(LOSS, params, batch, "gpu") == "tf32"
  with jax.default_matmul_precision("highest"):
    assert check_mod._precision(LOSS, params, batch, "gpu") == "fp32"


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

  monkeypatch.setattr(check_mod, "check", fake_check)
  with pytest.raises(train.CheckFailed, match="1 failed comparison"):
    train.main(["--strategy", "zero1", "--batch", "8", "--steps", "1", "--quiet",
                "--data", "synthetic", "--check"])
  assert seen["steps"] == 2 and seen["compile_kwargs"]["options"].roll is True
  out = capsys.readouterr().out
  assert "check FAILED" in out and "['w']" in out
