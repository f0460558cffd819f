"""Builds the global training DAG of a model: F and B per region, one UPDATE per region."""

from __future__ import annotations

from piper_jax.ir.graph import Edge, Graph, Node, NodeKind, Pass
from piper_jax.ir.model import ModelSpec

__all__ = ["build_graph", "compute_id", "update_id"]


def compute_id(region: int, pass_: Pass, mb: int | None = None) -> str:
  return f"r{region}{pass_.value}" + ("" if mb is None else str(mb))


def update_id(region: int) -> str:
  return f"upd{region}"


def build_graph(model: ModelSpec) -> Graph:
  """The unsplit training DAG: F(r) -> F(consumers), B(consumers) -> B(r), B(r) -> UPD(r).

  Data edges carry the tensor they move; F(r) -> B(r) carries the residuals.
  """
  nodes, edges = [], []
  for r in model.regions:
    for p in (Pass.F, Pass.B):
      nodes.append(Node(compute_id(r.index, p), NodeKind.COMPUTE, region=r.index, tags=r.tags,
                        pass_=p))
    nodes.append(Node(update_id(r.index), NodeKind.UPDATE, region=r.index, tags=r.tags,
                      tensors=tuple(model.params[i] for i in r.params)))
    edges.append(Edge(compute_id(r.index, Pass.F), compute_id(r.index, Pass.B)))
    edges.append(Edge(compute_id(r.index, Pass.B), update_id(r.index)))
    for ref in r.inputs:
      edges.append(Edge(compute_id(ref.region, Pass.F), compute_id(r.index, Pass.F), tensor=ref.spec))
      if ref.differentiable:
        edges.append(Edge(compute_id(r.index, Pass.B), compute_id(ref.region, Pass.B),
                          tensor=ref.spec))
  return Graph(nodes, edges)
