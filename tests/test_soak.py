"""Soak: 200 consecutive saves and loads of one state dict. After a warm-up, host RSS, open
file descriptors, threads and the engine's pooled/pinned bytes (and CUDA memory on the GPU
variant) stay flat; the test fails when they grow. Thresholds are generous, never timings."""

from __future__ import annotations

import gc
import os
import statistics
from pathlib import Path

import ckptio
import pytest
import torch
from ckptio.io.engines import engine as _engine

MIB = 2**20
ROUNDS, WARMUP = 200, 20


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def resources(extra: dict | None = None) -> dict[str, int]:
    gc.collect()
    e = _engine(None, None, None)
    out = {
        "rss": rss(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "pooled": e.pooled_bytes(),
        "pinned": e.pinned_bytes(),
    }
    out.update(extra or {})
    return out


def state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i}.w": torch.randn(16 * 1024 + i, generator=g) for i in range(24)}
    sd["emb"] = torch.randn(1024, 256, generator=g).to(torch.bfloat16)
    sd["view"] = sd["emb"][3:7]
    return {k: v.to(device) for k, v in sd.items()}


def soak(path: Path, device: str, extra=lambda: {}, **kw) -> list[dict[str, int]]:
    sd = state(device)
    samples = []
    for i in range(ROUNDS):
        ckptio.save(sd, path, **kw)
        got = ckptio.load(path, map_location=device, verify=bool(i % 2), **kw)
        if i % 50 == 0:
            assert all(torch.equal(got[k], sd[k]) for k in sd)
        del got
        samples.append(resources(extra()))
    return samples


def assert_flat(samples: list[dict[str, int]], rss_slack: int) -> str:
    after = samples[WARMUP:]
    base = {k: statistics.median(s[k] for s in after[:20]) for k in after[0]}
    last = {k: max(s[k] for s in after[-20:]) for k in after[0]}
    report = ", ".join(f"{k} {base[k]:.0f}->{last[k]:.0f}" for k in base)
    assert last["rss"] - base["rss"] <= rss_slack, report
    assert last["fds"] <= base["fds"], report
    # The replaced file is freed on a short-lived thread: allow it to be alive at a sample.
    assert last["threads"] <= base["threads"] + 2, report
    for k in base:
        if k not in ("rss", "fds", "threads"):
            assert last[k] <= base[k], report
    return report


@pytest.mark.slow
def test_soak_cpu_200_saves_and_loads_stay_flat(tmp_path):
    samples = soak(tmp_path / "ckpt.pt", "cpu")
    # A leak of one 64 KiB buffer per round would add ~11 MiB; of the state dict, ~1.5 GiB.
    print("\n" + assert_flat(samples, rss_slack=24 * MIB))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["bounce", "auto"])
def test_soak_gpu_200_saves_and_loads_stay_flat(tmp_path, backend):
    def cuda() -> dict[str, int]:
        torch.cuda.synchronize()
        return {
            "cuda_allocated": torch.cuda.memory_allocated(),
            "cuda_reserved": torch.cuda.memory_reserved(),
        }

    samples = soak(tmp_path / "ckpt.pt", "cuda", cuda, backend=backend)
    if backend == "bounce":
        assert samples[-1]["pinned"] > 0, "the bounce pipeline was not used"
    print("\n" + assert_flat(samples, rss_slack=64 * MIB))
