"""What a newcomer meets first: strict Piper JSON, errors that name the fix, a split alone,
compiling ahead of the first batch."""

import json

import jax
import numpy as np
import pytest

import piper_jax as pj
from models import init_mlp, mlp_loss, optimizer, random_batch, reference_run

pytestmark = pytest.mark.timeout(240)


def _model(n_stages=2):
  return (mlp_loss(n_stages), init_mlp(jax.random.PRNGKey(0), n_stages),
          random_batch(jax.random.PRNGKey(1), 16))


@pytest.mark.parametrize("entry,match", [
    ({"op": "replicate", "filter": {}, "devices": [0, 1], "zero_stage": 1},
     r"schedule entry 1 .*unknown key 'zero_stage' \(did you mean 'zero'\?\); a replicate "
     r"entry takes 'op', 'filter', 'devices', 'zero', 'shard_grads'"),
    ({"op": "place", "filter": {"PP": 0}, "device": [0]},
     r"schedule entry 1 .*unknown key 'device' \(did you mean 'devices'\?\)"),
    ({"op": "split", "filter": {}}, r"schedule entry 1 .*missing key 'num_microbatches'"),
    ({"op": "order"}, r"missing key 'filters'; an? order entry takes"),
])
def test_piper_json_is_read_strictly(entry, match):
  with pytest.raises(ValueError, match=match):
    pj.load_directives([{"op": "split", "num_microbatches": 2}, entry])


def test_piper_spellings_still_load(tmp_path):
  entries = [{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},
             {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2], "shard_grads": True,
              "shard_params": True, "bucket_size": 25, "reduce_stream": "r", "gather_stream": "g"},
             {"op": "place", "filter": {"PP": 1}, "devices": [1], "stream": "s"}]
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(entries))
  d = pj.load_directives(str(path))
  assert d[1].zero == 3 and d[1].bucket_mb == 25 and d[2].stream == "s"
  assert pj.load_directives(pj.dump_directives(d)) == d


def test_a_tag_in_the_wrong_case_gets_did_you_mean():
  loss, params, batch = _model()
  with pytest.raises(pj.DirectiveError, match=r"directive 0 .*unknown tag 'pp'.*did you mean 'PP'\?"):
    pj.plan(loss, [pj.place({"pp": 0}, [0])], params, batch, n_devices=2)


def test_a_bad_pass_names_the_directive():
  with pytest.raises(ValueError, match=r"pj.place filter \{'PASS': 'f'\}: PASS must be one of "
                                       r"\['F', 'B', 'BI', 'BW'\] or '\*', got 'f' \(did you mean 'F'\?\)"):
    pj.place({"PASS": "f"}, [0])


def test_a_pipeline_of_fewer_stages_than_regions_says_so():
  loss, params, batch = _model(n_stages=4)
  with pytest.raises(pj.DirectiveError, match=r"The model has 4 PP regions \(PP=0..3\) but the "
                                              r"directives place 2 \(PP=0, PP=1\).*n_stages=4"):
    pj.plan(loss, pj.strategies.pipeline(2, 2), params, batch, n_devices=8)


def test_an_unplaced_model_names_place_everything():
  loss, params, batch = _model()
  with pytest.raises(pj.DirectiveError, match=r"pj.place\(\{\}, \[0\]\) to run the whole model"):
    pj.plan(loss, [pj.place({"PP": 0}, [0]), pj.place({"PASS": "F", "PP": 1}, [0])], params,
            batch, n_devices=1)


def test_a_device_past_the_cpus_names_the_flag():
  loss, params, batch = _model()
  with pytest.raises(pj.DirectiveError, match=r"device index 2 is out of range.*"
                                              r"xla_force_host_platform_device_count=N"):
    pj.compile(loss, optimizer(), pj.strategies.data_parallel(4), params, batch,
               devices=jax.devices()[:2])


def test_a_split_alone_is_gradient_accumulation_on_one_device():
  loss, params, batch = _model()
  step = pj.compile(loss, optimizer(), [pj.split(4)], params, batch)
  assert step.plan.n_microbatches == 4 and len(step.mesh.devices.flat) == 1
  state = step.init(params)
  losses = []
  for _ in range(2):
    state, l = step(state, batch)
    losses.append(float(l))
  ref_losses, ref_params = reference_run(loss, params, [batch, batch], optimizer())
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(step.params(state)),
                  jax.tree_util.tree_leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_compile_ahead_of_the_first_batch():
  loss, params, batch = _model()
  step = pj.compile(loss, optimizer(), pj.strategies.data_parallel(2), params, batch)
  compiled = step.compile()
  assert isinstance(compiled, jax.stages.Compiled)
  assert step.compile() is compiled  # once
  state, first = step(step.init(params), batch)
  again = pj.compile(loss, optimizer(), pj.strategies.data_parallel(2), params, batch)
  _, lazily = again(again.init(params), batch)
  assert float(first) == float(lazily)
