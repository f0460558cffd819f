"""The planner's pieces on hand-made inputs: the memory and time arithmetic of the cost
model, its units, the activations alive at once in a simulated plan, how the search
cuts regions into stages and names and tabulates its candidates. Nothing is traced or
compiled."""

import types

import pytest

from piper_jax.ir.graph import Pass
from piper_jax.ir.plan import Task
from piper_jax.planner import (Candidate, CostModel, Estimate, MemoryEstimate, RegionTimes,
                               SearchResult, format_bytes, format_time)
from piper_jax.planner.costs import _peak_activations, _store_bytes, _stored_regions
from piper_jax.planner.search import _balanced_groups, _Layout, _microbatch_counts

pytestmark = pytest.mark.timeout(30)

GIB = 1 << 30


def test_memory_total_counts_gradients_beside_activations_or_the_larger():
  kept = MemoryEstimate(params=100, grads=40, optimizer=200, activations=30, weight_copies=5,
                        working=7)
  assert kept.total == 100 + 200 + 5 + 7 + 40 + 30
  # One backward frees activations as it makes gradients: only the larger counts.
  freed = MemoryEstimate(100, 40, 200, 30, grads_with_activations=False)
  assert freed.total == 100 + 200 + 40
  assert MemoryEstimate(100, 10, 200, 30, grads_with_activations=False).total == 330


def test_the_update_costs_its_bytes_at_memory_speed_or_as_measured():
  # adam's two state bytes per parameter byte: read parameters, gradients and state,
  # write parameters and state: 3 + 2 * 2 bytes moved per parameter byte.
  model = CostModel(memory_bytes_per_s=1e12)
  assert model.update_seconds(1e9, 2.0) == pytest.approx(7e-3)
  assert model.update_seconds(1e9, 0.0) == pytest.approx(3e-3)
  measured = CostModel(region_times=RegionTimes("cpu", 1, {}, {}, update_s_per_byte=1e-11))
  assert measured.update_seconds(1e9, 2.0) == pytest.approx(1e-2)
  # Times without the update measured fall back to the memory's speed.
  unmeasured = CostModel(memory_bytes_per_s=1e12, region_times=RegionTimes("cpu", 1, {}, {}))
  assert unmeasured.update_seconds(1e9, 2.0) == pytest.approx(7e-3)


def test_bytes_and_seconds_print_in_their_units():
  assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 * GIB, -2048)] == \
      ["0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB", "-2.0 KiB"]
  assert [format_time(s) for s in (2.5, 1.0, 0.0123, 1e-3, 4.56e-5, 0.9999996e-3)] == \
      ["2.5 s", "1 s", "12.3 ms", "1 ms", "45.6 us", "1 ms"]


def _estimate(step: float, compute: float, comm: float, update: float = 0.0) -> Estimate:
  return Estimate(step, compute, comm, 0.25, MemoryEstimate(2 * GIB, GIB, 0, 512 << 20),
                  update)


def test_an_estimate_says_how_much_communication_the_step_waits_for():
  lines = str(_estimate(0.012, 0.010, 0.003, 0.002)).splitlines()
  assert lines == ["step time: 12 ms per step (simulated)",
                   "  compute: 10 ms (bubble: 25.0% of it idle)",
                   "  communication: 3 ms (hidden behind compute)",
                   "  optimizer update: 2 ms",
                   "peak memory: 3.5 GiB per device (the busiest one)",
                   "  parameters: 2.0 GiB",
                   "  gradients: 1.0 GiB",
                   "  activations: 512.0 MiB"]  # parts of no bytes are left out
  assert "(added to the step)" in str(_estimate(0.015, 0.010, 0.003, 0.002))
  assert ("(1 ms of it added to the step, the rest hidden behind compute)"
          in str(_estimate(0.013, 0.010, 0.003, 0.002)))


def _task(region: int, pass_: Pass, mb: int, rank: int = 0) -> Task:
  return Task(f"n{region}{pass_.value}{mb}", region, pass_, mb, rank, 0, 1.0)


def _peak(ends: dict, rank: int = 0, nbytes=None) -> int:
  """`_peak_activations` of a plan whose tasks end at `ends` ({task: end time})."""
  plan = types.SimpleNamespace(tasks={t.label: t for t in ends})
  report = types.SimpleNamespace(end={t.label: e for t, e in ends.items()})
  return _peak_activations(plan, report, rank, nbytes or {0: 100, 1: 10})


def test_activations_live_from_their_forward_to_their_last_backward():
  F, B, BI, BW = Pass.F, Pass.B, Pass.BI, Pass.BW
  # GPipe's order keeps both microbatches' activations; 1F1B's one at a time.
  assert _peak({_task(0, F, 0): 1, _task(0, F, 1): 2, _task(0, B, 0): 4, _task(0, B, 1): 6}) == 200
  assert _peak({_task(0, F, 0): 1, _task(0, B, 0): 3, _task(0, F, 1): 4, _task(0, B, 1): 6}) == 100
  # A backward ending as a forward ends frees its bytes first.
  assert _peak({_task(0, F, 0): 1, _task(0, B, 0): 3, _task(0, F, 1): 3, _task(0, B, 1): 5}) == 100
  # Split backward passes: the activations stay until the later of BI and BW.
  assert _peak({_task(0, F, 0): 1, _task(0, BI, 0): 2, _task(0, F, 1): 3, _task(0, BW, 0): 5,
                _task(0, BI, 1): 6, _task(0, BW, 1): 7}) == 200
  # Each region's own bytes; tasks of another rank do not count.
  assert _peak({_task(0, F, 0): 1, _task(1, F, 0): 2, _task(1, B, 0): 3, _task(0, B, 0): 4,
                _task(0, F, 1, rank=1): 2, _task(0, B, 1, rank=1): 5}) == 110


