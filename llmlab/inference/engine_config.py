"""``EngineConfig``: every setting of :class:`~llmlab.inference.engine.LLMEngine`, and the engine
flags of ``llmlab serve``, ``llmlab generate`` and ``llmlab bench serve`` generated from it.

The model is vLLM's ``EngineArgs`` (its names, where vLLM has the setting): one dataclass field per
setting, with its default and ``--help`` text (:func:`option`). A CLI adds the flags of the fields
it offers with :func:`add_engine_arguments` and builds the config back with :func:`from_args`, so a
setting is declared once, here, as ``TrainConfig`` declares training's.

The kernel choices (``paged_attention``, ``packed_linear``, ``cpu_fused``: the engine's fast paths,
docs/kernels.md) are fields too; their defaults are the process-wide ones of :mod:`llmlab.kernels`
(``LLMLAB_KERNELS=paged_attention=cpu,packed_linear,cpu_fused`` or ``llmlab.kernels.enable(...)``)
at the time the config is made, and the engine reads only the config.

A config is checked once, when it is made (``__post_init__`` calls :meth:`EngineConfig.validate`):
the engine, ``build_engines`` and the CLIs pass it on without checking it again.

The request limits (``max_logprobs`` ... ``max_tokens_limit``) keep one request from taking a
small machine down: each is a ``llmlab serve`` flag, enforced by the engine in ``add_request``
(so ``LLM.generate`` too). The HTTP server's own limits (body size, prompts per request,
streams) are :class:`llmlab.serve.config.ServerConfig`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from llmlab.inference.outputs import StepMetrics

SWAP_SPACE_BYTES = 4 * 2**30  # vLLM's default swap_space: 4 GiB of host memory per GPU


def option(
    default: typing.Any,
    help: str,
    choices: Iterable[object] | None = None,
    cli: bool = True,
    factory: typing.Callable[[], typing.Any] | None = None,
) -> typing.Any:
    """An :class:`EngineConfig` field: its default (or ``factory()``, called when a config is
    made), ``--help`` text, allowed values and whether a CLI may offer it as a flag
    (``cli=False``: Python-only, e.g. a callback or a dtype)."""
    meta = {"help": help, "cli": cli} | ({"choices": tuple(choices)} if choices is not None else {})
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _kernel_default(name: str) -> typing.Callable[[], typing.Any]:
    """The process-wide default of kernel choice ``name`` (:func:`llmlab.kernels.settings`,
    which ``LLMLAB_KERNELS`` initialises), read when a config is made."""

    def default() -> typing.Any:
        from llmlab import kernels

        return getattr(kernels.settings(), name)

    return default


@dataclass
class EngineConfig:
    """The engine's settings (vLLM's names). Sizes in tokens, blocks or bytes as named.
    :meth:`validate` raises ``ValueError`` naming the first bad field."""

    # --- the KV cache and the scheduler ----------------------------------------------------------
    block_size: int = option(16, "tokens per KV-cache block")
    num_gpu_blocks: int | None = option(
        None,
        "KV-cache blocks (default: room for max-num-seqs full-length sequences, capped by "
        "kv-cache-memory-bytes)",
    )
    num_host_blocks: int | None = option(
        None,
        "host blocks for swap preemption (default with swap: what swap-space-bytes holds, at "
        "most num-gpu-blocks)",
    )
    max_num_seqs: int = option(256, "sequences per step")
    max_num_batched_tokens: int | None = option(None, "tokens per step (default: max(2048, max-model-len))")
    max_model_len: int | None = option(None, "context length (default: the model's max_position_embeddings)")
    enable_prefix_caching: bool = option(False, "reuse the KV blocks of prompt prefixes already computed")
    enable_chunked_prefill: bool = option(
        False, "split long prompts' prefill over steps of max-num-batched-tokens"
    )
    preemption_mode: str | None = option(
        None,
        "how a sequence gives up its blocks when the cache is full (default: swap on CUDA, else recompute)",
        choices=("recompute", "swap"),
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "bytes for the KV cache when num-gpu-blocks is not given (default: 64 MiB on CPU, "
        "40%% of free memory on CUDA)",
    )
    swap_space_bytes: int = option(SWAP_SPACE_BYTES, "host memory for swapped blocks, bytes")
    # --- the model --------------------------------------------------------------------------------
    device: str = option(
        "auto",
        "where the engine runs (auto: a GPU if there is one, else the CPU)",
        choices=("auto", "cpu", "cuda"),
    )
    dtype: torch.dtype = option(torch.float32, "weights and cache dtype", cli=False)
    quantization: str | None = option(
        None,
        "int8-weight-only: linear weights in int8 with per-channel scales, float arithmetic "
        "(int8: the same); w8a8: int8 weights and per-token int8 activations, int8 products",
        choices=("int8", "int8-weight-only", "w8a8"),
    )
    smoothquant_alpha: float = option(
        0.6,  # llmlab.inference.smooth_quant.ALPHA
        "w8a8: SmoothQuant's migration strength in [0, 1], activation outliers moved into the "
        "weights per channel, calibrated on the start of the bundled corpus (0: no smoothing)",
    )
    tensor_parallel_size: int = option(1, "ranks the model is sharded over")
    pipeline_parallel_size: int = option(
        1,
        "pipeline stages the layers are split into (each stage "
        "tensor-parallel over tensor-parallel-size ranks)",
    )
    distributed_executor_backend: str = option(
        "mp",
        "how the ranks are started: mp (processes on this host) or ray (actors placed on a "
        "Ray cluster: ray start --head / --address first)",
        choices=("mp", "ray"),
    )
    seed: int = option(0, "seed for requests that send none")
    generation_defaults: dict[str, typing.Any] | None = option(
        None,
        "sampling fields a request leaves unset (default: the checkpoint's generation_config.json)",
        cli=False,
    )
    check_invariants: bool = option(False, "verify the block pool after every step", cli=False)
    on_step: typing.Callable[[StepMetrics], object] | None = option(
        None, "called with each StepMetrics", cli=False
    )
    # --- kernels (docs/kernels.md) ------------------------------------------------------------------
    paged_attention: str = option(
        None,
        "attention over the paged cache: auto (Triton on CUDA tensors when installed, else "
        "PyTorch), triton, reference (PyTorch), cpu (the C++ kernel for CPU tensors, Triton on "
        "CUDA ones) (default: llmlab.kernels' setting, LLMLAB_KERNELS)",
        choices=("auto", "triton", "reference", "cpu"),
        cli=False,
        factory=_kernel_default("paged_attention"),
    )
    packed_linear: bool = option(
        None,
        "on a CPU device, linear weights prepacked once for oneDNN (F.linear where the CPU "
        "cannot pack the dtype, llmlab.kernels.cpu_linear)",
        cli=False,
        factory=_kernel_default("packed_linear"),
    )
    cpu_fused: bool = option(
        None,
        "the C++ RMSNorm, SwiGLU and rotary operators for CPU tensors (llmlab.kernels.cpu_fused)",
        cli=False,
        factory=_kernel_default("cpu_fused"),
    )
    # --- request limits ---------------------------------------------------------------------------
    max_logprobs: int = option(
        20, "most log-probabilities per token a request may ask for (logprobs, top_logprobs, prompt_logprobs)"
    )
    max_n: int = option(16, "most samples per prompt (n)")
    max_stop_strings: int = option(16, "most stop strings per request")
    max_stop_string_chars: int = option(256, "longest stop string, characters")
    max_tokens_limit: int | None = option(
        None, "largest max_tokens a request may ask for (default: what the context leaves)"
    )
    profile_dir: str | None = option(
        None,
        "folder for the engine's PyTorch profiler traces "
        "(LLMEngine.start_profile/stop_profile; llmlab serve: "
        "POST /start_profile, /stop_profile)",
    )
    # --- images (a vision-language model; llmlab.inference.multimodal) ---------------------------
    min_pixels: int = option(56 * 56, "images smaller than this (pixels) are scaled up to it")
    max_pixels: int = option(
        28 * 28 * 1280,
        "images larger than this (pixels) are scaled down to it: the cap on an image's tokens (28x28 each)",
    )
    limit_mm_per_prompt: int = option(4, "most images in one prompt")
    max_image_pixels: int = option(
        89_478_485, "refuse an image whose header claims more pixels (decompression bombs; Pillow's limit)"
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "EngineConfig":
        """Raise ``ValueError`` naming the first field out of its range (or a kernel this machine
        cannot build). Called once, when the config is made; call it again after changing a
        field in place."""
        for name in (
            "block_size",
            "max_num_seqs",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "max_n",
            "max_stop_strings",
            "max_stop_string_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("num_gpu_blocks", "max_num_batched_tokens", "max_model_len", "max_tokens_limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v} must be >= 1 (or None)")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"min_pixels={self.min_pixels} and max_pixels={self.max_pixels} must "
                f"satisfy 1 <= min_pixels <= max_pixels"
            )
        for name in ("limit_mm_per_prompt", "max_image_pixels"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.smoothquant_alpha <= 1:
            raise ValueError(f"smoothquant_alpha={self.smoothquant_alpha} must be in [0, 1]")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs} must be >= 0")
        for name in (
            "quantization",
            "preemption_mode",
            "paged_attention",
            "distributed_executor_backend",
        ):  # device: where it is used
            v, choices = getattr(self, name), _FIELDS[name].metadata["choices"]
            if v is not None and v not in choices:
                raise ValueError(
                    f"{name}={v!r}: supported values are None and " + ", ".join(repr(c) for c in choices)
                )
        self._check_kernels()
        if self.profile_dir:
            from llmlab.metrics.profiling import check_dir

            check_dir(self.profile_dir, "--profile-dir")
        return self

    def _check_kernels(self) -> None:
        from llmlab.kernels import cpu_build, cpu_linear

        if (self.paged_attention == "cpu" or self.cpu_fused) and not cpu_build.available():
            field = "paged_attention='cpu'" if self.paged_attention == "cpu" else "cpu_fused=True"
            raise ValueError(f"{field} needs a C++ compiler and the ninja package (pip install ninja)")
        if self.packed_linear and not cpu_linear.available():
            raise ValueError("packed_linear=True needs PyTorch built with oneDNN (mkldnn)")


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def field_names(cli_only: bool = True) -> list[str]:
    """The config's field names (``cli_only``: those a CLI may offer as flags)."""
    return [f.name for f in dataclasses.fields(EngineConfig) if f.metadata["cli"] or not cli_only]


