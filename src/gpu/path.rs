//! How device memory reaches a file: cuFile (GPUDirect Storage) or the
//! pinned bounce-buffer pipeline ([`super::bounce`]), chosen per file.
//!
//! [`open_device_path`] tries cuFile when asked (or in `auto`), and falls back
//! to the bounce pipeline when the library, the driver or the file's handle
//! registration fails, keeping the reason.

use crate::gpu::cufile::{self, FileHandle};
use crate::io::file::IoFile;
use crate::{Error, Result};

/// Which path moves device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// cuFile where it works on the file, the bounce pipeline otherwise.
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

/// Decide how device memory moves to and from `file`.
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
