"""Hugging Face Qwen3 / Qwen3-MoE checkpoints to and from examples/qwen3.py's parameters.

`load(directory)` reads a checkpoint folder (config.json plus `model.safetensors`, or
shards listed by `model.safetensors.index.json`) into a `qwen3.Qwen3Config` (or
`Qwen3MoEConfig`) and the parameter pytree of `qwen3.make_model(config)`; `save(directory,
config, params)` writes one that `transformers.AutoModelForCausalLM.from_pretrained`
loads as Qwen3ForCausalLM / Qwen3MoeForCausalLM:

  config, params = hf.load("Qwen3-1.7B", seq_len=2048)
  hf.save("trained", config, params, dtype=jnp.bfloat16)

Tensors are read memory-mapped one at a time and converted leaf by leaf: Hugging Face's
Linear weights are [out, in], Flax's kernels [in, out]; a MoE layer's experts
(`mlp.experts.{e}.gate_proj`, ...) are one [experts, ...] leaf here. Checkpoint features
the model does not implement (rotary scaling such as YaRN, sliding-window attention,
attention biases, dense layers among MoE ones) are refused with the field to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, which safetensors asks for by name
import numpy as np

try:
  from examples import qwen3
except ImportError:  # run from examples/ as a script
  import qwen3

__all__ = ["Tensor", "UnsupportedCheckpoint", "config_from_hf", "config_to_hf", "load",
           "read_config", "save", "tensors"]

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10 ** 9  # Hugging Face's default shard size ("5GB")
DTYPE_NAMES = {np.dtype(jnp.float32): "float32", np.dtype(jnp.bfloat16): "bfloat16",
               np.dtype(jnp.float16): "float16"}


class UnsupportedCheckpoint(ValueError):
  """A checkpoint the example model cannot hold as it is."""


def _safetensors():
  """The safetensors package, imported when first needed: train.py runs without it."""
  try:
    import safetensors
    import safetensors.numpy
  except ImportError as e:
    raise ImportError("Hugging Face checkpoints need the safetensors package: "
                      "pip install -e '.[hf]'") from e
  return safetensors


# -- config.json ---------------------------------------------------------------------

def read_config(directory: str) -> dict:
  """config.json of a checkpoint folder, as written."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} has no config.json; give a Hugging Face "
                            f"checkpoint folder")
  with open(path) as f:
    return json.load(f)


def _check_family(hf: dict) -> str:
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES:
    raise UnsupportedCheckpoint(
        f"config.json: model_type {model_type!r} is not implemented; examples/qwen3.py "
        f"implements {sorted(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())}): give "
        f"one of those checkpoints")
  architectures = hf.get("architectures")
  if architectures is not None and architectures != [ARCHITECTURES[model_type]]:
    raise UnsupportedCheckpoint(
        f"config.json: architectures {architectures} is not implemented for model_type "
        f"{model_type!r}; the model implements [{ARCHITECTURES[model_type]!r}]: give a "
        f"{ARCHITECTURES[model_type]} checkpoint")
  return model_type


def _rope_theta(hf: dict) -> float:
  """The rotary base, refusing any scaling (older `rope_scaling` or newer `rope_parameters`)."""
  for field in ("rope_scaling", "rope_parameters"):
    rope = hf.get(field)
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if kind != "default":
      raise UnsupportedCheckpoint(
          f"config.json: {field} {rope} is not implemented; the model implements plain "
          f"rotary embeddings (rope_type 'default'): remove {field} from config.json to "
          f"train without the scaling")
  return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 1e4)))


def _refuse_unimplemented(hf: dict, model_type: str) -> None:
  """Raises for the first field whose value the model does not implement."""
  fixed = {"use_sliding_window": False, "attention_bias": False, "hidden_act": "silu",
           "attention_dropout": 0.0}
  if model_type == "qwen3_moe":
    fixed.update(decoder_sparse_step=1, mlp_only_layers=[])
  for field, implemented in fixed.items():
    value = hf.get(field, implemented)
    if value != implemented and value is not None:
      raise UnsupportedCheckpoint(
          f"config.json: {field}={json.dumps(value)} is not implemented (the model "
          f"implements {field}={json.dumps(implemented)} only); set {field} to "
          f"{json.dumps(implemented)} in config.json to train the model without it")
  layer_types = set(hf.get("layer_types") or ["full_attention"])
  if layer_types != {"full_attention"}:
    raise UnsupportedCheckpoint(
        f"config.json: layer_types holds {sorted(layer_types - {'full_attention'})}, which "
        f"is not implemented (the model implements 'full_attention' layers only); set every "
        f"entry to 'full_attention' to train the model without them")


def _field(hf: dict, name: str):
  if name not in hf:
    raise UnsupportedCheckpoint(f"config.json has no {name!r}; a Qwen3 config.json names it")
  return hf[name]


