"""Read once, share over torch.distributed: loads where every rank of a process
group gets the whole checkpoint and each of its bytes is read from storage once.

``group=`` on ``ckptio.load`` (also with ``out=``), ``ckptio.load_state_dict``,
``ckptio.safetensors.load_file`` and ``load_sharded`` runs the call as one
**session** on every rank of the group (:func:`run`). The call does its local
work as without a group (open the file, decode the pickle or header, allocate
or plan the destinations); where it would read, it hands its **pieces** (file,
offset, bytes, and where they land on this rank) to :meth:`Session.read`:

1. **Agreement**, before any data moves: every rank says what it is about to
   read (each file's size and a digest of its records, the pieces' count,
   bytes and a digest) in one ``all_gather_object``. Ranks that see a
   different file, or load it differently (another ``out=``, other keys or
   devices), all raise :class:`GroupMismatchError` naming the rank and the
   difference. A rank whose local work failed takes part in the same exchange
   with its error: it raises its own exception, every other rank
   :class:`PeerLoadError` naming it. A session ends with one more exchange, so
   a failure after the last read (a strict key check) reaches every rank too.
2. **Plan** (the same on every rank, from the agreed pieces): the pieces,
   ordered by file and offset, are cut into one share per rank, balanced by
   bytes (a storage split between ranks where it crosses a share's boundary,
   at a MiB multiple of its start), each share into batches of at most
   :data:`BATCH` bytes.
3. **Rounds**: round ``r`` moves batch ``r`` of every rank. A thread reads this
   rank's batches with the engine, ahead of the rounds (its buffers within
   :data:`AHEAD`); each round starts with an ``all_reduce`` of every rank's
   status (its batch read, its buffers allocated), so that a failed read stops
   every rank at the same point, with a typed error on each, rather than
   leaving them in a collective. Then every rank's batch is broadcast from it,
   the round's broadcasts all at once: large parts in place (the destination's
   own memory, on every rank), parts under :data:`SMALL` packed in one buffer
   per batch, buffers for destinations that cannot take the bytes as they are
   (a strided or cast destination, a device the group's backends do not
   serve). A third thread faults in the host memory the other ranks' parts
   land in, ahead of their broadcasts. Memory beyond the destinations: the
   reader's buffers and one round's receive buffers.

Collectives only (NCCL for CUDA memory, gloo for host memory, whatever the
group's backends are): no transport of ckptio's own. ``last_report()`` says
``bytes_read`` (from storage, by this rank) and ``bytes_received`` (from the
other ranks). See docs/group.md.
"""

from __future__ import annotations

import bisect
import contextvars
import dataclasses
import functools
import hashlib
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ckptio.errors import GroupLoadError, GroupMismatchError, PeerLoadError
from ckptio.io import memory, reports, transfer
from ckptio.io.engines import IoOptions

#: Bytes of one rank's share read, then broadcast, per round.
BATCH = 64 << 20
#: Parts under this size travel packed in one buffer per batch.
SMALL = 1 << 20
#: Bytes of buffers (packed small parts, temporaries) a rank's reads may
#: hold ahead of the round in flight (parts read in place hold none).
AHEAD = 256 << 20
#: Where a storage is split (between ranks or batches): a multiple of this
#: many bytes from its start (its start is on a 4 KiB boundary in ckptio's
#: files, so O_DIRECT reads of each part need no shifting).
SPLIT = 1 << 20

T = TypeVar("T")


# --------------------------------------------------------------------------- pieces


@dataclasses.dataclass
class Piece:
    """Bytes every rank gets: ``nbytes`` from ``offset`` of file ``file`` (an
    index into the sources of :meth:`Session.read`), landing in ``target`` (a
    contiguous uint8 tensor) or, where it is None, in a buffer on ``device``
    that ``finish`` then consumes (copies into the real destination)."""

    file: int | None
    offset: int
    nbytes: int
    device: torch.device
    target: torch.Tensor | None = None
    finish: Callable[[torch.Tensor], None] | None = None
    #: May be cut between ranks and batches (False: read whole by one rank,
    #: as a CRC-32 check or a temporary's copy needs).
    splittable: bool = True
    #: ``file`` None: the bytes are this rank's already (``owner``): ``fill``
    #: copies them into a uint8 tensor.
    fill: Callable[[torch.Tensor], None] | None = None
    #: The rank that reads (or has) the bytes; None: the plan decides.
    owner: int | None = None
    #: Called on the ranks that received the bytes, once they are in place.
    done: Callable[[], None] | None = None


