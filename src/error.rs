//! The one error type of the core. Every fallible function returns [`Result`].
//!
//! Variants keep their sources (`io::Error` intact, so the binding can raise the
//! matching `OSError` subclass) and say *where* things went wrong: the step, the
//! path, the record. The binding turns each variant into one Python exception
//! (`src/binding/errors.rs`):
//!
//! | variant | Python |
//! | --- | --- |
//! | [`Error::Io`] | the `OSError` subclass of its errno (`MemoryError` when out of memory), naming the file |
//! | [`Error::Format`] | `ckptio.FormatError` |
//! | [`Error::InvalidArgument`] | `ValueError` (bad arguments, address ranges outside their owners, overlapping segments) |
//! | [`Error::Library`] | `ckptio.BackendUnavailableError` |
//! | [`Error::Cuda`] | `ckptio.CudaError` |
//! | [`Error::CuFile`] | `ckptio.CuFileError` |
//! | [`Error::Store`] | for now the `OSError` subclass of its [`StoreErrorKind`]'s errno, naming the URL (docs/objectstore.md) |

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Said after every [`Error::Format`]: torch's own words for an archive its
/// reader refuses, which users and tools search for.
pub const CORRUPT_HINT: &str = "there is a high likelihood that your checkpoint file is corrupted \
     (saved incompletely, damaged in transfer, or modified after saving)";

#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system call failed; `op` names the step ("open", "pwrite", "fsync", ...).
    Io {
        op: &'static str,
        path: Option<PathBuf>,
        source: io::Error,
    },
    /// The file is not a usable torch.save archive (bad zip, truncated, compressed record...).
    Format {
        path: Option<PathBuf>,
        reason: String,
    },
    /// The caller asked for something impossible (bad offset, size, option; a
    /// range outside the memory of its owners; segments that overlap).
    InvalidArgument(String),
    /// A library loaded at run time (libcuda, libcufile) is missing or lacks a symbol.
    Library { name: String, reason: String },
    /// A CUDA driver call failed.
    Cuda {
        call: &'static str,
        code: i32,
        name: String,
    },
    /// A cuFile call failed. `code` is the CUfileOpError, `cuda_code` the CUresult behind it.
    CuFile {
        call: &'static str,
        code: i32,
        cuda_code: i32,
        reason: String,
    },
    /// An object-store request failed (feature `objectstore`): `url` names the
    /// object, `kind` what went wrong, `reason` the store's own words.
    Store {
        kind: StoreErrorKind,
        url: String,
        reason: String,
    },
}

/// What an object-store request ran into, after the client's retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// No credentials were found (variables, options, instance or container).
    NoCredentials,
    /// The store refused the credentials or the request (401, 403).
    AccessDenied,
    NoSuchBucket,
    NoSuchKey,
    /// A conditional request lost: the object changed or already exists (409, 412).
    Conflict,
    /// The store still answered 503 SlowDown or 429 when the retries ran out.
    Throttled,
    /// The connection failed or broke and the retries ran out.
    ConnectionLost,
    /// Anything else the store answered (its reason says what).
    Other,
}

impl StoreErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreErrorKind::NoCredentials => "no credentials",
            StoreErrorKind::AccessDenied => "access denied",
            StoreErrorKind::NoSuchBucket => "no such bucket",
            StoreErrorKind::NoSuchKey => "no such key",
            StoreErrorKind::Conflict => "conflict",
            StoreErrorKind::Throttled => "throttled",
            StoreErrorKind::ConnectionLost => "connection lost",
            StoreErrorKind::Other => "store error",
        }
    }
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<Option<PathBuf>>, source: io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub fn io_at(op: &'static str, path: &Path, source: io::Error) -> Self {
        Self::io(op, Some(path.to_path_buf()), source)
    }

    pub fn format(path: Option<&Path>, reason: impl Into<String>) -> Self {
        Error::Format {
            path: path.map(Path::to_path_buf),
            reason: reason.into(),
        }
    }

    pub fn invalid(reason: impl Into<String>) -> Self {
        Error::InvalidArgument(reason.into())
    }

    /// Attach a path to an error raised by a layer that did not know it.
    #[must_use]
    pub fn with_path(mut self, p: &Path) -> Self {
        match &mut self {
            Error::Io { path, .. } | Error::Format { path, .. } if path.is_none() => {
                *path = Some(p.to_path_buf());
            }
            _ => {}
        }
        self
    }

    /// The errno behind an I/O error, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, path, source } => match path {
                Some(p) => write!(f, "{op} failed on {}: {source}", p.display()),
                None => write!(f, "{op} failed: {source}"),
            },
            Error::Format { path, reason } => match path {
                Some(p) => write!(
                    f,
                    "{}: not a usable checkpoint: {reason}; {CORRUPT_HINT}",
                    p.display()
                ),
                None => write!(f, "not a usable checkpoint: {reason}; {CORRUPT_HINT}"),
            },
            Error::InvalidArgument(reason) => f.write_str(reason),
            Error::Library { name, reason } => write!(f, "{name} unavailable: {reason}"),
            Error::Cuda { call, code, name } => write!(f, "{call} failed: {name} ({code})"),
            Error::CuFile {
                call,
                code,
                cuda_code,
                reason,
            } => {
                write!(f, "{call} failed: {reason} (cuFile error {code}")?;
                if *cuda_code != 0 {
                    write!(f, ", CUDA error {cuda_code}")?;
                }
                f.write_str(")")
            }
            Error::Store { kind, url, reason } => {
                write!(f, "{url}: {}: {reason}", kind.as_str())
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
