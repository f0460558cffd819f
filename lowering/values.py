"""The values tasks hand each other: typed keys, and where a step written out tick by
tick finds them (`Kept`) with what each tick keeps."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["ValueKind", "ValueKey", "Kept", "TickValues"]


class ValueKind(str, enum.Enum):
  """What a value is (a str enum, so that keys sort and print plainly)."""

  ACT = "act"    # output `index` of a region's F
  RES = "res"    # residual `index` a region's F stores for its B
  CT = "ct"      # cotangent of a region's input `index`, made by its B or BI
  WRES = "wres"  # value `index` a region's BI leaves for its BW
  # Expert parallel: what its all-to-all regroups. An expert-parallel region reads ACT
  # and CT values in its experts' layout (the devices that hold each expert), and makes
  # them in that layout before they go back to the devices their tokens came from.
  ACT_TO_EP = "act>ep"    # ACT `index` of `region`, regrouped by expert
  CT_TO_EP = "ct>ep"      # CT `index` of `region`, regrouped by expert
  ACT_FROM_EP = "act<ep"  # output `index` of expert-parallel `region`'s F, by expert
  CT_FROM_EP = "ct<ep"    # its B's cotangent of input `index`, by expert


@dataclasses.dataclass(frozen=True, order=True, repr=False)
class ValueKey:
  """One value of one microbatch: `kind` number `index` of region `region`."""

  kind: ValueKind
  region: int
  mb: int
  index: int
  # Hashed once: a plan's table looks keys up 100k times at 32 microbatches, and an
  # enum's hash runs in Python.
  _hash: int = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    object.__setattr__(self, "_hash", hash((self.kind.value, self.region, self.mb, self.index)))

  def __hash__(self) -> int:
    return self._hash

  def __reduce__(self):  # rebuilt, so that a copy in another process hashes there
    return (ValueKey, (self.kind, self.region, self.mb, self.index))

  def __str__(self) -> str:
    return f"{self.kind.value}:r{self.region}:mb{self.mb}:{self.index}"

  __repr__ = __str__  # tables print hundreds of keys

  def as_kind(self, kind: ValueKind) -> "ValueKey":
    return dataclasses.replace(self, kind=kind)


@dataclasses.dataclass(frozen=True, order=True, repr=False)
class Kept:
  """Position `pos` of the values a rank keeps from tick `tick` for its own later ticks
  (sortable: JAX sorts a pytree dict's keys; printed short: tables print hundreds)."""

  tick: int
  pos: int

  def __str__(self) -> str:
    return f"keep:t{self.tick}:{self.pos}"

  __repr__ = __str__


@dataclasses.dataclass(frozen=True)
class TickValues:
  """What one tick keeps and adds to: the (shape, dtype) of each kept position and per
  (rank, value key) its position; the gradient positions its tasks add to."""

  keep_positions: tuple[tuple, ...]
  keep_where: dict
  grads: tuple[int, ...]