def as_bytes(owner: torch.Tensor | torch.UntypedStorage, address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of ``owner``'s memory from ``address``."""
    st = owner.untyped_storage() if isinstance(owner, torch.Tensor) else owner
    at = address - st.data_ptr()
    if not (0 <= at and at + nbytes <= st.nbytes()):
        raise ValueError("a segment outside its owner's memory")
    # torch's stubs lack set_(source, offset, size) (the stride is optional)
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, at, (nbytes,))  # type: ignore[call-overload]


def segment_pieces(
    file: int, segments: Sequence[transfer.Segment], owners: Sequence[Any], splittable: bool = True
) -> list[Piece]:
    """The pieces of one file's engine reads (``segments``, each landing in the
    memory of its owner, a storage or tensor), as the group's read takes them.
    ``splittable`` False: each read whole by one rank (a CRC-32 check needs it)."""
    return [
        Piece(file, off, n, owner.device, as_bytes(owner, addr, n), splittable=splittable)
        for (off, addr, n, _), owner in zip(segments, owners, strict=True)
    ]


@dataclasses.dataclass
class SharedFile:
    """A file the pieces are read from: its name in messages, the native
    ``Reader`` or ``DeviceFile``, and its size."""

    path: str
    file: Any
    size: int


@dataclasses.dataclass
class _Part:
    piece: Piece
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def _order(p: Piece, comm: str) -> tuple[Any, ...]:
    return (-1 if p.file is None else p.file, p.offset, p.nbytes, comm, p.splittable, p.owner)


