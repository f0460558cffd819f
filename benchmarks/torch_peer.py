"""PyTorch peer of benchmarks/run.py: the same GPT and Qwen3 shapes under DDP, FSDP2 and
torch pipelining.

  python benchmarks/torch_peer.py                  # both GPT configs, every variant, on all GPUs
  python benchmarks/torch_peer.py --model 268m --variants ddp,pp-1f1b
  python benchmarks/torch_peer.py --model qwen3-8b --seq-len 4096 --batch 8 --pp 4 \
      --microbatches 8 --variants fsdp2,pp-gpipe,pp-1f1b,pp-zb,pp-interleaved,pp-zbv,pp-dualpipev
  python benchmarks/torch_peer.py --small          # tiny GPT, 2 CPU processes per variant (gloo)
  python benchmarks/torch_peer.py --small --model qwen3-tiny --dp 2   # pipelines on 2 x 2 CPU ranks

Models: the GPT presets `tiny`, `268m`, `1.3b` (examples/gpt.py's shapes) and the dense
Qwen3 presets `qwen3-tiny`, `qwen3-1.7b`, `qwen3-8b`, whose shapes, rotary theta, tied
embeddings and `flops_per_token` are read from examples/qwen3.py (which imports jax, so
the Qwen3 models need jax and flax installed beside torch; `qwen3-tiny` gets 8 layers, as
in run.py). The Qwen3 decoder: RMSNorm, rotary embeddings (rotate-half), grouped-query
attention with QK RMSNorm, SwiGLU, tied embeddings where the preset ties them, and
`scaled_dot_product_attention(is_causal=True, enable_gqa=...)` (cuDNN or flash on GPU;
torch >= 2.5). `--seq-len` overrides the preset's sequence length.

Each variant runs in its own set of processes (`torch.multiprocessing.spawn`, NCCL; gloo
on CPU), one variant after another. `ddp` and `fsdp2` use every GPU and split the global
batch over them; `fsdp2` is `fully_shard` on each block, then on the root, over all ranks.
The pipelines (`torch.distributed.pipelining`) run on `--pp` ranks (default 2): `pp-gpipe`,
`pp-1f1b` and `pp-zb` (ScheduleInterleavedZeroBubble, zero bubble with one stage per rank)
hold one stage per rank; `pp-interleaved` two per rank looped, `pp-dualpipev` and `pp-zbv`
(ScheduleZBVZeroBubble) two per rank in V placement. Blocks are split over the stages as
evenly as possible, the first stages taking the remainder (the last one holds the head).
With more GPUs than `--pp`, the pipelines run times data parallel over the others (`--dp`,
default: GPUs // pp; 1 on CPU): a 2-D (pp, dp) DeviceMesh with each stage `fully_shard`ed
over its dp group, without resharding between microbatches. A tied preset's pipeline
unties the head from the embedding when they sit on different stages (the last stage
holds its own copy). On GPU the model is pure bf16 (parameters, gradients and AdamW
states, eager, no autocast), so `fsdp2` needs no MixedPrecisionPolicy: it gathers and
reduces bf16, as DDP all-reduces bf16; on CPU everything is float32.

Reports the same row format as run.py, with peak memory (`torch.cuda.max_memory_allocated`
after the model is built, the largest over ranks) and MFU from the model's
`flops_per_token`; ratios are taken against the `fsdp2` row for Qwen3 models (DDP keeps
a whole 8B model and its AdamW states on each GPU) and against `ddp` for the GPT models.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from piper_jax.planner.hardware import accelerator  # noqa: E402

PRESETS = {
    "tiny": dict(vocab=256, seq=32, d=64, layers=4, heads=4),
    "268m": dict(vocab=32768, seq=1024, d=1024, layers=16, heads=16),
    "1.3b": dict(vocab=32768, seq=1024, d=2048, layers=24, heads=16),
}
# Dense Qwen3 presets of examples/qwen3.py that this peer builds.
QWEN3_MODELS = ("qwen3-tiny", "qwen3-1.7b", "qwen3-8b")

VARIANTS = ("ddp", "fsdp2", "pp-gpipe", "pp-1f1b", "pp-zb", "pp-interleaved", "pp-zbv",
            "pp-dualpipev")
# Pipeline variants: (schedule class name, stages per rank, V placement).
PIPELINES = {"pp-gpipe": ("ScheduleGPipe", 1, False), "pp-1f1b": ("Schedule1F1B", 1, False),
             "pp-zb": ("ScheduleInterleavedZeroBubble", 1, False),
             "pp-interleaved": ("ScheduleInterleaved1F1B", 2, False),
             "pp-zbv": ("ScheduleZBVZeroBubble", 2, True),
             "pp-dualpipev": ("ScheduleDualPipeV", 2, True)}


def flops_per_token(cfg) -> float:
  """6 * N + 12 * L * d * T, as examples/gpt.py `flops_per_token`."""
  d, L = cfg["d"], cfg["layers"]
  n_matmul = L * 12 * d * d + d * cfg["vocab"]
  return 6.0 * n_matmul + 12.0 * L * d * cfg["seq"]


def _qwen3_module():
  """examples/qwen3.py, imported only for Qwen3 models since it imports jax."""
  # Only its presets and FLOP count are read: jax must never claim the GPUs torch uses.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  try:
    from examples import qwen3
  except ImportError as e:
    raise SystemExit(f"the Qwen3 presets are read from examples/qwen3.py, which needs jax and "
                     f"flax installed beside torch: {e}") from e
  return qwen3


def model_config(model: str, seq_len: int = 0) -> dict:
  """The plain-dict config the workers build from: shapes, "family" and "flops" per token."""
  if model in PRESETS:
    cfg = dict(PRESETS[model], family="gpt")
    if seq_len:
      cfg["seq"] = seq_len
    return dict(cfg, flops=flops_per_token(cfg))
  if model not in QWEN3_MODELS:
    raise ValueError(f"unknown model {model!r}; choose from {', '.join((*PRESETS, *QWEN3_MODELS))}")
  qwen3 = _qwen3_module()
  # 8 layers, as run.py's tiny presets, so that 4 ranks x 2 stages still split evenly.
  over = dict(n_layers=8) if model == "qwen3-tiny" else {}
  c = qwen3.get_config(model, **over, **(dict(seq_len=seq_len) if seq_len else {}))
  return dict(family="qwen3", vocab=c.vocab_size, seq=c.seq_len, d=c.d_model, layers=c.n_layers,
              heads=c.n_heads, kv_heads=c.n_kv_heads, head_dim=c.head_dim, inter=c.intermediate,
              theta=c.rope_theta, eps=c.norm_eps, tie=c.tie_embeddings,
              flops=qwen3.flops_per_token(c))


def _build_stage(cfg, first: bool, last: bool, blocks: range):
  """A piece of the model: [embeddings] + blocks + [final norm and head]; all of it if first
  and last."""
  build = _build_qwen3_stage if cfg["family"] == "qwen3" else _build_gpt_stage
  return build(cfg, first, last, blocks)


def _run_blocks(blocks, cfg, x, *extra):
  """The blocks in turn; with cfg["ac"], each checkpointed (its backward recomputes it
  from its input), as run.py's `+ac` does for the JAX models."""
  from torch.utils.checkpoint import checkpoint
  for blk in blocks:
    x = checkpoint(blk, x, *extra, use_reentrant=False) if cfg.get("ac") else blk(x, *extra)
  return x


