"""Multi-process runs through jax.distributed: 2 processes x 4 CPU devices (gloo)."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import piper_jax as pj
from models import init_mlp, mlp_loss, optimizer, random_batch, reference_run

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # each process sets its own device count
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.mark.timeout(300)
def test_two_processes_match_one_process(tmp_path):
  out = tmp_path / "mp.npz"
  proc = subprocess.run([sys.executable, "-m", "piper_jax.launch", "--nprocs", "2",
                         "--devices-per-proc", "4", WORKER, str(out)],
                        capture_output=True, text=True, timeout=280, env=_env())
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(out)
  params = init_mlp(jax.random.PRNGKey(0), 2)
  batches = [random_batch(jax.random.PRNGKey(i), 16) for i in range(2)]
  ref_losses, ref_params = reference_run(mlp_loss(2), params, batches, optimizer())
  # The same strategy in this one process with 8 devices.
  step = pj.compile(mlp_loss(2), optimizer(), pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=1),
                    params, batches[0])
  state = step.init(params)
  one = []
  for b in batches:
    state, loss = step(state, b)
    one.append(float(loss))
  np.testing.assert_allclose(got["losses"], one, rtol=1e-6)
  np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5)
  for path, v in jax.tree_util.tree_flatten_with_path(step.params(state))[0]:
    key = "/".join(str(getattr(p, "key", p)) for p in path)
    np.testing.assert_allclose(got[key], np.asarray(v), rtol=1e-5, atol=1e-6)
  # The checkpoint the two processes wrote restores here, in one process, under ZeRO-3 on 4.
  other = pj.compile(mlp_loss(2), optimizer(), pj.strategies.data_parallel(4, zero=3), params,
                     batches[0])
  restored = other.params(pj.checkpoint.restore(str(out) + ".ckpt", other))
  for path, v in jax.tree_util.tree_flatten_with_path(restored)[0]:
    key = "/".join(str(getattr(p, "key", p)) for p in path)
    np.testing.assert_allclose(np.asarray(v), got[key], rtol=0, atol=0)


@pytest.mark.timeout(180)
def test_killing_one_process_ends_the_other(tmp_path):
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(2):
    env = dict(_env(), PIPER_COORDINATOR=f"127.0.0.1:{port}", PIPER_NUM_PROCESSES="2",
               PIPER_PROCESS_ID=str(i), PIPER_CPU_DEVICES="4")
    procs.append(subprocess.Popen([sys.executable, WORKER, str(tmp_path / "x.npz"), "hang"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True))
  survivor, victim = procs
  try:
    line = ""
    deadline = time.time() + 120
    while "READY" not in line and time.time() < deadline:
      line = victim.stdout.readline()
    assert "READY" in line
    victim.send_signal(signal.SIGKILL)
    t0 = time.time()
    code = survivor.wait(timeout=90)
    assert code != 0
    assert time.time() - t0 < 60
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
