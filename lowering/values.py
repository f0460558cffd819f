"""The values a pipeline's tasks hand each other, named by typed keys."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["ValueKind", "ValueKey"]


class ValueKind(str, enum.Enum):
  """What a value is (a str enum, so that keys sort and print plainly)."""

  ACT = "act"    # output `index` of a region's F
  RES = "res"    # residual `index` a region's F stores for its B
  CT = "ct"      # cotangent of a region's input `index`, made by its B or BI
  WRES = "wres"  # value `index` a region's BI leaves for its BW


@dataclasses.dataclass(frozen=True, order=True, repr=False)
class ValueKey:
  """One value of one microbatch: `kind` number `index` of region `region`."""

  kind: ValueKind
  region: int
  mb: int
  index: int

  def shifted(self, mbs: int) -> "ValueKey":
    """The same value `mbs` microbatches later."""
    return dataclasses.replace(self, mb=self.mb + mbs)

  def __str__(self) -> str:
    return f"{self.kind.value}:r{self.region}:mb{self.mb}:{self.index}"

  __repr__ = __str__  # windows and tables print hundreds of keys
