"""Directives: the strategy language. Frozen dataclasses with Piper's JSON format."""

from __future__ import annotations

import dataclasses
import difflib
import json
import operator
import os
from typing import Any, Mapping, Sequence, Union


__all__ = [
    "Directive", "Filter", "Place", "Replicate", "Shard", "ShardTensor", "Split", "Order",
    "place", "replicate", "shard", "shard_tensor", "split", "order",
    "load_directives", "dump_directives", "freeze_filter",
]

FilterValue = Union[int, str]
# A filter is stored frozen as sorted (tag, value) pairs; users write dicts.
Filter = tuple[tuple[str, FilterValue], ...]
PASSES = ("F", "B", "BI", "BW")
# Dtypes a data-parallel gradient reduction may run in (`replicate(reduce_dtype=...)`).
REDUCE_DTYPES = ("float32", "bfloat16", "float16")


def freeze_filter(spec: Mapping[str, FilterValue] | Filter | None, op: str = "") -> Filter:
  """A filter dict (`{TAG: index | "*"}`) as a hashable, sorted tuple.

  `op` names the directive being built, for the error message."""
  if spec is None:
    return ()
  items = spec.items() if isinstance(spec, Mapping) else spec
  where = f"pj.{op} filter {dict(items)}: " if op else ""
  out = []
  for tag, value in items:
    if not isinstance(tag, str):
      raise ValueError(f"{where}filter keys must be tag names, got {tag!r}")
    if tag == "PASS":
      if value != "*" and value not in PASSES:
        upper = value.upper() if isinstance(value, str) else None
        hint = f" (did you mean {upper!r}?)" if upper in PASSES else ""
        raise ValueError(f"{where}PASS must be one of {list(PASSES)} or '*', got {value!r}{hint}")
    elif not (value == "*" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)):
      raise ValueError(f"{where}the value for {tag!r} must be an index >= 0 or '*', got {value!r}")
    out.append((tag, value))
  return tuple(sorted(out))


def _filter_json(f: Filter) -> dict:
  return {k: v for k, v in f}


def _devices(devices: Sequence[int]) -> tuple[int, ...]:
  # Integers only (anything with __index__): int() would take device 1.7 as device 1.
  def index(d) -> int:
    try:
      if not isinstance(d, bool):
        return operator.index(d)
    except TypeError:
      pass
    raise ValueError(f"devices must be integer device indices, got {d!r}")
  devs = tuple(index(d) for d in devices)
  if not devs:
    raise ValueError("devices must be a non-empty list of device indices")
  if any(d < 0 for d in devs):
    raise ValueError(f"devices must be device indices >= 0 (they count from 0 and do not "
                     f"wrap around), got {list(devs)}")
  if len(set(devs)) != len(devs):
    raise ValueError(f"devices must not repeat, got {list(devs)}")
  return devs


class Directive:
  """Base of all directives: JSON round trip in Piper's format."""

  op: str = ""

  def to_json(self) -> dict:
    raise NotImplementedError

  def to_json_str(self) -> str:
    return json.dumps(self.to_json(), sort_keys=False)

  @staticmethod
  def from_json(obj: Mapping[str, Any]) -> "Directive":
    """A directive from one entry of a Piper JSON schedule (`{"op": ...}`).

    Raises:
      ValueError: naming the entry as JSON and what to change in it; a place,
        replicate, shard or shard_tensor entry without a "filter" is one.
    """
    try:
      if not isinstance(obj, Mapping) or "op" not in obj:
        raise ValueError(f"a directive is a JSON object with an 'op' key, got {obj!r}")
      op = obj["op"]
      if op not in _OPS:
        raise ValueError(f"unknown directive op {op!r}; expected one of {sorted(_OPS)}")
      # As in Piper's loader: a forgotten filter would otherwise match every node unnoticed.
      if op in _NEEDS_FILTER and obj.get("filter") is None:
        raise ValueError(f'a {op} entry needs a "filter": add "filter": {{}} to match every '
                         f'node, or name the nodes, e.g. "filter": {{"PP": 0}}')
      _check_keys(op, obj)
      return _OPS[op]._from_json(obj)
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{json.dumps(obj, default=repr)}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Place(Directive):
  """Runs the matched nodes on `devices` (one device, or a replicate group)."""

  filter: Filter
  devices: tuple[int, ...]
  stream: str | None = None
  op = "place"

  def to_json(self):
    out = {"op": "place", "filter": _filter_json(self.filter), "devices": list(self.devices)}
    if self.stream is not None:
      out["stream"] = self.stream
    return out

  @classmethod
  def _from_json(cls, o):
    return place(o["filter"], o["devices"], stream=o.get("stream"))


