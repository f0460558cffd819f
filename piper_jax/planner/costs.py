"""What a strategy costs, from one trace and its plan, without devices: `CostModel` turns
simulated work into seconds, `estimate` gives a strategy's step time and peak memory per
device (`MemoryEstimate`), which `strategies.search` ranks candidates by.

The model is traced once (`measure_model`); a plan's estimate (`estimate_plan`) is its
tick-by-tick simulation costed by FLOPs or measured region times, plus communication,
and its busiest device's parameters, gradients, optimizer state and live activations.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from piper_jax.ir.directives import Directive
from piper_jax.ir.pipeline import make_plan
from piper_jax.ir.plan import Plan
from piper_jax.lowering import (LoweringOptions, ParamLayout, RegionRunner, lowers_as_loop,
                                shared_analyses, trace_loss)
from piper_jax.planner.calibrate import RegionTimes
from piper_jax.planner.hardware import Accelerator, target_card

__all__ = ["CostModel", "MemoryEstimate", "Estimate", "estimate", "measure_model",
           "estimate_plan", "MeasuredModel", "format_bytes", "format_time", "JAX_GPU_POOL"]


@dataclasses.dataclass(frozen=True)
class CostModel:
  """How simulated work becomes seconds.

  Attributes:
    flops_per_s: sustained matmul FLOP/s of one device (a region's F costs its
      forward FLOPs, B twice that).
    link_bytes_per_s: bytes per second one device sends or receives, for data-parallel
      reductions and gathers and for pipeline activations.
    tick_overhead_s: fixed time per tick of the plan (each tick is one step of the
      lowered loop: a launch and a round of messages), which makes many small
      microbatches cost something.
    launch_overhead_s: fixed time per matmul a task launches from the host (with the
      fused kernels around it), in a loop over microbatches on one rank, which runs
      outside CUDA graphs: what makes many small microbatches slower than a few large
      ones. (A pipeline's ticks run as graphs, and a step of one microbatch has it in
      `flops_per_s`, a rate measured on such steps.)
    memory_bytes_per_s: bytes per second one device reads or writes its own memory.
      The optimizer's update is bound by it: every step reads each parameter, gradient
      and state byte a device updates and writes the parameters and state back, after
      its gradients are summed (what expert parallelism and ZeRO divide).
    region_times: measured seconds of each region's F and B (`pj.calibrate`), at
      each candidate's microbatch rows (interpolated between the rows timed); when
      given, tasks cost these instead of their FLOPs at `flops_per_s`, and the update
      its measured seconds per byte (when `pj.calibrate` was given the optimizer)
      instead of `memory_bytes_per_s`.
    card: the card planned for, when its GEMM figures are known
      (`Accelerator.gemm_efficiency`): each task costs its GEMMs one by one, by size,
      and fused attention's at its own rate, instead of all FLOPs at `flops_per_s`.
  """

  flops_per_s: float = 400e12
  link_bytes_per_s: float = 100e9
  tick_overhead_s: float = 20e-6
  launch_overhead_s: float = 11e-6
  memory_bytes_per_s: float = 3e12
  region_times: RegionTimes | None = None
  card: Accelerator | None = None

  @classmethod
  def for_accelerator(cls, card: "Accelerator | str", mfu: float = 0.55,
                      **fields) -> "CostModel":
    """The cost model of a card the planner knows (`ACCELERATORS`, or its name): matmuls
    at `mfu` of its dense bf16 peak (dense models of 1-8B parameters reach 0.55-0.57 on
    an H200 with cuDNN attention), its memory bandwidth and its links within a host,
    whatever machine plans; where the planner knows the card's GEMMs
    (`Accelerator.gemm_efficiency`), matmuls by size instead; `fields` set the others
    (`region_times`, ...)."""
    found = target_card(card)
    return cls(**{"flops_per_s": mfu * found.peak_flops,
                  "memory_bytes_per_s": found.memory_bytes_per_s,
                  "link_bytes_per_s": found.link_bytes_per_s,
                  "card": found if found.gemm_efficiency > 0 else None, **fields})

  def update_seconds(self, param_bytes: float, opt_ratio: float) -> float:
    """Seconds of the optimizer's update over `param_bytes` of parameters with
    `opt_ratio` bytes of state per parameter byte: measured per byte when the region
    times hold it, else its reads (parameters, gradients, state) and writes
    (parameters, state) at `memory_bytes_per_s`."""
    measured = self.region_times.update_s_per_byte if self.region_times else 0.0
    if measured > 0:
      return param_bytes * measured
    return param_bytes * (3 + 2 * opt_ratio) / self.memory_bytes_per_s


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Peak bytes on the busiest device of a candidate, by kind.

  Attributes:
    params, grads, optimizer: the device's parameters (with ZeRO-3's gathered
      weights), gradients and optimizer state.
    activations: what forward passes keep for their backward passes, at their peak.
    weight_copies: the weights cast once per step to the dtype the model reads them in
      (a pipeline keeps them for the whole step; ZeRO-1/2's distributed optimizer
      gathers them whole from the sharded fp32 parameters).
    working: what the largest backward recomputes, beyond what its forward kept, of
      the residuals remat dropped; in a loop over microbatches (a pipeline, accumulation,
      stages sharing a device), for the rank that computes the loss, also the cotangent
      of the loss region's largest value (the logits: in fp32 and again in the dtype
      they were made in), which its backward holds beside them.
    grads_with_activations: gradients live beside the activations (a pipeline or
      accumulation over microbatches); else a single backward frees activations as it
      makes gradients and the peak holds the larger of the two.
    fitted: for a step of one microbatch whose parts add up to more than the memory
      XLA compiles it for, but whose forwards could keep only what cannot be redone
      elementwise within it: XLA reorders and rematerializes the step into that memory
      (`XLA_FIT`), and the total is this. None otherwise.
  """

  params: int
  grads: int
  optimizer: int
  activations: int
  weight_copies: int = 0
  working: int = 0
  grads_with_activations: bool = True
  fitted: int | None = None

  @property
  def parts(self) -> int:
    """What the parts add up to, before XLA fits the step into its memory."""
    live = (self.grads + self.activations if self.grads_with_activations
            else max(self.grads, self.activations))
    return self.params + self.optimizer + self.weight_copies + self.working + live

  @property
  def total(self) -> int:
    return self.parts if self.fitted is None else min(self.parts, self.fitted)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """What one strategy is estimated to cost (`estimate`): seconds per step, its compute
  (with bubbles), communication and optimizer-update parts, the simulated bubble, and
  peak bytes per device."""

  step_time: float
  compute_time: float
  comm_time: float
  bubble_fraction: float
  memory: MemoryEstimate
  update_time: float = 0.0
  plan: Plan = dataclasses.field(default=None, repr=False, compare=False)

  def __str__(self) -> str:
    return "\n".join(_time_lines(self) + _memory_lines(self.memory))


