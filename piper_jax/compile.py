"""`compile`: loss + optimizer + directives -> a jitted, partitioned `TrainStep`."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from piper_jax.ir.directives import (Directive, Replicate, ShardTensor, Split,
                                      load_directives)
from piper_jax.ir.errors import DeviceIndexError
from piper_jax.ir.graph import Graph, NodeKind
from piper_jax.ir.pipeline import finish_plan, make_plan, place_graph
from piper_jax.ir.plan import Plan
from piper_jax.lowering import (Buffers, LoweringOptions, ParamLayout, Program, RegionRunner,
                                ScheduleTable, SplitAxis, StepCollective, check_leaf, collectives_table,
                                packed_update_reason, shard_map_unchecked, step_collectives,
                                trace_loss)
from piper_jax.check import check as check_step
from piper_jax.memory import CompiledMemory

__all__ = ["CompiledMemory", "TrainState", "TrainStep", "compile", "plan"]


@jax.tree_util.register_pytree_node_class
class TrainState:
  """Packed, partitioned parameters and the optimizer state over them.

  A pytree of `jax.Array`s whose shards show the partitioning; it remembers the
  `TrainStep` that made it (static, not a leaf) so that checkpoints can write the
  canonical layout.
  """

  __slots__ = ("params", "opt_state", "owner")

  def __init__(self, params: dict, opt_state: Any, owner: "TrainStep | None" = None):
    self.params, self.opt_state, self.owner = params, opt_state, owner

  def tree_flatten(self):
    return (self.params, self.opt_state), self.owner

  @classmethod
  def tree_unflatten(cls, owner, children):
    return cls(*children, owner)

  def __iter__(self):
    return iter((self.params, self.opt_state))

  def __repr__(self):
    return f"TrainState(params={self.params!r}, opt_state={self.opt_state!r})"


@contextlib.contextmanager
def _collector_paused():
  """Python's cyclic garbage collector paused while the step is built, traced and
  lowered (not while XLA compiles, nor in a call): in a process that has built steps
  before (a planner's search, a notebook, tests) its collections scan every object the
  earlier traces left, a fifth of a pipeline's build, trace and lowering on the CPU;
  what this one leaves behind is freed when it runs again."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def _batch_size(example_batch) -> int:
  """The rows every leaf of the batch shares on its leading axis, which split and
  replicate cut; a batch whose leaves disagree is refused here, before anything is traced."""
  shapes = {jax.tree_util.keystr(p): np.shape(x)
            for p, x in jax.tree_util.tree_flatten_with_path(example_batch)[0]}
  lead = {k: shape[0] if shape else None for k, shape in shapes.items()}
  rows = set(lead.values())
  if len(rows) > 1 or None in rows:
    # The leaves off the commonest leading axis first, then one that has it.
    common = max(rows - {None}, key=list(lead.values()).count, default=None)
    named = [k for k, n in lead.items() if n is None or n != common][:4]
    if common is not None:
      named.append(next(k for k, n in lead.items() if n == common))
    listed = ", ".join(f"batch{k} {shapes[k]}" for k in named)
    raise ValueError(
        f"the batch's leaves do not share a leading axis ({listed}): every batch leaf needs "
        f"the batch's rows first, which the step splits over microbatches and replicas; "
        f"pass values that are not per example in the params, or close over them in loss_fn")
  return int(rows.pop()) if rows else 0


def _traced_plan(loss_fn, directives, params, example_batch, n_devices, has_aux=False):
  """Traces the loss at the microbatch size and plans it.

  The microbatch size depends on the mesh and the microbatches, which placing the
  traced model fixes (`place_graph`). The loss is traced first at the size the
  directives suggest (`_guess_microbatch`), and again only when placing says otherwise:
  tracing a large model is most of `pj.compile`'s own time.
  """
  batch_size = _batch_size(example_batch)
  at = lambda n: jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((n,) + tuple(np.shape(x)[1:]), jax.numpy.result_type(x)),
      example_batch)
  guess = _guess_microbatch(directives, batch_size)
  traced_at = {}  # batch size -> the loss traced at it
  if guess is not None and guess < batch_size:
    traced_at[guess] = trace_loss(loss_fn, params, at(guess), has_aux)
    try:
      plan = make_plan(traced_at[guess].spec, directives, n_devices, global_batch=batch_size)
    except Exception:  # noqa: BLE001 - planned again below, where the error is raised
      plan = None
    if plan is not None and batch_size == guess * plan.mesh.n_data * plan.n_microbatches:
      return traced_at[guess], plan
  else:
    traced_at[batch_size] = trace_loss(loss_fn, params, example_batch, has_aux)
  # Placing reads the regions and their tags, which a trace at any batch size gives.
  first = next(iter(traced_at.values()))
  placed = place_graph(first.spec, directives, n_devices)
  mbs = batch_size // (placed.mesh.n_data * placed.n_microbatches)
  if mbs not in traced_at:
    traced_at[mbs] = trace_loss(loss_fn, params, at(mbs), has_aux)
  traced = traced_at[mbs]
  if [r.tags for r in traced.spec.regions] != [r.tags for r in first.spec.regions]:
    raise ValueError("the model's regions depend on the batch size; annotate regions the "
                     "same way for every batch size")
  if mbs == batch_size:
    if traced is not first:
      placed = place_graph(traced.spec, directives, n_devices)
    return traced, finish_plan(traced.spec, directives, placed)
  return traced, make_plan(traced.spec, directives, n_devices, global_batch=batch_size)


