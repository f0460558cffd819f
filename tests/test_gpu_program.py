"""The program a GPU runs, built and lowered on CPU devices.

`pj.compile` builds a different program on GPUs than the CPU tests run: on CPU every
tick's switch waits for every collective before it (`Program.order_collectives`, set
because XLA's CPU runtime runs independent operations in any order and hung an EP
pipeline); a GPU runs one program order, where a ppermute or a per-tick reduce-scatter
overlaps the next tick's work, so no such dependency may be added there. On GPUs the
step's jit also takes `Program.compiler_options("gpu")` (the per-tick conditionals and
the rolled loop as CUDA graphs), and bf16 weight-gradient GEMMs read bf16 and write fp32
(`regions.WIDE_WEIGHT_GRADS`; the CPU widens their operands first). Here the GPU's
`Program` is put in `pj.compile`'s place (`_gpu_program`), and the step is traced,
lowered for CUDA (`jax.stages.Traced.lower(lowering_platforms=("cuda",))`, which needs
no GPU) and run on CPU devices.
"""

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import piper_jax as pj
from examples import gpt
from models import (assert_same_run, init_mlp, jaxpr_ancestors, mlp_loss, optimizer, random_batch,
                    shard_map_body)
from piper_jax.ir.directives import Replicate
from piper_jax.lowering.program import PIPELINE_XLA_OPTIONS, Program

pytestmark = pytest.mark.timeout(240)
# The per-tick program, for what only it has (a rolled steady state, one switch a tick).
PER_TICK = pj.LoweringOptions(tick_loop=False)

_COMPILE = sys.modules["piper_jax.compile"]  # `piper_jax.compile` is also the function
_COLLECTIVES = ("ppermute", "reduce_scatter", "psum", "all_gather", "all_to_all")


class _GPUProgram(Program):
  """`Program` as `pj.compile` builds it for a GPU (devices[0].platform == "gpu")."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **{**kwargs, "order_collectives": False})

  def compiler_options(self, platform: str) -> dict:
    return super().compiler_options("gpu")


@pytest.fixture
def gpu_program(monkeypatch):
  """Within the test, `pj.compile` builds the GPU's program and jit options."""
  monkeypatch.setattr(_COMPILE, "Program", _GPUProgram)


def _pipeline_step(n_stages=2, n_mb=8, dp=2, zero=2, roll=True, bucket_mb=None):
  """A 1F1B x DP step of the test MLP on n_stages * dp CPU devices (ZeRO-0 with
  `bucket_mb`: an all-reduce in the tick where a bucket's gradients are final), with its
  state and batch."""
  loss, params = mlp_loss(n_stages), init_mlp(jax.random.PRNGKey(0), n_stages)
  batch = random_batch(jax.random.PRNGKey(1), 16 * dp)
  directives = pj.strategies.pipeline(n_stages, n_mb, "1f1b", dp=dp, zero=zero)
  if bucket_mb is not None:
    directives = [dataclasses.replace(d, bucket_mb=bucket_mb) if isinstance(d, Replicate)
                  else d for d in directives]
  step = pj.compile(loss, optimizer(), directives, params, batch,
                    devices=jax.devices()[:n_stages * dp], roll=roll,
                    options=pj.LoweringOptions(tick_loop=False))
  return step, step.init(params), batch


def _traced(step, state, batch):
  return step._step.trace(state, step._batch_leaves(batch))


def _loop_body(body):
  """The rolled loop's body (`lax.fori_loop` over a static range: a scan)."""
  loops = [e for e in body.eqns if e.primitive.name in ("scan", "while")]
  assert len(loops) == 1, [e.primitive.name for e in loops]
  e = loops[0]
  inner = e.params["jaxpr"] if e.primitive.name == "scan" else e.params["body_jaxpr"]
  return getattr(inner, "jaxpr", inner)


def _tick_switches(jaxpr) -> list[int]:
  """Indices of the ticks' switches among `jaxpr`'s equations: the conditionals that
  return a tick's loss (not ZeRO-2's per-rank layout of a tick's gradients, which
  switches on the rank too)."""
  return [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "cond"
          and any(v.aval.shape == () and v.aval.dtype == jnp.float32 for v in e.outvars)]


def _unordered(jaxpr):
  """(switch, collective) pairs of `jaxpr`'s equations where the collective comes first
  but the tick's switch does not wait for it."""
  names = [e.primitive.name for e in jaxpr.eqns]
  conds = _tick_switches(jaxpr)
  colls = [i for i, n in enumerate(names) if n in _COLLECTIVES]
  assert conds and colls, names
  return [(c, p) for c in conds for p in colls if p < c and p not in jaxpr_ancestors(jaxpr, c)]


