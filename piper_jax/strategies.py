"""One-call strategies: full directive lists for the common cases, and the planner that
chooses among them."""

from piper_jax.builders import data_parallel, pipeline
from piper_jax.planner import (Candidate, CostModel, Estimate, SearchResult, estimate,
                               search)

__all__ = ["data_parallel", "pipeline", "search", "estimate", "SearchResult", "Candidate",
           "CostModel", "Estimate"]
