"""A client's prompt: bounded when its message is parsed, prepared for the model once, as it arrives.

A model may normalise a prompt before it reads it (LongLive cleans it as Wan
does: ftfy, HTML entities, whitespace runs, about 30 microseconds a line and a
microsecond a character). The transport runs that normalisation (the runtime's
``prepare_prompt``) once, on the event loop, when a prompt arrives in
``start``, a tick, an input or an interaction, so a chunk's model thread never
cleans text and the session holds what the model reads. A prompt seen lately
is answered from a memo, so a client that sends its prompt with every tick
costs a lookup.

What a prompt may cost is bounded before that, at parse time: at most
:data:`MAX_PROMPT_CHARS` characters on at most :data:`MAX_PROMPT_LINES` lines
(``invalid_message`` past either). The umT5 encoder that reads a prompt takes
512 tokens, about 2,000 characters of English, and its tokenizer cuts what is
longer; a character bound cannot cut where the tokenizer would (whitespace runs
collapse and tokens vary in length), so a longer prompt is refused, with its
size in the message, rather than cut. The line bound is the cleaning's: each
line costs ftfy a pass of its own.

A session's new prompts (not remembered ones) are bounded in rate too:
:data:`PROMPT_CHANGES_PER_S` a second, :data:`PROMPT_CHANGE_BURST` at once,
far above what a model applies (the latest prompt before each chunk; a chunk is
several frames). Past it a prompt is refused (``too_many_ticks`` in protocol 1,
``interaction_failed`` in the realtime dialect) before it is cleaned: a client
that sends a new costly prompt in every message cannot keep the event loop
cleaning at the message rate.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_PROMPT_CHARS = 2000
MAX_PROMPT_LINES = 64
PREPARED_MEMO = 256  # prompts remembered with their prepared text (at most 256 x 2,000 characters)
PROMPT_CHANGES_PER_S = 4.0
PROMPT_CHANGE_BURST = 8


class PromptRateExceeded(Exception):
    """A session sent new prompts faster than :class:`PromptAllowance` lets it; the text says the bound."""


class PromptAllowance:
    """One session's new prompts: a token bucket of :data:`PROMPT_CHANGE_BURST`, refilled at
    :data:`PROMPT_CHANGES_PER_S` (event loop only)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tokens = float(PROMPT_CHANGE_BURST)
        self._at = clock()

    def take(self) -> None:
        now = self._clock()
        self._tokens = min(float(PROMPT_CHANGE_BURST), self._tokens + (now - self._at) * PROMPT_CHANGES_PER_S)
        self._at = now
        if self._tokens < 1.0:
            raise PromptRateExceeded(
                f"new prompts come at most {PROMPT_CHANGE_BURST} at once and {PROMPT_CHANGES_PER_S:g} a second "
                "(a model applies the latest one at each chunk); this one was not taken"
            )
        self._tokens -= 1.0


def prompt_problem(text: str) -> str | None:
    """Why ``text`` is not a prompt the server takes (None: it is); the message names the bound."""
    if len(text) > MAX_PROMPT_CHARS:
        return f"a prompt is at most {MAX_PROMPT_CHARS} characters, got {len(text)}"
    lines = text.count("\n") + 1
    if lines > MAX_PROMPT_LINES:
        return f"a prompt is at most {MAX_PROMPT_LINES} lines, got {lines}"
    return None


def _unchanged(text: str) -> str:
    return text


class PromptPreparer:
    """The served model's ``prepare_prompt``, run once per prompt that arrives (event loop only)."""

    def __init__(self) -> None:
        self._prepare: Callable[[str], str] = _unchanged
        self._memo: OrderedDict[str, str] = OrderedDict()
        self.prepared = 0  # prompts the model's function ran on (a memo hit is not counted)

    def use(self, prepare: Callable[[str], str]) -> None:
        """The loaded model's function (until then prompts are kept as sent: no session starts before)."""
        self._prepare = prepare
        self._memo.clear()

    def prepare(self, text: str | None, allowance: PromptAllowance | None = None) -> str | None:
        """``text`` as the model reads it; a new one (not remembered) takes one of ``allowance``'s tokens first
        (raises :class:`PromptRateExceeded` when there is none)."""
        if text is None:
            return None
        prepared = self._memo.get(text)
        if prepared is None:
            if allowance is not None:
                allowance.take()
            prepared = self._prepare(text)
            self.prepared += 1
            self._memo[text] = prepared
            if len(self._memo) > PREPARED_MEMO:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(text)
        return prepared
