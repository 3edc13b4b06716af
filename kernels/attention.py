"""MXFP8 attention: prefill (FlashAttention-style) and decode over an MXFP8 KV cache.

The public names, from the modules that hold them:

- ``mx_attention_prefill`` (``attention_prefill``): Triton prefill, exact (P·V in two bf16
  products) or with a bf16 P; ``quantize_vt_pages``: V into the MXFP8 cache's pages in one pass;
- ``mx_attention_decode`` (``attention_decode``): one query token against the MXFP8 cache, the
  kernel chosen by the registry ``DECODE`` (``attention_decode_ws`` under CUDA-graph capture on
  Hopper, the Triton kernel elsewhere that Triton runs, the torch reference otherwise);
  ``decode_path``: the path a call takes;
- ``rotate_qk_rows`` (``attention_rotate``): x·``reference.qk_rotation(D)``, alone or fused
  with MX rounding; ``decode_query_blocks`` (``attention_decode_common``): the decode query as
  the warp-specialized kernel reads it.

Tiles (docs/ARCHITECTURE.md, "Tiles, and which axis is which"): Q and K are MX-blocked along head_dim (1x32 tiles of [S, D]);
V is MX-blocked along the key sequence (32x1 tiles of [S, D]), because P·V reduces over keys.
A V block holds 32 consecutive keys starting at key 0; when the key count is not a multiple
of 32 the last block is padded with zero keys (the padding takes part in the block's amax as
zeros, i.e. not at all, and is dropped). Masked keys (padding masks) still belong to their V
block: the mask acts on the softmax only, exactly as it does on the cached V bytes.

The function every path computes is ``mx_attention_reference`` (``mxq.kernels.reference``):
MX-round Q, K, V, then softmax attention in float32 (fully masked query rows give zeros).
"""

from mxq.kernels.attention_decode import DECODE, decode_path, mx_attention_decode
from mxq.kernels.attention_decode_common import decode_query_blocks
from mxq.kernels.attention_prefill import mx_attention_prefill, quantize_vt_pages
from mxq.kernels.attention_rotate import rotate_qk_rows
from mxq.kernels.reference import mx_attention_reference

__all__ = [
    "DECODE",
    "decode_path",
    "decode_query_blocks",
    "mx_attention_decode",
    "mx_attention_prefill",
    "mx_attention_reference",
    "quantize_vt_pages",
    "rotate_qk_rows",
]
