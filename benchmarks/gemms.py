"""bf16 GEMM and cuDNN fused attention throughput on this machine's first GPU, as fractions
of the card's dense bf16 peak: what `pj.planner.Accelerator`'s GEMM figures stand for.

  python3 benchmarks/gemms.py --out gemms.json

Each product runs `--reps` times inside one jitted loop (the loop's own cost is in the
time: small products read low); the median of five calls is kept.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import piper_jax as pj

PLAIN = [(m, k, n) for m, k, n in itertools.product((512, 2048, 8192, 32768),
                                                      (1024, 4096, 16384), (1024, 4096, 16384))
         if m * max(k, n) <= 32768 * 16384]
LM_HEADS = [(8192, 2048, 151936), (4096, 4096, 151936), (16384, 2048, 151936)]
# Experts (count, tokens each, k, n): a MoE's grouped products.
EXPERTS = list(itertools.product((8, 128), (128, 640, 2560), ((2048, 768), (768, 2048), (2048, 1536))))
# (batch, tokens, heads, kv heads, head dim): Qwen3-1.7B and -8B's attention.
ATTENTION = [(1, 4096, 32, 8, 128), (2, 4096, 32, 8, 128), (1, 2048, 16, 8, 128),
             (2, 2048, 16, 8, 128), (4, 2048, 16, 8, 128), (8, 2048, 16, 8, 128)]


def _seconds(fn, *args) -> float:
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(5):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def gemm_seconds(experts: int, m: int, k: int, n: int, reps: int) -> float:
  """Seconds of one [m, k] x [k, n] product (`experts` of them batched when > 0)."""
  key = jax.random.PRNGKey(0)
  lead = (experts,) if experts else ()
  x = jax.random.normal(key, (2, *lead, m, k), jnp.bfloat16)  # two operands: no hoisting
  w = jax.random.normal(key, (*lead, k, n), jnp.bfloat16)

  def loop(x, w):
    body = lambda i, acc: acc + jnp.matmul(x[i % 2], w)
    return lax.fori_loop(0, reps, body, jnp.zeros((*lead, m, n), jnp.bfloat16))
  return _seconds(loop, x, w) / reps


def attention_seconds(b: int, t: int, heads: int, kv_heads: int, head_dim: int, causal: bool,
                      reps: int) -> tuple[float, float]:
  """Seconds of cuDNN's attention forward, and forward and backward."""
  key = jax.random.PRNGKey(1)
  q = jax.random.normal(key, (b, t, heads, head_dim), jnp.bfloat16)
  kv = jax.random.normal(key, (b, t, kv_heads, head_dim), jnp.bfloat16)
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
  grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
  # Each rep reads the last one's output, so that XLA runs them all.
  fwd = lambda q, k, v: lax.fori_loop(0, reps, lambda i, a: a + attend(q + a * 0, k, v),
                                      jnp.zeros_like(q))
  both = lambda q, k, v: lax.fori_loop(0, reps, lambda i, a: a + grad(q + a * 0, k, v)[0],
                                       jnp.zeros_like(q))
  return _seconds(fwd, q, kv, kv) / reps, _seconds(both, q, kv, kv) / reps


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=10, help="products per jitted loop")
  ap.add_argument("--out", default=None, help="JSON output path")
  args = ap.parse_args(argv)
  kind = jax.devices()[0].device_kind
  peak = pj.planner.accelerator(kind).peak_flops
  rows = []
  for experts, m, k, n in ([(0, *s) for s in PLAIN + LM_HEADS]
                           + [(e, m, k, n) for e, m, (k, n) in EXPERTS]):
    s = gemm_seconds(experts, m, k, n, args.reps)
    rows.append({"experts": experts, "m": m, "k": k, "n": n, "seconds": s,
                 "of_peak": 2.0 * max(experts, 1) * m * k * n / s / peak})
    print(rows[-1], flush=True)
  attention = []
  for (b, t, heads, kv_heads, head_dim), causal in itertools.product(ATTENTION, (True, False)):
    fwd, both = attention_seconds(b, t, heads, kv_heads, head_dim, causal, args.reps)
    # QK and PV over the scores computed (causal: half), backward 2.5x the forward's.
    flops = 4.0 * b * t * t * heads * head_dim * (0.5 if causal else 1.0)
    attention.append({"batch": b, "tokens": t, "heads": heads, "kv_heads": kv_heads,
                      "head_dim": head_dim, "causal": causal, "fwd_s": fwd, "fwd_bwd_s": both,
                      "fwd_of_peak": flops / fwd / peak, "fwd_bwd_of_peak": 3.5 * flops / both / peak})
    print(attention[-1], flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"device_kind": kind, "jax": jax.__version__, "peak_flops": peak,
                 "gemms": rows, "attention": attention}, f, indent=1)


if __name__ == "__main__":
  main()
