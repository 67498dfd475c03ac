//! A file for aligned positional I/O.
//!
//! Each [`IoFile`] holds two descriptors of one file, like KvikIO: a buffered one,
//! always there, and an O_DIRECT one where the filesystem takes it. Aligned
//! ranges go through O_DIRECT (no page-cache copy, no cache pollution), the
//! unaligned head and tail of a range through the buffered descriptor. On tmpfs
//! or any filesystem refusing O_DIRECT (EINVAL) the file is simply buffered.
//!
//! Writes split on whole memory pages ([`IoFile::write_unit`]), never finer,
//! even where O_DIRECT takes 512-byte blocks: the kernel warns that a buffered
//! and a direct write to one page at the same time can write a stale page back
//! over the direct data, and the engine's threads write neighbouring ranges at
//! the same time. A page that two ranges share is only ever written buffered.
//!
//! The loops here handle short transfers and EINTR; a read that meets the end of
//! the file before the bytes it needs is a typed `Format` error (a truncated file).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::io::align::{self, DioAlign};
use crate::io::mapped::FileMap;
use crate::{Error, Result};

/// Whether to use O_DIRECT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DirectMode {
    /// Where the filesystem takes it.
    #[default]
    Auto,
    /// Never: every byte through the page cache.
    Off,
    /// Always: opening fails when the filesystem refuses O_DIRECT.
    Required,
}

impl std::str::FromStr for DirectMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(DirectMode::Auto),
            "off" | "0" | "false" | "no" => Ok(DirectMode::Off),
            "on" | "1" | "true" | "yes" | "required" => Ok(DirectMode::Required),
            other => Err(Error::invalid(format!(
                "direct I/O mode must be auto, on or off, not {other:?}"
            ))),
        }
    }
}

/// One open file: a buffered descriptor and, where possible, an O_DIRECT one.
#[derive(Debug)]
pub struct IoFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    align: DioAlign,
    /// Why O_DIRECT is not used, when it is not.
    no_direct_reason: Option<String>,
    /// The file lives in memory (tmpfs): its I/O is CPU copies, not device requests.
    in_memory: bool,
    /// Opened for writing (else reads only).
    writable: bool,
    /// Reads copy from this mapping of the file's page cache instead of pread
    /// ([`IoFile::memory_view`]).
    mapped: Option<FileMap>,
    /// Test only: every pwrite as (through O_DIRECT, offset, length).
    #[cfg(test)]
    trace: Option<std::sync::Mutex<Vec<(bool, u64, usize)>>>,
}

