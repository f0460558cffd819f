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
    gemm_efficiency: the fraction of `peak_flops` large bf16 GEMMs reach; 0 when the
      planner has no such figures for the card (then matmuls run at one flat rate).
    gemm_half_flops: the FLOPs of a GEMM that runs at half of `gemm_efficiency`
      (smaller ones, as an expert's at a few hundred tokens, run slower still).
    attention_efficiency: the fraction of `peak_flops` a fused attention kernel
      reaches, forward and backward, on the FLOPs it computes (causal: half the scores).
  """

  name: str
  platform: str
  peak_flops: float
  memory_bytes: int
  memory_bytes_per_s: float
  link_bytes_per_s: float
  gemm_efficiency: float = 0.0
  gemm_half_flops: float = 0.0
  attention_efficiency: float = 0.0

  def gemm_seconds(self, gemm) -> float:
    """Seconds of an `ir.Gemm`'s products: attention's at `attention_efficiency` (causal:
    half of them); each other product its FLOPs at `gemm_efficiency` plus a fixed
    latency (the time of `gemm_half_flops` at that rate), or, when less, plus the time
    its operands and result take to move at `memory_bytes_per_s` (a batched product of
    single rows costs its bytes, not a latency per row)."""
    rate = self.gemm_efficiency * self.peak_flops
    if gemm.attention:
      return gemm.count * gemm.flops * (0.5 if gemm.causal else 1.0) / (
          self.attention_efficiency * self.peak_flops)
    moved = 2 * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n)  # bf16 bytes
    latency = min(self.gemm_half_flops / rate, moved / self.memory_bytes_per_s)
    return gemm.count * (gemm.flops / rate + latency)


ACCELERATORS = {a.name: a for a in (
    Accelerator("H100", "gpu", 989e12, 81559 * 2**20, 3.35e12, 300e9),
    # GEMM and attention rates chosen so that the planner meets the H200 rows of
    # benchmarks/RESULTS.md: large GEMMs at 0.62 of peak, cuDNN's attention at 0.225
    # (what the rows leave out, norms and other elementwise work, is in these figures).
    Accelerator("H200", "gpu", 989e12, 143771 * 2**20, 4.8e12, 300e9, gemm_efficiency=0.62,
                gemm_half_flops=3e9, attention_efficiency=0.225),
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
