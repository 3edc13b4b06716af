"""The import graph of ``mxq/`` (its modules and rooms) follows docs/ARCHITECTURE.md: imports run only downward.

Also ``kernels/*.py`` (``mxq.kernels``): its modules form no circle and reach nothing in mxq but
``mxq.formats``, ``mxq.settings`` (the environment) and ``mxq.compat`` (the releases); no module of
mxq/ or kernels/ grows past ``MAX_KERNEL_LINES``. And ``eval/*.py`` (``mxq.eval``) sits beside the
pipeline stages: it imports neither the CLI nor upward.

``cli → {calib, convert, hf, eval} → {runtime, checkpoint, recipe} → {formats, kernels, settings, compat}``;
no two modules import each other, not even lazily inside a function; the on-disk config schema
(``mxq.checkpoint.config``) and ``mxq.formats`` need no transformers. The graph is read with ``ast``
from the source (imports inside functions included), so a lazy import that closes a circle fails
here although Python would tolerate it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "mxq"
PACKAGE = "mxq"  # the node of mxq/__init__.py: what ``import mxq`` runs (public API, registration)
OUTSIDE = ("kernels", "eval")  # subpackages mapped into mxq (package-dir), one node each
ROOMS = ("calib", "checkpoint", "cli", "convert", "hf", "runtime")  # mxq's subpackages: a step of the pipeline each

# Layer of every module (named by its path under mxq/, dotted), top (0) to bottom (3). A module may
# import its own layer or lower ones. A room's ``__init__`` (node: the room's name) only documents it
# and loads its modules on demand, except ``cli``'s, which is the command line itself.
LAYERS = {
    0: {"cli", "cli.__main__", "cli.bench", "cli.eval", "cli.inspect_cmd", "cli.tune"},
    1: {PACKAGE, "calib.calibrator", "calib.sensitivity", "calib.gptq", "calib.gptq_core", "calib.gptq_experts",
        "calib.signround", "convert.converter", "convert.layout", "convert.source", "checkpoint.describe",
        "hf.quantizer", "hf.models", "hf.quantize", "eval"},
    2: {"runtime.experts", "runtime.tp", "runtime.fuse", "runtime.routing", "runtime.linear", "runtime.embedding",
        "runtime.attention", "runtime.decode", "checkpoint.files", "checkpoint.validate", "checkpoint.config",
        "calib.plan", "calib.reorder", "recipe", "progress"},
    3: {"formats", "kernels", "runtime.install", "settings", "lazy", "compat", *(r for r in ROOMS if r != "cli")},
}  # fmt: skip
LAYER = {m: rank for rank, mods in LAYERS.items() for m in mods}
NO_TRANSFORMERS = ("checkpoint.config", "formats", "settings")


def _node(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts) or PACKAGE


def _modules() -> dict[str, Path]:
    return {_node(p): p for p in SRC.rglob("*.py")}


def _known(dotted: str, known: set[str]) -> str:
    """The longest known node that ``dotted`` (a path under mxq, dotted) lies in."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return PACKAGE


def _target(dotted: str, names: list[str], known: set[str]) -> set[str]:
    """The mxq nodes an ``import``/``from ... import`` of ``dotted`` (names: what ``from`` takes) reaches."""
    parts = dotted.split(".")
    if parts[0] != PACKAGE:
        return set()
    base = ".".join(parts[1:])
    if not names:  # ``import mxq.a.b``
        return {_known(base, known)} if base else {PACKAGE}
    # ``from mxq.a import b, c``: submodules by name, anything else is the package ``a``
    return {_known(f"{base}.{n}" if base else n, known) if f"{base}.{n}".strip(".") in known
            else (_known(base, known) if base else PACKAGE) for n in names}  # fmt: skip


