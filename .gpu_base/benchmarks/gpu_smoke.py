"""GPU smoke run: piper-jax strategies on all visible GPUs train as one GPU does.

  python3 benchmarks/gpu_smoke.py                 # all visible GPUs (2 or 4)
  python3 benchmarks/gpu_smoke.py --out r.json    # also write the results as JSON
  python3 benchmarks/gpu_smoke.py --cpu           # 8 simulated CPU devices, tiny model

The CPU tests run the CPU's program (every tick's switch waits for the collectives
before it, `Program.order_collectives`) without the GPU's XLA options; this runs the
program a GPU builds: the GPU ordering, the command-buffer options of
`Program.compiler_options("gpu")`, cuDNN attention and the bf16 weight-gradient GEMMs
that write fp32. A small GPT (`examples/gpt.py`, bf16 compute with fp32 parameters)
trains `--steps` steps under each strategy:

  dp-zero1    data parallel over all devices, ZeRO-1
  dp-zero3    data parallel over all devices, ZeRO-3
  1f1b        1F1B over 2 GPUs (x data parallel over the rest, ZeRO-1), a rolled loop
  dualpipev   DualPipeV over 2 GPUs, 4 stages (x data parallel, ZeRO-2)
  1f1b+mask   1F1B with `optax.adamw(..., mask=...)` (no decay on vectors): whole-leaf
              optimizer updates instead of the packed buffers'

and each is compared with plain `jax.value_and_grad` + optax on one GPU on the same
batches: losses to `--loss-rtol` (relative), and every leaf's update over the steps to
0.3 of its norm (bf16 rounding moves elements, not a leaf's update as a whole: a frozen
or dropped leaf gives 1); then one step of plain `optax.sgd(1.0)` under the strategy
holds every leaf's update (its gradient) to 0.1 (a doubled gradient gives 1 there). Elements whose gradient is at bf16 rounding level are left out
(as tests/models.py `assert_updates_close`). A leaf's error is the smallest against the
plain run, the one-device run with the gradients summed over the strategy's microbatches
and the fp32-compute run (`REFERENCES`). It prints a row per strategy
(exit status 1 if any fails) and writes JSON to `--out` (default $OUT/gpu_smoke.json
when $OUT is set).

Most of the time is compiling: on 2 x H200 (jax 0.11.2) 1f1b, dualpipev and dp-zero1
passed in 110 s together, references included (a run of an earlier version, stopped
there by its time limit); with --cpu all five pass in 4-5 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cpu", action="store_true",
                 help="run on 8 simulated CPU devices (4 used) with a tiny model")
  p.add_argument("--devices", type=int, default=None,
                 help="devices to use (default: all GPUs; 4 with --cpu); even, >= 2")
  p.add_argument("--strategies", default=None,
                 help="comma-separated subset of: dp-zero1,dp-zero3,1f1b,dualpipev,1f1b+mask")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--microbatches", type=int, default=None,
                 help="per pipeline step (default 8: 1F1B over 2 GPUs rolls; 4 with --cpu)")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="compute dtype (parameters stay float32)")
  p.add_argument("--loss-rtol", type=float, default=2e-2)
  p.add_argument("--update-bound", type=float, default=0.3,
                 help="largest relative error of a leaf's update over the steps (adam)")
  p.add_argument("--sgd-bound", type=float, default=0.1,
                 help="largest relative error of a leaf's update in one SGD step")
  p.add_argument("--no-sgd", dest="sgd", action="store_false", help="skip the SGD steps")
  p.add_argument("--timeout", type=float, default=900,
                 help="give up (stack traces, exit 1) after this many seconds: a hung collective")
  p.add_argument("--out", default=None, help="JSON results (default $OUT/gpu_smoke.json)")
  return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None

if ARGS is not None and ARGS.cpu:
  # Before JAX starts: 8 CPU devices, and XLA's lowest CPU optimization (compile-bound
  # programs; the test suite runs so, tests/conftest.py).
  os.environ["JAX_PLATFORMS"] = "cpu"
  _flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
  if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
  os.environ["XLA_FLAGS"] = _flags.strip()

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)  # for `examples.gpt`


def _import_piper_jax():
  """piper_jax, installed (`pip install -e .`) or else from this checkout, whose
  `ir/` and `lowering/` are the packages `piper_jax.ir` and `piper_jax.lowering`
  (pyproject.toml's package-dir): a bare GPU machine runs the script as it is."""
  try:
    import piper_jax
    return piper_jax
  except ModuleNotFoundError as e:
    if not (e.name or "").startswith("piper_jax"):
      raise
  for name in [k for k in sys.modules if k == "piper_jax" or k.startswith("piper_jax.")]:
    del sys.modules[name]
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "piper_jax", os.path.join(_REPO, "piper_jax", "__init__.py"),
      submodule_search_locations=[os.path.join(_REPO, "piper_jax"), _REPO])
  module = importlib.util.module_from_spec(spec)
  sys.modules["piper_jax"] = module
  spec.loader.exec_module(module)
  return module


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

