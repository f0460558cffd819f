"""jaxpr -> regions -> one shard_map program (the only stage that touches devices).

The layers above (the API modules and the planner) import the lowering through these
names only, so that its modules can move without touching them.
"""

from piper_jax.lowering.buffers import Buffers
from piper_jax.lowering.collectives import StepCollective, collectives_table, step_collectives
from piper_jax.lowering.compat import shard_map_unchecked
from piper_jax.lowering.compiled import (collectives_in_conditionals, copies_in_branches,
                                         distinct_kernels)
from piper_jax.lowering.layout import ParamLayout
from piper_jax.lowering.local import RegionRunner, SplitAxis
from piper_jax.lowering.optimizer import packed_update_reason
from piper_jax.lowering.options import LoweringOptions
from piper_jax.lowering.program import Program, lowers_as_loop
from piper_jax.lowering.regions import (analyze_region, backward_input, first_alike,
                                        full_residuals, region_backward, region_forward,
                                        shared_analyses, split_backward)
from piper_jax.lowering.schedule_table import ScheduleTable
from piper_jax.lowering.scopes import RESERVED, enter_scope, parse_scope, reset_counters
from piper_jax.lowering.trace import TracedLoss, check_leaf, trace_loss

__all__ = [
    "Buffers", "LoweringOptions", "ParamLayout", "Program", "ScheduleTable", "TracedLoss",
    "trace_loss", "check_leaf", "lowers_as_loop", "RegionRunner", "SplitAxis", "analyze_region", "first_alike", "shared_analyses", "region_forward",
    "region_backward", "backward_input", "full_residuals", "split_backward", "StepCollective",
    "collectives_table", "collectives_in_conditionals", "copies_in_branches", "distinct_kernels", "step_collectives", "packed_update_reason", "shard_map_unchecked",
    "RESERVED", "enter_scope", "parse_scope", "reset_counters",
]
