"""Checkpoints with orbax, in the canonical layout: they restore under any strategy."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["save", "restore", "latest_step"]


def _manager(directory, create: bool):
  """Orbax's manager of `directory`; `create` (for saving) makes the directory and deletes
  the temporary directories of saves that never committed (a run killed while saving)."""
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(create=create, cleanup_tmp_directories=create)
  return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def save(directory: str | os.PathLike, state, step: int) -> None:
  """Saves `state` as step `step` under `directory`.

  What is written is the user's parameter pytree and the optimizer state over it
  (`TrainStep.canonical`), not the packed per-device buffers, so `restore` works
  under another strategy. Orbax writes each process's own shards into a temporary
  directory and commits a step by renaming it into place: a run killed while saving
  keeps the previous step (`latest_step` and `restore` skip the unfinished one), and
  the next `save` deletes what the killed one left.
  """
  import orbax.checkpoint as ocp
  if state.owner is None:
    raise ValueError("save needs a state made by a TrainStep (step.init or step(...))")
  with _manager(directory, create=True) as mngr:
    mngr.save(step, args=ocp.args.StandardSave(state.owner.canonical(state)))
    mngr.wait_until_finished()


def latest_step(directory: str | os.PathLike) -> int | None:
  """The newest complete step under `directory`, or None."""
  if not os.path.isdir(directory):
    return None
  with _manager(directory, create=False) as mngr:
    return mngr.latest_step()


def restore(directory: str | os.PathLike, train_step, step: int | None = None) -> Any:
  """Restores step `step` (default: the newest) for `train_step`, partitioned its way.

  Returns:
    A `TrainState` for `train_step`.
  """
  import orbax.checkpoint as ocp
  with _manager(directory, create=False) as mngr:
    step = mngr.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {os.fspath(directory)!r}")
    tree = mngr.restore(step, args=ocp.args.StandardRestore(train_step.canonical_shapes()))
  return train_step.from_canonical(tree)
