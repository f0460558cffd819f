"""The plan as data (`lowering/schedule_table.py`) on hand-built and IR plans: every read
finds the value it names in the row the table gives it, executed with labels for values."""

import dataclasses

import numpy as np
import pytest

from piper_jax import ir, strategies
from piper_jax.ir import Pass, TensorSpec
from piper_jax.ir.pipeline import make_plan
from piper_jax.lowering.schedule_table import build_table

pytestmark = pytest.mark.timeout(120)

N_REGIONS = 4


@dataclasses.dataclass(frozen=True)
class T:
  """A task as the table sees it."""

  region: int
  pass_: Pass
  mb: int


def reads(t):
  """A chain of regions: F reads its input; B and BI read F's residual and the next
  region's cotangent; BW reads BI's weight residual."""
  r, m = t.region, t.mb
  if t.pass_ is Pass.F:
    return [("act", r - 1, m)] if r else []
  if t.pass_ is Pass.BW:
    return [("wres", r, m)]
  return [("res", r, m)] + ([("ct", r + 1, m)] if r + 1 < N_REGIONS else [])


def produces(t):
  r, m = t.region, t.mb
  if t.pass_ is Pass.F:
    return [("act", r, m), ("res", r, m)]
  if t.pass_ is Pass.BW:
    return []
  return ([("ct", r, m)] if r else []) + ([("wres", r, m)] if t.pass_ is Pass.BI else [])


def signature(key):
  return {"act": ((4,), "float32"), "ct": ((4,), "float32"), "res": ((8,), "float32"),
          "wres": ((2,), "bfloat16")}[key[0]]


def execute(table, ticks, reads=reads, produces=produces, made_from=lambda key: None):
  """Runs the table with value labels in place of arrays, as `TickLoop` runs it; asserts
  every read, that values passed inside a slot's kind are made before they are read,
  and that every task of `ticks` runs once, in its tick's order. A regroup turns the
  label of its source into the label of the value made from it."""
  regrouped = {}
  n_ranks = table.code.shape[1]
  stores = [[[None] * (s.depth + 1) for s in table.stores] for _ in range(n_ranks)]
  ran = []
  assert table.n_iterations == len(ticks)
  for ti in range(table.n_iterations):
    got = {}
    for rank in range(n_ranks):
      done = 0
      for s in range(table.n_slots):
        kind = table.slot_of(ti, rank, s)
        if kind is not None:
          done += _run_slot(table, ticks[ti][rank][done:], kind, stores[rank], (ti, rank, s),
                            ran, reads, produces)
        for n, g in enumerate(table.regroups):
          src, dst = table.regroup_rows[ti, rank, s, n]
          x = stores[rank][g.source][src]
          stores[rank][g.target][dst] = regrouped.setdefault(x, next(
              (k for k in _all_keys(ticks, reads, made_from) if made_from(k) == x), None))
      assert done == len(ticks[ti][rank])
    for j, rnd in enumerate(table.rounds):
      got[j] = {a: [stores[a][st][table.send_rows[ti, a, j, n]]
                    for n, st in enumerate(rnd.stores)] for a in range(n_ranks)}
    for j, rnd in enumerate(table.rounds):
      for a, b in rnd.perm:
        for n, st in enumerate(rnd.stores):
          stores[b][st][table.recv_rows[ti, b, j, n]] = got[j][a][n]
  assert sorted(ran, key=str) == sorted(((ti, r, t) for ti, tick in enumerate(ticks)
                                         for r, ts in enumerate(tick) for t in ts), key=str)


def _all_keys(ticks, reads, made_from):
  """Every key read, and those they are regrouped from."""
  keys = {k for tick in ticks for ts in tick for t in ts for k in reads(t)}
  while True:
    more = {made_from(k) for k in keys} - {None} - keys
    if not more:
      return keys
    keys |= more


