"""IR passes on tiny hand-built models: no JAX tracing, no devices."""

import pytest

from piper_jax import ir
from piper_jax.ir import NodeKind, Pass, TensorSpec
from piper_jax.ir.build import build_graph
from piper_jax.ir.passes import split_microbatches
from piper_jax.ir.pipeline import place_graph

pytestmark = pytest.mark.timeout(60)


def chain_model(n_regions=2, batch=8, tied=False):
  """A chain of regions: r0 -> r1 -> ...; param i belongs to region i (param 0 also last if tied)."""
  act = TensorSpec("act", (batch, 4), "float32")
  regions = []
  for i in range(n_regions):
    params = (i,) + ((0,) if tied and i == n_regions - 1 and i else ())
    inputs = (ir.ActivationRef(i - 1, 0, act),) if i else ()
    outputs = (act,) if i < n_regions - 1 else (TensorSpec("loss", (), "float32"),)
    regions.append(ir.RegionSpec(i, (("PP", i),), params, (0,) if i == 0 else (), inputs, outputs,
                                 produces_loss=i == n_regions - 1, flops=1.0))
  params = tuple(TensorSpec(f"w{i}", (4, 4), "float32") for i in range(n_regions))
  return ir.ModelSpec(tuple(regions), params, (TensorSpec("x", (batch, 4), "float32"),), batch)


def test_build_graph_has_f_b_update_and_edges():
  g = build_graph(chain_model(3))
  kinds = [n.kind for n in g.nodes.values()]
  assert kinds.count(NodeKind.COMPUTE) == 6 and kinds.count(NodeKind.UPDATE) == 3
  assert ("r0F", "r1F") in {(e.src, e.dst) for e in g.edges}
  assert ("r1B", "r0B") in {(e.src, e.dst) for e in g.edges}
  assert g.find_cycle() is None


def test_split_copies_nodes_per_microbatch():
  g = split_microbatches(build_graph(chain_model(2)), 3)
  assert {n.id for n in g.compute_nodes()} == {f"r{r}{p}{m}" for r in (0, 1) for p in "FB"
                                              for m in range(3)}
  assert ("r0F2", "r1F2") in {(e.src, e.dst) for e in g.edges}
  assert sum(1 for e in g.edges if e.dst == "upd0") == 3


def test_split_backward_splits_only_the_named_keys():
  from piper_jax.ir.passes import split_backward
  g = split_microbatches(build_graph(chain_model(2)), 2)
  g = split_backward(g, {(1, 0), (0, 1)})
  ids = {n.id for n in g.compute_nodes() if n.pass_ is not Pass.F}
  assert ids == {"r1BI0", "r1BW0", "r0B0", "r0BI1", "r0BW1", "r1B1"}
  edges = {(e.src, e.dst) for e in g.edges}
  # A split backward sends its cotangent from BI to a fused B, and a fused B to a BI.
  assert {("r1BI0", "r0B0"), ("r1B1", "r0BI1"), ("r0BI1", "r0BW1"), ("r0BW1", "upd0"),
          ("r0B0", "upd0"), ("r1F0", "r1BW0")} <= edges
  assert g.find_cycle() is None


def test_pipeline_plan_inserts_send_recv_and_1f1b_ticks():
  import piper_jax as pj
  plan = ir.make_plan(chain_model(2), pj.strategies.pipeline(2, 4, "1f1b"), n_devices=2)
  kinds = [n.kind for n in plan.graph.nodes.values()]
  assert kinds.count(NodeKind.SEND) == 8 and kinds.count(NodeKind.RECV) == 8
  seq = [t.label for tick in plan.ticks for t in tick[1]]
  assert seq == ["r1F0", "r1B0", "r1F1", "r1B1", "r1F2", "r1B2", "r1F3", "r1B3"]
  # Rank 1 never holds more than one microbatch's activations under 1F1B.
  assert "r1F0" in str(plan) and "send" in str(plan)


def test_ticks_as_long_as_the_busiest_rank():
  # Ticks end in a collective every rank waits on, so a tick lasts as long as its
  # busiest rank. ZB-H1's BI and BW of a microbatch share a tick with the next F, as
  # 1F1B's B does (F alone on one rank beside BI + BW on the other wasted a third), and
  # tasks move to later ticks where their rank waits anyway.
  import piper_jax as pj
  plans = {s: ir.make_plan(chain_model(2), pj.strategies.pipeline(2, 8, s), n_devices=2)
           for s in ("1f1b", "zb")}
  reports = {s: p.simulate({"F": 1, "BI": 1, "BW": 1}) for s, p in plans.items()}
  assert len(plans["zb"].ticks) == len(plans["1f1b"].ticks) == 10
  assert [t.label for t in plans["zb"].ticks[3][1]] == ["r1F2", "r1BI2", "r1BW2"]
  # The second warm-up F waits a tick, beside the last rank's first F and B:
  # F | F, F B | 7 x (B F, F B) | B, as long as the steps the event simulation finds.
  assert [[t.label for t in ts] for ts in plans["1f1b"].ticks[1]] == [["r0F1"], ["r1F0", "r1B0"]]
  for r in reports.values():
    assert r.tick_makespan == 1 + 3 + 7 * 3 + 2 == reports["1f1b"].makespan
  # A message costs "comm" once per tick that sends one: all but the last tick here.
  assert plans["1f1b"].simulate({"F": 1, "B": 2, "comm": 0.5}).tick_makespan == 27 + 9 * 0.5


