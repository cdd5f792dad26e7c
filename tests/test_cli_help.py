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
