"""Planning time on one CPU of large pipeline x data-parallel plans (no devices, no tracing).

  python benchmarks/plan_time.py                 # the default cases, 1F1B and interleaved
  python benchmarks/plan_time.py --schedules 1f1b --cases 16x64x128
  python benchmarks/plan_time.py --traced        # also pj.plan of the GPT example (traces it)
  python benchmarks/plan_time.py --search 1024 --regions 4,36   # pj.strategies.search, Qwen3-8B shape

A case is PPxDPxMB: pipeline ranks, data-parallel replicas per rank, microbatches.
The default times `ir.make_plan` of a GPT-like `ModelSpec` built here (embedding and
blocks in the first stage, blocks and the tied head in the last): what is measured
is the compiler's passes and tick scheduling, not JAX. `--traced` also times
`pj.plan` of `examples/gpt.py` (1.3B widths, two blocks a stage), tracing included. Interleaved
runs two stages per rank, so it has twice the stages of its case's PP ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for examples/

import piper_jax as pj  # noqa: E402
from piper_jax import ir  # noqa: E402

DEFAULT_CASES = ("16x64x128", "16x64x64", "8x128x64")
SCHEDULES = ("1f1b", "interleaved")
BLOCK_LEAVES = 12  # parameter leaves of one transformer block (norms, attention, MLP)


@dataclasses.dataclass(frozen=True)
class Case:
  n_ranks: int
  dp: int
  n_microbatches: int

  @classmethod
  def parse(cls, text: str) -> "Case":
    pp, dp, mb = (int(x) for x in text.lower().split("x"))
    return cls(pp, dp, mb)

  @property
  def name(self) -> str:
    return f"PP{self.n_ranks} x DP{self.dp} x {self.n_microbatches}"


def gpt_like_model(n_stages: int, batch: int, seq: int = 1024, d_model: int = 2048,
                   vocab: int = 32768, blocks_per_stage: int = 2) -> ir.ModelSpec:
  """A GPT's regions as the tracer would give them, one per stage, with a tied embedding."""
  f32 = lambda name, *shape: ir.TensorSpec(name, shape, "float32")
  act = f32("act", batch, seq, d_model)
  params = [f32("embed", vocab, d_model), f32("pos_embed", seq, d_model)]
  regions = []
  for s in range(n_stages):
    first = len(params)
    for b in range(blocks_per_stage):
      for k in range(BLOCK_LEAVES):
        params.append(f32(f"block_{s * blocks_per_stage + b}.{k}", d_model, d_model))
    own = tuple(range(first, len(params)))
    last = s == n_stages - 1
    if s == 0:
      own = (0, 1) + own
    if last:
      own += (0,)  # the tied head reads the embedding
    inputs = (ir.ActivationRef(s - 1, 0, act),) if s else ()
    outputs = (f32("loss"),) if last else (act,)
    flops = 2.0 * batch * seq * d_model * d_model * BLOCK_LEAVES * blocks_per_stage
    regions.append(ir.RegionSpec(s, (("PP", s),), own, (0, 1) if s in (0, n_stages - 1) else (),
                                 inputs, outputs, produces_loss=last, flops=flops))
  batch_specs = (ir.TensorSpec("tokens", (batch, seq), "int32"),
                 ir.TensorSpec("targets", (batch, seq), "int32"))
  return ir.ModelSpec(tuple(regions), tuple(params), batch_specs, batch)


def n_stages(case: Case, schedule: str) -> int:
  return 2 * case.n_ranks if schedule == "interleaved" else case.n_ranks


def time_make_plan(case: Case, schedule: str) -> float:
  stages = n_stages(case, schedule)
  batch = case.dp * case.n_microbatches
  model = gpt_like_model(stages, batch)
  directives = pj.strategies.pipeline(stages, case.n_microbatches, schedule, dp=case.dp, zero=1)
  t0 = time.perf_counter()
  ir.make_plan(model, directives, n_devices=case.n_ranks * case.dp)
  return time.perf_counter() - t0


def time_traced_plan(case: Case, schedule: str) -> float:
  import jax

  from examples import gpt
  stages = n_stages(case, schedule)
  config = gpt.get_config("1.3b", n_layers=2 * stages, n_stages=stages, tie_embeddings=True)
  net = gpt.GPT(config)
  params = jax.eval_shape(lambda: gpt.init_params(net, jax.random.PRNGKey(0)))
  batch = jax.eval_shape(
      lambda: gpt.random_batch(config, jax.random.PRNGKey(0), case.dp * case.n_microbatches))
  directives = pj.strategies.pipeline(stages, case.n_microbatches, schedule, dp=case.dp, zero=1)
  t0 = time.perf_counter()
  pj.plan(gpt.loss_fn(net), directives, params, batch, n_devices=case.n_ranks * case.dp)
  return time.perf_counter() - t0


def time_search(n_devices: int, n_regions: int, batch: int = 1024) -> tuple[float, object]:
  """Seconds of `pj.strategies.search` over `n_devices` for the Qwen3-8B shape (seq 4096)
  annotated as `n_regions` PP regions, and its result; shapes only."""
  import jax
  import optax

  from examples import qwen3
  config = qwen3.get_config("qwen3-8b", n_stages=n_regions)
  net = qwen3.make_model(config)
  params = jax.eval_shape(lambda: qwen3.init_params(net, jax.random.PRNGKey(0)))
  example = jax.eval_shape(lambda: qwen3.random_batch(config, jax.random.PRNGKey(1), batch))
  t0 = time.perf_counter()
  result = pj.strategies.search(qwen3.loss_fn(net), optax.adamw(1e-4), params, example,
                                n_devices, memory_per_device=2**50)
  return time.perf_counter() - t0, result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                      help="comma-separated PPxDPxMB cases (PP = pipeline ranks)")
  parser.add_argument("--schedules", default=",".join(SCHEDULES))
  parser.add_argument("--traced", action="store_true",
                      help="also time pj.plan of the GPT example, tracing included")
  parser.add_argument("--search", type=int, default=0, metavar="N_DEVICES",
                      help="time pj.strategies.search over this many devices instead")
  parser.add_argument("--regions", default="4,36", help="--search: PP regions of the model")
  args = parser.parse_args()
  if args.search:
    print("PP regions | search (s) | candidates | best")
    for n in (int(x) for x in args.regions.split(",")):
      seconds, result = time_search(args.search, n)
      print(f"{n} | {seconds:.1f} | {len(result.candidates)} | {result.best.name}", flush=True)
    return
  cases = [Case.parse(c) for c in args.cases.split(",")]
  schedules = args.schedules.split(",")
  columns = [(s, "make_plan") for s in schedules]
  if args.traced:
    columns += [(s, "pj.plan") for s in schedules]
  head = ["case"] + [f"{s} {what} (s)" for s, what in columns]
  print(" | ".join(head), flush=True)
  for case in cases:
    cells = [case.name]
    for schedule, what in columns:
      timer = time_make_plan if what == "make_plan" else time_traced_plan
      cells.append(f"{timer(case, schedule):.2f}")
    print(" | ".join(cells), flush=True)


if __name__ == "__main__":
  main()
