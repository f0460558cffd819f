"""Every plan with microbatches or pipeline ranks as one loop over its ticks: one
device's numbers for every schedule, and a program whose size does not grow with the
number of microbatches."""

import re

import jax
import numpy as np
import optax
import pytest

import piper_jax as pj
from models import assert_same_run, init_mlp, mlp_loss, moe_gpt, random_batch, tp_gpt
from piper_jax.lowering import collectives_in_conditionals, copies_in_branches, distinct_kernels
from piper_jax.lowering.tick_loop import Pools

pytestmark = pytest.mark.timeout(300)

# As test_parallel's: eps=1e-6 keeps Adam from turning rounding-level expert gradients
# into full-size steps.
MOE_TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-6, weight_decay=0.1))


@pytest.mark.parametrize("schedule,n_stages,dp,zero", [
    ("1f1b", 4, 1, 0), ("dualpipev", 4, 1, 0), ("gpipe", 2, 2, 1), ("zb", 2, 2, 2),
    ("interleaved", 4, 2, 3)])
def test_tick_loop_same_numbers(schedule, n_stages, dp, zero):
  params = init_mlp(jax.random.PRNGKey(0), n_stages)
  directives = pj.strategies.pipeline(n_stages, 4, schedule, dp=dp, zero=zero)
  step, _ = assert_same_run(mlp_loss(n_stages), params, directives)
  assert step.tick_loop


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_branches_write_the_stores_in_place_on_cpu(schedule):
  # XLA's CPU copy insertion copies every store buffer a conditional's branches write
  # unless it runs its region analysis, which `pj.compile` turns on for loops; then
  # of the store buffers only the one branches both read and write (the activations')
  # is copied.
  params = init_mlp(jax.random.PRNGKey(0), 4)
  directives = pj.strategies.pipeline(4, 4, schedule)
  step, state = assert_same_run(mlp_loss(4), params, directives)
  pools = Pools.of_stores(step.schedule_table.stores)
  kind = {"float32": "f32", "int32": "s32", "bool": "pred"}
  buffers = [f"{kind[dt]}[{n},{m}]" for n, m, dt in zip(pools.rows, pools.size, pools.dtype)]
  batch = random_batch(jax.random.PRNGKey(0), 16)

  def compiled(**kw):
    s = pj.compile(mlp_loss(4), optax.adam(1e-3), directives, params, batch, **kw)
    return s.lower(s.init(params), batch).compile().as_text()

  def copies(text):
    return [len(re.findall(r"= " + re.escape(b) + r"\{[^}]*\} copy\(", text)) for b in buffers]

  assert step.compiler_options() == {"xla_cpu_copy_insertion_use_region_analysis": True}
  text, xla_text = compiled(), compiled(compiler_options={})
  ours, xlas = copies(text), copies(xla_text)
  assert len(buffers) >= 3 and sum(n > 0 for n in ours) <= 1
  assert all(n > 0 for n in xlas) and sum(ours) < sum(xlas) / 3, (ours, xlas)
  # The bytes each run of a branch copies, as run.py --compile-only reports them: none
  # in the idle branch, less than under XLA's own options, but not nothing: the branches
  # analysed after the first few still copy the activations' buffer and gradient sums.
  [branches], [xla_branches] = copies_in_branches(text), copies_in_branches(xla_text)
  assert branches[0] == 0 < xla_branches[0] and sum(branches) < sum(xla_branches)
  assert sum(b > 0 for b in branches) >= len(branches) // 2, branches


