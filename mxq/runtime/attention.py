"""MXFP8 attention for Hugging Face models: the attention function, the MXFP8 KV cache.

``import mxq`` registers ``"mxfp8"`` with transformers' ``AttentionInterface`` (and its mask
interface, with the SDPA mask rules: no mask when causality alone suffices, else a 4-D bool
mask). A model loaded with ``attn_implementation="mxfp8"``, or from a checkpoint whose
``quantization_config`` says ``attention: mxfp8``, computes ``mx_attention_reference``:
Q and K MX-rounded along head_dim, V along the keys, fp32 softmax. On CUDA the Triton kernels
of ``mxq.kernels.attention`` run it; on CPU (or with ``MXQ_KERNELS=reference``) the torch
reference does.

``MXFP8Cache`` stores the KV cache as MXFP8 and makes decoding read it as such::

    model.generate(ids, past_key_values=MXFP8Cache(), max_new_tokens=64)

Per layer it keeps K as fp8 [B, Hkv, C, Dp] with one E8M0 byte per 32 head_dim elements of a
token (1x32, final as soon as the token arrives), and V in 32-token pages, fp8 [B, Hkv, C/32, D, 32]
(each page transposed: keys contiguous, K-major for P·V; one page of a head is one contiguous
block, so a decode tile reads whole 4 KB blocks at D=128), with one E8M0 byte per page and
channel, uint8 [B, Hkv, C/32, D] (32x1 blocks along the keys).

A partially filled last V page: its scale depends on tokens not yet seen, so the page's bf16
values (at most 31 tokens) are kept beside the fp8 pages and the page is re-quantized from
them, zero-padded, on every append; its fp8 bytes and scale in the cache are always those of
the tokens present so far, and final once the page holds 32 tokens (the bf16 copy is then
dropped). Decoding thus computes exactly the reference on the whole current sequence, and the
cache bytes after appending token by token equal quantizing the whole sequence at once.
``crop`` (assisted decoding) reopens a page from kept bf16 values: see ``MXFP8CacheLayer.crop``.

Q/K rotation (on by default): before Q and K are MX-rounded they are multiplied by a fixed
orthogonal ±1 matrix (random signs times Hadamard blocks along head_dim,
``mxq.kernels.reference.qk_rotation``) and the scores are divided by its block size. Attention
is unchanged in exact arithmetic; outlier channels (RoPE'd K has a few) get spread over the
whole 1x32 block, so the FP8 error of Q·K drops (SmolLM2: mean KL to exact attention 2.4x
smaller, BENCHMARKS.md). The cache stores K rotated; decoding rotates the one query. Set
``mxq.runtime.attention.QK_ROTATION = "none"`` to measure without it.

The cache only works with the ``mxfp8`` attention: its ``update`` returns views of the MXFP8
storage (``MXFP8KV``), not bf16 tensors.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mxq.formats import E4M3, ScaleRule, decode_e8m0, quantize_mx
from mxq.kernels.buffers import persistent
from mxq.kernels.registry import check_kernels, default_kernels

ATTN_IMPLEMENTATION = "mxfp8"
# Element format and scale rule of the attention operands (Q, K, V and the cache).
ATTN_ELEM = E4M3
ATTN_RULE = ScaleRule.RCEIL
PAGE = 32
ROTATIONS = ("hadamard", "none")
# Read when a cache layer is created and at each attention call (module docstring).
QK_ROTATION = "hadamard"

try:
    from mxq.kernels import attention as _kattn
    from mxq.kernels import quantize as _kquant
except ImportError:  # no Triton: the reference everywhere
    _kattn = _kquant = None


def _use_triton(t: torch.Tensor, kernels: str | None = None) -> bool:
    """The Triton kernels on CUDA; the torch reference on a CPU, without Triton, or where the
    kernels spec (the module's ``mxq_kernels`` from ``mxq.set_kernels``, else ``MXQ_KERNELS``) is
    "reference"."""
    if _kattn is None or not t.is_cuda:
        return False
    return (check_kernels(kernels) if kernels is not None else default_kernels()) != "reference"


def _rotation_on() -> bool:
    if QK_ROTATION not in ROTATIONS:
        raise ValueError(f"mxq.runtime.attention.QK_ROTATION: expected one of {ROTATIONS}, got {QK_ROTATION!r}")
    return QK_ROTATION == "hadamard"


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] -> x·qk_rotation(D) in float32: Triton on CUDA, the reference elsewhere."""
    if _use_triton(x):
        return _kattn.rotate_qk_rows(x)
    from mxq.kernels.reference import rotate_qk

    return rotate_qk(x)


def _quantize_rows(x: torch.Tensor):
    """MX along the last axis -> (fp8 [..., ceil32], uint8 scales): Triton on CUDA, format core elsewhere."""
    if _use_triton(x):
        return _kquant.quantize_mx_rows(x, ATTN_ELEM, ATTN_RULE, 32)
    t = quantize_mx(x, -1, ATTN_ELEM, 32, ATTN_RULE)
    return t.data, t.scales


def _quantize_vt(v: torch.Tensor):
    """V [B, H, n, D] -> MX along the keys in the cache's pages (fp8 [B, H, P, D, 32], scales [B, H, P, D])."""
    if _use_triton(v):
        return _kattn.quantize_vt_pages(v, ATTN_ELEM, ATTN_RULE, paged=True)
    data, scales = _quantize_rows(v.transpose(-1, -2))  # [B, H, D, P*32], [B, H, D, P]
    b, h, d, n = data.shape
    return data.view(b, h, d, n // PAGE, PAGE).permute(0, 1, 3, 2, 4).contiguous(), scales.transpose(2, 3).contiguous()


def _dequant_pages(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """V pages fp8 [B, H, P, D, 32] with scales [B, H, P, D] -> float32 [B, H, P*32, D]."""
    v = data.float() * decode_e8m0(scales).unsqueeze(-1)
    return v.transpose(-1, -2).reshape(data.shape[0], data.shape[1], -1, data.shape[3])


def _dequant_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [..., n*32] with scales [..., n] -> float32."""
    v = data.float().reshape(*data.shape[:-1], -1, 32) * decode_e8m0(scales).unsqueeze(-1)
    return v.reshape(data.shape)


class MXFP8KV:
    """What ``MXFP8CacheLayer.update`` returns for keys and values: the layer's MXFP8 storage.

    ``fresh`` holds the bf16 (key, value) of this update when the cache was empty before it
    (a prefill): those are the whole sequence, and the prefill kernel rounds them itself.
    """

    def __init__(self, layer: MXFP8CacheLayer, fresh: tuple[torch.Tensor, torch.Tensor] | None):
        self.layer = layer
        self.fresh = fresh

    @property
    def shape(self) -> torch.Size:
        layer = self.layer
        return torch.Size((layer.k_data.shape[0], layer.k_data.shape[1], layer.length, layer.head_dim))


class MXFP8CacheLayer(DynamicLayer):
    """One layer's MXFP8 KV cache (layout in the module docstring)."""

    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__()
        self.length = 0
        self.head_dim = 0
        self.k_data = self.k_scale = self.v_data = self.v_scale = None
        self.v_tail = None  # bf16 values of the partial last page [B, Hkv, length % 32, D]
        self.v_prev = None  # bf16 values of the last full page [B, Hkv, 32, D] (for crop)
        self.rotated = _rotation_on()  # K is stored as K·qk_rotation(D)
        self.counters = None  # int32 arrival counts of the decode kernel's fused merge (zero between calls)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.head_dim = key_states.shape[-1]
        self.is_initialized = True

    def _reserve(self, b: int, h: int, need: int) -> None:
        cap = 0 if self.k_data is None else self.k_data.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 256)
        new_cap = (new_cap + PAGE - 1) // PAGE * PAGE
        d, dp = self.head_dim, (self.head_dim + 31) // 32 * 32
        dev, f8 = self.device, ATTN_ELEM.torch_dtype
        kd = torch.zeros((b, h, new_cap, dp), dtype=f8, device=dev)
        ks = torch.full((b, h, new_cap, dp // 32), 1, dtype=torch.uint8, device=dev)
        vd = torch.zeros((b, h, new_cap // PAGE, d, PAGE), dtype=f8, device=dev)
        vs = torch.full((b, h, new_cap // PAGE, d), 1, dtype=torch.uint8, device=dev)
        if cap:
            kd[:, :, :cap] = self.k_data
            ks[:, :, :cap] = self.k_scale
            vd[:, :, : cap // PAGE] = self.v_data
            vs[:, :, : cap // PAGE] = self.v_scale
        self.k_data, self.k_scale, self.v_data, self.v_scale = kd, ks, vd, vs

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, n, _ = key_states.shape
        start = self.length
        fresh = (key_states, value_states) if start == 0 else None
        if n == 0:
            return MXFP8KV(self, fresh), MXFP8KV(self, fresh)
        self._reserve(b, h, start + n + PAGE)
        kq, ks = _quantize_rows(_rotate(key_states) if self.rotated else key_states)
        self.k_data[:, :, start : start + n] = kq
        self.k_scale[:, :, start : start + n] = ks
        # V: re-quantize from the first page not yet final (its bf16 tail) through the new tokens.
        p0 = start // PAGE
        vals = value_states if self.v_tail is None else torch.cat([self.v_tail, value_states], dim=2)
        vq, vs = _quantize_vt(vals)  # [B, H, pages, D, 32], [B, H, pages, D]
        self.v_data[:, :, p0 : p0 + vq.shape[2]] = vq
        self.v_scale[:, :, p0 : p0 + vs.shape[2]] = vs
        self.length = start + n
        keep = self.length % PAGE
        end_full = vals.shape[2] - keep
        if end_full >= PAGE:  # a page became final: keep its bf16 values, crop may reopen it
            self.v_prev = vals[:, :, end_full - PAGE : end_full].clone()
        self.v_tail = vals[:, :, end_full:].clone() if keep else None
        return MXFP8KV(self, fresh), MXFP8KV(self, fresh)

    def decode_counters(self) -> torch.Tensor:
        """The fused split merge's counters for this layer's decode calls (B*Hkv int32, zero)."""
        need = self.k_data.shape[0] * self.k_data.shape[1]
        if self.counters is None or self.counters.numel() < need or self.counters.device != self.k_data.device:
            dev = self.k_data.device
            # kept by the layer across CUDA-graph replays: made outside any graph's memory pool
            kept = persistent(lambda: torch.zeros(need, dtype=torch.int32, device=dev), dev)
            if kept is None:  # under stream capture: a zeroed one for this call, inside the graph
                return torch.zeros(need, dtype=torch.int32, device=dev)
            self.counters = kept
        return self.counters

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as float32 [B, Hkv, length, D]: the exact MX values the cache holds (K rotated if ``rotated``)."""
        n, d = self.length, self.head_dim
        k = _dequant_rows(self.k_data[:, :, :n], self.k_scale[:, :, :n])[..., :d]
        npg = (n + PAGE - 1) // PAGE
        v = _dequant_pages(self.v_data[:, :, :npg], self.v_scale[:, :, :npg])[:, :, :n]
        return k, v

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()

    def _index_batch(self, fn) -> None:
        if self.k_data is None:
            return
        self.k_data, self.k_scale = fn(self.k_data), fn(self.k_scale)
        self.v_data, self.v_scale = fn(self.v_data), fn(self.v_scale)
        if self.v_tail is not None:
            self.v_tail = fn(self.v_tail)
        if self.v_prev is not None:
            self.v_prev = fn(self.v_prev)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._index_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens (negative: that many; positive: keep that many, transformers' legacy form).

        K rows are final per token: only the length changes. V: the page the new end falls in is
        partial again, so it is re-quantized from the bf16 values of its kept tokens; those are
        kept for the current partial page and the last full page, so a crop of up to
        32 + (length % 32) tokens (assisted decoding removes a few) leaves exactly the bytes of
        the shorter sequence. Further back, the reopened page's kept tokens come from their MX
        values under the old page scale (exact in bf16, re-rounded exactly under the new one):
        they keep the rounding of the page they had.
        """
        tokens_to_remove = int(tokens_to_remove)
        n = self.length - abs(tokens_to_remove) if tokens_to_remove <= 0 else tokens_to_remove
        if n >= self.length or self.k_data is None:
            return
        n = max(n, 0)
        page, keep = divmod(n, PAGE)
        end_full = self.length // PAGE * PAGE
        tail = None
        if keep:
            if page * PAGE >= end_full:
                tail = self.v_tail[:, :, :keep]
            elif page * PAGE == end_full - PAGE and self.v_prev is not None:
                tail = self.v_prev[:, :, :keep]
            else:
                v = _dequant_pages(self.v_data[:, :, page : page + 1], self.v_scale[:, :, page : page + 1])
                tail = v[:, :, :keep].to(self.dtype)
            vq, vs = _quantize_vt(tail)
            self.v_data[:, :, page : page + 1] = vq
            self.v_scale[:, :, page : page + 1] = vs
            tail = tail.clone()
        if page * PAGE < end_full:  # the last full page is gone or reopened
            self.v_prev = None
        self.v_tail = tail
        self.length = n


class MXFP8Cache(DynamicCache):
    """A KV cache that stores K and V as MXFP8 (see the module docstring). Needs ``attn_implementation="mxfp8"``."""

    def __init__(self, *args, **kwargs):
        super(DynamicCache, self).__init__(layer_class_to_replicate=MXFP8CacheLayer)


def mxfp8_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: [B, Hq, Sq, D] queries -> ([B, Sq, Hq, D], None)."""
    if dropout and module.training:
        raise ValueError("mxfp8 attention is for inference: dropout is not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None:
        causal = False  # the 4-D mask already holds the causal pattern
        attention_mask = attention_mask[..., : _key_len(key)]
    b, hq, sq, d = query.shape
    out = torch.empty((b, sq, hq, d), dtype=query.dtype, device=query.device)
    rotation = _rotation_on()
    cfg = dict(scale=scaling, elem=ATTN_ELEM, rule=ATTN_RULE, qk_rotation=rotation)
    spec = getattr(module, "mxq_kernels", None)
    triton = _use_triton(query, spec)
    if isinstance(key, MXFP8KV):
        layer = key.layer
        if layer.rotated != rotation:
            raise ValueError(
                f"MXFP8Cache layer {layer_name(module)} was filled with Q/K rotation "
                f"{'on' if layer.rotated else 'off'} but mxq.runtime.attention.QK_ROTATION is now {QK_ROTATION!r}"
            )
        if sq == 1 and triton:
            _kattn.mx_attention_decode(
                query, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length,
                attention_mask=attention_mask, out=out.transpose(1, 2), counters=layer.decode_counters(),
                kernels=spec, **cfg,
            )  # fmt: skip
            return out, None
        if key.fresh is not None:
            key, value = key.fresh
        else:  # MX values are fixed points of MX rounding: re-rounding the cache changes nothing
            key, value = layer.dequantize()
            cfg["k_rotated"] = rotation
    if triton:
        _kattn.mx_attention_prefill(
            query, key.to(query.dtype), value.to(query.dtype), causal=causal, attention_mask=attention_mask,
            out=out.transpose(1, 2), **cfg,
        )  # fmt: skip
        return out, None
    from mxq.kernels.reference import mx_attention_reference

    ref = mx_attention_reference(query, key, value, causal=causal, attention_mask=attention_mask, **cfg)
    out.copy_(ref.transpose(1, 2))
    return out, None


def layer_name(module: torch.nn.Module) -> str:
    return f"layer {getattr(module, 'layer_idx', '?')}"


def _key_len(key) -> int:
    return key.shape[2]


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, mxfp8_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()
