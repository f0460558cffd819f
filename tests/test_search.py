"""`pj.strategies.search`: only strategies that fit, ranked by the simulator, and the
chosen one trains to one device's numbers."""

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest

import piper_jax as pj
from examples import gpt
from models import assert_same_run, bytes_on_device, reference_run
from piper_jax.planner import estimate_plan, format_bytes, measure_model

MIB = 1 << 20


def _setup(net, batch_size=16):
  """(loss, params, batch) of an example model built from its config."""
  params = gpt.init_params(net, jax.random.PRNGKey(0))
  batch = gpt.random_batch(net.config, jax.random.PRNGKey(1), batch_size)
  return gpt.loss_fn(net), params, batch


def _gpt(n_stages, batch_size=16):
  return _setup(gpt.GPT(gpt.get_config("tiny", n_stages=n_stages)), batch_size)


def _one_step_like_one_device(loss, tx, params, batch, directives, n_devices=None):
  """One step of `directives` gives plain jax.value_and_grad + optax's loss and parameters."""
  ref_losses, ref_params = reference_run(loss, params, [batch], tx)
  devices = jax.devices()[:n_devices] if n_devices else None
  step = pj.compile(loss, tx, directives, params, batch, devices=devices)
  state, got = step(step.init(params), batch)
  np.testing.assert_allclose(float(got), ref_losses[0], rtol=1e-5)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                              atol=1e-6),
      step.params(state), ref_params)


@pytest.mark.timeout(60)
def test_only_strategies_that_fit():
  loss, params, batch = _gpt(4)
  tx = optax.adamw(1e-3)
  free = pj.strategies.search(loss, tx, params, batch, 8, 1 << 40, top=100)
  peaks = {(c.name, c.n_microbatches): c.peak_memory for c in free.candidates}
  assert not free.rejected and len(peaks) == len(free.candidates)
  names = {c.name for c in free.candidates}
  # Data parallel, pipelines on the 4 regions and on 2 ranks of 2 regions each, every schedule.
  assert {"dp8 zero0", "dp8 zero3", "1f1b pp4 x dp2 zero1", "1f1b pp2 [0-1 | 2-3] x dp4 zero1",
          "zb pp2 [0-1 | 2-3] x dp4 zero3", "interleaved pp2 v2 x dp4 zero1",
          "dualpipev pp2 v2 x dp4 zero0"} <= names
  # A tight bound: below every data-parallel ZeRO-0 candidate, above the smallest ZeRO-3 one.
  zero0 = min(p for (n, _), p in peaks.items() if n == "dp8 zero0")
  zero3 = min(p for (n, _), p in peaks.items() if n == "dp8 zero3")
  assert zero3 < zero0
  bound = (zero0 + zero3) / 2
  tight = pj.strategies.search(loss, tx, params, batch, 8, bound, top=100, headroom=1.0)
  assert all(c.peak_memory <= bound for c in tight.candidates)
  assert {c.name for c in tight.candidates} & {"dp8 zero3", "1f1b pp4 x dp2 zero1"}
  assert "dp8 zero0" not in {c.name for c in tight.candidates}
  rejected = {(r.name, r.n_microbatches): r for r in tight.rejected}
  for m in (1, 2):
    r = rejected[("dp8 zero0", m)]
    assert r.reason == (f"needs {format_bytes(peaks[('dp8 zero0', m)])} of "
                        f"{format_bytes(bound)}")
    assert r.peak_memory > bound
  assert len(tight.candidates) + len(tight.rejected) == len(free.candidates)
  table = tight.table(top=3).splitlines()
  assert table[0] == (f"the 3 fastest of {len(tight.candidates)} strategies that fit "
                      f"({len(tight.candidates) - 3} more in `candidates`):")
  assert table[2].startswith("| strategy | microbatches | simulated step") and len(table) == 7
  times = [c.step_time for c in tight.candidates]
  assert times == sorted(times)


def _cells(row):
  """A Markdown table row's cells: split at "|" that no backslash escapes."""
  return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


@pytest.mark.timeout(60)
def test_table_is_markdown_and_says_how_many_it_shows():
  # Grouped pipelines' names hold "|" ("1f1b pp2 [0-1 | 2-3]"): escaped in their cells.
  loss, params, batch = _gpt(4)
  result = pj.strategies.search(loss, optax.sgd(0.1), params, batch, 4, 1 << 40,
                                schedules=("1f1b",), zero_stages=(0,))
  n = len(result.candidates)
  lines = result.table(top=n).splitlines()
  assert lines[0] == f"all {n} strategies that fit, fastest first:" and lines[1] == ""
  rows = [_cells(r) for r in lines[2:]]
  assert all(len(r) == 5 for r in rows) and len(rows) == n + 2
  names = [r[0].replace("\\|", "|") for r in rows[2:]]
  assert names == [c.name for c in result.candidates]
  assert "1f1b pp2 [0-1 | 2-3] x dp2 zero0" in names
  top1 = str(dataclasses.replace(result, top=1))
  assert f"the 1 fastest of {n} strategies that fit ({n - 1} more in `candidates`):" in top1


