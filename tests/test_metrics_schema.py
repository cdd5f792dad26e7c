"""The metrics JSON contract as a JSON Schema (llmlab/metrics/train_metrics.schema.json).

Every metrics file the tests write is validated by the session fixture in the root conftest.py;
here: the schema is a valid Draft 2020-12 schema, a real run with every optional section passes,
and files with a per-step, per-rank or config field missing or mistyped are rejected.
"""

import copy
import json

import jsonschema
import pytest

import llmlab
from llmlab.metrics.schema import SCHEMA_PATH, train_metrics_schema, validate_train_metrics
from llmlab.training import trainer


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("schema") / "m.json"
    llmlab.train(
        llmlab.TrainConfig(steps=2, pp=2, num_microbatches=2, metrics_json=str(path)), progress=False
    )
    return json.loads(path.read_text())


def test_the_schema_is_a_valid_schema_and_the_tests_use_it():
    jsonschema.Draft202012Validator.check_schema(train_metrics_schema())
    assert train_metrics_schema()["$schema"].endswith("/draft/2020-12/schema")
    assert SCHEMA_PATH.name == "train_metrics.schema.json"
    assert trainer.write_metrics.__name__ == "validated"  # the root conftest's check is in place


def test_a_real_pipeline_run_validates(pipeline_run):
    validate_train_metrics(pipeline_run)
    assert "pipeline" in pipeline_run and len(pipeline_run["ranks"]) == 2


@pytest.mark.parametrize(
    "path",
    [
        ("steps", 0, "loss"),
        ("steps", 1, "step_time_s"),
        ("steps", 0, "tokens_per_s"),
        ("steps", 1, "grad_norm"),
        ("steps", 0, "lr"),
        ("steps", 0, "skipped"),
        ("ranks", 0, "comm_bytes", "all_reduce"),
        ("ranks", 1, "memory_bytes", "activations_peak"),
        ("ranks", 0, "coords", "tp"),
        ("config", "world_size"),
        ("pipeline", "bubble_fraction_theory"),
    ],
)
def test_a_missing_field_is_rejected(pipeline_run, path):
    bad = copy.deepcopy(pipeline_run)
    node = bad
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(jsonschema.ValidationError, match=f"'{path[-1]}' is a required property"):
        validate_train_metrics(bad)


@pytest.mark.parametrize(
    "path, value",
    [
        (("steps", 0, "loss"), "4.2"),
        (("steps", 0, "step"), 0),
        (("ranks", 0, "comm_bytes", "send"), -1),
        (("pipeline", "bubble_fraction_measured"), 1.5),
        (("config", "zero"), 4),
        (("steps", 0, "grad_norm"), -1.0),
        (("steps", 0, "skipped"), "no"),
    ],
)
def test_a_wrong_type_or_range_is_rejected(pipeline_run, path, value):
    bad = copy.deepcopy(pipeline_run)
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_train_metrics(bad)


def test_extra_fields_are_allowed_so_the_schema_can_grow(pipeline_run):
    ok = copy.deepcopy(pipeline_run)
    ok["steps"][0]["grad_norm_clipped"] = 1.0
    ok["steps"][1]["grad_norm"] = None  # a skipped fp16 step
    ok["ranks"][0]["coords"]["cp"] = 0
    validate_train_metrics(ok)
    ok["ranks"][0]["coords"]["cp"] = "zero"  # but a coordinate is still an integer
    with pytest.raises(jsonschema.ValidationError):
        validate_train_metrics(ok)


def test_metrics_are_strict_json_nonfinite_values_null_and_flagged(pipeline_run):
    from llmlab.metrics.schema import strict_json

    bad = copy.deepcopy(pipeline_run)
    bad["steps"][0]["loss"] = float("nan")
    with pytest.raises(ValueError):
        json.dumps(bad, allow_nan=False)  # a bare NaN is not JSON
    ok = json.loads(json.dumps(strict_json(bad), allow_nan=False))
    assert ok["steps"][0]["loss"] is None and ok["steps"][0]["nonfinite"] == {"loss": "nan"}
    validate_train_metrics(ok)
    ok["steps"][0]["nonfinite"] = {"loss": "big"}
    with pytest.raises(jsonschema.ValidationError):
        validate_train_metrics(ok)
