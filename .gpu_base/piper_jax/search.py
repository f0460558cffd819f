"""`search`: enumerates the strategies a model's annotations allow, plans and simulates
each without devices, estimates its peak memory per device, and ranks those that fit.

The model is traced once; every candidate is planned from that trace (`make_plan`
with the candidate's directives), simulated with the regions' matmul FLOPs from the
jaxpr (`Plan.simulate("flops")`), and costed with a `CostModel`. See `search` for what
the time and memory estimates count and leave out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import optax

from piper_jax.calibrate import RegionTimes
from piper_jax.compile import compile as compile_step
from piper_jax.ir.directives import (Directive, Order, order, place, replicate, shard,
                                     shard_tensor, split)
from piper_jax.ir.pipeline import make_plan
from piper_jax.ir.plan import Plan
from piper_jax.lowering.local import RegionRunner
from piper_jax.lowering.options import LoweringOptions
from piper_jax.lowering.program import lowers_as_loop
from piper_jax.lowering.regions import analyze_region
from piper_jax.lowering.trace import trace_loss

__all__ = ["CostModel", "MemoryEstimate", "Estimate", "Candidate", "Rejected", "SearchResult",
           "search", "estimate", "PIPELINE_SCHEDULES"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")
# "dp" is data parallelism alone (no pipeline); the others are pipeline schedules.
ALL_SCHEDULES = ("dp",) + PIPELINE_SCHEDULES
# Schedules whose stages may each hold several consecutive PP regions (the others
# place a fixed pattern of single regions on each rank).
_GROUPABLE = ("gpipe", "1f1b", "zb")
_GIB = 1 << 30


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
    region_times: measured seconds of each region's F and B (`pj.calibrate`), scaled
      to each candidate's microbatch rows; when given, tasks cost these instead of
      their FLOPs at `flops_per_s`.
  """

  flops_per_s: float = 400e12
  link_bytes_per_s: float = 100e9
  tick_overhead_s: float = 20e-6
  region_times: RegionTimes | None = None


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
      the residuals remat dropped.
    grads_with_activations: gradients live beside the activations (a pipeline or
      accumulation over microbatches); else a single backward frees activations as it
      makes gradients and the peak holds the larger of the two.
  """

  params: int
  grads: int
  optimizer: int
  activations: int
  weight_copies: int = 0
  working: int = 0
  grads_with_activations: bool = True

  @property
  def total(self) -> int:
    live = (self.grads + self.activations if self.grads_with_activations
            else max(self.grads, self.activations))
    return self.params + self.optimizer + self.weight_copies + self.working + live


@dataclasses.dataclass(frozen=True)
class Estimate:
  """What one strategy is estimated to cost (`estimate`): seconds per step, its compute
  (with bubbles) and communication parts, the simulated bubble, and peak bytes per device."""

  step_time: float
  compute_time: float
  comm_time: float
  bubble_fraction: float
  memory: MemoryEstimate
  plan: Plan = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate(Estimate):
  """A strategy that fits, with its estimates (`Estimate`'s fields: step_time,
  compute_time, comm_time, bubble_fraction, memory and the plan simulated, from the one
  trace at the example batch's size).

  Attributes:
    name: e.g. "1f1b pp2 x dp4 zero1" or "dp8 zero3".
    directives: the directive list for `pj.compile`.
    schedule: "dp" (no pipeline) or a pipeline schedule.
    n_ranks, dp, zero: pipeline ranks, data-parallel replicas per rank, ZeRO stage.
    stages: per pipeline stage, the PP region indices it holds (empty without a pipeline).
    n_microbatches: microbatches per step.
  """

  name: str
  directives: list
  schedule: str
  n_ranks: int
  dp: int
  zero: int
  stages: tuple[tuple[int, ...], ...]
  n_microbatches: int

  @property
  def peak_memory(self) -> int:
    return self.memory.total


@dataclasses.dataclass(frozen=True)
class Rejected:
  """A strategy left out, and why (over the memory bound, or not plannable)."""

  name: str
  directives: list
  n_microbatches: int
  reason: str
  peak_memory: int | None = None


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """Candidates that fit `memory_per_device`, fastest first, and those rejected."""

  best: Candidate
  candidates: tuple[Candidate, ...]
  rejected: tuple[Rejected, ...]
  memory_per_device: float
  top: int = 10

  def table(self, top: int | None = None) -> str:
    """A markdown table of the `top` fastest candidates (default: the search's `top`)."""
    rows = ["| strategy | microbatches | simulated step | bubble | peak memory |",
            "| --- | --- | --- | --- | --- |"]
    for c in self.candidates[:self.top if top is None else top]:
      rows.append(f"| {c.name} | {c.n_microbatches} | {_fmt_time(c.step_time)} | "
                  f"{100 * c.bubble_fraction:.1f}% | {format_bytes(c.peak_memory)} |")
    return "\n".join(rows)

  def timelines(self, folder: str, top: int = 3, fmt: str = "svg") -> list[str]:
    """Draws the plan of each of the `top` fastest candidates as a per-device timeline
    (`Plan.timeline`, tasks sized by their FLOPs) into `folder`; returns the paths."""
    import os
    import re
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k, c in enumerate(self.candidates[:top]):
      slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{c.name} mb{c.n_microbatches}").strip("_")
      paths.append(os.path.join(folder, f"{k + 1}_{slug}.{fmt}"))
      c.plan.timeline(paths[-1], costs="flops")
    return paths

  def compile_best(self, loss_fn: Callable, optimizer: optax.GradientTransformation,
                   params: Any, example_batch: Any, devices: Sequence[Any] | None = None,
                   tries: int = 3, fraction: float = 0.95, **compile_kwargs):
    """Compiles the fastest candidates in turn and returns the first, with its
    `TrainStep`, whose compiled program fits: XLA's own memory analysis of it
    (`TrainStep.memory`) within `fraction` of `memory_per_device`.

    The search ranks by estimates; XLA's count of the compiled step also holds its
    temporaries and copies, which the estimates leave out. Each try compiles once (the
    step returned runs that program).

    Raises:
      ValueError: when none of the first `tries` candidates fits, naming each one's bytes.
    """
    devices = list(jax.devices() if devices is None else devices)
    bound = fraction * self.memory_per_device
    tried = []
    for c in self.candidates[:tries]:
      step = compile_step(loss_fn, optimizer, c.directives, params, example_batch,
                          devices=devices[:c.n_ranks * c.dp], **compile_kwargs)
      need = step.memory().total
      if need <= bound:
        return c, step
      tried.append(f"{c.name} ({c.n_microbatches} microbatches): {format_bytes(need)}, "
                   f"estimated {format_bytes(c.peak_memory)}")
    raise ValueError(f"none of the {len(tried)} fastest strategies compiles within "
                     f"{format_bytes(bound)} per device ({100 * fraction:.0f}% of "
                     f"{format_bytes(self.memory_per_device)}) by XLA's count: "
                     + "; ".join(tried) + ". Try more `tries`, a smaller batch, or more devices.")

  def __str__(self) -> str:
    return (f"{len(self.candidates)} strategies fit {format_bytes(self.memory_per_device)} per "
            f"device ({len(self.rejected)} rejected); best: {self.best.name}, "
            f"{self.best.n_microbatches} microbatches\n{self.table()}")


def format_bytes(n: float) -> str:
  """Bytes in the largest binary unit that keeps one digit before the point."""
  for unit, size in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} B"


def _fmt_time(s: float) -> str:
  if s >= 1:
    return f"{s:.3g} s"
  if s >= 1e-3:
    return f"{s * 1e3:.3g} ms"
  return f"{s * 1e6:.3g} us"


# -- the model, measured once ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Model:
  """What the estimates read from the one trace (all at `batch_size` rows)."""

  spec: Any                         # ModelSpec
  batch_size: int
  pp: tuple[int, ...]               # the model's PP indices, in order (empty: no pipeline)
  pp_flops: Mapping[int, float]     # PP index -> forward FLOPs of its regions
  opt_ratio: float                  # optimizer-state bytes per parameter byte
  copy_ratio: Mapping[int, float]   # leaf -> bytes of its cast copy per byte (leaves cast once a step)
  runner: RegionRunner = dataclasses.field(repr=False, compare=False)
  ep_regions: frozenset[int] = frozenset()  # regions annotated "EP" (experts)
  n_experts: int = 0                # experts every EP region's leaves split over (their gcd)
  tp_size: int = 0                  # gcd of the dimensions named "tp" (0: none)
  # remat -> region -> bytes kept from F for B, analysed on first use.
  _act_bytes: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def act_bytes(self, remat: bool) -> Mapping[int, int]:
    """Per region, the bytes its F keeps for B (residuals under `remat`, and its
    activation inputs, received from the region before or made on this device)."""
    if remat not in self._act_bytes:
      per = {}
      for r in self.spec.regions:
        ad = analyze_region(self.runner, r.index, remat)
        stored = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in ad.stored_avals)
        per[r.index] = int(stored) + sum(x.spec.nbytes for x in r.inputs)
      self._act_bytes[remat] = per
    return self._act_bytes[remat]


