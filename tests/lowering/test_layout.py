"""The parameter layout (`lowering/layout.py`) on a hand-built 4-stage plan whose first
stage holds most of the parameters: packing is lossless, stacked ranks pad to the
largest, and spread slots hold the parts end to end and convert to the stacked rows
and back exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from piper_jax import ir, strategies
from piper_jax.ir import TensorSpec
from piper_jax.ir.pipeline import make_plan
from piper_jax.lowering.layout import SHARED, ParamLayout
from piper_jax.lowering.options import LoweringOptions

pytestmark = pytest.mark.timeout(60)

N = 4  # stages, one per rank


def _model():
  """Stage 0 reads a 64 x 8 table and its own 8 x 8 weight; stages 1-3 an 8 x 8 weight
  each; the last stage also reads the table (a tied head: a SHARED leaf)."""
  act = TensorSpec("act", (2, 8), "float32")
  params = [TensorSpec("table", (64, 8), "float32"), TensorSpec("tied", (8, 8), "float32")]
  params += [TensorSpec(f"w{i}", (8, 8), "float32") for i in range(N)]
  regions = []
  for i in range(N):
    reads = (0, 2) if i == 0 else (1, 2 + i) if i == N - 1 else (2 + i,)
    reads = reads + ((1,) if i == 0 else ())
    inputs = (ir.ActivationRef(i - 1, 0, act),) if i else ()
    outputs = (act,) if i < N - 1 else (TensorSpec("loss", (), "float32"),)
    regions.append(ir.RegionSpec(i, (("PP", i),), reads, (0,) if i == 0 else (), inputs,
                                 outputs, produces_loss=i == N - 1, flops=1.0))
  return ir.ModelSpec(tuple(regions), tuple(params), (TensorSpec("x", (2, 8), "float32"),), 2)


def _layouts():
  model = _model()
  plan = make_plan(model, strategies.pipeline(N, 2, "1f1b"), N)
  stacked = ParamLayout(model, plan, options=LoweringOptions(spread_uneven_slots=False))
  spread = ParamLayout(model, plan, options=LoweringOptions())
  leaves = [jnp.arange(np.prod(p.shape), dtype=jnp.float32).reshape(p.shape) + 1000 * k
            for k, p in enumerate(model.params)]
  return model, stacked, spread, leaves


def test_packing_is_lossless_and_tied_leaves_are_shared():
  model, stacked, spread, leaves = _layouts()
  assert stacked.home[1].slot == SHARED and stacked.home[0].rank == 0
  for layout in (stacked, spread):
    buffers = layout.pack(leaves)
    shapes = layout.shapes()
    assert jax.tree_util.tree_map(lambda x: x.shape, buffers) == jax.tree_util.tree_map(
        lambda s: s.shape, shapes)
    for a, b in zip(layout.unpack(buffers), leaves):
      np.testing.assert_array_equal(a, b)


def test_uneven_slot_is_spread_and_converts_to_the_stacked_rows():
  model, stacked, spread, leaves = _layouts()
  assert not stacked.spread
  (key, sp), = spread.spread.items()   # the slot of the table and the stages' weights
  assert sp.lengths[0] == 64 * 8 + 8 * 8 and sp.lengths[1:] == (64, 64, 64)
  assert sp.size % spread.n_devices == 0 and sp.size < sum(sp.lengths) + spread.n_devices
  # Stacked, every rank pads to the first stage's part: 4 x 576 for 768 elements.
  i = stacked.slot_ids["float32"].index(key[0])
  assert stacked.pack(leaves).slots["float32"][i].size == N * sp.lengths[0]
  buffers = spread.pack(leaves)
  working = spread.to_working(buffers)
  np.testing.assert_array_equal(working.slots["float32"][i],
                                stacked.pack(leaves).slots["float32"][i])
  back = spread.from_working(working)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(buffers)):
    np.testing.assert_array_equal(a, b)
  assert spread.specs(sharded=False).slots["float32"][i] != spread.specs(
      sharded=False, working=True).slots["float32"][i]
