"""Packs parameter leaves into flat per-rank buffers sharded over ("pp", "dp").

Leaves split by shard / shard_tensor are not packed: each lives in a
[n_pp, n_group, *piece] array whose rows are the pieces of the devices of its
"ep" or "tp" group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from piper_jax.ir.model import ModelSpec
from piper_jax.ir.plan import Plan
from piper_jax.lowering.buffers import Buffers
from piper_jax.lowering.options import SLOT_BYTES, LoweringOptions

__all__ = ["ParamLayout", "Home", "Spread", "match_positions", "signature"]

SHARED = -1  # the slot index of the buffer every rank holds (tied or unused parameters)
SPLIT = -2   # the slot index of leaves split by shard / shard_tensor (kept unpacked)


def signature(aval) -> tuple:
  """(shape, dtype name) of an array or abstract value: what output positions share."""
  return _signature(tuple(aval.shape), aval.dtype)


@functools.lru_cache(maxsize=None)
def _signature(shape: tuple, dtype) -> tuple:
  # Cached: a plan asks for every value of every tick (16k calls for a 1.34B PP4 ZB).
  return (tuple(int(d) for d in shape), str(jnp.dtype(dtype)))


def match_positions(per_rank: dict[int, list[tuple[Any, Any]]]) -> tuple[list[tuple], dict]:
  """Gives each rank's values positions in one list, sharing positions by shape and dtype.

  Values of equal shape and dtype on different ranks (a transformer block's on
  every stage) share a position, so a `lax.switch` on the rank returns them without
  packing. Returns the positions' (shape, dtype) and, per (rank, key), the position.
  """
  positions: list[tuple] = []
  where: dict = {}
  for rank, values in sorted(per_rank.items()):
    used: set[int] = set()
    for key, aval in values:
      sig = signature(aval)
      pos = next((i for i, s in enumerate(positions) if s == sig and i not in used), None)
      if pos is None:
        positions.append(sig)
        pos = len(positions) - 1
      used.add(pos)
      where[(rank, key)] = pos
  return positions, where


def _pieces(x: jax.Array, dim: int, n: int) -> jax.Array:
  """[..., D, ...] -> [n, ..., D/n, ...]: the devices' pieces along `dim`."""
  s = x.shape
  return jnp.moveaxis(x.reshape(s[:dim] + (n, s[dim] // n) + s[dim + 1:]), dim, 0)


def _whole(x: jax.Array, dim: int) -> jax.Array:
  """The inverse of `_pieces`."""
  x = jnp.moveaxis(x, 0, dim)
  s = x.shape
  return x.reshape(s[:dim] + (s[dim] * s[dim + 1],) + s[dim + 2:])


def _fill_slots(leaves: Sequence[tuple], slot_bytes: int) -> tuple[list[tuple[int, int]], int]:
  """Slots and offsets of packed leaves, given per leaf (rank, group, dtype, size); rank
  None: the SHARED segment; a group is (region slot, cast or not), or (0, cast or not) for
  all of a pipeline rank's regions.

  A group's leaves of one dtype fill parts of at most `slot_bytes` in order (a larger
  leaf gets a part of its own). A group's parts on different ranks share slot indices
  largest with largest, so that little of a slot's buffer is padding on the ranks with
  smaller parts. Returns per leaf (slot, offset) and the number of slots.
  """
  fill: dict[tuple, int] = {}   # (rank, (group, part) or SHARED, dtype) -> elements
  last: dict[tuple, int] = {}   # (rank, group, dtype) -> its last part
  where = []
  for rank, j, dt, size in leaves:
    if rank is None:
      key = (None, SHARED, dt)
    else:
      k = last.setdefault((rank, j, dt), 0)
      n = fill.get((rank, (j, k), dt), 0)
      if n and n + size > slot_bytes // jnp.dtype(dt).itemsize:
        k = last[(rank, j, dt)] = k + 1
      key = (rank, (j, k), dt)
    where.append((key, fill.get(key, 0)))
    fill[key] = fill.get(key, 0) + size
  parts: dict[tuple, list] = {}
  for (rank, part, dt), n in fill.items():
    if part != SHARED:
      parts.setdefault((rank, part[0], dt), []).append((-n, part))
  rename = {(rank, part, dt): (j, i) for (rank, j, dt), ps in parts.items()
            for i, (_, part) in enumerate(sorted(ps))}
  ids = {x: i for i, x in enumerate(sorted(set(rename.values())))}
  return ([(SHARED if key[1] == SHARED else ids[rename[key]], off) for key, off in where],
          max(len(ids), 1))


@dataclasses.dataclass(frozen=True)
class Home:
  """Where a parameter leaf lives: a slot of a rank (or SHARED), an offset in its segment."""

  rank: int | None
  slot: int
  dtype: str
  offset: int
  size: int
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Spread:
  """A slot stored spread over all devices: its pipeline ranks' parts end to end, padded
  at the end to `size` elements (a multiple of the device count) and stored as
  [devices, size / devices] (two dimensions, as every other buffer: an optimizer's
  mask that reads `ndim` sees buffers alike). `lengths[r]`: the elements of rank r's part."""

  lengths: tuple[int, ...]
  size: int

  def offset(self, rank: int) -> int:
    return sum(self.lengths[:rank])


# Spread a slot when stacking its ranks' parts would pad it by more than this fraction.
SPREAD_PADDING = 0.25


class ParamLayout:
  """Parameter leaves packed per (pipeline rank, slot, dtype), in dp-sized chunks.

  The leaves of the j-th region placed on rank i fill slots (j, 0), (j, 1), ... of
  rank i, each of at most `options.slot_bytes`; slots are numbered across ranks in that order
  (leaves read on several ranks go to the SHARED segment that every rank holds). A
  pipeline rank's regions fill one sequence of slots, in order: a slot's buffer is then
  padded to the largest rank's part of the whole stage, not of one region (a first
  region that also holds the embedding would pad every rank's first slot to its size,
  and have it spread); a pipeline's ZeRO-3 gathers all of them as the step starts. A
  segment is padded to `n_dp * chunk` and stored as `n_dp` chunks, so that ZeRO-3
  shards it by keeping one chunk per replica. The buffers are a `Buffers`: per dtype,
  `slots[dtype]`, a list with one [n_pp, n_dp, chunk] array per slot of
  `slot_ids[dtype]`, and `shared[dtype]`: [n_dp, C_shared].

  Stacking pads each rank's part of a slot to the largest rank's: a pipeline whose
  first stage holds a large embedding would give every rank that many bytes of
  parameters and optimizer state. Below ZeRO-3 (and in any pipeline) such slots
  (`spread`, see `options.spread_uneven_slots`) are stored as one flat array over all devices
  (`Spread`), an even share per device, and laid out stacked only inside the step
  (`to_working`, `from_working`), where the optimizer never sees them.
  """

  def __init__(self, model: ModelSpec, plan: Plan, casts: dict[int, str] | None = None,
               options: LoweringOptions | None = None):
    self.options = options = options or LoweringOptions()
    mesh = plan.mesh
    # leaf -> (dimension, "ep" | "tp"): the leaves shard / shard_tensor split.
    split = {p: (d, mesh.sharded[r]) for r, dims in mesh.split_dims.items()
             for p, d in dims.items()}
    self.mesh = mesh
    self.split = {p: d for p, (d, _) in split.items()}   # leaf -> split dimension
    self.split_kind = {p: k for p, (_, k) in split.items()}  # leaf -> "ep" | "tp"
    self.params = model.params
    self._choose_casts(model, casts, options)
    self._place_leaves(model, plan)
    self._size_segments(model, mesh)
    self.spread: dict[tuple[int, str], Spread] = (
        self._spread_uneven() if self.n_pp > 1 and self.zero < 3 and options.spread_uneven_slots
        else {})
    self.cast_slots = {(h.slot, h.dtype) for p, h in enumerate(self.home) if p in self.cast}
    self._index = {(j, dt): i for dt, js in self.slot_ids.items() for i, j in enumerate(js)}
    self._unpack_casts()
    self.shared_chunk = {dt: max(self.chunk.get((SHARED, dt), 0), 1) for dt in self.dtypes}

  def _choose_casts(self, model: ModelSpec, casts: dict[int, str] | None,
                    options: LoweringOptions) -> None:
    """Leaves the model only reads in a narrower dtype (`TracedLoss.param_casts`), cast
    once per step: one target per dtype (the commonest), in slots of their own. In
    pipelines too: casting once a step is faster and compiles faster than casting in
    every task."""
    if not options.cast_weights:
      casts = {}
    casts = {p: to for p, to in (casts or {}).items() if p not in self.split}
    self.cast_to: dict[str, str] = {}
    for dt in sorted({model.params[p].dtype for p in casts}):
      targets = [to for p, to in casts.items() if model.params[p].dtype == dt]
      self.cast_to[dt] = max(sorted(set(targets)), key=targets.count)
    self.cast = {p for p, to in casts.items() if self.cast_to[model.params[p].dtype] == to}

  def _place_leaves(self, model: ModelSpec, plan: Plan) -> None:
    """Each leaf's `Home`: split leaves' pieces by position (shared across ranks by
    shape, per kind), the others packed into slots of their rank (or SHARED)."""
    mesh = plan.mesh
    region_slot: dict[int, int] = {}
    for rank in range(self.n_pp):
      for j, r in enumerate(plan.rank_regions(rank)):
        region_slot[r] = j
    users = model.param_users()
    homes: dict[int, Home] = {}
    packed: list[tuple] = []   # (leaf, rank or None for SHARED, region slot, dtype, size)
    split_vals: dict[str, dict[int, list]] = {k: {r: [] for r in range(self.n_pp)}
                                              for k in self.group_size}
    for p, spec in enumerate(model.params):
      ranks = {mesh.region_rank[u] for u in users[p]}
      if p in self.split:
        if len(ranks) != 1:
          raise ValueError(f"parameter {spec.name} is split (shard/shard_tensor) and read on "
                           f"several pipeline ranks; split parameters must stay on one rank")
        rank, kind = ranks.pop(), self.split_kind[p]
        piece = list(spec.shape)
        piece[self.split[p]] //= self.group_size[kind]
        split_vals[kind][rank].append(
            (p, jax.ShapeDtypeStruct(tuple(piece), jnp.dtype(spec.dtype))))
        homes[p] = Home(rank, SPLIT, spec.dtype, 0, spec.size, spec.shape)
      elif len(ranks) == 1:
        # Without a pipeline, ZeRO-3 gathers a region's slots for its tasks: one region each.
        group = (region_slot[users[p][0]] if self.n_pp == 1 else 0, p in self.cast)
        packed.append((p, ranks.pop(), group, spec.dtype, spec.size))
      else:
        packed.append((p, None, None, spec.dtype, spec.size))
    placed, self.n_slots = _fill_slots([x[1:] for x in packed],
                                             self.options.slot_bytes or SLOT_BYTES)
    for (p, rank, _, dt, size), (slot, off) in zip(packed, placed):
      homes[p] = Home(rank, slot, dt, off, size, model.params[p].shape)
    self.home: list[Home] = [homes[p] for p in range(len(model.params))]
    # Positions of split leaves' arrays, shared across ranks by shape, per kind:
    # (piece shape, dtype, kind).
    self.split_positions: list[tuple] = []
    self.split_pos: dict[int, int] = {}
    for kind, vals in split_vals.items():
      positions, where = match_positions(vals)
      self.split_pos.update({p: len(self.split_positions) + pos for (_, p), pos in where.items()})
      self.split_positions += [(shape, dt, kind) for shape, dt in positions]

  def _size_segments(self, model: ModelSpec, mesh) -> None:
    """Chunk size of each (slot, dtype) segment (the largest over ranks, split n_dp
    ways) and the slots that hold leaves of each dtype."""
    self.dtypes = sorted({s.dtype for p, s in enumerate(model.params) if p not in self.split})
    self.chunk: dict[tuple[int, str], int] = {}
    for h in self.home:
      if h.slot != SPLIT:
        c = math.ceil((h.offset + h.size) / self.n_dp)
        self.chunk[(h.slot, h.dtype)] = max(self.chunk.get((h.slot, h.dtype), 0), c)
    # The slots that hold leaves of each dtype, in the order of `slots[dtype]`.
    self.slot_ids = {dt: [j for j in range(self.n_slots) if self.chunk.get((j, dt), 0)]
                     for dt in self.dtypes}

  # -- what the mesh decides ------------------------------------------------

  @property
  def n_pp(self) -> int:
    return self.mesh.n_pp

  @property
  def n_dp(self) -> int:
    """Replicas each slot's chunks are spread over (all data axes together)."""
    return self.mesh.n_data

  @property
  def gathers_at_start(self) -> bool:
    """A pipeline's ZeRO-3 gathers its parameters once, as the step starts, and keeps
    them for the step (`gather_masters`): its tasks then hold no collective of their
    own and the pipeline is lowered as one loop. It is lowered as ZeRO-2 with sharded
    masters (a pipeline's ZeRO-2 sums gradients whole and reduce-scatters them once):
    gathered a tick at a time, a stage's weights were held for the step all the same,
    since consecutive ticks read them."""
    return self.mesh.zero == 3 and self.n_pp > 1 and self.n_dp > 1

  @property
  def zero(self) -> int:
    return 2 if self.gathers_at_start else self.mesh.zero

  @property
  def data_axes(self):
    """The data axes, or the one data axis by its name."""
    axes = self.mesh.data_axes
    return axes if len(axes) > 1 else axes[0]

  @property
  def group_size(self) -> dict[str, int]:
    """Devices of each "ep" / "tp" group."""
    return dict(self.mesh.inner)

  @property
  def copies(self) -> dict[str, tuple]:
    """(axes, number) of the copies of split pieces, per kind (`MeshSpec.copies`)."""
    return {k: self.mesh.copies(k) for k in self.mesh.inner}

  @property
  def n_devices(self) -> int:
    return self.n_pp * self.mesh.n_dp  # tensor-parallel devices included

  @property
  def all_axes(self) -> tuple[str, ...]:
    return self.mesh.axis_names

  def _spread_uneven(self) -> dict[tuple[int, str], Spread]:
    """The slots whose ranks' parts differ so much that stacking them would pad by more
    than `SPREAD_PADDING`: stored spread evenly over all devices."""
    spread = {}
    for (j, dt), chunk in self.chunk.items():
      if j == SHARED:
        continue
      lengths = [0] * self.n_pp
      for h in self.home:
        if h.slot == j and h.dtype == dt:
          lengths[h.rank] = max(lengths[h.rank], h.offset + h.size)
      content = sum(lengths)
      if content and self.n_pp * self.n_dp * chunk > (1 + SPREAD_PADDING) * content:
        size = math.ceil(content / self.n_devices) * self.n_devices
        spread[(j, dt)] = Spread(tuple(lengths), size)
    return spread

  def _unpack_casts(self) -> None:
    """A pipeline's cast leaves, unpacked once per step into arrays of their own that
    every tick passes through: sliced from a packed segment inside a tick, each weight
    is copied (a memcpy for cuBLAS) by every task reading it, F's and B's: 2 copies of
    the stage's weights a tick. The arrays are flat, so ranks share positions by size
    (`match_positions`; a GPT's embedding on the first rank and its head on the last
    share one); a rank fills the others' with zeros."""
    self.unpacked_positions: list[tuple] = []
    self.unpacked_pos: dict[int, int] = {}
    if self.n_pp > 1 and self.zero < 3:
      per_rank: dict[int, list] = {}
      for p in sorted(self.cast):
        h = self.home[p]
        if h.slot != SHARED:
          per_rank.setdefault(h.rank, []).append(
              (p, jax.ShapeDtypeStruct((h.size,), jnp.dtype(self.cast_to[h.dtype]))))
      self.unpacked_positions, where = match_positions(per_rank)
      self.unpacked_pos = {p: pos for (_, p), pos in where.items()}
    # Every cast leaf outside SHARED is unpacked, and cast leaves fill slots of their
    # own: these slots need no cast copy.
    self.unpacked_slots = {(self.home[p].slot, self.home[p].dtype) for p in self.unpacked_pos}

  @property
  def shards_masters(self) -> bool:
    """Whether ZeRO-1/2 keep the parameters sharded like the optimizer state and gather
    them at the start of each step (`gather_masters`), as Megatron's distributed optimizer.

    Only with weights the model reads in a narrower dtype: those are all-gathered in
    bf16 (half the bytes of gathering the fp32 parameters after the update, which
    ZeRO-1/2 otherwise do), and the gathered copy lives for the step only. Always for a
    pipeline's ZeRO-3 (`gathers_at_start`).
    """
    return self.gathers_at_start or (
        self.options.shard_masters and self.zero in (1, 2) and self.n_dp > 1
        and any(j != SHARED for j, _ in self.cast_slots))

  # -- shapes and shardings -------------------------------------------------

  def segment_size(self, slot: int, dtype: str) -> int:
    if slot == SHARED:
      return self.n_dp * self.shared_chunk[dtype]
    return self.n_dp * self.chunk.get((slot, dtype), 0)

  def _slot_shape(self, j: int, dt: str, working: bool) -> tuple[int, ...]:
    if not working and (j, dt) in self.spread:
      return (self.n_devices, self.spread[(j, dt)].size // self.n_devices)
    return (self.n_pp, self.n_dp, self.chunk[(j, dt)])

  def shapes(self, working: bool = False) -> Buffers:
    """The buffers' shapes as stored (`working`: as the step's body reads them)."""
    return Buffers(
        slots={dt: [jax.ShapeDtypeStruct(self._slot_shape(j, dt, working), jnp.dtype(dt))
                    for j in self.slot_ids[dt]]
               for dt in self.dtypes},
        shared={dt: jax.ShapeDtypeStruct((self.n_dp, self.shared_chunk[dt]), jnp.dtype(dt))
                for dt in self.dtypes},
        split=[jax.ShapeDtypeStruct((self.n_pp, self.group_size[k]) + shape, jnp.dtype(dt))
               for shape, dt, k in self.split_positions])

  def split_zero_dim(self, pos: int) -> int | None:
    """The dimension of split position `pos`'s piece that ZeRO shards over its copies
    (the first that divides evenly), or None (no copies, or none divides)."""
    shape, _, kind = self.split_positions[pos]
    _, copies = self.copies[kind]
    if copies == 1:
      return None
    return next((d for d, n in enumerate(shape) if n % copies == 0), None)

  def specs(self, sharded: bool, split_sharded: bool = False, working: bool = False) -> Buffers:
    """PartitionSpecs of the buffers: chunks sharded over the data axes when `sharded`
    (ZeRO); split leaves' pieces over their group's axis ("ep" or "tp"), and over
    their copies too when `split_sharded` (ZeRO's sharding of their gradients and
    optimizer state, and with ZeRO-3 of the pieces themselves). Spread slots are
    stored over all devices; `working`: the stacked layout the step's body reads."""
    dp = self.data_axes if sharded else None
    split = []
    for pos, (shape, _, kind) in enumerate(self.split_positions):
      dims = [None] * len(shape)
      d = self.split_zero_dim(pos) if split_sharded else None
      if d is not None:
        dims[d] = self.copies[kind][0]
      split.append(P("pp", kind, *dims))
    slot = lambda j, dt: (P(self.all_axes, None) if not working and (j, dt) in self.spread
                          else P("pp", dp, None))
    return Buffers(slots={dt: [slot(j, dt) for j in self.slot_ids[dt]] for dt in self.dtypes},
                   shared={dt: P(dp, None) for dt in self.dtypes}, split=split)

  # -- packing --------------------------------------------------------------

  def _part(self, leaves: Sequence[jax.Array], rank: int | None, slot: int, dt: str):
    """A rank's leaves of a (slot, dtype), flat and end to end (offsets leave no gaps)."""
    parts = [(h.offset, jnp.ravel(x)) for x, h in zip(leaves, self.home)
             if h.rank == rank and h.slot == slot and h.dtype == dt]
    parts.sort(key=lambda t: t[0])
    return jnp.concatenate([x for _, x in parts]) if parts else jnp.zeros((0,), jnp.dtype(dt))

  def _segment(self, leaves: Sequence[jax.Array], rank: int | None, slot: int, dt: str):
    flat = self._part(leaves, rank, slot, dt)
    n = self.segment_size(slot, dt)
    return jnp.pad(flat, (0, n - flat.shape[0])).reshape(self.n_dp, n // self.n_dp)

  def _pack_slot(self, leaves: Sequence[jax.Array], j: int, dt: str) -> jax.Array:
    if (j, dt) in self.spread:
      flat = jnp.concatenate([self._part(leaves, rank, j, dt) for rank in range(self.n_pp)])
      flat = jnp.pad(flat, (0, self.spread[(j, dt)].size - flat.shape[0]))
      return flat.reshape(self.n_devices, -1)
    return jnp.stack([self._segment(leaves, rank, j, dt) for rank in range(self.n_pp)])

  def pack(self, leaves: Sequence[jax.Array]) -> Buffers:
    """Parameter leaves (in pytree order) -> the buffers of `shapes()`."""
    leaves = [jnp.asarray(x) for x in leaves]
    slots, shared = {}, {}
    for dt in self.dtypes:
      slots[dt] = [self._pack_slot(leaves, j, dt) for j in self.slot_ids[dt]]
      shared[dt] = self._segment(leaves, None, SHARED, dt)
    split = []
    for pos, (shape, dt, kind) in enumerate(self.split_positions):
      n = self.group_size[kind]
      rows = [jnp.zeros((n,) + shape, jnp.dtype(dt))] * self.n_pp
      for p, q in self.split_pos.items():
        if q == pos:
          rows[self.home[p].rank] = _pieces(leaves[p], self.split[p], n)
      split.append(jnp.stack(rows))
    return Buffers(slots=slots, shared=shared, split=split)

  def unpack(self, buffers: Buffers) -> list[jax.Array]:
    """The buffers of `pack` -> parameter leaves in pytree order."""
    out = []
    for p, h in enumerate(self.home):
      if h.slot == SPLIT:
        out.append(_whole(buffers.split[self.split_pos[p]][h.rank], self.split[p]))
        continue
      if h.slot == SHARED:
        seg = buffers.shared[h.dtype].reshape(-1)
      elif h.size == 0:
        seg = jnp.zeros((0,), jnp.dtype(h.dtype))
      elif (h.slot, h.dtype) in self.spread:
        flat = buffers.slots[h.dtype][self._index[(h.slot, h.dtype)]]
        seg = flat.reshape(-1)[self.spread[(h.slot, h.dtype)].offset(h.rank):]
      else:
        seg = buffers.slots[h.dtype][self._index[(h.slot, h.dtype)]][h.rank].reshape(-1)
      out.append(seg[h.offset:h.offset + h.size].reshape(h.shape))
    return out

  def to_working(self, buffers: Buffers) -> Buffers:
    """Stored buffers -> the stacked layout the step's body reads: each spread slot's
    ranks' parts as the rows of a [n_pp, n_dp, chunk] array (outside shard_map: XLA
    moves the pieces)."""
    def rows(x, j, dt):
      sp, n, flat = self.spread[(j, dt)], self.n_dp * self.chunk[(j, dt)], x.reshape(-1)
      return jnp.stack([jnp.pad(lax.slice(flat, (sp.offset(r),), (sp.offset(r) + sp.lengths[r],)),
                                (0, n - sp.lengths[r])).reshape(self.n_dp, n // self.n_dp)
                        for r in range(self.n_pp)])
    return self._map_spread(buffers, rows)

  def from_working(self, buffers: Buffers) -> Buffers:
    """The inverse of `to_working` (the step's gradients -> the stored layout)."""
    def flat(x, j, dt):
      sp = self.spread[(j, dt)]
      parts = jnp.concatenate([x[r].reshape(-1)[:sp.lengths[r]] for r in range(self.n_pp)])
      return jnp.pad(parts, (0, sp.size - parts.shape[0])).reshape(self.n_devices, -1)
    return self._map_spread(buffers, flat)

  def _map_spread(self, buffers: Buffers, fn) -> Buffers:
    if not self.spread:
      return buffers
    slots = {dt: [fn(x, j, dt) if (j, dt) in self.spread else x
                  for j, x in zip(self.slot_ids[dt], xs)]
             for dt, xs in buffers.slots.items()}
    return buffers.replace(slots=slots)

  # -- inside shard_map -----------------------------------------------------

  def local_segment(self, local: Buffers, slot: int, dt: str) -> jax.Array:
    """What this device's buffers hold of a (slot, dtype) segment, flat: the whole
    segment under ZeRO 0-2, this replica's chunk of it under ZeRO-3."""
    if slot == SHARED:
      return local.shared[dt].reshape(-1)
    if (slot, dt) not in self._index:  # only empty leaves
      return jnp.zeros((0,), jnp.dtype(dt))
    return local.slots[dt][self._index[(slot, dt)]][0].reshape(-1)

  def local_piece(self, split: list, p: int) -> jax.Array:
    """This device's piece of split leaf `p`, from the `Buffers.split` pieces."""
    return split[self.split_pos[p]][0, 0]

  def gather_piece(self, x: jax.Array, pos: int) -> jax.Array:
    """Split position `pos`'s [1, 1, *piece] buffer, sharded over its copies by ZeRO
    (`split_zero_dim`), all-gathered whole again."""
    d = self.split_zero_dim(pos)
    if d is None:
      return x
    return lax.all_gather(x, self.copies[self.split_positions[pos][2]][0], axis=2 + d, tiled=True)

  def gather_masters(self, local: Buffers) -> Buffers:
    """Under `shards_masters`: this replica's shards of the parameters -> the whole
    buffers, slots of cast leaves cast before they are all-gathered (bf16 on the wire)."""
    dp = self.data_axes
    slots = {dt: [lax.all_gather(x.astype(self.cast_to[dt]) if (j, dt) in self.cast_slots else x,
                                 dp, axis=1, tiled=True)
                  for j, x in zip(self.slot_ids[dt], xs)]
             for dt, xs in local.slots.items()}
    split = [self.gather_piece(x, pos) for pos, x in enumerate(local.split)]
    return Buffers(slots=slots, split=split,
                   shared={dt: lax.all_gather(x, dp, axis=0, tiled=True)
                           for dt, x in local.shared.items()})

  def leaf(self, segment: jax.Array, h: Home, start: jax.Array | None = None) -> jax.Array:
    """Leaf `h` of its flat segment; `start`: its offset as a traced scalar, where the
    caller keeps XLA from folding it (`tick_loop._offsets`)."""
    if start is None:
      return segment[h.offset:h.offset + h.size].reshape(h.shape)
    return lax.dynamic_slice(segment, (start,), (h.size,),
                             allow_negative_indices=False).reshape(h.shape)

  def unpack_cast(self, local: Buffers) -> list[jax.Array]:
    """This rank's cast leaves (`unpacked_pos`), flat, sliced from its local buffers
    (whole segments) and cast; positions of other ranks' leaves hold zeros."""
    def rank_leaves(rank):
      def run(local):
        out = [None] * len(self.unpacked_positions)
        for p, pos in self.unpacked_pos.items():
          h = self.home[p]
          if h.rank == rank:
            seg = self.local_segment(local, h.slot, h.dtype)
            out[pos] = seg[h.offset:h.offset + h.size].astype(self.cast_to[h.dtype])
        return [jnp.zeros(shape, dt) if x is None else x
                for x, (shape, dt) in zip(out, self.unpacked_positions)]
      return run

    local = local.replace(split=[])
    return lax.switch(lax.axis_index("pp"), [rank_leaves(r) for r in range(self.n_pp)], local)

  def unpacked_leaf(self, leaves: list[jax.Array], p: int) -> jax.Array:
    """Leaf `p` from `unpack_cast`'s arrays, in its shape (a reshape of a flat array)."""
    return leaves[self.unpacked_pos[p]].reshape(self.home[p].shape)
