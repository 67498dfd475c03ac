"""Helpers the benches, probes and tests share; not part of the wheel.

The disk's own limits that ``ckptio bench`` measures (``drop_cache``,
``settle_disk``, ``raw_limits``, ``raw_write``, ``cold_read``,
``synthetic_state_dict``...) live in ``ckptio.tools.bench``; these are the rest:
CUDA driver calls, page-fault and madvise timings, checkpoints in /dev/shm, and
profilers that wrap the package's functions. Benches run as ``python
benches/x.py`` find this module beside them; probes put ``benches/`` on
``sys.path``; tests get it from pytest's ``pythonpath`` (pyproject.toml).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import ckptio
import torch
from ckptio.tools.bench import GiB, cold_read, parallel, run_threads


def buffered_cold_read(path: str, nbytes: int, threads: int = 8, chunk: int = 64 << 20) -> float:
    """Seconds to read ``path``'s first ``nbytes`` cold through the page cache
    (kernel readahead), several threads, into a buffer a chunk per thread: on
    some disks this beats O_DIRECT."""
    ring = memoryview(bytearray(chunk * threads))
    return cold_read(path, ring, 0, threads, chunk, nbytes)


def shm_checkpoint(gib: float, tensors: int, device: str) -> tuple[str, torch.nn.Module, int]:
    """``gib`` GiB of bf16 ones in ``tensors`` equal tensors on ``device``, saved by
    ckptio in a new folder of /dev/shm, and a module of one empty buffer per
    tensor (each its own allocation) to load them into: (path, module, bytes).
    The caller removes the folder (``shutil.rmtree(os.path.dirname(path))``)."""
    n = int(gib * GiB) // tensors // 2
    sd = {f"w{i}": torch.ones(n, dtype=torch.bfloat16, device=device) for i in range(tensors)}
    path = os.path.join(tempfile.mkdtemp(dir="/dev/shm"), "m.pt")
    ckptio.save(sd, path)
    del sd
    model = torch.nn.Module()
    for i in range(tensors):
        model.register_buffer(f"w{i}", torch.empty(n, dtype=torch.bfloat16, device=device))
    return path, model, 2 * n * tensors


LLM_LAYERS = 166
LLM_VOCAB = 151936


def llm_shapes(nbytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of an LLM-shaped bf16 state dict of about ``nbytes``
    (issue 37): two vocab x hidden embeddings, 166 layers of q/k/v/o and
    gate/up/down matrices with their 1-D norms and q/k/v biases, a final norm:
    1,995 tensors whatever the size (the hidden size scales with it; at 4 GiB
    hidden 1024, biases of 512 B and 2 KiB)."""

    def layout(h: int) -> list[tuple[str, tuple[int, ...]]]:
        kv, inter = h // 4, h * 11 // 4
        rows: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (LLM_VOCAB, h))]
        for i in range(LLM_LAYERS):
            p = f"model.layers.{i}."
            rows += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
            ]
        return rows + [("model.norm.weight", (h,)), ("lm_head.weight", (LLM_VOCAB, h))]

    def size(rows: list[tuple[str, tuple[int, ...]]]) -> int:
        return sum(2 * (s[0] * (s[1] if len(s) > 1 else 1)) for _, s in rows)

    h = 64  # the multiple of 64 that comes nearest
    while abs(size(layout(h + 64)) - nbytes) < abs(size(layout(h)) - nbytes):
        h += 64
    return layout(h)


