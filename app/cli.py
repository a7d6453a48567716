"""The ``arstream`` command: each subcommand lives in the module that owns it."""

from __future__ import annotations

import importlib
import sys

# subcommand words -> module whose ``main(argv)`` handles the rest of the line
COMMANDS: dict[tuple[str, ...], str] = {
    ("serve",): "arstream.app.server",
    ("client",): "arstream.app.client",
    ("bench", "runner"): "arstream.runner.bench",
    ("bench", "model"): "arstream.models.tiny_world.bench",
    ("bench", "serve"): "arstream.app.bench",
    ("train", "tiny-world"): "arstream.models.tiny_world.train",
    ("eval", "tiny-world"): "arstream.models.tiny_world.evaluate",
}

USAGE = "usage: arstream {serve | client URL | bench runner|model|serve | train tiny-world | eval tiny-world} [options]"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    for words, module_name in sorted(COMMANDS.items(), key=lambda item: -len(item[0])):
        if tuple(args[: len(words)]) == words:
            module = importlib.import_module(module_name)
            return int(module.main(args[len(words) :]) or 0)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
