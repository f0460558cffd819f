"""Every strategy gives the same losses and parameters as one device (fp32, 2+ steps)."""

import gc
import json
import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import piper_jax as pj
from models import assert_same_run, init_mlp, mlp_loss, piper_run, random_batch

pytestmark = pytest.mark.timeout(240)


def _mlp(n_stages, tied=False, seed=0):
  return mlp_loss(n_stages, tied), init_mlp(jax.random.PRNGKey(seed), n_stages, tied)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_8(zero):
  loss, params = _mlp(2)
  assert_same_run(loss, params, pj.strategies.data_parallel(8, zero=zero))


def test_one_device_no_directives_needed_beyond_place():
  loss, params = _mlp(1)
  assert_same_run(loss, params, [pj.place({}, [0])])


def test_data_parallel_buckets_by_default():
  # ZeRO-0 all-reduces in 25 MB buckets unless asked otherwise (test_data_parallel_8
  # runs them); ZeRO >= 1 reduce-scatters per slot.
  assert pj.strategies.data_parallel(8)[0].bucket_mb == 25.0
  assert pj.strategies.data_parallel(8, bucket_mb=None)[0].bucket_mb is None
  assert pj.strategies.data_parallel(8, zero=1)[0].bucket_mb is None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline(schedule, stages):
  loss, params = _mlp(stages)
  assert_same_run(loss, params, pj.strategies.pipeline(stages, 4, schedule=schedule), n_steps=3)


def test_pipeline_refuses_one_rank_of_two_stages():
  # DualPipeV and interleaved hold two stages or more on each rank: two stages would
  # make a one-rank "pipeline" of all the model.
  with pytest.raises(ValueError, match=re.escape(
      "dualpipev puts stages r and 2n-1-r on rank r: n_stages=2 makes one rank; use "
      "n_stages >= 4, or schedule='1f1b' for 2 stages")):
    pj.strategies.pipeline(2, 4, "dualpipev")
  with pytest.raises(ValueError, match=re.escape(
      "n_stages=2 with n_virtual=2 makes one rank; use n_stages >= 4, or schedule='1f1b'")):
    pj.strategies.pipeline(2, 4, "interleaved")
  with pytest.raises(ValueError, match="interleaved needs n_virtual >= 2 stages per rank, got 1"):
    pj.strategies.pipeline(4, 4, "interleaved", n_virtual=1)
  assert len(pj.strategies.pipeline(4, 4, "dualpipev")) == 1 + 4 + 2  # split, places, orders


@pytest.mark.parametrize("zero", [1, 3])
def test_pipeline_2_stages_x_dp_4(zero):
  loss, params = _mlp(2)
  assert_same_run(loss, params, pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=zero),
                  batch_size=32)


def test_tied_embedding_first_and_last_stage():
  loss, params = _mlp(2, tied=True)
  assert_same_run(loss, params, pj.strategies.pipeline(2, 4, "1f1b"))


def test_tied_embedding_pipeline_x_dp_zero2():
  loss, params = _mlp(2, tied=True)
  assert_same_run(loss, params, pj.strategies.pipeline(2, 2, "gpipe", dp=2, zero=2))


def test_more_microbatches_than_stages_and_two_regions_per_rank():
  loss, params = _mlp(4)
  directives = [pj.split(4), pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [0]),
                pj.place({"PP": 2}, [1]), pj.place({"PP": 3}, [1])]
  assert_same_run(loss, params, directives)


def test_piper_json_schedule_file(tmp_path):
  loss, params = _mlp(2)
  schedule = [
      {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},
      {"op": "place", "filter": {"PP": 0}, "devices": [0, 2]},
      {"op": "place", "filter": {"PP": 1}, "devices": [1, 3]},
      {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2], "reduce_stream": "dp",
       "shard_grads": True},
      {"op": "replicate", "filter": {"PP": 1}, "devices": [1, 3], "reduce_stream": "dp",
       "shard_grads": True},
      {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}],
                                  [{"PP": 0, "MB": 0, "PASS": "B"}], [{"PP": 0, "MB": 1, "PASS": "B"}]]},
      {"op": "order", "filters": [[{"PP": 1, "MB": 0, "PASS": "F"}], [{"PP": 1, "MB": 0, "PASS": "B"}],
                                  [{"PP": 1, "MB": 1, "PASS": "F"}], [{"PP": 1, "MB": 1, "PASS": "B"}]]},
  ]
  path = tmp_path / "schedule.json"
  path.write_text(json.dumps(schedule))
  step, _ = assert_same_run(loss, params, str(path))
  assert step.plan.mesh.zero == 2 and step.plan.mesh.n_dp == 2


