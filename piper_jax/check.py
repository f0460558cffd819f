"""`check`: runs a compiled strategy next to the plain computation and compares the numbers.

In float32 the strategy must give plain JAX's numbers to tight tolerances. In reduced
precision (bfloat16 compute, or float32 matrix products at an accelerator's TF32 default)
two correct computations differ by their rounding, so both the strategy and plain JAX are
judged against a float32 run of the same model at the highest matrix precision: a leaf
passes when the strategy's error is within a small factor of plain JAX's own.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from piper_jax.memory import CompiledMemory
from piper_jax.precision import precision_of, widen

__all__ = ["CheckReport", "check", "FP32_RTOL", "FP32_LOSS_RTOL", "LOW_PRECISION_FACTOR",
           "ROUNDOFF"]

FP32_RTOL = 1e-4
FP32_LOSS_RTOL = 1e-5
# A reduced-precision leaf passes when its error from the float32 run is at most this many
# times plain JAX's, plus the format's unit roundoff.
LOW_PRECISION_FACTOR = 2.0
ROUNDOFF = {"bf16": 2.0 ** -8, "tf32": 2.0 ** -11}
_N_WORST = 5
_N_FAILURES_SHOWN = 10
# A leaf counts as frozen when the strategy moved it less than this fraction of what
# the reference moved it.
_FROZEN_FRACTION = 1e-2
# Adam steps every element by about the learning rate whatever its gradient's size, in
# the gradient's direction: where the gradient is at the level of rounding (an attention
# key bias, which softmax ignores), that direction is noise. Parameter comparisons leave
# out elements whose reference gradient is within this many times the leaf's RMS
# gradient error of zero.
_NOISE_MULTIPLE = 4.0


@dataclasses.dataclass(frozen=True)
class CheckReport:
  """What `check` found.

  The reference is plain JAX in float32, and the float32 run of the same model in reduced
  precision (where `plain_*` hold plain JAX's own distance from it).

  Attributes:
    losses: the strategy's loss at each step.
    reference_losses: the reference's loss at each step.
    loss_rel_diff: the largest |strategy - reference| / |reference| over the steps.
    leaves: per parameter leaf (named by `jax.tree_util.keystr`), the relative
      difference ||strategy - reference|| / ||reference|| after the last step, over the
      elements whose gradient is clear of rounding noise (see `left_out`). The norm
      divided by is at least that of a leaf as large whose elements have the model's
      RMS size: a leaf that starts at zero (a bias) is no larger than its updates.
    left_out: per leaf, the fraction of its elements left out of `leaves`: those whose
      reference gradient is within 4x the leaf's RMS gradient error of zero, which Adam
      steps in a direction set by rounding (all zero without the SGD check).
    worst: the 5 leaves of `leaves` nearest to failing or past it, worst first (frozen
      leaves before all).
    frozen: leaves the reference moved and the strategy did not (1% of its move or less).
    grad_leaves: per leaf, the relative difference of the gradient read off one SGD
      step of the strategy from the reference's gradient (divided by at least the norm
      of a leaf as large with the model's RMS gradient: a gradient that cancels to
      rounding level is noise); None without the SGD check.
    worst_grads: the worst leaves of `grad_leaves`, worst first (empty without it).
    rtol: the tolerance on parameters and gradients: alone in float32, added to
      `factor` times plain JAX's error in reduced precision.
    loss_rtol: the tolerance on losses, likewise.
    precision: "fp32"; "bf16" when a parameter or a value the loss computes is narrower
      than float32 (bfloat16, float16); "tf32" when float32 matrix products run at the
      accelerator's default precision (TF32 on NVIDIA GPUs, bfloat16 passes on TPUs).
    reference: where plain JAX ran: "one_device" or "jit".
    failures: one line per failed comparison; empty when the check passed.
    passed: True when every comparison is within tolerance and no leaf is frozen.
    factor: in reduced precision, how many times plain JAX's error the strategy's may
      be; None in float32.
    plain_losses: in reduced precision, plain JAX's losses (`reference_losses` are the
      float32 run's); else None.
    plain_loss_rel_diff: plain JAX's `loss_rel_diff`; None in float32.
    plain_leaves: plain JAX's `leaves`; None in float32.
    plain_grad_leaves: plain JAX's `grad_leaves`; None in float32 or without the SGD
      check.
    slices: how many equal slices of the batch the references accumulated gradients
      over (1: the whole batch at once), to fit the device.
    aux_rel_diff: for a step compiled with `has_aux`, per aux leaf, the largest relative
      difference from the reference over the steps (judged as the loss is).
  """

  losses: tuple[float, ...]
  reference_losses: tuple[float, ...]
  loss_rel_diff: float
  leaves: dict[str, float]
  left_out: dict[str, float]
  worst: tuple[tuple[str, float], ...]
  frozen: tuple[str, ...]
  grad_leaves: dict[str, float] | None
  worst_grads: tuple[tuple[str, float], ...]
  rtol: float
  loss_rtol: float
  precision: str
  reference: str
  failures: tuple[str, ...]
  passed: bool
  factor: float | None = None
  plain_losses: tuple[float, ...] | None = None
  plain_loss_rel_diff: float | None = None
  plain_leaves: dict[str, float] | None = None
  plain_grad_leaves: dict[str, float] | None = None
  slices: int = 1
  aux_rel_diff: dict[str, float] = dataclasses.field(default_factory=dict)

  def __str__(self) -> str:
    where = {"one_device": "one device", "jit": "jax.jit over the same devices"}[self.reference]
    verdict = f"check {'PASSED' if self.passed else 'FAILED'}"
    if self.factor is None:
      lines = [f"{verdict}: strategy vs plain JAX on {where}, fp32 tolerances (parameters "
               f"and gradients {self.rtol:.0e}, losses {self.loss_rtol:.0e})",
               f"{'step':>6}  {'loss':>14}  {'reference':>14}  {'rel diff':>9}"]
      for i, (a, b) in enumerate(zip(self.losses, self.reference_losses)):
        lines.append(f"{i + 1:>6}  {a:>14.7g}  {b:>14.7g}  {_rel(a, b):>9.2e}")
    else:
      lines = [f"{verdict}: strategy and plain JAX ({self.precision}, on {where}) against "
               f"a float32 run at the highest matrix precision; each passes within "
               f"{self.factor:g}x plain JAX's error + {self.rtol:.1e}",
               f"{'step':>6}  {'loss':>14}  {'plain JAX':>14}  {'float32':>14}  "
               f"{'error':>9}  {'plain err':>9}"]
      for i, (a, p, b) in enumerate(zip(self.losses, self.plain_losses, self.reference_losses)):
        lines.append(f"{i + 1:>6}  {a:>14.7g}  {p:>14.7g}  {b:>14.7g}  {_rel(a, b):>9.2e}  "
                     f"{_rel(p, b):>9.2e}")
    if self.aux_rel_diff:
      lines.append("aux, largest rel diff over the steps: " + ", ".join(
          f"{n} {d:.2e}" for n, d in self.aux_rel_diff.items()))
    if self.slices > 1:
      lines.append(f"(the references accumulated gradients over {self.slices} slices of "
                   f"the batch to fit the device)")
    width = max([len(n) for n, _ in self.worst + self.worst_grads] + [4])
    lines.append(f"worst parameters after {len(self.losses)} step(s) "
                 f"(||strategy - reference|| / ||reference||):")
    mark = lambda n: ("  FROZEN" if n in self.frozen else
                      f"  ({self.left_out[n]:.1%} of elements at gradient noise left out)"
                      if self.left_out.get(n) else "")
    lines += [f"  {n:<{width}}  {d:.2e}{self._against(self.plain_leaves, n, d)}{mark(n)}"
              for n, d in self.worst]
    if self.grad_leaves is not None:
      lines.append("worst gradients (one SGD step):")
      lines += [f"  {n:<{width}}  {d:.2e}{self._against(self.plain_grad_leaves, n, d)}"
                for n, d in self.worst_grads]
    if self.failures:
      lines.append("failures:")
      lines += [f"  {f}" for f in self.failures[:_N_FAILURES_SHOWN]]
      if len(self.failures) > _N_FAILURES_SHOWN:
        lines.append(f"  ... and {len(self.failures) - _N_FAILURES_SHOWN} more (.failures)")
    return "\n".join(lines)

  @staticmethod
  def _against(plain: dict[str, float] | None, name: str, d: float) -> str:
    if plain is None:
      return ""
    return f"  plain JAX {plain[name]:.2e}  ({_ratio(d, plain[name])})"


def _tolerances(precision: str, rtol: float | None) -> tuple[float, float]:
  """(parameters' and gradients' rtol, the loss's rtol): `rtol` if given, else the
  precision's rounding (reduced precision) or float32's defaults."""
  if precision != "fp32":
    tol = rtol if rtol is not None else ROUNDOFF[precision]
    return tol, tol
  return (rtol if rtol is not None else FP32_RTOL,
          rtol if rtol is not None else FP32_LOSS_RTOL)


def _run_strategy(step, params, batches: list, has_aux: bool) -> tuple[list, list]:
  """The strategy's run: per step its loss then aux leaves, and its parameters, moved to
  the host before the references run, so that they do not share device memory with
  its state."""
  state = step.init(params)
  reported = []
  for b in batches:
    state, out = step(state, b)
    reported.append(_reported(out, has_aux))
  got = _host(step.params(state))
  del state
  return reported, got


def _judge_reported(reported: list, ref: list, plain: list | None, aux_names: list,
                    rtol: float, factor: float, failures: list) -> tuple:
  """Relative differences of the losses (and the aux leaves, judged as the loss is)
  from the reference's; `plain`: plain JAX's in reduced precision, whose error scales
  the limit. Adds what fails to `failures`. Returns (per step, plain JAX's per step or
  None, aux name -> worst)."""
  def judge(what, a, b, pl):
    d, plain_d = _rel(a, b), (None if pl is None else _rel(pl, b))
    if not d <= rtol + (0.0 if plain_d is None else factor * plain_d):  # NaN fails too
      failures.append(f"{what}: {a:.7g} vs {b:.7g}: " + _verdict(d, plain_d, factor, rtol))
    return d, plain_d

  rel, plain_rel = [], []
  for i in range(len(reported)):
    d, plain_d = judge(f"loss at step {i + 1}", reported[i][0], ref[i][0],
                       None if plain is None else plain[i][0])
    rel.append(d)
    plain_rel.append(plain_d)
  aux_rel: dict[str, float] = {}
  for j, name in enumerate(aux_names, start=1):
    for i in range(len(reported)):
      d, _ = judge(f"{name} at step {i + 1}", reported[i][j], ref[i][j],
                   None if plain is None else plain[i][j])
      aux_rel[name] = max(aux_rel.get(name, 0.0), d, key=_nan_first)
  return rel, (plain_rel if plain is not None else None), aux_rel


def _judge_leaves(table: dict, plain_table: dict | None, frozen, what: str, rtol: float,
                  factor: float, failures: list) -> None:
  """Adds to `failures` each leaf of `table` (relative differences) over its limit:
  `rtol`, plus `factor` times plain JAX's difference in reduced precision."""
  for k, d in table.items():
    plain_d = None if plain_table is None else plain_table[k]
    if k not in frozen and not d <= rtol + (0.0 if plain_d is None else factor * plain_d):
      failures.append(f"{what}{k}: " + _verdict(d, plain_d, factor, rtol))


def check(step, params: Any, batch: Any, steps: int = 2, reference: str = "auto",
          rtol: float | None = None, sgd: bool = True, loss_fn: Callable | None = None,
          optimizer: optax.GradientTransformation | None = None,
          fp32_loss_fn: Callable | None = None, factor: float = LOW_PRECISION_FACTOR,
          slices: int | None = None) -> CheckReport:
  """Runs a compiled step and the plain computation from the same parameters and compares.

  Plain JAX is `jax.value_and_grad(loss_fn)` + `optimizer.update` + `optax.apply_updates`
  under `jax.jit`, either on one device or over the step's devices with each parameter
  sharded along its first dimension that divides (plain `jax.jit` partitions it; for
  models that do not fit one device). With `sgd`, the strategy is compiled a second time
  with `optax.sgd` (`step.with_optimizer`) and its one update is compared with the
  reference's gradient: Adam and global-norm clipping hide a gradient off by a constant
  factor, which plain SGD shows.

  In float32 a leaf passes when ||strategy - plain|| <= rtol * ||plain||, where the norm
  divided by is at least that of a leaf as large with the model's RMS element: a bias
  that starts at zero is only as large as its updates, which are noisy. In reduced
  precision both the strategy and plain JAX are compared with a float32 run of the same
  model (`fp32_loss_fn`, at the highest matrix precision) and a leaf passes when the
  strategy's error is at most `factor` times plain JAX's plus `rtol`. Parameters are
  compared over the elements whose gradient is clear of rounding noise, since Adam makes
  a full step in a direction set by the noise elsewhere (an attention key bias, which
  softmax ignores). A leaf the reference moved and the strategy did not fails at any
  tolerance. Runs in one process: results are compared on the host.

  Args:
    step: a `TrainStep` (from `pj.compile`), or anything with its `init`, `__call__`,
      `params`, `with_optimizer` (for the SGD check), `devices` and, unless given below,
      `loss_fn` and `optimizer`: the step judged.
    params: the parameters to start both runs from (not modified).
    batch: one batch, used at every step, or a list or iterator of batches (the first
      `steps` are used).
    steps: the number of training steps to compare.
    reference: "one_device", "jit", or "auto": one device when the parameters, their
      gradients and the optimizer state take at most half of its memory (or its memory
      is unknown), else "jit".
    rtol: float32: the tolerance on parameters and gradients (default 1e-4; losses 1e-5).
      Reduced precision: the floor added to `factor` times plain JAX's error (default the
      format's unit roundoff, 2**-8 for bfloat16, 2**-11 for TF32).
    sgd: also compare one SGD step's gradients (compiles the strategy a second time).
    loss_fn: the plain computation's loss; default `step.loss_fn`.
    optimizer: the plain computation's optimizer; default `step.optimizer`.
    fp32_loss_fn: the same loss computed in float32 (the model built with
      dtype=float32), the truth a reduced-precision step is judged against; default
      `loss_fn` with every narrow value widened (`piper_jax.precision.widen`).
    factor: how many times plain JAX's reduced-precision error the strategy's may be.
    slices: the references accumulate gradients over this many equal slices of the
      batch (a plain `lax.scan`); None: as few as XLA's count of the compiled
      reference says fit the device's free memory (1 where memory is unknown, as on the
      CPU).

  Returns:
    A `CheckReport`; `print` it for a table, test `.passed`.

  (Over 80 lines for its arguments' documentation; its phases are the helpers above.)
  """
  if reference not in ("auto", "one_device", "jit"):
    raise ValueError(f"reference must be 'auto', 'one_device' or 'jit', got {reference!r}")
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  if jax.process_count() > 1:
    raise ValueError("check runs in one process: it reads both runs' parameters on the host")
  loss_fn = loss_fn if loss_fn is not None else getattr(step, "loss_fn", None)
  if loss_fn is None:
    raise ValueError("the step does not keep its loss function; pass loss_fn=")
  tx = optimizer if optimizer is not None else step.optimizer
  batches = _batches(step, batch, steps)
  devices = list(step.mesh.devices.flat) if hasattr(step, "mesh") else list(step.devices)
  if reference == "auto":
    reference = "one_device" if _fits_one_device(params, tx, jax.local_devices()[0]) else "jit"
  precision = precision_of(loss_fn, params, batches[0], devices[0].platform)
  low = precision != "fp32"
  p_rtol, l_rtol = _tolerances(precision, rtol)

  keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  start = _host(params)

  has_aux = getattr(step, "has_aux", False)
  reported, got = _run_strategy(step, params, batches, has_aux)

  placement = _placement(reference, devices)
  plain = _Reference(loss_fn, tx, placement, highest=False, has_aux=has_aux)
  truth = plain
  if low:
    wide = fp32_loss_fn if fp32_loss_fn is not None else widen(loss_fn)
    to32 = lambda t: jax.tree_util.tree_map(
        lambda x: x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)
    truth = _Reference(wide, tx, placement, highest=True, cast=to32, has_aux=has_aux)
  n = slices or truth.slices_that_fit(params, batches[0])
  plain_reported, plain_params, plain_grads = plain.train(params, batches, n)
  ref_reported, ref_params, ref_grads = (truth.train(params, batches, n) if low else
                                         (plain_reported, plain_params, plain_grads))
  losses, ref_losses, plain_losses = ([r[0] for r in rs]
                                      for rs in (reported, ref_reported, plain_reported))

  grad_leaves = plain_grad_leaves = None
  keep = [None] * len(keys)
  if sgd:
    implied = _sgd_gradient(step, params, batches[0], start, plain_grads)
    grad_leaves = dict(zip(keys, _rel_leaves(implied, ref_grads)))
    # Noise is what rounding does to the gradient: plain JAX's in reduced precision
    # (whatever the strategy does), the strategy's own distance in float32.
    noisy = plain_grads if low else implied
    keep = [np.abs(np.asarray(g, np.float64)) > _NOISE_MULTIPLE * _rms([a - g])
            if _rms([a - g]) > 0 else None for a, g in zip(noisy, ref_grads)]
    if low:
      plain_grad_leaves = dict(zip(keys, _rel_leaves(plain_grads, ref_grads)))

  failures = []
  aux_names = list(step.aux_names) if has_aux else []
  rel_losses, plain_rel, aux_rel = _judge_reported(
      reported, ref_reported, plain_reported if low else None, aux_names, l_rtol, factor,
      failures)
  leaves, left_out, frozen = _compare_params(keys, start, got, ref_params, keep, failures)
  plain_leaves = None
  if low:
    plain_leaves = _compare_params(keys, start, plain_params, ref_params, keep, [])[0]
  _judge_leaves(leaves, plain_leaves, frozen, "parameter ", p_rtol, factor, failures)
  if grad_leaves is not None:
    _judge_leaves(grad_leaves, plain_grad_leaves, (), "gradient of ", p_rtol, factor, failures)

  score = lambda table, plain_table: {
      k: d if plain_table is None else d / (p_rtol + factor * plain_table[k])
      for k, d in table.items()}
  return CheckReport(
      losses=tuple(losses), reference_losses=tuple(ref_losses),
      loss_rel_diff=max(rel_losses, key=_nan_first), leaves=leaves, left_out=left_out,
      worst=_worst(leaves, score(leaves, plain_leaves), first=frozen), frozen=frozen,
      grad_leaves=grad_leaves,
      worst_grads=_worst(grad_leaves, score(grad_leaves, plain_grad_leaves))
      if grad_leaves else (),
      rtol=p_rtol, loss_rtol=l_rtol, precision=precision, reference=reference,
      failures=tuple(failures), passed=not failures, factor=factor if low else None,
      plain_losses=tuple(plain_losses) if low else None,
      plain_loss_rel_diff=max(plain_rel, key=_nan_first) if low else None,
      plain_leaves=plain_leaves, plain_grad_leaves=plain_grad_leaves, slices=n,
      aux_rel_diff=aux_rel)


def _verdict(d: float, plain: float | None, factor: float, floor: float) -> str:
  """Why a comparison failed, in words."""
  if plain is None:
    return f"relative difference {d:.2e} > {floor:.0e}"
  return (f"{d:.2e} from the float32 run, plain JAX {plain:.2e} ({_ratio(d, plain)}) > "
          f"{factor:g}x plain JAX's + {floor:.1e}")


def _ratio(d: float, plain: float) -> str:
  return f"{d / plain:.2f}x" if plain > 0 else "plain JAX exact"


def _compare_params(keys, start, got, ref, keep, failures):
  """Per leaf: the relative difference over the kept elements, the fraction left out;
  and the frozen leaves.

  `keep[i]` is a boolean mask of leaf i's elements to compare, or None for all of them.
  Appends a line to `failures` for each frozen leaf.
  """
  rms = _rms(start)
  leaves, left_out, frozen = {}, {}, []
  for k, p0, a, b, mask in zip(keys, start, got, ref, keep):
    a, b, p0 = (np.asarray(x, np.float64) for x in (a, b, p0))
    moved, moved_ref = _norm(a - p0), _norm(b - p0)
    diff = _norm(a - b if mask is None else (a - b)[mask])
    left_out[k] = 1.0 - float(np.mean(mask)) if mask is not None and mask.size else 0.0
    leaves[k] = diff / max(_norm(b), rms * math.sqrt(b.size), _TINY)
    if moved_ref > 0 and moved <= _FROZEN_FRACTION * moved_ref:
      frozen.append(k)
      failures.append(f"parameter {k} is frozen: the reference moved it by {moved_ref:.2e}, "
                      f"the strategy by {moved:.2e}")
  return leaves, left_out, tuple(frozen)


# -- inputs ----------------------------------------------------------------------


def _batches(step, batch, steps: int) -> list:
  """One batch repeated `steps` times, or the first `steps` of a list or iterator."""
  if hasattr(batch, "__next__"):
    out = list(itertools.islice(batch, steps))
  else:
    structure = jax.tree_util.tree_structure
    tree = getattr(getattr(step, "_traced", None), "batch_tree", None)
    many = isinstance(batch, (list, tuple)) and len(batch) > 0
    if tree is not None:
      many = many and structure(batch) != tree and all(structure(b) == tree for b in batch)
    else:
      # Without the compiled structure: a list of like containers (a batch's own
      # top-level tuple holds arrays).
      many = many and all(not jax.tree_util.treedef_is_leaf(structure(b))
                          and structure(b) == structure(batch[0]) for b in batch)
    if not many:
      return [batch] * steps
    out = list(batch[:steps])
  if len(out) < steps:
    raise ValueError(f"{steps} steps need {steps} batches, got {len(out)}")
  return out


def _fits_one_device(params, tx, device) -> bool:
  """Whether parameters, gradients and optimizer state take at most half a device's memory."""
  limit = _memory_stats(device).get("bytes_limit")
  if not limit:
    return True
  nbytes = lambda t: sum(math.prod(np.shape(x)) * jnp.dtype(jnp.result_type(x)).itemsize
                         for x in jax.tree_util.tree_leaves(t))
  opt = jax.eval_shape(tx.init, jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params))
  return 2 * nbytes(params) + nbytes(opt) <= limit // 2


