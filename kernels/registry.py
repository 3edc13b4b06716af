"""Kernel paths as data: each is one object with the shapes it takes, its tile rule and its launch.

A dispatcher is an ordered ``Registry`` of ``KernelPath`` objects ending in the torch reference.
``choose(problem)`` walks the list once and returns the first path whose ``supports(problem)``
holds; the call then runs that path, and the name a benchmark table prints is that same
object's ``name``: what is reported is what ran.

``supports`` looks only at the ``problem`` (shapes, dtypes, formats, the device's capability and
SM count, all known on the host), never at tensor contents, so choosing syncs nothing and a call
can be captured in a CUDA graph. Tests build problems for devices they do not have (say, sm_90
with 132 SMs) and assert which path is chosen by identity.

Which paths may be chosen is an argument, ``kernels``: ``"auto"`` (every path, in order),
``"reference"`` (the torch reference only), or path names separated by commas (only those, in
registry order; the reference stays the last resort). One spelling serves every registry (the
linear layers' and attention's): a name belongs to one of them; a registry none of whose paths is
named stays on "auto" ("reference" applies to all).
``MXQ_KERNELS`` sets the default.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mxq import settings

ENV = settings.KERNELS
REGISTRIES: dict[str, Registry] = {}  # what -> registry, filled as the kernel modules are imported
# Every module that declares a registry (a test holds the list): a spec may name a path before its
# module was imported (MXQ_KERNELS=moe_block read at the first linear call), so an unknown name first
# imports these (``load_paths``).
PATH_MODULES = ("mxq.kernels.dispatch", "mxq.kernels.moe", "mxq.kernels.moe_block", "mxq.kernels.attention_decode",
                "mxq.kernels.attention_sdpa_decode")  # fmt: skip


@dataclass(frozen=True)
class KernelPath:
    """One way to compute a function: ``supports(problem)`` says where it may run, ``run`` runs
    it (same signature for every path of a registry), ``config(problem)`` gives its tiles for
    tables (None where the path has no tile rule). ``gluon``: the ``gluon_api`` name of a Gluon
    kernel that may be turned off at its first launch (the call then takes the next path)."""

    name: str
    summary: str
    supports: Callable = field(repr=False)
    run: Callable = field(repr=False)
    config: Callable | None = field(default=None, repr=False)
    gluon: str | None = None

    def describe(self, problem) -> str:
        """``name`` and, where the path has a tile rule, the config it runs this problem with."""
        cfg = self.config(problem) if self.config is not None else None
        return self.name if cfg is None else f"{self.name} {cfg}"


class Registry:
    """An ordered list of paths whose last entry is the reference (it supports every problem).
    Every path's ``run`` takes the same arguments: the problem, then the call's operands."""

    def __init__(self, what: str, paths: list[KernelPath]):
        names = [p.name for p in paths]
        if len(set(names)) != len(names) or not paths or paths[-1].name != "reference":
            raise ValueError(f"{what}: path names must be unique and end with 'reference', got {names}")
        self.what = what
        self.paths = tuple(paths)
        self._by_name = {p.name: p for p in paths}
        self._allowed: dict[str, tuple[KernelPath, ...]] = {}  # per spec: parsed once (decode is host-bound)
        REGISTRIES[what] = self

    def __getitem__(self, name: str) -> KernelPath:
        return self._by_name[name]

    def __iter__(self):
        return iter(self.paths)

    def names(self) -> list[str]:
        return [p.name for p in self.paths]

    def allowed(self, kernels: str | None) -> tuple[KernelPath, ...]:
        """The paths ``kernels`` admits, in registry order (module doc); raises on an unknown name."""
        spec = kernels_spec(kernels)
        if torch.compiler.is_compiling():
            # parsed, not memoised: dynamo guards on what a traced call reads, and a memo read (and
            # filled) while tracing fails its own guard on the next call, a recompile of the model
            return self._parse(spec)
        hit = self._allowed.get(spec)
        if hit is None:
            hit = self._allowed[spec] = self._parse(spec)
        return hit

    def _parse(self, spec: str) -> tuple[KernelPath, ...]:
        if spec == "auto":
            return self.paths
        wanted = spec.split(",")
        if spec != "reference" and not any(w in self._by_name for w in wanted):
            return self.paths  # names only other registries' paths: this function stays on auto
        return tuple(p for p in self.paths if p.name in wanted or p.name == "reference")

    def choose(self, problem, kernels: str | None = None, skip: KernelPath | None = None) -> KernelPath:
        """The first admitted path that supports ``problem`` (after ``skip``, when given)."""
        paths = self.allowed(kernels)
        if skip is not None:
            paths = paths[paths.index(skip) + 1 :] if skip in paths else paths
        for path in paths:
            if path.name == "reference" or path.supports(problem):
                return path
        raise AssertionError("unreachable: the reference supports every problem")


def kernels_spec(kernels: str | None) -> str:
    """The normalised spec of a ``kernels`` argument: ``check_kernels(kernels)``, or for None the
    default (``default_kernels``)."""
    return check_kernels(kernels) if kernels is not None else default_kernels()


def default_kernels() -> str:
    """The spec used where no ``kernels`` argument is given: ``$MXQ_KERNELS``, else "auto"."""
    return check_kernels(settings.kernels() or "auto", source=ENV)


CHECKED: dict[tuple, str] = {}  # check_kernels' memo: (kernels, source) -> spec


def check_kernels(kernels: str | None, source: str | None = None) -> str:
    """``kernels`` normalised ("auto", "reference" or known names joined by commas); a ValueError
    naming ``source`` (the option or variable it came from) and the unknown name otherwise.
    Memoized (calls sit on the decode path) in a plain dict, not ``functools.lru_cache``: traced code
    calls it (the attention's kernel choice under ``torch.compile``), and an lru_cache wrapper there
    makes Dynamo warn the user. A name not known yet is not cached. Nor is anything while Dynamo traces
    (``Registry.allowed`` says why)."""
    if torch.compiler.is_compiling():
        return _normalised(kernels, source)
    key = (kernels, source)
    spec = CHECKED.get(key)
    if spec is None:
        spec = _normalised(kernels, source)
        if len(CHECKED) >= 256:
            CHECKED.clear()
        CHECKED[key] = spec
    return spec


check_kernels.cache_clear = CHECKED.clear  # as functools' memo offers (tests register paths)


def load_paths() -> None:
    """Import every module of ``PATH_MODULES`` (those Triton cannot import stay out): then every path
    name is known, and ``mxq kernels`` lists every registry."""
    for name in PATH_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _normalised(kernels: str | None, source: str | None) -> str:
    spec = (kernels or "auto").strip().lower()
    if spec in ("auto", "reference"):
        return spec
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    known = {n for r in REGISTRIES.values() for n in r.names()}
    if any(s not in known for s in wanted):  # perhaps a path of a module not imported yet
        load_paths()
        known = {n for r in REGISTRIES.values() for n in r.names()}
    unknown = [s for s in wanted if s not in known]
    if unknown or not wanted:
        where = f"{source}={kernels!r}" if source else f"kernels={kernels!r}"
        raise ValueError(f"{where}: unknown kernel path {', '.join(unknown) or repr(spec)}; expected 'auto', 'reference' or names from {sorted(known)}")
    return ",".join(wanted)
