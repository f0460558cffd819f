"""piper-jax in one file: a small Flax model trained with a 1F1B pipeline x data parallel.

Run from the repository root (after `make install` or `pip install -e .`):

  python examples/quickstart.py

It splits the model into two pipeline stages, runs each stage on its own devices
(2 stages x DP replicas), trains a few steps and checks that the first loss is the
one plain `jax.value_and_grad` computes on one device.
"""

import os

# Without GPUs, let XLA's CPU backend pretend to be 8 devices. XLA reads the flag once,
# when JAX starts its backend, so it must be set before `import jax`; it does nothing
# on GPUs, and a flag you already set wins.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import piper_jax as pj  # noqa: E402

D_IN, WIDTH, N_CLASSES = 16, 64, 10


class Block(nn.Module):
  """A pre-norm residual MLP block."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x)))
    return x + nn.Dense(WIDTH)(h)


class Model(nn.Module):
  """An input projection, two pipeline stages of two blocks each, and a classifier."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)          # outside every region: joins the first stage
    with pj.annotate("PP"):         # stage 0 (region PP=0)
      x = Block()(Block()(x))
    with pj.annotate("PP"):         # stage 1 (region PP=1)
      x = Block()(Block()(x))
    return nn.Dense(N_CLASSES)(nn.LayerNorm()(x))  # joins the last stage


model = Model()


def loss_fn(params, batch):
  """The mean loss over the batch's leading axis, as piper-jax expects."""
  logits = model.apply(params, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def random_batch(rng, batch_size):
  kx, ky = jax.random.split(rng)
  return {"x": jax.random.normal(kx, (batch_size, D_IN)),
          "y": jax.random.randint(ky, (batch_size,), 0, N_CLASSES)}


def main(steps=5):
  """Trains `steps` steps; returns (piper-jax losses, plain one-device losses)."""
  n_devices = jax.device_count()
  assert n_devices >= 2, "a 2-stage pipeline needs at least 2 devices"
  dp = n_devices // 2                     # each stage replicated over n_devices/2 devices
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, D_IN)))
  batches = [random_batch(jax.random.PRNGKey(i), 8 * dp) for i in range(steps)]  # 2 rows per microbatch and replica
  tx = optax.adamw(1e-3)

  # 2 stages x `dp` replicas, 4 microbatches per step, 1F1B order, ZeRO-1 over the replicas.
  directives = pj.strategies.pipeline(n_stages=2, n_microbatches=4, schedule="1f1b",
                                      dp=dp, zero=1)
  step = pj.compile(loss_fn, tx, directives, params, batches[0])
  print(step.plan)                        # what every device runs, tick by tick

  state = step.init(params)               # partitioned parameters + optimizer state
  losses = []
  for batch in batches:
    state, loss = step(state, batch)
    losses.append(float(loss))
  trained = step.params(state)            # the original pytree, gathered

  # The same steps in plain JAX on one device: jax.value_and_grad + the optax update.
  @jax.jit
  def plain_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  one = jax.devices()[0]
  p, opt_state = jax.device_put((params, tx.init(params)), one)
  plain = []
  for batch in batches:
    p, opt_state, loss = plain_step(p, opt_state, jax.device_put(batch, one))
    plain.append(float(loss))

  for i, (a, b) in enumerate(zip(losses, plain)):
    print(f"step {i}: loss {a:.6f} (one device: {b:.6f})")
  # Same numbers up to float rounding (fp32 matmuls on GPUs default to TF32: looser).
  rtol = 1e-5 if one.platform == "cpu" else 2e-2
  np.testing.assert_allclose(losses, plain, rtol=rtol)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=10 * rtol, atol=1e-6),
                         trained, p)
  return losses, plain


if __name__ == "__main__":
  main()