@dataclasses.dataclass(frozen=True)
class Replicate(Directive):
  """Data parallel over `devices` with ZeRO stage `zero` (0-3)."""

  filter: Filter
  devices: tuple[int, ...]
  zero: int = 0
  bucket_mb: float | None = None
  reduce_stream: str | None = None
  gather_stream: str | None = None
  reduce_dtype: str | None = None
  op = "replicate"

  def to_json(self):
    out = {"op": "replicate", "filter": _filter_json(self.filter), "devices": list(self.devices)}
    for key in ("reduce_stream", "gather_stream", "reduce_dtype"):
      if getattr(self, key) is not None:
        out[key] = getattr(self, key)
    if self.zero == 1:
      out["zero"] = 1  # Piper has no ZeRO-1 key; this extension keeps the round trip.
    if self.zero >= 2:
      out["shard_grads"] = True
    if self.zero == 3:
      out["shard_params"] = True
    if self.bucket_mb is not None:
      out["bucket_size"] = self.bucket_mb
    return out

  @classmethod
  def _from_json(cls, o):
    zero = 3 if o.get("shard_params") else 2 if o.get("shard_grads") else int(o.get("zero", 0))
    return replicate(o["filter"], o["devices"], zero=zero, bucket_mb=o.get("bucket_size"),
                     reduce_stream=o.get("reduce_stream"), gather_stream=o.get("gather_stream"),
                     reduce_dtype=o.get("reduce_dtype"))


@dataclasses.dataclass(frozen=True)
class Shard(Directive):
  """Expert parallel: partitions the expert axis over `devices` (all-to-all)."""

  filter: Filter
  devices: tuple[int, ...]
  op = "shard"

  def to_json(self):
    return {"op": "shard", "filter": _filter_json(self.filter), "devices": list(self.devices)}

  @classmethod
  def _from_json(cls, o):
    return shard(o["filter"], o["devices"])


@dataclasses.dataclass(frozen=True)
class ShardTensor(Directive):
  """Tensor parallel (Megatron f/g) over `devices` along the partitioning axis `axis`."""

  filter: Filter
  devices: tuple[int, ...]
  axis: str = "tp"
  op = "shard_tensor"

  def to_json(self):
    return {"op": "shard_tensor", "filter": _filter_json(self.filter),
            "devices": list(self.devices), "axis": self.axis}

  @classmethod
  def _from_json(cls, o):
    return shard_tensor(o["filter"], o["devices"], axis=o.get("axis", "tp"))


@dataclasses.dataclass(frozen=True)
class Split(Directive):
  """Splits the batch of the matched regions into `num_microbatches` microbatches."""

  num_microbatches: int
  filter: Filter = ()
  dim_name: str = "MB"
  op = "split"

  def to_json(self):
    return {"op": "split", "filter": _filter_json(self.filter), "dim_name": self.dim_name,
            "num_microbatches": self.num_microbatches}

  @classmethod
  def _from_json(cls, o):
    return split(o["num_microbatches"], o.get("filter") or None, dim_name=o.get("dim_name", "MB"))


@dataclasses.dataclass(frozen=True)
class Order(Directive):
  """Orders groups of nodes: every node of group i runs before every node of group i+1."""

  groups: tuple[tuple[Filter, ...], ...]
  op = "order"

  def to_json(self):
    return {"op": "order", "filters": [[_filter_json(f) for f in g] for g in self.groups]}

  @classmethod
  def _from_json(cls, o):
    return order(o["filters"])


_OPS = {c.op: c for c in (Place, Replicate, Shard, ShardTensor, Split, Order)}
# The keys each entry takes, Piper's spellings included: (required, optional).
_KEYS = {
    "place": (("filter", "devices"), ("stream",)),
    "replicate": (("filter", "devices"),
                  ("zero", "shard_grads", "shard_params", "bucket_size", "reduce_stream",
                   "gather_stream", "reduce_dtype")),
    "shard": (("filter", "devices"), ()),
    "shard_tensor": (("filter", "devices"), ("axis",)),
    "split": (("num_microbatches",), ("filter", "dim_name")),
    "order": (("filters",), ()),
}


def _check_keys(op: str, obj: Mapping[str, Any]) -> None:
  """Refuses an unknown key (a misspelling would otherwise be dropped) and a missing one."""
  required, optional = _KEYS[op]
  allowed = ("op",) + required + optional
  takes = f"a {op} entry takes {', '.join(repr(k) for k in allowed)}"
  for key in obj:
    if key not in allowed:
      close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.5)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ValueError(f"unknown key {key!r}{hint}; {takes}")
  for key in required:
    if key not in obj:
      raise ValueError(f"missing key {key!r}; {takes}")