impl IoFile {
    /// Open an existing regular file for reading. Anything else is refused
    /// before a byte is read: a folder (EISDIR), a FIFO, a socket or a device
    /// (a read of those blocks for ever or never ends). The open itself does
    /// not block: O_NONBLOCK, cleared once the file is known to be regular.
    pub fn open_read(path: &Path, mode: DirectMode) -> Result<Self> {
        let buffered = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io_at("open", path, e))?;
        check_regular(&buffered, path)?;
        clear_nonblock(&buffered);
        Self::with_direct(buffered, path, false, libc::O_RDONLY, mode)
    }

    /// Open `path` as `os.open(path, flags, 0o644)` does (`GdsFile`): the
    /// caller's access mode and creation and status flags (O_CREAT, O_EXCL,
    /// O_TRUNC, O_TMPFILE, O_SYNC...) on the buffered descriptor, less
    /// O_DIRECT, which the second descriptor adds where the filesystem takes
    /// it; that one has the same access mode and O_SYNC, O_DSYNC and
    /// O_NOATIME, so a read of a file opened O_WRONLY (or a write of one
    /// opened O_RDONLY) fails with EBADF on either, and with O_SYNC / O_DSYNC
    /// every write is durable when it returns. Writable unless O_RDONLY.
    ///
    /// Refused before anything is opened (`InvalidArgument`): a negative
    /// `flags`, O_APPEND (on
    /// Linux a pwrite on an O_APPEND descriptor appends, wherever the offset
    /// says), O_PATH (no reads or writes) and an access mode that is none of
    /// O_RDONLY, O_WRONLY, O_RDWR. A file that is not regular is refused as
    /// by [`Self::open_read`] (the open itself does not block: O_NONBLOCK,
    /// cleared after unless the caller asked for it).
    pub fn open_flags(path: &Path, flags: i32, mode: DirectMode) -> Result<Self> {
        use std::ffi::CString;
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;
        if flags < 0 {
            return Err(Error::invalid(format!(
                "flags must be os.open flags (an int >= 0), not {flags}"
            )));
        }
        let refused = [
            (
                libc::O_APPEND,
                "O_APPEND is not supported: every write goes to the offset given, \
                 and on Linux a pwrite on an O_APPEND descriptor appends instead",
            ),
            (
                libc::O_PATH,
                "O_PATH is not supported: such a descriptor cannot read or write",
            ),
        ];
        if let Some((_, why)) = refused.iter().find(|(f, _)| flags & f != 0) {
            return Err(Error::invalid(format!("flags: {why}")));
        }
        let access = flags & libc::O_ACCMODE;
        if access == libc::O_ACCMODE {
            return Err(Error::invalid(
                "flags: the access mode must be O_RDONLY, O_WRONLY or O_RDWR",
            ));
        }
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::invalid("the path contains a NUL byte"))?;
        let open_flags = (flags & !libc::O_DIRECT) | libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: a NUL-terminated path; the mode is read only with O_CREAT or O_TMPFILE.
        let fd = unsafe { libc::open(c.as_ptr(), open_flags, 0o644 as libc::c_uint) };
        if fd < 0 {
            return Err(Error::io_at("open", path, io::Error::last_os_error()));
        }
        // SAFETY: a descriptor just opened, owned by nothing else.
        let buffered = unsafe { File::from_raw_fd(fd) };
        check_regular(&buffered, path)?;
        if flags & libc::O_NONBLOCK == 0 {
            clear_nonblock(&buffered);
        }
        let carried = access | (flags & (libc::O_SYNC | libc::O_DSYNC | libc::O_NOATIME));
        Self::with_direct(buffered, path, access != libc::O_RDONLY, carried, mode)
    }

    /// Wrap a file already open for writing (e.g. a temp file made by
    /// [`crate::io::persist`]) and add an O_DIRECT descriptor to it.
    pub fn from_writable(file: File, path: &Path, mode: DirectMode) -> Result<Self> {
        Self::with_direct(file, path, true, libc::O_RDWR, mode)
    }

    /// `direct_flags`: the access mode and status flags of the O_DIRECT descriptor.
    fn with_direct(
        buffered: File,
        path: &Path,
        write: bool,
        direct_flags: i32,
        mode: DirectMode,
    ) -> Result<Self> {
        let align = align::dio_align(buffered.as_raw_fd());
        let in_memory = align::is_tmpfs_fd(buffered.as_raw_fd());
        let (direct, reason) = match mode {
            DirectMode::Off => (None, Some("O_DIRECT disabled by configuration".to_string())),
            // Linux >= 6.6 accepts O_DIRECT on tmpfs but it buys nothing there
            // (memory is the storage) and would force aligned staging copies.
            DirectMode::Auto if in_memory => (
                None,
                Some("tmpfs: the page cache is the storage".to_string()),
            ),
            _ => match reopen_direct(&buffered, direct_flags) {
                Ok(f) => (Some(f), None),
                Err(e) if mode == DirectMode::Required => {
                    return Err(Error::io_at("open with O_DIRECT", path, e));
                }
                Err(e) => (None, Some(format!("filesystem refused O_DIRECT: {e}"))),
            },
        };
        Ok(IoFile {
            path: path.to_path_buf(),
            buffered,
            direct,
            align,
            no_direct_reason: reason,
            in_memory,
            writable: write,
            mapped: None,
            #[cfg(test)]
            trace: None,
        })
    }

    /// The same file for reading its bytes from memory (tmpfs, or pages in the
    /// page cache): buffered only (a duplicate of the buffered descriptor),
    /// counted as in memory (memory threads and chunks), and reading through
    /// `map` where given. `why` says why there is no O_DIRECT.
    pub fn memory_view(&self, map: Option<FileMap>, why: &str) -> Result<IoFile> {
        let buffered = self
            .buffered
            .try_clone()
            .map_err(|e| Error::io_at("dup", &self.path, e))?;
        Ok(IoFile {
            path: self.path.clone(),
            buffered,
            direct: None,
            align: self.align,
            no_direct_reason: Some(why.to_string()),
            in_memory: true,
            writable: self.writable,
            mapped: map,
            #[cfg(test)]
            trace: None,
        })
    }

    /// Whether reads copy from a mapping of the file ([`IoFile::memory_view`]).
    pub fn is_mapped(&self) -> bool {
        self.mapped.is_some()
    }

    /// Test only: pretend O_DIRECT wants `a` (e.g. 512-byte blocks) and start
    /// logging every write ([`Self::take_trace`]).
    #[cfg(test)]
    pub(crate) fn fake_alignment(&mut self, a: DioAlign) {
        self.align = a;
        self.trace = Some(std::sync::Mutex::new(Vec::new()));
    }

    /// Test only: the writes logged since [`Self::fake_alignment`].
    #[cfg(test)]
    pub(crate) fn take_trace(&self) -> Vec<(bool, u64, usize)> {
        self.trace
            .as_ref()
            .map(|t| std::mem::take(&mut *t.lock().unwrap()))
            .unwrap_or_default()
    }

    fn pwrite(&self, fd: RawFd, buf: &[u8], off: u64) -> Result<()> {
        #[cfg(test)]
        if let Some(t) = &self.trace {
            let direct = self.direct.as_ref().is_some_and(|d| d.as_raw_fd() == fd);
            t.lock().unwrap().push((direct, off, buf.len()));
        }
        pwrite_all(fd, buf, off).map_err(|e| Error::io_at("pwrite", &self.path, e))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The buffered descriptor's file (always present).
    pub fn file(&self) -> &File {
        &self.buffered
    }

    pub fn alignment(&self) -> DioAlign {
        self.align
    }

    /// What writes split on: whole pages, or O_DIRECT's blocks where they are
    /// larger. A range written through O_DIRECT covers whole units, so it never
    /// shares a page with a buffered write of a neighbouring range.
    pub fn write_unit(&self) -> u64 {
        (self.align.offset as u64).max(align::page_size())
    }

    /// The descriptor cuFile should register: the O_DIRECT one where there is one.
    pub fn fd_for_device_io(&self) -> RawFd {
        self.direct.as_ref().unwrap_or(&self.buffered).as_raw_fd()
    }

    /// Opened for writing ([`IoFile::from_writable`]); else for reads only.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    pub fn no_direct_reason(&self) -> Option<&str> {
        self.no_direct_reason.as_deref()
    }

    /// Whether the file lives in memory (tmpfs), where reads and writes are
    /// memory copies that scale with CPU threads rather than a device queue.
    pub fn is_in_memory(&self) -> bool {
        self.in_memory
    }

    pub fn len(&self) -> Result<u64> {
        self.buffered
            .metadata()
            .map(|m| m.len())
            .map_err(|e| Error::io_at("stat", &self.path, e))
    }

    pub fn is_empty(&self) -> Result<bool> {
        self.len().map(|n| n == 0)
    }

    /// The O_DIRECT descriptor, if the range (offset, length, address) meets its alignment.
    fn direct_fd_for(&self, off: u64, len: usize, addr: usize) -> Option<RawFd> {
        let d = self.direct.as_ref()?;
        let ok = align::is_aligned(off, self.align.offset as u64)
            && align::is_aligned(len as u64, self.align.offset as u64)
            && align::is_aligned(addr as u64, self.align.memory as u64);
        ok.then(|| d.as_raw_fd())
    }

    /// Write all of `buf` at `off`: the aligned middle through O_DIRECT when the
    /// memory allows it, head and tail buffered.
    pub fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        let (head, mid, tail) = self.split(off, buf, self.write_unit());
        let fd = self.buffered.as_raw_fd();
        if !head.is_empty() {
            self.pwrite(fd, head, off)?;
        }
        let mid_off = off + head.len() as u64;
        if !mid.is_empty() {
            let dfd = self
                .direct_fd_for(mid_off, mid.len(), mid.as_ptr() as usize)
                .unwrap_or(fd);
            self.pwrite(dfd, mid, mid_off)?;
        }
        if !tail.is_empty() {
            let tail_off = mid_off + mid.len() as u64;
            self.pwrite(fd, tail, tail_off)?;
        }
        Ok(())
    }

    /// Fill all of `buf` from `off`. Meeting the end of the file first is a
    /// `Format` error (the file is truncated).
    pub fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        let total = buf.len();
        let (h, m) = {
            let (head, mid, _) = self.split(off, buf, self.align.offset as u64);
            (head.len(), mid.len())
        };
        let fd = self.buffered.as_raw_fd();
        let (head, rest) = buf.split_at_mut(h);
        let (mid, tail) = rest.split_at_mut(m);
        self.read_exact(fd, head, off, total)?;
        let mid_off = off + h as u64;
        let dfd = self
            .direct_fd_for(mid_off, mid.len(), mid.as_ptr() as usize)
            .unwrap_or(fd);
        self.read_exact(dfd, mid, mid_off, total)?;
        self.read_exact(fd, tail, mid_off + m as u64, total)
    }

    /// Read whole aligned blocks `[off, off+buf.len())` through O_DIRECT (or
    /// buffered when there is none), stopping early only at end of file.
    /// Returns the bytes read. `off`, `buf.len()` and `buf`'s address must meet
    /// [`Self::alignment`] when the file is direct.
    pub fn read_blocks_upto(&self, buf: &mut [u8], off: u64) -> Result<usize> {
        let fd = self
            .direct_fd_for(off, buf.len(), buf.as_ptr() as usize)
            .unwrap_or(self.buffered.as_raw_fd());
        self.pread(fd, buf, off)
    }

    /// Fill `buf` from `off` until the end of the file: from the mapping where
    /// there is one (pread for what lies past it: the file grew), else pread.
    fn pread(&self, fd: RawFd, buf: &mut [u8], off: u64) -> Result<usize> {
        let mut done = 0;
        if let Some(m) = &self.mapped {
            done = m.read_upto(buf, off)?;
            if done == buf.len() {
                return Ok(done);
            }
        }
        let n = pread_upto(fd, &mut buf[done..], off + done as u64)
            .map_err(|e| Error::io_at("pread", &self.path, e))?;
        Ok(done + n)
    }

    /// [`Self::read_blocks_upto`] for a range whose first `need` bytes must be
    /// in the file: meeting its end sooner is a `Format` error (truncated file).
    pub fn read_blocks_needed(&self, buf: &mut [u8], off: u64, need: usize) -> Result<()> {
        let got = self.read_blocks_upto(buf, off)?;
        if got < need {
            return Err(Error::format(
                Some(&self.path),
                format!(
                    "file ends at byte {} but data runs to byte {}",
                    off + got as u64,
                    off + need as u64
                ),
            ));
        }
        Ok(())
    }

    /// Write whole [`Self::write_unit`]s through O_DIRECT when possible.
    pub fn write_blocks(&self, buf: &[u8], off: u64) -> Result<()> {
        let unit = self.write_unit();
        let whole = align::is_aligned(off, unit) && align::is_aligned(buf.len() as u64, unit);
        let fd = self
            .direct_fd_for(off, buf.len(), buf.as_ptr() as usize)
            .filter(|_| whole)
            .unwrap_or(self.buffered.as_raw_fd());
        self.pwrite(fd, buf, off)
    }

    fn read_exact(&self, fd: RawFd, buf: &mut [u8], off: u64, total: usize) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let n = self.pread(fd, buf, off)?;
        if n < buf.len() {
            return Err(Error::format(
                Some(&self.path),
                format!(
                    "file ends at byte {} but {total} bytes are needed from a range starting near {off}",
                    off + n as u64
                ),
            ));
        }
        Ok(())
    }

    /// Split `[off, off+len)` into a head, a middle of whole `a`-byte units
    /// and a tail (by file offset). Without O_DIRECT everything is "head".
    fn split<'a>(&self, off: u64, buf: &'a [u8], a: u64) -> (&'a [u8], &'a [u8], &'a [u8]) {
        if self.direct.is_none() {
            return (buf, &[], &[]);
        }
        let end = off + buf.len() as u64;
        let mid_start = align::align_up(off, a).min(end);
        let mid_end = align::align_down(end, a).max(mid_start);
        let h = (mid_start - off) as usize;
        let m = (mid_end - mid_start) as usize;
        let (head, rest) = buf.split_at(h);
        let (mid, tail) = rest.split_at(m);
        (head, mid, tail)
    }

    /// Preallocate `[0, len)` so that a full disk fails now, not mid-write,
    /// and the data lands in few extents. Filesystems without fallocate are fine.
    pub fn preallocate(&self, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        crate::io::fault::hit(crate::io::fault::Point::Fallocate, &self.path)?;
        // SAFETY: fallocate on a valid fd with in-range arguments.
        let rc = unsafe { libc::fallocate(self.buffered.as_raw_fd(), 0, 0, len as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) => Ok(()),
            _ => Err(Error::io_at("fallocate", &self.path, e)),
        }
    }

    /// fsync the file (data and metadata).
    pub fn sync(&self) -> Result<()> {
        self.buffered
            .sync_all()
            .map_err(|e| Error::io_at("fsync", &self.path, e))
    }
}

