"""The split-tensor rules (`lowering/local.py`) on hand-written functions: a traced
function evaluated on each device's pieces gives the whole function's values and
gradients, and what a split cannot run is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from piper_jax.lowering.compat import shard_map_unchecked
from piper_jax.lowering.local import SplitAxis, SplitError, eval_split

pytestmark = pytest.mark.timeout(120)


def _on_pieces(f, args, split_dims, kind="tp"):
  """f traced whole, evaluated on 2 devices' pieces of the arguments split along
  `split_dims` (one dimension or None per argument); returns the gathered output."""
  closed = jax.make_jaxpr(f)(*args)
  axis = SplitAxis("t", 2, kind)

  def local(*pieces):
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, pieces))
    split = {v: {d} for v, d in zip(closed.jaxpr.invars, split_dims) if d is not None}
    env, dims = eval_split(closed.jaxpr.eqns, env, split, axis, "the test function")
    out = closed.jaxpr.outvars[0]
    assert not dims.get(out), "the output should come out whole"
    return env[out]

  specs = tuple(P() if d is None else P(*([None] * d + ["t"])) for d in split_dims)
  mesh = Mesh(np.array(jax.devices()[:2]), ("t",))
  return shard_map_unchecked(local, mesh, specs, P())(*args)


def test_megatron_mlp_on_pieces_matches_the_whole():
  # Column-parallel then row-parallel: the contraction over the split hidden dimension
  # gives partial sums, all-reduced forward; x's cotangent is all-reduced backward.
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(ks[0], (4, 8))
  w1 = jax.random.normal(ks[1], (8, 6))
  w2 = jax.random.normal(ks[2], (6, 8))
  f = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2
  np.testing.assert_allclose(_on_pieces(f, (x, w1, w2), (None, 1, 0)), f(x, w1, w2),
                             rtol=1e-5, atol=1e-5)
  loss = lambda x: jnp.sum(_on_pieces(f, (x, w1, w2), (None, 1, 0)) ** 2)
  want = jax.grad(lambda x: jnp.sum(f(x, w1, w2) ** 2))(x)
  np.testing.assert_allclose(jax.grad(loss)(x), want, rtol=1e-4, atol=1e-4)


def test_a_sum_over_the_expert_axis_is_refused():
  # Experts never mix: a reduction over the split expert axis is an error that says
  # which primitive did it.
  x = jnp.ones((4, 3))
  with pytest.raises(SplitError, match="reduce_sum"):
    _on_pieces(lambda x: jnp.sum(x, axis=0), (x,), (0,), kind="ep")
