"""Trains the example GPT under a piper-jax strategy.

Without a GPU it runs on 8 simulated CPU devices:

  python examples/train_gpt.py --strategy pp-1f1b --stages 2 --dp 4 --zero 1 \
      --microbatches 4 --steps 6

Strategies: dp, zero1, zero2, zero3 (data parallel over all devices, ZeRO level
K) and pp-gpipe, pp-1f1b (`--stages` pipeline stages, `--microbatches`, times
`--dp` data-parallel replicas with ZeRO level `--zero`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_NUM_CPU_DEVICES = 8


def _configure_cpu_devices() -> None:
  """Asks for 8 CPU devices; must run before JAX's backend initialises."""
  if os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu"):
    return
  flag = "--xla_force_host_platform_device_count"
  if flag in os.environ.get("XLA_FLAGS", ""):
    return  # the user chose a count
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", _NUM_CPU_DEVICES)
  except AttributeError:
    # Older JAX without the option: XLA reads the flag when the backend starts.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" {flag}={_NUM_CPU_DEVICES}").strip()
  except RuntimeError:
    pass  # backend already running (e.g. called from a test): use its devices


_configure_cpu_devices()

# Run as a script without an installed piper_jax: import it from the repository.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.append(_REPO)

import jax
import jax.numpy as jnp
import optax

import piper_jax as pj

try:
  from examples import gpt
except ImportError:
  import gpt  # run as a script: examples/ is on sys.path

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "pp-gpipe", "pp-1f1b")


class UsageError(ValueError):
  """Flags that do not fit together or do not fit the devices."""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--strategy", choices=STRATEGIES, default="pp-1f1b")
  p.add_argument("--stages", type=int, default=2,
                 help="pipeline stages (pp-* strategies)")
  p.add_argument("--microbatches", type=int, default=4,
                 help="microbatches per step (pp-* strategies)")
  p.add_argument("--dp", type=int, default=1,
                 help="data-parallel degree (pp-* strategies)")
  p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                 help="ZeRO level (pp-* strategies)")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--batch", type=int, default=16, help="global batch size")
  p.add_argument("--model", choices=tuple(gpt.PRESETS), default="tiny")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute dtype (parameters stay float32)")
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def build_strategy(args, n_devices: int):
  """Returns (directives, number of devices used, number of model stages)."""
  if not args.strategy.startswith("pp-"):
    if args.dp != 1 or args.zero != 0:
      raise UsageError(
          f"--dp and --zero apply to pp-* strategies; --strategy "
          f"{args.strategy} is data parallel over all {n_devices} devices")
    zero = 0 if args.strategy == "dp" else int(args.strategy[-1])
    if args.batch % n_devices:
      raise UsageError(
          f"--batch {args.batch} must be divisible by the {n_devices} devices "
          f"of data parallelism")
    return pj.strategies.data_parallel(n_devices, zero=zero), n_devices, 1

  n_used = args.stages * args.dp
  if args.stages < 1 or args.dp < 1 or n_used > n_devices:
    raise UsageError(
        f"--stages {args.stages} x --dp {args.dp} needs {n_used} devices but "
        f"only {n_devices} are available; lower --stages or --dp")
  if args.batch % (args.dp * args.microbatches):
    raise UsageError(
        f"--batch {args.batch} must be divisible by --dp {args.dp} x "
        f"--microbatches {args.microbatches}")
  schedule = args.strategy[len("pp-"):]
  directives = pj.strategies.pipeline(
      args.stages, args.microbatches, schedule=schedule, dp=args.dp,
      zero=args.zero)
  return directives, n_used, args.stages


def main(argv=None) -> dict:
  """Runs the training job; returns {"losses", "tokens_per_s", "step", "state"}."""
  args = parse_args(argv)
  devices = jax.devices()
  directives, n_used, n_stages = build_strategy(args, len(devices))
  devices = devices[:n_used]

  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
  try:
    config = gpt.get_config(args.model, n_stages=n_stages, dtype=dtype)
  except ValueError as e:
    raise UsageError(f"--stages {n_stages}: {e}") from e
  model = gpt.GPT(config)
  rng = jax.random.PRNGKey(args.seed)
  params = gpt.init_params(model, rng)
  data_rng = jax.random.fold_in(rng, 1)
  batch = gpt.random_batch(config, data_rng, args.batch)
  optimizer = optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(args.lr))

  print(f"devices: {len(devices)} x {devices[0].device_kind} "
        f"({devices[0].platform})")
  print(f"model: {args.model}, {gpt.count_params(params) / 1e6:.2f}M params, "
        f"{config.n_layers} layers in {config.n_stages} stage(s), {args.dtype}")
  print(f"strategy: {args.strategy}")

  step = pj.compile(gpt.loss_fn(model), optimizer, directives, params, batch,
                    devices=devices)
  print(step.plan)
  state = step.init(params)

  tokens_per_step = args.batch * config.seq_len
  losses, times = [], []
  for i in range(args.steps):
    if i > 0:
      batch = jax.block_until_ready(gpt.random_batch(
          config, jax.random.fold_in(data_rng, i), args.batch))
    start = time.perf_counter()
    state, loss = step(state, batch)
    loss = float(jax.block_until_ready(loss))
    elapsed = time.perf_counter() - start
    losses.append(loss)
    if i == 0:
      print(f"step {i:4d}  loss {loss:.4f}  (compile + run {elapsed:.1f}s)")
    else:
      times.append(elapsed)
      print(f"step {i:4d}  loss {loss:.4f}  "
            f"{tokens_per_step / elapsed:,.0f} tok/s")

  tokens_per_s = tokens_per_step * len(times) / sum(times) if times else None
  if tokens_per_s is not None:
    print(f"mean throughput (steps 1-{args.steps - 1}): "
          f"{tokens_per_s:,.0f} tok/s")
  return {"losses": losses, "tokens_per_s": tokens_per_s, "step": step,
          "state": state}


if __name__ == "__main__":
  try:
    main()
  except UsageError as e:
    sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")
