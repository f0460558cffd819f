"""`search`: enumerates the strategies a model's annotations allow, plans and simulates
each without devices, estimates its peak memory per device, and ranks those that fit.

The model is traced once (`costs.measure_model`); every candidate is planned from that
trace (`make_plan` with the candidate's directives), simulated with the regions' matmul
FLOPs from the jaxpr (`Plan.simulate("flops")`), and costed with a `CostModel`
(`costs.estimate_plan`). See `search` for what the time and memory estimates count and
leave out.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import optax

from piper_jax import builders
from piper_jax.compile import compile as compile_step
from piper_jax.ir.directives import (Directive, Order, order, place, replicate, shard,
                                     shard_tensor, split)
from piper_jax.ir.pipeline import make_plan
from piper_jax.lowering import LoweringOptions
from piper_jax.planner.hardware import ACCELERATORS, Accelerator, target_card
from piper_jax.planner.costs import (JAX_GPU_POOL, CostModel, Estimate, MeasuredModel, estimate_plan,
                                     format_bytes, format_time, measure_model)

__all__ = ["Candidate", "Rejected", "SearchResult", "search", "PIPELINE_SCHEDULES"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")
# "dp" is data parallelism alone (no pipeline); the others are pipeline schedules.
ALL_SCHEDULES = ("dp",) + PIPELINE_SCHEDULES
# Schedules whose stages may each hold several consecutive PP regions (the others
# place a fixed pattern of single regions on each rank).
_GROUPABLE = ("gpipe", "1f1b", "zb")
_GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate(Estimate):
  """A strategy that fits, with its estimates (`Estimate`'s fields: step_time,
  compute_time, comm_time, bubble_fraction, memory, update_time and the plan simulated,
  from the one trace at the example batch's size).

  Attributes:
    name: e.g. "1f1b pp2 x dp4 zero1" or "dp8 zero3".
    directives: the directive list for `pj.compile`.
    schedule: "dp" (no pipeline) or a pipeline schedule.
    n_ranks, dp, zero: pipeline ranks, data-parallel replicas per rank, ZeRO stage.
    stages: per pipeline stage, the PP region indices it holds (empty without a pipeline).
    n_microbatches: microbatches per step.
    checkpointing: the label of `search`'s `checkpointing` variant of the loss this
      candidate runs (None: the loss as given).
  """

  name: str
  directives: list
  schedule: str
  n_ranks: int
  dp: int
  zero: int
  stages: tuple[tuple[int, ...], ...]
  n_microbatches: int
  checkpointing: str | None = None

  @property
  def peak_memory(self) -> int:
    return self.memory.total

  def __str__(self) -> str:
    return f"{self.name}, {_microbatches(self.n_microbatches)}\n{super().__str__()}"


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
  # `search`'s checkpointing variants of the loss, by label (`Candidate.checkpointing`).
  variants: dict = dataclasses.field(default_factory=dict)

  def table(self, top: int | None = None) -> str:
    """A Markdown table of the `top` fastest candidates (default: the search's `top`),
    after a line that says how many of those that fit it shows."""
    shown = self.candidates[:self.top if top is None else top]
    rows = [_shown(len(shown), len(self.candidates)), "",
            "| strategy | microbatches | simulated step | bubble | peak memory |",
            "| --- | --- | --- | --- | --- |"]
    for c in shown:
      rows.append(f"| {_cell(c.name)} | {c.n_microbatches} | "
                  f"{format_time(c.step_time)} | {100 * c.bubble_fraction:.1f}% | "
                  f"{format_bytes(c.peak_memory)} |")
    return "\n".join(rows)

  def timelines(self, folder: str, top: int = 3, fmt: str = "svg") -> list[str]:
    """Draws the plan of each of the `top` fastest candidates as a per-device timeline
    (`Plan.timeline`, tasks sized by their FLOPs) into `folder`; returns the paths."""
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
    """Compiles the fastest candidates in turn (a checkpointing candidate with its
    variant of `loss_fn`) and returns the first, with its `TrainStep`, whose compiled
    program fits: XLA's own memory analysis of it
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
      fn = self.variants[c.checkpointing] if c.checkpointing else loss_fn
      step = compile_step(fn, optimizer, c.directives, params, example_batch,
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
            f"{_microbatches(self.best.n_microbatches)}\n{self.table()}")


def _microbatches(m: int) -> str:
  return f"{m} microbatch" + ("" if m == 1 else "es")


def _cell(text: str) -> str:
  """`text` in a Markdown table cell: grouped pipelines' names hold "|", which ends one."""
  return text.replace("|", r"\|")


def _shown(n: int, total: int) -> str:
  if n >= total:
    return f"all {total} strategies that fit, fastest first:"
  return f"the {n} fastest of {total} strategies that fit ({total - n} more in `candidates`):"


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
  n_stages = len(lay.stages)
  if all(len(s) == 1 for s in lay.stages) or lay.n_virtual > 1:
    return builders.pipeline(n_stages, lay.n_microbatches, lay.schedule, dp=lay.dp,
                               zero=lay.zero, n_virtual=max(lay.n_virtual, 2),
                               reduce_dtype=reduce_dtype)
  # Several consecutive PP regions per rank: place each on its rank's devices, and
  # run the schedule's stage orders with every filter of stage k widened to a group
  # of its regions (forward in order, backward reversed; the data edges order them).
  base = builders.pipeline(n_stages, lay.n_microbatches, lay.schedule)
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


def _layouts(model: MeasuredModel, n_devices: int, schedules: Sequence[str],
             zero_stages: Sequence[int],
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
    elif schedule == "dualpipev" and len(pp) % 2 == 0 and len(pp) >= 4:  # 2 ranks or more
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


# -- the search --------------------------------------------------------------------

def search(loss_fn: Callable, optimizer: optax.GradientTransformation, params: Any,
           example_batch: Any, n_devices: int, memory_per_device: float | None = None, *,
           target: "Accelerator | str | None" = None,
           schedules: Sequence[str] = ALL_SCHEDULES, zero_stages: Sequence[int] = (0, 1, 3),
           microbatches: Sequence[int] | None = None, top: int = 10,
           costs: CostModel | None = None, virtual_stages: Sequence[int] = (2,),
           group_regions: bool = True, max_microbatches: int | None = None,
           remat: bool | None = None, reduce_dtype: str | None = None,
           bucket_mb: float | None = 25.0, expert_parallel: bool | None = None,
           tensor_parallel: bool | None = None, headroom: float = 0.75,
           checkpointing: Mapping[str, Callable] | None = None) -> SearchResult:
  """Chooses a strategy: enumerates, plans, simulates and ranks those that fit.

  Candidates use all `n_devices`:

  * "dp": data parallel over all devices (`strategies.data_parallel`), each ZeRO stage
    of `zero_stages`, with gradient accumulation over each microbatch count.
  * pipelines over the model's `pj.annotate("PP")` regions, each schedule of
    `schedules` whose rank count divides `n_devices`, times data parallel over the
    rest with each ZeRO stage: "gpipe", "1f1b" and "zb" on 2 .. n_regions ranks, where
    fewer ranks than regions take consecutive regions each (`group_regions`; cut to
    balance the regions' FLOPs); "interleaved" with `n_regions / v` ranks for each v of
    `virtual_stages`; "dualpipev" with `n_regions / 2` ranks (both on 2 ranks or more:
    never one rank holding every stage). A model's regions are its
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
  costing its regions' matmul FLOPs from the jaxpr (B twice F) at `flops_per_s`, or,
  for a card whose GEMMs the planner knows (`CostModel.card`), each matmul by its size
  and fused attention at its own rate, or their measured times
  (`CostModel.region_times` from `pj.calibrate`), plus
  `tick_overhead_s` per tick, plus communication at `link_bytes_per_s`: data-parallel
  reductions and gathers by ZeRO stage and pipeline activations and their cotangents,
  added to a pipeline's compute and hidden behind the compute of a step without one
  (only what exceeds it counts; expert and tensor parallelism's exchanges, which the
  next computation waits for, are added), plus the optimizer's update over the
  parameters each device updates (memory-bound: `memory_bytes_per_s`, or its measured
  time from `pj.calibrate`). Elementwise work and attention's non-matmul cost are
  otherwise left out.

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
  the larger of the two (one backward frees the one as it makes the other), and a step
  above XLA's memory (`JAX_GPU_POOL` of `memory_per_device`) counts as fitted to it where
  remat's residuals would fit (XLA rematerializes such a step). Accumulation on one rank
  keeps remat's residuals (XLA compiles each microbatch's F and B together). A pipeline
  or accumulation also keeps its weights cast once a step (the bf16 copies of fp32
  masters) and, under remat, the largest backward's recomputed residuals. ZeRO-1/2 of a model that reads
  its fp32 weights in bf16 shard the fp32 parameters too and hold the bf16 copy whole
  (`LoweringOptions.shard_masters`). XLA's temporaries, communication
  buffers and fragmentation are left out: leave headroom.

  Args:
    loss_fn, optimizer, params, example_batch: as `pj.compile` takes them (shapes are
      enough); `example_batch` has the global batch size.
    n_devices: devices to plan for.
    memory_per_device: bytes per device; candidates estimated above `headroom` of it
      are rejected. Default: `target`'s memory.
    target: the card the plan is for (`piper_jax.planner.ACCELERATORS`' name, e.g.
      "H200", or an `Accelerator`), whatever machine plans: its memory and, unless
      `costs` is given, `CostModel.for_accelerator(target)`. Trace the model as it will
      run there: a fused attention's memory, not the host's (`examples/`' models take
      `attention="cudnn"`, which a host without cuDNN traces with the same residuals).
    schedules: "dp" and/or pipeline schedules to try (default all).
    zero_stages: ZeRO stages to try where there are data-parallel replicas.
    microbatches: microbatch counts to try (default: powers of two, above).
    top: rows of `SearchResult.table()` (the fastest; its first line says how many fit).
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
    checkpointing: activation checkpointing as a choice, where the model offers it:
      label -> the same loss with parts of the model under `jax.checkpoint` (e.g.
      {"per block": the model built with its blocks under `nn.remat`}). Every strategy
      is also tried with each, named "... +ac LABEL": its memory is what that model's
      forwards keep, its backward costs the forward FLOPs it runs again.

  Returns:
    A `SearchResult`; `best.directives` go to `pj.compile` with the first
    `best.n_ranks * best.dp` devices.

  Raises:
    ValueError: for bad arguments, a model without PP regions asked for pipelines
      only, or when no candidate fits (naming the smallest need).

  (Over 80 lines for its arguments' documentation; the search is in the helpers.)
  """
  if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
    raise ValueError(f"n_devices must be an int >= 1, got {n_devices!r}; pass the number of "
                     f"devices to plan for")
  if not 0 < headroom <= 1:
    raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
  if target is not None:
    card = target_card(target)
    memory_per_device = card.memory_bytes if memory_per_device is None else memory_per_device
    costs = costs or CostModel.for_accelerator(card)
  if memory_per_device is None or not memory_per_device > 0:
    raise ValueError(f"memory_per_device must be > 0 bytes, got {memory_per_device!r}; pass "
                     f"each device's memory in bytes (e.g. 80 * 2**30), or target= a card "
                     f"name ({', '.join(ACCELERATORS)})")
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
  variants = dict(checkpointing or {})
  if None in variants or any(not callable(f) for f in variants.values()):
    raise ValueError("checkpointing maps labels to loss functions (the model with parts "
                     "under jax.checkpoint), e.g. {'per block': loss_fn_with_remat}")
  choices = _Choices(n_devices, float(memory_per_device), tuple(schedules), tuple(zero_stages),
                     microbatches, costs, tuple(virtual_stages), group_regions,
                     max_microbatches, remat, reduce_dtype, bucket_mb, expert_parallel,
                     tensor_parallel, headroom)
  fits, rejected = [], []
  for label, fn in [(None, loss_fn)] + list(variants.items()):
    _search_one(label, fn, optimizer, params, example_batch, choices, fits, rejected)
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
  return SearchResult(fits[0], tuple(fits), tuple(rejected), float(memory_per_device), top,
                      variants)


@dataclasses.dataclass(frozen=True)
class _Choices:
  """What `search` tries and within what bounds: the same for every variant of the loss."""

  n_devices: int
  memory_per_device: float
  schedules: tuple[str, ...]
  zero_stages: tuple[int, ...]
  microbatches: Sequence[int] | None
  costs: CostModel
  virtual_stages: tuple[int, ...]
  group_regions: bool
  max_microbatches: int | None
  remat: bool | None
  reduce_dtype: str | None
  bucket_mb: float | None
  expert_parallel: bool | None
  tensor_parallel: bool | None
  headroom: float


def _search_one(label: str | None, loss_fn: Callable, optimizer, params, example_batch,
                c: _Choices, fits: list, rejected: list) -> None:
  """`search`'s candidates of one variant of the loss (`label`: its checkpointing, None
  for the loss as given), added to `fits` and `rejected`."""
  model = measure_model(loss_fn, optimizer, params, example_batch)
  suffix = f" +ac {label}" if label else ""
  schedules, microbatches, memory_per_device = c.schedules, c.microbatches, c.memory_per_device
  n_devices, headroom = c.n_devices, c.headroom
  pipelines = [s for s in schedules if s != "dp"]
  if pipelines and "dp" not in schedules and len(model.pp) < 2:
    raise ValueError(
        f"schedules {list(schedules)} are pipelines only, but the model has "
        f"{len(model.pp)} pj.annotate('PP') region(s) covering it (a pipeline needs 2 or "
        f"more, and every region inside one); annotate the model's stages with "
        f"pj.annotate('PP') or add 'dp' to schedules")
  layouts = _layouts(model, n_devices, schedules, c.zero_stages, microbatches,
                     c.virtual_stages, c.group_regions, c.max_microbatches, c.expert_parallel,
                     c.tensor_parallel)
  if not layouts:
    raise ValueError(
        f"no strategy of {list(schedules)} fits {n_devices} device(s) and a batch of "
        f"{model.batch_size}: the batch must divide over the data-parallel replicas and "
        f"microbatches ({microbatches or 'powers of two'}); change the batch size, "
        f"microbatches or n_devices")
  for lay in layouts:
    directives = _directives(lay, c.reduce_dtype, c.bucket_mb)
    try:
      plan = make_plan(model.spec, directives, lay.n_ranks * lay.dp, global_batch=model.batch_size)
    except (ValueError, RuntimeError) as e:  # DirectiveError and PlanError are ValueErrors
      rejected.append(Rejected(lay.name + suffix, directives, lay.n_microbatches,
                               f"does not plan: {e}"))
      continue
    est = estimate_plan(model, plan, c.costs,
                        LoweringOptions(remat=c.remat).resolved(plan.mesh.n_pp, "gpu").remat,
                        memory_limit=JAX_GPU_POOL * memory_per_device)
    mem = est.memory
    if mem.total > headroom * memory_per_device:
      of = ("" if headroom == 1 else
            f" ({100 * headroom:.0f}% of {format_bytes(memory_per_device)})")
      rejected.append(Rejected(lay.name + suffix, directives, lay.n_microbatches,
                               f"needs {format_bytes(mem.total)} of "
                               f"{format_bytes(headroom * memory_per_device)}{of}", mem.total))
      continue
    fits.append(Candidate(**{f.name: getattr(est, f.name) for f in dataclasses.fields(Estimate)},
                          name=lay.name + suffix, checkpointing=label,
                          directives=directives, schedule=lay.schedule, n_ranks=lay.n_ranks,
                          dp=lay.dp, zero=lay.zero, stages=lay.stages,
                          n_microbatches=lay.n_microbatches))

