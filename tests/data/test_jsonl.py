"""JSON-lines rows, each named by file and line."""

import pytest

from areal_fast.data.jsonl import jsonl_rows


def test_rows_are_named_by_line_and_blank_lines_skipped(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"q": "1+1", "a": 2}\n\n  \n{"q": "2+2", "a": 4}\n')
    rows = jsonl_rows(path)
    assert rows == [
        (f"{path} line 1", {"q": "1+1", "a": 2}),
        (f"{path} line 4", {"q": "2+2", "a": 4}),
    ]


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"q": 1}\n{"q" 1}\n', " line 2: invalid JSON (Expecting ':' delimiter at column 6)"),
        ('{"q": 1}\n[1, 2]\n', " line 2: expected a JSON object, got list"),
        ("\n\n", ": file holds no rows"),
    ],
)
def test_bad_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        jsonl_rows(path)
    assert str(err.value) == f"{path}{message}"


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        jsonl_rows(tmp_path / "none.jsonl")
