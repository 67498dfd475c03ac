"""The foundation benchmark: raw disk limit vs ckptio vs torch.save/torch.load.

Runs ckptio.tools.bench (the runner of ``ckptio bench``) at 1 GiB and 4 GiB (CPU
state dicts) in one process and prints one table per size, with ratios against
the raw limit measured in the same run.
Usage: python benches/bench_io.py [--sizes 1G,4G] [--dir DIR] [--json OUT]
"""

import argparse
import json

from ckptio.io.units import parse_size as _size
from ckptio.tools import bench


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1G,4G")
    p.add_argument("--dir", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=5, help="rounds; rows keep their median")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out = {}
    for s in a.sizes.split(","):
        rows = bench.run(_size(s), a.dir, a.threads, None, a.device, a.repeat)
        print(bench.table(rows), flush=True)
        ratio = {r.name: r.gib_s for r in rows}
        raw_w = next(v for k, v in ratio.items() if k.startswith("raw write"))
        raw_r = next(v for k, v in ratio.items() if k.startswith("raw read"))
        fresh = ratio[bench.RAW_FRESH]
        tl = ratio["torch.load, cold"]
        print(
            f"targets: ckptio.save/raw write = {ratio['ckptio.save (durable)'] / raw_w:.2f} "
            f"(>= 0.85), ckptio.load/raw read = {ratio['ckptio.load, cold'] / raw_r:.2f} "
            f"(>= 0.85); ckptio.load/torch.load = {ratio['ckptio.load, cold'] / tl:.2f} "
            f"(>= 1.5)\nbounds: raw read/torch.load = {raw_r / tl:.2f} (no loader beats the "
            f"raw read); a read into fresh memory (what a load into new tensors pays) = "
            f"{fresh / raw_r:.2f}x the raw read; ckptio.load/that read = "
            f"{ratio['ckptio.load, cold'] / fresh:.2f}\n",
            flush=True,
        )
        out[s] = json.loads(bench.to_json(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
