"""One-call strategies: full directive lists for the common cases."""

from __future__ import annotations

from piper_jax import schedules
from piper_jax.ir.directives import Directive, place, replicate, split

__all__ = ["data_parallel", "pipeline"]

_SCHEDULES = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b}


def data_parallel(n_devices: int, zero: int = 0) -> list[Directive]:
  """Replicates the whole model over devices 0..n_devices-1 with ZeRO stage `zero`."""
  if n_devices < 1:
    raise ValueError(f"n_devices must be >= 1, got {n_devices}")
  return [replicate({}, list(range(n_devices)), zero=zero)]


def pipeline(n_stages: int, n_microbatches: int, schedule: str = "1f1b", dp: int = 1,
             zero: int = 0) -> list[Directive]:
  """A pipeline of `n_stages` PP regions, optionally data parallel, as directives.

  Stage s of DP replica r runs on device r * n_stages + s.

  Args:
    n_stages: the number of PP regions of the model (stage s = region PP=s).
    n_microbatches: microbatches per step.
    schedule: "gpipe" or "1f1b".
    dp: data-parallel replicas of every stage.
    zero: ZeRO stage of the DP axis.
  """
  if schedule not in _SCHEDULES:
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(_SCHEDULES)}")
  if dp < 1 or n_stages < 1:
    raise ValueError(f"n_stages and dp must be >= 1, got {n_stages} and {dp}")
  out: list[Directive] = [split(n_microbatches)]
  for s in range(n_stages):
    devices = [r * n_stages + s for r in range(dp)]
    if dp == 1:
      out.append(place({"PP": s}, devices))
    else:
      out.append(replicate({"PP": s}, devices, zero=zero))
  return out + _SCHEDULES[schedule](n_stages, n_microbatches)
