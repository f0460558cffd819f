"""The local launcher: examples/train.py over 2 processes x 4 CPU devices trains one model
(the losses of one process over 8 devices, printed once), and a script that never joins
the job fails the launch instead of running as independent copies."""

import os
import re
import subprocess
import sys

import pytest

from examples import train

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
ARGS = ["--model", "tiny", "--strategy", "zero1", "--batch", "8", "--steps", "2",
        "--data", "synthetic", "--log-every", "1"]


def _env() -> dict:
  env = dict(os.environ)
  # Each process takes the launcher's device count; the other flags carry over.
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _launch(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "piper_jax.launch", *argv], cwd=ROOT,
                        env=_env(), capture_output=True, text=True, timeout=timeout)


def _losses(stdout: str) -> list[tuple[int, float]]:
  return [(int(m[1]), float(m[2])) for m in re.finditer(r"^step +(\d+) +loss ([\d.]+)", stdout,
                                                        re.M)]


def test_two_processes_train_one_model_and_print_once(capsys):
  run = _launch("--nprocs", "2", "--devices-per-proc", "4", TRAIN, *ARGS)
  assert run.returncode == 0, run.stderr[-4000:]
  assert run.stdout.count("devices: 8 x cpu") == 1, run.stdout
  got = _losses(run.stdout)
  assert [s for s, _ in got] == [1, 2], run.stdout
  train.main(ARGS)  # the same run in this process, over its 8 devices
  one = _losses(capsys.readouterr().out)
  assert [s for s, _ in one] == [1, 2]
  # Printed to 4 decimals: equal up to the last digit's rounding.
  assert [v for _, v in got] == pytest.approx([v for _, v in one], abs=2e-4)

def test_launcher_refuses_a_script_that_never_joins(tmp_path):
  script = tmp_path / "alone.py"
  script.write_text("print('ran')\n")
  run = _launch("--nprocs", "2", str(script), timeout=60)
  assert run.returncode != 0
  assert "without joining the job" in run.stderr, run.stderr
  assert "call `pj.distributed.initialize()`" in run.stderr, run.stderr


def test_launcher_passes_on_a_failing_process_code(tmp_path):
  script = tmp_path / "fails.py"
  script.write_text("import sys\nsys.exit(3)\n")
  run = _launch("--nprocs", "2", str(script), timeout=60)
  assert run.returncode == 3, run.stderr
  assert "without joining" not in run.stderr
