"""Test setup: 8 simulated CPU devices and the single-device reference."""

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are small and compile-bound: the CPU backend's lowest
# optimization level took the suite from 8m56s to 6m34s, every test passing at its
# tolerance. Test subprocesses inherit it.
_flags = os.environ.get("XLA_FLAGS", "")
_named = re.findall(r"--(?:no)?(\w+)", _flags)
if "xla_backend_optimization_level" not in _named:
  _flags += " --xla_backend_optimization_level=0"
# XLA's CPU fusion emitters compile the tests' steps 2.4x slower (an EP x ZB step 6.4 vs
# 2.6 s), with the same numbers either way.
if "xla_cpu_use_fusion_emitters" not in _named:
  _flags += " --xla_cpu_use_fusion_emitters=false"
# Splitting a kernel's module for parallel code generation costs more than it gains
# where pytest's workers already keep every core busy: a TP x DualPipeV test 25-26 s
# unsplit against 29-30 s, a bf16 check 26-27 against 27-29 s.
if "xla_cpu_parallel_codegen_split_count" not in _named:
  _flags += " --xla_cpu_parallel_codegen_split_count=1"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# Many tests compile the same programs (a reference run of the same model, the same
# strategy from another test): one persistent cache for the whole run, which pytest's
# workers and the tests' subprocesses inherit from the process that starts them.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="piper-jax-tests-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # older jax: XLA_FLAGS above does it
  pass

import sys  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)  # for `examples.gpt`


import pytest  # noqa: E402


def _memory_maps() -> int | None:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


# A quarter of the kernel's default limit on memory maps (vm.max_map_count).
_MAPS_KEPT = 16384


@pytest.fixture(autouse=True)
def _free_compiled_programs():
  """Drops JAX's caches of compiled programs once a worker holds many memory maps:
  every CPU executable holds maps of its code, and a worker that kept all of the
  suite's went past the kernel's limit (vm.max_map_count, 65530) and crashed inside
  XLA's compiler. Kept below that, later tests reuse the programs and traces."""
  yield
  maps = _memory_maps()
  if maps is None or maps > _MAPS_KEPT:
    jax.clear_caches()


@pytest.fixture
def batches_of(monkeypatch):
  """`batches_of(config)`: `models.random_batch` draws token batches of a GPT config."""
  import models
  from examples import gpt

  def use(config):
    monkeypatch.setattr(models, "random_batch",
                        lambda rng, n: gpt.random_batch(config, rng, n, pattern_seed=1))

  return use
