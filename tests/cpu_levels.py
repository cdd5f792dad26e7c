"""The CPU levels a C++ kernel test runs at: this CPU's own and the one below it
(``LLMLAB_CPU_ISA``), with a check of which build ran (llmlab.kernels.cpu_isa)."""

from types import ModuleType
from typing import Any

import pytest

from llmlab.kernels import cpu_isa

LEVELS = [None] + [lv for lv in [cpu_isa.fallback()] if lv]  # the current level, and the one below


def level_fixture(kernels: ModuleType) -> Any:
    """A fixture running a test with the build of ``kernels`` for this CPU's level, then with
    LLMLAB_CPU_ISA forcing the level below it (its own build: no AVX-512 code under avx2),
    checking ``kernels.isa()`` says which build ran."""

    @pytest.fixture(params=LEVELS, ids=lambda lv: lv or "native")
    def level(request: Any, monkeypatch: Any) -> str | None:
        if request.param:
            monkeypatch.setenv(cpu_isa.ENV, request.param)
        assert kernels.isa() == (request.param or cpu_isa.cpu_isa())
        return request.param

    return level
