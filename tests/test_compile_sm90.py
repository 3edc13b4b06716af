"""Every kernel variant recorded from the GPU tests compiles for sm_90 with this environment's
Triton, on a CPU (``mxq.kernels.compile_check``): CI runs this with the pinned Triton and with the
latest release, so a kernel a new release cannot compile fails here, by name. Gluon kernels that
the installed Triton cannot build are reported with their declared fall-back (``gluon_api``)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mxq.kernels import compile_check, gluon_api  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "kernel_variants.json"


def _check(path: Path) -> tuple[int, list[tuple[str, str]]]:
    """``compile_check check`` in a fresh process: the test session runs Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "mxq.kernels.compile_check", "check", str(path)],
                       capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    lines = [ln.split(" ", 1) for ln in r.stdout.splitlines() if ln.split(" ", 1)[0] in ("ok", "not-built", "FAILED")]
    return r.returncode, [(a, b) for a, b in lines]


def test_recorded_variants_compile_for_sm90():
    variants = compile_check.load(DATA)
    assert len({v["kernel"] for v in variants}) >= 20
    rc, lines = _check(DATA)
    failed = [b for a, b in lines if a == "FAILED"]
    assert not failed, "kernels this Triton cannot compile for sm_90:\n" + "\n".join(failed)
    assert rc == 0 and len(lines) == len(variants)
    for (status, detail), v in zip(lines, variants):
        assert detail.startswith(v["kernel"])
        assert status == ("not-built" if v["gluon"] and not gluon_api.HAVE_GLUON else "ok"), detail


def test_every_recorded_kernel_is_still_there():
    """A renamed or removed kernel, or a changed argument list, leaves no stale entry behind: the
    file is re-recorded instead (``compile_check record``)."""
    for v in compile_check.load(DATA):
        if v["gluon"] and not gluon_api.HAVE_GLUON:
            continue
        fn = compile_check.resolve(v["kernel"])
        assert set(v["signature"]) == set(fn.arg_names), v["kernel"]
        assert set(v["constexprs"]) | set(v["attrs"]) <= set(fn.arg_names), v["kernel"]


def test_a_variant_reads_back_as_it_was_compiled(tmp_path):
    """variant() -> JSON -> compile_variant(): constexprs by name (a dtype among them), the alignment
    attributes and the options survive; a broken constexpr fails by the kernel's name."""
    fn = compile_check.resolve("mxq.kernels.moe_decode:down_combine_kernel")
    names = fn.arg_names
    ptrs = dict(h_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*u8", b_ptr="*bf16", out_ptr="*bf16", ids_ptr="*i64",
                pos_ptr="*i64", rw_ptr="*bf16")  # fmt: skip
    cons = dict(TOPK=8, BN=8, BK=256, BS=32, HAS_BIAS=False, EVEN_K=True, QUANT=True, NUM_STAGES=2, SORTED=False,
                EMAX=8, MBITS=3, MAXN=448.0, EMIN=-6, RULE=0, HW_CVT=True, FP8=tl.float8e4nv)  # fmt: skip
    sig = {n: "constexpr" if n in cons else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("h_ptr", "w_ptr", "K")}
    opts = SimpleNamespace(num_warps=4, num_stages=3, num_ctas=1, maxnreg=None, enable_fp_fusion=True)
    v = compile_check.variant(fn, sig, {(names.index(k),): tl.constexpr(x) for k, x in cons.items()}, opts, attrs)
    path = tmp_path / "v.json"
    path.write_text(json.dumps([v, {**v, "constexprs": {**v["constexprs"], "BS": 24}}]))  # a block of 24: no arange
    back = compile_check.load(path)[0]
    assert back["kernel"] == "mxq.kernels.moe_decode:down_combine_kernel" and back["gluon"] is False
    assert back["constexprs"]["FP8"] == {"dtype": "fp8e4nv"} and back["constexprs"]["BK"] == 256
    assert back["attrs"]["K"] == [["tt.divisibility", 16]] and back["options"]["num_warps"] == 4
    rc, lines = _check(path)
    assert rc == 1 and [a for a, _ in lines] == ["ok", "FAILED"]
    assert lines[1][1].startswith("mxq.kernels.moe_decode:down_combine_kernel: ")


