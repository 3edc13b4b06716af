"""``mxq tune``: time candidate tiles of the decode GEMM for a model's weight shapes on this GPU and
cache the fastest per shape and batch-size bucket (``kernels/tune.py``); the dispatch reads the
cache from then on, in every process on this machine (``MXQ_CACHE=off`` ignores it)."""

from __future__ import annotations

from pathlib import Path

import typer

# Llama-3 linear shapes (N, K) as serving stacks run them (qkv and gate/up fused), as in the GEMM benchmark.
PRESETS = {
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "llama3-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
    # one rank of two under mxq.runtime.tp: qkv and gate/up split by N, o and down by K
    "llama3-70b-tp2": [(5120, 8192), (8192, 4096), (28672, 8192), (8192, 14336)],
}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'6144x4096,4096x4096' -> [(6144, 4096), (4096, 4096)]; a preset name gives its shapes."""
    out: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in PRESETS:
            out += PRESETS[part]
            continue
        nk = part.lower().split("x")
        if len(nk) != 2 or not all(v.isdigit() and int(v) > 0 for v in nk):
            raise typer.BadParameter(
                f"--shapes: {part!r} is not NxK (weight rows x columns, e.g. 4096x14336) nor one of {', '.join(PRESETS)}"
            )
        out.append((int(nk[0]), int(nk[1])))
    return out


def checkpoint_shapes(path: Path) -> list[tuple[int, int]]:
    """The distinct (N, K) of a quantized checkpoint's fp8 2-D weights, in file order."""
    from mxq.checkpoint.files import read_index

    shapes = {tuple(i.shape): None for i in read_index(path).values() if i.dtype in FP8_DTYPES and len(i.shape) == 2}
    if not shapes:
        raise ValueError(f"{path}: no fp8 weights to tune for; quantize the model first (mxq quantize)")
    return list(shapes)  # type: ignore[arg-type]


def tune_cmd(
    checkpoint: Path | None = typer.Argument(
        None, help="A quantized checkpoint directory: tune for its weight shapes."
    ),
    shapes: str = typer.Option(
        "", "--shapes", help="Weight shapes NxK, comma-separated, or a preset: " + ", ".join(PRESETS) + "."
    ),
    ms: str = typer.Option(
        "1,8,16", "--ms", help="Batch sizes (1-16) to tune at; one entry per bucket 1, 2-8, 9-16."
    ),
    cache: Path | None = typer.Option(
        None, "--cache", help="Cache file (default: tune.json in $MXQ_CACHE, else ~/.cache/mxq)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the shapes and batch sizes that would be tuned; no GPU needed."
    ),
    show: bool = typer.Option(False, "--show", help="List the cached and shipped entries and exit; no GPU needed."),
) -> None:
    """Tune the decode GEMM's tiles for a model's shapes on this GPU and cache the fastest."""
    from mxq.kernels import tune

    if cache is not None:
        tune.PATH = cache
    if show:
        _show()
        return
    todo = checkpoint_shapes(checkpoint) if checkpoint is not None else []
    todo += [s for s in parse_shapes(shapes) if s not in todo]
    if not todo:
        raise typer.BadParameter("give a checkpoint directory or --shapes")
    try:
        m_list = [int(v) for v in ms.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"--ms: {ms!r} is not a comma-separated list of integers") from None
    if not m_list or any(not 1 <= m <= 16 for m in m_list):
        raise typer.BadParameter(f"--ms: {ms!r}: batch sizes must be 1-16 (the decode GEMM's range)")
    tune.reset()
    typer.echo(f"shapes (N x K): {', '.join(f'{n}x{k}' for n, k in todo)}; M: {', '.join(map(str, m_list))}", err=True)
    typer.echo(f"cache: {tune.cache_path()}", err=True)
    if dry_run:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError("tune times kernels on a CUDA GPU and none is visible; --dry-run lists what it would tune")
    from mxq.progress import progress_bar

    with progress_bar("tune") as bar:
        task = bar.add_task("tune", total=len(todo) * len({tune.m_bucket(m) for m in m_list}))
        rows = tune_decode_ws(
            todo, m_list, log=lambda s: bar.console.print(s), progress=lambda done, total: bar.update(task, completed=done, total=total)
        )  # fmt: skip
    changed = sum(r["best"] != r["default"] for r in rows)
    typer.echo(f"tuned {len(rows)} (shape, M) entries, {changed} differ from the built-in rule; written to {tune.cache_path()}")


