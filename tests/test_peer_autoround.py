"""The AutoRound peer bench (``mxq.eval.peer_autoround``): without its optional packages it says which
ones it needs, in one line, before loading anything."""

import sys
import types

import pytest


@pytest.mark.parametrize("missing", ["auto_round", "compressed_tensors"])
def test_peer_autoround_names_what_it_needs(monkeypatch, missing):
    from mxq.eval import peer_autoround

    for name in ("auto_round", "compressed_tensors"):  # the other one present (a stand-in), this one missing
        monkeypatch.setitem(sys.modules, name, None if name == missing else types.ModuleType(name))
    monkeypatch.setattr("mxq.hf.models.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as e:
        peer_autoround.main(["--calib", "calib.txt", "--heldout", "heldout.txt"])
    msg = str(e.value)
    assert msg.startswith("peer_autoround: needs auto-round and compressed-tensors") and "\n" not in msg
    assert missing in msg


def test_peer_autoround_set_parses_values():
    from mxq.eval.peer_autoround import autoround_kwargs

    got = autoround_kwargs(["amp=False", "seed=0", "minmax_lr=2.5e-3", "dynamic_max_gap=-1", "act_data_type=mx_fp_rceil", "x=None"])
    assert got == {"amp": False, "seed": 0, "minmax_lr": 2.5e-3, "dynamic_max_gap": -1, "act_data_type": "mx_fp_rceil", "x": None}
    assert type(got["seed"]) is int and type(got["minmax_lr"]) is float


@pytest.mark.parametrize("bad", ["amp", "=1", "not a name=1", "iters=0", "lr=1e-3"])
def test_peer_autoround_set_refuses_malformed(bad):
    from mxq.eval.peer_autoround import autoround_kwargs

    with pytest.raises(SystemExit) as e:
        autoround_kwargs([bad])
    assert str(e.value).startswith(f"peer_autoround: --set {bad!r}") and "\n" not in str(e.value)