def add_engine_arguments(
    p: argparse._ActionsContainer,  # a parser or an argument group
    names: list[str] | None = None,
    overrides: dict[str, dict[str, typing.Any]] | None = None,
) -> None:
    """One flag per field in ``names`` (default: every CLI field), ``max_num_seqs`` ->
    ``--max-num-seqs`` with the field's type, default, help and choices. ``overrides``:
    ``{name: {"default": ..., "help": ..., "choices": ...}}`` where a CLI differs (e.g.
    ``bench serve`` runs on the CPU by default)."""
    hints = typing.get_type_hints(EngineConfig)
    for name in names if names is not None else field_names():
        f, over = _FIELDS[name], (overrides or {}).get(name, {})
        field_default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        kind = hints[name]
        args = typing.get_args(kind)
        if args:  # X | None
            kind = next(a for a in args if a is not type(None))
        flag = "--" + name.replace("_", "-")
        default = over.get("default", field_default)
        help_ = over.get("help", f.metadata["help"])
        if kind is bool:
            p.add_argument(flag, action="store_true", default=default, help=help_)
            continue
        choices = over.get("choices", f.metadata.get("choices"))
        p.add_argument(
            flag,
            type=kind,
            default=default,
            help=help_,
            choices=choices,
            metavar=None if choices else {int: "N", float: "X"}.get(kind),
        )


def from_args(args: argparse.Namespace, names: list[str] | None = None, **extra: typing.Any) -> EngineConfig:
    """The :class:`EngineConfig` of the flags :func:`add_engine_arguments` added (``names``),
    plus ``extra`` fields (checked as it is made). Raises ``ValueError`` naming a bad value."""
    kw = {n: getattr(args, n) for n in (names if names is not None else field_names()) if hasattr(args, n)}
    return EngineConfig(**{**kw, **extra})


def resolve(config: EngineConfig | None, engine_args: dict[str, typing.Any]) -> EngineConfig:
    """The config an engine runs: ``config`` as it is (checked when it was made), with
    ``engine_args`` replacing its fields (a new config, checked), or one made of ``engine_args``."""
    if config is None:
        return EngineConfig(**engine_args)
    return dataclasses.replace(config, **engine_args) if engine_args else config