def _run_slot(table, tasks, kind, stores, at, ran, reads, produces) -> int:
  """Runs one slot's kind on a rank's stores; returns how many tasks it ran."""
  ti, rank, s = at
  ts = tasks[:len(kind.steps)]
  assert [(t.region, t.pass_, t.mb) for t in ts] == [
      (r, p, table.mb[ti, rank, s]) for r, p in kind.steps]
  local = {}
  for j, t in enumerate(ts):
    ran.append((ti, rank, t))
    for n, key in enumerate(reads(t)):
      if (j, n) in kind.read_at:
        x = kind.read_at.index((j, n))
        have = stores[kind.reads[x]][table.read_rows[ti, rank, s, x]]
      else:
        have = local.get(key)
      assert have == key, (ti, rank, t, key, have)
    local.update((key, key) for key in produces(t))
  for x, (j, n) in enumerate(kind.write_at):
    stores[kind.writes[x]][table.write_rows[ti, rank, s, x]] = produces(ts[j])[n]
  return len(ts)


def one_f_one_b(n_ranks, n_mb):
  """Textbook 1F1B, one task per rank and tick, region r on rank r."""
  order = {r: [] for r in range(n_ranks)}
  for r in range(n_ranks):
    warm = min(n_ranks - r, n_mb)
    f = b = 0
    for _ in range(warm):
      order[r].append(T(r, Pass.F, f)); f += 1
    while b < n_mb:
      order[r].append(T(r, Pass.B, b)); b += 1
      if f < n_mb:
        order[r].append(T(r, Pass.F, f)); f += 1
  # Ticks: each rank runs its next task once what it reads has arrived.
  done, ticks, pos = {}, [], {r: 0 for r in range(n_ranks)}
  while any(pos[r] < len(order[r]) for r in range(n_ranks)):
    tick = [[] for _ in range(n_ranks)]
    ti = len(ticks)
    for r in range(n_ranks):
      if pos[r] < len(order[r]):
        t = order[r][pos[r]]
        if all(k in done and (done[k][0] == r or done[k][1] < ti) for k in reads(t)):
          tick[r].append(t)
          pos[r] += 1
    for r, ts in enumerate(tick):
      for t in ts:
        for k in produces(t):
          done[k] = (r, ti)
    ticks.append(tick)
  return ticks


def test_1f1b_table_runs_and_keeps_only_live_values():
  ticks = one_f_one_b(N_REGIONS, 8)
  table = build_table(ticks, reads, produces, signature)
  execute(table, ticks)
  assert {k.steps for k in table.kinds} == {((r, p),) for r in range(4)
                                            for p in (Pass.F, Pass.B)}
  assert table.n_slots == 1
  # Rank 0 keeps at most 4 microbatches' residuals (the stages ahead of it), not 8.
  res = next(i for i, s in enumerate(table.stores) if s.shape == (8,))
  assert table.stores[res].depth == 4
  # Two ppermutes a tick carry every neighbour's exchange.
  pairs = [p for r in table.rounds for p in r.perm]
  assert len(table.rounds) == 2 and sorted(pairs) == [(0, 1), (1, 0), (1, 2), (2, 1),
                                                      (2, 3), (3, 2)]


