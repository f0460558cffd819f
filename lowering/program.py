"""Lowers a ticked plan to one shard_map body over the ("dp", ["ep",] ["tp",] "pp") mesh.

A plan with microbatches or pipeline ranks runs as one loop over its ticks
(`lowering/tick_loop.py`). A step of one microbatch on one rank is written out tick by
tick: values that outlive a tick are kept by position (`layout.match_positions`),
ZeRO-3 all-gathers the slots a tick reads one tick ahead, before the previous tick's
work, and keeps the slots consecutive ticks read, ZeRO 2/3 reduce-scatter each tick's
gradients and ZeRO-0 with `bucket_mb` all-reduces them in buckets as they become final,
so that XLA overlaps them with the backward as under `jax.jit`. Either way gradients
accumulate per leaf, unreduced over microbatches, and are laid out into the flat
parameter segments and reduced once at the end (ZeRO 0/1, and a pipeline's ZeRO 2/3; a
pipeline's ZeRO-3 gathers its slots as the step starts: `ParamLayout.gathers_at_start`).
Expert-parallel regions exchange their tokens by all-to-all over "ep" before and after
each pass; split weights' pieces (shard, shard_tensor) get their gradients reduced only
over their copies (`lowering/gradients.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from piper_jax.ir.graph import Pass
from piper_jax.ir.plan import Plan, Task
from piper_jax.lowering.buffers import Buffers, StepParams
from piper_jax.lowering.options import LoweringOptions
from piper_jax.lowering.gradients import GradientSums, zeros_of
from piper_jax.lowering.layout import SHARED, ParamLayout, match_positions, signature
from piper_jax.lowering.local import RegionRunner
from piper_jax.lowering.regions import (BackwardSplit, RegionAD, analyze_region, backward_input,
                                        backward_weight, first_alike, full_residuals,
                                        region_backward, region_forward, relabel, split_backward)
from piper_jax.lowering.tick_loop import TickLoop
from piper_jax.lowering.values import (Kept, TickValues,
                                       ValueKey, ValueKind)

__all__ = ["Program", "lowers_as_loop"]

_GRAD_PASSES = (Pass.B, Pass.BW)
# Expert parallel's kinds of values -> the kind they are in the devices' own layout.
_BY_EXPERT = {ValueKind.ACT_TO_EP: ValueKind.ACT, ValueKind.CT_TO_EP: ValueKind.CT,
              ValueKind.ACT_FROM_EP: ValueKind.ACT, ValueKind.CT_FROM_EP: ValueKind.CT}
_MADE_BY_EXPERTS = (ValueKind.ACT_FROM_EP, ValueKind.CT_FROM_EP)


def _from_stored(fn, ad: RegionAD, split: BackwardSplit):
  """`fn(split, residuals, cts, *rest)` (B, BI or BW) as a pass of what a task reads:
  (stored residuals, params, batch, acts, outs, cts, *rest)."""
  def run(stored, params, batch, acts, outs, cts, *rest):
    return fn(split, full_residuals(ad, stored, params, batch, acts, outs), cts, *rest)
  run.__name__ = run.__qualname__ = fn.__name__  # the pass's name in HLO metadata and profiles
  return run


def _plus_zero_of(x: jax.Array, after: jax.Array) -> jax.Array:
  """`x` plus exactly 0 computed from `after` (any shape; isfinite is 0 or 1): a data
  dependency XLA's CPU compiler keeps; its GPU compiler folds it away."""
  return x + 0 * jnp.all(jnp.isfinite(after)).astype(x.dtype)


def _waits_for(x: jax.Array, after: jax.Array) -> jax.Array:
  """`x`, computed after `after` (a scalar), for both of XLA's compilers: the GPU
  compiler keeps optimization barriers until it has scheduled the program; the CPU
  compiler drops them before it merges collectives, but keeps `_plus_zero_of`."""
  return lax.optimization_barrier((_plus_zero_of(x, after), after))[0]


@dataclasses.dataclass
class _State:
  """What a step's ticks pass on: arrays by location, gradient sums, the loss."""

  # The running sums of the loss and the aux leaves (`Program.sums`).
  loss: jax.Array
  arrays: dict = dataclasses.field(default_factory=dict)
  # Gradient position -> sum; under `GradientSums.scatter_each_tick`, (slot, dtype) ->
  # this replica's reduce-scattered chunk.
  acc: dict = dataclasses.field(default_factory=dict)
  split_acc: dict = dataclasses.field(default_factory=dict)  # split leaves' pieces, by position


