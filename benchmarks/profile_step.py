"""Profiles a few steps of one benchmark variant with jax.profiler (for reading the trace).

  python benchmarks/profile_step.py --variant pp-1f1b --model 268m --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variant", default="pp-1f1b")
  ap.add_argument("--model", default="268m")
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  import jax
  import optax

  import piper_jax as pj
  from benchmarks.run import _config
  from examples import gpt

  n = len(jax.devices())
  config = _config(args.model, 2)
  net = gpt.GPT(config)
  params = gpt.init_params(net, jax.random.PRNGKey(0))
  batch = gpt.random_batch(config, jax.random.PRNGKey(1), 16)
  directives = pj.strategies.pipeline(2, args.microbatches, schedule=args.variant[3:], dp=n // 2)
  step = pj.compile(gpt.loss_fn(net), optax.adamw(1e-4), directives, params, batch)
  state = step.init(params)
  hlo = step.lower(state, batch).compile().as_text()
  with open(os.path.join(args.out, "step.hlo.txt"), "w") as f:
    f.write(hlo)
  print("conditionals in optimized HLO:", hlo.count(" conditional("), flush=True)
  for _ in range(2):
    state, loss = step(state, batch)
  loss.block_until_ready()
  with jax.profiler.trace(os.path.join(args.out, "trace")):
    for _ in range(2):
      state, loss = step(state, batch)
    loss.block_until_ready()


if __name__ == "__main__":
  main()