def _time_lines(e: Estimate) -> list[str]:
  return [f"step time: {format_time(e.step_time)} per step (simulated)",
          f"  compute: {format_time(e.compute_time)} (bubble: {100 * e.bubble_fraction:.1f}% "
          f"of it idle)",
          f"  communication: {format_time(e.comm_time)} ({_comm_note(e)})",
          f"  optimizer update: {format_time(e.update_time)}"]


def _comm_note(e: Estimate) -> str:
  """How much of the communication the step waits for (the rest overlaps compute)."""
  waited = e.step_time - e.compute_time - e.update_time
  if waited <= 1e-6 * e.step_time:
    return "hidden behind compute"
  if waited >= e.comm_time * (1 - 1e-6):
    return "added to the step"
  return f"{format_time(waited)} of it added to the step, the rest hidden behind compute"


def _memory_lines(m: MemoryEstimate) -> list[str]:
  parts = [("parameters", m.params), ("gradients", m.grads), ("optimizer state", m.optimizer),
           ("activations", m.activations), ("weight copies", m.weight_copies),
           ("backward working set", m.working)]
  # One backward frees activations as it makes gradients: the peak holds the larger.
  larger = "" if m.grads_with_activations else ", counting the larger of gradients and activations"
  fitted = ("" if m.total == m.parts else
            f"; the parts add up to {format_bytes(m.parts)}, which XLA rematerializes to fit")
  return ([f"peak memory: {format_bytes(m.total)} per device (the busiest one{larger}{fitted})"]
          + [f"  {name}: {format_bytes(n)}" for name, n in parts if n])