def _guess_microbatch(directives, batch_size: int) -> int | None:
  """The microbatch size the directives suggest: the batch over the microbatches of
  `split` and the data-parallel copies of the widest `replicate` (over its
  `shard_tensor` group, whose devices share rows: those of one replicate group, when a
  pipeline's shard_tensor lists every stage's); None without microbatches."""
  n_mb = math.prod(d.num_microbatches for d in directives if isinstance(d, Split))
  groups = [set(d.devices) for d in directives if isinstance(d, Replicate)]
  copies = max([len(g) for g in groups] + [1])
  tp = max([max([len(set(d.devices) & g) for g in groups], default=0) or len(d.devices)
            for d in directives if isinstance(d, ShardTensor)] + [1])
  ways = n_mb * max(copies // tp, 1)
  if ways == 1 or batch_size % ways:
    return None
  return batch_size // ways


def plan(loss_fn: Callable, directives, params: Any, example_batch: Any, n_devices: int,
         has_aux: bool = False) -> Plan:
  """Builds and checks the plan of a strategy without devices (shapes are enough).

  `params` and `example_batch` may be `jax.ShapeDtypeStruct` pytrees; nothing is
  compiled or placed, so plans for thousands of devices can be checked and
  simulated (`.simulate(costs)`, `.timeline(path)`) on one CPU.
  """
  return _traced_plan(loss_fn, load_directives(directives), params, example_batch, n_devices,
                      has_aux)[1]


@dataclasses.dataclass(frozen=True)
class _Partitioning:
  """How a step's state and batch are partitioned over its mesh: the gradients'
  PartitionSpecs (`Buffers`), the parameters' and optimizer state's shardings, the
  optimizer state's shapes, the whole state's (a `TrainState`) and the batch's."""

  grad_specs: Any
  params: Any
  opt_shapes: Any
  opt: Any
  state: Any
  batch: NamedSharding


class TrainStep:
  """A compiled training step. `init(params) -> state`, `step(state, batch) -> (state, loss)`
  (`(state, (loss, aux))` for a loss_fn compiled with `has_aux`)."""

  def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation,
               directives: Sequence[Directive] | str, params: Any, example_batch: Any,
               devices: Sequence[jax.Device] | None = None,
               options: LoweringOptions | None = None, has_aux: bool = False,
               platform: str | None = None):
    self.devices = list(jax.devices() if devices is None else devices)
    self.platform: str = _platform(platform, self.devices[0])
    self.directives = load_directives(directives)
    self.loss_fn, self.optimizer, self.has_aux = loss_fn, optimizer, has_aux
    traced, plan = self._trace_and_plan(params, example_batch)
    pm = plan.mesh
    self.plan: Plan = plan
    self.batch_size = traced.spec.batch_size * pm.n_data * plan.n_microbatches
    self._traced = traced
    options = LoweringOptions.checked(options).resolved(
        pm.n_pp, self.platform, sum(len(g) for g in pm.groups))
    self.options: LoweringOptions = options
    self._layout = layout = ParamLayout(traced.spec, plan, traced.param_casts(), options)
    axes = {k: SplitAxis(k, n, k) for k, n in pm.inner.items()}
    runner = RegionRunner(traced, pm.sharded, axes, pm.split_dims)
    self._program = Program(runner, plan, layout, options, self.platform)
    grid = np.vectorize(lambda d: self.devices[d], otypes=[object])(np.array(pm.device_grid()))
    self.mesh = Mesh(grid, pm.axis_names)
    # ZeRO-1/2 with bf16-read weights keep the fp32 masters sharded like the gradients
    # (`layout.shards_masters`); ZeRO-3 shards them too.
    sharded = pm.zero >= 3 or layout.shards_masters
    self._parts = self._place_state(sharded)
    self._step = self._jit_step(sharded)
    replicated = NamedSharding(self.mesh, P())
    self._pack = jax.jit(layout.pack, out_shardings=self._parts.params)
    self._opt_init = jax.jit(optimizer.init, out_shardings=self._parts.opt)
    self._pack_opt = jax.jit(layout.pack, out_shardings=self._to_sharding(self._parts.grad_specs))
    self._unpack = jax.jit(layout.unpack, out_shardings=replicated)
    self._to_canonical = None
    self._collectives: list[StepCollective] | None = None
    self._compiled = None  # the step `memory` compiled, which calls then run

  def _trace_and_plan(self, params: Any, example_batch: Any) -> tuple:
    """The traced loss and its plan; a device index past the CPU's devices gets the
    flag that makes more."""
    try:
      return _traced_plan(self.loss_fn, self.directives, params, example_batch,
                          len(self.devices), self.has_aux)
    except DeviceIndexError as e:
      if self.devices[0].platform == "cpu":
        e.args = (f"{e.args[0]}. On the CPU, JAX makes N devices when told before it starts: "
                  f"XLA_FLAGS=--xla_force_host_platform_device_count=N in the environment, or "
                  f"jax.config.update('jax_num_cpu_devices', N) before the first use of jax",)
      raise

  def _to_sharding(self, specs):
    return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))

  def _place_state(self, sharded: bool) -> "_Partitioning":
    """How the state is partitioned (`sharded`: the parameters over the data-parallel
    replicas): parameters, gradients, optimizer state and the batch; sets whether the
    optimizer updates packed buffers or whole leaves (`leaf_update`)."""
    layout, traced, optimizer, zero = self._layout, self._traced, self.optimizer, self.plan.mesh.zero
    grad_specs = layout.specs(sharded=zero >= 1, split_sharded=zero >= 1)
    param_shardings = self._to_sharding(layout.specs(sharded=sharded, split_sharded=sharded))
    # The optimizer updates the packed buffers when it treats every element alike;
    # otherwise (masks, per-leaf labels, factored or matrix updates) whole leaves.
    param_shapes = jax.tree_util.tree_unflatten(traced.param_tree, [x for _, x in traced.param_leaves])
    shapes = layout.shapes()
    self.leaf_update: str | None = packed_update_reason(optimizer, param_shapes, shapes)
    if self.leaf_update is None:
      opt_shapes = jax.eval_shape(optimizer.init, shapes)
      # Optimizer state leaves shaped like a parameter buffer are partitioned like
      # its gradients (ZeRO >= 1: over "dp" too); scalars such as counts are replicated.
      opt_spec_of = {}
      for s, spec in zip(jax.tree_util.tree_leaves(shapes),
                         jax.tree_util.tree_leaves(grad_specs, is_leaf=lambda x: isinstance(x, P))):
        opt_spec_of.setdefault(s.shape, spec)
      opt_specs = jax.tree_util.tree_map(lambda s: opt_spec_of.get(tuple(s.shape), P()),
                                         opt_shapes)
    else:
      # Whole leaves' state is spread over all the step's devices, leaf by leaf.
      opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
      opt_specs = jax.tree_util.tree_map(lambda s: self._spread_spec(s.shape), opt_shapes)
    opt_shardings = self._to_sharding(opt_specs)
    pm = self.plan.mesh
    return _Partitioning(
        grad_specs=grad_specs, params=param_shardings, opt_shapes=opt_shapes, opt=opt_shardings,
        state=TrainState(param_shardings, opt_shardings, self),
        batch=NamedSharding(self.mesh, P(pm.data_axes if len(pm.data_axes) > 1 else "dp")))

  def _jit_step(self, sharded: bool):
    """The jitted step: the shard_map body on the partitioned state (`sharded` as in
    `_place_state`), then the optimizer."""
    layout, traced, optimizer, zero = self._layout, self._traced, self.optimizer, self.plan.mesh.zero
    n_batch = len(traced.spec.batch)
    # The body reads the stacked layout; spread slots are stored otherwise (`ParamLayout`).
    body = shard_map_unchecked(self._program.body, self.mesh,
                      in_specs=(layout.specs(sharded, sharded, working=True),
                                [self._parts.batch.spec] * n_batch),
                      out_specs=(layout.specs(zero >= 1, zero >= 1, working=True), P()))
    has_aux = self.has_aux

    def step_fn(state: TrainState, batch: list):
      grads, sums = body(layout.to_working(state.params), batch)
      loss = (sums[0], jax.tree_util.tree_unflatten(traced.aux_tree, list(sums[1:]))
              ) if has_aux else sums[0]
      grads = layout.from_working(grads)
      if self.leaf_update is None:
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, self), loss
      spread = self._canonical_shardings()
      as_tree = lambda buffers: jax.tree_util.tree_unflatten(traced.param_tree, [
          jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(layout.unpack(buffers), spread)])
      params = as_tree(state.params)
      updates, opt_state = optimizer.update(as_tree(grads), state.opt_state, params)
      params = optax.apply_updates(params, updates)
      return TrainState(layout.pack(jax.tree_util.tree_leaves(params)), opt_state, self), loss

    compiler_options = self.options.compiler_options
    if compiler_options is None:
      device = self.devices[0]
      rocm = "rocm" in str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
      compiler_options = {} if rocm else self._program.compiler_options()
    return jax.jit(step_fn, in_shardings=(self._parts.state, [self._parts.batch] * n_batch),
                   out_shardings=(self._parts.state, NamedSharding(self.mesh, P())),
                   donate_argnums=0, compiler_options=dict(compiler_options) or None)

  # -- public API ---------------------------------------------------------------

  def init(self, params: Any) -> TrainState:
    """Packs `params` into partitioned buffers and initialises the optimizer over them."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    if tree != self._traced.param_tree:
      raise ValueError(f"params have structure {tree}, but the step was compiled for "
                       f"{self._traced.param_tree}")
    # Checked here: packing would fail inside JAX with no name, or cast silently.
    self._traced.check_params(leaves)
    leaves = self._onto_mesh(leaves)
    buffers = self._pack(leaves)
    if self.leaf_update is None:
      return TrainState(buffers, self._opt_init(buffers), self)
    return TrainState(buffers, self._opt_init(jax.tree_util.tree_unflatten(tree, leaves)), self)

  def _onto_mesh(self, leaves: list) -> list:
    """Leaves placed on other devices than the step's (say, on one device by
    `jax.device_put`) are moved onto its mesh in the checkpoint layout first; jit would
    reject them."""
    if jax.process_count() > 1:
      return leaves
    mesh_devices = set(self.mesh.devices.flat)
    return [jax.device_put(x, sh) if isinstance(x, jax.Array) and x.sharding.device_set != mesh_devices
            else x for x, sh in zip(leaves, self._canonical_shardings())]

  def _batch_leaves(self, batch) -> list:
    """Batch leaves as global arrays sharded as `batch_sharding`.

    A global `jax.Array` sharded otherwise is resharded onto it: over the same devices
    (any process count, or any devices in one process) by `jax.device_put`; over other
    devices of several processes only when it is fully replicated (each process then
    holds the whole batch), and else refused. With several processes, host data (or
    a process-local array) is the rows this process's devices take: process p's
    `batch_size / process_count` rows `[p*B/P, (p+1)*B/P)` when the data-parallel
    replicas divide evenly over the processes, the whole batch when every process
    holds a device of each replica (a pipeline across processes).
    """
    paths, tree = jax.tree_util.tree_flatten_with_path(batch)
    if tree != self._traced.batch_tree:
      raise ValueError(f"batch has structure {tree}, but the step was compiled for "
                       f"{self._traced.batch_tree}")
    n_proc = jax.process_count()
    out = []
    for (path, x), spec in zip(paths, self._traced.spec.batch):
      name = f"batch{jax.tree_util.keystr(path)}"
      check_leaf(name, x, spec.dtype, traced_from="the example batch's")
      want = (self.batch_size,) + spec.shape[1:]
      if isinstance(x, jax.Array) and (n_proc == 1 or not x.is_fully_addressable):
        if tuple(x.shape) != want:
          raise ValueError(f"{name} has shape {tuple(x.shape)}, but the step was compiled "
                           f"for {want} (the example batch's)")
        sharding = self._parts.batch
        if not x.sharding.is_equivalent_to(sharding, x.ndim):
          if n_proc == 1 or x.sharding.device_set == sharding.device_set:
            x = jax.device_put(x, sharding)
          elif x.is_fully_replicated:
            x = jax.make_array_from_process_local_data(
                sharding, np.asarray(x.addressable_data(0)), want)
          else:
            raise ValueError(
                f"{name} is a global jax.Array sharded as {x.sharding} over devices other "
                f"than the step's, which JAX cannot reshard across processes: pass it "
                f"sharded as `step.batch_sharding` ({sharding}), fully replicated, or as "
                f"host data (the rows of this process's devices)")
      elif n_proc > 1:
        index = self._parts.batch.addressable_devices_indices_map(want)
        spans = sorted({sl[0].indices(want[0])[:2] for sl in index.values()})
        local = (sum(b - a for a, b in spans),) + spec.shape[1:]
        if tuple(np.shape(x)) != local:
          runs = []  # adjacent spans merged: rows 0:8, not 0:2, 2:4, ...
          for a, b in spans:
            if runs and runs[-1][1] == a:
              a = runs.pop()[0]
            runs.append((a, b))
          rows = ", ".join(f"{a}:{b}" for a, b in runs)
          raise ValueError(f"{name} has shape {tuple(np.shape(x))}: with {n_proc} processes "
                           f"pass the {local[0]} rows this process's devices take (rows "
                           f"{rows} of the global batch), shape {local}, or a global "
                           f"jax.Array of shape {want}")
        x = jax.make_array_from_process_local_data(self._parts.batch, np.asarray(x), want)
      elif tuple(np.shape(x)) != want:
        raise ValueError(f"{name} has shape {tuple(np.shape(x))}, but the step was compiled "
                         f"for {want} (the example batch's)")
      out.append(x)
    return out

  @property
  def batch_sharding(self) -> NamedSharding:
    """The sharding of every batch leaf the step runs on (rows over the data-parallel
    axes); a global `jax.Array` batch sharded so is passed as it is."""
    return self._parts.batch

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
    """One training step: returns the new state and the mean loss over the batch.

    Raises:
      MemoryError: on GPUs, before the first step, when a device has too little free
        memory for it: a step over several GPUs that runs short can hang instead of
        failing.
    """
    self._check_runs_here()
    if self._compiled is None and len(self.devices) > 1 and self.devices[0].platform == "gpu":
      local = [d for d in self.devices if d.process_index == jax.process_index()]
      problem = self.memory().shortfall([d.memory_stats() or {} for d in local])
      if problem:
        raise MemoryError(
            f"{problem}. Not started: free the arrays kept on the devices (parameters made "
            f"whole on one device and then sharded, earlier states), lower the batch or use "
            f"more microbatches, or let JAX's allocator take more of each device "
            f"(XLA_PYTHON_CLIENT_MEM_FRACTION)")
    return (self._compiled or self._step)(state, self._batch_leaves(batch))

  @property
  def aux_names(self) -> list[str]:
    """With `has_aux`, each aux leaf's name ("aux['ce']"), in `tree_leaves` order."""
    return list(self._traced.aux_names)

  @property
  def tick_loop(self) -> bool:
    """Whether the step runs as one loop over all its ticks: every plan with microbatches
    or pipeline ranks does; a step of one microbatch on one rank writes its ticks out."""
    return self._program.tick_loop is not None

  @property
  def schedule_table(self) -> ScheduleTable | None:
    """The loop's plan as data (`lowering.schedule_table`): its task kinds, value stores,
    exchange rounds and regroups, per tick, rank and slot; None for a step written out
    tick by tick."""
    loop = self._program.tick_loop
    return None if loop is None else loop.table

  @property
  def layout(self) -> ParamLayout:
    """Where each parameter leaf lives: its slot, rank and offset (`home`), the slots
    (`n_slots`, `spread`), the leaves read in a narrower dtype (`cast`) and those
    split by shard / shard_tensor (`split`), and how ZeRO holds them
    (`shards_masters`, `gathers_at_start`)."""
    return self._layout

  def compiler_options(self, platform: str | None = None) -> dict:
    """The XLA options the step compiles with on `platform` (default: the step's)."""
    return self._program.compiler_options(platform)

  def collectives(self) -> list[StepCollective]:
    """The collectives one step runs: read from the step's traced program (so they are
    the ones the lowering emits, not the IR's plan of them), plus the resharding XLA
    does outside it (ZeRO-1/2 parameters gathered after the update, whole-leaf
    optimizers, spread slots). Traces the step once; the first call reuses the trace."""
    if self._collectives is None:
      with _collector_paused():
        traced = self._step.trace(*self._abstract_inputs())
      self._collectives = step_collectives(traced.jaxpr) + self._xla_resharding()
    return list(self._collectives)

  def _xla_resharding(self) -> list[StepCollective]:
    """What XLA moves between the step's shard_map and the optimizer: per device, the
    bytes of the arrays it reshards."""
    layout, out = self._layout, []
    shapes = jax.tree_util.tree_leaves(layout.shapes())
    grads = jax.tree_util.tree_leaves(self._parts.grad_specs, is_leaf=lambda x: isinstance(x, P))
    params = jax.tree_util.tree_leaves(self._parts.params)
    per_device = lambda s, spec: (int(np.prod(NamedSharding(self.mesh, spec).shard_shape(s.shape)))
                                  * np.dtype(s.dtype).itemsize)
    axes = tuple(self.mesh.axis_names)
    gathered = sum(per_device(s, g) for s, g, p in zip(shapes, grads, params)
                   if NamedSharding(self.mesh, g) != p)
    if gathered and self.leaf_update is None:
      out.append(StepCollective("all-gather (XLA)", self.plan.mesh.data_axes, gathered, 1,
                                ("after the update",)))
    if self.leaf_update is not None:
      moved = sum(per_device(s, g) for s, g in zip(shapes, grads))
      out.append(StepCollective("resharding (XLA)", axes, 2 * moved, 1,
                                ("whole leaves for the optimizer and back",)))
    if layout.spread:
      moved = sum(layout.spread[k].size * np.dtype(k[1]).itemsize for k in layout.spread)
      out.append(StepCollective("resharding (XLA)", axes, 2 * moved // layout.n_devices, 1,
                                ("spread slots to their ranks and back",)))
    return out

  def describe(self) -> str:
    """The plan, the lowering options that differ from the defaults, and the collectives
    the compiled step runs (`collectives`)."""
    # Every option as resolved for this plan and platform (`LoweringOptions.resolved`).
    options = ", ".join(f"{f.name}={getattr(self.options, f.name)!r}"
                        for f in dataclasses.fields(self.options))
    loop = self._program.tick_loop
    lowered = ("tick by tick: one microbatch on one rank" if loop is None else
               f"one loop over microbatches: {len(loop.table.kinds)} task kinds one after the "
               f"other, each microbatch's values handed on directly" if loop.direct else
               f"one loop over all ticks: {len(loop.table.kinds)} task kinds, "
               f"{len(loop.table.stores)} value stores of {loop.table.store_bytes / 2**20:.1f} MiB "
               f"on every device")
    if loop is not None and loop.cuts_at_collectives:
      phases = loop.phases
      lowered += ("; each slot's switch cut at tensor parallel's collectives, which run "
                  "between its phases" + (f" ({phases.n} phases, {len(phases.cut_kinds)} "
                                          f"kinds cut)" if phases else " (once traced)"))
    return "\n".join([str(self.plan),
                      f"lowered for {self.platform}: {lowered}",
                      f"lowering options, resolved: {options}",
                      "collectives the compiled step runs (per step; in a switch, summed "
                      "over its branches, of which each device runs one):",
                      collectives_table(self.collectives())])

  def to_dot(self) -> str:
    """Graphviz DOT of the plan with the communication the compiled step runs: the IR's
    per-region gradient and parameter collectives give way to a table of the step's own
    (`collectives`); pipeline sends and receives and expert all-to-alls stay."""
    planned = (NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER)
    g = self.plan.graph
    keep = [n for n in g.nodes.values() if n.kind not in planned]
    ids = {n.id for n in keep}
    dot = Graph(keep, [e for e in g.edges if e.src in ids and e.dst in ids]).to_dot()
    rows = collectives_table(self.collectives()).replace('"', "'").split("\n")
    label = "collectives the compiled step runs\\l" + "".join(r + "\\l" for r in rows)
    node = f'  "step collectives" [shape=note, fontname=monospace, label="{label}"];\n'
    return dot[:dot.rindex("}")] + node + "}\n"

  def check(self, params: Any, batch: Any, steps: int = 2, **kwargs):
    """Runs this strategy and the plain computation from `params` and compares them:
    losses, every leaf after `steps` steps and one plain-SGD step's gradients (in
    reduced precision, both against a float32 run of the same model).

    Returns a `piper_jax.check.CheckReport` (`print` it; `.passed`); `kwargs` go to
    `piper_jax.check.check` (`reference`, `rtol`, `sgd`, `fp32_loss_fn`, `slices`).
    """
    return check_step(self, params, batch, steps=steps, **kwargs)

  def with_optimizer(self, optimizer: optax.GradientTransformation) -> "TrainStep":
    """The same strategy, loss, devices and options compiled with another optimizer."""
    params = jax.tree_util.tree_unflatten(
        self._traced.param_tree,
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in self._traced.param_leaves])
    batch = jax.tree_util.tree_unflatten(
        self._traced.batch_tree,
        [jax.ShapeDtypeStruct((self.batch_size,) + tuple(x.shape[1:]), x.dtype)
         for x in self._traced.spec.batch])
    with _collector_paused():
      return TrainStep(self.loss_fn, optimizer, self.directives, params, batch, self.devices,
                       self.options, self.has_aux, self.platform)

  def _check_runs_here(self) -> None:
    """Refuses a GPU's program that these devices cannot run, before one device fails
    and its peers wait for it in a collective."""
    if self._program.gpu_only and self.devices[0].platform == "cpu":
      raise ValueError(
          "this step was built with platform='gpu' and its bf16 weight-gradient GEMMs "
          "write fp32, which XLA's CPU runtime cannot run: run it on GPUs, build it for "
          "these devices (drop platform=), or read it here with step.trace / step.lower")

  def trace(self, state: TrainState, batch: Any) -> jax.stages.Traced:
    """The traced step (`.jaxpr`: the program piper-jax built, collectives included)."""
    with _collector_paused():
      return self._step.trace(state, self._batch_leaves(batch))

  def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
    """The `jax.stages.Lowered` step, for `.as_text()` or `.compile()`; a step built for
    GPUs on other devices (`pj.compile(platform="gpu")`) is lowered for CUDA."""
    with _collector_paused():
      if self.platform == "gpu" and self.devices[0].platform != "gpu":
        return self.trace(state, batch).lower(lowering_platforms=("cuda",))
      return self._step.lower(state, self._batch_leaves(batch))

  def memory(self) -> CompiledMemory:
    """What the compiled step needs per device, from XLA's memory analysis of it.

    Compiles the step on shapes (nothing is allocated); later calls run that program."""
    return CompiledMemory.of(self.compile())

  def compile(self) -> jax.stages.Compiled:
    """Compiles the step with XLA now, from shapes alone (nothing is allocated), as
    `jax.jit(f).lower(...).compile()` does; every later call runs this program, so the
    first step is a step and compile time is measured here. Returns the compiled step
    (`.as_text()`, `.memory_analysis()`, `.cost_analysis()`)."""
    self._check_runs_here()
    if self._compiled is None:
      with _collector_paused():
        lowered = self._step.lower(*self._abstract_inputs())
      self._compiled = lowered.compile()
    return self._compiled

  def _abstract_inputs(self) -> tuple[TrainState, list]:
    """The step's state and batch leaves as shapes with their shardings (nothing allocated)."""
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    params = jax.tree_util.tree_map(sds, self._layout.shapes(), self._parts.params)
    opt_state = jax.tree_util.tree_map(sds, self._parts.opt_shapes, self._parts.opt)
    batch = [jax.ShapeDtypeStruct((self.batch_size,) + tuple(x.shape[1:]), x.dtype,
                                  sharding=self._parts.batch)
             for x in self._traced.spec.batch]
    return TrainState(params, opt_state, self), batch

  def params(self, state: TrainState) -> Any:
    """The parameters as the user's original pytree, gathered."""
    return jax.tree_util.tree_unflatten(self._traced.param_tree, self._unpack(state.params))

  # -- the canonical layout (checkpoints) ---------------------------------------

  def _canonical_shardings(self) -> list[NamedSharding]:
    """Per parameter leaf: sharded over all the step's devices along its first dimension
    that divides evenly (replicated when none does), so that each process holds and
    writes only its part of a checkpoint."""
    return [NamedSharding(self.mesh, self._spread_spec(np.shape(x)))
            for _, x in self._traced.param_leaves]

  def _spread_spec(self, shape: tuple) -> P:
    """An array sharded over all the step's devices along its first dimension that
    divides evenly, or replicated when none does."""
    n = self.mesh.devices.size
    axis = next((i for i, d in enumerate(shape) if d % n == 0), None)
    return P() if axis is None else P(*([None] * axis + [tuple(self.mesh.axis_names)]))

  def canonical(self, state: TrainState) -> dict:
    """`{"params": ..., "opt_state": ...}` in the user's pytree layout, whatever the strategy.

    Optimizer-state entries shaped like the parameter buffers (adam's mu, nu, ...)
    become parameter pytrees; the rest (counts) stay as they are. Leaves are
    sharded over the step's devices (see `_canonical_shardings`).
    """
    if self._to_canonical is None:
      self._to_canonical = jax.jit(self._layout.unpack, out_shardings=self._canonical_shardings())
    tree = lambda b: jax.tree_util.tree_unflatten(self._traced.param_tree, self._to_canonical(b))
    opt = jax.tree_util.tree_map(lambda b: tree(b) if _is_buffers(b) else b,
                                 state.opt_state, is_leaf=_is_buffers)
    return {"params": tree(state.params), "opt_state": opt}

  def from_canonical(self, tree: dict) -> TrainState:
    """The inverse of `canonical`, partitioned for this step's strategy."""
    outer = jax.tree_util.tree_structure(self._parts.opt, is_leaf=_is_buffers)
    parts = outer.flatten_up_to(tree["opt_state"])
    shards = outer.flatten_up_to(self._parts.opt)
    # Copies (may_alias=False): the tree may hold a live state's arrays (`canonical` passes
    # counts through), and a step donates its state.
    opt = [self._pack_opt(self._onto_mesh(jax.tree_util.tree_leaves(x))) if _is_buffers(sh)
           else jax.device_put(x, sh, may_alias=False) for x, sh in zip(parts, shards)]
    leaves = jax.tree_util.tree_leaves(tree["params"])
    return TrainState(self._pack(self._onto_mesh(leaves)), outer.unflatten(opt), self)

  def canonical_shapes(self) -> dict:
    """Shapes and dtypes of `canonical(state)` (replicated on this step's mesh), for restoring."""
    replicated = NamedSharding(self.mesh, P())
    sds = lambda x, sh: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sh)
    params = jax.tree_util.tree_unflatten(
        self._traced.param_tree,
        [sds(x, sh) for (_, x), sh in zip(self._traced.param_leaves, self._canonical_shardings())])
    opt = jax.tree_util.tree_map(
        lambda b, sh: params if _is_buffers(b) else sds(b, replicated if b.ndim == 0 else sh),
        self._parts.opt_shapes, self._parts.opt, is_leaf=_is_buffers)
    return {"params": params, "opt_state": opt}