@pytest.mark.timeout(60)
def test_no_pipeline_on_one_rank():
  # Two regions make one rank of DualPipeV (stages r and 2n-1-r) or of interleaved
  # (2 virtual stages): neither is proposed, planned or rejected.
  loss, params, batch = _gpt(2)
  result = pj.strategies.search(loss, optax.sgd(0.1), params, batch, 8, 1 << 40,
                                schedules=("1f1b", "interleaved", "dualpipev"))
  everything = list(result.candidates) + list(result.rejected)
  assert {c.name.split()[0] for c in everything} == {"1f1b"}
  assert all(c.n_ranks == 2 for c in result.candidates)
  with pytest.raises(ValueError, match="no strategy of"):
    pj.strategies.search(loss, optax.sgd(0.1), params, batch, 8, 1 << 40,
                         schedules=("interleaved", "dualpipev"))


@pytest.mark.timeout(60)
def test_estimate_prints_with_units():
  loss, params, batch = _gpt(2)
  tx = optax.adamw(1e-3)
  est = pj.strategies.estimate(loss, tx, params, batch, pj.strategies.pipeline(2, 4, "1f1b"), 2)
  text = str(est).splitlines()
  time_ = r"[\d.e+-]+ (s|ms|us)"
  assert re.fullmatch(rf"step time: {time_} per step \(simulated\)", text[0])
  assert re.fullmatch(rf"  compute: {time_} \(bubble: [\d.]+% of it idle\)", text[1])
  assert re.fullmatch(rf"  communication: {time_} \(added to the step\)", text[2])
  assert re.fullmatch(rf"  optimizer update: {time_}", text[3])
  assert text[4] == f"peak memory: {format_bytes(est.memory.total)} per device (the busiest one)"
  assert f"  parameters: {format_bytes(est.memory.params)}" in text
  # Without a pipeline the data-parallel traffic overlaps the compute; the peak holds the
  # larger of gradients and activations.
  dp = str(pj.strategies.estimate(loss, tx, params, batch, pj.strategies.data_parallel(2), 2))
  assert "hidden behind compute" in dp and "counting the larger of gradients" in dp
  best = pj.strategies.search(loss, tx, params, batch, 2, 1 << 40, schedules=("dp",)).best
  assert str(best).startswith(f"{best.name}, {best.n_microbatches} microbatch")
  assert "step time: " in str(best)


@pytest.mark.timeout(60)
def test_best_trains_like_one_device():
  # Plain SGD, so that a wrongly scaled gradient shows in the updated parameters.
  loss, params, batch = _gpt(4)
  tx = optax.sgd(0.1)
  result = pj.strategies.search(loss, tx, params, batch, 8, 1 << 40, top=100)
  best = result.best  # a grouped pipeline: test_grouped_regions_train_like_one_device
  _one_step_like_one_device(loss, tx, params, batch, best.directives, best.n_ranks * best.dp)


@pytest.mark.timeout(60)
def test_timelines_of_the_top_candidates(tmp_path):
  loss, params, batch = _gpt(2)
  result = pj.strategies.search(loss, optax.sgd(0.1), params, batch, 2, 1 << 40,
                                schedules=("1f1b", "gpipe"), microbatches=(2, 4))
  paths = result.timelines(str(tmp_path), top=2)
  assert len(paths) == 2 and paths[0].endswith(".svg")
  assert all("<svg" in open(p).read() for p in paths) and paths[0] != paths[1]
  assert result.candidates[0].name.replace(" ", "_") in paths[0]


@pytest.mark.timeout(30)
def test_more_microbatches_of_1f1b_rank_above_gpipe_with_2():
  # No tick overhead: FLOPs alone, where 2 microbatches on 2 ranks leave a third idle.
  loss, params, batch = _gpt(2)
  costs = pj.strategies.CostModel(tick_overhead_s=0.0)
  result = pj.strategies.search(loss, optax.sgd(0.1), params, batch, 2, 1 << 40,
                                schedules=("gpipe", "1f1b"), microbatches=(2, 8), costs=costs)
  rank = {(c.schedule, c.n_microbatches): i for i, c in enumerate(result.candidates)}
  by = {(c.schedule, c.n_microbatches): c for c in result.candidates}
  assert rank[("1f1b", 8)] < rank[("gpipe", 2)]
  assert by[("gpipe", 2)].bubble_fraction > 2 * by[("1f1b", 8)].bubble_fraction
  assert by[("gpipe", 2)].compute_time > by[("1f1b", 8)].compute_time
  # 1F1B keeps fewer microbatches alive than GPipe at the same count.
  assert by[("1f1b", 8)].memory.activations < by[("gpipe", 8)].memory.activations


@pytest.mark.timeout(90)
def test_grouped_regions_train_like_one_device(batches_of):
  # Two PP regions per rank (placed one by one, orders widened to the rank's regions):
  # k AdamW steps and a plain-SGD step give one device's numbers.
  config = gpt.get_config("tiny", n_stages=4)
  loss, params, batch = _setup(gpt.GPT(config))
  batches_of(config)
  result = pj.strategies.search(loss, optax.adamw(1e-3), params, batch, 4, 1 << 40,
                                schedules=("1f1b",), zero_stages=(1,), microbatches=(4,))
  grouped = next(c for c in result.candidates if c.stages == ((0, 1), (2, 3)))
  assert_same_run(loss, params, grouped.directives, devices=jax.devices()[:4])


