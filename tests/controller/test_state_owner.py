"""The controller owns its state: no module but ``controller/async_loop.py`` assigns an attribute
of an :class:`~areal_fast.controller.async_loop.AsyncController`.

Read from the source with ``ast`` (nothing is imported). A name counts as a controller where it
is called ``controller``, is annotated ``AsyncController`` (a parameter or a variable,
``"AsyncController"`` strings included), or is assigned from a call of ``AsyncController`` or
of a function of the package annotated to return one; an assignment, augmented assignment or
``setattr`` on such a name in any other module fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "areal_fast"
OWNER = PACKAGE / "controller" / "async_loop.py"
CLASS = "AsyncController"


def _is_controller_annotation(node: ast.AST | None) -> bool:
    """Whether an annotation names the controller class (``AsyncController``, a dotted path to
    it, the same as a string, or either inside ``X | None`` / ``Optional[X]``)."""
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _is_controller_annotation(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return False
    if isinstance(node, ast.Name):
        return node.id == CLASS
    if isinstance(node, ast.Attribute):
        return node.attr == CLASS
    if isinstance(node, ast.BinOp):
        return _is_controller_annotation(node.left) or _is_controller_annotation(node.right)
    if isinstance(node, ast.Subscript):
        return _is_controller_annotation(node.slice)
    return False


def controller_factories(paths) -> set[str]:
    """Names of the functions in the files ``paths`` annotated to return a controller."""
    return {
        node.name
        for path in paths
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _is_controller_annotation(node.returns)
    }


def _controller_names(tree: ast.AST, factories: set[str]) -> set[str]:
    """Names that hold a controller somewhere in ``tree`` (see the module docstring)."""
    names = {"controller"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _is_controller_annotation(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and _is_controller_annotation(node.annotation):
            if isinstance(node.target, ast.Name):
                names.add(node.target.id)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called == CLASS or called in factories:
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def controller_writes(path: Path, factories: frozenset[str] = frozenset()) -> list[str]:
    """``file:line: name.attr`` for every attribute of a controller that the file at ``path``
    assigns (``=``, ``+=``, annotated, or ``setattr(name, ...)``); ``factories``: functions
    that return a controller."""
    tree = ast.parse(path.read_text(), str(path))
    names = _controller_names(tree, set(factories))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in names
        ):
            found.append((node.lineno, f"setattr({node.args[0].id}, ...)"))
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id in names
                    and isinstance(part.ctx, ast.Store)
                ):
                    found.append((node.lineno, f"{part.value.id}.{part.attr}"))
    return [f"{path.name}:{line}: {what}" for line, what in sorted(found)]


def test_only_async_loop_assigns_controller_attributes():
    paths = sorted(PACKAGE.rglob("*.py"))
    factories = frozenset(controller_factories(paths))
    assert "new_controller" in factories  # the launcher's, as a check that the scan reads them
    writes = [
        line for path in paths if path != OWNER for line in controller_writes(path, factories)
    ]
    assert not writes, "AsyncController attributes assigned outside async_loop.py:\n" + "\n".join(
        writes
    )


def test_the_check_sees_each_kind_of_write(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "def drain(c: 'AsyncController', n):\n"
        "    c.running = n\n"
        "    c.count += 1\n"
        "def build(cfg):\n"
        "    controller = AsyncController(cfg)\n"
        "    setattr(controller, 'x', 1)\n"
        "def recover(ctrl: AsyncController | None):\n"
        "    ctrl.failed: int = 2\n"
        "def fine(ledger):\n"
        "    ledger.running = 0\n"
        "def make() -> 'AsyncController':\n"
        "    ...\n"
        "def run(controller):\n"
        "    controller.version = 3\n"
        "    made = make()\n"
        "    made.saves = None\n"
    )
    path = tmp_path / "drain.py"
    path.write_text(source)
    factories = controller_factories([path])
    assert factories == {"make"}
    assert controller_writes(path, frozenset(factories)) == [
        "drain.py:3: c.running",
        "drain.py:4: c.count",
        "drain.py:7: setattr(controller, ...)",
        "drain.py:9: ctrl.failed",
        "drain.py:15: controller.version",
        "drain.py:17: made.saves",
    ]
