"""Starts N local processes of a script with a coordinator on loopback.

  python -m piper_jax.launch --nprocs 2 [--devices-per-proc 4] script.py [args...]

Each process gets the coordinator address, its id and the process count in the
environment; the script calls `pj.distributed.initialize()` first. On CPU,
`--devices-per-proc` sets the simulated devices of each process. When one process
fails, the others are stopped and the launcher exits with its code; a process that
ends without having joined the job (the script never called
`pj.distributed.initialize()`, so each process ran alone) fails the run too.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

from piper_jax.distributed import (ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_JOINED_DIR,
                                   ENV_NUM_PROCESSES, ENV_PROCESS_ID, joined_marker)


class NotJoinedError(RuntimeError):
  """A process ended without joining the job: its script never initialized."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(i: int, nprocs: int, address: str, joined_dir: str,
               devices_per_proc: int | None) -> dict:
  env = dict(os.environ, **{ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(nprocs),
                            ENV_PROCESS_ID: str(i), ENV_JOINED_DIR: joined_dir})
  if devices_per_proc:
    env[ENV_CPU_DEVICES] = str(devices_per_proc)
  return env


def _kill(procs: list[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()


def _not_joined(procs: list[subprocess.Popen], joined_dir: str) -> int | None:
  """The id of a process that exited 0 without having joined, if any."""
  return next((i for i, p in enumerate(procs)
               if p.poll() == 0 and not os.path.exists(joined_marker(joined_dir, i))), None)


def _supervise(procs: list[subprocess.Popen], argv: list[str], joined_dir: str,
               grace_s: float) -> int:
  """Waits for the processes; returns the first non-zero exit code (or 0)."""
  while True:
    lone = _not_joined(procs, joined_dir)
    if lone is not None:
      _kill(procs)  # the others run their own copy of the job, not a part of one
      raise NotJoinedError(
          f"process {lone} of {len(procs)} ran {argv[0]} to the end without joining the "
          f"job, so each process ran alone on its own devices; call "
          f"`pj.distributed.initialize()` at the start of {argv[0]}, before anything "
          f"touches devices")
    failed = [p for p in procs if p.poll() not in (None, 0)]
    if failed:
      deadline = time.time() + grace_s
      while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
      _kill(procs)
      return failed[0].returncode
    if all(p.poll() is not None for p in procs):
      return 0
    time.sleep(0.2)


def launch(nprocs: int, argv: list[str], devices_per_proc: int | None = None,
           grace_s: float = 10.0) -> int:
  """Runs `python argv...` in `nprocs` processes; returns the first non-zero exit code (or 0).

  Raises:
    NotJoinedError: a process exited 0 without calling `pj.distributed.initialize()`.
  """
  if nprocs < 1:
    raise ValueError(f"--nprocs must be >= 1, got {nprocs}")
  address = f"127.0.0.1:{_free_port()}"
  with tempfile.TemporaryDirectory(prefix="piper-joined-") as joined_dir:
    procs = [subprocess.Popen([sys.executable] + argv,
                              env=_child_env(i, nprocs, address, joined_dir, devices_per_proc))
             for i in range(nprocs)]
    try:
      code = _supervise(procs, argv, joined_dir, grace_s)
    except BaseException:  # Ctrl-C or a process that never joined: stop the rest
      _kill(procs)
      raise
    codes = [p.wait() for p in procs]
  return code or next((c for c in codes if c), 0)


def main(args=None) -> int:
  prog = "python -m piper_jax.launch"
  ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--nprocs", type=int, required=True, help="processes to start")
  ap.add_argument("--devices-per-proc", type=int, default=None,
                  help="simulated CPU devices per process (CPU only)")
  ap.add_argument("script", help="the Python script to run")
  ap.add_argument("script_args", nargs=argparse.REMAINDER)
  ns = ap.parse_args(args)
  try:
    return launch(ns.nprocs, [ns.script] + ns.script_args, ns.devices_per_proc)
  except NotJoinedError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
