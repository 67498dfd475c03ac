//! How device memory reaches a file: cuFile (GPUDirect Storage) or the
//! pinned bounce-buffer pipeline ([`super::bounce`]), chosen per file.
//!
//! [`open_device_path`] tries cuFile when asked (or in `auto`), and falls back
//! to the bounce pipeline when the library, the driver or the file's handle
//! registration fails, keeping the reason. In `auto`, files read only take the
//! bounce pipeline where cuFile runs in compat mode.

use crate::gpu::cufile::{self, FileHandle};
use crate::io::file::IoFile;
use crate::{Error, Result};

/// Which path moves device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// cuFile where it works on the file, the bounce pipeline otherwise (and
    /// for reads where cuFile runs in compat mode: [`open_device_path`]).
    #[default]
    Auto,
    /// cuFile or an error.
    CuFile,
    /// The pinned bounce pipeline, never cuFile.
    Bounce,
}

impl std::str::FromStr for Backend {
    type Err = Error;
    /// "auto", "cufile" or "bounce"; "gds" and "posix" (earlier names) are aliases.
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Backend::Auto),
            "cufile" | "gds" => Ok(Backend::CuFile),
            "bounce" | "posix" => Ok(Backend::Bounce),
            other => Err(Error::invalid(format!(
                "backend must be auto, cufile or bounce, not {other:?}"
            ))),
        }
    }
}

impl Backend {
    /// The name reports use: "auto", "cufile" or "bounce".
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::CuFile => "cufile",
            Backend::Bounce => "bounce",
        }
    }

    /// `CKPTIO_BACKEND`, else auto.
    pub fn from_env() -> Result<Self> {
        std::env::var("CKPTIO_BACKEND").map_or(Ok(Backend::Auto), |v| v.parse())
    }
}

/// The path chosen for one file's device memory.
pub enum DevicePath {
    /// Pinned bounce buffers; `reason` says why cuFile is not used.
    Bounce { reason: String },
    /// cuFile on a registered handle; `compat` when cuFile runs in its
    /// compatibility mode (no nvidia-fs: it bounces through host memory itself);
    /// `requested` when the caller asked for cuFile (not `auto`).
    CuFile {
        handle: FileHandle,
        compat: bool,
        requested: bool,
    },
}

impl DevicePath {
    pub fn name(&self) -> &'static str {
        match self {
            DevicePath::Bounce { .. } => "bounce",
            DevicePath::CuFile { .. } => "cufile",
        }
    }

    /// For cuFile: "p2p" (true GPUDirect) or "compat".
    pub fn gds_mode(&self) -> Option<&'static str> {
        match self {
            DevicePath::CuFile { compat: true, .. } => Some("compat"),
            DevicePath::CuFile { compat: false, .. } => Some("p2p"),
            DevicePath::Bounce { .. } => None,
        }
    }

    /// The caller asked for this path: reads from memory keep it (in `auto`
    /// they take the bounce lanes, as cuFile would read the disk again).
    pub fn is_requested(&self) -> bool {
        matches!(
            self,
            DevicePath::CuFile {
                requested: true,
                ..
            }
        )
    }

    pub fn fallback_reason(&self) -> Option<&str> {
        match self {
            DevicePath::Bounce { reason } => Some(reason),
            DevicePath::CuFile { .. } => None,
        }
    }
}

/// Why `auto` reads a file through the bounce pipeline where cuFile would take it.
pub const COMPAT_READS: &str = "cuFile runs in compat mode (no nvidia-fs): it reads through \
     host buffers of its own, and the bounce pipeline read faster (backend=\"cufile\" to use it)";

/// Decide how device memory moves to and from `file`.
///
/// In `auto`, a file opened for reads only takes the bounce pipeline where
/// cuFile runs in compat mode: without nvidia-fs cuFile bounces through host
/// memory itself, and cold reads of the same files ran 4-8% faster on the
/// bounce pipeline in 12 of 13 paired rounds on five fresh H200 machines
/// (docs/benchmarks.md). Writes were even there, and keep cuFile.
///
/// # Safety
/// With cuFile, the handle keeps using `file`'s descriptor: the returned value
/// must be dropped before `file`.
pub unsafe fn open_device_path(file: &IoFile, backend: Backend) -> Result<DevicePath> {
    if backend == Backend::Bounce {
        return Ok(DevicePath::Bounce {
            reason: "bounce backend requested".into(),
        });
    }
    let attempt = || -> Result<DevicePath> {
        let driver = cufile::driver()?;
        if backend == Backend::Auto && driver.is_compat_mode() && !file.is_writable() {
            return Ok(DevicePath::Bounce {
                reason: COMPAT_READS.into(),
            });
        }
        // SAFETY: the caller drops the handle before `file`, which owns the fd.
        let handle = unsafe { driver.register(file.fd_for_device_io())? };
        Ok(DevicePath::CuFile {
            handle,
            compat: driver.is_compat_mode(),
            requested: backend == Backend::CuFile,
        })
    };
    match attempt() {
        Ok(p) => Ok(p),
        Err(e) if backend == Backend::Auto => Ok(DevicePath::Bounce {
            reason: format!("cuFile unavailable for {}: {e}", file.path().display()),
        }),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::file::{scratch, DirectMode};

    /// `auto`: where cuFile runs in compat mode, a file opened for reads only
    /// takes the bounce pipeline (and says why) and a writable one takes
    /// cuFile; `cufile` takes cuFile for either. Without a driver (or where
    /// the filesystem's handle cannot register), both fall back in `auto`.
    #[test]
    fn auto_reads_take_the_bounce_pipeline_in_compat_mode() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = d.path().join("f");
        let writable = scratch(&path, DirectMode::Auto);
        writable.write_at(&[7u8; 4096], 0).unwrap();
        let read_only = IoFile::open_read(&path, DirectMode::Auto).unwrap();
        assert!(writable.is_writable() && !read_only.is_writable());
        // SAFETY: every path is dropped before the files.
        let (w, r) = unsafe {
            (
                open_device_path(&writable, Backend::Auto).unwrap(),
                open_device_path(&read_only, Backend::Auto).unwrap(),
            )
        };
        let compat = cufile::driver().map(|d| d.is_compat_mode());
        match (&w, compat) {
            (DevicePath::CuFile { compat, .. }, Ok(c)) => {
                assert_eq!(*compat, c);
                if c {
                    assert_eq!(r.fallback_reason(), Some(COMPAT_READS));
                } else {
                    assert_eq!(r.name(), "cufile");
                }
                // SAFETY: as above.
                let asked = unsafe { open_device_path(&read_only, Backend::CuFile) }.unwrap();
                assert_eq!(asked.name(), "cufile");
                assert!(asked.is_requested());
            }
            (DevicePath::Bounce { reason }, _) => {
                assert!(reason.contains("cuFile unavailable"), "{reason}");
                assert_eq!(r.name(), "bounce");
            }
            (DevicePath::CuFile { .. }, Err(e)) => panic!("cuFile without a driver: {e:?}"),
        }
        drop((w, r));
    }
}
