"""`split_microbatches`: one F and one B node per region and microbatch."""

from __future__ import annotations

from piper_jax.ir.build import compute_id
from piper_jax.ir.graph import Edge, Graph, NodeKind

__all__ = ["split_microbatches"]


def split_microbatches(graph: Graph, num_microbatches: int) -> Graph:
  """Copies every compute node per microbatch (tag MB) and every edge between them.

  Needs: an unsplit graph from `build_graph`. Inserts: F/B nodes `r{i}F{m}`; edges
  between compute nodes are copied per microbatch, edges into UPDATE come from
  every microbatch. After: no compute node without `mb`.
  """
  nodes, edges = [], []
  for n in graph.nodes.values():
    if n.kind is NodeKind.COMPUTE:
      nodes += [n.replace(id=compute_id(n.region, n.pass_, m), mb=m) for m in range(num_microbatches)]
    else:
      nodes.append(n)
  kind = {i: n.kind for i, n in graph.nodes.items()}
  for e in graph.edges:
    src_c, dst_c = kind[e.src] is NodeKind.COMPUTE, kind[e.dst] is NodeKind.COMPUTE
    for m in range(num_microbatches):
      src = f"{e.src}{m}" if src_c else e.src
      dst = f"{e.dst}{m}" if dst_c else e.dst
      edges.append(Edge(src, dst, e.kind, e.tensor))
      if not (src_c or dst_c):
        break
  return Graph(nodes, edges)
