"""Measured region costs: every region's F and B timed on one device, cached, and used by
the simulator and the planner in place of FLOP counts."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import piper_jax as pj
from examples import gpt
from piper_jax.ir.pipeline import make_plan
from piper_jax.lowering.trace import trace_loss

pytestmark = pytest.mark.timeout(120)


def _tiny(n_stages=2):
  config = gpt.get_config("tiny", n_stages=n_stages, n_layers=2 * n_stages)
  net = gpt.GPT(config)
  params = jax.eval_shape(lambda: gpt.init_params(net, jax.random.PRNGKey(0)))
  batch = jax.eval_shape(lambda: gpt.random_batch(config, jax.random.PRNGKey(1), 8))
  return gpt.loss_fn(net), params, batch


def test_every_region_is_timed_and_the_cache_is_reused(tmp_path, monkeypatch):
  loss, params, batch = _tiny()
  cache = tmp_path / "times.json"
  times = pj.calibrate(loss, params, batch, rows=2, repeats=2, cache=cache)
  n_regions = len(trace_loss(loss, params, batch).spec.regions)
  assert sorted(times.forward) == sorted(times.backward) == list(range(n_regions))
  assert all(t > 0 for t in [*times.forward.values(), *times.backward.values()])
  assert times.rows == 2 and times.costs(4)[(0, "F")] == pytest.approx(2 * times.forward[0])
  costs = times.costs(2)  # zero-bubble schedules execute BI and BW apart: they sum to B
  assert all(0 < costs[(r, "BI")] <= costs[(r, "B")] and
             costs[(r, "BI")] + costs[(r, "BW")] == pytest.approx(costs[(r, "B")])
             for r in range(n_regions))
  # A second call finds every region in the cache and times nothing.
  cal = sys.modules["piper_jax.planner.calibrate"]  # the module (pj.calibrate is its function)
  monkeypatch.setattr(cal, "_seconds", lambda *a: pytest.fail("timed a cached region"))
  again = pj.calibrate(loss, params, batch, rows=2, repeats=2, cache=cache)
  assert again == times
  with pytest.raises(ValueError, match="needs >= 16 rows"):
    pj.calibrate(loss, params, batch, rows=16)


def test_the_optimizers_update_is_timed_per_byte_and_cached(tmp_path, monkeypatch):
  loss, params, batch = _tiny()
  cache = tmp_path / "times.json"
  tx = optax.adamw(1e-3)
  times = pj.calibrate(loss, params, batch, rows=2, repeats=2, cache=cache, optimizer=tx)
  assert times.update_s_per_byte > 0
  assert pj.calibrate(loss, params, batch, rows=2, repeats=1).update_s_per_byte == 0
  cal = sys.modules["piper_jax.planner.calibrate"]
  monkeypatch.setattr(cal, "_seconds", lambda *a: pytest.fail("timed a cached update"))
  again = pj.calibrate(loss, params, batch, rows=2, repeats=2, cache=cache, optimizer=tx)
  assert again == times
  # The planner costs the update by it: adam over 1 MB takes a millionth of that.
  costs = pj.strategies.CostModel(region_times=times)
  assert costs.update_seconds(1e6, 2.0) == pytest.approx(1e6 * times.update_s_per_byte)
  # An optimizer bound to the parameters' tree is timed on that tree.
  monkeypatch.undo()
  labels = jax.tree_util.tree_map(lambda x: "decay" if x.ndim > 1 else "none", params)
  tree_tx = optax.multi_transform({"decay": optax.adamw(1e-3), "none": optax.sgd(1e-3)}, labels)
  assert pj.calibrate(loss, params, batch, rows=2, repeats=1, cache=cache,
                      optimizer=tree_tx).update_s_per_byte > 0


def test_costs_interpolate_between_the_row_counts_measured():
  at2 = pj.RegionTimes("cpu", 2, {0: 4.0}, {0: 8.0}, {0: 2.0})
  at8 = pj.RegionTimes("cpu", 8, {0: 10.0}, {0: 20.0}, {0: 8.0})
  both = dataclasses.replace(at8, other_rows=(at2,))
  assert both.costs(8)[(0, "F")] == 10.0 and both.costs(2)[(0, "F")] == 4.0
  mid = both.costs(4)  # a third of the way from 2 to 8 rows
  assert mid[(0, "F")] == pytest.approx(6.0) and mid[(0, "B")] == pytest.approx(12.0)
  assert mid[(0, "BI")] + mid[(0, "BW")] == pytest.approx(mid[(0, "B")])
  # Beyond the measured rows: in proportion to the nearest measurement.
  assert both.costs(16)[(0, "F")] == pytest.approx(20.0)
  assert both.costs(1)[(0, "F")] == pytest.approx(2.0)


def test_several_row_counts_are_timed_and_cached(tmp_path, monkeypatch):
  loss, params, batch = _tiny()
  cache = tmp_path / "times.json"
  times = pj.calibrate(loss, params, batch, rows=[4, 1], repeats=1, cache=cache)
  assert times.rows == 4 and [t.rows for t in times.other_rows] == [1]
  one = times.other_rows[0]
  assert times.costs(1)[(0, "F")] == pytest.approx(one.forward[0])
  cal = sys.modules["piper_jax.planner.calibrate"]
  monkeypatch.setattr(cal, "_seconds", lambda *a: pytest.fail("timed a cached region"))
  assert pj.calibrate(loss, params, batch, rows=[4, 1], repeats=1, cache=cache) == times
  with pytest.raises(ValueError, match="non-empty list"):
    pj.calibrate(loss, params, batch, rows=[])


def test_search_sees_small_microbatches_run_slower_per_row():
  # Made-up timings where 2 rows take as long as 8 (launch-bound kernels): scaled from
  # 8 rows alone, 8 microbatches of the batch's 8 rows look best (less bubble); with both
  # measured, 2 microbatches of 4 rows do.
  loss, params, batch = _tiny()
  n = len(trace_loss(loss, params, batch).spec.regions)
  at8 = pj.RegionTimes("cpu", 8, {r: 1.0 for r in range(n)}, {r: 2.0 for r in range(n)})
  both = dataclasses.replace(at8, other_rows=(dataclasses.replace(at8, rows=2),))
  kw = dict(n_devices=2, memory_per_device=2**30, schedules=("1f1b",), microbatches=(2, 8))
  tx = optax.sgd(0.1)
  pick = lambda times: pj.strategies.search(
      loss, tx, params, batch, costs=pj.strategies.CostModel(region_times=times),
      **kw).best.n_microbatches
  assert pick(at8) == 8 and pick(both) == 2


def test_regions_are_timed_on_the_batchs_own_token_ids(monkeypatch):
  # Token ids decide how an embedding's gradient scatters (all-zero ids serialize it on
  # one row): a batch with values is timed on its first rows, one given as shapes on
  # ids spread over many rows.
  loss, params, _ = _tiny()
  config = gpt.get_config("tiny", n_stages=2, n_layers=4)
  batch = gpt.random_batch(config, jax.random.PRNGKey(1), 8)
  cal = sys.modules["piper_jax.planner.calibrate"]
  seen = []
  monkeypatch.setattr(cal, "_seconds",
                      lambda fn, args, repeats: seen.append(args[1]) or 1e-3)
  pj.calibrate(loss, params, batch, rows=2, repeats=1)
  first = jax.tree_util.tree_leaves(batch)
  ints = [x for args in seen for x in args if jnp.issubdtype(x.dtype, jnp.integer)]
  assert ints and all(any(x.shape == y[:2].shape and bool((x == y[:2]).all()) for y in first)
                      for x in ints)
  seen.clear()
  pj.calibrate(loss, params, jax.eval_shape(lambda: batch), rows=2, repeats=1)
  ints = [x for args in seen for x in args if jnp.issubdtype(x.dtype, jnp.integer)]
  assert ints and all(len(set(np.asarray(x).ravel().tolist())) > 1 for x in ints)


def test_regions_are_timed_on_what_the_regions_before_them_make(monkeypatch):
  # A MoE block's combine gathers by the token slots its router chose, an input from the
  # region before it: timed on zeros, its backward would scatter every row onto one.
  from examples import qwen3
  config = qwen3.get_config("qwen3-moe-tiny")
  net = qwen3.make_model(config)
  params = jax.eval_shape(lambda: qwen3.init_params(net, jax.random.PRNGKey(0)))
  batch = qwen3.random_batch(config, jax.random.PRNGKey(1), 4)
  cal = sys.modules["piper_jax.planner.calibrate"]
  seen = []
  monkeypatch.setattr(cal, "_seconds", lambda fn, args, repeats: seen.append(args[2]) or 1e-3)
  pj.calibrate(qwen3.loss_fn(net), params, batch, rows=2, repeats=1)
  slots = [x for acts in seen for x in acts if jnp.issubdtype(x.dtype, jnp.integer)]
  assert slots and all(len(set(np.asarray(x).ravel().tolist())) > 1 for x in slots)


def test_simulate_takes_per_region_costs():
  # Per-region costs equal for every region simulate as the per-pass costs do.
  loss, params, batch = _tiny()
  spec = trace_loss(loss, params, batch).spec
  plan = make_plan(spec, pj.strategies.pipeline(2, 4, "1f1b"), 2)
  n = len(spec.regions)
  per_region = {**{(r, "F"): 1.0 for r in range(n)}, **{(r, "B"): 2.0 for r in range(n)}}
  assert plan.simulate(per_region).makespan == plan.simulate({"F": 1, "B": 2}).makespan
  with pytest.raises(ValueError, match="no 'B' time for region \\d"):
    plan.simulate({(r, "F"): 1.0 for r in range(n)})


def test_search_ranks_with_measured_times():
  # A made-up measurement where stage 1 is ten times slower than stage 0: the planner
  # sees that pipeline bubble grow, which FLOP counts of equal stages would not show.
  loss, params, batch = _tiny()
  n = len(trace_loss(loss, params, batch).spec.regions)
  slow = pj.RegionTimes("cpu", 1, {r: (10.0 if r else 1.0) for r in range(n)},
                        {r: (20.0 if r else 2.0) for r in range(n)})
  tx = optax.sgd(0.1)
  kw = dict(n_devices=2, memory_per_device=2**30, schedules=("1f1b",), microbatches=(4,))
  measured = pj.strategies.search(loss, tx, params, batch,
                                  costs=pj.strategies.CostModel(region_times=slow), **kw)
  flops = pj.strategies.search(loss, tx, params, batch, **kw)
  assert measured.best.bubble_fraction > flops.best.bubble_fraction + 0.2
  assert measured.best.compute_time > 40.0  # seconds of the made-up regions


def test_train_script_ranks_by_measured_times(tmp_path, capsys):
  from examples import train
  cache = tmp_path / "times.json"
  out = train.main(["--strategy", "auto", "--stages", "2", "--steps", "1", "--batch", "16",
                    "--data", "synthetic", "--calibrate", str(cache), "--quiet"])
  assert cache.exists() and "chosen: " in capsys.readouterr().out
  assert len(out["losses"]) == 1


def test_regions_that_trace_alike_are_timed_once(tmp_path, monkeypatch):
  # A 4-stage GPT's middle stages trace alike: one is analysed and timed, and the other
  # takes its times.
  cal = sys.modules["piper_jax.planner.calibrate"]
  analysed, timed = [], []
  from piper_jax.lowering import analyze_region, regions
  analyze = analyze_region
  monkeypatch.setattr(regions, "analyze_region",
                      lambda runner, r, remat: analysed.append(r) or analyze(runner, r, remat))
  seconds = cal._seconds
  monkeypatch.setattr(cal, "_seconds", lambda *a: timed.append(1) or seconds(*a))
  loss, params, batch = _tiny(4)
  times = pj.calibrate(loss, params, batch, rows=2, repeats=2, cache=tmp_path / "t.json")
  assert analysed == [0, 1, 3] and len(timed) == 3 * 3  # F, F + B, F + BI per region
  assert times.forward[2] == times.forward[1] and times.backward[2] == times.backward[1]
  assert sorted(times.forward) == [0, 1, 2, 3]
