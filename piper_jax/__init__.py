"""piper-jax: a programmable distributed-training compiler for JAX."""

from piper_jax import checkpoint, distributed, schedules, strategies, viz
from piper_jax.annotate import annotate
from piper_jax.compile import TrainState, TrainStep, compile, plan
from piper_jax.ir.directives import (Directive, Order, Place, Replicate, Shard, ShardTensor, Split,
                                     dump_directives, load_directives, order, place, replicate,
                                     shard, shard_tensor, split)
from piper_jax.ir.errors import DirectiveError, PlanError
from piper_jax.lowering import LoweringOptions
from piper_jax.planner import RegionTimes, calibrate

__version__ = "0.1.0"

__all__ = [
    "annotate",
    "calibrate",
    "RegionTimes",
    "compile",
    "plan",
    "LoweringOptions",
    "TrainStep",
    "TrainState",
    "place",
    "replicate",
    "shard",
    "shard_tensor",
    "split",
    "order",
    "load_directives",
    "dump_directives",
    "Directive",
    "Place",
    "Replicate",
    "Shard",
    "ShardTensor",
    "Split",
    "Order",
    "DirectiveError",
    "PlanError",
    "schedules",
    "strategies",
    "viz",
    "checkpoint",
    "distributed",
]