def test_no_annotation_is_one_region():
  import jax.numpy as jnp
  import optax

  def loss(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        jnp.tanh(batch["x"] @ params["w"]) @ params["v"], batch["y"]).mean()

  k1, k2 = jax.random.split(jax.random.PRNGKey(3))
  params = {"w": jax.random.normal(k1, (8, 16)), "v": jax.random.normal(k2, (16, 5))}
  step, _ = assert_same_run(loss, params, pj.strategies.data_parallel(4, zero=1))
  assert len(step.plan.model.regions) == 1


def test_memory_partitioned_4_stage_pipeline():
  loss, params = _mlp(4)
  step, state = assert_same_run(loss, params, pj.strategies.pipeline(4, 4, "1f1b"))
  _check_partitioned(state, n_parts=4)


def test_memory_partitioned_zero3_on_8():
  loss, params = _mlp(2)
  step, state = assert_same_run(loss, params, pj.strategies.data_parallel(8, zero=3))
  _check_partitioned(state, n_parts=8)


def test_compiled_step_does_not_keep_the_example_params():
  # The example params only give shapes: a step that held them would keep a whole copy
  # of the model on one device (1 GiB of the 268M GPT's peak, found on GPU).
  loss, params = _mlp(2)
  step = pj.compile(loss, optax.adam(1e-3), pj.strategies.data_parallel(8, zero=3), params,
                    _batch())
  state = step.init(params)
  refs = [weakref.ref(x) for x in jax.tree_util.tree_leaves(params)]
  del params
  gc.collect()
  assert all(r() is None for r in refs)
  assert state.params is not None


def test_init_takes_params_placed_on_one_device():
  # As `jax.device_put(params, jax.devices()[0])` or a single-device restore leaves them.
  loss, params = _mlp(2)
  on_one = jax.device_put(params, jax.devices()[1])
  step = pj.compile(loss, optax.adam(1e-3), pj.strategies.data_parallel(8, zero=3), params, _batch())
  got = step.canonical(step.init(on_one))["params"]
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                         got, params)


def _check_partitioned(state, n_parts):
  per_device = {}
  total = 0
  for leaf in jax.tree_util.tree_leaves(state):
    if leaf.ndim == 0:
      continue
    total += leaf.nbytes
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  assert per_device
  for dev, nbytes in per_device.items():
    # Each device holds about 1/n of the state (plus the padding of its chunks).
    assert nbytes <= total / n_parts * 1.5, (dev, nbytes, total)


def test_unused_parameter_is_still_updated_like_one_device():
  import jax.numpy as jnp
  loss, params = _mlp(2)
  params = dict(params, unused=jnp.ones((3,)))   # no gradient; adamw's decay still moves it
  assert_same_run(loss, params, pj.strategies.pipeline(2, 2, "1f1b", dp=2, zero=1))


def test_skip_connection_across_stages():
  # Region 0's output feeds regions 1 and 2: two sends, and B(0) sums two cotangents.
  import jax.numpy as jnp
  import optax
  from models import D_HID, N_CLASSES

  def loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["embed"])
    with pj.annotate("PP"):
      h0 = jnp.tanh(x @ params["w0"])
    with pj.annotate("PP"):
      h1 = jnp.tanh(h0 @ params["w1"])
    with pj.annotate("PP"):
      h2 = jnp.tanh(h1 @ params["w2"]) + h0
      logits = h2 @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  ks = jax.random.split(jax.random.PRNGKey(5), 5)
  params = {"embed": jax.random.normal(ks[0], (8, D_HID)) * 0.3,
            **{f"w{i}": jax.random.normal(ks[1 + i], (D_HID, D_HID)) * 0.3 for i in range(3)},
            "head": jax.random.normal(ks[4], (D_HID, N_CLASSES)) * 0.3}
  step, _ = assert_same_run(loss, params, pj.strategies.pipeline(3, 4, "1f1b"))
  sends = [n for n in step.plan.graph.nodes.values() if n.kind.value == "send"]
  assert {(n.devices, n.peer) for n in sends} >= {((0,), (1,)), ((0,), (2,)), ((1,), (2,))}


