"""Every schedule gives one device's numbers; the simulator reproduces the known formulas."""

import json

import jax
import pytest

import piper_jax as pj
from piper_jax import ir
from ir.test_passes import chain_model
from models import assert_same_run, init_mlp, mlp_loss

pytestmark = pytest.mark.timeout(300)


def _same(n_stages, directives, batch_size=16):
  params = init_mlp(jax.random.PRNGKey(0), n_stages)
  return assert_same_run(mlp_loss(n_stages), params, directives, batch_size=batch_size)


@pytest.mark.parametrize("schedule,n_stages,n_ranks", [
    ("zb", 2, 2), ("zb", 4, 4), ("interleaved", 4, 2), ("interleaved", 8, 4),
    ("dualpipev", 4, 2), ("dualpipev", 8, 4)])
def test_schedule_same_numbers(schedule, n_stages, n_ranks):
  step, _ = _same(n_stages, pj.strategies.pipeline(n_stages, 2 * n_ranks, schedule))
  assert step.plan.mesh.n_pp == n_ranks


@pytest.mark.parametrize("schedule,n_stages", [("zb", 2), ("interleaved", 4), ("dualpipev", 4)])
@pytest.mark.parametrize("zero", [1, 3])
def test_schedule_with_dp(schedule, n_stages, zero):
  _same(n_stages, pj.strategies.pipeline(n_stages, 4, schedule, dp=2, zero=zero), batch_size=16)


def test_zero_bubble_splits_backward():
  step, _ = _same(2, pj.strategies.pipeline(2, 4, "zb"))
  passes = {t.pass_.value for t in step.plan.tasks.values()}
  assert passes == {"F", "BI", "BW"}


def test_custom_order_from_piper_json(tmp_path):
  # Stage 0 runs both forwards before any backward; stage 1 alternates.
  sched = [{"op": "split", "num_microbatches": 2},
           {"op": "place", "filter": {"PP": 0}, "devices": [0]},
           {"op": "place", "filter": {"PP": 1}, "devices": [1]},
           {"op": "order", "filters": [[{"PP": 0, "PASS": "F", "MB": 0}, {"PP": 0, "PASS": "F", "MB": 1}],
                                       [{"PP": 0, "PASS": "BI", "MB": 1}], [{"PP": 0, "PASS": "BI", "MB": 0}],
                                       [{"PP": 0, "PASS": "BW", "MB": 0}, {"PP": 0, "PASS": "BW", "MB": 1}]]}]
  path = tmp_path / "custom.json"
  path.write_text(json.dumps(sched))
  step, _ = _same(2, str(path))
  seq = [t.label for tick in step.plan.ticks for t in tick[0]]
  assert seq.index("r0BI1") < seq.index("r0BI0")


def test_infeasible_custom_order_names_cycle():
  # BI of stage 0 needs BI of stage 1, which needs F of stage 1, which needs F of stage 0.
  d = [pj.split(2), pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [1]),
       pj.order([{"PP": 0, "PASS": "BI", "MB": 0}, {"PP": 0, "PASS": "F", "MB": 1},
                 {"PP": 0, "PASS": "BW", "MB": 0}]),
       pj.order([{"PP": 1, "PASS": "F", "MB": 1}, {"PP": 1, "PASS": "BI", "MB": 0},
                 {"PP": 1, "PASS": "BW", "MB": 0}])]
  with pytest.raises(pj.DirectiveError, match=r"directive 4 .*cycle r\d"):
    _same(2, d)


def _f(stage, pass_, mb):
  return {"PP": stage, "PASS": pass_, "MB": mb}


