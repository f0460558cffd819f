"""Where a compiled program holds its memory at its peak, by kind of value.

  XLA_FLAGS=--xla_dump_to=dump python3 benchmarks/compile_only.py --mock-gpus 4 ...
  python3 benchmarks/peak_breakdown.py dump/*live-range.txt

XLA's `*-live-range.txt` dump ends with a "Stack trace breakdown for peak usage": every
buffer live at the peak under the operation that made it, nested in the computations
(loop bodies, conditional branches) that hold it. This sums them per computation, with
block numbers and output indices dropped, so that "block_N/mlp/mul" counts every
block's copy of that value: what remat keeps, what a backward holds, what a branch of
the pipeline's loop allocates beside the others.
"""

from __future__ import annotations

import argparse
import collections
import re

# A computation the breakdown nests buffers under: a branch or body, by its XLA name.
_COMPUTATION = re.compile(r"(region_\d+)\.\d+_spmd \(")
_ENTRY = re.compile(r"[├└]── (.*) \(\d+\.\d+%, total: ([\d ]+) bytes")


def breakdown(text: str, depth_inside: int = 16) -> dict[str, collections.Counter]:
  """{computation (or "outside"): Counter(kind -> bytes)} of the peak's breakdown;
  entries indented deeper than `depth_inside` belong to the computation above them."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if "Stack trace breakdown" in line), None)
  if start is None:
    raise ValueError("no 'Stack trace breakdown for peak usage' in the file: pass XLA's "
                     "*-live-range.txt dump of a compiled module")
  sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  current = "outside"
  for line in lines[start + 1:]:
    if not line.strip():
      break
    m = _COMPUTATION.search(line)
    if m and "sunk" not in line:
      current = m.group(1)
      continue
    m = _ENTRY.search(line)
    if not m:
      continue
    name, nbytes = m.group(1), int(m.group(2).replace(" ", ""))
    if "sunk" in name or name.endswith(("/while", "/cond")):
      continue  # containers: their buffers are listed below them
    depth = len(line) - len(line.lstrip(" │"))
    kind = re.sub(r"\{\d+\}", "", re.sub(r"block_\d+", "block_N", name.split("/cond/")[-1]))
    sums[current if depth > depth_inside else "outside"][kind] += nbytes
  return dict(sums)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("file", help="XLA's *-live-range.txt dump")
  ap.add_argument("--top", type=int, default=14, help="kinds listed per computation")
  args = ap.parse_args(argv)
  for where, kinds in breakdown(open(args.file).read()).items():
    print(f"== {where}: {sum(kinds.values()) / 2**30:.2f} GiB")
    for kind, nbytes in kinds.most_common(args.top):
      print(f"   {nbytes / 2**20:9.1f} MiB  {kind[:150]}")


if __name__ == "__main__":
  main()
