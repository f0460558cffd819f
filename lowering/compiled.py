"""What XLA compiled of a step, read from the compiled program's text.

On GPUs a conditional that holds a collective runs from the host, outside CUDA graphs
(`collectives_in_conditionals`); a store that XLA cannot keep in place is copied each
time a branch runs (`copies_in_branches`); and XLA's CPU compiler compiles each distinct
kernel on its own, one LLVM module each, so their number is what its compile time
follows (`distinct_kernels`).
"""

from __future__ import annotations

import math
import re

__all__ = ["collectives_in_conditionals", "copies_in_branches", "distinct_kernels"]

_HLO_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")


def _computations(hlo: str) -> dict[str, list[str]]:
  """The compiled program's computations by name: their instruction lines."""
  comps: dict[str, list[str]] = {}
  cur = None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m:
      cur = comps.setdefault(m.group(1), [])
    elif cur is not None:
      cur.append(line)
  return comps


def _branches(comps: dict[str, list[str]]) -> list[list[str]]:
  """Each conditional's branch computations, by name."""
  return [re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[1])
          for lines in comps.values() for line in lines if " conditional(" in line]


def _called(line: str) -> list[str]:
  """The computations an instruction line calls (fused computations, reducers, branches,
  loop bodies and conditions), by name."""
  return re.findall(r"%([\w.\-]+)", " ".join(re.findall(
      r"(?:calls|to_apply|branch_computations|body|condition)=\{?([^}]*)\}?", line)))


def _array_bytes(shape: str) -> int:
  """Bytes of an HLO array shape such as `f32[14,524288]` (`pred` a byte; sub-byte
  types packed)."""
  m = re.match(r"([a-z]+)(\d*)\w*\[([\d,]*)\]", shape)
  bits = int(m.group(2)) if m.group(2) else 8
  return (bits * math.prod(int(d) for d in m.group(3).split(",") if d) + 7) // 8


def copies_in_branches(hlo: str) -> list[list[int]]:
  """Per conditional of the compiled program, per branch, the bytes its own `copy`
  instructions write: what XLA copies each time that branch runs (the stores a branch
  passes through where XLA could not keep them in place)."""
  comps = _computations(hlo)
  return [[sum(_array_bytes(m.group(1)) for line in comps.get(b, [])
               for m in [re.search(r"= (\w+\[[\d,]*\])\S* copy\(", line)] if m)
           for b in branches] for branches in _branches(comps)]


def collectives_in_conditionals(hlo: str) -> list[str]:
  """The collectives the compiled program runs inside a conditional's branches
  (following the computations they call), by HLO opcode."""
  comps = _computations(hlo)
  found, seen = [], set()
  todo = [c for branches in _branches(comps) for c in branches]
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      found += [op for op in _HLO_COLLECTIVES if re.search(rf"\b{op}(-start)?\(", line)]
      todo += _called(line)
  return found


def distinct_kernels(hlo: str) -> int:
  """How many distinct kernels the compiled program's fusions make: fused computations
  compared up to the names of their values and computations and their source
  information, with the computations they call (a reducer's) compared likewise (those
  XLA compiles once however often they run)."""
  comps = _computations(hlo)

  def canon(name: str, seen: tuple = ()) -> str:
    lines = []
    for line in comps.get(name, []):
      line = re.sub(r",? metadata=\{[^}]*\}", "", line)
      called = _called(line)
      line = re.sub(r"%[\w.\-]+", "%", line).strip()
      lines.append(line + "".join("{" + canon(c, seen + (name,)) + "}"
                                  for c in called if c not in seen))
    return "\n".join(lines)

  fused = {c for lines in comps.values() for line in lines if " fusion(" in line
           for c in _called(line)}
  return len({canon(c) for c in fused})