@pytest.mark.parametrize("n_stages", [1, 2])
def test_bucketed_gradient_reduction(n_stages):
  # bucket_mb: a step of one microbatch on one rank all-reduces ZeRO-0 gradients in
  # buckets as soon as they are final; a pipeline's loop reduces them after its last tick.
  loss, params = _mlp(2)
  dp = 8 // n_stages
  directives = [pj.split(2)] * (n_stages > 1) + [
      pj.replicate({"PP": s} if n_stages > 1 else {}, [r * n_stages + s for r in range(dp)],
                   bucket_mb=0.001)
      for s in range(n_stages)] + (pj.schedules.one_f_one_b(2, 2) if n_stages > 1 else [])
  step, _ = assert_same_run(loss, params, directives)
  assert step.plan.bucket_mb == 0.001 and step.tick_loop is (n_stages > 1)
  text = step.lower(step.init(params), _batch()).as_text()
  reduces = text.count("all_reduce") + text.count("all-reduce")
  if n_stages == 1:
    assert len(_reduced_in_ticks(step)) > 1 and reduces > 1
  else:
    assert reduces >= 1


def _batch(size=16):
  from models import random_batch
  return random_batch(jax.random.PRNGKey(0), size)


def _bf16_reduced_grads(loss, params, batch, n_dp):
  """Each replica's gradient (of its rows' mean, over n_dp) rounded to bf16, summed in bf16."""
  rows = len(batch["y"]) // n_dp
  parts = [jax.grad(loss)(params, jax.tree_util.tree_map(lambda x: x[r * rows:(r + 1) * rows], batch))
           for r in range(n_dp)]
  total = None
  for g in parts:
    g = jax.tree_util.tree_map(lambda x: (x / n_dp).astype(jnp.bfloat16), g)
    total = g if total is None else jax.tree_util.tree_map(jnp.add, total, g)
  return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), total)


@pytest.mark.parametrize("zero,bucket_mb", [(0, None), (0, 0.001), (1, None), (3, None)])
def test_reduce_dtype_bf16(zero, bucket_mb):
  # replicate(reduce_dtype="bfloat16"): every replica's gradient is rounded to bf16 and
  # the sum is taken in bf16 - what reducing per-replica jax.grad results so gives.
  loss, params = _mlp(2)
  batch = _batch()
  directives = pj.strategies.data_parallel(2, zero=zero, reduce_dtype="bfloat16",
                                           bucket_mb=bucket_mb)
  _, sgd_params, step, state = piper_run(loss, params, [batch], optax.sgd(1.0), directives,
                                         devices=jax.devices()[:2])
  want = _bf16_reduced_grads(loss, params, batch, 2)
  exact = jax.grad(loss)(params, batch)
  for p, q, g, e in zip(*map(jax.tree_util.tree_leaves, (params, sgd_params, want, exact))):
    got = np.asarray(p - q)
    # Rounded like the reference (one bf16 step apart where fp32 noise crosses a
    # rounding boundary), and not the fp32 sum.
    step_ = np.abs(np.asarray(g)) * 2.0**-7 + 1e-6
    assert np.all(np.abs(got - g) <= step_), (got, g)
    assert np.mean(np.abs(got - g) <= 1e-6 + 1e-5 * np.abs(g)) > 0.95
  assert not all(np.allclose(np.asarray(p - q), np.asarray(e), rtol=1e-6, atol=0)
                 for p, q, e in zip(*map(jax.tree_util.tree_leaves, (params, sgd_params, exact))))
  assert "bf16" in step.lower(state, batch).as_text()
  assert bool(_reduced_in_ticks(step)) == (bucket_mb is not None)


def test_reduce_dtype_bf16_pipeline_zero2():
  # A pipeline's ZeRO-2 reduce-scatter (once, after the last tick) under 1F1B x DP 4
  # runs in bf16 too.
  loss, params = _mlp(2)
  directives = pj.strategies.pipeline(2, 2, "1f1b", dp=4, zero=2, reduce_dtype="bfloat16")
  batch = _batch()
  _, sgd_params, step, state = piper_run(loss, params, [batch], optax.sgd(1.0), directives)
  exact = jax.grad(loss)(params, batch)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(exact))
  for p, q, e in zip(*map(jax.tree_util.tree_leaves, (params, sgd_params, exact))):
    # bf16 rounds each replica's summed gradient: an absolute error of a few
    # bf16 steps of the largest gradient, where replicas' gradients cancel.
    np.testing.assert_allclose(np.asarray(p - q), np.asarray(e), rtol=1e-2, atol=2**-7 * scale)
  assert step.plan.reduce_dtype == "bfloat16" and "bf16" in step.lower(state, batch).as_text()


