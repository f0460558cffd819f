"""The global training DAG: typed nodes and edges, and the graph that holds them."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import AbstractSet, Iterable, Mapping

__all__ = ["NodeKind", "Pass", "DepKind", "TensorSpec", "Node", "Edge", "Graph"]


class NodeKind(enum.Enum):
  COMPUTE = "compute"
  SEND = "send"
  RECV = "recv"
  ALL_REDUCE = "all_reduce"
  REDUCE_SCATTER = "reduce_scatter"
  ALL_GATHER = "all_gather"
  ALL_TO_ALL = "all_to_all"
  UPDATE = "update"


class Pass(enum.Enum):
  F = "F"
  B = "B"
  BI = "BI"
  BW = "BW"


class DepKind(enum.Enum):
  DATA = "data"
  TEMPORAL = "temporal"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """An abstract tensor: a name, a shape and a dtype name (no device, no data).

  `names` are a parameter's per-dimension partitioning names (Flax
  `nn.with_partitioning`), which `shard_tensor` reads; None when it has none.
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  names: tuple[str | None, ...] | None = None

  @property
  def size(self) -> int:
    n = 1
    for d in self.shape:
      n *= d
    return n

  @property
  def nbytes(self) -> int:
    itemsize = {"bool": 1, "int8": 1, "uint8": 1, "bfloat16": 2, "float16": 2, "int16": 2,
                "float32": 4, "int32": 4, "uint32": 4, "float64": 8, "int64": 8}.get(self.dtype, 4)
    return self.size * itemsize

  def to_json(self) -> dict:
    out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
    if self.names is not None:
      out["names"] = list(self.names)
    return out


@dataclasses.dataclass(frozen=True)
class Node:
  """One step of the training DAG on one device group.

  Compute nodes carry `region`, `pass_` and (after split) `mb`; communication
  nodes carry the `axis` they run over and, for SEND/RECV, the `peer` group.
  `devices` is the device group (set by place/replicate), `zero` its ZeRO stage.
  `group` names an order group of several filters the node belongs to: its members
  on one device may run together (DualPipe's F&B). `shard` is ("ep" | "tp", n) on
  the compute nodes of a region split n ways by shard / shard_tensor.
  """

  id: str
  kind: NodeKind
  region: int | None = None
  tags: tuple[tuple[str, int], ...] = ()
  pass_: Pass | None = None
  mb: int | None = None
  devices: tuple[int, ...] | None = None
  zero: int = 0
  axis: str | None = None
  peer: tuple[int, ...] | None = None
  tensors: tuple[TensorSpec, ...] = ()
  group: str | None = None
  shard: tuple[str, int] | None = None

  def replace(self, **changes) -> "Node":
    return dataclasses.replace(self, **changes)

  def tag_values(self) -> dict[str, int | str]:
    """The values a filter is matched against: region tags, MB and PASS."""
    out: dict[str, int | str] = dict(self.tags)
    if self.mb is not None:
      out["MB"] = self.mb
    if self.pass_ is not None:
      out["PASS"] = self.pass_.value
    return out

  @property
  def label(self) -> str:
    """Compact name: 'r1F3' = region 1, forward, microbatch 3."""
    if self.kind is NodeKind.COMPUTE:
      return f"r{self.region}{self.pass_.value}{'' if self.mb is None else self.mb}"
    return self.id

  def to_json(self) -> dict:
    out = {"id": self.id, "kind": self.kind.value}
    for key in ("region", "mb", "axis"):
      if getattr(self, key) is not None:
        out[key] = getattr(self, key)
    if self.tags:
      out["tags"] = dict(self.tags)
    if self.pass_ is not None:
      out["pass"] = self.pass_.value
    if self.devices is not None:
      out["devices"] = list(self.devices)
      out["zero"] = self.zero
    if self.peer is not None:
      out["peer"] = list(self.peer)
    if self.shard is not None:
      out["shard"] = list(self.shard)
    if self.tensors:
      out["tensors"] = [t.to_json() for t in self.tensors]
    return out


@dataclasses.dataclass(frozen=True)
class Edge:
  src: str
  dst: str
  kind: DepKind = DepKind.DATA
  tensor: TensorSpec | None = None

  def to_json(self) -> dict:
    out = {"src": self.src, "dst": self.dst, "kind": self.kind.value}
    if self.tensor is not None:
      out["tensor"] = self.tensor.to_json()
    return out


