"""The offline sm_90 compile of the decode kernel (tools/sass_dev.py): the GPU-only code paths
(hardware fp8 conversion, cp.async pipelining, the factored rotation MMA) compile for Hopper on a
CPU machine, and the loop reader finds the main loop."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from mxq.kernels import gluon_api  # noqa: E402

# A development tool kept out of the wheel (tools/): loaded from its file, run as a script.
SASS_DEV = Path(__file__).resolve().parent.parent / "tools" / "sass_dev.py"
_spec = importlib.util.spec_from_file_location("sass_dev", SASS_DEV)
sass_dev = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_dev)

# The warp-specialized kernels exist only where the Gluon API they are written for does (gluon_api).
needs_gluon = pytest.mark.skipif(gluon_api.PROBLEM is not None, reason=f"Hopper kernels off: {gluon_api.PROBLEM}")


def test_main_loop_histogram_reads_the_backward_branch():
    sass = "\n".join(
        [
            "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
            "        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
            "        /*0020*/              @P0 LDG.E R2, desc[UR4][R2.64] ;",
            "        /*0030*/                   F2FP.F16.E4M3.UNPACK_B R5, R6 ;",
            "        /*0040*/              @!P1 BRA 0x10 ;",
            "        /*0050*/                   EXIT ;",
        ]
    )
    n, ops = sass_dev.main_loop_histogram(sass)
    assert n == 4 and ops == {"HMMA": 1, "LDG": 1, "F2FP": 1, "BRA": 1}


def test_decode_kernel_compiles_for_sm90(tmp_path):
    """Runs the CLI in a fresh process: the test session itself runs Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(SASS_DEV), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    regs = int(re.search(r"registers/thread (\d+)", out.stdout).group(1))
    n = int(re.search(r"main loop: (\d+) instructions", out.stdout).group(1))
    assert regs <= 255 and 0 < n < 2000
    ptx = (tmp_path / "k.ptx").read_text()
    assert "mma.sync" in ptx and "cp.async" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    ops = sass_dev.main_loop_histogram((tmp_path / "k.sass").read_text())[1]
    assert ops["HMMA"] == 64  # K 64x128 and V 128x64 tiles against 16 columns: m16n8k16 on 2 warps


