"""The one place the pass order is written: model + directives -> checked `Plan`."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from piper_jax.ir.build import build_graph
from piper_jax.ir.directives import (Directive, Order, Place, Replicate, Shard, ShardTensor, Split,
                                      place)
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.filters import select
from piper_jax.ir.graph import Graph, NodeKind
from piper_jax.ir.mesh import MeshSpec, derive_mesh
from piper_jax.ir.model import ModelSpec
from piper_jax.ir.passes import (apply_order, insert_collectives, insert_send_recv, place_nodes,
                                 shard_regions, split_backward, split_microbatches)
from piper_jax.ir.passes.split_backward import backward_split_keys
from piper_jax.ir.plan import Plan
from piper_jax.ir.verify import verify

__all__ = ["PlacedGraph", "make_plan", "place_graph", "finish_plan"]


def _filters(d: Directive):
  if isinstance(d, Order):
    return [f for g in d.groups for f in g]
  return [d.filter]


def _region_names(model: ModelSpec, most: int = 8) -> str:
  """The regions' tags, as a filter would name them ('PP=0, PP=1'), the first `most` only."""
  names = list(dict.fromkeys(r.name if r.tags else "(untagged)" for r in model.regions))
  more = f" and {len(names) - most} more" if len(names) > most else ""
  return ", ".join(names[:most]) + more


def _check_filters(model: ModelSpec, directives: Sequence[Directive], n_mb: int) -> None:
  known = model.tags() | {"MB", "PASS"}
  for i, d in enumerate(directives):
    for f in _filters(d):
      for tag, value in f:
        if tag not in known:
          same = [k for k in sorted(known) if k.lower() == tag.lower()]
          hint = (f"did you mean {same[0]!r}?" if same else
                  f"annotate regions with pj.annotate({tag!r}) to add it")
          raise DirectiveError(
              f"unknown tag {tag!r} in filter {dict(f)}; this model's tags are "
              f"{sorted(known)} ({hint})", i, d)
        if tag == "MB" and value != "*" and value >= n_mb:
          raise DirectiveError(f"filter {dict(f)} names microbatch {value} but the batch is split "
                               f"into {n_mb}", i, d)


def _num_microbatches(model: ModelSpec, directives: Sequence[Directive]) -> int:
  n_mb, first = 1, None
  for i, d in enumerate(directives):
    if not isinstance(d, Split):
      continue
    if d.filter and len({r.index for r in model.regions}) > 1:
      covered = {r.index for r in model.regions
                 if all(v == "*" or dict(r.tags).get(t) == v for t, v in d.filter if t != "MB")}
      if covered != {r.index for r in model.regions}:
        raise DirectiveError("splits only some regions; split the whole model (filter {}) so "
                             "every region sees the same microbatches", i, d)
    if first is not None:
      raise DirectiveError(f"splits into {d.num_microbatches} microbatches but directive "
                           f"{first} split the batch already, into {n_mb}; use one split", i, d)
    n_mb, first = d.num_microbatches, i
  return n_mb


@dataclasses.dataclass(frozen=True)
class PlacedGraph:
  """A plan before its collectives and orders: the placed, cut and sharded graph, its mesh."""

  graph: Graph
  mesh: MeshSpec
  n_microbatches: int


def make_plan(model: ModelSpec, directives: Sequence[Directive], n_devices: int,
              global_batch: int | None = None, check: bool = False) -> Plan:
  """Builds the global DAG of `model`, rewrites it with `directives` and orders it per device.

  Pass order: split, BI/BW split (of the backwards `order`s name as BI and BW),
  place/replicate, mesh check, send/recv, shard/shard_tensor, collectives, order.
  Raises `DirectiveError` (naming the directive) or `PlanError` for bad input.
  With `check`, `verify` runs after every pass and names the pass that broke it.
  """
  directives = list(directives)
  placed = place_graph(model, directives, n_devices, global_batch, check)
  return finish_plan(model, directives, placed, check)


def _checker(check: bool):
  """`verify` when `check`, else a pass-through with its signature."""
  return (lambda g, after, **kw: verify(g, after, **kw)) if check else (lambda g, after, **kw: g)


