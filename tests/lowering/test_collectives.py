"""The collectives a compiled step runs, read from its traced program
(`lowering/collectives.py`, `TrainStep.collectives`, `describe`, `to_dot`)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import piper_jax as pj
from models import init_mlp, mlp_loss, random_batch
from piper_jax.lowering.collectives import collectives_table, step_collectives

pytestmark = pytest.mark.timeout(120)


def test_collectives_of_a_jaxpr_are_counted_through_loops_and_switches():
  def f(x, i):
    with jax.named_scope("pj:tick 0"):
      x = lax.psum(x, "dp")
    with jax.named_scope("pj:tick loop"):
      x = lax.fori_loop(0, 5, lambda _, c: lax.ppermute(c, "pp", [(0, 1), (1, 0)]), x)
    return lax.switch(i, [lambda y: lax.all_gather(y, "dp", tiled=True)[:4], lambda y: y * 2], x)

  closed = jax.make_jaxpr(f, axis_env=[("dp", 2), ("pp", 2)])(jnp.ones((4,), jnp.float32), 0)
  found = step_collectives(closed)
  assert [(c.kind, c.axes, c.count, c.where, c.nbytes) for c in found] == [
      ("all-reduce", ("dp",), 1, ("tick 0",), 16),
      ("send/recv", ("pp",), 5, ("tick loop",), 16),
      ("all-gather", ("dp",), 1, ("one branch of a switch",), 16)]
  table = collectives_table(found)
  assert "tick loop" in table and "| 5 " in table


def _step(directives, **options):
  params = init_mlp(jax.random.PRNGKey(0), 2)
  batch = random_batch(jax.random.PRNGKey(1), 16)
  return pj.compile(mlp_loss(2), optax.adam(1e-3), directives, params, batch,
                    options=pj.LoweringOptions(**options))


def test_a_steps_collectives_are_the_lowerings():
  # ZeRO-2 reduce-scatters in the ticks that finish gradients; the IR plans one per
  # backward, the lowering one per tick and slot: the report shows the lowering's.
  found = _step(pj.strategies.data_parallel(4, zero=2)).collectives()
  scatters = [c for c in found if c.kind == "reduce-scatter"]
  assert scatters and all(c.where[0].startswith("tick ") and c.axes == ("dp",) for c in scatters)
  assert any(c.kind == "all-gather (XLA)" and c.where == ("after the update",) for c in found)
  # A pipeline's exchanges are sends and receives over "pp", tick by tick.
  step = _step(pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=1))
  sends = [c for c in step.collectives() if c.kind == "send/recv"]
  assert sends and all(c.axes == ("pp",) for c in sends)
  text = step.describe()
  assert "collectives the compiled step runs" in text and "send/recv" in text
  dot = step.to_dot()
  assert '"step collectives"' in dot and '"rs:r0"' not in dot and '"send:' in dot


def test_the_tick_loops_collectives_are_per_iteration():
  step = _step(pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=3))
  found = step.collectives()
  loop = [c for c in found if c.where[:1] == ("tick loop",)]
  assert {c.kind for c in loop} == {"send/recv"}
  # ZeRO-3 gathers the weights as the step starts, and the gradients summed whole are
  # reduce-scattered once, after the loop.
  assert any(c.kind == "all-gather" and c.where == ("step start",) for c in found), found
  assert any(c.kind == "reduce-scatter" and c.where == ("step end",) for c in found)
  # Once per iteration (a sub-step of a tick): at least once per tick.
  assert all(c.count >= len(step.plan.ticks) for c in loop)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_pipelines_gradients_are_reduce_scattered_once(zero):
  # A pipeline sums a stage's gradients whole over its microbatches and reduce-scatters
  # them once, after its last tick, under ZeRO-2/3 as under ZeRO-1: one reduce-scatter
  # per slot, not one per tick (which XLA ran holding several ticks' whole gradients).
  # Without a pipeline each tick's are reduce-scattered as the backward makes them.
  step = _step(pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=zero))
  assert step._program.tick_loop is not None
  scatters = [c for c in step.collectives() if c.kind == "reduce-scatter"]
  # One per segment (the slot, and the leaves every rank holds), at the step's end.
  assert scatters and all(c.where == ("step end",) and c.count == 1 for c in scatters), scatters
  dp = _step(pj.strategies.data_parallel(4, zero=zero))
  assert any(c.where[0].startswith("tick ") for c in dp.collectives()
             if c.kind == "reduce-scatter")
