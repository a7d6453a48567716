"""The ``arstream`` command: one argparse tree, built here, from the modules that own each subcommand.

Each subcommand's module provides ``add_arguments(parser)`` and ``run(args) -> int``.
Only the module of the subcommand being run (or asked for ``--help``) is imported,
so ``arstream --help`` answers without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

from . import __version__


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # e.g. ("bench", "model")
    module: str  # provides add_arguments(parser) and run(args)
    summary: str  # one line for the parent's command list
    # "module:function" adding the options, where that is lighter than importing ``module`` (no torch for --help)
    arguments: str | None = None
    # "module:function" checking the parsed options before ``module`` is imported: an exit status, or None to go
    # on (so a bad flag is refused in well under a second, not after torch has loaded)
    precheck: str | None = None


COMMANDS: tuple[Command, ...] = (
    Command(
        ("serve",),
        "arstream.app.server",
        "serve a world model over WebSocket, with the demo page at /",
        arguments="arstream.app.settings:add_serve_arguments",
        precheck="arstream.app.address:refusal_before_loading",
    ),
    Command(("plan",), "arstream.app.plan", "what a model takes on a GPU, and how many sessions fit"),
    Command(("drain",), "arstream.programs.drain", "move a replica's live sessions to peers, then let it exit"),
    Command(("client",), "arstream.programs.client", "run one scripted session against a server and save its frames"),
    Command(("bench", "runner"), "arstream.programs.bench_runner", "the runner's bookkeeping cost against a direct loop"),
    Command(("bench", "model"), "arstream.programs.bench_model", "frames per second of a model through the runner"),
    Command(("bench", "serve"), "arstream.programs.bench", "end-to-end load test of the server against the bare runner"),
    Command(("bench", "gpu-check"), "arstream.programs.gpu_check", "the GPU check: h264, tiny-world, matrix-game-2 served"),
    Command(("train", "tiny-world"), "arstream.programs.tiny_world.train", "train tiny-world (the shipped recipe)"),
    Command(
        ("train", "tiny-world-decoder"),
        "arstream.programs.tiny_world.train_decoder",
        "train tiny-world's frame decoder on a frozen transformer",
    ),
    Command(("eval", "tiny-world"), "arstream.programs.tiny_world.evaluate", "responsiveness and drift of tiny-world"),
)

# Intermediate words: their summary line (a group has no module of its own).
GROUPS: dict[tuple[str, ...], str] = {
    ("bench",): "side-by-side measurements; each ends with one JSON line",
    ("train",): "train a model",
    ("eval",): "evaluate a model",
}


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``arstream serve: argument --port: invalid int value: 'x'``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def plain_text(doc: str | None) -> str | None:
    """A module docstring as help text: Sphinx roles and literals (:class:`X`, ``y``) read as X and y."""
    if doc is None:
        return None
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", lambda match: match.group(1).rsplit(".", 1)[-1], doc)
    return doc.replace("``", "")


def command_functions(command: Command) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[..., int]]:
    """The command's add_arguments and run; ``run`` imports the command's module only when called."""
    if command.arguments is None:
        module = importlib.import_module(command.module)
        return module.add_arguments, module.run
    module_name, _, function = command.arguments.partition(":")
    add_options = getattr(importlib.import_module(module_name), function)

    def run(args: argparse.Namespace) -> int:
        if command.precheck is not None:
            check_module, _, check = command.precheck.partition(":")
            refused = getattr(importlib.import_module(check_module), check)(args)
            if refused is not None:
                return int(refused)
        return int(importlib.import_module(command.module).run(args) or 0)

    return add_options, run


def build_parser(
    load: Callable[[Command], bool], parsers: dict[tuple[str, ...], CommandParser] | None = None
) -> CommandParser:
    """The whole tree; ``add_arguments`` runs only for commands where ``load(command)`` is true.

    ``parsers``, when given, receives each command's own parser by its words.
    """
    root = CommandParser(
        prog="arstream",
        description="ARStream: a realtime server for autoregressive video world models.",
        epilog="Run 'arstream COMMAND --help' for a command's options.",
    )
    root.add_argument("--version", action="version", version=f"arstream {__version__}")
    subparsers: dict[tuple[str, ...], argparse._SubParsersAction[CommandParser]] = {
        (): root.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
    }
    for command in COMMANDS:
        for depth in range(1, len(command.words)):  # its groups, in the order commands first name them
            words = command.words[:depth]
            if words not in subparsers:
                group = subparsers[words[:-1]].add_parser(words[-1], help=GROUPS[words], description=GROUPS[words])
                subparsers[words] = group.add_subparsers(
                    title="commands", dest="_".join(words), metavar="COMMAND", required=True
                )
        parser = subparsers[command.words[:-1]].add_parser(
            command.words[-1],
            help=command.summary,
            description=command.summary,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if parsers is not None:
            parsers[command.words] = parser
        if load(command):
            add_options, run = command_functions(command)
            add_options(parser)
            parser.description = plain_text(parser.description)
            parser.set_defaults(run=run)
    return root


def selected(argv: Sequence[str]) -> Command | None:
    """The command whose words start ``argv`` (options before them are not used by this CLI)."""
    for command in COMMANDS:
        if tuple(argv[: len(command.words)]) == command.words:
            return command
    return None


def attach_dash_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--keys -*2`` as ``--keys=-*2``: argparse reads a value that starts with ``-`` as a flag.

    Only for ``parser``'s options that take one value, and only when the next word is none of its options.
    """
    actions = parser._option_string_actions  # argparse has no public map of option strings to actions
    attached: list[str] = []
    words = iter(argv)
    for word in words:
        action = actions.get(word)
        takes_one = action is not None and action.nargs is None and isinstance(action, argparse._StoreAction)
        following = next(words, None) if takes_one else None
        if following is None:
            attached.append(word)
        elif following.startswith("-") and following.split("=", 1)[0] not in actions:
            attached.append(f"{word}={following}")
        else:
            attached.extend([word, following])
    return attached


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = selected(args_list)
    parsers: dict[tuple[str, ...], CommandParser] = {}
    parser = build_parser(lambda command: command == chosen, parsers)
    if chosen is not None:
        args_list = attach_dash_values(args_list, parsers[chosen.words])
    try:
        args = parser.parse_args(args_list)
        return int(args.run(args) or 0)
    except SystemExit as exited:  # --help, --version, usage errors, or a command's own exit
        if isinstance(exited.code, str):
            print(exited.code, file=sys.stderr)
            return 1
        return 0 if exited.code is None else exited.code


class CommandMain(Protocol):
    """A subcommand's ``main``: ``argv`` (its own words, not the command's) defaults to ``sys.argv[1:]``."""

    def __call__(self, argv: Sequence[str] | None = None) -> int: ...


def main_for(*words: str) -> CommandMain:
    """``main(argv)`` for one subcommand, for ``python -m`` on its module and for tests."""

    def command_main(argv: Sequence[str] | None = None) -> int:
        return main([*words, *(sys.argv[1:] if argv is None else argv)])

    return command_main


if __name__ == "__main__":
    sys.exit(main())