pj = _import_piper_jax()
from examples import gpt  # noqa: E402

STRATEGIES = ("dp-zero1", "dp-zero3", "1f1b", "dualpipev", "1f1b+mask")
# The GPU model: small enough to compile in seconds, with cuDNN attention in bf16
# (head dim 64). The CPU's: tiny.
GPU_MODEL = dict(vocab_size=1024, seq_len=128, d_model=256, n_layers=4, n_heads=4)
CPU_MODEL = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)


def adamw():
  """The tests' optimizer (tests/models.py `optimizer`)."""
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def masked_adamw():
  """Weight decay on matrices only: a mask, which piper-jax updates leaf by leaf."""
  return optax.adamw(1e-3, weight_decay=0.1,
                     mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))


def strategies(n: int, n_mb: int) -> dict:
  """name -> (model stages, directives, optimizer) for `n` devices."""
  dp = n // 2
  return {
      "dp-zero1": (1, pj.strategies.data_parallel(n, zero=1), adamw),
      "dp-zero3": (1, pj.strategies.data_parallel(n, zero=3), adamw),
      "1f1b": (2, pj.strategies.pipeline(2, n_mb, "1f1b", dp=dp, zero=1 if dp > 1 else 0), adamw),
      "dualpipev": (4, pj.strategies.pipeline(4, n_mb, "dualpipev", dp=dp,
                                              zero=2 if dp > 1 else 0), adamw),
      "1f1b+mask": (2, pj.strategies.pipeline(2, n_mb, "1f1b", dp=dp, zero=1 if dp > 1 else 0),
                    masked_adamw),
  }


def update_errors(got, ref, start, grads) -> dict[str, float]:
  """Per leaf: ||(got - start) - (ref - start)|| / ||ref - start|| over the elements
  whose reference gradient is at least 1% of the gradients' RMS (tests/models.py
  `assert_updates_close`); leaves with no such element are left out."""
  leaves = lambda t: [np.asarray(x, np.float32).ravel() for x in jax.tree_util.tree_leaves(t)]
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(start)]
  gs = leaves(grads)
  g_rms = float(np.sqrt(sum(np.sum(g * g) for g in gs) / sum(g.size for g in gs)))
  out = {}
  for name, g, r, s, grad in zip(paths, leaves(got), leaves(ref), leaves(start), gs):
    signal = np.abs(grad) >= 1e-2 * g_rms
    if not signal.any():
      continue
    moved, want = (g - s)[signal], (r - s)[signal]
    norm = float(np.linalg.norm(want))
    out[name] = float(np.linalg.norm(moved - want)) / norm if norm > 0 else float("inf")
  return out


# The one-device runs a strategy's is compared with; a leaf within the bound of any of
# them passes. In bf16 the plain run is one of several equally right ones: a pipeline's
# gradients are sums over microbatches, each computed in bf16, and some of its sums are
# wider (fp32 weight-gradient GEMMs). Adam turns that rounding into whole steps for the
# elements whose gradient changes sign, and over 3 steps a bias moved 0.27-0.31 of its
# norm away from the plain run's (tiny GPT, 1F1B x DP 2 on CPU) while the plain run with
# the gradients summed over the same microbatches moved as far (and piper-jax's 0.01 from
# that one); under SGD all stayed within 0.03. A frozen or dropped leaf, or (under SGD) a
# gradient at another scale, is about 1 from all three.
REFERENCES = {"plain": "one device, whole batch, the model's dtype",
              "microbatched": "one device, gradients summed over the strategy's microbatches",
              "fp32": "one device, whole batch, fp32 compute"}


