"""`calibrate`: each region's forward and backward timed on one device, for the
simulator and `strategies.search` (measured task costs instead of FLOP counts).

A region's F is what a pipeline task runs (its traced vjp, keeping its residuals); its B
takes F's residuals and the output cotangents to the parameter and input gradients, and
its BI to the input cotangents alone (BW is the rest of B).
Both are compiled alone with `jax.jit` at a microbatch's rows and timed, at one or
several row counts; other microbatch sizes are interpolated between them, or scaled in
proportion beyond them (`RegionTimes.costs`). Given the optimizer, its
update is timed too, per parameter byte (memory-bound, what ZeRO and expert parallelism
divide). A JSON file (`cache`) keeps them per device kind, rows and region program, so
a machine measures a model once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from piper_jax.lowering import (RegionRunner, backward_input, full_residuals, region_backward,
                                region_forward, shared_analyses, split_backward, trace_loss)

__all__ = ["RegionTimes", "calibrate"]


@dataclasses.dataclass(frozen=True)
class RegionTimes:
  """Seconds of each region's F and B at `rows` rows of a microbatch on one device.

  Attributes:
    device_kind: the device they were measured on.
    rows: the microbatch rows they were measured at.
    forward, backward: region index -> seconds of its F and of its B.
    backward_input: region index -> seconds of its BI (the input cotangents alone, as
      zero-bubble schedules run it); its BW is the rest of B. Empty: half of B each.
    update_s_per_byte: seconds of the optimizer's update per byte of parameters it
      updates (0: not measured, no optimizer given).
    other_rows: the same measured at other microbatch rows (`calibrate` given several):
      `costs` interpolates between the two nearest, since a small microbatch's kernels
      run below a large one's speed per row.
  """

  device_kind: str
  rows: int
  forward: Mapping[int, float]
  backward: Mapping[int, float]
  backward_input: Mapping[int, float] = dataclasses.field(default_factory=dict)
  update_s_per_byte: float = 0.0
  other_rows: tuple["RegionTimes", ...] = ()

  def _own_costs(self, scale: float) -> dict:
    """This measurement's task seconds, times `scale`."""
    out: dict = {}
    for r, t in self.forward.items():
      out[(r, "F")] = t * scale
    for r, t in self.backward.items():
      out[(r, "B")] = t * scale
      if r in self.backward_input:
        bi = min(self.backward_input[r], t)
        out[(r, "BI")], out[(r, "BW")] = bi * scale, (t - bi) * scale
    return out

  def costs(self, rows: int, comm: float = 0.0) -> dict:
    """`Plan.simulate` costs at `rows` rows per microbatch: {(region, pass): seconds},
    and "comm" (a message's latency). Between two measured row counts each task's
    seconds are interpolated linearly; beyond them, scaled in proportion to the rows
    from the nearest."""
    points = sorted((self, *self.other_rows), key=lambda t: t.rows)
    below = [t for t in points if t.rows <= rows]
    above = [t for t in points if t.rows >= rows]
    if not below or not above or below[-1].rows == above[0].rows:
      near = above[0] if not below else below[-1]
      out = near._own_costs(rows / near.rows)
    else:
      lo, hi = below[-1], above[0]
      w = (rows - lo.rows) / (hi.rows - lo.rows)
      a, b = lo._own_costs(1.0), hi._own_costs(1.0)
      out = {k: (1 - w) * a[k] + w * b.get(k, a[k]) for k in a}
    out["comm"] = comm
    return out


def _rows_of(batch: Any, rows: int) -> Any:
  """The batch's first `rows` rows, as shapes."""
  def cut(x):
    shape = tuple(np.shape(x))
    if not shape or shape[0] < rows:
      raise ValueError(f"calibrate: every batch leaf needs >= {rows} rows on its leading "
                       f"axis, got shape {shape}; pass a smaller `rows` or a larger batch")
    return jax.ShapeDtypeStruct((rows,) + shape[1:], jnp.result_type(x))
  return jax.tree_util.tree_map(cut, batch)


# Integers (token ids, labels) of a batch given as shapes are drawn below this bound:
# in range for any vocabulary the test models use, and spread over enough rows that an
# embedding's scatter-add gradient does not serialize on one row as all-zero ids would.
_INT_BOUND = 256
# Part of a cached timing's key: timings made otherwise (each call waited for, all-zero
# ids) do not match.
_METHOD = (f"calls back to back; ints below {_INT_BOUND} or the batch's own; activations "
           f"from the regions before")