# Split's filter stays optional (Piper requires it): `pj.split` documents `filter=None`, and
# a split must cover the whole model whatever its filter says.
_NEEDS_FILTER = ("place", "replicate", "shard", "shard_tensor")


def place(filter, devices, stream=None) -> Place:
  """Places the nodes matched by `filter` on `devices`."""
  return Place(freeze_filter(filter, "place"), _devices(devices), stream)


def replicate(filter, devices, zero=0, bucket_mb=None, reduce_stream=None,
              gather_stream=None, reduce_dtype=None) -> Replicate:
  """Replicates the matched regions over `devices` (data parallel) with ZeRO `zero` in 0..3.

  `reduce_dtype` ("bfloat16", "float16" or "float32"; default: the parameter's dtype)
  is the dtype gradients are cast to for their reduction over `devices`, as PyTorch
  FSDP's `reduce_dtype`: bf16 halves the bytes and rounds each replica's gradient.
  """
  if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
    raise ValueError(f"replicate zero must be 0, 1, 2 or 3, got {zero!r}")
  if bucket_mb is not None and not bucket_mb > 0:
    raise ValueError(f"replicate bucket_mb must be > 0, got {bucket_mb!r}")
  if reduce_dtype is not None:
    reduce_dtype = getattr(reduce_dtype, "name", None) or getattr(reduce_dtype, "__name__", reduce_dtype)
    if reduce_dtype not in REDUCE_DTYPES:
      raise ValueError(f"replicate reduce_dtype must be one of {list(REDUCE_DTYPES)} or None, "
                       f"got {reduce_dtype!r}")
  return Replicate(freeze_filter(filter, "replicate"), _devices(devices), zero, bucket_mb, reduce_stream,
                   gather_stream, reduce_dtype)


def shard(filter, devices) -> Shard:
  """Expert parallel: shards the expert axis of the matched regions over `devices`."""
  return Shard(freeze_filter(filter, "shard"), _devices(devices))


def shard_tensor(filter, devices, axis="tp") -> ShardTensor:
  """Tensor parallel: splits parameters whose partitioning names `axis` over `devices`."""
  return ShardTensor(freeze_filter(filter, "shard_tensor"), _devices(devices), str(axis))


def split(num_microbatches, filter=None, dim_name="MB") -> Split:
  """Splits the batch into `num_microbatches` microbatches (tag `dim_name`)."""
  if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
    raise ValueError(f"split num_microbatches must be an int >= 1, got {num_microbatches!r}")
  if dim_name != "MB":
    raise ValueError(f"split dim_name must be 'MB' (the only microbatch tag), got {dim_name!r}")
  return Split(num_microbatches, freeze_filter(filter, "split"), dim_name)


def order(groups) -> Order:
  """Orders groups of filters; consecutive groups get temporal edges.

  Args:
    groups: a list of groups, each a filter dict or a list of filter dicts. Filters
      in one group may run in any order (or overlapped) relative to each other.
  """
  frozen = []
  for g in groups:
    g = [g] if isinstance(g, Mapping) else list(g)
    if not g:
      raise ValueError("order groups must not be empty")
    frozen.append(tuple(freeze_filter(f, "order") for f in g))
  if len(frozen) < 2:
    raise ValueError("order needs at least two groups")
  return Order(tuple(frozen))


def load_directives(source: str | os.PathLike | Sequence[Mapping] | Sequence[Directive]) -> list[Directive]:
  """Directives from a Piper JSON schedule: a path to a file, or a list of `{"op": ...}` dicts."""
  if isinstance(source, (str, os.PathLike)):
    with open(source) as f:
      source = json.load(f)
  if not isinstance(source, Sequence):
    raise ValueError("a Piper schedule is a JSON list of directives")
  out = []
  for i, entry in enumerate(source):
    if isinstance(entry, Directive):
      out.append(entry)
      continue
    try:
      out.append(Directive.from_json(entry))
    except ValueError as e:  # from_json names the entry as JSON; this adds its index
      raise ValueError(f"schedule entry {i} {e}") from None
  return out


def dump_directives(directives: Sequence[Directive], path: str | os.PathLike | None = None) -> list[dict]:
  """Writes directives as a Piper JSON schedule to `path` (if given); returns the JSON list."""
  out = [d.to_json() for d in directives]
  if path is not None:
    with open(path, "w") as f:
      json.dump(out, f, indent=2)
      f.write("\n")
  return out