def format_bytes(n: float) -> str:
  """Bytes in the largest binary unit that keeps one digit before the point."""
  for unit, size in (("GiB", (1 << 30)), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} B"


def format_time(s: float) -> str:
  """Seconds in s, ms or us, three significant figures."""
  # Rounded before the unit is chosen: 0.9999996 ms is "1 ms", not "1e+03 us".
  s = float(f"{s:.3g}")
  if s >= 1:
    return f"{s:.3g} s"
  if s >= 1e-3:
    return f"{s * 1e3:.3g} ms"
  return f"{s * 1e6:.3g} us"


# -- the model, measured once ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MeasuredModel:
  """What the estimates read from the one trace (all at `batch_size` rows)."""

  spec: Any                         # ModelSpec
  batch_size: int
  pp: tuple[int, ...]               # the model's PP indices, in order (empty: no pipeline)
  pp_flops: Mapping[int, float]     # PP index -> forward FLOPs of its regions
  opt_ratio: float                  # optimizer-state bytes per parameter byte
  copy_ratio: Mapping[int, float]   # leaf -> bytes of its cast copy per byte (leaves cast once a step)
  runner: RegionRunner = dataclasses.field(repr=False, compare=False)
  loss_cotangent: int = 0           # bytes a loss region's backward holds for its largest value
  ep_regions: frozenset[int] = frozenset()  # regions annotated "EP" (experts)
  n_experts: int = 0                # experts every EP region's leaves split over (their gcd)
  tp_size: int = 0                  # gcd of the dimensions named "tp" (0: none)
  casts: Mapping[int, str] = dataclasses.field(default_factory=dict)  # leaf -> dtype it is read in
  # remat -> region -> bytes kept from F for B, analysed on first use.
  _act_bytes: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def act_bytes(self, remat: bool) -> Mapping[int, int]:
    """Per region, the bytes its F keeps for B (residuals under `remat`, and its
    activation inputs, received from the region before or made on this device)."""
    if remat not in self._act_bytes:
      # Regions that trace alike (a model's equal blocks) share one analysis.
      ads = shared_analyses(self.runner, [r.index for r in self.spec.regions], remat)
      per = {}
      for r in self.spec.regions:
        stored = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize
                     for a in ads[r.index].stored_avals)
        per[r.index] = int(stored) + sum(x.spec.nbytes for x in r.inputs)
      self._act_bytes[remat] = per
    return self._act_bytes[remat]


def measure_model(loss_fn, optimizer, params, example_batch) -> MeasuredModel:
  """Traces the loss once and reads what every estimate of it needs."""
  traced = trace_loss(loss_fn, params, example_batch)
  spec = traced.spec
  pp_of = [dict(r.tags).get("PP") for r in spec.regions]
  pp = tuple(sorted({p for p in pp_of if p is not None})) if None not in pp_of else ()
  pp_flops = {p: sum(r.flops for r, q in zip(spec.regions, pp_of) if q == p) for p in pp}
  p_bytes = sum(p.nbytes for p in spec.params)
  opt = jax.eval_shape(optimizer.init, params)
  o_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                for x in jax.tree_util.tree_leaves(opt) if hasattr(x, "shape"))
  ep_regions = frozenset(r.index for r in spec.regions if "EP" in dict(r.tags))
  n_experts = math.gcd(*[spec.params[p].shape[0] for r in ep_regions
                         for p in spec.regions[r].params if spec.params[p].shape])
  tp_size = math.gcd(*[s.shape[d] for s in spec.params if s.names
                       for d, name in enumerate(s.names) if name == "tp"])
  casts = traced.param_casts()
  copy_ratio = {p: np.dtype(to).itemsize / np.dtype(spec.params[p].dtype).itemsize
                for p, to in casts.items()}
  return MeasuredModel(spec, spec.batch_size, pp, pp_flops, o_bytes / max(p_bytes, 1), copy_ratio,
                       RegionRunner(traced), _loss_cotangent(traced), ep_regions, n_experts,
                       tp_size, dict(casts))