def _config_text(kernel: str, cfg: dict) -> str:
    if kernel == "decode_ws":
        from mxq.kernels import gemm_decode_ws as WS

        try:
            return WS.describe(WS.DecodeWSConfig(**cfg))
        except TypeError:
            pass
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def _show() -> None:
    """Every entry of the user's cache and of the shipped file: device, kernel, shape, the chosen
    config and its time against the rule's."""
    from rich.console import Console
    from rich.table import Table

    from mxq.kernels import tune

    tune.reset()
    for title, c in (("cache " + str(tune.cache_path()), tune.cache()), ("shipped " + str(tune.SHIPPED.path), tune.SHIPPED)):
        t = Table(title=title)
        for col in ("device", "kernel", "entry", "config", "µs", "rule µs"):
            t.add_column(col)
        for dev, kernels in sorted(c.devices.items()):
            for kern, entries in sorted((kernels if isinstance(kernels, dict) else {}).items()):
                for key, rec in sorted(entries.items()) if isinstance(entries, dict) else ():
                    cfg = rec.get("config", {}) if isinstance(rec, dict) else {}
                    t.add_row(dev, kern, key, _config_text(kern, cfg), str(rec.get("us", "")),
                              str(rec.get("default_us", "")))  # fmt: skip
        Console().print(t if t.row_count else f"{title}: no entries")


def tune_decode_ws(shapes, ms=(1, 8, 16), device=None, *, log=print, progress=None) -> list[dict]:
    """Tune ``gemm_decode_ws`` (W8A8 decode, E4M3 X, RCEIL) for each weight shape (N, K) at each
    M bucket of ``ms`` and write the winners to the cache. Weights are random fp8 (the kernel's
    speed does not depend on their values). Every candidate's output is checked against the
    rule's before it is timed; one that differs is reported and dropped. Returns one row per
    (shape, M): the timings and the choice. ``progress(done, total)`` is called after each row."""
    import torch

    from mxq.kernels import gemm_decode_ws as WS
    from mxq.kernels.tune import (
        cache,
        device_name,
        m_bucket,
        pick,
        record,
        shape_key,
        time_interleaved,
        weight_copies,
    )

    device = torch.device(device or "cuda")
    if not (device.type == "cuda" and torch.cuda.is_available()):
        raise RuntimeError("mxq tune needs a CUDA GPU")
    if not WS.gluon_api.usable("gemm_decode_ws") or torch.cuda.get_device_capability(device)[0] != 9:
        raise RuntimeError(
            f"mxq tune: the tuned kernel (gemm_decode_ws) runs on Hopper (sm_90) with Triton Gluon; "
            f"{torch.cuda.get_device_name(device)} is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        )
    buckets: dict[int, int] = {}
    for m in ms:
        if not 1 <= m <= WS.WS_MAX_M:
            raise ValueError(f"--ms: {m} is outside 1..{WS.WS_MAX_M} (the decode GEMM's batch sizes)")
        buckets.setdefault(m_bucket(m), m)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    name = device_name(device)
    rows, total = [], len(shapes) * len(buckets)
    for n, k in shapes:
        if not WS.takes(1, k, 32):
            log(f"skip {n}x{k}: K % 128 != 0 (the decode GEMM does not take it; the dispatch runs another kernel)")
            total -= len(buckets)
            continue
        packs = [
            ((torch.randn(n, k, device=device) * 64).to(torch.float8_e4m3fn),
             torch.randint(118, 130, (n, k // 32), dtype=torch.uint8, device=device))
            for _ in range(weight_copies(n * k, l2))
        ]  # fmt: skip
        records = {}
        for m in buckets.values():
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            cands = WS.decode_ws_candidates(m, n, k, device)
            ys, ok = {}, {}
            for c in cands:
                try:
                    ys[c] = WS.mx_decode_gemm_ws(x, *packs[0], config=c, out_dtype=torch.float32)
                except Exception as e:  # noqa: BLE001 - a candidate that does not build is dropped
                    log(f"  {n}x{k} M={m}: {WS.describe(c)} dropped: {type(e).__name__}: {str(e).splitlines()[0]}")
            y0 = ys.get(cands[0])
            if y0 is None:
                raise RuntimeError(f"{n}x{k} M={m}: the rule's own config failed")
            tol = 1e-5 * float(y0.abs().max()) + 1e-30
            for c, y in ys.items():
                err = float((y - y0).abs().max())
                if err <= tol:
                    ok[WS.describe(c)] = c
                else:
                    log(f"  {n}x{k} M={m}: {WS.describe(c)} dropped: differs from the rule's config by {err:.3g} (> {tol:.3g})")
            times = time_interleaved(
                {d: [lambda p=p, c=c, x=x: WS.mx_decode_gemm_ws(x, p[0], p[1], config=c) for p in packs] for d, c in ok.items()}
            )
            default = WS.describe(cands[0])
            best = pick(times, default)
            records[shape_key(m, n, k)] = record(ok[best], times[best], times[default], m, len(ok))
            rows.append(dict(n=n, k=k, m=m, us=times, default=default, best=best))
            log(f"{n}x{k} M={m}: {best} {times[best]:.2f} µs (rule {times[default]:.2f} µs, x{times[default] / times[best]:.3f})")
            if progress is not None:
                progress(len(rows), total)
        cache().put("decode_ws", name, records)  # after every shape: an interrupted run keeps what it measured
        del packs
    WS.PLANS.clear()  # plans built before hold the old choice
    return rows
