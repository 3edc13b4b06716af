"""The offline sm_90 compile of the decode kernel (kernels/sass_dev.py): the GPU-only code paths
(hardware fp8 conversion, cp.async pipelining, the factored rotation MMA) compile for Hopper on a
CPU machine, and the loop reader finds the main loop."""

import os
import re
import subprocess
import sys

import pytest

sass_dev = pytest.importorskip("mxq.kernels.sass_dev")


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
        [sys.executable, "-m", "mxq.kernels.sass_dev", "--out", str(tmp_path)],
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
