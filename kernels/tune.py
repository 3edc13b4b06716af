"""Per-shape autotuning, cached on disk per device (``mxq tune``).

The kernels pick their tiles by rules measured on the Llama-3 shapes (``pick_*_config``).
A rule is right on most shapes and a few % off on others (kernels/NOTES.md, "GEMM: decode tiles per
shape and `mxq tune`": 64-row decode tiles at 3 programs per SM win on some rows, lose on others). The tuner
times a small set of candidate configs per (kernel, shape, M bucket) on the GPU at hand, keeps the
fastest -- the rule's own config unless another is at least ``MIN_GAIN`` faster, so noise does not
move it -- and writes it to a JSON cache that the dispatch reads when it builds a launch plan:

    {"version": 1, "devices": {"NVIDIA H100 80GB HBM3": {"decode_ws": {"m16_n6144_k4096": {
        "config": {...}, "us": 16.2, "default_us": 17.1, "m": 16, "date": "...", ...}}}}}

- where: ``tune.json`` in mxq's cache folder (``mxq.settings``: ``$MXQ_CACHE``, else
  ``$XDG_CACHE_HOME/mxq``, else ``~/.cache/mxq``), or the file ``mxq tune --cache`` names (``PATH``);
- shipped entries (``kernels/tuned.json``: the Llama-3 8B/70B shapes and 70B's TP=2 rank shapes, tuned
  on the GPUs named in it;
  each entry records its date and versions) answer where the user's cache has no entry for the
  device, shape and bucket;
- ``MXQ_CACHE=off``: neither is read (the rules alone), unless ``PATH`` names a file; the variable is
  read when a config is looked up (``enabled``);
- entries are keyed by the device's name, so one file serves several GPU models;
- a cache that cannot be read or parsed is reported once (a warning naming the file) and ignored;
  an entry whose config does not fit the kernel's config class is ignored the same way;
- writes go to a temporary file in the same folder, then ``os.replace``: a crash leaves the old
  cache whole; the file is re-read just before writing, so entries written meanwhile are kept.

Timing (``time_interleaved``): every candidate's CUDA graph runs its kernel over several copies of
the weight (more bytes than three L2s, so weights stream from HBM as they do in a model), cycled to
at least ``MIN_GRAPH_CALLS`` calls with a small ``separator`` kernel after each (as a model's norms
and adds sit between its GEMMs; a graph of separators alone is timed too and subtracted); all graphs
are built first, then replayed in rotated rounds; a candidate's figure is the median of its replays
(one-shot timings move by several % between calls). Replays are timed behind a spin kernel
(``time_replays``), so the graph launch latency is not counted: a replay timed right after a
synchronize adds that latency divided by the calls in the graph to every figure, baselines included
(kernels/NOTES.md, "Measurement: timing method").
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
import warnings
from pathlib import Path

from mxq import settings
from mxq.compat import versions

VERSION = 1
# A candidate replaces the rule's config only if it is at least this much faster (the interleaved
# timings repeat to ~1-2 %; a smaller "win" is as likely noise as not).
MIN_GAIN = 0.02
PATH: Path | None = None  # the cache file a caller names (``mxq tune --cache``); None: mxq's cache folder


def enabled() -> bool:
    """Whether tuned configs are read: a file named in ``PATH``, or ``MXQ_CACHE`` not off (read at each call)."""
    return PATH is not None or settings.cache_dir() is not None


def cache_path() -> Path:
    """Where the tuning cache lives (module doc); with ``MXQ_CACHE=off``, where it would (for writing)."""
    return PATH if PATH is not None else settings.cache_dir("tune.json", ignore_off=True)


def m_bucket(m: int) -> int:
    """Decode batch sizes share an entry by bucket: 1, 2..8 (8-row tiles), 9..16."""
    return 1 if m <= 1 else 8 if m <= 8 else 16


def shape_key(m: int, n: int, k: int) -> str:
    return f"m{m_bucket(m)}_n{n}_k{k}"


class TuneCache:
    """The JSON file of tuned configs (module doc); loaded on first use."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._data: dict | None = None
        self._warned: set[str] = set()

    def _warn(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"{self.path}: {what}; using the built-in tile rules", stacklevel=3)

    def _read(self, warn: bool) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            if warn:
                self._warn(f"unreadable tuning cache ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            return {}
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("devices"), dict):
            if warn:
                self._warn(f"not an mxq tuning cache of version {VERSION}")
            return {}
        return data["devices"]

    @property
    def devices(self) -> dict:
        if self._data is None:
            self._data = self._read(warn=True)
        return self._data

    def get(self, kernel: str, device: str, key: str) -> dict | None:
        """The record for (kernel, device name, shape key), or None."""
        node = self.devices
        for part in (device, kernel):
            node = node.get(part) if isinstance(node, dict) else None
        rec = node.get(key) if isinstance(node, dict) else None
        if rec is not None and not (isinstance(rec, dict) and isinstance(rec.get("config"), dict)):
            self._warn(f"entry {device} / {kernel} / {key} has no config")
            return None
        return rec

    def config(self, kernel: str, device: str, key: str, cls):
        """The cached config as an instance of the dataclass ``cls``, or None (no entry, or an entry
        whose fields do not fit ``cls``: warned once, ignored)."""
        rec = self.get(kernel, device, key)
        if rec is None:
            return None
        cfg = rec["config"]
        if set(cfg) - {f.name for f in dataclasses.fields(cls)} or not all(isinstance(v, (int, bool, type(None))) for v in cfg.values()):
            self._warn(f"entry {device} / {kernel} / {key} does not fit {cls.__name__}")
            return None
        return cls(**cfg)

    def put(self, kernel: str, device: str, records: dict[str, dict]) -> None:
        """Add or replace ``records`` (shape key -> record) and write the file atomically."""
        data = self._read(warn=False)  # entries another tuner wrote since we loaded stay
        node = data
        for part in (device, kernel):  # a malformed level is replaced, not merged into
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node.update(records)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": VERSION, "devices": data}, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        self._data = data


