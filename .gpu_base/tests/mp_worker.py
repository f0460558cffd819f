"""One process of the multi-process tests (2 processes x 4 CPU devices, gloo).

  mp_worker.py OUT                    PP2 x DP4 1F1B ZeRO-1: k adam steps, a checkpoint and
                                      one SGD step, to OUT (the case "pp_zero1")
  mp_worker.py OUT hang               the same, stepping until killed
  mp_worker.py OUT CASE[,CASE...]     each case of `case`, to OUT.CASE.npz ("all": every one)

Importing this module touches no device, so that the tests can build each case's
single-device reference from `case(name)`; `main` joins the job first.
"""

import os
import sys
import time

import jax
import numpy as np
import optax

import piper_jax as pj

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (HERE, os.path.dirname(HERE)):  # models; examples.gpt / examples.moe
  if _p not in sys.path:
    sys.path.insert(0, _p)

from models import init_mlp, mlp_loss, optimizer, random_batch  # noqa: E402

N_ADAM = 2
# tests/test_parallel.py's: eps=1e-6 keeps a rarely routed expert's rounding-level
# gradient from moving it a full adam step.
MOE_TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-6, weight_decay=0.1))
CASES = ("pp_zero1", "zero3", "dualpipev", "pp_ep")


def case(name: str) -> dict:
  """One strategy of the two-process runs: the model, its N_ADAM adam batches and SGD
  batch (`batches`, global), the directives, `devices` (indices into `jax.devices()`,
  which lists process 0's 4 devices, then process 1's), and per batch how each
  process hands it over (`feeds`: "rows": host arrays of the rows `rows(me)` names;
  "replicated": a global array replicated over all 8 devices; "reversed": a global
  array sharded over the 8 devices in reverse order)."""
  if name in ("pp_zero1", "zero3", "dualpipev"):
    n_stages = 4 if name == "dualpipev" else 2
    c = dict(loss=mlp_loss(n_stages), params=init_mlp(jax.random.PRNGKey(0), n_stages),
             tx=optimizer(), batch_size=16,
             make_batch=lambda i: random_batch(jax.random.PRNGKey(i), 16))
  else:
    from examples import gpt, moe
    config = moe.MoEConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_stages=2,
                           n_layers=2)
    model = moe.MoEGPT(config)
    # Jitted: flax's eager init took 11 s of the case's 13 on a loaded 2-core machine.
    init = jax.jit(lambda rng: gpt.init_params(model, rng))
    c = dict(loss=gpt.loss_fn(model), params=init(jax.random.PRNGKey(0)),
             tx=MOE_TX, batch_size=8,
             make_batch=lambda i: gpt.random_batch(config, jax.random.PRNGKey(i), 8,
                                                   pattern_seed=1))
  half = c["batch_size"] // 2
  c["rows"] = lambda me: slice(me * half, (me + 1) * half)
  c["feeds"] = ["rows"] * (N_ADAM + 1)
  if name == "pp_zero1":
    c["directives"] = pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=1)
    c["devices"] = list(range(8))
  elif name == "zero3":
    # ZeRO-3 over both processes' 8 devices: parameters gathered across processes.
    # Global batches of other shardings over the same devices are resharded.
    c["directives"] = pj.strategies.data_parallel(8, zero=3)
    c["devices"] = list(range(8))
    c["feeds"] = ["rows", "replicated", "reversed"]
  elif name == "dualpipev":
    # 2 ranks x 2 replicas, each pipeline across the processes (rank 0 in process 0,
    # rank 1 in process 1): every process holds a device of each replica, so each
    # passes the whole batch.
    c["directives"] = pj.strategies.pipeline(4, 4, "dualpipev", dp=2)
    c["devices"] = [0, 4, 1, 5]
    c["rows"] = lambda me: slice(None)
  else:  # pp_ep
    # Stage s on [s, 2 + s] of `devices` = one EP group of 2 whose devices sit in both
    # processes (all-to-alls across them); the pipelines stay in one process.
    c["directives"] = pj.strategies.pipeline(2, 2, "1f1b", dp=2) + [
        pj.shard({"EP": "*"}, [0, 2, 1, 3])]
    c["devices"] = [0, 1, 4, 5]
    c["feeds"] = ["rows", "replicated", "rows"]  # 8 devices' replicated onto the step's 4
  make_batch = c.pop("make_batch")
  c["batches"] = [make_batch(i) for i in range(N_ADAM + 1)]
  return c


