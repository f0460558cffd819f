"""The accelerators the planner knows by name: what a plan for them is costed against
when it is made on another machine (a laptop planning a GPU cluster)."""

from __future__ import annotations

import dataclasses

__all__ = ["Accelerator", "ACCELERATORS", "accelerator", "target_card"]


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One card as the planner costs it.

  Attributes:
    name: the name `jax.Device.device_kind` contains ("H200" in "NVIDIA H200").
    platform: JAX's platform name for it ("gpu").
    peak_flops: dense bf16 matrix FLOP/s (no sparsity), what MFU is measured against.
    memory_bytes: device memory, as the driver reports it.
    memory_bytes_per_s: memory bandwidth (HBM, as specified).
    link_bytes_per_s: what one device's collectives move per second to the other
      devices of its host (NVLink's 450 GB/s a direction on H100 and H200, of which
      an all-reduce's bus reaches about two thirds).
  """

  name: str
  platform: str
  peak_flops: float
  memory_bytes: int
  memory_bytes_per_s: float
  link_bytes_per_s: float


ACCELERATORS = {a.name: a for a in (
    Accelerator("H100", "gpu", 989e12, 81559 * 2**20, 3.35e12, 300e9),
    Accelerator("H200", "gpu", 989e12, 143771 * 2**20, 4.8e12, 300e9),
    Accelerator("A100", "gpu", 312e12, 81920 * 2**20, 2.0e12, 200e9),
)}


def accelerator(device_kind: str) -> Accelerator | None:
  """The known card whose name `device_kind` contains ("NVIDIA H200", or "H200"), or
  None (a CPU, or a card the planner has no figures for)."""
  return next((a for name, a in ACCELERATORS.items() if name in device_kind), None)


def target_card(card: "Accelerator | str") -> Accelerator:
  """`card` itself, or the known card of that name; a ValueError names the known ones."""
  found = card if isinstance(card, Accelerator) else accelerator(card)
  if found is None:
    raise ValueError(f"unknown accelerator {card!r}; choose one of {list(ACCELERATORS)}, or "
                     f"pass a piper_jax.planner.Accelerator")
  return found
