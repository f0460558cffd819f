"""Lowers a ticked plan to one shard_map body over the ("dp", "pp") mesh.

Each tick, every pipeline rank runs its own tasks through one `lax.switch` on
`axis_index("pp")`. Values that outlive a tick leave the switch packed into flat
per-dtype sections: a "keep" section for the rank itself and one section per
`ppermute` round for the values other ranks read. Gradients stay unreduced over
microbatches (ZeRO 0/1) and are reduced once at the end, or are reduce-scattered
per tick (ZeRO 2/3); ZeRO-3 gathers a slot's parameters before the switch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from piper_jax.ir.graph import Pass
from piper_jax.ir.plan import Plan, Task
from piper_jax.lowering.layout import SHARED, ParamLayout
from piper_jax.lowering.regions import RegionAD, analyze_region, region_backward, region_forward
from piper_jax.lowering.trace import TracedLoss

__all__ = ["Program"]

# Value keys: ("act", region, mb, k) output k of F; ("res", region, mb, k) stored
# residual k of F; ("ct", region, mb, i) cotangent of input i, made by B.


@dataclasses.dataclass(frozen=True)
class _Loc:
  array: tuple          # ("keep", tick, dtype) or ("recv", tick, round, dtype)
  offset: int
  size: int
  shape: tuple
  dtype: str


def _pack_layout(values: list[tuple[tuple, Any]]) -> dict[str, list[tuple[tuple, int, int, tuple]]]:
  """Per dtype: (key, offset, size, shape) of each value, packed in order."""
  out: dict[str, list] = {}
  fill: dict[str, int] = {}
  for key, aval in values:
    dt = str(np.dtype(aval.dtype))
    n = int(np.prod(aval.shape))
    out.setdefault(dt, []).append((key, fill.get(dt, 0), n, tuple(aval.shape)))
    fill[dt] = fill.get(dt, 0) + n
  return out


class Program:
  """The per-tick lowering of a plan; `body` is the shard_map body of one step."""

  def __init__(self, traced: TracedLoss, plan: Plan, layout: ParamLayout):
    self.traced, self.plan, self.layout = traced, plan, layout
    self.model = traced.spec
    self.ad: dict[int, RegionAD] = {r.index: analyze_region(traced, r.index)
                                    for r in self.model.regions}
    self.n_mb = plan.n_microbatches
    self.mbs = self.model.batch_size
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
    return [("ct", r, m, i) for i in self.ad[r].diff_acts]

  def _plan_values(self):
    plan = self.plan
    producer: dict[tuple, Task] = {}
    for t in plan.tasks.values():
      for key in self._produces(t):
        producer[key] = t
    readers: dict[tuple, list[Task]] = {}
    for t in plan.tasks.values():
      for key in self._reads(t):
        readers.setdefault(key, []).append(t)
    self.loc: dict[tuple, _Loc] = {}          # (key, reader rank) -> where it lives
    self.sections: list[dict] = []            # per tick: layouts of keep and rounds
    for tick_i, tick in enumerate(plan.ticks):
      keep_vals = {rank: [] for rank in range(plan.n_ranks)}
      msgs: dict[tuple[int, int], list] = {}
      for rank, tasks in enumerate(tick):
        for task in tasks:
          for key in self._produces(task):
            later_local = any(rd.rank == rank and rd.tick > tick_i for rd in readers.get(key, []))
            if later_local:
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
      layout = {"keep": {}, "rounds": []}
      for rank, vals in keep_vals.items():
        for dt, entries in _pack_layout(vals).items():
          layout["keep"].setdefault(dt, {})[rank] = entries
          for key, off, n, shape in entries:
            self.loc[(key, rank)] = _Loc(("keep", tick_i, dt), off, n, shape, dt)
      for ri, rnd in enumerate(rounds):
        per_dt: dict[str, dict] = {}
        for a, b in rnd:
          for dt, entries in _pack_layout(msgs[(a, b)]).items():
            per_dt.setdefault(dt, {})[a] = entries
            for key, off, n, shape in entries:
              self.loc[(key, b)] = _Loc(("recv", tick_i, ri, dt), off, n, shape, dt)
        layout["rounds"].append((rnd, per_dt))
      self.sections.append(layout)
    self.producer, self.readers = producer, readers

  # -- the shard_map body -------------------------------------------------------

  def body(self, params: dict, batch: list):
    """One training step on local shards -> (grads like params, summed mean loss)."""
    plan, layout = self.plan, self.layout
    zero, n_dp = layout.zero, layout.n_dp
    rank_idx = lax.axis_index("pp")
    arrays: dict[tuple, jax.Array] = {}
    grads: dict[tuple[int, str], jax.Array] = {}
    loss = jnp.zeros((), jnp.float32)
    for tick_i, tick in enumerate(plan.ticks):
      sec = self.sections[tick_i]
      # Parameters this tick reads: whole segments (ZeRO-3: all-gathered here).
      slots = sorted({layout.home[p].slot for ts in tick for t in ts
                      for p in self.model.regions[t.region].params})
      dts = layout.dtypes
      if zero == 3:
        segs = {(s, dt): lax.all_gather(layout.local_chunk(params, s, dt), "dp", tiled=True)
                for s in slots for dt in dts if layout.segment_size(s, dt)}
      else:
        segs = None
      reads = sorted({self.loc[(key, rank)].array for rank, ts in enumerate(tick) for t in ts
                      for key in self._reads(t)
                      if (key, rank) in self.loc and self.loc[(key, rank)].array[1] < tick_i},
                     key=str)
      operands = {"arrays": {k: arrays[k] for k in reads}, "params": params if segs is None else segs,
                  "batch": batch}
      grad_keys = sorted({(layout.home[p].slot, layout.home[p].dtype) for ts in tick for t in ts
                          if t.pass_ is not Pass.F
                          for p in self.model.regions[t.region].params}, key=str)
      out_spec = self._out_spec(sec, grad_keys)
      branches = [self._branch(rank, tick_i, tick[rank], out_spec, segs is not None)
                  for rank in range(plan.n_ranks)]
      if len(branches) == 1:
        outs = branches[0](operands)
      else:
        outs = lax.switch(rank_idx, branches, operands)
      keep, rounds, g, l = outs
      loss = loss + l
      for dt, x in keep.items():
        arrays[("keep", tick_i, dt)] = x
      for ri, ((rnd, _), payload) in enumerate(zip(sec["rounds"], rounds)):
        for dt, x in payload.items():
          arrays[("recv", tick_i, ri, dt)] = lax.ppermute(x, "pp", perm=rnd)
      for key, x in g.items():
        if zero >= 2:
          x = lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True)
        grads[key] = grads[key] + x if key in grads else x
    return self._finish_grads(grads), lax.psum(loss, ("dp", "pp")) / (n_dp * self.n_mb)

  def _out_spec(self, sec, grad_keys):
    keep = {dt: max(e[-1][1] + e[-1][2] for e in per_rank.values())
            for dt, per_rank in sec["keep"].items()}
    rounds = [{dt: max(e[-1][1] + e[-1][2] for e in per_rank.values())
               for dt, per_rank in per_dt.items()} for _, per_dt in sec["rounds"]]
    grads = {key: self.layout.segment_size(*key) for key in grad_keys}
    return keep, rounds, grads

  def _branch(self, rank: int, tick_i: int, tasks: list[Task], out_spec, gathered: bool):
    layout, model, sec = self.layout, self.model, self.sections[tick_i]
    keep_sizes, round_sizes, grad_sizes = out_spec

    def run(ops):
      env: dict[tuple, jax.Array] = {}

      def read(key):
        if key in env:
          return env[key]
        loc = self.loc[(key, rank)]
        x = ops["arrays"][loc.array]
        return x[loc.offset:loc.offset + loc.size].reshape(loc.shape)

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

      grad_acc: dict[tuple, jax.Array] = {}
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
          srcs = self._ct_sources(r, m, k)
          ct = jnp.zeros(o.shape, jnp.dtype(o.dtype))
          for key in srcs:
            ct = ct + read(key).astype(ct.dtype)
          if spec.produces_loss and k == self.traced.loss_output():
            ct = ct + jnp.asarray(1.0 / (layout.n_dp * self.n_mb), ct.dtype)
          cts.append(ct)
        d_params, d_acts = region_backward(ad, stored, params, batch, acts, outs, cts)
        for i, x in zip(ad.diff_acts, d_acts):
          env[("ct", r, m, i)] = x
        by_leaf = {spec.params[i]: g for i, g in zip(ad.diff_params, d_params)}
        for key in {(layout.home[p].slot, layout.home[p].dtype) for p in by_leaf}:
          flat = self._flat_grad(key, by_leaf, grad_sizes[key])
          grad_acc[key] = grad_acc[key] + flat if key in grad_acc else flat

      def pack(entries_by_dt, sizes):
        out = {}
        for dt, size in sizes.items():
          entries = entries_by_dt.get(dt, {}).get(rank, [])
          parts = [jnp.ravel(env[key]).astype(dt) for key, _, _, _ in entries]
          used = sum(n for _, _, n, _ in entries)
          parts.append(jnp.zeros((size - used,), jnp.dtype(dt)))
          out[dt] = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        return out

      keep = pack(sec["keep"], keep_sizes)
      rounds = [pack(per_dt, sizes) for (_, per_dt), sizes in zip(sec["rounds"], round_sizes)]
      g = {key: grad_acc.get(key, jnp.zeros((n,), jnp.dtype(key[1]))) for key, n in grad_sizes.items()}
      return keep, rounds, g, loss

    return run

  def _flat_grad(self, key, by_leaf: dict, size: int) -> jax.Array:
    """A segment-sized gradient: the given leaves at their offsets, zeros elsewhere."""
    layout = self.layout
    dt = jnp.dtype(key[1])
    homes = sorted((h.offset, p) for p, h in enumerate(layout.home)
                   if (h.slot, h.dtype) == key and p in by_leaf)
    parts, at = [], 0
    for off, p in homes:
      if off > at:
        parts.append(jnp.zeros((off - at,), dt))
      parts.append(jnp.ravel(by_leaf[p]).astype(dt))
      at = off + layout.home[p].size
    if size > at:
      parts.append(jnp.zeros((size - at,), dt))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  def _finish_grads(self, grads: dict) -> dict:
    """Reduces accumulated gradients once and lays them out like the local param buffers."""
    layout = self.layout
    zero, n_dp = layout.zero, layout.n_dp
    out = {"slots": {}, "shared": {}}
    for dt in layout.dtypes:
      cols = []
      for j in range(layout.n_slots):
        c = layout.chunk.get((j, dt), 0)
        if not c:
          continue
        g = grads.get((j, dt))
        if g is None:
          g = jnp.zeros((c if zero >= 2 else n_dp * c,), jnp.dtype(dt))
        if zero == 0:
          g = lax.psum(g, "dp").reshape(n_dp, c)
        elif zero == 1:
          g = lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True).reshape(1, c)
        else:
          g = g.reshape(1, c)
        cols.append(g)
      rows = n_dp if zero == 0 else 1
      row = jnp.concatenate(cols, axis=1) if cols else jnp.zeros((rows, 0), jnp.dtype(dt))
      pad = layout.width[dt] - row.shape[1]
      out["slots"][dt] = jnp.pad(row, ((0, 0), (0, pad)))[None]
      c = layout.shared_chunk[dt]
      g = grads.get((SHARED, dt))
      if g is None:
        g = jnp.zeros((c if zero >= 2 else n_dp * c,), jnp.dtype(dt))
      g = lax.psum(g, "pp")
      if zero == 0:
        g = lax.psum(g, "dp").reshape(n_dp, c)
      elif zero == 1:
        g = lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True).reshape(1, c)
      else:
        g = g.reshape(1, c)
      out["shared"][dt] = g
    return out
