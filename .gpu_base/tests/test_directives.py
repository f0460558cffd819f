"""Directives: constructors, Piper JSON round trip, schedules and strategies."""

import json

import pytest

import piper_jax as pj

pytestmark = pytest.mark.timeout(30)


def test_json_round_trip(tmp_path):
  ds = [pj.split(4), pj.place({"PP": 0}, [0], stream="s0"),
        pj.replicate({"PP": "*"}, [0, 1], zero=1, bucket_mb=25),
        pj.replicate({"PP": 1}, [2, 3], zero=2, reduce_dtype="bfloat16"),
        pj.replicate({"PP": 2}, [4, 5], zero=3),
        pj.shard({"EP": "*"}, [0, 1]), pj.shard_tensor({"PP": 0}, [0, 1], axis="tp"),
        pj.order([[{"PP": 0, "PASS": "F", "MB": 0}, {"PP": 0, "PASS": "B", "MB": 1}],
                  {"PP": 0, "PASS": "B", "MB": 0}])]
  path = tmp_path / "s.json"
  pj.dump_directives(ds, path)
  again = pj.load_directives(str(path))
  assert again == ds
  assert pj.dump_directives(again) == json.loads(path.read_text())


def test_reduce_dtype_values():
  import jax.numpy as jnp
  assert pj.replicate({}, [0, 1], reduce_dtype=jnp.bfloat16).reduce_dtype == "bfloat16"
  with pytest.raises(ValueError, match="reduce_dtype must be one of"):
    pj.replicate({}, [0, 1], reduce_dtype="int8")


def test_piper_keys_map_to_zero():
  d = pj.load_directives([{"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1],
                           "shard_grads": True, "bucket_size": 50}])[0]
  assert d.zero == 2 and d.bucket_mb == 50
  d = pj.load_directives([{"op": "replicate", "filter": {}, "devices": [0, 1],
                           "shard_grads": True, "shard_params": True}])[0]
  assert d.zero == 3


@pytest.mark.parametrize("op", ["place", "replicate", "shard", "shard_tensor"])
def test_entry_without_filter_is_rejected(op):
  entry = {"op": op, "devices": [0, 1]}
  with pytest.raises(ValueError, match=r'^schedule entry 1 \{"op": "%s", "devices": \[0, 1\]\}: '
                                       r'a %s entry needs a "filter": add "filter": \{\} to match '
                                       r'every node' % (op, op)):
    pj.load_directives([{"op": "split", "num_microbatches": 2}, entry])
  with pytest.raises(ValueError, match=r'^\{"op": "%s", .*needs a "filter"' % op):
    pj.Directive.from_json({**entry, "filter": None})
  assert pj.load_directives([{**entry, "filter": {}}])[0].filter == ()


def test_one_f_one_b_order_per_stage():
  orders = pj.schedules.one_f_one_b(2, 4)
  first = [dict(g[0])["PASS"] + str(dict(g[0])["MB"]) for g in orders[0].groups]
  last = [dict(g[0])["PASS"] + str(dict(g[0])["MB"]) for g in orders[1].groups]
  assert first == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
  assert last == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_gpipe_order():
  (o,) = pj.schedules.gpipe(1, 3)
  assert [dict(g[0])["PASS"] + str(dict(g[0])["MB"]) for g in o.groups] == [
      "F0", "F1", "F2", "B0", "B1", "B2"]


def test_pipeline_strategy_devices():
  ds = pj.strategies.pipeline(2, 4, dp=2, zero=1)
  reps = [d for d in ds if isinstance(d, pj.Replicate)]
  assert [d.devices for d in reps] == [(0, 2), (1, 3)] and all(d.zero == 1 for d in reps)
  with pytest.raises(ValueError, match="unknown schedule"):
    pj.strategies.pipeline(2, 4, schedule="nope")


def test_public_surface():
  expected = {"annotate", "compile", "TrainStep", "TrainState", "place", "replicate", "shard",
              "shard_tensor", "split", "order", "load_directives", "dump_directives",
              "schedules", "strategies", "DirectiveError", "PlanError"}
  assert expected <= set(pj.__all__)
  for name in pj.__all__:
    assert hasattr(pj, name), name
