"""Bad input raises a clear error before anything compiles, naming the directive."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import piper_jax as pj
from models import D_IN, init_mlp, mlp_loss, optimizer, random_batch

pytestmark = pytest.mark.timeout(60)


def _compile(directives, n_stages=2, batch_size=16):
  params = init_mlp(jax.random.PRNGKey(0), n_stages)
  return pj.compile(mlp_loss(n_stages), optimizer(), directives, params,
                    random_batch(jax.random.PRNGKey(1), batch_size))


def _raises(directives, *patterns, **kw):
  with pytest.raises(pj.PlanError) as info:
    _compile(directives, **kw)
  msg = str(info.value)
  for p in patterns:
    assert re.search(p, msg), msg
  return msg


def test_unknown_tag():
  _raises([pj.place({"XX": 0}, [0])], r"directive 0 \{\"op\": \"place\"", "unknown tag 'XX'",
          "annotate")


def test_filter_matching_nothing():
  _raises([pj.place({}, [0]), pj.place({"PP": 7}, [1])], r"directive 1 ", "matches no node")


def test_device_index_out_of_range():
  _raises([pj.replicate({}, [0, 1, 2, 9])], r"directive 0 ", "device index 9 is out of range",
          "8 devices")


def test_microbatches_do_not_divide_batch():
  _raises([pj.split(3), pj.place({}, [0])], r"directive 0 \{\"op\": \"split\"",
          "does not divide", "divisible by 3")


def test_microbatches_times_dp_do_not_divide_batch():
  _raises(pj.strategies.pipeline(2, 4, dp=4), "4 data-parallel replicas x 4 microbatches",
          batch_size=8)


def test_cycle_made_by_order():
  d = [pj.split(2), pj.place({}, [0]),
       pj.order([{"PP": 0, "PASS": "B", "MB": 0}, {"PP": 0, "PASS": "F", "MB": 0}])]
  _raises(d, r"directive 2 \{\"op\": \"order\"", "cycle", "r0F0")


@pytest.mark.parametrize("groups", [[0, 0, 1], [0, 1, 0]], ids=["adjacent", "apart"])
def test_order_naming_a_node_twice(groups):
  # Told as such, not as an order across devices or a cycle.
  f = lambda m: {"PP": 0, "PASS": "F", "MB": m}
  d = [pj.split(2), pj.place({}, [0]), pj.order([f(m) for m in groups])]
  _raises(d, r"directive 2 \{\"op\": \"order\"", r"names r0F0 in groups 0 and [12]",
          "names each node once")


def test_order_across_devices():
  d = [pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [1]),
       pj.order([{"PP": 1, "PASS": "F"}, {"PP": 0, "PASS": "B"}])]
  _raises(d, r"directive 2 ", "share no device", "across devices cannot be kept")


def test_unplaced_region():
  # No directive is at fault, so the message names what to place instead.
  with pytest.raises(pj.DirectiveError) as info:
    _compile([pj.place({"PP": 0}, [0])])
  msg = str(info.value)
  assert re.search(r"region 1 \(\{'PP': 1\}\) has an unplaced node r1F", msg), msg
  assert "pj.place({'PP': 1}, [0])" in msg and not msg.startswith("directive"), msg


@pytest.mark.parametrize("second", [4, 2])
def test_a_second_split(second):
  # The same count twice is refused as plainly as another count (it had been taken as a
  # batch split twice over: "the batch of 2 does not divide" for a batch of 16).
  _raises([pj.split(2), pj.split(second), pj.replicate({}, [0, 1])],
          r"directive 1 \{\"op\": \"split\"",
          f"splits into {second} microbatches but directive 0 split the batch already, into 2",
          "use one split")


def test_region_placed_on_some_devices_and_replicated_over_others():
  d = [pj.place({"PP": 0}, [0, 1]), pj.replicate({"PP": 0}, [2, 3]),
       pj.replicate({"PP": 1}, [4, 5])]
  _raises(d, r"directive 1 \{\"op\": \"replicate\"", r"replicates over \[2, 3\] but node r0F0 was "
          r"placed on \[0, 1\]", "on the same devices")
  # Only the backward moved elsewhere: a region's F, B and update share one group.
  d = [pj.replicate({}, [0, 1]), pj.place({"PP": 0, "PASS": "B"}, [2])]
  _raises(d, r"directive 1 \{\"op\": \"place\"", r"puts node r0B0 on \[2\] but other nodes of "
          r"region 0 are on \[0, 1\]", "same devices")


def test_order_group_matching_nothing():
  d = [pj.split(2), pj.place({}, [0]), pj.order([{"PP": 0, "MB": 0}, {"PP": 5}])]
  _raises(d, r"directive 2 \{\"op\": \"order\"", r"filter \{'PP': 5\} \(group 1\) matches no node",
          "regions are PP=0, PP=1", "fix the filter")


def test_replicate_groups_not_a_mesh_axis():
  d = [pj.replicate({"PP": 0}, [0, 1]), pj.replicate({"PP": 1}, [2, 3, 4])]
  _raises(d, r"directive \d ", "mesh axis")


def test_overlapping_groups():
  d = [pj.replicate({"PP": 0}, [0, 1]), pj.replicate({"PP": 1}, [1, 2])]
  _raises(d, "overlap", "mesh axis")


def test_mixed_zero_stages():
  d = [pj.replicate({"PP": 0}, [0, 2], zero=1), pj.replicate({"PP": 1}, [1, 3], zero=3)]
  _raises(d, "ZeRO stages", "one zero")


def test_microbatch_filter_out_of_range():
  d = [pj.split(2), pj.place({}, [0]), pj.order([{"MB": 0}, {"MB": 5}])]
  _raises(d, r"directive 2 ", "microbatch 5")


def test_bad_directive_arguments():
  with pytest.raises(ValueError, match="zero must be"):
    pj.replicate({}, [0], zero=4)
  with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3, got True"):
    pj.replicate({}, [0], zero=True)
  for devices in ([0.0, 1.0], [0, 1.7], [True]):
    with pytest.raises(ValueError, match="devices must be integer device indices"):
      pj.place({}, devices)
  assert pj.replicate({}, np.arange(2)).devices == (0, 1)  # numpy's integers are integers
  with pytest.raises(ValueError, match=r"indices >= 0 .* got \[0, -1\]"):
    pj.place({}, [0, -1])
  with pytest.raises(ValueError, match="num_microbatches"):
    pj.split(0)
  with pytest.raises(ValueError, match="PASS"):
    pj.place({"PASS": "X"}, [0])
  with pytest.raises(ValueError, match="unknown directive op"):
    pj.load_directives([{"op": "teleport"}])
  # An entry that is no JSON (here an optimizer passed where directives go) is named too.
  with pytest.raises(ValueError, match="schedule entry 1 .*JSON object"):
    pj.load_directives([pj.split(2), object()])


def test_unknown_platform():
  params = init_mlp(jax.random.PRNGKey(0), 2)
  with pytest.raises(ValueError, match="platform must be 'cpu' or 'gpu'.*'tpu'"):
    pj.compile(mlp_loss(2), optimizer(), pj.strategies.data_parallel(2), params,
               random_batch(jax.random.PRNGKey(1), 16), platform="tpu")


def test_errors_come_before_compiling(monkeypatch):
  calls = []
  monkeypatch.setattr(jax, "jit", lambda *a, **k: calls.append(a) or (lambda *x: None))
  with pytest.raises(pj.PlanError):
    _compile([pj.place({"PP": 0}, [0])])
  assert not calls


def test_the_build_pauses_the_garbage_collector_and_gives_it_back():
  # pj.compile and step.compile trace with Python's collector paused (the loss when
  # building, the optimizer's update then and again in the step), and leave it as they
  # found it, when they fail too.
  import gc
  import optax
  seen = []
  inner = optimizer()
  tx = optax.GradientTransformation(
      inner.init, lambda *a: seen.append(gc.isenabled()) or inner.update(*a))
  params, batch = init_mlp(jax.random.PRNGKey(0), 2), random_batch(jax.random.PRNGKey(1), 16)
  step = pj.compile(mlp_loss(2), tx, pj.strategies.pipeline(2, 2, "1f1b"), params, batch)
  built = len(seen)
  step.compile()
  assert 0 < built < len(seen) and not any(seen) and gc.isenabled()
  with pytest.raises(pj.PlanError):
    pj.compile(mlp_loss(2), tx, [pj.place({"PP": 0}, [0])], params, batch)
  assert gc.isenabled()
  gc.disable()
  try:
    pj.compile(mlp_loss(2), tx, pj.strategies.pipeline(2, 2, "1f1b"), params, batch)
    assert not gc.isenabled()
  finally:
    gc.enable()


def test_annotation_inside_a_transformed_function():
  @jax.jit
  def block(w, x):
    with pj.annotate("PP"):
      return jnp.tanh(x @ w)

  def loss(params, batch):
    return jnp.mean(block(params["w"], batch["x"]) ** 2)

  params = {"w": jnp.ones((8, 4))}
  with pytest.raises(ValueError, match=r"pj.annotate\('PP'\) is used inside a `(p)?jit`"):
    pj.compile(loss, optimizer(), [pj.place({}, [0])], params, random_batch(jax.random.PRNGKey(0), 8))


@pytest.mark.parametrize("transform", ["scan", "remat"])
def test_annotation_inside_scan_and_remat(transform):
  def layer(x, w):
    with pj.annotate("PP"):
      return jnp.tanh(x @ w)

  def loss(params, batch):
    if transform == "scan":
      x, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), batch["x"], params["w"])
    else:
      x = jax.checkpoint(lambda w, x: layer(x, w))(params["w"][0], batch["x"])
    return jnp.mean(x ** 2)

  params, batch = {"w": jnp.ones((2, D_IN, D_IN))}, random_batch(jax.random.PRNGKey(0), 8)
  with pytest.raises(ValueError, match=r"pj.annotate\('PP'\) is used inside a `(scan|remat2|"
                     r"checkpoint)`.*annotate at the top level of the loss, around the transformed"):
    pj.compile(loss, optimizer(), [pj.place({}, [0])], params, batch)


def test_different_reduce_dtypes():
  d = [pj.replicate({"PP": 0}, [0, 2], reduce_dtype="bfloat16"), pj.replicate({"PP": 1}, [1, 3])]
  _raises(d, r"directive 0 ", "different gradient reduction dtypes", "same reduce_dtype")


def test_different_bucket_sizes():
  d = [pj.replicate({"PP": 0}, [0, 2], bucket_mb=10), pj.replicate({"PP": 1}, [1, 3], bucket_mb=20)]
  _raises(d, r"directive 0 ", "different bucket sizes \\[10, 20\\]", "one bucket_mb")


# Tiny regions for shard and shard_tensor, each with one operation the local evaluation
# cannot run on split tensors; `op` is applied inside the split region.
_E = 4  # experts; a batch of 32 rows traces as 2 data replicas x [4 experts, 4, D_IN]


def _ep_loss(op):
  def loss(params, batch):
    with pj.annotate("PP"):
      x = batch["x"].reshape(_E, -1, D_IN)  # dispatched tokens: [experts, capacity, d]
      with pj.annotate("EP"):
        y = op(jnp.einsum("ecd,edf->ecf", x, params["w"]))
      return jnp.mean(y ** 2)
  return loss


def _tp_loss(op):
  def loss(params, batch):
    with pj.annotate("PP"):
      h = batch["x"] @ params["w"].value  # column parallel: dimension 1 is split
      return jnp.mean(op(h) ** 2)
  return loss


_EP_OPS = {
    "cumsum": (lambda y: jnp.cumsum(y, axis=0), "`cumsum` works along dimension 0, which is split"),
    "sum": (lambda y: y - y.sum(axis=0, keepdims=True),
            r"`reduce_sum` reduces over split dimension\(s\) \[0\]"),
    "contract": (lambda y: jnp.einsum("ecd,ecd->cd", y, y)[None] * y,
                 r"`dot_general` contracts over the expert axis \(dimension 0\)"),
    "concatenate": (lambda y: jnp.concatenate([y, y])[:_E],
                    "`concatenate` concatenates along split dimension 0"),
    "split": (lambda y: jnp.concatenate(jnp.split(y, 2)[::-1]),
              "`split` splits along split dimension 0"),
    "slice": (lambda y: y * y[:1], "`slice` slices split dimension 0"),
    "rev": (lambda y: y[::-1], r"`rev` reverses split dimension\(s\) \[0\]"),
    "reshape": (lambda y: y.transpose(1, 0, 2).reshape(-1, D_IN).reshape(_E, -1, D_IN),
                r"`reshape` reshapes \(4, 4, 8\) to \(16, 8\) in a way that mixes the split "
                r"dimension 1"),
    "gather": (lambda y: y[jnp.array([1, 0, 3, 2])], "`gather` is not supported on split tensors"),
    "output": (lambda y: jnp.ones((_E, 1)) * y.sum(axis=(1, 2))[None],
               r"output 0 \[4, 4\] does not keep the expert axis first"),
}
_TP_OPS = {
    "sort": (lambda h: jnp.sort(h, axis=1), "`sort` works along dimension 1, which is split"),
    "argmax": (lambda h: h * jnp.argmax(h, axis=1, keepdims=True),
               r"`argmax` reduces over split dimension\(s\) \[1\]"),
    "max": (lambda h: jax.nn.softmax(h, axis=1),
            "`reduce_max` takes the maximum over split dimension"),
    "contract and keep": (lambda h: h @ h[:16], "contracts over a split dimension while keeping"),
    "outer": (lambda h: h[:, :, None] * h[:, None, :], r"`mul` would split dimensions \[1, 2\]"),
    "pad": (lambda h: jnp.pad(h, ((0, 0), (0, 2))), "`pad` is not supported on split tensors"),
    "reshape": (lambda h: h.reshape(-1), "`reshape` .* mixes the split dimension 1"),
}


def test_ep_weights_cast_before_the_region():
  # A bf16 model that casts its expert weights before the EP block hands the region
  # activations, not parameters: the message says to cast inside.
  def loss(params, batch):
    with pj.annotate("PP"):
      x = batch["x"].reshape(_E, -1, D_IN)
      w = params["w"].astype(jnp.bfloat16)
      with pj.annotate("EP"):
        y = jnp.einsum("ecd,edf->ecf", x.astype(jnp.bfloat16), w)
      return jnp.mean(y.astype(jnp.float32) ** 2)
  directives = [pj.replicate({}, [0, 1]), pj.shard({"EP": 0}, [0, 1])]
  with pytest.raises(pj.DirectiveError, match=r"directive 1 .*region 1 \(PP=0,EP=0\) reads no "
                     r"parameters: read the expert weights \(and cast them\) inside"):
    pj.compile(loss, optimizer(), directives, {"w": jnp.ones((_E, D_IN, D_IN))},
               {"x": jnp.ones((32, D_IN))})


@pytest.mark.parametrize("kind,name", [("ep", k) for k in _EP_OPS] + [("tp", k) for k in _TP_OPS])
def test_unsupported_ops_in_split_regions(kind, name):
  op, pattern = (_EP_OPS if kind == "ep" else _TP_OPS)[name]
  if kind == "ep":
    loss, params = _ep_loss(op), {"w": jnp.ones((_E, D_IN, D_IN))}
    directives = [pj.replicate({}, [0, 1]), pj.shard({"EP": 0}, [0, 1])]
    where = r"region 1 \(PP=0,EP=0\) under shard: "
  else:
    loss, params = _tp_loss(op), {"w": nn.Partitioned(jnp.ones((D_IN, 16)), names=(None, "tp"))}
    directives = [pj.replicate({}, [0, 1]), pj.shard_tensor({}, [0, 1])]
    where = r"region 0 \(PP=0\) under shard_tensor: "
  batch = {"x": jnp.ones((32, D_IN))}
  with pytest.raises(ValueError) as info:
    pj.compile(loss, optimizer(), directives, params, batch)
  msg = str(info.value)
  assert re.search(where + ".*" + pattern, msg), msg
  # Every message also says what to change.
  assert re.search(r"; (experts must not mix|apply it along|write this part|keep |only one|"
                   r"split only|an EP region must return)", msg), msg


def _mlp_step():
  params = init_mlp(jax.random.PRNGKey(0), 2)
  step = pj.compile(mlp_loss(2), optimizer(), pj.strategies.pipeline(2, 2), params,
                    random_batch(jax.random.PRNGKey(1), 16))
  return step, params


def test_init_with_params_of_other_shapes_or_dtypes():
  step, params = _mlp_step()
  wide = dict(params, stage1={**params["stage1"], "w": jnp.ones((16, 17))})
  with pytest.raises(ValueError, match=r"params\['stage1'\]\['w'\] has shape \(16, 17\), but the "
                     r"step was compiled for \(16, 16\) \(the params given to pj.compile\)"):
    step.init(wide)
  # A silent cast would change what the step trains; the message says how to cast.
  half = dict(params, embed=params["embed"].astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r"params\['embed'\] has dtype bfloat16, but the step was "
                     r"compiled for float32 .*`.astype\(jnp.float32\)`"):
    step.init(half)


def test_batch_of_another_dtype():
  step, params = _mlp_step()
  state = step.init(params)
  batch = random_batch(jax.random.PRNGKey(2), 16)
  with pytest.raises(ValueError, match=r"batch\['y'\] has dtype int16, but the step was compiled "
                     r"for int32 \(the example batch's\); cast it with `.astype\(jnp.int32\)`"):
    step(state, dict(batch, y=batch["y"].astype(jnp.int16)))
  with pytest.raises(ValueError, match=r"batch\['x'\] has dtype bfloat16.*float32"):
    step(state, dict(batch, x=batch["x"].astype(jnp.bfloat16)))
  with pytest.raises(ValueError, match=r"batch\['x'\] has shape \(8, 8\), but the step was "
                     r"compiled for \(16, 8\)"):
    step(state, random_batch(jax.random.PRNGKey(2), 8))
  # numpy's int64 and float64 are taken as jit takes them: 32 bits unless x64 is on.
  if not jax.config.jax_enable_x64:
    step._batch_leaves({"x": np.asarray(batch["x"], np.float64),
                        "y": np.asarray(batch["y"], np.int64)})


@pytest.mark.parametrize("extra", [np.zeros(8, np.float32), np.float32(1.0)], ids=["rows", "scalar"])
@pytest.mark.parametrize("name", ["a", "z"])  # sorted before and after the batch's leaves
def test_batch_leaf_without_the_batchs_rows(extra, name):
  # Whichever leaf comes first, the message names the leaves and what they must share.
  batch = dict(random_batch(jax.random.PRNGKey(1), 16), **{name: extra})
  params = init_mlp(jax.random.PRNGKey(0), 2)
  with pytest.raises(ValueError, match=r"do not share a leading axis \(.*batch\['" + name +
                     r"'\] \(" + ",".join(str(d) for d in np.shape(extra)) + r",?\).*the batch's "
                     r"rows first"):
    pj.compile(mlp_loss(2), optimizer(), [pj.split(4)], params, batch)


def test_a_split_projection_with_fewer_heads_than_devices():
  # Three heads of 8 over 2 devices: the split projection's 24 columns become 3 heads,
  # which do not divide; the message names the sizes and the group to pick.
  loss = _tp_loss(lambda h: h.reshape(h.shape[0], 3, 8).sum(axis=-1))
  params = {"w": nn.Partitioned(jnp.ones((D_IN, 24)), names=(None, "tp"))}
  directives = [pj.replicate({}, [0, 1]), pj.shard_tensor({}, [0, 1])]
  with pytest.raises(ValueError, match=r"reshapes \(32, 24\) to \(32, 3, 8\): the split "
                     r"dimension 1 becomes dimension 1 of size 3, which does not divide over 2 "
                     r"devices; use a group of devices whose size divides 3"):
    pj.compile(loss, optimizer(), directives, params, {"x": jnp.ones((32, D_IN))})
