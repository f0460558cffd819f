"""The values a pipeline's tasks hand each other: typed keys, and where the per-tick
program finds them (`Kept`, `Received`) with what each tick keeps and exchanges."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["ValueKind", "ValueKey", "Kept", "Received", "Location", "Exchange", "TickValues"]


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

  def __str__(self) -> str:
    return f"{self.kind.value}:r{self.region}:mb{self.mb}:{self.index}"

  __repr__ = __str__  # tables print hundreds of keys


class _Location:
  """What `Kept` and `Received` share: both kinds sort together (JAX sorts a pytree
  dict's keys) and print as their `__str__` (tables print hundreds)."""

  tick: int

  def _order(self) -> tuple:
    return (self.tick, type(self).__name__, dataclasses.astuple(self))

  def __lt__(self, other: "_Location") -> bool:
    return self._order() < other._order()

  def __repr__(self) -> str:
    return str(self)


@dataclasses.dataclass(frozen=True, repr=False)
class Kept(_Location):
  """Position `pos` of the values a rank keeps from tick `tick` for its own later ticks."""

  tick: int
  pos: int

  def __str__(self) -> str:
    return f"keep:t{self.tick}:{self.pos}"


@dataclasses.dataclass(frozen=True, repr=False)
class Received(_Location):
  """Position `pos` of what a rank receives in round `round` after tick `tick`."""

  tick: int
  round: int
  pos: int

  def __str__(self) -> str:
    return f"recv:t{self.tick}:{self.round}:{self.pos}"


Location = Kept | Received


@dataclasses.dataclass(frozen=True)
class Exchange:
  """One `ppermute` after a tick: its (source, destination) pairs, the (shape, dtype) of
  each position, and per (source rank, value key) its position."""

  perm: tuple[tuple[int, int], ...]
  positions: tuple[tuple, ...]
  where: dict


@dataclasses.dataclass(frozen=True)
class TickValues:
  """What one tick keeps, exchanges and adds to: the (shape, dtype) of each kept position
  and per (rank, value key) its position; its rounds; the gradient positions its tasks
  add to."""

  keep_positions: tuple[tuple, ...]
  keep_where: dict
  rounds: tuple[Exchange, ...]
  grads: tuple[int, ...]