def test_several_tasks_a_tick_and_split_backwards():
  # One rank, all regions: a tick's chain of tasks (each reading what the one before
  # made) is one kind whose values pass inside its branch; B of the last microbatch is
  # split into BI and BW in different ticks.
  ticks = [[[T(r, Pass.F, m) for r in range(4)]] for m in range(2)]
  ticks += [[[T(3, Pass.B, 0), T(2, Pass.B, 0), T(1, Pass.B, 0), T(0, Pass.B, 0)]]]
  ticks += [[[T(3, Pass.BI, 1), T(2, Pass.BI, 1)]], [[T(1, Pass.B, 1), T(3, Pass.BW, 1)]],
            [[T(2, Pass.BW, 1), T(0, Pass.B, 1)]]]
  table = build_table(ticks, reads, produces, signature)
  execute(table, ticks)
  assert not table.rounds
  forward = table.kinds[table.kind_index(*[(r, Pass.F) for r in range(4)])]
  # The forward chain stores the four residuals, not the activations its steps pass on.
  assert forward.read_at == () and forward.write_at == ((0, 1), (1, 1), (2, 1), (3, 1))
  # The backward chain runs once (microbatch 1's backward is split over ticks): as a
  # kind of its own it would only add code, so its tasks take a slot each.
  assert all(k.steps[0][1] is not Pass.B or len(k.steps) == 1 for k in table.kinds)
  assert table.n_slots == 4 and (table.code[2, 0] > 0).all()
  wres = next(i for i, s in enumerate(table.stores) if s.dtype == "bfloat16")
  assert table.stores[wres].depth == 2


@pytest.mark.parametrize("schedule,n_stages", [("1f1b", 4), ("gpipe", 4), ("zb", 4),
                                               ("interleaved", 4), ("dualpipev", 4)])
def test_tables_of_the_builtin_schedules(schedule, n_stages):
  act = TensorSpec("act", (8, 4), "float32")
  regions = []
  for i in range(n_stages):
    inputs = (ir.ActivationRef(i - 1, 0, act),) if i else ()
    outputs = (act,) if i < n_stages - 1 else (TensorSpec("loss", (), "float32"),)
    regions.append(ir.RegionSpec(i, (("PP", i),), (i,), (0,) if i == 0 else (), inputs,
                                 outputs, produces_loss=i == n_stages - 1, flops=1.0))
  model = ir.ModelSpec(tuple(regions), tuple(TensorSpec(f"w{i}", (4, 4), "float32")
                                             for i in range(n_stages)),
                       (TensorSpec("x", (8, 4), "float32"),), 8)
  plan = make_plan(model, strategies.pipeline(n_stages, 4, schedule), 8)
  table = build_table(plan.ticks, reads, produces, signature)
  execute(table, plan.ticks)
  n_tasks = sum(len(ts) for tick in plan.ticks for ts in tick)
  assert sum(len(table.kinds[c - 1].steps) for c in table.code.flat if c) == n_tasks


def test_ranks_meet_once_a_tick_whatever_its_tasks():
  # Two ranks, two tasks a tick in the steady state: one iteration per tick, and the
  # activation and the cotangent travel in one round as the tick ends.
  F, B = Pass.F, Pass.B
  two = [[[T(0, F, 0)], []],
         [[T(0, F, 1)], [T(1, F, 0), T(1, B, 0)]],
         [[T(0, F, 2), T(0, B, 0)], [T(1, F, 1), T(1, B, 1)]],
         [[T(0, B, 1)], [T(1, F, 2), T(1, B, 2)]],
         [[T(0, B, 2)], []]]
  two_regions = lambda t: [k for k in reads(t) if k[:2] != ("ct", 2)]
  table = build_table(two, two_regions, produces, signature)
  execute(table, two, reads=two_regions)
  assert table.n_iterations == len(two) and table.n_slots == 2
  assert [r.perm for r in table.rounds] == [((0, 1), (1, 0))]
  # The last stage's F and B of one microbatch are one kind: its residual stays in the
  # branch; only B's cotangent, which rank 0 reads, goes to a store.
  last = table.kinds[table.kind_index((1, F), (1, B))]
  assert last.write_at == ((1, 0),) and last.read_at == ((0, 0),)
  # Rank 1 sends B's cotangent of microbatch m in tick m + 1, rank 0 the activation of
  # microbatch m + 2 (scratch rows where nothing goes).
  ct = table.stores.index(next(s for s in table.stores if s.shape == (4,)))
  assert (table.send_rows[1:4, 1, 0] != table.stores[ct].scratch).any()


