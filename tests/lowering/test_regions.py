"""Regions that trace alike (`lowering/regions.py` `region_key`): a pipeline's equal
middle stages are analysed once and share the jaxprs under their own names; a stage
of other shapes is traced by itself."""

import jax
import jax.numpy as jnp
import optax
import pytest

import piper_jax as pj
from piper_jax.lowering import program

pytestmark = pytest.mark.timeout(120)

D = 8


@jax.custom_vjp
def _tanh(x):
  return jnp.tanh(x)


_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda y, g: (g * (1 - y * y),))


@jax.custom_vjp
def _tanh_straight_through(x):
  return jnp.tanh(x)


_tanh_straight_through.defvjp(lambda x: (jnp.tanh(x), None), lambda _, g: (g,))


def _model(hidden: tuple[int, ...], wrap: str | None = None):
  """Params and loss of an MLP with one PP region per entry of `hidden` (its width).
  `wrap`: "checkpoint", each stage's hidden layer under its own `jax.checkpoint`;
  "custom_vjp", its tanh a custom derivative's; "custom_vjp_apart", the same, but stage
  2's passes its cotangent straight through."""
  ks = jax.random.split(jax.random.PRNGKey(0), 2 * len(hidden) + 1)
  params = {"head": jax.random.normal(ks[-1], (D, 3)) * 0.3}
  for s, h in enumerate(hidden):
    params[f"stage{s}"] = {"w1": jax.random.normal(ks[2 * s], (D, h)) * 0.3,
                           "w2": jax.random.normal(ks[2 * s + 1], (h, D)) * 0.3}

  def loss(params, batch):
    x = batch["x"]
    for s in range(len(hidden)):
      with pj.annotate("PP"):
        p = params[f"stage{s}"]
        tanh = jnp.tanh
        if wrap in ("custom_vjp", "custom_vjp_apart"):  # each call wraps its rules anew
          tanh = _tanh_straight_through if wrap == "custom_vjp_apart" and s == 2 else _tanh
        hidden_layer = lambda x, w, tanh=tanh: tanh(x @ w)
        if wrap == "checkpoint":  # each stage traces its own checkpoint jaxpr
          hidden_layer = jax.checkpoint(hidden_layer)
        x = x + hidden_layer(x, p["w1"]) @ p["w2"]
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  batch = {"x": jnp.ones((8, D)), "y": jnp.zeros((8,), jnp.int32)}
  return loss, params, batch


def _compile(hidden, monkeypatch, wrap=None):
  """The step, its program and the regions `analyze_region` traced."""
  traced = []
  real = program.analyze_region

  def counting(runner, r, remat=False):
    traced.append(r)
    return real(runner, r, remat)

  monkeypatch.setattr(program, "analyze_region", counting)
  loss, params, batch = _model(hidden, wrap)
  step = pj.compile(loss, optax.sgd(0.1), pj.strategies.pipeline(len(hidden), 4, schedule="1f1b"),
                    params, batch, devices=jax.devices()[:len(hidden)])
  return step, step._program, traced


@pytest.mark.parametrize("wrap, analysed", [("checkpoint", [0, 1, 3]),
                                             ("custom_vjp", [0, 1, 3]),
                                             ("custom_vjp_apart", [0, 1, 2, 3])])
def test_wrapped_stages_are_traced_once_and_step_as_one_device(monkeypatch, wrap, analysed):
  # Each stage's checkpoint holds a jaxpr of its own, and each custom derivative call
  # its own rule objects; equal ones still key alike, other rules apart.
  step, _, traced = _compile((16, 16, 16, 16), monkeypatch, wrap)
  assert traced == analysed
  loss, params, batch = _model((16, 16, 16, 16), wrap)
  state = step.init(params)
  state, _ = step(state, batch)
  grads = jax.grad(loss)(params, batch)
  want = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
  got = step.params(state)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert jnp.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_equal_stages_are_traced_once(monkeypatch):
  _, prog, traced = _compile((16, 16, 16, 16), monkeypatch)
  # The first stage takes the batch and the last one the head: only 1 and 2 are equal.
  assert traced == [0, 1, 3]
  a, b = prog.ad[1], prog.ad[2]
  assert b.region == 2 and b.stored == a.stored and b.jaxpr.eqns[0].outvars == a.jaxpr.eqns[0].outvars
  assert prog.split[2].jaxpr.outvars == prog.split[1].jaxpr.outvars
  # The copy carries region 2's names, as its own trace would.
  names = lambda j: {str(e.source_info.name_stack) for e in j.eqns}
  for j2, j1 in ((b.jaxpr, a.jaxpr), (prog.split[2].jaxpr, prog.split[1].jaxpr)):
    assert any("PP=2" in n for n in names(j2)) and not any("PP=1" in n for n in names(j2))
    assert any("PP=1" in n for n in names(j1))


def test_a_stage_of_other_shapes_is_traced_apart(monkeypatch):
  _, prog, traced = _compile((16, 16, 32, 16), monkeypatch)
  assert traced == [0, 1, 2, 3]
  assert prog.ad[2].stored != prog.ad[1].stored


def test_rotary_tables_are_recomputed_not_stored():
  # cos and sin of positions (rotary embeddings) depend on no input: B redoes them
  # instead of F storing them per microbatch; the matmul's input is what F keeps.
  from piper_jax.lowering.local import RegionRunner
  from piper_jax.lowering.regions import analyze_region
  from piper_jax.lowering.trace import trace_loss

  def loss(params, batch):
    with pj.annotate("PP"):
      pos = jnp.arange(batch["x"].shape[1], dtype=jnp.float32)
      angle = pos[:, None] * params["freq"][None, :]
      x = batch["x"] * jnp.cos(angle) + batch["x"] * jnp.sin(angle)
      y = x @ params["w"]
    return jnp.mean(y ** 2)

  params = {"freq": jnp.ones((D,)), "w": jnp.ones((D, D))}
  batch = {"x": jnp.ones((4, 16, D))}
  runner = RegionRunner(trace_loss(loss, params, batch))
  stored = analyze_region(runner, 0, remat=False).stored_avals
  assert [tuple(a.shape) for a in stored] == [(4, 16, D)], stored


@pytest.mark.parametrize("act", ["gelu", "gelu_exact", "silu", "sigmoid", "tanh"])
def test_an_activations_backward_reads_only_the_matmuls_output(act):
  # Under remat B redoes an activation from the matmul output F keeps, whatever
  # primitives this jax's derivative rules use (jax 0.11's tanh writes its derivative
  # as `one_minus_square`, which stored GELU's hidden twice until it counted as cheap).
  from piper_jax.lowering.local import RegionRunner
  from piper_jax.lowering.regions import analyze_region
  from piper_jax.lowering.trace import trace_loss
  fn = {"gelu": jax.nn.gelu, "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
        "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid,
        "tanh": jnp.tanh}[act]

  def loss(params, batch):
    with pj.annotate("PP"):
      y = fn(batch["x"] @ params["w1"]) @ params["w2"]
    return jnp.mean(y ** 2)

  params = {"w1": jnp.ones((D, 4 * D)), "w2": jnp.ones((4 * D, D))}
  batch = {"x": jnp.ones((4, 16, D))}
  runner = RegionRunner(trace_loss(loss, params, batch))
  stored = analyze_region(runner, 0, remat=True).stored_avals
  hidden = [a for a in stored if a.shape[-1] == 4 * D]  # besides: the first matmul's input
  assert len(hidden) == 1 and len(stored) == 2, stored