@pytest.mark.timeout(30)
def test_bad_input_says_what_to_change():
  loss, params, batch = _gpt(2)
  tx = optax.sgd(0.1)
  with pytest.raises(ValueError, match="n_devices must be an int >= 1, got 0"):
    pj.strategies.search(loss, tx, params, batch, 0, 1 << 30)
  with pytest.raises(ValueError, match="memory_per_device must be > 0 bytes"):
    pj.strategies.search(loss, tx, params, batch, 8, 0)
  with pytest.raises(ValueError, match=r"headroom must be in \(0, 1\], got 1.5"):
    pj.strategies.search(loss, tx, params, batch, 8, 1 << 30, headroom=1.5)
  with pytest.raises(ValueError, match="schedules must be a non-empty list"):
    pj.strategies.search(loss, tx, params, batch, 8, 1 << 30, schedules=("pp",))
  one, one_params, one_batch = _gpt(1)
  with pytest.raises(ValueError, match="annotate the model's stages with pj.annotate\\('PP'\\) "
                                       "or add 'dp' to schedules"):
    pj.strategies.search(one, tx, one_params, one_batch, 8, 1 << 30, schedules=("1f1b", "zb"))
  with pytest.raises(ValueError, match=r"no strategy fits 768 B per device \(75% of 1.0 KiB\).*give more memory"):
    pj.strategies.search(loss, tx, params, batch, 8, 1024)


@pytest.mark.timeout(60)
def test_train_script_auto(capsys):
  from examples import train
  with pytest.raises(train.UsageError, match="drop --dp and --zero"):
    train.build_strategy(train.parse_args(["--strategy", "auto", "--dp", "2"]), 8)
  # The script prints the table, compiles the fastest that fits by XLA's count, trains it.
  out = train.main(["--strategy", "auto", "--stages", "2", "--steps", "2", "--batch", "16",
                    "--data", "synthetic", "--memory-gib", str(5 / 1024), "--quiet"])
  printed = capsys.readouterr().out
  assert "| strategy | microbatches | simulated step | bubble | peak memory |" in printed
  chosen = printed.split("chosen: ")[1].splitlines()[0]
  need = float(re.search(r"compiled, it needs ([0-9.e-]+) GiB per device", chosen).group(1))
  assert 0 < need <= 0.95 * 5 / 1024
  assert np.isfinite(out["losses"]).all()


@pytest.mark.timeout(90)
def test_compile_best_checks_xla_memory():
  # The estimates leave XLA's temporaries out; compile_best reads the compiled program's
  # own memory analysis and refuses a candidate over the bound, naming its bytes (the
  # chosen one trains in test_train_script_auto).
  loss, params, batch = _gpt(2)
  tx = optax.sgd(0.1)
  result = pj.strategies.search(loss, tx, params, batch, 2, 1 << 30, schedules=("1f1b",),
                                zero_stages=(1,), microbatches=(2,))
  best = result.candidates[0]
  tight = dataclasses.replace(result, memory_per_device=best.peak_memory / 0.95)
  with pytest.raises(ValueError, match=r"none of the 1 fastest strategies compiles within .* "
                                       r"by XLA's count: " + re.escape(best.name) +
                                       r" \(\d+ microbatches\): [\d.]+ [KMG]?i?B, estimated"):
    tight.compile_best(loss, tx, params, batch, tries=1)


@pytest.mark.timeout(60)
def test_estimate_divides_state_by_zero_stage():
  # One strategy's estimate: ZeRO-1 halves the optimizer state of 2 replicas, ZeRO-3 also
  # the parameters and gradients (plus the gathered weights of one region).
  loss, params, batch = _gpt(2)
  tx = optax.adamw(1e-3)
  est = {z: pj.strategies.estimate(loss, tx, params, batch, pj.strategies.data_parallel(2, zero=z), 2)
         for z in (0, 1, 3)}
  m0, m1, m3 = (est[z].memory for z in (0, 1, 3))
  assert m1.optimizer == pytest.approx(m0.optimizer / 2, rel=1e-6) and m1.params == m0.params
  assert m3.grads == pytest.approx(m0.grads / 2, rel=1e-6)
  assert m0.params / 2 < m3.params <= m0.params / 2 + m0.params  # its shard + one gathered region
  assert m0.activations == m1.activations > 0 and est[0].step_time > 0
  pipe = pj.strategies.estimate(loss, tx, params, batch, pj.strategies.pipeline(2, 4, "1f1b"), 2)
  assert pipe.bubble_fraction > 0 and pipe.memory.params < m0.params
  # One backward frees activations as it makes gradients: without accumulation the peak
  # holds the larger of the two; accumulating over microbatches or a pipeline, both.
  assert not m0.grads_with_activations
  assert m0.total == m0.params + m0.optimizer + max(m0.grads, m0.activations)
  acc = pj.strategies.estimate(loss, tx, params, batch,
                               [pj.split(2)] + pj.strategies.data_parallel(2), 2).memory
  assert acc.grads_with_activations and acc.total == sum(
      (acc.params, acc.grads, acc.optimizer, acc.activations, acc.weight_copies, acc.working))
  assert pipe.memory.grads_with_activations and pipe.memory.weight_copies == 0  # fp32 reads
  # Under remat (a pipeline's default) a backward first recomputes what its forward dropped.
  assert pipe.memory.working > 0


