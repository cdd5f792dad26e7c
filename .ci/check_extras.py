"""Fail unless every requirement of llmlab's tested extras that applies here is installed.

The tests skip the Triton kernels only on platforms the ``kernels`` extra does not cover; on the
others a missing package must stop CI here, with its name, rather than surface as a skip or an
import error deep in the run. Usage: ``python .ci/check_extras.py dev`` (extras included by
``dev``, such as ``llmlab[kernels]``, are followed).
"""
import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement


def missing(extras: list[str]) -> list[str]:
    reqs = [Requirement(r) for r in metadata.requires("llmlab") or []]
    todo, seen, out = list(extras), set(), []
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for r in reqs:
            if r.marker is None or not r.marker.evaluate({"extra": extra}):
                continue
            if r.name == "llmlab":          # an extra that includes others: llmlab[kernels]
                todo += sorted(r.extras)
                continue
            try:
                version = metadata.version(r.name)
            except metadata.PackageNotFoundError:
                out.append(f"{r} (extra {extra!r}): not installed")
                continue
            if r.specifier and not r.specifier.contains(version, prereleases=True):
                out.append(f"{r} (extra {extra!r}): {version} installed")
    return out


if __name__ == "__main__":
    problems = missing(sys.argv[1:] or ["dev"])
    for p in problems:
        print(f"missing requirement: {p}", file=sys.stderr)
    sys.exit(1 if problems else 0)