def _imports(path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(mxq nodes, other top-level packages) that ``path`` imports anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    mxq_deps, other = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                mxq_deps |= _target(alias.name, [], known)
                other.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import (mxq imports by absolute name)"
            dotted = node.module or ""
            mxq_deps |= _target(dotted, [a.name for a in node.names], known)
            other.add(dotted.split(".")[0])
    return mxq_deps, other - {PACKAGE}


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    known = set(mods) | set(OUTSIDE)
    edges, external = {}, {}
    for name, path in mods.items():
        deps, other = _imports(path, known)
        edges[name] = deps - {name}
        external[name] = other
    return edges, external


def test_every_module_has_a_layer(graph):
    edges, _ = graph
    missing = sorted((set(edges) | {d for ds in edges.values() for d in ds}) - set(LAYER))
    assert not missing, f"mxq modules with no layer in tests/test_layers.py (place them per ARCHITECTURE.md): {missing}"


def test_no_upward_import(graph):
    edges, _ = graph
    upward = sorted(
        f"mxq.{a} imports mxq.{b} (layer {LAYER[a]} -> {LAYER[b]})"
        for a, ds in edges.items()
        for b in ds
        if a in LAYER and b in LAYER and LAYER[b] < LAYER[a]
    )
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_cycle(graph):
    edges, _ = graph
    cycles = _cycles(edges)
    assert not cycles, "import cycles among mxq modules:\n" + "\n".join(cycles)


def test_config_and_formats_reach_no_transformers(graph):
    edges, external = graph
    for root in NO_TRANSFORMERS:
        assert root in edges, f"mxq.{root} is missing"
        seen, todo = set(), [root]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(edges.get(n, ()))
        glue = {PACKAGE, "hf.quantizer", "runtime.attention"}
        assert not seen & glue, f"mxq.{root} reaches {sorted(seen & glue)}"
        bad = sorted(m for m in seen if "transformers" in external.get(m, ()))
        assert not bad, f"mxq.{root} imports (through {bad}) transformers"


def test_config_and_formats_import_without_transformers():
    """Import ``mxq.checkpoint.config`` and ``mxq.formats`` for real, past ``mxq/__init__.py`` (which loads the
    transformers glue on purpose): nothing they pull in, third-party packages included, may load
    transformers."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType({PACKAGE!r}); pkg.__path__ = [{str(SRC)!r}]; sys.modules[{PACKAGE!r}] = pkg\n"
        + "".join(
            f"import mxq.{m}\nassert mxq.{m}.__file__.startswith({str(SRC)!r}), mxq.{m}.__file__\n"
            for m in NO_TRANSFORMERS
        )
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "assert not bad, bad[:5]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


KERNELS = SRC.parent / "kernels"
EVAL = SRC.parent / "eval"
# A kernel module holds one kernel family: its kernels, host wrapper and tile rule. Past this many
# lines it is split by topic (the registry, the shared helpers in kernels/common.py).
MAX_KERNEL_LINES = 650


def _subpackage_graph(folder: Path, sub: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Edges among ``mxq.<sub>.*`` modules, and the other mxq nodes each reaches."""
    mods = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    edges, outside = {}, {}
    for name in mods | {"__init__"}:
        tree = ast.parse((folder / f"{name}.py").read_text())
        inner, other = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                dotted, names = node.module or "", [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                dotted, names = None, [a.name for a in node.names]
            else:
                continue
            for full in [dotted] if dotted is not None else names:
                parts = full.split(".")
                if parts[0] != PACKAGE:
                    continue
                if len(parts) >= 3 and parts[1] == sub:
                    inner.add(parts[2])
                elif len(parts) == 2 and parts[1] == sub:
                    inner |= {n for n in (names if dotted is not None else []) if n in mods}
                elif len(parts) >= 2:
                    other.add(parts[1])
        edges[name] = inner - {name}
        outside[name] = other
    return edges, outside


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(edges.get(n, ())):
            if state.get(d) == 1:
                found.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return found


def test_kernels_form_no_import_cycle_and_reach_only_formats():
    edges, outside = _subpackage_graph(KERNELS, "kernels")
    cycles = _cycles({k: v for k, v in edges.items() if k != "__init__"})
    assert not cycles, "import cycles among kernels/ modules:\n" + "\n".join(cycles)
    bad = sorted(f"kernels/{m}.py imports mxq.{o}" for m, os_ in outside.items() for o in os_ if o not in ("formats", "settings", "compat"))
    assert not bad, "kernels/ reaches mxq modules other than formats, settings and compat:\n" + "\n".join(bad)


def test_modules_stay_small():
    """No module of mxq/ or kernels/ past ``MAX_KERNEL_LINES``: one concept a module."""
    files = [*SRC.rglob("*.py"), *KERNELS.glob("*.py")]
    sizes = {str(p.relative_to(SRC.parent)): len(p.read_text().splitlines()) for p in files}
    big = sorted(f"{n}: {c} lines" for n, c in sizes.items() if c > MAX_KERNEL_LINES)
    assert not big, f"modules over {MAX_KERNEL_LINES} lines (split them by concept):\n" + "\n".join(big)


def test_eval_imports_no_cli_and_no_cycle():
    edges, outside = _subpackage_graph(EVAL, "eval")
    cycles = _cycles({k: v for k, v in edges.items() if k != "__init__"})
    assert not cycles, "import cycles among eval/ modules:\n" + "\n".join(cycles)
    bad = sorted(f"eval/{m}.py imports mxq.{o}" for m, os_ in outside.items() for o in os_ if LAYER.get(o, 3) < 1)
    assert not bad, "eval/ imports upward (the CLI):\n" + "\n".join(bad)


def test_the_environment_is_read_in_one_place():
    """Every ``MXQ_*`` variable mxq, its kernels and its eval harness name is one of the few that
    ``mxq.settings`` documents and reads; no other module reads one from the environment."""
    import re

    from mxq import settings

    assert len(settings.VARIABLES) <= 5
    named, reads = set(), []
    for root in (SRC, KERNELS, SRC.parent / "eval"):
        for p in root.rglob("*.py"):
            text = p.read_text()
            named |= set(re.findall(r"[\"'](MXQ_[A-Z0-9_]+)[\"']", text))
            if p.name != "settings.py":
                reads += [f"{p.parent.name}/{p.name}: {m}" for m in re.findall(r"(?:environ\.get|getenv)\([\"']MXQ_[A-Z0-9_]*", text)]
    assert named <= set(settings.VARIABLES), sorted(named - set(settings.VARIABLES))
    assert not reads, reads


ARCH = SRC.parent / "docs" / "ARCHITECTURE.md"


def test_architecture_names_what_the_code_holds():
    """docs/ARCHITECTURE.md's layer table lists exactly the modules of each layer above, and every
    file path it names exists."""
    import re

    text = ARCH.read_text()
    rows = {int(m.group(1)): set(re.findall(r"`([a-z_.]+)`", m.group(2)))
            for m in re.finditer(r"^\| (\d): [^|]+\| (.+) \|$", text, re.M)}  # fmt: skip
    assert rows.keys() == LAYERS.keys()
    for rank, mods in LAYERS.items():
        assert rows[rank] == mods, (rank, sorted(rows[rank] ^ mods))
    paths = set(re.findall(r"\b((?:mxq|kernels|eval|tests|recipes|docs|tools)/[\w./-]+\.(?:py|yaml|md|json))\b", text))
    assert paths, "no file paths found: the pattern no longer matches the document"
    missing = sorted(p for p in paths if not (SRC.parent / p).exists())
    assert not missing, missing
    # the rooms' tree: every module of mxq/ listed, in its room, and nothing else
    tree = text[text.index("## The rooms"):text.index("## The data path")]
    listed, room = set(), None
    for line in tree.splitlines():
        if m := re.match(r"^(mxq/(?:\w+/)?)(\S*)", line):
            room = m.group(1) if not m.group(2) else None
            listed |= {m.group(1) + m.group(2)} if m.group(2) else set()
        elif room and line.startswith("  "):
            listed |= {room + f for f in line.split()}
    held = {str(p.relative_to(SRC.parent)) for p in SRC.rglob("*.py")}
    rooms_init = {f"mxq/{r}/__init__.py" for r in ROOMS}  # listed or not: a room's own file
    assert listed - rooms_init == held - rooms_init, sorted((listed ^ held) - rooms_init)
    assert {f"mxq/{r}/" for r in ROOMS} <= {line.split()[0] for line in tree.splitlines() if line.startswith("mxq/")}


def test_forwards_are_set_in_one_place():
    """No module of mxq/ or kernels/ sets a forward on a module but ``mxq.runtime.install`` (an
    assignment to ``<x>.forward``, ``setattr(<x>, "forward", ...)`` or ``<x>.__dict__["forward"]``)."""
    found = []
    for path in [*SRC.rglob("*.py"), *KERNELS.glob("*.py")]:
        if path == SRC / "runtime" / "install.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
            hit = any(isinstance(t, ast.Attribute) and t.attr == "forward" for t in targets)
            hit |= any(isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == "forward" for t in targets)
            hit |= (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value == "forward")  # fmt: skip
            if hit:
                found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not found, f"forwards set outside mxq/runtime/install.py: {found}"
