"""`shard_regions`: expert parallel (shard) and tensor parallel (shard_tensor) regions."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from piper_jax.ir.directives import Shard, ShardTensor
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.filters import select
from piper_jax.ir.graph import DepKind, Edge, Graph, Node, NodeKind
from piper_jax.ir.mesh import MeshSpec
from piper_jax.ir.model import ModelSpec

__all__ = ["shard_regions", "split_dims"]

_OP = {"ep": "shard", "tp": "shard_tensor"}


def split_dims(model: ModelSpec, region: int, kind: str, axis: str = "tp") -> dict[int, int]:
  """Parameter leaf -> the dimension split in `region`: the expert axis (0) under "ep",
  the dimension whose partitioning name is `axis` under "tp"."""
  out = {}
  for p in model.regions[region].params:
    spec = model.params[p]
    if kind == "ep":
      out[p] = 0
    elif spec.names and axis in spec.names:
      out[p] = spec.names.index(axis)
  return out


def _check_ep(model: ModelSpec, r: int, g: int, err) -> None:
  spec = model.regions[r]
  if spec.batch or spec.produces_loss:
    raise err(f"region {r} ({spec.name}) reads the batch or computes the loss; an EP region "
              f"runs the experts on tokens already dispatched to [experts, capacity, ...]")
  tensors = ([("parameter", model.params[p]) for p in spec.params]
             + [("input", x.spec) for x in spec.inputs] + [("output", o) for o in spec.outputs])
  if not spec.params or not spec.inputs:
    raise err(f"region {r} ({spec.name}) has no expert parameters or no dispatched inputs; "
              f"match only the expert computation with shard")
  n_exp = model.params[spec.params[0]].shape[0] if model.params[spec.params[0]].shape else 0
  for what, t in tensors:
    if not t.shape or t.shape[0] != n_exp:
      raise err(f"{what} {t.name} {list(t.shape)} of EP region {r} lacks the expert axis: every "
                f"tensor of an EP region needs a leading axis of {n_exp} experts "
                f"([experts, capacity, d_model] tokens, [experts, ...] weights)")
  if n_exp % g:
    raise err(f"{n_exp} experts of region {r} do not divide over {g} devices; use a group size "
              f"that divides the expert count")


def _check_tp(model: ModelSpec, r: int, g: int, axis: str, err) -> bool:
  found = False
  for p, dim in split_dims(model, r, "tp", axis).items():
    spec = model.params[p]
    found = True
    if spec.shape[dim] % g:
      raise err(f"parameter {spec.name} {list(spec.shape)} is split along dimension {dim} "
                f"({axis!r}) of size {spec.shape[dim]}, which does not divide over {g} devices")
  return found


def shard_regions(graph: Graph, model: ModelSpec, mesh: MeshSpec,
                  directives: Sequence[tuple[int, Shard | ShardTensor]]) -> tuple[Graph, MeshSpec]:
  """Marks the regions shard / shard_tensor match and gives the mesh its inner axis.

  Needs: placed nodes, SEND/RECV inserted. `devices` of a directive, intersected
  with a matched region's group, must be an aligned block of that group: the group
  splits into blocks of that size, each holding all experts (or all of a tensor)
  between its devices. Under shard, the dispatched tokens of every F and B of the
  region pass through an ALL_TO_ALL node before and after it.
  """
  if not directives:
    return graph, mesh
  kind_of: dict[int, tuple[str, int]] = {}
  dims: dict[int, dict[int, int]] = {}
  size_of: dict[int, int] = {}
  tp_found: dict[int, bool] = {}
  for i, d in directives:
    kind = "ep" if isinstance(d, Shard) else "tp"
    err = lambda msg, i=i, d=d: DirectiveError(msg, i, d)
    if any(t in ("MB", "PASS") for t, _ in d.filter):
      raise err("shards whole regions (every microbatch and pass); drop MB and PASS from the filter")
    for r in sorted({n.region for n in select(graph, d.filter, kinds=(NodeKind.COMPUTE,))}):
      if r in kind_of and kind_of[r][0] != kind:
        j = kind_of[r][1]
        raise err(f"region {r} ({model.regions[r].name}) is also matched by directive {j} "
                  f"({_OP[kind_of[r][0]]}); a region is either expert parallel (shard) "
                  f"or tensor parallel (shard_tensor), not both")
      kind_of[r] = (kind, i)
      dims[r] = split_dims(model, r, kind, getattr(d, "axis", "tp"))
      group = mesh.groups[mesh.region_rank[r]]
      block = [x for x in group if x in d.devices]
      if not block:
        raise err(f"none of devices {list(d.devices)} hold region {r} ({model.regions[r].name}), "
                  f"which runs on {list(group)}; shard over a block of those devices")
      g, start = len(block), group.index(block[0])
      if g == 1:
        raise err(f"only device {block[0]} of {list(d.devices)} holds region {r} "
                  f"({model.regions[r].name}), which runs on {list(group)}; list at least two "
                  f"devices of that group to split it over")
      if len(group) % g or start % g or list(group[start:start + g]) != block:
        raise err(f"devices {block} are not an aligned block of region {r}'s group {list(group)}; "
                  f"use {g} consecutive devices of it starting at a multiple of {g}, with "
                  f"{g} dividing {len(group)}")
      size_of.setdefault(g, i)
      if kind == "ep":
        _check_ep(model, r, g, err)
      else:
        tp_found[i] = tp_found.get(i, False) or _check_tp(model, r, g, d.axis, err)
  for i, found in tp_found.items():
    if not found:
      raise DirectiveError(f"no parameter of the matched regions has the partitioning name "
                           f"{dict(directives)[i].axis!r}; mark the weights to split with "
                           f"flax.linen.with_partitioning", i, dict(directives)[i])
  kinds = {k for k, _ in kind_of.values()}
  if len(kinds) > 1:
    i = max(i for _, i in kind_of.values())
    raise DirectiveError("mixes shard and shard_tensor in one plan, which this version does not "
                         "support; use one of them", i, dict(directives)[i])
  if len(size_of) > 1:
    (g0, _), (g1, i1) = sorted(size_of.items())[:2]
    raise DirectiveError(f"shards over groups of {g1} devices but another directive uses {g0}; "
                         f"use one group size", i1, dict(directives)[i1])
  kind, g = kinds.pop(), next(iter(size_of))
  if g == 1:
    return graph, mesh
  nodes, edges = dict(graph.nodes), list(graph.edges)
  for n in graph.compute_nodes():
    if n.region in kind_of:
      nodes[n.id] = n.replace(shard=(kind, g))
  if kind == "ep":
    edges = _insert_all_to_all(graph, nodes, edges, set(kind_of))
  mesh = dataclasses.replace(mesh, inner=g, inner_kind=kind,
                             sharded={r: k for r, (k, _) in kind_of.items()}, split_dims=dims)
  return Graph(nodes.values(), edges), mesh


def _insert_all_to_all(graph: Graph, nodes: dict, edges: list, regions: set) -> list[Edge]:
  """Routes the data edges into and out of each EP compute node through ALL_TO_ALL nodes."""
  out = []
  ep = {n.id for n in graph.compute_nodes() if n.region in regions}
  for i in sorted(ep):
    n = nodes[i]
    for side in ("in", "out"):
      nodes[f"a2a:{i}:{side}"] = Node(f"a2a:{i}:{side}", NodeKind.ALL_TO_ALL, region=n.region,
                                       tags=n.tags, mb=n.mb, devices=n.devices, zero=n.zero,
                                       axis="ep")
  for e in edges:
    if e.kind is not DepKind.DATA or (e.dst not in ep and e.src not in ep):
      out.append(e)
      continue
    if e.src in ep and e.dst in ep and graph.nodes[e.src].region == graph.nodes[e.dst].region:
      out.append(e)  # F -> B of one region: residuals stay local
      continue
    src, dst = e.src, e.dst
    if src in ep:
      out.append(Edge(src, f"a2a:{src}:out", tensor=e.tensor))
      src = f"a2a:{src}:out"
    if dst in ep:
      out.append(Edge(f"a2a:{dst}:in", dst, tensor=e.tensor))
      dst = f"a2a:{dst}:in"
    out.append(Edge(src, dst, tensor=e.tensor))
  return list(dict.fromkeys(out))
