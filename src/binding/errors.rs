//! ckptio's Python exception classes and the one conversion from the core's
//! error: I/O errors become the matching `OSError` subclass (from errno), the
//! rest a specific ckptio class.
//!
//! `CkptioError` derives from `RuntimeError`, what torch.load raises on a
//! corrupt archive and for CUDA failures: code written for torch that catches
//! RuntimeError catches ckptio's errors too, and `except ckptio.FormatError`
//! still singles them out.

use pyo3::exceptions::{PyMemoryError, PyOSError, PyValueError};
use pyo3::prelude::*;

use crate::{Error, StoreErrorKind};

pyo3::create_exception!(
    ckptio,
    CkptioError,
    pyo3::exceptions::PyRuntimeError,
    "Base class of ckptio's own errors (a RuntimeError, as torch.load's are)."
);
pyo3::create_exception!(
    ckptio,
    FormatError,
    CkptioError,
    "The file is not a usable checkpoint (torch.save archive or safetensors file)."
);
pyo3::create_exception!(
    ckptio,
    BackendUnavailableError,
    CkptioError,
    "A library or backend (libcuda, libcufile) is not available."
);
pyo3::create_exception!(ckptio, CudaError, CkptioError, "A CUDA driver call failed.");
pyo3::create_exception!(
    ckptio,
    CuFileError,
    CkptioError,
    "A cuFile (GPUDirect Storage) call failed."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::Io { op, path, source } => match source.raw_os_error() {
                // OSError(errno, strerror, filename) picks the subclass
                // (FileNotFoundError, PermissionError, ...) from errno.
                Some(errno) => {
                    let text = format!("{op} failed: {}", strip_os_suffix(&source.to_string()));
                    match path {
                        Some(p) => PyOSError::new_err((errno, text, p.into_os_string())),
                        None => PyOSError::new_err((errno, text)),
                    }
                }
                None if source.kind() == std::io::ErrorKind::OutOfMemory => {
                    PyMemoryError::new_err(msg)
                }
                None => PyOSError::new_err(msg),
            },
            Error::Format { .. } => FormatError::new_err(msg),
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::Library { .. } => BackendUnavailableError::new_err(msg),
            Error::Cuda { .. } => CudaError::new_err(msg),
            Error::CuFile { .. } => CuFileError::new_err(msg),
            // Until the store's own classes land (docs/objectstore.md), the
            // OSError subclass of the nearest errno, named by the URL.
            Error::Store { kind, url, reason } => {
                let errno = match kind {
                    StoreErrorKind::NoCredentials | StoreErrorKind::AccessDenied => libc::EACCES,
                    StoreErrorKind::NoSuchBucket | StoreErrorKind::NoSuchKey => libc::ENOENT,
                    StoreErrorKind::Conflict => libc::EEXIST,
                    StoreErrorKind::Throttled => libc::EBUSY,
                    StoreErrorKind::ConnectionLost => libc::ECONNRESET,
                    _ => libc::EIO,
                };
                PyOSError::new_err((errno, format!("{}: {reason}", kind.as_str()), url))
            }
        }
    }
}

fn strip_os_suffix(s: &str) -> &str {
    s.find(" (os error").map_or(s, |i| &s[..i])
}
