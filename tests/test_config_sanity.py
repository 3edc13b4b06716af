"""Mixture-of-experts keys of config.json checked before any work: a nonsense expert count, top-k,
width, step, group or layer list is refused in one line naming config.json and the key, before a
model is built or a tensor read, and an expert count is bounded by what the checkpoint's headers
hold, so that no structure as large as a wrong count is ever built. transformers itself takes
these values as given (a negative count quietly builds dense MLPs, below)."""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc

import pytest
import torch
from cli_helpers import run_cli
from moe_models import FAMILIES, moe_model
from safetensors import safe_open

from mxq.checkpoint.config import EXPERT_COUNT_KEYS
from mxq.hf.models import ModelSourceError, check_moe_config


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each family's tiny checkpoint, saved once; tests edit copies."""
    root = tmp_path_factory.mktemp("moe")
    made = {}

    def get(family):
        if family not in made:
            made[family] = root / family
            moe_model(family).save_pretrained(made[family])
        return made[family]

    return get


def _edited(src, dst, **changes):
    """A copy of ``src`` with config.json's keys set (a value of ``...`` removes the key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _count_key(src) -> str:
    """The key the saved config.json spells the expert count with."""
    cfg = json.loads((src / "config.json").read_text())
    return next(k for k in EXPERT_COUNT_KEYS if k in cfg)


def _refused(tmp_path, rc, err, *named):
    """Failed in one line naming each of ``named``, no traceback, nothing beside OUT."""
    assert rc != 0 and "Traceback" not in err, err[-800:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mxq: error: "), err[-800:]
    for n in named:
        assert n in lines[0], (n, lines[0])
    assert not (tmp_path / "mx").exists()
    assert [p.name for p in tmp_path.iterdir() if ".mxq-" in p.name] == []


def _forbid_work(monkeypatch):
    """From here on, building a config or a model, or reading a tensor, fails the test
    (pytest.fail is no Exception, so the command line's one-line handler does not swallow it)."""
    import transformers

    import mxq.checkpoint.files
    import mxq.convert.source  # imported before the patch: it binds read_tensor by name when first imported

    def fail(*a, **k):
        pytest.fail("work started before config.json was checked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fail)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", fail)
    for module in (mxq.checkpoint.files, mxq.convert.source):
        monkeypatch.setattr(module, "read_tensor", fail)


# per family: a key and a nonsense value; "count" stands for the family's expert count key
CASES = [
    *[(f, "count", v) for f in FAMILIES for v in (-4, 0)],
    *[(f, "num_experts_per_tok", v) for f in FAMILIES for v in (0, 5)],  # top-k of 4 experts: 1..4
    ("olmoe", "count", True), ("mixtral", "count", 4.5), ("gpt_oss", "count", "4"),
    ("qwen3_moe", "moe_intermediate_size", -64), ("qwen3_moe", "decoder_sparse_step", 0),
    ("qwen3_moe", "mlp_only_layers", [2]), ("qwen2_moe", "shared_expert_intermediate_size", 0),
    ("deepseek_v3", "n_group", 3), ("deepseek_v3", "topk_group", 2), ("deepseek_v3", "first_k_dense_replace", -1),
    ("glm4_moe", "n_shared_experts", -1), ("llama4_text", "interleave_moe_layer_step", 0),
    ("llama4_text", "moe_layers", [0, 5]), ("llama4_text", "intermediate_size_mlp", -96),
]  # fmt: skip


@pytest.mark.parametrize(("family", "key", "value"), CASES)
def test_nonsense_moe_keys_are_refused_before_any_work(
    tmp_path, monkeypatch, sources, family, key, value
):
    src = sources(family)
    key = _count_key(src) if key == "count" else key
    bad = _edited(src, tmp_path / "src", **{key: value})
    _forbid_work(monkeypatch)
    rc, err = run_cli(["quantize", str(bad), str(tmp_path / "mx")])
    _refused(tmp_path, rc, err, "config.json", f"{key} is {json.dumps(value)};")


def test_a_negative_count_would_build_dense_mlps(tmp_path, sources):
    """The reported case, Qwen3-MoE's hub spelling ``num_experts: -4``: transformers builds the
    model without any experts module (so the checkpoint's experts would be dropped); mxq refuses."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mxq.runtime.experts import experts_layers

    bad = _edited(sources("qwen3_moe"), tmp_path / "src", num_local_experts=..., num_experts=-4)
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bad))
    assert experts_layers(dense) == {}
    rc, err = run_cli(["quantize", str(bad), str(tmp_path / "mx")])
    _refused(
        tmp_path, rc, err, f"{bad / 'config.json'}: num_experts is -4; expected a positive integer"
    )
    rc, err = run_cli(
        [
            "calibrate",
            str(bad),
            "--dataset",
            str(tmp_path / "absent.txt"),
            "--out",
            str(tmp_path / "p.json"),
        ]
    )
    _refused(tmp_path, rc, err, "config.json: num_experts is -4")  # before the text is read
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "gpt_oss"]
)  # experts stored per expert, and fused 3-D
def test_a_huge_count_is_bounded_by_the_checkpoint(tmp_path, monkeypatch, sources, family):
    """``num_experts: 1000000000`` built every expected expert name (and ran out of memory) before
    any check; now the count is refused against the checkpoint's headers, in little time and memory."""
    src = sources(family)
    key = _count_key(src)
    bad = _edited(src, tmp_path / "src", **{key: 10**9})
    with safe_open(src / "model.safetensors", "pt") as f:
        n_tensors = len(list(f.keys()))
    _forbid_work(monkeypatch)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        rc, err = run_cli(["quantize", str(bad), str(tmp_path / "mx")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _refused(
        tmp_path,
        rc,
        err,
        "config.json",
        f"{key} is 1000000000, more experts than the checkpoint holds: {n_tensors} tensors",
    )
    # the bound that matters is memory (the failure was running out of it); the time bound is far above
    # any machine's spread (the refusal takes well under a second) and only guards against a hang
    assert time.perf_counter() - t0 < 120 and peak < 64 * 2**20, (time.perf_counter() - t0, peak)


def test_a_count_above_the_experts_on_disk_names_the_missing_one(tmp_path, sources):
    """A count the headers allow but the checkpoint does not hold: the first missing expert tensor
    is named, with both counts."""
    bad = _edited(sources("qwen3_moe"), tmp_path / "src", num_local_experts=6)
    rc, err = run_cli(["quantize", str(bad), str(tmp_path / "mx")])
    _refused(tmp_path, rc, err, "missing model.layers.0.mlp.experts.4.down_proj.weight",
             "the model's config makes 6 experts, the checkpoint holds 4")  # fmt: skip


def test_expert_names_cost_what_the_checkpoint_lists():
    """Matching an experts module to the checkpoint never builds a structure of the config's size:
    a count of 10**12 against a checkpoint of 4 experts is answered at once (an expected-name set
    would need terabytes)."""
    from mxq.convert.layout import ConversionError, experts_on_disk
    from mxq.runtime.experts import GATED, ExpertsLayer

    info = ExpertsLayer(
        "model.layers.0.mlp.experts", 10**12, GATED, ((128, 64), (64, 64)), False, False
    )
    weights = {f"model.layers.0.mlp.experts.{e}.{p}.weight": ("BF16", (64, 64))
               for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    tracemalloc.start()  # memory, not time, is the proof: a set of the config's size would need terabytes
    try:
        with pytest.raises(
            ConversionError, match=r"missing model\.layers\.0\.mlp\.experts\.4\.down_proj\.weight"
        ):
            experts_on_disk(info, weights)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


# MoE causal LMs of transformers whose own defaults must pass (no false alarms on real settings)
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "llama4", "glm4_moe",
             "granitemoe", "jamba", "jetmoe", "phimoe", "minimax", "dots1", "hunyuan_v1_moe", "ernie4_5_moe", "flex_olmo",
             "lfm2_moe", "exaone_moe", "doge")  # fmt: skip


def test_real_settings_pass():
    from transformers import CONFIG_MAPPING, AutoConfig

    checked = 0
    for mt in MOE_TYPES:
        if mt not in CONFIG_MAPPING:  # not in this transformers release
            continue
        cfg = AutoConfig.for_model(mt).to_dict()
        check_moe_config(cfg, f"{mt} defaults")
        checked += 1
    assert checked >= 10
    # a composite config's text part is checked as well
    with pytest.raises(
        ModelSourceError, match=r"x/config\.json: text_config\.num_local_experts is -1;"
    ):
        check_moe_config({"text_config": {"num_local_experts": -1}}, "x/config.json")
