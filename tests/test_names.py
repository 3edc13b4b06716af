"""Every ``module.name`` that mxq's code reads off one of its own modules exists.

Much of mxq runs only on a Hopper GPU (the Gluon kernels, the kernel lanes, ``mxq tune``), so the CPU
suite never executes those lines, and a name moved from one module to another left them pointing at
nothing: ``kernels/lanes.py`` read ``gemm_decode_ws.TensorDescriptor`` and ``mxq tune`` read
``gemm_decode_ws.HAVE_GLUON`` after both had moved to ``gluon_api``, and each failed at its first GPU
call. This test resolves, in every source file, each attribute loaded off a name bound by
``import mxq...`` / ``from mxq... import module`` against the imported module itself, scope by scope
(a function's own imports shadow the file's; a name the scope also assigns is left alone), and each
``from mxq... import name`` at any depth. The tests are checked too: their GPU half runs only on a GPU.
"""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    p
    for folder in ("mxq", "kernels", "eval", "recipes", "tools", "tests")
    for p in (ROOT / folder).rglob("*.py")
    if "__pycache__" not in p.parts
)


def _module(name: str) -> types.ModuleType | None:
    try:
        m = importlib.import_module(name)
    except ImportError:
        return None
    return m if isinstance(m, types.ModuleType) else None


def _own_nodes(body: list[ast.stmt]):
    """Every node of this block, not descending into the functions and classes defined in it (their
    def and class statements themselves are yielded)."""
    todo = list(body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _imports(body: list[ast.stmt]) -> dict[str, types.ModuleType]:
    """Names this block binds to mxq modules by its own import statements."""
    out: dict[str, types.ModuleType] = {}
    for node in _own_nodes(body):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mxq" and not node.level:
            for a in node.names:
                m = _module(f"{node.module}.{a.name}")
                if m is not None:
                    out[a.asname or a.name] = m
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mxq":
                    m = _module(a.name if a.asname else "mxq")
                    if m is not None:
                        out[a.asname or "mxq"] = m
    return out


def _stored(body: list[ast.stmt]) -> set[str]:
    """Names this block assigns other than by import, the functions and classes it defines included."""
    names = set()
    for node in _own_nodes(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
    return names


def _missing(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, 'alias.attr') for each attribute read off an mxq module alias that the module lacks."""
    out = []

    def visit(body, scope_args, outer: dict[str, types.ModuleType]):
        aliases = {**outer, **_imports(body)}
        for name in _stored(body) | scope_args:
            aliases.pop(name, None)
        for node in _own_nodes(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}, aliases)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, set(), aliases)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name):
                m = aliases.get(node.value.id)
                if m is not None and not hasattr(m, node.attr):
                    out.append((node.lineno, f"{node.value.id}.{node.attr}"))

    visit(tree.body, set(), {})
    return out


def test_the_check_finds_a_missing_name():
    """The checker itself: a name read off an imported mxq module that it does not define is found, one
    it defines is not, and a local that shadows the alias is left alone."""
    src = (
        "from mxq.kernels import gluon_api as G\n"
        "def f():\n    return G.TensorDescriptor, G.no_such_name\n"
        "def g(G):\n    return G.anything\n"
        "def h():\n    from mxq.kernels import tune as G\n    return G.lookup, G.TensorDescriptor\n"
    )
    assert sorted(_missing(ast.parse(src))) == [(3, "G.no_such_name"), (8, "G.TensorDescriptor")]


def _unimportable(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, 'module.name') for each ``from mxq.module import name`` (at any depth: a function's own
    imports run only when it is called) whose module lacks the name and has no such submodule."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mxq" and not node.level:
            m = _module(node.module)
            if m is None:
                out.append((node.lineno, node.module))
                continue
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if a.name != "*" and not hasattr(m, a.name) and _module(f"{node.module}.{a.name}") is None]  # fmt: skip
    return out


def test_the_import_check_finds_a_missing_name():
    src = "def f():\n    from mxq.kernels.gluon_api import TensorDescriptor, no_such_name\n    from mxq.kernels import tune\n"
    assert _unimportable(ast.parse(src)) == [(2, "mxq.kernels.gluon_api.no_such_name")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_read_off_an_mxq_module_exists(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    missing = _missing(tree) + _unimportable(tree)
    assert not missing, f"{path.relative_to(ROOT)}: " + ", ".join(f"line {n}: {what}" for n, what in missing)