def _measure(loss_fn, optimizer, params, example_batch) -> _Model:
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
  copy_ratio = {p: np.dtype(to).itemsize / np.dtype(spec.params[p].dtype).itemsize
                for p, to in traced.param_casts().items()}
  return _Model(spec, spec.batch_size, pp, pp_flops, o_bytes / max(p_bytes, 1), copy_ratio,
                RegionRunner(traced), ep_regions, n_experts, tp_size)


# -- candidate directives ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Layout:
  """The shape of one candidate before it is planned."""

  schedule: str
  n_ranks: int
  dp: int
  zero: int
  n_microbatches: int
  stages: tuple[tuple[int, ...], ...]
  n_virtual: int = 1
  ep: bool = False  # experts split over each stage's data-parallel devices
  tp: int = 1       # tensor-parallel group size within each stage's devices

  @property
  def name(self) -> str:
    ep = (f" ep{self.dp}" if self.ep else "") + (f" tp{self.tp}" if self.tp > 1 else "")
    if self.schedule == "dp":
      return f"dp{self.dp} zero{self.zero}{ep}"
    pp = f"pp{self.n_ranks}"
    if self.n_virtual > 1:
      pp += f" v{self.n_virtual}"
    if any(len(s) > 1 for s in self.stages) and self.n_virtual == 1:
      pp += " [" + " | ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else f"{s[0]}"
                              for s in self.stages) + "]"
    dp = f" x dp{self.dp} zero{self.zero}" if self.dp > 1 else ""
    return f"{self.schedule} {pp}{dp}{ep}"


