"""Trains an example model (GPT, Qwen3 or Qwen3-MoE) under a piper-jax strategy.

Without a GPU it runs on 8 simulated CPU devices:

  python examples/train.py --strategy pp-1f1b --stages 2 --dp 4 --zero 1 \
      --microbatches 4 --steps 6
  python examples/train.py --model qwen3-tiny --strategy pp-dualpipev --stages 4 --dp 2

`--model` takes any preset of examples/gpt.py (tiny, 268m, 1.3b, ...) or
examples/qwen3.py (qwen3-tiny, qwen3-1.7b, qwen3-8b, qwen3-moe-tiny,
qwen3-30b-a3b-4gpu); a Qwen3-MoE preset's experts are split over each stage's
data-parallel devices with `--ep`.

Real Qwen3 weights: `--init-from DIR` starts from a Hugging Face Qwen3 / Qwen3-MoE
checkpoint folder (its config.json sets the model), `--tokenizer DIR/tokenizer.json`
tokenizes `--data` (documents packed into sequences, its end-of-text token between
them), and `--save-hf OUT` writes the trained weights as a checkpoint Hugging Face
loads (examples/hf.py):

  python examples/train.py --init-from Qwen3-1.7B --tokenizer Qwen3-1.7B/tokenizer.json \
      --data my_texts/ --seq-len 2048 --strategy zero1 --save-hf trained

Strategies: dp, zero1, zero2, zero3 (data parallel over all devices, ZeRO level
K) and pp-gpipe, pp-1f1b, pp-zb, pp-interleaved, pp-dualpipev (`--stages` pipeline
stages, two per device for interleaved and DualPipeV, `--microbatches`, times `--dp`
data-parallel replicas with ZeRO level `--zero`). `--check` first compares two
steps of the strategy with the plain computation (`piper_jax.check`) and stops,
exit status 1, when they differ. `--strategy auto` lets `pj.strategies.search` choose
among them for the model's `--stages` regions and `--memory-gib` per device, prints
its table and trains with the best.

Started by the local launcher, the processes train one model over all their devices
(here 2 x 4 CPU devices) and process 0 prints:

  python -m piper_jax.launch --nprocs 2 --devices-per-proc 4 examples/train.py \
      --strategy zero1 --steps 6

On a terminal a progress bar shows the loss; piped or logged, one line every
`--log-every` steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

import piper_jax as pj
from piper_jax.planner import ACCELERATORS, accelerator

try:
  from examples import gpt, hf, moe, qwen3
except ImportError:
  import gpt  # run as a script: examples/ is on sys.path
  import hf
  import moe
  import qwen3

CPU_DEVICES = 8  # simulated devices when JAX finds no accelerator


def use_simulated_cpu_devices(n: int = CPU_DEVICES) -> None:
  """Asks for `n` CPU devices when JAX runs on the CPU; must run before the first device
  is used (afterwards, e.g. under a test, the backend's devices stay)."""
  if os.environ.get("JAX_PLATFORMS", "") not in ("", "cpu"):
    return
  if "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return  # the user chose a count
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except AttributeError:  # a JAX without the option reads the flag when its backend starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={n}").strip()
  except RuntimeError:
    pass  # the backend already runs


STRATEGIES = ("dp", "zero1", "zero2", "zero3", "pp-gpipe", "pp-1f1b", "pp-zb", "pp-interleaved",
              "pp-dualpipev", "auto")


def _preset(name: str) -> dict:
  return {**gpt.PRESETS, **qwen3.PRESETS}[name]


def _model_name(args) -> str | None:
  """The --model preset, `tiny` when omitted; None: the --init-from checkpoint's own."""
  return args.model or (None if args.init_from else "tiny")


def _n_experts(args) -> int:
  """Routed experts per layer of the model the flags describe (0: dense)."""
  if args.experts:
    return args.experts
  if args.init_from and os.path.isfile(os.path.join(args.init_from, "config.json")):
    fields = hf.read_config(args.init_from)
    return fields.get("num_experts", fields.get("num_local_experts", 0))
  return _preset(_model_name(args) or "tiny").get("n_experts", 0)


class UsageError(ValueError):
  """Flags that do not fit together or do not fit the devices."""


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows each option's default, except where its help already says what it is."""

  def _get_help_string(self, action: argparse.Action) -> str:
    if "default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=_DefaultsFormatter)
  p.add_argument("--strategy", choices=STRATEGIES, default="pp-1f1b",
                 help="how the model is split over the devices")
  p.add_argument("--stages", type=int, default=2,
                 help="pipeline stages (pp-* strategies; auto: the model's PP regions)")
  p.add_argument("--memory-gib", type=float, default=None,
                 help="auto: memory per device the strategy must fit (default: the "
                      "device's, or 16 GiB on CPU)")
  p.add_argument("--plan-for", metavar="CARD", default=None,
                 help="auto: plan for this card (" + ", ".join(ACCELERATORS) + ") instead of "
                      "this machine's devices, print the table and stop: its memory, "
                      "FLOP/s and links, the model traced as it runs there (fused "
                      "attention's memory), from any machine (default: plan and train here)")
  p.add_argument("--plan-devices", type=int, default=None,
                 help="--plan-for: how many cards (default: this machine's device count)")
  p.add_argument("--timelines", metavar="DIR", default=None,
                 help="auto: draw the plans of the three fastest candidates into DIR "
                      "(default: none drawn)")
  p.add_argument("--calibrate", metavar="CACHE.json", default=None,
                 help="auto: time each region on the first device (kept in this file for "
                      "the next run) and rank by those times instead of FLOP counts "
                      "(default: rank by FLOP counts)")
  p.add_argument("--microbatches", type=int, default=4,
                 help="microbatches per step (pp-* strategies)")
  p.add_argument("--dp", type=int, default=1,
                 help="data-parallel degree (pp-* strategies)")
  p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                 help="ZeRO level (pp-* strategies)")
  p.add_argument("--steps", type=int, default=10, help="training steps")
  p.add_argument("--batch", type=int, default=16, help="global batch size")
  p.add_argument("--model", choices=tuple(gpt.PRESETS) + tuple(qwen3.PRESETS), default=None,
                 help="model preset (default: tiny; with --init-from the checkpoint's "
                      "config.json, which a qwen3 preset given must match)")
  p.add_argument("--init-from", metavar="DIR", default=None,
                 help="start from this Hugging Face Qwen3 or Qwen3-MoE checkpoint folder "
                      "(config.json and .safetensors; default: random parameters)")
  p.add_argument("--save-hf", metavar="DIR", default=None,
                 help="at the end, write the trained parameters into DIR as a Hugging Face "
                      "checkpoint (qwen3 models; default: none written)")
  p.add_argument("--save-hf-dtype", choices=("float32", "bfloat16"), default="float32",
                 help="dtype of the tensors --save-hf writes")
  p.add_argument("--seq-len", type=int, default=None,
                 help="override the preset's sequence length (default: the preset's; with "
                      "--init-from alone, 4096 or the checkpoint's max_position_embeddings "
                      "if smaller)")
  p.add_argument("--experts", type=int, default=0,
                 help="GPT presets: 0: dense; N: MoE GPT with N experts, top-2, in every "
                      "block (examples/moe.py)")
  p.add_argument("--ep", action="store_true",
                 help="split the experts over each stage's data-parallel devices (pj.shard)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute dtype (parameters stay float32)")
  p.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default=None,
                 help="dtype of the data-parallel gradient reductions (default: the parameters')")
  p.add_argument("--bucket-mb", type=float, default=25.0,
                 help="dp: all-reduce gradients in buckets of this many MB (replicate's "
                      "bucket_mb; 0: one all-reduce per parameter slot at the step's end)")
  p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None,
                 help="store less per microbatch: B recomputes elementwise residuals from "
                      "a value stored in their place (pj.compile(remat=...); default: "
                      "pipelines only)")
  p.add_argument("--lr", type=float, default=1e-3, help="adamw's (peak) learning rate")
  p.add_argument("--warmup", type=int, default=0,
                 help="steps of linear warm-up from 0 to --lr (default: none)")
  p.add_argument("--decay", choices=("constant", "cosine"), default="constant",
                 help="after the warm-up: keep --lr, or a cosine decay to --lr/10 at --steps")
  p.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data")
  p.add_argument("--data", default="stdlib",
                 help="a text file or folder to train on (bytes, or --tokenizer's tokens); "
                      "'stdlib' (default) is the Python standard library's source; "
                      "'synthetic' a learnable random walk")
  p.add_argument("--tokenizer", metavar="TOKENIZER.json", default=None,
                 help="a Hugging Face tokenizers file: --data's files become documents of "
                      "its tokens, packed with the end-of-text token between them (default: "
                      "bytes)")
  p.add_argument("--eos", metavar="TOKEN", default=None,
                 help="--tokenizer's end-of-text token (default: eos_token of the "
                      "tokenizer_config.json beside it, else one of " + ", ".join(EOS_TOKENS)
                      + ")")
  p.add_argument("--metrics", default=None,
                 help="append per-step metrics to this JSONL file (default: none written)")
  p.add_argument("--ckpt-dir", default=None,
                 help="checkpoint folder (orbax; default: no checkpoints)")
  p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: at the end)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the newest checkpoint in --ckpt-dir (any strategy)")
  p.add_argument("--check", action="store_true",
                 help="before training, compare two steps of the strategy on the first batch "
                      "with the plain computation (piper_jax.check) and stop if they differ")
  p.add_argument("--log-every", type=int, default=10,
                 help="read the loss and log every N steps (reading it waits for the devices)")
  p.add_argument("--quiet", action="store_true",
                 help="no progress bar on a terminal: plain lines as when piped")
  return p


