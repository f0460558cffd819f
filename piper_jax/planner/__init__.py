"""The planner: a cost model of a strategy's step time and memory, region timings measured on
one device, and the search that ranks the strategies a model allows by them."""

from piper_jax.planner.calibrate import RegionTimes, calibrate
from piper_jax.planner.hardware import ACCELERATORS, Accelerator, accelerator
from piper_jax.planner.costs import (JAX_GPU_POOL, CostModel, Estimate, MeasuredModel,
                                     MemoryEstimate, estimate, estimate_plan, format_bytes,
                                     format_time, measure_model)
from piper_jax.planner.search import (PIPELINE_SCHEDULES, Candidate, Rejected, SearchResult,
                                      search)

__all__ = [
    "Accelerator", "ACCELERATORS", "accelerator", "RegionTimes", "calibrate", "CostModel", "Estimate", "MeasuredModel", "MemoryEstimate",
    "estimate", "estimate_plan", "measure_model", "format_bytes", "format_time", "Candidate",
    "Rejected", "JAX_GPU_POOL", "SearchResult", "search", "PIPELINE_SCHEDULES",
]
