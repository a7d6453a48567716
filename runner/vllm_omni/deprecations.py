"""How ARStream imports vLLM: its CPU platform let answer first, their own deprecation warnings ignored.

vLLM resolves its platform the first time anything imports it, so ARStream's
platform plugins (:mod:`arstream.runner.vllm_omni.platform`) are activated
right before: every module of this runtime imports vLLM through
:func:`importing_vllm`. vLLM and its dependencies also warn about their own use
of deprecated torch APIs while they import and load; those warnings are not
ARStream's to act on, and the test suite runs with warnings as errors, so the
runtime ignores deprecation and future warnings around vLLM's imports and
model loading only (they still show elsewhere).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from .platform import activate_cpu_platform


@contextmanager
def ignoring_their_deprecations() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


@contextmanager
def importing_vllm() -> Iterator[None]:
    """Around an import of vLLM or vLLM-Omni by ARStream's runtime (see the module docstring)."""
    activate_cpu_platform()
    with ignoring_their_deprecations():
        yield
