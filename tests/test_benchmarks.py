"""benchmarks/run.py --small runs the same code as the GPU benchmark, on CPU."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_run_small(tmp_path):
  out = tmp_path / "small.json"
  variants = ["jit-dp", "pp-1f1b@z1"]  # shmap-dp: test_run_small_moe; dp@bN: below
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--small", "--pp", "2",
       "--steps", "3", "--warmup", "1", "--variants", ",".join(variants), "--out", str(out)],
      capture_output=True, text=True, timeout=580)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["variant"] for r in rows] == variants
  for r in rows:
    assert "error" not in r, r
    assert r["tokens_per_s"] > 0 and r["loss"] == r["loss"]
  # Same model, batches and optimizer steps: every strategy ends at the same loss.
  losses = [r["loss"] for r in rows]
  assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
  assert "| tiny | pp-1f1b@z1 |" in proc.stdout
  # Pipelines on 2 ranks x DP 4 carry the simulator's prediction beside the measurement,
  # and every row XLA's count of the memory its program needs.
  assert all(r["sim_ms"] > 0 and r["devices"] == 8 for r in rows if r["variant"].startswith("pp-"))
  assert all(r["xla_gib"] > 0 for r in rows)


@pytest.mark.timeout(300)
def test_run_small_moe():
  # run.py's MoE steps, built in this process: plain shard_map DP (per-device routing)
  # and 1F1B with the experts split (dp+ep and DualPipeV x EP: test_parallel). Dropless
  # routing: the same loss under both.
  import jax
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  losses = []
  for variant in ("shmap-dp", "pp-1f1b+ep"):
    call, state, batches, _, _ = run.make_step(variant, "moe-tiny", batch=16, microbatches=4)
    state, loss = call(state, batches[0])
    losses.append(float(loss))
  assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
  assert jax.device_count() == 8


def test_profile_summary(tmp_path):
  # profile_step.summarize reads a Perfetto trace: busy time is the union of the first
  # GPU's kernels, gaps are the idle stretches between them.
  import gzip
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  from profile_step import load_trace, summarize
  meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 8, "args": {"name": "/device:GPU:1"}}]
  kernels = [{"ph": "X", "pid": 7, "tid": 1, "ts": 0, "dur": 100, "name": "gemm_12"},
             {"ph": "X", "pid": 7, "tid": 2, "ts": 50, "dur": 100, "name": "gemm_3"},
             {"ph": "X", "pid": 7, "tid": 1, "ts": 400, "dur": 5, "name": "add_fusion"},
             {"ph": "X", "pid": 8, "tid": 1, "ts": 0, "dur": 999, "name": "other_gpu"}]
  path = tmp_path / "t.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": meta + kernels}, f)
  events = load_trace(str(path))
  text = summarize(events)
  assert "3 kernels over 0.4 ms: busy 0.2 ms (38%)" in text, text
  assert "largest idle gaps (us): 250" in text
  assert "gemm_#" in text and "other_gpu" not in text
  assert "100.0 ms" not in text and "0.1 ms x1      gemm_12" in summarize(events, named=3)
  assert "GPU:1 1 kernels over 1.0 ms" in summarize(events, gpu=1)
  # host_summary groups the events of the processes that are not GPUs.
  from profile_step import host_summary
  host = [{"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
          {"ph": "X", "pid": 9, "tid": 1, "ts": 0, "dur": 300, "name": "cuGraphLaunch (CudaGraph:12)"},
          {"ph": "X", "pid": 9, "tid": 1, "ts": 400, "dur": 100, "name": "cuGraphLaunch (CudaGraph:7)"}]
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": meta + kernels + host}, f)
  text = host_summary(load_trace(str(path)))
  assert "host: 2 events" in text and "0.4 ms x2      cuGraphLaunch (CudaGraph:#)" in text, text
  assert "gemm" not in text
  # tick_table cuts a GPU's timeline at its NCCL kernels (a pipeline's ticks end in one).
  from profile_step import tick_table
  ticks = kernels[:2] + [{"ph": "X", "pid": 7, "tid": 1, "ts": 300, "dur": 50,
                          "name": "ncclDevKernel_SendRecv"}] + kernels[2:3]
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": meta + ticks}, f)
  rows = tick_table(load_trace(str(path)), [0]).splitlines()
  assert rows[1].split()[:5] == ["0.00", "0.15", "0.15", "0.05", "2"], rows
  assert rows[2].split()[:2] == ["0.35", "0.01"], rows


def test_baseline_of_each_variant():
  sys.path.insert(0, ROOT)
  from benchmarks.run import BASELINE_OF
  assert BASELINE_OF("pp-1f1b@z3+balanced") == "jit-dp"
  assert BASELINE_OF("zero3") == "gspmd-fsdp"
  assert BASELINE_OF("zero1+bf16") == "jit-dp+bf16"  # pure bf16 against pure bf16
  assert BASELINE_OF("jit-dp+bf16") == "jit-dp+bf16"
  assert BASELINE_OF("dp+ep", "moe-1b") == "shmap-dp"  # routes per device, as piper does
  assert BASELINE_OF("accum@b25") == "shmap-accum"


def test_bucketed_variants_reduce_in_buckets():
  # "@bN": replicate's gradient buckets of N MB, for DP and for accumulation alike.
  sys.path.insert(0, ROOT)
  from benchmarks import run
  for variant, bucket in (("dp@b25", 25.0), ("accum@b1", 1.0), ("accum-1f1b@b2", 2.0),
                          ("accum", None)):
    _, _, directives = run.build(variant, "tiny", 8, 4, pp=1)
    assert [d.bucket_mb for d in directives if type(d).__name__ == "Replicate"] == [bucket]


def test_a_step_time_is_no_shorter_than_a_call(monkeypatch):
  # A call that returns only when its step is done (the host launching every
  # microbatch): the loop runs one step per call, not the median of intervals of which
  # the last is empty.
  sys.path.insert(0, ROOT)
  from benchmarks import run
  clock = [0.0]
  monkeypatch.setattr(run.time, "perf_counter", lambda: clock[0])

  class Ready:
    def block_until_ready(self):
      return self

  def call(state, batch):
    clock[0] += 1.0
    return state, Ready()

  _, _, step_s, dispatch_s = run.loop_steps(call, None, [None], 2)
  assert step_s == dispatch_s == 1.0


@pytest.mark.parametrize("variant,match", [("jit-dp+ep", "baselines take only \\+bf16"),
                                           ("dp+fast", "unknown suffix"),
                                           ("pp-1f1b+noloop", "unknown suffix"),
                                           ("pp-1f1b+xla", "give --xla-flags"),
                                           ("pp-zb+remat+noremat", "contradict")])
def test_bad_variants_are_reported_before_running(variant, match):
  sys.path.insert(0, ROOT)
  from benchmarks.run import main
  with pytest.raises(ValueError, match=match):
    main(["--small", "--variants", variant])


def test_stage_layers_suffix():
  sys.path.insert(0, ROOT)
  from benchmarks.run import build
  config, _, _ = build("pp-1f1b+L5-3", "tiny", 2, 2)
  assert config.stage_layers == (5, 3)
  # Stages that do not divide the blocks evenly: 8 blocks over 3 ranks.
  config, _, _ = build("pp-1f1b+L3-3-2", "tiny", 3, 3, pp=3)
  assert config.n_stages == 3 and config.stage_layers == (3, 3, 2)
  _, _, (dp,) = build("dp@b1", "tiny", 8, 1)  # DP with 1 MB gradient buckets
  assert dp.bucket_mb == 1.0 and dp.zero == 0 and len(dp.devices) == 8
  with pytest.raises(ValueError, match="summing to 8"):
    build("pp-1f1b+L5-4", "tiny", 2, 2)


def test_suffixes_choose_lowering_options():
  sys.path.insert(0, ROOT)
  from benchmarks.run import lowering_options
  options = lowering_options(["keepgathered", "stacked", "slot16", "noremat", "nocmdbuf"])
  assert not options.zero3_reshard and not options.spread_uneven_slots and options.remat is False
  assert options.slot_bytes == 16 << 20 and options.compiler_options == {}
  assert lowering_options([]).changed() == {}


@pytest.mark.timeout(120)
def test_accumulated_baseline_matches_plain_dp():
  # shmap-accum (4 microbatches over 2 ranks: 2 of 2 rows on each of 8 devices) trains
  # as shmap-dp does: its accumulation gives the full batch's loss and gradients.
  import jax
  import numpy as np
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  assert jax.device_count() == 8
  results = {}
  for variant in ("shmap-dp", "shmap-accum"):
    call, state, batches, _, _ = run.make_step(variant, "tiny", batch=32, microbatches=4)
    state, loss = call(state, batches[0])
    results[variant] = (float(loss), jax.tree_util.tree_leaves(state[0]))
  (loss_dp, p_dp), (loss_acc, p_acc) = results["shmap-dp"], results["shmap-accum"]
  np.testing.assert_allclose(loss_acc, loss_dp, rtol=1e-5)
  for a, b in zip(p_acc, p_dp):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="shmap-accum splits each device's 32/8 rows"):
    run.make_step("shmap-accum", "tiny", batch=32, microbatches=3)


def test_qwen3_presets_in_run():
  # run.py builds the Qwen3 presets: the MoE one's pipeline with its experts split
  # (its numbers against one device are tests/test_qwen3.py's), the dense one trained.
  import jax
  import numpy as np
  import piper_jax as pj
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  assert run.is_moe("qwen3-moe-tiny") and not run.is_moe("qwen3-tiny")
  assert run.BASELINE_OF("pp-1f1b+ep", "qwen3-moe-tiny") == "shmap-dp"
  config, net, directives = run.build("pp-1f1b+ep", "qwen3-moe-tiny", 8, 4, pp=2, seq_len=16)
  assert config.seq_len == 16 and config.n_stages == 2 and type(net).__name__ == "Qwen3MoE"
  assert any(isinstance(d, pj.Shard) for d in directives)
  call, state, batches, config, _ = run.make_step("jit-dp", "qwen3-tiny", batch=8,
                                                  microbatches=1, seq_len=16)
  losses = []
  for b in batches[:2]:
    state, loss = call(state, b)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and batches[0]["tokens"].shape == (8, 16)
  # +ac checkpoints the blocks; the 8B shape's ratios fall back to GSPMD FSDP, which
  # runs where jit DP does not fit.
  config, _, _ = run.build("zero3+ac", "qwen3-tiny", 8, 1, seq_len=16)
  assert config.remat and run.BASELINE_OF("zero1+ac", "qwen3-8b") == "jit-dp+ac"
  fsdp = {"variant": "gspmd-fsdp+ac", "model": "qwen3-8b", "tokens_per_s": 1.0}
  rows = {("qwen3-8b", "gspmd-fsdp+ac"): fsdp}
  assert run.baseline_row(rows, "zero1+ac", "qwen3-8b") == ("gspmd-fsdp+ac", fsdp)
  assert run.baseline_row(rows, "zero1", "qwen3-8b") == ("gspmd-fsdp", None)
  with pytest.raises(ValueError, match=r"\+ac checkpoints the blocks of the Qwen3 models"):
    run.build("dp+ac", "tiny", 8, 1)
  # --layers: a preset's shapes with fewer blocks (the 8B on 2 GPUs); Qwen3 presets only.
  config = run._config("qwen3-8b", 2, layers=8)
  assert config.n_layers == 8 and config.d_model == 4096 and config.stage_bounds[1] == (4, 8)
  with pytest.raises(ValueError, match="--layers sets the blocks of a Qwen3 preset"):
    run._config("268m", 1, layers=8)


def test_largest_batch_doubles_until_out_of_memory(monkeypatch):
  import argparse
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  tried, microbatches = [], []

  def child(args, variant, model):
    tried.append(args.batch)
    microbatches.append(args.microbatches)
    if args.batch > 32:
      return {"variant": variant, "model": model, "error": "out of memory"}
    return {"variant": variant, "model": model, "step_ms": 1.0}

  monkeypatch.setattr(run, "_child", child)
  args = argparse.Namespace(batch=8, microbatches=4, max_batch=256)
  row = run._largest_batch(args, "zero3", "tiny")
  assert tried == [8, 16, 32, 64] and row["max_batch"] == 32 and row["failed_batch"] == 64
  # A microbatch keeps its two sequences: a pipeline trains a larger batch in more of them.
  assert microbatches == [4, 8, 16, 32] and row["microbatches"] == 16
  assert "error" not in row
  tried.clear()
  row = run._largest_batch(argparse.Namespace(batch=8, microbatches=4, max_batch=16), "zero3", "tiny")
  assert tried == [8, 16] and row["max_batch"] == 16 and "failed_batch" not in row


@pytest.mark.timeout(120)
def test_a_child_past_its_timeout_gives_a_row(tmp_path):
  # A variant that runs past --timeout ends as a row saying so; the call goes on.
  out = tmp_path / "t.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--small", "--timeout", "1",
       "--variants", "jit-dp", "--out", str(out)],
      capture_output=True, text=True, timeout=100)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (row,) = json.loads(out.read_text())["rows"]
  assert row["variant"] == "jit-dp" and row["error"].startswith("timed out after 1 s"), row


def test_plot_draws_the_tables(tmp_path):
  # plot.py reads each machine's table: one bar per row with a ratio, baselines marked.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import plot
  md = tmp_path / "R.md"
  md.write_text(
      "# R\n\n## 2 x H200\n\n"
      "| cmd | model | variant | GPUs | batch / mb | step ms | vs baseline | peak GiB |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
      "| 1 | 268M | jit-dp | 2 | 16 | 31.4 | 1.00x | 10.08 |\n"
      "| 1 | 268M | **pp-1f1b** | 2 | 16 / 8 | 46.7 | **0.68x** | - |\n"
      "| 1 | 268M | pp-zb | 2 | 16 / 8 | 50.0 | | 5.3 |\n\n## Not measured yet\n")
  found = plot.bars(str(md))
  assert [(b.panel, b.label, b.ratio, b.baseline, b.peak_gib) for b in found] == [
      ("2 x H200, 268M", "1: jit-dp 16", 1.0, True, 10.08),
      ("2 x H200, 268M", "1: pp-1f1b 16 / 8", 0.68, False, None)]
  plot.draw(found, str(tmp_path / "r.png"))
  assert (tmp_path / "r.png").stat().st_size > 1000


def test_planner_names_run_variants_of_search_candidates():
  # planner.py pick sets strategies.search's candidates beside run.py's rows of the same
  # strategy.
  import types
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import planner
  mesh = lambda ep: types.SimpleNamespace(size=lambda axis: ep if axis == "ep" else 1)
  c = lambda schedule, dp, zero, mb, ep=False: types.SimpleNamespace(
      schedule=schedule, dp=dp, zero=zero, n_microbatches=mb,
      plan=types.SimpleNamespace(mesh=mesh(dp if ep else 1)))
  assert planner.variant_of(c("dp", 4, 1, 1)) == "zero1" and planner.variant_of(c("dp", 4, 0, 1)) == "dp"
  assert planner.variant_of(c("dp", 4, 3, 2)) is None  # accumulation: a row per --microbatches
  assert planner.variant_of(c("1f1b", 2, 3, 8)) == "pp-1f1b@z3"
  assert planner.variant_of(c("dualpipev", 1, 0, 8)) == "pp-dualpipev"
  # Expert parallel: run.py's +ep rows, which have no ZeRO without a pipeline.
  assert planner.variant_of(c("dp", 4, 0, 1, ep=True)) == "dp+ep"
  assert planner.variant_of(c("dp", 4, 1, 1, ep=True)) is None
  assert planner.variant_of(c("1f1b", 2, 0, 4, ep=True)) == "pp-1f1b+ep"


def test_results_meta_keeps_the_shape_arguments_a_script_has(tmp_path):
  # torch_peer.py writes through run.py's write_results without run.py's --layers.
  import argparse
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  out = tmp_path / "r.json"
  args = argparse.Namespace(batch=8, microbatches=4, steps=3, pp=2, seq_len=4096, small=False,
                            out=str(out))
  run.write_results(args, [], "results_torch", torch="2.11")
  meta = json.loads(out.read_text())["meta"]
  assert meta["pp"] == 2 and meta["seq_len"] == 4096 and "layers" not in meta
  assert meta["torch"] == "2.11"


@pytest.mark.timeout(120)
def test_pipeline_rows_simulate_from_timed_regions(tmp_path):
  # --calibrate: a pipeline row's prediction from its regions timed at the microbatch
  # rows (here 32 / (4 replicas x 4 microbatches) = 2), cached for the next row.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  cache = tmp_path / "times.json"
  _, _, _, _, sim = run.make_step("pp-1f1b", "tiny", batch=32, microbatches=4,
                                  calibrate=str(cache))
  assert sim["sim_timed_ms"] > 0 and cache.exists()
  timed = json.load(open(cache))
  assert timed and all(len(v) == 3 for v in timed.values())
  rows = [{"model": "tiny", "variant": "pp-1f1b", "devices": 8, "step_ms": 3.0,
           "tokens_per_s": 1.0, "compile_s": 1.0, **sim}]
  assert f"| {sim['sim_timed_ms']:.1f} |" in run.table(rows)


@pytest.mark.timeout(300)
def test_planner_estimates_expert_parallel_rows(tmp_path):
  # planner.py estimate sets the planner's estimate beside each piper-jax row of a raw
  # file, the experts split over devices included, with matmuls at the FLOP/s of the
  # call's baseline.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import planner
  row = lambda variant, ms, gib: {"variant": variant, "model": "qwen3-moe-tiny", "devices": 4,
                                  "device_kind": "NVIDIA H200", "step_ms": ms, "peak_gib": gib,
                                  "mfu": 0.2, "attention": "xla"}
  raw = tmp_path / "moe.json"
  raw.write_text(json.dumps({"meta": {"batch": 8, "microbatches": 4, "pp": 2},
                             "rows": [row("shmap-dp", 2.0, 0.1), row("dp+ep", 1.5, 0.05),
                                      row("pp-1f1b+ep", 3.0, 0.05)]}))
  out = {p["variant"]: p for p in planner.predict(str(raw), 300e9)}
  assert sorted(out) == ["dp+ep", "pp-1f1b+ep"]  # the baseline is what the others are against
  for p in out.values():
    assert p["predicted_gib"] > 0 and p["predicted_ms"] > 0 and p["measured_ms"] > 0
  # The pipeline's devices hold half the layers: fewer parameters than DP x EP's.
  assert out["pp-1f1b+ep"]["params_gib"] < out["dp+ep"]["params_gib"]
  # --compile-only rows ran nothing: XLA's count stands for the measured memory.
  raw.write_text(json.dumps({"meta": {"batch": 8, "microbatches": 4, "pp": 2},
                             "rows": [{"variant": "pp-1f1b+ep", "model": "qwen3-moe-tiny",
                                       "devices": 4, "xla_gib": 0.07, "attention": "xla"}]}))
  (p,) = planner.predict(str(raw), 300e9)
  assert p["measured_gib"] == 0.07 and p["measured_ms"] is None and p["predicted_ms"] is None
  assert p["predicted_gib"] == out["pp-1f1b+ep"]["predicted_gib"]
  # A file of several microbatch counts (run.py --microbatches 4,8): each row its own.
  raw.write_text(json.dumps({"meta": {"batch": 8, "microbatches": [8, 4], "pp": 2},
                             "rows": [{"variant": "pp-1f1b+ep", "model": "qwen3-moe-tiny",
                                       "devices": 4, "xla_gib": 0.07, "attention": "xla",
                                       "microbatches": 4}]}))
  (p,) = planner.predict(str(raw), 300e9)
  assert p["predicted_gib"] == out["pp-1f1b+ep"]["predicted_gib"]
  # --stacked: rows that ran with uneven slots stacked over the ranks, each rank padded
  # to the largest, not spread over all devices (stages of 6 and 2 blocks).
  raw.write_text(json.dumps({"meta": {"batch": 8, "microbatches": 4, "pp": 2},
                             "rows": [{"variant": "pp-1f1b+ep+L6-2", "model": "qwen3-moe-tiny",
                                       "devices": 4, "xla_gib": 0.07, "attention": "xla"}]}))
  (spread,) = planner.predict(str(raw), 300e9)
  (stacked,) = planner.predict(str(raw), 300e9, stacked=True)
  assert stacked["params_gib"] > spread["params_gib"]


@pytest.mark.timeout(300)
def test_compile_only_counts_memory_without_running():
  # run.py --compile-only builds its variants on shapes and compiles them: XLA's count of
  # each program's memory, no step run; its baselines are run.py's own jitted steps.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  # (+tp's program: tests/test_tick_loop.py counts its collectives in conditionals.)
  rows = [run.compile_variant(v, "tiny", batch=32, microbatches=4, pp=2)
          for v in ("jit-dp", "pp-1f1b@z1")]
  for r in rows:
    assert r["compile_s"] > 0 and r["xla_gib"] > 0 and r["devices"] == 8
    assert r["collectives_in_conditionals"] == 0 and r["kernels"] > 0
  # +tp: each rank's first two data-parallel devices split the attention and MLP.
  assert run.build("pp-1f1b+tp", "tiny", 8, 4, pp=2)[2][-1].devices == (0, 2, 1, 3)
  assert rows[0]["build_s"] == 0 and rows[1]["build_s"] > 0 and rows[1]["microbatches"] == 4
  # Data parallel keeps every parameter and optimizer state on each device; 1F1B over 2
  # ranks half of them.
  assert rows[1]["memory"]["arguments"] < rows[0]["memory"]["arguments"]
  # Every row says the most a switch branch copies; plain jit has no switch.
  assert rows[0]["branch_copy_mib"] == 0 and all(r["branch_copy_mib"] >= 0 for r in rows)
  text = run.compile_table(rows)
  assert "| tiny | pp-1f1b@z1 | 8 |" in text and "x jit-dp |" in text and "| 0 |" in text
  assert "| MiB copied in a branch |" in text and "| kernels |" in text
  with pytest.raises(ValueError, match="add --compile-only"):
    run.main(["--small", "--mock-gpus", "4", "--variants", "jit-dp"])


@pytest.mark.timeout(120)
def test_build_only_times_the_build_alone():
  # run.py --build-only times pj.compile's build (a fresh process each, the fastest of
  # --repeat), with no XLA compile; plain-JAX baselines have nothing to build.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  row = run.compile_variant("pp-1f1b", "tiny", batch=32, microbatches=4, pp=2, build_only=True)
  assert row["build_s"] > 0 and row["compile_s"] == 0 and "xla_gib" not in row
  assert row["microbatches"] == 4 and row["devices"] == 8
  row["tries_s"] = [row["build_s"] + 0.5, row["build_s"]]
  text = run.build_table([row, {"variant": "pp-zb", "model": "tiny", "error": "out of memory"}])
  assert f"| tiny | pp-1f1b | 8 | 32 / 4 | {row['build_s']:.2f} |" in text
  assert "| tiny | pp-zb | | | out of memory | |" in text
  with pytest.raises(ValueError, match="nothing to build"):
    run.main(["--small", "--build-only", "--variants", "shmap-dp,pp-1f1b"])
  with pytest.raises(ValueError, match="drop --compile-only \\(or --build-only\\)"):
    run.main(["--small", "--build-only", "--max-batch", "64", "--variants", "pp-1f1b"])


def test_accumulation_rows_against_plain_scan():
  # run.py's `accum` is piper-jax's gradient accumulation on every device, `accum-1f1b`
  # the same with the model's two stages sharing each device; both against `shmap-accum`
  # (plain lax.scan accumulation over the same microbatches), whose memory `accum` keeps.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  assert run.BASELINE_OF("accum") == run.BASELINE_OF("accum-1f1b") == "shmap-accum"
  _, _, directives = run.build("accum-1f1b", "tiny", 8, 4, pp=1)
  assert [type(d).__name__ for d in directives[:2]] == ["Split", "Replicate"]
  assert type(directives[-1]).__name__ == "Order"
  rows = {v: run.compile_variant(v, "tiny", batch=32, microbatches=4, pp=1)
          for v in ("shmap-accum", "accum", "accum-1f1b")}
  assert rows["accum"]["microbatches"] == rows["accum-1f1b"]["microbatches"] == 4
  # Over 8 CPU devices slots hold 64 MiB and XLA's CPU program copies the weights it
  # slices out of them (on one device, a slot per leaf: tests/test_memory.py, 1.1x).
  for v in ("accum", "accum-1f1b"):
    assert rows[v]["xla_gib"] <= 1.25 * rows["shmap-accum"]["xla_gib"], (v, rows)
  assert "x shmap-accum |" in run.compile_table(list(rows.values()))


def test_repeated_compiles_keep_each_variants_fastest(monkeypatch, tmp_path):
  # --repeat N compiles the variants N times in turn, a process each, and keeps each
  # variant's least build + XLA with every try's; a variant that failed every try keeps
  # its error.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  times = {"shmap-dp": iter([3.0, 2.0, 4.0]), "pp-1f1b+ep": iter([5.0, 6.0, 4.5])}
  order = []

  def child(args, variant, model):
    order.append(variant)
    if variant == "pp-1f1b+tp":
      return {"variant": variant, "model": model, "error": "out of memory"}
    return {"variant": variant, "model": model, "devices": 8, "build_s": 0.5,
            "compile_s": next(times[variant]),
            "xla_gib": 0.1, "collectives_in_conditionals": 0, "branch_copy_mib": 0.0}

  monkeypatch.setattr(run, "_child", child)
  rows = run.main(["--small", "--compile-only", "--repeat", "3", "--model", "moe", "--variants",
                   "shmap-dp,pp-1f1b+ep,pp-1f1b+tp", "--out", str(tmp_path / "c.json")])
  assert order == ["shmap-dp", "pp-1f1b+ep", "pp-1f1b+tp"] * 3
  dp, ep, tp = rows
  assert dp["compile_s"] == 2.0 and dp["tries_s"] == [3.5, 2.5, 4.5]
  assert ep["compile_s"] == 4.5 and ep["tries_s"] == [5.5, 6.5, 5.0]
  assert tp["error"] == "out of memory"
  with pytest.raises(ValueError, match="add --compile-only"):
    run.main(["--small", "--repeat", "2", "--variants", "jit-dp"])


def test_several_microbatch_counts_compile_in_each_turn(monkeypatch, tmp_path):
  # --microbatches 4,32 with --compile-only: each turn compiles every variant at each
  # count, so that both counts see the same drift; a row's ratio is against its
  # baseline at its own count.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import run
  xla = {("shmap-dp", 4): iter([2.0, 3.0]), ("pp-1f1b+ep", 4): iter([3.0, 2.9]),
         ("shmap-dp", 32): iter([4.0, 3.0]), ("pp-1f1b+ep", 32): iter([5.0, 4.5])}
  order = []

  def child(args, variant, model):
    order.append((variant, args.microbatches))
    row = {"variant": variant, "model": model, "devices": 8, "build_s": 0.5,
           "compile_s": next(xla[variant, args.microbatches]), "xla_gib": 0.1}
    return row if variant.startswith("shmap") else {**row, "microbatches": args.microbatches}

  monkeypatch.setattr(run, "_child", child)
  rows = run.main(["--small", "--compile-only", "--repeat", "2", "--model", "moe", "--batch", "128",
                   "--microbatches", "4,32", "--variants", "shmap-dp,pp-1f1b+ep",
                   "--out", str(tmp_path / "c.json")])
  assert order == [("shmap-dp", 4), ("pp-1f1b+ep", 4), ("shmap-dp", 32), ("pp-1f1b+ep", 32)] * 2
  assert [(r["variant"], r["microbatches"], r["compile_s"]) for r in rows] == [
      ("shmap-dp", 4, 2.0), ("pp-1f1b+ep", 4, 2.9), ("shmap-dp", 32, 3.0), ("pp-1f1b+ep", 32, 4.5)]
  text = run.compile_table(rows)
  assert "| moe-tiny | pp-1f1b+ep | 8 | 4 | 0.5 | 2.9 | 1.36x shmap-dp |" in text  # 3.4 / 2.5
  assert "| moe-tiny | pp-1f1b+ep | 8 | 32 | 0.5 | 4.5 | 1.43x shmap-dp |" in text  # 5.0 / 3.5
  assert json.load(open(tmp_path / "c.json"))["meta"]["microbatches"] == [4, 32]
  # One count: a baseline's row has none, and a suffixed one still serves its variant.
  one = [{"variant": "jit-dp+bf16", "model": "tiny", "devices": 8, "build_s": 0.0,
          "compile_s": 2.0, "xla_gib": 0.1},
         {"variant": "pp-1f1b+bf16", "model": "tiny", "devices": 8, "build_s": 0.5,
          "compile_s": 2.5, "xla_gib": 0.1, "microbatches": 4}]
  assert "| tiny | pp-1f1b+bf16 | 8 | 4 | 0.5 | 2.5 | 1.50x jit-dp+bf16 |" in run.compile_table(one)
  with pytest.raises(ValueError, match="add --compile-only"):
    run.main(["--small", "--microbatches", "4,32", "--variants", "pp-1f1b"])
  with pytest.raises(SystemExit):  # argparse's own message names the comma list
    run.main(["--small", "--compile-only", "--microbatches", "4,x", "--variants", "pp-1f1b"])
