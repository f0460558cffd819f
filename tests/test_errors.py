"""Bad input raises a clear error before anything compiles, naming the directive."""

import re

import jax
import pytest

import piper_jax as pj
from models import init_mlp, mlp_loss, optimizer, random_batch

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


def test_order_across_devices():
  d = [pj.place({"PP": 0}, [0]), pj.place({"PP": 1}, [1]),
       pj.order([{"PP": 1, "PASS": "F"}, {"PP": 0, "PASS": "B"}])]
  _raises(d, r"directive 2 ", "share no device", "across devices cannot be kept")


def test_unplaced_region():
  _raises([pj.place({"PP": 0}, [0])], "region 1", "unplaced", "place or replicate")


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
  with pytest.raises(ValueError, match="num_microbatches"):
    pj.split(0)
  with pytest.raises(ValueError, match="PASS"):
    pj.place({"PASS": "X"}, [0])
  with pytest.raises(ValueError, match="unknown directive op"):
    pj.load_directives([{"op": "teleport"}])
  # An entry that is no JSON (here an optimizer passed where directives go) is named too.
  with pytest.raises(ValueError, match="schedule entry 1 .*JSON object"):
    pj.load_directives([pj.split(2), object()])


def test_errors_come_before_compiling(monkeypatch):
  calls = []
  monkeypatch.setattr(jax, "jit", lambda *a, **k: calls.append(a) or (lambda *x: None))
  with pytest.raises(pj.PlanError):
    _compile([pj.place({"PP": 0}, [0])])
  assert not calls


def test_annotation_inside_a_transformed_function():
  import jax.numpy as jnp

  @jax.jit
  def block(w, x):
    with pj.annotate("PP"):
      return jnp.tanh(x @ w)

  def loss(params, batch):
    return jnp.mean(block(params["w"], batch["x"]) ** 2)

  params = {"w": jnp.ones((8, 4))}
  with pytest.raises(ValueError, match=r"pj.annotate\('PP'\) is used inside a `(p)?jit`"):
    pj.compile(loss, optimizer(), [pj.place({}, [0])], params, random_batch(jax.random.PRNGKey(0), 8))


def test_different_reduce_dtypes():
  d = [pj.replicate({"PP": 0}, [0, 2], reduce_dtype="bfloat16"), pj.replicate({"PP": 1}, [1, 3])]
  _raises(d, r"directive 0 ", "different gradient reduction dtypes", "same reduce_dtype")


def test_different_bucket_sizes():
  d = [pj.replicate({"PP": 0}, [0, 2], bucket_mb=10), pj.replicate({"PP": 1}, [1, 3], bucket_mb=20)]
  _raises(d, r"directive 0 ", "different bucket sizes \\[10, 20\\]", "one bucket_mb")
