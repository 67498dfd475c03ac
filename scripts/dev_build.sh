#!/usr/bin/env bash
# Development build: the extension built by cargo (debug unless --release is
# given) and placed beside the Python sources, so that
#   PYTHONPATH=python .venv/bin/python -m pytest
# runs this checkout without a reinstall (any venv with the test extras will do).
# Built with the probe hooks (cargo feature probes: _native.host_memory and
# _native.memory_copy_floor) that the tests use where present and the benches need.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --features python,probes "$@"
profile=debug
for a in "$@"; do [ "$a" = "--release" ] && profile=release; done
# A new file renamed over the old: a process that has the old one loaded keeps it.
cp "target/$profile/libckptio.so" python/ckptio/_native.abi3.so.tmp
mv -f python/ckptio/_native.abi3.so.tmp python/ckptio/_native.abi3.so