# XLA's GPU command buffers (CUDA graphs) for a pipeline's step: XLA's default kinds
# plus the loop's conditional and the loop itself, so that a tick's kernels go to the
# GPU as one graph. Without them XLA copies the branch index to the host, waits for the
# stream, and launches the branch's kernels one by one; at a microbatch of 2 sequences
# many take a few microseconds. Each slot's conditional sits alone between
# collectives (which do not go into graphs), so the smallest graph must be one
# command, or XLA leaves the conditional on the host (and the host, not the GPU, sets
# the step's pace). jit DP has no conditionals.
PIPELINE_COMMAND_BUFFERS = ("FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,"
                            "CONDITIONAL,WHILE")
PIPELINE_XLA_OPTIONS = {"xla_gpu_enable_command_buffer": PIPELINE_COMMAND_BUFFERS,
                        "xla_gpu_graph_min_graph_size": 1}
# The loop's branches write the value stores in place. XLA's GPU copy insertion sees that
# a conditional's branches may alias its operands (region analysis); its CPU default does
# not, and copies every store buffer in every branch of every slot. With it, branches
# analysed after the first few of a switch still copy what they pass through
# (docs/lowering.md says how much).
LOOP_CPU_XLA_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def lowers_as_loop(plan: Plan) -> bool:
  """Whether `plan` is lowered as one loop over its ticks: every plan with microbatches or
  pipeline ranks (pipelines, gradient accumulation, stages sharing a device, expert and
  tensor parallel tasks, bucketed or not). A step of one microbatch on one rank has no
  ticks that repeat: its ticks are written out one by one, so that XLA schedules the
  step whole, overlapping bucketed all-reduces and ZeRO-3's prefetched gathers with the
  backward as it does under `jax.jit`."""
  return plan.mesh.n_pp > 1 or plan.n_microbatches > 1


