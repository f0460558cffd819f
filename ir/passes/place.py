"""`place_nodes`: assigns device groups (and ZeRO stages) from place/replicate."""

from __future__ import annotations

from typing import Sequence

from piper_jax.ir.directives import Place, Replicate
from piper_jax.ir.errors import DeviceIndexError, DirectiveError
from piper_jax.ir.filters import select
from piper_jax.ir.graph import Graph

__all__ = ["place_nodes"]


def place_nodes(graph: Graph, directives: Sequence[tuple[int, Place | Replicate]],
                n_devices: int) -> tuple[Graph, dict[str, int]]:
  """Sets `devices` (and `zero` for replicate) on the nodes each directive matches.

  Needs: filters already checked against the model's tags. Later directives
  override earlier ones for the same node. Returns the graph and, per node id,
  the index of the directive that placed it (for error messages).
  """
  updated, placed_by = {}, {}
  for index, d in directives:
    bad = [x for x in d.devices if not 0 <= x < n_devices]
    if bad:
      raise DeviceIndexError(
          f"device index {bad[0]} is out of range: there are {n_devices} devices "
          f"(indices 0..{n_devices - 1})", index, d, n_devices=n_devices)
    for n in select(graph, d.filter):
      n = updated.get(n.id, n)
      zero = d.zero if isinstance(d, Replicate) else n.zero
      if isinstance(d, Replicate) and n.devices is not None and set(n.devices) != set(d.devices):
        if len(n.devices) > 1:
          raise DirectiveError(
              f"replicates over {list(d.devices)} but node {n.label} was placed on "
              f"{list(n.devices)}; place and replicate a region on the same devices", index, d)
      updated[n.id] = n.replace(devices=tuple(sorted(d.devices)), zero=zero)
      placed_by[n.id] = index
  return graph.with_nodes(updated), placed_by
