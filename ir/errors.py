"""Errors raised for bad directives and plans, before anything compiles."""

from __future__ import annotations

__all__ = ["DeviceIndexError", "DirectiveError", "PlanError"]


class PlanError(ValueError):
  """A plan that cannot run: a cycle, an unplaced region, an infeasible order."""


class DirectiveError(PlanError):
  """A directive that is wrong for this model; the message names it and the fix."""

  def __init__(self, message: str, index: int | None = None, directive=None):
    self.index = index
    self.directive = directive
    where = ""
    if directive is not None:
      label = "directive" if index is None else f"directive {index}"
      where = f"{label} {directive.to_json_str()}: "
    super().__init__(where + message)


class DeviceIndexError(DirectiveError):
  """A directive names a device index past the devices the step has."""

  def __init__(self, message: str, index: int | None = None, directive=None,
               n_devices: int = 0):
    super().__init__(message, index, directive)
    self.n_devices = n_devices
