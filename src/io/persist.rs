//! Crash-safe replacement of a file, and the removal of what killed saves leave.
//!
//! [`AtomicFile::create`] makes a temp file beside the target, created
//! exclusively (`O_EXCL | O_NOFOLLOW`) in the target's folder so the final
//! rename cannot cross filesystems. [`AtomicFile::commit`] fsyncs the temp file,
//! renames it over the target and fsyncs the folder, in that order:
//!
//! | step | after a crash here |
//! | --- | --- |
//! | writing, fsync of the temp file | the old target is intact; a stale temp file may be left |
//! | rename | atomic: readers see the old or the new file, never a mix |
//! | fsync of the folder | the rename itself is now durable |
//!
//! Dropping an uncommitted `AtomicFile` removes the temp file.
//!
//! **Temp files and their liveness.** Temp files are named
//! `.<target name>.ckptio-<pid>-<nonce>.tmp` and carry an open-file-description
//! lock (`F_OFD_SETLK`, whole file) for as long as the save that made them has
//! them open: the kernel drops it when that process exits or is killed, in
//! whatever PID namespace it ran (and, on a filesystem with working locks such
//! as NFS, on whatever host). [`remove_stale_temps`] removes a file of that
//! pattern only after taking a lock on it, which proves that no save holds it;
//! the pid in the name is only informative. A writer takes its lock before it
//! writes anything and checks afterwards that its file is still linked, so a
//! cleanup that ran between the creation and the lock cannot take a live file.
//! Where the filesystem has no locks, nothing is proven dead and nothing is
//! removed (`ckptio clean` then says so by removing nothing).
//!
//! **Links.** A symbolic link at the target is followed by the kernel (an
//! `O_PATH` open, as `torch.save`'s own `open()` follows it), so
//! `fs.protected_symlinks` and the folders' permissions apply exactly as they
//! would to `torch.save`: the file the link resolves to is replaced, in its own
//! folder, and the link stays. A link to nothing is refused (ENOENT): no file
//! is created through a link.
//!
//! **Mode and owner.** A replaced file keeps its permission bits, and its owner
//! and group where the process may set them (root; or the group alone, for a
//! group the process is in). The temp file is created with the owner's bits
//! only (plus owner read and write while it is written), so nobody else can
//! open it before it has its final owner and mode; those are set before the
//! fsync. A new file gets 0o666 minus the umask, as with `open()`.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::io::fault::{self, Point};
use crate::{Error, Result};

const TMP_TAG: &str = ".ckptio-";
const TMP_SUFFIX: &str = ".tmp";
/// Attempts at a temp file that a concurrent cleanup removed before it was locked.
const CREATE_ATTEMPTS: usize = 8;

/// What a replaced file had: it keeps it.
#[derive(Clone, Copy, Debug)]
struct Kept {
    mode: u32,
    uid: u32,
    gid: u32,
}

pub struct AtomicFile {
    target: PathBuf,
    dir: File,
    target_name: OsString,
    tmp_name: OsString,
    tmp_path: PathBuf,
    /// The temp file; its open file description holds the liveness lock, so it
    /// stays open until the rename is done (or the name removed).
    file: Option<File>,
    kept: Option<Kept>,
    committed: bool,
}

impl AtomicFile {
    /// Create the temp file for replacing `target`, after removing the temp
    /// files of dead saves in its folder.
    pub fn create(target: &Path) -> Result<Self> {
        Self::create_with(target, true)
    }

    /// [`AtomicFile::create`]; `sweep`: remove the temp files of dead saves in
    /// the folder first (a save of many files does it once, not per file).
    pub fn create_with(target: &Path, sweep: bool) -> Result<Self> {
        let Located {
            dir,
            parent,
            name,
            target,
            kept,
        } = locate(target)?;
        if sweep {
            remove_stale_temps_in(&dir, &parent);
        }
        // Owner bits only until the final owner and mode are set (see the module doc).
        let mode = kept.map_or(0o666, |k| (k.mode & 0o700) | 0o600);
        let (tmp_name, tmp_path, file) = create_locked_temp(&dir, &parent, &name, mode)?;
        let me = AtomicFile {
            target,
            dir,
            target_name: name,
            tmp_name,
            tmp_path,
            file: Some(file),
            kept,
            committed: false,
        };
        if let Some(k) = kept {
            me.keep_owner(k);
        }
        Ok(me)
    }

