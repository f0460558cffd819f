"""`check`: runs a compiled strategy next to the plain computation and compares the numbers."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["CheckReport", "check", "FP32_RTOL", "FP32_LOSS_RTOL", "LOW_PRECISION_RTOL"]

FP32_RTOL = 1e-4
FP32_LOSS_RTOL = 1e-5
LOW_PRECISION_RTOL = 2e-2
_N_WORST = 5
_N_FAILURES_SHOWN = 10
# A leaf counts as frozen when the strategy moved it less than this fraction of what
# the reference moved it.
_FROZEN_FRACTION = 1e-2
# Adam steps every element by about the learning rate whatever its gradient's size, in
# the gradient's direction: where the gradient is at the level of rounding (an attention
# key bias, which softmax ignores), that direction is noise. Parameter comparisons leave
# out elements whose reference gradient is within this many times the leaf's RMS
# gradient difference (from the SGD check) of zero.
_NOISE_MULTIPLE = 4.0


@dataclasses.dataclass(frozen=True)
class CheckReport:
  """What `check` found.

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
      reference gradient is within 4x the leaf's RMS gradient difference of zero, which
      Adam steps in a direction set by rounding (all zero without the SGD check).
    worst: the 5 leaves of `leaves` with the largest difference, worst first (frozen
      leaves before all).
    frozen: leaves the reference moved and the strategy did not (1% of its move or less).
    grad_leaves: per leaf, the relative difference of the gradient read off one SGD
      step of the strategy from the reference's gradient (divided by at least the norm
      of a leaf as large with the model's RMS gradient: a gradient that cancels to
      rounding level is noise); None without the SGD check.
    worst_grads: the worst leaves of `grad_leaves`, worst first (empty without it).
    rtol: the tolerance on parameters and gradients.
    loss_rtol: the tolerance on losses.
    precision: "fp32"; "bf16" when a parameter or a value the loss computes is narrower
      than float32 (bfloat16, float16); "tf32" when float32 matrix products run at the
      accelerator's default precision (TF32 on NVIDIA GPUs, bfloat16 passes on TPUs).
      The last two take the low-precision tolerances.
    reference: "one_device" or "jit".
    failures: one line per failed comparison; empty when the check passed.
    passed: True when every comparison is within tolerance and no leaf is frozen.
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

  def __str__(self) -> str:
    where = {"one_device": "one device", "jit": "jax.jit over the same devices"}[self.reference]
    lines = [f"check {'PASSED' if self.passed else 'FAILED'}: strategy vs {where}, "
             f"{self.precision} tolerances (parameters and gradients {self.rtol:.0e}, "
             f"losses {self.loss_rtol:.0e})",
             f"{'step':>6}  {'loss':>14}  {'reference':>14}  {'rel diff':>9}"]
    for i, (a, b) in enumerate(zip(self.losses, self.reference_losses)):
      lines.append(f"{i + 1:>6}  {a:>14.7g}  {b:>14.7g}  {_rel(a, b):>9.2e}")
    width = max([len(n) for n, _ in self.worst + self.worst_grads] + [4])
    lines.append(f"worst parameters after {len(self.losses)} step(s) "
                 f"(||strategy - reference|| / ||reference||):")
    mark = lambda n: ("  FROZEN" if n in self.frozen else
                      f"  ({self.left_out[n]:.1%} of elements at gradient noise left out)"
                      if self.left_out.get(n) else "")
    lines += [f"  {n:<{width}}  {d:.2e}{mark(n)}" for n, d in self.worst]
    if self.grad_leaves is not None:
      lines.append("worst gradients (one SGD step):")
      lines += [f"  {n:<{width}}  {d:.2e}" for n, d in self.worst_grads]
    if self.failures:
      lines.append("failures:")
      lines += [f"  {f}" for f in self.failures[:_N_FAILURES_SHOWN]]
      if len(self.failures) > _N_FAILURES_SHOWN:
        lines.append(f"  ... and {len(self.failures) - _N_FAILURES_SHOWN} more (.failures)")
    return "\n".join(lines)