def test_copies_in_branches_reads_each_branch_of_each_conditional():
  hlo = """
%idle (p: (f32[4,8], pred[2])) -> (f32[4,8], pred[2]) {
  %p = (f32[4,8]{1,0}, pred[2]{0}) parameter(0)
  %a = f32[4,8]{1,0} get-tuple-element(%p), index=0
  %b = pred[2]{0} get-tuple-element(%p), index=1
  %copy.1 = f32[4,8]{1,0} copy(%a)
  %copy.2 = pred[2]{0} copy(%b)
  ROOT %t = (f32[4,8]{1,0}, pred[2]{0}) tuple(%copy.1, %copy.2)
}

%run (p: (f32[4,8], pred[2])) -> (f32[4,8], pred[2]) {
  ROOT %p = (f32[4,8]{1,0}, pred[2]{0}) parameter(0)
}

ENTRY %main (i: s32[], x: (f32[4,8], pred[2])) -> (f32[4,8], pred[2]) {
  %i = s32[] parameter(0)
  %x = (f32[4,8]{1,0}, pred[2]{0}) parameter(1)
  ROOT %c = (f32[4,8]{1,0}, pred[2]{0}) conditional(%i, %x, %x), branch_computations={%idle, %run}
}
"""
  assert copies_in_branches(hlo) == [[4 * 8 * 4 + 2, 0]]
  assert collectives_in_conditionals(hlo) == []


def test_distinct_kernels_counts_fusions_alike_once():
  # Two fusions whose computations differ only in names and source information are one
  # kernel; another slice offset makes another.
  fused = lambda name, lo, hi: f"""
%{name} (p.{name}: f32[64]) -> f32[8] {{
  %p.{name} = f32[64]{{0}} parameter(0)
  %s.{name} = f32[8]{{0}} slice(%p.{name}), slice={{[{lo}:{hi}]}}, metadata={{op_name="{name}"}}
  ROOT %e.{name} = f32[8]{{0}} exponential(%s.{name})
}}
"""
  hlo = fused("a", 0, 8) + fused("b", 0, 8) + fused("c", 8, 16) + """
ENTRY %main (x: f32[64]) -> (f32[8], f32[8], f32[8]) {
  %x = f32[64]{0} parameter(0)
  %f1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%a
  %f2 = f32[8]{0} fusion(%x), kind=kLoop, calls=%b
  %f3 = f32[8]{0} fusion(%x), kind=kLoop, calls=%c
  ROOT %t = (f32[8]{0}, f32[8]{0}, f32[8]{0}) tuple(%f1, %f2, %f3)
}
"""
  assert distinct_kernels(hlo) == 2
  # Fusions alike but for the reducer they call (add against max) are two kernels.
  reducer = lambda name, op: f"""
%{name} (x.{name}: f32[], y.{name}: f32[]) -> f32[] {{
  %x.{name} = f32[] parameter(0)
  %y.{name} = f32[] parameter(1)
  ROOT %r.{name} = f32[] {op}(%x.{name}, %y.{name})
}}
"""
  reduced = lambda name, to: f"""
%{name} (p.{name}: f32[64]) -> f32[] {{
  %p.{name} = f32[64]{{0}} parameter(0)
  %z.{name} = f32[] constant(0)
  ROOT %s.{name} = f32[] reduce(%p.{name}, %z.{name}), dimensions={{0}}, to_apply=%{to}
}}
"""
  hlo = (reducer("add1", "add") + reducer("add2", "add") + reducer("max1", "maximum")
         + reduced("ra", "add1") + reduced("rb", "add2") + reduced("rc", "max1") + """
ENTRY %main (x: f32[64]) -> (f32[], f32[], f32[]) {
  %x = f32[64]{0} parameter(0)
  %f1 = f32[] fusion(%x), kind=kInput, calls=%ra
  %f2 = f32[] fusion(%x), kind=kInput, calls=%rb
  %f3 = f32[] fusion(%x), kind=kInput, calls=%rc
  ROOT %t = (f32[], f32[], f32[]) tuple(%f1, %f2, %f3)
}
""")
  assert distinct_kernels(hlo) == 2


def test_a_stages_blocks_share_their_kernels():
  # A stage's blocks trace alike but their weights lie at other offsets of the rank's
  # slot: sliced at offsets XLA cannot fold, they compile to the same kernels, so a
  # deeper stage adds none (at static offsets, 1 -> 2 blocks a stage added 32 on the CPU).
  from examples import gpt

  def kernels(n_layers):
    net = gpt.GPT(gpt.get_config("tiny", n_stages=2, n_layers=n_layers))
    params = gpt.init_params(net, jax.random.PRNGKey(0))
    batch = gpt.random_batch(net.config, jax.random.PRNGKey(1), 16)
    step = pj.compile(gpt.loss_fn(net), optax.adam(1e-3), pj.strategies.pipeline(2, 4, "1f1b"),
                      params, batch, devices=jax.devices()[:2])
    return distinct_kernels(step.lower(step.init(params), batch).compile().as_text())

  one_block, two_blocks = kernels(2), kernels(4)
  assert two_blocks <= one_block + 2, (one_block, two_blocks)


