"""Side-by-side benchmark: plain jax.jit DP / GSPMD FSDP against piper-jax strategies.

  python benchmarks/run.py                  # both GPT configs, every variant, on all GPUs
  python benchmarks/run.py --model 268m --variants jit-dp,dp,pp-1f1b
  python benchmarks/run.py --small          # tiny model on 8 CPU devices (CI)
  python benchmarks/run.py --model 1.3b --pp 4 --variants jit-dp,pp-1f1b@z1,pp-zb@z3
  python benchmarks/run.py --compile-only --mock-gpus 8 --model 1.3b --pp 4 \\
      --variants jit-dp,pp-1f1b    # an 8-GPU program compiled (not run) on one GPU
  python benchmarks/run.py --small --compile-only --repeat 3 --model moe --variants shmap-dp,pp-1f1b+ep
                                   # the fastest of 3 compiles each, taken in turn
  python benchmarks/run.py --small --compile-only --repeat 3 --model moe --microbatches 4,32 \\
      --variants shmap-dp,pp-1f1b+ep   # both microbatch counts in each turn

Variants. Plain-JAX baselines: `jit-dp` (jax.jit data parallel), `gspmd-fsdp` (every
leaf's largest divisible dimension sharded over all devices), `shmap-dp` (data parallel
written with shard_map: loss and gradients per device, then `pmean`; the fair baseline
for MoE models, whose `jit-dp` routes the global batch as one group) and `shmap-accum`
(the same with each device's rows split into `--microbatches` / `--pp` microbatches,
accumulated with `lax.scan`: plain JAX on the kernels a `--pp`-rank pipeline runs per
task). piper-jax: `dp`, `zero1`, `zero2`, `zero3` over all devices (`dp@b25`: gradients
all-reduced in 25 MB buckets during the backward), `accum` (`[pj.split(--microbatches)]`
beside `replicate`: gradient accumulation on every device; with `--pp 1` against
`shmap-accum` over the same microbatches; `accum@b25`: its gradients all-reduced in 25 MB
buckets), `accum-1f1b` (the same with the model's two pipeline stages sharing each
device, ordered 1F1B), and `pp-SCHEDULE` (gpipe, 1f1b, zb, interleaved, dualpipev) over
`--pp` ranks times data parallel over the other devices, `@zK` for ZeRO-K on the
data-parallel axis (default `--zero`). Interleaved and DualPipeV hold two stages per rank.

Suffixes (`zero3+rbf16+r24`):
  +rK           DP and ZeRO over K regions (the model's blocks cut into K stages)
  +L9-7         the blocks of each pipeline stage (default: equal blocks)
  +balanced     `gpt.balanced_stage_layers` (the last stage fewer, for the head and loss)
  +ep           experts split over each rank's data-parallel devices (`pj.shard`)
  +tp           attention and MLP split over pairs of each rank's data-parallel devices
                (`pj.shard_tensor`, Megatron's layout)
  +bf16         parameters and optimizer states in bf16 (the PyTorch peer's setting);
                its ratio is against `jit-dp+bf16`
  +mask         adamw without decay on vectors; its ratio is against `jit-dp+mask`
  +ac           checkpoint every block of a Qwen3 model (its `remat`)
  +rbf16        data-parallel gradients reduced in bf16 (`reduce_dtype="bfloat16"`)
  +remat, +noremat   `LoweringOptions.remat` on or off (default: on in pipelines)
  +nocast       `cast_weights` off: every task casts its own bf16-read weights
  +nodistopt    `shard_masters` off: ZeRO-1/2 keep replicated fp32 parameters
  +keepgathered `zero3_reshard` off: ZeRO-3 keeps weights gathered forward to backward
  +stacked      `spread_uneven_slots=False`: uneven slots stacked, each rank padded to the largest
  +slotN        `slot_bytes` of N MiB
  +nocmdbuf     XLA's own command buffers (`compiler_options={}`), not piper-jax's
  +xla          the variant with `--xla-flags` added to XLA_FLAGS (process-wide options)

Each variant runs in a fresh child process (its peak memory is its own and an
out-of-memory error ends only that row), one after another on the same devices. A row:
the median step time over `--steps` steps after `--warmup`, timed as a training loop
runs them (each step called before the previous step's loss is waited for; "blocked
ms" waits for each step, "host ms" is how long a call takes to return: when it is close
to "step ms" and "step ms" is no less than "blocked ms", the host is the limit),
tokens/s, MFU (against the card's dense bf16 peak, `piper_jax.planner.ACCELERATORS`), peak device memory
(`peak_bytes_in_use`, the largest over devices), XLA's count of the compiled program's
memory per device (`xla_gib`), compile time (XLA's compile, plus the first call minus
one step, plus `pj.compile`'s own tracing and planning, `build_s`), and tokens/s over
the matching plain-JAX baseline of the same call. Pipeline rows add the simulator's
prediction (`plan.simulate` with FLOP costs), in milliseconds through the baseline's
step: baseline step x makespan / work per rank (`sim_tick_ms` tick by tick); with
`--calibrate CACHE`, from the regions timed on the first device (`sim_timed_ms`).

`--compile-only` builds each variant on shapes and compiles it without running it:
`build_s` (`pj.compile`), `compile_s` (XLA), `xla_gib` and `kernels`, the distinct
kernels XLA made (its CPU compiler compiles each on its own, so this count is what its
compile time follows, without the time's drift). With `--mock-gpus N`, JAX's
mock GPU topology makes this process see N GPUs of N processes, so one GPU compiles the
program one of N runs, autotuning locally. `--build-only` times `pj.compile`'s build
alone (`build_s`: tracing, planning, region analysis), each in a fresh process as a user's
first build runs; with `--repeat N`, the fastest of N. Given several microbatch counts
(`--microbatches 4,32`), each turn compiles every variant at each count, so that the
counts see the same drift; each row's ratio is against its baseline at its own count.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # examples/ holds the models

BASELINES = ("jit-dp", "gspmd-fsdp", "shmap-dp", "shmap-accum")
PIPER = ("dp", "zero1", "zero2", "zero3", "accum", "accum-1f1b", "pp-gpipe", "pp-1f1b", "pp-zb",
         "pp-interleaved", "pp-dualpipev")
_NOT_PIPELINES = BASELINES + PIPER[:6]
# Which baseline each variant's ratio is taken against.
_BASELINE = {"gspmd-fsdp": "gspmd-fsdp", "zero3": "gspmd-fsdp", "accum": "shmap-accum",
             "accum-1f1b": "shmap-accum"}
# Variant suffixes besides "+rK" (a DP variant over K regions), "+L<blocks>-..." and
# "+slotN"; the module docstring says what each does.
_SUFFIXES = ("ep", "tp", "balanced", "bf16", "mask", "ac", "rbf16", "remat", "noremat", "nocast",
             "nodistopt", "keepgathered", "stacked", "nocmdbuf", "xla")
_REGIONS = re.compile(r"r\d+")
_LAYERS = re.compile(r"L\d+(-\d+)+")  # "+L9-7": blocks per pipeline stage
_SLOTS = re.compile(r"slot\d+")  # "+slot16": slot_bytes of 16 MiB
# Stages per pipeline rank.
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "zb": 1, "interleaved": 2, "dualpipev": 2}


def _family(model: str):
  """The examples module a model name comes from: qwen3 (dense or MoE presets), moe
  (the MoE GPT, "moe-*") or gpt."""
  from examples import gpt, moe, qwen3
  return qwen3 if model.startswith("qwen3") else moe if model.startswith("moe-") else gpt


def step_family(model: str):
  """The examples module whose `init_params`, `loss_fn` and `random_batch` a model uses:
  qwen3 for its presets, else gpt (the MoE GPT is a GPT there)."""
  from examples import gpt, qwen3
  return qwen3 if model.startswith("qwen3") else gpt


def is_moe(model: str) -> bool:
  if model.startswith("moe-"):
    return True
  if model.startswith("qwen3"):
    from examples import qwen3
    return "n_experts" in qwen3.PRESETS[model]
  return False


def BASELINE_OF(variant: str, model: str = "") -> str:
  """The plain-JAX row a variant's ratio is taken against (the `+bf16` one for `+bf16`,
  the `+mask` one for `+mask`;
  `shmap-dp`, which routes per device, for MoE models)."""
  base, mods = split_variant(variant)
  default = "shmap-dp" if is_moe(model) else "jit-dp"
  return _BASELINE.get(base.partition("@")[0], default) + "".join(
      "+" + m for m in ("bf16", "mask", "ac") if m in mods)


def baseline_row(rows_by_key: dict, variant: str, model: str, baseline_of=None):
  """(name, row) of the baseline a variant's ratio is against: `baseline_of`'s (default
  `BASELINE_OF`), or GSPMD FSDP where jit DP did not run (a model too large for it)."""
  name = (baseline_of or BASELINE_OF)(variant, model)
  row = rows_by_key.get((model, name))
  if row is None and name.startswith("jit-dp"):
    name = "gspmd-fsdp" + name[len("jit-dp"):]
    row = rows_by_key.get((model, name))
  return name, row


def _counts(text: str) -> list[int]:
  """--microbatches: "4,32" -> [4, 32]."""
  try:
    counts = [int(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: give a count or a comma list of counts, "
                                     f"such as 8 or 4,32") from None
  if min(counts) < 1 or len(set(counts)) < len(counts):
    raise argparse.ArgumentTypeError(f"{text!r}: counts are positive and each given once")
  return counts


def split_variant(variant: str) -> tuple[str, list[str]]:
  """"zero3+rbf16+r8" -> ("zero3", ["rbf16", "r8"])."""
  base, *mods = variant.split("+")
  return base, mods


def parse_pipeline(variant: str, default_zero: int) -> tuple[str, int] | None:
  """"pp-1f1b@z3" -> ("1f1b", 3); None for variants that are not pipelines."""
  if not variant.startswith("pp-"):
    return None
  name, _, zero = variant[3:].partition("@z")
  if name not in STAGES_PER_RANK:
    raise ValueError(f"unknown pipeline schedule in {variant!r}; use one of {list(STAGES_PER_RANK)}")
  return name, int(zero) if zero else default_zero


def _setup_cpu(small: bool):
  if small:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


def _config(model: str, n_stages: int, balanced: bool = False, bf16: bool = False,
            attention: str | None = None, seq_len: int = 0, remat: bool = False,
            layers: int = 0, stage_layers: tuple[int, ...] | None = None):
  config = _preset(model, n_stages, balanced, layers, stage_layers)
  if remat:
    if not hasattr(config, "remat"):
      raise ValueError(f"+ac checkpoints the blocks of the Qwen3 models; {model} has no remat")
    config = dataclasses.replace(config, remat=True)
  if seq_len:
    config = dataclasses.replace(config, seq_len=seq_len)
  if attention:
    config = dataclasses.replace(config, attention=attention)
  if bf16:  # parameters and optimizer states in bf16, as the PyTorch peer runs
    import jax.numpy as jnp
    config = dataclasses.replace(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  return config


def _preset(model: str, n_stages: int, balanced: bool, layers: int = 0,
            stage_layers: tuple[int, ...] | None = None):
  import jax.numpy as jnp
  from examples import gpt, moe, qwen3
  # Stages of uneven blocks are set as the config is made: its check refuses stages that
  # do not divide the blocks evenly otherwise.
  staged = dict(n_stages=n_stages, stage_layers=stage_layers)
  if model.startswith("qwen3"):
    # The tiny presets: 8 layers, so every variant (up to 4 ranks x 2 stages) runs.
    kw = (dict(n_layers=8) if model.endswith("tiny") else
          dict(dtype=jnp.bfloat16, param_dtype=jnp.float32))
    if layers:  # the preset's shapes with fewer (or more) blocks, to fit fewer GPUs
      kw["n_layers"] = layers
    return qwen3.get_config(model, **staged, **kw)
  if layers:
    raise ValueError(f"--layers sets the blocks of a Qwen3 preset; {model} is not one")
  if model.startswith("moe-"):
    if model == "moe-tiny":
      return moe.get_config("tiny", **staged, n_layers=4, n_experts=8)
    return moe.get_config(model[4:], **staged, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  # tiny: 8 layers, so every variant (up to 4 ranks x 2 stages) trains the same model.
  kw = (dict(n_layers=8) if model == "tiny" else
        dict(dtype=jnp.bfloat16, param_dtype=jnp.float32))
  config = gpt.get_config(model, **staged, **kw)
  if not balanced or n_stages == 1 or stage_layers:
    return config
  return dataclasses.replace(config, stage_layers=gpt.balanced_stage_layers(config, n_stages))


def fsdp_shardings(tree, mesh):
  """Plain GSPMD FSDP's sharding of every leaf of `tree` over `mesh`'s one axis "d"."""
  import jax
  from jax.sharding import NamedSharding
  return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, _fsdp_spec(x, mesh.size)), tree)


def _fsdp_spec(x, n):
  """Shard the largest dimension divisible by n over all devices (plain GSPMD FSDP)."""
  from jax.sharding import PartitionSpec as P
  dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
  for d in dims:
    if x.shape[d] % n == 0:
      return P(*[("d" if i == d else None) for i in range(x.ndim)])
  return P()


def build(variant: str, model: str, n: int, microbatches: int, pp: int = 2, zero: int = 0,
          attention: str | None = None, seq_len: int = 0, layers: int = 0):
  """(config, Flax model, piper-jax directives or None for a baseline) of a variant on n devices."""
  import piper_jax as pj
  from examples import gpt, moe, qwen3

  base, mods = split_variant(variant)
  pipe = parse_pipeline(base, zero)
  regions = [int(m[1:]) for m in mods if _REGIONS.fullmatch(m)]  # "+r4": DP over 4 regions
  name, _, bucket = base.partition("@b")  # "dp@b25", "accum@b25": 25 MB gradient buckets
  bucket_mb = float(bucket) if bucket else None
  n_stages = (pp * STAGES_PER_RANK[pipe[0]] if pipe else 2 if name == "accum-1f1b"
              else regions[0] if regions else 1)
  split = [tuple(int(n) for n in m[1:].split("-")) for m in mods if _LAYERS.fullmatch(m)]
  if split:
    n_layers = _config(model, 1, layers=layers).n_layers
    if len(split[0]) != n_stages or sum(split[0]) != n_layers:
      raise ValueError(f"{variant!r}: +L needs {n_stages} stages' blocks summing to "
                       f"{n_layers}, got {split[0]}")
  config = _config(model, n_stages, balanced="balanced" in mods, bf16="bf16" in mods,
                   remat="ac" in mods, attention=attention, seq_len=seq_len, layers=layers,
                   stage_layers=split[0] if split else None)
  if "tp" in mods:  # every model's config names Megatron's layout under tp_axis
    config = dataclasses.replace(config, tp_axis="tp")
  net = make_net(model, config)
  if base in BASELINES:
    return config, net, None
  reduce_dtype = "bfloat16" if "rbf16" in mods else None
  if pipe:
    directives = pj.strategies.pipeline(n_stages, microbatches, schedule=pipe[0], dp=n // pp,
                                        zero=pipe[1], reduce_dtype=reduce_dtype)
  elif name in ("accum", "accum-1f1b"):  # accumulation on every device, stages sharing it
    directives = [pj.split(microbatches), pj.replicate({}, list(range(n)), zero=zero,
                                                       bucket_mb=bucket_mb,
                                                       reduce_dtype=reduce_dtype)]
    if name == "accum-1f1b":
      directives += pj.schedules.one_f_one_b(n_stages, microbatches)
  else:
    if name not in PIPER[:4]:
      raise ValueError(f"unknown variant {variant!r}")
    directives = [pj.replicate({}, list(range(n)), zero=0 if name == "dp" else int(name[-1]),
                               bucket_mb=bucket_mb, reduce_dtype=reduce_dtype)]
  if "ep" in mods:  # experts split over each rank's data-parallel group
    directives.append(pj.shard({"EP": "*"}, list(range(n))))
  if "tp" in mods:  # rank r's data-parallel devices are r, r + pp, ...: its first two
    ranks = pp if pipe else 1
    directives.append(pj.shard_tensor({}, [r + k * ranks for r in range(ranks) for k in (0, 1)]))
  return config, net, directives


def make_net(model: str, config):
  """The Flax model of a run.py model name with `config`."""
  from examples import gpt, moe, qwen3
  family = _family(model)
  return (family.make_model(config) if family is qwen3
          else moe.MoEGPT(config) if family is moe else gpt.GPT(config))


def accumulated_value_and_grad(loss_fn, accumulate: int):
  """`jax.value_and_grad(loss_fn)` over `accumulate` equal microbatches of the batch's
  rows, as a JAX user writes gradient accumulation: `lax.scan`, then the mean."""
  import jax
  import jax.numpy as jnp
  grad_fn = jax.value_and_grad(loss_fn)
  if accumulate == 1:
    return grad_fn
  tree_map = jax.tree_util.tree_map

  def value_and_grad(p, b):
    mbs = tree_map(lambda x: x.reshape(accumulate, -1, *x.shape[1:]), b)
    # The sum starts at zero inside the scan: one copy of the microbatch's program, and
    # no microbatch's activations outside it.
    shapes = jax.eval_shape(grad_fn, p, tree_map(lambda x: x[0], mbs))
    zero = tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    body = lambda total, mb: (tree_map(jnp.add, total, grad_fn(p, mb)), None)
    total, _ = jax.lax.scan(body, zero, mbs)
    return tree_map(lambda x: x / accumulate, total)

  return value_and_grad


def lowering_options(mods: list[str]):
  """The `pj.LoweringOptions` a variant's suffixes choose (the module docstring says
  what each does)."""
  import piper_jax as pj
  slots = [int(m[4:]) << 20 for m in mods if _SLOTS.fullmatch(m)]
  return pj.LoweringOptions(
      remat=True if "remat" in mods else False if "noremat" in mods else None,
      cast_weights="nocast" not in mods,
      shard_masters="nodistopt" not in mods,
      zero3_reshard="keepgathered" not in mods,
      spread_uneven_slots="stacked" not in mods,
      compiler_options={} if "nocmdbuf" in mods else None,
      **({"slot_bytes": slots[0]} if slots else {}))


def shapes(family, net, config, batch: int):
  """(parameters, a global batch of `batch` rows) of a model, as shapes: nothing is
  allocated (the planner, `pj.compile` on shapes, and compiling without running)."""
  import jax
  key = jax.random.PRNGKey(0)
  return (jax.eval_shape(lambda: family.init_params(net, key)),
          jax.eval_shape(lambda: family.random_batch(config, key, batch)))


def init_params(family, net, seed: int = 0):
  """Random parameters of the shapes `family.init_params` gives, made by one small
  program per distinct shape: ones for norm scales, zeros for biases, N(0, 0.02)
  otherwise. Flax's init compiles every initializer into one program, which took XLA
  94 s for the 8B-shaped Qwen3 on an H200; timing does not depend on the values. On
  CPU (the small runs the tests compare) it is Flax's init itself.

  Every leaf is made sharded over all devices (its largest divisible dimension), never
  whole on device 0 (33 GB for the 8B shape): a multi-GPU step that finds too little
  memory can hang in its first call instead of failing."""
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding

  root = jax.random.PRNGKey(seed)
  if jax.default_backend() == "cpu":
    return family.init_params(net, root)
  shapes = jax.eval_shape(lambda r: family.init_params(net, r), root)
  mesh = Mesh(np.array(jax.devices()), ("d",))

  @functools.cache
  def normal(shape, dtype, spec):
    return jax.jit(lambda key: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
                   out_shardings=NamedSharding(mesh, spec))

  def leaf(i, path, s):
    name = str(getattr(path[-1], "key", ""))
    spec = _fsdp_spec(s, mesh.size)
    if name in ("scale", "bias"):
      fill = jnp.ones if name == "scale" else jnp.zeros
      return fill(s.shape, s.dtype, device=NamedSharding(mesh, spec))
    return normal(s.shape, s.dtype, spec)(jax.random.fold_in(root, i))

  flat, tree = jax.tree_util.tree_flatten_with_path(shapes)
  return jax.tree_util.tree_unflatten(tree, [leaf(i, p, s) for i, (p, s) in enumerate(flat)])


def timed_regions(loss_fn, params, batch, plan, remat: bool, cache: str, optimizer=None):
  """(`pj.calibrate` of every region at `plan`'s microbatch rows on the first device,
  those rows), for a global `batch` with values (its token ids are timed); with
  `optimizer`, its update too."""
  import jax

  import piper_jax as pj
  rows = jax.tree_util.tree_leaves(batch)[0].shape[0] // (plan.mesh.n_data * plan.n_microbatches)
  return pj.calibrate(loss_fn, params, batch, rows, remat=remat, cache=cache,
                      optimizer=optimizer), rows


def baseline_call(base: str, devices, loss_fn, tx, params, microbatches: int, pp: int,
                  batch: int):
  """A plain-JAX baseline's jitted step on `devices` and its (params, optimizer state,
  batch) shardings; `params` may be shapes."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  n = len(devices)

  def train_step(state, b, mean=lambda x: x, accumulate=1):
    p, o = state
    loss, grads = mean(accumulated_value_and_grad(loss_fn, accumulate)(p, b))
    updates, o = tx.update(grads, o, p)
    return (optax.apply_updates(p, updates), o), loss

  mesh = Mesh(np.array(devices), ("d",))
  rep_sh, bsh = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
  rep = lambda tree: jax.tree_util.tree_map(lambda _: rep_sh, tree)
  opt_shapes = jax.eval_shape(tx.init, params)
  if base in ("shmap-dp", "shmap-accum"):
    # Data parallel as a JAX user writes it with shard_map: each device runs the loss
    # on its own rows (a MoE routes its own tokens, as under piper-jax), then pmean.
    from jax import lax
    from piper_jax.lowering.compat import shard_map_unchecked  # zero sums are not device-varying
    accumulate = 1
    if base == "shmap-accum":  # a pipeline device's rows per task at a time
      accumulate = microbatches // pp
      if microbatches % pp or batch % n or (batch // n) % accumulate:
        raise ValueError(
            f"shmap-accum splits each device's {batch}/{n} rows into --microbatches / --pp "
            f"= {microbatches}/{pp} microbatches: pick numbers that divide evenly")
    local_step = lambda state, b: train_step(state, b, mean=lambda x: lax.pmean(x, "d"),
                                             accumulate=accumulate)
    call = jax.jit(shard_map_unchecked(local_step, mesh, (P(), P("d")), (P(), P())),
                   donate_argnums=0)
    return call, (rep(params), rep(opt_shapes), bsh)
  if base == "jit-dp":
    psh, osh = rep(params), rep(opt_shapes)
  else:
    psh, osh = fsdp_shardings(params, mesh), fsdp_shardings(opt_shapes, mesh)
  call = jax.jit(train_step, in_shardings=((psh, osh), bsh), out_shardings=((psh, osh), None),
                 donate_argnums=0)
  return call, (psh, osh, bsh)


def make_step(variant: str, model: str, batch: int, microbatches: int, pp: int = 2,
              zero: int = 0, attention: str | None = None, seq_len: int = 0, layers: int = 0,
              calibrate: str | None = None):
  """Builds one variant's training step on this process's devices.

  Returns (call, state, batches, config, sim): `call(state, batch) -> (state, loss)`,
  four random global batches, and the simulator's prediction for pipelines (with
  `calibrate`, a cache file, also from the step's regions timed on the first device at
  its microbatch rows: "sim_timed_ms").
  """
  import jax
  import optax

  import piper_jax as pj

  devices = jax.devices()
  n = len(devices)
  base, mods = split_variant(variant)
  config, net, directives = build(variant, model, n, microbatches, pp, zero, attention, seq_len,
                                   layers)
  family = step_family(model)
  loss_fn = family.loss_fn(net)
  params = init_params(family, net)
  # "+mask": no weight decay on vectors (biases, norms), the common LLM setting; such an
  # optimizer updates whole leaves under piper-jax (`TrainStep.leaf_update`).
  mask = (lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)) if "mask" in mods else None
  tx = optax.adamw(1e-4, weight_decay=0.1, mask=mask)
  batches = [family.random_batch(config, jax.random.PRNGKey(i), batch) for i in range(4)]
  sim = {}

  if base in BASELINES:
    call, (psh, osh, bsh) = baseline_call(base, devices, loss_fn, tx, params, microbatches, pp,
                                          batch)
    p = jax.device_put(params, psh)
    state = (p, jax.jit(tx.init, out_shardings=osh)(p))
    batches = [jax.device_put(b, bsh) for b in batches]
  else:
    options = lowering_options(mods)
    t0 = time.perf_counter()
    call = pj.compile(loss_fn, tx, directives, params, batches[0], options=options)
    sim["build_s"] = time.perf_counter() - t0  # tracing, planning, region analysis
    state = call.init(params)
    if base.startswith("pp-"):
      report = call.plan.simulate("flops")
      work = sum(t.cost for t in call.plan.tasks.values()) / call.plan.n_ranks
      sim = {**sim, "sim_makespan": report.makespan, "sim_tick_makespan": report.tick_makespan,
             "sim_work_per_rank": work, "sim_bubble": report.bubble_fraction}
      if calibrate:
        times, rows = timed_regions(loss_fn, params, batches[0], call.plan,
                                    options.remat is not False, calibrate)
        sim["sim_timed_ms"] = call.plan.simulate(times.costs(rows)).tick_makespan * 1e3
  return call, state, batches, config, sim