def _filled(avals, key, device, given: list | None = None) -> list:
  """Arrays of `avals` on `device`: `given` arrays where there are any (a concrete
  batch's rows), else small random floats, and small random integers where `given`
  is a list (batch leaves) and zeros elsewhere (indices between regions, whose range
  only the model knows)."""
  out = []
  for i, a in enumerate(avals):
    if given is not None and given[i] is not None:
      out.append(jax.device_put(jnp.asarray(given[i], a.dtype), device))
    elif jnp.issubdtype(a.dtype, jnp.floating):
      x = 0.02 * jax.random.normal(jax.random.fold_in(key, i), a.shape, jnp.float32)
      out.append(jax.device_put(x.astype(a.dtype), device))
    elif given is not None and jnp.issubdtype(a.dtype, jnp.integer):
      x = jax.random.randint(jax.random.fold_in(key, i), a.shape, 0, _INT_BOUND)
      out.append(jax.device_put(x.astype(a.dtype), device))
    else:
      out.append(jax.device_put(jnp.zeros(a.shape, a.dtype), device))
  return out


def _batch_rows(example_batch: Any, rows: int) -> list:
  """The batch's leaves cut to `rows` rows where they hold values, None for shapes."""
  return [None if isinstance(x, jax.ShapeDtypeStruct) else np.asarray(x)[:rows]
          for x in jax.tree_util.tree_leaves(example_batch)]


def _seconds(fn: Callable, args: tuple, repeats: int) -> float:
  """Seconds per call of `fn(*args)` after one compiling call: the median of three
  rounds of `repeats` calls dispatched back to back, as a step's tasks follow each
  other on the device (waiting after each call would add the host's launch to it)."""
  jax.block_until_ready(fn(*args))
  rounds = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(repeats):  # each output dropped as the next call is dispatched
      out = fn(*args)
    jax.block_until_ready(out)
    rounds.append((time.perf_counter() - t0) / repeats)
  return statistics.median(rounds)


# The most parameter elements the optimizer's update is timed on: 256 MiB of fp32, far
# beyond the caches, so that a large model's time per byte is the memory's.
_UPDATE_ELEMENTS = 1 << 26


def _update_seconds_per_byte(optimizer, params: Any, device, repeats: int, known: dict) -> float:
  """Seconds per parameter byte of `optimizer`'s update and apply on `device` (0.0 when
  it cannot be timed). The update is memory-bound, its time grows with the bytes whatever
  the leaves' shapes: it is timed on one leaf of the largest parameter's dtype, as many
  elements as the parameters (at most `_UPDATE_ELEMENTS`); an optimizer bound to the
  parameters' tree (labels or masks given as a pytree) on zeros of that tree, if small."""
  leaves = jax.tree_util.tree_leaves(params)
  total = sum(math.prod(x.shape) for x in leaves)
  dtype = max(leaves, key=lambda x: math.prod(x.shape)).dtype
  trees = [lambda: jnp.full((min(total, _UPDATE_ELEMENTS),), 0.01, dtype)]
  if total <= 4 * _UPDATE_ELEMENTS:
    trees.append(lambda: jax.tree_util.tree_map(lambda x: jnp.full(x.shape, 0.01, x.dtype), params))

  def step(p, s, g):
    u, s = optimizer.update(g, s, p)
    return optax.apply_updates(p, u), s

  for make in trees:
    try:
      x = jax.device_put(make(), device)
      state = jax.device_put(optimizer.init(x), device)
      jaxpr = jax.make_jaxpr(step)(x, state, x)
    except Exception:  # noqa: BLE001 - an optimizer that needs the parameters' own tree
      continue
    name = hashlib.sha256(repr((device.device_kind, _METHOD, "update", str(jaxpr))
                               ).encode()).hexdigest()
    if name not in known:
      nbytes = sum(y.size * y.dtype.itemsize for y in jax.tree_util.tree_leaves(x))
      known[name] = _seconds(jax.jit(step), (x, state, x), repeats) / nbytes
    return known[name]
  return 0.0


def calibrate(loss_fn: Callable, params: Any, example_batch: Any, rows: int | Sequence[int], *,
              device: Any = None, remat: bool = False, repeats: int = 5,
              cache: str | os.PathLike | None = None,
              optimizer: optax.GradientTransformation | None = None) -> RegionTimes:
  """Times every region's F and B of `loss_fn` at `rows` rows on one device.

  Args:
    loss_fn, params, example_batch: as `pj.compile` takes them (shapes are enough);
      the batch's leading axis has at least `rows` rows. A batch with values is timed
      on its first rows (token ids decide how an embedding's gradient scatters);
      leaves given as shapes get small random values. Parameters are random; each
      region's activation inputs are what the regions before it made of them.
    rows: rows of one microbatch per device (e.g. the global batch over data-parallel
      replicas and microbatches), or several such counts: each is timed, and
      `RegionTimes.costs` interpolates between them (what a search over microbatch
      counts needs: small microbatches run below a large one's speed per row).
    device: where to time (default: the first device).
    remat: time F and B as `pj.compile(remat=...)` runs them (pipelines use True).
    repeats: timed calls per pass (the median counts).
    cache: a JSON file of earlier measurements: regions found there (same device kind,
      rows, remat and program) are not timed again; new ones are added.
    optimizer: the optimizer `pj.compile` takes; when given, its update is timed too
      (`RegionTimes.update_s_per_byte`, in the largest parameter leaf's dtype; 0 when
      neither one flat leaf nor a small enough copy of the parameters takes it).

  Returns:
    `RegionTimes`; `RegionTimes.costs(rows)` goes to `plan.simulate`, and
    `CostModel(region_times=...)` to `strategies.search`.
  """
  counts = [rows] if isinstance(rows, int) and not isinstance(rows, bool) else list(rows)
  if not counts or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in counts):
    raise ValueError(f"rows must be an int >= 1 or a non-empty list of them, got {rows!r}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats!r}")
  device = device or jax.devices()[0]
  known = {}
  if cache and os.path.exists(cache):
    with open(cache) as fh:
      known = json.load(fh)
  timed = [_time_regions(loss_fn, params, example_batch, r, device, remat, repeats, known)
           for r in sorted(set(counts))]
  update = 0.0
  if optimizer is not None:
    update = _update_seconds_per_byte(optimizer, params, device, repeats, known)
  if cache:
    with open(cache, "w") as fh:
      json.dump(known, fh, indent=1)
  first = next(t for t in timed if t.rows == counts[0])
  return dataclasses.replace(first, update_s_per_byte=update,
                             other_rows=tuple(t for t in timed if t is not first))