def check(step, params: Any, batch: Any, steps: int = 2, reference: str = "auto",
          rtol: float | None = None, sgd: bool = True, loss_fn: Callable | None = None,
          compile_kwargs: dict | None = None) -> CheckReport:
  """Runs a compiled step and the plain computation from the same parameters and compares.

  The reference is `jax.value_and_grad(loss_fn)` + `optimizer.update` +
  `optax.apply_updates` under `jax.jit`, either on one device or over the step's devices
  with each parameter sharded along its first dimension that divides (plain `jax.jit`
  partitions it; for models that do not fit one device). With `sgd`, a second step is
  compiled under the same directives with `optax.sgd` and its one update is compared with
  the reference's gradient: Adam and global-norm clipping hide a gradient off by a
  constant factor, which plain SGD shows.

  A leaf passes when ||strategy - reference|| <= rtol * ||reference||, where the norm
  divided by is at least that of a leaf as large with the model's RMS element: a bias
  that starts at zero is only as large as its updates, which are noisy. Parameters are
  compared over the elements whose gradient (from the SGD check) is clear of rounding
  noise, since Adam makes a full step in a direction set by the noise elsewhere (an
  attention key bias, which softmax ignores). A leaf the reference moved and the
  strategy did not fails at any tolerance. Runs in one process: results are compared on
  the host.

  Args:
    step: a `TrainStep` (from `pj.compile`).
    params: the parameters to start both runs from (not modified).
    batch: one batch, used at every step, or a list or iterator of batches (the first
      `steps` are used).
    steps: the number of training steps to compare.
    reference: "one_device", "jit", or "auto": one device when the parameters, their
      gradients and the optimizer state take at most half of its memory (or its memory
      is unknown), else "jit".
    rtol: the tolerance on parameters, gradients and losses. None takes 1e-4 on
      parameters and gradients and 1e-5 on losses when parameters and computation are
      float32, and 2e-2 on all when any of them is narrower (bfloat16, or float32
      matrix products at an accelerator's default precision, TF32 on NVIDIA GPUs).
    sgd: also compare one SGD step's gradients (compiles the strategy a second time).
    loss_fn: the loss the step was compiled from; default `step.loss_fn`.
    compile_kwargs: more keyword arguments for the SGD step's `pj.compile` (`options`:
      `TrainStep.check` passes the step's own, so that the same program runs).

  Returns:
    A `CheckReport`; `print` it for a table, test `.passed`.
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
  tx = step.optimizer
  batches = _batches(step, batch, steps)
  devices = list(step.mesh.devices.flat) if hasattr(step, "mesh") else list(step.devices)
  if reference == "auto":
    reference = "one_device" if _fits_one_device(params, tx, jax.local_devices()[0]) else "jit"
  precision = _precision(loss_fn, params, batches[0], devices[0].platform)
  low = precision != "fp32"
  p_rtol = rtol if rtol is not None else (LOW_PRECISION_RTOL if low else FP32_RTOL)
  l_rtol = rtol if rtol is not None else (LOW_PRECISION_RTOL if low else FP32_LOSS_RTOL)

  keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  start = _host(params)

  # The strategy first, its results moved to the host, so that the reference does not
  # share device memory with its state.
  state = step.init(params)
  losses = []
  for b in batches:
    state, loss = step(state, b)
    losses.append(float(loss))
  got = _host(step.params(state))
  del state

  place_params, place_batch, place_state = _placement(reference, devices)
  ref_losses, ref_params = _reference_run(loss_fn, tx, params, batches, place_params,
                                          place_batch, place_state)
  ref = _host(ref_params)
  del ref_params

  failures = []
  rel_losses = [_rel(a, b) for a, b in zip(losses, ref_losses)]
  for i, d in enumerate(rel_losses):
    if not d <= l_rtol:  # NaN fails too
      failures.append(f"loss at step {i + 1}: {losses[i]:.7g} vs {ref_losses[i]:.7g} "
                      f"(relative difference {d:.2e} > {l_rtol:.0e})")

  grad_leaves, keep = None, [None] * len(keys)
  if sgd:
    grad_leaves, keep = _sgd_check(step, loss_fn, params, batches[0], start, place_params,
                                   place_batch, compile_kwargs or {})
    grad_leaves = dict(zip(keys, grad_leaves))
  leaves, left_out, frozen = _compare_params(keys, start, got, ref, keep, p_rtol, failures)
  if grad_leaves is not None:
    failures += [f"gradient of {k}: relative difference {d:.2e} > {p_rtol:.0e}"
                 for k, d in grad_leaves.items() if not d <= p_rtol]

  return CheckReport(
      losses=tuple(losses), reference_losses=tuple(ref_losses),
      loss_rel_diff=max(rel_losses, key=_nan_first), leaves=leaves, left_out=left_out,
      worst=_worst(leaves, first=frozen), frozen=frozen,
      grad_leaves=grad_leaves, worst_grads=_worst(grad_leaves) if grad_leaves else (),
      rtol=p_rtol, loss_rtol=l_rtol, precision=precision, reference=reference,
      failures=tuple(failures), passed=not failures)


def _compare_params(keys, start, got, ref, keep, rtol, failures):
  """Per leaf: the relative difference over the kept elements, the fraction left out;
  and the frozen leaves.

  `keep[i]` is a boolean mask of leaf i's elements to compare, or None for all of them.
  Appends a line to `failures` for each leaf that fails.
  """
  rms = _rms(start)
  leaves, left_out, frozen = {}, {}, []
  for k, p0, a, b, mask in zip(keys, start, got, ref, keep):
    a, b, p0 = (np.asarray(x, np.float64) for x in (a, b, p0))
    moved, moved_ref = _norm(a - p0), _norm(b - p0)
    diff = _norm(a - b if mask is None else (a - b)[mask])
    left_out[k] = 1.0 - float(np.mean(mask)) if mask is not None and mask.size else 0.0
    leaves[k] = d = diff / max(_norm(b), rms * math.sqrt(b.size), _TINY)
    if moved_ref > 0 and moved <= _FROZEN_FRACTION * moved_ref:
      frozen.append(k)
      failures.append(f"parameter {k} is frozen: the reference moved it by {moved_ref:.2e}, "
                      f"the strategy by {moved:.2e}")
    elif not d <= rtol:
      failures.append(f"parameter {k}: relative difference {d:.2e} > {rtol:.0e}")
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


def _precision(loss_fn, params, batch, platform: str) -> str:
  """"bf16" when a floating parameter or a value the loss computes is narrower than
  float32; "tf32" when a float32 matrix product runs at an accelerator's default
  precision; else "fp32"."""
  narrow = lambda dt: jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize < 4
  if any(narrow(jnp.result_type(x)) for x in jax.tree_util.tree_leaves(params)):
    return "bf16"
  shapes = lambda t: jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), t)
  eqns = list(_all_eqns(jax.make_jaxpr(loss_fn)(shapes(params), shapes(batch)).jaxpr))
  if any(narrow(v.aval.dtype) for e in eqns for v in e.outvars if hasattr(v.aval, "dtype")):
    return "bf16"
  if platform != "cpu" and any(e.primitive.name in ("dot_general", "conv_general_dilated")
                               and _reduced(e.params.get("precision")) for e in eqns):
    return "tf32"
  return "fp32"


def _reduced(precision) -> bool:
  """Whether a matrix product's precision lets an accelerator round float32 inputs."""
  if precision is None:
    return True
  if isinstance(precision, (tuple, list)):
    return any(p == jax.lax.Precision.DEFAULT for p in precision)
  name = getattr(precision, "name", str(precision))
  return name == "DEFAULT" or any(t in name for t in ("TF32", "BF16", "F16", "F8"))


