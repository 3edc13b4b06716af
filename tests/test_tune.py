"""The tuning cache (kernels/tune.py) and ``mxq tune`` (mxq/cli/tune.py): file format, atomic
writes, bad files, the choice rule, the command's inputs; the timing itself on a Hopper GPU
(``test_gpu_tune_decode_ws_writes_and_dispatch_reads``, marked gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import pytest

from mxq.kernels import tune


@dataclass(frozen=True)
class Cfg:
    block_n: int = 128
    split_k: int = 1
    fuse_x: bool = False
    block_m: int | None = None


def _put(path, device="GPU A", key="m1_n64_k128", cfg=Cfg(64, 4, True)):
    tune.TuneCache(path).put("k", device, {key: tune.record(cfg, 9.5, 10.0, 1, 3)})


def test_round_trip(tmp_path):
    p = tmp_path / "sub" / "tune.json"  # the folder is made on first write
    _put(p)
    _put(p, key="m16_n64_k128", cfg=Cfg(128, 2, False, 16))
    c = tune.TuneCache(p)
    assert c.config("k", "GPU A", "m1_n64_k128", Cfg) == Cfg(64, 4, True)
    assert c.config("k", "GPU A", "m16_n64_k128", Cfg) == Cfg(128, 2, False, 16)
    assert c.config("k", "GPU B", "m1_n64_k128", Cfg) is None
    assert c.config("other", "GPU A", "m1_n64_k128", Cfg) is None
    data = json.loads(p.read_text())
    rec = data["devices"]["GPU A"]["k"]["m1_n64_k128"]
    assert data["version"] == tune.VERSION and rec["us"] == 9.5 and rec["default_us"] == 10.0 and rec["m"] == 1
    assert [f.name for f in p.parent.iterdir()] == ["tune.json"]  # no temporary left behind


def test_put_keeps_entries_written_meanwhile(tmp_path):
    """Two tuners (processes) sharing the file: each re-reads before writing, so neither loses the other's entries."""
    p = tmp_path / "t.json"
    a, b = tune.TuneCache(p), tune.TuneCache(p)
    assert a.config("k", "GPU A", "x", Cfg) is None  # a has loaded the (missing) file
    b.put("k", "GPU B", {"y": tune.record(Cfg(), 1.0, 1.0, 1, 1)})
    a.put("k", "GPU A", {"x": tune.record(Cfg(64), 1.0, 1.0, 1, 1)})
    c = tune.TuneCache(p)
    assert c.config("k", "GPU A", "x", Cfg) == Cfg(64) and c.config("k", "GPU B", "y", Cfg) == Cfg()


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "t.json"
    _put(p)
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(tune.json, "dump", boom)
    with pytest.raises(OSError, match="disk full"):
        _put(p, key="m8_n64_k128")
    assert p.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["t.json"]


@pytest.mark.parametrize(
    "text,what",
    [("{not json", "unreadable tuning cache"), ('{"version": 99, "devices": {}}', "not an mxq tuning cache"),
     ("[1, 2]", "not an mxq tuning cache"), (b"\xff\xfe\x00", "unreadable tuning cache")],
)  # fmt: skip
def test_bad_file_is_reported_once_and_ignored(tmp_path, text, what):
    p = tmp_path / "t.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    c = tune.TuneCache(p)
    with pytest.warns(UserWarning, match=f"{p}: {what}.*built-in tile rules") as rec:
        assert c.config("k", "GPU A", "m1_n64_k128", Cfg) is None
        assert c.config("k", "GPU A", "m8_n64_k128", Cfg) is None
    assert len(rec) == 1
    _put(p)  # a later tune replaces the bad file with a good one
    assert tune.TuneCache(p).config("k", "GPU A", "m1_n64_k128", Cfg) == Cfg(64, 4, True)


def test_entry_that_does_not_fit_the_config_is_ignored(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"version": 1, "devices": {"GPU A": {"k": {
        "a": {"config": {"block_n": 64, "warp_size": 7}}, "b": {"config": {"block_n": "64"}}, "c": {"us": 1.0},
        "d": {"config": {"block_n": 64}}}}}}))  # fmt: skip
    c = tune.TuneCache(p)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert c.config("k", "GPU A", "a", Cfg) is None
        assert c.config("k", "GPU A", "b", Cfg) is None
        assert c.config("k", "GPU A", "c", Cfg) is None
        assert c.config("k", "GPU A", "d", Cfg) == Cfg(block_n=64)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 3 and all(str(p) in m for m in msgs)
    assert "GPU A / k / a does not fit Cfg" in msgs[0] and "c has no config" in msgs[2]


