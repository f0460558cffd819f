"""`CompiledMemory`: XLA's count of a compiled program's bytes per device."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

__all__ = ["CompiledMemory"]


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Bytes per device of the compiled step, by XLA's own accounting
  (`jax.stages.Compiled.memory_analysis`): the state and batch it reads, what it
  returns (the new state is written over the donated old one), and its temporaries."""

  arguments: int
  outputs: int
  aliased: int
  temporaries: int

  @property
  def total(self) -> int:
    """The most bytes the step holds at once on a device, allocator slack aside."""
    return self.arguments + self.outputs - self.aliased + self.temporaries

  @classmethod
  def of(cls, compiled) -> "CompiledMemory":
    """The counts of a `jax.stages.Compiled` (any jitted program, not only a step's)."""
    stats = compiled.memory_analysis()
    if stats is None:
      raise NotImplementedError("XLA has no memory analysis on this platform")
    return cls(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
               int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes))

  def shortfall(self, stats: Sequence[Mapping[str, int]]) -> str | None:
    """Why devices with these allocator stats (`Device.memory_stats()`, one per device)
    cannot run the step once its state is on them, or None when each has room.

    A run needs, beyond the state and batch it is given, its temporaries and the outputs
    not written over the donated state."""
    need = self.outputs - self.aliased + self.temporaries
    for i, st in enumerate(stats):
      limit, used = st.get("bytes_limit"), st.get("bytes_in_use", 0)
      if limit and need > limit - used:
        gib = lambda b: f"{b / 2**30:.1f} GiB"
        return (f"the step needs {gib(need)} per device beyond its state, but device {i} has "
                f"{gib(limit - used)} free of its allocator's {gib(limit)} ({gib(used)} in use)")
    return None
