"""`split_backward`: B -> BI (input cotangents) + BW (weight gradients), for zero-bubble orders."""

from __future__ import annotations

from piper_jax.ir.build import compute_id
from piper_jax.ir.graph import Edge, Graph, NodeKind, Pass

__all__ = ["split_backward"]


def split_backward(graph: Graph) -> Graph:
  """Replaces every B node by BI and BW.

  Needs: a split graph. Inserts: BI takes B's incoming cotangents and sends B's
  outgoing ones; BW reads F's residuals and what BI leaves for it (edge BI -> BW)
  and feeds the UPDATE. After: no B node; BW never precedes its BI.
  """
  nodes, rename = [], {}
  for n in graph.nodes.values():
    if n.kind is NodeKind.COMPUTE and n.pass_ is Pass.B:
      bi = n.replace(id=compute_id(n.region, Pass.BI, n.mb), pass_=Pass.BI)
      bw = n.replace(id=compute_id(n.region, Pass.BW, n.mb), pass_=Pass.BW)
      nodes += [bi, bw]
      rename[n.id] = (bi.id, bw.id)
    else:
      nodes.append(n)
  edges = []
  for e in graph.edges:
    src, dst = e.src, e.dst
    if src in rename and graph.nodes[dst].kind is NodeKind.UPDATE:
      edges.append(Edge(rename[src][1], dst, e.kind, e.tensor))
      continue
    if dst in rename and graph.nodes[src].kind is NodeKind.COMPUTE and graph.nodes[src].pass_ is Pass.F:
      edges.append(Edge(src, rename[dst][0], e.kind, e.tensor))
      edges.append(Edge(src, rename[dst][1], e.kind, e.tensor))
      continue
    src = rename[src][0] if src in rename else src
    dst = rename[dst][0] if dst in rename else dst
    edges.append(Edge(src, dst, e.kind, e.tensor))
  for bi, bw in rename.values():
    edges.append(Edge(bi, bw))
  return Graph(nodes, edges)
