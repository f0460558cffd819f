"""Where a step's weight gradients accumulate, and how they are reduced and laid out.

The loop over ticks (pipelines, gradient accumulation) adds each task's weight gradients
to the rank's whole (slot, dtype) segments in place (`in_segments`). A step of one
microbatch on one rank, written out tick by tick, adds them to running sums, one per leaf
(flat, at a position ranks share by size: `match_positions`), laid out into the flat
parameter segments as the step ends (`assemble`). Under ZeRO 2/3 without a pipeline,
either step reduce-scatters each tick's gradients into this replica's segments. The sums are reduced over the data axes once (`finish`). Split
leaves (shard / shard_tensor) keep their pieces' shapes and are summed over their copies
only (`finish_split`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from piper_jax.ir.plan import Plan
from piper_jax.ir.model import ModelSpec
from piper_jax.lowering.buffers import Buffers
from piper_jax.lowering.layout import SHARED, ParamLayout, match_positions
from piper_jax.lowering.regions import RegionAD

__all__ = ["GradientSums", "zeros_of"]


def zeros_of(sig) -> jax.Array:
  """Zeros of a (shape, dtype) signature."""
  return jnp.zeros(sig[0], jnp.dtype(sig[1]))


class GradientSums:
  """The step's gradient sums: their positions, what each task adds, the reductions.

  Attributes:
    positions: (shape, dtype) of each sum. Per-leaf sums are flat, so that leaves of
      one size on different ranks share a position whatever their shapes (a model's
      embedding [V, D] on the first rank and its head [D, V] on the last): every rank
      holds every position, and by shape each would hold both. Split leaves' pieces
      come last, from `split0` on, at `split0 + layout.split_pos[p]`.
    in_segments: the loop over ticks: the sums of unsplit leaves are the rank's whole
      (slot, dtype) segments, each leaf added at its offset, not per-leaf sums (which a
      switch over task kinds would pass through, one array each, and lay out at the end).
    where: (rank, leaf) -> its position.
    leaves_of_rank: rank -> the unsplit leaves whose gradients it makes.
    owned: rank -> the positions of those leaves.
    reduce_dtype: the dtype gradients travel in over the data axes (replicate's
      reduce_dtype), or None for their own.
    scatter_each_tick: ZeRO-2/3 without a pipeline: each tick's gradients are
      reduce-scattered as it makes them, and the sums are this replica's chunks. A
      pipeline's ZeRO-2/3 sum a stage's gradients whole over its microbatches, as
      ZeRO-0/1 do, and reduce-scatter them once after the last tick (as Megatron's
      distributed optimizer and PyTorch's pipeline schedules over FSDP do): per tick it
      would be a reduce-scatter per microbatch, and XLA holds several ticks' whole
      gradients while they run, more than the one whole sum.
  """

  def __init__(self, model: ModelSpec, plan: Plan, layout: ParamLayout,
               ad: dict[int, RegionAD], reduce_dtype: str | None, looped: bool = False):
    """`looped`: the step is one loop over its ticks (`lowering.tick_loop`)."""
    self.model, self.plan, self.layout, self.ad = model, plan, layout, ad
    self.reduce_dtype = reduce_dtype
    self.data_axes = plan.mesh.data_axes
    self.n_data = plan.mesh.n_data
    self.scatter_each_tick = layout.zero >= 2 and plan.mesh.n_pp == 1
    self.in_segments = looped and not self.scatter_each_tick
    per_rank: dict[int, list] = {r: [] for r in range(plan.n_ranks)}
    split_leaves: dict[int, int] = {}
    for r in model.regions:
      rank = plan.mesh.region_rank[r.index]
      for p in self.leaves(r.index):
        if p in layout.split:
          split_leaves[p] = rank
        elif all(k != p for k, _ in per_rank[rank]):
          per_rank[rank].append((p, jax.ShapeDtypeStruct((model.params[p].size,),
                                                          jnp.dtype(model.params[p].dtype))))
    self.positions, self.where = match_positions(per_rank)
    self.split0 = len(self.positions)
    self.positions += [(shape, dt) for shape, dt, _ in layout.split_positions]
    for p, rank in split_leaves.items():
      self.where[(rank, p)] = self.split0 + layout.split_pos[p]
      per_rank[rank].append((p, None))
    self.leaves_of_rank = {rank: [p for p, _ in vals if p not in layout.split]
                           for rank, vals in per_rank.items()}
    self.owned = {rank: {self.where[(rank, p)] for p in leaves}
                  for rank, leaves in self.leaves_of_rank.items()}

  def leaves(self, region: int) -> list[int]:
    """The leaves `region`'s backward makes gradients for."""
    spec = self.model.regions[region]
    return [spec.params[i] for i in self.ad[region].diff_params]

  def buckets(self, final_at: list[set[int]]) -> dict[int, list[list[int]]]:
    """ZeRO-0 with bucket_mb: per tick, the buckets of positions that become final in
    it (`final_at[t]`: the positions tick t adds to)."""
    if self.layout.zero != 0 or not self.plan.bucket_mb or self.layout.n_dp == 1:
      return {}
    last = {pos: t for t, grads in enumerate(final_at) for pos in grads if pos < self.split0}
    limit = self.plan.bucket_mb * 2**20
    out: dict[int, list[list[int]]] = {}
    for t in sorted(set(last.values())):
      bucket, size = [], 0
      for pos in sorted((p for p, lt in last.items() if lt == t), reverse=True):
        shape, dt = self.positions[pos]
        bucket.append(pos)
        size += int(np.prod(shape)) * np.dtype(dt).itemsize
        if size >= limit:
          out.setdefault(t, []).append(bucket)
          bucket, size = [], 0
      if bucket:
        out.setdefault(t, []).append(bucket)
    return out

  def collective(self, op, x, *args, keep_dtype: bool = True, **kwargs):
    """`op(x, ...)` (psum or psum_scatter of gradients over data axes; x an array or a
    tuple), computed in `reduce_dtype` where there is one; the result is cast back to x's
    dtype unless `keep_dtype` is False."""
    if lax.psum(1, args[0] if args else kwargs["axis_name"]) == 1:
      return x  # a sum over one device, which XLA would still copy
    dt = self.reduce_dtype
    if dt is None:
      return op(x, *args, **kwargs)
    cast = lambda t, to: t.astype(to) if jnp.issubdtype(t.dtype, jnp.floating) else t
    out = op(jax.tree_util.tree_map(lambda t: cast(t, dt), x), *args, **kwargs)
    if not keep_dtype:
      return out
    return jax.tree_util.tree_map(lambda t, ref: cast(t, ref.dtype), out, x)

  def zero_sums(self) -> tuple[dict, dict]:
    """Zero sums of every position the step adds to: (acc, split_acc)."""
    if self.in_segments:
      acc = {key: jnp.zeros((self.layout.segment_size(*key),), jnp.dtype(key[1]))
             for key in self.segment_keys(range(self.split0))}
    elif not self.scatter_each_tick:
      acc = {pos: zeros_of(self.positions[pos]) for pos in range(self.split0)}
    else:
      acc = {key: jnp.zeros((self.layout.segment_size(*key) // self.n_data,), jnp.dtype(key[1]))
             for key in self.segment_keys(range(self.split0))}
    split = {pos: zeros_of(self.positions[pos])
             for pos in range(self.split0, len(self.positions))}
    return acc, split

  def add_task(self, rank: int, grads: dict[int, jax.Array], acc: dict,
               split_acc: dict) -> None:
    """Adds one task's weight gradients (leaf -> array) on pipeline rank `rank` to the
    step's sums (`zero_sums`): per-leaf sums, or this replica's reduce-scattered
    segments (`scatter_each_tick`); split leaves' pieces to `split_acc`."""
    if self.in_segments:
      for key, start, gs in self._runs(grads):
        g = jnp.concatenate([jnp.ravel(g).astype(acc[key].dtype) for g in gs])
        acc[key] = lax.dynamic_update_slice(acc[key], acc[key][start:start + g.size] + g,
                                            (start,))
      grads = {p: g for p, g in grads.items() if p in self.layout.split}
    by_pos = {self.where[(rank, p)]: g for p, g in grads.items()}
    segment_grads = {}
    for pos, g in by_pos.items():
      if pos >= self.split0:
        split_acc[pos] = split_acc[pos] + g.astype(split_acc[pos].dtype)
      elif not self.scatter_each_tick:
        acc[pos] = acc[pos] + jnp.ravel(g).astype(acc[pos].dtype)
      else:
        segment_grads[pos] = g.astype(self.positions[pos][1])
    if segment_grads:
      keys = sorted({(self.layout.home[p].slot, self.layout.home[p].dtype)
                     for p in self.leaves_of_rank[rank]
                     if self.where[(rank, p)] in segment_grads}, key=str)
      segs = self.assemble_rank(rank, segment_grads, keys, self.reduce_dtype, True)
      for key, x in segs.items():
        x = self.collective(lax.psum_scatter, x, self.data_axes, scatter_dimension=0,
                            tiled=True)
        acc[key] = acc[key] + x.astype(key[1])

  def _runs(self, grads: dict[int, jax.Array]) -> list[tuple[tuple, int, list]]:
    """The unsplit leaves of `grads` as runs that lie back to back in one segment:
    ((slot, dtype), offset of the run, its gradients in order). One add per run
    instead of one per leaf: a region's leaves are consecutive in its rank's slot, and
    XLA compiles each add at its own offset as its own kernel."""
    homes = sorted(((self.layout.home[p], p) for p in grads if p not in self.layout.split),
                   key=lambda hp: (str(hp[0].slot), hp[0].dtype, hp[0].offset))
    runs: list[tuple[tuple, int, list]] = []
    end = None
    for h, p in homes:
      key = (h.slot, h.dtype)
      if runs and runs[-1][0] == key and end == h.offset:
        runs[-1][2].append(grads[p])
      else:
        runs.append((key, h.offset, [grads[p]]))
      end = h.offset + grads[p].size
    return runs

  def tick_sums(self, rank: int, grads: dict[int, jax.Array], positions, old: dict,
                filler: Callable) -> dict[int, jax.Array]:
    """In a step written out tick by tick, the sums after rank `rank`'s part of a tick,
    at `positions` (those any rank adds to in the tick): `old` plus its gradients (leaf -> array) where
    it made some, its sum passed through where it made none, and at a position it does
    not own (another rank's leaves, shared by size) `filler(signature)`: an array nobody
    reads, which is never assembled and needs no copy."""
    by_pos = {self.where[(rank, p)]: g for p, g in grads.items()}
    out = {}
    for pos in positions:
      g, prev, sig = by_pos.get(pos), old.get(pos), self.positions[pos]
      if g is not None:
        g = g.astype(sig[1])
        if pos < self.split0:  # per-leaf sums are flat; split pieces keep their shape
          g = jnp.ravel(g)
        out[pos] = g if prev is None else prev + g
      elif pos < self.split0 and pos not in self.owned[rank]:
        out[pos] = filler(sig)
      else:
        out[pos] = zeros_of(sig) if prev is None else prev
    return out

  def segment_keys(self, positions) -> list[tuple]:
    """The (slot, dtype) segments that gradients at `positions` (any rank's) fall in."""
    layout = self.layout
    return sorted({(layout.home[p].slot, layout.home[p].dtype)
                   for rank, leaves in self.leaves_of_rank.items() for p in leaves
                   if self.where[(rank, p)] in positions}, key=str)

  def assemble(self, grads: dict[int, jax.Array], switch: Callable, dtype: str | None = None,
               materialize: bool = False) -> dict[tuple, jax.Array]:
    """Per-leaf gradients (by position) -> this rank's flat (slot, dtype) segments, built
    in `dtype` if given (a reduction's dtype: the cast fuses into the copy of each leaf),
    through `switch` (one branch per pipeline rank). `materialize`: each raveled leaf is
    computed on its own (an optimization barrier) instead of fused into the segment's
    concatenate, whose GPU emitter can produce a fused bias-gradient reduction with one
    thread per column, slow enough to matter per step."""
    keys = self.segment_keys(grads)
    return switch([lambda g, r=r: self.assemble_rank(r, g, keys, dtype, materialize)
                   for r in range(self.plan.n_ranks)], grads)

  def assemble_rank(self, rank: int, g: dict[int, jax.Array], keys: list[tuple],
                    dtype: str | None, materialize: bool) -> dict[tuple, jax.Array]:
    """`assemble` on pipeline rank `rank`: its leaves' gradients into segments `keys`."""
    layout = self.layout
    segs = {key: jnp.zeros((layout.segment_size(*key),), jnp.dtype(dtype or key[1]))
            for key in keys}
    for p in self.leaves_of_rank[rank]:
      pos = self.where[(rank, p)]
      if pos not in g:
        continue
      h = layout.home[p]
      key = (h.slot, h.dtype)
      leaf = jnp.ravel(g[pos]).astype(segs[key].dtype)
      if materialize:
        leaf = lax.optimization_barrier(leaf)
      segs[key] = lax.dynamic_update_slice(segs[key], leaf, (h.offset,))
    return segs

  def finish(self, segments: dict, split_acc: dict, bucketed: bool) -> Buffers:
    """Reduces the assembled segments and the split leaves' sums (`finish_split`) once,
    laid out like the local parameter buffers; `bucketed`: ZeRO-0's sums were already
    all-reduced in buckets."""
    layout = self.layout
    slots, shared = {}, {}
    for dt in layout.dtypes:
      slots[dt] = [self._reduce(segments.get((j, dt)), layout.chunk[(j, dt)], dt,
                                bucketed)[None]
                   for j in layout.slot_ids[dt]]
      tied = segments.get((SHARED, dt))
      tied = None if tied is None else lax.psum(tied, "pp")  # tied: summed over ranks
      shared[dt] = self._reduce(tied, layout.shared_chunk[dt], dt, bucketed)
    return Buffers(slots=slots, shared=shared, split=self.finish_split(split_acc))

  def _reduce(self, g, chunk: int, dt: str, bucketed: bool) -> jax.Array:
    """A segment's gradient, reduced over "dp" as its ZeRO stage says, as [rows, chunk].

    ZeRO-0: all-reduced, every replica keeps all rows; ZeRO-1 (and a pipeline's 2/3):
    reduce-scattered to this replica's chunk; else already reduce-scattered per tick.
    """
    zero, n_dp, axes = self.layout.zero, self.layout.n_dp, self.data_axes
    if g is None:
      g = jnp.zeros((chunk if self.scatter_each_tick else n_dp * chunk,), jnp.dtype(dt))
    if zero == 0:
      g = g if bucketed else self.collective(lax.psum, g, axes)
      return g.astype(dt).reshape(n_dp, chunk)
    if not self.scatter_each_tick:
      g = self.collective(lax.psum_scatter, g, axes, scatter_dimension=0, tiled=True)
      return g.astype(dt).reshape(1, chunk)
    return g.reshape(1, chunk)

  def finish_split(self, split_acc: dict[int, jax.Array]) -> list[jax.Array]:
    """Split leaves' gradients, summed over the copies of their group, as [1, 1, *piece].

    Expert pieces are copied over "dp" (tensor-parallel devices compute the same
    ones); tensor-parallel pieces over the data axes, whose devices see other rows.
    With ZeRO >= 1 the sum is reduce-scattered along `layout.split_zero_dim`.
    """
    layout, out = self.layout, []
    for k, (shape, dt, kind) in enumerate(layout.split_positions):
      g = split_acc.get(self.split0 + k)
      g = jnp.zeros(shape, jnp.dtype(dt)) if g is None else g
      axes, copies = layout.copies[kind]
      d = layout.split_zero_dim(k) if layout.zero >= 1 else None
      if d is not None:
        g = self.collective(lax.psum_scatter, g, axes, scatter_dimension=d, tiled=True)
      elif copies > 1:
        g = self.collective(lax.psum, g, axes)
      out.append(g[None, None])
    return out