/// Refuse what is not a regular file: a folder (EISDIR), a FIFO, a socket
/// or a device (a read of those blocks for ever or never ends).
fn check_regular(f: &File, path: &Path) -> Result<()> {
    let meta = f.metadata().map_err(|e| Error::io_at("stat", path, e))?;
    if meta.is_dir() {
        return Err(Error::io_at(
            "open",
            path,
            io::Error::from_raw_os_error(libc::EISDIR),
        ));
    }
    if !meta.is_file() {
        let kind = file_kind(&meta);
        let why = format!("not a regular file: {kind}, not a checkpoint");
        return Err(Error::io_at(
            "open",
            path,
            io::Error::new(io::ErrorKind::InvalidInput, why),
        ));
    }
    Ok(())
}

/// Take O_NONBLOCK (set for the open) off `f`'s descriptor.
fn clear_nonblock(f: &File) {
    let fd = f.as_raw_fd();
    // SAFETY: F_GETFL / F_SETFL on a descriptor we own; only O_NONBLOCK changes.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
}

/// What a file that is not regular is, in an error message.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::MetadataExt;
    kind_of_mode(meta.mode())
}

/// What a file of `st_mode` `mode` that is not regular is, in an error message.
pub(crate) fn kind_of_mode(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFIFO => "a FIFO (named pipe)",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "not a file",
    }
}