def _bodies(step, state, batch) -> list:
  """The step's shard_map body and, if it rolls, its loop's body."""
  body = shard_map_body(_traced(step, state, batch).jaxpr.jaxpr)
  return [body] + ([_loop_body(body)] if step.rolled else [])


# 1F1B over 4 ranks: rank 2 receives microbatch 2's activation at tick 3 and runs its F
# at tick 6, so tick 4's switch need not wait for that ppermute. A gradient bucket's
# all-reduce is read by no later tick.
@pytest.mark.parametrize("n_stages,dp,bucket_mb,overlapped", [(4, 1, None, {"ppermute"}),
                                                              (2, 2, 1e-3, {"psum"})])
def test_gpu_ticks_do_not_wait_for_unrelated_collectives(n_stages, dp, bucket_mb, overlapped,
                                                          gpu_program, monkeypatch):
  # The step a GPU runs is the CPU's without the waits: a tick's switch depends on a
  # collective before it only when it reads its result, so the collective can run
  # beside the next tick's work.
  zero = 0
  step, state, batch = _pipeline_step(n_stages, dp=dp, zero=zero, bucket_mb=bucket_mb)
  assert not step._program.order_collectives
  assert (step.rolled is not None) == (n_stages == 2)
  bodies = _bodies(step, state, batch)
  unordered = [{j.eqns[p].primitive.name for _, p in _unordered(j)} for j in bodies]
  assert all(u <= overlapped for u in unordered)  # outside the loop and in it
  assert set().union(*unordered) == overlapped
  # Nor does the GPU's program compute the CPU's "loss + 0 * isfinite(x)" of collectives.
  names = lambda j: [e.primitive.name for e in j.eqns]
  assert all("is_finite" not in names(j) for j in bodies)

  # The same strategy as the CPU builds it: every switch waits for every collective.
  monkeypatch.setattr(_COMPILE, "Program", Program)
  cpu_step, cpu_state, _ = _pipeline_step(n_stages, dp=dp, zero=zero, bucket_mb=bucket_mb)
  assert cpu_step._program.order_collectives
  cpu_bodies = _bodies(cpu_step, cpu_state, batch)
  assert all(_unordered(j) == [] for j in cpu_bodies)
  # One program otherwise: the same switches and collectives in the same order.
  kinds = lambda j: [n for n in names(j) if n in ("cond", "scan", "while") + _COLLECTIVES]
  assert [kinds(j) for j in bodies] == [kinds(j) for j in cpu_bodies]


def test_gpu_rolled_loop_runs_its_ticks_in_order(gpu_program):
  # Without the CPU's waits, each tick of the rolled loop still waits for the tick
  # before it (through the loss both read), so that a carried value is read before the
  # tick that makes its successor runs and XLA need not copy it each iteration
  # (test_strategies.py::test_rolled_loop_carries_values_without_copies).
  step, state, batch = _pipeline_step()
  _, loop = _bodies(step, state, batch)
  assert step.rolled.iters >= 2
  conds = _tick_switches(loop)
  assert len(conds) == step.rolled.length >= 2
  for before, after in zip(conds, conds[1:]):
    assert before in jaxpr_ancestors(loop, after)


