"""The planner's estimates beside the measurements of run.py's raw JSON.

  python benchmarks/predict.py benchmarks/raw/2026-11-27_h200x2_1.3b_dp_zero.json

For each piper-jax row of a file (run.py's, or compile_only.py's, whose measured memory is
XLA's count and which have no step time),
`pj.strategies.estimate` of the same directives on the row's devices, from shapes:
peak memory per device against the measured `peak_gib`, and the step time against the
measured one, with matmuls at the FLOP/s the same call's `jit-dp` row (else its
`gspmd-fsdp` row) achieved beside its optimizer's update, the update at the card's
memory bandwidth, and links at `--link-gbps`. Rows that ran cuDNN's fused
attention are traced with XLA's attention recomputed in the backward, which keeps what
the fused kernel keeps (q, k, v), not the T x T probabilities.

With `--calibrate CACHE`, run on a GPU, step times are also simulated from each region's
F and B timed there (`pj.calibrate` at the row's microbatch rows, with the row's
attention and the batch's own token ids), and the optimizer's update timed per byte.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import run  # noqa: E402


def baseline_costs(rows: list[dict], link_bytes_per_s: float, meta: dict, seq_len: int = 0,
                   layers: int = 0):
  """(`CostModel` with matmuls at the FLOP/s a call's plain-JAX baseline reached (the
  FLOPs of its jaxpr over its step), that baseline's row): jit DP, else GSPMD FSDP where
  DP does not fit, else shard_map DP (the MoE's); (the default FLOP/s, None) for a call
  without one that ran (compile_only.py's rows have no FLOP/s). The baseline's step also ran AdamW's update over the parameters
  each device holds (all of them; GSPMD FSDP's 1/n), at the card's memory bandwidth, and
  shard_map DP its `pmean` of the gradients after the backward, which nothing overlaps
  (an all-reduce at `link_bytes_per_s`): its FLOP/s are of the rest of the step, as the
  estimates add those apart."""
  import jax
  import math

  import piper_jax as pj
  from hardware import memory_bytes_per_s
  base = next((r for name in ("jit-dp", "gspmd-fsdp", "shmap-dp") for r in rows
               if r["variant"] == name and "error" not in r and r.get("mfu")), None)
  if base is None:
    return pj.strategies.CostModel(link_bytes_per_s=link_bytes_per_s), None
  costs = pj.strategies.CostModel(link_bytes_per_s=link_bytes_per_s,
                                  memory_bytes_per_s=memory_bytes_per_s(base["device_kind"]))
  config, net, _ = run.build(base["variant"], base["model"], base["devices"],
                             meta["microbatches"], meta.get("pp", 2), attention="xla+remat",
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
            calibrate: str | None = None) -> list[dict]:
  """Rows of estimates for a raw file; `seq_len` and `layers` stand in for a file whose
  meta does not say them (run.py's before it recorded them). With `calibrate` (a cache
  file), step times also come from each region's F and B timed on this machine's first
  device at the row's microbatch rows (`pj.calibrate`, with the row's attention)."""
  import jax
  import optax

  import piper_jax as pj
  data = json.load(open(path))
  meta, rows = data["meta"], data["rows"]
  ok = [r for r in rows if "error" not in r]
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
    config, net, directives = run.build(variant, model, n, meta["microbatches"], pp,
                                        attention=attention,
                                        seq_len=meta.get("seq_len") or seq_len,
                                        layers=meta.get("layers") or layers)
    family = run.step_family(model)
    key = jax.random.PRNGKey(0)
    params, batch = run.shapes(family, net, config, meta["batch"])
    mods = run.split_variant(variant)[1]
    remat = True if "remat" in mods else False if "noremat" in mods else None
    est = pj.strategies.estimate(family.loss_fn(net), optax.adamw(1e-4, weight_decay=0.1), params,
                                 batch, directives, n, costs=costs, remat=remat,
                                 options=run.lowering_options(mods))
    m = est.memory
    timed_ms = None
    if calibrate:
      # Time what the row ran: its attention, its microbatch rows, remat as compiled.
      _, timed_net, _ = run.build(variant, model, n, meta["microbatches"], pp,
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
          options=run.lowering_options(mods))
      timed_ms = timed.step_time * 1e3
    out.append({"file": os.path.basename(path), "model": model, "variant": variant,
                # compile_only.py's rows ran nothing: XLA's count is what they measured.
                "measured_gib": r.get("peak_gib") or r.get("xla_gib"),
                "predicted_gib": m.total / 2**30,
                "params_gib": m.params / 2**30, "grads_gib": m.grads / 2**30,
                "optimizer_gib": m.optimizer / 2**30, "activations_gib": m.activations / 2**30,
                "copies_gib": m.weight_copies / 2**30, "working_gib": m.working / 2**30,
                "sums_copy_gib": m.sums_copy / 2**30,
                "grads_with_activations": m.grads_with_activations,
                "measured_ms": r.get("step_ms"),
                "predicted_ms": est.step_time * 1e3 if base is not None else None,
                "update_ms": est.update_time * 1e3,
                "calibrated_ms": timed_ms})
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("files", nargs="+", help="raw JSON files of run.py or compile_only.py")
  ap.add_argument("--link-gbps", type=float, default=300.0,
                  help="bytes per second one GPU sends, in GB/s (NVLink hosts: ~300)")
  ap.add_argument("--seq-len", type=int, default=0,
                  help="the sequence length of files whose meta lacks it")
  ap.add_argument("--layers", type=int, default=0,
                  help="the Qwen3 blocks of files whose meta lacks them")
  ap.add_argument("--calibrate", default=None, metavar="CACHE",
                  help="also predict step times from regions timed on this machine's first "
                       "device (pj.calibrate; CACHE keeps the timings)")
  args = ap.parse_args(argv)
  if not args.calibrate:
    run._setup_cpu(True)
  print("| model | variant | peak GiB measured | predicted (params, grads, optimizer, "
        "activations, weight copies, working, per-tick sums' copy; grads beside activations "
        "or the larger) | "
        "step ms measured | predicted (of it the optimizer's update) | from timed regions |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for path in args.files:
    for p in predict(path, args.link_gbps * 1e9, args.seq_len, args.layers, args.calibrate):
      parts = ", ".join(f"{p[k]:.2f}" for k in ("params_gib", "grads_gib", "optimizer_gib",
                                                "activations_gib", "copies_gib", "working_gib",
                                                "sums_copy_gib"))
      parts += "; " + ("beside" if p["grads_with_activations"] else "larger")
      pred_ms = (f"{p['predicted_ms']:.1f} ({p['update_ms']:.1f})"
                 if p["predicted_ms"] is not None else "-")
      measured = f"{p['measured_gib']:.2f}" if p["measured_gib"] else "-"
      measured_ms = "-" if p["measured_ms"] is None else f"{p['measured_ms']:.1f}"
      print(f"| {p['model']} | {p['variant']} | {measured} | {p['predicted_gib']:.2f} ({parts}) "
            f"| {measured_ms} | {pred_ms} | "
            f"{'-' if p['calibrated_ms'] is None else format(p['calibrated_ms'], '.1f')} |",
            flush=True)


if __name__ == "__main__":
  main()
