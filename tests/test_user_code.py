"""Importing user code named by a config key: ``module:name`` or ``file.py:name``."""

import pytest

from areal_fast._user_code import import_attribute


def test_module_and_name():
    import json

    assert import_attribute("json:dumps", "reward.path") is json.dumps


def test_file_is_imported_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text("CALLS = []\ndef score(c, s):\n    return 1.5\n")
    fn = import_attribute("my_reward.py:score", "reward.path")
    assert fn("x", {}) == 1.5
    again = import_attribute(f"{tmp_path / 'my_reward.py'}:CALLS", "reward.path")
    assert again is import_attribute("my_reward.py:CALLS", "reward.path")  # same module


@pytest.mark.parametrize(
    "path,message",
    [
        ("no_colon", "must be 'module:function' or 'file.py:function'"),
        ("json:", "must be 'module:function'"),
        ("missing.py:f", "no file 'missing.py'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz' (ModuleNotFoundError"),
        ("json:no_such_name", "'json' has no 'no_such_name'"),
        ("broken.py:f", "cannot import 'broken.py' (ZeroDivisionError: division by zero)"),
    ],
)
def test_errors_are_one_line_naming_the_key(path, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    with pytest.raises(ValueError) as err:
        import_attribute(path, "agent.path")
    text = str(err.value)
    assert text.startswith(f"agent.path = {path!r}") and message in text
    assert "\n" not in text
