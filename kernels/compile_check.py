"""Every kernel variant mxq launches, compiled again for sm_90 on a machine without a GPU.

A variant is one specialization Triton compiles: the kernel, its argument types, constexprs,
alignment attributes and options (warps, stages, registers). ``record`` notes each one that a
run on a GPU compiles (the runs are the GPU tests and benchmarks: the shapes and tiles dispatch
really chooses); ``compile_variant`` compiles a noted one for sm_90 with the installed Triton,
Triton's compiler, ptxas and all, which needs no GPU. CI does that with both of its Tritons
(``tests/test_compile_sm90.py``), so a kernel that a new Triton release cannot compile fails CI
with its name instead of at a user's first call. The Gluon kernels exist only where the Triton
has the Gluon API they are written for (``gluon_api.HAVE_GLUON``); elsewhere their declared
fall-back is dispatch's next path, and their variants are reported as not built. A Triton kernel
launched with programmatic dependent launch also fails if its PTX touches global memory before
``griddepcontrol.wait`` (``pdl_order``): it could read what the kernel before it has not yet written.

    python -m mxq.kernels.compile_check record FILE -- PYTEST_ARGS...   (on a GPU: run pytest, note variants)
    python -m mxq.kernels.compile_check select FILE OUT                  (a few variants a kernel)
    python -m mxq.kernels.compile_check check FILE                       (anywhere: compile every variant)
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl",
           "launch_cooperative_grid")  # fmt: skip


def _value(v):
    """A constexpr as JSON: plain values as they are, a dtype by name, a JIT function by module:name."""
    if isinstance(v, tl.constexpr):
        v = v.value
    if isinstance(v, tl.dtype):
        return {"dtype": str(v)}
    if isinstance(v, JITFunction):
        return {"jit": f"{v.fn.__module__}:{v.fn.__qualname__}"}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"constexpr of type {type(v).__name__} is not recorded")


def _unvalue(v):
    if isinstance(v, dict) and "dtype" in v:
        return tl.dtype(v["dtype"])
    if isinstance(v, dict) and "jit" in v:
        return resolve(v["jit"])
    return v


def resolve(name: str):
    """The JIT function ``module:qualname``."""
    module, _, qual = name.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def variant(fn: JITFunction, signature: dict, constexprs: dict, options, attrs: dict) -> dict:
    """One compile's specialization as JSON (keys by argument name, so that it reads across releases)."""
    names = fn.arg_names
    return {
        "kernel": f"{fn.fn.__module__}:{fn.fn.__qualname__}",
        "gluon": type(fn).__name__.startswith("Gluon"),
        "signature": dict(signature),
        "constexprs": {names[k[0]]: _value(v) for k, v in constexprs.items() if len(k) == 1},
        "attrs": {names[k[0]]: v for k, v in attrs.items() if len(k) == 1},
        "options": {k: getattr(options, k) for k in OPTIONS if hasattr(options, k)},
    }


@contextlib.contextmanager
def record(path: str | os.PathLike):
    """Note every kernel variant compiled inside the block (mxq's kernels only), merged into the
    JSON file ``path`` (written through a temporary file and a rename)."""
    found: dict[str, dict] = {}
    original = JITFunction._do_compile

    def noting(self, key, signature, device, constexprs, options, attrs, warmup):
        if self.fn.__module__.startswith("mxq."):
            try:
                v = variant(self, signature, constexprs, options, attrs)
                found[json.dumps(v, sort_keys=True)] = v
            except TypeError as e:
                print(f"compile_check: {self.fn.__qualname__} not recorded: {e}", file=sys.stderr)
        return original(self, key, signature, device, constexprs, options, attrs, warmup)

    JITFunction._do_compile = noting
    try:
        yield found
    finally:
        JITFunction._do_compile = original
        path = Path(path)
        old = json.loads(path.read_text()) if path.exists() else []
        merged = {json.dumps(v, sort_keys=True): v for v in old}
        merged.update(found)
        _write(path, sorted(merged.values(), key=lambda v: (v["kernel"], json.dumps(v, sort_keys=True))))


