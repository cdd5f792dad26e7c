"""The planner: which layouts of a model fit a cluster, and which is fastest (``llmlab plan``).

One idea per file: :mod:`~llmlab.planner.specs` (the model and the workload),
:mod:`~llmlab.planner.cluster` (GPUs, links, presets), :mod:`~llmlab.planner.layout` (a layout and the
space searched), :mod:`~llmlab.planner.memory` and :mod:`~llmlab.planner.step_time` (the cost model,
built on :mod:`llmlab.formulas`), :mod:`~llmlab.planner.search` (evaluate and rank),
:mod:`~llmlab.planner.api` (:func:`plan`), :mod:`~llmlab.planner.calibrate` and
:mod:`~llmlab.planner.validate` (this machine), :mod:`~llmlab.planner.report`,
:mod:`~llmlab.planner.inputs` (the command line's flags checked) and :mod:`~llmlab.planner.cli`. The cost model and where it is wrong: docs/planner.md.
"""

from llmlab.planner.api import plan
from llmlab.planner.cluster import NODE_PRESETS, ClusterSpec, cluster_preset
from llmlab.planner.layout import Layout
from llmlab.planner.specs import ModelSpec, Workload

__all__ = ["plan", "ClusterSpec", "NODE_PRESETS", "cluster_preset", "Layout", "ModelSpec", "Workload"]