@pytest.mark.parametrize("schedule,stages,dp,zero,tied", [
    ("1f1b", 2, 1, 0, True), ("1f1b", 4, 2, 3, False), ("zb", 2, 2, 2, False),
    ("dualpipev", 4, 1, 1, False), ("interleaved", 4, 1, 0, False)])
def test_schedules_at_sixteen_microbatches(schedule, stages, dp, zero, tied):
  # Long enough for a steady state between warm-up and cool-down; one loop, same numbers.
  loss, params = _mlp(stages, tied=tied)
  directives = pj.strategies.pipeline(stages, 16, schedule, dp=dp, zero=zero)
  step, state = assert_same_run(loss, params, directives, batch_size=16 * dp)
  assert step.tick_loop and "while" in step.lower(state, _batch(16 * dp)).as_text()


def test_pipeline_microbatch_shaped_like_a_weight():
  # Microbatches of 16 rows make [16, 16] activations, the shape of the stages' weights:
  # output positions shared by shape must still start each rank's gradient sums at zero.
  loss, params = _mlp(4)
  assert_same_run(loss, params, pj.strategies.pipeline(4, 4, "dualpipev"), batch_size=64)


@pytest.mark.parametrize("strategy", ["dp0", "dp1", "1f1b-dp2-z2", "1f1b-dp2-z3"])
def test_regions_in_several_slots(strategy):
  # A region's leaves fill slots of at most `slot_bytes`, each its own buffer (so the
  # optimizer can update one while another's gradients are reduced); with 1 KiB slots
  # the MLP's regions take several each.
  loss, params = _mlp(2)
  if strategy.startswith("dp"):
    directives = pj.strategies.data_parallel(8, zero=int(strategy[2]))
  else:
    directives = pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=int(strategy[-1]))
  step, state = assert_same_run(loss, params, directives,
                                options=pj.LoweringOptions(slot_bytes=1024))
  per_rank = max(len(step.plan.rank_regions(r)) for r in range(step.plan.n_ranks))
  assert step.layout.n_slots > per_rank
  assert len(state.params.slots["float32"]) == step.layout.n_slots
  back = step.from_canonical(step.canonical(state))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                         back.params, state.params)


def test_zero3_gathers_one_tick_ahead():
  # DP ZeRO-3 over two regions runs one task a tick (F0, F1, B1, B0). Each tick's
  # all-gathers are issued before the previous tick's work, so they can run beside it,
  # and B1 takes F1's gathered weights: three gathers, two of them before F0's matmuls.
  from models import random_batch
  loss, params = _mlp(2)
  step, state = assert_same_run(loss, params, pj.strategies.data_parallel(8, zero=3))
  assert [[(t.region, t.pass_.value) for t in tick[0]] for tick in step.plan.ticks] == [
      [(0, "F")], [(1, "F")], [(1, "B")], [(0, "B")]]
  text = step.lower(state, random_batch(jax.random.PRNGKey(0), 16)).as_text()
  ops = re.findall(r"stablehlo\.(all_gather|dot_general)", text)
  assert ops.count("all_gather") == 3 and ops[:2] == ["all_gather"] * 2, ops


def test_zero3_pipeline_gathers_its_weights_as_the_step_starts():
  # In a pipeline every tick of a rank reads its stage's weights: ZeRO-3 gathers each
  # segment once, as the step starts, and the ticks form one loop.
  loss, params = _mlp(2)
  directives = pj.strategies.pipeline(2, 4, "1f1b", dp=4, zero=3)
  step, state = assert_same_run(loss, params, directives, batch_size=32)
  assert step.tick_loop and step.layout.gathers_at_start
  gathers = [c for c in step.collectives() if c.kind == "all-gather"]
  assert gathers and all(c.where == ("step start",) and c.count == 1 for c in gathers), gathers


