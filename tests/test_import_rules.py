"""Layer rules of the package, read from the imports of every module under ``areal_fast/``
(with ``ast``; imports inside functions and type-only ``if TYPE_CHECKING:`` imports count too).

Each rule is one row of :data:`FORBIDDEN_IMPORTS`: modules of the first package must not
import anything of the second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "areal_fast"

# (importing package, forbidden package, why)
FORBIDDEN_IMPORTS: list[tuple[str, str, str]] = [
    (
        "areal_fast.controller",
        "areal_fast.workers",
        "the driver talks to the workers only through areal_fast.wire",
    ),
    (
        "areal_fast.workers",
        "areal_fast.controller",
        "worker processes know only the messages, never the driver's code",
    ),
    ("areal_fast.wire", "areal_fast.controller", "the wire is shared by both sides"),
    ("areal_fast.wire", "areal_fast.workers", "the wire is shared by both sides"),
]


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    """Dotted module name of a file under the package folder ``root`` (``__init__.py``: the
    package itself)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PACKAGE_ROOT) -> list[tuple[int, str]]:
    """Every ``(line, absolute module name)`` that the file at ``path`` (under the package
    folder ``root``) imports, anywhere in it; ``from X import y`` yields both ``X`` and
    ``X.y`` (``y`` may be a submodule), and a relative import is resolved against the file's
    own package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def within(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its submodules."""
    return module == package or module.startswith(package + ".")


def forbidden_imports_of(rules: list[tuple[str, str, str]], root: Path = PACKAGE_ROOT) -> list[str]:
    """One line ``file:line: importer imports target (reason)`` per import statement under the
    package folder ``root`` that breaks one of ``rules`` (the shortest forbidden name it
    imports); empty when every rule holds."""
    broken: dict[tuple, str] = {}  # (file, line, importer, reason) -> shortest target
    for path in sorted(root.rglob("*.py")):
        importer, where = module_name(path, root), str(path.relative_to(root.parent))
        for line, target in imported_modules(path, root):
            for source, forbidden, reason in rules:
                if within(importer, source) and within(target, forbidden):
                    key = (where, line, importer, reason)
                    broken[key] = min(broken.get(key, target), target, key=len)
    return [
        f"{where}:{line}: {importer} imports {target} ({reason})"
        for (where, line, importer, reason), target in sorted(broken.items())
    ]


def test_every_rule_names_an_existing_package():
    for source, forbidden, _ in FORBIDDEN_IMPORTS:
        for package in (source, forbidden):
            folder = PACKAGE_ROOT.parent.joinpath(*package.split("."))
            assert (folder / "__init__.py").is_file(), f"{package} is not a package"


def test_no_forbidden_imports():
    broken = forbidden_imports_of(FORBIDDEN_IMPORTS)
    assert not broken, "imports that break a layer rule:\n" + "\n".join(broken)


def _tiny_package(tmp_path: Path, loop_source: str) -> Path:
    """A package ``areal_fast`` with ``controller/loop.py`` holding ``loop_source`` and an
    empty ``workers`` package; returns its folder."""
    root = tmp_path / "areal_fast"
    for package in (root, root / "controller", root / "workers"):
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text("")
    (root / "controller" / "loop.py").write_text(loop_source)
    return root


RULE = [("areal_fast.controller", "areal_fast.workers", "test")]


@pytest.mark.parametrize(
    "source,line,target",
    [
        ("from areal_fast.workers import core_share\n", 1, "areal_fast.workers"),
        ("from areal_fast import workers\n", 1, "areal_fast.workers"),
        (
            "import areal_fast.workers.rollout_worker as rw\n",
            1,
            "areal_fast.workers.rollout_worker",
        ),
        (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from areal_fast.workers.reward_pool import RewardPool\n",
            3,
            "areal_fast.workers.reward_pool",
        ),
        ("def f():\n    from ..workers import trainer_worker\n", 2, "areal_fast.workers"),
    ],
)
def test_the_check_sees_every_kind_of_import(tmp_path, source, line, target):
    broken = forbidden_imports_of(RULE, _tiny_package(tmp_path, source))
    assert broken == [
        f"areal_fast/controller/loop.py:{line}: areal_fast.controller.loop imports {target} (test)"
    ]


def test_allowed_imports_pass(tmp_path):
    source = "from areal_fast.wire import messages\nfrom . import ledger\nimport areal_fast\n"
    assert forbidden_imports_of(RULE, _tiny_package(tmp_path, source)) == []
