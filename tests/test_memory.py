"""What each pipeline rank's devices hold of the parameters and optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import piper_jax as pj
from models import assert_same_run, init_mlp, mlp_loss, random_batch

pytestmark = pytest.mark.timeout(240)

D, TABLE = 16, 2048


def _uneven(n_stages=4):
  """A pipeline whose first stage also holds a large table (a 2048-row embedding's
  place): 130 kB of its parameters against 1 kB on each other stage."""
  ks = jax.random.split(jax.random.PRNGKey(0), n_stages + 2)
  params = {"table": jax.random.normal(ks[0], (TABLE, D)) * 0.1,
            "head": jax.random.normal(ks[1], (D, 5)) * 0.3}
  for s in range(n_stages):
    params[f"w{s}"] = jax.random.normal(ks[2 + s], (D, D)) * 0.3

  def loss(params, batch):
    x = jnp.pad(batch["x"], ((0, 0), (0, D - batch["x"].shape[1])))
    for s in range(n_stages):
      with pj.annotate("PP"):
        if s == 0:
          x = x + params["table"].mean(0)
        x = jnp.tanh(x @ params[f"w{s}"])
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch["y"]).mean()

  return loss, params


def _bytes_per_device(state) -> dict:
  out: dict = {}
  for leaf in jax.tree_util.tree_leaves(state):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def _share_per_rank(step, params) -> dict:
  """Bytes of the parameters each pipeline rank's regions read, times 3 (adam's two
  moments), from the plan: what a rank's device holds when ranks are stacked."""
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
  sizes = {n: x.nbytes for n, x in zip(names, jax.tree_util.tree_leaves(params))}
  users = step.plan.model.param_users()
  share: dict = {}
  for p, regions in users.items():
    for rank in {step.plan.mesh.region_rank[r] for r in regions}:
      share[rank] = share.get(rank, 0) + 3 * sizes[names[p]]
  return share


def _step(directives, batch_size=8, **options):
  loss, params = _uneven()
  step = pj.compile(loss, optax.adam(1e-3), directives, params,
                    random_batch(jax.random.PRNGKey(0), batch_size),
                    options=pj.LoweringOptions(**options))
  return step, params, step.init(params)


def test_stacked_ranks_hold_at_most_the_largest_stage():
  # Without `spread_uneven_slots` ranks' parts are stacked: no rank holds more than the
  # largest rank's share (plus 10% of chunk padding), nor any other rank's parameters.
  step, params, state = _step(pj.strategies.pipeline(4, 4, "1f1b"), spread_uneven_slots=False)
  share = _share_per_rank(step, params)
  held = _bytes_per_device(state)
  assert len(held) == 4 and all(b <= max(share.values()) * 1.1 + 1024 for b in held.values())
  # Every rank pads to the first stage's table: most of what is held is padding.
  assert sum(held.values()) > 3 * sum(share.values())


@pytest.mark.parametrize("directives", [
    pj.strategies.pipeline(4, 4, "1f1b"),
    pj.strategies.pipeline(4, 4, "interleaved", dp=2, zero=1),
], ids=["1f1b-pp4", "interleaved-pp2xdp2-zero1"])
def test_each_device_holds_an_even_share_of_uneven_stages(directives):
  # The first stage's table is ~130 kB of 140 kB: by default spread over all devices,
  # each holds a quarter of the state (params and adam's two moments), within a little
  # padding, not the first stage's whole.
  step, params, state = _step(directives)
  assert step.layout.spread, "the table's slot should be spread"
  state_bytes = 3 * sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  held = _bytes_per_device(state)
  assert len(held) == 4
  for device, b in held.items():
    assert b <= state_bytes / 4 * 1.1 + 1024, (device, b, state_bytes)
  assert sum(held.values()) <= state_bytes * 1.1 + 4096


def test_stacked_slots_and_xlas_own_options_give_one_devices_numbers():
  # Uneven stages stacked over the ranks, each padded to the largest (not spread), and
  # XLA's default options in place of piper-jax's: the numbers of one device.
  loss, params = _uneven()
  step, _ = assert_same_run(loss, params, pj.strategies.pipeline(4, 4, "dualpipev", dp=2, zero=1),
                            batch_size=8, options=pj.LoweringOptions(spread_uneven_slots=False))
  assert not step.layout.spread
  step, _ = assert_same_run(loss, params, pj.strategies.pipeline(4, 4, "interleaved", dp=2),
                            batch_size=8, options=pj.LoweringOptions(compiler_options={}))
  assert step.options.compiler_options == {}


def test_spread_slots_give_one_devices_numbers():
  loss, params = _uneven()
  spread = pj.LoweringOptions()  # spread_uneven_slots, the default
  step, _ = assert_same_run(loss, params, pj.strategies.pipeline(4, 4, "1f1b"), batch_size=8,
                            options=spread)
  assert step.layout.spread
  # A masked optimizer updates whole leaves, read from the spread slot.
  masked = optax.adamw(1e-2, weight_decay=0.5,
                       mask=lambda t: jax.tree_util.tree_map(lambda x: x.ndim > 1, t))
  assert_same_run(loss, params, pj.strategies.pipeline(4, 4, "1f1b"), batch_size=8, tx=masked,
                  check_sgd=False, options=spread)
  assert_same_run(loss, params, pj.strategies.pipeline(4, 4, "dualpipev", dp=2, zero=2),
                  batch_size=8, options=spread)