def test_select_keeps_what_covers_the_most():
    rows = [dict(kernel="m:k", constexprs=dict(A=a, B=b), options=dict(num_warps=w))
            for a, b, w in ((1, 0, 4), (1, 0, 4), (2, 0, 4), (1, 1, 8), (3, 1, 8))]  # fmt: skip
    rows.append(dict(kernel="m:j", constexprs=dict(A=1), options=dict(num_warps=4)))
    got = compile_check.select(rows, per_kernel=2)
    assert [r["kernel"] for r in got].count("m:k") == 2 and [r["kernel"] for r in got].count("m:j") == 1
    # the first k variant, then the one adding the most new values (A=3, B=1, 8 warps)
    assert got[0] is rows[0] and got[1] is rows[4]
    assert compile_check.select(rows[:2], per_kernel=4) == [rows[0]]  # a duplicate adds nothing


def test_record_notes_mxq_kernels_and_merges(tmp_path, monkeypatch, capsys):
    """``record`` notes each specialization an mxq kernel compiles (not other JIT functions, not one
    with a constexpr it cannot write), merges into the file it finds and leaves the compile alone."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, *a: ("compiled", self.fn.__name__))
    ours = JITFunction(compile_check.resolve("mxq.kernels.moe_decode:down_combine_kernel").fn)
    other = JITFunction(test_select_keeps_what_covers_the_most)  # a function outside mxq
    names = ours.arg_names
    opts = SimpleNamespace(num_warps=8, num_stages=4, num_ctas=1, maxnreg=None)
    path = tmp_path / "variants.json"
    path.write_text(json.dumps([dict(kernel="mxq.kernels.x:k", gluon=False, signature={}, constexprs={}, attrs={},
                                     options={})]))  # fmt: skip
    with compile_check.record(path) as found:
        for bk in (128, 256, 256):  # the repeat is one variant
            got = JITFunction._do_compile(ours, None, {"K": "i32"}, 0, {(names.index("BK"),): tl.constexpr(bk)}, opts,
                                          {(names.index("K"),): [["tt.divisibility", 16]]}, False)  # fmt: skip
            assert got == ("compiled", "down_combine_kernel")
        JITFunction._do_compile(other, None, {}, 0, {}, opts, {}, False)
        JITFunction._do_compile(ours, None, {}, 0, {(names.index("BS"),): object()}, opts, {}, False)
    assert len(found) == 2 and "not recorded" in capsys.readouterr().err
    rows = compile_check.load(path)
    assert [r["kernel"] for r in rows] == ["mxq.kernels.moe_decode:down_combine_kernel"] * 2 + ["mxq.kernels.x:k"]
    assert sorted(r["constexprs"]["BK"] for r in rows[:2]) == [128, 256]
    assert rows[0]["options"]["num_warps"] == 8 and rows[0]["attrs"] == {"K": [["tt.divisibility", 16]]}


def test_pdl_order_finds_a_read_before_the_wait():
    """A kernel launched with PDL that loads or stores global memory before griddepcontrol.wait is
    reported (it may run beside the kernel that writes its input); waiting first, no PDL, a Gluon
    kernel (checked in its SASS tests) and a declared exception are not."""
    head = ".version 8.7\n.target sm_90\n.visible .entry k(\n.param .u64 p\n)\n{\n"
    early = head + "ld.global.b32 %r1, [%rd1];\ngriddepcontrol.wait;\nst.global.b32 [%rd2], %r1;\n}\n"
    late = head + "griddepcontrol.launch_dependents;\ngriddepcontrol.wait;\nld.global.b32 %r1, [%rd1];\n}\n"
    never = head + "cp.async.ca.shared.global [%r2], [%rd1], 16;\n}\n"

    def v(kernel="mxq.kernels.producers:_rmsnorm_mx_kernel", pdl=True, gluon=False):
        return {"kernel": kernel, "options": {"launch_pdl": pdl}, "gluon": gluon}

    assert "ld.global comes before griddepcontrol.wait" in compile_check.pdl_order(v(), early)
    assert "cp.async" in compile_check.pdl_order(v(), never)
    assert compile_check.pdl_order(v(), late) == ""
    assert compile_check.pdl_order(v(pdl=False), early) == ""
    assert compile_check.pdl_order(v(gluon=True), early) == ""
    for exempt in compile_check.PDL_EARLY_ACCESS:
        assert compile_check.pdl_order(v(exempt), early) == ""
