"""What one tick of a pipeline loop costs beyond its kernels, on 2 or more GPUs.

  python3 benchmarks/tick_overhead.py                  # all visible GPUs
  python3 benchmarks/tick_overhead.py --cpu            # 2 simulated CPU devices, tiny sizes

A piper-jax pipeline runs its ticks as one `lax.fori_loop` whose body chooses each
rank's task with `lax.switch`, sends what a tick made to the next rank with
`lax.ppermute`, and writes it into a store at a dynamic row. This times that loop's
parts apart, in one shard_map over all devices, each variant a program of its own:

  plain            every branch in turn, without a switch or an exchange (an iteration
                   runs them all, as so many ticks, over as many fewer iterations)
  switch           each rank's branch chosen from a table, as the pipeline loop does
  permute          no switch; each tick sends its output to the next rank
  switch+permute   both: the pipeline loop's tick
  overlap          switch+permute, each iteration sending the previous one's output, so
                   that the exchange may run beside the switch (a message a tick late)
  unrolled         switch+permute with the iterations unrolled (no while loop)

each compiled with piper-jax's pipeline options (`Program.compiler_options`: the
conditional and the loop as CUDA graphs) and with XLA's own (`+xla`). `--branches`, `--slots` and
`--rounds` give the switch as many branches as a pipeline's task kinds, an inner loop
of that many switches per iteration, and that many exchanges; `--acc` carries fp32
gradient sums of every layer that the odd branches add their weight gradients to, as a
pipeline's backward does. A branch is
`--layers` bf16 matmuls of `--rows` x `--width` with a normalisation between them (a few
kernels each, as a transformer block's are); the two branches cost the same (one reads
the weights transposed, each scales by its own constant), and the ranks take them in turn. It prints, per variant, the median step
time over `--reps` calls and the time per iteration over `plain`'s: what a tick costs
beyond its compute. The JSON (`--out`) holds every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

VARIANTS = ("plain", "switch", "permute", "switch+permute", "overlap", "unrolled")


def build(variant: str, devices, layers: int, rows: int, width: int, iters: int,
          compiler_options: dict, n_branches: int = 2, slots: int = 1, rounds: int = 1,
          acc: bool = False):
  """A jitted step(x, ws) -> (y, store, grad sums) running `variant`'s loop on `devices`."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  n = len(devices)
  mesh = Mesh(np.array(devices), ("pp",))
  table = np.array([[[(i * slots + s + r) % n_branches for s in range(slots)]
                     for i in range(iters)] for r in range(n)], np.int32)

  def layer_stack(xg, ws, b):
    x, g = xg
    for k in range(layers):
      h = (x @ (ws[k].T if b % 2 else ws[k])) * (1.0 + b / 64)
      h = h * lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True)
                        + 1e-6).astype(h.dtype)
      if acc and b % 2:  # a backward's weight gradient, added to the step's sum
        g = g.at[k].add(lax.dot_general(x, h, (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32))
      x = x + jax.nn.gelu(h)
    return x, g

  branches = [lambda xg, ws, b=b: layer_stack(xg, ws, b) for b in range(n_branches)]
  switch = "switch" in variant or variant in ("unrolled", "overlap")
  permute = "permute" in variant or variant in ("unrolled", "overlap")
  perm = [(j, (j + 1) % n) for j in range(n)]

  def run_slots(i, xg, ws, tab):
    if slots == 1:
      return lax.switch(tab[0, i, 0], branches, xg, ws)
    return lax.fori_loop(0, slots, lambda s, xg: lax.switch(tab[0, i, s], branches, xg, ws), xg)

  def exchange(y):
    for k in range(rounds):  # the later rounds the other way, as a backward's messages go
      y = lax.ppermute(y, "pp", perm if k % 2 == 0 else [(b, a) for a, b in perm])
    return y

  def tick(i, x, g, store, ws, tab):
    # Without a switch an iteration runs every branch in turn, each a tick of its own.
    for b in (None,) if switch else range(n_branches):
      if b is None:
        y, g = run_slots(i, (x, g), ws, tab)
      else:
        y = x
        for _ in range(slots):
          y, g = branches[b]((y, g), ws)
      if permute:
        y = exchange(y)
      store = lax.dynamic_update_slice(store, y[None], (i % store.shape[0], 0, 0))
      x = y
    return x, g, store

  def body(x, ws, tab):
    store = jnp.zeros((4,) + x.shape, x.dtype)
    g = jnp.zeros((layers, width, width) if acc else (1,), jnp.float32)
    n_iter = iters if switch else iters // n_branches
    if variant == "unrolled":
      for i in range(iters):
        x, g, store = tick(i, x, g, store, ws, tab)
      return x, store, g
    if variant == "overlap":
      def late(i, c):
        x, g, pending, store = c
        y, g = run_slots(i, (x, g), ws, tab)
        store = lax.dynamic_update_slice(store, y[None], (i % store.shape[0], 0, 0))
        return exchange(pending), g, y, store
      x, g, _, store = lax.fori_loop(0, iters, late, (x, g, x, store))
      return x, store, g
    x, g, store = lax.fori_loop(0, n_iter, lambda i, c: tick(i, *c, ws, tab), (x, g, store))
    return x, store, g

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("pp"), P(), P("pp")),
                     out_specs=(P("pp"), P(None, "pp"), P("pp")), check_vma=False)
  step = jax.jit(fn, compiler_options=compiler_options or None)
  key = jax.random.PRNGKey(0)
  x = jax.device_put(jax.random.normal(key, (n * rows, width), jnp.bfloat16),
                     NamedSharding(mesh, P("pp")))
  ws = jax.device_put(jax.random.normal(key, (layers, width, width), jnp.bfloat16) / width ** 0.5,
                      NamedSharding(mesh, P()))
  tab = jax.device_put(jnp.asarray(table), NamedSharding(mesh, P("pp")))
  return step, (x, ws, tab)