def _compiled(call, state, batch):
  """(the step compiled, as a callable, and XLA's bytes per device for it,
  `CompiledMemory.total`; 0 for a jitted baseline where XLA has no memory analysis)."""
  from piper_jax.memory import CompiledMemory
  if hasattr(call, "memory"):  # a piper-jax TrainStep: calls then run what it compiled
    return call, call.memory().total
  compiled = call.lower(state, batch).compile()
  try:
    return compiled, CompiledMemory.of(compiled).total
  except NotImplementedError:
    return compiled, 0


def loop_steps(call, state, batches, steps: int):
  """`steps` timed steps as a training loop runs them: each step's call is made before
  the previous step's loss is waited for, so the host prepares step i + 1 while the GPU
  runs step i. Returns (state, last loss, the median seconds from one loss being ready
  to the next, or until a call returns where that is longer; the latter)."""
  import numpy as np
  done, dispatch, prev = [], [], None
  for i in range(steps + 1):
    t0 = time.perf_counter()
    state, loss = call(state, batches[i % len(batches)])
    dispatch.append(time.perf_counter() - t0)  # until the call returns, before the GPU ends
    if prev is not None:
      prev.block_until_ready()
      done.append(time.perf_counter())
    prev = loss
  loss.block_until_ready()
  done.append(time.perf_counter())
  dispatch_s = float(np.median(dispatch))
  # A loop runs no faster than the host launches its steps: where a call returns only
  # when its step is done, the last interval above is empty.
  return state, loss, max(float(np.median(np.diff(done))), dispatch_s), dispatch_s