def _loss_cotangent(traced) -> int:
  """Bytes of the cotangent the loss region's backward holds for its largest float value
  (a language model's logits, [rows, tokens, vocab]): summed in fp32 (the softmax's
  gather transposed into a scatter-add), and again in the narrower dtype the value was
  made in, if any (XLA's dumps of pipelines on GPUs show both live at the peak)."""
  best, itemsize = 0, 4
  for r, spec in zip(traced.regions, traced.spec.regions):
    if not spec.produces_loss:
      continue
    for eqn in r.eqns:
      for v in eqn.outvars:
        aval = getattr(v, "aval", None)
        if aval is None or not jnp.issubdtype(aval.dtype, jnp.floating):
          continue
        n = math.prod(aval.shape)
        if n > best or (n == best and aval.dtype.itemsize < itemsize):
          best, itemsize = n, aval.dtype.itemsize
  return best * (4 + (itemsize if itemsize < 4 else 0))


# -- estimates ---------------------------------------------------------------------

# XLA's GPU scheduler keeps a step within this fraction of the memory it compiles for
# (its default `xla_gpu_memory_limit_slop_factor`).
XLA_FIT = 0.95
# The fraction of a GPU's memory JAX's allocator takes, which XLA compiles for (unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise).
JAX_GPU_POOL = 0.75


def estimate_plan(model: MeasuredModel, plan: Plan, costs: CostModel, remat: bool,
                  options: LoweringOptions = LoweringOptions(),
                  memory_limit: float | None = None) -> Estimate:
  """The `Estimate` of a planned candidate: the simulated compute, then per pipeline
  rank its memory and its traffic; the busiest rank sets each. `memory_limit`: the
  bytes per device XLA compiles the step for (see `estimate`)."""
  spec, mesh = model.spec, plan.mesh
  rows = model.batch_size // (mesh.n_data * plan.n_microbatches)  # rows of one microbatch
  scale = rows / model.batch_size  # the trace holds the whole batch; costs scale with rows
  report, compute = _simulated_compute(model, plan, costs, rows, scale)
  act = model.act_bytes(remat)
  full = model.act_bytes(False) if remat else act
  looped = lowers_as_loop(plan)
  one_rank_loop = looped and mesh.n_pp == 1
  # A one-rank loop runs a microbatch's F and B as one chain in one branch, compiled
  # together: XLA's fusions redo elementwise values in the backward, and what stays is
  # remat's residuals (XLA's buffers of Qwen3-1.7B's accumulation on an H200 hold its
  # matmuls' bf16 outputs and none of their fp32 elementwise successors).
  chained = model.act_bytes(True) if one_rank_loop else act
  acts_of = [_peak_activations(plan, report, rank,
                               {r: int(chained[r] * scale) for r in plan.rank_regions(rank)})
             for rank in range(mesh.n_pp)]
  stored = _stored_regions(plan) if one_rank_loop else set()
  if stored:
    acts_of = [_store_bytes(plan, report, {r: int(act[r] * scale) for r in act}, stored,
                            {r: int(chained[r] * scale) for r in chained})]
  if looped:
    # One program for every rank: each device allocates the stores of the rank that
    # keeps the most.
    acts_of = [max(acts_of)] * mesh.n_pp
  # A pipeline's parameters are stacked over its ranks slot by slot, each slot as large
  # as its largest rank's part: every device holds that, not only its own rank's leaves
  # (interleaved 1F1B with the embedding on the first rank and the head on the last).
  stacked = _stacked_bytes(model, plan, options) if mesh.n_pp > 1 else None
  peak = MemoryEstimate(0, 0, 0, 0)
  comm = exposed = update = 0.0
  for rank in range(mesh.n_pp):
    mem, p_bytes, rank_update = _rank_memory(model, plan, rank, costs, options, stacked,
                                             acts_of[rank], act, full, remat, scale)
    if mem.total > peak.total:
      peak = mem
    update = max(update, rank_update)
    dp_bytes, sent = _rank_traffic(model, plan, rank, p_bytes, scale)
    comm = max(comm, (dp_bytes + sent) / costs.link_bytes_per_s)
    exposed = max(exposed, sent / costs.link_bytes_per_s)
  # Without a pipeline, XLA runs the data-parallel reductions and gathers beside the
  # compute that does not need them (the backward of later layers, the forward of
  # earlier ones): only communication beyond the compute's time shows, besides what
  # the regions wait for. A pipeline's loop reduces after its last tick and waits for
  # its messages each tick. The update follows the summed gradients.
  if memory_limit and not looped:
    peak = _fitted(model, plan, report, peak, memory_limit, scale)
  if mesh.n_pp > 1:
    step = compute + comm + update
  else:
    step = max(compute, comm - exposed) + exposed + update + _launch_seconds(model, plan, costs)
  return Estimate(step, compute, comm, report.bubble_fraction, peak, update, plan)


