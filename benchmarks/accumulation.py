"""Gradient accumulation and stages sharing one device, against plain JAX in the same call.

Rows, each at a global batch and a microbatch count, on the first device:
  jit       plain `jax.jit` of value_and_grad + the optimizer, the whole batch at once;
  scan      plain accumulation: value_and_grad over `lax.scan` of the microbatches;
  split     piper-jax `[pj.split(k)]` (accumulation on one device);
  1f1b      piper-jax 1F1B over the model's 2 pipeline regions, both on the device.
Each row gives its step time (median of `--steps` after `--warmup`), XLA's count of its
compiled program's memory and its compile time (lower + compile; for piper-jax's rows
`pj.compile`'s tracing and planning too), and the ratios to the
`scan` row of the same batch and microbatch count.

  python benchmarks/accumulation.py --model tiny --batch 32 --microbatches 2,8,32   # CPU
  python benchmarks/accumulation.py --model qwen3-1.7b --seq-len 2048 --dtype bfloat16 \\
      --batch 16 --microbatches 8 --rows jit,scan,split                               # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import piper_jax as pj  # noqa: E402
from examples import gpt, qwen3  # noqa: E402
from piper_jax.memory import CompiledMemory  # noqa: E402


def _model(name: str, seq_len: int, dtype):
  family = qwen3 if name in qwen3.PRESETS else gpt
  overrides = {"seq_len": seq_len} if seq_len else {}
  config = family.get_config(name, n_stages=2, dtype=dtype, **overrides)
  model = qwen3.make_model(config) if family is qwen3 else gpt.GPT(config)
  params = family.init_params(model, jax.random.PRNGKey(0))
  return family, config, family.loss_fn(model), params


def _plain(loss_fn, tx, params, batch, k: int):
  """The plain program: value_and_grad over `k` scanned microbatches (k=1: all at once)."""

  def grads(p, b):
    if k == 1:
      return jax.value_and_grad(loss_fn)(p, b)
    mbs = jax.tree_util.tree_map(lambda x: x.reshape(k, -1, *x.shape[1:]), b)

    def body(total, mb):
      return jax.tree_util.tree_map(jnp.add, total, jax.value_and_grad(loss_fn)(p, mb)), None

    # The sum starts at zero inside the scan, so no microbatch's activations live
    # outside it (run.py's accumulation starts from the first microbatch instead).
    zero = (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, p))
    total, _ = jax.lax.scan(body, zero, mbs)
    return jax.tree_util.tree_map(lambda x: x / k, total)

  def step(p, o, b):
    loss, g = grads(p, b)
    updates, o = tx.update(g, o, p)
    return optax.apply_updates(p, updates), o, loss

  started = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), batch).compile()
  compile_s = time.perf_counter() - started
  state = [jax.tree_util.tree_map(jnp.copy, params), tx.init(params)]

  def run():
    state[0], state[1], loss = compiled(state[0], state[1], batch)
    return loss

  return compiled, compile_s, run


def _piper(loss_fn, tx, params, batch, k: int, row: str):
  directives = [pj.split(k)]
  if row == "1f1b":
    directives += [pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [0])]
    directives += pj.schedules.one_f_one_b(2, k)
  started = time.perf_counter()  # pj.compile's tracing and planning count as compiling
  step = pj.compile(loss_fn, tx, directives, params, batch, devices=jax.devices()[:1])
  compiled = step.compile()
  compile_s = time.perf_counter() - started
  state = [step.init(params)]

  def run():
    state[0], loss = step(state[0], batch)
    return loss

  return compiled, compile_s, run


def measure(row: str, loss_fn, tx, params, batch, k: int, steps: int, warmup: int) -> dict:
  if row in ("jit", "scan"):
    compiled, compile_s, run = _plain(loss_fn, tx, params, batch, 1 if row == "jit" else k)
  else:
    compiled, compile_s, run = _piper(loss_fn, tx, params, batch, k, row)
  memory = CompiledMemory.of(compiled).total
  for _ in range(warmup):
    jax.block_until_ready(run())
  times = []
  for _ in range(steps):
    started = time.perf_counter()
    loss = jax.block_until_ready(run())
    times.append(time.perf_counter() - started)
  return {"row": row, "microbatches": 1 if row == "jit" else k, "step_ms": 1e3 * statistics.median(times),
          "memory_gib": memory / 2**30, "compile_s": compile_s, "loss": float(loss)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--seq-len", type=int, default=0)
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--microbatches", default="2,8,32", help="comma-separated counts")
  ap.add_argument("--rows", default="scan,split,1f1b", help="of jit, scan, split, 1f1b")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--out", default=None, help="JSON output path")
  args = ap.parse_args(argv)
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
  family, config, loss_fn, params = _model(args.model, args.seq_len, dtype)
  tx = optax.adamw(1e-4)
  batch = family.random_batch(config, jax.random.PRNGKey(1), args.batch)
  device = jax.devices()[0]
  print(f"{args.model}, batch {args.batch}, {args.dtype}, on {device.device_kind}")
  results = []
  print("| microbatches | row | step ms | memory GiB | compile s | vs scan: time | memory | compile |")
  print("|---|---|---|---|---|---|---|---|")
  for k in [int(x) for x in args.microbatches.split(",")]:
    base = None
    for row in args.rows.split(","):
      if row == "jit" and k != int(args.microbatches.split(",")[0]):
        continue  # one row without accumulation per call
      r = measure(row, loss_fn, tx, params, batch, k, args.steps, args.warmup)
      r["model"], r["batch"], r["device"] = args.model, args.batch, device.device_kind
      results.append(r)
      base = r if row == "scan" else base
      ratio = (lambda key: f"{r[key] / base[key]:.2f}x") if base and row != "jit" else (lambda key: "")
      print(f"| {k} | {row} | {r['step_ms']:.1f} | {r['memory_gib']:.3f} | {r['compile_s']:.1f} | "
            f"{ratio('step_ms')} | {ratio('memory_gib')} | {ratio('compile_s')} |", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
