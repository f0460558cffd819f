"""The program a GPU runs, built and lowered on CPU devices.

`pj.compile` builds a different program on GPUs than the CPU tests run: on CPU a step
written out tick by tick makes every tick wait for every collective before it
(`Program.order_collectives`, set because XLA's CPU runtime runs independent operations
in any order and hung an EP step); a GPU runs one program order, where a bucket's
all-reduce overlaps the next tick's work, so no such dependency may be added there. On
GPUs a pipeline's jit also takes `Program.compiler_options("gpu")` (the loop's
conditionals and the loop itself as CUDA graphs), and bf16 weight-gradient GEMMs read bf16 and write fp32
(where gradients sum over microbatches; the CPU widens their operands first). Here
`pj.compile(..., platform="gpu")` builds the GPU's program on CPU devices, and the step
is traced, lowered for CUDA (`step.lower`, which needs no GPU) and run on CPU devices.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import piper_jax as pj
from examples import gpt
from models import (assert_same_run, collectives_in_conds, init_mlp, mlp_loss, optimizer,
                    random_batch, shard_map_body)
from piper_jax.ir.directives import Replicate
from piper_jax.lowering.program import LOOP_CPU_XLA_OPTIONS, PIPELINE_XLA_OPTIONS

pytestmark = pytest.mark.timeout(240)

_COLLECTIVES = ("ppermute", "reduce_scatter", "psum", "all_gather", "all_to_all")


def _pipeline_step(n_stages=2, n_mb=8, dp=2, zero=2, bucket_mb=None, platform="gpu"):
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
                    devices=jax.devices()[:n_stages * dp], platform=platform)
  return step, step.init(params), batch


def _bucketed_dp_step(n_devices=2, platform="gpu"):
  """DP with one microbatch and gradient buckets (the step written out tick by tick, an
  all-reduce in the tick where a bucket's gradients are final), its state and batch."""
  loss, params = mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2)
  batch = random_batch(jax.random.PRNGKey(1), 8 * n_devices)
  directives = [dataclasses.replace(d, bucket_mb=1e-3) if isinstance(d, Replicate) else d
                for d in pj.strategies.data_parallel(n_devices)]
  step = pj.compile(loss, optimizer(), directives, params, batch,
                    devices=jax.devices()[:n_devices], platform=platform)
  return step, step.init(params), batch


def test_gpu_ticks_do_not_wait_for_unrelated_collectives():
  # The step a GPU runs is the CPU's without the waits: on CPU every tick waits for the
  # all-reduces before it ("loss + 0 * isfinite(x)"), on a GPU a bucket's all-reduce runs
  # beside the backward that follows; otherwise the same collectives in the same order.
  step, state, batch = _bucketed_dp_step()
  assert step.platform == "gpu" and not step.tick_loop
  names = lambda s, st: [e.primitive.name for e in
                         shard_map_body(s.trace(st, batch).jaxpr.jaxpr).eqns]
  gpu = names(step, state)
  cpu_step, cpu_state, _ = _bucketed_dp_step(platform=None)
  assert cpu_step.platform == "cpu"
  cpu = names(cpu_step, cpu_state)
  assert gpu.count("psum") >= 2 and "is_finite" not in gpu and "is_finite" in cpu
  colls = lambda ns: [n for n in ns if n in _COLLECTIVES]
  assert colls(gpu) == colls(cpu)


def test_gpu_step_lowers_for_cuda_with_command_buffers(monkeypatch):
  # The GPU's step lowers for CUDA without a GPU: its ticks as conditionals in a while
  # loop, and the jit carries the command-buffer options. XLA parses those on
  # CPU too (test_strategies.py::test_compiler_options: a bad one fails there), so a
  # CPU compile checks the command-buffer kinds' names against this XLA.
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # conftest's names no GPU option
  step, state, batch = _pipeline_step()
  cuda = step.lower(state, batch)
  text = cuda.as_text()
  assert step.tick_loop and "stablehlo.while" in text and "stablehlo.case" in text
  assert "stablehlo.collective_permute" in text and "stablehlo.reduce_scatter" in text
  assert "mhlo.num_partitions = 4" in text
  assert _jit_options(cuda) == PIPELINE_XLA_OPTIONS
  assert {"CONDITIONAL", "WHILE"} <= set(PIPELINE_XLA_OPTIONS["xla_gpu_enable_command_buffer"]
                                         .split(","))
  assert PIPELINE_XLA_OPTIONS["xla_gpu_graph_min_graph_size"] == 1
  step.compile()  # for its CPU devices, from shapes, with the same options

  # An option XLA_FLAGS names is left to XLA_FLAGS; data parallelism takes none.
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_graph_min_graph_size=4")
  step, state, batch = _pipeline_step(n_mb=4)
  assert _jit_options(step.lower(state, batch)) == {
      k: v for k, v in PIPELINE_XLA_OPTIONS.items() if k != "xla_gpu_graph_min_graph_size"}
  loss, params = mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2)
  dp = pj.compile(loss, optimizer(), pj.strategies.data_parallel(4), params, batch,
                  devices=jax.devices()[:4], platform="gpu")
  assert _jit_options(dp.lower(dp.init(params), batch)) == {}
  cpu_pipeline, state, batch = _pipeline_step(n_mb=4, platform=None)
  assert cpu_pipeline.compiler_options() == LOOP_CPU_XLA_OPTIONS
  assert _jit_options(cpu_pipeline.lower(state, batch)) == LOOP_CPU_XLA_OPTIONS


