"""`pj.compile`'s own work for run.py's variants: tracing, planning and region analysis,
without XLA (the `build_s` of run.py's rows, alone and repeated).

  python benchmarks/build_time.py --model 1.3b --pp 4 --batch 16 --microbatches 8 \
      --variants pp-1f1b,pp-dualpipev,pp-interleaved
  python benchmarks/build_time.py --small            # tiny GPT on 8 CPU devices

Parameters and batches are `jax.ShapeDtypeStruct`s, so no model is allocated; the
directives and lowering options are run.py's for the same variant on this machine's
devices. Prints the median and every repetition of each variant, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402


def build_seconds(variant: str, model: str, batch: int, microbatches: int, pp: int,
                  reps: int, seq_len: int = 0) -> list[float]:
  """Wall seconds of `pj.compile` for `variant`, `reps` times."""
  import jax
  import optax

  import piper_jax as pj

  n = len(jax.devices())
  config, net, directives = run.build(variant, model, n, microbatches, pp, 0, None, seq_len)
  if directives is None:
    raise ValueError(f"{variant!r} is a plain-JAX baseline: it has no pj.compile to time")
  family = run.step_family(model)
  params, example = run.shapes(family, net, config, batch)
  tx = optax.adamw(1e-4, weight_decay=0.1)
  options = run.lowering_options(run.split_variant(variant)[1])
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    pj.compile(family.loss_fn(net), tx, directives, params, example, options=options)
    times.append(time.perf_counter() - t0)
  return times


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="1.3b")
  ap.add_argument("--variants", default="pp-1f1b,pp-dualpipev")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--pp", type=int, default=4)
  ap.add_argument("--seq-len", type=int, default=0)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--small", action="store_true", help="tiny model on 8 simulated CPU devices")
  ap.add_argument("--out", default=None, help="JSON output path")
  args = ap.parse_args(argv)
  run._setup_cpu(args.small)
  import jax  # after the CPU devices are set up
  model = "tiny" if args.small else args.model
  rows = []
  for variant in args.variants.split(","):
    times = build_seconds(variant, model, args.batch, args.microbatches, args.pp, args.reps,
                          args.seq_len)
    rows.append({"variant": variant, "model": model, "devices": len(jax.devices()),
                 "device_kind": jax.devices()[0].device_kind, "batch": args.batch,
                 "microbatches": args.microbatches, "pp": args.pp,
                 "build_s": statistics.median(times), "build_s_all": times})
    print(f"{model} {variant} pp{args.pp} {args.batch}/{args.microbatches}: "
          f"{statistics.median(times):.2f} s ({', '.join(f'{t:.2f}' for t in times)})", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