def _progress(text: str):
  """A line on stderr that the parent quotes when this child runs past --timeout."""
  print(f"[run] {text}", file=sys.stderr, flush=True)


def run_variant(variant: str, model: str, batch: int, microbatches: int, steps: int, warmup: int,
                pp: int = 2, zero: int = 0, attention: str | None = None, seq_len: int = 0,
                layers: int = 0, calibrate: str | None = None):
  """Runs one variant in this process; returns its row."""
  import jax
  import numpy as np

  import piper_jax as pj

  from examples import gpt

  devices = jax.devices()
  n = len(devices)
  t_start = time.perf_counter()
  call, state, batches, config, sim = make_step(variant, model, batch, microbatches, pp, zero,
                                                attention, seq_len, layers, calibrate)
  tokens = batch * config.seq_len
  _progress(f"{variant}: built in {time.perf_counter() - t_start:.1f} s")

  # Compiled apart from the first step, so that a row that runs past --timeout says
  # which of the two it was in, with XLA's count of the memory the program needs.
  t0 = time.perf_counter()
  call, xla_bytes = _compiled(call, state, batches[0])
  compiled = time.perf_counter() - t0
  _progress(f"{variant}: compiled in {compiled:.1f} s; XLA counts "
            f"{xla_bytes / 2**30:.1f} GiB per device")
  t0 = time.perf_counter()
  state, loss = call(state, batches[0])
  loss.block_until_ready()
  first = time.perf_counter() - t0
  _progress(f"{variant}: first step {first:.1f} s")
  for i in range(warmup):
    state, loss = call(state, batches[(i + 1) % len(batches)])
  loss.block_until_ready()
  state, loss, step_s, dispatch_s = loop_steps(call, state, batches, steps)
  # The same steps with the host waiting for each before calling the next: the GPU
  # idles while the host launches the step's first work.
  blocked = []
  for i in range(steps):
    t0 = time.perf_counter()
    state, loss = call(state, batches[i % len(batches)])
    loss.block_until_ready()
    blocked.append(time.perf_counter() - t0)
  peak = 0
  for d in jax.local_devices():
    stats = d.memory_stats() or {}
    peak = max(peak, stats.get("peak_bytes_in_use", 0))
  kind = devices[0].device_kind
  card = pj.planner.accelerator(kind)
  peak_flops = card.peak_flops if card else None
  tps = tokens / step_s
  fpt = _family(model).flops_per_token(config)
  mfu = fpt * tps / (n * peak_flops) if peak_flops else None
  return {"variant": variant, "model": model, "devices": n, "device_kind": kind,
          "step_ms": step_s * 1e3, "step_ms_blocked": float(np.median(blocked)) * 1e3,
          "dispatch_ms": dispatch_s * 1e3,
          "tokens_per_s": tps, "mfu": mfu,
          "peak_gib": peak / 2**30 if peak else None,
          "xla_gib": xla_bytes / 2**30,
          # pj.compile's own work counts, as jax.jit's tracing does in its first call.
          "compile_s": compiled + max(first - step_s, 0.0) + sim.get("build_s", 0.0),
          "loss": float(loss), "attention": gpt.attention_implementation(config),
          "stage_layers": [e - b for b, e in config.stage_bounds], **sim}