def llm_state_dict(nbytes: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """An LLM-shaped bf16 state dict (:func:`llm_shapes`) of random finite values on ``device``."""
    sd = {}
    for name, shape in llm_shapes(nbytes):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        sd[name] = _finite_bits(t)
    return sd


def _finite_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (bf16) filled with random bits but the top exponent bit: every value
    finite (no NaN, which compares unequal to itself), magnitudes below 2."""
    bits = t.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return bits.bitwise_and_(~(1 << 14)).view(torch.bfloat16)


def even_state_dict(
    nbytes: int, tensors: int = 512, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """``tensors`` equal bf16 tensors of random finite values, ``nbytes`` in all."""
    n = nbytes // tensors // 2
    sd = {}
    for i in range(tensors):
        t = torch.empty(n, dtype=torch.bfloat16, device=device)
        sd[f"w{i}"] = _finite_bits(t)
    return sd


def shaped_state_dict(
    shape: str, nbytes: int, device: str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The state dict a bench's ``--shape`` names: ``even`` (``synthetic_state_dict``,
    of ``dtype``) or ``llm`` (:func:`llm_state_dict`, bf16 always)."""
    if shape == "llm":
        return llm_state_dict(nbytes, device)
    if shape != "even":
        raise ValueError(f"--shape must be even or llm, not {shape!r}")
    from ckptio.tools.bench import synthetic_state_dict

    return synthetic_state_dict(nbytes, device, dtype)


def module_of(shapes: dict[str, list[int]], dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A module tree whose state dict has these keys and shapes, every parameter
    written (its pages faulted in, as a model's are)."""
    root = torch.nn.Module()
    for key, shape in shapes.items():
        *path, leaf = key.split(".")
        m = root
        for name in path:
            if not hasattr(m, name):
                m.add_module(name, torch.nn.Module())
            m = getattr(m, name)
        t = torch.full(shape, 0.5, dtype=dtype, device=device)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def fastsafetensors_loader(
    device: str, nogds: bool, odirect: bool | None = None, copy: bool = False
) -> Callable[[str], Any] | None:
    """fastsafetensors' load of a whole file to ``device`` (None where it is not
    installed): ``nogds`` as it takes it; ``odirect`` sets FASTSAFETENSORS_ODIRECT
    for the call (None: as the environment has it); ``copy``: tensors that own
    their memory (cloned out of its buffer, freed when its file closes)."""
    try:
        from fastsafetensors import fastsafe_open
    except ImportError:
        return None
    # fastsafetensors wants an indexed device ("cuda:0", not "cuda").
    dev = f"{device}:{torch.cuda.current_device()}" if device == "cuda" else device

    def load(path: str) -> dict[str, torch.Tensor]:
        old = os.environ.get("FASTSAFETENSORS_ODIRECT")
        if odirect is not None:
            os.environ["FASTSAFETENSORS_ODIRECT"] = "1" if odirect else "0"
        try:
            with fastsafe_open(path, device=dev, nogds=nogds) as f:
                return {k: f.get_tensor(k).clone() if copy else f.get_tensor(k) for k in f.keys()}
        finally:
            if odirect is not None:
                if old is None:
                    os.environ.pop("FASTSAFETENSORS_ODIRECT", None)
                else:
                    os.environ["FASTSAFETENSORS_ODIRECT"] = old

    return load


def libcuda() -> Any:
    """libcuda through ctypes, with the argument types of the driver calls the
    benches and probes make (ctypes releases the GIL around each call)."""
    vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
    cu = ctypes.CDLL("libcuda.so.1")
    for name, args in (
        ("cuCtxGetCurrent", [ctypes.POINTER(vp)]),
        ("cuCtxSetCurrent", [vp]),
        ("cuMemHostRegister_v2", [vp, sz, ctypes.c_uint]),
        ("cuMemHostUnregister", [vp]),
        ("cuMemcpyHtoDAsync_v2", [u64, vp, sz, vp]),
        ("cuStreamCreate", [ctypes.POINTER(vp), ctypes.c_uint]),
        ("cuStreamSynchronize", [vp]),
        ("cuStreamDestroy_v2", [vp]),
    ):
        getattr(cu, name).argtypes = args
    return cu


def cuda_check(rc: int, what: str) -> None:
    """A RuntimeError naming the driver call where ``rc`` is not CUDA_SUCCESS."""
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def h2d_seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds to fill the CUDA byte tensor ``dst`` from the pinned host byte
    tensor ``src`` (reused where ``dst`` is larger), one copy per ``src`` length:
    the pinned host-to-device limit the probes measure against."""
    n, piece = dst.numel(), src.numel()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for o in range(0, n, piece):
        ln = min(piece, n - o)
        dst[o : o + ln].copy_(src[:ln], non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def timed_threads(threads: list[threading.Thread]) -> float:
    """Seconds from starting ``threads`` to the end of the last of them."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def on_streams(
    threads: int, items: list[Any], fn: Callable[[Any, Any], None], ctx: Any = None
) -> float:
    """``fn(item, stream)`` for every item, in order, on ``threads`` threads,
    each with a CUDA stream of its own in context ``ctx`` (default: the calling
    thread's), synced before the thread ends; seconds."""
    cu = libcuda()
    if ctx is None:
        ctx = ctypes.c_void_p()
        cuda_check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    todo = list(reversed(items))
    lock = threading.Lock()

    def work(stopped: Callable[[], bool]) -> None:
        st = ctypes.c_void_p()
        try:
            cuda_check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            cuda_check(cu.cuStreamCreate(ctypes.byref(st), 1), "cuStreamCreate")
            while not stopped():
                with lock:
                    if not todo:
                        break
                    item = todo.pop()
                fn(item, st)
            cuda_check(cu.cuStreamSynchronize(st), "cuStreamSynchronize")
        finally:
            if st.value:
                cu.cuStreamDestroy_v2(st)

    t0 = time.perf_counter()
    run_threads(threads, work)
    return time.perf_counter() - t0


def libc() -> Any:
    """libc through ctypes (errno kept), with mmap, munmap and madvise typed."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    c = ctypes.CDLL(None, use_errno=True)
    c.mmap.restype = vp
    c.mmap.argtypes = [vp, sz, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    c.munmap.argtypes = [vp, sz]
    c.madvise.argtypes = [vp, sz, ctypes.c_int]
    return c


MADV_POPULATE_READ = 22  # Linux 5.14: page tables filled, pages read
MADV_POPULATE_WRITE = 23  # Linux 5.14: pages faulted in writable


def madvise_s(
    ranges: list[tuple[int, int]],
    threads: int = 16,
    piece: int = 64 << 20,
    advice: int = MADV_POPULATE_WRITE,
) -> float:
    """Seconds for ``madvise(advice)`` over every (address, length) of ``ranges``,
    in ``piece``-byte calls on ``threads`` threads (ctypes releases the GIL):
    fault in fresh memory (MADV_POPULATE_WRITE) or fill the page tables of a
    file mapping (MADV_POPULATE_READ) as several threads would."""
    c = libc()
    jobs = [(b + o, min(piece, n - o)) for b, n in ranges for o in range(0, n, piece)]

    def one(i: int, _: int) -> None:
        addr, n = jobs[i]
        if c.madvise(addr, n, advice) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({advice})")

    t0 = time.perf_counter()
    parallel(threads, len(jobs), 1, one)
    return time.perf_counter() - t0


def fresh_memory_fault_s(
    sizes: list[int], threads: int = 16, piece: int = 64 << 20, kind: str = "memfd"
) -> float:
    """Seconds to fault in fresh memory laid out as a first staging lays it out,
    one buffer of each of ``sizes`` (MADV_POPULATE_WRITE, ``piece`` per call, on
    ``threads`` threads): what any first staging into new buffers costs at least,
    before pinning and before the copies. ``kind``: "memfd" (shared buffers),
    "anon" (private anonymous memory, 4 KiB pages) or "anon+thp" (the same, advised
    MADV_HUGEPAGE first)."""
    maps, bases = [], []
    for n in sizes:
        if kind == "memfd":
            fd = os.memfd_create("ckptio-bench")
            try:
                os.ftruncate(fd, n)
                maps.append(mmap.mmap(fd, n))
            finally:
                os.close(fd)
        else:
            maps.append(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE))
            if kind == "anon+thp":
                maps[-1].madvise(mmap.MADV_HUGEPAGE)
        bases.append(ctypes.addressof(ctypes.c_char.from_buffer(maps[-1])))
    return madvise_s(list(zip(bases, sizes, strict=True)), threads, piece)


class EngineReads:
    """Seconds in which a native read ran (the union of the ``read_segments``
    calls' spans: a load's batches may read side by side) since :meth:`reset`:
    the engine's share of a load; the rest is Python, unpickling and allocating
    the destinations. One load at a time, until :meth:`close`."""

    def __init__(self, pkg: Any = None) -> None:
        """``pkg``: ``ckptio`` (default), or a copy of it at another commit."""
        pkg = pkg if pkg is not None else ckptio
        self.calls = 0
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._inner: list[tuple[type, Any]] = []
        for cls in (pkg._native.Reader, pkg._native.DeviceFile):
            self._wrap(cls)

    def _wrap(self, cls: type) -> None:
        inner = cls.read_segments  # type: ignore[attr-defined]
        self._inner.append((cls, inner))

        def timed(obj: object, *args: object, **kw: object) -> object:
            t = time.perf_counter()
            try:
                return inner(obj, *args, **kw)
            finally:
                with self._lock:
                    self._spans.append((t, time.perf_counter()))
                    self.calls += 1

        cls.read_segments = timed  # type: ignore[attr-defined]

    @property
    def seconds(self) -> float:
        busy, end = 0.0, float("-inf")
        with self._lock:
            spans = sorted(self._spans)
        for a, b in spans:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        return busy

    def reset(self) -> None:
        with self._lock:
            self._spans, self.calls = [], 0

    def close(self) -> None:
        """Put the native methods back."""
        for cls, inner in self._inner:
            cls.read_segments = inner  # type: ignore[attr-defined]
        self._inner.clear()


class LoadPhases:
    """Seconds spent in each step of ``load_state_dict`` in place (the
    ``state_dict`` module's ``open_source``, ``_plain_walk``, ``plan`` and
    ``execute``) since :meth:`reset`, for package ``pkg`` (``ckptio``, or a copy
    of it at another commit); until :meth:`close`."""

    STEPS = ("open_source", "_plain_walk", "plan", "execute")

    def __init__(self, pkg: Any) -> None:
        self.seconds: dict[str, float] = {}
        self._owner = sys.modules[f"{pkg.__name__}.state_dict"]
        self._inner = {name: getattr(self._owner, name) for name in self.STEPS}
        for name, f in self._inner.items():

            def timed(*a: Any, _f: Any = f, _name: str = name, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.seconds[_name] = self.seconds.get(_name, 0.0) + time.perf_counter() - t0

            setattr(self._owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()

    def close(self) -> None:
        """Put the functions back."""
        for name, f in self._inner.items():
            setattr(self._owner, name, f)


def store_probe(doc: str, rounds: int, run: Callable[[Any, Any], None]) -> None:
    """A probe's main against a SeaweedFS on the loopback (tests/s3server.py on
    the path): ``--size``, ``--device``, ``--rounds``, then ``run(args, server)``."""
    import argparse

    import s3server

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=rounds)
    with s3server.running() as srv:
        run(ap.parse_args(), srv)