def test_data_parallel_microbatches_accumulate_in_turn():
  # Without a pipeline each microbatch's F and B run before the next one's (gradient
  # accumulation: one microbatch's activations alive); under ZeRO-3 each task kind of
  # the loop gathers its region's weights as it runs (held only while a task runs).
  from models import random_batch
  loss, params = _mlp(2)
  directives = [pj.split(2)] + pj.strategies.data_parallel(8, zero=3)
  step, state = assert_same_run(loss, params, directives, batch_size=32)
  assert [t.label for tick in step.plan.ticks for t in tick[0]] == [
      "r0F0", "r1F0", "r1B0", "r0B0", "r0F1", "r1F1", "r1B1", "r0B1"]
  text = step.lower(state, random_batch(jax.random.PRNGKey(0), 32)).as_text()
  kinds = step.schedule_table.kinds
  assert len(kinds) == 4  # r0F r1F r1B r0B, each compiled once for both microbatches
  assert len(re.findall(r"stablehlo\.all_gather", text)) == len(kinds)


@pytest.mark.parametrize("zero,bucket_mb", [(0, None), (0, 25.0), (1, None), (3, None)])
def test_gradient_leaves_materialized_before_their_segment(zero, bucket_mb):
  # Each raveled gradient leaf passes an optimization barrier before it is copied into
  # its flat segment, so that XLA cannot fuse its producer (a bias gradient's reduction)
  # into the segment's concatenate; bucketed sums come out of an all-reduce already.
  # Each bias's sum over the rows reads its cotangent through one more (the next test).

  from models import random_batch

  loss, params = _mlp(2)
  step, state = assert_same_run(loss, params,
                                pj.strategies.data_parallel(8, zero=zero, bucket_mb=bucket_mb))
  text = step.lower(state, random_batch(jax.random.PRNGKey(0), 16)).as_text()
  leaves = len(jax.tree_util.tree_leaves(params))
  biases = sum(x.ndim == 1 for x in jax.tree_util.tree_leaves(params))
  # One operand each (ZeRO-3's gathers wait for the loss behind barriers of two), and
  # ZeRO-3's reduce-scattered chunks pass one before they are summed.
  leaf_barriers = re.findall(r"= stablehlo\.optimization_barrier %[\w#]+ :", text)
  scattered = len(re.findall(r"stablehlo\.reduce_scatter", text)) if zero >= 2 else 0
  assert len(leaf_barriers) == (0 if bucket_mb else leaves) + biases + scattered, leaf_barriers


@pytest.mark.parametrize("directives", ["dp", "1f1b", "zb"])
def test_bias_gradients_summed_from_a_barrier(directives):
  # A bias's gradient (a sum over the rows of a cotangent) reads the cotangent through an
  # optimization barrier, so that XLA gives the sum its own kernel instead of fusing it
  # into LayerNorm's backward, which reads the same cotangent; B, and ZB's BW, alike.
  directives = {"dp": pj.strategies.data_parallel(8, bucket_mb=25.0),
                "1f1b": pj.strategies.pipeline(2, 4, "1f1b"),
                "zb": pj.strategies.pipeline(2, 4, "zb")}[directives]
  loss, params = _mlp(2)
  step, state = assert_same_run(loss, params, directives)
  text = step.lower(state, _batch(16)).as_text()
  n_sums = 0
  for func in text.split("func.func")[1:]:  # value names are per function
    barriers = set(re.findall(r"(%\w+) = stablehlo\.optimization_barrier", func))
    sums = re.findall(r"stablehlo\.reduce\((%\w+) init: %\w+\) applies stablehlo\.add across "
                      r"dimensions = \[0\] : \(tensor<(?!1x)\d+x16xf32>", func)  # not a unit axis
    assert all(x in barriers for x in sums), (sums, barriers, func)
    n_sums += len(sums)
  assert n_sums >= 2