def _cli(*args) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH")}
    out = subprocess.run(
        [sys.executable, str(SASS_DEV), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _hazards(out: str) -> int:
    return int(re.search(r"wgmma register hazards: (\d+)", out).group(1))


def test_wgmma_register_hazards_model():
    """Groups end at gsb0; DEPBAR.LE N leaves the N newest groups in flight; the loop runs twice."""
    loop = [
        "        /*0100*/                   LDS.U16 R8, [R2] ;",  # pass 2: R8 belongs to a group in flight
        "        /*0110*/                   HGMMA.64x16x16.F32.BF16 R24, R8, gdesc[UR4], R24 ;",
        "        /*0120*/                   HGMMA.64x16x16.F32.BF16 R24, R12, gdesc[UR4], R24, gsb0 ;",
        "        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        "        /*0140*/                   PRMT R16, R3, 0x5410, R4 ;",  # R16 is no operand: fine
        "        /*0150*/              @P0 BRA 0x100 ;",
    ]
    assert [h[2] for h in sass_dev.wgmma_register_hazards("\n".join(loop))] == ["R8"]
    loop[3] = loop[3].replace("0x1", "0x0")  # the group retired before the next write
    assert sass_dev.wgmma_register_hazards("\n".join(loop)) == []


def test_gemm_prefill_register_hazard_follows_ptxas(tmp_path):
    """The pipelined prefill loop (zero-tile accumulator start, 256x128x64, 8 warps) compiled for
    sm_90: ptxas < 13.3 (Triton 3.6 bundles 12.8) writes the next K step's dequantized weights into
    registers a wgmma may still read (triton-lang/triton#9433; the inf/garbage seen on the H200);
    ptxas >= 13.3 orders those writes after the waits. The serialized loop is clean with either:
    this is what kernels/toolchain.py gates the dispatch on."""
    from mxq.kernels import toolchain

    bundled = os.path.join(os.path.dirname(sass_dev.triton.__file__), "backends", "nvidia", "bin", "ptxas")
    version = toolchain.ptxas_version(bundled)
    assert version is not None
    hz = _hazards(_cli("--kernel", "gemm", "--loop", "zero_dot", "--ptxas", bundled, "--out", str(tmp_path / "a")))
    if version >= toolchain.MIN_SAFE_PTXAS:
        assert hz == 0
    elif sass_dev.triton.__version__.startswith("3.6."):  # the pair the hazard was found with
        assert hz > 0
    assert _hazards(_cli("--kernel", "gemm", "--loop", "old", "--ptxas", bundled, "--out", str(tmp_path / "b"))) == 0
    fixed = [p for p in toolchain.candidate_ptxas() if (toolchain.ptxas_version(p) or (0, 0)) >= toolchain.MIN_SAFE_PTXAS]
    if not fixed:
        pytest.skip("no ptxas >= 13.3 installed (pip install nvidia-cuda-nvcc)")
    for tile in ("256x128x64", "128x64x64"):
        warps = "8" if tile.startswith("256") else "4"
        out = _cli("--kernel", "gemm", "--tile", tile, "--warps", warps, "--loop", "zero_dot", "--ptxas", fixed[0],
                   "--out", str(tmp_path / tile))  # fmt: skip
        assert _hazards(out) == 0, tile


def test_decode_f8_converts_no_weight_element(tmp_path):
    """The fp8 tensor-core decode GEMM (kernels/gemm_decode.py, dispatched W8A8 at 3 <= M <= 16)
    compiled for sm_90: per step of 4 MX blocks and 128 weight rows, 8 fp8 wgmmas (m64n16k32,
    one per block per warpgroup half) and no conversion instruction in the loop (the weight
    goes from TMA to the MMA as fp8 bytes; only the accumulator is rescaled)."""
    out = _cli("--kernel", "decode_f8", "--tile", "16x128x4", "--split-k", "4", "--quant-x", "--stages", "2",
               "--out", str(tmp_path))  # fmt: skip
    ops = sass_dev.main_loop_histogram((tmp_path / "k.sass").read_text())[1]
    assert ops["QGMMA"] == 8 and ops["HGMMA"] == 0
    assert not any(ops[o] for o in ("F2FP", "F2F", "HADD2", "I2F")), dict(ops)
    assert "registers/thread" in out


def _fake_ptxas(path: Path, release: str) -> str:
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(0o755)
    return str(path)


def test_prefer_fixed_ptxas_respects_the_user(monkeypatch, tmp_path):
    """A fixed ptxas replaces Triton's own for sm_90 only where that one is older than 13.3 and
    the user set none, through the variable this Triton reads for sm_90."""
    from mxq.kernels import toolchain

    env = toolchain.sm90_ptxas_env()
    assert env in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
    fake = _fake_ptxas(tmp_path / "ptxas", "13.4")
    old = _fake_ptxas(tmp_path / "ptxas-old", "12.8")
    monkeypatch.setattr(toolchain, "candidate_ptxas", lambda: [fake])
    monkeypatch.setattr(toolchain, "triton_ptxas", lambda: old)
    monkeypatch.setenv(env, "/somewhere/ptxas")
    assert toolchain.prefer_fixed_ptxas() is None and os.environ[env] == "/somewhere/ptxas"
    monkeypatch.delenv(env)
    assert toolchain.prefer_fixed_ptxas() == fake and os.environ[env] == fake
    assert toolchain.ptxas_version(fake) == (13, 4)
    monkeypatch.delenv(env)
    monkeypatch.setattr(toolchain, "triton_ptxas", lambda: fake)  # Triton's own is new enough: kept
    assert toolchain.prefer_fixed_ptxas() is None and env not in os.environ


def test_ptxas_choice_is_made_at_configuration_not_import(tmp_path):
    """Importing the kernels leaves the ptxas variable alone; ``configure_ptxas`` (the first launch
    calls it) makes the choice once, as ``prefer_fixed_ptxas`` would; a later call changes nothing."""
    fake = _fake_ptxas(tmp_path / "ptxas", "13.4")
    old = _fake_ptxas(tmp_path / "ptxas-old", "12.8")
    code = (
        "import os\n"
        "import mxq.kernels, mxq.kernels.gemm, mxq.kernels.attention\n"
        "from mxq.kernels import toolchain\n"
        "env = toolchain.sm90_ptxas_env()\n"
        "assert env not in os.environ, os.environ.get(env)\n"
        f"toolchain.candidate_ptxas = lambda: [{fake!r}]\n"
        f"toolchain.triton_ptxas = lambda: {old!r}\n"
        "toolchain.configure_ptxas()\n"
        f"assert os.environ[env] == {fake!r}\n"
        "os.environ[env] = 'chosen later'\n"
        "toolchain.configure_ptxas()\n"
        "assert os.environ[env] == 'chosen later'\n"
    )
    drop = ("TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@needs_gluon
def test_decode_ws_compiles_warp_specialized(tmp_path):
    """The warp-specialized decode GEMM (kernels/gemm_decode_ws.py, Gluon) compiled for sm_90:
    16 fp8 wgmmas (m64n16k32; 4 blocks x 2 warpgroup halves, for the peeled first step and the
    loop), registers handed between the loader and math warpgroups (USETMAXREG), at most 128
    registers per thread at launch (two programs per SM) and nothing spilled to local memory."""
    pytest.importorskip("triton.experimental.gluon")
    out = _cli("--kernel", "decode_ws", "--split-k", "4", "--stages", "2", "--maxnreg", "128", "--out", str(tmp_path))
    sass = (tmp_path / "k.sass").read_text()
    assert len(re.findall(r"QGMMA\.64x16x32\.F32\.E4M3\.E4M3", sass)) == 16
    assert "HGMMA" not in sass and "USETMAXREG" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "register spills"
    assert int(re.search(r"registers/thread (\d+)", out).group(1)) <= 128


@needs_gluon
def test_decode_ws_fused_x_compiles(tmp_path):
    """With X quantized inside the kernel (--fuse-x): the same 16 fp8 wgmmas, X rounded by the
    hardware conversion (F2FP.SATFINITE.E4M3), its tiles stored to shared memory and fenced for the
    async proxy, only W by TMA (3 of the unfused kernel's 6 TMA loads), a wait for the kernel before
    it (which wrote X), no spills, at most 128 registers at launch."""
    pytest.importorskip("triton.experimental.gluon")
    out = _cli("--kernel", "decode_ws", "--split-k", "4", "--stages", "2", "--maxnreg", "128", "--fuse-x", "--out", str(tmp_path))
    sass = (tmp_path / "k.sass").read_text()
    assert len(re.findall(r"QGMMA\.64x16x32\.F32\.E4M3\.E4M3", sass)) == 16
    assert "F2FP.SATFINITE.E4M3.F32.PACK" in sass and "STS" in sass and "FENCE.VIEW.ASYNC.S" in sass
    assert len(re.findall(r"UTMALDG", sass)) == 3 and "ACQBULK" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "register spills"
    assert int(re.search(r"registers/thread (\d+)", out).group(1)) <= 128


@needs_gluon
@pytest.mark.parametrize("maxnreg,block_m", [(80, 16), (64, 16), (64, 8)])
def test_decode_ws_64_row_tiles_compile(tmp_path, maxnreg, block_m):
    """The tuner's 64-row decode tiles (one m64 wgmma per MX block: 8 in all) at 80 and 64 registers
    per thread at launch (3 and 4 programs per SM): the math warpgroup gets 136 / 104 registers from
    the loader's (USETMAXREG 0x88 / 0x68, loader 0x18) and nothing spills, at 16 and 8 activation rows."""
    pytest.importorskip("triton.experimental.gluon")
    out = _cli("--kernel", "decode_ws", "--block-n", "64", "--block-m", str(block_m), "--split-k", "4", "--stages", "3",
               "--maxnreg", str(maxnreg), "--out", str(tmp_path))  # fmt: skip
    sass = (tmp_path / "k.sass").read_text()
    assert len(re.findall(rf"QGMMA\.64x{block_m}x32\.F32\.E4M3\.E4M3", sass)) == 8
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {hex(maxnreg + maxnreg - 24)}" in sass
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in sass
    spills = len(re.findall(r"\b(LDL|STL)\b", sass))
    # Triton 3.9 spills 2 words at 64 registers with 16 rows (4 LDL/STL; same speed on an H200)
    assert spills <= (4 if gluon_api.NEWER_API and (maxnreg, block_m) == (64, 16) else 0), "register spills"
    assert int(re.search(r"registers/thread (\d+)", out).group(1)) <= maxnreg


@needs_gluon
@pytest.mark.parametrize("fuse_x", [False, True])
def test_decode_ws_waits_for_the_quantizer(tmp_path, fuse_x):
    """Programmatic dependent launch: the decode kernel waits for the kernel that writes X
    (griddepcontrol.wait, ACQBULK in SASS) before it reads X, with X quantized inside it too, and
    lets the kernel behind it start (griddepcontrol.launch_dependents) before its weight stream;
    the quantizer and the producers it follows release it early and wait for their own writer."""
    pytest.importorskip("triton.experimental.gluon")
    _cli("--kernel", "decode_ws", "--split-k", "4", "--stages", "2", "--maxnreg", "128", "--out", str(tmp_path),
         *(["--fuse-x"] if fuse_x else []))  # fmt: skip
    ptx = (tmp_path / "k.ptx").read_text()
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("cp.async.bulk.tensor")
    assert "ACQBULK" in (tmp_path / "k.sass").read_text()
    import inspect

    from mxq.kernels import common, producers, quantize

    src = inspect.getsource(quantize.quantize_rows_kernel.fn)
    assert src.index("gdc_follow()") < src.index("tl.load(")
    src = inspect.getsource(producers)
    assert src.index("gdc_follow()") < src.index("def _rmsnorm_mx_kernel")
    src = inspect.getsource(common.gdc_follow.fn)
    assert src.index("gdc_launch_dependents()") < src.index("gdc_wait()")
    assert "griddepcontrol.launch_dependents" in inspect.getsource(common.gdc_launch_dependents.fn)


@needs_gluon
def test_prefill_rs_compiles_register_operand(tmp_path):
    """The register-operand prefill GEMM (gemm_prefill_ws.mx_prefill_rs_kernel) compiled for
    sm_90: bf16 wgmmas m64n256k16 whose left operand comes from registers (4 a step, per MMA
    partition of the two: the first step + two a loop iteration + an even tail, one step left in
    flight by waits down to 2 groups), no write to a register an in-flight wgmma reads (the hazard
    that gave wrong sums when the operands were loop-carried), the fp8 -> bf16 by byte moves (no
    F2F in the MMA loop), TMA loads only, the loader warp at 24 registers, no spills."""
    pytest.importorskip("triton.experimental.gluon")
    out = _cli("--kernel", "prefill_rs", "--stages", "4", "--out", str(tmp_path))
    sass = (tmp_path / "k.sass").read_text()
    hg = re.findall(r"HGMMA\.64x256x16\.F32\.BF16 R\d+, R(\d+), gdesc", sass)
    steps = 2  # K steps a loop iteration
    assert len(hg) == 8 * steps * 2  # per MMA partition
    assert _hazards(out) == 0
    loop = re.search(r"main loop: (\d+) instructions", out)
    assert loop and int(loop.group(1)) < 300 * steps
    waits = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass))
    if gluon_api.NEWER_API:  # Triton 3.9's code for this loop needs more registers than the MMA warps
        # have: ptxas serializes the wgmmas (C7512), right but slower (kernels/NOTES.md)
        assert waits == {"0"}
    else:
        assert "2" in waits
    assert "F2F" not in out.split("main loop")[1].split("wgmma register hazards")[0]
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "register spills"
    assert "LDG" not in sass.replace("UTMALDG", "")


@needs_gluon
@pytest.mark.parametrize("d,maxnreg", [(128, 128), (64, 80)])
def test_attention_decode_ws_compiles_warp_specialized(tmp_path, d, maxnreg):
    """The warp-specialized attention decode kernel (kernels/attention_decode_ws.py, Gluon) compiled
    for sm_90: fp16 wgmmas m64n8k16 with the cache's widened codes as the register operand (per
    64-key tile: D/32 blocks x 2 k16 for the scores, 2 pages x 2 (P_hi, P_lo) x D/64 x 2 k16 for
    P·V; in the unmasked loop and the last, masked tile), waited for twice a tile, no global load
    in the loop (the proxy fence would wait for it), TMA loads, registers handed from the loader
    warp to the math warpgroup, the launch's register cap (80: three programs per SM), no spills,
    and the wait for the query preparation (programmatic dependent launch)."""
    pytest.importorskip("triton.experimental.gluon")
    out = _cli("--kernel", "attn_ws", "--head-dim", str(d), "--maxnreg", str(maxnreg), "--out", str(tmp_path))
    sass = (tmp_path / "k.sass").read_text()
    per_tile = (d // 32) * 2 + 2 * 2 * (d // 64) * 2
    assert len(re.findall(r"HGMMA\.64x8x16\.F32 ", sass)) == 2 * per_tile
    tile_loops = [lp for lp in sass_dev.loops(sass) if any(op.startswith("HGMMA") for _, op, _ in lp)]
    body = " ".join(op for _, op, _ in min(tile_loops, key=len))  # the unmasked tile loop
    assert body.count("HGMMA") == per_tile and body.count("WARPGROUP.DEPBAR") == 2
    # Q·Kᵀ on the fp8 codes (DecodeAttnWSConfig.qk_fp8): one fp8 wgmma m64n8k32 per D block, both
    # operands from shared memory; the P·V wgmmas as before; fewer shared loads and conversions
    f8 = tmp_path / "f8"
    out8 = _cli("--kernel", "attn_ws", "--head-dim", str(d), "--maxnreg", str(maxnreg), "--qk-fp8", "--out", str(f8))
    sass8 = (f8 / "k.sass").read_text()
    body8 = [op for _, op, _ in min((lp for lp in sass_dev.loops(sass8) if any(op.startswith("QGMMA") for _, op, _ in lp)), key=len)]
    assert sum(op.startswith("QGMMA") for op in body8) == d // 32  # (the opcode as parsed stops at "x")
    assert sum(op.startswith("HGMMA") for op in body8) == per_tile - (d // 32) * 2
    assert len(re.findall(r"QGMMA\.64x8x32\.F32\.E4M3\.E4M3 ", sass8)) == 2 * (d // 32)
    assert " ".join(body8).count("WARPGROUP.DEPBAR") == 2
    ops = body.split()
    for op in ("LDS", "F2FP"):
        assert sum(o.startswith(op) for o in body8) < sum(o.startswith(op) for o in ops), op
    assert not re.search(r"\b(LDL|STL)\b", sass8), "register spills"
    assert int(re.search(r"registers/thread (\d+)", out8).group(1)) <= maxnreg
    assert "LDG" not in body.replace("UTMALDG", "")
    assert "USETMAXREG" in sass and "UTMALDG" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "register spills"
    assert int(re.search(r"registers/thread (\d+)", out).group(1)) <= maxnreg
    assert "griddepcontrol.wait" in (tmp_path / "k.ptx").read_text()
    # the fused split merge: one ticket (acq_rel add), one reset; its loads batched (one L2 round
    # trip per group of splits: every load of a merge loop before its first multiply)
    assert sass.count("ATOMG.E.ADD.STRONG.GPU") == 1 and sass.count("ATOMG.E.EXCH.STRONG.GPU") == 1
    merge = [[op for _, op, _ in lp] for lp in sass_dev.loops(sass) if sum(op.startswith("LDG") for _, op, _ in lp) >= 8]
    assert len(merge) == 2
    for ops in merge:
        last_ld = max(i for i, op in enumerate(ops) if op.startswith("LDG"))
        first_math = min(i for i, op in enumerate(ops) if op.startswith(("FFMA", "FMUL", "FMNMX")))
        assert last_ld < first_math, ops