def _all_eqns(jaxpr):
  """Every equation, inside jit, scan, remat and other sub-jaxprs too."""
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else (p,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
        if hasattr(sub, "eqns"):
          yield from _all_eqns(sub)


def _fits_one_device(params, tx, device) -> bool:
  """Whether parameters, gradients and optimizer state take at most half a device's memory."""
  try:
    stats = device.memory_stats()
  except Exception:  # backends without memory statistics
    stats = None
  limit = (stats or {}).get("bytes_limit")
  if not limit:
    return True
  nbytes = lambda t: sum(math.prod(np.shape(x)) * jnp.dtype(jnp.result_type(x)).itemsize
                         for x in jax.tree_util.tree_leaves(t))
  opt = jax.eval_shape(tx.init, jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params))
  return 2 * nbytes(params) + nbytes(opt) <= limit // 2


# -- the reference ---------------------------------------------------------------


def _placement(reference: str, devices: list):
  """Functions placing parameters, batches and optimizer state for the reference."""
  if reference == "one_device":
    dev = jax.local_devices()[0]
    put = lambda t: jax.device_put(t, dev)
    return put, put, lambda t: t
  mesh = Mesh(np.array(devices), ("d",))
  n = len(devices)

  def sharding(x):
    # The first dimension that divides evenly, so that no device holds a whole weight.
    shape = np.shape(x)
    axis = next((i for i, d in enumerate(shape) if d % n == 0), None)
    return NamedSharding(mesh, P() if axis is None else P(*([None] * axis + ["d"])))

  def put_batch(t):
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, NamedSharding(
        mesh, P("d") if np.shape(x)[0] % n == 0 else P())), t)

  put = lambda t: jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding(x)), t)
  constrain = lambda t: jax.tree_util.tree_map(
      lambda x: jax.lax.with_sharding_constraint(x, sharding(x)), t)
  return put, put_batch, constrain