# -- the references --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Placement:
  """Where a reference runs: the sharding of each parameter (and optimizer state leaf)
  and of each batch leaf, by shape; `spread` when over several devices, whose jitted
  outputs are then constrained to those shardings too."""

  sharding: Callable  # leaf shape -> Sharding
  batch_sharding: Callable  # leaf shape -> Sharding
  device: Any  # the device whose free memory bounds the reference
  spread: bool

  def put(self, tree):
    # Copies: the reference's step donates its parameters, never the caller's arrays.
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, self.sharding(np.shape(x)), may_alias=False), tree)

  def put_batch(self, tree):
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, self.batch_sharding(np.shape(x))), tree)

  def constrain(self, tree):
    if not self.spread:
      return tree
    return jax.tree_util.tree_map(
        lambda x: jax.lax.with_sharding_constraint(x, self.sharding(x.shape)), tree)

  def shapes(self, tree, sharding: Callable | None = None):
    """`tree`'s leaves as `jax.ShapeDtypeStruct`s placed as `put` would place them."""
    sharding = sharding or self.sharding
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), jnp.result_type(x), sharding=sharding(np.shape(x))), tree)


def _placement(reference: str, devices: list) -> _Placement:
  if reference == "one_device":
    one = SingleDeviceSharding(jax.local_devices()[0])
    return _Placement(lambda shape: one, lambda shape: one, jax.local_devices()[0], False)
  mesh = Mesh(np.array(devices), ("d",))
  n = len(devices)

  def sharding(shape):
    # The first dimension that divides evenly, so that no device holds a whole weight.
    axis = next((i for i, d in enumerate(shape) if d % n == 0), None)
    return NamedSharding(mesh, P() if axis is None else P(*([None] * axis + ["d"])))

  def batch_sharding(shape):
    return NamedSharding(mesh, P("d") if shape[0] % n == 0 else P())

  return _Placement(sharding, batch_sharding, devices[0], True)