def _fitted(model: MeasuredModel, plan: Plan, report, peak: MemoryEstimate,
            memory_limit: float, scale: float) -> MemoryEstimate:
  """`peak` of a step of one microbatch, fitted by XLA into `memory_limit` where it is
  above it and the forwards' residuals that elementwise equations cannot redo fit: XLA
  compiles such a step whole, and its scheduler and rematerialization trade those
  recomputations for memory (Qwen3-1.7B at batch 16 on one H200: 94 GiB in JAX's
  default pool of 75% of the card, 112 GiB given 95%)."""
  bound = int(XLA_FIT * memory_limit)
  if peak.total <= bound:
    return peak
  least = model.act_bytes(True)
  floor = _peak_activations(plan, report, 0, {r: int(least[r] * scale) for r in least})
  if dataclasses.replace(peak, activations=floor).total > bound:
    return peak
  return dataclasses.replace(peak, fitted=bound)


def _launch_seconds(model: MeasuredModel, plan: Plan, costs: CostModel) -> float:
  """A one-rank loop's launches: each task's matmuls (a B's twice its F's) at
  `launch_overhead_s`; none for a step of one microbatch (in the rate) or a pipeline."""
  if plan.mesh.n_pp > 1 or plan.n_microbatches == 1:
    return 0.0
  weight = {"F": 1, "B": 2, "BI": 1, "BW": 1}
  regions = model.spec.regions
  return costs.launch_overhead_s * sum(regions[t.region].matmuls * weight[t.pass_.value]
                                       for t in plan.tasks.values() if t.pass_.value in weight)


def _simulated_compute(model: MeasuredModel, plan: Plan, costs: CostModel, rows: int,
                       scale: float) -> tuple[Any, float]:
  """The plan simulated (from measured region times, else FLOPs) and its compute seconds,
  a tick's overhead included."""
  if costs.region_times is not None:  # measured seconds per task
    report = plan.simulate(costs.region_times.costs(rows))
    return report, report.tick_makespan + costs.tick_overhead_s * len(plan.ticks)
  if costs.card is not None:
    report = plan.simulate(_gemm_costs(model, plan, costs.card, scale))
    return report, report.tick_makespan + costs.tick_overhead_s * len(plan.ticks)
  report = plan.simulate("flops")
  top = max([r.flops for r in model.spec.regions] + [0.0])
  unit = top * scale / costs.flops_per_s  # seconds per simulated unit (largest region's F)
  return report, report.tick_makespan * unit + costs.tick_overhead_s * len(plan.ticks)