def _time_regions(loss_fn: Callable, params: Any, example_batch: Any, rows: int, device,
                  remat: bool, repeats: int, known: dict) -> RegionTimes:
  """`calibrate` at one row count (`known`: the cache's timings, updated)."""
  traced = trace_loss(loss_fn, params, _rows_of(example_batch, rows))
  batch_rows = _batch_rows(example_batch, rows)
  runner = RegionRunner(traced)
  forward, backward, inputs_only = {}, {}, {}
  key = jax.random.PRNGKey(0)
  regions = traced.spec.regions
  # A region that traces like an earlier one (a model's equal blocks) shares its analysis,
  # and with it its name: it is timed once.
  analysed = shared_analyses(runner, [spec.index for spec in regions], remat)
  ads = [analysed[spec.index] for spec in regions]
  names = [hashlib.sha256(repr((device.device_kind, rows, remat, _METHOD, str(ad.jaxpr))
                               ).encode()).hexdigest() for ad in ads]
  # Each region is timed on what the regions before it made of random parameters and
  # the batch's rows, in trace order: values of the model's own range (the token
  # slots an expert dispatch gathers by; zeros would pile every scatter-add of their
  # backward onto one row). A value is dropped after its last reader.
  last_read = {(x.region, x.output): spec.index for spec in regions for x in spec.inputs}
  values: dict = {}
  timing = any(name not in known for name in names)
  for spec, ad, name in zip(regions, ads, names):
    r = spec.index
    p_avals, b_avals, a_avals = runner.avals(r)
    given = [None, [batch_rows[i] for i in spec.batch],
             [values.get((x.region, x.output)) for x in spec.inputs], None]
    if timing and any(ref[0] == r for ref in last_read):
      region_in = [_filled(avals, jax.random.fold_in(key, n), device, given[n])
                   for n, avals in enumerate((p_avals, b_avals, a_avals))]
      outs = jax.jit(lambda p, b, a, r=r: runner.run(r, p, b, a))(*region_in)
      values.update(((r, k), o) for k, o in enumerate(outs) if (r, k) in last_read)
    for ref in [ref for ref, reader in last_read.items() if reader == r]:
      values.pop(ref, None)
    if name in known:
      forward[r], backward[r], inputs_only[r] = known[name]
      continue
    outs = runner.out_avals(r)
    ct_avals = [outs[k] for k in ad.float_outs]
    split = split_backward(ad, ct_avals)
    inputs = tuple(_filled(avals, jax.random.fold_in(key, n), device, given[n])
                   for n, avals in enumerate((p_avals, b_avals, a_avals, ct_avals)))

    def fwd(p, b, a):
      return region_forward(ad, p, b, a)

    def fwd_bwd(p, b, a, cts):
      out, stored = region_forward(ad, p, b, a)
      return region_backward(split, full_residuals(ad, stored, p, b, a, out), cts)

    def fwd_bi(p, b, a, cts):
      out, stored = region_forward(ad, p, b, a)
      return backward_input(split, full_residuals(ad, stored, p, b, a, out), cts)

    f = _seconds(jax.jit(fwd), inputs[:3], repeats)
    fb = _seconds(jax.jit(fwd_bwd), inputs, repeats)
    fbi = _seconds(jax.jit(fwd_bi), inputs, repeats)
    # B is what F + B adds to F, BI what F + BI adds; a floor keeps a region whose
    # backward fuses away positive.
    forward[r], backward[r] = f, max(fb - f, 0.1 * f)
    inputs_only[r] = min(max(fbi - f, 0.05 * f), backward[r])
    known[name] = [forward[r], backward[r], inputs_only[r]]
  return RegionTimes(device.device_kind, rows, forward, backward, inputs_only)