def test_buckets_keys_and_choice():
    assert [tune.m_bucket(m) for m in (1, 2, 8, 9, 16)] == [1, 8, 8, 16, 16]
    assert tune.shape_key(5, 4096, 14336) == "m8_n4096_k14336"
    # the rule's config stays unless another is >= MIN_GAIN faster
    assert tune.pick({"rule": 10.0, "a": 9.9, "b": 10.5}, "rule") == "rule"
    assert tune.pick({"rule": 10.0, "a": 9.7, "b": 9.5}, "rule") == "b"
    assert tune.pick({"rule": 10.0, "a": 10.0 * (1 - tune.MIN_GAIN) - 1e-9}, "rule") == "a"
    assert tune.weight_copies(10**9, 50 * 2**20) == 1 and tune.weight_copies(10**6, 50 * 2**20) == 8
    assert tune.weight_copies(32 * 2**20, 50 * 2**20) == 5


@pytest.mark.parametrize("n,min_calls", [(1, 32), (3, 32), (5, 7), (40, 32), (7, 1)])
def test_graph_calls_cycle_the_copies(n, min_calls):
    calls = [object() for _ in range(n)]
    got = tune.graph_calls(calls, min_calls)
    # at least min_calls, whole passes only (each copy as often as the others), copies in turn
    assert len(got) >= min_calls and len(got) % n == 0 and len(got) - n < max(min_calls, n)
    assert all(got[i] is calls[i % n] for i in range(len(got)))
    with pytest.raises(ValueError, match="no calls"):
        tune.graph_calls([], min_calls)


