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
  if not spec.params:
    raise err(f"region {r} ({spec.name}) reads no parameters: read the expert weights (and "
              f"cast them) inside its pj.annotate(\"EP\") block, so that they are the "
              f"region's parameters and not inputs computed before it")
  if not spec.inputs:
    raise err(f"region {r} ({spec.name}) has no dispatched inputs; match only the expert "
              f"computation with shard")
  n_exp = model.params[spec.params[0]].shape[0] if model.params[spec.params[0]].shape else 0
  for what, t in tensors:
    if not t.shape or t.shape[0] != n_exp:
      raise err(f"{what} {t.name} {list(t.shape)} of EP region {r} lacks the expert axis: every "
                f"tensor of an EP region needs a leading axis of {n_exp} experts "
                f"([experts, capacity, d_model] tokens, [experts, ...] weights)")
  if n_exp % g:
    raise err(f"{n_exp} experts of region {r} do not divide over {g} devices; use a group size "
              f"that divides the expert count")


def _check_tp(model: ModelSpec, dims: dict[int, int], g: int, axis: str, err) -> None:
  for p, dim in dims.items():
    spec = model.params[p]
    if spec.shape[dim] % g:
      raise err(f"parameter {spec.name} {list(spec.shape)} is split along dimension {dim} "
                f"({axis!r}) of size {spec.shape[dim]}, which does not divide over {g} devices")


def shard_regions(graph: Graph, model: ModelSpec, mesh: MeshSpec,
                  directives: Sequence[tuple[int, Shard | ShardTensor]]) -> tuple[Graph, MeshSpec]:
  """Marks the regions shard / shard_tensor match and gives the mesh its inner axes.

  Needs: placed nodes, SEND/RECV inserted. `devices` of a directive, intersected
  with a matched region's group, is one group of its kind: shard_tensor groups are
  t consecutive devices starting at a multiple of t; shard groups are e devices at
  stride t (1 without shard_tensor) inside an aligned block of e * t. The other
  groups of a rank repeat the pattern. Under shard, the dispatched tokens of every F
  and B of the region pass through an ALL_TO_ALL node before and after it.
  """
  if not directives:
    return graph, mesh
  kind_of, dims, blocks = _match_regions(graph, model, mesh, directives)
  sizes = _group_sizes(blocks, directives)
  _check_groups(model, mesh, directives, dims, blocks, sizes)
  inner = {k: g for k, (g, _) in sizes.items()}
  nodes, edges = dict(graph.nodes), list(graph.edges)
  for n in graph.compute_nodes():
    if n.region in kind_of:
      kind = kind_of[n.region][0]
      nodes[n.id] = n.replace(shard=(kind, inner[kind]))
  ep_regions = {r for r, (k, _) in kind_of.items() if k == "ep"}
  if ep_regions:
    edges = _insert_all_to_all(graph, nodes, edges, ep_regions)
  mesh = dataclasses.replace(mesh, inner=inner, sharded={r: k for r, (k, _) in kind_of.items()},
                             split_dims=dims)
  return Graph(nodes.values(), edges), mesh