def _directives(lay: _Layout, reduce_dtype: str | None, bucket_mb: float | None) -> list[Directive]:
  out = _placement(lay, reduce_dtype, bucket_mb)
  if lay.ep:  # each expert region's experts split over its stage's data-parallel devices
    out.append(shard({"EP": "*"}, list(range(lay.n_ranks * lay.dp))))
  if lay.tp > 1:  # the first `tp` devices of each rank: one group, the others repeat it
    out.append(shard_tensor({}, [r * lay.n_ranks + k for k in range(lay.n_ranks)
                                 for r in range(lay.tp)]))
  return out


def _placement(lay: _Layout, reduce_dtype: str | None, bucket_mb: float | None) -> list[Directive]:
  if lay.schedule == "dp":
    out = [replicate({}, list(range(lay.dp)), zero=lay.zero,
                     bucket_mb=bucket_mb if lay.zero == 0 else None, reduce_dtype=reduce_dtype)]
    if lay.dp == 1:
      out = [place({}, [0])]
    return out + ([split(lay.n_microbatches)] if lay.n_microbatches > 1 else [])
  from piper_jax import strategies
  n_stages = len(lay.stages)
  if all(len(s) == 1 for s in lay.stages) or lay.n_virtual > 1:
    return strategies.pipeline(n_stages, lay.n_microbatches, lay.schedule, dp=lay.dp,
                               zero=lay.zero, n_virtual=max(lay.n_virtual, 2),
                               reduce_dtype=reduce_dtype)
  # Several consecutive PP regions per rank: place each on its rank's devices, and
  # run the schedule's stage orders with every filter of stage k widened to a group
  # of its regions (forward in order, backward reversed; the data edges order them).
  base = strategies.pipeline(n_stages, lay.n_microbatches, lay.schedule)
  out: list[Directive] = [split(lay.n_microbatches)]
  for k, regions in enumerate(lay.stages):
    devices = [r * lay.n_ranks + k for r in range(lay.dp)]
    for s in regions:
      out.append(place({"PP": s}, devices) if lay.dp == 1 else
                 replicate({"PP": s}, devices, zero=lay.zero, reduce_dtype=reduce_dtype))
  for d in base:
    if isinstance(d, Order):
      out.append(order([[x for f in g for x in _widen(f, lay.stages)] for g in d.groups]))
  return out


def _widen(f, stages) -> list[dict]:
  """One stage's filter as the filters of its regions (backward passes last to first)."""
  f = dict(f)
  regions = stages[f["PP"]]
  if f.get("PASS", "F") != "F":
    regions = regions[::-1]
  return [dict(f, PP=s) for s in regions]