@pytest.mark.timeout(60)
def test_a_loop_on_one_device_costs_its_launches_and_holds_the_loss_cotangent():
  # Accumulation on one device launches every microbatch's matmuls from the host (F once,
  # B twice): k microbatches cost k times that beside the same FLOPs. Its backward holds
  # the loss cotangent (the logits') beside the residuals, as a pipeline's does.
  loss, params, batch = _gpt(2)
  tx = optax.adamw(1e-3)
  model = measure_model(loss, tx, params, batch)
  assert all(r.matmuls > 0 for r in model.spec.regions)
  per_mb = 3 * sum(r.matmuls for r in model.spec.regions)

  def accumulation(k, launch):
    costs = pj.strategies.CostModel(launch_overhead_s=launch, tick_overhead_s=0.0)
    plan = pj.plan(loss, [pj.split(k)], params, batch, 1)
    return estimate_plan(model, plan, costs, remat=False)

  for k in (2, 4):
    free, paid = accumulation(k, 0.0), accumulation(k, 1e-3)
    assert paid.step_time - free.step_time == pytest.approx(k * per_mb * 1e-3, rel=1e-6)
    assert model.loss_cotangent > 0
    assert free.memory.working == pytest.approx(model.loss_cotangent / k, rel=0.01)
  one = estimate_plan(model, pj.plan(loss, [], params, batch, 1),
                      pj.strategies.CostModel(launch_overhead_s=1.0), remat=False)
  assert one.step_time < 1.0 and one.memory.working == 0  # one microbatch: in the rate


@pytest.mark.timeout(60)
def test_regions_that_trace_alike_are_analysed_once(monkeypatch):
  # A 4-stage GPT's middle stages trace alike: the planner analyses one of them, and each
  # keeps the bytes its own analysis finds.
  from piper_jax.lowering import analyze_region, regions
  loss, params, batch = _gpt(4)
  model = measure_model(loss, optax.adamw(1e-3), params, batch)
  analysed = []
  monkeypatch.setattr(regions, "analyze_region",
                      lambda runner, r, remat: analysed.append(r) or analyze_region(runner, r, remat))
  got = model.act_bytes(False)
  assert sorted(analysed) == [0, 1, 3]
  for r in model.spec.regions:
    stored = analyze_region(model.runner, r.index, False).stored_avals
    own = sum(a.size * a.dtype.itemsize for a in stored) + sum(x.spec.nbytes for x in r.inputs)
    assert got[r.index] == own


@pytest.mark.timeout(60)
def test_accumulation_keeps_remats_residuals_and_the_weights_cast_once():
  # On one rank a microbatch's F and B run as one chain, compiled together: XLA redoes
  # elementwise values in the backward, so what stays is remat's residuals (XLA's
  # buffers of Qwen3-1.7B's accumulation on an H200), and the loop keeps the weights
  # it casts once a step. A step of one microbatch is costed as before.
  import jax.numpy as jnp
  config = gpt.get_config("tiny", n_stages=1, dtype=jnp.bfloat16)
  loss, params, batch = _setup(gpt.GPT(config))
  model = measure_model(loss, optax.adamw(1e-3), params, batch)
  costs = pj.strategies.CostModel()
  cast = sum(model.spec.params[p].nbytes * r for p, r in model.copy_ratio.items())
  assert cast > 0 and model.act_bytes(True)[0] < model.act_bytes(False)[0]
  two = estimate_plan(model, pj.plan(loss, [pj.split(2)], params, batch, 1), costs,
                      remat=False).memory
  assert two.weight_copies == int(cast)
  assert two.activations == int(model.act_bytes(True)[0] * 0.5)
  one = estimate_plan(model, pj.plan(loss, [], params, batch, 1), costs, remat=False).memory
  assert one.weight_copies == 0 and one.activations == model.act_bytes(False)[0]


@pytest.mark.timeout(60)
def test_xla_fits_a_step_of_one_microbatch_into_its_memory_where_it_can():
  # A step of one microbatch compiles whole: above the memory XLA compiles for, it
  # rematerializes down to it, so long as what elementwise equations cannot redo fits
  # (Qwen3-1.7B at batch 16 on one H200: 94 GiB in JAX's pool, 112 GiB given 95%). A
  # loop over microbatches keeps what its stores hold.
  from piper_jax.planner.costs import XLA_FIT
  loss, params, batch = _gpt(1)
  tx = optax.adamw(1e-3)
  model = measure_model(loss, tx, params, batch)
  costs = pj.strategies.CostModel()
  step = pj.plan(loss, [], params, batch, 1)
  free = estimate_plan(model, step, costs, remat=False).memory
  assert free.fitted is None and free.total == free.parts
  floor = dataclasses.replace(free, activations=sum(model.act_bytes(True).values())).total
  assert floor < free.total  # the tiny GPT's GELU and LayerNorm values can be redone
  limit = (floor + free.total) / 2 / XLA_FIT
  est = estimate_plan(model, step, costs, remat=False, memory_limit=limit)
  fitted = est.memory
  assert fitted.total == int(XLA_FIT * limit) < fitted.parts == free.total
  assert "which XLA rematerializes to fit" in str(est)
  too_small = estimate_plan(model, step, costs, remat=False, memory_limit=floor / 2).memory
  assert too_small.total == free.total  # it cannot fit: the estimate says so
  roomy = estimate_plan(model, step, costs, remat=False, memory_limit=2 * free.total).memory
  assert roomy.total == free.total
  loop = estimate_plan(model, pj.plan(loss, [pj.split(2)], params, batch, 1), costs,
                       remat=False, memory_limit=limit).memory
  assert loop.fitted is None


