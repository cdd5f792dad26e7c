"""The planner's ranked table (GB = 1e9 bytes, times in seconds)."""

from __future__ import annotations


def count(n: float) -> str:
    """A parameter count in the unit that suits it: ``230k``, ``6.6M``, ``70.6B``, ``1.2T``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def seconds(x: float, step: float) -> str:
    """``x`` seconds to 3 significant digits; float noise (below 1e-9 of the step) is 0."""
    return f"{0.0 if abs(x) <= 1e-9 * step else x:.3g}"


def headline(result: dict) -> str | None:
    """``None`` when some layout fits; else the line that says none does and by how much."""
    rows = result["layouts"]
    if any(r["fits"] for r in rows):
        return None
    least = min(rows, key=lambda r: r["memory_bytes_per_gpu"])
    return (
        f"NO LAYOUT FITS: of {len(rows)} layouts the smallest, {least['name']} zero "
        f"{least['zero']}, {least['why_not']}; add GPUs (--num-gpus), memory (--gpu-memory-gb) "
        f"or shrink the model or batch"
    )


def format_table(result: dict, top: int = 15) -> str:
    """The ranked table (the :func:`headline` first when nothing fits)."""
    m, c, w = result["model"], result["cluster"], result["workload"]
    lines = [
        f"{m['name']}: {count(m['num_params'])} parameters ({m['num_layers']} layers, "
        f"hidden {m['hidden']}); {c['num_gpus']} x {c['name']} GPUs "
        f"({c['gpu_memory_bytes'] / 1e9:.0f} GB, {c['gpus_per_node']} per node); "
        f"seq {w['seq_len']}, {w['global_batch_tokens']:,} tokens/step, {w['dtype']}",
        f"{result['num_layouts']} valid layouts in {result['search_time_s']:.2f} s; "
        f"best first (step = compute + exposed comm + bubble)",
        f"{'#':>3} {'layout':<22} {'zero':>4} {'m':>4} {'rc':>4} {'mem GB':>7} {'fits':<5} "
        f"{'step s':>8} {'compute':>8} {'comm':>8} {'bubble':>8} {'MFU':>5} "
        f"{'tokens/s':>10} {'days':>7}",
    ]
    for i, r in enumerate(result["layouts"][:top], 1):
        lines.append(
            f"{i:>3} {r['name']:<22} {r['zero']:>4} {r['num_microbatches']:>4} "
            f"{'full' if r['recompute'] == 'full' else '-':>4} "
            f"{r['memory_bytes_per_gpu'] / 1e9:>7.4g} {'yes' if r['fits'] else 'NO':<5} "
            f"{r['step_time_s']:>8.3g} {r['compute_s']:>8.3g} "
            f"{seconds(r['exposed_comm_s'], r['step_time_s']):>8} "
            f"{seconds(r['bubble_s'], r['step_time_s']):>8} {r['mfu']:>5.2f} {r['tokens_per_s']:>10.4g} "
            f"{r['days_to_train']:>7.3g}"
        )
    head = headline(result)
    if head:
        lines.insert(0, head)
    notfit = [r for r in result["layouts"] if not r["fits"]]
    if notfit and not headline(result):
        lines.append(
            f"{len(notfit)} layouts do not fit, e.g. {notfit[0]['name']} "
            f"zero {notfit[0]['zero']}: {notfit[0]['why_not']}"
        )
    return "\n".join(lines)


def format_validation(v: dict) -> str:
    lines = [
        f"validation on this machine ({v['world_size']} ranks, {v['backend']}): memory = "
        f"{v['memory_quantity']}",
        f"{'layout':<28} {'pred MB':>8} {'meas MB':>8} {'err':>6} {'pred s':>8} {'meas s':>8}",
    ]
    for r in v["layouts"]:
        lines.append(
            f"{r['label']:<28} {r['memory_predicted'] / 1e6:>8.2f} "
            f"{r['memory_measured'] / 1e6:>8.2f} {r['memory_rel_err']:>6.1%} "
            f"{r['step_time_predicted_s']:>8.4f} {r['step_time_measured_s']:>8.4f}"
        )
    lines.append(
        f"memory max relative error {v['memory_max_rel_err']:.1%}; step-time Spearman {v['spearman']:.2f}"
    )
    return "\n".join(lines)
