"""One process of the multi-process test: PP2 x DP4 1F1B ZeRO-1 over 2 processes x 4 devices."""

import sys

import piper_jax as pj

pj.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from models import init_mlp, mlp_loss, optimizer, random_batch  # noqa: E402


def main(out_path, n_steps=2, batch_size=16, hang=False):
  assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
  params = init_mlp(jax.random.PRNGKey(0), 2)
  batches = [random_batch(jax.random.PRNGKey(i), batch_size) for i in range(n_steps)]
  step = pj.compile(mlp_loss(2), optimizer(), pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=1),
                    params, batches[0])
  state = step.init(params)
  half = batch_size // 2
  me = jax.process_index()
  losses = []
  for i in range(10**6 if hang else n_steps):
    b = batches[i % n_steps]
    local = jax.tree_util.tree_map(lambda x: np.asarray(x)[me * half:(me + 1) * half], b)
    state, loss = step(state, local)
    losses.append(float(loss))
    if hang and i == 0:
      print("READY", flush=True)
  if not hang:
    # Every process takes part; each writes only the shards it holds.
    pj.checkpoint.save(out_path + ".ckpt", state, step=n_steps)
  final = jax.tree_util.tree_map(np.asarray, step.params(state))
  if me == 0:
    np.savez(out_path, losses=np.array(losses),
             **{"/".join(map(str, k)): v for k, v in _flat(final)})


def _flat(tree):
  return [(tuple(getattr(p, "key", p) for p in path), v)
          for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


if __name__ == "__main__":
  main(sys.argv[1], hang=len(sys.argv) > 2 and sys.argv[2] == "hang")