def config_from_hf(hf: dict, **overrides) -> qwen3.Qwen3Config:
  """The `Qwen3Config` / `Qwen3MoEConfig` of a config.json's fields, with Hugging Face's
  defaults for absent ones; `overrides` set training fields (seq_len: by default
  max_position_embeddings; n_stages, dtype, ...)."""
  model_type = _check_family(hf)
  _refuse_unimplemented(hf, model_type)
  moe = model_type == "qwen3_moe"
  heads = _field(hf, "num_attention_heads")
  fields = dict(
      vocab_size=_field(hf, "vocab_size"), d_model=_field(hf, "hidden_size"),
      n_layers=_field(hf, "num_hidden_layers"), n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      # Qwen3's default head_dim is 128, Qwen3-MoE's hidden_size / heads.
      head_dim=hf.get("head_dim") or (_field(hf, "hidden_size") // heads if moe else 128),
      rope_theta=_rope_theta(hf), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      seq_len=hf.get("max_position_embeddings", 32768))
  if moe:
    # transformers 5 writes num_experts as num_local_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    fields.update(n_experts=experts, top_k=hf.get("num_experts_per_tok", 8),
                  moe_intermediate=hf.get("moe_intermediate_size", 768),
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                  router_aux_coef=float(hf.get("router_aux_loss_coef", 1e-3)),
                  shared_intermediate=0, capacity_factor=None)
  else:
    fields.update(intermediate=_field(hf, "intermediate_size"))
  return (qwen3.Qwen3MoEConfig if moe else qwen3.Qwen3Config)(**{**fields, **overrides})


def config_to_hf(config: qwen3.Qwen3Config, dtype: Any = jnp.float32,
                 extra: dict | None = None) -> dict:
  """config.json's fields for `config`, whose tensors are stored in `dtype`, over those of
  `extra` (e.g. the config.json of the checkpoint trained from), which keep what the model
  does not set: token ids, a max_position_embeddings above seq_len, ..."""
  moe = isinstance(config, qwen3.Qwen3MoEConfig)
  if moe and config.shared_intermediate:
    raise UnsupportedCheckpoint(
        f"shared_intermediate={config.shared_intermediate}: Qwen3MoeForCausalLM has no "
        f"shared expert; train with shared_intermediate=0 to save a Qwen3-MoE checkpoint")
  model_type = "qwen3_moe" if moe else "qwen3"
  # Newer transformers restate dtype and rope_theta under these names: the fields below win.
  kept = {k: v for k, v in (extra or {}).items() if k not in ("dtype", "rope_parameters")}
  defaults = dict(max_position_embeddings=config.seq_len, initializer_range=qwen3.INIT_STD,
                  use_cache=True, max_window_layers=config.n_layers)
  hf = {**defaults, **kept}
  hf.update(
      architectures=[ARCHITECTURES[model_type]], model_type=model_type,
      vocab_size=config.vocab_size, hidden_size=config.d_model,
      num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
      num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_act="silu",
      max_position_embeddings=max(hf["max_position_embeddings"], config.seq_len),
      rope_theta=config.rope_theta, rope_scaling=None, rms_norm_eps=config.norm_eps,
      tie_word_embeddings=config.tie_embeddings, attention_bias=False,
      attention_dropout=0.0, use_sliding_window=False, sliding_window=None,
      torch_dtype=DTYPE_NAMES[np.dtype(dtype)])
  if not moe:
    hf.update(intermediate_size=config.intermediate)
  else:
    # The dense MLP width sizes mlp_only_layers, none here: the original's is kept.
    hf.setdefault("intermediate_size", config.moe_intermediate)
    hf.update(num_experts=config.n_experts, num_experts_per_tok=config.top_k,
              moe_intermediate_size=config.moe_intermediate,
              norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
              router_aux_loss_coef=config.router_aux_coef)
    hf.pop("num_local_experts", None)
  return hf


# -- tensor names --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Tensor:
  """One Hugging Face tensor and where it lives in the Flax parameters.

  Attributes:
    name: Hugging Face's name, e.g. "model.layers.0.self_attn.q_proj.weight".
    path: keys of the Flax leaf, e.g. ("block_0", "attn", "q", "kernel").
    expert: index along the leaf's leading expert axis; None: the whole leaf.
    transpose: a Linear weight [out, in] held as a Flax kernel [in, out].
  """

  name: str
  path: tuple[str, ...]
  expert: int | None = None
  transpose: bool = False


def _linear(name: str, *path: str) -> Tensor:
  return Tensor(f"{name}.weight", (*path, "kernel"), transpose=True)


def _norm(name: str, *path: str) -> Tensor:
  return Tensor(f"{name}.weight", (*path, "scale"))


