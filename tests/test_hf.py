"""Hugging Face checkpoints (examples/hf.py) and tokenized data (examples/train.py): the
files have Hugging Face's names and shapes, load back bit-exact, refuse what the model
does not implement, and train.py starts from one, trains on packed tokens and saves one."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

from safetensors import safe_open  # noqa: E402

import hf_fixture  # noqa: E402
from examples import hf, qwen3, train  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _model(name, **overrides):
  config = qwen3.get_config(name, **overrides)
  params = jax.jit(lambda rng: qwen3.init_params(qwen3.make_model(config), rng))(
      jax.random.PRNGKey(0))
  return config, params


def _stored(directory):
  """{name: (shape, dtype name)} of every tensor in the folder's .safetensors files."""
  out = {}
  for file in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
    with safe_open(os.path.join(directory, file), framework="numpy") as f:
      assert f.metadata() == {"format": "pt"}  # transformers refuses files without it
      for name in f.keys():
        out[name] = (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
  return out


def _assert_same(params, loaded):
  flat, tree = jax.tree_util.tree_flatten_with_path(params)
  loaded_flat, loaded_tree = jax.tree_util.tree_flatten(loaded)
  assert tree == loaded_tree
  for (path, a), b in zip(flat, loaded_flat):
    a = np.asarray(a)
    assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)


def _edit_config(directory, **fields):
  path = os.path.join(directory, "config.json")
  config = json.load(open(path))
  config.update(fields)
  json.dump(config, open(path, "w"))


def test_dense_untied_names_shapes_and_round_trip(tmp_path):
  # head_dim 24 with 4 heads of a 64-wide model: q is 96 wide, not hidden_size.
  config, params = _model("qwen3-tiny", head_dim=24)
  hf.save(str(tmp_path), config, params)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  fields = json.load(open(tmp_path / "config.json"))
  assert fields["architectures"] == ["Qwen3ForCausalLM"] and fields["model_type"] == "qwen3"
  assert {k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "tie_word_embeddings",
                                 "torch_dtype", "rope_theta", "rms_norm_eps")} == dict(
      vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
      torch_dtype="float32", rope_theta=1e6, rms_norm_eps=1e-6)
  assert fields["rope_scaling"] is None and fields["use_sliding_window"] is False
  stored = _stored(tmp_path)
  layer = "model.layers.1"
  assert {k: v[0] for k, v in stored.items() if k.startswith(layer + ".")} == {
      f"{layer}.input_layernorm.weight": (64,),
      f"{layer}.self_attn.q_proj.weight": (4 * 24, 64),
      f"{layer}.self_attn.k_proj.weight": (2 * 24, 64),
      f"{layer}.self_attn.v_proj.weight": (2 * 24, 64),
      f"{layer}.self_attn.o_proj.weight": (64, 4 * 24),
      f"{layer}.self_attn.q_norm.weight": (24,),
      f"{layer}.self_attn.k_norm.weight": (24,),
      f"{layer}.post_attention_layernorm.weight": (64,),
      f"{layer}.mlp.gate_proj.weight": (128, 64),
      f"{layer}.mlp.up_proj.weight": (128, 64),
      f"{layer}.mlp.down_proj.weight": (64, 128),
  }
  assert stored["model.embed_tokens.weight"] == ((256, 64), "F32")
  assert stored["lm_head.weight"] == ((256, 64), "F32")
  assert stored["model.norm.weight"][0] == (64,)
  assert len(stored) == 2 * 11 + 3
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:  # [out, in]
    np.testing.assert_array_equal(f.get_tensor(f"{layer}.self_attn.o_proj.weight"),
                                  np.asarray(params["block_1"]["attn"]["o"]["kernel"]).T)
  loaded_config, loaded = hf.load(str(tmp_path))
  assert loaded_config == config
  _assert_same(params, loaded)


