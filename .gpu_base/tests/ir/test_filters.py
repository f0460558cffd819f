"""Filters: the tag index gives what matching every node gives; orders report the first cycle."""

import pytest

import piper_jax as pj
from piper_jax import ir
from piper_jax.ir import NodeKind
from piper_jax.ir.build import build_graph
from piper_jax.ir.directives import Order, freeze_filter
from piper_jax.ir.filters import matches, select
from piper_jax.ir.passes import split_microbatches
from piper_jax.ir.pipeline import place_graph

from ir.test_passes import chain_model

pytestmark = pytest.mark.timeout(60)

KINDS = [(NodeKind.COMPUTE,), (NodeKind.COMPUTE, NodeKind.UPDATE), tuple(NodeKind)]
# Beyond the directives' own: every value of a tag, a PASS no node has before the
# BI/BW split, values and tags no node carries.
EXTRA_FILTERS = [{}, {"PP": "*"}, {"MB": "*"}, {"PASS": "*"}, {"PASS": "BI"}, {"PP": 99},
                 {"MB": 1, "PP": "*"}, {"MB": "*", "PASS": "BW", "PP": 2}, {"EP": 0}, {"EP": "*"}]


def _scan(graph, f, kinds):
  """`select` as the definition reads: every node of `kinds`, kept when `f` matches it."""
  return [n for n in graph.nodes.values() if n.kind in kinds and matches(f, n)]


def _filters(directives):
  """Every filter of `directives`, and each with PASS "B" as the BI/BW split looks them up."""
  out = []
  for d in directives:
    fs = [f for g in d.groups for f in g] if isinstance(d, Order) else [d.filter]
    out += fs + [tuple((t, "B" if t == "PASS" else v) for t, v in f) for f in fs]
  return list(dict.fromkeys(out + [freeze_filter(f) for f in EXTRA_FILTERS]))


@pytest.mark.parametrize("schedule,n_stages", [("1f1b", 4), ("interleaved", 8), ("zb", 4)])
def test_select_gives_what_a_scan_of_every_node_gives(schedule, n_stages):
  # PP4 x DP2 with 8 microbatches; interleaved holds two stages per rank.
  model = chain_model(n_stages, batch=64, tied=True)
  directives = pj.strategies.pipeline(n_stages, 8, schedule, dp=2, zero=1)
  plan = ir.make_plan(model, directives, n_devices=8)
  assert plan.mesh.n_pp == 4 and plan.mesh.n_dp == 2
  graphs = {"split": split_microbatches(build_graph(model), 8),
            "placed": place_graph(model, directives, n_devices=8).graph,
            "planned": plan.graph}
  if schedule == "zb":
    assert any(n.pass_ is ir.Pass.BI for n in graphs["placed"].nodes.values())
  filters = _filters(directives)
  assert len(filters) > 8 * 2 * n_stages  # an order filter per pass and microbatch of each stage
  found = 0
  for name, graph in graphs.items():
    for f in filters:
      for kinds in KINDS:
        got = select(graph, f, kinds=kinds)
        assert got == _scan(graph, f, kinds), (name, dict(f), kinds)
        found += bool(got)
  assert found > len(filters)  # most filters match nodes: the comparison is not of empty lists


def _two_rank_plan(*orders):
  directives = [pj.split(2), pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [1])]
  return ir.make_plan(chain_model(2), directives + [pj.order(o) for o in orders], n_devices=2)


def _f(pp, pass_, mb):
  return {"PP": pp, "PASS": pass_, "MB": mb}


def test_order_names_the_first_directive_that_closes_a_cycle():
  backwards_first = [_f(0, "B", 0), _f(0, "F", 0)]
  across_devices = [_f(1, "F", 0), _f(0, "B", 0)]
  # A cycle is reported before the error of a later directive ...
  with pytest.raises(pj.DirectiveError, match=r"^directive 3 .*a cycle r0F0 -> r0B0 -> r0F0;"):
    _two_rank_plan(backwards_first, across_devices)
  # ... and an error before a cycle before the cycle.
  with pytest.raises(pj.DirectiveError, match=r"^directive 3 .*share no device"):
    _two_rank_plan(across_devices, backwards_first)
  # A cycle that only the second directive closes names the second.
  one_f_one_b = [_f(0, "F", 0), _f(0, "F", 1), _f(0, "B", 0), _f(0, "B", 1)]
  b1_before_f1 = [_f(0, "B", 1), _f(0, "F", 1)]
  with pytest.raises(pj.DirectiveError, match=r"^directive 4 .*creates a cycle"):
    _two_rank_plan(one_f_one_b, b1_before_f1)
  plan = _two_rank_plan(one_f_one_b)
  assert [t.label for tick in plan.ticks for t in tick[0]] == ["r0F0", "r0F1", "r0B0", "r0B1"]