def time_variant(step, args, reps: int) -> list[float]:
  import jax

  jax.block_until_ready(step(*args))  # compile and warm up
  jax.block_until_ready(step(*args))
  out = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    out.append((time.perf_counter() - t0) * 1e3)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cpu", action="store_true", help="2 simulated CPU devices, tiny sizes")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--rows", type=int, default=4096)
  ap.add_argument("--width", type=int, default=2048)
  ap.add_argument("--iters", type=int, default=32)
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--branches", type=int, default=2,
                  help="distinct branches of the switch (the pipeline's task kinds)")
  ap.add_argument("--slots", type=int, default=1,
                  help="switches per iteration, in an inner loop (tasks a rank runs per tick)")
  ap.add_argument("--rounds", type=int, default=1,
                  help="ppermutes per iteration, alternating direction")
  ap.add_argument("--acc", action="store_true",
                  help="carry fp32 weight-gradient sums of every layer through the loop, added "
                       "to by the odd branches (a backward), passed through by the others")
  ap.add_argument("--options", choices=("both", "pj", "xla"), default="both",
                  help="compile with piper-jax's pipeline options, XLA's, or both")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()
    args.layers, args.rows, args.width, args.iters, args.reps = 2, 8, 16, 6, 2
  import jax

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from piper_jax.lowering.program import PIPELINE_XLA_OPTIONS

  devices = jax.devices()[:2] if args.cpu else jax.devices()
  gpu = devices[0].platform == "gpu"
  rows = []
  for variant in args.variants.split(","):
    names = {"both": ("pj", "xla"), "pj": ("pj",), "xla": ("xla",)}[args.options]
    for opts_name in (names if gpu else ("xla",)):
      opts = dict(PIPELINE_XLA_OPTIONS) if opts_name == "pj" else {}
      step, inputs = build(variant, devices, args.layers, args.rows, args.width, args.iters, opts,
                           args.branches, args.slots, args.rounds, args.acc)
      times = time_variant(step, inputs, args.reps)
      rows.append({"variant": variant if opts_name == "pj" else variant + "+xla",
                   "step_ms": statistics.median(times), "times_ms": times})
      print(f"{rows[-1]['variant']:>22}: {rows[-1]['step_ms']:.2f} ms", flush=True)
  base = {r["variant"].endswith("+xla"): r["step_ms"] for r in rows if r["variant"].startswith("plain")}
  print(f"\n{len(devices)} x {devices[0].device_kind}, {args.iters} iterations of {args.slots} "
        f"slot(s) over {args.branches} branches of {args.layers} layers of {args.rows} x "
        f"{args.width}, {args.rounds} round(s)" + (", gradient sums carried" if args.acc else ""))
  print(f"{'variant':>22} | step ms | ms per iteration over plain")
  for r in rows:
    plain = base.get(r["variant"].endswith("+xla"))
    extra = "" if plain is None else f"{(r['step_ms'] - plain) / args.iters:+.3f}"
    r["per_iter_over_plain_ms"] = None if plain is None else (r["step_ms"] - plain) / args.iters
    print(f"{r['variant']:>22} | {r['step_ms']:7.2f} | {extra}")
  out = args.out or (os.path.join(os.environ["OUT"], "tick_overhead.json") if os.environ.get("OUT") else None)
  if out:
    with open(out, "w") as f:
      json.dump({"devices": len(devices), "device_kind": devices[0].device_kind,
                 "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows},
                f, indent=1)


if __name__ == "__main__":
  main()
