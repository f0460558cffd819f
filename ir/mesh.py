"""The device mesh a placed graph implies: pipeline ranks x data-parallel replicas."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from piper_jax.ir.directives import Directive
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.graph import Graph, NodeKind

__all__ = ["MeshSpec", "derive_mesh"]


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Ranks along the pipeline axis, each a group of `n_dp` devices (the DP axis).

  `groups[i][j]` is the device of pipeline rank i and data-parallel replica j,
  so the device mesh is `groups` transposed, with axes ("dp", "pp").
  """

  groups: tuple[tuple[int, ...], ...]
  region_rank: Mapping[int, int]
  zero: int
  # Devices of a shard ("ep") / shard_tensor ("tp") group, for the kinds the plan uses.
  inner: Mapping[str, int] = dataclasses.field(default_factory=dict)
  sharded: Mapping[int, str] = dataclasses.field(default_factory=dict)  # region -> kind
  # region -> {parameter leaf: the dimension split over the region's inner axis}
  split_dims: Mapping[int, Mapping[int, int]] = dataclasses.field(default_factory=dict)

  @property
  def n_pp(self) -> int:
    return len(self.groups)

  @property
  def n_dp(self) -> int:
    """Devices per pipeline rank (data-parallel replicas times the inner groups)."""
    return len(self.groups[0])

  def size(self, kind: str) -> int:
    """Devices of a `kind` ("ep" or "tp") group; 1 when the plan has none."""
    return self.inner.get(kind, 1)

  @property
  def n_data(self) -> int:
    """Ways the batch is split per rank: tensor-parallel devices share their rows."""
    return self.n_dp // self.size("tp")

  @property
  def axis_names(self) -> tuple[str, ...]:
    """The device mesh's axes: ("dp", ["ep",] ["tp",] "pp")."""
    return ("dp",) + tuple(k for k in _INNER if k in self.inner) + ("pp",)

  @property
  def data_axes(self) -> tuple[str, ...]:
    """Axes the batch is split over and replicated parameters are reduced over."""
    return ("dp", "ep") if "ep" in self.inner else ("dp",)

  def copies(self, kind: str | None) -> tuple[tuple[str, ...], int]:
    """The axes over which a parameter is copied, and how many copies there are.

    Whole parameters and tensor-parallel pieces: the data axes. Expert pieces: the
    outer "dp" only (tensor-parallel devices hold the same experts). Their
    gradients are summed over these copies, and ZeRO shards over them.
    """
    if kind == "ep":
      return ("dp",), self.n_dp // (self.size("ep") * self.size("tp"))
    return self.data_axes, self.n_data

  def device_grid(self) -> list:
    """Devices as nested lists in the order of `axis_names`.

    Within a rank's group, device j is replica j // (ep * tp) of the outer "dp",
    then expert block, then tensor-parallel position: tensor-parallel groups are
    consecutive devices, expert groups stride over them.
    """
    sizes = [self.n_dp // (self.size("ep") * self.size("tp"))]
    sizes += [self.size(k) for k in _INNER if k in self.inner]
    rows = [[g[j] for g in self.groups] for j in range(self.n_dp)]
    for n in reversed(sizes[1:]):
      rows = [rows[i:i + n] for i in range(0, len(rows), n)]
    return rows


_INNER = ("ep", "tp")


def derive_mesh(graph: Graph, placed_by: Mapping[str, int], directives: Sequence[Directive]) -> MeshSpec:
  """Checks that the device groups form a (dp, pp) mesh and ranks them.

  Every region's nodes must share one group; groups must be disjoint and of one
  size (replicate groups form the dp axis); one ZeRO stage for the whole plan.
  """
  def err(node_id, msg):
    i = placed_by.get(node_id)
    return DirectiveError(msg, i, directives[i] if i is not None else None)

  region_group: dict[int, tuple[int, ...]] = {}
  region_node: dict[int, str] = {}
  zero: dict[int, str] = {}
  for n in graph.nodes.values():
    if n.kind not in (NodeKind.COMPUTE, NodeKind.UPDATE):
      continue
    if n.devices is None:
      # No directive is at fault, so none is named: the message says which one to add.
      raise DirectiveError(_unplaced_message(graph, n))
    g = region_group.setdefault(n.region, n.devices)
    if g != n.devices:
      raise err(n.id, f"puts node {n.label} on {list(n.devices)} but other nodes of region "
                      f"{n.region} are on {list(g)}; every F, B and update of a region must "
                      f"run on the same devices")
    region_node.setdefault(n.region, n.id)
    zero.setdefault(n.zero, n.id)
  if len(zero) > 1:
    (z0, _), (z1, id1) = sorted(zero.items())[:2]
    raise err(id1, f"mixes ZeRO stages {sorted(zero)} in one plan; use one zero for every "
                   f"replicate directive")
  groups = sorted(set(region_group.values()))
  for a in groups:
    for b in groups:
      if a < b and set(a) & set(b):
        r = next(r for r, g in region_group.items() if g == b)
        raise err(region_node[r], f"device groups {list(a)} and {list(b)} overlap; replicate "
                                  f"groups must form a mesh axis: make them equal or disjoint")
  sizes = {len(g) for g in groups}
  if len(sizes) > 1:
    small = min(groups, key=len)
    r = next(r for r, g in region_group.items() if g == small)
    raise err(region_node[r], f"device groups have different sizes {sorted(sizes)}; replicate "
                              f"groups must form a mesh axis: give every stage as many "
                              f"replicas")
  rank = {g: i for i, g in enumerate(groups)}
  z = next(iter(zero)) if len(groups[0]) > 1 else 0
  return MeshSpec(tuple(groups), {r: rank[g] for r, g in region_group.items()}, z)


def _unplaced_message(graph, node) -> str:
  """Why `node` is unplaced and the change that places it; when other regions of its tag
  are placed, also the count of the model's regions against the placed ones (a pipeline
  built for fewer stages than the model has)."""
  tags = {t: v for t, v in node.tags if t not in ("MB", "PASS")}
  msg = (f"region {node.region} ({tags or 'the whole model'}) has an unplaced node "
         f"{node.label}: no place or replicate directive matches it; add one whose filter "
         f"matches {tags}, such as pj.place({tags}, [0])")
  computes = [n for n in graph.nodes.values() if n.kind in (NodeKind.COMPUTE, NodeKind.UPDATE)]
  for tag in tags:
    have = sorted({dict(n.tags)[tag] for n in computes if tag in dict(n.tags)})
    placed = sorted({dict(n.tags)[tag] for n in computes
                     if tag in dict(n.tags) and n.devices is not None})
    if placed and len(placed) < len(have):
      return (f"{msg}. The model has {len(have)} {tag} regions ({tag}={have[0]}..{have[-1]}) "
              f"but the directives place {len(placed)} ({', '.join(f'{tag}={v}' for v in placed)}):"
              f" a pipeline needs one stage per region (pj.strategies.pipeline("
              f"n_stages={len(have)}, ...))")
  return f"{msg}, or pj.place({{}}, [0]) to run the whole model on device 0"
