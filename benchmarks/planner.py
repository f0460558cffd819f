"""The planner against measurements: estimates, search picks and planning time.

Its estimates beside run.py's rows, what its search picks, and how long planning takes:

  python benchmarks/planner.py estimate benchmarks/raw/2026-11-28_h200x4_1.3b_pp4_one_loop.json
  python benchmarks/planner.py pick --regions 4 benchmarks/raw/2026-11-28_h200x4_qwen3_8b_seq4096_pp2_dp2.json
  python benchmarks/planner.py time                    # make_plan of PP x DP x MB cases
  python benchmarks/planner.py time --search 1024 --regions 4,36   # strategies.search, Qwen3-8B shape

`estimate`: for each piper-jax row of run.py's raw JSON (or of `run.py --compile-only`,
whose measured memory is XLA's count and which have no step time),
`pj.strategies.estimate` of the same directives on the row's devices, from shapes:
peak memory per device against the measured one, and the step time against the
measured one, with matmuls at the FLOP/s the same call's `jit-dp` row (else its
`gspmd-fsdp`, else `shmap-dp` row) reached beside its optimizer's update, the update at
the card's memory bandwidth, and links at `--link-gbps`. Rows that ran cuDNN's fused
attention are traced with XLA's attention recomputed in the backward, which keeps what
the fused kernel keeps (q, k, v), not the T x T probabilities.

`pick`: `strategies.search` over the model of the files' rows (their batch, sequence
length and blocks) cut into `--regions` PP regions, on the rows' device count and the
card's memory, costed as `estimate` does; prints the ranking beside the measured row of
each candidate's strategy where the files have one, and the pick's measured step against
the fastest measured row.

`time`: `ir.make_plan` of large pipeline x data-parallel plans of a GPT-like `ModelSpec`
(the compiler's passes and tick scheduling, no JAX; PPxDPxMB cases: pipeline ranks,
replicas per rank, microbatches), `--traced` also `pj.plan` of `examples/gpt.py`
(tracing included), or `--search N` `pj.strategies.search` over N devices.

With `--calibrate CACHE` (on a GPU), `estimate` and `pick` also cost each region by its
F and B timed on this machine's first device (`pj.calibrate` at the rows' microbatch
rows, with the rows' attention and real token ids) and the optimizer's update timed per
byte; CACHE keeps the timings. Otherwise everything runs on the CPU, from shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402  (also puts the repository root on the path, for examples/)


# ---- estimate ---------------------------------------------------------------------------

def _microbatches(meta: dict, row: dict) -> int:
  """A row's microbatch count: the call's, or the row's own where the call compiled
  several (`run.py --compile-only --microbatches 4,32`)."""
  return row["microbatches"] if isinstance(meta["microbatches"], list) else meta["microbatches"]


def baseline_costs(rows: list[dict], link_bytes_per_s: float, meta: dict, seq_len: int = 0,
                   layers: int = 0):
  """(`CostModel` with matmuls at the FLOP/s a call's plain-JAX baseline reached (the
  FLOPs of its jaxpr over its step), that baseline's row): jit DP, else GSPMD FSDP where
  DP does not fit, else shard_map DP (the MoE's); (the default FLOP/s, None) for a call
  without one that ran (`--compile-only` rows have no FLOP/s). The baseline's step also ran AdamW's update over the parameters
  each device holds (all of them; GSPMD FSDP's 1/n), at the card's memory bandwidth, and
  shard_map DP its `pmean` of the gradients after the backward, which nothing overlaps
  (an all-reduce at `link_bytes_per_s`): its FLOP/s are of the rest of the step, as the
  estimates add those apart."""
  import jax
  import math

  import piper_jax as pj
  base = next((r for name in ("jit-dp", "gspmd-fsdp", "shmap-dp") for r in rows
               if r["variant"] == name and "error" not in r and r.get("mfu")), None)
  if base is None:
    return pj.strategies.CostModel(link_bytes_per_s=link_bytes_per_s), None
  costs = pj.strategies.CostModel(link_bytes_per_s=link_bytes_per_s,
                                  memory_bytes_per_s=pj.planner.accelerator(base["device_kind"]).memory_bytes_per_s)
  config, net, _ = run.build(base["variant"], base["model"], base["devices"],
                             _microbatches(meta, base), meta.get("pp", 2),
                             attention="xla+remat",
                             seq_len=meta.get("seq_len") or seq_len,
                             layers=meta.get("layers") or layers)
  family = run.step_family(base["model"])
  params, batch = run.shapes(family, net, config, meta["batch"])
  p_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  n = base["devices"]
  held = p_bytes / (n if base["variant"] == "gspmd-fsdp" else 1)
  step = base["step_ms"] / 1e3
  other = costs.update_seconds(held, 2.0)  # AdamW: two moments per parameter
  if base["variant"] == "shmap-dp":
    other += 2 * (n - 1) / n * p_bytes / link_bytes_per_s
  # FLOPs as the estimates count them: the jaxpr's matmuls (a MoE's capacity padding
  # included, which the MFU's 6 N_active per token leaves out), a backward twice a
  # forward, the batch split over the devices.
  from piper_jax.lowering.trace import trace_loss
  spec = trace_loss(family.loss_fn(net), params, batch).spec
  flops = 3 * sum(r.flops for r in spec.regions) / n
  return dataclasses.replace(costs, flops_per_s=flops / (step - other)), base


def predict(path: str, link_bytes_per_s: float, seq_len: int = 0, layers: int = 0,
            calibrate: str | None = None, target: str | None = None,
            stacked: bool = False) -> list[dict]:
  """Rows of estimates for a raw file; `seq_len` and `layers` stand in for a file whose
  meta does not say them (run.py's before it recorded them). With `calibrate` (a cache
  file), step times also come from each region's F and B timed on this machine's first
  device at the row's microbatch rows (`pj.calibrate`, with the row's attention). With
  `target` (a card's name), the costs are `CostModel.for_accelerator(target)`'s, nothing
  measured: what a machine without the cards predicts. `stacked`: the rows ran with
  uneven slots stacked over the pipeline ranks (`spread_uneven_slots=False`, the default
  before they were spread)."""
  import jax
  import optax

  import piper_jax as pj
  data = json.load(open(path))
  meta, rows = data["meta"], data["rows"]
  options_of = lambda mods: dataclasses.replace(run.lowering_options(mods),
                                                **({"spread_uneven_slots": False} if stacked else {}))
  ok = [r for r in rows if "error" not in r]
  if target:
    costs, base = pj.strategies.CostModel.for_accelerator(target), {"target": target}
  else:
    costs, base = baseline_costs(ok, link_bytes_per_s, meta, seq_len, layers)
  out = []
  for r in ok:
    variant = r["variant"]
    if variant.split("+")[0].split("@")[0] in run.BASELINES:
      continue
    n, model = r["devices"], r["model"]
    pp = r.get("pp", meta.get("pp", 2))
    # cuDNN's fused attention keeps no T x T scores; traced on a CPU, XLA's attention
    # recomputed in the backward keeps the same values.
    attention = "xla+remat" if r.get("attention", "cudnn") == "cudnn" else r["attention"]
    microbatches = _microbatches(meta, r)
    config, net, directives = run.build(variant, model, n, microbatches, pp,
                                        attention=attention,
                                        seq_len=meta.get("seq_len") or seq_len,
                                        layers=meta.get("layers") or layers)
    family = run.step_family(model)
    key = jax.random.PRNGKey(0)
    params, batch = run.shapes(family, net, config, meta["batch"])
    mods = run.split_variant(variant)[1]
    remat = True if "remat" in mods else False if "noremat" in mods else None
    # XLA compiled the row for JAX's pool of the card's memory.
    card = pj.planner.accelerator(target or r.get("device_kind", ""))
    limit = card and pj.planner.JAX_GPU_POOL * card.memory_bytes
    est = pj.strategies.estimate(family.loss_fn(net), optax.adamw(1e-4, weight_decay=0.1), params,
                                 batch, directives, n, costs=costs, remat=remat,
                                 options=options_of(mods), memory_limit=limit)
    m = est.memory
    timed_ms = None
    if calibrate:
      # Time what the row ran: its attention, its microbatch rows, remat as compiled.
      _, timed_net, _ = run.build(variant, model, n, microbatches, pp,
                                  attention=r.get("attention"),
                                  seq_len=meta.get("seq_len") or seq_len,
                                  layers=meta.get("layers") or layers)
      use_remat = est.plan.mesh.n_pp > 1 if remat is None else remat
      # Real token ids: an embedding's gradient scatters by them.
      values = family.random_batch(config, key, meta["batch"])
      times, _ = run.timed_regions(family.loss_fn(timed_net), params, values, est.plan,
                                   use_remat, calibrate, optax.adamw(1e-4, weight_decay=0.1))
      timed = pj.strategies.estimate(
          family.loss_fn(net), optax.adamw(1e-4, weight_decay=0.1), params, batch, directives,
          n, costs=dataclasses.replace(costs, region_times=times), remat=remat,
          options=options_of(mods))
      timed_ms = timed.step_time * 1e3
    out.append({"file": os.path.basename(path), "model": model, "variant": variant,
                # --compile-only rows ran nothing: XLA's count is what they measured.
                "measured_gib": r.get("peak_gib") or r.get("xla_gib"),
                "predicted_gib": m.total / 2**30,
                "params_gib": m.params / 2**30, "grads_gib": m.grads / 2**30,
                "optimizer_gib": m.optimizer / 2**30, "activations_gib": m.activations / 2**30,
                "copies_gib": m.weight_copies / 2**30, "working_gib": m.working / 2**30,
                "grads_with_activations": m.grads_with_activations,
                # A loop runs no faster than the host launches its steps.
                "measured_ms": max(r.get("step_ms") or 0, r.get("dispatch_ms") or 0) or None,
                "predicted_ms": est.step_time * 1e3 if base is not None else None,
                "update_ms": est.update_time * 1e3,
                "calibrated_ms": timed_ms})
  return out


def estimate_main(args) -> None:
  print("| model | variant | peak GiB measured | predicted (params, grads, optimizer, "
        "activations, weight copies, working; grads beside activations "
        "or the larger) | "
        "step ms measured | predicted (of it the optimizer's update) | from timed regions |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for path in args.files:
    for p in predict(path, args.link_gbps * 1e9, args.seq_len, args.layers, args.calibrate,
                     args.target, args.stacked):
      parts = ", ".join(f"{p[k]:.2f}" for k in ("params_gib", "grads_gib", "optimizer_gib",
                                                "activations_gib", "copies_gib", "working_gib"))
      parts += "; " + ("beside" if p["grads_with_activations"] else "larger")
      pred_ms = (f"{p['predicted_ms']:.1f} ({p['update_ms']:.1f})"
                 if p["predicted_ms"] is not None else "-")
      measured = f"{p['measured_gib']:.2f}" if p["measured_gib"] else "-"
      measured_ms = "-" if p["measured_ms"] is None else f"{p['measured_ms']:.1f}"
      print(f"| {p['model']} | {p['variant']} | {measured} | {p['predicted_gib']:.2f} ({parts}) "
            f"| {measured_ms} | {pred_ms} | "
            f"{'-' if p['calibrated_ms'] is None else format(p['calibrated_ms'], '.1f')} |",
            flush=True)


# ---- pick -------------------------------------------------------------------------------

def variant_of(c) -> str | None:
  """run.py's variant for a search candidate (None for accumulation without a pipeline,
  whose `accum` rows are one per command's `--microbatches`, and for expert parallelism
  over ZeRO without one, which run.py has no variant for)."""
  ep = c.plan.mesh.size("ep") > 1  # its expert regions split over devices
  if c.schedule == "dp":
    if c.n_microbatches > 1 or (ep and c.zero):
      return None
    return "dp+ep" if ep else "dp" if c.zero == 0 else f"zero{c.zero}"
  return (f"pp-{c.schedule}" + (f"@z{c.zero}" if c.dp > 1 and c.zero else "")
          + ("+ep" if ep else ""))


def pick_main(args) -> None:
  import jax
  import optax

  import piper_jax as pj
  data = [json.load(open(f)) for f in args.files]
  meta = data[0]["meta"]
  rows = [r for d in data for r in d["rows"] if "error" not in r]
  model, n, kind = rows[0]["model"], rows[0]["devices"], rows[0]["device_kind"]
  if args.target:
    costs, base = pj.strategies.CostModel.for_accelerator(args.target), {"target": args.target}
  else:
    costs, base = baseline_costs(rows, args.link_gbps * 1e9, meta, args.seq_len, args.layers)
  if base is None:
    raise ValueError("the files hold no jit-dp, gspmd-fsdp or shmap-dp row: the estimates "
                     "take their matmul FLOP/s from the call's plain-JAX baseline; add a file "
                     "with one")
  config = run._config(model, args.regions, attention="xla+remat",
                       seq_len=meta.get("seq_len") or args.seq_len,
                       layers=meta.get("layers") or args.layers)
  family = run.step_family(model)
  net = run.make_net(model, config)
  params, batch = run.shapes(family, net, config, meta["batch"])
  tx = optax.adamw(1e-4, weight_decay=0.1)
  if args.calibrate:
    # Timed with the attention the rows ran (cuDNN's keeps what XLA's recomputed keeps,
    # at its own speed) and real token ids (an embedding's gradient scatters by them).
    timed_config = run._config(model, args.regions, attention=rows[0].get("attention"),
                               seq_len=meta.get("seq_len") or args.seq_len,
                               layers=meta.get("layers") or args.layers)
    values = family.random_batch(config, jax.random.PRNGKey(0), meta["batch"])
    share = meta["batch"] // n  # a device's rows, down to the smallest microbatch tried
    times = pj.calibrate(family.loss_fn(run.make_net(model, timed_config)), params, values,
                         sorted({share, max(1, share // 8)}), cache=args.calibrate,
                         optimizer=tx)
    costs = dataclasses.replace(costs, region_times=times)
  found = pj.strategies.search(family.loss_fn(net), tx, params, batch, n,
                               pj.planner.accelerator(args.target or kind).memory_bytes,
                               costs=costs)
  measured = {}  # a later file's row of a variant stands for it
  for r in rows:
    if run.split_variant(r["variant"])[1] in ([], ["ep"]):
      measured[r["variant"]] = r
  print("| strategy | microbatches | estimated ms | measured ms (variant) | peak GiB estimated | measured |")
  print("| --- | --- | --- | --- | --- | --- |")
  for c in found.candidates[:args.top]:
    v = variant_of(c)
    r = measured.get(v) if v and (c.schedule == "dp" or c.n_microbatches == meta["microbatches"]) else None
    got = f"{r['step_ms']:.1f} ({v})" if r else "-"
    peak = f"{r['peak_gib']:.2f}" if r else "-"
    print(f"| {c.name} | {c.n_microbatches} | {c.step_time * 1e3:.1f} | {got} | "
          f"{c.peak_memory / 2**30:.2f} | {peak} |")
  best = min(rows, key=lambda r: r["step_ms"])
  pick = measured.get(variant_of(found.best))
  if pick:
    print(f"\npicked {found.best.name}: measured {pick['step_ms']:.1f} ms, "
          f"{pick['step_ms'] / best['step_ms']:.3f}x the fastest measured row "
          f"({best['variant']}, {best['step_ms']:.1f} ms)")
  else:
    print(f"\npicked {found.best.name}: not among the measured rows")


# ---- time -------------------------------------------------------------------------------

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
                   vocab: int = 32768, blocks_per_stage: int = 2):
  """A GPT's regions as the tracer would give them, one per stage, with a tied embedding
  (an `ir.ModelSpec`)."""
  from piper_jax import ir
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
  import piper_jax as pj
  from piper_jax import ir
  stages = n_stages(case, schedule)
  batch = case.dp * case.n_microbatches
  model = gpt_like_model(stages, batch)
  directives = pj.strategies.pipeline(stages, case.n_microbatches, schedule, dp=case.dp, zero=1)
  t0 = time.perf_counter()
  ir.make_plan(model, directives, n_devices=case.n_ranks * case.dp)
  return time.perf_counter() - t0


def time_traced_plan(case: Case, schedule: str) -> float:
  import jax

  import piper_jax as pj

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

  import piper_jax as pj
  from examples import qwen3
  config = qwen3.get_config("qwen3-8b", n_stages=n_regions)
  net = qwen3.make_model(config)
  params = jax.eval_shape(lambda: qwen3.init_params(net, jax.random.PRNGKey(0)))
  example = jax.eval_shape(lambda: qwen3.random_batch(config, jax.random.PRNGKey(1), batch))
  t0 = time.perf_counter()
  result = pj.strategies.search(qwen3.loss_fn(net), optax.adamw(1e-4), params, example,
                                n_devices, memory_per_device=2**50)
  return time.perf_counter() - t0, result


def time_main(args) -> None:
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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="command", required=True)
  costed = argparse.ArgumentParser(add_help=False)
  costed.add_argument("--link-gbps", type=float, default=300.0,
                      help="bytes per second one GPU sends, in GB/s (NVLink hosts: ~300)")
  costed.add_argument("--seq-len", type=int, default=0,
                      help="the sequence length of files whose meta lacks it")
  costed.add_argument("--layers", type=int, default=0,
                      help="the Qwen3 blocks of files whose meta lacks them")
  costed.add_argument("--calibrate", default=None, metavar="CACHE",
                      help="also cost regions by their F and B timed on this machine's first "
                           "device (pj.calibrate; CACHE keeps the timings)")
  costed.add_argument("--target", default=None, metavar="CARD",
                      help="cost for this card (pj.planner.ACCELERATORS) instead of the FLOP/s "
                           "the file's baseline measured: a prediction made without the cards")
  est = sub.add_parser("estimate", parents=[costed],
                       help="the planner's memory and step time beside each measured row")
  est.add_argument("files", nargs="+", help="raw JSON files of run.py")
  est.add_argument("--stacked", action="store_true",
                   help="the rows ran with uneven slots stacked over the pipeline ranks "
                        "(spread_uneven_slots=False, the default before they were spread)")
  pk = sub.add_parser("pick", parents=[costed],
                      help="what strategies.search picks, beside the measured rows")
  pk.add_argument("files", nargs="+", help="raw JSON files of run.py from one machine and "
                  "model (with the same batch and microbatches), oldest first")
  pk.add_argument("--regions", type=int, default=4, help="PP regions the model is cut into")
  pk.add_argument("--top", type=int, default=12)
  tm = sub.add_parser("time", help="planning and search time on the CPU")
  tm.add_argument("--cases", default=",".join(DEFAULT_CASES),
                  help="comma-separated PPxDPxMB cases (PP = pipeline ranks)")
  tm.add_argument("--schedules", default=",".join(SCHEDULES))
  tm.add_argument("--traced", action="store_true",
                  help="also time pj.plan of the GPT example, tracing included")
  tm.add_argument("--search", type=int, default=0, metavar="N_DEVICES",
                  help="time pj.strategies.search over this many devices instead")
  tm.add_argument("--regions", default="4,36", help="--search: PP regions of the model")
  args = ap.parse_args(argv)
  if not getattr(args, "calibrate", None):
    run._setup_cpu(True)
  {"estimate": estimate_main, "pick": pick_main, "time": time_main}[args.command](args)


if __name__ == "__main__":
  main()
