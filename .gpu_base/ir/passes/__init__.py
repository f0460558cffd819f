"""Directive passes over the global training DAG, applied in one fixed order."""

from piper_jax.ir.passes.comm import insert_collectives, insert_send_recv
from piper_jax.ir.passes.order import apply_order
from piper_jax.ir.passes.place import place_nodes
from piper_jax.ir.passes.shard import shard_regions
from piper_jax.ir.passes.split import split_microbatches
from piper_jax.ir.passes.split_backward import split_backward

__all__ = ["apply_order", "insert_collectives", "insert_send_recv", "place_nodes",
           "shard_regions", "split_backward", "split_microbatches"]
