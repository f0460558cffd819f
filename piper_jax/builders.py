"""Full directive lists for the common cases: data parallel and pipelines."""

from __future__ import annotations

from piper_jax import schedules
from piper_jax.ir.directives import Directive, place, replicate, split

__all__ = ["data_parallel", "pipeline"]

_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")


def data_parallel(n_devices: int, zero: int = 0, reduce_dtype: str | None = None,
                  bucket_mb: float | None = 25.0) -> list[Directive]:
  """Replicates the whole model over devices 0..n_devices-1 with ZeRO stage `zero`.

  Gradients are reduced in `reduce_dtype` (see `replicate`). With ZeRO-0 they are
  all-reduced in buckets of `bucket_mb` MB as soon as the backward has made them (25,
  as PyTorch DDP's default; None: one all-reduce per parameter slot at the end of the
  step); ZeRO >= 1 reduce-scatters per slot and takes no buckets.
  """
  if n_devices < 1:
    raise ValueError(f"n_devices must be >= 1, got {n_devices}")
  return [replicate({}, list(range(n_devices)), zero=zero,
                    bucket_mb=bucket_mb if zero == 0 else None, reduce_dtype=reduce_dtype)]


def pipeline(n_stages: int, n_microbatches: int, schedule: str = "1f1b", dp: int = 1,
             zero: int = 0, n_virtual: int = 2, reduce_dtype: str | None = None) -> list[Directive]:
  """A pipeline of `n_stages` PP regions, optionally data parallel, as directives.

  Pipeline rank k of DP replica r runs on device r * n_ranks + k. Stage s sits on
  rank s for "gpipe", "1f1b" and "zb"; on rank s % n_ranks with
  n_ranks = n_stages / n_virtual for "interleaved"; on rank min(s, 2n-1-s) with
  n = n_stages / 2 for "dualpipev". Both need two ranks or more: n_stages >=
  2 * n_virtual for "interleaved", n_stages >= 4 for "dualpipev".

  Args:
    n_stages: the number of PP regions of the model (stage s = region PP=s).
    n_microbatches: microbatches per step.
    schedule: "gpipe", "1f1b", "interleaved", "zb" (ZB-H1) or "dualpipev".
    dp: data-parallel replicas of every stage.
    zero: ZeRO stage of the DP axis.
    n_virtual: stages per rank for "interleaved" (2 or more).
    reduce_dtype: dtype of the DP gradient reductions (see `replicate`).
  """
  if schedule not in _SCHEDULES:
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(_SCHEDULES)}")
  if dp < 1 or n_stages < 1:
    raise ValueError(f"n_stages and dp must be >= 1, got {n_stages} and {dp}")
  if schedule == "interleaved":
    _check_interleaved(n_stages, n_virtual)
    n_ranks = n_stages // n_virtual
    rank_of = lambda s: s % n_ranks
    orders = schedules.interleaved_1f1b(n_ranks, n_virtual, n_microbatches)
  elif schedule == "dualpipev":
    _check_dualpipev(n_stages)
    n_ranks = n_stages // 2
    rank_of = lambda s: min(s, n_stages - 1 - s)
    orders = schedules.dualpipev(n_ranks, n_microbatches)
  else:
    n_ranks = n_stages
    rank_of = lambda s: s
    orders = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b,
              "zb": schedules.zero_bubble}[schedule](n_stages, n_microbatches)
  out: list[Directive] = [split(n_microbatches)]
  for s in range(n_stages):
    devices = [r * n_ranks + rank_of(s) for r in range(dp)]
    if dp == 1:
      out.append(place({"PP": s}, devices))
    else:
      out.append(replicate({"PP": s}, devices, zero=zero, reduce_dtype=reduce_dtype))
  return out + orders


def _check_interleaved(n_stages: int, n_virtual: int) -> None:
  """Interleaved needs n_virtual stages on each of two or more ranks."""
  if isinstance(n_virtual, bool) or not isinstance(n_virtual, int) or n_virtual < 2:
    raise ValueError(f"interleaved needs n_virtual >= 2 stages per rank, got {n_virtual!r}; "
                     f"use schedule='1f1b' for one stage per rank")
  if n_stages % n_virtual:
    raise ValueError(f"interleaved needs n_stages ({n_stages}) divisible by n_virtual "
                     f"({n_virtual})")
  if n_stages < 2 * n_virtual:
    raise ValueError(f"interleaved puts stages r, r + n_ranks, ... on rank r: n_stages="
                     f"{n_stages} with n_virtual={n_virtual} makes one rank; use n_stages >= "
                     f"{2 * n_virtual}, or schedule='1f1b' for {n_stages} stages")


def _check_dualpipev(n_stages: int) -> None:
  """DualPipeV needs two stages on each of two or more ranks."""
  if n_stages % 2:
    raise ValueError(f"dualpipev needs an even n_stages (two per rank), got {n_stages}")
  if n_stages < 4:
    raise ValueError(f"dualpipev puts stages r and 2n-1-r on rank r: n_stages={n_stages} makes "
                     f"one rank; use n_stages >= 4, or schedule='1f1b' for {n_stages} stages")