class Graph:
  """An immutable DAG of `Node`s and `Edge`s; passes build new graphs with `replace`."""

  def __init__(self, nodes: Iterable[Node], edges: Iterable[Edge]):
    self.nodes: dict[str, Node] = {}
    for n in nodes:
      if n.id in self.nodes:
        raise ValueError(f"duplicate node id {n.id!r}")
      self.nodes[n.id] = n
    self.edges: tuple[Edge, ...] = tuple(edges)
    self.succ: dict[str, list[Edge]] = {i: [] for i in self.nodes}
    self.pred: dict[str, list[Edge]] = {i: [] for i in self.nodes}
    for e in self.edges:
      if e.src not in self.nodes or e.dst not in self.nodes:
        raise ValueError(f"edge {e.src}->{e.dst} names a missing node")
      self.succ[e.src].append(e)
      self.pred[e.dst].append(e)

  def replace(self, nodes: Iterable[Node] | None = None, edges: Iterable[Edge] | None = None) -> "Graph":
    return Graph(self.nodes.values() if nodes is None else nodes,
                 self.edges if edges is None else edges)

  def with_nodes(self, updated: Mapping[str, Node]) -> "Graph":
    """A graph with some nodes replaced by id."""
    return self.replace(nodes=[updated.get(i, n) for i, n in self.nodes.items()])

  def tagged(self, tag: str, value: int | str) -> AbstractSet[str]:
    """Ids of the nodes whose `tag_values()` give `tag` the value `value` ("*": any value)."""
    return self._by_tag.get((tag, value), frozenset())

  @functools.cached_property
  def _by_tag(self) -> dict[tuple[str, int | str], set[str]]:
    # Built once per graph on first use, so that a filter intersects a few sets instead
    # of matching every node; nodes never change after construction. No node tag
    # value is "*", so (tag, "*") can hold the nodes that carry the tag at all.
    index: dict[tuple[str, int | str], set[str]] = {}
    for n in self.nodes.values():
      for tag, value in n.tag_values().items():
        index.setdefault((tag, value), set()).add(n.id)
        index.setdefault((tag, "*"), set()).add(n.id)
    return index

  @functools.cached_property
  def position(self) -> dict[str, int]:
    """Each node id's place in `nodes`, the graph order."""
    return {i: k for k, i in enumerate(self.nodes)}

  def compute_nodes(self) -> list[Node]:
    return [n for n in self.nodes.values() if n.kind is NodeKind.COMPUTE]

  def find_cycle(self) -> list[str] | None:
    """A cycle as a list of node ids, or None when the graph is acyclic."""
    color = {i: 0 for i in self.nodes}
    parent: dict[str, str] = {}
    for root in self.nodes:
      if color[root]:
        continue
      stack = [(root, iter(self.succ[root]))]
      color[root] = 1
      while stack:
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
          color[node] = 2
          stack.pop()
          continue
        d = nxt.dst
        if color[d] == 1:
          path, cur = [node], node
          while cur != d:
            cur = parent[cur]
            path.append(cur)
          return path[::-1] + [d]
        if color[d] == 0:
          color[d] = 1
          parent[d] = node
          stack.append((d, iter(self.succ[d])))
    return None

  def to_json(self) -> dict:
    return {"nodes": [n.to_json() for n in self.nodes.values()],
            "edges": [e.to_json() for e in self.edges]}

  def to_dot(self) -> str:
    """Graphviz DOT: one cluster per device group, temporal edges dashed."""
    groups: dict[tuple, list[Node]] = {}
    for n in self.nodes.values():
      groups.setdefault(n.devices or (), []).append(n)
    lines = ["digraph piper {", "  rankdir=LR;", "  node [shape=box, fontsize=10];"]
    for gi, (devs, ns) in enumerate(groups.items()):
      lines.append(f"  subgraph cluster_{gi} {{")
      lines.append(f'    label="devices {list(devs)}";' if devs else '    label="unplaced";')
      for n in ns:
        shape = "box" if n.kind is NodeKind.COMPUTE else "ellipse"
        lines.append(f'    "{n.id}" [label="{n.label}", shape={shape}];')
      lines.append("  }")
    for e in self.edges:
      style = "dashed" if e.kind is DepKind.TEMPORAL else "solid"
      lines.append(f'  "{e.src}" -> "{e.dst}" [style={style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"

  def __len__(self):
    return len(self.nodes)
