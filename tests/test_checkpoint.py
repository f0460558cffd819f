"""Checkpoints: canonical layout, restore under another strategy, same losses as without."""

import jax
import numpy as np
import optax
import pytest

import piper_jax as pj
from models import init_mlp, mlp_loss, optimizer, random_batch

pytestmark = pytest.mark.timeout(300)


def _steps(step, state, batches):
  losses = []
  for b in batches:
    state, loss = step(state, b)
    losses.append(float(loss))
  return state, losses


def test_save_under_pp_dp_restore_under_zero3(tmp_path):
  params = init_mlp(jax.random.PRNGKey(0), 2)
  loss, tx = mlp_loss(2), optimizer()
  batches = [random_batch(jax.random.PRNGKey(i), 16) for i in range(4)]
  a = pj.compile(loss, tx, pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1), params, batches[0])
  b = pj.compile(loss, tx, pj.strategies.data_parallel(4, zero=3), params, batches[0])
  _, uninterrupted = _steps(a, a.init(params), batches)

  state, first = _steps(a, a.init(params), batches[:2])
  pj.checkpoint.save(tmp_path / "ckpt", state, step=2)
  assert pj.checkpoint.latest_step(tmp_path / "ckpt") == 2
  restored = pj.checkpoint.restore(tmp_path / "ckpt", b)
  np.testing.assert_allclose(jax.tree_util.tree_leaves(b.params(restored))[0],
                             jax.tree_util.tree_leaves(a.params(state))[0], rtol=0, atol=0)
  _, second = _steps(b, restored, batches[2:])
  np.testing.assert_allclose(first + second, uninterrupted, rtol=1e-5)


def test_canonical_layout_is_the_users_pytree():
  params = init_mlp(jax.random.PRNGKey(0), 2)
  step = pj.compile(mlp_loss(2), optax.adam(1e-3), pj.strategies.pipeline(2, 2), params,
                    random_batch(jax.random.PRNGKey(0), 8))
  canon = step.canonical(step.init(params))
  assert jax.tree_util.tree_structure(canon["params"]) == jax.tree_util.tree_structure(params)
  mu = canon["opt_state"][0].mu
  assert jax.tree_util.tree_structure(mu) == jax.tree_util.tree_structure(params)
  # Each device holds (and a process writes) only its part of a checkpointed leaf.
  embed = canon["params"]["embed"]
  assert not embed.sharding.is_fully_replicated
  assert {s.data.shape for s in embed.addressable_shards} == {(4, 16)}


def test_restore_missing_directory(tmp_path):
  params = init_mlp(jax.random.PRNGKey(0), 1)
  step = pj.compile(mlp_loss(1), optax.sgd(0.1), [pj.place({}, [0])], params,
                    random_batch(jax.random.PRNGKey(0), 8))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError):
    pj.checkpoint.restore(tmp_path / "empty", step)