def test_tick_loop_expert_parallel_x_pipeline(batches_of):
  config, loss, params = moe_gpt(2)
  batches_of(config)
  directives = pj.strategies.pipeline(2, 2, "zb", dp=2, zero=1)
  directives.append(pj.shard({"EP": "*"}, [0, 2, 1, 3]))
  step, _ = assert_same_run(loss, params, directives, batch_size=8, tx=MOE_TX)
  assert step.plan.mesh.size("ep") == 2


def _inputs(n_stages, dp):
  """The test MLP's parameters for `n_stages` regions and a batch for `dp` replicas."""
  return init_mlp(jax.random.PRNGKey(0), n_stages), random_batch(jax.random.PRNGKey(1), 16 * dp)


def _built(directives, dp, options=None, n_stages=2):
  """pj.compile of the test MLP on `n_stages * dp` devices (no step runs)."""
  params, batch = _inputs(n_stages, dp)
  return pj.compile(mlp_loss(n_stages), optax.sgd(0.1), directives, params, batch,
                    devices=jax.devices()[:n_stages * dp], options=options)


def _passes_in_program(schedule, n_microbatches, options):
  step = _built(pj.strategies.pipeline(4, n_microbatches, schedule), 1, options, n_stages=4)
  params, batch = _inputs(4, 1)
  text = step.lower(step.init(params), batch).as_text()
  # Lines: the schedule's tables are constants, one line each whatever their length.
  return len(re.findall(r"call @region_(?:forward|backward)", text)), text.count("\n")


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_program_size_does_not_grow_with_microbatches(schedule):
  calls4, size4 = _passes_in_program(schedule, 4, None)
  calls16, size16 = _passes_in_program(schedule, 16, None)
  # (Microbatches of another size pool their stores otherwise: a few lines either way.)
  assert calls4 == calls16 and size16 < 1.05 * size4, (calls4, calls16, size4, size16)
  # Each region's F and B once: 4 regions, 2 passes.
  assert calls4 <= 8, calls4


def test_a_pipelines_zero_stages_are_one_program_with_sharded_masters():
  # A pipeline's ZeRO-3 gathers its weights (bf16) as the step starts and keeps them for
  # the step, like ZeRO-1/2's distributed optimizer, and every stage reduce-scatters the
  # gradients once: ZeRO-1, 2 and 3 are the same program, one loop.
  import jax.numpy as jnp
  from examples import gpt
  net = gpt.GPT(gpt.get_config("tiny", n_stages=2, dtype=jnp.bfloat16))
  params = gpt.init_params(net, jax.random.PRNGKey(0))
  batch = gpt.random_batch(net.config, jax.random.PRNGKey(1), 16)
  texts = []
  for zero in (1, 2, 3):
    step = pj.compile(gpt.loss_fn(net), optax.adamw(1e-3),
                      pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=zero), params, batch,
                      devices=jax.devices()[:4])
    assert step.tick_loop and step.layout.shards_masters
    texts.append(step.lower(step.init(params), batch).as_text())
  assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 1), (2, 2), (2, 3)])
def test_pipelines_run_as_one_loop(dp, zero):
  # By default a pipeline is one loop over its ticks. At any ZeRO stage its tasks run
  # no collective of their own: gradients are reduce-scattered once after the loop, and
  # ZeRO-3 gathers the weights as the step starts (expert and tensor parallelism's
  # tasks run theirs inside the loop: tests/test_parallel.py).
  step = _built(pj.strategies.pipeline(2, 4, "1f1b", dp=dp, zero=zero), dp)
  assert step.tick_loop and "one loop over all ticks" in step.describe()
  # The options as resolved for this plan on this platform: remat on in pipelines.
  assert "lowering options, resolved: remat=True, " in step.describe()
  # What every device allocates for the values that outlive a tick.
  table = step.schedule_table
  assert table.store_bytes == sum(
      (st.depth + 1) * int(np.prod(st.shape)) * np.dtype(st.dtype).itemsize
      for st in table.stores) > 0
  assert f"{len(table.stores)} value stores of {table.store_bytes / 2**20:.1f} MiB" in (
      step.describe())


