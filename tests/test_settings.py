"""``mxq.settings``: the four documented variables, each against what it must change."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from mxq import settings


def test_cache_folder_follows_mxq_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("MXQ_CACHE", str(tmp_path / "c"))
    assert settings.cache_dir() == tmp_path / "c" and settings.cache_dir("ppl") == tmp_path / "c" / "ppl"
    monkeypatch.setenv("MXQ_CACHE", "~/x")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert settings.cache_dir("cpu") == tmp_path / "home" / "x" / "cpu"
    monkeypatch.delenv("MXQ_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir("tune.json") == tmp_path / "xdg" / "mxq" / "tune.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/not/used")  # XDG asks for an absolute path
    assert settings.cache_dir() == tmp_path / "home" / ".cache" / "mxq"
    for off in ("off", "OFF", "none", "0", "false", "no"):
        monkeypatch.setenv("MXQ_CACHE", off)
        assert settings.cache_dir("ppl") is None
        assert settings.cache_dir("ppl", ignore_off=True) == tmp_path / "home" / ".cache" / "mxq" / "ppl"
        assert settings.cpu_build_dir().is_dir() and "mxq-cpu-" in settings.cpu_build_dir().name


def test_each_cache_kind_moves_with_mxq_cache(monkeypatch, tmp_path):
    """The tuning cache, the compiled CPU kernels and the perplexity results all live under MXQ_CACHE."""
    from mxq.eval import cache as ppl_cache
    from mxq.kernels import cpu, tune

    monkeypatch.setenv("MXQ_CACHE", str(tmp_path))
    monkeypatch.setattr(tune, "PATH", None)
    assert tune.cache_path() == tmp_path / "tune.json"
    assert cpu.cache_dir() == tmp_path / "cpu"
    assert ppl_cache.cache_dir() == tmp_path / "ppl"


def test_kernels_and_cpu_kernels(monkeypatch):
    from mxq.kernels.registry import default_kernels

    monkeypatch.delenv("MXQ_KERNELS", raising=False)
    assert settings.kernels() is None and default_kernels() == "auto"
    monkeypatch.setenv("MXQ_KERNELS", "  reference ")
    assert default_kernels() == "reference"
    monkeypatch.setenv("MXQ_KERNELS", "no_such_kernel")
    with pytest.raises(ValueError, match="MXQ_KERNELS"):
        default_kernels()
    monkeypatch.setenv("MXQ_CPU_KERNELS", "0")
    assert not settings.cpu_kernels()
    monkeypatch.setenv("MXQ_CPU_KERNELS", "1")
    assert settings.cpu_kernels()


def test_debug_flags(monkeypatch):
    monkeypatch.setenv("MXQ_DEBUG", "launch-check, NO-LANES")
    assert settings.debug("launch-check") and settings.debug("no-lanes")
    monkeypatch.setenv("MXQ_DEBUG", "no-lanes,lanes-off")
    with pytest.warns(UserWarning, match="MXQ_DEBUG: unknown lanes-off"):
        assert settings.debug("no-lanes") and not settings.debug("launch-check")
    with pytest.raises(ValueError, match="unknown flag"):
        settings.debug("nope")
    monkeypatch.delenv("MXQ_DEBUG")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not settings.debug("launch-check")


def test_debug_switches_reach_the_modules_that_read_them_at_import():
    code = "from mxq.runtime import linear; from mxq.kernels import launch; print(linear.LANES, launch.CHECK)"
    for value, want in (("", "True False"), ("no-lanes,launch-check", "False True")):
        env = {"MXQ_DEBUG": value, "PATH": "/usr/bin:/bin"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0 and r.stdout.split()[-2:] == want.split(), r.stderr[-2000:]


def test_importing_settings_loads_no_torch():
    r = subprocess.run([sys.executable, "-c", "import sys, mxq.settings; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]