def mock_gpus(n: int) -> None:
  """Before JAX starts its backend: N GPUs of N processes, this one's local. Autotuning
  is not shared between the processes (each would wait for the others' results)."""
  import jax
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_shard_autotuning=false").strip()
  jax.config.update("jax_mock_gpu_topology", f"1x{n}x1")


def compile_variant(variant: str, model: str, batch: int, microbatches: int, pp: int = 2,
                    zero: int = 0, attention: str | None = None, seq_len: int = 0,
                    layers: int = 0, build_only: bool = False) -> dict:
  """One variant built on shapes and compiled, not run: its row, with `pj.compile`'s
  build (`build_s`), XLA's compile (`compile_s`) and XLA's count of the program's memory
  per device (`xla_gib`, and its parts under "memory"); `build_only`: the build alone."""
  import jax
  import optax

  import piper_jax as pj
  from examples import gpt
  from piper_jax.lowering import collectives_in_conditionals, copies_in_branches, distinct_kernels
  from piper_jax.memory import CompiledMemory

  devices = jax.devices()
  base, mods = split_variant(variant)
  config, net, directives = build(variant, model, len(devices), microbatches, pp, zero,
                                  attention, seq_len, layers)
  family = step_family(model)
  params, example = shapes(family, net, config, batch)
  mask = (lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)) if "mask" in mods else None
  tx = optax.adamw(1e-4, weight_decay=0.1, mask=mask)
  loss_fn = family.loss_fn(net)
  row = {"variant": variant, "model": model, "devices": len(devices),
         "device_kind": devices[0].device_kind, "batch": batch,
         "attention": gpt.attention_implementation(config), "build_s": 0.0}
  if base in BASELINES:
    call, (psh, osh, bsh) = baseline_call(base, devices, loss_fn, tx, params, microbatches,
                                          pp, batch)
    shaped = lambda tree, sh: jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    b = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=bsh),
                               example)
    t0 = time.perf_counter()
    compiled = call.lower((shaped(params, psh), shaped(jax.eval_shape(tx.init, params), osh)),
                          b).compile()
  else:
    t0 = time.perf_counter()
    step = pj.compile(loss_fn, tx, directives, params, example, options=lowering_options(mods))
    row["build_s"] = time.perf_counter() - t0
    row["microbatches"] = step.plan.n_microbatches
    if build_only:
      return {**row, "compile_s": 0.0}
    t0 = time.perf_counter()
    compiled = step.compile()
  row["compile_s"] = time.perf_counter() - t0
  mem = CompiledMemory.of(compiled)
  # On GPUs a conditional that holds a collective runs from the host, outside CUDA graphs.
  text = compiled.as_text()
  row["collectives_in_conditionals"] = len(collectives_in_conditionals(text))
  # What XLA copies each time a switch branch runs (the most of any branch).
  row["branch_copy_mib"] = max((b for c in copies_in_branches(text) for b in c), default=0) / 2**20
  # XLA's CPU compiler compiles each distinct kernel on its own: a count that does not drift.
  row["kernels"] = distinct_kernels(text)
  row["xla_gib"] = mem.total / 2**30
  row["memory"] = {k: getattr(mem, k) for k in ("arguments", "outputs", "aliased", "temporaries")}
  return row