def test_accumulation_and_stages_sharing_a_device_run_as_one_loop():
  assert _built([pj.split(4)], 1).tick_loop
  assert _built([pj.split(4)] + pj.strategies.data_parallel(2, zero=1), 2).tick_loop
  shared = [pj.split(4), pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [0])]
  assert _built(shared + pj.schedules.one_f_one_b(2, 4), 1).tick_loop


def test_stages_sharing_a_device_compile_each_step_once():
  # 1F1B of two stages on one device: the last stage's F and B run as one chain every
  # microbatch, and warm-up's first chain (F0 F1 B1) is cut into F0 and that chain, not
  # into single tasks whose code would be compiled beside the chain's.
  shared = [pj.split(8), pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [0])]
  directives = shared + pj.schedules.one_f_one_b(2, 8)
  steps = [s for k in _built(directives, 1).schedule_table.kinds for s in k.steps]
  assert len(steps) == len(set(steps)) == 4
  assert_same_run(mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2), directives, batch_size=16,
                  devices=jax.devices()[:1])


def test_bucketed_pipelines_loop_and_one_microbatch_on_one_rank_is_written_out():
  # A loop reduces bucketed gradients once, after its last tick; a step of one
  # microbatch on one rank has no ticks that repeat and is written out tick by tick.
  buckets = [pj.split(4)] + [pj.replicate({"PP": s}, [2 * r + s for r in range(2)],
                                          bucket_mb=0.001) for s in range(2)]
  assert _built(buckets + pj.schedules.one_f_one_b(2, 4), 2).tick_loop
  dp = _built(pj.strategies.data_parallel(4), 2)
  assert not dp.tick_loop and "tick by tick" in dp.describe()


@pytest.mark.parametrize("plan", ["accumulation", "expert_parallel_pipeline"])
def test_accumulation_and_expert_pipelines_do_not_grow_with_microbatches(plan, batches_of):
  # The loop holds each region's passes once whatever the microbatch count, for gradient
  # accumulation on one device and for a pipeline whose tasks run all-to-alls.
  from test_parallel import MOE_TX, _moe
  config, loss, params = _moe(2)
  batches_of(config)
  from examples import gpt
  sizes = []
  for n_mb in (4, 16):
    if plan == "accumulation":
      directives, devices = [pj.split(n_mb)], jax.devices()[:1]
    else:
      directives = pj.strategies.pipeline(2, n_mb, "1f1b", dp=2, zero=1)
      directives, devices = directives + [pj.shard({"EP": "*"}, [0, 2, 1, 3])], jax.devices()[:4]
    batch = gpt.random_batch(config, jax.random.PRNGKey(1), 4 * n_mb)
    step = pj.compile(loss, MOE_TX, directives, params, batch, devices=devices)
    assert step.tick_loop
    text = step.lower(step.init(params), batch).as_text()
    sizes.append((len(re.findall(r"call @region_(?:forward|backward)", text)), text.count("\n")))
  (calls4, size4), (calls16, size16) = sizes
  assert calls4 == calls16 and abs(size16 - size4) < 0.05 * size4, sizes


@pytest.mark.parametrize("directives,n_devices", [
    (pj.strategies.pipeline(2, 4, "1f1b", dp=2, zero=1), 4),
    (pj.strategies.pipeline(2, 4, "zb", dp=2, zero=3), 4),
    ([pj.split(4)] + pj.strategies.data_parallel(2, zero=1), 2),
    ([pj.split(4)] + pj.strategies.data_parallel(2, zero=2), 2),
    ([pj.split(4)] + pj.strategies.data_parallel(2, zero=3), 2),
], ids=["1f1b-dp2-zero1", "zb-dp2-zero3", "accumulation-dp2-zero1", "accumulation-dp2-zero2",
        "accumulation-dp2-zero3"])