def test_tied_has_no_head(tmp_path):
  config, params = _model("qwen3-tiny", tie_embeddings=True)
  hf.save(str(tmp_path), config, params)
  assert json.load(open(tmp_path / "config.json"))["tie_word_embeddings"] is True
  assert "lm_head.weight" not in _stored(tmp_path)
  loaded_config, loaded = hf.load(str(tmp_path))
  assert loaded_config == config and "head" not in loaded
  _assert_same(params, loaded)


def test_moe_names_shapes_and_round_trip(tmp_path):
  config, params = _model("qwen3-moe-tiny", norm_topk_prob=False)
  hf.save(str(tmp_path), config, params)
  fields = json.load(open(tmp_path / "config.json"))
  assert fields["architectures"] == ["Qwen3MoeForCausalLM"]
  assert {k: fields[k] for k in ("model_type", "num_experts", "num_experts_per_tok",
                                 "moe_intermediate_size", "norm_topk_prob",
                                 "decoder_sparse_step", "mlp_only_layers")} == dict(
      model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
  stored = _stored(tmp_path)
  assert stored["model.layers.0.mlp.gate.weight"][0] == (8, 64)  # the router
  for e in range(8):
    assert stored[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"][0] == (32, 64)
    assert stored[f"model.layers.1.mlp.experts.{e}.up_proj.weight"][0] == (32, 64)
    assert stored[f"model.layers.1.mlp.experts.{e}.down_proj.weight"][0] == (64, 32)
  assert not any(".mlp.gate_proj" in k for k in stored)
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    np.testing.assert_array_equal(
        f.get_tensor("model.layers.1.mlp.experts.5.down_proj.weight"),
        np.asarray(params["block_1"]["moe"]["experts"]["w_down"][5]).T)
  loaded_config, loaded = hf.load(str(tmp_path))
  assert loaded_config == config
  _assert_same(params, loaded)


def test_sharded_index_and_resave(tmp_path):
  config, params = _model("qwen3-moe-tiny", tie_embeddings=True)
  files = hf.save(str(tmp_path), config, params, max_shard_bytes=40_000)
  index = json.load(open(tmp_path / "model.safetensors.index.json"))
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  assert sorted(os.path.basename(f) for f in files) == sorted(
      shards + ["model.safetensors.index.json", "config.json"])
  stored = _stored(tmp_path)
  assert set(index["weight_map"]) == set(stored)
  assert index["metadata"]["total_size"] == 4 * sum(np.prod(s) for s, _ in stored.values())
  _, loaded = hf.load(str(tmp_path))
  _assert_same(params, loaded)
  hf.save(str(tmp_path), config, params)  # one file now: the shards and index go
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_bfloat16_files(tmp_path):
  config, params = _model("qwen3-tiny")
  hf.save(str(tmp_path), config, params, dtype=jnp.bfloat16)
  assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
  assert {dtype for _, dtype in _stored(tmp_path).values()} == {"BF16"}
  rounded = jax.tree_util.tree_map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
  _, as_fp32 = hf.load(str(tmp_path))  # the parameters' dtype: float32 by default
  _assert_same(jax.tree_util.tree_map(lambda x: x.astype(np.float32), rounded), as_fp32)
  _, as_bf16 = hf.load(str(tmp_path), param_dtype=jnp.bfloat16)
  _assert_same(rounded, as_bf16)


def test_fields_of_the_original_are_kept(tmp_path):
  config, params = _model("qwen3-moe-tiny")
  original = {"eos_token_id": 7, "max_position_embeddings": 40960, "intermediate_size": 6144,
              "hidden_size": 1, "dtype": "bfloat16", "num_local_experts": 99,
              "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}
  hf.save(str(tmp_path), config, params, extra=original)
  fields = hf.read_config(str(tmp_path))
  assert (fields["eos_token_id"], fields["max_position_embeddings"],
          fields["intermediate_size"]) == (7, 40960, 6144)        # the model does not set these
  assert fields["hidden_size"] == 64 and fields["rope_theta"] == 1e6  # the model's own win
  assert not {"dtype", "num_local_experts", "rope_parameters"} & set(fields)
  loaded_config, _ = hf.load(str(tmp_path))
  assert loaded_config == dataclasses.replace(config, seq_len=40960)


def test_newer_transformers_field_names():
  # transformers 5 writes rope_parameters and num_local_experts.
  fields = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 6,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
  config = hf.config_from_hf(fields, seq_len=16)
  assert (config.n_experts, config.rope_theta, config.head_dim, config.n_kv_heads) == (
      6, 5e5, 16, 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A dense and a MoE checkpoint, written once."""
  out = {}
  for name in ("qwen3-tiny", "qwen3-moe-tiny"):
    out[name] = str(tmp_path_factory.mktemp(name))
    hf.save(out[name], *_model(name))
  return out


@pytest.mark.parametrize("name, fields, field", [
    ("qwen3-tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ("qwen3-tiny", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}},
     "rope_parameters"),
    ("qwen3-tiny", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ("qwen3-tiny", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3-tiny", {"attention_bias": True}, "attention_bias"),
    ("qwen3-tiny", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3-tiny", {"model_type": "llama"}, "model_type"),
    ("qwen3-tiny", {"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ("qwen3-moe-tiny", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3-moe-tiny", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
])
def test_refuses_what_the_model_does_not_implement(saved, tmp_path, name, fields, field):
  directory = tmp_path / "ckpt"
  directory.mkdir()
  for file in os.listdir(saved[name]):
    os.symlink(os.path.join(saved[name], file), directory / file)
  os.remove(directory / "config.json")
  json.dump({**hf.read_config(saved[name]), **fields}, open(directory / "config.json", "w"))
  with pytest.raises(hf.UnsupportedCheckpoint, match=f"config.json: {field}") as e:
    hf.load(str(directory))
  assert "implement" in str(e.value)


def test_refuses_weights_that_do_not_fit(tmp_path):
  ckpt = str(tmp_path)
  config, params = _model("qwen3-tiny")
  hf.save(ckpt, config, params)
  _edit_config(ckpt, intermediate_size=96)
  with pytest.raises(hf.UnsupportedCheckpoint,
                     match=r"model.layers.0.mlp.down_proj.weight has shape \[64, 128\], but "
                           r"config.json implies \[64, 96\]"):
    hf.load(ckpt)
  _edit_config(ckpt, intermediate_size=128, num_hidden_layers=3)
  with pytest.raises(hf.UnsupportedCheckpoint, match="lacks 11 tensor"):
    hf.load(ckpt)
  _edit_config(ckpt, num_hidden_layers=2, tie_word_embeddings=True)  # lm_head is then a copy
  hf.load(ckpt)
  _edit_config(ckpt, num_hidden_layers=1, tie_word_embeddings=False)
  with pytest.raises(hf.UnsupportedCheckpoint,
                     match=r"holds 11 tensor\(s\) its config.json has no place for"):
    hf.load(ckpt)
  with pytest.raises(hf.UnsupportedCheckpoint, match="no shared expert"):
    hf.save(str(tmp_path / "shared"), *_model("qwen3-moe-tiny", shared_intermediate=16))


@pytest.mark.parametrize("case", sorted(hf_fixture.CASES))
def test_logits_of_a_loaded_checkpoint_are_transformers(case, tmp_path):
  # What transformers computed for the same checkpoint (tests/fixtures/make_hf_logits.py).
  theirs = np.load(hf_fixture.FIXTURE)[case]
  config = hf_fixture.write_checkpoint(str(tmp_path), case)
  loaded_config, params = hf.load(str(tmp_path), attention="xla")
  assert loaded_config == config
  ours, _ = qwen3.make_model(loaded_config).apply(
      {"params": params}, jnp.asarray(hf_fixture.tokens(config)))
  assert np.abs(np.asarray(ours) - theirs).max() <= 1e-5


def test_transformers_gives_the_same_logits(tmp_path):
  """Only where transformers and torch are installed (neither is a dependency)."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  for name, overrides in (("qwen3-tiny", dict(head_dim=24)),
                          ("qwen3-moe-tiny", dict(tie_embeddings=True))):
    config, params = _model(name, attention="xla", **overrides)
    # Norm scales away from 1 and larger weights: a misplaced tensor cannot hide.
    params = jax.tree_util.tree_map(lambda x: x * 5 if x.ndim > 1 else x + 0.5, params)
    directory = str(tmp_path / name)
    hf.save(directory, config, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, config.seq_len))
    with torch.no_grad():
      theirs = model(torch.tensor(tokens)).logits.numpy()
    ours, _ = qwen3.make_model(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)


# -- tokenized data ------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(60)]


def _tokenizer(directory, eos="<|endoftext|>", config=None):
  """A word-level tokenizer.json (and tokenizer_config.json) in `directory`."""
  vocab = {"<unk>": 0, eos: 1, "<|im_end|>": 2, **{w: k + 3 for k, w in enumerate(WORDS)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "tokenizer.json")
  tok.save(path)
  if config is not None:
    json.dump(config, open(os.path.join(directory, "tokenizer_config.json"), "w"))
  return path


def _documents(directory, n=4, words=400):
  rng = np.random.default_rng(0)
  os.makedirs(directory, exist_ok=True)
  docs = []
  for k in range(n):
    docs.append(rng.choice(WORDS, words).tolist())
    with open(os.path.join(directory, f"doc{k}.txt"), "w") as f:
      f.write(" ".join(docs[-1]))
  return docs


def test_eos_token(tmp_path):
  path = _tokenizer(str(tmp_path / "a"))
  tok = train.load_tokenizer(path)
  assert train.eos_id(tok, path) == 1                    # a known end-of-text name
  assert train.eos_id(tok, path, "<|im_end|>") == 2      # --eos
  path = _tokenizer(str(tmp_path / "b"), config={"eos_token": {"content": "<|im_end|>"}})
  assert train.eos_id(train.load_tokenizer(path), path) == 2  # tokenizer_config.json's
  path = _tokenizer(str(tmp_path / "c"), eos="<stop>")
  with pytest.raises(train.UsageError, match="--eos TOKEN"):
    train.eos_id(train.load_tokenizer(path), path)


def test_documents_are_packed_with_eos_between(tmp_path):
  path = _tokenizer(str(tmp_path))
  docs = _documents(str(tmp_path / "data"), n=4, words=400)
  tok = train.load_tokenizer(path)
  stream = train.tokenize_documents(train.read_texts(str(tmp_path / "data")), tok, eos=1)
  ids = lambda doc: [WORDS.index(w) + 3 for w in doc]
  assert stream.tolist() == ids(docs[0]) + [1] + ids(docs[1]) + [1] + ids(docs[2]) + [1] + ids(
      docs[3])
  sequences = train.pack(stream, seq_len=31)
  assert sequences.shape == (len(stream) // 32, 32)
  np.testing.assert_array_equal(sequences.reshape(-1), stream[:sequences.size])
  n = len(sequences)
  batches = [train.packed_batch(sequences, 8, seed=3, step=i) for i in range(-(-2 * n // 8))]
  again = train.packed_batch(sequences, 8, seed=3, step=5)
  np.testing.assert_array_equal(batches[5]["tokens"], again["tokens"])  # the step's alone
  for b in batches:
    np.testing.assert_array_equal(b["tokens"][:, 1:], b["targets"][:, :-1])
  rows = np.concatenate([np.concatenate([b["tokens"], b["targets"][:, -1:]], 1)
                         for b in batches])
  seen = lambda part: sorted(map(tuple, part))
  assert seen(rows[:n]) == seen(sequences)              # each sequence once an epoch
  assert seen(rows[n:2 * n]) == seen(sequences)
  assert not np.array_equal(rows[:n], rows[n:2 * n])    # in a new order
  other = train.packed_batch(sequences, 8, seed=4, step=5)
  assert not np.array_equal(other["tokens"], again["tokens"])


def test_train_from_checkpoint_with_tokenizer_and_save(tmp_path):
  tokenizer = _tokenizer(str(tmp_path / "tok"), config={"eos_token": "<|endoftext|>"})
  _documents(str(tmp_path / "data"), n=6, words=300)
  config, params = _model("qwen3-tiny", vocab_size=80)
  hf.save(str(tmp_path / "ckpt"), config, params)
  _edit_config(str(tmp_path / "ckpt"), eos_token_id=1)
  argv = ["--init-from", str(tmp_path / "ckpt"), "--tokenizer", tokenizer,
          "--data", str(tmp_path / "data"), "--strategy", "pp-1f1b", "--stages", "2",
          "--dp", "4", "--zero", "1", "--microbatches", "2", "--batch", "8", "--quiet",
          "--steps", "2", "--log-every", "1", "--seq-len", "16"]
  out = train.main(argv + ["--save-hf", str(tmp_path / "out")])
  # The first step's loss is the checkpoint's own on the first packed batch.
  args = train.parse_args(argv)
  get_batch = train.batch_source(args, qwen3, dataclasses.replace(config, seq_len=16),
                                 train.load_tokenizer(tokenizer), None)
  batch = get_batch(0)
  assert batch["tokens"].shape == (8, 16)
  first = qwen3.loss_fn(qwen3.make_model(config))(params, batch)
  np.testing.assert_allclose(out["losses"][0], float(first), rtol=1e-5)
  saved_config, trained = hf.load(str(tmp_path / "out"))
  # max_position_embeddings stays the original's (32), not the 16 trained on.
  assert saved_config == config
  assert json.load(open(tmp_path / "out" / "config.json"))["eos_token_id"] == 1  # kept
  assert sorted(os.listdir(tmp_path / "out")) == [
      "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
  trained_params = out["step"].params(out["state"])
  _assert_same(jax.tree_util.tree_map(np.asarray, trained_params), trained)
  assert not np.array_equal(trained["embed"]["embedding"], params["embed"]["embedding"])


def test_init_from_usage_errors(tmp_path):
  config, params = _model("qwen3-tiny", vocab_size=8)  # fewer ids than the tokenizer has
  hf.save(str(tmp_path / "ckpt"), config, params)
  tokenizer = _tokenizer(str(tmp_path / "tok"))
  _documents(str(tmp_path / "data"))
  argv = ["--init-from", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data"),
          "--tokenizer", tokenizer, "--strategy", "dp", "--batch", "8", "--quiet"]
  for extra, match in [
      (["--model", "tiny"], "--model tiny is a GPT preset"),
      (["--model", "qwen3-moe-tiny"], "--model qwen3-moe-tiny is a Qwen3-MoE, but --init-from"),
      (["--model", "qwen3-tiny"], "--model qwen3-tiny has vocab_size=256, but --init-from"),
      (["--experts", "4"], "drop --experts"),
      ([], "has 63 tokens, more than the 8 of --init-from")]:
    with pytest.raises(train.UsageError, match=match):
      train.main(argv + extra)


def test_other_usage_errors(tmp_path):
  config, params = _model("qwen3-tiny")
  hf.save(str(tmp_path / "ckpt"), config, params)
  with pytest.raises(train.UsageError, match="add --tokenizer"):
    train.main(["--init-from", str(tmp_path / "ckpt"), "--strategy", "dp", "--quiet"])
  with pytest.raises(train.UsageError, match="--save-hf writes Qwen3 checkpoints"):
    train.main(["--model", "tiny", "--save-hf", str(tmp_path / "out"), "--strategy", "dp"])
  _edit_config(str(tmp_path / "ckpt"), rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(train.UsageError, match="rope_scaling"):
    train.main(["--init-from", str(tmp_path / "ckpt"), "--data", "synthetic", "--strategy", "dp"])
