"""Plan timelines (per-device Gantt charts), drawn by `piper_jax.ir.timeline`."""

from piper_jax.ir.timeline import COLORS, DEFAULT_COSTS, figure, timeline

__all__ = ["COLORS", "DEFAULT_COSTS", "figure", "timeline"]