def _layer_tensors(config: qwen3.Qwen3Config, i: int) -> list[Tensor]:
  hf, block = f"model.layers.{i}", f"block_{i}"
  out = [_norm(f"{hf}.input_layernorm", block, "input_norm")]
  for proj in "qkvo":
    out.append(_linear(f"{hf}.self_attn.{proj}_proj", block, "attn", proj))
  out += [_norm(f"{hf}.self_attn.q_norm", block, "attn", "q_norm"),
          _norm(f"{hf}.self_attn.k_norm", block, "attn", "k_norm"),
          _norm(f"{hf}.post_attention_layernorm", block, "post_attn_norm")]
  if not isinstance(config, qwen3.Qwen3MoEConfig):
    return out + [_linear(f"{hf}.mlp.{p}_proj", block, "mlp", p) for p in ("gate", "up", "down")]
  out.append(_linear(f"{hf}.mlp.gate", block, "moe", "router"))
  for p in ("gate", "up", "down"):
    out += [Tensor(f"{hf}.mlp.experts.{e}.{p}_proj.weight", (block, "moe", "experts", f"w_{p}"),
                   expert=e, transpose=True) for e in range(config.n_experts)]
  return out


def tensors(config: qwen3.Qwen3Config) -> list[Tensor]:
  """Every Hugging Face tensor of `config`'s model, embedding first and head last."""
  out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"))]
  for i in range(config.n_layers):
    out += _layer_tensors(config, i)
  out.append(_norm("model.norm", "final_norm"))
  if not config.tie_embeddings:
    out.append(_linear("lm_head", "head"))
  return out


def _abstract_params(config: qwen3.Qwen3Config) -> Any:
  """Shapes and dtypes of `qwen3.init_params` (traced, nothing allocated)."""
  model = qwen3.make_model(config)
  return jax.eval_shape(lambda rng: qwen3.init_params(model, rng), jax.random.PRNGKey(0))


def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _keys(path) -> tuple[str, ...]:
  return tuple(str(k.key) for k in path)


# -- reading -------------------------------------------------------------------------

def _weight_files(directory: str) -> dict[str, str]:
  """Hugging Face tensor name -> the .safetensors file holding it."""
  single, index = os.path.join(directory, SINGLE_FILE), os.path.join(directory, INDEX_FILE)
  if os.path.isfile(single):
    files = [single]
  elif os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  else:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if len(files) != 1:
      raise FileNotFoundError(
          f"{directory} holds {len(files)} .safetensors files and no {INDEX_FILE}; give a "
          f"folder with {SINGLE_FILE} or with shards listed by {INDEX_FILE}")
  names = {}
  for file in files:
    with _safetensors().safe_open(file, framework="numpy") as f:
      names.update({name: file for name in f.keys()})
  return names


class _Reader(contextlib.ExitStack):
  """Memory-mapped .safetensors files, each opened once, read a tensor at a time (a copy),
  and unmapped on leaving the `with` block."""

  def __init__(self, files: dict[str, str]):
    super().__init__()
    self.files = files
    self.open: dict[str, Any] = {}

  def get(self, name: str) -> np.ndarray:
    file = self.files[name]
    if file not in self.open:
      self.open[file] = self.enter_context(_safetensors().safe_open(file, framework="numpy"))
    return self.open[file].get_tensor(name)


def _check_names(config: qwen3.Qwen3Config, wanted: list[Tensor], present: set[str]) -> None:
  """Every tensor the model needs is there, and no tensor the model has no place for."""
  needed = {t.name for t in wanted}
  missing = sorted(needed - present)
  if missing:
    raise UnsupportedCheckpoint(
        f"the checkpoint lacks {len(missing)} tensor(s) its config.json implies, e.g. "
        f"{missing[:3]}; give the config.json these weights were saved with")
  # A tied checkpoint may keep a copy of the embedding as lm_head; old ones keep rotary tables.
  ignored = {"lm_head.weight"} if config.tie_embeddings else set()
  extra = sorted(n for n in present - needed - ignored if not n.endswith("rotary_emb.inv_freq"))
  if extra:
    raise UnsupportedCheckpoint(
        f"the checkpoint holds {len(extra)} tensor(s) its config.json has no place for, "
        f"e.g. {extra[:3]}; give the config.json these weights were saved with")


def _read_leaf(reader: _Reader, parts: list[Tensor], shape: tuple, dtype) -> np.ndarray:
  """The Flax leaf made of `parts` (one tensor, or one per expert), cast to `dtype`."""
  def convert(t: Tensor, want: tuple) -> np.ndarray:
    stored = reader.get(t.name)
    x = stored.T if t.transpose else stored
    if x.shape != want:
      raise UnsupportedCheckpoint(
          f"{t.name} has shape {list(stored.shape)}, but config.json implies "
          f"{list(want[::-1] if t.transpose else want)}; give the config.json these weights "
          f"were saved with")
    return x
  if parts[0].expert is None:
    return np.ascontiguousarray(convert(parts[0], shape), dtype=dtype)
  leaf = np.empty(shape, dtype)
  for t in parts:
    leaf[t.expert] = convert(t, shape[1:])
  return leaf


