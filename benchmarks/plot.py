"""Draws the tables of benchmarks/RESULTS.md as one picture.

  python benchmarks/plot.py                      # RESULTS.md -> benchmarks/results.png
  python benchmarks/plot.py --machine "4 x H200" --out benchmarks/results_4xh200.png

One panel per machine and model: each table row as a bar, its tokens/s over the
baseline of the same command (the table's "vs baseline": jit DP, GSPMD FSDP for ZeRO-3,
shard_map DP for MoE models), labelled with the row's command number ("cmd") and its
peak memory. The commands and their raw JSON are listed under each table; ratios
compare within a command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Bar:
  panel: str      # "2 x H200, 1.34B"
  label: str      # "2: pp-1f1b 16 / 8" (the row's command, variant, batch)
  ratio: float    # tokens/s over the same command's baseline
  baseline: bool  # the row is its command's baseline (1.00x)
  peak_gib: float | None


def _number(cell: str) -> float | None:
  m = re.search(r"(\d+(?:\.\d+)?)", cell.replace("*", ""))
  return float(m.group(1)) if m else None


def bars(results_md: str) -> list[Bar]:
  """The rows of every table under a "## <machine>" heading that has "variant" and "vs
  baseline" columns; rows with no ratio (no baseline in their command) are left out."""
  found, machine, cols = [], None, None
  for line in open(results_md):
    line = line.strip()
    if line.startswith("## "):
      machine, cols = line[3:], None
      continue
    if not line.startswith("|") or machine is None:
      cols = None if not line.startswith("|") else cols
      continue
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cols is None:
      if "variant" in cells and "vs baseline" in cells:
        cols = {name: k for k, name in enumerate(cells)}
      continue
    if set(cells[0]) <= set("- :"):
      continue  # the header's rule
    ratio = re.match(r"\**(\d+\.\d+)x", cells[cols["vs baseline"]])
    if not ratio:
      continue
    get = lambda name: cells[cols[name]] if name in cols else ""
    variant = get("variant").replace("*", "").strip()
    label = f"{get('cmd')}: {variant} {get('batch / mb')}".strip()
    peak = _number(get("peak GiB")) if get("peak GiB") not in ("", "-") else None
    found.append(Bar(f"{machine}, {get('model')}", label, float(ratio.group(1)),
                     get("vs baseline").replace("*", "").startswith("1.00x") and
                     variant.split()[0] in ("jit-dp", "gspmd-fsdp", "shmap-dp"), peak))
  return found


def draw(all_bars: list[Bar], out: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = list(dict.fromkeys(b.panel for b in all_bars))
  if not panels:
    raise ValueError("no table rows with a ratio to a baseline: nothing to draw")
  heights = [len([b for b in all_bars if b.panel == p]) for p in panels]
  fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.2 + 0.22 * sum(heights) + 0.6 * len(panels)),
                           gridspec_kw={"height_ratios": heights}, squeeze=False)
  for ax, panel in zip(axes[:, 0], panels):
    mine = [b for b in all_bars if b.panel == panel]
    ys = range(len(mine))
    ax.barh(ys, [b.ratio for b in mine],
            color=["#9e9e9e" if b.baseline else "#3b75af" for b in mine])
    ax.set_yticks(list(ys), [b.label for b in mine], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.6)
    for y, b in zip(ys, mine):
      if b.peak_gib:
        ax.text(b.ratio, y, f" {b.peak_gib:.1f} GiB", va="center", fontsize=6)
    ax.set_title(panel, fontsize=9, loc="left")
    ax.set_xlim(0, max(1.2, max(b.ratio for b in mine) * 1.25))
  axes[-1, 0].set_xlabel("tokens/s over the same command's baseline (grey); label: peak memory per GPU")
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
  ap.add_argument("--out", default=os.path.join(HERE, "results.png"))
  ap.add_argument("--machine", default=None, help='only the tables of this machine ("2 x H200")')
  args = ap.parse_args(argv)
  found = [b for b in bars(args.results)
           if args.machine is None or b.panel.startswith(args.machine + ",")]
  draw(found, args.out)
  print(f"{args.out}: {len(found)} rows")


if __name__ == "__main__":
  main()