def test_compiler_options(monkeypatch):
  # On GPUs a pipeline's step runs its loop and the loop's conditionals as CUDA graphs; on
  # CPUs a loop's branches write its stores in place; data parallelism (neither) and
  # XLA_FLAGS that set them keep XLA's.
  from models import optimizer, random_batch
  from piper_jax.lowering.program import (LOOP_CPU_XLA_OPTIONS, PIPELINE_COMMAND_BUFFERS,
                                          PIPELINE_XLA_OPTIONS)
  loss, params = _mlp(2)
  batch = random_batch(jax.random.PRNGKey(1), 16)
  pp = pj.compile(loss, optimizer(), pj.strategies.pipeline(2, 4), params, batch)
  dp = pj.compile(loss, optimizer(), pj.strategies.data_parallel(8), params, batch)
  assert "CONDITIONAL" in PIPELINE_COMMAND_BUFFERS and "WHILE" in PIPELINE_COMMAND_BUFFERS
  # A tick's conditional is one command between two collective-permutes.
  assert PIPELINE_XLA_OPTIONS["xla_gpu_graph_min_graph_size"] == 1
  assert pp.compiler_options("gpu") == PIPELINE_XLA_OPTIONS
  assert pp.compiler_options("cpu") == LOOP_CPU_XLA_OPTIONS
  assert dp.compiler_options("gpu") == dp.compiler_options("cpu") == {}
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
  assert pp.compiler_options("gpu") == {"xla_gpu_graph_min_graph_size": 1}
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION --xla_gpu_graph_min_graph_size=5")
  assert pp.compiler_options("gpu") == {}
  # A longer flag that starts with the same name is another option.
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer_va_remapping=true")
  assert pp.compiler_options("gpu") == PIPELINE_XLA_OPTIONS
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_copy_insertion_use_region_analysis=false")
  assert pp.compiler_options("cpu") == {}
  # The user's options reach XLA in place of piper-jax's.
  bad = pj.compile(loss, optimizer(), pj.strategies.pipeline(2, 4), params, batch,
                   compiler_options={"xla_gpu_enable_command_buffer": "NOT_A_COMMAND"})
  with pytest.raises(Exception, match="NOT_A_COMMAND"):
    bad(bad.init(params), batch)


def test_debug_print_inside_a_stage(capfd):
  # F runs the region's traced vjp without the equations nothing reads; a
  # jax.debug.print in a stage, and the sum only it reads, still run.

  def loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["embed"])
    for s in range(2):
      with pj.annotate("PP"):
        p = params[f"stage{s}"]
        x = x + jnp.tanh(x @ p["w"] + p["b"])
        jax.debug.print("stage {s} rows {n}", s=s, n=jnp.sum(jnp.ones_like(x[:, 0])))
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch["y"]).mean()

  assert_same_run(loss, init_mlp(jax.random.PRNGKey(0), 2), pj.strategies.pipeline(2, 4))
  out = capfd.readouterr().out
  assert "stage 1 rows 4" in out and "stage 0 rows 4" in out  # microbatches of 16 / 4


def test_lowering_options_are_one_argument():
  import dataclasses
  loss, params = _mlp(2)
  opts = pj.LoweringOptions(zero3_reshard=False, slot_bytes=1024)
  step = pj.compile(loss, optax.sgd(0.1), pj.strategies.pipeline(2, 2), params, _batch(),
                    options=opts, remat=False)
  assert step.options == dataclasses.replace(opts, remat=False)
  assert step.options.changed() == {"zero3_reshard": False, "remat": False, "slot_bytes": 1024}
  assert step.layout.n_slots > 1  # 1 KiB slots: several a region
  # remat=None resolves per strategy: on in pipelines.
  assert pj.compile(loss, optax.sgd(0.1), pj.strategies.pipeline(2, 2), params,
                    _batch()).options.remat is True
  with pytest.raises(ValueError, match="slot_bytes must be >= 1"):
    pj.LoweringOptions(slot_bytes=0)


def test_options_of_the_wrong_type_are_refused_with_the_fix():
  # A dict for options, or a string for a switch (which would pass as true), is refused
  # before anything is traced, naming what to pass instead.
  loss, params = _mlp(2)
  with pytest.raises(TypeError, match=r"pass pj\.LoweringOptions\(remat=True\)"):
    pj.compile(loss, optax.sgd(0.1), pj.strategies.pipeline(2, 2), params, _batch(),
               options={"remat": True})
  with pytest.raises(TypeError, match=r"pass pj\.LoweringOptions\(slot_bytes=1024\)"):
    pj.strategies.estimate(loss, optax.sgd(0.1), params, _batch(), pj.strategies.data_parallel(2),
                           2, options={"slot_bytes": 1024})
  for bad, says in [(dict(remat="no"), "remat must be True, False or None"),
                    (dict(spread_uneven_slots=1), "spread_uneven_slots must be True or False"),
                    (dict(slot_bytes="1MB"), "slot_bytes must be a number of bytes"),
                    (dict(compiler_options=["xla_cpu_enable_fast_math"]),
                     "compiler_options must be a dict of XLA option names")]:
    with pytest.raises(TypeError, match=says):
      pj.LoweringOptions(**bad)


