"""vLLM and its dependencies warn about their own use of deprecated torch APIs while they import and load.

Those warnings are not ARStream's to act on, and the test suite runs with
warnings as errors, so the runtime ignores deprecation and future warnings
around vLLM's imports and model loading only (they still show elsewhere).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def ignoring_their_deprecations() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield
