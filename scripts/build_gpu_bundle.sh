#!/usr/bin/env bash
# Builds what scripts/gpu_check.sh needs into dist/ (gitignored; carry it):
# the abi3 wheel (release, with the probe hooks that benches/bench_memory.py and
# the probes call: cargo feature probes) and the Rust unit-test binary.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf dist && mkdir -p dist
maturin build --release -q -o dist --features probes
bin=$(cargo test --lib --no-run --message-format=json 2>/dev/null \
      | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["cdylib","rlib"]: print(m["executable"])' | tail -1)
cp "$bin" dist/ckptio-test-lib
ls -la dist