def test_stages_sharing_a_device_keep_their_residuals_in_the_loops_stores():
  F, B = Pass.F, Pass.B
  # Accumulation: each microbatch's passes are one chain, whose residuals stay in its
  # branch (one microbatch's, all regions).
  order = [_task(r, p, m) for m in range(2) for r, p in ((0, F), (1, F), (1, B), (0, B))]
  plan = types.SimpleNamespace(ticks=[[order]], tasks={t.label: t for t in order})
  assert _stored_regions(plan) == set()
  # 1F1B with both stages on the device: region 0's F of microbatch 1 runs before its B
  # of microbatch 0, so its residuals go to a store of 2 live rows and a scratch row,
  # held for the step beside region 1's chain (F then B of one microbatch).
  order = [_task(0, F, 0), _task(1, F, 0), _task(1, B, 0), _task(0, F, 1), _task(0, B, 0),
           _task(1, F, 1), _task(1, B, 1), _task(0, B, 1)]
  plan = types.SimpleNamespace(ticks=[[order]], tasks={t.label: t for t in order})
  report = types.SimpleNamespace(end={t.label: i + 1 for i, t in enumerate(order)})
  assert _stored_regions(plan) == {0}
  assert _store_bytes(plan, report, {0: 100, 1: 10}, {0}) == 3 * 100 + 10


def test_stages_cut_regions_where_the_slowest_stage_is_fastest():
  assert _balanced_groups([1, 1, 1, 1], 2) == ((0, 1), (2, 3))
  assert _balanced_groups([4, 1, 1, 1, 1], 2) == ((0,), (1, 2, 3, 4))
  assert _balanced_groups([1, 1, 1], 2) == ((0,), (1, 2))  # ties cut earlier
  assert _balanced_groups([3, 1, 1, 1, 2], 3) == ((0,), (1, 2), (3, 4))
  assert _balanced_groups([5, 6, 7], 3) == ((0,), (1,), (2,))


def test_microbatch_counts_divide_the_replicas_batch():
  assert _microbatch_counts(12, 2, None, 8) == [2, 4]  # powers of two from `low`
  assert _microbatch_counts(64, 3, None, 16) == [4, 8, 16]
  assert _microbatch_counts(12, 1, [3, 5, 6, 0], 8) == [3, 6]  # given: those that divide


def test_candidate_names_say_schedule_ranks_and_replicas():
  assert _Layout("dp", 1, 8, 3, 1, ()).name == "dp8 zero3"
  assert _Layout("dp", 1, 8, 1, 1, (), ep=True).name == "dp8 zero1 ep8"
  assert _Layout("1f1b", 2, 4, 1, 4, ((0, 1), (2, 3))).name == "1f1b pp2 [0-1 | 2-3] x dp4 zero1"
  assert _Layout("gpipe", 2, 1, 0, 4, ((0,), (1,))).name == "gpipe pp2"
  assert (_Layout("interleaved", 2, 4, 0, 4, ((0,), (1,), (2,), (3,)), n_virtual=2, tp=2).name
          == "interleaved pp2 v2 x dp4 zero0 tp2")


def _candidate(name: str, step: float, peak: int, m: int) -> Candidate:
  return Candidate(step_time=step, compute_time=step, comm_time=0.0, bubble_fraction=0.125,
                   memory=MemoryEstimate(peak, 0, 0, 0), name=name, directives=[],
                   schedule="1f1b", n_ranks=2, dp=4, zero=1, stages=((0, 1), (2, 3)),
                   n_microbatches=m)


def test_the_search_table_is_markdown_and_says_how_many_it_shows():
  fast = _candidate("1f1b pp2 [0-1 | 2-3] x dp4 zero1", 0.0123, 3 * GIB // 2, 4)
  slow = _candidate("dp8 zero0", 2.5, 5 << 20, 1)
  result = SearchResult(fast, (fast, slow), (), 16.0 * GIB, top=1)
  fast_row = r"| 1f1b pp2 [0-1 \| 2-3] x dp4 zero1 | 4 | 12.3 ms | 12.5% | 1.5 GiB |"
  assert result.table().splitlines() == [
      "the 1 fastest of 2 strategies that fit (1 more in `candidates`):", "",
      "| strategy | microbatches | simulated step | bubble | peak memory |",
      "| --- | --- | --- | --- | --- |",
      fast_row]
  assert result.table(top=5).splitlines()[0] == "all 2 strategies that fit, fastest first:"
  assert result.table(top=5).splitlines()[-1] == "| dp8 zero0 | 1 | 2.5 s | 12.5% | 5.0 MiB |"
  assert str(result).splitlines()[0] == (
      "2 strategies fit 16.0 GiB per device (0 rejected); best: "
      "1f1b pp2 [0-1 | 2-3] x dp4 zero1, 4 microbatches")
  assert str(slow).splitlines()[0] == "dp8 zero0, 1 microbatch"
  assert fast.peak_memory == 3 * GIB // 2



def test_a_card_the_planner_does_not_know_is_refused_by_name():
  with pytest.raises(ValueError, match=r"unknown accelerator 'B300'; choose one of \['H100', 'H200', 'A100'\]"):
    CostModel.for_accelerator("B300")
  h200 = CostModel.for_accelerator("NVIDIA H200", mfu=0.5)
  assert h200.flops_per_s == pytest.approx(0.5 * 989e12)
  assert h200.memory_bytes_per_s == 4.8e12 and h200.link_bytes_per_s == 300e9