def _child(args, variant, model):
  cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--model", model,
         "--batch", str(args.batch), "--microbatches", str(args.microbatches),
         "--steps", str(args.steps), "--warmup", str(args.warmup), "--pp", str(args.pp),
         "--zero", str(args.zero)] + (["--small"] if args.small else [])
  cmd += ["--seq-len", str(args.seq_len)] if args.seq_len else []
  cmd += ["--layers", str(args.layers)] if args.layers else []
  cmd += ["--attention", args.attention] if args.attention else []
  cmd += ["--calibrate", args.calibrate] if args.calibrate else []
  cmd += ["--compile-only"] if args.compile_only else []
  cmd += ["--build-only"] if args.build_only else []
  cmd += ["--mock-gpus", str(args.mock_gpus)] if args.mock_gpus else []
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if "xla" in split_variant(variant)[1]:  # process-wide XLA options, such as the allocator
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
  except subprocess.TimeoutExpired as e:  # a row that says where the child got to
    said = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    last = [l for l in said.splitlines() if l.startswith("[run]")][-1:]
    return {"variant": variant, "model": model, "wall_s": time.time() - t0,
            "error": f"timed out after {args.timeout} s" + (f"; last: {last[0]}" if last else "")}
  for line in proc.stdout.splitlines():
    if line.startswith("ROW "):
      return json.loads(line[4:])
  said = (proc.stderr or proc.stdout).strip().splitlines()
  # The exception's own line says what went wrong; the traceback above it, where.
  raised = [l for l in said if re.match(r"[\w.]+(Error|Exception)\b", l)]
  err = (raised[-1] if raised else " | ".join(said[-3:])).replace(ROOT + os.sep, "")
  if "RESOURCE_EXHAUSTED" in (proc.stderr or "") or "out of memory" in (proc.stderr or "").lower():
    err = "out of memory"
  return {"variant": variant, "model": model, "error": err[:500], "wall_s": time.time() - t0}