def _reference_run(loss_fn, tx, params, batches, put, put_batch, constrain):
  """`len(batches)` steps of jitted value_and_grad + optimizer: (losses, parameters)."""

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return constrain(optax.apply_updates(params, updates)), constrain(opt_state), loss

  params = put(params)
  opt_state = jax.jit(lambda p: constrain(tx.init(p)))(params)
  losses = []
  for b in batches:
    params, opt_state, loss = train_step(params, opt_state, put_batch(b))
    losses.append(float(loss))
  return losses, params


def _sgd_check(step, loss_fn, params, batch, start, put, put_batch, compile_kwargs):
  """One SGD step of the strategy, read back as a gradient, against the reference's.

  Returns per leaf the relative difference, and a mask of the elements whose reference
  gradient is clear of the leaf's gradient noise (`_NOISE_MULTIPLE` times the RMS
  difference).
  """
  grads = _host(jax.jit(jax.grad(loss_fn))(put(params), put_batch(batch)))
  # A learning rate that makes the update as large as the parameters, so that reading
  # the gradient back as (before - after) / lr keeps the parameters' precision.
  g_norm = math.sqrt(sum(_norm(g) ** 2 for g in grads))
  p_norm = math.sqrt(sum(_norm(p) ** 2 for p in start))
  lr = p_norm / g_norm if g_norm > 0 and p_norm > 0 and math.isfinite(p_norm / g_norm) else 1.0
  sgd_step = _compile(loss_fn, optax.sgd(lr), step.directives, params, batch,
                      devices=list(step.devices), **compile_kwargs)
  state, _ = sgd_step(sgd_step.init(params), batch)
  after = _host(sgd_step.params(state))
  del state
  rms = _rms(grads)
  rel, keep = [], []
  for p0, p1, g in zip(start, after, grads):
    g = np.asarray(g, np.float64)
    implied = (np.asarray(p0, np.float64) - np.asarray(p1, np.float64)) / lr
    rel.append(_norm(implied - g) / max(_norm(g), rms * math.sqrt(g.size), _TINY))
    noise = _norm(implied - g) / math.sqrt(max(g.size, 1))
    keep.append(np.abs(g) > _NOISE_MULTIPLE * noise if noise > 0 else np.ones(g.shape, bool))
  return rel, keep


def _compile(*args, **kwargs):
  # Looked up when called, so that tests can put a faulty compiler in its place.
  from piper_jax.compile import compile as pj_compile
  return pj_compile(*args, **kwargs)


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


def _worst(leaves: dict[str, float], first=()) -> tuple[tuple[str, float], ...]:
  """The `_N_WORST` largest, NaN and the leaves named in `first` before the rest."""
  key = lambda kv: (kv[0] not in first, -_nan_first(kv[1]))
  return tuple(sorted(leaves.items(), key=key)[:_N_WORST])
