"""SmolLM2 on the CPU as users run it: bf16 against its MXFP8 checkpoint, ``generate()`` at B=1.

    python -m mxq.eval.bench_cpu --out cpu.json [--threads 2] [--pairs 3] [--new-tokens 16] [--prefill 512]

Each model loads in a fresh process (a worker, ``--worker ROLE``), through ``from_pretrained`` as a
user loads it: ``bf16`` is the embedded default model (SmolLM2-135M-Instruct, GGUF dequantized to
bf16, ``mxq.hf.models.load_model``); ``mxfp8`` is its ``mxq quantize`` checkpoint (the default recipe,
W8A8 E4M3; written to ``--checkpoint`` first when that folder has no config) on the default kernels
(the ``cpu`` path where it builds); ``mxfp8-reference`` is the same checkpoint with
``kernels="reference"`` (the torch reference: what the CPU ran before the ``cpu`` path);
``mxfp8-all`` (not run unless named in ``--roles``) is the ``mxfp8-all`` recipe's checkpoint: the
tied embedding and lm_head in MXFP8 too, one shared copy (written beside ``--checkpoint``). Each worker
measures, with ``torch.set_num_threads(--threads)``:

* weights: bytes of the parameters and buffers (a tied matrix counted once), and of the matrices
  the recipe quantized (their fp8 codes and scales; in bf16 the same matrices in bf16);
* ``generate(ids, max_new_tokens=N)`` (greedy, ``--prompt-len`` prompt, dynamic cache): new
  tokens per second of wall time and of process CPU time, median of ``--repeats`` calls after a
  warm-up call (the first call's time is reported: with an empty build cache it includes building
  the CPU kernels, ``--fresh-cache`` forces that);
* prefill: ``model(ids)`` over ``--prefill`` tokens (logits at every position, no cache), tokens/s;
* resident memory (VmRSS) after loading and at the end, and the peak (VmHWM).

``--pairs`` alternates the roles' processes that many times (bf16, mxfp8, ..., bf16, mxfp8, ...) and
reports the median of each figure over the pairs with its min-max: other work on a shared machine
shows up as spread (the load average before and after is recorded too). Prints a table with the
ratios to bf16 and writes JSON.

``--gemv`` instead times one projection call at SmolLM2's decode shapes (M=1, one thread, in this
process): ``F.linear`` on the bf16 weight, the reference, the ``cpu`` path through ``mx_linear`` and
each of its GEMV kernels called directly (fp32 FMA on fp16-decoded codes, 16-bit-table bf16 dot
products, byte-table bf16 dot products), microseconds, median of rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLES = ("bf16", "mxfp8", "mxfp8-reference", "mxfp8-all")
DEFAULT_CHECKPOINT = Path(tempfile.gettempdir()) / "mxq-bench-cpu-smollm2-mxfp8"
RECIPES = {"mxfp8": "mxfp8", "mxfp8-reference": "mxfp8", "mxfp8-all": "mxfp8-all"}


def checkpoint_for(role: str, base: Path) -> Path:
    """The checkpoint a role loads: ``--checkpoint`` for the default recipe, a sibling for mxfp8-all."""
    return base if RECIPES[role] == "mxfp8" else base.with_name(f"{base.name}-{RECIPES[role]}")


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _weight_bytes(model) -> tuple[int, int]:
    """(bytes of all parameters and buffers, each storage once; bytes of the projections the default
    recipe quantizes (every Linear but the output head): fp8 codes and scales, or bf16)."""
    import torch

    from mxq.runtime.linear import MXLinear

    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    head = model.get_output_embeddings()
    quantized = 0
    for m in model.modules():
        if isinstance(m, MXLinear) and m is not head:
            quantized += m.weight.nbytes + m.weight_scale.nbytes
        elif type(m) is torch.nn.Linear and m is not head:
            quantized += m.weight.nbytes
    return total, quantized


def worker(role: str, a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    if a.fresh_cache:
        os.environ["MXQ_CACHE"] = tempfile.mkdtemp(prefix="mxq-cache-")  # a cold build of the CPU kernels
    import mxq  # noqa: F401  (registers the mxq quantizer with transformers)

    t0 = time.perf_counter()
    if role == "bf16":
        from mxq.hf.models import load_model

        model, _ = load_model("default", tokenizer=False)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint_for(role, a.checkpoint), dtype=torch.bfloat16).eval()
        if role == "mxfp8-reference":
            from mxq.runtime.linear import set_kernels

            set_kernels(model, "reference")
    load_s = time.perf_counter() - t0
    rss_loaded = _status_kb("VmRSS")
    total, quantized = _weight_bytes(model)
    from mxq.kernels.dispatch import linear_path

    path = linear_path(1, 576, 576, torch.device("cpu"), kernels="reference" if role == "mxfp8-reference" else None).name
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 10000, (1, a.prompt_len), generator=g)
    pre = torch.randint(100, 10000, (1, a.prefill), generator=g)
    kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False)
    res = dict(role=role, load_s=load_s, weight_bytes=total, quantized_bytes=quantized, linear_path=path)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        res["first_generate_s"] = time.perf_counter() - t0
        wall, cpu = [], []
        for _ in range(a.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            out = model.generate(ids, **kw)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        n = out.shape[1] - ids.shape[1]
        res["generate_tok_s"] = n / statistics.median(wall)
        res["generate_cpu_tok_s"] = n / statistics.median(cpu)
        res["tokens"] = out[0, ids.shape[1]:].tolist()
        model(pre[:, :32])  # warm-up of the prefill shapes' first call
        times = []
        for _ in range(a.prefill_repeats):
            t0 = time.perf_counter()
            model(pre)
            times.append(time.perf_counter() - t0)
        res["prefill_tok_s"] = a.prefill / statistics.median(times)
    res["rss_loaded_mb"], res["rss_end_mb"], res["rss_peak_mb"] = (
        rss_loaded / 1024, _status_kb("VmRSS") / 1024, _status_kb("VmHWM") / 1024)  # fmt: skip
    return res


def _prepare(checkpoint: Path, recipe: str) -> None:
    if (checkpoint / "config.json").exists():
        return
    exe = Path(sys.executable).with_name("mxq")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mxq_launch"]
    cmd = [*cmd, "quantize", "default", str(checkpoint), "--recipe", recipe, "--force"]
    print(f"writing the MXFP8 checkpoint: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)


def _run_worker(role: str, a) -> dict:
    cmd = [sys.executable, "-m", "mxq.eval.bench_cpu", "--worker", role, "--threads", str(a.threads),
           "--new-tokens", str(a.new_tokens), "--prompt-len", str(a.prompt_len), "--prefill", str(a.prefill),
           "--repeats", str(a.repeats), "--prefill-repeats", str(a.prefill_repeats), "--checkpoint", str(a.checkpoint)]  # fmt: skip
    if a.fresh_cache:
        cmd.append("--fresh-cache")
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"worker {role} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def _summary(runs: list[dict]) -> dict:
    out = {}
    for key in ("generate_tok_s", "generate_cpu_tok_s", "prefill_tok_s", "first_generate_s", "load_s",
                "weight_bytes", "quantized_bytes", "rss_loaded_mb", "rss_peak_mb"):  # fmt: skip
        vals = [r[key] for r in runs]
        out[key] = dict(median=statistics.median(vals), min=min(vals), max=max(vals))
    out["linear_path"] = runs[0]["linear_path"]
    return out


def print_table(res: dict) -> None:
    s = res["summary"]
    base = s["bf16"]
    print(f"\nSmolLM2-135M on {res['env']['cpu']}, {res['env']['threads']} threads, generate B=1, "
          f"{res['args']['new_tokens']} new tokens; median over {res['args']['pairs']} fresh processes (min-max)")  # fmt: skip
    print("| model | linear path | generate tok/s | vs bf16 | CPU-time tok/s | vs bf16 | prefill tok/s "
          f"({res['args']['prefill']}) | vs bf16 | weights MB | vs bf16 | quantized matrices vs bf16 | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    def fig(v, key):
        m = v[key]
        return f"{m['median']:.1f} ({m['min']:.1f}-{m['max']:.1f})", f"{m['median'] / base[key]['median']:.2f}x"

    for role, v in s.items():
        g, gr = fig(v, "generate_tok_s")
        c, cr = fig(v, "generate_cpu_tok_s")
        p, pr = fig(v, "prefill_tok_s")
        wb = v["weight_bytes"]["median"]
        path = "(nn.Linear, bf16)" if role == "bf16" else v["linear_path"]
        print(f"| {role} | {path} | {g} | {gr} | {c} | {cr} | {p} | {pr} | {wb / 1e6:.1f} | "
              f"{wb / base['weight_bytes']['median']:.3f} | "
              f"{v['quantized_bytes']['median'] / base['quantized_bytes']['median']:.3f} | {v['rss_peak_mb']['median']:.0f} |")  # fmt: skip
    for role, v in s.items():
        print(f"{role}: first generate() {v['first_generate_s']['median']:.2f} s "
              f"({v['first_generate_s']['min']:.2f}-{v['first_generate_s']['max']:.2f}), load {v['load_s']['median']:.1f} s")  # fmt: skip
    print(f"load average before {res['env']['loadavg_before']}, after {res['env']['loadavg_after']}")


GEMV_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def bench_gemv(rounds: int = 7) -> list[dict]:
    """Microseconds per call at SmolLM2's shapes, M=1, one thread (``--gemv``)."""
    import torch
    import torch.nn.functional as F

    from mxq.formats import E4M3, ScaleRule, quantize_mx
    from mxq.kernels import cpu, mx_linear

    torch.set_num_threads(1)
    lib = cpu.library()

    def us(fn, calls):
        for _ in range(3):
            fn()
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(out)

    def row(name, n, k):
        g = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        t = quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL)
        x = torch.randn(1, k, generator=g).to(torch.bfloat16)
        xf, y = x.float(), torch.empty(1, n)
        calls = max(3, int(2e7 // (n * k)))
        ptrs = (t.data.data_ptr(), t.scales.data_ptr(), n)
        return dict(shape=name, n=n, k=k,
                    bf16_linear=us(lambda: F.linear(x, w), calls),
                    reference=us(lambda: mx_linear(x, t.data, t.scales, act_elem=E4M3, kernels="reference"), max(3, calls // 20)),
                    cpu_w8a8=us(lambda: mx_linear(x, t.data, t.scales, act_elem=E4M3), calls),
                    fp32_fma=us(lambda: lib.mxq_gemv(xf.data_ptr(), 1, k, *ptrs, 32, 0, None, y.data_ptr(), 1), calls),
                    bf16dot_table16=us(lambda: lib.mxq_gemv_bf16(x.data_ptr(), 1, k, *ptrs, 0, None, y.data_ptr(), 1), calls),
                    bf16dot_vbmi=us(lambda: lib.mxq_gemv_vbmi(x.data_ptr(), 1, k, *ptrs, 0, None, y.data_ptr(), 1), calls))  # fmt: skip

    rows = []
    for name, (n, k) in GEMV_SHAPES.items():
        rows.append(row(name, n, k))
        print(" ".join(f"{key}={v:.1f}" if isinstance(v, float) else f"{key}={v}" for key, v in rows[-1].items()), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_cpu.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3, help="fresh processes per role, alternated")
    ap.add_argument("--roles", default=",".join(ROLES))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate() calls per process")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--fresh-cache", action="store_true", help="build the CPU kernels anew in each process")
    ap.add_argument("--gemv", action="store_true", help="time the GEMV kernels at SmolLM2's shapes instead")
    ap.add_argument("--worker", choices=ROLES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.gemv:
        import torch

        env = dict(cpu=_cpu_name(), threads=1, torch=torch.__version__, python=platform.python_version(),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                   loadavg_before=os.getloadavg())  # fmt: skip
        rows = bench_gemv()
        env["loadavg_after"] = os.getloadavg()
        with open(a.out, "w") as f:
            json.dump(dict(env=env, gemv=rows), f, indent=1)
        return 0
    if a.worker:
        print(json.dumps(worker(a.worker, a)), flush=True)
        return 0
    roles = a.roles.split(",")
    for role in roles:
        if role != "bf16":
            _prepare(checkpoint_for(role, a.checkpoint), RECIPES[role])
    import torch
    import transformers

    env = dict(cpu=_cpu_name(), cores=os.cpu_count(), threads=a.threads, torch=torch.__version__,
               transformers=transformers.__version__, python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               loadavg_before=os.getloadavg(), command=" ".join(["python -m mxq.eval.bench_cpu", *(argv or sys.argv[1:])]))  # fmt: skip
    runs = {r: [] for r in roles}
    for i in range(a.pairs):
        for role in roles:
            res = _run_worker(role, a)
            runs[role].append(res)
            print(f"pair {i + 1}/{a.pairs} {role}: generate {res['generate_tok_s']:.1f} tok/s "
                  f"(CPU time {res['generate_cpu_tok_s']:.1f}), prefill {res['prefill_tok_s']:.0f} tok/s, "
                  f"first generate {res['first_generate_s']:.2f} s, load avg {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    env["loadavg_after"] = os.getloadavg()
    if "bf16" in runs and "mxfp8" in runs:
        env["same_tokens_mxfp8_vs_reference"] = (
            [r["tokens"] for r in runs["mxfp8"]] == [r["tokens"] for r in runs.get("mxfp8-reference", runs["mxfp8"])])
    res = dict(env=env, args=vars(a) | {"checkpoint": str(a.checkpoint)}, runs=runs,
               summary={r: _summary(v) for r, v in runs.items()})  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    if "bf16" in runs:
        print_table(res)
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    raise SystemExit(main())