def _is_buffers(x) -> bool:
  return isinstance(x, Buffers)


def _platform(platform: str | None, device: jax.Device) -> str:
  """The platform a step is built for: `platform` if given, else `device`'s."""
  if platform is None:
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
  if platform not in ("cpu", "gpu"):
    raise ValueError(f"platform must be 'cpu' or 'gpu' (or None: the devices'), got {platform!r}")
  return platform


def compile(loss_fn: Callable, optimizer: optax.GradientTransformation, directives,
            params: Any, example_batch: Any, devices: Sequence[jax.Device] | None = None,
            options: LoweringOptions | None = None, *, has_aux: bool = False,
            remat: bool | None = None, compiler_options: dict | None = None,
            platform: str | None = None) -> TrainStep:
  """Compiles a training step of `loss_fn(params, batch)` under a directive list.

  Args:
    loss_fn: the mean loss over the batch's leading axis, with `pj.annotate` regions.
    has_aux: `loss_fn` returns `(loss, aux)`, as for `jax.value_and_grad(has_aux=True)`:
      aux a pytree of float scalars, per-batch means (metrics), which the step combines
      over microbatches and replicas as it does the loss and returns as `(loss, aux)`.
    optimizer: any optax transformation (see `TrainStep.leaf_update`).
    directives: a list of directives, Piper JSON dicts, or a path to a Piper JSON file.
    params: the parameters (or their shapes) the step will train.
    example_batch: a batch (or its shapes) with the global batch size.
    devices: the devices directive indices refer to; default `jax.devices()`.
    options: a `LoweringOptions`, every switch of how the plan is lowered; None takes
      the defaults. None of them changes the numbers.
    remat, compiler_options: shorthands for the options of those names, which
      they replace when given.
    platform: "cpu" or "gpu", the platform whose program to build; None: the devices'.
      A GPU's step built on CPU devices runs there (refused where it holds bf16 GEMMs
      writing fp32, which the CPU cannot run) and `step.lower` lowers it for CUDA: the
      program a GPU would run, read on a machine without one.

  Returns:
    A `TrainStep`.
  """
  given = {k: v for k, v in (("remat", remat), ("compiler_options", compiler_options))
           if v is not None}
  options = dataclasses.replace(LoweringOptions.checked(options), **given)
  with _collector_paused():
    return TrainStep(loss_fn, optimizer, directives, params, example_batch, devices, options,
                     has_aux, platform)