@pytest.mark.parametrize("directives,traces", [
    (pj.strategies.pipeline(2, 4, "1f1b", dp=2), 1),
    (pj.strategies.data_parallel(4), 1),
    ([pj.place({}, [0])], 1),
])
def test_the_loss_is_traced_once_at_the_microbatch_size(directives, traces):
  # Tracing a large model is most of pj.compile's own time.
  loss, params = _mlp(2)
  seen = []

  def counted(p, b):
    seen.append(b["x"].shape[0])
    return loss(p, b)

  batch = random_batch(jax.random.PRNGKey(0), 16)
  step = pj.compile(counted, optax.sgd(0.1), directives, params, batch)
  assert len(seen) == traces and seen[-1] == 16 // (step.plan.mesh.n_data * step.plan.n_microbatches)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_two_values_from_one_stage_into_the_next(schedule):
  # Stage 1 reads two of stage 0's values: each crosses in its own send and receive.
  params = init_mlp(jax.random.PRNGKey(0), 2)

  def loss(params, batch):
    x = jnp.tanh(batch["x"] @ params["embed"])
    with pj.annotate("PP"):
      x = x + jnp.tanh(x @ params["stage0"]["w"] + params["stage0"]["b"])
      s = jnp.mean(x ** 2, axis=-1, keepdims=True)
    with pj.annotate("PP"):
      x = s * jnp.tanh(x @ params["stage1"]["w"] + params["stage1"]["b"])
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch["y"]).mean()

  step, _ = assert_same_run(loss, params, pj.strategies.pipeline(2, 2, schedule))
  assert sum(n.kind.value == "send" for n in step.plan.graph.nodes.values()) >= 4


def _reduced_in_ticks(step):
  """The all-reduces a step runs inside its ticks (gradient buckets), not at its end."""
  return [c for c in step.collectives()
          if c.kind == "all-reduce" and any(w.startswith("tick ") for w in c.where)]


@pytest.mark.parametrize("how", ["tensor-parallel-pipeline", "expert-parallel-pipeline",
                                 "accumulation", "data-parallel"])
def test_compile_traces_the_loss_once(monkeypatch, how):
  # Tracing a large model is most of pj.compile's own time: the microbatch size the
  # directives imply is guessed before placing them, tensor groups that list every
  # stage's devices included.
  import importlib
  from examples import gpt
  from models import moe_gpt, tp_gpt
  compile_module = importlib.import_module("piper_jax.compile")
  calls = []
  trace = compile_module.trace_loss
  monkeypatch.setattr(compile_module, "trace_loss",
                      lambda *a, **k: calls.append(1) or trace(*a, **k))
  config, loss, params = (tp_gpt(2) if how.startswith("tensor") else moe_gpt(2))
  directives = {
      "tensor-parallel-pipeline": pj.strategies.pipeline(2, 4, "1f1b", dp=4)
                                  + [pj.shard_tensor({}, [0, 2, 1, 3])],
      "expert-parallel-pipeline": pj.strategies.pipeline(2, 4, "1f1b", dp=4)
                                  + [pj.shard({"EP": "*"}, list(range(8)))],
      "accumulation": [pj.split(4)] + pj.strategies.data_parallel(8),
      "data-parallel": pj.strategies.data_parallel(8),
  }[how]
  batch = gpt.random_batch(config, jax.random.PRNGKey(0), 32)
  step = pj.compile(loss, optax.sgd(0.1), directives, params, batch)
  assert len(calls) == 1
  assert step.plan.n_microbatches * step.plan.mesh.n_data * step._program.mbs == 32


def test_the_guessed_microbatch_counts_a_tensor_group_within_one_replica_group():
  import importlib
  guess = importlib.import_module("piper_jax.compile")._guess_microbatch
  stages = [pj.replicate({"PP": s}, [s, s + 2, s + 4, s + 6]) for s in range(2)]
  # TP2 inside each stage's 4 devices: 2 data-parallel copies, 4 microbatches.
  assert guess([pj.split(4)] + stages + [pj.shard_tensor({}, [0, 2, 1, 3])], 64) == 8
  # A tensor group outside every replicate group counts its own devices.
  assert guess([pj.split(2), pj.replicate({}, [0, 1]), pj.shard_tensor({}, [2, 3])], 16) == 8
  assert guess(pj.strategies.data_parallel(4), 16) == 4
