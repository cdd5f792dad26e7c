"""``llmlab`` command line: ``train``, ``estimate``, ``generate``, ``serve``, ``bench``, ``doctor``, ``classroom``.

Thin by design: it parses, validates and calls the package. ``train``'s flags are generated from
:class:`~llmlab.training.config.TrainConfig`; the other subcommands live next to what they run:
each such module offers ``add_arguments(parser)`` and ``run(args) -> int`` and is listed in
:data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). "<group> <what>" entries become sub-subcommands of the group.
SUBCOMMANDS = {
    "estimate": ("llmlab.estimate", "the three walls: memory, compute and communication calculators"),
    "generate": ("llmlab.inference.cli", "offline generation with the paged-KV-cache engine"),
    "serve": ("llmlab.serve.cli", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"),
    "plan": (
        "llmlab.planner.cli",
        "choose a DP x TP x PP x CP (x EP) layout: predicted memory and step time, ranked; --serve: serving layouts",
    ),
    "doctor": ("llmlab.doctor", "what this machine offers and how each lab will run here"),
    "bench serve": (
        "llmlab.serve.bench_cli",
        "serving benchmark: offline against Hugging Face generate, or --endpoint URL over HTTP",
    ),
    "bench comm": ("llmlab.tools.comm_bench", "collective bandwidth (all-reduce, all-gather, ...)"),
    "classroom results": (
        "llmlab.classroom.results",
        "a room's exercise results as a table: who solved which exercise",
    ),
}
# Commands that only group others ("bench serve", "classroom results").
GROUPS = {
    "bench": "benchmarks: serve, comm",
    "classroom": "for the instructor of a room of learners: results",
}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`~llmlab.training.config.TrainConfig` field (``seq_len`` ->
    ``--seq-len``), with the field's type, help text, default and choices, plus the CLI-only
    ``--config`` and ``--no-progress``.

    The TrainConfig flags are parsed with ``default=SUPPRESS``: the namespace holds exactly the
    flags given on the command line, so they can override a ``--config`` file; the defaults live
    in TrainConfig alone and are shown in ``--help``.
    """
    import dataclasses
    import typing

    from llmlab.training.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="JSON/YAML file of TrainConfig keys (flags on the command line win)",
    )
    for f in dataclasses.fields(TrainConfig):
        kind = hints[f.name]
        args = typing.get_args(kind)
        if args:  # X | None
            kind = next(a for a in args if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if kind is bool and not f.default:
            p.add_argument(
                flag, action="store_true", default=argparse.SUPPRESS, help=f"{help_} (default: off)"
            )
        elif kind is bool:  # on by default: --no-<flag> turns it off
            p.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"{help_} (default: on)",
            )
        else:
            if "default" not in help_:
                help_ += f" (default: {'none' if f.default is None else f.default})"
            p.add_argument(
                flag,
                type=kind,
                default=argparse.SUPPRESS,
                help=help_,
                choices=f.metadata.get("choices"),
                metavar=None if "choices" in f.metadata else {int: "N", float: "X"}.get(kind),
            )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from llmlab.training.config import TrainConfig, check_inputs

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    cfg = TrainConfig.from_file(args.config, **given) if args.config else TrainConfig(**given)
    check_inputs(cfg)  # bad flags are refused here, before torch is imported (seconds)
    from llmlab.training.trainer import train

    leader = os.environ.get("RANK", "0") == "0"  # under torchrun every rank runs this
    if cfg.resume and leader:
        from llmlab.training.checkpoint import latest_checkpoint

        if (
            latest_checkpoint(cfg.require_checkpoint_dir()) is None
        ):  # as Megatron, say so rather than start silently
            print(f"no valid checkpoint in {cfg.checkpoint_dir}: starting from step 1", file=sys.stderr)
    metrics = train(cfg, progress=not args.no_progress and leader)
    if not leader:
        return _rank_done()
    steps = metrics["steps"]
    if steps:  # throughput of the whole run: its tokens over the sum of its step times
        tokens = len(steps) * cfg.global_batch_size * cfg.seq_len
        tokens_per_s = tokens / sum(s["step_time_s"] for s in steps)
        print(
            f"step {steps[0]['step']}: loss {steps[0]['loss']:.4f} -> step {steps[-1]['step']}: "
            f"loss {steps[-1]['loss']:.4f}  ({tokens_per_s:.0f} tokens/s over {len(steps)} "
            f"step{'s' if len(steps) > 1 else ''}, {cfg.world_size} rank{'s' if cfg.world_size > 1 else ''})"
        )
    else:  # only a resumed run can have no step left
        print(
            f"nothing to train: the latest checkpoint in {cfg.checkpoint_dir} is already at "
            f"step {cfg.steps} or later (--steps {cfg.steps})"
        )
    evals = [s for s in steps if s.get("eval_loss") is not None]
    if evals:
        print("held-out loss: " + ", ".join(f"step {s['step']} {s['eval_loss']:.4f}" for s in evals))
    if cfg.metrics_json:
        print(f"metrics written to {cfg.metrics_json}")
    if cfg.save_model:
        what = "PEFT adapter" if cfg.lora_rank is not None else "model"
        print(f"{what} written to {cfg.save_model}")
    return _rank_done()


