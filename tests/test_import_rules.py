"""The package's import rules, read from the source (nothing is imported): no import circles,
and the layer rules of ARCHITECTURE's table (cli / launch > controller > rollout | train > sync
> rl > ops > kernels).

Every ``areal_fast/**.py`` is parsed with ``ast``, and ``kernels/*.py`` as the
``areal_fast.kernels`` package the wheel ships them as. Each import statement anywhere in a
file is an arrow from its module to the module it names: at module level, inside functions
(lazy imports) and under ``if TYPE_CHECKING:`` alike; relative imports are resolved;
``from P import name`` points at the submodule ``P.name`` when there is one, else at ``P``.
Importing a submodule does not count as an arrow to its parent packages, and what
``importlib.import_module`` loads is not read. An import of an ``areal_fast`` module that does
not exist fails the test.

To add a rule, add a row to :data:`RULES` (``forbid(importer, [forbidden, ...], reason)``);
the helpers (:func:`import_graph`, :func:`import_circles`, :func:`rule_breaks`) know nothing
of this package's layout.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "areal_fast"
# where each package's sources are: areal_fast/ itself, and kernels/ shipped as areal_fast.kernels
SOURCE_ROOTS = {PACKAGE: REPO / "areal_fast", f"{PACKAGE}.kernels": REPO / "kernels"}
NATIVE = f"{PACKAGE}._C"  # the compiled extension: a module with no Python source


# --------------------------------------------------------------------------- the helpers


class Arrow(NamedTuple):
    """One import: ``importer`` (a module) names ``target`` (a module) at ``path:line``."""

    importer: str
    target: str
    path: Path
    line: int


def module_files(roots: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Module name → (file, whether it is a package's ``__init__.py``) for every ``.py`` file
    under each root (``{package name: folder}``)."""
    modules = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join([package, *parts])] = (path, is_package)
    return modules


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` statement of ``module`` imports from."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules one import statement names (``known``: the modules that exist)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _absolute(node, module, is_package)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(roots: dict[str, Path], leaves: tuple[str, ...] = ()) -> list[Arrow]:
    """Every import between modules under ``roots`` (see the module docstring).

    ``leaves`` are modules without Python source (a compiled extension) that may be
    imported. Imports of modules outside the roots' packages are left out.

    Raises
    ------
    AssertionError
        An import names a module under one of the roots that does not exist.
    """
    modules = module_files(roots)
    known = set(modules) | set(leaves)
    arrows = []
    for module, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in dict.fromkeys(_targets(node, module, is_package, known)):
                if not any(_under(target, root) for root in roots):
                    continue
                assert target in known, (
                    f"{path}:{node.lineno} imports {target}, which does not exist"
                )
                if target != module:
                    arrows.append(Arrow(module, target, path, node.lineno))
    return arrows


def import_circles(arrows: list[Arrow]) -> list[list[str]]:
    """The import circles: each strongly connected component of more than one module
    (Tarjan 1972), its modules sorted; the components sorted."""
    graph: dict[str, set[str]] = {}
    for arrow in arrows:
        graph.setdefault(arrow.importer, set()).add(arrow.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def _under(module: str, prefix: str) -> bool:
    """Whether ``module`` is ``prefix`` or inside it (``a.b`` is under ``a``, ``a.bc`` is not)."""
    return module == prefix or module.startswith(prefix + ".")


class Rule(NamedTuple):
    """Modules under ``importer`` must not import modules under ``forbidden`` (``reason``)."""

    importer: str
    forbidden: str
    reason: str


def forbid(importer: str, forbidden: list[str], reason: str) -> list[Rule]:
    """One :class:`Rule` per forbidden prefix, all with the same importer and reason."""
    return [Rule(importer, f, reason) for f in forbidden]


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def rule_breaks(arrows: list[Arrow], rules: list[Rule]) -> list[str]:
    """One line per import that breaks a rule: ``path:line: importer -> target (reason)``."""
    return [
        f"{_shown(a.path)}:{a.line}: {a.importer} -> {a.target} ({rule.reason})"
        for rule in rules
        for a in arrows
        if _under(a.importer, rule.importer) and _under(a.target, rule.forbidden)
    ]


# --------------------------------------------------------------------------- the rules


def _pkgs(*names: str) -> list[str]:
    return [f"{PACKAGE}.{name}" for name in names]


DRIVER = ("controller", "launch", "cli")  # the driver process and what starts it
PROCESSES = ("workers", "wire")  # the worker processes' own code, and what crosses to them
HELPERS = _pkgs(
    "_checks", "_native", "_nodes", "_replies", "_signals", "_user_code"
)  # shared leaves

RULES = [
    *forbid(f"{PACKAGE}.kernels",
            _pkgs("ops", "rl", "sync", "models", "data", "rollout", "train", "agent",
                  "integrations", *DRIVER, *PROCESSES),
            "kernels are the bottom layer: Triton code that knows no package above it"),
    *forbid(f"{PACKAGE}.ops",
            _pkgs("rl", "sync", "models", "data", "rollout", "train", "agent", "integrations",
                  *DRIVER, *PROCESSES),
            "ops holds the fast paths and their fallbacks; the losses are rl's, above it"),
    *forbid(f"{PACKAGE}.rl",
            _pkgs("sync", "models", "data", "rollout", "train", "agent", "integrations",
                  *DRIVER, *PROCESSES),
            "rl is pure tensor math over ops"),
    *forbid(f"{PACKAGE}.sync",
            _pkgs("data", "rollout", "train", "agent", "integrations", *DRIVER, *PROCESSES),
            "weight sync sits below both ends of a transfer, the trainer and the engines"),
    *forbid(f"{PACKAGE}.rollout", _pkgs("train"),
            "engines do not import the trainer: the names both use live below them "
            "(sync/adapter.py)"),
    *forbid(f"{PACKAGE}.train", _pkgs("rollout"), "the trainer does not import the engines"),
    *forbid(f"{PACKAGE}.rollout", _pkgs("agent", "integrations", *DRIVER, *PROCESSES),
            "engines run inside workers and know nothing of what drives them"),
    *forbid(f"{PACKAGE}.train", _pkgs("agent", "integrations", *DRIVER, *PROCESSES),
            "the trainer engine runs inside workers and knows nothing of what drives it"),
    *forbid(f"{PACKAGE}.agent", _pkgs("train", *DRIVER, *PROCESSES),
            "agents run in rollout workers: they know the engines, not the trainer or the driver"),
    *forbid(f"{PACKAGE}.models",
            _pkgs("rl", "sync", "data", "rollout", "train", "agent", "integrations", *DRIVER, *PROCESSES),
            "model loading and attention patches know no RL"),
    *forbid(f"{PACKAGE}.data",
            _pkgs("ops", "rl", "sync", "models", "rollout", "train", "agent", "integrations",
                  *DRIVER, *PROCESSES),
            "tasks and rewards are plain data and user code"),
    *forbid(f"{PACKAGE}.integrations",
            _pkgs("sync", "rollout", "train", "agent", *DRIVER, *PROCESSES),
            "the TRL and verl adapters are drop-in losses: ops and rl only"),
    *forbid(f"{PACKAGE}.controller", _pkgs("launch", "cli"),
            "the driver knows no launcher: the launcher wires it"),
    *forbid(f"{PACKAGE}.controller", _pkgs("workers"),
            "the driver talks to the workers only through areal_fast.wire"),
    *forbid(f"{PACKAGE}.workers", _pkgs("controller", "launch", "cli"),
            "worker processes know only the messages, never the driver's code"),
    *forbid(f"{PACKAGE}.wire", _pkgs("controller", "workers", "launch", "cli"),
            "the wire is shared by both sides and knows neither"),
    *forbid(f"{PACKAGE}.launch", _pkgs("cli"),
            "the launcher is below the command line: cli imports launch, never the reverse"),
    *[rule for importer in HELPERS
      for rule in forbid(importer,
                         _pkgs("kernels", "ops", "rl", "sync", "models", "data", "rollout",
                               "train", "agent", "integrations", *DRIVER, *PROCESSES),
                         "the private helpers are leaves that every layer may use")],
]  # fmt: skip

# Circles that are tolerated, each the set of modules of one circle: none. A circle not listed
# fails the test, and so does an entry whose circle is gone.
ALLOWED_CIRCLES: list[set[str]] = []


# --------------------------------------------------------------------------- the tests


def _arrows() -> list[Arrow]:
    return import_graph(SOURCE_ROOTS, leaves=(NATIVE,))


def test_no_import_circles():
    circles = import_circles(_arrows())
    new = [c for c in circles if set(c) not in ALLOWED_CIRCLES]
    gone = [sorted(a) for a in ALLOWED_CIRCLES if sorted(a) not in circles]
    files = {m: _shown(p) for m, (p, _) in module_files(SOURCE_ROOTS).items()}
    assert not new, "import circles:\n" + "\n".join(
        " <-> ".join(files[m] for m in circle) for circle in new
    )
    assert not gone, f"circles in ALLOWED_CIRCLES that are gone (remove them): {gone}"


def test_layer_rules():
    breaks = rule_breaks(_arrows(), RULES)
    assert not breaks, "imports that break a layer rule:\n" + "\n".join(breaks)


def test_every_rule_names_an_existing_module():
    modules = set(module_files(SOURCE_ROOTS))
    for rule in RULES:
        for prefix in (rule.importer, rule.forbidden):
            assert any(_under(m, prefix) for m in modules), f"{rule}: no module {prefix}"


def test_the_helpers_find_a_circle_and_a_forbidden_import(tmp_path):
    """The helpers on a tiny tree: a relative import, a type-only import and a lazy import."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import b\n"
    )
    (pkg / "high.py").write_text("from .low import a\n\ndef f():\n    import pkg.low.c\n")
    (pkg / "low" / "c.py").write_text("from . import a\n")
    arrows = import_graph({"pkg": pkg})
    assert {(a.importer, a.target) for a in arrows} == {
        ("pkg.low.a", "pkg.high"),
        ("pkg.high", "pkg.low.a"),
        ("pkg.high", "pkg.low.c"),
        ("pkg.low.c", "pkg.low.a"),
    }
    assert import_circles(arrows) == [["pkg.high", "pkg.low.a", "pkg.low.c"]]
    breaks = rule_breaks(arrows, forbid("pkg.low", ["pkg.high"], "low stays low"))
    assert len(breaks) == 1 and breaks[0].endswith("pkg.low.a -> pkg.high (low stays low)")