def test_gpu_step_lowers_for_cuda_with_command_buffers(gpu_program, monkeypatch):
  # The GPU's step lowers for CUDA without a GPU: its ticks as conditionals in one
  # while loop, and the jit carries the command-buffer options. XLA parses those on
  # CPU too (test_strategies.py::test_compiler_options: a bad one fails there), so a
  # CPU compile checks the command-buffer kinds' names against this XLA.
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # conftest's names no GPU option
  step, state, batch = _pipeline_step()
  traced = _traced(step, state, batch)
  cuda = traced.lower(lowering_platforms=("cuda",))
  text = cuda.as_text()
  # Shapes and shardings are enough: the same program from abstract inputs.
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      (state, step._batch_leaves(batch)))
  assert step._step.trace(*abstract).lower(lowering_platforms=("cuda",)).as_text() == text
  assert len(re.findall(r"stablehlo\.while", text)) == 1, "one rolled loop"
  body, loop = _bodies(step, state, batch)
  assert step.rolled.iters >= 2
  n_switches = len(_tick_switches(body)) + len(_tick_switches(loop))
  assert n_switches == len(step.plan.ticks) - (step.rolled.iters - 1) * step.rolled.length
  assert len(re.findall(r"stablehlo\.case", text)) >= n_switches
  assert "stablehlo.collective_permute" in text and "stablehlo.reduce_scatter" in text
  assert "mhlo.num_partitions = 4" in text
  assert _jit_options(cuda) == PIPELINE_XLA_OPTIONS
  assert {"CONDITIONAL", "WHILE"} <= set(PIPELINE_XLA_OPTIONS["xla_gpu_enable_command_buffer"]
                                         .split(","))
  assert PIPELINE_XLA_OPTIONS["xla_gpu_graph_min_graph_size"] == 1
  cpu = step.lower(state, batch)
  assert _jit_options(cpu) == PIPELINE_XLA_OPTIONS
  cpu.compile()

  # An option XLA_FLAGS names is left to XLA_FLAGS; data parallelism takes none.
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_graph_min_graph_size=4")
  step, state, batch = _pipeline_step(n_mb=4)
  assert _jit_options(step.lower(state, batch)) == {
      k: v for k, v in PIPELINE_XLA_OPTIONS.items() if k != "xla_gpu_graph_min_graph_size"}
  loss, params = mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2)
  dp = pj.compile(loss, optimizer(), pj.strategies.data_parallel(4), params, batch,
                  devices=jax.devices()[:4])
  assert _jit_options(dp.lower(dp.init(params), batch)) == {}


def _jit_options(lowered) -> dict:
  """The compiler options a lowered step's jit was given."""
  kvs = getattr(lowered._lowering, "_compiler_options_kvs", None)
  if kvs is None:
    pytest.skip("this jax keeps a lowering's compiler options elsewhere")
  return dict(kvs)


def test_gpu_weight_gradient_gemms_write_fp32(monkeypatch):
  # A bf16 GPT's weight gradients: on a GPU the GEMM reads bf16 and writes fp32
  # (`regions.WIDE_WEIGHT_GRADS`); XLA's CPU runtime has no such dot, so on CPU
  # the operands are widened first. Lowered for CUDA with the backend taken for a GPU.
  config = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2,
                         n_stages=2, dtype=jnp.bfloat16, attention="xla")
  model = gpt.GPT(config)
  loss, params = gpt.loss_fn(model), gpt.init_params(model, jax.random.PRNGKey(0))
  batch = gpt.random_batch(config, jax.random.PRNGKey(1), 8, pattern_seed=1)

  def wide_dots(backend):
    # A step of its own: traces (the step's and its passes') are cached per step.
    step = pj.compile(loss, optimizer(), pj.strategies.pipeline(2, 4, "1f1b"), params, batch,
                      devices=jax.devices()[:2])
    state = step.init(params)
    with monkeypatch.context() as m:
      m.setattr(jax, "default_backend", lambda: backend)
      text = _traced(step, state, batch).lower(lowering_platforms=("cuda",)).as_text()
    # (lhs, rhs) -> out: bf16 operands, fp32 result; weight gradients are 2-D.
    return re.findall(r"stablehlo\.dot_general .*: \(tensor<[\dx]+xbf16>, tensor<[\dx]+xbf16>\) "
                      r"-> tensor<\d+x\d+xf32>", text)

  assert wide_dots("gpu")
  assert not wide_dots("cpu")


@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 2)])
def test_gpu_ordered_pipeline_runs_on_cpu(dp, zero, gpu_program):
  # The GPU's ordering on CPU devices, as the CPU would never build it: without EP no
  # conditional holds a collective, the case that hung (tests/test_parallel.py::
  # test_cpu_ticks_wait_for_the_collectives_before_them). 1F1B over 2 devices, x DP 2 with
  # ZeRO-2 (then reduce-scattered per tick), and DualPipeV x DP 2 x ZeRO-3 each ran 1,700
  # steps so here without hanging.
  # Same numbers as one device's, under the GPU's compiler options too.
  loss, params = mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2)
  directives = pj.strategies.pipeline(2, 8, "1f1b", dp=dp, zero=zero)
  step, state = assert_same_run(loss, params, directives, batch_size=16 * dp,
                                devices=jax.devices()[:2 * dp], options=PER_TICK)
  assert not step._program.order_collectives and step.rolled is not None
  assert _jit_options(step.lower(state, random_batch(jax.random.PRNGKey(0), 16 * dp))) \
      == step._program.compiler_options("gpu") != {}
