"""MXFP8 input embeddings (``mxq.runtime.embedding``) and one copy for a tied embedding and lm_head.

References are independent of the layer: the numpy bit-level decode of ``mx_reference`` for the
table, the whole dequantized matrix indexed by the ids, and a compressed-tensors checkpoint written
with that package's own MXFP8 classes, as llm-compressor's ``model_free_ptq`` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mx_reference as R
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import mxq
from mxq.convert.converter import quantize_checkpoint
from mxq.formats import E4M3, E5M2, MXTensor, ScaleRule, dequantize_mx, fake_quantize_mx
from mxq.recipe import RecipeError, TensorSpec, load_recipe, parse_recipe
from mxq.runtime.embedding import MXEmbedding
from mxq.runtime.linear import (
    FusedMXLinear,
    MXLinear,
    ProjectionSlice,
    fuse_projections,
    mx_layers,
    unfuse_projections,
)

VOCAB = 301  # a prime: no block, tile or vector width divides it
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
SMALL = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=64)  # fmt: skip
CASES = [(f, t) for f in FAMILIES for t in (True, False)]


def _src(path: Path, family: str, tied: bool, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg_cls, model_cls = FAMILIES[family]
    m = model_cls(cfg_cls(**SMALL, tie_word_embeddings=tied)).to(torch.bfloat16)
    with torch.no_grad():  # rows of very different magnitudes: the per-row scales matter
        m.get_input_embeddings().weight.mul_(torch.logspace(-3, 1, VOCAB).unsqueeze(1).to(torch.bfloat16))
    m.save_pretrained(path)
    return path


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _ids(n: int = 2, s: int = 13, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, s), generator=g)
    ids[0, :3] = torch.tensor([0, VOCAB - 1, VOCAB - 1])  # the edges, and a repeated id
    return ids


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# --- the layer -------------------------------------------------------------------------------


@pytest.mark.parametrize("elem", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_equals_whole_dequantized_table_and_bit_level_decode(elem, dtype):
    torch.manual_seed(11)
    v, h = 997, 160
    table = torch.randn(v, h) * torch.logspace(-6, 6, v).unsqueeze(1)
    table[3, 40:50] = 0.0  # a partly zero block
    table[4, 64:96] = 0.0  # an all-zero block
    table[5, 7] = float("inf")  # a non-finite block: NaN scale, NaN outputs
    emb = torch.nn.Embedding(v, h).to(dtype)
    emb.weight.data.copy_(table.to(dtype))
    mx = MXEmbedding.from_embedding(emb, TensorSpec(elem, ScaleRule.RCEIL))
    assert mx.weight.dtype == elem.torch_dtype and mx.weight_scale.shape == (v, h // 32) and mx.dtype == dtype
    ids = torch.randint(0, v, (3, 7, 5))
    ids[0, 0, :3] = torch.tensor([3, 4, 5])
    got = mx(ids)
    assert got.shape == (3, 7, 5, h) and got.dtype == dtype
    whole = dequantize_mx(mx.mx_weight(), dtype)
    torch.testing.assert_close(got, whole[ids], rtol=0, atol=0, equal_nan=True)
    ref = R.dequantize(mx.weight.view(torch.uint8).numpy(), mx.weight_scale.numpy(), elem.name, (v, h), -1, 32)
    want = torch.from_numpy(ref[ids.numpy()]).to(dtype)  # float64 -> dtype: exact (fp8 values fit)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # the codes themselves are the independent quantizer's
    codes, scales = R.quantize(table.to(dtype).float().numpy(), elem.name, "rceil")
    assert np.array_equal(mx.weight.view(torch.uint8).numpy(), codes) and np.array_equal(mx.weight_scale.numpy(), scales)


def test_compiles_without_graph_breaks():
    torch.manual_seed(2)
    mx = MXEmbedding.from_embedding(torch.nn.Embedding(VOCAB, 64), TensorSpec(E4M3, ScaleRule.RCEIL))
    ids = torch.randint(0, VOCAB, (2, 9))
    torch._dynamo.reset()
    got = torch.compile(mx, backend="aot_eager", fullgraph=True)(ids)
    torch._dynamo.reset()
    assert torch.equal(got, mx(ids))


def test_embedding_dim_must_be_whole_blocks():
    with pytest.raises(ValueError, match="embedding_dim divisible by 32, got 80"):
        MXEmbedding(10, 80)


# --- recipes ---------------------------------------------------------------------------------


def test_recipe_key_and_shipped_recipes():
    r = load_recipe("mxfp8-all")
    assert r.embeddings == "mxfp8" and r.to_dict()["embeddings"] == "mxfp8" and r.exclude == ()
    for name in ("mxfp8", "mxfp8-w8a16", "mxfp8-e5m2", "mxfp8-attn", "mxfp8-lm-head"):
        rec = load_recipe(name)
        assert rec.embeddings is None and "embeddings" not in rec.to_dict()  # behaviour and record unchanged
    base = {"name": "x", "weights": {"elem": "e4m3", "scale_rule": "rceil"}}
    assert parse_recipe({**base, "embeddings": "bf16"}).embeddings is None
    with pytest.raises(RecipeError, match=r"<recipe>: embeddings: expected null, 'bf16' or 'mxfp8', got 'e4m3'"):
        parse_recipe({**base, "embeddings": "e4m3"})


# --- in memory and through the converter: the same model ---------------------------------------


@pytest.mark.parametrize("family, tied", CASES)
def test_quantize_model_equals_converter_and_from_pretrained(tmp_path, family, tied):
    src = _src(tmp_path / "src", family, tied)
    mem = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), "mxfp8-all")
    emb, head = mem.model.embed_tokens, mem.lm_head
    assert type(emb) is MXEmbedding and type(head) is MXLinear and head.act is not None
    assert (head.weight is emb.weight and head.weight_scale is emb.weight_scale) == tied
    assert mem.dtype == torch.bfloat16  # not the fp8 code table's dtype
    rep = quantize_checkpoint(src, tmp_path / "q", "mxfp8-all", progress=False)
    assert rep.kept == {} and "model.embed_tokens" in {r.name for r in rep.quantized}
    assert ("lm_head" in {r.name for r in rep.quantized}) != tied  # a tied head has no tensor to write
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["layers"]["model.embed_tokens"] == {"weights": {"elem": "e4m3", "scale_rule": "rceil"}, "activations": None}
    assert qc["recipe"]["embeddings"] == "mxfp8"
    if tied:
        assert qc["tied"] == {"lm_head": {"to": "model.embed_tokens", "activations": {"elem": "e4m3", "scale_rule": "rceil"}}}
        assert "lm_head" not in qc["layers"]
    else:
        assert "tied" not in qc and "lm_head" in qc["layers"]
    disk = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    loaded = mxq.load(tmp_path / "q", fuse=False)
    for m in (disk, loaded):
        assert type(m.model.embed_tokens) is MXEmbedding and m.dtype == torch.bfloat16
        assert (m.lm_head.weight is m.model.embed_tokens.weight and m.lm_head.weight_scale is m.model.embed_tokens.weight_scale) == tied
    for (n1, p1), (n2, p2) in zip(mem.state_dict().items(), disk.state_dict().items(), strict=True):
        assert n1 == n2 and p1.dtype == p2.dtype and torch.equal(_u8(p1), _u8(p2)), n1
    ids = _ids()
    with torch.no_grad():
        want = mem(ids).logits
        assert torch.equal(disk(ids).logits, want) and torch.equal(loaded(ids).logits, want)
        # the embedding output is the stored table dequantized, row by row
        t = _tensors(tmp_path / "q")
        table = MXTensor(t["model.embed_tokens.weight"], t["model.embed_tokens.weight_scale"], (VOCAB, 96), 1, 32, E4M3)
        assert torch.equal(disk.model.embed_tokens(ids), table.dequantize(torch.bfloat16)[ids])


def test_e8m0_scales_load_the_same(tmp_path):
    src = _src(tmp_path / "src", "llama", True)
    quantize_checkpoint(src, tmp_path / "u8", "mxfp8-all", progress=False)
    quantize_checkpoint(src, tmp_path / "e8m0", "mxfp8-all", progress=False, scale_dtype="e8m0")
    assert _tensors(tmp_path / "e8m0")["model.embed_tokens.weight_scale"].dtype == torch.float8_e8m0fnu
    a, b = mxq.load(tmp_path / "u8"), mxq.load(tmp_path / "e8m0")
    assert b.model.embed_tokens.weight_scale.dtype == torch.uint8 and b.lm_head.weight_scale is b.model.embed_tokens.weight_scale
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("family, tied", CASES)
def test_logits_match_fake_quant_reference(tmp_path, family, tied):
    """An independent forward: the bf16 model with the table MX-rounded by the format core and every
    Linear computing fq(X) @ fq(W).T in float32 (the tied head on the rounded table)."""
    src = _src(tmp_path / "src", family, tied)
    quantize_checkpoint(src, tmp_path / "q", "mxfp8-all", progress=False)
    got = mxq.load(tmp_path / "q", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        emb = ref.get_input_embeddings()
        emb.weight.data = fake_quantize_mx(emb.weight.data, -1, E4M3)  # the tied head sees it too
    for name, lin in [(n, m) for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)]:
        w_q = lin.weight.detach().float() if (tied and name == "lm_head") else fake_quantize_mx(lin.weight.detach().float(), -1, E4M3)

        def fwd(x, lin=lin, w_q=w_q):
            y = fake_quantize_mx(x.float(), -1, E4M3) @ w_q.t()
            return (y + lin.bias.float() if lin.bias is not None else y).to(x.dtype)

        lin.forward = fwd
    ids = _ids()
    with torch.no_grad():
        a, b = got(ids).logits.double(), ref(ids).logits.double()
    assert ((a - b).norm() / b.norm()).item() < 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tied_checkpoint_stores_the_matrix_once(tmp_path, family):
    src = _src(tmp_path / "src", family, True)
    quantize_checkpoint(src, tmp_path / "all", "mxfp8-all", progress=False)
    quantize_checkpoint(src, tmp_path / "base", "mxfp8", progress=False)
    all_, base = _tensors(tmp_path / "all"), _tensors(tmp_path / "base")
    assert not any(k.startswith("lm_head") for k in all_) and not any(k.startswith("lm_head") for k in base)
    assert sorted(all_) == sorted([*base, "model.embed_tokens.weight_scale"])
    v, h = VOCAB, SMALL["hidden_size"]
    nbytes = lambda t: sum(x.numel() * x.element_size() for x in t.values())  # noqa: E731
    assert nbytes(base) - nbytes(all_) == v * h * 2 - (v * h + v * h // 32)  # bf16 table -> fp8 + scales, once
    # save_pretrained of the loaded model keeps it so: one table, one set of scales
    m = mxq.load(tmp_path / "all")
    m.save_pretrained(tmp_path / "again")
    again = _tensors(tmp_path / "again")
    assert sorted(again) == sorted(all_)
    for k, t in all_.items():
        assert torch.equal(_u8(again[k]), _u8(t)), k
    idx = tmp_path / "again" / "model.safetensors.index.json"
    keys = json.loads(idx.read_text())["weight_map"] if idx.exists() else {}
    assert not any(k.startswith("lm_head") for k in keys)
    with torch.no_grad():
        ids = _ids()
        assert torch.equal(mxq.load(tmp_path / "again")(ids).logits, m(ids).logits)


@pytest.mark.parametrize("family, tied", CASES)
def test_state_dict_round_trip(tmp_path, family, tied):
    src = _src(tmp_path / "src", family, tied)
    a = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), "mxfp8-all")
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    assert {"model.embed_tokens.weight", "model.embed_tokens.weight_scale", "lm_head.weight_scale"} <= set(sd)
    b = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(_src(tmp_path / "other", family, tied, seed=9),
                                                                dtype=torch.bfloat16), "mxfp8-all")  # fmt: skip
    ids = _ids()
    with torch.no_grad():
        assert not torch.equal(a(ids).logits, b(ids).logits)
        b.load_state_dict(sd)
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert (b.lm_head.weight is b.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("tied", [True, False])
def test_in_memory_model_saves_and_loads(tmp_path, tied):
    src = _src(tmp_path / "src", "qwen2", tied)
    m = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), "mxfp8-all")
    m.save_pretrained(tmp_path / "saved")
    keys = set(_tensors(tmp_path / "saved"))
    assert {"model.embed_tokens.weight", "model.embed_tokens.weight_scale"} <= keys
    assert ({"lm_head.weight", "lm_head.weight_scale"} <= keys) != tied and not (tied and any("lm_head" in k for k in keys))
    back = mxq.load(tmp_path / "saved")
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)


@pytest.mark.parametrize("family, tied", CASES)
def test_generate(tmp_path, family, tied):
    src = _src(tmp_path / "src", family, tied)
    quantize_checkpoint(src, tmp_path / "q", "mxfp8-all", progress=False)
    m = mxq.load(tmp_path / "q")
    prompt = _ids(1, 6)
    out = m.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11) and torch.equal(out[:, :6], prompt)
    static = m.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(static, out)
    # greedy decoding step by step without a cache gives the same tokens
    ids = prompt
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, m(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(ids, out)


@pytest.mark.parametrize("tied", [True, False])
def test_fuse_projections_with_mx_lm_head(tmp_path, tied):
    src = _src(tmp_path / "src", "qwen2", tied)
    m = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), "mxfp8-all", fuse=False)
    keys = sorted(m.state_dict())
    ids = _ids()
    with torch.no_grad():
        want = m(ids).logits
    assert len(fuse_projections(m)) == 2 * SMALL["num_hidden_layers"]
    assert isinstance(m.model.layers[0].self_attn.q_proj, ProjectionSlice)
    assert isinstance(m.model.layers[0].mlp.mxq_fused_gate_proj_up_proj, FusedMXLinear)
    assert type(m.lm_head) is MXLinear and "lm_head" in mx_layers(m)
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    assert sorted(m.state_dict()) == keys
    unfuse_projections(m)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)


# --- tied heads: the rules ---------------------------------------------------------------------


def _recipe(tmp_path: Path, **kw) -> Path:
    d = {"name": "emb", "weights": {"elem": "e4m3", "scale_rule": "rceil"},
         "activations": {"elem": "e4m3", "scale_rule": "rceil"}, "embeddings": "mxfp8", **kw}  # fmt: skip
    p = tmp_path / "r.yaml"
    p.write_text(json.dumps(d))
    return p


def test_tied_head_excluded_by_the_recipe_shares_the_table_with_bf16_activations(tmp_path):
    """One tensor serves both: the embedding is quantized, so is the tied head's weight; the head's
    exclusion keeps its activations in bf16. Untied, the excluded head stays bf16 entirely."""
    recipe = _recipe(tmp_path, exclude=["lm_head"])
    src = _src(tmp_path / "src", "llama", True)
    rep = quantize_checkpoint(src, tmp_path / "q", recipe, progress=False)
    assert rep.kept == {}
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["tied"] == {"lm_head": {"to": "model.embed_tokens", "activations": None}}
    m = mxq.load(tmp_path / "q")
    assert m.lm_head.weight is m.model.embed_tokens.weight and m.lm_head.act is None
    mem = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), load_recipe(recipe))
    with torch.no_grad():
        assert torch.equal(mem(_ids()).logits, m(_ids()).logits)
    untied = _src(tmp_path / "u", "llama", False)
    rep = quantize_checkpoint(untied, tmp_path / "qu", recipe, progress=False)
    assert rep.kept == {"lm_head": "excluded by recipe"} and type(mxq.load(tmp_path / "qu").lm_head) is torch.nn.Linear


def test_lm_head_recipe_on_a_tied_model_is_unchanged(tmp_path):
    src = _src(tmp_path / "src", "qwen2", True)
    rep = quantize_checkpoint(src, tmp_path / "q", "mxfp8-lm-head", progress=False)
    assert "tied" in rep.kept["lm_head"] and "model.embed_tokens" not in {r.name for r in rep.quantized}
    m = mxq.load(tmp_path / "q")
    assert type(m.model.embed_tokens) is torch.nn.Embedding and type(m.lm_head) is torch.nn.Linear


def test_hidden_size_not_whole_blocks_keeps_the_embedding(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMALL, "hidden_size": 80, "head_dim": 16, "num_attention_heads": 5}, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    warnings = []
    rep = quantize_checkpoint(tmp_path / "src", tmp_path / "q", _recipe(tmp_path), progress=False, warn=warnings.append)
    assert rep.kept["model.embed_tokens"] == "H=80 is not a multiple of 32"
    assert any("keeping model.embed_tokens" in w for w in warnings)
    m = mxq.load(tmp_path / "q")
    assert type(m.model.embed_tokens) is torch.nn.Embedding and m.lm_head.weight is m.model.embed_tokens.weight


def test_config_errors_are_one_line(tmp_path):
    src = _src(tmp_path / "src", "llama", True)
    quantize_checkpoint(src, tmp_path / "q", "mxfp8-all", progress=False)
    cfg_file = tmp_path / "q" / "config.json"
    good = json.loads(cfg_file.read_text())

    def load_with(**change):
        cfg = json.loads(json.dumps(good))
        for k, v in change.items():
            if v is None:
                cfg["quantization_config"].pop(k)
            else:
                cfg["quantization_config"][k] = v
        cfg_file.write_text(json.dumps(cfg))
        return mxq.load(tmp_path / "q")

    with pytest.raises(ValueError, match=r"tied\['lm_head'\]\.to: 'model.norm' is not one of the quantization_config's layers"):
        load_with(tied={"lm_head": {"to": "model.norm", "activations": None}})
    with pytest.raises(ValueError, match=r"quantizes 'model.embed_tokens', which LlamaForCausalLM ties to 'lm_head'.*under tied"):
        load_with(tied=None)
    with pytest.raises(ValueError, match=r"tied\['lm_head'\]: expected"):
        load_with(tied={"lm_head": "model.embed_tokens"})
    cfg = json.loads(json.dumps(good))
    cfg["tie_word_embeddings"] = False
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"ties 'lm_head' to 'model.embed_tokens', but LlamaForCausalLM does not tie them"):
        mxq.load(tmp_path / "q")


# --- llm-compressor's model_free_ptq(scheme="MXFP8", ignore=["lm_head"]) ------------------------


def _model_free_mxfp8(src: Path, out: Path, ignore: list[str]) -> Path:
    """What ``model_free_ptq`` writes, with compressed-tensors' own classes: every ``.weight`` its
    name-based matcher selects for targets ["Linear"] (the embedding included, norms excluded) as
    fp8 codes under compressed-tensors' MX scales, and a config of one group and the ignore list."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
    from compressed_tensors.utils import match_quantizable_tensors

    scheme = preset_name_to_scheme("MXFP8", ["Linear"])
    tensors = _tensors(src)
    for module, name in list(match_quantizable_tensors(tensors, ignore, scheme.targets)):
        w = tensors[name]
        amax = w.reshape(w.shape[0], -1, 32).abs().amax(-1)
        scale = 2.0 ** (generate_mx_scales(amax.float(), 8) - 127)
        sd = MXFP8QuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        del tensors[name]
        for k, v in sd.items():
            tensors[f"{module}.{k}"] = v.contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    qc = QuantizationConfig.model_validate({"config_groups": {"config_group_0": scheme}, "ignore": ignore,
                                            "quantization_status": "compressed", "format": "mxfp8-quantized"})  # fmt: skip
    cfg["quantization_config"] = {"version": ct.__version__, "quant_method": "compressed-tensors", "transform_config": {},
                                  **json.loads(json.dumps(qc.model_dump(exclude=["quant_method"]), default=str))}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