def _largest_batch(args, variant: str, model: str) -> dict:
  """The row of the largest global batch `variant` runs: --batch doubled, one process per
  try, until a try runs out of memory (or fails otherwise) or passes --max-batch. The
  microbatches double with the batch, so a pipeline's microbatch keeps its size (more of
  them is how a pipeline trains a larger batch). The row records the batch as "max_batch"
  and the first batch that did not fit as "failed_batch"."""
  best, batch = None, args.batch
  while batch <= args.max_batch:
    microbatches = args.microbatches * batch // args.batch
    row = _child(argparse.Namespace(**{**vars(args), "batch": batch, "microbatches": microbatches}),
                 variant, model)
    row["microbatches"] = microbatches
    if "error" in row:
      failed = {"failed_batch": batch, "failed_error": row["error"]}
      return ({**best, **failed} if best else {**row, "max_batch": None, **failed})
    best, batch = {**row, "max_batch": batch}, batch * 2
  return best if best else {"variant": variant, "model": model, "max_batch": None,
                            "error": f"--batch {args.batch} is above --max-batch"}


def add_predictions(rows) -> None:
  """Simulator predictions in ms, calibrated with the plain DP row of the same model."""
  ok = {(r["model"], r["variant"]): r for r in rows if "error" not in r}
  for r in rows:
    _, dp = baseline_row(ok, r["variant"], r["model"])
    # The calibration holds for the baseline's batch only (not another --max-batch try's).
    if "sim_makespan" in r and dp and r.get("max_batch") == dp.get("max_batch"):
      r["sim_ms"] = dp["step_ms"] * r["sim_makespan"] / r["sim_work_per_rank"]
      r["sim_tick_ms"] = dp["step_ms"] * r["sim_tick_makespan"] / r["sim_work_per_rank"]


