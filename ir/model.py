"""The abstract model the compiler plans for: regions, their tensors and parameters.

Built by `lowering.trace` from a jaxpr, or by hand in tests; it holds shapes only.
"""

from __future__ import annotations

import dataclasses

from piper_jax.ir.graph import TensorSpec

__all__ = ["ActivationRef", "Gemm", "RegionSpec", "ModelSpec"]


@dataclasses.dataclass(frozen=True)
class ActivationRef:
  """An input of a region that an earlier region produced: its `output` index there."""

  region: int
  output: int
  spec: TensorSpec
  differentiable: bool = True


@dataclasses.dataclass(frozen=True)
class Gemm:
  """Matmuls of one shape in a region's forward, at the traced batch: `count` products
  of [m, k] by [k, n] (a batched product's per batch element: one expert's, one head's).

  A smaller batch gives each fewer rows `m`, or, for attention's products (one per
  sequence and head) and a batched product of single rows, fewer of them.

  attention: attention's score or value products.
  causal: under a causal mask, whose upper half a fused attention kernel skips.
  recomputed: under a checkpoint, so that the backward runs it again.
  """

  m: int
  k: int
  n: int
  count: int
  attention: bool = False
  causal: bool = False
  recomputed: bool = False

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.k * self.n

  def at(self, scale: float) -> "Gemm":
    """These products at `scale` of the traced batch's rows (at least one row each)."""
    if self.attention or self.m == 1:
      return dataclasses.replace(self, count=max(1, round(self.count * scale)))
    return dataclasses.replace(self, m=max(1, round(self.m * scale)))


@dataclasses.dataclass(frozen=True)
class RegionSpec:
  """One annotated region of the loss: what it reads and what it produces."""

  index: int
  tags: tuple[tuple[str, int], ...]
  params: tuple[int, ...]              # indices into ModelSpec.params
  batch: tuple[int, ...]               # indices into ModelSpec.batch
  inputs: tuple[ActivationRef, ...]    # activations from earlier regions
  outputs: tuple[TensorSpec, ...]      # activations later regions read (per microbatch)
  produces_loss: bool = False
  flops: float = 0.0                   # forward FLOPs for the whole batch
  # Of those, the FLOPs its backward runs again (what jax.checkpoint leaves to recompute).
  recompute_flops: float = 0.0
  matmuls: int = 0                     # its forward's matmuls (kernels a task launches)
  gemms: tuple[Gemm, ...] = ()         # its forward's matmuls by size (how fast each runs)

  @property
  def name(self) -> str:
    return ",".join(f"{t}={i}" for t, i in self.tags) or "all"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The regions of a loss function, in trace order, and the leaves they read."""

  regions: tuple[RegionSpec, ...]
  params: tuple[TensorSpec, ...]       # parameter leaves, named by pytree path
  batch: tuple[TensorSpec, ...]        # batch leaves with the leading batch axis
  batch_size: int

  def tags(self) -> set[str]:
    return {t for r in self.regions for t, _ in r.tags}

  def param_users(self) -> dict[int, list[int]]:
    """Parameter leaf index -> the regions that read it."""
    users: dict[int, list[int]] = {i: [] for i in range(len(self.params))}
    for r in self.regions:
      for p in r.params:
        users[p].append(r.index)
    return users
