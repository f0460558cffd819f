"""jaxpr -> regions -> per-tick shard_map program (the only stage that touches devices)."""

from piper_jax.lowering.layout import ParamLayout
from piper_jax.lowering.program import Program
from piper_jax.lowering.trace import TracedLoss, trace_loss

__all__ = ["ParamLayout", "Program", "TracedLoss", "trace_loss"]
