"""The ``arstream`` command: one argparse tree, built here, from the modules that own each subcommand.

Each subcommand's module provides ``add_arguments(parser)`` and ``run(args) -> int``.
Only the module of the subcommand being run (or asked for ``--help``) is imported,
so ``arstream --help`` answers without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from arstream import __version__


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # e.g. ("bench", "model")
    module: str  # provides add_arguments(parser) and run(args)
    summary: str  # one line for the parent's command list


COMMANDS: tuple[Command, ...] = (
    Command(("serve",), "arstream.app.server", "serve a world model over WebSocket, with the demo page at /"),
    Command(("drain",), "arstream.app.drain", "move a replica's live sessions to peers, then let it exit"),
    Command(("client",), "arstream.app.client", "run one scripted session against a server and save its frames"),
    Command(("bench", "runner"), "arstream.models.bench_runner", "the runner's bookkeeping cost against a direct loop"),
    Command(("bench", "model"), "arstream.models.bench_model", "frames per second of a model through the runner"),
    Command(("bench", "serve"), "arstream.app.bench", "end-to-end load test of the server against the bare runner"),
    Command(("train", "tiny-world"), "arstream.models.tiny_world.train", "train tiny-world (the shipped recipe)"),
    Command(
        ("train", "tiny-world-decoder"),
        "arstream.models.tiny_world.train_decoder",
        "train tiny-world's frame decoder on a frozen transformer",
    ),
    Command(("eval", "tiny-world"), "arstream.models.tiny_world.evaluate", "responsiveness and drift of tiny-world"),
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


def build_parser(load: Callable[[Command], bool]) -> CommandParser:
    """The whole tree; ``add_arguments`` runs only for commands where ``load(command)`` is true."""
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
        if load(command):
            module = importlib.import_module(command.module)
            module.add_arguments(parser)
            parser.set_defaults(run=module.run)
    return root


def selected(argv: Sequence[str]) -> Command | None:
    """The command whose words start ``argv`` (options before them are not used by this CLI)."""
    for command in COMMANDS:
        if tuple(argv[: len(command.words)]) == command.words:
            return command
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = selected(args_list)
    parser = build_parser(lambda command: command == chosen)
    try:
        args = parser.parse_args(args_list)
        return int(args.run(args) or 0)
    except SystemExit as exited:  # --help, --version, usage errors, or a command's own exit
        if isinstance(exited.code, str):
            print(exited.code, file=sys.stderr)
            return 1
        return 0 if exited.code is None else exited.code


def main_for(*words: str) -> Callable[[Sequence[str] | None], int]:
    """``main(argv)`` for one subcommand, for ``python -m`` on its module and for tests."""

    def command_main(argv: Sequence[str] | None = None) -> int:
        return main([*words, *(sys.argv[1:] if argv is None else argv)])

    return command_main


if __name__ == "__main__":
    sys.exit(main())