    /// Give the temp file the replaced file's owner and group, where allowed.
    fn keep_owner(&self, k: Kept) {
        let fd = self.file().as_raw_fd();
        let Ok(m) = self.file().metadata() else {
            return;
        };
        if (m.uid(), m.gid()) == (k.uid, k.gid) {
            return;
        }
        // SAFETY: fchown on a descriptor we own; failure changes nothing.
        if unsafe { libc::fchown(fd, k.uid, k.gid) } != 0 {
            // Not root: the group alone may still be ours to give.
            // SAFETY: as above; uid_t::MAX (-1) leaves the owner as it is.
            unsafe { libc::fchown(fd, libc::uid_t::MAX, k.gid) };
        }
    }

    /// The open temp file.
    pub fn file(&self) -> &File {
        // `file` is only None after commit, which consumes self.
        self.file
            .as_ref()
            .unwrap_or_else(|| unreachable!("temp file used after commit"))
    }

    pub fn tmp_path(&self) -> &Path {
        &self.tmp_path
    }

    /// The file that will be replaced (links resolved by the kernel).
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Final mode, fsync the temp file, rename it over the target, fsync the folder.
    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().unwrap_or_else(|| unreachable!());
        if let Some(k) = self.kept {
            // After fchown (which clears set-id bits), before the fsync.
            // SAFETY: fchmod on a descriptor we own.
            if unsafe { libc::fchmod(file.as_raw_fd(), k.mode & 0o7777) } != 0 {
                let e = io::Error::last_os_error();
                self.file = Some(file);
                return Err(Error::io_at("chmod", &self.tmp_path, e));
            }
        }
        if let Err(e) = fault::hit(Point::Fsync, &self.tmp_path).and_then(|()| {
            file.sync_all()
                .map_err(|e| Error::io_at("fsync", &self.tmp_path, e))
        }) {
            self.file = Some(file); // Drop removes the name, then releases the lock
            return Err(e);
        }
        let from = cstr(&self.tmp_name)?;
        let to = cstr(&self.target_name)?;
        let fd = self.dir.as_raw_fd();
        // Hold the file being replaced open across the rename: otherwise the
        // rename drops its last link and frees all its blocks (tenths of a
        // second per GiB here, with online discard) before returning.
        let replaced = open_existing(fd, &to);
        let renamed = fault::hit(Point::Rename, &self.target).and_then(|()| {
            // SAFETY: valid dir fd and NUL-terminated names.
            if unsafe { libc::renameat(fd, from.as_ptr(), fd, to.as_ptr()) } != 0 {
                return Err(Error::io_at(
                    "rename",
                    &self.target,
                    io::Error::last_os_error(),
                ));
            }
            Ok(())
        });
        if let Err(e) = renamed {
            self.file = Some(file);
            return Err(e);
        }
        self.committed = true;
        // The lock may go now: the temp name no longer exists.
        drop(file);
        let synced = fault::hit(Point::FsyncDir, &self.target).and_then(|()| {
            self.dir
                .sync_all()
                .map_err(|e| Error::io_at("fsync folder of", &self.target, e))
        });
        // The new file is durable: free the old one's blocks off this thread
        // (on a worker thread: no thread of its own per save).
        if let Some(old) = replaced {
            crate::workers::detach(move || drop(old));
        }
        synced
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            // The name goes first, the lock (with the descriptor) after it: a
            // cleanup never finds this file unlocked under its name.
            if let Ok(c) = cstr(&self.tmp_name) {
                // SAFETY: valid dir fd and NUL-terminated name.
                unsafe { libc::unlinkat(self.dir.as_raw_fd(), c.as_ptr(), 0) };
            }
            self.file.take();
        }
    }
}

