"""Pipeline schedules as `order` directives over PP region indices (stage s = PP=s)."""

from __future__ import annotations

from piper_jax.ir.directives import Order, order

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble", "dualpipev",
           "stage_sequence"]


def _check(n_stages: int, n_microbatches: int) -> None:
  for name, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _check_ranks(schedule: str, n_ranks: int, layout: str) -> None:
  """Two stages or more per rank need two ranks or more to be a pipeline at all."""
  if n_ranks < 2:
    raise ValueError(f"{schedule} needs n_ranks >= 2 (it puts {layout}), got "
                     f"{n_ranks}; use n_ranks >= 2, or one_f_one_b for a single rank")


def _order(stage: int, seq: list[tuple[str, int]]) -> Order:
  return order([{"PP": stage, "PASS": p, "MB": m} for p, m in seq])


def _rank_order(groups: list[list[tuple[int, str, int]]]) -> Order:
  """An order over one rank's (stage, pass, microbatch) groups."""
  return order([[{"PP": s, "PASS": p, "MB": m} for s, p, m in g] for g in groups])


def stage_sequence(schedule: str, stage: int, n_stages: int, n_microbatches: int) -> list[tuple[str, int]]:
  """The (pass, microbatch) sequence one stage runs under `schedule` ("gpipe" or "1f1b")."""
  _check(n_stages, n_microbatches)
  if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n_stages:
    raise ValueError(f"stage must be an int in 0..{n_stages - 1} (n_stages={n_stages}), got "
                     f"{stage!r}")
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


def interleaved_1f1b(n_ranks: int, n_virtual: int, n_microbatches: int) -> list[Order]:
  """Interleaved 1F1B (Megatron): rank r holds stages v * n_ranks + r for v < n_virtual.

  Microbatches go through the rank's stages in rounds of n_ranks; the bubble is
  (n_ranks - 1) / (n_virtual * n_microbatches) of the 1F1B one's. Needs n_ranks >= 2,
  n_virtual >= 2 and n_microbatches divisible by n_ranks.
  """
  _check(n_ranks, n_microbatches)
  _check(n_virtual, 1)
  if n_virtual < 2:
    raise ValueError(f"interleaved_1f1b needs n_virtual >= 2 stages per rank, got {n_virtual}; "
                     f"use one_f_one_b for one stage per rank")
  _check_ranks("interleaved_1f1b", n_ranks, f"n_virtual={n_virtual} stages on each rank")
  if n_microbatches % n_ranks:
    raise ValueError(f"interleaved_1f1b needs n_microbatches ({n_microbatches}) divisible by "
                     f"n_ranks ({n_ranks})")
  total = n_microbatches * n_virtual
  out = []
  for r in range(n_ranks):
    def chunk(k, forward):
      c = (k // n_ranks) % n_virtual
      return (c if forward else n_virtual - 1 - c) * n_ranks + r

    def mb(k):
      return (k // (n_ranks * n_virtual)) * n_ranks + k % n_ranks

    warmup = min((n_ranks - r - 1) * 2 + (n_virtual - 1) * n_ranks, total)
    seq = [[(chunk(k, True), "F", mb(k))] for k in range(warmup)]
    f, b = warmup, 0
    while b < total:
      if f < total:
        seq.append([(chunk(f, True), "F", mb(f))])
        f += 1
      seq.append([(chunk(b, False), "B", mb(b))])
      b += 1
    out.append(_rank_order(seq))
  return out


def _zb_sequences(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int]]]:
  """Per-stage (pass, microbatch) sequences of ZB-H1, from a unit-cost list schedule.

  When a stage is free it runs, in this priority: a ready BI (it unblocks the stage
  before), a ready F if fewer than n_stages - s microbatches hold activations (1F1B's
  memory), else a pending BW (weight gradients fill what would be bubbles).
  """
  p, m = n_stages, n_microbatches
  done: dict[tuple[str, int, int], int] = {}
  nxt_f = [0] * p
  w_queue: list[list[int]] = [[] for _ in range(p)]
  live = [0] * p
  seqs: list[list[tuple[str, int]]] = [[] for _ in range(p)]
  free = [0] * p
  total = 3 * p * m
  t = 0
  while sum(len(x) for x in seqs) < total:
    for s in range(p):
      if free[s] > t:
        continue
      ready = lambda key: key in done and done[key] <= t
      bi = next((mb for mb in range(m) if ("F", s, mb) in done and ("BI", s, mb) not in done
                 and (ready(("BI", s + 1, mb)) if s + 1 < p else ready(("F", s, mb)))), None)
      f = nxt_f[s]
      if bi is not None:
        item = ("BI", bi)
      elif f < m and live[s] < p - s and (s == 0 or ready(("F", s - 1, f))):
        item = ("F", f)
      elif w_queue[s]:
        item = ("BW", w_queue[s].pop(0))
      else:
        continue
      kind, mb = item
      done[(kind, s, mb)] = t + 1
      seqs[s].append(item)
      free[s] = t + 1
      if kind == "F":
        nxt_f[s] += 1
        live[s] += 1
      elif kind == "BI":
        w_queue[s].append(mb)
      else:
        live[s] -= 1
    t += 1
  return seqs


def zero_bubble(n_stages: int, n_microbatches: int) -> list[Order]:
  """ZB-H1: backward split into BI and BW; BW fills the bubbles of 1F1B at its memory.

  Each stage keeps at most n_stages - s microbatches of activations (counted until
  their BW), like 1F1B; BI runs as soon as it can to unblock the stage before, and
  BW runs when the stage would otherwise wait.
  """
  _check(n_stages, n_microbatches)
  return [_order(s, seq) for s, seq in enumerate(_zb_sequences(n_stages, n_microbatches))]


def dualpipev(n_ranks: int, n_microbatches: int) -> list[Order]:
  """DualPipeV: rank r holds stages r and 2 * n_ranks - 1 - r (a "V" through the ranks).

  Microbatches enter at rank 0, run down the ranks through the first stages and
  back up through the second ones. In the steady state each rank pairs the
  forward of one microbatch with the backward of another in one order group
  (F&B), so one's compute can hide the other's communication. Needs n_ranks >= 2 and
  n_microbatches >= 2 * n_ranks.
  """
  _check(n_ranks, n_microbatches)
  _check_ranks("dualpipev", n_ranks, "stages r and 2 * n_ranks - 1 - r on rank r")
  if n_microbatches < 2 * n_ranks:
    raise ValueError(f"dualpipev needs n_microbatches >= 2 * n_ranks = {2 * n_ranks}, got "
                     f"{n_microbatches}; use more microbatches or fewer ranks")
  n, m = n_ranks, n_microbatches
  out = []
  for r in range(n):
    s0, s1 = r, 2 * n - 1 - r
    count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}

    def take(kind):
      stage = s0 if kind[1] == "0" else s1
      item = (stage, kind[0], count[kind])
      count[kind] += 1
      return item

    groups = []
    groups += [[take("F0")] for _ in range((n - r - 1) * 2)]
    for _ in range(r + 1):
      groups += [[take("F0")], [take("F1")]]
    for _ in range(n - r - 1):
      groups += [[take("B1")], [take("F1")]]
    for _ in range(m - 2 * n + r + 1):
      groups += [[take("F0"), take("B1")], [take("F1"), take("B0")]]
    for _ in range(n - r - 1):
      groups += [[take("B1")], [take("F1"), take("B0")]]
    for _ in range(r + 1):
      groups += [[take("B1")], [take("B0")]]
    groups += [[take("B0")] for _ in range(n - r - 1)]
    out.append(_rank_order(groups))
  return out