def _gemm_costs(model: MeasuredModel, plan: Plan, card: Accelerator, scale: float) -> dict:
  """`Plan.simulate` costs of each region on `card`, GEMM by GEMM at a microbatch's
  `scale` of the traced batch: F its GEMMs, B twice them and those it recomputes, but
  attention's (a fused kernel's rate holds its backward's recomputed scores). An
  expert-parallel device runs fewer experts on more tokens each: the group's."""
  out = {"comm": 0.0}
  for r in model.spec.regions:
    ep = plan.mesh.size("ep") if plan.mesh.sharded.get(r.index) == "ep" else 1
    f = again = 0.0
    for g in r.gemms:
      t = card.gemm_seconds(dataclasses.replace(g.at(scale * ep), count=g.count // ep)
                            if ep > 1 and not g.attention else g.at(scale))
      f += t
      again += t if g.recomputed and not g.attention else 0.0
    out[(r.index, "F")], out[(r.index, "B")] = f, 2 * f + again
    out[(r.index, "BI")], out[(r.index, "BW")] = f + again, f
  return out


def _rank_memory(model: MeasuredModel, plan: Plan, rank: int, costs: CostModel,
                 options: LoweringOptions, stacked: int | None, acts: int, act, full,
                 remat: bool, scale: float) -> tuple[MemoryEstimate, float, float]:
  """A pipeline rank's peak memory per device, the bytes of parameters its gradients
  reduce over the data-parallel replicas, and its optimizer update's seconds."""
  spec, mesh = model.spec, plan.mesh
  n, m, zero = mesh.n_dp, plan.n_microbatches, mesh.zero
  pipelined = mesh.n_pp > 1
  regions = plan.rank_regions(rank)
  # Leaves split over an expert or tensor group: each device holds 1/group of them,
  # and ZeRO divides that piece over the group's copies (n / group devices).
  group = {p: mesh.size(mesh.sharded[r]) for r in regions if r in mesh.sharded
           for p in mesh.split_dims.get(r, {})}
  leaves = sorted({p for r in regions for p in spec.regions[r].params} - set(group))
  p_bytes = sum(spec.params[p].nbytes for p in leaves)
  pieces = [(spec.params[p].nbytes / g, n // g) for p, g in group.items()]
  piece_bytes = sum(b for b, _ in pieces)  # this device's pieces, whole over their copies
  by_zero = lambda stage: sum(b / (c if zero >= stage else 1) for b, c in pieces)
  # A leaf's bytes in the dtype the model reads it in (cast once a step).
  read = lambda p: spec.params[p].nbytes * model.copy_ratio.get(p, 1.0)
  region_read = [sum(read(p) for p in spec.regions[r].params if p not in group)
                 for r in regions]
  # ZeRO-3 gathers weights in the dtype they are read in: a pipeline's once, as the step
  # starts, kept for the step; without a pipeline one region at a time.
  # A pipeline's split pieces are gathered whole over their copies too.
  gathered = (sum(read(p) for p in leaves) + piece_bytes if pipelined
              else max(region_read, default=0)) if zero >= 3 else 0
  cast = int(sum(read(p) for p in leaves if p in model.copy_ratio))
  # ZeRO-1/2 with weights read in a narrower dtype keep the fp32 parameters sharded
  # and gather the narrow copy as the step starts (the distributed optimizer); below
  # ZeRO-3 a pipeline also casts its weights once a step and keeps the copies.
  masters = (options.shard_masters and options.cast_weights and zero in (1, 2) and n > 1
             and cast > 0)
  # A loop over microbatches (a pipeline, or accumulation on one rank) casts its weights
  # once a step and keeps the copies; below ZeRO-3 that is the whole rank's.
  copies = cast if masters or ((pipelined or m > 1) and zero < 3) else 0
  held = p_bytes if stacked is None else stacked  # parameters and optimizer state
  params = int(held / (n if zero >= 3 or masters else 1) + by_zero(3) + gathered)
  # A pipeline sums a stage's gradients whole over its microbatches, at any ZeRO stage,
  # and reduce-scatters them once; split pieces' sums are whole until the step ends.
  grads = int(p_bytes / (n if zero >= 2 and not pipelined else 1) + piece_bytes)
  updated = held / (n if zero >= 1 else 1) + by_zero(1)  # parameter bytes it updates
  opt = int(updated * model.opt_ratio)
  update = costs.update_seconds(updated, model.opt_ratio)
  p_bytes += sum(b for b, c in pieces if c > 1)  # split pieces with copies reduce too
  # A backward under remat first recomputes what its forward dropped.
  working = max((int((full[r] - act[r]) * scale) for r in regions), default=0) if remat else 0
  if (pipelined or m > 1) and any(spec.regions[r].produces_loss for r in regions):
    working += int(model.loss_cotangent * scale)
  mem = MemoryEstimate(params, grads, opt, acts, copies, working,
                       grads_with_activations=pipelined or m > 1)
  return mem, p_bytes, update


def _rank_traffic(model: MeasuredModel, plan: Plan, rank: int, p_bytes: float,
                  scale: float) -> tuple[float, float]:
  """Bytes a device of pipeline `rank` moves per step: (data-parallel reductions and
  gathers, what its computations wait for: expert, tensor and pipeline messages)."""
  spec, mesh = model.spec, plan.mesh
  n, m, zero = mesh.n_dp, plan.n_microbatches, mesh.zero
  f = (n - 1) / n
  regions = plan.rank_regions(rank)
  ep, tp = mesh.size("ep"), mesh.size("tp")
  # Data-parallel traffic per device: ZeRO 0/1 and pipelines reduce once a step and
  # gather the update (ZeRO-3: the weights, once a step); ZeRO 2/3 without a pipeline
  # reduce-scatter per microbatch, and ZeRO-3 gathers weights before each F and B.
  if zero <= 1 or mesh.n_pp > 1:
    dp_bytes = 2 * f * p_bytes
  elif zero == 2:
    dp_bytes = f * p_bytes * (m + 1)
  else:
    dp_bytes = f * p_bytes * 3 * m
  # Expert parallel: each EP region's tokens go to their experts' devices and back,
  # in F and again in B, every microbatch. These and tensor parallelism's reductions
  # sit between a region's computations, which wait for them.
  sent = sum(4 * (ep - 1) / ep * x.spec.nbytes * scale * m
             for r in regions if mesh.sharded.get(r) == "ep"
             for x in spec.regions[r].inputs)
  # Tensor parallel: each row-parallel weight (split on the dimension it contracts)
  # has its output all-reduced over the group in F, and its input's cotangent in B.
  tokens = _tokens(spec) * scale  # tokens of one microbatch on one device's rows
  act_item = _act_itemsize(spec)
  sent += sum(2 * 2 * (tp - 1) / tp * tokens * spec.params[p].shape[-1] * act_item
              * m for r in regions if mesh.sharded.get(r) == "tp"
              for p, d in mesh.split_dims.get(r, {}).items()
              if d == 0 and len(spec.params[p].shape) == 2)
  # Pipeline traffic: each activation crossing ranks goes forward, its cotangent back.
  for r in spec.regions:
    for x in r.inputs:
      a, b = mesh.region_rank[x.region], mesh.region_rank[r.index]
      if a != b and rank in (a, b):
        sent += x.spec.nbytes * scale * m
  return dp_bytes, sent


def _stacked_bytes(model: MeasuredModel, plan: Plan, options: LoweringOptions) -> int:
  """Bytes per device of the parameters' stacked slots, whole (before ZeRO shards them),
  as `ParamLayout` lays them out; leaves split over expert or tensor groups aside."""
  shapes = ParamLayout(model.spec, plan, model.casts, options).shapes()
  nbytes = lambda s: math.prod(s.shape) * np.dtype(s.dtype).itemsize
  # A slot is [ranks, replicas, chunk] (or, spread, [devices, share]): one rank's part per
  # device; the shared segment, [replicas, chunk], is on every device.
  return int(sum(nbytes(s) // s.shape[0] for slots in shapes.slots.values() for s in slots)
             + sum(nbytes(s) for s in shapes.shared.values()))


def _tokens(spec) -> int:
  """Tokens of the traced batch: the elements of its first batch leaf (rows x sequence)."""
  return math.prod(spec.batch[0].shape) if spec.batch else spec.batch_size


def _act_itemsize(spec) -> int:
  """Bytes per element of the activations between regions (4 when there are none)."""
  acts = [x.spec for r in spec.regions for x in r.inputs]
  return np.dtype(acts[0].dtype).itemsize if acts else 4


def _stored_regions(plan: Plan) -> set[int]:
  """On one rank: the regions whose residuals the loop keeps in its stores, those whose
  F and backward of a microbatch are not one chain of that microbatch's tasks in one
  tick (stages sharing the device); a chain's residuals stay inside its branch."""
  stored = set()
  for tick in plan.ticks:
    tasks = tick[0]
    for i, t in enumerate(tasks):
      if t.pass_.value != "F":
        continue
      j = next((j for j in range(i + 1, len(tasks)) if tasks[j].region == t.region
                and tasks[j].mb == t.mb), None)
      if j is None or any(u.mb != t.mb for u in tasks[i:j]):
        stored.add(t.region)
  return stored


def _store_bytes(plan: Plan, report, nbytes: Mapping[int, int], stored: set[int],
                 chained: Mapping[int, int] | None = None) -> int:
  """A one-rank loop's activations when the residuals of regions `stored`
  (`_stored_regions`) live in its stores: those stores whole for the step (a row per
  microbatch the schedule keeps alive, and a scratch row), and beside them the largest
  residuals a chain keeps in its branch (`chained`, default `nbytes`)."""
  chained = nbytes if chained is None else chained
  rows = sum(_peak_activations(plan, report, 0, {q: nbytes[q] if q == r else 0 for q in nbytes})
             + nbytes[r] for r in stored)
  return int(rows + max((chained[r] for r in chained if r not in stored), default=0))


def _peak_activations(plan: Plan, report, rank: int, nbytes: Mapping[int, int]) -> int:
  """The most bytes of (region, microbatch) activations alive at once on `rank`: from
  the end of a region's F until the end of its last backward pass, in the simulation."""
  end = report.end
  events = []
  last: dict[tuple[int, int], float] = {}
  for t in plan.tasks.values():
    if t.rank != rank or t.pass_.value == "F":
      continue
    key = (t.region, t.mb)
    last[key] = max(last.get(key, 0.0), end[t.label])
  for t in plan.tasks.values():
    if t.rank == rank and t.pass_.value == "F":
      events.append((end[t.label], 1, nbytes[t.region]))
      events.append((last.get((t.region, t.mb), end[t.label]), -1, nbytes[t.region]))
  live = best = 0
  for _, d, b in sorted(events, key=lambda e: (e[0], e[1])):
    live += d * b
    best = max(best, live)
  return best


# -- the public estimate ------------------------------------------------------------

def estimate(loss_fn: Callable, optimizer: optax.GradientTransformation, params: Any,
             example_batch: Any, directives: Sequence[Directive], n_devices: int, *,
             costs: CostModel | None = None, remat: bool | None = None,
             options: LoweringOptions | None = None,
             memory_limit: float | None = None) -> Estimate:
  """The step time and peak memory per device `search` would estimate for `directives`
  (see `search` for what they count), without devices. `options` are the
  `pj.compile` options the step would be lowered with. `memory_limit`: the bytes per
  device XLA compiles the step for (JAX's pool, `JAX_GPU_POOL` of a GPU's memory unless
  `XLA_PYTHON_CLIENT_MEM_FRACTION` says otherwise); XLA fits a step of one microbatch
  that would need more into it, where it can. None: as much as it needs.

  Raises:
    ValueError: for directives that do not plan.
  """
  model = measure_model(loss_fn, optimizer, params, example_batch)
  options = LoweringOptions.checked(options)
  plan = make_plan(model.spec, list(directives), n_devices, global_batch=model.batch_size)
  if remat is not None:
    options = dataclasses.replace(options, remat=remat)
  options = options.resolved(plan.mesh.n_pp, "gpu")
  return estimate_plan(model, plan, costs or CostModel(), options.remat, options, memory_limit)
