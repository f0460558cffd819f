"""PyTorch peer of benchmarks/run.py: the same GPT shapes under DDP and torch pipelining.

  python benchmarks/torch_peer.py                  # both GPT configs, every variant, on all GPUs
  python benchmarks/torch_peer.py --model 268m --variants ddp,pp-1f1b
  python benchmarks/torch_peer.py --small          # tiny model, 2 CPU processes with gloo

Each variant runs in its own set of processes (one per GPU, `torch.multiprocessing.spawn`,
NCCL; gloo on CPU), one variant after another. `ddp` uses every GPU and splits the global
batch over them; the pipelines (`torch.distributed.pipelining`) use 2 ranks: `pp-gpipe`,
`pp-1f1b` with one stage per rank, `pp-interleaved` and `pp-dualpipev` with two (looped
and V placement). On GPU the model is pure bf16 (parameters and AdamW states), eager.
Reports the same row format as run.py; ratios are taken against the `ddp` row.
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

# Dense bf16 peak FLOP/s per card (no sparsity).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

PRESETS = {
    "tiny": dict(vocab=256, seq=32, d=64, layers=4, heads=4),
    "268m": dict(vocab=32768, seq=1024, d=1024, layers=16, heads=16),
    "1.3b": dict(vocab=32768, seq=1024, d=2048, layers=24, heads=16),
}

VARIANTS = ("ddp", "pp-gpipe", "pp-1f1b", "pp-interleaved", "pp-dualpipev")
# Pipeline variants: (schedule class name, stages per rank).
PIPELINES = {"pp-gpipe": ("ScheduleGPipe", 1), "pp-1f1b": ("Schedule1F1B", 1),
             "pp-interleaved": ("ScheduleInterleaved1F1B", 2),
             "pp-dualpipev": ("ScheduleDualPipeV", 2)}
PP_RANKS = 2


def flops_per_token(cfg) -> float:
  """6 * N + 12 * L * d * T, as examples/gpt.py `flops_per_token`."""
  d, L = cfg["d"], cfg["layers"]
  n_matmul = L * 12 * d * d + d * cfg["vocab"]
  return 6.0 * n_matmul + 12.0 * L * d * cfg["seq"]


def _build_stage(cfg, first: bool, last: bool, blocks: range):
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
      for blk in self.blocks:
        x = blk(x)
      if last:
        x = self.head(self.ln_f(x))
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


def _worker(rank: int, world: int, variant: str, model: str, batch: int, microbatches: int,
            steps: int, warmup: int, use_cuda: bool, out_path: str):
  """One rank of one variant; rank 0 writes the row as JSON to `out_path`."""
  import torch
  import torch.distributed as dist

  if use_cuda:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
  else:
    # Two processes on a small CPU: one thread each, not one per core each.
    torch.set_num_threads(1)
    device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
  dtype = torch.bfloat16 if use_cuda else torch.float32
  cfg = PRESETS[model]

  def make(first, last, blocks, seed):
    torch.manual_seed(seed)
    with device:
      return _build_stage(cfg, first, last, blocks).to(dtype)

  if variant == "ddp":
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = DDP(make(True, True, range(cfg["layers"]), 0), device_ids=[rank] if use_cuda else None)
    modules = [net]
    data = [(x[rank::world], y[rank::world]) for x, y in _batches(cfg, batch, device)]

    def step(x, y):
      loss = _loss(net(x), y)
      loss.backward()
      return loss.detach()
  else:
    from torch.distributed import pipelining
    sched_name, per_rank = PIPELINES[variant]
    n_stages = world * per_rank
    if variant == "pp-dualpipev":
      ids = [rank, 2 * world - 1 - rank]  # V placement
    else:
      ids = [rank + i * world for i in range(per_rank)]  # looped placement
    L = cfg["layers"]
    if L % n_stages:
      raise ValueError(f"{L} layers do not split into {n_stages} stages")
    k = L // n_stages
    stages, modules = [], []
    for s in ids:
      mod = make(s == 0, s == n_stages - 1, range(s * k, (s + 1) * k), s)
      modules.append(mod)
      stages.append(pipelining.PipelineStage(mod, s, n_stages, device))
    cls = getattr(pipelining, sched_name)
    sched = cls(stages[0] if per_rank == 1 else stages, n_microbatches=microbatches, loss_fn=_loss)
    # The last stage would otherwise concatenate every microbatch's logits.
    extra = {"return_outputs": False} if "return_outputs" in inspect.signature(sched.step).parameters else {}
    has_first, has_last = 0 in ids, n_stages - 1 in ids
    data = _batches(cfg, batch, device)

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
  peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in kind), None) if use_cuda else None
  tps = batch * cfg["seq"] / step_s
  mfu = flops_per_token(cfg) * tps / (world * peak_flops) if peak_flops else None
  row = {"variant": variant, "model": model, "devices": world, "device_kind": kind,
         "step_ms": step_s * 1e3, "tokens_per_s": tps, "mfu": mfu,
         "peak_gib": peak / 2**30 if peak else None, "compile_s": max(first - step_s, 0.0),
         "loss": sum(losses) / len(losses)}
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
  if variant in PIPELINES:
    from torch.distributed import pipelining
    if not hasattr(pipelining, PIPELINES[variant][0]):
      return error(f"{PIPELINES[variant][0]} not available in this torch ({torch.__version__})")
    world = PP_RANKS
  else:
    world = n_gpus if use_cuda else 2
  if use_cuda and world > n_gpus:
    return error(f"needs {world} GPUs, found {n_gpus}")
  split = world if variant == "ddp" else args.microbatches
  if args.batch % split:
    return error(f"batch {args.batch} does not split into {split} equal parts")
  os.environ["MASTER_ADDR"] = "127.0.0.1"
  os.environ["MASTER_PORT"] = str(_free_port())
  fd, out_path = tempfile.mkstemp(suffix=".json")
  os.close(fd)
  try:
    ctx = mp.spawn(_worker, nprocs=world, join=False,
                   args=(world, variant, model, args.batch, args.microbatches, args.steps,
                         args.warmup, use_cuda, out_path))
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


def table(rows) -> str:
  """The table of benchmarks/run.py, with every ratio against the DDP row."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from run import table as run_table
  return run_table(rows, baseline_of=lambda variant, model: "ddp")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="268m,1.3b", help="comma list of: tiny, 268m, 1.3b")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--timeout", type=int, default=900, help="seconds per variant")
  ap.add_argument("--small", action="store_true", help="tiny model on 2 CPU processes (gloo)")
  ap.add_argument("--out", default=None, help="JSON output path")
  args = ap.parse_args(argv)
  if args.small:
    args.model, args.batch, args.microbatches, args.steps, args.warmup = "tiny", 8, 4, 2, 1
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
                dtype="bfloat16" if use_cuda else "float32")
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
