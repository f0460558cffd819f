"""Profiles a few steps of one benchmark variant and says where the GPU time went.

  python benchmarks/profile_step.py --variant pp-1f1b --model 268m --out DIR

Writes a jax.profiler trace (with a Perfetto JSON; with --hlo, the optimized HLO)
under DIR and prints, for the first GPU (`--gpus 0,1` for more): the wall time of the
profiled steps, the time some kernel ran (busy), the largest idle gaps, and the kernels
that took the most time, grouped by name with digits removed.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _union(events) -> list[tuple[float, float]]:
  out: list[list[float]] = []
  for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def _overlap(events, others) -> float:
  """Time (us) the spans of `events` overlap the union of `others`' spans."""
  busy, total = _union(others), 0.0
  for a, b in _union(events):
    total += sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if x < b and y > a)
  return total


def load_trace(trace_path: str) -> list[dict]:
  """The events of a Perfetto JSON trace (gzipped), read once for every summary."""
  with gzip.open(trace_path, "rt") as f:
    return json.load(f)["traceEvents"]


def summarize(events: list[dict], top: int = 15, named: int = 0, gpu: int = 0) -> str:
  """A text summary of GPU `gpu`'s kernels in a Perfetto JSON trace.

  Kernels are grouped by name with digits removed (`top` groups); `named` more lines
  list single kernel names (as the optimized HLO names its fusions) by total time.
  """
  gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and re.search(rf"/device:GPU:{gpu}\b", str(e.get("args", {}).get("name", "")))}
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and e.get("dur")]
  if not kernels:
    names = sorted({str(e.get("args", {}).get("name")) for e in events
                    if e.get("ph") == "M" and e.get("name") == "process_name"})
    return f"no GPU:{gpu} kernels in the trace; its processes: {names}"
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
  busy, gaps, end = 0.0, [], spans[0][0]
  start = end
  for a, b in spans:
    if a > end:
      gaps.append(a - end)
    busy += max(0.0, b - max(a, end))
    end = max(end, b)
  wall = end - start
  by_name = collections.defaultdict(lambda: [0.0, 0])
  for e in kernels:
    key = re.sub(r"\d+", "#", e["name"])[:70]
    by_name[key][0] += e["dur"]
    by_name[key][1] += 1
  short = [e["dur"] for e in kernels if e["dur"] < 10]
  nccl = [e for e in kernels if "nccl" in e["name"].lower()]
  hidden = _overlap(nccl, [e for e in kernels if "nccl" not in e["name"].lower()])
  lines = [f"GPU:{gpu} {len(kernels)} kernels over {wall / 1e3:.1f} ms: busy {busy / 1e3:.1f} ms "
           f"({100 * busy / wall:.0f}%), {len(short)} kernels under 10 us ({sum(short) / 1e3:.1f} ms)",
           "largest idle gaps (us): " + ", ".join(f"{g:.0f}" for g in sorted(gaps)[-8:][::-1]),
           f"idle gaps over 50 us: {sum(g for g in gaps if g > 50) / 1e3:.1f} ms in "
           f"{sum(g > 50 for g in gaps)}",
           f"NCCL kernels {sum(e['dur'] for e in nccl) / 1e3:.1f} ms, of which beside other "
           f"kernels {hidden / 1e3:.1f} ms"]
  for name, (dur, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
    lines.append(f"  {dur / 1e3:8.1f} ms {100 * dur / busy:5.1f}% x{count:<6d} {name}")
  if named:
    exact = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
      exact[e["name"][:70]][0] += e["dur"]
      exact[e["name"][:70]][1] += 1
    lines.append("by kernel name:")
    for name, (dur, count) in sorted(exact.items(), key=lambda kv: -kv[1][0])[:named]:
      lines.append(f"  {dur / 1e3:8.1f} ms x{count:<6d} {name}")
  return "\n".join(lines)


def host_summary(events: list[dict], top: int = 25) -> str:
  """The host's side of the profiled steps: events of the processes that are not GPUs
  (XLA's thunks, stream waits, copies to the host), grouped by name with digits removed,
  by total time. A GPU idle between ticks while the host waits here is a host-paced loop."""
  gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and "/device:GPU:" in str(e.get("args", {}).get("name", ""))}
  host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu_pids and e.get("dur")]
  by_name = collections.defaultdict(lambda: [0.0, 0])
  for e in host:
    key = re.sub(r"\d+", "#", e["name"])[:70]
    by_name[key][0] += e["dur"]
    by_name[key][1] += 1
  lines = [f"host: {len(host)} events"]
  for name, (dur, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
    lines.append(f"  {dur / 1e3:8.1f} ms x{count:<6d} {name}")
  return "\n".join(lines)


def tick_table(events: list[dict], gpus: list[int]) -> str:
  """Per GPU, the stretches between consecutive NCCL kernels (a pipeline's ticks end in
  one): compute-busy, idle and NCCL time of each, to see which rank waits in which tick."""
  lines = []
  for gpu in gpus:
    pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and re.search(rf"/device:GPU:{gpu}\b", str(e.get("args", {}).get("name", "")))}
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in pids
                      and e.get("dur")), key=lambda e: e["ts"])
    if not kernels:
      continue
    lines.append(f"GPU:{gpu} ticks (ms): start, compute busy, idle, nccl, kernels")
    t0, start, busy, end, count = kernels[0]["ts"], kernels[0]["ts"], 0.0, kernels[0]["ts"], 0
    for e in kernels:
      a, b = e["ts"], e["ts"] + e["dur"]
      if "nccl" in e["name"].lower():
        idle = (a - start) - busy if a > start else 0.0
        lines.append(f"  {(start - t0) / 1e3:7.2f} {busy / 1e3:6.2f} {max(idle, 0) / 1e3:6.2f} "
                     f"{e['dur'] / 1e3:6.2f} {count:5d}  {e['name'][:40]}")
        start, busy, count, end = b, 0.0, 0, max(end, b)
        continue
      busy += max(0.0, b - max(a, end))
      end, count = max(end, b), count + 1
    lines.append(f"  {(start - t0) / 1e3:7.2f} {busy / 1e3:6.2f} {max(end - start - busy, 0) / 1e3:6.2f} "
                 f"   -   {count:5d}  (to the last kernel)")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="pp-1f1b",
                  help="a variant of benchmarks/run.py (jit-dp, dp, zero3, pp-1f1b@z1+balanced, ...)")
  ap.add_argument("--model", default="268m")
  ap.add_argument("--pp", type=int, default=2)
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--steps", type=int, default=1)
  ap.add_argument("--attention", default=None, choices=["xla", "cudnn"])
  ap.add_argument("--hlo", action="store_true", help="also write the optimized HLO")
  ap.add_argument("--named", type=int, default=0, help="also list this many kernels by exact name")
  ap.add_argument("--gpus", default="0", help="comma list of GPUs to summarize (a pipeline's ranks)")
  ap.add_argument("--ticks", action="store_true",
                  help="also list each GPU's stretches between NCCL kernels (a pipeline's ticks)")
  ap.add_argument("--host", action="store_true",
                  help="also list the host's events (XLA thunks, waits) by total time")
  ap.add_argument("--keep", action="store_true", help="copy the Perfetto trace to OUT/trace.json.gz")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  # XLA runs without its CUDA graphs while profiling unless told otherwise; a pipeline's
  # ticks run as graphs, so profile what the benchmark runs.
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_enable_command_buffers_during_profiling" not in re.findall(r"--(?:no)?(\w+)", flags):
    os.environ["XLA_FLAGS"] = flags + " --xla_enable_command_buffers_during_profiling=true"
  import jax

  from benchmarks.run import make_step

  call, state, batches, _, _ = make_step(args.variant, args.model, args.batch, args.microbatches,
                                         args.pp, attention=args.attention)
  batch = batches[0]
  os.makedirs(args.out, exist_ok=True)
  if args.hlo:  # a second compilation: jit's call cache does not hold the lowered one
    hlo = call.lower(state, batch).compile().as_text()
    with gzip.open(os.path.join(args.out, "step.hlo.txt.gz"), "wt") as f:
      f.write(hlo)
    print("conditionals in optimized HLO:", hlo.count(" conditional("), flush=True)
  for _ in range(2):
    state, loss = call(state, batch)
  loss.block_until_ready()
  trace_dir = os.path.join(args.out, "trace")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(args.steps):
      state, loss = call(state, batch)
    loss.block_until_ready()
  newest = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
               key=os.path.getmtime)
  events = load_trace(newest)
  for gpu in args.gpus.split(","):
    print(summarize(events, named=args.named, gpu=int(gpu)), flush=True)
  if args.ticks:
    print(tick_table(events, [int(g) for g in args.gpus.split(",")]), flush=True)
  if args.host:
    print(host_summary(events), flush=True)
  if args.keep:
    import shutil
    shutil.copy(newest, os.path.join(args.out, "trace.json.gz"))


if __name__ == "__main__":
  main()
