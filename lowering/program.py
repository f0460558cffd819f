"""Lowers a ticked plan to one shard_map body over the ("dp", "pp") mesh.

Each tick, every pipeline rank runs its own tasks through one `lax.switch` on
`axis_index("pp")`. Values that outlive a tick leave the switch as a list of arrays
whose positions ranks share by shape (`_match_positions`): a "keep" list for the
rank itself and one list per `ppermute` round for the values other ranks read.
Gradients accumulate per leaf, unreduced over microbatches, and are laid out into
the flat parameter segments and reduced once at the end (ZeRO 0/1), or laid out and
reduce-scattered per tick (ZeRO 2/3); ZeRO-3 gathers a slot's parameters before the
switch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from piper_jax.ir.graph import Pass
from piper_jax.ir.plan import Plan, Task
from piper_jax.lowering.layout import SHARED, ParamLayout
from piper_jax.lowering.regions import (BackwardSplit, RegionAD, analyze_region, backward_input,
                                        backward_weight, full_residuals, region_backward,
                                        region_forward, split_backward)
from piper_jax.lowering.trace import TracedLoss

__all__ = ["Program"]

# Value keys: ("act", region, mb, k) output k of F; ("res", region, mb, k) stored
# residual k of F; ("ct", region, mb, i) cotangent of input i, made by B or BI;
# ("wres", region, mb, k) value k that BI leaves for BW.
_GRAD_PASSES = (Pass.B, Pass.BW)


def _signature(aval) -> tuple:
  return (tuple(int(d) for d in aval.shape), str(np.dtype(aval.dtype)))


def _match_positions(per_rank: dict[int, list[tuple[Any, Any]]]) -> tuple[list[tuple], dict]:
  """Gives each rank's values positions in one output list, sharing positions by shape.

  `lax.switch` branches must return the same types; values of equal shape and dtype
  on different ranks (a transformer block's on every stage) share a position, so
  nothing is packed or copied. Returns the positions' (shape, dtype) and, per
  (rank, key), the position of that value.
  """
  positions: list[tuple] = []
  where: dict = {}
  for rank, values in sorted(per_rank.items()):
    used: set[int] = set()
    for key, aval in values:
      sig = _signature(aval)
      pos = next((i for i, s in enumerate(positions) if s == sig and i not in used), None)
      if pos is None:
        positions.append(sig)
        pos = len(positions) - 1
      used.add(pos)
      where[(rank, key)] = pos
  return positions, where


def _zeros(sig) -> jax.Array:
  return jnp.zeros(sig[0], jnp.dtype(sig[1]))


class Program:
  """The per-tick lowering of a plan; `body` is the shard_map body of one step."""

  def __init__(self, traced: TracedLoss, plan: Plan, layout: ParamLayout):
    self.traced, self.plan, self.layout = traced, plan, layout
    self.model = traced.spec
    self.ad: dict[int, RegionAD] = {r.index: analyze_region(traced, r.index)
                                    for r in self.model.regions}
    self.split: dict[int, BackwardSplit] = {}
    for t in plan.tasks.values():
      if t.pass_ is Pass.BI and t.region not in self.split:
        spec = self.model.regions[t.region]
        cts = [jax.ShapeDtypeStruct(spec.outputs[k].shape, jnp.dtype(spec.outputs[k].dtype))
               for k in self.ad[t.region].float_outs]
        self.split[t.region] = split_backward(self.ad[t.region], cts)
    self.n_mb = plan.n_microbatches
    self.mbs = self.model.batch_size
    self._plan_grads()
    self._plan_values()

  # -- static analysis: who produces and reads every value ----------------------

  def _value_aval(self, key):
    kind, r, m, k = key
    spec = self.model.regions[r]
    if kind == "act":
      o = spec.outputs[k]
      return jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype))
    if kind == "res":
      return self.ad[r].res_avals[self.ad[r].stored[k]]
    if kind == "wres":
      return self.split[r].carry_avals[k]
    x = spec.inputs[k].spec
    return jax.ShapeDtypeStruct(x.shape, jnp.dtype(x.dtype))

  def _reads(self, task: Task) -> list[tuple]:
    """Value keys a task reads."""
    r, m = task.region, task.mb
    spec, ad = self.model.regions[r], self.ad[r]
    keys = []
    if task.pass_ is Pass.F:
      keys += [("act", x.region, m, x.output) for x in spec.inputs]
    else:
      keys += [("res", r, m, k) for k in range(len(ad.stored))]
      for a in ad.alias:
        if a and a[0] == "act":
          x = spec.inputs[a[1]]
          keys.append(("act", x.region, m, x.output))
        elif a and a[0] == "out":
          keys.append(("act", r, m, a[1]))
      keys += self._ct_sources(r, m)
      if task.pass_ is Pass.BW:
        keys += [("wres", r, m, k) for k in range(len(self.split[r].carry))]
    return list(dict.fromkeys(keys))

  def _ct_sources(self, r: int, m: int, out: int | None = None) -> list[tuple]:
    """The ("ct", consumer, m, i) keys that sum to the cotangent of region r's outputs."""
    keys = []
    for c in self.model.regions:
      for i, x in enumerate(c.inputs):
        if x.region == r and x.differentiable and (out is None or x.output == out):
          keys.append(("ct", c.index, m, i))
    return keys

  def _produces(self, task: Task) -> list[tuple]:
    r, m = task.region, task.mb
    if task.pass_ is Pass.F:
      return ([("act", r, m, k) for k in range(len(self.model.regions[r].outputs))]
              + [("res", r, m, k) for k in range(len(self.ad[r].stored))])
    if task.pass_ is Pass.BW:
      return []
    out = [("ct", r, m, i) for i in self.ad[r].diff_acts]
    if task.pass_ is Pass.BI:
      out += [("wres", r, m, k) for k in range(len(self.split[r].carry))]
    return out

  def _plan_values(self):
    plan = self.plan
    readers: dict[tuple, list[Task]] = {}
    for t in plan.tasks.values():
      for key in self._reads(t):
        readers.setdefault(key, []).append(t)
    self.loc: dict[tuple, tuple] = {}   # (key, reader rank) -> array key of the value
    self.ticks: list[dict] = []         # per tick: keep positions, rounds, grad positions
    for tick_i, tick in enumerate(plan.ticks):
      keep_vals = {rank: [] for rank in range(plan.n_ranks)}
      msgs: dict[tuple[int, int], list] = {}
      for rank, tasks in enumerate(tick):
        for task in tasks:
          for key in self._produces(task):
            if any(rd.rank == rank and rd.tick > tick_i for rd in readers.get(key, [])):
              keep_vals[rank].append((key, self._value_aval(key)))
            for dst in sorted({rd.rank for rd in readers.get(key, []) if rd.rank != rank}):
              msgs.setdefault((rank, dst), []).append((key, self._value_aval(key)))
      rounds: list[list[tuple[int, int]]] = []
      for a, b in sorted(msgs):
        for rnd in rounds:
          if all(a != x and b != y for x, y in rnd):
            rnd.append((a, b))
            break
        else:
          rounds.append([(a, b)])
      keep_pos, keep_where = _match_positions(keep_vals)
      for (rank, key), pos in keep_where.items():
        self.loc[(key, rank)] = ("keep", tick_i, pos)
      round_info = []
      for ri, rnd in enumerate(rounds):
        pos, where = _match_positions({a: msgs[(a, b)] for a, b in rnd})
        for a, b in rnd:
          for key, _ in msgs[(a, b)]:
            self.loc[(key, b)] = ("recv", tick_i, ri, where[(a, key)])
        round_info.append((rnd, pos, where))
      grad_pos = sorted({self.grad_where[(rank, p)] for rank, tasks in enumerate(tick)
                         for t in tasks if t.pass_ in _GRAD_PASSES
                         for p in self._grad_leaves(t.region)})
      self.ticks.append({"keep": (keep_pos, keep_where), "rounds": round_info, "grads": grad_pos})
    self.buckets = self._plan_buckets()

  def _plan_buckets(self) -> dict[int, list[list[int]]]:
    """ZeRO-0 with bucket_mb: per tick, the buckets of gradient positions that become final."""
    if self.layout.zero != 0 or not self.plan.bucket_mb or self.layout.n_dp == 1:
      return {}
    last = {pos: t for t, info in enumerate(self.ticks) for pos in info["grads"]}
    limit = self.plan.bucket_mb * 2**20
    out: dict[int, list[list[int]]] = {}
    for t in sorted(set(last.values())):
      bucket, size = [], 0
      for pos in sorted((p for p, lt in last.items() if lt == t), reverse=True):
        shape, dt = self.grad_positions[pos]
        bucket.append(pos)
        size += int(np.prod(shape)) * np.dtype(dt).itemsize
        if size >= limit:
          out.setdefault(t, []).append(bucket)
          bucket, size = [], 0
      if bucket:
        out.setdefault(t, []).append(bucket)
    return out

  def _grad_leaves(self, region: int) -> list[int]:
    spec = self.model.regions[region]
    return [spec.params[i] for i in self.ad[region].diff_params]

  def _plan_grads(self):
    """Positions of the per-leaf gradient accumulators, shared across ranks by shape."""
    per_rank: dict[int, list] = {r: [] for r in range(self.plan.n_ranks)}
    for r in self.model.regions:
      rank = self.plan.mesh.region_rank[r.index]
      for p in self._grad_leaves(r.index):
        if all(k != p for k, _ in per_rank[rank]):
          per_rank[rank].append((p, jax.ShapeDtypeStruct(self.model.params[p].shape,
                                                          jnp.dtype(self.model.params[p].dtype))))
    self.grad_positions, self.grad_where = _match_positions(per_rank)
    self.grad_leaves_of_rank = {rank: [p for p, _ in vals] for rank, vals in per_rank.items()}

  # -- the shard_map body -------------------------------------------------------

  def _switch(self, branches, operands):
    if len(branches) == 1:
      return branches[0](operands)
    return lax.switch(lax.axis_index("pp"), branches, operands)

  def body(self, params: dict, batch: list):
    """One training step on local shards -> (grads like params, summed mean loss)."""
    plan, layout = self.plan, self.layout
    zero, n_dp = layout.zero, layout.n_dp
    arrays: dict[tuple, jax.Array] = {}
    acc: dict = {}   # ZeRO 0/1: grad position -> sum; ZeRO 2/3: (slot, dtype) -> reduced chunk
    loss = jnp.zeros((), jnp.float32)
    for tick_i, tick in enumerate(plan.ticks):
      info = self.ticks[tick_i]
      # Parameters this tick reads: whole segments (ZeRO-3: all-gathered here).
      slots = sorted({layout.home[p].slot for ts in tick for t in ts
                      for p in self.model.regions[t.region].params})
      if zero == 3:
        segs = {(s, dt): lax.all_gather(layout.local_chunk(params, s, dt), "dp", tiled=True)
                for s in slots for dt in layout.dtypes if layout.segment_size(s, dt)}
      else:
        segs = None
      reads = sorted({self.loc[(key, rank)] for rank, ts in enumerate(tick) for t in ts
                      for key in self._reads(t)
                      if (key, rank) in self.loc and self.loc[(key, rank)][1] < tick_i}, key=str)
      operands = {"arrays": {k: arrays[k] for k in reads},
                  "params": params if segs is None else segs, "batch": batch}
      branches = [self._branch(rank, tick_i, tick[rank], segs is not None)
                  for rank in range(plan.n_ranks)]
      keep, rounds, grads, tick_loss = self._switch(branches, operands)
      loss = loss + tick_loss
      for pos, x in enumerate(keep):
        arrays[("keep", tick_i, pos)] = x
      for ri, ((rnd, _, _), payload) in enumerate(zip(info["rounds"], rounds)):
        for pos, x in enumerate(payload):
          arrays[("recv", tick_i, ri, pos)] = lax.ppermute(x, "pp", perm=rnd)
      if zero >= 2 and grads:
        for key, x in self._assemble(grads).items():
          x = lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True)
          acc[key] = acc[key] + x if key in acc else x
      else:
        for pos, x in grads.items():
          acc[pos] = acc[pos] + x if pos in acc else x
        for bucket in self.buckets.get(tick_i, []):
          # One all-reduce of several arrays as soon as they are final, which XLA
          # can overlap with the backward work that follows.
          for pos, x in zip(bucket, lax.psum(tuple(acc[p] for p in bucket), "dp")):
            acc[pos] = x
    if zero < 2:
      acc = self._assemble(acc) if acc else {}
    return self._finish_grads(acc), lax.psum(loss, ("dp", "pp")) / (n_dp * self.n_mb)

  def _assemble(self, grads: dict[int, jax.Array]) -> dict[tuple, jax.Array]:
    """Per-leaf gradients (by position) -> this rank's flat (slot, dtype) segments."""
    layout = self.layout
    keys = sorted({(layout.home[p].slot, layout.home[p].dtype)
                   for rank, leaves in self.grad_leaves_of_rank.items() for p in leaves
                   if self.grad_where[(rank, p)] in grads}, key=str)

    def branch(rank):
      def run(g):
        segs = {key: jnp.zeros((layout.segment_size(*key),), jnp.dtype(key[1])) for key in keys}
        for p in self.grad_leaves_of_rank[rank]:
          pos = self.grad_where[(rank, p)]
          if pos not in g:
            continue
          h = layout.home[p]
          key = (h.slot, h.dtype)
          segs[key] = lax.dynamic_update_slice(segs[key], jnp.ravel(g[pos]), (h.offset,))
        return segs
      return run

    return self._switch([branch(r) for r in range(self.plan.n_ranks)], grads)

  def _branch(self, rank: int, tick_i: int, tasks: list[Task], gathered: bool):
    layout, model, info = self.layout, self.model, self.ticks[tick_i]
    keep_pos, keep_where = info["keep"]

    def run(ops):
      env: dict[tuple, jax.Array] = {}

      def read(key):
        if key in env:
          return env[key]
        return ops["arrays"][self.loc[(key, rank)]]

      seg_cache = {}

      def segment(slot, dt):
        if (slot, dt) not in seg_cache:
          seg_cache[(slot, dt)] = (ops["params"][(slot, dt)] if gathered
                                   else layout.local_segment(ops["params"], slot, dt))
        return seg_cache[(slot, dt)]

      def param(p):
        h = layout.home[p]
        return layout.leaf(segment(h.slot, h.dtype), h)

      def batch_mb(r, m):
        return [lax.dynamic_slice_in_dim(ops["batch"][i], m * self.mbs, self.mbs, 0)
                for i in model.regions[r].batch]

      grad_acc: dict[int, jax.Array] = {}
      loss = jnp.zeros((), jnp.float32)
      for t in tasks:
        r, m = t.region, t.mb
        spec, ad = model.regions[r], self.ad[r]
        params = [param(p) for p in spec.params]
        batch = batch_mb(r, m)
        if t.pass_ is Pass.F:
          acts = [read(("act", x.region, m, x.output)) for x in spec.inputs]
          outs, stored = region_forward(self.traced, ad, params, batch, acts)
          for k, x in enumerate(outs):
            env[("act", r, m, k)] = x
          for k, x in enumerate(stored):
            env[("res", r, m, k)] = x
          if spec.produces_loss:
            loss = loss + outs[self.traced.loss_output()].astype(jnp.float32)
          continue
        acts = [None] * len(spec.inputs)
        outs = [None] * len(spec.outputs)
        for a in ad.alias:
          if a and a[0] == "act":
            x = spec.inputs[a[1]]
            acts[a[1]] = read(("act", x.region, m, x.output))
          elif a and a[0] == "out":
            outs[a[1]] = read(("act", r, m, a[1]))
        stored = [read(("res", r, m, k)) for k in range(len(ad.stored))]
        cts = []
        for k in ad.float_outs:
          o = spec.outputs[k]
          ct = jnp.zeros(o.shape, jnp.dtype(o.dtype))
          for key in self._ct_sources(r, m, k):
            ct = ct + read(key).astype(ct.dtype)
          if spec.produces_loss and k == self.traced.loss_output():
            ct = ct + jnp.asarray(1.0 / (layout.n_dp * self.n_mb), ct.dtype)
          cts.append(ct)
        if t.pass_ is Pass.B:
          d_params, d_acts = region_backward(ad, stored, params, batch, acts, outs, cts)
        else:
          res = full_residuals(ad, stored, params, batch, acts, outs)
          if t.pass_ is Pass.BI:
            d_acts, carry = backward_input(self.split[r], res, cts)
            for k, x in enumerate(carry):
              env[("wres", r, m, k)] = x
            d_params = []
          else:
            carry = [read(("wres", r, m, k)) for k in range(len(self.split[r].carry))]
            d_params = backward_weight(self.split[r], res, cts, carry)
            d_acts = []
        for i, x in zip(ad.diff_acts, d_acts):
          env[("ct", r, m, i)] = x
        for i, g in zip(ad.diff_params, d_params):
          p = spec.params[i]
          grad_acc[p] = grad_acc[p] + g if p in grad_acc else g

      def fill(positions, where):
        out = [None] * len(positions)
        for (rk, key), pos in where.items():
          if rk == rank:
            out[pos] = env[key]
        return tuple(_zeros(sig) if x is None else x.astype(sig[1]) for x, sig in zip(out, positions))

      keep = fill(keep_pos, keep_where)
      rounds = [fill(pos, where) for _, pos, where in info["rounds"]]
      by_pos = {self.grad_where[(rank, p)]: g for p, g in grad_acc.items()}
      grads = {pos: by_pos[pos].astype(self.grad_positions[pos][1]) if pos in by_pos
               else _zeros(self.grad_positions[pos]) for pos in info["grads"]}
      return keep, rounds, grads, loss

    return run

  def _finish_grads(self, grads: dict) -> dict:
    """Reduces accumulated gradients once and lays them out like the local param buffers."""
    layout = self.layout
    out = {"slots": {}, "shared": {}}
    for dt in layout.dtypes:
      cols = [self._reduce(grads.get((j, dt)), layout.chunk[(j, dt)], dt)
              for j in range(layout.n_slots) if layout.chunk.get((j, dt), 0)]
      rows = layout.n_dp if layout.zero == 0 else 1
      row = jnp.concatenate(cols, axis=1) if cols else jnp.zeros((rows, 0), jnp.dtype(dt))
      pad = layout.width[dt] - row.shape[1]
      out["slots"][dt] = jnp.pad(row, ((0, 0), (0, pad)))[None]
      shared = grads.get((SHARED, dt))
      shared = None if shared is None else lax.psum(shared, "pp")  # tied: summed over ranks
      out["shared"][dt] = self._reduce(shared, layout.shared_chunk[dt], dt)
    return out

  def _reduce(self, g, chunk: int, dt: str) -> jax.Array:
    """A segment's gradient, reduced over "dp" as its ZeRO stage says, as [rows, chunk].

    ZeRO-0: all-reduced, every replica keeps all rows; ZeRO-1: reduce-scattered to
    this replica's chunk; ZeRO-2/3: already reduce-scattered per tick.
    """
    zero, n_dp = self.layout.zero, self.layout.n_dp
    if g is None:
      g = jnp.zeros((chunk if zero >= 2 else n_dp * chunk,), jnp.dtype(dt))
    if zero == 0:
      g = g if self.buckets else lax.psum(g, "dp")  # buckets were all-reduced already
      return g.reshape(n_dp, chunk)
    if zero == 1:
      return lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True).reshape(1, chunk)
    return g.reshape(1, chunk)