def _balanced_groups(flops: Sequence[float], n: int) -> tuple[tuple[int, ...], ...]:
  """Positions 0..len(flops)-1 cut into `n` contiguous groups with the smallest largest
  sum (the slowest stage sets a pipeline's pace); earlier cuts on ties."""
  k = len(flops)
  prefix = [0.0]
  for x in flops:
    prefix.append(prefix[-1] + x)
  # best[j][i]: smallest largest group of the first i positions in j groups.
  inf = float("inf")
  best = [[inf] * (k + 1) for _ in range(n + 1)]
  cut = [[0] * (k + 1) for _ in range(n + 1)]
  best[0][0] = 0.0
  for j in range(1, n + 1):
    for i in range(j, k + 1):
      for c in range(j - 1, i):
        v = max(best[j - 1][c], prefix[i] - prefix[c])
        if v < best[j][i] - 1e-9 * max(abs(v), 1.0):
          best[j][i], cut[j][i] = v, c
  groups, i = [], k
  for j in range(n, 0, -1):
    c = cut[j][i]
    groups.append(tuple(range(c, i)))
    i = c
  return tuple(reversed(groups))


def _microbatch_counts(per_replica: int, low: int, given: Sequence[int] | None,
                       most: int) -> list[int]:
  """Microbatch counts that divide the per-replica batch: `given`, or powers of two
  from `low` (rounded up to one) to `most`."""
  if given is not None:
    return sorted({m for m in given if m >= 1 and per_replica % m == 0})
  out, m = [], 1
  while m <= min(per_replica, most):
    if m >= low and per_replica % m == 0:
      out.append(m)
    m *= 2
  return out


