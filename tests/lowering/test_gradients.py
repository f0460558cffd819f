"""The step's gradient sums (`lowering/gradients.py`): where every rank adds its gradients."""

import jax
import optax
import pytest

import piper_jax as pj
from examples import qwen3

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