def _match_regions(graph: Graph, model: ModelSpec, mesh: MeshSpec, directives) -> tuple:
  """The regions each directive splits: (region -> (kind, directive), region -> its split
  dimensions per leaf, [(directive, kind, region, positions in its rank's group)])."""
  kind_of: dict[int, tuple[str, int]] = {}
  dims: dict[int, dict[int, int]] = {}
  blocks: list[tuple[int, str, int, list[int]]] = []
  # shard first: a shard_tensor whose filter also covers EP regions (such as {} or
  # {"PP": 0}) leaves them to shard, unless it would split weights there.
  ordered = sorted(directives, key=lambda t: not isinstance(t[1], Shard))
  for i, d in ordered:
    kind = "ep" if isinstance(d, Shard) else "tp"
    err = lambda msg, i=i, d=d: DirectiveError(msg, i, d)
    if any(t in ("MB", "PASS") for t, _ in d.filter):
      raise err("shards whole regions (every microbatch and pass); drop MB and PASS from the filter")
    matched = sorted({n.region for n in select(graph, d.filter, kinds=(NodeKind.COMPUTE,))})
    if kind == "tp":
      taken = [r for r in matched if r in kind_of and kind_of[r][0] == "ep"]
      clash = [r for r in taken if split_dims(model, r, "tp", d.axis)]
      if taken and (clash or len(taken) == len(matched)):
        r = (clash or taken)[0]
        raise err(f"region {r} ({model.regions[r].name}) is also matched by directive "
                  f"{kind_of[r][1]} (shard); a region is either expert parallel (shard) or "
                  f"tensor parallel (shard_tensor), not both")
      matched = [r for r in matched if r not in taken]
    for r in matched:
      kind_of[r] = (kind, i)
      dims[r] = split_dims(model, r, kind, getattr(d, "axis", "tp"))
      group = mesh.groups[mesh.region_rank[r]]
      block = [k for k, x in enumerate(group) if x in d.devices]
      if not block:
        raise err(f"none of devices {list(d.devices)} hold region {r} ({model.regions[r].name}), "
                  f"which runs on {list(group)}; shard over a group of those devices")
      if len(block) == 1:
        raise err(f"only device {group[block[0]]} of {list(d.devices)} holds region {r} "
                  f"({model.regions[r].name}), which runs on {list(group)}; list at least two "
                  f"devices of that group to split it over")
      blocks.append((i, kind, r, block))
  return kind_of, dims, blocks


def _group_sizes(blocks: list, directives) -> dict[str, tuple[int, int]]:
  """kind -> (its group size, the first directive that set it); one size per kind."""
  sizes: dict[str, tuple[int, int]] = {}
  for i, kind, r, block in blocks:
    g0, i0 = sizes.setdefault(kind, (len(block), i))
    if len(block) != g0:
      raise DirectiveError(f"{_OP[kind]} over groups of {len(block)} devices but directive {i0} "
                           f"uses {g0}; use one group size per kind", i, dict(directives)[i])
  return sizes


def _check_groups(model: ModelSpec, mesh: MeshSpec, directives, dims: dict, blocks: list,
                  sizes: dict) -> None:
  """Each group is laid out as the docstring of `shard_regions` says, expert regions
  route tokens per expert, and every shard_tensor splits some weight."""
  e, t = sizes.get("ep", (1, 0))[0], sizes.get("tp", (1, 0))[0]
  tp_found: dict[int, bool] = {}
  for i, kind, r, block in blocks:
    d = dict(directives)[i]
    group = mesh.groups[mesh.region_rank[r]]
    stride = t if kind == "ep" else 1
    start = block[0]
    ok = (len(group) % (e * t) == 0 and block == [start + k * stride for k in range(len(block))]
          and (start % (e * t) < t if kind == "ep" else start % t == 0))
    if not ok:
      devs = [group[k] for k in block]
      how = (f"{e} devices at stride {t} (the shard_tensor group size)" if kind == "ep" and t > 1
             else f"{len(block)} consecutive devices starting at a multiple of {len(block)}")
      raise DirectiveError(f"devices {devs} are not a {_OP[kind]} group of region {r}'s devices "
                           f"{list(group)} ({len(group)} per rank, groups of ep={e} x tp={t}); "
                           f"use {how}", i, d)
    if kind == "ep":
      _check_ep(model, r, e, lambda msg, i=i, d=d: DirectiveError(msg, i, d))
    else:
      _check_tp(model, dims[r], t, d.axis, lambda msg, i=i, d=d: DirectiveError(msg, i, d))
      tp_found[i] = tp_found.get(i, False) or bool(dims[r])
  for i, found in tp_found.items():
    if not found:
      raise DirectiveError(f"no parameter of the matched regions has the partitioning name "
                           f"{dict(directives)[i].axis!r}; mark the weights to split with "
                           f"flax.linen.with_partitioning", i, dict(directives)[i])


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
