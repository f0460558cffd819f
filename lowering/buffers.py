"""The parameters as a step stores them, and everything laid out like them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["Buffers", "StepParams"]


@dataclasses.dataclass(frozen=True)
class Buffers:
  """A step's parameter buffers (`ParamLayout.pack`), or anything laid out like them:
  their gradients, optimizer moments, shapes or PartitionSpecs. A pytree.

  slots: dtype -> one flat buffer per slot of `ParamLayout.slot_ids[dtype]`,
    [ranks, replicas, chunk] (a spread slot: [devices, share]).
  shared: dtype -> the [replicas, chunk] buffer of leaves every rank reads (tied).
  split: the pieces of leaves split by shard / shard_tensor, [ranks, group, *piece].
  """

  slots: dict[str, list[Any]]
  shared: dict[str, Any]
  split: list[Any] = dataclasses.field(default_factory=list)

  def replace(self, **changes) -> "Buffers":
    return dataclasses.replace(self, **changes)


# Flattened in the order of the dict this replaced ("shared", "slots", "split"), so that
# the leaves of a state keep their order.
jax.tree_util.register_dataclass(Buffers, data_fields=["shared", "slots", "split"],
                                 meta_fields=[])


@dataclasses.dataclass
class StepParams:
  """What a step's tasks read their weights from: its own `Buffers` (whole, or this
  replica's shards under ZeRO-3), their cast copies (slots of the leaves the model reads
  in a narrower dtype; None without), and the cast leaves a pipeline unpacks once
  (`ParamLayout.unpack_cast`)."""

  own: Buffers
  cast: Buffers | None = None
  leaves: list = dataclasses.field(default_factory=list)


jax.tree_util.register_dataclass(StepParams, data_fields=["own", "cast", "leaves"],
                                 meta_fields=[])