@pytest.mark.timeout(60)
def test_the_optimizers_update_is_costed_by_the_bytes_each_device_updates():
  # Adam reads parameters, gradients and two moments and writes three (7 bytes per
  # parameter byte) once a step: ZeRO-1 over 2 replicas halves it, and it adds to the
  # step whatever else is hidden.
  loss, params, batch = _gpt(2)
  tx = optax.adamw(1e-3)
  costs = pj.strategies.CostModel(memory_bytes_per_s=1e9)  # slow, so the update shows
  p_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  est = {z: pj.strategies.estimate(loss, tx, params, batch, pj.strategies.data_parallel(2, zero=z),
                                   2, costs=costs) for z in (0, 1)}
  assert est[0].update_time == pytest.approx(7 * p_bytes / 1e9, rel=1e-4)  # + step counts
  assert est[1].update_time == pytest.approx(est[0].update_time / 2, rel=1e-6)
  assert est[0].step_time == pytest.approx(
      max(est[0].compute_time, est[0].comm_time) + est[0].update_time)
  assert est[0].step_time - est[1].step_time == pytest.approx(est[0].update_time / 2, rel=1e-6)
  default = pj.strategies.estimate(loss, tx, params, batch, pj.strategies.data_parallel(2), 2)
  assert default.update_time == pytest.approx(7 * p_bytes / 3e12, rel=1e-4)
  # Measured seconds per byte (pj.calibrate given the optimizer) replace the bandwidth.
  times = pj.RegionTimes("cpu", 1, {}, {}, update_s_per_byte=2e-9)
  assert pj.strategies.CostModel(region_times=times).update_seconds(100, 2.0) == \
      pytest.approx(2e-7)


@pytest.mark.timeout(60)
def test_a_pipelines_loss_rank_holds_the_logits_cotangent_in_its_backward():
  # The loss's backward sums the logits' cotangent in fp32 and casts it to the dtype the
  # logits were made in: both live beside the recomputed residuals (XLA's dumps on GPUs).
  import jax.numpy as jnp

  from piper_jax.ir.pipeline import make_plan
  from piper_jax.lowering.options import LoweringOptions
  tx = optax.adamw(1e-3)
  for dtype, per_element in ((jnp.float32, 4), (jnp.bfloat16, 4 + 2)):
    config = gpt.get_config("tiny", n_stages=2, dtype=dtype)
    loss, params, batch = _setup(gpt.GPT(config))
    model = measure_model(loss, tx, params, batch)
    assert model.loss_cotangent == 16 * config.seq_len * config.vocab_size * per_element
  plan = make_plan(model.spec, pj.strategies.pipeline(2, 4, "1f1b"), 2, global_batch=16)
  costs = pj.strategies.CostModel()
  with_it = estimate_plan(model, plan, costs, True, LoweringOptions()).memory
  without = estimate_plan(dataclasses.replace(model, loss_cotangent=0), plan, costs, True,
                          LoweringOptions()).memory
  assert with_it.working - without.working == model.loss_cotangent // 4  # a microbatch's rows


@pytest.mark.timeout(90)
def test_experts_divide_the_update_and_wait_for_their_exchanges():
  # Without a pipeline the data-parallel reduction hides behind the backward, but a
  # region waits for its tokens' all-to-all: split experts add that to the step, and
  # divide the update of their weights over the group.
  from examples import moe
  loss, params, batch = _setup(moe.MoEGPT(moe.get_config("tiny", n_stages=2, n_layers=4,
                                                        n_experts=8)))
  tx = optax.adamw(1e-3)
  costs = pj.strategies.CostModel(link_bytes_per_s=1e6, memory_bytes_per_s=1e9)
  whole = pj.strategies.estimate(loss, tx, params, batch, pj.strategies.data_parallel(4), 4,
                                 costs=costs)
  directives = pj.strategies.data_parallel(4) + [pj.shard({"EP": "*"}, [0, 1, 2, 3])]
  split = pj.strategies.estimate(loss, tx, params, batch, directives, 4, costs=costs)
  assert split.update_time < whole.update_time
  # The slow links make the all-to-alls longer than the compute: the step counts them.
  assert split.step_time > split.compute_time + split.update_time