def _rank_done() -> int:
    """0; under torchrun the rank's process ends here, output flushed, without the interpreter's
    teardown, as ``llmlab.launch``'s ranks and the tensor-parallel workers do: process-group
    threads racing the teardown can abort a finished rank ("terminate called without an active
    exception", SIGABRT, seen once in the torchrun test on a loaded machine), and torchrun then
    reports the whole job failed."""
    import os
    from llmlab.runtime.launch import under_torchrun

    if under_torchrun() and os.environ.get("TORCHELASTIC_RUN_ID"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends each flag's help with its default, once: not where the help text already says it
    (``(default: the checkpoint's, else 128)``), ``off`` for a switch, ``none`` for no value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "default" in help_ or not action.option_strings or action.default is argparse.SUPPRESS:
            return help_
        if action.nargs == 0 and action.default is False:  # store_true
            return f"{help_} (default: off)"
        return f"{help_} (default: {'none' if action.default is None else '%(default)s'})"


def _chosen(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (``"train"``, ``"bench comm"``), ``None`` when it names none
    (``llmlab --help``, ``llmlab --version``): the first words that are not flags."""
    words = [a for a in argv if not a.startswith("-")][:2]
    if not words:
        return None
    return " ".join(words) if words[0] in GROUPS and len(words) > 1 else words[0]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``llmlab`` parser. With ``argv``, only the subcommand it names gets its flags (the
    others only their one-line help), so ``llmlab --version`` and ``llmlab --help`` import no
    subcommand module, hence not torch; without ``argv``, every subcommand gets its flags."""
    from llmlab import __version__

    chosen = _chosen(argv) if argv is not None else None
    full = argv is None
    parser = argparse.ArgumentParser(
        prog="llmlab",
        description="llmlab: train and serve large language models at scale on "
        "torch.distributed, and measure what it costs (llmlab <command> --help for each command)",
    )
    parser.add_argument("--version", action="version", version=f"llmlab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model on dp*cp*tp*pp ranks")
    if full or chosen == "train":
        add_train_arguments(train)
    groups = {}
    for group, help_ in GROUPS.items():
        groups[group] = sub.add_parser(group, help=help_).add_subparsers(dest="what", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        parent = groups[name.split()[0]] if " " in name else sub
        # Other commands' flags show their defaults; train's help texts carry them already.
        p = parent.add_parser(name.split()[-1], help=help_, formatter_class=HelpFormatter)
        p.set_defaults(module=module)
        if full or chosen == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def _report_rank_error(command: str, e) -> None:
    """One error line, the failed rank's own traceback, and where its log is."""
    print(f"llmlab {command}: error: {str(e).splitlines()[0]}", file=sys.stderr)
    if e.rank_traceback:
        print(e.rank_traceback.rstrip(), file=sys.stderr)
    if e.log_dir:
        print(f"log: {e.log_dir}/rank{e.rank}.log", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run ``llmlab <command>``. Exit codes: 0 done, 2 bad input (refused before any rank starts),
    1 a rank failed (reported as one error line, that rank's traceback and its log path), or a
    value in the job's rendezvous store was forged (reported as one line naming rank and key)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    from llmlab.runtime.result_auth import ForgedValueError

    if getattr(args, "what", None):  # errors name the whole command: "llmlab bench comm"
        args.command = f"{args.command} {args.what}"
    try:
        if args.command == "train":
            return run_train(args)
        return int(importlib.import_module(args.module).run(args) or 0)
    except ForgedValueError as e:
        print(f"llmlab {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"llmlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # A RankError can only come from llmlab.runtime.launch once imported (it imports torch:
        # a command that launches no rank, such as ``classroom results``, does not pay for it).
        launch = sys.modules.get("llmlab.runtime.launch")
        if launch is None or not isinstance(e, launch.RankError):
            raise
        _report_rank_error(args.command, e)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