def _jit_options(lowered) -> dict:
  """The compiler options a lowered step's jit was given."""
  kvs = getattr(lowered._lowering, "_compiler_options_kvs", None)
  if kvs is None:
    pytest.skip("this jax keeps a lowering's compiler options elsewhere")
  return dict(kvs)


def test_gpu_weight_gradient_gemms_write_fp32():
  # A bf16 GPT's weight gradients: on a GPU the GEMM reads bf16 and writes fp32
  # (gradients summed over microbatches); XLA's CPU runtime has no such dot, so on CPU
  # the operands are widened first. Both steps lowered for CUDA.
  config = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2,
                         n_stages=2, dtype=jnp.bfloat16, attention="xla")
  model = gpt.GPT(config)
  loss, params = gpt.loss_fn(model), gpt.init_params(model, jax.random.PRNGKey(0))
  batch = gpt.random_batch(config, jax.random.PRNGKey(1), 8, pattern_seed=1)

  steps = {}

  def wide_dots(platform):
    steps[platform] = step = pj.compile(loss, optimizer(), pj.strategies.pipeline(2, 4, "1f1b"),
                                        params, batch, devices=jax.devices()[:2],
                                        platform=platform)
    text = step.trace(step.init(params), batch).lower(lowering_platforms=("cuda",)).as_text()
    # (lhs, rhs) -> out: bf16 operands, fp32 result; weight gradients are 2-D.
    return re.findall(r"stablehlo\.dot_general .*: \(tensor<[\dx]+xbf16>, tensor<[\dx]+xbf16>\) "
                      r"-> tensor<\d+x\d+xf32>", text)

  assert wide_dots("gpu")
  assert not wide_dots("cpu")
  # The CPU cannot run such a dot: the GPU's step is refused here before one device fails
  # and its peer waits for it in a collective; the CPU's runs.
  gpu, cpu = steps["gpu"], steps["cpu"]
  with pytest.raises(ValueError, match="platform='gpu'.*cannot run.*drop platform="):
    gpu(gpu.init(params), batch)
  with pytest.raises(ValueError, match="cannot run"):
    gpu.memory()
  assert np.isfinite(float(cpu(cpu.init(params), batch)[1]))


@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 2)])
def test_gpu_ordered_pipeline_runs_on_cpu(dp, zero):
  # The GPU's ordering on CPU devices, as the CPU would never build it: without EP no
  # conditional holds a collective, the case that hung (tests/test_parallel.py::
  # test_cpu_ticks_wait_for_the_collectives_before_them). 1F1B over 2 devices, x DP 2 with
  # ZeRO-2 (then reduce-scattered per tick), and DualPipeV x DP 2 x ZeRO-3 each ran 1,700
  # steps so here without hanging.
  # Same numbers as one device's, under the GPU's compiler options too.
  loss, params = mlp_loss(2), init_mlp(jax.random.PRNGKey(0), 2)
  directives = pj.strategies.pipeline(2, 8, "1f1b", dp=dp, zero=zero)
  step, state = assert_same_run(loss, params, directives, batch_size=16 * dp,
                                devices=jax.devices()[:2 * dp], platform="gpu")
  assert step.platform == "gpu" and step.tick_loop
  lowered = step.lower(state, random_batch(jax.random.PRNGKey(0), 16 * dp))
  assert _jit_options(lowered) == step.compiler_options() != {}


def test_gpu_tensor_parallel_pipeline_holds_no_collective_in_a_conditional():
  # The GPU's bf16 program (fp32-writing weight-gradient GEMMs) of a PP2 x TP2 pipeline:
  # its all-reduces run between the phases of each slot's switch, none inside one.
  config = gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2,
                         n_stages=2, dtype=jnp.bfloat16, attention="xla", tp_axis="tp")
  model = gpt.GPT(config)
  loss, params = gpt.loss_fn(model), gpt.init_params(model, jax.random.PRNGKey(0))
  batch = gpt.random_batch(config, jax.random.PRNGKey(1), 8, pattern_seed=1)
  directives = pj.strategies.pipeline(2, 4, "1f1b", dp=2) + [pj.shard_tensor({}, [0, 2, 1, 3])]
  step = pj.compile(loss, optimizer(), directives, params, batch, devices=jax.devices()[:4],
                    platform="gpu")
  jaxpr = step.trace(step.init(params), batch).jaxpr.jaxpr
  body = shard_map_body(jaxpr)
  assert re.search(r"cut at tensor parallel's collectives.*\(\d+ phases", step.describe())
  assert collectives_in_conds(body) == []
  assert "psum" in str(body) and "cond" in str(body)