def _layouts(model: _Model, n_devices: int, schedules: Sequence[str], zero_stages: Sequence[int],
             microbatches: Sequence[int] | None, virtual_stages: Sequence[int],
             group_regions: bool, max_microbatches: int | None,
             expert_parallel: bool | None = None,
             tensor_parallel: bool | None = None) -> list[_Layout]:
  batch = model.batch_size
  out: list[_Layout] = []
  zeros = lambda dp: sorted(set(zero_stages)) if dp > 1 else [0]
  if "dp" in schedules and batch % n_devices == 0:
    per = batch // n_devices
    for zero in zeros(n_devices):
      for m in _microbatch_counts(per, 1, microbatches, max_microbatches or 8):
        out.append(_Layout("dp", 1, n_devices, zero, m, ()))
  pp = model.pp
  for schedule in schedules:
    if schedule == "dp":
      continue
    shapes: list[tuple[int, tuple, int]] = []  # (n_ranks, stages, n_virtual)
    if schedule in _GROUPABLE:
      for n_ranks in range(2, len(pp) + 1):
        if n_ranks < len(pp) and not group_regions:
          continue
        flops = [model.pp_flops[p] for p in pp]
        groups = _balanced_groups(flops, n_ranks)
        shapes.append((n_ranks, tuple(tuple(pp[i] for i in g) for g in groups), 1))
    elif schedule == "interleaved":
      for v in virtual_stages:
        if v >= 2 and len(pp) % v == 0 and len(pp) // v >= 2:
          shapes.append((len(pp) // v, tuple((p,) for p in pp), v))
    elif schedule == "dualpipev" and len(pp) % 2 == 0 and len(pp) >= 2:
      shapes.append((len(pp) // 2, tuple((p,) for p in pp), 2))
    for n_ranks, stages, v in shapes:
      if n_devices % n_ranks:
        continue
      dp = n_devices // n_ranks
      if batch % dp:
        continue
      per = batch // dp
      low = 2 * n_ranks if schedule == "dualpipev" else n_ranks
      for m in _microbatch_counts(per, low, microbatches, max_microbatches or max(8, 4 * n_ranks)):
        if schedule == "interleaved" and m % n_ranks:
          continue
        if schedule == "dualpipev" and m < 2 * n_ranks:
          continue
        for zero in zeros(dp):
          out.append(_Layout(schedule, n_ranks, dp, zero, m, stages, v if v > 1 else 1))
  if model.ep_regions and expert_parallel is not False:
    # Expert parallel: the experts of each EP region split over its stage's
    # data-parallel devices, where they divide evenly.
    ep = [dataclasses.replace(lay, ep=True) for lay in out
          if lay.dp > 1 and model.n_experts and model.n_experts % lay.dp == 0]
    out = ep if expert_parallel else out + ep
  if model.tp_size and tensor_parallel is not False:
    # Tensor parallel: groups of 2, 4, ... of each stage's devices split the weights
    # named "tp" (where those dimensions divide), sharing their batch rows.
    tp = [dataclasses.replace(lay, tp=t) for lay in out if not lay.ep
          for t in (2, 4, 8) if lay.dp % t == 0 and model.tp_size % t == 0]
    out = tp if tensor_parallel else out + tp
  return out


# -- estimates ---------------------------------------------------------------------

def _estimate(model: _Model, plan: Plan, costs: CostModel, remat: bool,
              options: LoweringOptions = LoweringOptions()):
  """(step_time, compute_time, comm_time, bubble, MemoryEstimate) of a planned candidate."""
  spec, mesh = model.spec, plan.mesh
  rows = model.batch_size // (mesh.n_data * plan.n_microbatches)  # rows of one microbatch
  scale = rows / model.batch_size  # the trace holds the whole batch; costs scale with rows
  if costs.region_times is not None:  # measured seconds per task
    report = plan.simulate(costs.region_times.costs(rows))
    compute = report.tick_makespan + costs.tick_overhead_s * len(plan.ticks)
  else:
    report = plan.simulate("flops")
    top = max([r.flops for r in spec.regions] + [0.0])
    unit = top * scale / costs.flops_per_s  # seconds per simulated unit (largest region's F)
    compute = report.tick_makespan * unit + costs.tick_overhead_s * len(plan.ticks)
  n, m, zero = mesh.n_dp, plan.n_microbatches, mesh.zero
  f = (n - 1) / n
  act = model.act_bytes(remat)
  full = model.act_bytes(False) if remat else act
  peak = MemoryEstimate(0, 0, 0, 0)
  comm = 0.0
  pipelined = mesh.n_pp > 1
  ep, tp = mesh.size("ep"), mesh.size("tp")
  tokens = _tokens(spec) * scale  # tokens of one microbatch on one device's rows
  act_item = _act_itemsize(spec)
  acts_of = [_peak_activations(plan, report, rank,
                               {r: int(act[r] * scale) for r in plan.rank_regions(rank)})
             for rank in range(mesh.n_pp)]
  if lowers_as_loop(plan, options):
    # One program for every rank: each device allocates the stores of the rank that
    # keeps the most.
    acts_of = [max(acts_of)] * mesh.n_pp
  for rank in range(mesh.n_pp):
    regions = plan.rank_regions(rank)
    # Leaves split over an expert or tensor group: each device holds 1/group of them,
    # and ZeRO divides that piece over the group's copies (n / group devices).
    group = {p: mesh.size(mesh.sharded[r]) for r in regions if r in mesh.sharded
             for p in mesh.split_dims.get(r, {})}
    leaves = sorted({p for r in regions for p in spec.regions[r].params} - set(group))
    p_bytes = sum(spec.params[p].nbytes for p in leaves)
    pieces = [(spec.params[p].nbytes / g, n // g) for p, g in group.items()]
    by_zero = lambda stage: sum(b / (c if zero >= stage else 1) for b, c in pieces)
    # A leaf's bytes in the dtype the model reads it in (cast once a step).
    read = lambda p: spec.params[p].nbytes * model.copy_ratio.get(p, 1.0)
    region_read = [sum(read(p) for p in spec.regions[r].params if p not in group)
                   for r in regions]
    # ZeRO-3 gathers weights in the dtype they are read in and keeps a pipeline stage's
    # gathered between its microbatches; without a pipeline it gathers one region at a time.
    gathered = (sum(read(p) for p in leaves) if pipelined else max(region_read, default=0)
                ) if zero >= 3 else 0
    cast = int(sum(read(p) for p in leaves if p in model.copy_ratio))
    # ZeRO-1/2 with weights read in a narrower dtype keep the fp32 parameters sharded
    # and gather the narrow copy as the step starts (the distributed optimizer); below
    # ZeRO-3 a pipeline also casts its weights once a step and keeps the copies.
    masters = (options.shard_masters and options.cast_weights and zero in (1, 2) and n > 1
               and cast > 0)
    copies = cast if masters or (pipelined and zero < 3) else 0
    params = int(p_bytes / (n if zero >= 3 or masters else 1) + by_zero(3) + gathered)
    grads = int(p_bytes / (n if zero >= 2 else 1) + by_zero(2))
    opt = int((p_bytes / (n if zero >= 1 else 1) + by_zero(1)) * model.opt_ratio)
    p_bytes += sum(b for b, c in pieces if c > 1)  # split pieces with copies reduce too
    acts = acts_of[rank]
    # A backward under remat first recomputes what its forward dropped.
    working = max((int((full[r] - act[r]) * scale) for r in regions), default=0) if remat else 0
    mem = MemoryEstimate(params, grads, opt, acts, copies, working,
                         grads_with_activations=pipelined or m > 1)
    if mem.total > peak.total:
      peak = mem
    # Data-parallel traffic per device: ZeRO 0/1 reduce once a step and (ZeRO-1) gather
    # the update; ZeRO 2/3 reduce-scatter per microbatch; ZeRO-3 gathers weights before
    # each F and B (a pipeline stage: once a step).
    if zero <= 1:
      dp_bytes = 2 * f * p_bytes
    elif zero == 2:
      dp_bytes = f * p_bytes * (m + 1)
    else:
      dp_bytes = f * p_bytes * (m + (1 if pipelined else 2 * m))
    # Expert parallel: each EP region's tokens go to their experts' devices and back,
    # in F and again in B, every microbatch.
    sent = sum(4 * (ep - 1) / ep * x.spec.nbytes * scale * m
               for r in regions if mesh.sharded.get(r) == "ep"
               for x in spec.regions[r].inputs)
    # Tensor parallel: each row-parallel weight (split on the dimension it contracts)
    # has its output all-reduced over the group in F, and its input's cotangent in B.
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
    comm = max(comm, (dp_bytes + sent) / costs.link_bytes_per_s)
  # Without a pipeline, XLA runs the data-parallel reductions and gathers beside the
  # compute that does not need them (the backward of later layers, the forward of
  # earlier ones): only communication beyond the compute's time shows. A pipeline's
  # loop reduces after its last tick and waits for its messages each tick.
  step = compute + comm if pipelined else max(compute, comm)
  return step, compute, comm, report.bubble_fraction, peak


def _tokens(spec) -> int:
  """Tokens of the traced batch: the elements of its first batch leaf (rows x sequence)."""
  return math.prod(spec.batch[0].shape) if spec.batch else spec.batch_size


def _act_itemsize(spec) -> int:
  """Bytes per element of the activations between regions (4 when there are none)."""
  acts = [x.spec for r in spec.regions for x in r.inputs]
  return np.dtype(acts[0].dtype).itemsize if acts else 4


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


# -- the search --------------------------------------------------------------------

def estimate(loss_fn: Callable, optimizer: optax.GradientTransformation, params: Any,
             example_batch: Any, directives: Sequence[Directive], n_devices: int, *,
             costs: CostModel | None = None, remat: bool | None = None,
             options: LoweringOptions | None = None) -> Estimate:
  """The step time and peak memory per device `search` would estimate for `directives`
  (see `search` for what they count), without devices. `options` are the
  `pj.compile` options the step would be lowered with (they choose between one loop
  over the ticks, whose devices all hold the stores of the rank that keeps the most,
  and the per-tick program).

  Raises:
    ValueError: for directives that do not plan.
  """
  model = _measure(loss_fn, optimizer, params, example_batch)
  plan = make_plan(model.spec, list(directives), n_devices, global_batch=model.batch_size)
  use_remat = (plan.mesh.n_pp > 1) if remat is None else remat
  step, compute, comm, bubble, mem = _estimate(model, plan, costs or CostModel(), use_remat,
                                                options or LoweringOptions())
  return Estimate(step, compute, comm, bubble, mem, plan)


def search(loss_fn: Callable, optimizer: optax.GradientTransformation, params: Any,
           example_batch: Any, n_devices: int, memory_per_device: float, *,
           schedules: Sequence[str] = ALL_SCHEDULES, zero_stages: Sequence[int] = (0, 1, 3),
           microbatches: Sequence[int] | None = None, top: int = 10,
           costs: CostModel | None = None, virtual_stages: Sequence[int] = (2,),
           group_regions: bool = True, max_microbatches: int | None = None,
           remat: bool | None = None, reduce_dtype: str | None = None,
           bucket_mb: float | None = 25.0, expert_parallel: bool | None = None,
           tensor_parallel: bool | None = None, headroom: float = 0.75) -> SearchResult:
  """Chooses a strategy: enumerates, plans, simulates and ranks those that fit.

  Candidates use all `n_devices`:

  * "dp": data parallel over all devices (`strategies.data_parallel`), each ZeRO stage
    of `zero_stages`, with gradient accumulation over each microbatch count.
  * pipelines over the model's `pj.annotate("PP")` regions, each schedule of
    `schedules` whose rank count divides `n_devices`, times data parallel over the
    rest with each ZeRO stage: "gpipe", "1f1b" and "zb" on 2 .. n_regions ranks, where
    fewer ranks than regions take consecutive regions each (`group_regions`; cut to
    balance the regions' FLOPs); "interleaved" with `n_regions / v` ranks for each v of
    `virtual_stages`; "dualpipev" with `n_regions / 2` ranks. A model's regions are its
    finest stages: more stages need more `PP` regions in the model.
  * microbatch counts that divide the per-replica batch: `microbatches`, or powers of
    two from the pipeline ranks (1 without a pipeline; 2 x ranks for DualPipeV) up to
    `max_microbatches` (default 8 without a pipeline, else max(8, 4 x ranks)).

  * expert parallel, for a model with `pj.annotate("EP")` regions: each candidate also
    with every EP region's experts split over its stage's data-parallel devices
    (`pj.shard({"EP": "*"}, ...)`, where the experts divide evenly); their weights,
    gradients and optimizer state count 1/EP per device, and each EP region's tokens
    cross the links four times a microbatch (to the experts and back, in F and in B).

  * tensor parallel, for a model whose weights carry Flax partitioning names "tp": each
    candidate without split experts also with groups of 2, 4 or 8 of each stage's
    devices splitting those weights (`pj.shard_tensor`; the group shares its batch
    rows); the split weights count 1/TP per device, and each row-parallel weight's
    output (F) and input cotangent (B) are all-reduced over the group.

  Step time (`CostModel`): the plan's tick-by-tick simulated makespan with each task
  costing its regions' matmul FLOPs from the jaxpr (B twice F) at `flops_per_s` (or
  their measured times, `CostModel.region_times` from `pj.calibrate`), plus
  `tick_overhead_s` per tick, plus communication at `link_bytes_per_s`: data-parallel
  reductions and gathers by ZeRO stage and pipeline activations and their cotangents,
  added to a pipeline's compute and hidden behind the compute of a step without one
  (only what exceeds it counts). Elementwise work and attention's non-matmul cost are
  left out.

  Peak memory per device (the busiest pipeline rank, `MemoryEstimate`): its regions'
  parameters (as given: fp32 masters stay fp32), gradients of the same size, and
  optimizer state (`jax.eval_shape(optimizer.init, params)`, spread over the parameters
  in proportion), each divided over the data-parallel replicas by ZeRO (1: optimizer
  state, 2: and gradients, 3: and parameters, plus the weights gathered in the dtype the
  model reads them in: a pipeline stage's, or without a pipeline the largest region's);
  plus activations: per (region, microbatch), the residuals its F stores for B (`remat`
  as `pj.compile` applies it: default on for pipelines) and its activation inputs, alive
  from the end of its F to the end of its last backward in the simulation, summed at
  their peak. Without accumulation or a pipeline, gradients and activations count as
  the larger of the two (one backward frees the one as it makes the other). A pipeline
  also keeps its weights cast once a step (the bf16 copies of fp32 masters) and, under
  remat, the largest backward's recomputed residuals. ZeRO-1/2 of a model that reads
  its fp32 weights in bf16 shard the fp32 parameters too and hold the bf16 copy whole
  (`LoweringOptions.shard_masters`). XLA's temporaries, communication
  buffers and fragmentation are left out: leave headroom.

  Args:
    loss_fn, optimizer, params, example_batch: as `pj.compile` takes them (shapes are
      enough); `example_batch` has the global batch size.
    n_devices: devices to plan for.
    memory_per_device: bytes per device; candidates estimated above `headroom` of it
      are rejected.
    schedules: "dp" and/or pipeline schedules to try (default all).
    zero_stages: ZeRO stages to try where there are data-parallel replicas.
    microbatches: microbatch counts to try (default: powers of two, above).
    top: rows of `SearchResult.table()`.
    costs: a `CostModel` (default `CostModel()`).
    virtual_stages: stages per rank to try for "interleaved".
    group_regions: also try pipelines with fewer ranks than PP regions.
    max_microbatches: the largest default microbatch count (see above).
    remat: as `pj.compile(remat=...)` will run (None: on for pipelines only).
    reduce_dtype, bucket_mb: passed to every `replicate` (see `strategies.data_parallel`).
    expert_parallel: None: candidates with and without split experts (a model with EP
      regions); True: only split; False: never.
    tensor_parallel: the same for tensor-parallel groups (a model with "tp" names).
    headroom: the fraction of `memory_per_device` an estimate may use: what the
      estimate leaves out (XLA's temporaries, communication buffers) measured up to
      a quarter of a GPU's peak, more in pipelines (benchmarks/RESULTS.md).

  Returns:
    A `SearchResult`; `best.directives` go to `pj.compile` with the first
    `best.n_ranks * best.dp` devices.

  Raises:
    ValueError: for bad arguments, a model without PP regions asked for pipelines
      only, or when no candidate fits (naming the smallest need).
  """
  if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
    raise ValueError(f"n_devices must be an int >= 1, got {n_devices!r}; pass the number of "
                     f"devices to plan for")
  if not 0 < headroom <= 1:
    raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
  if not memory_per_device > 0:
    raise ValueError(f"memory_per_device must be > 0 bytes, got {memory_per_device!r}; pass "
                     f"each device's memory in bytes (e.g. 80 * 2**30)")
  unknown = [s for s in schedules if s not in ALL_SCHEDULES]
  if unknown or not schedules:
    raise ValueError(f"schedules must be a non-empty list of {list(ALL_SCHEDULES)}, got "
                     f"{list(schedules)}")
  bad_zero = [z for z in zero_stages if z not in (0, 1, 2, 3)]
  if bad_zero or not zero_stages:
    raise ValueError(f"zero_stages must be a non-empty list of 0..3, got {list(zero_stages)}")
  if microbatches is not None and not any(isinstance(m, int) and m >= 1 for m in microbatches):
    raise ValueError(f"microbatches must hold ints >= 1, got {list(microbatches)}")
  costs = costs or CostModel()
  pipelines = [s for s in schedules if s != "dp"]
  model = _measure(loss_fn, optimizer, params, example_batch)
  if pipelines and "dp" not in schedules and len(model.pp) < 2:
    raise ValueError(
        f"schedules {list(schedules)} are pipelines only, but the model has "
        f"{len(model.pp)} pj.annotate('PP') region(s) covering it (a pipeline needs 2 or "
        f"more, and every region inside one); annotate the model's stages with "
        f"pj.annotate('PP') or add 'dp' to schedules")
  layouts = _layouts(model, n_devices, schedules, zero_stages, microbatches, virtual_stages,
                     group_regions, max_microbatches, expert_parallel, tensor_parallel)
  if not layouts:
    raise ValueError(
        f"no strategy of {list(schedules)} fits {n_devices} device(s) and a batch of "
        f"{model.batch_size}: the batch must divide over the data-parallel replicas and "
        f"microbatches ({microbatches or 'powers of two'}); change the batch size, "
        f"microbatches or n_devices")
  fits, rejected = [], []
  for lay in layouts:
    directives = _directives(lay, reduce_dtype, bucket_mb)
    try:
      plan = make_plan(model.spec, directives, lay.n_ranks * lay.dp, global_batch=model.batch_size)
    except (ValueError, RuntimeError) as e:  # DirectiveError and PlanError are ValueErrors
      rejected.append(Rejected(lay.name, directives, lay.n_microbatches, f"does not plan: {e}"))
      continue
    use_remat = (plan.mesh.n_pp > 1) if remat is None else remat
    step, compute, comm, bubble, mem = _estimate(model, plan, costs, use_remat)
    if mem.total > headroom * memory_per_device:
      of = ("" if headroom == 1 else
            f" ({100 * headroom:.0f}% of {format_bytes(memory_per_device)})")
      rejected.append(Rejected(lay.name, directives, lay.n_microbatches,
                               f"needs {format_bytes(mem.total)} of "
                               f"{format_bytes(headroom * memory_per_device)}{of}", mem.total))
      continue
    fits.append(Candidate(step, compute, comm, bubble, mem, plan, name=lay.name,
                          directives=directives, schedule=lay.schedule, n_ranks=lay.n_ranks,
                          dp=lay.dp, zero=lay.zero, stages=lay.stages,
                          n_microbatches=lay.n_microbatches))
  if not fits:
    needs = [r for r in rejected if r.peak_memory is not None]
    smallest = min(needs, key=lambda r: r.peak_memory, default=None)
    hint = (f"; the smallest, {smallest.name} with {smallest.n_microbatches} microbatches, "
            f"needs {format_bytes(smallest.peak_memory)}" if smallest else
            f": {rejected[0].reason}" if rejected else "")
    raise ValueError(f"no strategy fits {format_bytes(headroom * memory_per_device)} per "
                     f"device ({100 * headroom:.0f}% of {format_bytes(memory_per_device)}) on "
                     f"{n_devices} device(s){hint}; give more memory or devices, more ZeRO "
                     f"stages, pipeline schedules or microbatches")
  # Equal times prefer fewer, larger microbatches (the FLOP model does not see that
  # small matmuls run slower), then less memory.
  fits.sort(key=lambda c: (c.step_time, c.n_microbatches, c.peak_memory, c.name))
  return SearchResult(fits[0], tuple(fits), tuple(rejected), float(memory_per_device), top)
