"""`verify`: the invariants a graph keeps after each pass (tests run it after every pass)."""

from __future__ import annotations

from piper_jax.ir.errors import PlanError
from piper_jax.ir.graph import DepKind, Graph, NodeKind

__all__ = ["verify"]


def verify(graph: Graph, after: str, placed: bool = False, cut: bool = False) -> Graph:
  """Checks `graph` and names the pass `after` which it broke, else returns it.

  Always: acyclic, every compute node has a pass, a split graph has a microbatch
  on every compute node or none. `placed`: every compute and update node has
  devices and temporal edges stay on one device group. `cut`: no data edge joins
  compute nodes of different groups (they go through SEND/RECV).
  """
  def fail(msg):
    raise PlanError(f"internal error after pass {after!r}: {msg}")

  cycle = graph.find_cycle()
  if cycle:
    fail(f"cycle {' -> '.join(cycle)}")
  computes = graph.compute_nodes()
  if any(n.pass_ is None for n in computes):
    fail("a compute node without a pass")
  if len({n.mb is None for n in computes}) > 1:
    fail("some compute nodes are split into microbatches and some are not")
  if placed:
    for n in graph.nodes.values():
      if n.kind in (NodeKind.COMPUTE, NodeKind.UPDATE) and n.devices is None:
        fail(f"node {n.label} has no devices")
    for e in graph.edges:
      if e.kind is DepKind.TEMPORAL and graph.nodes[e.src].devices != graph.nodes[e.dst].devices:
        fail(f"temporal edge {e.src} -> {e.dst} crosses device groups")
  if cut:
    for e in graph.edges:
      a, b = graph.nodes[e.src], graph.nodes[e.dst]
      if (e.kind is DepKind.DATA and a.kind is NodeKind.COMPUTE and b.kind is NodeKind.COMPUTE
          and a.devices != b.devices):
        fail(f"data edge {e.src} -> {e.dst} crosses device groups without SEND/RECV")
  return graph