def _reported(out, has_aux: bool) -> tuple[float, ...]:
  """What a step reports, flat: the loss, then (`has_aux`) the aux leaves."""
  if not has_aux:
    return (float(out),)
  loss, aux = out
  return (float(loss), *(float(x) for x in jax.tree_util.tree_leaves(aux)))


def _value_and_grad(loss_fn: Callable, slices: int, has_aux: bool = False) -> Callable:
  """`jax.value_and_grad(loss_fn)` over the batch in `slices` equal slices, accumulated
  in float32 by a `lax.scan` (plain JAX's gradient accumulation); the value is the
  loss, then (`has_aux`) the aux leaves, as one float32 vector."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def whole(params, batch):
    value, grads = grad_fn(params, batch)
    leaves = [value[0], *jax.tree_util.tree_leaves(value[1])] if has_aux else [value]
    return jnp.stack([jnp.asarray(x, jnp.float32) for x in leaves]), grads

  if slices == 1:
    return whole

  def accumulated(params, batch):
    cut = jax.tree_util.tree_map(
        lambda x: x.reshape((slices, x.shape[0] // slices) + x.shape[1:]), batch)
    wide = lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), t)

    def body(total, piece):
      loss, grads = whole(params, piece)
      return jax.tree_util.tree_map(jnp.add, total, wide((loss, grads))), None

    value = jax.eval_shape(whole, params, jax.tree_util.tree_map(lambda x: x[0], cut))[0]
    zero = wide((jnp.zeros(value.shape), jax.tree_util.tree_map(jnp.zeros_like, params)))
    (loss, grads), _ = jax.lax.scan(body, zero, cut)
    grads = jax.tree_util.tree_map(lambda g, p: (g / slices).astype(p.dtype), grads, params)
    return loss / slices, grads

  return accumulated


@dataclasses.dataclass(frozen=True)
class _Reference:
  """Plain `jax.value_and_grad` + optimizer under `jax.jit`, as the check runs it."""

  loss_fn: Callable
  tx: optax.GradientTransformation
  placement: _Placement
  highest: bool  # float32 matrix products at the highest precision
  cast: Callable = lambda t: t  # applied to the parameters first
  has_aux: bool = False  # loss_fn returns (loss, aux)
  # Compiled steps by number of slices: the one `slices_that_fit` measured is the one run.
  _compiled: dict = dataclasses.field(default_factory=dict)

  def _precision(self):
    return jax.default_matmul_precision("highest" if self.highest else None)

  def _step(self, slices: int, params, opt_state, batch):
    """The step compiled for these shapes: (params, opt_state, batch) -> (params,
    opt_state, loss, grads)."""
    if slices not in self._compiled:
      vg, c = _value_and_grad(self.loss_fn, slices, self.has_aux), self.placement.constrain

      def train_step(params, opt_state, batch):
        loss, grads = vg(params, batch)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return c(optax.apply_updates(params, updates)), c(opt_state), loss, grads

      with self._precision():
        self._compiled[slices] = jax.jit(train_step, donate_argnums=(0, 1)).lower(
            params, opt_state, batch).compile()
    return self._compiled[slices]

  def _shapes(self, params, batch):
    """The step's arguments as placed shapes: nothing is allocated."""
    pl = self.placement
    params = jax.eval_shape(self.cast, params)
    opt_state = jax.eval_shape(self.tx.init, params)
    return pl.shapes(params), pl.shapes(opt_state), pl.shapes(batch, pl.batch_sharding)

  def slices_that_fit(self, params, batch) -> int:
    """A number of slices of the batch whose compiled step XLA counts as fitting the
    device's free memory (1 where the device does not say its memory).

    The steps on slices of one and two rows are compiled first: what a row adds gives
    each slicing's size, so the whole batch's step (a large float32 one can take minutes
    for XLA to try to fit) is compiled only where it should fit."""
    stats = _memory_stats(self.placement.device)
    size = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if not stats.get("bytes_limit") or size == 1:
      return 1
    free = 0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    args = self._shapes(params, batch)
    need = lambda n: CompiledMemory.of(self._step(n, *args)).total
    # Slices of one and of two rows: what a row of a slice adds.
    one = need(size)
    per_row = need(size // 2) - one if size % 2 == 0 else one
    for n in (d for d in range(1, size + 1) if size % d == 0):
      if n == size or one + per_row * (size // n - 1) <= free:
        if n == size or need(n) <= free:
          return n
        del self._compiled[n]
    return size

  def train(self, params, batches, slices: int):
    """`len(batches)` steps: per step what it reports (the loss, then the aux leaves),
    the parameters and the first step's gradient, on the host."""
    pl = self.placement
    step = self._step(slices, *self._shapes(params, batches[0]))
    params = pl.put(self.cast(params))
    with self._precision():
      opt_state = jax.jit(lambda p: pl.constrain(self.tx.init(p)))(params)
    losses, first = [], None
    for b in batches:
      params, opt_state, values, grads = step(params, opt_state, pl.put_batch(b))
      losses.append(tuple(float(x) for x in np.asarray(values)))
      first = _host(grads) if first is None else first
      del grads
    out = _host(params)
    del params, opt_state
    return losses, out, first


def _memory_stats(device) -> dict:
  """The device's allocator statistics; empty where the backend keeps none."""
  try:
    return device.memory_stats() or {}
  except Exception:  # backends without memory statistics
    return {}


def _sgd_gradient(step, params, batch, start: list, grads: list) -> list:
  """The gradient read off one SGD step of the strategy (`step.with_optimizer`)."""
  # A learning rate that makes the update as large as the parameters, so that reading
  # the gradient back as (before - after) / lr keeps the parameters' precision.
  g_norm = math.sqrt(sum(_norm(g) ** 2 for g in grads))
  p_norm = math.sqrt(sum(_norm(p) ** 2 for p in start))
  lr = p_norm / g_norm if g_norm > 0 and p_norm > 0 and math.isfinite(p_norm / g_norm) else 1.0
  sgd_step = step.with_optimizer(optax.sgd(lr))
  state, _ = sgd_step(sgd_step.init(params), batch)
  after = _host(sgd_step.params(state))
  del state
  return [(np.asarray(p0, np.float64) - np.asarray(p1, np.float64)) / lr
          for p0, p1 in zip(start, after)]


def _rel_leaves(got: list, ref: list) -> list[float]:
  """Per leaf ||got - ref|| / ||ref||, dividing by at least the norm of a leaf as large
  with the model's RMS element."""
  rms = _rms(ref)
  return [_norm(np.asarray(a, np.float64) - np.asarray(g, np.float64))
          / max(_norm(g), rms * math.sqrt(np.size(g)), _TINY) for a, g in zip(got, ref)]


# -- comparisons -----------------------------------------------------------------


_TINY = float(np.finfo(np.float32).tiny)


def _host(tree) -> list:
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _norm(x) -> float:
  """The 2-norm of a leaf, in float64."""
  x = np.asarray(x, np.float64).ravel()
  return math.sqrt(float(np.dot(x, x)))


def _rel(a: float, b: float) -> float:
  return abs(a - b) / max(abs(b), _TINY)


def _rms(leaves: list) -> float:
  """The root mean square over the elements of all the leaves."""
  n = sum(np.size(x) for x in leaves)
  return math.sqrt(sum(_norm(x) ** 2 for x in leaves) / max(n, 1))


def _nan_first(d: float) -> float:
  return math.inf if math.isnan(d) else d


def _worst(leaves: dict[str, float], scores: dict[str, float],
           first=()) -> tuple[tuple[str, float], ...]:
  """The `_N_WORST` leaves with the largest scores (NaN and the leaves named in `first`
  before the rest), with their values."""
  key = lambda k: (k not in first, -_nan_first(scores[k]))
  return tuple((k, leaves[k]) for k in sorted(leaves, key=key)[:_N_WORST])
