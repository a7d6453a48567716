"""Protocol parsing, frame headers and the session state machine, as plain units (no server)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from arstream.app.prompts import MAX_PROMPT_CHARS, MAX_PROMPT_LINES
from arstream.app.wire import HEADER_BYTES, Codec, FrameHeader, WireError, decode_frame, encode_chunk
from arstream.app.protocol import (
    ERROR_CLOSE_CODES,
    MAX_JSON_DEPTH,
    CloseMessage,
    ErrorCode,
    InputMessage,
    PingMessage,
    ProtocolError,
    StartMessage,
    TickMessage,
    error_message,
    loads_strict,
    parse_client_message,
)
from arstream.app.session import RECENT_EVENT_IDS, Session, SessionState, SessionStateError, restart_reason


def parse(obj: object) -> object:
    return parse_client_message(json.dumps(obj))


def refused(text: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parse_client_message(text)
    return caught.value


# ---- parsing --------------------------------------------------------------------------------


def test_parses_every_client_message_type() -> None:
    assert parse({"type": "start", "prompt": "p", "seed": 3, "codec": "raw", "quality": 50}) == StartMessage(
        type="start", prompt="p", seed=3, codec="raw", quality=50
    )
    tick = parse({"type": "tick", "tick_id": 7, "controls": {"keys": ["d"]}, "prompt": None, "reset": True})
    assert isinstance(tick, TickMessage) and tick.tick_id == 7 and tick.reset and not tick.close
    event = parse({"type": "input", "event_id": 2**32 - 1, "prompt": "x"})
    assert isinstance(event, InputMessage) and event.event_id == 2**32 - 1 and event.controls is None
    assert parse({"type": "ping", "t": 3}) == PingMessage(type="ping", t=3)
    assert isinstance(parse({"type": "close"}), CloseMessage)


def test_unknown_fields_are_ignored_for_additive_extensions() -> None:
    assert parse({"type": "ping", "t": 1.0, "future_field": [1]}) == PingMessage(type="ping", t=1.0)


@pytest.mark.parametrize(
    "bad_id", [-1, 2**32, 1.0, 1.5, True, False, "3", None, [1]], ids=lambda v: f"{type(v).__name__}:{v!r}"
)
def test_ids_must_be_u32_integers(bad_id: object) -> None:
    for kind, field in (("tick", "tick_id"), ("input", "event_id")):
        error = refused(json.dumps({"type": kind, field: bad_id}))
        assert error.code is ErrorCode.INVALID_MESSAGE and not error.fatal
        assert field in error.message


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_non_finite_numbers_are_refused(text: str) -> None:
    error = refused('{"type": "ping", "t": ' + text + "}")
    assert error.code is ErrorCode.INVALID_MESSAGE


def test_nesting_limit_is_32_levels() -> None:
    def nested(levels: int) -> str:
        return "[" * levels + "]" * levels

    assert loads_strict(nested(MAX_JSON_DEPTH)) == loads_strict(nested(MAX_JSON_DEPTH))
    with pytest.raises(ValueError, match="deeper"):
        loads_strict(nested(MAX_JSON_DEPTH + 1))
    # brackets inside strings are not nesting
    assert loads_strict(json.dumps({"s": "[" * 100})) == {"s": "[" * 100}
    refused('{"type": "ping", "x": ' + nested(32) + "}")


def test_hostile_unterminated_strings_are_refused() -> None:
    hostile = '"\\"' * 20000 + "[" * 40
    with pytest.raises(ValueError):
        loads_strict(hostile)


@pytest.mark.parametrize(
    "text",
    ['{"type": "tick", "tick_id": 1, "prompt": 3}', '{"type": "input", "event_id": 1, "prompt": {}}',
     '{"type": "start", "prompt": false}'],
)
def test_prompt_must_be_string_or_null(text: str) -> None:
    assert refused(text).code is ErrorCode.INVALID_MESSAGE


@pytest.mark.parametrize("message_type", ["start", "tick", "input"])
def test_a_prompt_is_bounded_in_characters_and_lines(message_type: str) -> None:
    """Before, a prompt was bounded only by the message size (32,000 newlines cost LongLive 0.5 s a chunk)."""
    ids = {"tick": {"tick_id": 4}, "input": {"event_id": 4}}.get(message_type, {})
    longest = "x" * (MAX_PROMPT_CHARS - MAX_PROMPT_LINES) + "\n" * (MAX_PROMPT_LINES - 1)
    assert parse({"type": message_type, "prompt": longest, **ids}).prompt == longest  # type: ignore[attr-defined]
    too_long = refused(json.dumps({"type": message_type, "prompt": "x" * (MAX_PROMPT_CHARS + 1), **ids}))
    assert too_long.code is ErrorCode.INVALID_MESSAGE and "at most 2000 characters, got 2001" in too_long.message
    assert too_long.tick_id == (4 if message_type == "tick" else None)
    many_lines = refused(json.dumps({"type": message_type, "prompt": "a\n" * MAX_PROMPT_LINES, **ids}))
    assert many_lines.code is ErrorCode.INVALID_MESSAGE and "at most 64 lines, got 65" in many_lines.message


@pytest.mark.parametrize(
    "text",
    ['{"type": "start", "codec": "png"}', '{"type": "start", "quality": 0}', '{"type": "start", "quality": 101}',
     '{"type": "start", "seed": -1}', '{"type": "start", "quality": 80.0}'],
)
def test_start_fields_are_range_checked(text: str) -> None:
    error = refused(text)
    assert error.message_type == "start"


def test_refusal_keeps_a_usable_tick_id_only() -> None:
    assert refused('{"type": "tick", "tick_id": 4, "reset": "yes"}').tick_id == 4
    assert refused('{"type": "tick", "tick_id": true, "reset": "yes"}').tick_id is None


def test_error_codes_fatality_and_close_codes_match_the_protocol_table() -> None:
    assert {code.value: ERROR_CLOSE_CODES.get(code) for code in ErrorCode} == {
        "invalid_message": None,
        "invalid_controls": None,
        "stale_tick": None,
        "too_many_ticks": None,
        "stale_event": None,
        "session_failed": None,
        "message_too_large": 1009,
        "start_required": 1008,
        "unauthorized": 1008,
        "over_capacity": 1013,
        "idle_timeout": 4001,
        "resume_failed": 4002,
        "taken_over": 4003,
        "internal": 1011,
        "invalid_image": 4004,
        "share_failed": 4005,
        "not_controller": None,
        "unknown_viewer": None,
        "rewind_unavailable": None,
        "control_refused": None,
    }
    assert error_message(ErrorCode.IDLE_TIMEOUT, "m")["fatal"] is True
    assert error_message(ErrorCode.STALE_TICK, "m", tick_id=3) == {
        "type": "error", "code": "stale_tick", "message": "m", "tick_id": 3, "fatal": False,
    }


@given(st.text(max_size=200))
def test_parser_only_ever_raises_protocol_errors(text: str) -> None:
    try:
        parse_client_message(text)
    except ProtocolError as error:
        assert error.code is ErrorCode.INVALID_MESSAGE


# ---- frames ------------------------------------------------------------------------------


@given(
    codec=st.sampled_from(list(Codec)),
    last=st.booleans(),
    frame_index=st.integers(0, 2**16 - 1),
    chunk_index=st.integers(0, 2**32 - 1),
    tick_id=st.integers(0, 2**32 - 1),
    width=st.integers(0, 2**16 - 1),
    height=st.integers(0, 2**16 - 1),
)
def test_header_round_trips(
    codec: Codec, last: bool, frame_index: int, chunk_index: int, tick_id: int, width: int, height: int
) -> None:
    header = FrameHeader(codec, last, frame_index, chunk_index, tick_id, width, height)
    packed = header.pack()
    assert len(packed) == HEADER_BYTES == 20
    assert FrameHeader.unpack(packed) == header


def test_header_layout_is_little_endian_as_documented() -> None:
    packed = FrameHeader(Codec.JPEG, True, 1, 0x01020304, 0x0A0B0C0D, 640, 360).pack()
    assert packed[:4] == b"ARF1"
    assert packed[4] == 1 and packed[5] == 1
    assert packed[6:8] == (1).to_bytes(2, "little")
    assert packed[8:12] == bytes([4, 3, 2, 1])
    assert packed[12:16] == bytes([0x0D, 0x0C, 0x0B, 0x0A])
    assert packed[16:18] == (640).to_bytes(2, "little") and packed[18:20] == (360).to_bytes(2, "little")


def test_bad_headers_are_refused() -> None:
    with pytest.raises(WireError, match="magic"):
        FrameHeader.unpack(b"XXXX" + bytes(16))
    with pytest.raises(WireError, match="codec"):
        FrameHeader.unpack(b"ARF1" + bytes([7]) + bytes(15))
    with pytest.raises(WireError, match="header"):
        FrameHeader.unpack(b"ARF1")


@pytest.mark.parametrize("codec", [codec for codec in Codec if not codec.stateful])  # h264: tests/server/test_codec.py
def test_chunk_encoding_marks_only_the_last_frame(codec: Codec) -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(3, 16, 24, 3), dtype=np.uint8)
    messages = encode_chunk(frames, codec=codec, quality=95, chunk_index=5, tick_id=9)
    assert len(messages) == 3
    for index, message in enumerate(messages):
        header, pixels = decode_frame(message)
        assert header == FrameHeader(codec, index == 2, index, 5, 9, 24, 16)
        assert pixels.shape == (16, 24, 3)
        if codec is Codec.RAW:
            assert np.array_equal(pixels, frames[index])
            assert len(message) == HEADER_BYTES + 16 * 24 * 3


# ---- sessions --------------------------------------------------------------------------------


def active_session(max_pending_ticks: int = 2) -> Session:
    session = Session("s-test", codec="raw", quality=80, seed=None, prompt=None, max_pending_ticks=max_pending_ticks)
    session.transition(SessionState.ACTIVE)
    return session


def tick(tick_id: int, **fields: object) -> TickMessage:
    return TickMessage(type="tick", tick_id=tick_id, **fields)  # type: ignore[arg-type]


def event(event_id: int, **fields: object) -> InputMessage:
    return InputMessage(type="input", event_id=event_id, **fields)  # type: ignore[arg-type]


def test_illegal_transition_names_the_expected_states() -> None:
    session = Session("s-test", codec="raw", quality=80, seed=None, prompt=None, max_pending_ticks=1)
    with pytest.raises(SessionStateError, match="expected session state active or draining, but it is awaiting_start"):
        session.transition(SessionState.FAILED)
    with pytest.raises(SessionStateError, match="accept a tick.*awaiting_start"):
        session.accept_tick(tick(1))


def test_credits_limit_pending_ticks_and_come_back() -> None:
    session = active_session(max_pending_ticks=2)
    session.accept_tick(tick(1))
    session.accept_tick(tick(2))
    with pytest.raises(ProtocolError) as caught:
        session.accept_tick(tick(3))
    assert caught.value.code is ErrorCode.TOO_MANY_TICKS and caught.value.tick_id == 3
    assert session.last_tick_id == 2  # a refusal does not move the floor
    session.release_credit()
    session.accept_tick(tick(3))
    assert session.pending_ticks == 2


def test_events_latest_wins_and_duplicates_apply_once() -> None:
    session = active_session()
    assert session.accept_event(event(1, controls={"keys": ["w"]})) is False
    job = session.accept_tick(tick(1, controls={"keys": ["a"]}))
    assert session.accept_event(event(2, controls={"keys": ["d"]}, prompt="later")) is False
    assert session.accept_event(event(2, controls={"keys": ["s"]})) is True  # duplicate: acked, not staged
    with pytest.raises(ProtocolError) as caught:
        session.accept_event(event(0))
    assert caught.value.code is ErrorCode.STALE_EVENT
    inputs = session.take_chunk_inputs(job)
    assert inputs.controls == {"keys": ["d"]} and inputs.prompt == "later"
    assert inputs.applied_event_ids == (1, 2)
    assert session.take_chunk_inputs(job).applied_event_ids == ()


def test_a_later_tick_does_not_undo_an_input_that_arrived_after_it() -> None:
    session = active_session()
    first = session.accept_tick(tick(1, controls={"keys": ["w"]}))
    second = session.accept_tick(tick(2, controls={"keys": ["a"]}))
    session.accept_event(event(1, controls={"keys": ["s"]}))
    assert session.take_chunk_inputs(first).controls == {"keys": ["s"]}
    assert session.take_chunk_inputs(second).controls == {"keys": ["s"]}


def test_old_event_ids_stop_being_duplicates() -> None:
    session = active_session()
    for event_id in range(RECENT_EVENT_IDS + 1):
        session.accept_event(event(event_id))
    assert session.accept_event(event(RECENT_EVENT_IDS)) is True
    with pytest.raises(ProtocolError):
        session.accept_event(event(0))


def test_failure_requires_reset_unless_one_is_already_queued() -> None:
    session = active_session(max_pending_ticks=4)
    session.accept_tick(tick(1))
    session.note_failure(1)
    assert session.state is SessionState.FAILED
    with pytest.raises(ProtocolError) as caught:
        session.accept_tick(tick(2))
    assert caught.value.code is ErrorCode.SESSION_FAILED and caught.value.tick_id == 2
    session.accept_tick(tick(3, reset=True))
    assert state_of(session) is SessionState.ACTIVE
    session.note_failure(2)  # an older failure reported late: the queued reset recovers it
    assert state_of(session) is SessionState.ACTIVE


def test_close_flag_drains_the_session() -> None:
    session = active_session()
    session.accept_tick(tick(1, close=True))
    assert session.state is SessionState.DRAINING
    with pytest.raises(ProtocolError) as caught:
        session.accept_tick(tick(2))
    assert caught.value.code is ErrorCode.INVALID_MESSAGE


@pytest.mark.parametrize(
    ("reset", "new_rollout", "produced_before", "expected"),
    [
        (False, False, True, None),
        (False, True, False, None),  # the session's first chunk
        (False, True, True, "evicted"),  # KV gone without being asked
        (True, True, True, "reset"),
        (True, True, False, "reset"),
    ],
)
def test_restart_reason(reset: bool, new_rollout: bool, produced_before: bool, expected: str | None) -> None:
    assert restart_reason(reset=reset, new_rollout=new_rollout, produced_before=produced_before) == expected


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("tick"), st.integers(0, 40), st.booleans()),
            st.tuples(st.just("event"), st.integers(0, 40), st.booleans()),
            st.tuples(st.just("done"), st.just(0), st.just(False)),
        ),
        max_size=60,
    )
)
def test_random_message_sequences_keep_credits_and_floors(operations: list[tuple[str, int, bool]]) -> None:
    """Credits never exceed the limit or go negative; floors only rise; every staged event is applied once."""
    session = active_session(max_pending_ticks=3)
    accepted_events: list[int] = []
    applied: list[int] = []
    jobs = []
    for kind, number, flag in operations:
        tick_floor, event_floor = session.last_tick_id, session.event_floor
        try:
            if kind == "tick":
                jobs.append(session.accept_tick(tick(number, controls={"keys": ["w"] if flag else []})))
            elif kind == "event":
                if not session.accept_event(event(number)):
                    accepted_events.append(number)
            elif jobs:
                applied.extend(session.take_chunk_inputs(jobs.pop(0)).applied_event_ids)
                session.release_credit()
        except ProtocolError:
            assert (session.last_tick_id, session.event_floor) == (tick_floor, event_floor)
        assert 0 <= session.pending_ticks <= 3
        assert session.pending_ticks == len(jobs)
        if tick_floor is not None:
            assert session.last_tick_id is not None and session.last_tick_id >= tick_floor
    # one more chunk boundary takes whatever is still pending
    for job in jobs or [session.accept_tick(tick(1000))]:
        applied.extend(session.take_chunk_inputs(job).applied_event_ids)
    assert applied == accepted_events == sorted(set(accepted_events))


def state_of(session: Session) -> SessionState:
    """The state read afresh (mypy keeps an ``assert session.state is X`` narrowing across the calls that change it)."""
    return session.state