/// A second, independent open of the same file with O_DIRECT, with the
/// access mode and status flags of `flags`. Opening /proc/self/fd/N makes a
/// new open file description, so O_DIRECT does not leak onto the buffered
/// descriptor (fcntl would set it on both).
fn reopen_direct(file: &File, flags: i32) -> io::Result<File> {
    let proc = format!("/proc/self/fd/{}", file.as_raw_fd());
    let access = flags & libc::O_ACCMODE;
    OpenOptions::new()
        .read(access != libc::O_WRONLY)
        .write(access != libc::O_RDONLY)
        .custom_flags((flags & !libc::O_ACCMODE) | libc::O_DIRECT | libc::O_CLOEXEC)
        .open(proc)
}

/// Run a positional transfer to completion: `op(done)` moves bytes from
/// `done` on and returns what the syscall returned. Retries EINTR, continues
/// after short transfers, stops when `op` returns 0. Returns the bytes moved.
fn transfer_all(len: usize, mut op: impl FnMut(usize) -> isize) -> io::Result<usize> {
    let mut done = 0usize;
    while done < len {
        let n = op(done);
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

/// pread until `buf` is full or the end of the file; returns the bytes read.
pub fn pread_upto(fd: RawFd, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let len = buf.len();
    let ptr = buf.as_mut_ptr();
    transfer_all(len, |done| {
        // SAFETY: [ptr+done, ptr+len) lies within `buf`.
        unsafe {
            libc::pread(
                fd,
                ptr.add(done).cast(),
                len - done,
                (off + done as u64) as libc::off_t,
            )
        }
    })
}

/// pwrite all of `buf` at `off`, across short writes and EINTR.
pub fn pwrite_all(fd: RawFd, buf: &[u8], off: u64) -> io::Result<()> {
    let len = buf.len();
    let ptr = buf.as_ptr();
    let done = transfer_all(len, |done| {
        // SAFETY: [ptr+done, ptr+len) lies within `buf`.
        unsafe {
            libc::pwrite(
                fd,
                ptr.add(done).cast(),
                len - done,
                (off + done as u64) as libc::off_t,
            )
        }
    })?;
    if done < len {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "pwrite wrote nothing",
        ));
    }
    Ok(())
}

