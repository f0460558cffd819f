"""The abstract model the compiler plans for: regions, their tensors and parameters.

Built by `lowering.trace` from a jaxpr, or by hand in tests; it holds shapes only.
"""

from __future__ import annotations

import dataclasses

from piper_jax.ir.graph import TensorSpec

__all__ = ["ActivationRef", "RegionSpec", "ModelSpec"]


@dataclasses.dataclass(frozen=True)
class ActivationRef:
  """An input of a region that an earlier region produced: its `output` index there."""

  region: int
  output: int
  spec: TensorSpec
  differentiable: bool = True


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
