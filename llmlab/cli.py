"""``llmlab`` command line: ``train``, ``estimate``, ``generate``, ``bench``, ``doctor``.

Thin by design: it parses, validates and calls the package. Subcommands other than ``train``
live next to what they run; each such module offers ``add_arguments(parser)`` and
``run(args) -> int`` and is listed in :data:`SUBCOMMANDS`. A subcommand whose module has not
landed yet answers "not supported yet" with exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). "bench <what>" entries become sub-subcommands of ``bench``.
SUBCOMMANDS = {
    "estimate": ("llmlab.estimate", "the three walls: memory, compute and communication calculators"),
    "generate": ("llmlab.inference.cli", "offline generation with the paged-KV-cache engine"),
    "doctor": ("llmlab.doctor", "what this machine offers and how each lab will run here"),
    "bench serve": ("llmlab.inference.bench", "serving benchmark against Hugging Face generate"),
    "bench comm": ("llmlab.parallel.comm_bench", "collective bandwidth (all-reduce, all-gather, ...)"),
}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from llmlab.model.config import PRESETS
    from llmlab.training.config import TrainConfig
    d = TrainConfig()
    p.add_argument("--model", default=d.model, choices=sorted(PRESETS), help="model preset")
    p.add_argument("--config", default=None, help="JSON/YAML file of flags (command line wins)")
    for name in ("dp", "tp", "pp", "ep"):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{name} degree")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--dp-mode", default=d.dp_mode, choices=["naive", "ddp", "ring"],
                   help="data-parallel gradient sync (default: bucketed, overlapped ddp)")
    p.add_argument("--bucket-mb", type=float, default=d.bucket_mb, help="DDP bucket size in MB")
    p.add_argument("--pp-schedule", default=d.pp_schedule, choices=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--num-microbatches", type=int, default=d.num_microbatches)
    p.add_argument("--virtual-stages", type=int, default=d.virtual_stages)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--global-batch-size", type=int, default=d.global_batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=["constant", "linear", "cosine"],
                   help="decay after warm-up, to --min-lr at the last step")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help="linear warm-up from 0 to --lr over this many steps")
    p.add_argument("--min-lr", type=float, default=d.min_lr, help="learning rate at the last step")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, metavar="MAX_NORM",
                   help="clip the global gradient norm to MAX_NORM")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default=d.dtype, choices=["fp32", "bf16", "fp16"],
                   help="compute dtype; bf16/fp16 keep fp32 master weights (fp16 adds loss scaling)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--metrics-json", default=None, help="write the run's metrics (CONTRACT) here")
    p.add_argument("--save-model", default=None,
                   help="after training, write the model as config.json + model.safetensors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace, argv: list[str]) -> int:
    from llmlab.training.config import TrainConfig
    from llmlab.training.trainer import train
    import dataclasses
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    if args.config:
        # Flags given explicitly on the command line override the file.
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
        cfg = TrainConfig.from_file(args.config, **{k: v for k, v in values.items() if k in given})
    else:
        cfg = TrainConfig(**values)
    import os
    leader = os.environ.get("RANK", "0") == "0"  # under torchrun every rank runs this
    metrics = train(cfg, progress=not args.no_progress and leader)
    if not leader:
        return 0
    steps = metrics["steps"]
    if steps:
        print(f"step {steps[0]['step']}: loss {steps[0]['loss']:.4f} -> step {steps[-1]['step']}: "
              f"loss {steps[-1]['loss']:.4f}  ({steps[-1]['tokens_per_s']:.0f} tokens/s, "
              f"{cfg.world_size} rank{'s' if cfg.world_size > 1 else ''})")
    if cfg.metrics_json:
        print(f"metrics written to {cfg.metrics_json}")
    if args.save_model:
        print(f"model written to {args.save_model}")
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="llmlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(sub.add_parser("train", help="train a model on dp*tp*pp ranks"))
    bench = sub.add_parser("bench", help="benchmarks: serve, comm")
    bench_sub = bench.add_subparsers(dest="bench_what", required=True)
    handlers = {}
    for name, (module, help_) in SUBCOMMANDS.items():
        parent = bench_sub if name.startswith("bench ") else sub
        p = parent.add_parser(name.split()[-1], help=help_)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not (e.name and module.startswith(e.name)):
                raise
            mod = None
        if mod is not None:
            mod.add_arguments(p)
        handlers[name] = (module, mod)
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return run_train(args, argv)
        name = f"bench {args.bench_what}" if args.command == "bench" else args.command
        module, mod = handlers[name]
        if mod is None:
            print(f"llmlab {name}: not supported yet ({module} has not landed)", file=sys.stderr)
            return 2
        return int(mod.run(args) or 0)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"llmlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
