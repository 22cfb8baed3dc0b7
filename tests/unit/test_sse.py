"""Bounded SSE framing (`toolq.orchestrator.protocol.sse`) and what the decoder makes of a cut event."""

from __future__ import annotations

import json
import tracemalloc

import httpx
from httpx_sse import EventSource
from hypothesis import given, settings
from hypothesis import strategies as st

from toolq.orchestrator.protocol.events import EventDecoder
from toolq.orchestrator.protocol.sse import Oversize, SSEReader, iter_frames

MiB = 1024 * 1024


def frames_of(body: bytes, max_event_bytes: int = 8 * MiB, chunk: int | None = None) -> list:
    pieces = [body] if chunk is None else [body[i : i + chunk] for i in range(0, len(body), chunk)]
    return list(iter_frames(pieces, max_event_bytes))


def httpx_sse_data(body: bytes) -> list[str]:
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)
    return [sse.data for sse in EventSource(response).iter_sse()]


BODY = (b"event: a\ndata: one\n\n"
        b": keep-alive\n\n"
        b"data: two\r\ndata:  three\r\n\r\n"
        b"data\rdata: x\r\r"
        b"id: 7\n\n"
        b"data: caf\xc3\xa9 \xff\n\n"
        b"data: unterminated")


def test_framing_matches_httpx_sse_at_every_chunk_size():
    expected = httpx_sse_data(BODY)
    assert expected == ["one", "two\n three", "\nx", "", "café \ufffd"]
    for chunk in (1, 2, 3, 7, 64, None):
        assert frames_of(BODY, chunk=chunk) == expected, chunk


def test_an_event_over_the_bound_comes_out_as_its_size_and_head_only():
    big = json.dumps({"type": "response.output_item.done", "item": {"text": "x" * 5000}}).encode()
    body = b"data: small\n\ndata: " + big + b"\n\ndata: after\n\n"
    out = frames_of(body, max_event_bytes=1024, chunk=100)
    assert out[0] == "small" and out[2] == "after"
    cut = out[1]
    assert isinstance(cut, Oversize)
    assert cut.size == len(b"data: ") + len(big) + 1
    assert cut.type == "response.output_item.done"
    assert len(cut.head) <= 512


def test_a_200_mib_event_never_takes_more_than_a_few_mib():
    reader = SSEReader(max_event_bytes=8 * MiB)
    chunk = b"x" * (64 * 1024)
    tracemalloc.start()
    try:
        assert reader.feed(b'data: {"type": "response.output_text.delta", "delta": "') == []
        for _ in range(200 * 16):  # 200 MiB in one line, as the server would stream it
            assert reader.feed(chunk) == []
        out = reader.feed(b'"}\n\n')
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(out) == 1 and isinstance(out[0], Oversize)
    assert out[0].size > 200 * MiB
    assert peak < 10 * MiB, f"peak {peak / MiB:.1f} MiB while reading a 200 MiB event"


def test_many_lines_that_add_up_past_the_bound_are_one_cut_event():
    body = b"".join(b"data: " + b"y" * 100 + b"\n" for _ in range(50)) + b"\n" + b"data: next\n\n"
    out = frames_of(body, max_event_bytes=1000)
    assert isinstance(out[0], Oversize) and out[1] == "next"


def test_decoder_counts_a_cut_and_says_whether_a_commit_was_lost():
    decoder = EventDecoder()
    delta = Oversize(10**9, b'data: {"type":"response.output_text.delta","delta":"xxx')
    done = Oversize(10**9, b'data: {"type":"response.output_item.done","output_index":0,"item":{')
    completed = Oversize(10**9, b'data: {"type":"response.completed","response":{"id":"r"')
    unreadable = Oversize(10**9, b"data: " + b"[" * 500)
    assert decoder.decode(delta) is None  # the live view misses a piece; nothing else does
    cut = decoder.decode(done)
    assert (cut.kind, cut.event_type, cut.size) == ("cut", "response.output_item.done", 10**9)
    assert decoder.decode(completed).kind == "completed"  # its items came in their own events
    assert decoder.decode(unreadable).kind == "cut"
    assert decoder.skipped["oversize"] == 4


def test_a_deeply_nested_frame_is_skipped_and_counted():
    decoder = EventDecoder()
    deep = '{"type": "response.output_text.delta", "delta": "x", "pad": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert decoder.decode(deep) is None
    item = {"type": "function_call", "call_id": "c", "name": "n", "arguments": "{}",
            "extra": json.loads("[" * 300 + "]" * 300)}  # parses, but pydantic could not serialize it back
    assert decoder.decode(json.dumps({"type": "response.output_item.done", "item": item})) is None
    assert decoder.skipped["too_deep"] == 2
    shallow = {**item, "extra": json.loads("[" * 100 + "]" * 100)}
    event = decoder.decode(json.dumps({"type": "response.output_item.done", "item": shallow}))
    assert event.item.call_id == "c"
    json.dumps(event.item.to_wire())


def test_lone_surrogates_in_a_frame_become_replacement_characters():
    decoder = EventDecoder()
    event = decoder.decode('{"type": "response.output_item.done", "item": {"type": "function_call", '
                           '"call_id": "c\\ud800", "name": "n", "arguments": "{\\"p\\": \\"\\udcff \\\\udcff\\"}", '
                           '"\\udc80key": "v"}}')
    assert event.item.call_id == "c\ufffd"
    # A surrogate the frame decodes to is replaced; an escape inside the arguments' own JSON text
    # is text here, for `load_arguments` to refuse.
    assert event.item.arguments == '{"p": "\ufffd \\udcff"}'
    json.dumps(event.item.to_wire(), ensure_ascii=False).encode("utf-8")


LINES = st.lists(st.one_of(st.sampled_from([b"", b"data", b"data:", b"data: x", b": hi", b"event: e", b"id: 1",
                                            b"retry: 5", b"data:  two spaces", b"bogus: 1"]),
                           st.binary(max_size=12).map(lambda b: b"data: " + b.replace(b"\r", b"").replace(b"\n", b""))),
                 max_size=20)
SEPARATORS = st.sampled_from([b"\n", b"\r\n", b"\r"])


@settings(max_examples=150, derandomize=True, deadline=None)
@given(LINES, st.lists(SEPARATORS, min_size=1, max_size=3), st.integers(1, 9))
def test_framing_matches_httpx_sse_on_random_bodies(lines, seps, chunk):
    body = b"".join(line + seps[i % len(seps)] for i, line in enumerate(lines))
    assert frames_of(body, chunk=chunk) == httpx_sse_data(body)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=6), st.integers(1, 50), st.integers(50, 400))
def test_each_event_is_kept_whole_or_cut_at_the_bound(sizes, chunk, bound):
    events = [b"data: " + b"z" * n + b"\n\n" for n in sizes]
    out = frames_of(b"".join(events), max_event_bytes=bound, chunk=chunk)
    assert len(out) == len(events)
    for n, frame in zip(sizes, out, strict=True):
        lines_bytes = len(b"data: ") + n + 1  # the blank line that ends it is not part of it
        if lines_bytes > bound:
            assert isinstance(frame, Oversize) and frame.size == lines_bytes
        else:
            assert frame == "z" * n