def test_no_collective_inside_the_loops_conditionals(directives, n_devices):
  # The loop's branches hold no collective: ranks meet in the exchange rounds after
  # the slots, gradients are reduced after the loop, a pipeline's ZeRO-3 gathers as the
  # step starts; accumulation on one rank has no switch at all, so ZeRO 2/3's gathers
  # and per-backward reduce-scatters sit in the loop's body.
  params, batch = _inputs(2, n_devices)
  step = pj.compile(mlp_loss(2), optax.sgd(0.1), directives, params, batch,
                    devices=jax.devices()[:n_devices])
  hlo = step.lower(step.init(params), batch).compile().as_text()
  assert step.tick_loop and (" conditional(" in hlo) == (step.schedule_table.period is None)
  assert collectives_in_conditionals(hlo) == []
  assert re.search(r"\b(all-reduce|reduce-scatter|collective-permute)(-start)?\(", hlo)


def test_accumulation_with_experts_or_tensors_split_has_no_switch(batches_of):
  # One rank: the loop's body runs one microbatch's passes one after the other, its
  # all-to-alls and all-reduces with them.
  for model, shard in ((moe_gpt, pj.shard({"EP": "*"}, [0, 1])),
                       (tp_gpt, pj.shard_tensor({}, [0, 1]))):
    config, loss, params = model(1)
    batches_of(config)
    directives = [pj.split(2), pj.replicate({}, [0, 1, 2, 3], zero=3), shard]
    step, state = assert_same_run(loss, params, directives, batch_size=16, tx=MOE_TX)
    assert step.schedule_table.period is not None
    import models
    hlo = step.lower(state, models.random_batch(jax.random.PRNGKey(0), 16)).compile().as_text()
    assert collectives_in_conditionals(hlo) == [], model


@pytest.mark.parametrize("schedule,n_stages", [("1f1b", 2), ("dualpipev", 4)])
def test_an_expert_parallel_pipelines_all_to_alls_run_outside_its_conditionals(
    batches_of, schedule, n_stages):
  # They run after each slot's switch, on rows of the stores (`Regroup`).
  config, loss, params = moe_gpt(n_stages)
  batches_of(config)
  from examples import gpt
  directives = pj.strategies.pipeline(n_stages, 4, schedule, dp=2, zero=1)
  directives.append(pj.shard({"EP": "*"}, [0, 2, 1, 3]))
  batch = gpt.random_batch(config, jax.random.PRNGKey(1), 8)
  step = pj.compile(loss, optax.sgd(0.1), directives, params, batch, devices=jax.devices()[:4])
  hlo = step.lower(step.init(params), batch).compile().as_text()
  assert collectives_in_conditionals(hlo) == []
  assert re.search(r"\ball-to-all(-start)?\(", hlo)
  # What an all-to-all makes lies in a buffer apart from what it reads: regrouped in
  # place, a buffer was copied whole in every branch of the switch on GPUs.
  table, pools = step.schedule_table, step._program.tick_loop.pools
  assert table.regroups and all(
      table.stores[g.target].regrouped and not table.stores[g.source].regrouped
      and pools.of[g.source] != pools.of[g.target] for g in table.regroups)
  # A slot's positions of one level and dtype share one all-to-all.
  together = {(g.level, table.stores[g.source].dtype) for g in table.regroups}
  assert len(together) < len(table.regroups)
  in_loop = [l for l in hlo.splitlines() if re.search(r"\ball-to-all(-start)?\(", l)
             and "pj:tick loop" in l]  # not GSPMD's, which moves the weights' layout
  assert len(in_loop) == len(together)


@pytest.mark.parametrize("how", ["1f1b-dp2-tp2", "zb-dp2-tp2", "stages-sharing-dp2-tp2",
                                 "dualpipev-zero3-tp2"])