def _global(x, devices, spec):
  from jax.sharding import Mesh, NamedSharding
  full = np.asarray(x)
  sharding = NamedSharding(Mesh(np.array(devices), ("x",)), spec)
  return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def _feed(c, batch, how):
  from jax.sharding import PartitionSpec as P
  if how == "rows":
    rows = c["rows"](jax.process_index())
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], batch)
  devices = jax.devices()
  if how == "replicated":
    return jax.tree_util.tree_map(lambda x: _global(x, devices, P()), batch)
  assert how == "reversed"
  return jax.tree_util.tree_map(lambda x: _global(x, devices[::-1], P("x")), batch)


def run_case(name: str, out_path: str, hang: bool = False) -> None:
  c = case(name)
  devices = [jax.devices()[i] for i in c["devices"]]
  compile_ = lambda tx: pj.compile(c["loss"], tx, c["directives"], c["params"], c["batches"][0],
                                   devices=devices)
  me = jax.process_index()
  extra = {}
  step = compile_(c["tx"])
  state = step.init(c["params"])
  if name == "zero3":
    # Host data of another number of rows than this process's devices take.
    try:
      step(state, jax.tree_util.tree_map(np.asarray, c["batches"][0]))
      extra["wrong_rows"] = np.array("")
    except ValueError as e:
      extra["wrong_rows"] = np.array(str(e))
  if name == "pp_ep":
    # A global batch sharded over other devices than the step's, not replicated:
    # JAX cannot reshard it across processes; the step says how to pass it.
    try:
      step(state, _feed(c, c["batches"][0], "reversed"))
      extra["refused"] = np.array("")
    except ValueError as e:
      extra["refused"] = np.array(str(e))
  losses = []
  for i in range(10**6 if hang else N_ADAM):
    state, loss = step(state, _feed(c, c["batches"][i % N_ADAM], c["feeds"][i % N_ADAM]))
    losses.append(float(loss))
    if hang and i == 0:
      print("READY", flush=True)
  if name == "pp_zero1":
    # Every process takes part; each writes only the shards it holds.
    pj.checkpoint.save(out_path + ".ckpt", state, step=N_ADAM)
  final = jax.tree_util.tree_map(np.asarray, step.params(state))
  # One plain-SGD step (learning rate 1): the parameters move by exactly the gradient.
  sgd = compile_(optax.sgd(1.0))
  sgd_state, _ = sgd(sgd.init(c["params"]), _feed(c, c["batches"][N_ADAM], c["feeds"][N_ADAM]))
  sgd_final = jax.tree_util.tree_map(np.asarray, sgd.params(sgd_state))
  if me == 0:
    np.savez(out_path, losses=np.array(losses), **extra,
             **{"params/" + k: v for k, v in flat(final)},
             **{"sgd/" + k: v for k, v in flat(sgd_final)})


def flat(tree):
  """[("a/b", leaf), ...]: a pytree's leaves by path."""
  return [("/".join(str(getattr(p, "key", p)) for p in path), v)
          for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def main(out_path: str, what: str = "") -> None:
  pj.distributed.initialize()
  assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
  if what in ("", "hang"):
    return run_case("pp_zero1", out_path, hang=what == "hang")
  for name in CASES if what == "all" else what.split(","):
    t0 = time.time()
    run_case(name, f"{out_path}.{name}.npz")
    print(f"process {jax.process_index()}: {name} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
