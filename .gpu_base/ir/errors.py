"""Errors raised for bad directives and plans, before anything compiles."""

from __future__ import annotations

__all__ = ["DirectiveError", "PlanError"]


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