def test_mixed_fused_and_split_backward():
  # 1F1B where microbatches 0-1 run a fused B and 2-3 run BI, then BW later.
  stage0 = ([("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3)]
            + [("BI", 2), ("BW", 2), ("BI", 3), ("BW", 3)])
  stage1 = ([("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("BI", 2), ("F", 3)]
            + [("BI", 3), ("BW", 2), ("BW", 3)])
  sched = [{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4},
           {"op": "place", "filter": {"PP": 0}, "devices": [0]},
           {"op": "place", "filter": {"PP": 1}, "devices": [1]}]
  sched += [{"op": "order", "filters": [[_f(s, p, m)] for p, m in seq]}
            for s, seq in enumerate((stage0, stage1))]
  step, _ = _same(2, sched)
  labels = {t.label for t in step.plan.tasks.values()}
  assert {f"r{s}B{m}" for s in (0, 1) for m in (0, 1)} <= labels
  assert {f"r{s}{p}{m}" for s in (0, 1) for p in ("BI", "BW") for m in (2, 3)} <= labels
  assert not labels & {"r0B2", "r1B3", "r0BI0", "r1BW1"}


def _plan(*orders):
  d = [pj.split(2), pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [1])]
  return ir.make_plan(chain_model(2), d + [pj.order(o) for o in orders], n_devices=2)


def test_split_backward_errors():
  with pytest.raises(pj.DirectiveError,
                     match=r'directive 3 .*orders the BI of \{"PP": 0, "MB": 1\} \(r0B1\) but no '
                           r'order directive names its BW; add \{"PP": 0, "MB": 1, "PASS": "BW"\}'):
    _plan([_f(0, "F", 1), _f(0, "BI", 1)])
  with pytest.raises(pj.DirectiveError, match=r"directive 3 .*orders the BW of .*r0B0.* no order "
                                              r"directive names its BI"):
    _plan([_f(0, "F", 0), _f(0, "BW", 0)])
  with pytest.raises(pj.DirectiveError, match=r"directive 4 .*orders the BW of .*r0B0.* but its BI "
                                              r"is in directive 3; put the BI and BW of one "
                                              r"backward in the same order directive"):
    _plan([_f(0, "F", 0), _f(0, "BI", 0)], [_f(0, "F", 1), _f(0, "BW", 0)])
  with pytest.raises(pj.DirectiveError, match=r"directive 3 .*orders the BW of .*r0B0.* "
                                              r"\(group 1\) before its BI \(group 2\)"):
    _plan([_f(0, "F", 0), _f(0, "BW", 0), _f(0, "BI", 0)])
  with pytest.raises(pj.DirectiveError, match=r"directive 3 .*names the fused B of .*r0B1.*, which "
                                              r"directive 4 splits into BI and BW"):
    _plan([{"PP": 0, "PASS": "F", "MB": "*"}, {"PP": 0, "PASS": "B", "MB": "*"}],
          [_f(0, "BI", 1), _f(0, "BW", 1)])
  with pytest.raises(pj.DirectiveError, match=r"names the BI of .*r0B0.* more than once "
                                              r"\(directive 3 group 0, directive 3 group 2\)"):
    _plan([{"PP": 0, "PASS": "BI", "MB": "*"}, _f(0, "BW", 1), _f(0, "BI", 0), _f(0, "BW", 0)])


def test_wildcard_names_every_backward_it_matches():
  plan = _plan([{"PP": "*", "PASS": "F", "MB": 0}, {"PP": "*", "PASS": "BI", "MB": 0},
                {"PP": "*", "PASS": "BW", "MB": 0}])
  passes = {n.label for n in plan.graph.compute_nodes() if n.pass_.value != "F"}
  assert passes == {"r0BI0", "r0BW0", "r1BI0", "r1BW0", "r0B1", "r1B1"}


def test_dualpipev_needs_enough_microbatches():
  with pytest.raises(ValueError, match="n_microbatches >= 2 \\* n_ranks = 4"):
    pj.schedules.dualpipev(2, 3)


def test_schedules_refuse_degenerate_arguments():
  with pytest.raises(ValueError, match=r"dualpipev needs n_ranks >= 2 .*, got 1; use n_ranks >= 2"):
    pj.schedules.dualpipev(1, 4)
  with pytest.raises(ValueError, match=r"interleaved_1f1b needs n_ranks >= 2 .*, got 1"):
    pj.schedules.interleaved_1f1b(1, 2, 4)
  with pytest.raises(ValueError, match=r"n_virtual >= 2 stages per rank, got 1; use one_f_one_b"):
    pj.schedules.interleaved_1f1b(2, 1, 4)
  with pytest.raises(ValueError, match=r"stage must be an int in 0..1 \(n_stages=2\), got 2"):
    pj.schedules.stage_sequence("1f1b", 2, 2, 4)
  with pytest.raises(ValueError, match="n_microbatches must be an int >= 1, got 0"):
    pj.schedules.stage_sequence("gpipe", 0, 2, 0)


def _sim(n_stages, m, schedule, costs, **kw):
  plan = ir.make_plan(chain_model(n_stages, batch=64), pj.strategies.pipeline(n_stages, m, schedule, **kw),
                      n_devices=64)
  return plan.simulate(costs)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_simulator_1f1b_and_gpipe_formulas(p, m):
  r = _sim(p, m, "1f1b", {"F": 1, "B": 2})
  assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
  assert r.makespan == pytest.approx((m + p - 1) * 3)
  assert r.peak_activations[0] == min(p, m) and r.peak_activations[p - 1] == 1
  g = _sim(p, m, "gpipe", {"F": 1, "B": 2})
  assert g.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
  assert all(v == m for v in g.peak_activations.values())


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_simulator_zero_bubble_h1(p, m):
  # ZB-H1 (Qi et al.): idle per device (p-1)(F+B-W) with B = BI+BW, at 1F1B's memory.
  f, bi, bw = 1, 1, 1
  r = _sim(p, m, "zb", {"F": f, "BI": bi, "BW": bw})
  assert r.makespan == pytest.approx(m * (f + bi + bw) + (p - 1) * (f + bi + bw - bw))
  one = _sim(p, m, "1f1b", {"F": f, "BI": bi, "BW": bw})
  assert r.peak_activations == one.peak_activations
  assert r.makespan < one.makespan


def test_simulator_interleaved_bubble():
  # Megatron: the bubble shrinks by the number of virtual stages.
  p, v, m = 4, 2, 8
  r = _sim(p * v, m, "interleaved", {"F": 1, "B": 2}, n_virtual=v)
  one = _sim(p, m, "1f1b", {"F": 2, "B": 4})  # same work per rank, one stage each
  assert r.makespan < one.makespan
  assert r.makespan == pytest.approx(m * v * 3 + (p - 1) * 3)


def test_simulator_dualpipev():
  # DualPipeV keeps 2*n_ranks + 1 chunk activations at most, and beats 1F1B's bubble.
  n, m = 4, 16
  r = _sim(2 * n, m, "dualpipev", {"F": 1, "B": 2})
  assert max(r.peak_activations.values()) <= 2 * n + 1
  one = _sim(n, m, "1f1b", {"F": 2, "B": 4})
  assert r.bubble_fraction < one.bubble_fraction


@pytest.mark.parametrize("ext", [".svg", ".png", ".html"])
def test_timeline_picture(tmp_path, ext):
  plan = ir.make_plan(chain_model(4, batch=64), pj.strategies.pipeline(4, 4, "zb"), n_devices=4)
  path = plan.timeline(tmp_path / f"plan{ext}")
  data = open(path, "rb").read()
  assert len(data) > 1000
  if ext != ".png":
    assert b"<svg" in data and b"rank 0" in data
  with pytest.raises(ValueError, match="svg, .png or .html"):
    plan.timeline(tmp_path / "plan.jpg")
  if ext == ".svg":  # tick by tick, as the lowering runs it
    ticked = open(plan.timeline(tmp_path / "ticks.svg", ticks=True)).read()
    assert f"{len(plan.ticks)} ticks" in ticked


def test_tick_by_tick_times():
  # Each tick starts when the previous one's busiest rank ends; a rank's tasks in a
  # tick run back to back.
  plan = ir.make_plan(chain_model(2), pj.strategies.pipeline(2, 4, "1f1b"), n_devices=2)
  r = plan.simulate({"F": 1, "B": 2})
  assert (r.tick_start["r0F0"], r.tick_start["r0F1"], r.tick_start["r1F0"]) == (0, 1, 1)
  assert (r.tick_start["r1B0"], r.tick_end["r1B0"], r.tick_start["r0B0"]) == (2, 4, 4)
  assert max(r.tick_end.values()) == r.tick_makespan >= r.makespan


def test_simulate_with_jaxpr_flops():
  params = init_mlp(jax.random.PRNGKey(0), 2)
  from models import optimizer, random_batch
  step = pj.compile(mlp_loss(2), optimizer(), pj.strategies.pipeline(2, 4, "1f1b"), params,
                    random_batch(jax.random.PRNGKey(0), 16))
  r = step.plan.simulate("flops")
  assert r.makespan > 0 and 0 <= r.bubble_fraction < 1
  flops = [r.flops for r in step.plan.model.regions]
  # Per microbatch of 4: region 0 = embedding (2*4*8*16) + stage (2*4*16*16);
  # region 1 = stage + head (2*4*16*5).
  assert flops == [2 * 4 * 8 * 16 + 2 * 4 * 16 * 16, 2 * 4 * 16 * 16 + 2 * 4 * 16 * 5]


def test_plan_for_1024_devices_from_shapes_only():
  import time

  from examples import gpt
  config = gpt.get_config("1.3b", n_stages=8)
  net = gpt.GPT(config)
  params = jax.eval_shape(lambda: gpt.init_params(net, jax.random.PRNGKey(0)))
  batch = jax.eval_shape(lambda: gpt.random_batch(config, jax.random.PRNGKey(0), 2048))
  t0 = time.time()
  plan = pj.plan(gpt.loss_fn(net), pj.strategies.pipeline(8, 16, "1f1b", dp=128, zero=1), params,
                 batch, n_devices=1024)
  report = plan.simulate("flops")
  assert plan.mesh.n_dp == 128 and plan.mesh.n_pp == 8 and report.makespan > 0
  assert time.time() - t0 < 60


def test_dualpipev_f_and_b_pairs_share_a_tick():
  n, m = 2, 8
  plan = ir.make_plan(chain_model(2 * n, batch=64), pj.strategies.pipeline(2 * n, m, "dualpipev"),
                      n_devices=n, check=True)
  groups = {}
  for node in plan.graph.compute_nodes():
    if node.group:
      groups.setdefault((node.group, node.devices), []).append(plan.tasks[node.id].tick)
  pairs = [ticks for ticks in groups.values() if len(ticks) == 2]
  # A pair runs in one tick unless a member waits for a message the other does not
  # (at most the first pair of a rank, while the pipeline fills).
  assert len(pairs) >= 2 * (m - n) and sum(a != b for a, b in pairs) <= n
