"""The NaN-code scan that every load of an mxq checkpoint runs, word-wise against byte-wise.

Writes one fp8 tensor of ``--mib`` MiB of random finite E4M3 codes (no NaN: the case every good
checkpoint is, so the scan reads it all), then times ``mxq.checkpoint.validate.count_codes`` over it with the
word-wise test (the default) and byte by byte (the reference), at each ``--threads`` count (torchrun
starts each rank with one), alternating the two, median of ``--reps``. Both must count the same. Prints a
table of GB/s with the ratio word-wise / byte-wise and writes JSON.

    python -m mxq.eval.bench_scan --mib 1024 --threads 1,2 --out scan.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch


def main(argv=None) -> int:
    from safetensors.torch import save_file

    from mxq.checkpoint.files import read_header
    from mxq.checkpoint.validate import count_codes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the tensor scanned (MiB)")
    p.add_argument("--threads", default="1", help="torch thread counts, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON file to write")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 256, (a.mib, 1 << 20), dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN code: the scan must read every byte
        path = os.path.join(tmp, "x.safetensors")
        save_file({"w": codes.view(torch.float8_e4m3fn)}, path)
        del codes
        info = read_header(path)[0]["w"]
        count_codes(info, 0x7F)  # the file in the page cache, as after a conversion or a first load
        prev = torch.get_num_threads()
        for n in [int(t) for t in a.threads.split(",")]:
            torch.set_num_threads(n)
            times = {True: [], False: []}
            for _ in range(a.reps):
                for wordwise in (True, False):
                    t0 = time.perf_counter()
                    assert count_codes(info, 0x7F, wordwise=wordwise) == (0, -1)
                    times[wordwise].append(time.perf_counter() - t0)
            word, byte = (info.nbytes / statistics.median(times[w]) / 1e9 for w in (True, False))
            rows.append(dict(threads=n, wordwise_gb_s=word, bytewise_gb_s=byte, ratio=word / byte))
        torch.set_num_threads(prev)
    res = dict(env=dict(cpu=platform.processor() or platform.machine(), torch=torch.__version__,
                        date=time.strftime("%Y-%m-%d"), cores=os.cpu_count()), mib=a.mib, reps=a.reps, rows=rows)  # fmt: skip
    print(f"## NaN-code scan of {a.mib} MiB ({res['env']['date']}, torch {torch.__version__}, {os.cpu_count()} cores)\n")
    print("| threads | byte-wise GB/s | word-wise GB/s | word / byte |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['threads']} | {r['bytewise_gb_s']:.2f} | {r['wordwise_gb_s']:.2f} | {r['ratio']:.2f} |")
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
