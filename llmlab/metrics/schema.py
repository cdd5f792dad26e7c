"""The metrics JSON of ``llmlab train --metrics-json`` as a JSON Schema, and its validator.

The schema (:data:`SCHEMA_PATH`, ``llmlab/metrics/train_metrics.schema.json``) is the contract of
docs/CONTRACT.md in machine-readable form: required fields, their types and units. Objects allow
extra fields, so a new measurement (a per-step ``grad_norm``, a mesh coordinate ``cp``) is added
to the schema's ``properties``, and to ``required`` if every run reports it.

Validation uses the ``jsonschema`` package (in the ``dev`` extra; the library itself does not
need it): the tests validate every metrics file they write.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

SCHEMA_PATH = Path(__file__).with_name("train_metrics.schema.json")


@lru_cache(maxsize=1)
def train_metrics_schema() -> dict:
    """The schema as a dict."""
    return json.loads(SCHEMA_PATH.read_text())


def validate_train_metrics(metrics: dict) -> None:
    """Raise ``jsonschema.ValidationError`` (naming the path of the offending field) unless
    ``metrics`` follows the schema. Needs ``jsonschema`` (``pip install llmlab[dev]``)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(train_metrics_schema())
    cls(train_metrics_schema()).validate(metrics)


def strict_json(obj):
    """A copy of ``obj`` (dicts, lists, numbers, strings) that ``json.dumps(..., allow_nan=False)``
    accepts: every non-finite float becomes ``None``, and a dict that held one gets a
    ``"nonfinite"`` entry naming the key and what it was, e.g. ``{"loss": None, "nonfinite":
    {"loss": "nan"}}``. In a list, a non-finite element becomes ``None`` only."""
    if isinstance(obj, dict):
        out = {k: strict_json(v) for k, v in obj.items()}
        bad = {k: str(v).lower() for k, v in obj.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad:
            out["nonfinite"] = dict(out.get("nonfinite") or {}) | bad
        return out
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