/// A new, empty file opened for reading and writing (for tests).
#[cfg(test)]
pub(crate) fn scratch(path: &Path, mode: DirectMode) -> IoFile {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap();
    IoFile::from_writable(f, path, mode).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::align::AlignedBuf;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn roundtrip(dir: &Path, mode: DirectMode) {
        let path = dir.join("f.bin");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let io = IoFile::from_writable(f, &path, mode).unwrap();
        // Unaligned offsets and lengths, from unaligned and aligned memory.
        let cases: &[(u64, usize)] = &[
            (0, 4096),
            (1, 10),
            (4095, 4098),
            (8192, 3 * 4096 + 17),
            (100_000, 1),
        ];
        for (i, &(off, len)) in cases.iter().enumerate() {
            let data = pattern(len, i as u8);
            io.write_at(&data, off).unwrap();
            let mut back = vec![0u8; len];
            io.read_at(&mut back, off).unwrap();
            assert_eq!(back, data, "case {i}");
            // Aligned memory too (the zero-copy O_DIRECT path).
            let mut ab = AlignedBuf::new(len, 4096).unwrap();
            io.read_at(&mut ab.as_mut_slice()[..len], off).unwrap();
            assert_eq!(&ab.as_slice()[..len], &data[..]);
        }
        io.sync().unwrap();
        // Reading past the end is a typed truncation error.
        let end = io.len().unwrap();
        let mut b = vec![0u8; 10];
        match io.read_at(&mut b, end - 5) {
            Err(Error::Format { .. }) => {}
            other => panic!("expected a Format error, got {other:?}"),
        }
    }

    #[test]
    fn roundtrip_on_disk_auto() {
        let d = tempfile::tempdir().unwrap();
        roundtrip(d.path(), DirectMode::Auto);
    }

    #[test]
    fn roundtrip_buffered() {
        let d = tempfile::tempdir().unwrap();
        roundtrip(d.path(), DirectMode::Off);
    }

    #[test]
    fn tmpfs_falls_back_to_buffered() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let d = tempfile::tempdir_in(shm).unwrap();
        roundtrip(d.path(), DirectMode::Auto);
        let path = d.path().join("g.bin");
        std::fs::write(&path, b"x").unwrap();
        let f = IoFile::open_read(&path, DirectMode::Auto).unwrap();
        assert!(!f.is_direct());
        assert!(f.no_direct_reason().is_some());
    }

    #[test]
    fn open_errors_are_typed() {
        let d = tempfile::tempdir().unwrap();
        match IoFile::open_read(&d.path().join("missing"), DirectMode::Auto) {
            Err(Error::Io { source, op, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
                assert_eq!(op, "open");
            }
            other => panic!("{other:?}"),
        }
        match IoFile::open_read(d.path(), DirectMode::Auto) {
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EISDIR)),
            Ok(_) => panic!("a folder opened as a file"),
        }
    }

    #[test]
    fn mode_parsing() {
        assert_eq!("AUTO".parse::<DirectMode>().unwrap(), DirectMode::Auto);
        assert_eq!("off".parse::<DirectMode>().unwrap(), DirectMode::Off);
        assert_eq!("on".parse::<DirectMode>().unwrap(), DirectMode::Required);
        assert!("sometimes".parse::<DirectMode>().is_err());
    }
}