def parse_args(argv=None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def build_strategy(args, n_devices: int):
  """Returns (directives, number of devices used, number of model stages); for
  `--strategy auto`, no directives yet (`search_strategy` chooses them)."""
  if args.calibrate and args.strategy != "auto":
    raise UsageError("--calibrate times regions for --strategy auto's ranking; add "
                     "--strategy auto or drop --calibrate")
  if (args.plan_for or args.plan_devices) and args.strategy != "auto":
    raise UsageError("--plan-for and --plan-devices plan a strategy: add --strategy auto")
  if args.plan_for and accelerator(args.plan_for) is None:
    raise UsageError(f"--plan-for {args.plan_for}: choose one of {', '.join(ACCELERATORS)}")
  if args.plan_devices is not None and not args.plan_for:
    raise UsageError("--plan-devices counts the cards of --plan-for: add --plan-for CARD")
  if args.strategy == "auto":
    if args.dp != 1 or args.zero != 0:
      raise UsageError("--strategy auto chooses data parallelism and ZeRO itself; drop --dp "
                       "and --zero (--ep keeps only candidates with the experts split)")
    if args.stages < 1:
      raise UsageError(f"--stages {args.stages} must be positive")
    return None, args.plan_devices or n_devices, args.stages
  directives, n_used, n_stages = _base_strategy(args, n_devices)
  if args.ep:
    n_experts = _n_experts(args)
    if not n_experts:
      raise UsageError("--ep splits the experts of a MoE model; add --experts N or take a "
                       "qwen3-moe preset or checkpoint")
    if n_experts % (args.dp if args.strategy.startswith("pp-") else n_used):
      raise UsageError(f"{n_experts} experts must divide over the data-parallel devices "
                       f"of a stage for --ep")
    directives = directives + [pj.shard({"EP": "*"}, list(range(n_used)))]
  return directives, n_used, n_stages


def _base_strategy(args, n_devices: int):
  if not args.strategy.startswith("pp-"):
    if args.dp != 1 or args.zero != 0:
      raise UsageError(
          f"--dp and --zero apply to pp-* strategies; --strategy "
          f"{args.strategy} is data parallel over all {n_devices} devices")
    zero = 0 if args.strategy == "dp" else int(args.strategy[-1])
    if args.batch % n_devices:
      raise UsageError(
          f"--batch {args.batch} must be divisible by the {n_devices} devices "
          f"of data parallelism")
    return (pj.strategies.data_parallel(n_devices, zero=zero, reduce_dtype=args.reduce_dtype,
                                        bucket_mb=args.bucket_mb or None), n_devices, 1)

  schedule = args.strategy[len("pp-"):]
  # Interleaved and DualPipeV hold two stages per pipeline rank.
  per_rank = 2 if schedule in ("interleaved", "dualpipev") else 1
  if args.stages < 1 or args.dp < 1 or args.stages % per_rank:
    raise UsageError(f"--stages {args.stages} and --dp {args.dp} must be positive, and "
                     f"--strategy {args.strategy} needs an even --stages (two per device)"
                     if per_rank == 2 else
                     f"--stages {args.stages} and --dp {args.dp} must be positive")
  n_used = args.stages // per_rank * args.dp
  if n_used > n_devices:
    raise UsageError(
        f"--stages {args.stages} x --dp {args.dp} needs {n_used} devices but "
        f"only {n_devices} are available; lower --stages or --dp")
  if args.batch % (args.dp * args.microbatches):
    raise UsageError(
        f"--batch {args.batch} must be divisible by --dp {args.dp} x "
        f"--microbatches {args.microbatches}")
  try:
    directives = pj.strategies.pipeline(
        args.stages, args.microbatches, schedule=schedule, dp=args.dp,
        zero=args.zero, reduce_dtype=args.reduce_dtype)
  except ValueError as e:  # e.g. microbatches the schedule cannot use
    raise UsageError(f"--strategy {args.strategy}: {e}") from e
  return directives, n_used, args.stages


def device_memory_bytes(device, cpu_default_gib: float = 16.0) -> float:
  """The memory of one device (`memory_stats()["bytes_limit"]`), or `cpu_default_gib`
  on CPU and wherever the backend does not say."""
  stats = device.memory_stats() if device.platform != "cpu" else None
  limit = (stats or {}).get("bytes_limit")
  return float(limit) if limit else cpu_default_gib * 2 ** 30


def checkpointing_variants(family, config, experts: int) -> dict:
  """The search's activation checkpointing choices where the model offers them: a dense
  Qwen3 with every block under nn.remat."""
  if family is not qwen3 or experts or isinstance(config, qwen3.Qwen3MoEConfig) or config.remat:
    return {}
  return {"per block": family.loss_fn(build_model(family, dataclasses.replace(config, remat=True),
                                                  experts))}


def search_strategy(args, loss_fn, optimizer, params, batch, devices, checkpointing=None):
  """`--strategy auto`: searches, prints the table; returns the compiled step of the
  fastest candidate that fits the devices' memory (`checkpointing`: the model's
  activation checkpointing variants, tried as well)."""
  memory = (args.memory_gib * 2 ** 30 if args.memory_gib is not None
            else device_memory_bytes(devices[0]))
  costs = None
  if args.calibrate:  # measured region times on this device instead of FLOP counts
    # The candidates' microbatches hold batch / (replicas x microbatches) rows: from a
    # device's share of the batch down to an eighth of it. Both ends are timed.
    share = max(1, args.batch // len(devices))
    rows = sorted({share, max(1, share // 8)})
    times = pj.calibrate(loss_fn, params, batch, rows, device=devices[0],
                         remat=bool(args.remat), cache=args.calibrate, optimizer=optimizer)
    costs = pj.strategies.CostModel(region_times=times)
  try:
    result = pj.strategies.search(loss_fn, optimizer, params, batch, len(devices), memory,
                                  remat=args.remat, reduce_dtype=args.reduce_dtype,
                                  bucket_mb=args.bucket_mb or None, costs=costs,
                                  expert_parallel=True if args.ep else None,
                                  checkpointing=checkpointing)
  except ValueError as e:
    raise UsageError(f"--strategy auto: {e}") from e
  print(f"strategy search over {len(devices)} device(s), {memory / 2 ** 30:.3g} GiB each: "
        f"{len(result.candidates)} fit, {len(result.rejected)} rejected")
  print(result.table())
  if args.timelines:
    print("timelines of the fastest:", ", ".join(result.timelines(args.timelines)))
  try:  # the first of the fastest whose compiled program fits, by XLA's count
    best, step = result.compile_best(loss_fn, optimizer, params, batch, devices,
                                     remat=args.remat)
  except ValueError as e:
    raise UsageError(f"--strategy auto: {e}") from e
  print(f"chosen: {best.name}, {best.n_microbatches} microbatch(es); compiled, it needs "
        f"{step.memory().total / 2 ** 30:.3g} GiB per device")
  return step


def plan_for(args, n_stages: int, dtype, n_devices: int) -> dict:
  """--plan-for CARD: the search's table for `n_devices` of that card, made on shapes on
  this machine (nothing is initialised, compiled or run); the model as it runs there:
  the preset's vocabulary, and cuDNN's fused attention where the card would run it
  (traced here with the same memory)."""
  if args.init_from:
    raise UsageError("--plan-for plans a --model preset on shapes; drop --init-from (name "
                     "the checkpoint's preset with --model)")
  family, config = preset_config(args, n_stages, dtype, None)
  if getattr(config, "attention", "given") is None:
    config = dataclasses.replace(config, attention=gpt.attention_implementation(config, "gpu"))
  model = build_model(family, config, args.experts)
  params = jax.eval_shape(lambda: family.init_params(model, jax.random.PRNGKey(args.seed)))
  tokens = jax.ShapeDtypeStruct((args.batch, config.seq_len), jnp.int32)
  batch = {"tokens": tokens, "targets": tokens}
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr))
  card = accelerator(args.plan_for)
  try:  # the card's memory unless --memory-gib says otherwise
    result = pj.strategies.search(family.loss_fn(model), optimizer, params, batch, n_devices,
                                  None if args.memory_gib is None else args.memory_gib * 2 ** 30,
                                  target=card, remat=args.remat,
                                  reduce_dtype=args.reduce_dtype,
                                  bucket_mb=args.bucket_mb or None,
                                  expert_parallel=True if args.ep else None,
                                  checkpointing=checkpointing_variants(family, config,
                                                                       args.experts))
  except ValueError as e:
    raise UsageError(f"--plan-for {args.plan_for}: {e}") from e
  print(f"strategy search for {n_devices} x {card.name} "
        f"({result.memory_per_device / 2 ** 30:.3g} GiB each), "
        f"planned on this machine: {len(result.candidates)} fit, {len(result.rejected)} "
        f"rejected")
  print(result.table())
  return {"search": result}


class TrainingDiverged(RuntimeError):
  """The loss stopped being finite; the last good checkpoint is kept."""


class CheckFailed(RuntimeError):
  """`--check` found the strategy's numbers differ from the plain computation's."""


TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")  # the files of a --data folder that are read
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")  # common end-of-text names


def read_texts(spec: str, max_bytes: int = 8 << 20) -> list[bytes]:
  """The contents of a text file, of every .py/.txt/.md/.rst file under a folder (in
  sorted order), or of the stdlib; `max_bytes` in all, the last one cut."""
  if spec == "stdlib":
    spec = os.path.dirname(os.__file__)
  if os.path.isfile(spec):
    paths = [spec]
  elif os.path.isdir(spec):
    paths = []
    for root, dirs, files in os.walk(spec):
      dirs.sort()
      paths += [os.path.join(root, n) for n in sorted(files) if n.endswith(TEXT_SUFFIXES)]
  else:
    raise UsageError(f"--data {spec!r} is neither a file nor a folder")
  texts, total = [], 0
  for path in paths:
    if total >= max_bytes:
      break
    with open(path, "rb") as f:
      texts.append(f.read(max_bytes - total))
    total += len(texts[-1])
  if total < 4096:
    raise UsageError(f"--data {spec!r} holds only {total} bytes; give more text")
  return texts


def load_corpus(spec: str, max_bytes: int = 8 << 20) -> np.ndarray:
  """Bytes of a text file, of every .py/.txt/.md/.rst file under a folder, or of the stdlib."""
  return np.frombuffer(b"".join(read_texts(spec, max_bytes)), np.uint8)


def text_batch(corpus: np.ndarray, seq_len: int, batch: int, seed: int, step: int) -> dict:
  """Random windows of the corpus, the same for the same (seed, step) on every run."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(corpus) - seq_len - 1, size=batch)
  windows = np.stack([corpus[s:s + seq_len + 1] for s in starts]).astype(np.int32)
  return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


def load_tokenizer(path: str):
  """A Hugging Face `tokenizers.Tokenizer` from its tokenizer.json."""
  try:
    import tokenizers
  except ImportError as e:
    raise UsageError("--tokenizer needs the tokenizers package: pip install -e '.[hf]'") from e
  if not os.path.isfile(path):
    raise UsageError(f"--tokenizer {path!r} is not a file; give a tokenizer.json")
  return tokenizers.Tokenizer.from_file(path)


def eos_id(tokenizer, path: str, token: str | None = None) -> int:
  """The id of `token`, else of eos_token in the tokenizer_config.json beside `path`, else
  of the first of `EOS_TOKENS` the tokenizer knows."""
  if token is None:
    beside = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if os.path.isfile(beside):
      with open(beside) as f:
        named = json.load(f).get("eos_token")
      token = named.get("content") if isinstance(named, dict) else named
  candidates = [token] if token is not None else list(EOS_TOKENS)
  for name in candidates:
    if tokenizer.token_to_id(name) is not None:
      return tokenizer.token_to_id(name)
  raise UsageError(f"--tokenizer {path!r} has no token {' or '.join(candidates)}; name its "
                   f"end-of-text token with --eos TOKEN")


def tokenize_documents(texts: list[bytes], tokenizer, eos: int) -> np.ndarray:
  """The documents' tokens, one stream with `eos` between documents."""
  encoded = tokenizer.encode_batch([t.decode("utf-8", errors="replace") for t in texts])
  parts = []
  for k, doc in enumerate(encoded):
    parts += ([np.asarray([eos], np.int32)] if k else []) + [np.asarray(doc.ids, np.int32)]
  return np.concatenate(parts)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
  """Consecutive sequences [n, seq_len + 1] of the stream (the tail that fills none is
  dropped): tokens and, shifted by one, targets."""
  n = len(tokens) // (seq_len + 1)
  return tokens[:n * (seq_len + 1)].reshape(n, seq_len + 1)


def packed_batch(sequences: np.ndarray, batch: int, seed: int, step: int) -> dict:
  """Rows `step * batch ...` of the sequences in an order reshuffled every epoch: every
  sequence once per epoch, and the same batch for the same (seed, step) on every run."""
  n = len(sequences)
  rows = np.arange(step * batch, (step + 1) * batch)
  order = {e: np.random.default_rng([seed, e]).permutation(n) for e in np.unique(rows // n)}
  picked = sequences[[order[r // n][r % n] for r in rows]]
  return {"tokens": picked[:, :-1], "targets": picked[:, 1:]}


def data_tokenizer(args):
  """--tokenizer's tokenizer, or None when --data is read as bytes or is synthetic."""
  if args.tokenizer is None:
    if args.eos is not None:
      raise UsageError("--eos names a token of --tokenizer; add --tokenizer or drop --eos")
    if args.init_from and args.data != "synthetic":
      raise UsageError(f"--init-from {args.init_from} trains on the checkpoint's tokens: add "
                       f"--tokenizer with its tokenizer.json (bytes are not its tokens)")
    return None
  if args.data == "synthetic":
    raise UsageError("--data synthetic is random tokens, nothing to tokenize; drop --tokenizer")
  return load_tokenizer(args.tokenizer)


def preset_config(args, n_stages: int, dtype, vocab_size: int | None):
  """(family, config) of the --model preset for `vocab_size` tokens (None: the preset's)."""
  name = _model_name(args)
  overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
  if args.seq_len:
    overrides["seq_len"] = args.seq_len
  family = qwen3 if name in qwen3.PRESETS else gpt
  if family is qwen3 and args.experts:
    raise UsageError("--experts makes a MoE GPT; the qwen3-moe presets are MoE already")
  if args.save_hf and (family is not qwen3):
    raise UsageError(f"--save-hf writes Qwen3 checkpoints, and --model {name} is a GPT; take "
                     f"a qwen3 preset or --init-from")
  try:
    if args.experts:
      return family, moe.MoEConfig(**{**gpt.PRESETS[name], **overrides}, n_stages=n_stages,
                                   dtype=dtype, n_experts=args.experts)
    return family, family.get_config(name, n_stages=n_stages, dtype=dtype, **overrides)
  except ValueError as e:
    raise UsageError(f"--stages {n_stages}: {e}") from e


# The fields of a qwen3 preset a checkpoint must share for --model to name it.
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                       "intermediate", "tie_embeddings", "rope_theta", "norm_eps", "n_experts",
                       "top_k", "moe_intermediate", "norm_topk_prob")


def _check_preset_matches(args, checkpoint: qwen3.Qwen3Config) -> qwen3.Qwen3Config:
  """The --model preset, which must describe the --init-from checkpoint's model."""
  if args.model not in qwen3.PRESETS:
    raise UsageError(f"--model {args.model} is a GPT preset and --init-from loads a Qwen3 "
                     f"checkpoint: drop --model (the checkpoint's config.json sets the model)")
  preset = qwen3.get_config(args.model)
  kind = lambda c: "a Qwen3-MoE" if isinstance(c, qwen3.Qwen3MoEConfig) else "a dense Qwen3"
  if kind(preset) != kind(checkpoint):
    raise UsageError(f"--model {args.model} is {kind(preset)}, but --init-from "
                     f"{args.init_from} is {kind(checkpoint)}; drop --model to train the "
                     f"checkpoint's model")
  for field in ARCHITECTURE_FIELDS:
    ours, theirs = getattr(preset, field, None), getattr(checkpoint, field, None)
    if ours != theirs:
      raise UsageError(f"--model {args.model} has {field}={ours}, but --init-from "
                       f"{args.init_from} has {field}={theirs}; drop --model to train the "
                       f"checkpoint's model")
  return preset


def checkpoint_model(args, n_stages: int, dtype, vocab_size: int | None):
  """(config, params) of --init-from, for `vocab_size` tokens (None: any)."""
  if args.experts:
    raise UsageError("--experts makes a MoE GPT; --init-from's config.json says whether the "
                     "model is MoE: drop --experts")
  where = f"--init-from {args.init_from}"
  try:
    fields = hf.read_config(args.init_from)
    overrides = dict(n_stages=n_stages, dtype=dtype,
                     seq_len=args.seq_len or min(4096, fields.get("max_position_embeddings", 4096)))
    config = hf.config_from_hf(fields, **overrides)
  except (OSError, hf.UnsupportedCheckpoint) as e:
    raise UsageError(f"{where}: {e}") from e
  except ValueError as e:  # the stages do not fit the checkpoint's layers
    raise UsageError(f"--stages {n_stages}: {e}") from e
  if args.model:
    preset = _check_preset_matches(args, config)
    overrides["seq_len"] = args.seq_len or preset.seq_len
    if isinstance(preset, qwen3.Qwen3MoEConfig):
      overrides["capacity_factor"] = preset.capacity_factor
  if vocab_size is not None and vocab_size > config.vocab_size:
    raise UsageError(f"--tokenizer {args.tokenizer} has {vocab_size} tokens, more than the "
                     f"{config.vocab_size} of {where}; give the checkpoint's own tokenizer")
  try:
    return hf.load(args.init_from, **overrides)
  except (OSError, hf.UnsupportedCheckpoint) as e:
    raise UsageError(f"{where}: {e}") from e


def batch_source(args, family, config, tokenizer, rng) -> Callable[[int], dict]:
  """`get_batch(step)`: the batch of a step, the same on every run (so a resumed run under
  any strategy continues on the tokens it would have had)."""
  if args.data == "synthetic":
    data_rng = jax.random.fold_in(rng, 1)
    return lambda i: jax.device_get(family.random_batch(
        config, jax.random.fold_in(data_rng, i), args.batch))
  if tokenizer is None:
    corpus = load_corpus(args.data)
    return lambda i: text_batch(corpus, config.seq_len, args.batch, args.seed, i)
  eos = eos_id(tokenizer, args.tokenizer, args.eos)
  sequences = pack(tokenize_documents(read_texts(args.data), tokenizer, eos), config.seq_len)
  if len(sequences) < args.batch:
    raise UsageError(f"--data {args.data!r} makes {len(sequences)} sequences of "
                     f"{config.seq_len + 1} tokens, fewer than --batch {args.batch}; give "
                     f"more text or lower --seq-len")
  print(f"data: {len(sequences)} sequences of {config.seq_len + 1} tokens")
  return lambda i: packed_batch(sequences, args.batch, args.seed, i)


def save_hf(args, step, state, config) -> None:
  """--save-hf: the trained parameters as a Hugging Face checkpoint, with --init-from's
  config.json fields and --tokenizer's files beside them (process 0 writes)."""
  started = time.perf_counter()
  # Sharded over the step's devices, then copied to the host a shard file at a time.
  params = step.canonical(state)["params"]
  if jax.process_count() > 1:  # each process holds only its shards
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    extra = hf.read_config(args.init_from) if args.init_from else {}
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.save_hf_dtype]
    hf.save(args.save_hf, config, params, dtype=dtype, extra=extra)
    if args.tokenizer:
      _copy_tokenizer(args.tokenizer, args.save_hf)
  print(f"saved a Hugging Face checkpoint to {args.save_hf} in "
        f"{time.perf_counter() - started:.1f} s")


def _copy_tokenizer(path: str, directory: str) -> None:
  """tokenizer.json, and the tokenizer_config.json beside it, into the checkpoint folder."""
  beside = os.path.join(os.path.dirname(path), "tokenizer_config.json")
  for source, name in ((path, "tokenizer.json"), (beside, "tokenizer_config.json")):
    target = os.path.join(directory, name)
    if os.path.isfile(source) and not (os.path.exists(target) and os.path.samefile(source, target)):
      shutil.copyfile(source, target)


def build_model(family, config, experts: int):
  """The example model of `config`."""
  if family is qwen3:
    return qwen3.make_model(config)
  return moe.MoEGPT(config) if experts else gpt.GPT(config)


def join_job() -> None:
  """Joins the other processes when `python -m piper_jax.launch` started this one (its
  `--devices-per-proc` then sets the CPU devices); else asks for simulated CPU devices."""
  if not pj.distributed.launched():
    use_simulated_cpu_devices()
  elif not jax.distributed.is_initialized():  # a second main() in the process has joined
    pj.distributed.initialize()


@contextlib.contextmanager
def printing_on_first_process():
  """Process 0 prints; the others' stdout goes nowhere, so a job's report shows once."""
  if jax.process_index() == 0:
    yield
    return
  with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
    yield


def _global_array(x, sharding) -> jax.Array:
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def feed(step, batch: dict):
  """The batch as `step` takes it: in one process as it is; in several, one global array
  made from the whole batch, which every process draws alike, since the rows a process's
  devices take depend on the strategy."""
  if jax.process_count() == 1:
    return batch
  return jax.tree_util.tree_map(lambda x: _global_array(x, step.batch_sharding), batch)


class Progress:
  """Reports what the steps return each time it is read (the loss, and the loss's parts
  where the model reports them), with tokens/s, MFU and the learning rate: a tqdm bar
  when stdout and stderr are a terminal, else one plain line (a piped run's log keeps
  every one), and a JSONL row per step (--metrics). MFU only on cards whose peak is
  known (`pj.planner.accelerator`): a CPU's figure would mean nothing."""

  def __init__(self, args, first: int, tokens_per_step: int, flops_per_step: float,
               devices: list, schedule: optax.Schedule):
    self.tokens_per_step, self.schedule = tokens_per_step, schedule
    card = accelerator(devices[0].device_kind)
    self.peak = card.peak_flops * len(devices) if card and devices[0].platform != "cpu" else None
    self.flops_per_step = flops_per_step
    first_process = jax.process_index() == 0
    terminal = sys.stdout.isatty() and sys.stderr.isatty()
    self.bar = (tqdm(total=args.steps, initial=first, unit="step", dynamic_ncols=True)
                if terminal and first_process and not args.quiet else None)
    self.metrics = open(args.metrics, "a") if args.metrics and first_process else None

  def report(self, done: int, rows: list[dict], seconds: float) -> None:
    """Steps `done - len(rows) + 1 .. done` took `seconds` each and returned `rows`
    ({"loss": ..., and the aux metrics})."""
    tps = self.tokens_per_step / seconds
    mfu = self.flops_per_step / seconds / self.peak if self.peak else None
    last, lr = rows[-1], float(self.schedule(done - 1))
    parts = {k: v for k, v in last.items() if k != "loss"}
    if self.bar is not None:
      self.bar.update(len(rows))
      shown = {k: f"{v:.4f}" for k, v in parts.items()}
      if mfu is not None:
        shown["mfu"] = f"{mfu:.1%}"
      self.bar.set_postfix(loss=f"{last['loss']:.4f}", **shown, tok_s=f"{tps:,.0f}",
                           lr=f"{lr:.2e}")
    else:
      shown = "".join(f"  {k} {v:.4f}" for k, v in parts.items())
      shown += "" if mfu is None else f"  MFU {mfu:.1%}"
      print(f"step {done:5d}  loss {last['loss']:.4f}{shown}  {tps:,.0f} tok/s  lr {lr:.2e}",
            flush=True)
    if self.metrics:
      for k, row in enumerate(rows):
        i = done - len(rows) + k + 1
        out = {"step": i, **row, "lr": float(self.schedule(i - 1)), "tokens_per_s": tps,
               "seconds": seconds}
        if mfu is not None:
          out["mfu"] = mfu
        self.metrics.write(json.dumps(out) + "\n")
      self.metrics.flush()

  def saved(self, done: int, directory: str, seconds: float) -> None:
    line = f"step {done:5d}  checkpoint saved to {directory} in {seconds:.2f} s"
    if self.bar is not None:
      self.bar.write(line)
    else:
      print(line, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    if self.metrics:
      self.metrics.close()


def learning_rate(args) -> optax.Schedule:
  """The learning rate of each step (from 0): --warmup, then --decay."""
  after = (optax.cosine_decay_schedule(args.lr, max(args.steps - args.warmup, 1), alpha=0.1)
           if args.decay == "cosine" else optax.constant_schedule(args.lr))
  if not args.warmup:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, args.lr, args.warmup), after],
                              [args.warmup])


def _as_row(out) -> dict:
  """What a step returned, read: {"loss": ...}, with the aux metrics of a step compiled
  with `has_aux`."""
  if isinstance(out, tuple):
    loss, aux = out
    return {"loss": float(loss), **{k: float(v) for k, v in aux.items()}}
  return {"loss": float(out)}


def _check_finite(values: list[float], done: int, ckpt_dir: str | None, saved: int) -> None:
  for k, value in enumerate(values):
    if not np.isfinite(value):
      where = f"step {saved} in {ckpt_dir}" if ckpt_dir and saved else "none"
      raise TrainingDiverged(f"loss is {value} at step {done - len(values) + k + 1}; "
                             f"stopped. Last good checkpoint: {where}")


def train_loop(args, step, state, get_batch, first: int, progress: Progress):
  """Steps from `first` to `args.steps`; returns (losses, timed windows as (steps,
  seconds), state). Checkpoint saves are timed apart from the steps."""
  losses, windows, saved = [], [], first
  pending, since = [], time.perf_counter()  # steps called whose losses are not read yet
  for i in range(first, args.steps):
    state, out = step(state, feed(step, get_batch(i)))  # returns before the devices finish
    pending.append(out)
    done = i + 1
    save = args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0)
                              or done == args.steps)
    if not (save or done % args.log_every == 0 or done == args.steps):
      continue
    # Reading the losses waits for the devices: once every --log-every steps.
    rows = [_as_row(x) for x in pending]
    values = [r["loss"] for r in rows]
    now = time.perf_counter()
    _check_finite(values, done, args.ckpt_dir, saved)
    losses += values
    if done - len(values) > first:  # the first window holds the compilation
      windows.append((len(values), now - since))
    progress.report(done, rows, (now - since) / len(values))
    pending = []
    if save:
      pj.checkpoint.save(args.ckpt_dir, state, step=done)
      saved = done
      progress.saved(done, args.ckpt_dir, time.perf_counter() - now)
    since = time.perf_counter()
  return losses, windows, state


def main(argv=None) -> dict:
  """Runs the training job; returns {"losses", "tokens_per_s", "step", "state"}."""
  args = parse_args(argv)
  join_job()
  with printing_on_first_process():
    return run(args)


def run(args) -> dict:
  """The job of `main`, once this process has its devices."""
  devices = jax.devices()
  directives, n_used, n_stages = build_strategy(args, len(devices))
  devices = devices[:n_used]
  if args.log_every < 1:
    raise UsageError(f"--log-every must be >= 1, got {args.log_every}")
  if (args.resume or args.ckpt_every) and not args.ckpt_dir:
    raise UsageError("--resume and --ckpt-every need --ckpt-dir")
  if args.check and jax.process_count() > 1:
    raise UsageError("--check compares the strategy with the plain computation in one "
                     "process; drop --check under the launcher (or run it in one process)")

  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
  tokenizer = data_tokenizer(args)
  vocab_size = (None if args.data == "synthetic" else
                tokenizer.get_vocab_size() if tokenizer else 256)
  rng = jax.random.PRNGKey(args.seed)
  if args.plan_for:
    return plan_for(args, n_stages, dtype, n_used)
  if args.init_from:
    family = qwen3
    config, params = checkpoint_model(args, n_stages, dtype, vocab_size)
  else:
    family, config = preset_config(args, n_stages, dtype, vocab_size)
    params = family.init_params(build_model(family, config, args.experts), rng)
  model = build_model(family, config, args.experts)
  get_batch = batch_source(args, family, config, tokenizer, rng)
  schedule = learning_rate(args)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      args.lr if args.warmup == 0 and args.decay == "constant" else schedule))

  print(f"devices: {len(devices)} x {devices[0].device_kind} "
        f"({devices[0].platform})")
  n_experts = args.experts or getattr(config, "n_experts", 0)
  kind = f" MoE ({n_experts} experts, top-{getattr(config, 'top_k', 2)})" if n_experts else ""
  print(f"model: {_model_name(args) or args.init_from}{kind}, "
        f"{gpt.count_params(params) / 1e6:.2f}M params, "
        f"{config.n_layers} layers in {config.n_stages} stage(s), {args.dtype}")
  print(f"strategy: {args.strategy}; data: {args.data}")

  # A MoE Qwen3 reports its cross-entropy and load-balancing loss beside their sum
  # (has_aux); the planner (--strategy auto) costs the plain loss.
  metrics = (family is qwen3 and bool(getattr(config, "router_aux_coef", 0))
             and directives is not None)
  loss_of = lambda m: family.loss_fn(m, metrics=True) if metrics else family.loss_fn(m)
  loss_fn = loss_of(model)
  if directives is None:
    step = search_strategy(args, loss_fn, optimizer, params, get_batch(0), devices,
                           checkpointing_variants(family, config, args.experts))
  else:
    step = pj.compile(loss_fn, optimizer, directives, params, get_batch(0),
                      devices=devices, remat=args.remat, has_aux=metrics)
  print(step.describe())  # the plan, options, and the collectives the step runs
  started = time.perf_counter()
  step.compile()  # XLA compiles here, so that the first step's time is a step's
  print(f"compiled in {time.perf_counter() - started:.1f} s")
  if args.check:
    # In bf16 the strategy is judged against the same model in float32 beside plain JAX's
    # own bf16 error; fused attention exists only in narrow types, XLA's computes float32.
    wide = dataclasses.replace(config, dtype=jnp.float32, attention=(
        "xla" if config.attention in (None, "cudnn") else config.attention))
    fp32_loss = loss_of(build_model(family, wide, args.experts))
    started = time.perf_counter()
    report = step.check(params, get_batch(0), steps=2, fp32_loss_fn=fp32_loss)
    print(report)
    print(f"check took {time.perf_counter() - started:.1f} s")
    if not report.passed:
      raise CheckFailed(f"--check: the strategy differs from the plain computation "
                        f"({len(report.failures)} failed comparison(s), listed above)")
  first = 0
  if args.resume and pj.checkpoint.latest_step(args.ckpt_dir) is not None:
    state = pj.checkpoint.restore(args.ckpt_dir, step)
    first = pj.checkpoint.latest_step(args.ckpt_dir)
    print(f"resumed from step {first} in {args.ckpt_dir}")
  else:
    state = step.init(params)

  tokens_per_step = args.batch * config.seq_len
  flops_per_step = tokens_per_step * (
      moe.flops_per_token if args.experts else family.flops_per_token)(config)
  progress = Progress(args, first, tokens_per_step, flops_per_step, step.devices, schedule)
  try:
    losses, windows, state = train_loop(args, step, state, get_batch, first, progress)
  finally:
    progress.close()

  steps_timed = sum(n for n, _ in windows)
  tokens_per_s = tokens_per_step * steps_timed / sum(t for _, t in windows) if windows else None
  if tokens_per_s is not None:
    print(f"mean throughput (after the first {args.log_every} steps): {tokens_per_s:,.0f} tok/s")
  local = [d for d in step.devices if d.process_index == jax.process_index()]
  peak = max(((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in local), default=0)
  if peak:  # the allocator's count: what the run needed, --check included
    print(f"peak device memory: {peak / 2**30:.1f} GiB")
  if args.save_hf:
    save_hf(args, step, state, config)
  return {"losses": losses, "tokens_per_s": tokens_per_s, "step": step,
          "state": state}


if __name__ == "__main__":
  try:
    main()
  except (UsageError, TrainingDiverged, CheckFailed) as e:
    sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")