/// Where a save to some path lands, as the kernel resolves it.
struct Located {
    dir: File,
    parent: PathBuf,
    name: OsString,
    /// `parent/name`.
    target: PathBuf,
    kept: Option<Kept>,
}

fn split(target: &Path) -> Result<(PathBuf, OsString)> {
    if target.as_os_str().as_bytes().ends_with(b"/") {
        // A folder's name (open("x/", "wb") is EISDIR): file_name() would drop
        // the slash and make a file named as the folder.
        let e = io::Error::from_raw_os_error(libc::EISDIR);
        return Err(Error::io_at("save", target, e));
    }
    let name = target
        .file_name()
        .ok_or_else(|| Error::invalid(format!("{} does not name a file", target.display())))?
        .to_os_string();
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// The folder and name a save to `target` replaces: `target` itself, or the
/// file a symbolic link there resolves to, followed by the kernel (so
/// fs.protected_symlinks applies) and checked to be the file found under its
/// resolved name.
fn locate(target: &Path) -> Result<Located> {
    let (parent, name) = split(target)?;
    let dir = open_dir(&parent)?;
    let c = cstr(&name)?;
    let st = match stat_at(&dir, &c) {
        Ok(st) => st,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            return Ok(Located {
                target: parent.join(&name),
                dir,
                parent,
                name,
                kept: None,
            })
        }
        Err(e) => return Err(Error::io_at("stat", target, e)),
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFLNK {
        check_replaceable(&st, target)?;
        check_writable(&dir, &c, target)?;
        return Ok(Located {
            target: parent.join(&name),
            dir,
            parent,
            name,
            kept: Some(kept(&st)),
        });
    }
    // SAFETY: openat with a valid dir fd and a NUL-terminated name; the fd is owned below.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io_at(
            "follow link",
            target,
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let pointee = unsafe { File::from_raw_fd(fd) };
    let pst = stat_fd(pointee.as_raw_fd()).map_err(|e| Error::io_at("stat", target, e))?;
    check_replaceable(&pst, target)?;
    let real = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_err(|e| Error::io_at("resolve link", target, e))?;
    let (rparent, rname) = split(&real)?;
    let rdir = open_dir(&rparent)?;
    let rc = cstr(&rname)?;
    let same = stat_at(&rdir, &rc).is_ok_and(|s| same_file(&s, &pst));
    if !same {
        return Err(Error::io_at(
            "resolve link",
            target,
            io::Error::other(format!(
                "the link resolved to {}, which was replaced meanwhile",
                real.display()
            )),
        ));
    }
    check_writable(&rdir, &rc, target)?;
    Ok(Located {
        dir: rdir,
        parent: rparent,
        name: rname,
        target: real,
        kept: Some(kept(&pst)),
    })
}

/// A save replaces a regular file (or makes one): a folder is EISDIR, and a
/// device, FIFO or socket is refused, not renamed over (as root, a save to
/// /dev/null replaced the device node with a file).
fn check_replaceable(st: &libc::stat, target: &Path) -> Result<()> {
    let why = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => return Ok(()),
        libc::S_IFDIR => io::Error::from_raw_os_error(libc::EISDIR),
        mode => io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "not a regular file: {}; a checkpoint is saved by replacing a regular file",
                crate::io::file::kind_of_mode(mode)
            ),
        ),
    };
    Err(Error::io_at("save", target, why))
}

/// A file this process may not write is not replaced, as open() would not
/// write it: a rename over it needs only the folder's permission, and a
/// checkpoint made read-only (chmod a-w) was replaced without a word.
fn check_writable(dir: &File, name: &CStr, target: &Path) -> Result<()> {
    // SAFETY: a directory descriptor we hold and a NUL-terminated name.
    let rc =
        unsafe { libc::faccessat(dir.as_raw_fd(), name.as_ptr(), libc::W_OK, libc::AT_EACCESS) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if matches!(
            e.raw_os_error(),
            Some(libc::EACCES | libc::EPERM | libc::EROFS)
        ) {
            return Err(Error::io_at("save", target, e));
        }
    }
    Ok(())
}

