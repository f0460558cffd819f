"""Communication passes: SEND/RECV on cross-device edges, gradient and parameter collectives."""

from __future__ import annotations

from piper_jax.ir.graph import DepKind, Edge, Graph, Node, NodeKind
from piper_jax.ir.mesh import MeshSpec
from piper_jax.ir.model import ModelSpec

__all__ = ["insert_send_recv", "insert_collectives"]


def insert_send_recv(graph: Graph) -> Graph:
  """Cuts every data edge between compute nodes on different device groups.

  Needs: placed nodes. Inserts: `src -> SEND -> RECV -> dst`, the SEND on the
  producer's group and the RECV on the consumer's, both carrying the tensor.
  After: data edges between compute nodes stay within one group.
  """
  nodes, edges = list(graph.nodes.values()), []
  sent: dict[tuple[str, str], int] = {}   # values already cut between a pair of nodes
  for e in graph.edges:
    a, b = graph.nodes[e.src], graph.nodes[e.dst]
    if (e.kind is DepKind.DATA and a.kind is NodeKind.COMPUTE and b.kind is NodeKind.COMPUTE
        and a.devices != b.devices):
      tensors = (e.tensor,) if e.tensor else ()
      # A region may hand the next several values: each its own SEND/RECV pair.
      k = sent[(a.id, b.id)] = sent.get((a.id, b.id), -1) + 1
      name = f"{a.id}>{b.id}" + (f"#{k}" if k else "")
      send = Node(f"send:{name}", NodeKind.SEND, region=a.region, mb=a.mb,
                  devices=a.devices, zero=a.zero, axis="pp", peer=b.devices, tensors=tensors)
      recv = Node(f"recv:{name}", NodeKind.RECV, region=b.region, mb=b.mb,
                  devices=b.devices, zero=b.zero, axis="pp", peer=a.devices, tensors=tensors)
      nodes += [send, recv]
      edges += [Edge(a.id, send.id, tensor=e.tensor), Edge(send.id, recv.id, tensor=e.tensor),
                Edge(recv.id, b.id, tensor=e.tensor)]
    else:
      edges.append(e)
  return Graph(nodes, edges)


def insert_collectives(graph: Graph, model: ModelSpec, mesh: MeshSpec) -> Graph:
  """Adds the data-parallel and tied-parameter collectives of the plan.

  ZeRO-0: one ALL_REDUCE of a region's gradients over "dp" before its UPDATE.
  ZeRO-1: one REDUCE_SCATTER before UPDATE, an ALL_GATHER of parameters after.
  ZeRO-2: a REDUCE_SCATTER per microbatch, an ALL_GATHER after UPDATE.
  ZeRO-3: an ALL_GATHER of parameters before every F and B, a REDUCE_SCATTER per
  microbatch. A pipeline's ZeRO-2/3 communicate as its ZeRO-1 (the lowering sums a
  stage's gradients whole and reduce-scatters them once; ZeRO-3 gathers the weights
  as the step starts, after the previous update). Parameters read on several pipeline
  ranks get an ALL_REDUCE of their gradients over "pp". Expert parameters (shard) are
  all-reduced only over the copies of their expert group, with no ZeRO.
  """
  nodes, edges = list(graph.nodes.values()), list(graph.edges)
  by_region: dict[int, list[Node]] = {}
  for n in graph.compute_nodes():
    by_region.setdefault(n.region, []).append(n)
  for r in model.regions:
    upd = graph.nodes[f"upd{r.index}"]
    params = upd.tensors
    axes, replicas = mesh.copies(mesh.sharded.get(r.index))
    zero = (0 if mesh.sharded.get(r.index) == "ep" else
            min(mesh.zero, 1) if mesh.n_pp > 1 else mesh.zero)
    axis = "+".join(axes)
    if replicas > 1 and params:
      backs = [n for n in by_region[r.index] if n.pass_.value != "F"]
      common = dict(region=r.index, tags=r.tags, devices=upd.devices, zero=zero, axis=axis,
                    tensors=params)
      if zero in (0, 1):
        kind = NodeKind.ALL_REDUCE if zero == 0 else NodeKind.REDUCE_SCATTER
        red = Node(f"{'ar' if zero == 0 else 'rs'}:r{r.index}", kind, **common)
        nodes.append(red)
        edges += [Edge(b.id, red.id) for b in backs] + [Edge(red.id, upd.id)]
      else:
        for b in backs:
          red = Node(f"rs:{b.id}", NodeKind.REDUCE_SCATTER, mb=b.mb, **common)
          nodes.append(red)
          edges += [Edge(b.id, red.id), Edge(red.id, upd.id)]
      if zero in (1, 2):
        ag = Node(f"ag:r{r.index}", NodeKind.ALL_GATHER, **common)
        nodes.append(ag)
        edges.append(Edge(upd.id, ag.id))
      if zero == 3:
        for c in by_region[r.index]:
          ag = Node(f"ag:{c.id}", NodeKind.ALL_GATHER, mb=c.mb, **common)
          nodes.append(ag)
          edges.append(Edge(ag.id, c.id))
  tied = {p: users for p, users in model.param_users().items()
          if len({mesh.region_rank[u] for u in users}) > 1}
  if tied:
    users = sorted({u for us in tied.values() for u in us})
    ar = Node("ar:tied", NodeKind.ALL_REDUCE, axis="pp",
              tensors=tuple(model.params[p] for p in sorted(tied)))
    nodes.append(ar)
    for n in graph.compute_nodes():
      if n.region in users and n.pass_.value != "F":
        edges.append(Edge(n.id, ar.id))
    edges += [Edge(ar.id, f"upd{u}") for u in users]
  return Graph(nodes, edges)
