"""The example's training loop: checkpoints, resume (also under another strategy), NaN stop."""

import json
import re
import shutil
import time

import numpy as np
import pytest

from examples import train

pytestmark = pytest.mark.timeout(300)

PP = ["--strategy", "pp-1f1b", "--stages", "2", "--dp", "2", "--zero", "1", "--microbatches", "2",
      "--batch", "8", "--quiet"]


def test_resume_after_kill_gives_the_same_losses(tmp_path):
  # (`--check` before training: test_check's runs of this script.)
  full = train.main(PP + ["--steps", "4", "--ckpt-dir", str(tmp_path / "a"),
                          "--ckpt-every", "2", "--metrics", str(tmp_path / "m.jsonl")])
  rows = [json.loads(l) for l in open(tmp_path / "m.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  # A run stopped after step 2, then resumed: on the same strategy, and on ZeRO-3 over 8.
  train.main(PP + ["--steps", "2", "--ckpt-dir", str(tmp_path / "b"), "--ckpt-every", "1"])
  shutil.copytree(tmp_path / "b", tmp_path / "c")
  same = train.main(PP + ["--steps", "4", "--ckpt-dir", str(tmp_path / "b"), "--resume"])
  np.testing.assert_allclose(same["losses"], full["losses"][2:], rtol=1e-5)
  other = train.main(["--strategy", "zero3", "--batch", "8", "--quiet", "--steps", "4",
                      "--ckpt-dir", str(tmp_path / "c"), "--resume"])
  np.testing.assert_allclose(other["losses"], full["losses"][2:], rtol=1e-5)
  # Step 4's checkpoint exists in "a"; resuming at 4 of 3 runs nothing.
  again = train.main(PP + ["--steps", "3", "--ckpt-dir", str(tmp_path / "a"), "--resume"])
  assert again["losses"] == []


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  with pytest.raises(train.TrainingDiverged, match="Last good checkpoint: step"):
    train.main(PP + ["--steps", "30", "--lr", "1e30", "--ckpt-dir", str(tmp_path / "d"),
                         "--ckpt-every", "1"])


@pytest.mark.parametrize("argv,n_devices,match", [
    (["--strategy", "dp", "--ep"], 8, "add --experts"),
    (["--strategy", "pp-1f1b", "--stages", "2", "--dp", "4", "--experts", "6", "--ep",
      "--batch", "16"], 8, "must divide over the data-parallel devices"),
    (["--strategy", "pp-1f1b", "--stages", "4", "--dp", "4"], 8, "needs 16 devices"),
    (["--strategy", "pp-dualpipev", "--stages", "3"], 8, "even --stages"),
    (["--strategy", "dp", "--batch", "12"], 8, "divisible by the 8 devices"),
    (["--strategy", "dp", "--calibrate", "t.json"], 8, "add --strategy auto"),
    (["--strategy", "dp", "--plan-for", "H200"], 8, "add --strategy auto"),
    (["--strategy", "auto", "--plan-for", "B300"], 8, "choose one of H100, H200, A100"),
    (["--strategy", "auto", "--plan-devices", "64"], 8, "add --plan-for CARD"),
])
def test_usage_errors(argv, n_devices, match):
  with pytest.raises(train.UsageError, match=match):
    train.build_strategy(train.parse_args(argv), n_devices)


def test_log_every_must_be_positive():
  with pytest.raises(train.UsageError, match="--log-every must be >= 1, got 0"):
    train.main(["--strategy", "dp", "--log-every", "0", "--quiet"])


def test_two_stages_per_device_count_devices_right():
  # DualPipeV and interleaved hold two stages per device: 4 stages x DP 2 use 4 devices.
  args = train.parse_args(["--strategy", "pp-dualpipev", "--stages", "4", "--dp", "2",
                               "--microbatches", "4", "--batch", "8", "--experts", "4", "--ep"])
  directives, n_used, n_stages = train.build_strategy(args, 4)
  assert (n_used, n_stages) == (4, 4)
  assert directives[-1].devices == (0, 1, 2, 3)


DP = ["--strategy", "dp", "--batch", "8", "--data", "synthetic"]


def test_piped_output_is_a_line_per_log_every_and_saves_are_timed_apart(tmp_path, capsys,
                                                                      monkeypatch):
  # capsys is no terminal: plain lines, no progress bar. A CPU's peak FLOP/s is unknown,
  # so no MFU. A slow save shows on its own line, not in the steps' tok/s.
  def slow_save(directory, state, step):
    time.sleep(1.0)

  monkeypatch.setattr(train.pj.checkpoint, "save", slow_save)
  train.main(DP + ["--steps", "6", "--log-every", "2", "--ckpt-dir", str(tmp_path / "k"),
                   "--ckpt-every", "2", "--metrics", str(tmp_path / "m.jsonl")])
  captured = capsys.readouterr()
  lines = captured.out.splitlines()
  steps = [l for l in lines if re.match(r"step +\d+ +loss", l)]
  assert len(steps) == 3, captured.out
  for done, line in zip((2, 4, 6), steps):
    assert re.fullmatch(rf"step +{done} +loss \d+\.\d{{4}} +[\d,]+ tok/s +lr 1\.00e-03", line), line
  assert sum("checkpoint saved" in l for l in lines) == 3, captured.out
  assert "MFU" not in captured.out + captured.err
  assert "\r" not in captured.out + captured.err  # no progress bar redraws
  rows = [json.loads(l) for l in open(tmp_path / "m.jsonl")]
  assert "mfu" not in rows[0] and rows[0]["lr"] == 1e-3
  assert all(r["seconds"] < 0.5 for r in rows if r["step"] > 2), rows  # after compilation


def test_help_shows_every_default(capsys):
  with pytest.raises(SystemExit):
    train.main(["--help"])
  out = capsys.readouterr().out
  # Each option's entry starts on a line indented by two spaces; its help wraps below.
  entries = re.split(r"\n(?=  -)", out.split("options:", 1)[1])[1:]
  entries = [" ".join(e.split()) for e in entries if not e.lstrip().startswith("-h")]
  assert len(entries) == len(train.build_parser()._actions) - 1, out
  for entry in entries:
    assert "default" in entry, entry
  for shown in ("(default: pp-1f1b)", "(default: 10)", "(default: 16)", "(default: 0.001)"):
    assert shown in " ".join(entries)


def test_moe_metrics_and_learning_rate_are_logged(tmp_path, capsys):
  # A MoE Qwen3 reports its cross-entropy and load-balancing loss beside their sum
  # (pj.compile(has_aux=True)), combined over microbatches and replicas as the loss is.
  argv = ["--model", "qwen3-moe-tiny", "--strategy", "pp-1f1b", "--stages", "2", "--dp", "2",
          "--microbatches", "2", "--batch", "8", "--steps", "3", "--log-every", "1",
          "--warmup", "2", "--decay", "cosine", "--lr", "1e-2", "--data", "synthetic",
          "--metrics", str(tmp_path / "m.jsonl")]
  out = train.main(argv)
  assert out["step"].has_aux and out["step"].aux_names == ["aux['ce']", "aux['load_balance']"]
  rows = [json.loads(l) for l in open(tmp_path / "m.jsonl")]
  coef = 1e-3  # router_aux_coef of the preset
  for r in rows:
    assert r["loss"] == pytest.approx(r["ce"] + coef * r["load_balance"], rel=1e-5)
    assert r["load_balance"] >= 1.0  # n_experts * sum_e f_e P_e: top_k when balanced
  schedule = train.learning_rate(train.parse_args(argv))
  assert [r["lr"] for r in rows] == [float(schedule(i)) for i in range(3)]
  assert rows[0]["lr"] == 0 and rows[1]["lr"] == pytest.approx(5e-3)
  assert "mfu" not in rows[0]  # a CPU's peak is unknown
  printed = capsys.readouterr().out
  assert re.search(r"step +3  loss [\d.]+  ce [\d.]+  load_balance [\d.]+  [\d,]+ tok/s  lr ", printed)


def test_plan_for_cards_this_machine_does_not_have(capsys):
  # 64 H200s planned on this CPU, on shapes: nothing initialised, compiled or run.
  out = train.main(["--strategy", "auto", "--plan-for", "H200", "--plan-devices", "64",
                    "--model", "tiny", "--batch", "64", "--dtype", "bfloat16"])
  result = out["search"]
  assert result.candidates and all(c.n_ranks * c.dp == 64 for c in result.candidates)
  assert "strategy search for 64 x H200 (140 GiB each)" in capsys.readouterr().out
