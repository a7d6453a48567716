"""What LongLive needs beyond the server's own dependencies (the ``longlive`` extra), checked before it is imported.

A machine without them (the GPU check's device copy carries no transformers
or tokenizers) gets one line naming what is missing and how to install it,
rather than a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util

# umT5's encoder and its tokenizers, and Wan's prompt cleaning; peft is needed only to merge a LoRA (checked there)
NEEDED = ("transformers", "tokenizers", "ftfy")


def check_longlive_extra() -> None:
    """Raise ImportError naming every missing distribution of :data:`NEEDED`."""
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"longlive needs {', '.join(missing)}, not installed here: pip install 'arstream[longlive]'")
