"""``llmlab <command> --help``: every flag of every subcommand says what it does and its default,
once (``train``'s flags are checked against TrainConfig in test_train.py)."""

import argparse

from llmlab.cli import HelpFormatter, build_parser


def _subparsers(parser, prefix=""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{prefix}{name} ")
    if prefix:
        yield prefix.strip(), parser


def test_every_subcommand_flag_has_help_and_its_default_once():
    commands = dict(_subparsers(build_parser()))
    assert {"generate", "serve", "estimate", "doctor", "bench serve", "bench comm"} <= set(commands)
    fmt = HelpFormatter("llmlab")
    checked = 0
    for name, parser in commands.items():
        if name in ("train", "bench"):
            continue
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = f"llmlab {name} {action.option_strings[0]}"
            assert action.help and action.help.strip(), f"{flag} has no help text"
            shown = fmt._get_help_string(action) % {"default": action.default}
            assert "default" in shown, f"{flag}: help does not give the default: {shown!r}"
            assert shown.count("(default") <= 1, f"{flag}: default shown twice: {shown!r}"
            assert "(default: None)" not in shown and "(default: False)" not in shown, shown
            checked += 1
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, name
    assert checked > 60, checked


def test_engine_flags_are_generated_from_engine_config():
    """serve, generate and bench serve declare no engine flag of their own: each is an
    EngineConfig field, parsed back into the config (bad values name the flag)."""
    import dataclasses

    import pytest

    from llmlab.inference import bench, cli as generate_cli
    from llmlab.inference.engine_config import EngineConfig, field_names
    from llmlab.serve import cli as serve_cli

    commands = dict(_subparsers(build_parser()))
    for name, fields in (
        ("serve", field_names()),
        ("generate", generate_cli.ENGINE_FLAGS),
        ("bench serve", bench.ENGINE_FLAGS),
    ):
        dests = {a.dest for a in commands[name]._actions}
        assert set(fields) <= dests, (name, set(fields) - dests)
    assert "seed" not in generate_cli.ENGINE_FLAGS
    assert not {"max_request_body_bytes", "max_prompts_per_request"} & set(field_names())
    serve_dests = {a.dest for a in commands["serve"]._actions}  # the server's own: ServerConfig
    assert {"max_request_body_bytes", "max_concurrent_streams", "allowed_hosts"} <= serve_dests
    args = build_parser().parse_args(
        ["serve", "--max-n", "3", "--block-size", "8", "--enable-prefix-caching"]
    )
    cfg = serve_cli.engine_config(args)
    assert cfg == EngineConfig(max_n=3, block_size=8, enable_prefix_caching=True)
    assert {f.name for f in dataclasses.fields(EngineConfig)} - set(field_names()) == {
        "dtype",
        "generation_defaults",
        "check_invariants",
        "on_step",  # Python-only fields
        "paged_attention",
        "packed_linear",
        "cpu_fused",
    }  # (kernels: LLMLAB_KERNELS)
    with pytest.raises(ValueError, match="--max-n 0 must be >= 1"):
        serve_cli.validate(build_parser().parse_args(["serve", "--max-n", "0"]))
