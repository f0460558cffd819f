"""The global training DAG, its directive passes and per-device plans (no JAX here)."""

from piper_jax.ir.directives import (Directive, Order, Place, Replicate, Shard, ShardTensor, Split,
                                     dump_directives, load_directives, order, place, replicate,
                                     shard, shard_tensor, split)
from piper_jax.ir.errors import DirectiveError, PlanError
from piper_jax.ir.graph import DepKind, Edge, Graph, Node, NodeKind, Pass, TensorSpec
from piper_jax.ir.mesh import MeshSpec
from piper_jax.ir.model import ActivationRef, Gemm, ModelSpec, RegionSpec
from piper_jax.ir.pipeline import make_plan
from piper_jax.ir.plan import Plan, Task

__all__ = [
    "Directive", "Order", "Place", "Replicate", "Shard", "ShardTensor", "Split",
    "dump_directives", "load_directives", "order", "place", "replicate", "shard", "shard_tensor",
    "split", "DirectiveError", "PlanError", "DepKind", "Edge", "Graph", "Node", "NodeKind", "Pass",
    "TensorSpec", "MeshSpec", "ActivationRef", "Gemm", "ModelSpec", "RegionSpec", "make_plan", "Plan", "Task",
]
