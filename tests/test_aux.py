"""`pj.compile(..., has_aux=True)`: a loss_fn returning (loss, aux) as for
`jax.value_and_grad(has_aux=True)`; aux is combined over microbatches and replicas as
the loss is, so every strategy reports one device's values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import piper_jax as pj
from models import init_mlp, random_batch

pytestmark = pytest.mark.timeout(120)


def _aux_loss(n_stages: int):
  """The test MLP's cross-entropy plus a penalty made on the first stage; aux: the
  cross-entropy, the accuracy and the penalty (made in two different regions)."""

  def loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["embed"])
    penalty = None
    for s in range(n_stages):
      with pj.annotate("PP"):
        p = params[f"stage{s}"]
        x = x + jnp.tanh(x @ p["w"] + p["b"])
        penalty = jnp.mean(x ** 2) if penalty is None else penalty
    logits = x @ params["head"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = jnp.mean((jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32))
    return ce + 0.01 * penalty, {"ce": ce, "accuracy": accuracy, "penalty": penalty}

  return loss


def _one_device(loss, params, batches, tx):
  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  opt_state, out = tx.init(params), []
  for b in batches:
    (value, aux), grads = grad_fn(params, b)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    out.append((float(value), {k: float(v) for k, v in aux.items()}))
  return out


@pytest.mark.parametrize("name,directives,n_devices", [
    ("one device", [pj.place({}, [0])], 1),
    ("accumulation", [pj.split(4)], 1),
    ("dp4 zero3", pj.strategies.data_parallel(4, zero=3), 4),
    ("dp2 x accumulation", [pj.split(2)] + pj.strategies.data_parallel(2, zero=1), 2),
    ("1f1b pp2 x dp2", pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=1), 4),
    ("zb pp2", pj.strategies.pipeline(2, 4, "zb"), 2),
    ("dualpipev pp2", pj.strategies.pipeline(4, 4, "dualpipev"), 2),
])
def test_aux_is_one_devices(name, directives, n_devices):
  n_stages = 4 if "dualpipev" in name else 2
  loss = _aux_loss(n_stages)
  params = init_mlp(jax.random.PRNGKey(0), n_stages)
  batches = [random_batch(jax.random.PRNGKey(i), 16) for i in range(2)]
  tx = optax.adam(1e-2)
  step = pj.compile(loss, tx, directives, params, batches[0], devices=jax.devices()[:n_devices],
                    has_aux=True)
  assert step.aux_names == ["aux['accuracy']", "aux['ce']", "aux['penalty']"]
  state, got = step.init(params), []
  for b in batches:
    state, (value, aux) = step(state, b)
    got.append((float(value), {k: float(v) for k, v in aux.items()}))
  want = _one_device(loss, params, batches, tx)
  for (value, aux), (ref_value, ref_aux) in zip(got, want):
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert aux.keys() == ref_aux.keys()
    for k in aux:
      np.testing.assert_allclose(aux[k], ref_aux[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_check_compares_aux():
  loss = _aux_loss(2)
  params = init_mlp(jax.random.PRNGKey(0), 2)
  batch = random_batch(jax.random.PRNGKey(1), 16)
  step = pj.compile(loss, optax.adam(1e-2), pj.strategies.pipeline(2, 2, "1f1b", dp=2), params,
                    batch, devices=jax.devices()[:4], has_aux=True)
  report = step.check(params, batch)
  assert report.passed, report
  assert set(report.aux_rel_diff) == {"aux['accuracy']", "aux['ce']", "aux['penalty']"}
  assert all(d < 1e-5 for d in report.aux_rel_diff.values())
  assert "aux, largest rel diff" in str(report)


def test_aux_refusals():
  params = init_mlp(jax.random.PRNGKey(0), 2)
  batch = random_batch(jax.random.PRNGKey(1), 16)
  tx, directives = optax.sgd(0.1), pj.strategies.data_parallel(2)
  devices = jax.devices()[:2]
  loss = _aux_loss(2)
  with pytest.raises(ValueError, match=r"has_aux=True"):
    pj.compile(loss, tx, directives, params, batch, devices=devices)
  plain = lambda p, b: loss(p, b)[0]
  with pytest.raises(ValueError, match=r"must return \(loss, aux\)"):
    pj.compile(plain, tx, directives, params, batch, devices=devices, has_aux=True)

  def per_row(p, b):
    value, aux = loss(p, b)
    return value, {"logits": b["x"] @ p["embed"]}
  with pytest.raises(ValueError, match=r"aux\['logits'\] has shape \(\d+, \d+\).*mean"):
    pj.compile(per_row, tx, directives, params, batch, devices=devices, has_aux=True)

  def constant(p, b):
    return loss(p, b)[0], {"lr": jnp.float32(0.1)}
  with pytest.raises(ValueError, match=r"aux\['lr'\] is a constant"):
    pj.compile(constant, tx, directives, params, batch, devices=devices, has_aux=True)


def _compare_aux(loss, params, batches, directives, n_devices, tx):
  step = pj.compile(loss, tx, directives, params, batches[0], devices=jax.devices()[:n_devices],
                    has_aux=True)
  state = step.init(params)
  for b, (ref_value, ref_aux) in zip(batches, _one_device(loss, params, batches, tx)):
    state, (value, aux) = step(state, b)
    np.testing.assert_allclose(float(value), ref_value, rtol=1e-5)
    for k in ref_aux:
      np.testing.assert_allclose(float(aux[k]), ref_aux[k], rtol=1e-5, atol=1e-6, err_msg=k)
  return step


def test_aux_of_an_expert_parallel_pipeline():
  # A MoE Qwen3's cross-entropy and load-balancing loss (made outside the experts'
  # regions), 1F1B x DP 2 with the experts split over each rank's 2 devices.
  from examples import qwen3
  config = qwen3.get_config("qwen3-moe-tiny", n_stages=2, seq_len=16)
  model = qwen3.make_model(config)
  params = jax.jit(lambda rng: qwen3.init_params(model, rng))(jax.random.PRNGKey(0))
  batches = [qwen3.random_batch(config, jax.random.PRNGKey(i), 8) for i in range(2)]
  directives = pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1)
  directives.append(pj.shard({"EP": "*"}, [0, 2, 1, 3]))
  tx = optax.adamw(1e-2, eps=1e-6)
  step = _compare_aux(qwen3.loss_fn(model, metrics=True), params, batches, directives, 4, tx)
  assert step.plan.mesh.size("ep") == 2 and step.aux_names == ["aux['ce']", "aux['load_balance']"]


def test_aux_of_a_tensor_parallel_step():
  from examples import gpt
  from models import tp_gpt
  config, _, params = tp_gpt()
  model = gpt.GPT(config)

  def loss(params, batch):
    logits = model.apply({"params": params}, batch["tokens"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return ce, {"ce": ce, "top1": jnp.mean((logits.argmax(-1) == batch["targets"]).astype(
        jnp.float32))}

  batches = [gpt.random_batch(config, jax.random.PRNGKey(i), 8) for i in range(2)]
  directives = [pj.replicate({}, [0, 1, 2, 3], zero=3), pj.shard_tensor({}, [0, 1])]
  _compare_aux(loss, params, batches, directives, 4, optax.adam(1e-2))
