"""Small annotated models and the single-device reference the tests compare against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import piper_jax as pj

D_IN, D_HID, N_CLASSES = 8, 16, 5


def init_mlp(rng, n_stages: int, tied: bool = False):
  """Per stage a dense layer; an embedding of the inputs and a classifier head."""
  ks = jax.random.split(rng, n_stages + 2)
  params = {"embed": jax.random.normal(ks[0], (D_IN, D_HID)) * 0.3}
  for s in range(n_stages):
    params[f"stage{s}"] = {"w": jax.random.normal(ks[1 + s], (D_HID, D_HID)) * 0.3,
                           "b": jnp.zeros((D_HID,)) + 0.01 * s}
  if not tied:
    params["head"] = jax.random.normal(ks[-1], (D_HID, N_CLASSES)) * 0.3
  return params


def mlp_loss(n_stages: int, tied: bool = False):
  """Mean softmax cross-entropy of an MLP with one PP region per stage."""

  def loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["embed"])
    for s in range(n_stages):
      with pj.annotate("PP"):
        p = params[f"stage{s}"]
        x = x + jnp.tanh(x @ p["w"] + p["b"])
    head = params["embed"][:N_CLASSES].T if tied else params["head"]
    logits = x @ head
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss


def random_batch(rng, batch_size: int):
  kx, ky = jax.random.split(rng)
  return {"x": jax.random.normal(kx, (batch_size, D_IN)),
          "y": jax.random.randint(ky, (batch_size,), 0, N_CLASSES)}


def optimizer():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def reference_run(loss_fn, params, batches, tx):
  """k steps of plain jax.value_and_grad + optax on one device: (losses, params)."""
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for b in batches:
    params, opt_state, loss = step(params, opt_state, b)
    losses.append(float(loss))
  return losses, params


def piper_run(loss_fn, params, batches, tx, directives, **kw):
  step = pj.compile(loss_fn, tx, directives, params, batches[0], **kw)
  state = step.init(params)
  losses = []
  for b in batches:
    state, loss = step(state, b)
    losses.append(float(loss))
  return losses, step.params(state), step, state


def assert_same_run(loss_fn, params, directives, n_steps=2, batch_size=16, seed=0, tx=None,
                    check_sgd=True, **kw):
  """Asserts k steps under `directives` match the single-device run (fp32, tight).

  Losses agree to 1e-5 relative and gradients (read off one SGD step with
  learning rate 1, unless `check_sgd` is False because another test of the same
  strategy reads them) to 1e-5; parameters after k adamw steps to 1e-4 relative,
  with an absolute floor of 0.5% of one update for elements whose gradient is
  at rounding level (Adam normalises those to a full-size step).
  """
  tx = tx or optimizer()
  fresh = lambda i: random_batch(jax.random.PRNGKey(seed * 100 + i), batch_size)
  batches = [fresh(i) for i in range(n_steps)]
  ref_losses, ref_params = reference_run(loss_fn, params, batches, tx)
  losses, got_params, step, state = piper_run(loss_fn, params, batches, tx, directives, **kw)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=5e-5),
      got_params, ref_params)
  if not check_sgd:
    return step, state
  grad_batch = fresh(n_steps)
  ref_grads = jax.jit(jax.grad(loss_fn))(params, grad_batch)
  _, sgd_params, _, _ = piper_run(loss_fn, params, [grad_batch], optax.sgd(1.0), directives, **kw)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(ref_grads))
  jax.tree_util.tree_map(
      lambda p, q, g: np.testing.assert_allclose(np.asarray(p - q), np.asarray(g), rtol=1e-5,
                                                 atol=1e-5 * scale),
      params, sgd_params, ref_grads)
  return step, state


def assert_updates_close(got, ref, start, grads, bound=0.1):
  """Asserts each leaf moved from `start` as in the reference run, leaf by leaf:
  ||(got - start) - (ref - start)|| <= bound * ||ref - start||.

  For bf16-compute runs, whose elements differ from one device's by rounding: a
  frozen or dropped leaf (relative error 1) or one moved at another scale (a gradient
  doubled: 1 under SGD) fails the bound, which rounding stays far below. Elements
  whose gradient (`grads`, the reference's) is at bf16 rounding level, as an attention
  key's bias, move by noise and are left out.
  """
  leaves = lambda t: [np.asarray(x, np.float32).ravel() for x in jax.tree_util.tree_leaves(t)]
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(start)]
  rms = lambda xs: float(np.sqrt(sum(np.sum(x * x) for x in xs) / sum(x.size for x in xs)))
  g_rms = rms(leaves(grads))
  wants = [r - s for r, s in zip(leaves(ref), leaves(start))]
  norm = lambda x: float(np.linalg.norm(x))
  for name, g, s, want, grad in zip(paths, leaves(got), leaves(start), wants, leaves(grads)):
    signal = np.abs(grad) >= 1e-2 * g_rms
    if not signal.any():
      continue
    moved, want = (g - s)[signal], want[signal]
    assert norm(want) > 0, f"{name} did not move in the reference run: the test cannot check it"
    err = norm(moved - want) / norm(want)
    assert err <= bound, f"{name}: update differs from one device's by {err:.3f} of its norm"


def assert_same_bf16_run(loss_fn, params, batches, directives, tx=None, losses=None, got=None,
                         sgd=True, **kw):
  """Checks a bf16-compute run under `directives` against the same model on one device:
  losses to 2e-2, every leaf's k-step update (to 0.3 of its norm) and, unless `sgd` is
  False because another test runs the same bf16 path, one plain-SGD step's update (to
  0.1: `assert_updates_close`). `losses`/`got` reuse a run already made."""
  tx = tx or optimizer()
  ref_losses, ref_params = reference_run(loss_fn, params, batches, tx)
  if losses is None:
    losses, got, _, _ = piper_run(loss_fn, params, batches, tx, directives, **kw)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
  grads = jax.jit(jax.grad(loss_fn))(params, batches[0])
  # Adam's k steps: looser, since it moves elements with small gradients a full step
  # whatever their rounding; the SGD step holds the gradients to 0.1.
  assert_updates_close(got, ref_params, params, grads, bound=0.3)
  if not sgd:
    return
  _, sgd_ref = reference_run(loss_fn, params, batches[:1], optax.sgd(1.0))
  _, sgd_got, _, _ = piper_run(loss_fn, params, batches[:1], optax.sgd(1.0), directives, **kw)
  assert_updates_close(sgd_got, sgd_ref, params, grads)


def _gpt_model(make_config, make_model, n_stages, kw):
  from examples import gpt
  kw.setdefault("n_layers", max(2, n_stages))
  config = make_config(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_stages=n_stages, **kw)
  model = make_model(config)
  # Flax's init under jit: a few seconds instead of op by op.
  params = jax.jit(lambda rng: gpt.init_params(model, rng))(jax.random.PRNGKey(0))
  return config, gpt.loss_fn(model), params


def moe_gpt(n_stages=1, **kw):
  """(config, loss, params) of a tiny MoE GPT (examples/moe.py); `kw` go to its config."""
  from examples import moe
  return _gpt_model(moe.MoEConfig, moe.MoEGPT, n_stages, kw)


def tp_gpt(n_stages=1, **kw):
  """(config, loss, params) of a tiny GPT with Megatron names for tensor parallelism."""
  from examples import gpt
  return _gpt_model(gpt.GPTConfig, gpt.GPT, n_stages, {"tp_axis": "tp", **kw})


def shard_map_body(jaxpr):
  """The jaxpr of the first shard_map inside `jaxpr` (searched through nested calls)."""
  from jax.extend.core import Jaxpr
  for e in jaxpr.eqns:
    if e.primitive.name == "shard_map":
      return e.params["jaxpr"]
    for inner in e.params.values():
      inner = getattr(inner, "jaxpr", inner)
      if isinstance(inner, Jaxpr) and (found := shard_map_body(inner)):
        return found


def bytes_on_device(tree, device) -> int:
  """Bytes of the arrays of `tree` (a step's state) held on `device`."""
  return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
             for s in x.addressable_shards if s.device == device)


def collectives_in_conds(jaxpr, inside: bool = False) -> list[str]:
  """The collective primitives of a jaxpr (and of those it calls) that sit inside a
  `cond`: the traced counterpart of `lowering.collectives_in_conditionals`."""
  from piper_jax.lowering.phases import COLLECTIVES
  found = []
  for e in jaxpr.eqns:
    if inside and e.primitive.name in COLLECTIVES:
      found.append(e.primitive.name)
    for v in e.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found += collectives_in_conds(sub, inside or e.primitive.name == "cond")
  return found
