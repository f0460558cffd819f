"""The step's gradient sums (`lowering/gradients.py`): where every rank adds its gradients."""

import jax
import jax.numpy as jnp
import optax
import pytest

import piper_jax as pj
from examples import qwen3
from models import init_mlp, mlp_loss, random_batch

pytestmark = pytest.mark.timeout(120)


def test_gradient_sums_are_shared_across_ranks_by_size():
  # Every rank holds every gradient-sum position (a switch's outputs are alike on all
  # ranks): a Qwen3's embedding [V, D] on the first rank and its untied head [D, V] on
  # the last share one, as do the blocks' weights, so a rank holds no sum of the size of
  # a leaf it does not own.
  model = qwen3.make_model(qwen3.get_config("qwen3-tiny", n_stages=2))
  params = jax.eval_shape(lambda: qwen3.init_params(model, jax.random.PRNGKey(0)))
  batch = jax.eval_shape(lambda: qwen3.random_batch(model.config, jax.random.PRNGKey(1), 8))
  step = pj.compile(qwen3.loss_fn(model), optax.sgd(0.1), pj.strategies.pipeline(2, 4, "1f1b"),
                    params, batch)
  sums = step._program.grads
  per_rank = sums.leaves_of_rank
  assert len(per_rank[0]) > 0 and len(per_rank[1]) > 0
  assert len(sums.positions) == max(len(v) for v in per_rank.values())
  assert all(len(shape) == 1 for shape, _ in sums.positions)
  names = {sums.model.params[p].name: sums.where[(r, p)]
           for r, leaves in per_rank.items() for p in leaves}
  embed = next(n for n in names if "embed" in n)
  head = next(n for n in names if "head" in n)
  assert names[embed] == names[head]


def test_tick_sums_add_pass_through_and_fill():
  # After one rank's part of a per-tick program's tick: its gradients added to the sums
  # passed in, its other sums passed through, and another rank's positions (here the
  # head's, of a size no leaf of the first rank has) filled with whatever the caller
  # gives: nobody reads them.
  step = pj.compile(mlp_loss(2), optax.sgd(0.1), pj.strategies.pipeline(2, 2, "1f1b"),
                    init_mlp(jax.random.PRNGKey(0), 2), random_batch(jax.random.PRNGKey(1), 8),
                    devices=jax.devices()[:2])
  sums = step._program.grads
  positions = list(range(sums.split0))
  mine = sorted(sums.owned[0])
  other = [pos for pos in positions if pos not in sums.owned[0]]
  assert mine and other
  leaf = sums.leaves_of_rank[0][0]
  pos = sums.where[(0, leaf)]
  old = {q: jnp.ones(sums.positions[q][0]) for q in positions}
  g = jnp.full(sums.model.params[leaf].shape, 2.0)
  out = sums.tick_sums(0, {leaf: g}, positions, old, lambda sig: jnp.full(sig[0], 7.0))
  assert set(out) == set(positions)
  assert out[pos].shape == sums.positions[pos][0]  # raveled, as the sum
  assert float(out[pos].min()) == float(out[pos].max()) == 3.0  # old + its gradient
  assert all(out[q] is old[q] for q in mine if q != pos)  # passed through
  assert all(float(out[q].min()) == 7.0 for q in other)  # the filler
  # Without sums passed in, a position it owns and made nothing for starts at zero.
  fresh = sums.tick_sums(0, {}, mine, {}, lambda sig: None)
  assert set(fresh) == set(mine) and all(float(jnp.abs(x).max()) == 0 for x in fresh.values())
