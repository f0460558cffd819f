"""`LoweringOptions`: every switch that changes the program `pj.compile` builds."""

from __future__ import annotations

import dataclasses
from typing import Mapping

__all__ = ["LoweringOptions", "SLOT_BYTES"]


SLOT_BYTES = 64 << 20  # `LoweringOptions.slot_bytes` where there are reductions to overlap


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
  """How a plan is lowered; none of these changes the numbers a step computes.

  Attributes:
    remat: B recomputes a residual made by elementwise equations from one value F
      stores in its place when that is no larger; None does so in pipelines only.
    cast_weights: weights the model reads only in a narrower dtype are cast once per
      step (in slots of their own), not by every task that reads them.
    shard_masters: ZeRO-1/2 with weights read in a narrower dtype keep the fp32
      parameters sharded like the optimizer state and gather them in that dtype as the
      step starts (the distributed optimizer). A pipeline's ZeRO-3 always does.
    spread_uneven_slots: below ZeRO-3 (or in a pipeline), a slot whose pipeline ranks'
      parts differ so much that stacking them would pad it by more than a quarter (a large embedding
      on the first stage) is stored spread evenly over all devices, parameters and
      optimizer state, and laid out per rank only inside the step: each device holds
      an even share of the state instead of the largest rank's, at the cost of
      moving that slot's parameters and gradients once per step. False stacks every
      slot over the ranks, each padded to its largest rank's part: no resharding, for
      lopsided stages whose state fits anyway.
    slot_bytes: a region's leaves of one dtype fill slots of at most this many bytes,
      each its own buffer, so that one slot's update can run while another's gradients
      are still being reduced. None: 64 MiB, or a slot per leaf on one CPU device,
      where there is no reduction to overlap and XLA's CPU program copies every weight
      it slices out of a slot (GPU kernels read them in place).
    zero3_reshard: ZeRO-3 without a pipeline gathers a region's weights again for its
      backward (PyTorch FSDP's reshard_after_forward): a device holds the weights of the
      ticks in flight. (A pipeline's ZeRO-3 gathers them once, as the step starts.)
      False lets XLA keep each region's weights from its forward gather to its backward:
      half the gathers, every weight held whole for the whole step.
    compiler_options: XLA options for the step's `jax.jit`; None takes piper-jax's (on
      GPUs a pipeline's conditionals and rolled loop run as CUDA graphs; on CPU a loop's
      branches write the value stores in place), `{}` XLA's.
  """

  remat: bool | None = None
  cast_weights: bool = True
  shard_masters: bool = True
  spread_uneven_slots: bool = True
  slot_bytes: int | None = None
  zero3_reshard: bool = True
  compiler_options: Mapping[str, object] | None = None

  def __post_init__(self):
    # A wrong type would pass silently (any string is true) or fail deep in the lowering.
    for name in ("cast_weights", "shard_masters", "spread_uneven_slots", "zero3_reshard"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"LoweringOptions.{name} must be True or False, got "
                        f"{getattr(self, name)!r}")
    if self.remat is not None and not isinstance(self.remat, bool):
      raise TypeError(f"LoweringOptions.remat must be True, False or None (None: on in "
                      f"pipelines only), got {self.remat!r}")
    if self.slot_bytes is not None and (isinstance(self.slot_bytes, bool)
                                        or not isinstance(self.slot_bytes, int)):
      raise TypeError(f"LoweringOptions.slot_bytes must be a number of bytes (an int, such "
                      f"as 64 << 20) or None, got {self.slot_bytes!r}")
    if self.slot_bytes is not None and self.slot_bytes < 1:
      raise ValueError(f"slot_bytes must be >= 1, got {self.slot_bytes}")
    if self.compiler_options is not None and not (
        isinstance(self.compiler_options, Mapping)
        and all(isinstance(k, str) for k in self.compiler_options)):
      raise TypeError(f"LoweringOptions.compiler_options must be a dict of XLA option "
                      f"names to values (such as {{'xla_gpu_enable_command_buffer': ''}}), "
                      f"{{}} or None, got {self.compiler_options!r}")

  @staticmethod
  def checked(options) -> "LoweringOptions":
    """`options`, or the defaults for None; anything else is refused with the fix."""
    if options is None:
      return LoweringOptions()
    if not isinstance(options, LoweringOptions):
      fix = (f"pj.LoweringOptions({', '.join(f'{k}={v!r}' for k, v in options.items())})"
             if isinstance(options, Mapping) else "pj.LoweringOptions(...)")
      raise TypeError(f"options must be a pj.LoweringOptions, got {type(options).__name__} "
                      f"{options!r}: pass {fix}")
    return options

  def resolved(self, n_pp: int, platform: str, n_devices: int | None = None
               ) -> "LoweringOptions":
    """These options with every None decided, for a plan of `n_pp` pipeline ranks on
    `n_devices` devices (None: not known) of `platform` ("cpu", "gpu"): the one place
    the defaults are chosen; `pj.compile` and the planner read the result."""
    remat = n_pp > 1 if self.remat is None else self.remat
    slot_bytes = self.slot_bytes or (1 if platform == "cpu" and n_devices == 1 else SLOT_BYTES)
    return dataclasses.replace(self, remat=remat, slot_bytes=slot_bytes)


  def changed(self) -> dict:
    """The options that differ from the defaults, for printing with a plan."""
    default = LoweringOptions()
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)}
