"""``llmlab.plan(...)``: the planner in one call (what ``llmlab plan`` runs)."""

from __future__ import annotations

import time

from llmlab.planner.cluster import GB, ClusterSpec, cluster_preset
from llmlab.planner.search import search
from llmlab.planner.serve_spec import ServeWorkload
from llmlab.planner.specs import ModelSpec, Workload, from_hf_config, from_params, from_preset


def resolve_model(model=None, params=None, config=None, **shape) -> ModelSpec:
    """A :class:`ModelSpec` from exactly one of a preset name / spec, a parameter count (with
    optional ``num_layers``, ``hidden``, ``heads``, ``kv_heads``, ``vocab``) or a config.json."""
    given = [x is not None for x in (model, params, config)]
    if sum(given) != 1:
        raise ValueError("give exactly one of --model PRESET, --params N or --config config.json")
    if isinstance(model, ModelSpec):
        return model.validate()
    if model is not None:
        return from_preset(model).validate()
    if config is not None:
        return from_hf_config(config).validate()
    return from_params(params, **{k: v for k, v in shape.items() if v is not None}).validate()


def _serve_workload(workload: Workload | ServeWorkload | None) -> ServeWorkload | None:
    if isinstance(workload, Workload):
        raise TypeError("plan(serve=True) takes a ServeWorkload, not a training Workload")
    return workload


def _train_workload(workload: Workload | ServeWorkload | None) -> Workload:
    """``workload`` (default: ``Workload()``), checked."""
    if isinstance(workload, ServeWorkload):
        raise TypeError("a ServeWorkload is for plan(serve=True); training takes a Workload")
    return (workload or Workload()).validate()


def plan(
    model=None,
    *,
    params=None,
    config=None,
    cluster: ClusterSpec | str = "a800",
    num_gpus: int = 8,
    workload: Workload | ServeWorkload | None = None,
    max_microbatches: int = 64,
    zero_stages=(0, 1, 2, 3),
    serve: bool = False,
    **overrides,
) -> dict:
    """Rank every valid layout of a model on a cluster.

    ``serve=True``: the serving question instead (:func:`llmlab.planner.serve_api.plan_serve`,
    ``llmlab plan --serve``): ``workload`` is then a
    :class:`~llmlab.planner.serve_spec.ServeWorkload` and the keywords are ``plan_serve``'s.

    Args:
        model: a preset name (``tiny``, ``llama3-70b``, ...) or a :class:`ModelSpec`; or
            ``params=8e9`` (with shape keywords ``num_layers``, ``hidden``, ``heads``,
            ``kv_heads``, ``vocab``), or ``config="config.json"``.
        cluster: a node preset name (a100, a800, h100, h200) scaled to ``num_gpus``, or a
            :class:`ClusterSpec`; keyword overrides of ClusterSpec fields (``gpu_memory_bytes``,
            or ``gpu_memory_gb`` as the CLI's flag, ``gpus_per_node``, ...) apply to a preset.
        workload: sequence length, global batch in tokens, dtype, optimizer, token budget.

    Returns:
        ``{"model", "cluster", "workload", "num_layouts", "search_time_s", "layouts": [...]}``
        with the layouts best first (:func:`llmlab.planner.search.evaluate` rows).

    Raises:
        ValueError: an unknown preset, a shape or cluster that breaks a constraint, or no
            valid layout at all (the message names why the simplest one fails).
    """
    if serve:
        from llmlab.planner.serve_api import plan_serve

        return plan_serve(
            model,
            params=params,
            config=config,
            cluster=cluster,
            num_gpus=num_gpus,
            workload=_serve_workload(workload),
            **overrides,
        )
    shape = {
        k: overrides.pop(k) for k in ("num_layers", "hidden", "heads", "kv_heads", "vocab") if k in overrides
    }
    spec = resolve_model(model, params, config, **shape)
    if overrides.get("gpu_memory_gb") is not None:  # the CLI's unit
        overrides["gpu_memory_bytes"] = overrides.pop("gpu_memory_gb") * GB
    if isinstance(cluster, str):
        cluster = cluster_preset(cluster, num_gpus, **overrides)
    cluster = cluster.validate()
    workload = _train_workload(workload)
    t0 = time.perf_counter()
    rows = search(spec, workload, cluster, max_microbatches, zero_stages)
    if not rows:
        from llmlab.planner.layout import Layout, why_invalid

        reason = why_invalid(Layout(dp=cluster.num_gpus), spec, workload, cluster.gpus_per_node)
        raise ValueError(
            f"no valid layout of {spec.name} on {cluster.num_gpus} GPUs"
            + (f" (e.g. DP{cluster.num_gpus}: {reason})" if reason else "")
        )
    return {
        "model": spec.to_dict(),
        "cluster": cluster.to_dict(),
        "workload": vars(workload),
        "num_layouts": len(rows),
        "search_time_s": time.perf_counter() - t0,
        "layouts": rows,
        "units": {"memory": "bytes", "time": "seconds", "GB": GB},
    }