@pytest.mark.parametrize("family, tied", CASES)
def test_model_free_ptq_checkpoint_loads_with_mx_embedding(tmp_path, family, tied):
    src = _src(tmp_path / "src", family, tied)
    ckpt = _model_free_mxfp8(src, tmp_path / "ct", ["lm_head"])
    t = _tensors(ckpt)
    assert t["model.embed_tokens.weight"].dtype == torch.float8_e4m3fn and "lm_head.weight_scale" not in t
    m = mxq.load(ckpt, dtype=torch.float32, fuse=False)
    assert type(m.model.embed_tokens) is MXEmbedding
    qc = m.config.quantization_config
    assert qc.layers["model.embed_tokens"]["activations"] is None
    # every quantized tensor loads as stored; the layers decode it as a hand dequantization does
    by_hand = {}
    for name in [k[: -len(".weight_scale")] for k in t if k.endswith(".weight_scale")]:
        codes, scales = t[name + ".weight"], t[name + ".weight_scale"]
        by_hand[name] = codes.float().reshape(codes.shape[0], -1, 32) * torch.exp2(scales.float() - 127).unsqueeze(-1)
        by_hand[name] = by_hand[name].reshape(codes.shape)
        mod = m.get_submodule(name)
        assert torch.equal(_u8(mod.weight.data), _u8(codes)) and torch.equal(mod.weight_scale.data, scales), name
        assert torch.equal(mod.dequantized_weight(), by_hand[name]), name
    assert set(by_hand) == (set(mx_layers(m)) | {"model.embed_tokens"}) - ({"lm_head"} if tied else set())
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(m.model.embed_tokens(ids), by_hand["model.embed_tokens"][ids])
    if tied:  # ignored, but it is the same matrix: it reads the fp8 table, with bf16 activations
        assert type(m.lm_head) is MXLinear and m.lm_head.weight is m.model.embed_tokens.weight and m.lm_head.act is None
        assert qc.tied_layers() == {"lm_head": ("model.embed_tokens", None)}
    else:
        assert type(m.lm_head) is torch.nn.Linear and torch.equal(m.lm_head.weight.data, t["lm_head.weight"].float())
    # the logits: a float32 model holding the hand-decoded tensors, every quantized Linear with MX activations
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        ref.get_input_embeddings().weight.data = by_hand["model.embed_tokens"].clone()
    for name, w in by_hand.items():
        if name == "model.embed_tokens":
            continue
        lin = ref.get_submodule(name)

        def fwd(x, lin=lin, w=w):
            y = fake_quantize_mx(x.float(), -1, E4M3) @ w.t()
            return y + lin.bias.float() if lin.bias is not None else y

        lin.forward = fwd
    with torch.no_grad():
        a, b = m(ids).logits.double(), ref(ids).logits.double()
    assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_compressed_tensors_targets_and_ignore_decide(tmp_path):
    """Which layers are quantized comes from targets/ignore: an embedding stored in fp8 while the
    ignore list names it, or a scale for a layer no group targets, is an error naming the tensor;
    a Linear-only config over a bf16 embedding (oneshot, mxq's own writer) leaves it bf16."""
    src = _src(tmp_path / "src", "llama", False)
    ckpt = _model_free_mxfp8(src, tmp_path / "ct", ["lm_head"])
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "model.embed_tokens"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor model.embed_tokens.weight_scale: a scale for model.embed_tokens, which .*leave unquantized"):
        mxq.load(ckpt)
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    cfg["quantization_config"]["config_groups"]["config_group_0"]["targets"] = ["re:.*mlp.*", "Embedding"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor model.layers.0.self_attn.(q|k|v|o)_proj.weight_scale: a scale for"):
        mxq.load(ckpt)
    # mxq's own compressed-tensors output of mxfp8-all targets the class "Embedding" explicitly
    quantize_checkpoint(src, tmp_path / "own", "mxfp8-all", fmt="compressed-tensors", progress=False)
    qc = json.loads((tmp_path / "own" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear", "Embedding"] and qc["ignore"] == []
    quantize_checkpoint(src, tmp_path / "native", "mxfp8-all", progress=False)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(mxq.load(tmp_path / "own")(ids).logits, mxq.load(tmp_path / "native")(ids).logits)


def test_inspect_validates_the_embedding(tmp_path):
    from mxq.checkpoint.describe import inspect_checkpoint

    src = _src(tmp_path / "src", "qwen2", True)
    quantize_checkpoint(src, tmp_path / "q", "mxfp8-all", progress=False)
    rep = inspect_checkpoint(tmp_path / "q")
    assert rep.problems == [] and rep.n_quantized == 15  # 14 Linear layers + the embedding (lm_head is tied)
    f = next((tmp_path / "q").glob("*.safetensors"))
    with safe_open(f, "pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}
    t["model.embed_tokens.weight_scale"] = t["model.embed_tokens.weight_scale"][:, :2].contiguous()
    save_file(t, f, metadata={"format": "pt"})
    probs = inspect_checkpoint(tmp_path / "q").problems
    assert any("tensor model.embed_tokens.weight_scale: shape [301, 2] does not match weight [301, 96]" in p for p in probs)