def _blocks(n_blocks=8, width=128):
  """A residual MLP with one region per block: 8 x 64 kB of weights."""
  ks = jax.random.split(jax.random.PRNGKey(0), n_blocks + 2)
  params = {"embed": jax.random.normal(ks[0], (8, width)) * 0.1,
            "head": jax.random.normal(ks[1], (width, 5)) * 0.1}
  params.update({f"w{s}": jax.random.normal(ks[2 + s], (width, width)) * 0.1
                 for s in range(n_blocks)})

  def loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["embed"])
    for s in range(n_blocks):
      with pj.annotate("PP"):
        x = x + jnp.tanh(x @ params[f"w{s}"])
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch["y"]).mean()

  return loss, params


def _temp_bytes(zero: int, **options) -> tuple[int, int, str]:
  loss, params = _blocks()
  batch = random_batch(jax.random.PRNGKey(1), 16)
  step = pj.compile(loss, optax.sgd(0.1), pj.strategies.data_parallel(4, zero=zero),
                    params, batch, options=pj.LoweringOptions(**options))
  compiled = step.lower(step.init(params), batch).compile()
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  return compiled.memory_analysis().temp_size_in_bytes, nbytes, compiled.as_text()


def test_zero3_holds_a_few_blocks_whole_not_the_model():
  # ZeRO-3 gathers each region's parameters for its forward and again for its backward.
  # Were those gathers merged (one per region, or one for the whole model), every device
  # would hold all parameters whole for the step: more temporary bytes than the model.
  temp3, model_bytes, text = _temp_bytes(3)
  temp0, _, _ = _temp_bytes(0)
  gathers = text.count(" all-gather(") + text.count(" all-gather-start(")
  # Each block's forward and backward gather its weights; the last block's backward
  # follows its forward at once and keeps its gathered weights.
  assert gathers >= 2 * 8 - 1, gathers
  assert temp3 < 0.75 * model_bytes, (temp3, model_bytes)
  assert temp3 < 0.5 * temp0, (temp3, temp0)
  # zero3_reshard=False: the backward reuses the forward's gathers (half the traffic).
  _, _, kept = _temp_bytes(3, zero3_reshard=False)
  assert kept.count(" all-gather(") + kept.count(" all-gather-start(") < gathers


def test_zero2_keeps_gradients_sharded():
  # ZeRO-2 reduce-scatters each region's gradients as the backward makes them: no
  # device holds every gradient whole, as ZeRO-0's all-reduce does.
  temp2, model_bytes, _ = _temp_bytes(2)
  temp0, _, _ = _temp_bytes(0)
  assert temp2 < model_bytes and temp2 < 0.5 * temp0, (temp2, model_bytes, temp0)


def test_zero3_kept_gathered_gives_one_devices_numbers():
  # zero3_reshard=False: the backward reads its forward's gathered weights.
  assert_same_run(mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2),
                  pj.strategies.data_parallel(4, zero=3),
                  options=pj.LoweringOptions(zero3_reshard=False))


def test_a_device_short_of_memory_is_named_before_the_step():
  # On GPUs the step compares XLA's count with each device's free memory before its
  # first call (a multi-GPU step short of memory can hang): the shortfall names the
  # device, what the step needs and what it has.
  from piper_jax.compile import CompiledMemory
  gib = 2**30
  m = CompiledMemory(arguments=6 * gib, outputs=6 * gib, aliased=6 * gib, temporaries=5 * gib)
  assert m.shortfall([{"bytes_limit": 10 * gib, "bytes_in_use": 4 * gib}]) is None
  assert m.shortfall([{}]) is None  # no allocator stats (CPU): nothing to compare
  said = m.shortfall([{"bytes_limit": 10 * gib, "bytes_in_use": 4 * gib},
                      {"bytes_limit": 10 * gib, "bytes_in_use": 6 * gib}])
  assert said == ("the step needs 5.0 GiB per device beyond its state, but device 1 has "
                  "4.0 GiB free of its allocator's 10.0 GiB (6.0 GiB in use)")


def _plain_accumulation_bytes(loss_fn, tx, params, batch, k):
  """XLA's count of plain JAX's accumulation: value_and_grad over `lax.scan` of k slices."""

  def step(p, o, b):
    mbs = jax.tree_util.tree_map(lambda x: x.reshape(k, -1, *x.shape[1:]), b)
    body = lambda t, mb: (jax.tree_util.tree_map(jnp.add, t, jax.value_and_grad(loss_fn)(p, mb)), None)
    (loss, g), _ = jax.lax.scan(body, (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, p)), mbs)
    updates, o = tx.update(jax.tree_util.tree_map(lambda x: x / k, g), o, p)
    return optax.apply_updates(p, updates), o, loss / k

  from piper_jax.memory import CompiledMemory
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), batch).compile()
  return CompiledMemory.of(compiled).total


def test_accumulation_holds_one_microbatch_like_plain_jax():
  # Wide activations, so that they, not the parameters, take the memory.
  from examples import gpt
  config = gpt.get_config("tiny", n_stages=2)
  model = gpt.GPT(config)
  loss_fn, tx = gpt.loss_fn(model), optax.adamw(1e-3)
  params = gpt.init_params(model, jax.random.PRNGKey(0))
  batch = gpt.random_batch(config, jax.random.PRNGKey(1), 32)
  piper = {}
  for k in (2, 16):
    step = pj.compile(loss_fn, tx, [pj.split(k)], params, batch)
    assert step.tick_loop
    piper[k] = step.memory().total
  assert piper[16] < 0.5 * piper[2]  # splitting the batch saves memory
  # Within 10% of plain accumulation: one microbatch's activations, one gradient sum
  # (laid out in place), and on one CPU device no weight copied out of a slot.
  assert step.options.slot_bytes == 1
  assert piper[16] <= 1.1 * _plain_accumulation_bytes(loss_fn, tx, params, batch, 16)
