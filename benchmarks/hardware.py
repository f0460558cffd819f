"""The cards the benchmarks report MFU against."""

from __future__ import annotations

# Dense bf16 peak FLOP/s per card (no sparsity).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak of a card by its device kind, or None when unknown (CPU)."""
  return next((v for k, v in PEAK_FLOPS.items() if k in device_kind), None)