fn kept(st: &libc::stat) -> Kept {
    Kept {
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
    }
}

fn same_file(a: &libc::stat, b: &libc::stat) -> bool {
    (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
fn stat_at(dir: &File, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid dir fd, NUL-terminated name, and a stat buffer we own.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn stat_fd(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat of a descriptor the caller owns into a buffer we own.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// A new temp file for `name` in `dir`, created with `mode` (less the umask)
/// and locked. Retried under a new name if a cleanup removed it before the
/// lock was taken.
fn create_locked_temp(
    dir: &File,
    parent: &Path,
    name: &OsStr,
    mode: u32,
) -> Result<(OsString, PathBuf, File)> {
    for _ in 0..CREATE_ATTEMPTS {
        let tmp_name = temp_name(name);
        let c = cstr(&tmp_name)?;
        let tmp_path = parent.join(&tmp_name);
        fault::hit(Point::Create, &tmp_path)?;
        // SAFETY: openat with a valid dir fd and NUL-terminated name; the fd
        // returned is owned by the File below.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(Error::io_at(
                "create temp file",
                &tmp_path,
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd is a fresh, valid descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let locked = lock(&file, libc::F_WRLCK as libc::c_short, true).is_ok();
        if locked && file.metadata().is_ok_and(|m| m.nlink() == 0) {
            continue; // removed between creation and lock: not ours any more
        }
        return Ok((tmp_name, tmp_path, file));
    }
    Err(Error::io(
        "create temp file",
        parent.join(name),
        io::Error::other("every temp file made was removed by a concurrent cleanup"),
    ))
}

/// An open-file-description lock on the whole file (`wait`: block until granted).
fn lock(file: &File, kind: libc::c_short, wait: bool) -> io::Result<()> {
    // SAFETY: an all-zero flock is valid; the fields that matter are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    let cmd = if wait {
        libc::F_OFD_SETLKW
    } else {
        libc::F_OFD_SETLK
    };
    loop {
        // SAFETY: fcntl lock command on a descriptor we own with a valid flock
        // (l_pid 0, as OFD locks require).
        if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &fl) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The regular file `name` in folder `dir`, opened read-only, if there is one.
fn open_existing(dir: libc::c_int, name: &CString) -> Option<File> {
    // SAFETY: valid dir fd and NUL-terminated name; the fd is owned below.
    let fd = unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK,
        )
    };
    // SAFETY: a fresh descriptor nobody else owns.
    (fd >= 0).then(|| unsafe { File::from_raw_fd(fd) })
}

fn cstr(s: &OsStr) -> Result<CString> {
    CString::new(s.as_bytes())
        .map_err(|_| Error::invalid(format!("path {s:?} contains a NUL byte")))
}

fn open_dir(dir: &Path) -> Result<File> {
    let c = cstr(dir.as_os_str())?;
    // SAFETY: NUL-terminated path; the fd is owned by the File below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(Error::io_at("open folder", dir, io::Error::last_os_error()));
    }
    // SAFETY: fresh descriptor.
    Ok(unsafe { File::from_raw_fd(fd) })
}

fn temp_name(target_name: &OsStr) -> OsString {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let nonce = nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(48);
    let tail = format!("{TMP_TAG}{}-{nonce:016x}{TMP_SUFFIX}", std::process::id());
    // A name fits NAME_MAX (255 bytes): the target's part is cut where the
    // whole would not (a target name of 221-255 bytes could not be saved).
    let room = NAME_MAX.saturating_sub(1 + tail.len());
    let name = target_name.as_bytes();
    let mut s = OsString::from(".");
    s.push(OsStr::from_bytes(&name[..name.len().min(room)]));
    s.push(tail);
    s
}

/// The longest file name most Linux file systems take.
const NAME_MAX: usize = 255;

/// Whether `file_name` is a temp file name made by [`temp_name`] (for any target).
pub fn is_temp_name(file_name: &OsStr) -> bool {
    let f = file_name.as_bytes();
    let Some(rest) = f
        .strip_prefix(b".")
        .and_then(|r| r.strip_suffix(TMP_SUFFIX.as_bytes()))
    else {
        return false;
    };
    // <target>.ckptio-<pid>-<16 hex>: the tag is the last one in the name.
    let tag = TMP_TAG.as_bytes();
    let Some(at) = rest.windows(tag.len()).rposition(|w| w == tag) else {
        return false;
    };
    let Ok(tail) = std::str::from_utf8(&rest[at + tag.len()..]) else {
        return false;
    };
    let Some((pid, nonce)) = tail.split_once('-') else {
        return false;
    };
    at > 0
        && !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
        && nonce.len() == 16
        // Lower-case only, as temp_name writes it (and the Python side's pattern):
        // a user's file in capitals is not ours to remove.
        && nonce.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Remove the temp files of dead saves (see the module doc) in `folder`: only
/// names of ckptio's temp pattern, only files on which a lock can be taken.
/// Returns the names removed.
pub fn remove_stale_temps(folder: &Path) -> Result<Vec<OsString>> {
    let dir = open_dir(folder)?;
    Ok(remove_stale_temps_in(&dir, folder))
}

fn remove_stale_temps_in(dir: &File, folder: &Path) -> Vec<OsString> {
    // Read the folder we hold open (not whatever the path names now).
    let entries = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))
        .or_else(|_| std::fs::read_dir(folder));
    let Ok(entries) = entries else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| is_temp_name(n) && remove_if_dead(dir, n))
        .collect()
}

