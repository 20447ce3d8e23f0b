"""A batch's input file, checked line by line (pure): what fails the whole batch, naming the line."""

from __future__ import annotations

import json

from gateway.batch.objects import MAX_BATCH_REQUESTS
from gateway.batch.validation import parse_batch_input

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **extra) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": custom_id}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def parse(*lines: str, endpoint: str = CHAT):
    return parse_batch_input("batch_x", "\n".join(lines).encode(), endpoint)


def test_valid_lines_become_work_items_with_their_line_numbers():
    items, errors = parse(line("a"), "", line("b"), "   ")
    assert errors == []
    assert [(i.line, i.custom_id, i.batch_id) for i in items] == [(1, "a", "batch_x"), (3, "b", "batch_x")]
    assert items[1].body["messages"][0]["content"] == "b"


def test_each_kind_of_bad_line_fails_the_batch_naming_its_line():
    items, errors = parse(
        line("a"),
        "{not json",
        "[1, 2]",
        json.dumps({"custom_id": "c", "method": "POST", "url": CHAT}),
        line("d", url="/v1/embeddings"),
        line("e", url="/v1/completions"),
        line("a"),
        json.dumps({"custom_id": "f", "method": "GET", "url": CHAT, "body": {}}),
        json.dumps({"custom_id": "g", "method": "POST", "url": CHAT, "body": "text"}),
    )
    assert items == []
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json_line"), (3, "invalid_json_line"), (4, "missing_required_parameter"), (5, "invalid_url"),
        (6, "mismatched_url"), (7, "duplicate_custom_id"), (8, "invalid_request"), (9, "invalid_request"),
    ]
    assert errors[3].message == ("line 5: url '/v1/embeddings' is not one of /v1/chat/completions, "
                                 "/v1/completions")
    assert errors[5].message == "line 7: custom_id 'a' appears more than once"


def test_an_empty_file_a_file_that_is_not_utf8_and_too_many_lines_fail():
    assert [e.code for e in parse("", "  ")[1]] == ["empty_file"]
    assert [e.code for e in parse_batch_input("b", b"\xff\xfe", CHAT)[1]] == ["invalid_file"]
    many = "\n".join(line(str(i)) for i in range(MAX_BATCH_REQUESTS + 1)).encode()
    items, errors = parse_batch_input("b", many, CHAT)
    assert items == [] and [e.code for e in errors] == ["too_many_requests"]


def test_a_body_that_is_not_a_valid_request_is_left_to_the_line():
    """Only the line's own request fails (in the error file), as OpenAI does."""
    bad_body = json.dumps({"custom_id": "x", "method": "POST", "url": CHAT, "body": {"temperature": "hot"}})
    items, errors = parse(bad_body)
    assert errors == [] and items[0].body == {"temperature": "hot"}


def test_lines_end_at_newline_only_and_odd_lines_fail_cleanly():
    """U+2028 inside a JSON string is not a line break; nesting too deep to parse, a line over
    the size a NATS message carries, and long values echoed in errors are all handled."""
    sep = line("x\u2028y").replace("\\u2028", "\u2028")  # the raw character inside the string
    items, errors = parse(sep + "\r")
    assert errors == [] and items[0].custom_id == "x\u2028y"
    deep = '{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": ' + "[" * 100_000
    long_url = line("u", url="/v1/" + "z" * 10_000)
    _, errors = parse_batch_input("b", "\n".join([deep, long_url, line("big") + " " * 500]).encode(), CHAT,
                                  max_line_bytes=400)
    assert [(e.line, e.code) for e in errors] == [(1, "line_too_large"), (2, "line_too_large"), (3, "line_too_large")]
    _, errors = parse_batch_input("b", "\n".join([deep, long_url]).encode(), CHAT)
    assert [(e.line, e.code) for e in errors] == [(1, "invalid_json_line"), (2, "invalid_url")]
    assert len(errors[1].message) < 200


def test_without_an_endpoint_each_line_keeps_its_own_url():
    items, errors = parse(line("a"), line("b", url="/v1/completions"), endpoint=None)
    assert errors == [] and [i.url for i in items] == [CHAT, "/v1/completions"]


def test_at_most_a_hundred_errors_are_listed():
    _, errors = parse(*["{bad"] * 150)
    assert len(errors) == 100 and errors[-1].code == "too_many_errors" and errors[-1].message == "and 51 more errors"
