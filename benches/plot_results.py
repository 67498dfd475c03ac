"""The charts of docs/benchmarks.md, drawn from the JSON the benches wrote into
benches/results/ (each chart names its run: machine, date, command, file).

    python benches/plot_results.py [--out docs/img]

Needs matplotlib (``pip install matplotlib``; ckptio itself does not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from ckptio.tools.bench import Bar, plot_bars

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _load(name: str) -> Any:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _rate(rows: dict[str, float], name: str, over: str, what: str) -> str:
    return f"{rows[name] / rows[over]:.2f}x {what}"


def disk(out: str) -> None:
    """ckptio against torch.save/torch.load, the torch.cuda.gds recipe and KvikIO, 2 GiB."""
    run = "gpu-h200-2026-11-30-2G-settled.json"
    g = {r["name"]: r["gib_s"] for r in _load(run) if r["case"] == "disk 2G" and r.get("gib_s")}
    raw_w = g["raw write + fsync (O_DIRECT)"]
    raw_r = max(g["raw read, cold (O_DIRECT)"], g["raw read, cold (buffered)"])

    def panel(raw: tuple[str, float], peers: list[str], ours: list[tuple[str, str]]) -> list[Bar]:
        """The raw limit, the peers against it, ckptio against torch, KvikIO POSIX and it."""
        torch_, kvikio = peers[0], peers[2]
        bars = [Bar(raw[0], raw[1])]
        bars += [Bar(n, g[n], f"{g[n] / raw[1]:.2f}x the raw limit") for n in peers]
        for name, label in ours:
            note = (
                f"{_rate(g, name, torch_, torch_.split()[0])}, "
                f"{_rate(g, name, kvikio, 'KvikIO POSIX')}, {g[name] / raw[1]:.2f}x raw"
            )
            bars.append(Bar(label, g[name], note))
        return bars

    saves = panel(
        ("raw O_DIRECT write + fsync", raw_w),
        ["torch.save + fsync", "torch.cuda.gds recipe save", "KvikIO posix write + fsync",
         "KvikIO cuFile write + fsync"],
        [("ckptio.save (posix)", "ckptio.save, bounce"),
         ("ckptio.save (cufile)", "ckptio.save, cuFile")],
    )  # fmt: skip
    loads = panel(
        ("raw read, best of O_DIRECT / buffered", raw_r),
        ["torch.load -> cuda, cold", "torch.cuda.gds recipe load", "KvikIO posix read, cold",
         "KvikIO cuFile read, cold"],
        [("ckptio.load (posix), cold", "ckptio.load, bounce"),
         ("ckptio.load (cufile), cold", "ckptio.load, cuFile")],
    )  # fmt: skip
    plot_bars(
        os.path.join(out, "disk-h200-2G.png"),
        "2 GiB bf16 state dict (128 tensors) on an H200, to and from its virtio disk",
        [("save, durable (fsync included)", saves), ("load to the GPU, cold", loads)],
        caption="H200 machine, 2026-11-30, at 2cb6c9b; BENCH_ARGS='--sizes 2G --rounds 3 "
        "--shm-size=' scripts/gpu_check.sh bench; medians of 3 rounds (torch, gds recipe: 1); "
        f"benches/results/{run}",
    )


def shm(out: str) -> None:
    """Where the disk is out of the way: 8 GiB to the GPU from /dev/shm."""
    run = "gpu-h200x2-2026-11-30-shm-8G-reread.json"
    g = {r["name"]: r["gib_s"] for r in _load(run) if r.get("gib_s")}
    pinned = g["D2H pinned copy"]
    kv = g["KvikIO posix read, cold"]

    def bar(name: str, label: str) -> Bar:
        return Bar(label, g[name], f"{g[name] / pinned:.2f}x pinned, {g[name] / kv:.2f}x KvikIO")

    loads = [
        Bar("pinned host-to-device copy (limit)", pinned),
        Bar("raw 8-thread read (O_DIRECT)", g["raw read, cold (O_DIRECT)"]),
        Bar("KvikIO POSIX read", kv, f"{kv / pinned:.2f}x pinned"),
        bar("ckptio.load (posix), cold", "ckptio.load, right after the save"),
        Bar(
            "ckptio.load, loaded again",
            g["ckptio.load (posix), pages read before"],
            f"{g['ckptio.load (posix), pages read before'] / pinned:.2f}x pinned",
        ),
    ]
    plot_bars(
        os.path.join(out, "shm-h200x2-8G.png"),
        "8 GiB bf16 state dict (512 tensors) loaded to an H200 from /dev/shm",
        [("load to the GPU", loads)],
        caption="H200 x2 machine (32 cores), 2026-11-30, at ec2d0ad; BENCH_ARGS='--sizes= "
        "--shm-size 8G --shm-rounds 2' scripts/gpu_check.sh bench; medians of 2; "
        f"benches/results/{run}",
    )


def dcp(out: str) -> None:
    """Async DCP: how long training is blocked, and when the checkpoint is durable."""
    run = "dcp-h200-2026-11-30-2G-all.json"
    size = _load(run)["sizes"][0]
    names = {
        "torch default": "torch, no stager",
        "torch FSW(cache_staged=True)": "torch, cache_staged_state_dict",
        "torch DefaultStager (fresh)": "torch DefaultStager",
        "ckptio DefaultStager host": "ckptio DefaultStager, host",
        "ckptio DefaultStager host, prepare()d": "ckptio, host after prepare()",
        "ckptio DefaultStager snapshot": "ckptio, device snapshot",
    }
    cfg = {c["name"]: c["saves"] for c in size["configs"] if c["name"] in names}

    def later(saves: list[dict[str, float]], key: str) -> float:
        return statistics.median(s[key] for s in saves[1:])

    blocked = [
        Bar(names[n], 1000 * later(s, "return_s"), f"save 1: {1000 * s[0]['return_s']:.1f} ms")
        for n, s in cfg.items()
    ]
    staged = [
        Bar(names[n], later(s, "staged_s"), f"save 1: {s[0]['staged_s']:.2f} s")
        for n, s in cfg.items()
    ]
    sync = size["ckptio_save_s"]
    upload = [
        Bar(names[n], later(s, "upload_s"), f"{later(s, 'upload_s') / sync:.2f}x a ckptio.save")
        for n, s in cfg.items()
    ]
    torch_s, ours_s = size["load_torch FileSystemReader_s"], size["load_ckptio_s"]
    gib = size["nbytes"] / 2**30
    loads = [
        Bar("raw read of the data file", size["raw_read_gib_s"]),
        Bar("torch FileSystemReader", gib / torch_s),
        Bar("ckptio FileSystemReader", gib / ours_s, f"{torch_s / ours_s:.2f}x torch"),
    ]
    plot_bars(
        os.path.join(out, "dcp-h200-2G.png"),
        "dcp.async_save of a 2 GiB bf16 state dict on an H200 (saves 2-5, median)",
        [
            ("async_save returns (training blocked)", blocked, "ms"),
            ("staging done (parameters may change)", staged, "s"),
            ("upload done (durable)", upload, "s"),
            ("dcp.load into the GPU tensors, cold", loads, "GiB/s"),
        ],
        caption="H200 machine, 2026-11-30, at 72e8578; DCP_SIZES=2G DCP_SAVES=5 "
        f"DCP_SKIP_TESTS=1 scripts/gpu_check.sh dcp; benches/results/{run}",
    )


def safetensors(out: str) -> None:
    """Cold safetensors loads: ckptio.safetensors against the safetensors package."""
    panels = []
    for run, title in (
        ("safetensors-h200-2026-11-29-4G.json", "4 GiB bf16, 1672 tensors, to an H200"),
        ("safetensors-cpu-dev-2026-11-29.json", "1 GiB bf16, 392 tensors, to host memory"),
    ):
        rows = {r["name"]: r for r in _load(run)["rows"]}
        bars = [
            Bar(
                "raw O_DIRECT read, fresh memory", rows["raw O_DIRECT read (fresh memory)"]["gib_s"]
            )
        ]
        for name, label in (
            ("safetensors.load_file", "safetensors.load_file"),
            ("ckptio (hub file)", "ckptio, file written by safetensors"),
            ("ckptio (ckptio file)", "ckptio, file written by ckptio"),
        ):
            r = rows[name]
            note = (
                "" if name.startswith("safetensors") else f"{r['vs_safetensors']:.2f}x safetensors"
            )
            bars.append(Bar(label, r["gib_s"], note))
        panels.append((title, bars))
    plot_bars(
        os.path.join(out, "safetensors.png"),
        "Cold safetensors loads (page cache dropped), median of 3",
        panels,
        caption="H200 machine: ST_SIZE=4G scripts/gpu_check.sh stbench; development VM (2 "
        "vCPUs): python benches/bench_safetensors.py --size 1G; both 2026-11-29; "
        "benches/results/safetensors-*-2026-11-29*",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.path.join(os.path.dirname(RESULTS), "..", "docs", "img"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for chart in (disk, shm, dcp, safetensors):
        chart(a.out)
        print(f"{chart.__name__}: done")


if __name__ == "__main__":
    main()