def test_a_value_read_in_the_tick_another_rank_makes_it_is_refused():
  F = Pass.F
  ticks = [[[T(0, F, 0)], [T(1, F, 0)]]]
  with pytest.raises(ValueError, match="in the tick it is made"):
    build_table(ticks, reads, produces, signature)


def test_a_value_read_before_it_is_made_is_refused():
  ticks = [[[T(1, Pass.F, 0)], [T(0, Pass.F, 0)]]]
  with pytest.raises(ValueError, match="in the tick it is made|before it is made"):
    build_table(ticks, reads, produces, signature)


# Region 1 is expert parallel: its F reads region 0's activation regrouped to the
# devices of its experts and makes its output before it is regrouped back ("<"); its B
# reads region 2's cotangent regrouped likewise.
EP = 1


def ep_reads(t):
  out = []
  for k in reads(t):
    if t.region == EP and k[0] in ("act", "ct"):
      k = (k[0] + ">",) + k[1:]
    out.append(k)
  return out


def ep_produces(t):
  return [(k[0] + "<",) + k[1:] if t.region == EP and k[0] in ("act", "ct") else k
          for k in produces(t)]


def ep_made_from(key):
  if key[0].endswith(">"):
    return (key[0][:-1],) + key[1:]
  if key[0] in ("act", "ct") and key[1] == EP:
    return (key[0] + "<",) + key[1:]
  return None


def ep_signature(key):
  return ((2, 2), "float32") if key[0][-1] in "<>" else signature(key)


@pytest.mark.parametrize("ticks", [one_f_one_b(N_REGIONS, 4),
                                   [[[T(r, Pass.F, m) for r in range(4)]
                                     + [T(r, Pass.B, m) for r in reversed(range(4))]]
                                    for m in range(3)]], ids=["1f1b-4-ranks", "one-rank"])
def test_regrouped_values_are_made_after_the_slot_that_makes_their_source(ticks):
  table = build_table(ticks, ep_reads, ep_produces, ep_signature, ep_made_from)
  execute(table, ticks, ep_reads, ep_produces, ep_made_from)
  # Both directions: into region 1's layout after the slot that made its input, and
  # back after its own slot; at most one of each a slot. What a regroup makes lies in a
  # store of its own (`Store.regrouped`), apart from the values of its shape it reads.
  def store(shape, regrouped):
    return next(j for j, s in enumerate(table.stores)
                if s.shape == shape and s.regrouped == regrouped)

  local, plain = (2, 2), (4,)
  assert sorted((g.source, g.target) for g in table.regroups) == sorted(
      [(store(plain, False), store(local, True)), (store(local, False), store(plain, True))])
  assert all(g.level == 0 for g in table.regroups)
  # No kind runs region 1 together with another region: the collectives sit between.
  assert all(all(r != EP for r, _ in k.steps) or {r for r, _ in k.steps} == {EP}
             for k in table.kinds)


def test_a_value_regrouped_from_a_value_nobody_makes_is_refused():
  ticks = [[[T(1, Pass.F, 0)]]]
  with pytest.raises(ValueError, match="no task makes it"):
    build_table(ticks, ep_reads, ep_produces, ep_signature, ep_made_from)


def test_value_keys_compare_sort_and_hash_by_their_fields_after_a_copy():
  # Keys are hashed once when made (the table looks them up 100k times); a copy, in this
  # process or another, is rebuilt and hashes there.
  import copy
  import pickle
  from piper_jax.lowering.values import ValueKey, ValueKind
  a, b = ValueKey(ValueKind.RES, 1, 2, 3), ValueKey(ValueKind.ACT, 1, 2, 3)
  for other in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a),
                dataclasses.replace(b, kind=ValueKind.RES)):
    assert other == a and hash(other) == hash(a) and {a: 1}[other] == 1
  assert a != b and sorted([a, b]) == [b, a] and str(a) == "res:r1:mb2:3"
  assert a.as_kind(ValueKind.ACT) == b and hash(a.as_kind(ValueKind.ACT)) == hash(b)