def table(rows, baseline_of=BASELINE_OF) -> str:
  """A markdown table of result rows; `baseline_of(variant, model)` names the row each ratio
  is against."""
  head = ("| model | variant | devices | step ms | blocked ms | host ms | sim ms | tok/s | vs baseline "
          "| MFU | peak GiB | XLA GiB | compile s |")
  lines = [head, "|" + "---|" * 13]
  base = {(r["model"], r["variant"]): r for r in rows if "error" not in r}
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['variant']} | | | | | | {r['error']} | | | | | |")
      continue
    name, b = baseline_row(base, r["variant"], r["model"], baseline_of)
    ratio = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x {name}" if b else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
    xla = f"{r['xla_gib']:.2f}" if r.get("xla_gib") else "-"
    sim = r.get("sim_timed_ms") or r.get("sim_ms")
    sim = f"{sim:.1f}" if sim else "-"
    blocked = f"{r['step_ms_blocked']:.1f}" if r.get("step_ms_blocked") else "-"
    host = f"{r['dispatch_ms']:.1f}" if r.get("dispatch_ms") else "-"
    lines.append(f"| {r['model']} | {r['variant']} | {r['devices']} | {r['step_ms']:.1f} | {blocked} | {host} | {sim} | "
                 f"{r['tokens_per_s'] / 1e3:.1f}k | {ratio} | {mfu} | {peak} | {xla} | {r['compile_s']:.1f} |")
  return "\n".join(lines)


def compile_table(rows, baseline_of=BASELINE_OF) -> str:
  """A markdown table of `--compile-only` rows; the ratio is build + XLA seconds over the
  baseline's."""
  lines = ["| model | variant | devices | mb | build s | XLA s | vs baseline | XLA GiB | kernels "
           "| collectives in conditionals | MiB copied in a branch |", "|" + "---|" * 11]
  # Rows of several microbatch counts (each row, baselines too, carries its count) each
  # have their baseline at their own count.
  counted = (all("microbatches" in r for r in rows)
             and len({r["microbatches"] for r in rows}) > 1)
  at = lambda r: r.get("microbatches") if counted else None
  base: dict = {}
  for r in rows:
    if "error" not in r:
      base.setdefault(at(r), {})[(r["model"], r["variant"])] = r
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['variant']} | | {r.get('microbatches', '')} | "
                   f"{r['error']} | | | | | | |")
      continue
    name, b = baseline_row(base[at(r)], r["variant"], r["model"], baseline_of)
    total = lambda x: x["build_s"] + x["compile_s"]
    ratio = f"{total(r) / total(b):.2f}x {name}" if b else "-"
    copied = f"{r['branch_copy_mib']:.1f}" if "branch_copy_mib" in r else "-"
    lines.append(f"| {r['model']} | {r['variant']} | {r['devices']} | "
                 f"{r.get('microbatches', '-')} | {r['build_s']:.1f} | {r['compile_s']:.1f} | "
                 f"{ratio} | {r['xla_gib']:.2f} | {r.get('kernels', '-')} | "
                 f"{r.get('collectives_in_conditionals', '-')} | {copied} |")
  return "\n".join(lines)


