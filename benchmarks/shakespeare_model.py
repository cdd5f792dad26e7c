"""Train and measure the shipped ``shakespeare`` model (llmlab/assets/models/shakespeare).

Two measures, both printed by ``measure`` (and asserted by ``measure --check``):

- **held-out loss**: mean next-byte cross-entropy (nats per byte) on the last tenth of the bundled
  corpus (``llmlab.data.corpus_tokens("heldout")``), which :class:`llmlab.data.BatchLoader` never
  samples, so no training run ever saw it. The tenth is cut into consecutive windows of 257
  bytes; every byte after the first of a window is predicted.
- **real words**: the prompts "ROMEO:", "JULIET:", "KING HENRY:", "First Citizen:", 300 new
  tokens each at temperature 0.8, seed 0, through ``llmlab.inference.LLM``; a word is a
  lower-cased run of letters and apostrophes; the score is the share of the generated words that
  also occur in the corpus.

Usage (from the repository root)::

    PYTHONPATH=$PWD nice python benchmarks/shakespeare_model.py train --steps 1000 \\
        --out llmlab/assets/models/shakespeare            # keeps the step with the best held-out loss
    PYTHONPATH=$PWD python benchmarks/shakespeare_model.py measure --check

Training is a plain single-process loop over llmlab's model and loader (the same maths as
``llmlab train`` at dp=1), plus what a model meant to be *used* needs and the teaching trainer
leaves out: warm-up and cosine learning-rate decay, weight decay, gradient clipping, and
evaluation on the held-out tenth to keep the best step.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

from llmlab.data import BatchLoader, corpus_tokens, load_corpus
from llmlab.model.config import get_preset
from llmlab.model.hf import save_hf_checkpoint
from llmlab.model.llama import LlamaForCausalLM

PROMPTS = ["ROMEO:", "JULIET:", "KING HENRY:", "First Citizen:"]
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "llmlab" / "assets" / "models" / "shakespeare"
TARGET_LOSS, TARGET_WORDS = 1.9, 0.80
_WORD = re.compile(r"[a-z']+")


def words(text: str) -> list[str]:
    """Lower-cased runs of letters and apostrophes."""
    return _WORD.findall(text.lower())


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, window: int = 256) -> float:
    """Mean cross-entropy (nats/byte) on the held-out tenth, in consecutive windows of ``window``
    predicted bytes (the first byte of each window is context only)."""
    model.eval()
    ids = corpus_tokens("heldout")
    total, count = 0.0, 0
    for s in range(0, ids.numel() - 1, window):
        chunk = ids[s: s + window + 1]
        if chunk.numel() < 2:
            break
        logits = model(chunk[None, :-1])
        loss = torch.nn.functional.cross_entropy(logits[0].float(), chunk[1:], reduction="sum")
        total, count = total + float(loss), count + chunk.numel() - 1
    model.train()
    return total / count


def samples(model_dir: str | Path, max_tokens: int = 300) -> list[str]:
    from llmlab.inference import LLM, SamplingParams
    llm = LLM(str(model_dir))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens))
    return [o.outputs[0].text for o in outs]


def real_word_share(texts: list[str]) -> float:
    vocab = set(words(load_corpus()))
    ws = [w for t in texts for w in words(t)]
    return sum(w in vocab for w in ws) / max(1, len(ws))


def measure(model_dir: str | Path) -> dict:
    from llmlab.model.hf import load_hf_model
    model = load_hf_model(model_dir)
    texts = samples(model_dir)
    return {"heldout_loss_nats_per_byte": heldout_loss(model),
            "real_word_share": real_word_share(texts),
            "parameters": sum(p.numel() for p in model.parameters()),
            "samples": dict(zip(PROMPTS, texts))}


def train(args) -> None:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_preset(args.preset, max_position_embeddings=max(args.seq_len,
                                                                get_preset(args.preset).max_position_embeddings))
    model = LlamaForCausalLM(cfg, seed=args.seed)
    loader = BatchLoader(global_batch_size=args.batch, seq_len=args.seq_len, seed=args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step: int) -> float:
        if step <= args.warmup:
            return args.lr * step / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))

    best, log = float("inf"), []
    t0 = time.time()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = loader.global_batch(step)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.log_every and step % args.log_every == 0:
            print(json.dumps({"step": step, "train_loss": round(loss.item(), 4),
                              "elapsed_s": round(time.time() - t0, 1)}), flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            held = heldout_loss(model)
            rec = {"step": step, "train_loss": loss.item(), "heldout_loss": held,
                   "lr": lr_at(step), "elapsed_s": round(time.time() - t0, 1)}
            if held < best:
                best = held
                save_hf_checkpoint(model, args.out)
                rec["saved"] = True
            log.append(rec)
            print(json.dumps(rec), flush=True)
    (Path(args.out) / "training_log.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "log": log}, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train, keeping the step with the best held-out loss")
    t.add_argument("--out", default=str(DEFAULT_DIR), help="model directory to write (default: the shipped one)")
    t.add_argument("--preset", default="shakespeare", help="model preset (default: shakespeare)")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: 1000)")
    t.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    t.add_argument("--seq-len", type=int, default=384,
                   help="tokens per sequence; longer than prompt + 300 sampled tokens (default: 384)")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    t.add_argument("--min-lr", type=float, default=1e-4, help="final learning rate (default: 1e-4)")
    t.add_argument("--warmup", type=int, default=50, help="warm-up steps (default: 50)")
    t.add_argument("--weight-decay", type=float, default=0.1, help="on matrices (default: 0.1)")
    t.add_argument("--eval-every", type=int, default=100, help="held-out evaluation interval (default: 100)")
    t.add_argument("--log-every", type=int, default=0, help="print the training loss every N steps (default: off)")
    t.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default: 0)")
    t.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    m = sub.add_parser("measure", help="held-out loss and real-word share, with the samples")
    m.add_argument("--model", default=str(DEFAULT_DIR), help="model directory (default: the shipped one)")
    m.add_argument("--check", action="store_true",
                   help=f"exit 1 unless loss <= {TARGET_LOSS} and real words >= {TARGET_WORDS:.0%}")
    args = p.parse_args(argv)
    if args.cmd == "train":
        train(args)
        return 0
    r = measure(args.model)
    print(f"held-out loss: {r['heldout_loss_nats_per_byte']:.3f} nats/byte  "
          f"real words: {r['real_word_share']:.1%}  parameters: {r['parameters']:,}")
    for prompt, text in r["samples"].items():
        print(f"\n--- {prompt} ---\n{prompt}{text}")
    if args.check and not (r["heldout_loss_nats_per_byte"] <= TARGET_LOSS
                           and r["real_word_share"] >= TARGET_WORDS):
        print(f"FAIL: targets are loss <= {TARGET_LOSS} and real words >= {TARGET_WORDS:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
