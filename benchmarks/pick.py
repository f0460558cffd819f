"""What `strategies.search` picks for the model of run.py's raw JSON, beside what the
same call measured.

  python benchmarks/pick.py --regions 4 benchmarks/raw/2026-11-28_h200x2_qwen3_8b_l8_seq4096.json

From shapes on a CPU: the model of the files' rows (their meta's batch, sequence length
and blocks) with `--regions` PP regions, searched over the rows' device count and the
card's memory, with matmuls at the FLOP/s the call's plain-JAX baseline reached (or,
with `--calibrate` on a GPU, each region timed there) and `--link-gbps` links. Prints
the ranking, each candidate beside the measured row of the same strategy where the
files have one (the same schedule, ZeRO stage and microbatches; run.py splits a model
into its own stages, which may differ from the candidate's), and the pick's measured
step against the fastest measured row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402


def variant_of(c) -> str | None:
  """run.py's variant for a search candidate (None for accumulation without a pipeline,
  and for expert parallelism over ZeRO without one, which run.py has no variant for)."""
  ep = c.plan.mesh.size("ep") > 1  # its expert regions split over devices
  if c.schedule == "dp":
    if c.n_microbatches > 1 or (ep and c.zero):
      return None
    return "dp+ep" if ep else "dp" if c.zero == 0 else f"zero{c.zero}"
  return (f"pp-{c.schedule}" + (f"@z{c.zero}" if c.dp > 1 and c.zero else "")
          + ("+ep" if ep else ""))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("files", nargs="+", help="raw JSON files of run.py from one machine and "
                  "model (with the same batch and microbatches), oldest first")
  ap.add_argument("--regions", type=int, default=4, help="PP regions the model is cut into")
  ap.add_argument("--link-gbps", type=float, default=300.0)
  ap.add_argument("--top", type=int, default=12)
  ap.add_argument("--seq-len", type=int, default=0, help="for files whose meta lacks it")
  ap.add_argument("--layers", type=int, default=0, help="for files whose meta lacks it")
  ap.add_argument("--calibrate", default=None, metavar="CACHE",
                  help="rank by each region's F and B and the optimizer's update timed on "
                       "this machine's first device (pj.calibrate at one device's rows of "
                       "the batch; CACHE keeps the timings) instead of FLOP counts")
  args = ap.parse_args(argv)
  if not args.calibrate:
    run._setup_cpu(True)
  import dataclasses

  import jax
  import optax

  import piper_jax as pj
  from hardware import memory_bytes
  from predict import baseline_costs
  data = [json.load(open(f)) for f in args.files]
  meta = data[0]["meta"]
  rows = [r for d in data for r in d["rows"] if "error" not in r]
  model, n, kind = rows[0]["model"], rows[0]["devices"], rows[0]["device_kind"]
  costs, base = baseline_costs(rows, args.link_gbps * 1e9, meta, args.seq_len, args.layers)
  if base is None:
    raise ValueError("the files hold no jit-dp, gspmd-fsdp or shmap-dp row: the estimates "
                     "take their matmul FLOP/s from the call's plain-JAX baseline; add a file "
                     "with one")
  config = run._config(model, args.regions, attention="xla+remat",
                       seq_len=meta.get("seq_len") or args.seq_len,
                       layers=meta.get("layers") or args.layers)
  family = run.step_family(model)
  net = run.make_net(model, config)
  params, batch = run.shapes(family, net, config, meta["batch"])
  tx = optax.adamw(1e-4, weight_decay=0.1)
  if args.calibrate:
    # Timed with the attention the rows ran (cuDNN's keeps what XLA's recomputed keeps,
    # at its own speed) and real token ids (an embedding's gradient scatters by them).
    timed_config = run._config(model, args.regions, attention=rows[0].get("attention"),
                               seq_len=meta.get("seq_len") or args.seq_len,
                               layers=meta.get("layers") or args.layers)
    values = family.random_batch(config, jax.random.PRNGKey(0), meta["batch"])
    share = meta["batch"] // n  # a device's rows, down to the smallest microbatch tried
    times = pj.calibrate(family.loss_fn(run.make_net(model, timed_config)), params, values,
                         sorted({share, max(1, share // 8)}), cache=args.calibrate,
                         optimizer=tx)
    costs = dataclasses.replace(costs, region_times=times)
  found = pj.strategies.search(family.loss_fn(net), tx, params, batch, n, memory_bytes(kind),
                               costs=costs)
  measured = {}  # a later file's row of a variant stands for it
  for r in rows:
    if run.split_variant(r["variant"])[1] in ([], ["ep"]):
      measured[r["variant"]] = r
  print("| strategy | microbatches | estimated ms | measured ms (variant) | peak GiB estimated | measured |")
  print("| --- | --- | --- | --- | --- | --- |")
  for c in found.candidates[:args.top]:
    v = variant_of(c)
    r = measured.get(v) if v and (c.schedule == "dp" or c.n_microbatches == meta["microbatches"]) else None
    got = f"{r['step_ms']:.1f} ({v})" if r else "-"
    peak = f"{r['peak_gib']:.2f}" if r else "-"
    print(f"| {c.name} | {c.n_microbatches} | {c.step_time * 1e3:.1f} | {got} | "
          f"{c.peak_memory / 2**30:.2f} | {peak} |")
  best = min(rows, key=lambda r: r["step_ms"])
  pick = measured.get(variant_of(found.best))
  if pick:
    print(f"\npicked {found.best.name}: measured {pick['step_ms']:.1f} ms, "
          f"{pick['step_ms'] / best['step_ms']:.3f}x the fastest measured row "
          f"({best['variant']}, {best['step_ms']:.1f} ms)")
  else:
    print(f"\npicked {found.best.name}: not among the measured rows")


if __name__ == "__main__":
  main()