def test_cache_path(monkeypatch, tmp_path):
    """A file named by the caller (``mxq tune --cache``), else tune.json in $MXQ_CACHE, else in
    $XDG_CACHE_HOME/mxq; with MXQ_CACHE=off nothing is read, but a named file is."""
    monkeypatch.setenv("MXQ_CACHE", str(tmp_path / "c"))
    assert tune.cache_path() == tmp_path / "c" / "tune.json" and tune.enabled()
    monkeypatch.setattr(tune, "PATH", tmp_path / "x.json")
    assert tune.cache_path() == tmp_path / "x.json"
    monkeypatch.setattr(tune, "PATH", None)
    monkeypatch.delenv("MXQ_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune.cache_path() == tmp_path / "mxq" / "tune.json"
    monkeypatch.setenv("MXQ_CACHE", "off")
    assert not tune.enabled() and tune.cache_path() == tmp_path / "mxq" / "tune.json"
    monkeypatch.setattr(tune, "PATH", tmp_path / "x.json")
    assert tune.enabled()


def _mxq(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mxq.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)  # fmt: skip


def test_cli_dry_run_lists_checkpoint_shapes(tmp_path):
    """The shapes come from the checkpoint's fp8 2-D weights (distinct, in the index's order) plus --shapes."""
    import torch
    from safetensors.torch import save_file

    ck = tmp_path / "ck"
    ck.mkdir()
    f8 = torch.float8_e4m3fn
    save_file({
        "a.q.weight": torch.zeros(96, 256, dtype=f8), "a.q.weight_scale": torch.zeros(96, 8, dtype=torch.uint8),
        "a.o.weight": torch.zeros(256, 96 * 4, dtype=f8), "b.q.weight": torch.zeros(96, 256, dtype=f8),
        "norm.weight": torch.zeros(256, dtype=torch.bfloat16), "emb.weight": torch.zeros(10, 256, dtype=torch.bfloat16),
    }, str(ck / "model.safetensors"))  # fmt: skip
    r = _mxq("tune", str(ck), "--shapes", "4096x4096,96x256", "--ms", "1,4", "--dry-run", "--cache", str(tmp_path / "c.json"))
    assert r.returncode == 0, r.stderr
    assert "shapes (N x K): 256x384, 96x256, 4096x4096; M: 1, 4" in r.stderr and str(tmp_path / "c.json") in r.stderr


@pytest.mark.parametrize(
    "args,msg",
    [(["--shapes", "40x"], "--shapes: '40x' is not NxK"), (["--shapes", "llama3-9b"], "'llama3-9b' is not NxK"),
     (["--shapes", "64x128", "--ms", "1,17"], "--ms: '1,17': batch sizes must be 1-16"),
     (["--shapes", "64x128", "--ms", "a"], "--ms: 'a' is not a comma-separated list"), ([], "give a checkpoint directory or --shapes")],
)  # fmt: skip
def test_cli_bad_options_are_one_line(args, msg):
    r = _mxq("tune", *args, "--dry-run")
    assert r.returncode != 0 and msg in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1, r.stderr


def test_cli_checkpoint_without_fp8_weights(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"w.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    r = _mxq("tune", str(tmp_path), "--dry-run")
    assert r.returncode == 1 and f"{tmp_path}: no fp8 weights to tune for" in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cli_without_gpu_says_so(tmp_path):
    r = _mxq("tune", "--shapes", "64x128", "--cache", str(tmp_path / "c.json"))
    assert r.returncode == 1 and "mxq: error: tune times kernels on a CUDA GPU and none is visible" in r.stderr
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("gluon,cap", [(True, (8, 0)), (False, (9, 0))])
def test_tune_decode_ws_refuses_what_cannot_run_it(monkeypatch, gluon, cap):
    """Past the GPU check (faked on a CPU machine), the tuner asks the kernel module whether its Gluon
    kernel is usable and the device whether it is Hopper, and says in one line which GPU it got; no
    weight is made before that."""
    import torch

    from mxq.cli.tune import tune_decode_ws
    from mxq.kernels import gemm_decode_ws as WS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(WS.gluon_api, "usable", lambda name: gluon)
    with pytest.raises(RuntimeError, match=r"runs on Hopper \(sm_90\) with Triton Gluon; Fake GPU is sm_" + "".join(map(str, cap))):
        tune_decode_ws([(4096, 4096)], (1,))


def test_shipped_entries_are_candidates(monkeypatch):
    """kernels/tuned.json (the H100 and H200 tunings written by `mxq tune`): every entry is a config the
    tuner could have chosen for its shape and bucket on a 132-SM Hopper, timed at an M of that bucket."""
    torch = pytest.importorskip("torch")
    from mxq.kernels import gemm_decode_ws as WS

    monkeypatch.setattr(WS, "sm_count", lambda device: 132)  # H100 SXM and H200 both have 132
    devices = tune.SHIPPED.devices
    assert set(devices) >= {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    for dev, kernels in devices.items():
        # the Llama-3 8B and 70B shapes at every bucket on both; the H100 also has 70B's TP=2 rank shapes
        from mxq.cli.tune import PRESETS

        shapes = PRESETS["llama3-8b"] + PRESETS["llama3-70b"]
        assert {tune.shape_key(m, n, k) for n, k in shapes for m in (1, 8, 16)} <= set(kernels["decode_ws"])
        for key, rec in kernels["decode_ws"].items():
            b, n, k = (int(v[1:]) for v in key.split("_"))
            assert tune.shape_key(rec["m"], n, k) == key and tune.m_bucket(rec["m"]) == b
            cfg = tune.SHIPPED.config("decode_ws", dev, key, WS.DecodeWSConfig)
            cands = WS.decode_ws_candidates(rec["m"], n, k, torch.device("cpu"))
            assert cfg in cands, (dev, key)
            # the rule's config unless another was MIN_GAIN faster
            assert cfg == cands[0] or rec["us"] <= rec["default_us"] * (1 - tune.MIN_GAIN), (dev, key)


def test_lookup_prefers_the_users_cache_then_the_shipped_one(monkeypatch, tmp_path):
    from mxq.kernels import gemm_decode_ws as WS

    monkeypatch.setattr(WS, "sm_count", lambda device: 132)
    monkeypatch.setattr(tune, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setenv("MXQ_CACHE", str(tmp_path))
    monkeypatch.setattr(tune, "PATH", tmp_path / "t.json")
    tune.reset()
    gpu = type("Dev", (), {"type": "cuda", "index": 0})()
    try:
        shipped = tune.SHIPPED.config("decode_ws", "NVIDIA H200", "m1_n10240_k8192", WS.DecodeWSConfig)
        assert shipped is not None and WS.pick_decode_ws_config(1, 10240, 8192, gpu) == shipped
        mine = WS.DecodeWSConfig(split_k=8)
        tune.cache().put("decode_ws", "NVIDIA H200", {"m1_n10240_k8192": tune.record(mine, 1.0, 1.0, 1, 1)})
        assert WS.pick_decode_ws_config(1, 10240, 8192, gpu) == mine
        monkeypatch.setenv("MXQ_CACHE", "off")
        monkeypatch.setattr(tune, "PATH", None)
        assert WS.pick_decode_ws_config(1, 10240, 8192, gpu) == WS.rule_decode_ws_config(1, 10240, 8192, gpu)
    finally:
        tune.reset()


def test_cli_show_lists_cache_and_shipped_entries(tmp_path):
    _put(tmp_path / "c.json", device="GPU Z", key="m8_n96_k256", cfg=Cfg(64, 2, False))
    r = _mxq("tune", "--show", "--cache", str(tmp_path / "c.json"), env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "GPU Z" in r.stdout and "m8_n96_k256" in r.stdout and "block_n=64 fuse_x=False split_k=2" in r.stdout
    assert "NVIDIA H200" in r.stdout and "m16_n57344_k8192" in r.stdout


def test_malformed_levels_read_as_missing_and_are_replaced_on_write(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"version": 1, "devices": {"GPU A": {"k": [1, 2]}, "GPU B": "x"}}))
    c = tune.TuneCache(p)
    assert c.config("k", "GPU A", "m1_n64_k128", Cfg) is None and c.config("k", "GPU B", "m1_n64_k128", Cfg) is None
    _put(p)
    _put(p, device="GPU B")
    c = tune.TuneCache(p)
    assert c.config("k", "GPU A", "m1_n64_k128", Cfg) == Cfg(64, 4, True) == c.config("k", "GPU B", "m1_n64_k128", Cfg)


@pytest.mark.gpu
def test_gpu_tune_decode_ws_writes_and_dispatch_reads(monkeypatch, tmp_path):
    """``tune_decode_ws`` times the candidates, writes one entry per (shape, M bucket) with the
    fastest config (or the rule's when nothing beats it by MIN_GAIN), and ``mx_linear`` then runs
    that config: same output as the config run directly."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kernel_helpers import HOPPER, activations, mx_weight

    if not HOPPER:
        pytest.skip("needs a Hopper GPU and Gluon")
    from mxq.cli.tune import tune_decode_ws
    from mxq.formats import E4M3
    from mxq.kernels import dispatch
    from mxq.kernels import gemm_decode_ws as WS

    monkeypatch.setenv("MXQ_CACHE", str(tmp_path))
    tune.reset()
    try:
        rows = tune_decode_ws([(1536, 1024)], (1, 16), log=lambda s: None)
        assert [(r["n"], r["k"], r["m"]) for r in rows] == [(1536, 1024, 1), (1536, 1024, 16)]
        data = json.loads((tmp_path / "tune.json").read_text())
        entries = data["devices"][torch.cuda.get_device_name()]["decode_ws"]
        assert set(entries) == {"m1_n1536_k1024", "m16_n1536_k1024"}
        for r in rows:
            assert r["best"] == tune.pick(r["us"], r["default"])
            rec = entries[tune.shape_key(r["m"], 1536, 1024)]
            assert WS.describe(WS.DecodeWSConfig(**rec["config"])) == r["best"] and rec["us"] == round(r["us"][r["best"]], 3)
        tune.reset()
        gen = torch.Generator().manual_seed(5)
        w, ws, _ = mx_weight(1536, 1024, E4M3, gen)
        x = activations(16, 1024, torch.bfloat16, gen, special=False, decades=(-2, 1))
        cfg = WS.pick_decode_ws_config(16, 1536, 1024, x.device)
        assert cfg == WS.DecodeWSConfig(**entries["m16_n1536_k1024"]["config"])
        assert dispatch.linear_path(16, 1536, 1024, x.device) is dispatch.LINEAR["decode_ws"]
        y = dispatch.mx_linear(x, w, ws, act_elem=E4M3)
        assert torch.equal(y, WS.mx_decode_gemm_ws(x, w, ws, act_elem=E4M3, config=cfg))
    finally:
        tune.reset()
