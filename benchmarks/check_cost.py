"""What `--check` costs beside training: one `examples/train.py` run, its wall time and
the device's peak memory (the allocator's count), printed as one JSON line.

  python benchmarks/check_cost.py -- --model qwen3-1.7b --strategy dp --dtype bfloat16 \\
      --batch 8 --seq-len 2048 --steps 2 --check
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from examples import train  # noqa: E402


def main(argv):
  argv = argv[argv.index("--") + 1:] if "--" in argv else argv
  started = time.perf_counter()
  train.main(argv)
  stats = jax.devices()[0].memory_stats() or {}
  print(json.dumps({"args": " ".join(argv), "wall_s": round(time.perf_counter() - started, 1),
                    "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 1)}))


if __name__ == "__main__":
  main(sys.argv[1:])