def _build_gpt_stage(cfg, first: bool, last: bool, blocks: range):
  """A GPT piece: [embeddings] + blocks + [final norm and head]; the whole GPT if first and last."""
  import torch
  import torch.nn.functional as F
  from torch import nn

  d, h = cfg["d"], cfg["heads"]
  resid_std = 0.02 / math.sqrt(2 * cfg["layers"])

  def linear(i, o, std, bias=True):
    m = nn.Linear(i, o, bias=bias)
    nn.init.normal_(m.weight, std=std)
    if bias:
      nn.init.zeros_(m.bias)
    return m

  class Block(nn.Module):

    def __init__(self):
      super().__init__()
      self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
      self.qkv, self.out = linear(d, 3 * d, 0.02), linear(d, d, resid_std)
      self.fc, self.proj = linear(d, 4 * d, 0.02), linear(4 * d, d, resid_std)

    def forward(self, x):
      b, t, _ = x.shape
      q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
      return x + self.proj(F.gelu(self.fc(self.ln2(x))))

  class Stage(nn.Module):

    def __init__(self):
      super().__init__()
      if first:
        self.embed, self.pos_embed = nn.Embedding(cfg["vocab"], d), nn.Embedding(cfg["seq"], d)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed.weight, std=0.01)
      self.blocks = nn.ModuleList(Block() for _ in blocks)
      if last:
        self.ln_f, self.head = nn.LayerNorm(d), linear(d, cfg["vocab"], 0.02, bias=False)

    def forward(self, x):
      if first:
        x = self.embed(x) + self.pos_embed(torch.arange(x.shape[1], device=x.device))[None]
      x = _run_blocks(self.blocks, cfg, x)
      if last:
        x = self.head(self.ln_f(x))
      return x

  return Stage()


