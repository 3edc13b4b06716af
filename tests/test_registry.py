"""kernels/registry.py: kernel paths as data. A registry is an ordered list ending in the reference;
``choose`` returns the first admitted path that supports a problem; ``kernels`` specs ("auto",
"reference", names) are checked once for every registry, with errors that name the bad name and
where it came from."""

from __future__ import annotations

import pytest

from mxq.kernels import dispatch, registry
from mxq.kernels.registry import KernelPath, Registry, check_kernels


def _path(name, supports=lambda p: True, config=None):
    return KernelPath(name, f"the {name} path", supports, lambda *a: name, config)


@pytest.fixture
def toy():
    """A registry of three toy paths, removed (with what check_kernels learnt of it) afterwards."""
    check_kernels.cache_clear()
    reg = Registry("toy", [
        _path("toy_small", lambda p: p <= 4, config=lambda p: f"tile{p}"), _path("toy_even", lambda p: p % 2 == 0),
        _path("reference"),
    ])  # fmt: skip
    yield reg
    registry.REGISTRIES.pop("toy", None)
    check_kernels.cache_clear()


def test_registry_shape_is_checked():
    with pytest.raises(ValueError, match="unique and end with 'reference'"):
        Registry("bad", [_path("a"), _path("b")])
    with pytest.raises(ValueError, match="unique and end with 'reference'"):
        Registry("bad", [_path("a"), _path("a"), _path("reference")])
    with pytest.raises(ValueError, match="unique and end with 'reference'"):
        Registry("bad", [])
    assert "bad" not in registry.REGISTRIES


def test_choose_walks_the_admitted_paths_in_order(toy):
    assert toy.names() == ["toy_small", "toy_even", "reference"] and list(toy) == list(toy.paths)
    assert toy.choose(3) is toy["toy_small"] and toy.choose(6) is toy["toy_even"] and toy.choose(7) is toy["reference"]
    assert toy.choose(2, "toy_even") is toy["toy_even"]  # only the named ones, the reference last
    assert toy.choose(3, "toy_even") is toy["reference"]
    assert toy.choose(2, " TOY_EVEN , toy_small ") is toy["toy_small"]  # registry order, not the spec's
    assert toy.choose(2, "reference") is toy["reference"]
    assert toy.choose(2, skip=toy["toy_small"]) is toy["toy_even"]  # the next path after a failed one
    assert toy.choose(2, "toy_even", skip=toy["toy_small"]) is toy["toy_even"]
    assert toy.allowed("toy_even") is toy.allowed("toy_even")  # parsed once per spec


def test_check_kernels_normalises_and_names_what_is_wrong(toy):
    assert check_kernels(None) == check_kernels("") == check_kernels(" Auto ") == "auto"
    assert check_kernels("REFERENCE") == "reference"
    assert check_kernels("toy_small, toy_even,") == "toy_small,toy_even"
    with pytest.raises(ValueError, match=r"kernels='toy_small,fastest': unknown kernel path fastest; expected 'auto'"):
        check_kernels("toy_small,fastest")
    with pytest.raises(ValueError, match=r"MXQ_KERNELS=',': unknown kernel path ','"):
        check_kernels(",", source="MXQ_KERNELS")
    with pytest.raises(ValueError, match="toy_small"):  # the known names are listed
        check_kernels("nope")


def test_default_kernels_reads_the_environment(toy, monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    assert registry.default_kernels() == "auto" and toy.allowed(None) == toy.paths
    monkeypatch.setenv(registry.ENV, "toy_even")
    assert registry.default_kernels() == "toy_even" and toy.choose(2) is toy["toy_even"]
    monkeypatch.setenv(registry.ENV, "toy_even,warp_drive")
    with pytest.raises(ValueError, match=r"MXQ_KERNELS='toy_even,warp_drive': unknown kernel path warp_drive"):
        toy.choose(2)


def test_a_registry_none_of_whose_paths_is_named_stays_on_auto(toy):
    """One spelling serves every registry: a name belongs to one of them, and a registry none of
    whose paths the spec names keeps every path ("reference" applies to all)."""
    assert registry.REGISTRIES["linear"] is dispatch.LINEAR
    assert toy.choose(2, "gemm") is toy["toy_small"] and toy.allowed("gemm") == toy.paths
    assert toy.choose(2, "gemm,toy_even") is toy["toy_even"]
    assert toy.choose(2, "reference") is toy["reference"]
    assert dispatch.LINEAR.allowed("toy_even") == dispatch.LINEAR.paths
    assert dispatch.LINEAR.allowed("toy_even,gemm") == (dispatch.LINEAR["gemm"], dispatch.LINEAR["reference"])


def test_describe_names_the_path_and_its_config(toy):
    assert toy["toy_small"].describe(3) == "toy_small tile3"
    assert toy["toy_even"].describe(3) == "toy_even" and toy["reference"].describe(3) == "reference"
    assert "toy_small" in repr(toy["toy_small"]) and "supports" not in repr(toy["toy_small"])


def test_path_modules_are_every_module_that_declares_a_registry():
    """``registry.PATH_MODULES`` (imported when a spec names a path not known yet) lists exactly the
    kernel modules that construct a ``Registry``."""
    import pathlib
    import re

    root = pathlib.Path(registry.__file__).parent
    declaring = {f"mxq.kernels.{p.stem}" for p in root.glob("*.py")
                 if p.stem != "registry" and re.search(r"^\w+ = Registry\(", p.read_text(), re.M)}  # fmt: skip
    assert declaring == set(registry.PATH_MODULES)


def test_a_spec_may_name_a_path_whose_module_was_not_imported_yet():
    """A fresh process that imports only the registry accepts MXQ_KERNELS naming the MoE block, MX
    attention and bf16-KV decode paths (their modules are imported to learn the names)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from mxq.kernels import registry as r; "
            "assert 'mxq.kernels.moe_block' not in sys.modules; print(r.default_kernels())")  # fmt: skip
    env = dict(os.environ, MXQ_KERNELS="moe_block,attn_decode_gqa,sdpa_decode")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "moe_block,attn_decode_gqa,sdpa_decode"


def test_choose_under_torch_compile_compiles_once(toy):
    """A one-token step is first run under ``torch.compile`` (transformers' static-cache
    ``generate``). Dynamo guards on what a traced call reads. A per-spec memo filled while
    tracing makes its own guard fail on the next call: the whole model recompiled once."""
    import torch
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def step(x):
        return x * 2 if toy.choose(3, "toy_small,toy_even") is toy["toy_small"] else x * 3

    x = torch.arange(5.0)
    for _ in range(3):
        assert torch.equal(step(x), x * 2)
    assert counter.frame_count == 1
    assert toy.choose(6, "toy_small,toy_even") is toy["toy_even"]  # eager calls still see the same paths
    torch._dynamo.reset()
