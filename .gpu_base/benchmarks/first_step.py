"""Does a plain-JAX step of a Qwen3 preset start, finish and keep the GPU ahead of the host?

  python3 benchmarks/first_step.py --model qwen3-8b --layers 8 --seq-len 4096 --batch 4 \\
      --modes fsdp --attention cudnn,xla

Each case runs in a child process with a timeout; a child that is stuck prints Python's
stack (faulthandler), so a row says whether the first call itself never returned. The
step is `jax.value_and_grad` + adamw, jitted on one device (`jit`), GSPMD FSDP over all
of them (`fsdp`: every leaf's largest divisible dimension sharded, as `run.py`'s
gspmd-fsdp), or the loss alone (`fwd`). A row: compile s, XLA's count of the program's
memory and the allocator's limit, the first call's return and end, host ms (until a
step's call returns) and step ms (loss to loss, each call made before the previous loss
is waited for). `--keep-unsharded` keeps the parameters as initialised on device 0
beside the sharded state, as a script that forgets them does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(args):
  import faulthandler

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from benchmarks.run import loop_steps
  from examples import qwen3

  faulthandler.dump_traceback_later(args.stack_after, exit=False)
  cfg = qwen3.get_config(args.model, n_layers=args.layers or qwen3.PRESETS[args.model]["n_layers"],
                         seq_len=args.seq_len or qwen3.PRESETS[args.model]["seq_len"],
                         dtype=jnp.bfloat16, param_dtype=jnp.float32,
                         attention=None if args.attention == "auto" else args.attention)
  model = qwen3.make_model(cfg)
  loss_fn = qwen3.loss_fn(model)
  params = qwen3.init_params(model, jax.random.PRNGKey(0))
  batch = qwen3.random_batch(cfg, jax.random.PRNGKey(1), args.batch)
  tx = optax.adamw(1e-4)

  def step(state, b):
    p, o = state
    if args.mode == "fwd":
      return state, loss_fn(p, b)
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return (optax.apply_updates(p, u), o), loss

  state = (params, tx.init(params))
  jitted = jax.jit(step, donate_argnums=0)
  if args.mode == "fsdp":
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from benchmarks.run import fsdp_shardings
    mesh = Mesh(np.array(jax.devices()), ("d",))
    state_sh = (fsdp_shardings(params, mesh), fsdp_shardings(jax.eval_shape(tx.init, params), mesh))
    batch_sh = NamedSharding(mesh, P("d"))
    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                     donate_argnums=0)
    state, batch = jax.device_put(state, state_sh), jax.device_put(batch, batch_sh)
  if not args.keep_unsharded:
    params = None
  t0 = time.perf_counter()
  compiled = jitted.lower(state, batch).compile()
  row = {"compile_s": time.perf_counter() - t0}
  m = compiled.memory_analysis()
  row["xla_gib"] = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                    + m.temp_size_in_bytes) / 2**30
  row["limit_gib"] = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0) / 2**30
  print(f"[first_step] compiled: {row}", file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  state, loss = compiled(state, batch)
  row["first_call_s"] = time.perf_counter() - t0
  print(f"[first_step] first call returned in {row['first_call_s']:.2f} s", file=sys.stderr,
        flush=True)
  loss.block_until_ready()
  row["first_step_s"] = time.perf_counter() - t0
  state, loss, step_s, host_s = loop_steps(compiled, state, [batch], args.steps)
  row["host_ms"], row["step_ms"] = host_s * 1e3, step_s * 1e3
  row["peak_gib"] = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0)
                        for d in jax.local_devices()) / 2**30
  print("ROW " + json.dumps(row), flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="qwen3-8b")
  ap.add_argument("--layers", type=int, default=0, help="blocks (default: the preset's)")
  ap.add_argument("--seq-len", type=int, default=0)
  ap.add_argument("--batch", type=int, default=2, help="global batch (sequences)")
  ap.add_argument("--modes", default="jit", help="comma list of jit, fsdp, fwd")
  ap.add_argument("--attention", default="auto", help="comma list of auto, cudnn, xla")
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--keep-unsharded", action="store_true")
  ap.add_argument("--timeout", type=int, default=120, help="seconds per case")
  ap.add_argument("--stack-after", type=int, default=60, help="a stuck child's stack after this")
  ap.add_argument("--out", default=None, help="JSON output path")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    args.mode, args.attention = args.child.split(",")
    return child(args)
  rows = []
  for mode, attention in itertools.product(args.modes.split(","), args.attention.split(",")):
    case = dict(model=args.model, layers=args.layers, seq_len=args.seq_len, batch=args.batch,
                mode=mode, attention=attention, keep_unsharded=args.keep_unsharded,
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{mode},{attention}"]
    cmd += [a for a in sys.argv[1:] if a != "--child"]
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
      out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
      err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
      case["error"] = f"timed out after {args.timeout} s"
    row = next((json.loads(l[4:]) for l in out.splitlines() if l.startswith("ROW ")), {})
    said = [l.strip() for l in err.splitlines() if l.startswith("[first_step]")]
    stack = [l.strip().replace(ROOT + os.sep, "") for l in err.splitlines()
             if l.startswith("  File")]
    case.update(row, wall_s=time.time() - t0, said=said[-1:], stack=stack[-8:])
    if not row and "error" not in case:
      case["error"] = (err.strip().splitlines() or ["no output"])[-1]
    print(json.dumps(case), flush=True)
    rows.append(case)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
