"""Pipeline schedules as `order` directives over PP region indices (stage s = PP=s)."""

from __future__ import annotations

from piper_jax.ir.directives import Order, order

__all__ = ["gpipe", "one_f_one_b", "stage_sequence"]


def _check(n_stages: int, n_microbatches: int) -> None:
  for name, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _order(stage: int, seq: list[tuple[str, int]]) -> Order:
  return order([{"PP": stage, "PASS": p, "MB": m} for p, m in seq])


def stage_sequence(schedule: str, stage: int, n_stages: int, n_microbatches: int) -> list[tuple[str, int]]:
  """The (pass, microbatch) sequence one stage runs under `schedule` ("gpipe" or "1f1b")."""
  m = n_microbatches
  if schedule == "gpipe":
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
  if schedule == "1f1b":
    warmup = min(n_stages - stage - 1, m)
    seq = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
      if f < m:
        seq.append(("F", f))
        f += 1
      seq.append(("B", b))
      b += 1
    return seq
  raise ValueError(f"unknown schedule {schedule!r}")


def gpipe(n_stages: int, n_microbatches: int) -> list[Order]:
  """GPipe: every stage runs all forwards, then all backwards."""
  _check(n_stages, n_microbatches)
  if n_microbatches == 1:
    return [order([{"PP": s, "PASS": "F"}, {"PP": s, "PASS": "B"}]) for s in range(n_stages)]
  return [_order(s, stage_sequence("gpipe", s, n_stages, n_microbatches)) for s in range(n_stages)]


def one_f_one_b(n_stages: int, n_microbatches: int) -> list[Order]:
  """1F1B (PipeDream-flush): stage s warms up with n_stages-s-1 forwards, then alternates.

  At most n_stages - s microbatches of activations are alive on stage s.
  """
  _check(n_stages, n_microbatches)
  if n_microbatches == 1:
    return gpipe(n_stages, 1)
  return [_order(s, stage_sequence("1f1b", s, n_stages, n_microbatches)) for s in range(n_stages)]