_CACHE: TuneCache | None = None
SHIPPED = TuneCache(Path(__file__).with_name("tuned.json"))
_DEVICE_NAMES: dict[int, str] = {}


def cache() -> TuneCache:
    """The process's cache (path fixed at first use; ``reset`` re-reads the environment)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = TuneCache(cache_path())
    return _CACHE


def reset() -> None:
    """Forget the loaded cache (tests; after ``MXQ_CACHE`` or ``PATH`` changes)."""
    global _CACHE
    _CACHE = None


def device_name(device) -> str:
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_NAMES:
        _DEVICE_NAMES[idx] = torch.cuda.get_device_name(idx)
    return _DEVICE_NAMES[idx]


def lookup(kernel: str, device, m: int, n: int, k: int, cls):
    """The tuned config of ``kernel`` for this shape on ``device`` (an instance of ``cls``): the user's
    cache's, else the shipped one's; None if neither has it, with ``MXQ_CACHE=off``, or off CUDA."""
    if not enabled() or getattr(device, "type", None) != "cuda":
        return None
    name, key = device_name(device), shape_key(m, n, k)
    return cache().config(kernel, name, key, cls) or SHIPPED.config(kernel, name, key, cls)


def pick(times: dict[str, float], default: str, min_gain: float = MIN_GAIN) -> str:
    """The fastest candidate, or ``default`` unless the fastest beats it by ``min_gain``."""
    best = min(times, key=times.get)
    return best if times[best] < times[default] * (1 - min_gain) else default


# Calls per timed CUDA graph, at least: the calls are cycled (over the weight copies) up to this
# count, so a graph is long against the host's enqueueing of the next replay (module doc, Timing).
MIN_GRAPH_CALLS = 32
# GPU cycles of the spin kernel queued ahead of a timed batch of replays: ~100 µs at 2 GHz, longer
# than the host takes to enqueue the start event and the replays behind it.
SPIN_CYCLES = 200_000


def graph_calls(calls: list, min_calls: int = MIN_GRAPH_CALLS) -> list:
    """``calls`` repeated in order until there are at least ``min_calls``: each copy is visited in
    turn, as often as the others (with one copy, its bytes must exceed L2 on their own)."""
    if not calls:
        raise ValueError("graph_calls: no calls to time")
    return list(calls) * -(-min_calls // len(calls))


def capture_graph(calls):
    """A CUDA graph that makes each of ``calls`` once, after one warm-up pass on a side stream
    (compiles, allocator pools) as graph capture requires."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def time_replays(g, replays: int = 2) -> float:
    """GPU µs of ``replays`` back-to-back replays of graph ``g``, between two events queued behind
    a spin kernel: the GPU is still busy with the spin while the host enqueues the start event and
    the replays, so the graph's launch latency (kernels/NOTES.md, "Measurement: timing method") is
    not in the figure, as it is not in a model whose whole step is one
    graph. Timing one replay right after a synchronize counted it in full."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def separator():
    """A call that launches one small elementwise kernel (a bf16 multiply over 4096 values, the size
    of a token's hidden state), put between the timed calls as a model puts a norm or an add
    between its GEMMs and its attention. Without it, chained copies of one kernel overlap through
    programmatic dependent launch (PDL); with it each call is timed on its own, ramp and tail
    included (``eval/bench_gemm.py`` also times the decode GEMM between the PDL producers that
    neighbour it in a fused model)."""
    import torch

    buf = torch.ones(1, 4096, dtype=torch.bfloat16, device="cuda")
    return lambda: buf.mul_(1.0)


def separated(calls: list, sep) -> list:
    """``calls`` with ``sep`` after each one."""
    return [f for call in calls for f in (call, sep)]


def time_interleaved(fns: dict[str, list], rounds: int = 7, reps: int = 5, sep=None) -> dict[str, float]:
    """Median µs per call of each named list of calls (one list = the same kernel over several
    weight copies), CUDA-graph replays interleaved across candidates (module doc): each graph makes
    the calls cycled to ``MIN_GRAPH_CALLS``, a ``separator`` kernel (or the call ``sep``) after each;
    the median time of a graph of separators alone is subtracted."""
    sep = sep or separator()
    graphs, base = {}, {}  # name or ("sep", calls) -> (graph, calls); name -> its separators' graph
    for name, calls in fns.items():
        calls = graph_calls(calls)
        base[name] = ("sep", len(calls))
        if base[name] not in graphs:
            graphs[base[name]] = (capture_graph([sep] * len(calls)), len(calls))
        graphs[name] = (capture_graph(separated(calls, sep)), len(calls))
    times: dict = {n: [] for n in graphs}
    order = list(fns) + [n for n in graphs if n not in fns]
    replays = 2
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            g, cnt = graphs[name]
            for _ in range(reps):
                times[name].append(time_replays(g, replays) / (replays * cnt))
    med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
    del graphs
    return {n: med[n] - med[base[n]] for n in fns}


def weight_copies(nbytes: int, l2_bytes: int) -> int:
    """Copies of a weight whose total exceeds three L2s, at most 8 (so the timed calls stream
    their weight from HBM, not L2)."""
    return max(1, min(8, -(-3 * l2_bytes // max(1, nbytes))))


def record(config, us: float, default_us: float, m: int, n_candidates: int) -> dict:
    """A cache entry: the config's fields and how it was chosen."""
    import torch

    tv = versions()["triton"]
    return {
        "config": dataclasses.asdict(config), "us": round(us, 3), "default_us": round(default_us, 3), "m": m,
        "candidates": n_candidates, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": tv,
    }  # fmt: skip
