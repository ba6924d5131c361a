"""The native extension's fallback warning names the areal_fast that was imported and,
when a source tree shadows an installed package that has the extension, says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import areal_fast
from areal_fast import _native

IMPORTED = Path(areal_fast.__file__).resolve().parent


def _fake_install(root: Path, with_extension: bool) -> Path:
    package = root / "site-packages" / "areal_fast"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if with_extension:
        (package / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    return package


def test_warning_names_the_shadowing_source_tree(tmp_path, monkeypatch):
    installed = _fake_install(tmp_path, with_extension=True)
    monkeypatch.setattr(_native, "installed_package_dir", lambda: installed)
    monkeypatch.setitem(sys.modules, "areal_fast._C", None)  # the import fails
    monkeypatch.delattr("areal_fast._C", raising=False)
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    monkeypatch.delenv(_native.REQUIRE_ENV, raising=False)
    _native._import_native.cache_clear()
    try:
        with pytest.warns(RuntimeWarning) as caught:
            assert _native.load_native() is None
    finally:
        _native._import_native.cache_clear()
    message = str(caught[0].message)
    assert (
        f"imported from {IMPORTED}, which shadows the installed areal_fast at {installed}"
        in message
    )
    assert f"remove {IMPORTED.parent} from sys.path" in message
    assert "C++ compiler" not in message and "\n" not in message


def test_a_required_extension_that_fails_to_import_raises(tmp_path, monkeypatch):
    installed = _fake_install(tmp_path, with_extension=True)
    monkeypatch.setattr(_native, "installed_package_dir", lambda: installed)
    monkeypatch.setitem(sys.modules, "areal_fast._C", None)  # the import fails
    monkeypatch.delattr("areal_fast._C", raising=False)
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    monkeypatch.setenv(_native.REQUIRE_ENV, "1")
    _native._import_native.cache_clear()
    try:
        with pytest.raises(
            ImportError, match="AREAL_FAST_REQUIRE_NATIVE=1: areal_fast native"
        ) as err:
            _native.load_native()
        with pytest.raises(ImportError):  # not cached: every call raises
            _native.load_native()
    finally:
        _native._import_native.cache_clear()
    assert "slower Python" not in str(err.value) and "shadows the installed" in str(err.value)


@pytest.mark.parametrize("install", ["none", "without extension", "same folder"])
def test_warning_without_a_shadowed_install_says_to_rebuild(tmp_path, monkeypatch, install):
    installed = {
        "none": None,
        "same folder": IMPORTED,
        "without extension": _fake_install(tmp_path, with_extension=False),
    }[install]
    monkeypatch.setattr(_native, "installed_package_dir", lambda: installed)
    message = _native.unavailable_message(ImportError("No module named 'areal_fast._C'"))
    assert f"imported from {IMPORTED}, which has no built extension" in message
    assert "reinstall areal_fast with a C++ compiler" in message
    assert "No module named 'areal_fast._C'" in message and "shadows" not in message