/// Remove temp file `name` if no live save holds its lock. Best effort:
/// anything that cannot be proven dead stays.
fn remove_if_dead(dir: &File, name: &OsStr) -> bool {
    let Ok(c) = cstr(name) else { return false };
    // SAFETY: valid dir fd and NUL-terminated name; the fd is owned below.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return false;
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    let Ok(st) = stat_fd(fd) else { return false };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return false;
    }
    // A read lock conflicts with the writer's write lock: granted, no save holds it.
    if lock(&file, libc::F_RDLCK as libc::c_short, false).is_err() {
        return false;
    }
    // Still the file we locked under that name? Then it goes, while the lock is held.
    if !stat_at(dir, &c).is_ok_and(|s| same_file(&s, &st)) {
        return false;
    }
    // SAFETY: valid dir fd and NUL-terminated name.
    let removed = unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } == 0;
    drop(file);
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn temps(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(TMP_TAG))
            .collect()
    }

    #[test]
    fn commit_replaces_and_cleans_up() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("ckpt.pt");
        std::fs::write(&t, b"old").unwrap();
        let a = AtomicFile::create(&t).unwrap();
        assert!(a.tmp_path().exists());
        assert_eq!(std::fs::read(&t).unwrap(), b"old");
        a.file().write_all(b"new").unwrap();
        a.commit().unwrap();
        assert_eq!(std::fs::read(&t).unwrap(), b"new");
        assert!(temps(d.path()).is_empty());
    }

    #[test]
    fn drop_without_commit_leaves_old_file() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("ckpt.pt");
        std::fs::write(&t, b"old").unwrap();
        {
            let a = AtomicFile::create(&t).unwrap();
            a.file().write_all(b"half").unwrap();
        }
        assert_eq!(std::fs::read(&t).unwrap(), b"old");
        assert!(temps(d.path()).is_empty());
    }

    #[test]
    fn failing_rename_keeps_old_and_removes_temp() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("ckpt.pt");
        let a = AtomicFile::create(&t).unwrap();
        // Someone puts a non-empty folder where the target goes: rename must fail.
        std::fs::create_dir(&t).unwrap();
        std::fs::write(t.join("x"), b"x").unwrap();
        match a.commit() {
            Err(Error::Io { op: "rename", .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(temps(d.path()).is_empty());
    }

    #[test]
    fn a_fifo_or_device_at_the_target_is_refused_not_replaced() {
        use std::os::unix::fs::FileTypeExt;
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("ckpt.pt");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path of ours.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let link = d.path().join("link.pt");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        for target in [&fifo, &link] {
            let e = AtomicFile::create(target).err().unwrap();
            assert!(e.to_string().contains("a FIFO (named pipe)"), "{e}");
        }
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        assert!(temps(d.path()).is_empty());
        let e = AtomicFile::create(Path::new("/dev/null")).err().unwrap();
        assert!(e.to_string().contains("a character device"), "{e}");
    }

    #[test]
    fn errors_are_typed() {
        let d = tempfile::tempdir().unwrap();
        let e = AtomicFile::create(&d.path().join("no/such/dir/f.pt"))
            .err()
            .unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let e = AtomicFile::create(d.path()).err().unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::EISDIR));
    }

    #[test]
    fn symlink_target_replaces_the_pointee() {
        let d = tempfile::tempdir().unwrap();
        let other = d.path().join("store");
        std::fs::create_dir(&other).unwrap();
        let real = other.join("step1.pt");
        std::fs::write(&real, b"old").unwrap();
        let link = d.path().join("latest.pt");
        std::os::unix::fs::symlink("store/step1.pt", &link).unwrap();
        let a = AtomicFile::create(&link).unwrap();
        assert_eq!(a.target(), std::fs::canonicalize(&real).unwrap());
        // The temp file lives beside the pointee: the rename stays in one folder.
        assert_eq!(temps(&other).len(), 1);
        a.file().write_all(b"new").unwrap();
        a.commit().unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&real).unwrap(), b"new");
    }

    #[test]
    fn links_to_nothing_or_to_a_folder_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let dangling = d.path().join("latest.pt");
        std::os::unix::fs::symlink("missing.pt", &dangling).unwrap();
        let e = AtomicFile::create(&dangling).err().unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        assert!(
            !d.path().join("missing.pt").exists(),
            "nothing is created through a link"
        );
        let to_dir = d.path().join("dir.pt");
        std::os::unix::fs::symlink(".", &to_dir).unwrap();
        let e = AtomicFile::create(&to_dir).err().unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::EISDIR));
        assert!(temps(d.path()).is_empty());
    }

    #[test]
    fn keeps_permissions_and_temp_is_private_until_commit() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("ckpt.pt");
        std::fs::write(&t, b"old").unwrap();
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o644)).unwrap();
        let a = AtomicFile::create(&t).unwrap();
        let tmp_mode = std::fs::metadata(a.tmp_path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(tmp_mode & 0o077, 0, "temp mode {tmp_mode:o} lets others in");
        a.commit().unwrap();
        assert_eq!(
            std::fs::metadata(&t).unwrap().permissions().mode() & 0o777,
            0o644
        );
        // A read-only file stays read-only, and is still replaced.
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o400)).unwrap();
        let a = AtomicFile::create(&t).unwrap();
        a.file().write_all(b"new").unwrap();
        a.commit().unwrap();
        assert_eq!(
            std::fs::metadata(&t).unwrap().permissions().mode() & 0o777,
            0o400
        );
        assert_eq!(std::fs::read(&t).unwrap(), b"new");
    }

    #[test]
    fn unlocked_temps_of_any_target_are_removed_whatever_their_pid() {
        let d = tempfile::tempdir().unwrap();
        // Our own pid: alive, yet nothing holds these files' locks.
        let me = std::process::id();
        let stale = [
            format!(".ckpt.pt.ckptio-{me}-00000000deadbeef.tmp"),
            format!(".step100.pt.ckptio-{me}-00000000deadbeef.tmp"),
        ];
        for s in &stale {
            std::fs::write(d.path().join(s), b"junk").unwrap();
        }
        // Not ours: other names, and a folder of our pattern.
        let keep = [
            "notes.tmp",
            ".x.ckptio-1-zz.tmp",
            ".ckptio-1-0000000000000000.tmp",
        ];
        for k in &keep {
            std::fs::write(d.path().join(k), b"x").unwrap();
        }
        std::fs::create_dir(d.path().join(".d.ckptio-1-0000000000000000.tmp")).unwrap();
        let a = AtomicFile::create(&d.path().join("ckpt.pt")).unwrap();
        for s in &stale {
            assert!(!d.path().join(s).exists(), "{s} stayed");
        }
        for k in &keep {
            assert!(d.path().join(k).exists(), "{k} was removed");
        }
        assert!(d.path().join(".d.ckptio-1-0000000000000000.tmp").is_dir());
        drop(a);
    }

    #[test]
    fn locked_temps_stay_and_cleanup_reports_what_it_removed() {
        let d = tempfile::tempdir().unwrap();
        // A live save of another target in this process: its file has its own lock.
        let live = AtomicFile::create(&d.path().join("a.pt")).unwrap();
        // A temp locked through another open file description (another process, say).
        let held_name = ".b.pt.ckptio-4194305-00000000deadbeef.tmp";
        std::fs::write(d.path().join(held_name), b"x").unwrap();
        let held = File::options()
            .read(true)
            .write(true)
            .open(d.path().join(held_name))
            .unwrap();
        lock(&held, libc::F_WRLCK as libc::c_short, false).unwrap();
        let dead = ".c.pt.ckptio-4194305-00000000deadbeef.tmp";
        std::fs::write(d.path().join(dead), b"x").unwrap();
        let removed = remove_stale_temps(d.path()).unwrap();
        assert_eq!(removed, vec![OsString::from(dead)]);
        assert!(live.tmp_path().exists());
        assert!(d.path().join(held_name).exists());
        live.file().write_all(b"new").unwrap();
        live.commit().unwrap();
        drop(held);
        assert_eq!(
            remove_stale_temps(d.path()).unwrap(),
            vec![OsString::from(held_name)]
        );
        assert_eq!(std::fs::read(d.path().join("a.pt")).unwrap(), b"new");
    }

    #[test]
    fn a_new_temp_holds_its_lock() {
        let d = tempfile::tempdir().unwrap();
        let dir = open_dir(d.path()).unwrap();
        let (name, _, file) =
            create_locked_temp(&dir, d.path(), OsStr::new("x.pt"), 0o600).unwrap();
        assert!(is_temp_name(&name));
        assert_eq!(file.metadata().unwrap().nlink(), 1);
        // The lock is really held: a second description cannot take it.
        let other = File::open(d.path().join(&name)).unwrap();
        assert!(lock(&other, libc::F_RDLCK as libc::c_short, false).is_err());
    }

    #[test]
    fn temp_names_parse() {
        let n = temp_name(OsStr::new("a.pt"));
        assert!(is_temp_name(&n));
        let long = "x".repeat(250);
        let n = temp_name(OsStr::new(&long));
        assert!(n.len() <= NAME_MAX && is_temp_name(&n), "{n:?}");
        assert!(is_temp_name(OsStr::new(
            ".a.ckptio-x.pt.ckptio-12-0123456789abcdef.tmp"
        )));
        for bad in [
            ".a.pt.ckptio-1-zz.tmp",
            ".a.pt.ckptio--0123456789abcdef.tmp",
            "a.pt.ckptio-1-0123456789abcdef.tmp",
            ".ckptio-1-0123456789abcdef.tmp",
            ".a.pt.ckptio-1-0123456789abcdef",
            ".a.pt.ckptio-1-0123456789abcdef0.tmp",
            ".a.pt.ckptio-1-0123456789ABCDEF.tmp",
        ] {
            assert!(!is_temp_name(OsStr::new(bad)), "{bad}");
        }
    }
}