def load(directory: str, **overrides) -> tuple[qwen3.Qwen3Config, Any]:
  """(config, params) of a Hugging Face Qwen3 / Qwen3-MoE checkpoint folder.

  `overrides` set the config's training fields (seq_len, n_stages, dtype, param_dtype,
  ...); the parameters are numpy arrays of `param_dtype` (default float32), converted
  one leaf at a time from the memory-mapped files."""
  config = config_from_hf(read_config(directory), **overrides)
  files = _weight_files(directory)
  wanted = tensors(config)
  _check_names(config, wanted, set(files))
  by_path: dict[tuple[str, ...], list[Tensor]] = {}
  for t in wanted:
    by_path.setdefault(t.path, []).append(t)
  with _Reader(files) as reader:

    def leaf(path, abstract):
      if _is_box(abstract):  # partitioning names (tp_axis) stay around the array
        return abstract.replace_boxed(leaf(path, abstract.unbox()))
      return _read_leaf(reader, by_path[_keys(path)], abstract.shape, abstract.dtype)

    params = jax.tree_util.tree_map_with_path(leaf, _abstract_params(config), is_leaf=_is_box)
  return config, params


# -- writing -------------------------------------------------------------------------

def _leaf(params: Any, path: tuple[str, ...]):
  for key in path:
    params = params[key]
  return params


def _to_hf(params: Any, t: Tensor, dtype) -> np.ndarray:
  """Tensor `t` of the Flax `params`, as Hugging Face stores it (one host copy)."""
  x = _leaf(params, t.path)
  x = np.asarray(x if t.expert is None else x[t.expert])
  return np.ascontiguousarray(x.T if t.transpose else x, dtype=dtype)


def _shards(sizes: list[tuple[Tensor, int]], max_bytes: int) -> list[list[Tensor]]:
  """Tensors in order, grouped greedily into shards of at most `max_bytes` (or one tensor)."""
  shards, current, used = [], [], 0
  for t, n in sizes:
    if current and used + n > max_bytes:
      shards.append(current)
      current, used = [], 0
    current.append(t)
    used += n
  return shards + [current] if current else shards


def _remove_old_weights(directory: str) -> None:
  """Deletes a previous save's weight files, which would otherwise mix with this one's."""
  old = glob.glob(os.path.join(directory, "model-*-of-*.safetensors"))
  for path in old + [os.path.join(directory, SINGLE_FILE), os.path.join(directory, INDEX_FILE)]:
    if os.path.isfile(path):
      os.remove(path)


def save(directory: str, config: qwen3.Qwen3Config, params: Any, dtype: Any = None,
         extra: dict | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
  """Writes config.json and model.safetensors (shards plus model.safetensors.index.json
  above `max_shard_bytes`) with Hugging Face's names; returns the files written.

  dtype: of the stored tensors (None: the parameters'); extra: config.json fields to keep
  beside the model's own, e.g. the token ids of the checkpoint trained from. The host
  holds one shard's tensors at a time."""
  params = nn.meta.unbox(params)
  dtype = np.dtype(dtype if dtype is not None else jnp.result_type(params["embed"]["embedding"]))
  if dtype not in DTYPE_NAMES:
    raise ValueError(f"dtype {dtype} cannot be saved; choose one of "
                     f"{[str(d) for d in DTYPE_NAMES]}")
  save_file = _safetensors().numpy.save_file
  hf_config = config_to_hf(config, dtype, extra)
  wanted = tensors(config)
  sizes = [(t, int(np.prod(np.shape(_leaf(params, t.path))[t.expert is not None:]))
            * dtype.itemsize) for t in wanted]
  shards = _shards(sizes, max_shard_bytes)
  os.makedirs(directory, exist_ok=True)
  _remove_old_weights(directory)
  names = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
  for name, shard in zip(names, shards):
    save_file({t.name: _to_hf(params, t, dtype) for t in shard}, os.path.join(directory, name),
              metadata={"format": "pt"})  # transformers refuses files without "format"
  written = [os.path.join(directory, n) for n in names]
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(n for _, n in sizes)},
             "weight_map": {t.name: n for n, shard in zip(names, shards) for t in shard}}
    written.append(_write_json(os.path.join(directory, INDEX_FILE), index))
  written.append(_write_json(os.path.join(directory, "config.json"), hf_config))
  return written


def _write_json(path: str, value: dict) -> str:
  with open(path, "w") as f:
    json.dump(value, f, indent=2)
    f.write("\n")
  return path
