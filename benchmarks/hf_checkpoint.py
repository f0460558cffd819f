"""Hugging Face checkpoints in and out, end to end, on one machine with no network.

A Qwen3-shaped checkpoint with random weights is written by `transformers`; a byte-level
BPE `tokenizer.json` is trained with `tokenizers` on the text files given; then
`examples/train.py --init-from` trains it on that text, saves it with `--save-hf` and an
orbax checkpoint; `transformers` loads the saved checkpoint and its logits are compared
with the model's own. Times: loading the checkpoint (examples/hf.py, to the host, and
placed on the step's devices), saving it, and orbax's save and restore of the same
training state. One JSON line on stdout.

  python benchmarks/hf_checkpoint.py --model qwen3-1.7b --text DIR [DIR ...] --work /tmp/hf
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # examples/ holds the models


def write_random_checkpoint(directory: str, config) -> None:
  """`transformers` writes the checkpoint of a randomly initialised model of `config`."""
  import torch
  import transformers
  from examples import hf
  fields = hf.config_to_hf(config)
  hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
  model.save_pretrained(directory, safe_serialization=True)


def train_tokenizer(files: list[str], path: str, vocab_size: int) -> None:
  """A byte-level BPE of `vocab_size` tokens trained on `files`, EOS `<|endoftext|>`."""
  import tokenizers
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train(files, trainer)
  tok.save(path)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen3-1.7b")
  p.add_argument("--text", nargs="+", required=True,
                 help="folders of text files (*.py, *.md, *.txt, *.rst) to train on")
  p.add_argument("--work", required=True, help="a folder for the checkpoints")
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--bpe-vocab", type=int, default=16384)
  args = p.parse_args(argv)

  import jax
  import numpy as np
  import torch
  import transformers
  import piper_jax as pj
  from examples import hf, qwen3, train

  os.makedirs(args.work, exist_ok=True)
  files = sorted(f for d in args.text for ext in ("py", "md", "txt", "rst")
                 for f in glob.glob(os.path.join(d, "**", f"*.{ext}"), recursive=True))
  data = os.path.join(args.work, "data")
  os.makedirs(data, exist_ok=True)
  n_bytes = 0
  for k, f in enumerate(files):  # one document per file, as train.py reads a folder
    text = open(f, errors="replace").read()
    n_bytes += len(text)
    with open(os.path.join(data, f"{k:06d}.txt"), "w") as out:
      out.write(text)
  row: dict = {"model": args.model, "text_files": len(files), "text_bytes": n_bytes,
               "device_kind": jax.devices()[0].device_kind}

  config = qwen3.get_config(args.model)
  if config.vocab_size < args.bpe_vocab:  # a test preset's: room for the BPE's tokens
    config = qwen3.get_config(args.model, vocab_size=args.bpe_vocab)
  ckpt = os.path.join(args.work, "init")
  started = time.perf_counter()
  write_random_checkpoint(ckpt, config)
  row["transformers_write_s"] = time.perf_counter() - started
  tokenizer = os.path.join(args.work, "tokenizer.json")
  started = time.perf_counter()
  train_tokenizer(files, tokenizer, args.bpe_vocab)
  row["bpe_train_s"] = time.perf_counter() - started

  # Loading alone: the files to host arrays, then placed as the step's state.
  started = time.perf_counter()
  loaded_config, params = hf.load(ckpt, seq_len=args.seq_len)
  row["hf_load_to_host_s"] = time.perf_counter() - started
  row["checkpoint_gib"] = sum(os.path.getsize(f) for f in glob.glob(
      os.path.join(ckpt, "*.safetensors"))) / 2**30
  del params

  saved, orbax_dir = os.path.join(args.work, "trained"), os.path.join(args.work, "orbax")
  argv = ["--init-from", ckpt, "--tokenizer", tokenizer, "--data", data, "--eos",
          "<|endoftext|>", "--strategy", "dp", "--batch", str(args.batch), "--seq-len",
          str(args.seq_len), "--dtype", "bfloat16", "--steps", str(args.steps),
          "--log-every", "10", "--save-hf", saved, "--ckpt-dir", orbax_dir,
          "--metrics", os.path.join(args.work, "metrics.jsonl")]
  started = time.perf_counter()
  out = train.main(argv)
  row["train_s"] = time.perf_counter() - started
  row["losses_first_last"] = [out["losses"][0], out["losses"][-1]]
  row["tokens_per_s"] = out["tokens_per_s"]
  step, state = out["step"], out["state"]

  # Placed as the step's state, saved, restored: orbax next to examples/hf.py.
  started = time.perf_counter()
  _, params = hf.load(saved, seq_len=args.seq_len)
  placed = step.init(params)
  jax.block_until_ready(placed)
  row["hf_load_and_place_s"] = time.perf_counter() - started
  del placed, params
  started = time.perf_counter()
  hf.save(os.path.join(args.work, "resaved"), loaded_config, step.canonical(state)["params"])
  row["hf_save_s"] = time.perf_counter() - started
  started = time.perf_counter()
  restored = pj.checkpoint.restore(orbax_dir, step)
  jax.block_until_ready(restored)
  row["orbax_restore_s"] = time.perf_counter() - started
  started = time.perf_counter()
  pj.checkpoint.save(os.path.join(args.work, "orbax2"), state, step=args.steps)
  row["orbax_save_s"] = time.perf_counter() - started
  del restored

  # transformers reads what was saved: the same logits as the model's own, in float32.
  model = transformers.AutoModelForCausalLM.from_pretrained(
      saved, attn_implementation="eager", dtype=torch.float32)
  tokens = np.random.default_rng(0).integers(0, args.bpe_vocab, (1, 64))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours_config, ours_params = hf.load(saved, seq_len=64, attention="xla")
  with jax.default_device(jax.devices("cpu")[0]):  # on the CPU, as transformers ran
    ours, _ = qwen3.make_model(ours_config).apply(
        {"params": ours_params}, jax.numpy.asarray(tokens, jax.numpy.int32))
  row["logits_max_abs_diff"] = float(np.abs(np.asarray(ours) - theirs).max())
  row["logits_max_abs"] = float(np.abs(theirs).max())
  print(json.dumps(row))
  return row


if __name__ == "__main__":
  main()