def _build_qwen3_stage(cfg, first: bool, last: bool, blocks: range):
  """A Qwen3 piece, as examples/qwen3.py's `Qwen3` (parameter init: normal(0.02), norms 1)."""
  import torch
  import torch.nn.functional as F
  from torch import nn

  d, h, kv, hd, eps = cfg["d"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["eps"]

  def linear(i, o):
    m = nn.Linear(i, o, bias=False)
    nn.init.normal_(m.weight, std=0.02)
    return m

  class RMSNorm(nn.Module):

    def __init__(self, n):
      super().__init__()
      self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
      # Its statistics are float32 for bf16 inputs, as the JAX model's.
      return F.rms_norm(x, (x.shape[-1],), self.weight, eps)

  def rope(x, cos, sin):
    """Rotates x [batch, seq, heads, head_dim] by position in float32 (rotate-half)."""
    xf = x.float()
    rotated = torch.cat([-xf[..., hd // 2:], xf[..., :hd // 2]], dim=-1)
    return (xf * cos[None, :, None] + rotated * sin[None, :, None]).to(x.dtype)

  class Attention(nn.Module):

    def __init__(self):
      super().__init__()
      self.q, self.k, self.v = linear(d, h * hd), linear(d, kv * hd), linear(d, kv * hd)
      self.o = linear(h * hd, d)
      self.q_norm, self.k_norm = RMSNorm(hd), RMSNorm(hd)

    def forward(self, x, cos, sin):
      b, t, _ = x.shape
      q = rope(self.q_norm(self.q(x).view(b, t, h, hd)), cos, sin).transpose(1, 2)
      k = rope(self.k_norm(self.k(x).view(b, t, kv, hd)), cos, sin).transpose(1, 2)
      v = self.v(x).view(b, t, kv, hd).transpose(1, 2)
      # Query head i reads key/value head i // (h // kv), as the JAX model's groups.
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
      return self.o(y.transpose(1, 2).reshape(b, t, h * hd))

  class Block(nn.Module):

    def __init__(self):
      super().__init__()
      self.input_norm, self.post_attn_norm = RMSNorm(d), RMSNorm(d)
      self.attn = Attention()
      self.gate, self.up, self.down = linear(d, cfg["inter"]), linear(d, cfg["inter"]), linear(
          cfg["inter"], d)

    def forward(self, x, cos, sin):
      x = x + self.attn(self.input_norm(x), cos, sin)
      y = self.post_attn_norm(x)
      return x + self.down(F.silu(self.gate(y)) * self.up(y))

  class Stage(nn.Module):

    def __init__(self):
      super().__init__()
      if first:
        self.embed = nn.Embedding(cfg["vocab"], d)
        nn.init.normal_(self.embed.weight, std=0.02)
      self.blocks = nn.ModuleList(Block() for _ in blocks)
      if last:
        self.final_norm = RMSNorm(d)
        # A last stage without the embedding cannot tie to it: it holds its own head.
        self.head = None if cfg["tie"] and first else linear(d, cfg["vocab"])

    def forward(self, x):
      if first:
        x = self.embed(x)
      t = x.shape[1]
      # Tables of this call's length, built here so that `.to(bf16)` never rounds them.
      inv = 1.0 / cfg["theta"] ** (
          torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
      angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * inv[None]
      angles = torch.cat([angles, angles], dim=-1)
      cos, sin = angles.cos(), angles.sin()
      x = _run_blocks(self.blocks, cfg, x, cos, sin)
      if last:
        x = F.linear(self.final_norm(x), (self.embed if self.head is None else self.head).weight)
      return x

  return Stage()


def _loss(logits, targets):
  import torch.nn.functional as F
  return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _batches(cfg, batch: int, device, n: int = 4):
  """`n` synthetic batches walking one fixed random cycle of the vocabulary (learnable bigrams)."""
  import torch
  g = torch.Generator().manual_seed(0)
  cycle = torch.randperm(cfg["vocab"], generator=g)
  out = []
  for _ in range(n):
    start = torch.randint(0, cfg["vocab"], (batch, 1), generator=g)
    walk = cycle[(start + torch.arange(cfg["seq"] + 1)) % cfg["vocab"]]
    out.append((walk[:, :-1].to(device), walk[:, 1:].to(device)))
  return out


def stage_layers(n_layers: int, n_stages: int) -> list[int]:
  """Blocks per pipeline stage: as even as possible, the first stages taking the remainder
  (the last stage also holds the head)."""
  if n_layers < n_stages:
    raise ValueError(f"{n_layers} layers do not fill {n_stages} stages")
  base, extra = divmod(n_layers, n_stages)
  return [base + (s < extra) for s in range(n_stages)]


def _worker(rank: int, world: int, variant: str, model: str, cfg: dict, batch: int,
            microbatches: int, pp: int, steps: int, warmup: int, use_cuda: bool, out_path: str):
  """One rank of one variant; rank 0 writes the row as JSON to `out_path`."""
  import torch
  import torch.distributed as dist
  from torch.distributed.device_mesh import init_device_mesh

  if use_cuda:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
  else:
    # Several processes on a small CPU: one thread each, not one per core each.
    torch.set_num_threads(1)
    device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
  dtype = torch.bfloat16 if use_cuda else torch.float32

  def make(first, last, blocks, seed):
    torch.manual_seed(seed)
    # Built in `dtype` directly: no float32 copy of an 8B model passes through the GPU.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
      with device:
        return _build_stage(cfg, first, last, blocks)
    finally:
      torch.set_default_dtype(default)

  L = cfg["layers"]
  row_extra = {}
  if variant in ("ddp", "fsdp2"):
    net = make(True, True, range(L), 0)
    if variant == "ddp":
      from torch.nn.parallel import DistributedDataParallel as DDP
      net = DDP(net, device_ids=[rank] if use_cuda else None)
    else:
      from torch.distributed.fsdp import fully_shard
      mesh = init_device_mesh(device.type, (world,))
      # Parameters are bf16 already (pure bf16 training), so no MixedPrecisionPolicy.
      for blk in net.blocks:
        fully_shard(blk, mesh=mesh)
      fully_shard(net, mesh=mesh)
    modules = [net]
    data = [(x[rank::world], y[rank::world]) for x, y in _batches(cfg, batch, device)]

    def step(x, y):
      loss = _loss(net(x), y)
      loss.backward()
      return loss.detach()
  else:
    from torch.distributed import pipelining
    sched_name, per_rank, v_shape = PIPELINES[variant]
    dp = world // pp
    if dp > 1:
      # pp outermost: rank = pp_rank * dp + dp_rank.
      mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
      pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
      pp_group = mesh["pp"].get_group()
    else:
      pp_rank, dp_rank, pp_group = rank, 0, None
    n_stages = pp * per_rank
    if v_shape:
      ids = [pp_rank, 2 * pp - 1 - pp_rank]
    else:
      ids = [pp_rank + i * pp for i in range(per_rank)]  # looped placement
    layers = stage_layers(L, n_stages)
    starts = [sum(layers[:s]) for s in range(n_stages)]
    stages, modules = [], []
    for s in ids:
      mod = make(s == 0, s == n_stages - 1, range(starts[s], starts[s] + layers[s]), s)
      if dp > 1:
        from torch.distributed.fsdp import fully_shard
        # Gathered weights stay until the step's backward ends: no all-gather per microbatch.
        for blk in mod.blocks:
          fully_shard(blk, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=False)
      modules.append(mod)
      stages.append(pipelining.PipelineStage(mod, s, n_stages, device, group=pp_group))
    cls = getattr(pipelining, sched_name)
    # Single-stage schedules take the stage; the multi-stage ones (ZB too) take a list.
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, n_microbatches=microbatches, loss_fn=_loss)
    # The last stage would otherwise concatenate every microbatch's logits.
    extra = {"return_outputs": False} if "return_outputs" in inspect.signature(sched.step).parameters else {}
    has_first, has_last = 0 in ids, n_stages - 1 in ids
    data = [(x[dp_rank::dp], y[dp_rank::dp]) for x, y in _batches(cfg, batch, device)]
    row_extra = {"pp": pp, "dp": dp, "stage_layers": layers}

    def step(x, y):
      losses = [] if has_last else None
      sched.step(*([x] if has_first else []), target=y if has_last else None, losses=losses,
                 **extra)
      return torch.stack(losses).mean().detach() if has_last else None

  params = [p for m in modules for p in m.parameters()]
  opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True if use_cuda else None)

  def train(i):
    opt.zero_grad(set_to_none=True)
    loss = step(*data[i % len(data)])
    opt.step()
    if use_cuda:
      torch.cuda.synchronize()
    return loss

  if use_cuda:
    # Peak of training alone, not of building the model.
    torch.cuda.reset_peak_memory_stats()
  t0 = time.perf_counter()
  loss = train(0)
  first = time.perf_counter() - t0
  for i in range(warmup):
    loss = train(i + 1)
  times = []
  for i in range(steps):
    t0 = time.perf_counter()
    loss = train(i)
    times.append(time.perf_counter() - t0)
  times.sort()
  med = (times[(steps - 1) // 2] + times[steps // 2]) / 2
  peak = torch.cuda.max_memory_allocated() if use_cuda else 0
  mine = {"step": med, "first": first, "peak": peak,
          "loss": None if loss is None else float(loss)}
  every = [None] * world
  dist.all_gather_object(every, mine)
  dist.destroy_process_group()
  if rank:
    return
  # Ranks run in lock step; take the slowest one's numbers.
  step_s = max(r["step"] for r in every)
  first = max(r["first"] for r in every)
  losses = [r["loss"] for r in every if r["loss"] is not None]
  peak = max(r["peak"] for r in every)
  kind = torch.cuda.get_device_name(rank) if use_cuda else "cpu"
  card = accelerator(kind) if use_cuda else None
  peak_flops = card.peak_flops if card else None
  tps = batch * cfg["seq"] / step_s
  mfu = cfg["flops"] * tps / (world * peak_flops) if peak_flops else None
  row = {"variant": variant, "model": model, "devices": world, "device_kind": kind,
         "step_ms": step_s * 1e3, "tokens_per_s": tps, "mfu": mfu,
         "peak_gib": peak / 2**30 if peak else None, "compile_s": max(first - step_s, 0.0),
         "loss": sum(losses) / len(losses), "seq_len": cfg["seq"], **row_extra}
  with open(out_path, "w") as f:
    json.dump(row, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_variant(args, variant: str, model: str, use_cuda: bool, n_gpus: int):
  """Spawns the processes of one variant; returns its row, or one with an "error"."""
  import torch
  import torch.multiprocessing as mp

  t0 = time.time()

  def error(msg):
    return {"variant": variant, "model": model, "error": msg[:300], "wall_s": time.time() - t0}

  if variant not in VARIANTS:
    return error(f"unknown variant (choose from {', '.join(VARIANTS)})")
  try:
    cfg = dict(model_config(model, args.seq_len), ac=args.ac)
  except ValueError as e:
    return error(str(e))
  if variant in PIPELINES:
    from torch.distributed import pipelining
    sched_name, per_rank, _ = PIPELINES[variant]
    if not hasattr(pipelining, sched_name):
      return error(f"{variant} needs torch.distributed.pipelining.{sched_name}, which torch "
                   f"{torch.__version__} does not have")
    dp = args.dp or (max(n_gpus // args.pp, 1) if use_cuda else 1)
    world = args.pp * dp
    if cfg["layers"] < args.pp * per_rank:
      return error(f"{cfg['layers']} layers do not fill {args.pp * per_rank} stages")
    split = dp * args.microbatches
  else:
    world = n_gpus if use_cuda else 2
    split = world
  if use_cuda and world > n_gpus:
    return error(f"needs {world} GPUs, found {n_gpus}")
  if args.batch % split:
    return error(f"batch {args.batch} does not split into {split} equal parts")
  os.environ["MASTER_ADDR"] = "127.0.0.1"
  os.environ["MASTER_PORT"] = str(_free_port())
  fd, out_path = tempfile.mkstemp(suffix=".json")
  os.close(fd)
  try:
    ctx = mp.spawn(_worker, nprocs=world, join=False,
                   args=(world, variant, model, cfg, args.batch, args.microbatches, args.pp,
                         args.steps, args.warmup, use_cuda, out_path))
    deadline = time.time() + args.timeout
    # join() raises if a rank fails, after ending the other ranks.
    while not ctx.join(timeout=5):
      if time.time() > deadline:
        for p in ctx.processes:
          p.kill()
          p.join()
        return error(f"timed out after {args.timeout}s")
    with open(out_path) as f:
      return json.load(f)
  except Exception as e:  # one failed variant must not end the run
    msg = str(e)
    if "out of memory" in msg.lower() or "OutOfMemoryError" in msg:
      return error("out of memory")
    lines = [l.strip() for l in msg.strip().splitlines() if l.strip()]
    return error(lines[-1] if lines else type(e).__name__)
  finally:
    os.remove(out_path)


def baseline_of(variant: str, model: str) -> str:
  """The row a ratio is against: FSDP2 for Qwen3 (an 8B model does not fit DDP), else DDP."""
  return "fsdp2" if model.startswith("qwen3") else "ddp"


def table(rows) -> str:
  """The table of benchmarks/run.py, with every ratio against `baseline_of`'s row."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from run import table as run_table
  return run_table(rows, baseline_of=baseline_of)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="268m,1.3b",
                  help="comma list of: " + ", ".join((*PRESETS, *QWEN3_MODELS)))
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
  ap.add_argument("--microbatches", type=int, default=8, help="per pipeline (per dp replica)")
  ap.add_argument("--pp", type=int, default=2, help="pipeline ranks of the pp-* variants")
  ap.add_argument("--dp", type=int, default=0,
                  help="data-parallel replicas of the pipelines (default: GPUs // pp; 1 on CPU)")
  ap.add_argument("--seq-len", type=int, default=0, help="override the model's sequence length")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--timeout", type=int, default=900, help="seconds per variant")
  ap.add_argument("--small", action="store_true",
                  help="tiny models (tiny, qwen3-tiny) on CPU processes (gloo)")
  ap.add_argument("--ac", action="store_true",
                  help="checkpoint every block (activation checkpointing), as run.py's +ac")
  ap.add_argument("--out", default=None, help="JSON output path")
  args = ap.parse_args(argv)
  if args.small:
    models = ["qwen3-tiny" if m.startswith("qwen3") else "tiny" for m in args.model.split(",")]
    args.model = ",".join(dict.fromkeys(models))
    args.steps, args.warmup, args.microbatches = 2, 1, max(4, 2 * args.pp)
    args.batch = 2 * args.microbatches * max(args.dp, 1)
  try:
    import torch
  except ImportError:
    print("torch_peer.py needs PyTorch, an optional dependency of piper-jax: pip install torch",
          file=sys.stderr)
    sys.exit(2)
  # NVLink multicast (NVLS) stays off on these machines.
  os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
  use_cuda = torch.cuda.is_available() and not args.small
  n_gpus = torch.cuda.device_count() if use_cuda else 0
  rows = []
  for model in args.model.split(","):
    for variant in args.variants.split(","):
      row = run_variant(args, variant, model, use_cuda, n_gpus)
      rows.append(row)
      print(json.dumps(row), flush=True)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from run import write_results
  write_results(args, rows, "results_torch", torch=torch.__version__,
                dtype="bfloat16" if use_cuda else "float32", pp=args.pp, dp=args.dp,
                seq_len=args.seq_len, ac=args.ac)
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