def test_a_tensor_parallel_pipelines_all_reduces_run_outside_its_conditionals(batches_of, how):
  # A slot's branches are cut at tensor parallel's all-reduces (`Phases`): each phase a
  # switch, the all-reduces between them on every device.
  config, loss, params = tp_gpt(4 if how.startswith("dualpipev") else 2)
  batches_of(config)
  if how.startswith("dualpipev"):  # 4 stages on 2 ranks, x TP2 x DP2 under ZeRO-3
    directives = pj.strategies.pipeline(4, 4, "dualpipev", dp=4, zero=3)
    directives.append(pj.shard_tensor({}, [0, 2, 1, 3]))
    n_devices = 8
  elif how != "stages-sharing-dp2-tp2":
    directives = pj.strategies.pipeline(2, 4, how.split("-")[0], dp=4, zero=1)
    directives.append(pj.shard_tensor({}, [0, 2, 1, 3]))
    n_devices = 8
  else:
    directives = [pj.split(4), pj.replicate({}, [0, 1, 2, 3], zero=1),
                  *pj.schedules.one_f_one_b(2, 4), pj.shard_tensor({}, [0, 1])]
    n_devices = 4
  step, state = assert_same_run(loss, params, directives, batch_size=8,
                                devices=jax.devices()[:n_devices])
  assert step.schedule_table.period is None and step.describe().count("phase") >= 1
  import models
  hlo = step.lower(state, models.random_batch(jax.random.PRNGKey(0), 8)).compile().as_text()
  assert " conditional(" in hlo and re.search(r"\ball-reduce(-start)?\(", hlo)
  assert collectives_in_conditionals(hlo) == []


def test_stores_of_one_size_and_dtype_share_a_buffer_and_its_scratch_row():
  # Small rows (at most 16 KiB) share one buffer per dtype, padded to the widest of them.
  from piper_jax.lowering.schedule_table import Store
  from piper_jax.lowering.tick_loop import Pools
  stores = (Store((4, 2), "float32", 3), Store((8,), "float32", 2), Store((8,), "bfloat16", 1),
            Store((2, 2), "float32", 1), Store((64, 128), "float32", 1),
            Store((64, 128), "float32", 2))
  pools = Pools.of_stores(stores)
  assert pools.of == (0, 0, 1, 0, 2, 2)
  assert pools.rows == (3 + 2 + 1 + 1, 1 + 1, 1 + 2 + 1)   # each store's rows, one scratch row
  assert pools.size == (8, 8, 64 * 128)
  assert pools.offset == (0, 3, 0, 5, 0, 1)
  rows = np.array([0, 2, 3])                        # store 0's rows, 3 is its scratch
  np.testing.assert_array_equal(pools.rows_of(stores, 0, rows), [0, 2, 6])
  np.testing.assert_array_equal(pools.rows_of(stores, 1, np.array([0, 1, 2])), [3, 4, 6])
  np.testing.assert_array_equal(pools.rows_of(stores, 5, np.array([0, 1, 2])), [1, 2, 3])
  assert [z.shape for z in pools.zeros()] == [(7, 8), (2, 8), (4, 64 * 128)]
  # Where sharing would pad the stores by more than a twentieth, they stay apart.
  apart = Pools.of_stores((Store((4096,), "float32", 8), Store((16,), "float32", 8)))
  assert apart.size == (4096, 16) and apart.of == (0, 1)


def test_accumulation_hands_each_microbatchs_values_on_directly(batches_of):
  # Each repeat of the straight loop is one microbatch's passes: its values pass from
  # task to task through no store, and all-to-alls run only where an expert-parallel
  # region's tokens change layout (its inputs, its outputs and their cotangents), not
  # after every pass on scratch rows.
  config, loss, params = moe_gpt(1)
  batches_of(config)
  directives = [pj.split(4), pj.replicate({}, [0, 1]), pj.shard({"EP": "*"}, [0, 1])]
  step, state = assert_same_run(loss, params, directives, batch_size=16, tx=MOE_TX)
  program = step._program
  assert program.tick_loop.direct and "values handed on directly" in step.describe()
  n_ep = sum(program.runner.io_local(r.index) for r in program.model.regions)
  import models  # the batches `batches_of` set for this model
  text = step.lower(state, models.random_batch(jax.random.PRNGKey(0), 16)).as_text()
  assert n_ep and len(re.findall(r"\ball_to_all\b", text)) == 4 * n_ep