@pytest.mark.timeout(60)
def test_a_pipeline_counts_its_gradients_whole_at_every_zero_stage():
  # A pipeline sums a stage's gradients whole over its microbatches and reduce-scatters
  # them once: ZeRO-2/3 hold what ZeRO-1 holds; without a pipeline ZeRO-2 halves them.
  loss, params, batch = _gpt(2)
  tx = optax.adamw(1e-3)
  est = lambda d, n: pj.strategies.estimate(loss, tx, params, batch, d, n).memory
  pipe = [est(pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=z), 4) for z in (1, 2, 3)]
  assert pipe[0].grads == pipe[1].grads == pipe[2].grads > 0
  # Read in fp32, ZeRO-3's gathered weights are the whole fp32 ones, beside its shard.
  assert pipe[2].params == pytest.approx(pipe[0].params / 2 + pipe[2].grads, rel=1e-5)
  dp0, dp2 = (est(pj.strategies.data_parallel(2, zero=z), 2) for z in (0, 2))
  assert dp2.grads == pytest.approx(dp0.grads / 2, rel=1e-6)


@pytest.mark.timeout(60)
def test_cast_weights_count_once_in_pipelines():
  # A bf16-compute model with fp32 masters: a pipeline keeps each weight's bf16 copy for
  # the step (half its bytes), and ZeRO-3 gathers weights in bf16.
  import jax.numpy as jnp
  loss, params, batch = _setup(gpt.GPT(gpt.get_config("tiny", n_stages=2, dtype=jnp.bfloat16)), 16)
  tx = optax.sgd(1e-3)
  pipe = pj.strategies.estimate(loss, tx, params, batch, pj.strategies.pipeline(2, 4, "1f1b"), 2)
  m = pipe.memory
  assert 0 < m.weight_copies <= m.params / 2 + 1
  fp32 = _setup(gpt.GPT(gpt.get_config("tiny", n_stages=2)), 16)
  gathered = []
  for loss, params, batch in (fp32, (loss, params, batch)):
    z3, z0 = (pj.strategies.estimate(loss, tx, params, batch,
                                     pj.strategies.data_parallel(2, zero=z), 2).memory
              for z in (3, 0))
    gathered.append(z3.params - z0.params / 2)  # beside its shard, the largest region
  assert gathered[1] == pytest.approx(gathered[0] / 2, rel=0.01)


@pytest.mark.timeout(90)
def test_experts_split_over_the_data_parallel_devices():
  # A MoE model: the search adds candidates with the experts split ("ep"), whose expert
  # weights count once over the group; the chosen one trains as one device does.
  from examples import moe
  loss, params, batch = _setup(moe.MoEGPT(moe.get_config("tiny", n_stages=2, n_layers=4,
                                                        n_experts=8)))
  tx = optax.sgd(0.1)
  result = pj.strategies.search(loss, tx, params, batch, 8, 1 << 40, schedules=("dp", "1f1b"),
                                zero_stages=(1,), microbatches=(2,), top=100)
  by = {c.name: c for c in result.candidates}
  split, whole = by["1f1b pp2 x dp4 zero1 ep4"], by["1f1b pp2 x dp4 zero1"]
  # Split experts are not all-reduced over the replicas: less data-parallel traffic than
  # their all-to-alls add, on this model.
  assert split.memory.params < whole.memory.params and 0 < split.comm_time < whole.comm_time
  assert any(c.name == "dp8 zero1 ep8" for c in result.candidates)
  only = pj.strategies.search(loss, tx, params, batch, 8, 1 << 40, schedules=("1f1b",),
                              zero_stages=(1,), microbatches=(2,), expert_parallel=True)
  assert all(c.name.endswith(" ep4") for c in only.candidates)
  _one_step_like_one_device(loss, tx, params, batch, split.directives)


@pytest.mark.timeout(90)
def test_tensor_parallel_groups_split_the_named_weights():
  # A GPT with Megatron partitioning names: candidates with TP groups hold half of every
  # split weight; a chosen TP x DP candidate trains as one device does (plain SGD).
  loss, params, batch = _setup(gpt.GPT(gpt.get_config("tiny", n_stages=2, tp_axis="tp")))
  tx = optax.sgd(0.1)
  result = pj.strategies.search(loss, tx, params, batch, 4, 1 << 40, schedules=("dp", "1f1b"),
                                zero_stages=(1,), microbatches=(2,), top=100)
  by = {c.name: c for c in result.candidates}
  split, whole = by["dp4 zero1 tp2"], by["dp4 zero1"]
  assert split.memory.params < whole.memory.params and "1f1b pp2 x dp2 zero1 tp2" in by
  only = pj.strategies.search(loss, tx, params, batch, 4, 1 << 40, schedules=("dp",),
                              zero_stages=(1,), microbatches=(2,), tensor_parallel=True)
  assert all(" tp" in c.name for c in only.candidates)
  for cand in (split, by["1f1b pp2 x dp2 zero1 tp2"]):
    _one_step_like_one_device(loss, tx, params, batch, cand.directives, 4)


