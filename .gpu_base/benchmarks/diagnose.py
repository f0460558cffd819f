"""Where does a pipeline step's time go? Times one-device variants of the same work.

  python benchmarks/diagnose.py --model 268m

Rows: plain jit on one GPU; piper-jax with everything placed on one GPU (no
switch, no ppermute), unsplit and split into microbatches; the 2-stage pipeline
with both stages on one GPU. Same card, same process order, median of --steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="268m")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=5)
  args = ap.parse_args()
  import jax
  import numpy as np
  import optax

  import piper_jax as pj
  from benchmarks.run import _config
  from examples import gpt

  def timeit(call, state, batch):
    state, loss = call(state, batch)
    loss.block_until_ready()
    ts = []
    for _ in range(args.steps):
      t0 = time.perf_counter()
      state, loss = call(state, batch)
      loss.block_until_ready()
      ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3

  tx = optax.adamw(1e-4)
  for name, n_stages, directives in [
      ("piper 1 region, 1 mb", 1, [pj.place({}, [0])]),
      ("piper 2 regions, 1 mb", 2, [pj.place({}, [0])]),
      ("piper 2 regions, 8 mb", 2, [pj.split(8), pj.place({}, [0])]),
      ("piper 1 region, 8 mb", 1, [pj.split(8), pj.place({}, [0])]),
  ]:
    config = _config(args.model, n_stages)
    net = gpt.GPT(config)
    loss_fn = gpt.loss_fn(net)
    params = gpt.init_params(net, jax.random.PRNGKey(0))
    batch = gpt.random_batch(config, jax.random.PRNGKey(1), args.batch)
    if name.startswith("piper 1 region, 1"):
      def plain(state, b):
        p, o = state
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss
      plain = jax.jit(plain, donate_argnums=0)
      own = jax.tree_util.tree_map(lambda x: x.copy(), params)
      print(f"plain jit: {timeit(plain, (own, tx.init(own)), batch):.1f} ms", flush=True)
    step = pj.compile(loss_fn, tx, directives, params, batch)
    t = timeit(step, step.init(params), batch)
    print(f"{name}: {t:.1f} ms  ticks={len(step.plan.ticks)}", flush=True)


if __name__ == "__main__":
  main()