def _shares(pieces: list[Piece], n: int) -> list[list[_Part]]:
    """Each rank's parts: pieces with an owner go to it; the others, in the
    given order, are cut into ``n`` runs of about equal bytes."""
    out: list[list[_Part]] = [[] for _ in range(n)]
    free = [p for p in pieces if p.owner is None and p.nbytes]
    for p in pieces:
        if p.owner is not None and p.nbytes:
            out[p.owner].append(_Part(p, 0, p.nbytes))
    total = sum(p.nbytes for p in free)
    if not total:
        return out
    starts = []
    at = 0
    for p in free:
        starts.append(at)
        at += p.nbytes
    cuts = [0]
    for k in range(1, n):
        b = total * k // n
        j = bisect.bisect_right(starts, b) - 1
        p, rel = free[j], b - starts[j]
        if p.splittable:
            rel = min(p.nbytes, (rel + SPLIT // 2) // SPLIT * SPLIT)
        else:
            rel = 0 if rel < p.nbytes // 2 else p.nbytes
        cuts.append(max(cuts[-1], starts[j] + rel))
    cuts.append(total)
    for p, s in zip(free, starts, strict=True):
        q = max(bisect.bisect_right(cuts, s) - 1, 0)
        lo = 0
        while lo < p.nbytes:
            while cuts[q + 1] <= s + lo:
                q += 1
            hi = min(p.nbytes, cuts[q + 1] - s)
            out[q].append(_Part(p, lo, hi))
            lo = hi
    return out


def _batches(parts: list[_Part], size: int) -> list[list[_Part]]:
    """A share cut into batches of at most ``size`` bytes (a part that may not
    be cut and is larger gets a batch of its own)."""
    out: list[list[_Part]] = [[]]
    used = 0
    for part in parts:
        lo = part.lo
        while lo < part.hi:
            room = size - used
            n = part.hi - lo
            if n > room:
                if part.piece.splittable:
                    n = (lo + room) // SPLIT * SPLIT - lo  # a cut at a MiB from the start
                else:
                    n = 0 if used else n
            if n <= 0:
                out.append([])
                used = 0
                continue
            out[-1].append(_Part(part.piece, lo, lo + n))
            used += n
            lo += n
            if used >= size:
                out.append([])
                used = 0
    return [b for b in out if b]


# --------------------------------------------------------------------------- where bytes land


@dataclasses.dataclass
class _Landing:
    """Where one batch's bytes land on this rank, and the collectives that move them."""

    #: Bytes in buffers per communication device type ("cpu", "cuda").
    sizes: dict[str, int]
    #: (part, device type, arena offset or None for in place)
    slots: list[tuple[_Part, str, int | None]]
    #: Device types of the small parts' packed buffer, in order; their spans.
    packed: dict[str, tuple[int, int]]
    nbytes: int = 0
    #: Filled by bind(): the tensors to broadcast, in order.
    ops: list[torch.Tensor] = dataclasses.field(default_factory=list)
    mems: list[tuple[_Part, torch.Tensor]] = dataclasses.field(default_factory=list)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


class Session:
    """One call (a load) run on every rank of ``group`` together (see the module doc)."""

    def __init__(self, group: Any, what: str) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{what}: group= needs torch.distributed initialized")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup, not {type(group).__name__}"
            )
        self.dist = dist
        self.group = group
        self.what = what
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        try:
            types = {d.type for d in group._device_types}
        except (AttributeError, RuntimeError):  # an older torch: from the backend's name
            name = str(dist.get_backend(group))
            types = ({"cuda"} if "nccl" in name else set()) | ({"cpu"} if "gloo" in name else set())
        self.types = types or {"cpu"}
        #: Set once every rank knows the call failed: no exchange is owed.
        self.settled = False
        self.bytes_read = 0
        self.bytes_received = 0
        self.unchecked: list[str] = []

    # ---- exchanges

    def exchange(self, entry: dict[str, Any]) -> list[Any]:
        """Every rank's ``entry``; raises on every rank where one failed or differs."""
        got: list[Any] = [None] * self.size
        self.dist.all_gather_object(got, entry, group=self.group)
        self._judge(got)
        return got

    def fail(self, e: BaseException) -> None:
        """Tell every rank this one failed with ``e`` (their exchange raises)."""
        if self.settled:
            return
        self.settled = True
        try:
            self.exchange({"kind": "error", "error": (type(e).__name__, _short(str(e)))})
        except GroupLoadError:
            pass  # another rank failed too: this rank raises its own error

    def _judge(self, got: list[Any]) -> None:
        mine = got[self.rank]
        bad = [
            (r, e) for r, e in enumerate(got) if not isinstance(e, dict) or e.get("kind") == "error"
        ]
        if bad:
            self.settled = True
            if mine.get("kind") == "error":
                return  # the caller raises its own error
            r, e = bad[0]
            kind, msg = e.get("error", ("?", "")) if isinstance(e, dict) else ("?", repr(e))
            raise PeerLoadError(f"{self.what}: rank {r} failed: {kind}: {msg}", r, kind)
        ref = got[0]
        for r, e in enumerate(got):
            diff = _difference(ref, e, r)
            if diff:
                self.settled = True
                raise GroupMismatchError(f"{self.what}: {diff}", r)

    # ---- the shared read

    def comm(self, dev: torch.device) -> str:
        """The device type whose collectives move bytes bound for ``dev``."""
        if dev.type in self.types:
            return dev.type
        return "cuda" if "cuda" in self.types and torch.cuda.is_available() else "cpu"

    def _device(self, kind: str) -> torch.device:
        if kind == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(kind)

    def read(
        self, files: Sequence[Any], pieces: list[Piece], io: IoOptions, verify: bool = False
    ) -> dict[str, Any]:
        """Fill every piece on every rank, each read from storage by one rank.
        ``files``: what the pieces' ``file`` indexes (``.path``, ``.file``: a
        native Reader or DeviceFile, ``.size``); ``io``: the engine knobs
        (:class:`~ckptio.io.engines.IoOptions`). Returns the stats of this rank's reads, with
        "bytes" (all the pieces), "bytes_read" and "bytes_received"."""
        self.agree(files, pieces, verify)
        return self.share(files, pieces, io, verify)

    def agree(self, files: Sequence[Any], pieces: list[Piece], verify: bool = False) -> None:
        """The exchange before any data moves (see the module doc); ``verify`` too:
        the ranks' collectives after the reads depend on it."""
        h = hashlib.sha1()
        for p in sorted(pieces, key=lambda p: _order(p, self.comm(p.device))):
            h.update(
                struct.pack(
                    "<qqq?", -1 if p.file is None else p.file, p.offset, p.nbytes, p.splittable
                )
            )
            h.update(self.comm(p.device).encode())
        entry = {
            "kind": "read",
            "files": [(f.size, _records_digest(f)) for f in files],
            "pieces": (len(pieces), sum(p.nbytes for p in pieces), h.hexdigest()),
            "verify": bool(verify),
            # Names may differ (a copy per node): only in messages.
            "names": [f.path for f in files],
        }
        self.exchange(entry)

    def share(
        self, files: Sequence[Any], pieces: list[Piece], io: IoOptions, verify: bool
    ) -> dict[str, Any]:
        ordered = sorted(pieces, key=lambda p: _order(p, self.comm(p.device)))
        sched = [_batches(s, BATCH) for s in _shares(ordered, self.size)]
        return _Rounds(self, list(files), sched, io, verify).run()


def _records_digest(f: Any) -> str:
    """A digest of a file's records: a torch archive's (name, offset, size,
    stored CRC-32) table (its content: two archives of one layout and other
    bytes differ here; and an object's version), a safetensors file's header."""
    h = hashlib.sha1()
    native = f.file
    version = getattr(native, "version", None)  # an object in a store: the one read
    if version is not None:
        h.update(f"version\0{version}\n".encode())
    if hasattr(native, "records"):
        crcs = dict(native.checksums()) if hasattr(native, "checksums") else {}
        for name, off, size in native.records():
            # Without the archive's prefix (the file's name when torch saved it).
            h.update(f"{name.partition('/')[2]}\0{off}\0{size}\0{crcs.get(name)}\n".encode())
    else:
        fd = native.fileno()
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(head + (os.pread(fd, min(n, 100_000_000), 8) if n else b""))
    return h.hexdigest()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _difference(ref: dict[str, Any], e: dict[str, Any], r: int) -> str | None:
    """How rank ``r``'s entry differs from rank 0's, in words (None: it does not)."""
    same = {k: v for k, v in e.items() if k != "names"}
    if same == {k: v for k, v in ref.items() if k != "names"}:
        return None
    if e.get("kind") != ref.get("kind"):
        what: dict[str | None, str] = {
            "read": "reading the checkpoint",
            "end": "done with the load",
        }
        there, here = (what.get(x.get("kind"), x.get("kind")) for x in (e, ref))
        return (
            f"rank {r} is {there} where rank 0 is {here}: the ranks load the checkpoint differently"
        )
    fa, fb = ref.get("files", []), e.get("files", [])
    if len(fa) != len(fb):
        return f"rank {r} reads {len(fb)} file(s), rank 0 {len(fa)}"
    names = zip(ref.get("names", []), e.get("names", []), strict=True)
    for (sa, da), (sb, db), (na, nb) in zip(fa, fb, names, strict=True):
        if sa != sb:
            return (
                f"rank {r} sees a different file: {nb} is {sb} bytes there, "
                f"{na} {sa} bytes on rank 0"
            )
        if da != db:
            return (
                f"rank {r} sees a different file: the records of {nb} (names, offsets, "
                f"sizes, stored CRC-32s) differ from those of {na} on rank 0"
            )
    if e.get("verify") != ref.get("verify"):
        return (
            f"rank {r} loads with verify={e.get('verify')}, rank 0 with "
            f"verify={ref.get('verify')}: the ranks must check the checkpoint alike"
        )
    (ca, ba, _), (cb, bb, _) = ref["pieces"], e["pieces"]
    return (
        f"rank {r} reads {cb} piece(s) ({_mib(bb)}) of the checkpoint, rank 0 {ca} ({_mib(ba)}), "
        "or others: the destinations (out=, keys, devices, verify) differ between the ranks"
    )


def _short(s: str, n: int = 2000) -> str:
    return s if len(s) <= n else s[:n] + "..."


# --------------------------------------------------------------------------- rounds


class _Rounds:
    """The rounds of one shared read (see the module doc, step 3)."""

    def __init__(
        self,
        s: Session,
        files: list[Any],
        sched: list[list[list[_Part]]],
        io: IoOptions,
        verify: bool,
    ) -> None:
        self.s = s
        self.files = files
        self.sched = sched
        self.io = io
        self.verify = verify
        self.mine = sched[s.rank]
        self.stats: list[dict[str, Any]] = []
        self.done: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue()
        # The reader runs ahead of the rounds while the buffers of the batches
        # it has read but not yet shared stay within AHEAD (parts read in place
        # cost nothing: the disk stays busy).
        self.ahead = threading.Condition()
        self.held = 0
        self.stop = False
        self.devices: set[torch.device] = set()

    # ---- layouts

    def _layout(self, batch: list[_Part]) -> _Landing:
        sizes: dict[str, int] = {}
        slots: list[tuple[_Part, str, int | None]] = []
        small: dict[str, list[_Part]] = {}
        nbytes = 0
        for part in batch:
            p = part.piece
            kind = self.s.comm(p.device)
            nbytes += part.nbytes
            if part.nbytes < SMALL:
                small.setdefault(kind, []).append(part)
                continue
            if p.target is not None and p.target.device.type == kind:
                slots.append((part, kind, None))
                continue
            # Where O_DIRECT can land straight: the file offset's phase in a page.
            phase = 0 if p.file is None else (p.offset + part.lo) % 4096
            at = _align(sizes.get(kind, 0), 4096) + phase
            slots.append((part, kind, at))
            sizes[kind] = at + part.nbytes
        packed: dict[str, tuple[int, int]] = {}
        for kind in sorted(small):
            start = at = _align(sizes.get(kind, 0), 4096)
            for part in small[kind]:
                slots.append((part, kind, at))
                at = _align(at + part.nbytes, 64)
            packed[kind] = (start, at)
            sizes[kind] = at
        return _Landing(sizes, slots, packed, nbytes)

    def _bind(self, land: _Landing) -> None:
        """Buffers, a tensor for each slot and the batch's collectives, in an
        order every rank shares."""
        arenas = {
            kind: torch.empty(n, dtype=torch.uint8, device=self.s._device(kind))
            for kind, n in land.sizes.items()
            if n
        }
        land.ops = [arenas[kind][a:b] for kind, (a, b) in sorted(land.packed.items()) if b > a]
        land.mems = []
        for part, kind, at in land.slots:
            p = part.piece
            if at is None:
                assert p.target is not None
                mem = p.target[part.lo : part.hi]
            else:
                mem = arenas[kind][at : at + part.nbytes]
            land.mems.append((part, mem))
            if mem.device.type == "cuda":
                self.devices.add(mem.device)
            if part.nbytes >= SMALL:
                land.ops.append(mem)

    # ---- this rank's reads (a thread)

    def _reader(self, stream: Any) -> None:
        # The caller's stream, as a load without a group uses: the buffers are
        # the caller's stream's, and the reads come after its queued work.
        if stream is not None:
            torch.cuda.set_stream(stream)
        for r, batch in enumerate(self.mine):
            land = self._layout(batch)
            need = sum(land.sizes.values())
            with self.ahead:

                def room(n: int = need) -> bool:
                    return self.stop or not self.held or self.held + n <= AHEAD

                self.ahead.wait_for(room)
                if self.stop:
                    return
                self.held += need
            try:
                self._bind(land)
                self.stats += self._read(land)
                self.done.put((r, land, None))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.done.put((r, None, e))
                return

    def _release(self, land: _Landing) -> None:
        with self.ahead:
            self.held -= sum(land.sizes.values())
            self.ahead.notify()

    def _read(self, land: _Landing) -> list[dict[str, Any]]:
        per_file: dict[int, tuple[list[transfer.Segment], list[Any]]] = {}
        filled: set[torch.device] = set()
        for part, mem in land.mems:
            p = part.piece
            if p.file is None:  # this rank's bytes already (whole pieces only)
                if not _same(mem, p.target):
                    if p.target is not None:
                        mem.copy_(p.target)
                    elif p.fill is not None:
                        p.fill(mem)
                    filled.add(mem.device)
                continue
            segs, owners = per_file.setdefault(p.file, ([], []))
            dev = -1 if mem.device.type == "cpu" else mem.device.index
            segs.append((p.offset + part.lo, mem.data_ptr(), part.nbytes, dev))
            owners.append(mem)
        for d in filled:  # copies on this thread's stream, which no other waits for
            if d.type == "cuda":
                torch.cuda.current_stream(d).synchronize()
        if not per_file:
            return []
        stats = transfer.read_files(self.files, per_file, self.io, self.verify)
        self.s.bytes_read += sum(st["bytes"] for st in stats)
        return stats

    # ---- the rounds (the calling thread)

    def run(self) -> dict[str, Any]:
        s = self.s
        rounds = max((len(b) for b in self.sched), default=0)
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        thread = threading.Thread(
            target=self._reader, args=(stream,), name="ckptio-group-read", daemon=True
        )
        if self.mine:
            thread.start()
        faults = threading.Thread(target=self._prefault, name="ckptio-group-fault", daemon=True)
        faults.start()
        try:
            for r in range(rounds):
                self._round(r)
        finally:
            with self.ahead:
                self.stop = True
                self.ahead.notify()
            for t in (thread, faults):
                if t.is_alive():
                    t.join()
        for d in self.devices:
            torch.cuda.current_stream(d).synchronize()
        out = reports.merged(self.stats, self.io.backend)
        if self.verify:  # the records other ranks checked count as checked
            lists: list[Any] = [None] * s.size
            mine = (
                [n for st in self.stats for n in st.get("verified", ())],
                [n for st in self.stats for n in st.get("unchecked", ())],
            )
            s.dist.all_gather_object(lists, mine, group=s.group)
            out["verified"] = sorted({n for v, _ in lists for n in v})
            out["unchecked"] = sorted({n for _, u in lists for n in u})
        total = sum(p.nbytes for b in self.sched for batch in b for p in batch)
        out["bytes"] = total
        out["bytes_read"] = s.bytes_read
        out["bytes_received"] = s.bytes_received
        return out

    def _prefault(self) -> None:
        """Fault in the host memory the other ranks' parts land in, round by
        round ahead of the broadcasts: the kernel does it in one call per part
        (a receive into fresh memory otherwise takes a trap per page, and ran at
        a third of the speed on a 2-core machine)."""
        rounds = max((len(b) for b in self.sched), default=0)
        for r in range(rounds):
            for q, batches in enumerate(self.sched):
                if q == self.s.rank or r >= len(batches):
                    continue
                for part in batches[r]:
                    t = part.piece.target
                    if self.stop:
                        return
                    if t is None or t.device.type != "cpu" or part.nbytes < SMALL:
                        continue
                    if not memory.populate(t.data_ptr() + part.lo, part.nbytes):
                        return

    def _round(self, r: int) -> None:
        """Batch ``r`` of every rank: every rank's status, then every batch
        broadcast from its reader (all at once: the group's backends move them
        side by side), then the bytes in buffers go to their destinations."""
        s = self.s
        dist = s.dist
        err: BaseException | None = None
        lands: list[tuple[int, _Landing]] = []
        try:
            for q, batches in enumerate(self.sched):
                if r >= len(batches):
                    continue
                if q == s.rank:
                    got, land, e = self.done.get()
                    assert got == r
                    if e is not None:
                        raise e
                else:
                    land = self._layout(batches[r])
                    self._bind(land)
                lands.append((q, land))
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            err = e
        kind = "cpu" if "cpu" in s.types else "cuda"
        status = torch.zeros(s.size, dtype=torch.int32, device=s._device(kind))
        if err is not None:
            status[s.rank] = 1
        dist.all_reduce(status, group=s.group)
        failed = [q for q, v in enumerate(status.tolist()) if v]
        if failed:
            try:
                self._fail(failed, err)
            finally:
                del err  # see _fail
        works = [
            dist.broadcast(t, src=dist.get_global_rank(s.group, q), group=s.group, async_op=True)
            for q, land in lands
            for t in land.ops
        ]
        for w in works:
            w.wait()
        for q, land in lands:
            if q != s.rank:
                s.bytes_received += land.nbytes
            self._finish(land, q == s.rank)
            if q == s.rank:
                self._release(land)

    def _finish(self, land: _Landing, mine: bool) -> None:
        """Bytes in buffers go to their destinations; then each piece's ``done``."""
        dsts: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        done = []
        with torch.no_grad():
            for part, mem in land.mems:
                p = part.piece
                if mine and p.file is None:
                    continue  # the owner's bytes came from their destination
                if p.done is not None:
                    done.append(p.done)
                if p.target is not None:
                    dst = p.target[part.lo : part.hi]
                    if _same(dst, mem):
                        continue
                    a, b = dsts.setdefault(dst.device, ([], []))
                    a.append(dst)
                    b.append(mem)
                    if dst.device.type == "cuda":
                        self.devices.add(dst.device)
                elif p.finish is not None:
                    p.finish(mem)
                    if p.device.type == "cuda":
                        self.devices.add(p.device)
            for a, b in dsts.values():
                torch._foreach_copy_(a, b)
        for fn in done:
            fn()

    def _fail(self, failed: list[int], err: BaseException | None) -> None:
        s = self.s
        s.settled = True
        with self.ahead:
            self.stop = True
            self.ahead.notify()
        msgs: list[Any] = [None] * s.size
        mine = None if err is None else (type(err).__name__, _short(str(err)))
        s.dist.all_gather_object(msgs, mine, group=s.group)
        if err is not None:
            # Frames that hold the error they raise make a cycle through its
            # traceback, which keeps the group (and its backend's threads)
            # alive until the garbage collector runs: destroy_process_group()
            # then frees nothing, and gloo's threads, still alive at exit, can
            # abort the process ("terminate called without an active exception").
            try:
                raise err
            finally:
                del err
        q = failed[0]
        kind, msg = msgs[q] or ("?", "")
        raise PeerLoadError(f"{s.what}: rank {q} failed to read its share: {kind}: {msg}", q, kind)


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.device == b.device and a.data_ptr() == b.data_ptr()


# --------------------------------------------------------------------------- sessions

_current: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "ckptio_group_session", default=None
)


def current() -> Session | None:
    """The session the calling code runs in (None: reading alone)."""
    return _current.get()


def run(group: Any, what: str, call: Callable[[], T]) -> T:
    """``call()`` as one session of every rank of ``group`` (see the module doc)."""
    s = Session(group, what)
    if s.size == 1:
        return call()
    token = _current.set(s)
    try:
        result = call()
    except Exception as e:
        s.fail(e)
        raise
    finally:
        _current.reset(token)
    s.exchange({"kind": "end"})
    return result


def groupable(what: str, path_arg: int = 0) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A load function whose ``group=`` keyword runs it as a session (:func:`run`);
    positional argument ``path_arg`` names the checkpoint in messages."""

    def deco(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            group = kwargs.pop("group", None)
            if group is None:
                return fn(*args, **kwargs)
            label = what
            if len(args) > path_arg and isinstance(args[path_arg], (str, os.PathLike)):
                label = f"{what}({os.fspath(args[path_arg])!r})"
            return run(group, label, lambda: fn(*args, **kwargs))

        return wrapper

    return deco
