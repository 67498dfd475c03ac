//! Crash-safe replacement of a file.
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
//! Dropping an uncommitted `AtomicFile` removes the temp file. Temp files are
//! named `.<target name>.ckptio-<pid>-<nonce>.tmp`, so a later save of the same
//! target recognises and removes those whose process is gone.
//!
//! A target that is a symbolic link is resolved first: the file it points to is
//! replaced and the link stays, as with `torch.save` (which writes through links).
//! A replaced file keeps its permission bits; a new one gets 0o666 minus the umask.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::io::fault::{self, Point};
use crate::{Error, Result};

const TMP_TAG: &str = ".ckptio-";
const TMP_SUFFIX: &str = ".tmp";

pub struct AtomicFile {
    target: PathBuf,
    dir: File,
    target_name: OsString,
    tmp_name: OsString,
    tmp_path: PathBuf,
    file: Option<File>,
    committed: bool,
}

impl AtomicFile {
    /// Create the temp file for replacing `target`.
    pub fn create(target: &Path) -> Result<Self> {
        let target = resolve_links(target)?;
        let name = target
            .file_name()
            .ok_or_else(|| Error::invalid(format!("{} does not name a file", target.display())))?
            .to_os_string();
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let old_mode = match std::fs::metadata(&target) {
            Ok(m) if m.is_dir() => {
                return Err(Error::io_at(
                    "save to",
                    &target,
                    io::Error::from_raw_os_error(libc::EISDIR),
                ));
            }
            Ok(m) => Some(m.permissions().mode() & 0o7777),
            Err(_) => None,
        };
        let dir = open_dir(&parent)?;
        remove_stale_temps(&dir, &name);

        let tmp_name = temp_name(&name);
        let c = cstr(&tmp_name)?;
        fault::hit(Point::Create, &parent.join(&tmp_name))?;
        // SAFETY: openat with a valid dir fd and NUL-terminated name; the fd
        // returned is owned by the File below.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o666 as libc::c_uint,
            )
        };
        let tmp_path = parent.join(&tmp_name);
        if fd < 0 {
            return Err(Error::io_at(
                "create temp file",
                &tmp_path,
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd is a fresh, valid descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let me = AtomicFile {
            target,
            dir,
            target_name: name,
            tmp_name,
            tmp_path,
            file: Some(file),
            committed: false,
        };
        if let Some(mode) = old_mode {
            // Keep the replaced file's permissions (best effort: an error here loses nothing).
            let _ = me
                .file()
                .set_permissions(std::fs::Permissions::from_mode(mode));
        }
        Ok(me)
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

    /// The file that will be replaced (links resolved).
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// fsync the temp file, rename it over the target, fsync the folder.
    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().unwrap_or_else(|| unreachable!());
        fault::hit(Point::Fsync, &self.tmp_path)?;
        file.sync_all()
            .map_err(|e| Error::io_at("fsync", &self.tmp_path, e))?;
        drop(file);
        let from = cstr(&self.tmp_name)?;
        let to = cstr(&self.target_name)?;
        let fd = self.dir.as_raw_fd();
        // Hold the file being replaced open across the rename: otherwise the
        // rename drops its last link and frees all its blocks (tenths of a
        // second per GiB here, with online discard) before returning.
        let replaced = open_existing(fd, &to);
        fault::hit(Point::Rename, &self.target)?;
        // SAFETY: valid dir fd and NUL-terminated names.
        if unsafe { libc::renameat(fd, from.as_ptr(), fd, to.as_ptr()) } != 0 {
            return Err(Error::io_at(
                "rename",
                &self.target,
                io::Error::last_os_error(),
            ));
        }
        self.committed = true;
        let synced = fault::hit(Point::FsyncDir, &self.target).and_then(|()| {
            self.dir
                .sync_all()
                .map_err(|e| Error::io_at("fsync folder of", &self.target, e))
        });
        // The new file is durable: free the old one's blocks off this thread.
        if let Some(old) = replaced {
            let _ = std::thread::Builder::new()
                .name("ckptio-release".into())
                .spawn(move || drop(old));
        }
        synced
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            self.file.take();
            if let Ok(c) = cstr(&self.tmp_name) {
                // SAFETY: valid dir fd and NUL-terminated name.
                unsafe { libc::unlinkat(self.dir.as_raw_fd(), c.as_ptr(), 0) };
            }
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

/// Follow symbolic links of the last component (up to 40 hops, like the kernel).
fn resolve_links(target: &Path) -> Result<PathBuf> {
    let mut p = target.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&p).map_err(|e| Error::io_at("read link", &p, e))?;
                p = match p.parent() {
                    Some(parent) if link.is_relative() => parent.join(link),
                    _ => link,
                };
            }
            _ => return Ok(p),
        }
    }
    Err(Error::io_at(
        "resolve link",
        target,
        io::Error::from_raw_os_error(libc::ELOOP),
    ))
}