def _write(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON into ``path`` through a temporary file and a rename (never half-written)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> list[dict]:
    return json.loads(Path(path).read_text())


def select(variants: list[dict], per_kernel: int = 4) -> list[dict]:
    """At most ``per_kernel`` variants of each kernel, each chosen for the most constexpr and option
    values not yet covered (the first one in file order on a tie): the code paths, in fewer compiles."""
    out = []
    by_kernel: dict[str, list[dict]] = {}
    for v in variants:
        by_kernel.setdefault(v["kernel"], []).append(v)
    for rows in by_kernel.values():
        pairs = [{(k, json.dumps(x)) for k, x in {**r["constexprs"], **r["options"]}.items()} for r in rows]
        seen: set = set()
        left = list(range(len(rows)))
        for _ in range(min(per_kernel, len(rows))):
            best = max(left, key=lambda i: (len(pairs[i] - seen), -i))
            if seen and not pairs[best] - seen:
                break
            out.append(rows[best])
            seen |= pairs[best]
            left.remove(best)
    return out


def compile_variant(v: dict):
    """Compile the noted variant ``v`` for sm_90 with the installed Triton; returns the compiled
    kernel. Raises what Triton raises (a compile or ptxas error)."""
    fn = resolve(v["kernel"])
    names = fn.arg_names
    source = ASTSource
    if v["gluon"]:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    sig = {n: v["signature"].get(n, "constexpr") for n in names}
    cons = {(names.index(k),): _unvalue(x) for k, x in v["constexprs"].items()}
    attrs = {(names.index(k),): x for k, x in v["attrs"].items()}
    src = source(fn, sig, constexprs=cons, attrs=attrs)
    opts = dict(v["options"])
    if not opts.get("maxnreg"):
        opts.pop("maxnreg", None)
    return triton.compile(src, target=TARGET, options=opts)


# Triton kernels launched with programmatic dependent launch that touch global memory before their
# griddepcontrol.wait, and why that is safe. Every other one must wait first (``pdl_order``).
PDL_EARLY_ACCESS = {
    # the router's expert indices, and zero rows for absent slots: the kernel before it (the X
    # rounding) is not itself launched with PDL, so the router had finished before that one started
    "mxq.kernels.moe:grouped_decode_kernel",
}


def pdl_order(v: dict, ptx: str) -> str:
    """"" if the variant is fine, else why: a (non-Gluon) kernel launched with programmatic dependent
    launch may start while the kernel before it still runs, so it must not read or write global
    memory before ``griddepcontrol.wait`` (kernels/NOTES.md, "GEMM: decode fixed cost")."""
    if not v["options"].get("launch_pdl") or v["gluon"] or v["kernel"] in PDL_EARLY_ACCESS:
        return ""
    body = ptx[ptx.index(".entry") :]
    wait = body.find("griddepcontrol.wait")
    mem = re.search(r"\b(ld|st|atom|red)\.global|\bcp\.async", body)
    if mem and (wait < 0 or mem.start() < wait):
        return f"launched with PDL but {mem.group(0)} comes before griddepcontrol.wait"
    return ""


def check(variants: list[dict]) -> list[tuple[str, str, str]]:
    """(status, kernel, detail) per variant: "ok" (compiled for sm_90), "not-built" (a Gluon kernel
    this Triton cannot build: its declared fall-back runs) or "FAILED" (Triton's error). Run it in a
    process without ``TRITON_INTERPRET``: the interpreter replaces the JIT functions."""
    from mxq.kernels import gluon_api, toolchain

    toolchain.configure_ptxas()
    out = []
    for v in variants:
        if v["gluon"] and not gluon_api.HAVE_GLUON:
            out.append(("not-built", v["kernel"], str(gluon_api.PROBLEM)))
            continue
        try:
            k = compile_variant(v)
            ok = ".target sm_90" in k.asm["ptx"] and len(k.asm["cubin"]) > 0
            why = pdl_order(v, k.asm["ptx"]) if ok else "no sm_90 cubin"
            out.append(("FAILED", v["kernel"], why) if why else ("ok", v["kernel"], ""))
        except Exception as e:  # noqa: BLE001 - reported with the kernel's name
            out.append(("FAILED", v["kernel"], f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "record":
        import signal

        import pytest

        def stop(*_):  # a time limit's SIGTERM: pytest stops as on Ctrl-C and the variants are kept
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        rest = argv[argv.index("--") + 1 :] if "--" in argv else []
        with record(argv[1]) as found:
            rc = pytest.main(rest)
        print(f"compile_check: {len(found)} variants noted into {argv[1]}")
        return int(rc)
    if len(argv) == 3 and argv[0] == "select":  # keep the variants that cover the most (``select``)
        rows = select(load(argv[1]))
        _write(Path(argv[2]), rows)
        print(f"compile_check: {len(rows)} variants into {argv[2]}")
        return 0
    if len(argv) == 2 and argv[0] == "check":
        results = check(load(argv[1]))
        for status, name, detail in results:
            print(f"{status} {name}{': ' + detail if detail else ''}", flush=True)
        return 1 if any(r[0] == "FAILED" for r in results) else 0
    print("usage:\n" + "\n".join(ln for ln in __doc__.splitlines() if "python -m" in ln), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