def test_replicate_inserts_collectives_by_zero_stage():
  import piper_jax as pj
  model = chain_model(2, batch=16)
  counts = {}
  for zero in range(4):
    plan = ir.make_plan(model, pj.strategies.pipeline(2, 2, dp=2, zero=zero), n_devices=4)
    counts[zero] = {k: sum(1 for n in plan.graph.nodes.values() if n.kind is k)
                    for k in (NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER)}
  assert counts[0][NodeKind.ALL_REDUCE] == 2
  assert counts[1][NodeKind.REDUCE_SCATTER] == 2 and counts[1][NodeKind.ALL_GATHER] == 2
  # A pipeline's ZeRO-2/3 reduce-scatter once and gather once, as its ZeRO-1.
  assert counts[2] == counts[3] == counts[1]
  # Without a pipeline: a reduce-scatter per microbatch, ZeRO-3 a gather per F and B.
  for zero in (2, 3):
    plan = ir.make_plan(model, [pj.split(2)] + pj.strategies.data_parallel(2, zero=zero),
                        n_devices=2)
    counts[zero] = {k: sum(1 for n in plan.graph.nodes.values() if n.kind is k)
                    for k in (NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER)}
  assert counts[2][NodeKind.REDUCE_SCATTER] == 4 and counts[2][NodeKind.ALL_GATHER] == 2
  assert counts[3][NodeKind.ALL_GATHER] == 8 and counts[3][NodeKind.REDUCE_SCATTER] == 4


def test_tied_parameter_gets_pipeline_all_reduce():
  import piper_jax as pj
  plan = ir.make_plan(chain_model(2, tied=True), pj.strategies.pipeline(2, 2), n_devices=2)
  ar = plan.graph.nodes["ar:tied"]
  assert ar.axis == "pp" and ar.tensors[0].name == "w0"


def test_plan_exports_json_and_dot():
  import json

  import piper_jax as pj
  plan = ir.make_plan(chain_model(2), pj.strategies.pipeline(2, 2), n_devices=2)
  data = json.loads(plan.to_json_str())
  assert data["mesh"]["groups"] == [[0], [1]] and data["ticks"]
  dot = plan.to_dot()
  assert dot.startswith("digraph") and '"r0F0" -> "send:r0F0>r1F0"' in dot


def test_cycle_detection():
  g = ir.Graph([ir.Node("a", NodeKind.COMPUTE, 0, pass_=Pass.F),
                ir.Node("b", NodeKind.COMPUTE, 0, pass_=Pass.B)],
               [ir.Edge("a", "b"), ir.Edge("b", "a", ir.DepKind.TEMPORAL)])
  assert g.find_cycle() in (["a", "b", "a"], ["b", "a", "b"])


def test_plans_for_many_devices_without_devices():
  import time

  import piper_jax as pj
  t0 = time.time()
  plan = ir.make_plan(chain_model(8, batch=1024), pj.strategies.pipeline(8, 8, dp=128, zero=1),
                      n_devices=1024)
  assert plan.mesh.n_dp == 128 and plan.mesh.n_pp == 8
  assert time.time() - t0 < 30


@pytest.mark.parametrize("schedule,n_stages", [("gpipe", 2), ("1f1b", 4), ("zb", 4),
                                                ("interleaved", 4), ("dualpipev", 4)])
@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 1), (2, 3)])
def test_every_pass_keeps_the_invariants(schedule, n_stages, dp, zero):
  import piper_jax as pj
  plan = ir.make_plan(chain_model(n_stages, batch=64, tied=True),
                      pj.strategies.pipeline(n_stages, 4, schedule, dp=dp, zero=zero),
                      n_devices=16, check=True)
  assert plan.ticks


def test_verify_names_the_pass():
  from piper_jax.ir.verify import verify
  g = ir.Graph([ir.Node("a", NodeKind.COMPUTE, 0, pass_=Pass.F)], [])
  with pytest.raises(ir.PlanError, match="after pass 'place_nodes': node r0F has no devices"):
    verify(g, "place_nodes", placed=True)


def test_a_later_place_overrides_an_earlier_one_where_both_match():
  # A placement of everything, then its exceptions (documented in the guide).
  placed = place_graph(chain_model(3), [ir.place({}, [0]), ir.place({"PP": 1}, [1])], n_devices=2)
  devices = {n.region: n.devices for n in placed.graph.nodes.values() if n.region is not None}
  assert devices == {0: (0,), 1: (1,), 2: (0,)}
