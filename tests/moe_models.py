"""Tiny random mixture-of-experts models of eight families, for the MoE tests: hidden 64, expert
width 64 (both multiples of the 32-element MX block), 2 layers, 4 experts top-2."""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "llama4_text", "glm4_moe")


def moe_config(family: str, **overrides):
    """A tiny config of ``family`` (transformers' model_type); ``overrides`` replace its values."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )
    per_family = {
        "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                          decoder_sparse_step=1, mlp_only_layers=[]),
        "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
        "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
        "olmoe": dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2),
        "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                            q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                            v_head_dim=16, rope_scaling=None, num_key_value_heads=4),
        "gpt_oss": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                        layer_types=["sliding_attention", "full_attention"]),
        "llama4_text": dict(intermediate_size=64, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                            interleave_moe_layer_step=1, moe_layers=[0, 1], no_rope_layers=[1, 1]),
        "glm4_moe": dict(intermediate_size=96, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0),
    }[family]
    return AutoConfig.for_model(family, **{**common, **per_family, **overrides})


def moe_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny ``family`` model with random weights (router weights spread so that every expert is used)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, **overrides), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
            elif "norm" in name or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model.eval()
