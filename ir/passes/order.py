"""`apply_order`: temporal edges from `order` directives, rejecting cycles."""

from __future__ import annotations

from typing import Mapping, Sequence

from piper_jax.ir.directives import Filter, Order
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.filters import select
from piper_jax.ir.graph import DepKind, Edge, Graph, NodeKind

__all__ = ["apply_order"]


def apply_order(graph: Graph, directives: Sequence[tuple[int, Order]]) -> Graph:
  """Adds a temporal edge from each node of group i to each node of group i+1 on its devices.

  Needs: placed nodes. Groups match compute nodes; an order between groups that
  share no device cannot be kept and is an error, as is an edge that closes a cycle.
  The members of a group of several filters on one device get a shared `group`
  name, so that the plan runs them in one tick (DualPipe's overlapped F&B).
  After: the graph is acyclic and each temporal edge stays on one device group.
  """
  if not directives:
    return graph
  # Orders change no node's tags, so each filter is matched once, on the graph as it comes.
  matched = {f: [n.id for n in select(graph, f, kinds=(NodeKind.COMPUTE,))]
             for _, d in directives for g in d.groups for f in g}
  added: list[tuple[int, Order, list[Edge]]] = []
  for index, d in directives:
    try:
      graph, edges = _order_edges(graph, index, d, matched)
    except DirectiveError:
      # An earlier directive that closes a cycle fails first, as when each is checked in turn.
      _raise_first_cycle(graph, added)
      raise
    added.append((index, d, edges))
  ordered = graph.replace(edges=graph.edges + tuple(e for _, _, edges in added for e in edges))
  # An acyclic graph has no cycle in any part of it, so one check clears every directive.
  if ordered.find_cycle():
    _raise_first_cycle(graph, added)
  return ordered


def _order_edges(graph: Graph, index: int, d: Order,
                 matched: Mapping[Filter, list[str]]) -> tuple[Graph, list[Edge]]:
  """The temporal edges of one order directive, and `graph` with its group names set."""
  groups = []
  for gi, g in enumerate(d.groups):
    ids = dict.fromkeys(i for f in g for i in matched[f])
    if not ids:
      raise DirectiveError(f"group {gi} matches no F/B node", index, d)
    groups.append([graph.nodes[i] for i in ids])
  seen: dict[str, int] = {}  # node id -> the first group naming it
  for gi, nodes in enumerate(groups):
    for n in nodes:
      if seen.setdefault(n.id, gi) != gi:
        raise DirectiveError(f"names {n.label} in groups {seen[n.id]} and {gi}; an order "
                             f"names each node once, in the group where it runs", index, d)
  members = {}
  for gi, (g, nodes) in enumerate(zip(d.groups, groups)):
    if len(g) > 1:
      for n in nodes:
        members.setdefault((gi, n.devices), []).append(n)
  named = {n.id: n.replace(group=f"o{index}.{gi}")
           for (gi, _), ns in members.items() if len(ns) > 1 for n in ns}
  if named:
    graph = graph.with_nodes(named)
    groups = [[graph.nodes[n.id] for n in nodes] for nodes in groups]
  new = []
  for gi, (a_nodes, b_nodes) in enumerate(zip(groups, groups[1:])):
    pairs = [(a, b) for a in a_nodes for b in b_nodes if a.devices == b.devices and a.id != b.id]
    if not pairs:
      a, b = a_nodes[0], b_nodes[0]
      raise DirectiveError(
          f"orders group {gi} ({a.label} on devices {list(a.devices)}) before group {gi + 1} "
          f"({b.label} on devices {list(b.devices)}), but they share no device: an order "
          f"across devices cannot be kept; order nodes of one device group", index, d)
    new += [Edge(a.id, b.id, DepKind.TEMPORAL) for a, b in pairs]
  return graph, new


def _raise_first_cycle(graph: Graph, added: Sequence[tuple[int, Order, list[Edge]]]) -> None:
  """Raises for the first directive whose edges, with those of earlier ones, close a cycle."""
  edges = graph.edges
  for index, d, new in added:
    edges += tuple(new)
    cycle = graph.replace(edges=edges).find_cycle()
    if cycle:
      labels = " -> ".join(graph.nodes[i].label for i in cycle)
      raise DirectiveError(f"creates a cycle {labels}; reorder the groups so that every data "
                           f"dependency (F before B, producer before consumer) is kept",
                           index, d)
