"""Tiny dense models, token ids, a character tokenizer and text: what the calibration tests share."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mxq.calib.calibrator import calibrate
from mxq.recipe import load_recipe


def tiny_llama(seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


def tiny_qwen(seed=1) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, tie_word_embeddings=True)
    m = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
            layer.input_layernorm.weight.uniform_(0.5, 2.0)  # non-trivial norms, so their permutation matters
            layer.post_attention_layernorm.weight.uniform_(0.5, 2.0)
    return m


def token_ids(vocab: int, n: int = 2, s: int = 33) -> torch.Tensor:
    return torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(5))


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


class CharTokenizer:
    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, verbose=False):
        return {"input_ids": [ord(c) % self.vocab for c in text]}


TEXT = " ".join(f"The {w} of channel {i} rises and falls." for i, w in enumerate(["range", "scale", "block"] * 40))


def tiny_plan_inputs(model):
    rec = load_recipe("mxfp8")
    cal = calibrate(model, CharTokenizer(model.config.vocab_size), TEXT, rec, samples=4, seq_len=48,
                    sample_rows=64, sensitivity_samples=2, sensitivity_seq_len=40, progress=False)
    return rec, cal