def place_graph(model: ModelSpec, directives: Sequence[Directive], n_devices: int,
                global_batch: int | None = None, check: bool = False) -> PlacedGraph:
  """The passes of `make_plan` up to shard/shard_tensor, which fix the mesh and microbatches.

  Raises what `make_plan` raises in those passes; `finish_plan` runs the rest.
  """
  check_ = _checker(check)
  directives = list(directives)
  for i, d in enumerate(directives):
    if not isinstance(d, Directive):
      raise TypeError(f"directive {i} is {d!r}, not a piper_jax directive (pj.place, ...)")
  if not any(isinstance(d, (Place, Replicate)) for d in directives):
    # Directives that place nothing (a split alone: gradient accumulation) run on one device.
    directives.append(place({}, [0]))
  n_mb = _num_microbatches(model, directives)
  _check_filters(model, directives, n_mb)
  graph = check_(build_graph(model), "build_graph")
  graph = check_(split_microbatches(graph, n_mb), "split_microbatches")
  orders = [(i, d) for i, d in enumerate(directives) if isinstance(d, Order)]
  split_keys = backward_split_keys(graph, orders)
  if split_keys:
    graph = check_(split_backward(graph, split_keys), "split_backward")
  for i, d in enumerate(directives):
    if not isinstance(d, Split):
      for f in _filters(d):
        if not select(graph, f, kinds=(NodeKind.COMPUTE, NodeKind.UPDATE)):
          group = (next(f" (group {g})" for g, fs in enumerate(d.groups) if f in fs)
                   if isinstance(d, Order) else "")
          raise DirectiveError(f"filter {dict(f)}{group} matches no node of this model, whose "
                               f"regions are {_region_names(model)}; fix the filter or drop it",
                               i, d)
  graph, placed_by = place_nodes(
      graph, [(i, d) for i, d in enumerate(directives) if isinstance(d, (Place, Replicate))],
      n_devices)
  mesh = derive_mesh(graph, placed_by, directives)
  graph = check_(graph, "place_nodes", placed=True)
  batch = model.batch_size if global_batch is None else global_batch
  graph = check_(insert_send_recv(graph), "insert_send_recv", placed=True, cut=True)
  graph, mesh = shard_regions(
      graph, model, mesh,
      [(i, d) for i, d in enumerate(directives) if isinstance(d, (Shard, ShardTensor))])
  graph = check_(graph, "shard_regions", placed=True, cut=True)
  if batch % (mesh.n_data * n_mb):
    idx = next((i for i, d in enumerate(directives) if isinstance(d, Split)), None)
    msg = (f"the batch of {batch} does not divide into {mesh.n_data} data-parallel replicas x "
           f"{n_mb} microbatches; pick a batch size divisible by {mesh.n_data * n_mb}")
    raise DirectiveError(msg, idx, directives[idx] if idx is not None else None)
  return PlacedGraph(graph, mesh, n_mb)


def finish_plan(model: ModelSpec, directives: Sequence[Directive], placed: PlacedGraph,
                check: bool = False) -> Plan:
  """The rest of `make_plan` after `place_graph`: collectives, orders and the ticked plan."""
  check_ = _checker(check)
  graph, mesh, n_mb = placed.graph, placed.mesh, placed.n_microbatches
  graph = check_(insert_collectives(graph, model, mesh), "insert_collectives", placed=True, cut=True)
  graph = check_(apply_order(graph, [(i, d) for i, d in enumerate(directives) if isinstance(d, Order)]),
                 "apply_order", placed=True, cut=True)
  buckets = {d.bucket_mb for d in directives if isinstance(d, Replicate) and d.bucket_mb}
  if len(buckets) > 1:
    i = next(i for i, d in enumerate(directives) if isinstance(d, Replicate) and d.bucket_mb)
    raise DirectiveError(f"replicate directives ask for different bucket sizes {sorted(buckets)}; "
                         f"use one bucket_mb", i, directives[i])
  dtypes = {d.reduce_dtype for d in directives if isinstance(d, Replicate)}
  if len(dtypes) > 1:
    i = next(i for i, d in enumerate(directives)
             if isinstance(d, Replicate) and d.reduce_dtype is not None)
    raise DirectiveError(f"replicate directives ask for different gradient reduction dtypes "
                         f"{sorted(map(str, dtypes))}; give every replicate the same reduce_dtype",
                         i, directives[i])
  return Plan(graph, model, mesh, n_mb, bucket_mb=buckets.pop() if buckets else None,
              reduce_dtype=dtypes.pop() if dtypes else None)
