"""A server's error reply as one bounded line."""

import json

from areal_fast._replies import MESSAGE_LIMIT, one_line, server_message


def test_one_line_joins_whitespace_and_cuts():
    assert one_line("a\n  b\tc ") == "a b c"
    long = "x" * (MESSAGE_LIMIT + 10)
    cut = one_line(long)
    assert len(cut) == MESSAGE_LIMIT and cut.endswith("...")
    assert one_line("abcdef", limit=5) == "ab..."
    assert one_line("abcde", limit=5) == "abcde"


def test_server_message_reads_the_known_json_fields():
    assert server_message(json.dumps({"message": "bad\nid"}).encode()) == "bad id"
    assert server_message(json.dumps({"detail": "not found"}).encode()) == "not found"
    nested = {"error": {"message": "out of memory", "code": 500}}
    assert server_message(json.dumps(nested).encode()) == "out of memory"
    # message wins over detail; an empty field is skipped
    assert server_message(json.dumps({"message": "", "detail": "d"}).encode()) == "d"


def test_server_message_falls_back_to_the_text():
    assert server_message(b"Internal Server Error\n") == "Internal Server Error"
    assert server_message(b'{"other": 1}') == '{"other": 1}'
    assert server_message(b"") == "(empty body)"
    assert server_message(b"\xff oops") == "\ufffd oops"