def build_table(rows) -> str:
  """A markdown table of `--build-only` rows: `pj.compile`'s build, the fastest try and
  every try's."""
  lines = ["| model | variant | devices | batch / mb | build s | tries s |", "|" + "---|" * 6]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['variant']} | | | {r['error']} | |")
      continue
    tries = " / ".join(f"{t:.2f}" for t in r.get("tries_s", [r["build_s"]]))
    lines.append(f"| {r['model']} | {r['variant']} | {r['devices']} | "
                 f"{r['batch']} / {r['microbatches']} | {r['build_s']:.2f} | {tries} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="268m,1.3b",
                  help="comma list of: tiny, 268m, 1.3b, moe-tiny, moe-1b, and the presets of "
                       "examples/qwen3.py (qwen3-tiny, qwen3-1.7b, qwen3-8b, qwen3-moe-tiny, "
                       "qwen3-30b-a3b-4gpu)")
  ap.add_argument("--variants", default=",".join(BASELINES + PIPER))
  ap.add_argument("--batch", type=int, default=None,
                  help="global batch (sequences; default 16, with --small 4 rows per microbatch)")
  ap.add_argument("--microbatches", type=_counts, default=None,
                  help="microbatches of the pipelines (default 8; with --small 2 x --pp, at least "
                       "4); with --compile-only, a comma list compiles each variant at each")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--timeout", type=int, default=900, help="seconds per variant")
  ap.add_argument("--pp", type=int, default=2, help="pipeline ranks of the pp-* variants")
  ap.add_argument("--zero", type=int, default=0, help="ZeRO of the pipelines' DP axis (or @zK)")
  ap.add_argument("--attention", default=None, choices=["xla", "cudnn"],
                  help="attention implementation (default: cuDNN for bf16 on GPU, else XLA)")
  ap.add_argument("--small", action="store_true", help="tiny model on 8 CPU devices")
  ap.add_argument("--calibrate", default=None, metavar="CACHE",
                  help="pipelines also simulate from their regions timed on the first device "
                       "at the microbatch rows (pj.calibrate; CACHE keeps the timings): the "
                       "table's sim ms, the JSON's sim_timed_ms")
  ap.add_argument("--xla-flags", default="",
                  help="XLA flags added to XLA_FLAGS for the variants with a +xla suffix "
                       "(--xla-flags='--xla_flag=value ...')")
  ap.add_argument("--max-batch", type=int, default=0,
                  help="for each variant, the largest global batch it fits: --batch, doubled "
                       "(one process per try) until a try runs out of memory or passes this")
  ap.add_argument("--seq-len", type=int, default=0, help="override the model's sequence length")
  ap.add_argument("--layers", type=int, default=0,
                  help="blocks of a Qwen3 preset (its shapes cut to fit fewer GPUs)")
  ap.add_argument("--compile-only", action="store_true",
                  help="build and compile each variant on shapes without running it: "
                       "build s, XLA s and XLA's count of its memory per device")
  ap.add_argument("--mock-gpus", type=int, default=0, metavar="N",
                  help="with --compile-only: compile for N GPUs of N processes on this "
                       "machine's one (JAX's mock GPU topology)")
  ap.add_argument("--repeat", type=int, default=1, metavar="N",
                  help="with --compile-only: compile the variants N times, in turn, a process "
                       "each, and keep each variant's fastest build + XLA (on a machine whose "
                       "times drift, ratios of the fastest compare)")
  ap.add_argument("--build-only", action="store_true",
                  help="time pj.compile's build of each variant (tracing, planning, region "
                       "analysis) on shapes, without XLA's compile: a fresh process each")
  ap.add_argument("--out", default=None, help="JSON output path")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  args.compile_only = args.compile_only or args.build_only  # a build is the first half of one
  if args.mock_gpus and not args.compile_only:
    raise ValueError("--mock-gpus compiles for GPUs this machine does not have: "
                     "add --compile-only (or --build-only)")
  if args.repeat > 1 and not args.compile_only:
    raise ValueError("--repeat compiles each variant again: add --compile-only (or --build-only)")
  counts = args.microbatches or []
  if len(counts) > 1 and (not args.compile_only or args.child):
    raise ValueError("several --microbatches compile each variant at each count: add "
                     "--compile-only (or --build-only), or run one count per command")
  if args.compile_only and args.max_batch:
    raise ValueError("--max-batch finds the batch that runs out of memory running: "
                     "drop --compile-only (or --build-only)")
  if args.small:
    model = ("qwen3-moe-tiny" if args.model.startswith("qwen3") and is_moe(args.model)
             else "qwen3-tiny" if args.model.startswith("qwen3")
             else "moe-tiny" if args.model.startswith("moe") else "tiny")
    args.model, args.steps, args.warmup = model, 2, 1
    counts = counts or [max(4, 2 * args.pp)]
    # Default: a row per microbatch on every device.
    args.batch = args.batch or max(16, max(counts) * 4)
  counts = counts or [8]
  args.microbatches = counts[0]
  args.batch = args.batch or 16
  for v in args.variants.split(","):
    base, mods = split_variant(v)
    patterns = (_REGIONS, _LAYERS, _SLOTS)
    if {m for m in mods if not any(p.fullmatch(m) for p in patterns)} - set(_SUFFIXES):
      raise ValueError(f"unknown suffix in {v!r}: use +rK, +L<blocks>-<blocks>..., +slotN and "
                       + ", ".join("+" + m for m in _SUFFIXES))
    if base in BASELINES and args.build_only and not args.child:  # a child is one variant
      raise ValueError(f"--build-only times pj.compile, and {v} is plain JAX with nothing to "
                       "build: leave it out")
    if base in BASELINES and set(mods) - {"bf16", "mask", "xla", "ac"}:
      raise ValueError(f"{v!r}: the plain-JAX baselines take only +bf16, +mask, +ac and +xla")
    if {"remat", "noremat"} <= set(mods):
      raise ValueError(f"{v!r}: +remat and +noremat contradict each other; keep one")
    if "xla" in mods and not args.xla_flags:
      raise ValueError(f"{v!r}: +xla runs the variant with --xla-flags added to XLA_FLAGS; "
                       "give --xla-flags")
    if base.partition("@")[0] not in _NOT_PIPELINES:
      parse_pipeline(base, args.zero)
  _setup_cpu(args.small)
  if args.child and args.mock_gpus:  # before JAX starts its backend
    mock_gpus(args.mock_gpus)
  if args.child and args.compile_only:
    row = compile_variant(args.child, args.model, args.batch, args.microbatches, args.pp,
                          args.zero, args.attention, args.seq_len, args.layers, args.build_only)
    print("ROW " + json.dumps(row), flush=True)
    return row
  if args.child:
    row = run_variant(args.child, args.model, args.batch, args.microbatches, args.steps, args.warmup,
                      args.pp, args.zero, args.attention, args.seq_len, args.layers,
                      args.calibrate)
    print("ROW " + json.dumps(row), flush=True)
    return row
  tries: dict[tuple, list] = {}
  for model in args.model.split(","):
    for _ in range(args.repeat):
      for k in counts:
        at_k = argparse.Namespace(**{**vars(args), "microbatches": k})
        for variant in args.variants.split(","):
          row = (_largest_batch(at_k, variant, model) if args.max_batch
                 else _child(at_k, variant, model))
          if len(counts) > 1:
            row["microbatches"] = k  # a baseline's row too: its ratio's count
          tries.setdefault((model, variant, k), []).append(row)
          print(json.dumps(row), flush=True)
  rows = [fastest(rs) for rs in tries.values()]
  args.microbatches = counts if len(counts) > 1 else counts[0]  # the results' meta
  import jax
  if args.build_only:
    write_results(args, rows, "build", jax=jax.__version__, mock_gpus=args.mock_gpus)
    print(build_table(rows))
    return rows
  if args.compile_only:
    write_results(args, rows, "compile", jax=jax.__version__, mock_gpus=args.mock_gpus)
    print(compile_table(rows))
    return rows
  add_predictions(rows)
  write_results(args, rows, "results", jax=jax.__version__)
  print(table(rows))
  return rows


def fastest(rows: list) -> dict:
  """Of one variant's compiles, the row of the least build + XLA (the first error if
  every try failed), with every try's build + XLA in "tries_s" when there were several."""
  ok = [r for r in rows if "error" not in r]
  if not ok:
    return rows[0]
  total = lambda r: r.get("build_s", 0.0) + r.get("compile_s", 0.0)
  best = dict(min(ok, key=total))
  if len(rows) > 1:
    best["tries_s"] = [round(total(r), 3) for r in ok]
  return best


def write_results(args, rows, name: str, **meta) -> str:
  """Writes {"meta", "rows"} JSON to --out, else benchmarks/<name>[_small].json."""
  # The shape arguments a caller has (torch_peer.py has no --layers).
  shape = {k: getattr(args, k) for k in ("pp", "seq_len", "layers") if hasattr(args, k)}
  meta = {"date": datetime.date.today().isoformat(), "batch": args.batch,
          "microbatches": args.microbatches, "steps": args.steps, **shape, **meta}
  out = args.out or os.path.join(ROOT, "benchmarks", f"{name}_small.json" if args.small else f"{name}.json")
  with open(out, "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return out


if __name__ == "__main__":
  main()