fn temp_name(target_name: &OsStr) -> OsString {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let nonce = nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(48);
    let mut s = OsString::from(".");
    s.push(target_name);
    s.push(format!(
        "{TMP_TAG}{}-{nonce:016x}{TMP_SUFFIX}",
        std::process::id()
    ));
    s
}

/// The pid in a temp name made by [`temp_name`] for `target_name`, if it is one.
pub fn temp_owner(file_name: &OsStr, target_name: &OsStr) -> Option<i32> {
    let f = file_name.as_bytes();
    let mut prefix = b".".to_vec();
    prefix.extend_from_slice(target_name.as_bytes());
    prefix.extend_from_slice(TMP_TAG.as_bytes());
    let rest = f
        .strip_prefix(prefix.as_slice())?
        .strip_suffix(TMP_SUFFIX.as_bytes())?;
    let rest = std::str::from_utf8(rest).ok()?;
    let (pid, nonce) = rest.split_once('-')?;
    (nonce.len() == 16 && nonce.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
    pid.parse().ok()
}

/// Remove temp files of earlier saves of this target whose process is gone
/// (killed mid-save). Best effort: cleanup never fails a save.
fn remove_stale_temps(dir: &File, target_name: &OsStr) {
    let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd())) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = temp_owner(&name, target_name) else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0
            || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            if let Ok(c) = cstr(&name) {
                // SAFETY: valid dir fd and NUL-terminated name.
                unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

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
        let real = d.path().join("step1.pt");
        std::fs::write(&real, b"old").unwrap();
        let link = d.path().join("latest.pt");
        std::os::unix::fs::symlink("step1.pt", &link).unwrap();
        let a = AtomicFile::create(&link).unwrap();
        a.file().write_all(b"new").unwrap();
        a.commit().unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&real).unwrap(), b"new");
    }

    #[test]
    fn keeps_permissions_of_replaced_file() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("ckpt.pt");
        std::fs::write(&t, b"old").unwrap();
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o640)).unwrap();
        let a = AtomicFile::create(&t).unwrap();
        a.commit().unwrap();
        assert_eq!(
            std::fs::metadata(&t).unwrap().permissions().mode() & 0o777,
            0o640
        );
    }

    #[test]
    fn stale_temps_of_dead_processes_are_removed() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("ckpt.pt");
        // pid 2^22+1 is above the default pid_max: never alive.
        let stale = d
            .path()
            .join(".ckpt.pt.ckptio-4194305-00000000deadbeef.tmp");
        std::fs::write(&stale, b"junk").unwrap();
        let other = d
            .path()
            .join(".other.pt.ckptio-4194305-00000000deadbeef.tmp");
        std::fs::write(&other, b"junk").unwrap();
        let a = AtomicFile::create(&t).unwrap();
        assert!(!stale.exists());
        assert!(
            other.exists(),
            "temp files of other targets are not ours to remove"
        );
        drop(a);
    }

    #[test]
    fn temp_names_parse() {
        let n = temp_name(OsStr::new("a.pt"));
        assert_eq!(
            temp_owner(&n, OsStr::new("a.pt")),
            Some(std::process::id() as i32)
        );
        assert_eq!(temp_owner(&n, OsStr::new("b.pt")), None);
        assert_eq!(
            temp_owner(OsStr::new(".a.pt.ckptio-1-zz.tmp"), OsStr::new("a.pt")),
            None
        );
    }
}