class References:
  """Plain jax.value_and_grad + optax on one device, cached by (kind, optimizer, split).
  The model's PP annotations are only names (`jax.named_scope`), so every strategy's
  model computes the same function as the one-stage model run here."""

  def __init__(self, cfg: dict, params, batches, device):
    self.device = device
    self.params, self.batches = jax.device_put((params, batches), device)
    self.loss = {dt: gpt.loss_fn(gpt.GPT(gpt.GPTConfig(**dict(cfg, dtype=dt))))
                 for dt in (cfg["dtype"], jnp.dtype(jnp.float32))}
    self.dtype = cfg["dtype"]
    self.runs = {}

  def gradient(self):
    """The plain run's gradient on the first batch (what tells signal from rounding)."""
    if "grad" not in self.runs:
      self.runs["grad"] = jax.device_get(jax.jit(jax.grad(self.loss[self.dtype]))(
          self.params, self.batches[0]))
    return self.runs["grad"]

  def run(self, kind: str, make_tx, n_steps: int, split: int = 1):
    """(losses, final params) of `n_steps` steps of `make_tx()`; `split`: the gradient
    is the mean over that many equal consecutive pieces of each batch."""
    key = (kind, make_tx.__name__, n_steps, split if kind == "microbatched" else 1)
    if key in self.runs:
      return self.runs[key]
    loss_fn = self.loss[jnp.dtype(jnp.float32) if kind == "fp32" else self.dtype]
    tx = make_tx()
    pieces = key[3]

    def value_and_grad(params, batch):
      if pieces == 1:
        return jax.value_and_grad(loss_fn)(params, batch)
      chunks = jax.tree_util.tree_map(
          lambda x: x.reshape((pieces, x.shape[0] // pieces) + x.shape[1:]), batch)

      def add(acc, chunk):
        value = jax.value_and_grad(loss_fn)(params, chunk)
        return jax.tree_util.tree_map(jnp.add, acc, value), None

      zero = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, params))
      total, _ = jax.lax.scan(add, zero, chunks)
      return jax.tree_util.tree_map(lambda x: x / pieces, total)

    @jax.jit
    def step(params, opt_state, batch):
      loss, grads = value_and_grad(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, losses = self.params, tx.init(self.params), []
    for b in self.batches[:n_steps]:
      params, opt_state, loss = step(params, opt_state, b)
      losses.append(float(loss))
    self.runs[key] = (losses, jax.device_get(params))
    return self.runs[key]

  def compare(self, got, make_tx, n_steps: int, split: int) -> dict:
    """(per leaf: (update error, reference), the smallest against the references;
    per reference: the largest error of a leaf against it)."""
    start, grads = jax.device_get(self.params), self.gradient()
    errs = {kind: update_errors(got, self.run(kind, make_tx, n_steps, split)[1], start, grads)
            for kind in REFERENCES}
    return ({leaf: min((errs[k][leaf], k) for k in REFERENCES) for leaf in errs["plain"]},
            {k: max(e.values()) for k, e in errs.items()})


def sgd():
  return optax.sgd(1.0)


def piper_run(loss_fn, params, batches, tx, directives, devices):
  step = pj.compile(loss_fn, tx, directives, params, batches[0], devices=devices)
  state = step.init(params)
  losses = []
  for b in batches:
    state, loss = step(state, b)
    losses.append(float(loss))
  return step, losses, jax.device_get(step.params(state))


def _worst(errors: dict, prefix: str) -> dict:
  leaf, (err, ref) = max(errors.items(), key=lambda kv: kv[1][0])
  return {f"{prefix}worst_leaf": leaf, f"{prefix}err": err, f"{prefix}closest": ref}


def check(name, n_stages, directives, make_tx, cfg, params, batches, devices, refs, args) -> dict:
  loss_fn = gpt.loss_fn(gpt.GPT(gpt.GPTConfig(**cfg, n_stages=n_stages)))
  row = {"strategy": name, "n_stages": n_stages, "optimizer": make_tx.__name__}
  t0 = time.perf_counter()
  step, losses, got = piper_run(loss_fn, params, batches, make_tx(), directives, devices)
  mesh = dict(zip(step.mesh.axis_names, step.mesh.devices.shape))
  split = step.plan.n_microbatches * step.plan.mesh.n_data  # microbatches of the step
  ref_losses = refs.run("plain", make_tx, len(batches))[0]
  row.update(
      devices=len(step.mesh.devices.flat), mesh=mesh, microbatches=split,
      rolled=step.rolled is not None, order_collectives=step._program.order_collectives,
      compiler_options=step._program.compiler_options(devices[0].platform),
      leaf_update=step.leaf_update, losses=losses, ref_losses=ref_losses)
  row["max_loss_rel"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
  errors, row["err_by_reference"] = refs.compare(got, make_tx, len(batches), split)
  row.update(_worst(errors, ""))
  ok = (all(np.isfinite(losses)) and row["max_loss_rel"] <= args.loss_rtol
        and row["err"] <= args.update_bound)
  if args.sgd:
    _, _, sgd_got = piper_run(loss_fn, params, batches[:1], sgd(), directives, devices)
    errors, row["sgd_err_by_reference"] = refs.compare(sgd_got, sgd, 1, split)
    row.update(_worst(errors, "sgd_"))
    ok = ok and row["sgd_err"] <= args.sgd_bound
  row["seconds"] = round(time.perf_counter() - t0, 2)
  row["pass"] = bool(ok)
  return row


def main(args) -> int:
  faulthandler.dump_traceback_later(args.timeout, exit=True)
  all_devices = jax.devices()
  platform = all_devices[0].platform
  if platform == "cpu" and not args.cpu:
    print("no GPU: pass --cpu to run on simulated CPU devices", file=sys.stderr)
    return 2
  n = args.devices or (4 if args.cpu else len(all_devices))
  if n < 2 or n % 2 or n > len(all_devices):
    print(f"need an even number >= 2 of devices, at most {len(all_devices)}; got {n}",
          file=sys.stderr)
    return 2
  devices = all_devices[:n]
  n_mb = args.microbatches or (4 if args.cpu else 8)
  dtype = jnp.dtype(args.dtype)
  cfg = dict(CPU_MODEL if args.cpu else GPU_MODEL, dtype=dtype)
  config = gpt.GPTConfig(**cfg)
  params = gpt.init_params(gpt.GPT(config), jax.random.PRNGKey(0))
  dp = n // 2
  batch_size = 2 * dp * n_mb  # 2 sequences a microbatch in the pipelines
  batches = [gpt.random_batch(config, jax.random.PRNGKey(1 + i), batch_size, pattern_seed=1)
             for i in range(args.steps)]
  chosen = args.strategies.split(",") if args.strategies else list(STRATEGIES)
  table = strategies(n, n_mb)
  unknown = [s for s in chosen if s not in table]
  if unknown:
    print(f"unknown strategies {unknown}; choose from {list(table)}", file=sys.stderr)
    return 2
  version = str(getattr(all_devices[0].client, "platform_version", ""))
  print(f"{n} x {all_devices[0].device_kind} ({platform}; {version}), jax {jax.__version__}, "
        f"GPT {cfg['d_model']}d x {cfg['n_layers']} layers, {args.dtype} compute, "
        f"batch {batch_size} x {cfg['seq_len']}, {args.steps} steps", flush=True)
  refs = References(cfg, params, batches, devices[0])
  _print_header(args)
  rows = []
  for name in chosen:
    n_stages, directives, make_tx = table[name]
    try:
      row = check(name, n_stages, directives, make_tx, cfg, params, batches, devices, refs, args)
    except Exception as e:  # noqa: BLE001 - a failing strategy is a row, not the end
      row = {"strategy": name, "pass": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    rows.append(row)
    _print_row(row)
  passed = all(r["pass"] for r in rows)
  print(f"{sum(r['pass'] for r in rows)}/{len(rows)} passed")
  out = args.out or (os.path.join(os.environ["OUT"], "gpu_smoke.json") if os.environ.get("OUT")
                     else None)
  if out:
    result = {"device_kind": all_devices[0].device_kind, "platform": platform,
              "platform_version": version,
              "jax": jax.__version__, "n_devices": n, "model": {**cfg, "dtype": args.dtype},
              "batch_size": batch_size, "microbatches": n_mb, "steps": args.steps,
              "references": REFERENCES,
              "bounds": {"loss_rtol": args.loss_rtol, "update": args.update_bound,
                         "sgd": args.sgd_bound if args.sgd else None},
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": rows, "passed": passed}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f, indent=1, default=str)
    print(f"wrote {out}")
  faulthandler.cancel_dump_traceback_later()
  return 0 if passed else 1


_COLUMNS = (("strategy", 10), ("mesh", 8), ("loss rel", 8), ("worst leaf (adam)", 24),
            ("err", 5), ("closest", 12), ("worst leaf (sgd)", 24), ("err", 5), ("s", 4),
            ("result", 6))


def _line(values) -> str:
  return "  ".join(str(v)[-w:].ljust(w) if i in (3, 6) else str(v).ljust(w)
                   for i, (v, (_, w)) in enumerate(zip(values, _COLUMNS))).rstrip()


def _print_header(args):
  bounds = f"loss rel <= {args.loss_rtol}, adam err <= {args.update_bound}"
  if args.sgd:
    bounds += f", sgd err <= {args.sgd_bound}"
  print(f"{bounds}; err: a leaf's update error against the closest reference run: "
        + "; ".join(f"{k}: {v}" for k, v in REFERENCES.items()))
  print(_line([name for name, _ in _COLUMNS]), flush=True)


def _print_row(r):
  short = lambda s: re.sub(r"\['([^']*)'\]", r"\1.", s).rstrip(".")
  if "error" in r:
    print(_line([r["strategy"], "-", "-", "-", "-", "-", "-", "-", "-", "FAIL"]))
    print("  " + r["error"].splitlines()[0][:300], flush=True)
    return
  print(_line([r["strategy"], ",".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1),
               f"{r['max_loss_rel']:.1e}", short(r["worst_leaf"]), f"{r['err']:.3f}",
               r["closest"], short(r.get("sgd_worst_leaf", "-")),
               f"{r['sgd_err']:.3f}" if "sgd_err" in r else "-", f"{r['seconds']:.0f}",
               "PASS" if r["pass"] else "FAIL"]), flush=True)


if __name__ == "__main__":
  sys.exit(main(ARGS))
