"""The cards the benchmarks report MFU against."""

from __future__ import annotations

# Dense bf16 peak FLOP/s per card (no sparsity).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak of a card by its device kind, or None when unknown (CPU)."""
  return next((v for k, v in PEAK_FLOPS.items() if k in device_kind), None)

# Memory per card in bytes, as nvidia-smi reports it.
MEMORY_BYTES = {"H100": 81559 * 2**20, "H200": 143771 * 2**20, "A100": 81920 * 2**20}


def memory_bytes(device_kind: str) -> int | None:
  """A card's memory by its device kind, or None when unknown."""
  return next((v for k, v in MEMORY_BYTES.items() if k in device_kind), None)

# Memory bandwidth per card in bytes per second (HBM, as specified).
MEMORY_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def memory_bytes_per_s(device_kind: str) -> float | None:
  """A card's memory bandwidth by its device kind, or None when unknown."""
  return next((v for k, v in MEMORY_BYTES_PER_S.items() if k in device_kind), None)
