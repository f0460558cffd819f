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


def test_an_operand_updated_before_a_cut_travels_as_itself_not_as_a_carried_value():
  # A branch writes what it makes before its all-reduce into a buffer it was given (as
  # a store row) and adds to a sum: the writes run in the first phase and the buffer
  # and sum travel between the phases, so nothing made before the cut is handed on.
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

  def idle(ops):
    return ops["store"], ops["sum"]

  def write_then_reduce(ops):
    h = jnp.tanh(ops["x"] * 2.0)
    store = lax.dynamic_update_slice(ops["store"], h.reshape(1, -1), (ops["row"], 0))
    total = ops["sum"] + jnp.sum(h, axis=0)
    return store, total + lax.psum(ops["x"], "tp").sum(axis=0)

  branches = [idle, write_then_reduce]
  seen = {}

  def step(cut):
    def body(x, store, total, row, i):
      ops = {"x": x, "store": store, "sum": total, "row": row}
      if not cut:
        return lax.switch(i, branches, ops)
      seen["phases"] = phases = Phases(branches, ops)
      return phases.switch(i, ops)
    return jax.jit(shard_map_unchecked(body, mesh, (P("tp"), P(), P(), P(), P()), (P(), P())))

  # Large enough that the phase after the cut would not redo h from the operands.
  x = jax.random.normal(jax.random.PRNGKey(3), (4096, 4))
  store, total = jnp.zeros((3, 2048 * 4)), jnp.arange(4.0)
  for i in (0, 1):
    args = (x, store, total, jnp.int32(1), jnp.int32(i))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                           step(True)(*args), step(False)(*args))
  cut = seen["phases"].cut[1]
  assert cut.carry == [[]]                       # h is not handed on
  assert [len(v) for v in cut.versions] == [1, 2]
  assert all(seg == 0 for v in cut.versions for seg, _ in v[:1])
  assert len(seen["phases"]._threads) == 2
