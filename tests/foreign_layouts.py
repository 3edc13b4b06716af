"""MoE checkpoints laid out the way other tools write them, built from a tiny random model.

The experts are written one expert at a time (2-D ``weight`` [N, K] fp8 + ``weight_scale``
[N, K/32] uint8, ``bias`` where the family has one) under the names those tools use:

- llm-compressor's ``oneshot`` (transformers 5 models, experts linearized for calibration):
  ``mlp.experts.E.{gate_proj,up_proj,down_proj}`` for every family, Mixtral included, and for
  gpt-oss with biases (its fused gate/up interleaves gate and up rows: even rows are gate);
- Mixtral's original layout: ``block_sparse_moe.experts.E.{w1,w3,w2}`` (gate, up, down), or the
  same ``w1/w3/w2`` names under ``mlp``.

The codes come from the numpy reference quantizer (``mx_reference``, RCEIL, E4M3), not from mxq,
and the ``quantization_config`` from compressed-tensors' own ``MXFP8`` preset. ``reference_model``
is the family's transformers model holding the exact decoded values (float32), fused back into
its in-memory layout by hand: what a correct load of the checkpoint computes, for weight-only
checkpoints exactly.
"""

from __future__ import annotations

import json
import re

import numpy as np
import torch
from moe_models import moe_model
from mx_reference import dequantize
from mx_reference import quantize as mx_quantize
from safetensors.torch import save_file

NAMINGS = {"gate_up_down": ("gate_proj", "up_proj", "down_proj"), "w1_w3_w2": ("w1", "w3", "w2")}
INTERLEAVED = ("gpt_oss",)  # families whose fused gate_up holds gate and up rows alternately
TRANSPOSED = ("gpt_oss", "llama4_text")  # families that store experts [E, K, N] in memory


def quantize_exact(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 codes, uint8 scales, exact decoded float32 values)."""
    codes, scales = mx_quantize(w.double().numpy().astype(np.float32), "e4m3", "rceil", axis=-1, block_size=32)
    exact = dequantize(codes, scales, "e4m3", tuple(w.shape), -1, 32)
    return (torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn),
            torch.from_numpy(np.ascontiguousarray(scales)), torch.from_numpy(np.ascontiguousarray(exact)).float())  # fmt: skip


def per_expert_checkpoint(path, family: str, naming: str = "gate_up_down", container: str = "mlp",
                          activations: bool = False, seed: int = 0, **overrides):  # fmt: skip
    """Write a compressed-tensors MXFP8 checkpoint of a tiny ``family`` model to ``path`` with its
    experts stored one by one (module doc); return the reference model (exact decoded weights)."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    model = moe_model(family, seed=seed, **overrides)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gate_n, up_n, down_n = NAMINGS[naming]
    out, ref = {}, dict(sd)
    for key in sorted(k for k in sd if k.endswith(".experts.gate_up_proj")):
        base = key[: -len(".gate_up_proj")]
        layer = base[: -len(".mlp.experts")]
        gu, dn = sd[key], sd[base + ".down_proj"]
        if family in TRANSPOSED:
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)  # -> [E, N, K]
        gub, dnb = sd.get(base + ".gate_up_proj_bias"), sd.get(base + ".down_proj_bias")
        new_gu, new_dn = torch.empty_like(gu), torch.empty_like(dn)
        for e in range(gu.shape[0]):
            rows = (slice(0, None, 2), slice(1, None, 2)) if family in INTERLEAVED else \
                (slice(0, gu.shape[1] // 2), slice(gu.shape[1] // 2, None))  # fmt: skip
            parts = {gate_n: (gu[e][rows[0]], rows[0], gub), up_n: (gu[e][rows[1]], rows[1], gub), down_n: (dn[e], slice(None), dnb)}
            for name, (w, r, bias) in parts.items():
                codes, scales, exact = quantize_exact(w)
                t = f"{layer}.{container}.experts.{e}.{name}"
                out[t + ".weight"], out[t + ".weight_scale"] = codes, scales
                (new_dn if name == down_n else new_gu)[e][r] = exact
                if bias is not None:
                    out[t + ".bias"] = bias[e][r].clone()
        if family in TRANSPOSED:
            new_gu, new_dn = new_gu.transpose(1, 2), new_dn.transpose(1, 2)
        ref[key], ref[base + ".down_proj"] = new_gu.contiguous(), new_dn.contiguous()
    ignored = re.compile(r"(^lm_head|\.mlp\.gate|\.router)$")
    for name, m in model.named_modules():  # every other Linear, as the config group's "Linear" target says
        if type(m) is torch.nn.Linear and not ignored.search(name):
            codes, scales, ref[name + ".weight"] = quantize_exact(sd[name + ".weight"])
            out[name + ".weight"], out[name + ".weight_scale"] = codes, scales
    for k, v in sd.items():
        if ".experts." in k or k in out:
            continue
        out[re.sub(r"\.mlp\.", f".{container}.", k) if ".mlp.gate." in k or ".mlp.router." in k else k] = v
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors", metadata={"format": "pt"})
    scheme = preset_name_to_scheme("MXFP8", ["Linear"])
    if not activations:
        scheme.input_activations = None
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*mlp.gate$", "re:.*router$"],
                            format="mxfp8-quantized", quantization_status="compressed")  # fmt: skip
    cfg = model.config.to_dict()
    cfg["quantization_config"] = json.loads(json.dumps(qc.model_dump(), default=str))
    (path / "config.json").write_text(json.dumps(cfg))
    model.load_state_dict(ref)
    return model.eval()
