"""A switch cut at its branches' collectives (`lowering/phases.py`), on hand-built
branches: the same results as `lax.switch`, with no collective inside a conditional."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from models import collectives_in_conds
from piper_jax.lowering.compat import shard_map_unchecked
from piper_jax.lowering.phases import Phases

pytestmark = pytest.mark.timeout(120)


def _branches():
  def idle(ops):
    return ops["x"], ops["y"]

  def one_cut(ops):  # a value made before the cut and read after it is handed on
    h = jnp.tanh(ops["x"] * 2.0)
    return lax.psum(h, "tp") * h + 1.0, ops["y"]

  @jax.jit
  def inner(x):  # a collective inside a call is cut too
    return lax.psum(x, "tp")

  def three_cuts(ops):  # all-reduce, then a gather of its result, then another
    a = inner(ops["x"] + 1.0)
    g = lax.all_gather(a * 3.0, "tp", axis=0, tiled=True)[: a.shape[0]]
    return lax.psum(g - a, "tp") + a, ops["y"] * 2

  return [idle, one_cut, three_cuts]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_phases_give_the_switchs_results_with_collectives_outside_it(index):
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  seen = {}

  def step(cut):
    def body(x, y, i):
      ops = {"x": x, "y": y}
      if not cut:
        return lax.switch(i, _branches(), ops)
      seen["phases"] = phases = Phases(_branches(), ops)
      return phases.switch(i, ops)
    return jax.jit(shard_map_unchecked(body, mesh, (P("tp"), P(), P()), (P("tp"), P())))

  x = jax.random.normal(jax.random.PRNGKey(index), (8, 4))
  y, i = jnp.arange(3.0), jnp.int32(index)
  got, want = step(True)(x, y, i), step(False)(x, y, i)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
  phases = seen["phases"]
  # Kinds right-aligned: three cuts make four phases, the one-cut kind starts in the third.
  assert phases.cut_kinds == [1, 2] and phases.n == 4
  cut, plain = (jax.make_jaxpr(step(c))(x, y, i).jaxpr for c in (True, False))
  assert sorted(set(collectives_in_conds(plain))) == ["all_gather", "psum"]
  assert collectives_in_conds(cut) == [] and "psum" in str(cut) and "all_gather" in str(cut)
