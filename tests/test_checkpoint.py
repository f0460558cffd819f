"""Checkpoints: canonical layout, restore under another strategy, same losses as without.

Each restore compares the whole canonical state (every parameter and optimizer leaf)
with the one that was saved, exactly, and training goes on to the losses of a run
that was never interrupted.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import piper_jax as pj
from examples import gpt
from models import init_mlp, mlp_loss, moe_gpt, optimizer, random_batch, reference_run, tp_gpt

pytestmark = pytest.mark.timeout(300)

# As in test_parallel: adam's eps=1e-6 keeps an expert few tokens reach from moving by
# a full step of rounding noise.
MOE_TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-6, weight_decay=0.1))


def _steps(step, state, batches):
  losses = []
  for b in batches:
    state, loss = step(state, b)
    losses.append(float(loss))
  return state, losses


def _assert_same_state(a, b):
  """Two canonical trees hold the same leaves: structure, shapes, dtypes and values, exactly."""
  leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
  leaves_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
  assert tree_a == tree_b, f"{tree_a}\n!=\n{tree_b}"
  assert leaves_a, "no leaves to compare"
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    name = jax.tree_util.keystr(path)
    assert (np.shape(x), x.dtype) == (np.shape(y), y.dtype), name
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def _resume_across(directory, steps, params, batches, rtol=1e-5):
  """Trains one step under each `TrainStep` of `steps`: each after the first restores the
  checkpoint the one before saved.

  Asserts every restore gives the saved canonical state exactly, and that the losses are
  those of an uninterrupted run under the first. Returns the final state.
  """
  _, uninterrupted = _steps(steps[0], steps[0].init(params), batches[:len(steps)])
  state, losses = _steps(steps[0], steps[0].init(params), batches[:1])
  for i, step in enumerate(steps[1:], start=1):
    saved = steps[i - 1].canonical(state)
    pj.checkpoint.save(directory, state, step=i)
    assert pj.checkpoint.latest_step(directory) == i
    state = pj.checkpoint.restore(directory, step)
    assert state.owner is step
    _assert_same_state(step.canonical(state), saved)
    state, more = _steps(step, state, batches[i:i + 1])
    losses += more
  np.testing.assert_allclose(losses, uninterrupted, rtol=rtol)
  return state


def _compile(loss, tx, params, batches, *strategies):
  return [pj.compile(loss, tx, d, params, batches[0]) for d in strategies]


def _mlp(n_steps=2):
  params = init_mlp(jax.random.PRNGKey(0), 2)
  return mlp_loss(2), params, [random_batch(jax.random.PRNGKey(i), 16) for i in range(n_steps)]


def _tokens(make, **kw):
  """(loss, params, 3 token batches) of a one-block GPT made by `models.moe_gpt`/`tp_gpt`."""
  config, loss, params = make(n_layers=1, **kw)
  return loss, params, [gpt.random_batch(config, jax.random.PRNGKey(i), 8, pattern_seed=1)
                        for i in range(3)]


def test_save_under_dp_restore_under_pp(tmp_path):
  loss, params, batches = _mlp()
  steps = _compile(loss, optimizer(), params, batches, pj.strategies.data_parallel(4),
                   pj.strategies.pipeline(2, 2, "1f1b"))
  _resume_across(tmp_path / "ckpt", steps, params, batches)


def test_save_under_pp_dp_zero1_restore_under_zero3(tmp_path):
  loss, params, batches = _mlp()
  steps = _compile(loss, optimizer(), params, batches,
                   pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1),
                   pj.strategies.data_parallel(4, zero=3))
  assert [s.plan.mesh.zero for s in steps] == [1, 3]
  _resume_across(tmp_path / "ckpt", steps, params, batches)


def test_resumed_sgd_step_gives_one_devices_parameters(tmp_path):
  # One plain-SGD step (learning rate 1: the update is the gradient) after a restore under
  # another strategy gives one device's parameters.
  loss, params, batches = _mlp()
  tx = optax.sgd(1.0)
  steps = _compile(loss, tx, params, batches, pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1),
                   pj.strategies.data_parallel(4, zero=3))
  got = steps[1].params(_resume_across(tmp_path / "ckpt", steps, params, batches))
  _, want = reference_run(loss, params, batches, tx)
  scale = max(float(jnp.max(jnp.abs(p - w))) for p, w in
              zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)))
  jax.tree_util.tree_map(
      lambda p, g, w: np.testing.assert_allclose(np.asarray(p - g), np.asarray(p - w), rtol=1e-5,
                                                 atol=1e-5 * scale),
      params, got, want)


@pytest.mark.parametrize("kind", ["ep", "tp"])
def test_split_pieces_to_unsplit_and_back(kind, tmp_path):
  # Expert (shard) and tensor (shard_tensor) parallel pieces, ZeRO-3 over the copies of
  # each piece, restored into whole leaves without the split and split again.
  if kind == "ep":
    loss, params, batches = _tokens(moe_gpt)
    split, tx = pj.shard({"EP": "*"}, [0, 1]), MOE_TX
  else:
    loss, params, batches = _tokens(tp_gpt)
    split, tx = pj.shard_tensor({}, [0, 1]), optimizer()
  pieces, whole = _compile(loss, tx, params, batches,
                           [pj.replicate({}, [0, 1, 2, 3], zero=3), split],
                           [pj.replicate({}, [0, 1, 2, 3], zero=1)])
  assert pieces.layout.split and not whole.layout.split
  _resume_across(tmp_path / "ckpt", [pieces, whole, pieces], params, batches)


def test_bf16_sharded_masters(tmp_path):
  # bf16 compute under EP x ZeRO-2 keeps the fp32 masters sharded over the data-parallel
  # copies; the checkpoint holds those fp32 masters, whole, and restores them under a
  # strategy that replicates them and back.
  loss, params, batches = _tokens(moe_gpt, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  sharded, replicated = _compile(loss, MOE_TX, params, batches,
                                 [pj.replicate({}, [0, 1, 2, 3], zero=2), pj.shard({"EP": "*"}, [0, 1])],
                                 [pj.replicate({}, [0, 1])])
  assert sharded.layout.shards_masters and not replicated.layout.shards_masters
  # The other strategy reduces the bf16 gradients in another order (losses 2.6e-5 apart).
  state = _resume_across(tmp_path / "ckpt", [sharded, replicated, sharded], params, batches,
                         rtol=2e-4)
  saved = sharded.canonical(state)
  assert {x.dtype for x in jax.tree_util.tree_leaves(saved["params"])} == {jnp.dtype(jnp.float32)}
  # Restored under its own strategy, the state goes on exactly as without the checkpoint.
  pj.checkpoint.save(tmp_path / "ckpt", state, step=3)
  again = pj.checkpoint.restore(tmp_path / "ckpt", sharded)
  _assert_same_state(sharded.canonical(again), saved)
  again, resumed = _steps(sharded, again, batches[:1])
  state, uninterrupted = _steps(sharded, state, batches[:1])
  assert resumed == uninterrupted
  _assert_same_state(sharded.canonical(again), sharded.canonical(state))


_KILLED_SAVER = textwrap.dedent("""
    import asyncio, os, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import jax
    from orbax.checkpoint._src.path import atomicity
    import piper_jax as pj
    from models import init_mlp, mlp_loss, optimizer, random_batch

    async def finalize(self):  # the arrays are written; stop before the commit
      open({marker!r}, "w").close()
      await asyncio.sleep(3600)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    params = init_mlp(jax.random.PRNGKey(0), 2)
    batches = [random_batch(jax.random.PRNGKey(i), 16) for i in range(3)]
    step = pj.compile(mlp_loss(2), optimizer(), pj.strategies.data_parallel(2), params, batches[0])
    state = pj.checkpoint.restore({ckpt!r}, step)
    state, _ = step(state, batches[2])
    pj.checkpoint.save({ckpt!r}, state, step=3)
    """)


def test_kill_while_saving_keeps_the_previous_step(tmp_path):
  # A process saving step 3 is killed (SIGKILL) once it has written the arrays but
  # before the commit: step 2 stays the newest and restores exactly; the run resumed
  # from it saves step 4, and that save deletes the unfinished step 3.
  loss, params, batches = _mlp(4)
  ckpt = tmp_path / "ckpt"
  step = pj.compile(loss, optimizer(), pj.strategies.data_parallel(2), params, batches[0])
  state, _ = _steps(step, step.init(params), batches[:2])
  saved = step.canonical(state)
  pj.checkpoint.save(ckpt, state, step=2)

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  marker = tmp_path / "writing"
  script = _KILLED_SAVER.format(root=root, tests=os.path.join(root, "tests"), marker=str(marker),
                                ckpt=str(ckpt))
  child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 240
    while not marker.exists():
      assert child.poll() is None, child.stdout.read().decode()[-4000:]
      assert time.monotonic() < deadline, "the saving process never reached the commit"
      time.sleep(0.05)
  finally:
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "3.orbax-checkpoint-tmp"]
  assert any((ckpt / "3.orbax-checkpoint-tmp").rglob("*")), "nothing of step 3 was written"

  assert pj.checkpoint.latest_step(ckpt) == 2
  restored = pj.checkpoint.restore(ckpt, step)
  _assert_same_state(step.canonical(restored), saved)
  state, _ = _steps(step, restored, batches[2:])
  saved = step.canonical(state)
  pj.checkpoint.save(ckpt, state, step=4)
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4"]
  assert pj.checkpoint.latest_step(ckpt) == 4
  _assert_same_state(step.canonical(pj.checkpoint.restore(ckpt, step)), saved)


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