@pytest.mark.timeout(60)
def test_one_loop_holds_the_largest_ranks_activations_on_every_device():
  # The loop is one program for every rank: each device allocates the stores of the
  # rank that keeps the most. Here the first rank keeps the activations (wide, and
  # 1F1B holds two microbatches there) and the last one the parameters.
  import jax.numpy as jnp

  def loss(params, batch):
    with pj.annotate("PP"):
      x = jnp.tanh(batch["x"] @ params["wide"]) @ params["narrow"]
    with pj.annotate("PP"):
      x = x * jnp.mean(params["big"])
    return jnp.mean((x - batch["y"]) ** 2)

  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"wide": jax.random.normal(k[0], (8, 2048)), "narrow": jax.random.normal(k[1], (2048, 8)),
            "big": jnp.ones((1 << 20,))}
  batch = {"x": jax.random.normal(k[2], (64, 8)), "y": jax.random.normal(k[3], (64, 8))}
  tx = optax.sgd(1e-3)
  directives = pj.strategies.pipeline(2, 4, "1f1b")
  stacked = pj.LoweringOptions(spread_uneven_slots=False)
  loop = pj.strategies.estimate(loss, tx, params, batch, directives, 2, options=stacked).memory
  # It peaks on the last rank's parameters (the stacked slot is as large as its part,
  # plus the empty shared segment's one float) and the first rank's activations.
  assert loop.params == (4 << 20) + 4
  first_rank_acts = 2 * 16 * 2048 * 4  # two microbatches' (16, 2048) fp32 tanh outputs
  assert loop.activations >= first_rank_acts