class Program:
  """The lowering of a plan; `body` is the shard_map body of one step."""

  def __init__(self, runner: RegionRunner, plan: Plan, layout: ParamLayout,
               options: LoweringOptions | None = None, platform: str = "gpu"):
    """`platform` ("cpu" or "gpu"): the devices the program is for. `options.remat` None
    is taken as False here; `pj.compile` resolves it."""
    self.options = options = options or LoweringOptions()
    self.runner, self.traced, self.plan, self.layout = runner, runner.traced, plan, layout
    self.platform = platform
    self.model = runner.spec
    mesh = plan.mesh
    self.data_axes = mesh.data_axes
    self.n_data = mesh.n_data
    self.ep = mesh.size("ep")
    self.ad: dict[int, RegionAD] = {}
    self.split: dict[int, BackwardSplit] = {}
    self._analyze_regions(runner, plan, options)
    self.n_mb = plan.n_microbatches
    self.mbs = self.model.batch_size
    for name, (r, _) in zip(runner.traced.aux_names, runner.traced.aux_outputs):
      if runner.io_local(r):
        raise ValueError(f"{name} is computed inside an expert-parallel region, on the tokens "
                         f"routed to this device's experts: compute it outside "
                         f"pj.annotate('EP'), from values every device holds whole")
    # Gradients reduced over data axes travel in this dtype (replicate's reduce_dtype).
    self.reduce_dtype = plan.reduce_dtype if layout.n_dp > 1 else None
    self.grads = GradientSums(self.model, plan, layout, self.ad, self.reduce_dtype,
                              looped=lowers_as_loop(plan))
    if lowers_as_loop(plan):
      # The loop finds its values through its own table (`schedule_table`), not
      # positions kept per tick, and reduces gradients once, after its last tick.
      self.tick_loop, self.ticks, self.loc, self.buckets = TickLoop(self), [], {}, {}
    else:
      self.tick_loop = None
      self._plan_values()
    self._passes: dict[tuple, Any] = {}

  def _analyze_regions(self, runner: RegionRunner, plan: Plan, options: LoweringOptions):
    """Each region's vjp analysis (`ad`) and backward split (`split`), traced once per
    `region_key`: a region that traces like an earlier one (a pipeline's middle stages)
    takes that one's jaxprs, relabelled with its own names."""
    remat = bool(options.remat)
    # Gradients summed over microbatches: bf16 weight-gradient GEMMs write fp32.
    wide = plan.n_microbatches > 1
    backward = {t.region for t in plan.tasks.values() if t.pass_ in (Pass.B, Pass.BI)}
    first = first_alike(runner, [spec.index for spec in self.model.regions], remat)
    for spec in self.model.regions:
      r = spec.index
      src = first[r]
      if src != r and (r in backward) == (src in backward):
        found = relabel(runner, src, r, self.ad[src], self.split.get(src))
        if found is not None:
          self.ad[r], split = found
          if split is not None:
            self.split[r] = split
          continue
      self.ad[r] = analyze_region(runner, r, remat)
      if r in backward:
        out_avals = runner.out_avals(r)
        cts = [out_avals[k] for k in self.ad[r].float_outs]
        self.split[r] = split_backward(self.ad[r], cts, runner.axis_env, wide,
                                       widen_operands=self.platform == "cpu")

  def sums(self) -> jax.Array:
    """Zero running sums of what a step reports: the loss, then each aux leaf."""
    return jnp.zeros((1 + len(self.traced.aux_outputs),), jnp.float32)

  @property
  def order_collectives(self) -> bool:
    """Whether each tick waits for the collectives before it: on CPU only. XLA's CPU
    runtime runs independent operations concurrently, in any order, and a conditional
    does not count as a collective: a device could enter a tick's switch (with EP's
    all_to_all inside) while its peer still waits in the previous tick's ppermute, and
    both wait forever. GPUs run one program order, where a ppermute may overlap the
    next tick's work."""
    return self.platform == "cpu"

  @property
  def gpu_only(self) -> bool:
    """Whether the program holds bf16 GEMMs that write fp32 (summed weight gradients on
    a GPU), which XLA's CPU runtime cannot run."""
    return any(s.prepare is not None and s.prepare.wide and not s.prepare.widen_operands
               for s in self.split.values())

  def compiler_options(self, platform: str | None = None) -> dict:
    """XLA options for this program's step on `platform` (default: the program's;
    `jax.jit`'s `compiler_options`); options that XLA_FLAGS already name are left to it."""
    platform = platform or self.platform
    if platform == "gpu" and self.plan.n_ranks > 1:
      options = PIPELINE_XLA_OPTIONS
    elif platform == "cpu" and lowers_as_loop(self.plan):
      options = LOOP_CPU_XLA_OPTIONS
    else:
      return {}
    named = set(re.findall(r"--(?:no)?(\w+)", os.environ.get("XLA_FLAGS", "")))
    return {k: v for k, v in options.items() if k not in named}

  def _pass(self, name: str, region: int, fn):
    """`fn` (one pass of a region), jitted once per (pass, region): traced for the
    first microbatch and called for the rest, so the lowered program holds one copy."""
    key = (name, region)
    if key not in self._passes:
      self._passes[key] = jax.jit(fn)
    return self._passes[key]

  # -- static analysis: who produces and reads every value ----------------------

  def value_aval(self, key: ValueKey):
    """The shape and dtype of a value."""
    if key.kind in _BY_EXPERT:  # expert parallel's layout: [device, its share, ...]
      a = self.value_aval(key.as_kind(_BY_EXPERT[key.kind]))
      return jax.ShapeDtypeStruct((self.ep, a.shape[0] // self.ep) + a.shape[1:], a.dtype)
    r, k = key.region, key.index
    spec = self.model.regions[r]
    if key.kind is ValueKind.ACT:
      o = spec.outputs[k]
      return jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype))
    if key.kind is ValueKind.RES:
      return self.ad[r].stored[k].aval
    if key.kind is ValueKind.WRES:
      return self.split[r].carry_avals[k]
    x = spec.inputs[k].spec
    return jax.ShapeDtypeStruct(x.shape, jnp.dtype(x.dtype))

  def task_reads(self, task: Task) -> list[ValueKey]:
    """Value keys a task reads."""
    r, m = task.region, task.mb
    spec, ad = self.model.regions[r], self.ad[r]
    act_in, act_out, ct_in, _ = self._io_kinds(r)
    keys = []
    if task.pass_ is Pass.F:
      keys += [ValueKey(act_in, x.region, m, x.output) for x in spec.inputs]
    else:
      keys += [ValueKey(ValueKind.RES, r, m, k) for k in range(len(ad.stored))]
      for kind, i in ad.reads:
        if kind == "act":
          x = spec.inputs[i]
          keys.append(ValueKey(act_in, x.region, m, x.output))
        else:
          keys.append(ValueKey(act_out, r, m, i))
      keys += [k.as_kind(ct_in) for k in self._ct_sources(r, m)]
      if task.pass_ is Pass.BW:
        keys += [ValueKey(ValueKind.WRES, r, m, k) for k in range(len(self.split[r].carry))]
    return list(dict.fromkeys(keys))

  def _io_kinds(self, r: int) -> tuple[ValueKind, ValueKind, ValueKind, ValueKind]:
    """The kinds of region r's input activations, its outputs, its outputs' cotangents
    and its inputs' cotangents as its passes read and make them: in its experts' layout
    if it is expert parallel (see `made_from`)."""
    if self.runner.io_local(r):
      return (ValueKind.ACT_TO_EP, ValueKind.ACT_FROM_EP, ValueKind.CT_TO_EP,
              ValueKind.CT_FROM_EP)
    return ValueKind.ACT, ValueKind.ACT, ValueKind.CT, ValueKind.CT

  def made_from(self, key: ValueKey) -> ValueKey | None:
    """The value `key` is regrouped from by expert parallel's all-to-all (`regroup`), or
    None for a value a task makes: an expert-parallel region reads its inputs and its
    outputs' cotangents regrouped by expert, and its outputs and its inputs'
    cotangents are regrouped back from what it makes."""
    if key.kind in _BY_EXPERT:
      return None if key.kind in _MADE_BY_EXPERTS else key.as_kind(_BY_EXPERT[key.kind])
    if key.kind in (ValueKind.ACT, ValueKind.CT) and self.runner.io_local(key.region):
      return key.as_kind(ValueKind.ACT_FROM_EP if key.kind is ValueKind.ACT
                         else ValueKind.CT_FROM_EP)
    return None

  def root(self, key: ValueKey) -> ValueKey:
    """The value a task makes that `key` is (regrouped from)."""
    while (src := self.made_from(key)) is not None:
      key = src
    return key

  def regroup(self, x: jax.Array, aval) -> jax.Array:
    """Expert parallel's all-to-all: row j of `x`'s [devices, ...] view goes to device j
    of the "ep" axis (by expert, or back to where the tokens came from: it is its own
    inverse), as a value of `aval`'s shape and dtype."""
    return self.regroup_together([x], [aval])[0]

  def regroup_together(self, xs: list[jax.Array], avals: list) -> list[jax.Array]:
    """`regroup` of each of `xs` (of one dtype) by one all-to-all, their [devices, ...]
    views side by side."""
    x = jnp.concatenate([x.reshape((self.ep, -1)) for x in xs], axis=1)
    y = lax.all_to_all(x, "ep", 0, 0, tiled=True)
    out, at = [], 0
    for x, aval in zip(xs, avals):
      n = x.size // self.ep
      out.append(y[:, at:at + n].reshape(aval.shape).astype(aval.dtype))
      at += n
    return out

  def _ct_sources(self, r: int, m: int, out: int | None = None) -> list[ValueKey]:
    """The cotangent keys (of consumers' inputs, microbatch m) that sum to the cotangent
    of region r's outputs (of output `out` only, if given)."""
    keys = []
    for c in self.model.regions:
      for i, x in enumerate(c.inputs):
        if x.region == r and x.differentiable and (out is None or x.output == out):
          keys.append(ValueKey(ValueKind.CT, c.index, m, i))
    return keys

  def task_produces(self, task: Task) -> list[ValueKey]:
    """Value keys a task makes."""
    r, m = task.region, task.mb
    _, act_out, _, ct_out = self._io_kinds(r)
    if task.pass_ is Pass.F:
      return ([ValueKey(act_out, r, m, k) for k in range(len(self.model.regions[r].outputs))]
              + [ValueKey(ValueKind.RES, r, m, k) for k in range(len(self.ad[r].stored))])
    if task.pass_ is Pass.BW:
      return []
    out = [ValueKey(ct_out, r, m, i) for i in self.ad[r].diff_acts]
    if task.pass_ is Pass.BI:
      out += [ValueKey(ValueKind.WRES, r, m, k) for k in range(len(self.split[r].carry))]
    return out

  def _plan_values(self):
    """Where each value a later tick reads is kept (one rank: no exchanges)."""
    plan = self.plan
    assert plan.n_ranks == 1, "plans with pipeline ranks are lowered as one loop"
    readers: dict[tuple, list[Task]] = {}
    for t in plan.tasks.values():
      for key in self.task_reads(t):  # a regrouped value is regrouped where it is read
        readers.setdefault(self.root(key), []).append(t)
    self.loc: dict[tuple, Kept] = {}   # (key, reader rank) -> where the reader finds it
    self.ticks: list[TickValues] = []
    for tick_i, tick in enumerate(plan.ticks):
      keep_vals = {rank: [] for rank in range(plan.n_ranks)}
      for rank, tasks in enumerate(tick):
        for task in tasks:
          for key in self.task_produces(task):
            if any(rd.tick > tick_i for rd in readers.get(key, [])):
              keep_vals[rank].append((key, self.value_aval(key)))
      keep_pos, keep_where = match_positions(keep_vals)
      for (rank, key), pos in keep_where.items():
        self.loc[(key, rank)] = Kept(tick_i, pos)
      grad_pos = sorted({self.grads.where[(rank, p)] for rank, tasks in enumerate(tick)
                         for t in tasks if t.pass_ in _GRAD_PASSES
                         for p in self.grads.leaves(t.region)})
      self.ticks.append(TickValues(tuple(keep_pos), keep_where, tuple(grad_pos)))
    self.buckets = self.grads.buckets([info.grads for info in self.ticks])

  # -- the shard_map body -------------------------------------------------------

  def _switch(self, branches, operands):
    if len(branches) == 1:
      return branches[0](operands)
    return lax.switch(lax.axis_index("pp"), branches, operands)

  def body(self, params: Buffers, batch: list):
    """One training step on local shards -> (grads like params, [mean loss, *mean aux
    leaves])."""
    st = _State(self.sums())
    layout = self.layout
    if layout.shards_masters:  # whole for the step, cast slots gathered in bf16
      with jax.named_scope("pj:step start"):
        params = layout.gather_masters(params)
    # Leaves the model only reads as a narrower dtype (fp32 master weights cast to bf16)
    # are cast once per step here (under `shards_masters` they arrive gathered in that
    # dtype, and the cast is a no-op), or all-gathered in that dtype per tick under ZeRO-3,
    # instead of being cast again from fp32 in every task that reads them. A pipeline
    # also unpacks them once (`ParamLayout.unpack_cast`): ticks read them whole.
    params = StepParams(params)
    if layout.zero < 3 and layout.cast_to:  # the cast copies of the slots with cast leaves
      cast_slots = layout.cast_slots - layout.unpacked_slots
      own = params.own
      params.cast = Buffers(
          slots={dt: [x.astype(to) if (j, dt) in cast_slots else None
                      for j, x in zip(layout.slot_ids[dt], own.slots[dt])]
                 for dt, to in layout.cast_to.items()},
          shared={dt: own.shared[dt].astype(to) for dt, to in layout.cast_to.items()
                  if (SHARED, dt) in layout.cast_slots})
      if layout.unpacked_pos:
        params.leaves = layout.unpack_cast(own)
    if self.tick_loop is not None:
      st.acc, st.split_acc = self.grads.zero_sums()
      with jax.named_scope("pj:tick loop"):
        out = self.tick_loop.run(params, batch, st.acc, st.split_acc, st.loss)
      st.acc, st.split_acc, st.loss = out.acc, out.split_acc, out.loss
    else:
      self._run_ticks(st, params, batch)
    acc = st.acc
    with jax.named_scope("pj:step end"):
      if not (self.grads.scatter_each_tick or self.grads.in_segments):
        # Bucketed sums are already reduced, in the reduce dtype: laid out as they are.
        acc = (self.grads.assemble(acc, self._switch, self.reduce_dtype,
                                   materialize=not self.buckets) if acc else {})
      out = self.grads.finish(acc, st.split_acc, bucketed=bool(self.buckets))
      loss = lax.psum(st.loss, self.data_axes + ("pp",)) / (self.n_data * self.n_mb)
    return out, loss

  def _run_ticks(self, st: "_State", params: StepParams, batch: list) -> None:
    """The plan's ticks one by one."""
    ahead, n = None, len(self.plan.ticks)
    for t in range(n):
      with jax.named_scope(f"pj:tick {t}"):
        # ZeRO-3: the next tick's all-gathers are issued before this tick's work, so they
        # can run beside it (prefetched one tick ahead); what both ticks read is gathered
        # once.
        gathered = ahead or (self._gather(t, params.own, after=st.loss)
                             if self.layout.zero == 3 else None)
        ahead = (self._gather(t + 1, params.own, gathered, after=st.loss)
                 if gathered and t + 1 < n else None)
        self._tick(t, st, params, batch, gathered=gathered)

  def _read(self, tick_i: int) -> set[int]:
    """The parameter leaves tick `tick_i` reads."""
    return {p for ts in self.plan.ticks[tick_i] for t in ts
            for p in self.model.regions[t.region].params}

  def _gather(self, tick_i: int, params: Buffers, have: tuple[dict, dict] | None = None,
              after: jax.Array | None = None) -> tuple[dict, dict]:
    """`gather_segments` of the leaves tick `tick_i` reads, waiting for `after` under
    `LoweringOptions.zero3_reshard`."""
    after = after if self.options.zero3_reshard else None
    return self.gather_segments(self._read(tick_i), params, have, after)

  def gather_segments(self, read: set[int], params: Buffers,
                      have: tuple[dict, dict] | None = None,
                      after: jax.Array | None = None) -> tuple[dict, dict]:
    """ZeRO-3: the whole (slot, dtype) segments of the leaves in `read`, all-gathered over
    the data axes, as (segments, cast segments); those in `have` (the previous tick's)
    are taken from there instead of gathered again.

    The gathers wait for `after` (the loss so far, which each tick makes depend on its
    work; XLA drops optimization barriers before it merges collectives). Without it XLA
    merges a segment's forward and backward gathers into one, and every tick's into one
    combined gather, and holds all parameters whole for the whole step."""
    layout = self.layout
    have_segs, have_cast = have or ({}, {})
    need: dict[tuple, set] = {}   # (slot, dtype) -> {read as cast?}
    for p in set(read) - set(layout.split):
      need.setdefault((layout.home[p].slot, layout.home[p].dtype), set()).add(p in layout.cast)

    got = {(key, key[1]): x for key, x in have_segs.items()}  # (key, dtype) -> segment
    got.update({(key, layout.cast_to[key[1]]): x for key, x in have_cast.items()})

    def get(key, to):
      if (key, to) not in got:  # a segment gathered whole is cast, not gathered again
        whole = got.get((key, key[1]))
        shard = layout.local_segment(params, *key)
        if after is not None:
          shard = _waits_for(shard, after)
        got[(key, to)] = (whole.astype(to) if whole is not None else lax.all_gather(
            shard.astype(to), self.data_axes, tiled=True))
      return got[(key, to)]

    # Cast leaves have slots of their own (the SHARED one may mix both: gathered once).
    segs = {key: get(key, key[1]) for key, kinds in need.items() if False in kinds}
    cast = {key: get(key, layout.cast_to[key[1]]) for key, kinds in need.items() if True in kinds}
    return segs, cast

  def _tick(self, tick_i: int, st: "_State", params: StepParams, batch: list,
            gathered: tuple[dict, dict] | None = None):
    """Runs tick `tick_i` and its collectives on `st`; `gathered`: the tick's ZeRO-3
    segments if already all-gathered (`_gather`)."""
    plan, layout, loc = self.plan, self.layout, self.loc
    zero, axes = layout.zero, self.data_axes
    tick, info = plan.ticks[tick_i], self.ticks[tick_i]
    read = self._read(tick_i)
    leaves, own = params.leaves, params.own
    if zero == 3:
      segs, cast = gathered or self._gather(tick_i, own, after=st.loss)
    else:
      segs, cast = None, params.cast
    split = self.gather_split_pieces(own.split, read)
    reads = sorted({loc[(key, rank)] for rank, ts in enumerate(tick) for t in ts
                    for key in map(self.root, self.task_reads(t))
                    if (key, rank) in loc and loc[(key, rank)].tick < tick_i}, key=str)
    # Running gradient sums the tick adds to inside the switch (all but the chunks of
    # `scatter_each_tick`; split leaves).
    acc_in = {}
    for pos in info.grads:
      sums = (st.split_acc if pos >= self.grads.split0 else
              {} if self.grads.scatter_each_tick else st.acc)
      if pos in sums:
        acc_in[pos] = sums[pos]
    operands = {"arrays": {k: st.arrays[k] for k in reads},
                "params": own if segs is None else segs, "cast": cast, "split": split,
                "leaves": leaves,
                "batch": batch, "acc": acc_in}
    branches = [self._branch(rank, tick_i, tick[rank], segs is not None, loc)
                for rank in range(plan.n_ranks)]
    if self.order_collectives:
      # Every branch reads the loss so far, which depends on the collectives before this
      # tick (an optimization barrier around the operands does not survive XLA).
      operands["after"] = st.loss
    keep, grads, tick_loss = self._switch(branches, operands)
    st.loss = st.loss + tick_loss
    if zero == 3 and self.options.zero3_reshard:  # later ticks' gathers wait for this one
      made = [x for x in [*keep, *grads.values()] if x.size]
      if made:
        st.loss = _waits_for(st.loss, made[0].reshape(-1)[0])
    for pos, x in enumerate(keep):
      st.arrays[Kept(tick_i, pos)] = x
    for pos in [p for p in grads if p >= self.grads.split0]:
      st.split_acc[pos] = grads.pop(pos)
    if self.grads.scatter_each_tick and grads:
      for key, x in self.grads.assemble(grads, self._switch, self.reduce_dtype,
                                        materialize=True).items():
        x = self.grads.collective(lax.psum_scatter, x, axes, scatter_dimension=0, tiled=True)
        # Behind a barrier: XLA would reassociate a sum of reduce-scatters into one
        # reduce-scatter of the summed whole gradients, held from tick to tick.
        x = lax.optimization_barrier(self._before_next_tick(st, x).astype(key[1]))
        st.acc[key] = st.acc[key] + x if key in st.acc else x
    else:
      st.acc.update(grads)
      for bucket in self.buckets.get(tick_i, []):
        # One all-reduce of several arrays as soon as they are final, which XLA
        # can overlap with the backward work that follows.
        summed = self.grads.collective(lax.psum, tuple(st.acc[p] for p in bucket), axes,
                                       keep_dtype=False)
        st.acc.update(zip(bucket, (self._before_next_tick(st, x) for x in summed)))

  def _before_next_tick(self, st: "_State", x: jax.Array) -> jax.Array:
    """x, a collective's result; under `order_collectives` the next tick's switch waits
    for it (the loss, which the switch reads, adds exactly 0: isfinite is 0 or 1)."""
    if self.order_collectives and x.size:  # on CPU only
      st.loss = _plus_zero_of(st.loss, x.reshape(-1)[0])
    return x

  def gather_split_pieces(self, local: list[jax.Array], read: set[int]) -> list[jax.Array]:
    """Split weights' pieces for a tick that reads parameters `read`; under ZeRO-3 those
    pieces are all-gathered over their copies (the others stay sharded: no task of
    the tick reads them)."""
    layout = self.layout
    if layout.zero < 3:
      return local
    out = list(local)
    for k in sorted({layout.split_pos[p] for p in read if p in layout.split}):
      out[k] = layout.gather_piece(local[k], k)
    return out

  def run_task(self, r: int, pass_: Pass, m: int, read, param, batch: list,
               made: dict, grad_acc: dict) -> jax.Array:
    """Runs pass `pass_` of region `r` on microbatch `m`'s values: `read(key)` gives a
    value it reads, `param(p)` a parameter leaf, `batch` the microbatch's batch leaves.
    Puts the values it makes in `made` (key -> array), adds its weight gradients to
    `grad_acc` (leaf -> sum), and returns its contribution to the loss."""
    model = self.model
    spec, ad = model.regions[r], self.ad[r]
    params = [param(p) for p in spec.params]
    act_in, act_out, ct_in, ct_out = self._io_kinds(r)
    loss = self.sums()
    if pass_ is Pass.F:
      acts = [read(ValueKey(act_in, x.region, m, x.output)) for x in spec.inputs]
      forward = self._pass("F", r, functools.partial(region_forward, ad))
      outs, stored = forward(params, batch, acts)
      for k, x in enumerate(outs):
        made[ValueKey(act_out, r, m, k)] = x
      for k, x in enumerate(stored):
        made[ValueKey(ValueKind.RES, r, m, k)] = x
      if spec.produces_loss:
        loss = loss.at[0].add(outs[self.traced.loss_output()].astype(jnp.float32))
      for j, (region, k) in enumerate(self.traced.aux_outputs):
        if region == r:
          loss = loss.at[1 + j].add(outs[k].astype(jnp.float32))
      return loss
    acts = [None] * len(spec.inputs)
    outs = [None] * len(spec.outputs)
    for kind, i in ad.reads:
      if kind == "act":
        x = spec.inputs[i]
        acts[i] = read(ValueKey(act_in, x.region, m, x.output))
      else:
        outs[i] = read(ValueKey(act_out, r, m, i))
    stored = [read(ValueKey(ValueKind.RES, r, m, k)) for k in range(len(ad.stored))]
    cts = []
    for k in ad.float_outs:
      o = self.value_aval(ValueKey(act_out, r, m, k))
      ct = jnp.zeros(o.shape, o.dtype)
      for key in self._ct_sources(r, m, k):
        ct = ct + read(key.as_kind(ct_in)).astype(ct.dtype)
      if spec.produces_loss and k == self.traced.loss_output():
        ct = ct + jnp.asarray(1.0 / (self.n_data * self.n_mb), ct.dtype)
      cts.append(ct)
    args = (stored, params, batch, acts, outs, cts)
    split = self.split[r]
    if pass_ is Pass.B:
      d_params, d_acts = self._pass("B", r, _from_stored(region_backward, ad, split))(*args)
    elif pass_ is Pass.BI:
      d_acts, carry = self._pass("BI", r, _from_stored(backward_input, ad, split))(*args)
      for k, x in enumerate(carry):
        made[ValueKey(ValueKind.WRES, r, m, k)] = x
      d_params = []
    else:
      carry = [read(ValueKey(ValueKind.WRES, r, m, k)) for k in range(len(split.carry))]
      d_params = self._pass("BW", r, _from_stored(backward_weight, ad, split))(*args, carry)
      d_acts = []
    for i, x in zip(ad.diff_acts, d_acts):
      made[ValueKey(ct_out, r, m, i)] = x
    for i, g in zip(ad.diff_params, d_params):
      p = spec.params[i]
      grad_acc[p] = grad_acc[p] + g if p in grad_acc else g
    return loss

  def param_reader(self, ops: dict, gathered: bool):
    """`param(p)`: parameter leaf p from a switch's operands ("params", "cast", "split",
    "leaves", and "offsets" where weights are sliced at offsets XLA cannot fold);
    `gathered`: "params" and "cast" hold ZeRO-3's gathered whole segments."""
    layout = self.layout
    seg_cache = {}

    def segment(slot, dt, cast):
      if (slot, dt, cast) not in seg_cache:
        src = ops["cast"] if cast else ops["params"]
        seg_cache[(slot, dt, cast)] = (src[(slot, dt)] if gathered
                                       else layout.local_segment(src, slot, dt))
      return seg_cache[(slot, dt, cast)]

    offsets = ops.get("offsets")  # the loop's (`tick_loop._offsets`)

    def leaf(seg, h):
      return layout.leaf(seg, h, None if offsets is None else offsets[h.offset])

    def param(p):
      if p in layout.split:
        return layout.local_piece(ops["split"], p)
      h = layout.home[p]
      if p in layout.unpacked_pos:  # (and the model's own cast turns it back)
        return layout.unpacked_leaf(ops["leaves"], p).astype(h.dtype)
      if p in layout.cast:  # the model's own cast of this turns it back into the cast copy
        return leaf(segment(h.slot, h.dtype, True), h).astype(h.dtype)
      return leaf(segment(h.slot, h.dtype, False), h)

    return param

  def _branch(self, rank: int, tick_i: int, tasks: list[Task], gathered: bool, loc: dict):
    layout, model, info = self.layout, self.model, self.ticks[tick_i]
    keep_pos, keep_where = info.keep_positions, info.keep_where

    def run(ops):
      env: dict[tuple, jax.Array] = {}

      def read(key):
        if key not in env and (src := self.made_from(key)) is not None:
          env[key] = self.regroup(read(src), self.value_aval(key))
        if key in env:
          return env[key]
        return ops["arrays"][loc[(key, rank)]]

      param = self.param_reader(ops, gathered)

      def batch_mb(r, m):
        return [lax.dynamic_slice_in_dim(ops["batch"][i], m * self.mbs,
                                         self.mbs, 0)
                for i in model.regions[r].batch]

      grad_acc: dict[int, jax.Array] = {}
      loss = self.sums()
      for t in tasks:
        loss = loss + self.run_task(t.region, t.pass_, t.mb, read, param,
                                    batch_mb(t.region, t.mb), env, grad_acc)

      # Positions that hold nothing of this rank's (gradient positions of leaves it does
      # not own) take an array of the same shape this tick made and dropped anyway, such
      # as a residual F and B used within the tick: it is written once either way,
      # zeros would be an extra write. Nobody reads these positions.
      mine = {key for (rk, key) in keep_where if rk == rank}
      spare: dict[tuple, list] = {}
      taken = {id(env[key]) for key in mine}  # an array may sit under two keys
      for key, x in env.items():
        if id(x) not in taken:
          taken.add(id(x))
          spare.setdefault(signature(x), []).append(x)

      def filler(sig):
        return spare[sig].pop() if spare.get(sig) else zeros_of(sig)

      def fill(positions, where):
        out = [None] * len(positions)
        for (rk, key), pos in where.items():
          if rk == rank:
            out[pos] = env[key]
        return tuple(filler(sig) if x is None else x.astype(sig[1])
                     for x, sig in zip(out, positions))

      keep = fill(keep_pos, keep_where)
      grads = self.grads.tick_sums(rank, grad_acc, info.grads, ops["acc"], filler)
      if "after" in ops:  # ordering only (`order_collectives`); a non-finite loss stays so
        loss = loss + 0 * ops["after"]
      return keep, grads, loss

    return run
