"""Starts N local processes of a script with a coordinator on loopback.

  python -m piper_jax.launch --nprocs 2 [--devices-per-proc 4] script.py [args...]

Each process gets the coordinator address, its id and the process count in the
environment; the script calls `pj.distributed.initialize()` first. On CPU,
`--devices-per-proc` sets the simulated devices of each process. When one process
fails, the others are stopped and the launcher exits with its code.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from piper_jax.distributed import ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(nprocs: int, argv: list[str], devices_per_proc: int | None = None,
           grace_s: float = 10.0) -> int:
  """Runs `python argv...` in `nprocs` processes; returns the first non-zero exit code (or 0)."""
  if nprocs < 1:
    raise ValueError(f"--nprocs must be >= 1, got {nprocs}")
  address = f"127.0.0.1:{_free_port()}"
  procs = []
  for i in range(nprocs):
    env = dict(os.environ, **{ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(nprocs),
                              ENV_PROCESS_ID: str(i)})
    if devices_per_proc:
      env[ENV_CPU_DEVICES] = str(devices_per_proc)
    procs.append(subprocess.Popen([sys.executable] + argv, env=env))
  code = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0)]
      if failed:
        code = failed[0].returncode
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.poll() is None for p in procs):
          time.sleep(0.2)
        for p in procs:
          if p.poll() is None:
            p.kill()
        break
      time.sleep(0.2)
  except KeyboardInterrupt:
    for p in procs:
      p.kill()
    raise
  codes = [p.wait() for p in procs]
  return code or next((c for c in codes if c), 0)


def main(args=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m piper_jax.launch", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--nprocs", type=int, required=True, help="processes to start")
  ap.add_argument("--devices-per-proc", type=int, default=None,
                  help="simulated CPU devices per process (CPU only)")
  ap.add_argument("script", help="the Python script to run")
  ap.add_argument("script_args", nargs=argparse.REMAINDER)
  ns = ap.parse_args(args)
  return launch(ns.nprocs, [ns.script] + ns.script_args, ns.devices_per_proc)


if __name__ == "__main__":
  sys.exit(main())
