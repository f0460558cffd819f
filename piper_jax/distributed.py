"""Multi-process set-up: a thin layer over `jax.distributed.initialize`."""

from __future__ import annotations

import os
from typing import Sequence

import jax

__all__ = ["initialize", "launched", "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID",
           "ENV_CPU_DEVICES", "ENV_JOINED_DIR"]

# Set by `python -m piper_jax.launch` for each process it starts.
ENV_COORDINATOR = "PIPER_COORDINATOR"
ENV_NUM_PROCESSES = "PIPER_NUM_PROCESSES"
ENV_PROCESS_ID = "PIPER_PROCESS_ID"
ENV_CPU_DEVICES = "PIPER_CPU_DEVICES"
# A folder where each process that joined leaves a file named by its id, so that the
# launcher can tell a script that never joined from one that did.
ENV_JOINED_DIR = "PIPER_JOINED_DIR"


def launched() -> bool:
  """Whether `python -m piper_jax.launch` started this process."""
  return ENV_COORDINATOR in os.environ


def joined_marker(directory: str, process_id: int) -> str:
  """The file process `process_id` leaves in `directory` once it has joined the job."""
  return os.path.join(directory, f"process-{process_id}.joined")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: int | Sequence[int] | None = None,
               *, heartbeat_timeout_seconds: int = 20, initialization_timeout: int = 120,
               **kwargs) -> None:
  """Joins this process to the job; call it before anything touches devices.

  Without arguments it uses what `python -m piper_jax.launch` set in the
  environment, or else lets `jax.distributed.initialize` detect the cluster (SLURM,
  Open MPI, ...). On CPU it asks for gloo collectives and, under the launcher, for
  the launcher's number of CPU devices per process, and tells the launcher it joined
  (the launcher fails a run whose processes never do). A process whose peer dies
  exits with an error after about `heartbeat_timeout_seconds` instead of hanging.
  """
  env = os.environ
  if coordinator_address is None and ENV_COORDINATOR in env:
    coordinator_address = env[ENV_COORDINATOR]
    num_processes = int(env[ENV_NUM_PROCESSES]) if num_processes is None else num_processes
    process_id = int(env[ENV_PROCESS_ID]) if process_id is None else process_id
  if env.get("JAX_PLATFORMS", "") in ("", "cpu"):
    try:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      if ENV_CPU_DEVICES in env:
        jax.config.update("jax_num_cpu_devices", int(env[ENV_CPU_DEVICES]))
    except Exception:  # a backend already running keeps its settings
      pass
  jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids,
                             heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                             initialization_timeout=initialization_timeout, **kwargs)
  if ENV_JOINED_DIR in env and ENV_PROCESS_ID in env:
    # Named by the launcher's id: jax.process_index() would start the backend here.
    with open(joined_marker(env[ENV_JOINED_DIR], int(env[ENV_PROCESS_ID])), "w"):
      pass