@pytest.mark.timeout(90)
def test_distributed_optimizer_shards_the_masters_and_gathers_the_bf16_copy():
  # ZeRO-1 over 4 replicas of a bf16-compute model: the fp32 parameters are sharded like
  # the optimizer state and the bf16 copy is whole, as the compiled step holds them.
  import jax.numpy as jnp
  loss, params, batch = _setup(gpt.GPT(gpt.get_config("tiny", n_stages=2, dtype=jnp.bfloat16)), 16)
  tx = optax.adam(1e-3)
  directives = pj.strategies.data_parallel(4, zero=1)
  m = pj.strategies.estimate(loss, tx, params, batch, directives, 4).memory
  plain = pj.strategies.estimate(loss, tx, params, batch, directives, 4,
                                 options=pj.LoweringOptions(shard_masters=False)).memory
  uncast = pj.strategies.estimate(loss, tx, params, batch, directives, 4,
                                  options=pj.LoweringOptions(cast_weights=False)).memory
  fp32 = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  for other in (plain, uncast):  # no bf16 copy to gather: the fp32 parameters stay whole
    assert other.params == pytest.approx(fp32, rel=1e-6) and other.weight_copies == 0
  assert m.params == pytest.approx(fp32 / 4, rel=1e-6)
  assert fp32 / 2 * 0.9 < m.weight_copies <= fp32 / 2  # the leaves read in bf16
  # The step's state on a device is its shard of the fp32 parameters and of adam's moments.
  step = pj.compile(loss, tx, directives, params, batch, devices=jax.devices()[:4])
  held = bytes_on_device(step.init(params), jax.devices()[0])
  assert held == pytest.approx(m.params + m.optimizer, rel=0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("head_width", [512, 16])
def test_stacked_slots_hold_the_largest_ranks_part_on_every_device(head_width):
  # Interleaved 1F1B on 2 ranks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. A
  # rank's regions fill one sequence of slots, and stacking pads each slot to its largest
  # rank's part. The embedding on rank 0 and a head as large on rank 1: the ranks are
  # even, nothing is padded. A small head: stacked, every device holds rank 0's part;
  # spread (the default), an even share of everything.
  import jax.numpy as jnp

  def loss(params, batch):
    with pj.annotate("PP"):
      x = jnp.tanh(batch["x"] @ params["embed"])
    for s in range(2):
      with pj.annotate("PP"):
        x = x + jnp.tanh(x @ params[f"w{s}"])
    with pj.annotate("PP"):
      x = x @ params["head"]
    return jnp.mean((x - batch["y"]) ** 2)

  k = jax.random.split(jax.random.PRNGKey(0), 6)
  params = {"embed": jax.random.normal(k[0], (512, 64)) * 0.05,
            "head": jax.random.normal(k[1], (64, head_width)) * 0.05,
            "w0": jax.random.normal(k[2], (64, 64)) * 0.1, "w1": jax.random.normal(k[3], (64, 64)) * 0.1}
  batch = {"x": jax.random.normal(k[4], (32, 512)), "y": jax.random.normal(k[5], (32, head_width))}
  tx = optax.adam(1e-3)
  directives = pj.strategies.pipeline(4, 4, "interleaved")
  first = params["embed"].nbytes + params["w1"].nbytes   # rank 0's part
  own = max(first, params["w0"].nbytes + params["head"].nbytes)
  even = sum(x.nbytes for x in params.values()) / 2
  for options in (pj.LoweringOptions(spread_uneven_slots=False), pj.LoweringOptions()):
    m = pj.strategies.estimate(loss, tx, params, batch, directives, 2, options=options).memory
    if head_width == 512:
      assert m.params <= 1.01 * own  # even ranks: stacked or not, no padding
      continue
    if options.spread_uneven_slots:
      assert m.params <= 1.02 * even < own
    else:
      assert m.params >= first > even
    step = pj.compile(loss, tx, directives, params, batch, devices=jax.devices()[:2],
                      options=options)
    held = bytes_on_device(step.init(params), jax.devices()[0])
    assert held == pytest.approx(m.params + m.optimizer, rel=0.02)


def _search_qwen3_8b(batch: int, n_devices: int, *args, **kwargs):
  """`search` for the Qwen3-8B preset at seq 4096 (4 PP regions, bf16 compute, fp32
  weights, cuDNN's attention, AdamW), on shapes."""
  import jax.numpy as jnp
  import optax
  from examples import qwen3
  config = qwen3.get_config("qwen3-8b", n_stages=4, dtype=jnp.bfloat16, attention="cudnn",
                            seq_len=4096)
  model = qwen3.make_model(config)
  params = jax.eval_shape(lambda: qwen3.init_params(model, jax.random.PRNGKey(0)))
  tokens = jax.ShapeDtypeStruct((batch, 4096), jnp.int32)
  return pj.strategies.search(qwen3.loss_fn(model), optax.adamw(1e-4), params,
                              {"tokens": tokens, "targets": tokens}, n_devices, *args, **kwargs)


@pytest.mark.timeout(120)
def test_the_8b_preset_planned_for_four_h200s_on_a_cpu_fits_where_it_was_measured():
  # Qwen3-8B, seq 4096, batch 8, bf16 compute, fp32 weights and AdamW on 4 x H200 trained
  # under ZeRO-1 and ZeRO-3 DP in 83.5 GiB and under PP4 1F1B (8 microbatches) in 61.8
  # GiB, in 808.5, 797.6 and 1232.4 ms a step (benchmarks/RESULTS.md). Planned here, on
  # shapes, for the H200, with the cuDNN attention it runs there: each fits, each within
  # 10% of its measured memory and 15% of its measured step.
  result = _search_qwen3_8b(8, 4, target="H200", schedules=("dp", "1f1b"), zero_stages=(1, 3),
                            microbatches=(1, 8))
  by = {(c.name, c.n_microbatches): c for c in result.candidates}
  for key, measured_gib, measured_ms in ((("dp4 zero1", 1), 83.54, 808.5),
                                         (("dp4 zero3", 1), 83.54, 797.6),
                                         (("1f1b pp4", 8), 61.79, 1232.4)):
    assert key in by, sorted(by)
    assert by[key].memory.total / 2**30 == pytest.approx(measured_gib, rel=0.1), key
    assert by[key].step_time * 1e3 == pytest.approx(measured_ms, rel=0.15), key


@pytest.mark.timeout(180)
def test_the_8b_preset_planned_for_1024_gpus_of_80_gib_fits_and_is_ranked():
  # One sequence of 4096 per device under ZeRO-3 needs about 25 GiB (weights and AdamW
  # state over 1024 devices, one sequence's activations): strategies fit, fastest first.
  result = _search_qwen3_8b(1024, 1024, 80 * 2**30, target="H100")
  assert result.candidates
  assert all(c.peak_memory <= 80 * 2**30 for c in result.candidates)
  times = [c.step_time for c in result.candidates]
  assert times == sorted(times)


@pytest.mark.timeout(120)
def test_activation_checkpointing_is_a_choice_the_search_costs():
  # The same Qwen3 with every block under nn.remat: its forwards keep only the blocks'
  # inputs, its backwards run the blocks' forwards again. Each strategy is tried both ways.
  import jax.numpy as jnp
  from examples import qwen3
  config = qwen3.get_config("qwen3-tiny", n_stages=2, seq_len=64)
  models = {remat: qwen3.make_model(dataclasses.replace(config, remat=remat))
            for remat in (False, True)}
  params = jax.eval_shape(lambda: qwen3.init_params(models[False], jax.random.PRNGKey(0)))
  tokens = jax.ShapeDtypeStruct((16, 64), jnp.int32)
  batch = {"tokens": tokens, "targets": tokens}
  result = pj.strategies.search(qwen3.loss_fn(models[False]), optax.adam(1e-3), params, batch,
                                2, 1 << 40, schedules=("dp", "1f1b"), zero_stages=(1,),
                                microbatches=(2,), top=100,
                                checkpointing={"per block": qwen3.loss_fn(models[True])})
  by = {c.name: c for c in result.candidates}
  for name in ("dp2 zero1", "1f1b pp2"):
    plain, ac = by[name], by[name + " +ac per block"]
    assert ac.checkpointing == "per block" and plain.checkpointing is None
    assert ac.memory.activations < plain.memory.activations
    assert ac.compute_time > plain.compute_time  # the blocks' forwards run twice
  # The fastest that fits a bound only the checkpointed model meets is compiled with it.
  need = by["dp2 zero1 +ac per block"].peak_memory
  tight = pj.strategies.search(qwen3.loss_fn(models[False]), optax.adam(1e-3), params, batch,
                               2, need / 0.75 * 1.001, schedules=("dp",), zero_stages=(1,),
                               microbatches=(2,),
                               checkpointing={"per block": qwen3.loss_fn(models[True])})
  assert tight.best.checkpointing == "per block"
  assert tight.variants["per block"] is not None
