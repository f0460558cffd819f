"""Compile run.py's variants without running them: XLA's compile time and its count of
each program's memory per device, for as many GPUs as a plan needs, on one.

  python3 benchmarks/compile_only.py --mock-gpus 4 --model 1.3b --pp 4 --batch 16 \
      --microbatches 8 --variants jit-dp,pp-1f1b,pp-dualpipev
  python3 benchmarks/compile_only.py --small        # tiny GPT on 8 simulated CPU devices

`--mock-gpus N` makes JAX see N GPUs of N processes while this machine has one (JAX's
mock GPU topology): XLA compiles the program one of them runs, autotuning on the local
GPU; nothing runs and nothing is allocated. So a 4- or 8-GPU plan's compile time and memory are
measured on a machine with one GPU. Each variant is built as run.py builds it, on
parameter and batch shapes: plain-JAX baselines as `jax.jit(...).lower(...).compile()`,
piper-jax ones as `pj.compile` (`build_s`, tracing, planning and region analysis) then
`TrainStep.memory()` (`compile_s`, XLA). It prints a row per variant, with its compile
time over its baseline's in the same process (run.py's `BASELINE_OF`), and writes the
rows as JSON to `--out` (default `$OUT/compile_only.json` when $OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402


def mock_gpus(n: int) -> None:
  """Before JAX starts its backend: N GPUs of N processes, one local. Autotuning is not
  shared between processes (each would wait for the others' results)."""
  import jax
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_shard_autotuning=false").strip()
  jax.config.update("jax_mock_gpu_topology", f"1x{n}x1")


def compile_variant(variant: str, model: str, batch: int, microbatches: int, pp: int,
                    seq_len: int = 0, attention: str | None = None, layers: int = 0) -> dict:
  """One variant built and compiled on shapes: its row."""
  import jax
  import optax

  import piper_jax as pj
  from examples import gpt
  from piper_jax.compile import CompiledMemory

  devices = jax.devices()
  base, mods = run.split_variant(variant)
  config, net, directives = run.build(variant, model, len(devices), microbatches, pp, 0,
                                      attention, seq_len, layers)
  family = run.step_family(model)
  params, example = run.shapes(family, net, config, batch)
  mask = (lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)) if "mask" in mods else None
  tx = optax.adamw(1e-4, weight_decay=0.1, mask=mask)
  loss_fn = family.loss_fn(net)
  row = {"variant": variant, "model": model, "devices": len(devices),
         "device_kind": devices[0].device_kind, "batch": batch,
         "attention": gpt.attention_implementation(config)}
  if base in run.BASELINES:
    call, (psh, osh, bsh) = run.baseline_call(base, devices, loss_fn, tx, params, microbatches,
                                              pp, batch)
    shaped = lambda tree, sh: jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    opt = jax.eval_shape(tx.init, params)
    b = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=bsh),
                               example)
    row["build_s"] = 0.0
    t0 = time.perf_counter()
    mem = CompiledMemory.of(call.lower((shaped(params, psh), shaped(opt, osh)), b).compile())
  else:
    t0 = time.perf_counter()
    step = pj.compile(loss_fn, tx, directives, params, example,
                      options=run.lowering_options(mods))
    row["build_s"] = time.perf_counter() - t0
    row["microbatches"] = step.plan.n_microbatches
    t0 = time.perf_counter()
    mem = step.memory()
  row["compile_s"] = time.perf_counter() - t0
  row["xla_gib"] = mem.total / 2**30
  row["memory"] = {k: getattr(mem, k) for k in ("arguments", "outputs", "aliased", "temporaries")}
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="1.3b")
  ap.add_argument("--variants", default="jit-dp,pp-1f1b,pp-dualpipev")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--pp", type=int, default=2)
  ap.add_argument("--seq-len", type=int, default=0)
  ap.add_argument("--attention", default=None, choices=["xla", "cudnn"])
  ap.add_argument("--layers", type=int, default=0, help="blocks instead of the preset's")
  ap.add_argument("--mock-gpus", type=int, default=0,
                  help="compile for this many GPUs of as many processes on this machine's one")
  ap.add_argument("--small", action="store_true", help="tiny model on 8 simulated CPU devices")
  ap.add_argument("--out", default=None, help="JSON output path")
  args = ap.parse_args(argv)
  run._setup_cpu(args.small)
  if args.mock_gpus:
    mock_gpus(args.mock_gpus)
  import jax  # after the devices are set up

  model = "tiny" if args.small else args.model
  rows = []
  out = args.out or (os.path.join(os.environ["OUT"], "compile_only.json")
                     if os.environ.get("OUT") else None)
  meta = {"model": model, "batch": args.batch, "microbatches": args.microbatches, "pp": args.pp,
          "seq_len": args.seq_len, "layers": args.layers, "mock_gpus": args.mock_gpus,
          "devices": len(jax.devices())}
  for variant in args.variants.split(","):
    try:
      row = compile_variant(variant, model, args.batch, args.microbatches, args.pp,
                            args.seq_len, args.attention, args.layers)
    except Exception as e:  # noqa: BLE001 - a row that does not build says why, the rest go on
      row = {"variant": variant, "model": model, "error": f"{type(e).__name__}: {e}"[:500]}
    rows.append(row)
    if out:  # after every row: a call cut short keeps what it compiled
      with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    done = {r["variant"]: r for r in rows if "error" not in r}
    base = done.get(run.BASELINE_OF(variant, model)) or done.get(
        "gspmd-fsdp" if run.BASELINE_OF(variant, model).startswith("jit-dp") else "")
    if "error" in row:
      print(f"{variant}: {row['error']}", flush=True)
      continue
    total = row["build_s"] + row["compile_s"]
    ratio = (f", {total / (base['build_s'] + base['compile_s']):.2f}x {base['variant']}"
             if base is not None and base is not row else "")
    print(f"{variant}: build {row['build_s']:.1f} s + XLA {row['compile_s']:.1f} s{ratio}; "
          f"XLA counts {row['xla_gib']:.2f} GiB per device", flush=True)
  return rows


if __name__ == "__main__":
  main()
