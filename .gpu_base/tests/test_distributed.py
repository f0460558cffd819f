"""Multi-process runs through jax.distributed: 2 processes x 4 CPU devices (gloo).

One launch (the `two_processes` fixture) runs every strategy of `mp_worker.CASES`, to
pay the processes' start-up once; each test reads its strategy's numbers and checks
them against one device: the losses and parameters of k adam steps, and one plain-SGD
step's parameters (which hold the gradients to their scale: adam and global-norm
clipping would hide a wrong one).
"""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mp_worker
import piper_jax as pj
from models import init_mlp, mlp_loss, optimizer, random_batch, reference_run

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")


def _env():
  env = dict(os.environ)
  # Each process sets its own device count; the other flags (conftest's optimization
  # level) carry over.
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _reference(name):
  """Case `name` on one device: k adam steps (losses, parameters) and the SGD batch's
  gradients."""
  c = mp_worker.case(name)
  n = mp_worker.N_ADAM
  losses, params = reference_run(c["loss"], c["params"], c["batches"][:n], c["tx"])
  grads = jax.jit(jax.grad(c["loss"]))(c["params"], c["batches"][n])
  return dict(case=c, losses=losses, params=params, grads=grads)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """Starts every case of the worker in one two-process launch and, while it runs, the
  cases' references on one device. Returns `outputs(name)`: a case's saved numbers,
  their path and its reference, once the launch has ended."""
  out = str(tmp_path_factory.mktemp("mp") / "mp")
  proc = subprocess.Popen([sys.executable, "-m", "piper_jax.launch", "--nprocs", "2",
                           "--devices-per-proc", "4", WORKER, out, "all"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
  ended = {}

  def outputs(name):
    if not ended:
      try:
        _, ended["stderr"] = proc.communicate(timeout=480)
      except subprocess.TimeoutExpired:
        proc.kill()
        _, ended["stderr"] = proc.communicate()
    assert proc.returncode == 0, ended["stderr"][-4000:]
    return np.load(f"{out}.{name}.npz"), f"{out}.{name}.npz", refs[name]

  try:
    refs = {name: _reference(name) for name in mp_worker.CASES}
    yield outputs
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()


def _assert_matches_one_device(two_processes, name):
  """The two processes' run of case `name` against plain jax.grad + optax on one device."""
  got, _, ref = two_processes(name)
  np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
  for key, v in mp_worker.flat(ref["params"]):
    np.testing.assert_allclose(got["params/" + key], np.asarray(v), rtol=1e-4, atol=5e-5,
                               err_msg=key)
  grads = ref["grads"]
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(grads))
  for (key, p), (_, g) in zip(mp_worker.flat(ref["case"]["params"]), mp_worker.flat(grads)):
    np.testing.assert_allclose(np.asarray(p) - got["sgd/" + key], np.asarray(g), rtol=1e-5,
                               atol=1e-5 * scale, err_msg=f"SGD step of {key}")


@pytest.mark.timeout(600)
def test_two_processes_match_one_process(two_processes):
  c = mp_worker.case("pp_zero1")
  params, batches = c["params"], c["batches"][:mp_worker.N_ADAM]
  # The same strategy in this one process with 8 devices.
  step = pj.compile(c["loss"], c["tx"], c["directives"], params, batches[0])
  state = step.init(params)
  one = []
  for b in batches:
    state, loss = step(state, b)
    one.append(float(loss))
  _assert_matches_one_device(two_processes, "pp_zero1")
  got, out, _ = two_processes("pp_zero1")
  np.testing.assert_allclose(got["losses"], one, rtol=1e-6)
  for key, v in mp_worker.flat(step.params(state)):
    np.testing.assert_allclose(got["params/" + key], np.asarray(v), rtol=1e-5, atol=1e-6)
  # The checkpoint the two processes wrote restores here, in one process, under ZeRO-3 on 4.
  other = pj.compile(c["loss"], optimizer(), pj.strategies.data_parallel(4, zero=3), params,
                     batches[0])
  restored = other.params(pj.checkpoint.restore(out + ".ckpt", other))
  for key, v in mp_worker.flat(restored):
    np.testing.assert_allclose(np.asarray(v), got["params/" + key], rtol=0, atol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["zero3", "dualpipev", "pp_ep"])
def test_two_processes_match_one_device(name, two_processes):
  # ZeRO-3 over 8 devices (batches: host rows, then global arrays replicated and sharded
  # over the devices in another order); DualPipeV with each pipeline across the two
  # processes (each passes the whole batch); PP x EP with each EP group across them
  # (a batch replicated over all 8 devices goes onto the step's 4).
  _assert_matches_one_device(two_processes, name)


@pytest.mark.timeout(600)
def test_two_processes_refuse_batches_they_cannot_take(two_processes):
  # Host rows that are not this process's; a global batch sharded (not replicated) over
  # other devices than the step's, which JAX reshards across processes only within one
  # device set.
  got, _, _ = two_processes("zero3")
  msg = str(got["wrong_rows"])  # process 0's, given the whole batch as host data
  assert msg.startswith("batch['x'] has shape (16, 8): with 2 processes pass the 8 rows this "
                        "process's devices take (rows 0:8 of the global batch), shape (8, 8)"), msg
  got, _, _ = two_processes("pp_ep")
  msg = str(got["refused"])
  assert msg.startswith("batch['targets'] is a global jax.Array sharded as"), msg
  assert "pass it sharded as `step.batch_sharding`" in msg, msg


def test_one_process_takes_global_batches_of_other_shardings():
  # One process, 8 devices, a step on 4: batches replicated over all 8, sharded over
  # them in reverse order, and committed to one device are moved onto the step's
  # sharding; one already sharded so passes as it is.
  params = init_mlp(jax.random.PRNGKey(0), 2)
  batches = [random_batch(jax.random.PRNGKey(i), 16) for i in range(3)]
  tx = optax.sgd(1.0)
  step = pj.compile(mlp_loss(2), tx, pj.strategies.pipeline(2, 2, "1f1b", dp=2), params,
                    batches[0])
  devices = jax.devices()
  feeds = [NamedSharding(Mesh(np.array(devices), ("x",)), P()),
           NamedSharding(Mesh(np.array(devices[::-1]), ("x",)), P("x")),
           jax.sharding.SingleDeviceSharding(devices[7])]
  state = step.init(params)
  losses = []
  for b, sharding in zip(batches, feeds):
    state, loss = step(state, jax.device_put(b, sharding))
    losses.append(float(loss))
  ref_losses, ref_params = reference_run(mlp_loss(2), params, batches, tx)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
      step.params(state), ref_params)
  assert isinstance(step.batch_sharding, NamedSharding)
  placed = jax.device_put(batches[0], step.batch_sharding)
  assert all(a is b for a, b in zip(step._batch_leaves(placed), jax.tree_util.tree_leaves(placed)))


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
