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
use pyo3::types::{PyDict, PyTuple, PyType};

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
            // The store's classes are OSError subclasses too (errno and the
            // URL as filename kept): code written for paths catches them.
            Error::Store { kind, url, reason } => {
                let errno = match kind {
                    StoreErrorKind::NoCredentials | StoreErrorKind::AccessDenied => libc::EACCES,
                    StoreErrorKind::NoSuchBucket | StoreErrorKind::NoSuchKey => libc::ENOENT,
                    StoreErrorKind::Conflict => libc::EEXIST,
                    StoreErrorKind::Throttled => libc::EBUSY,
                    StoreErrorKind::ConnectionLost => libc::ECONNRESET,
                    _ => libc::EIO,
                };
                let text = format!("{}: {reason}", kind.as_str());
                Python::attach(|py| match store_class(py, kind) {
                    Ok(cls) => PyErr::from_type(cls, (errno, text, url)),
                    Err(e) => e,
                })
            }
        }
    }
}

fn strip_os_suffix(s: &str) -> &str {
    s.find(" (os error").map_or(s, |i| &s[..i])
}

/// The store's exception classes: (name, built-in OSError subclass, parent
/// in this list, doc). Made at import (`store_classes`), since an exception
/// class with two bases (an OSError subclass and CkptioError) cannot be
/// declared by `create_exception!`.
const STORE_CLASSES: [(&str, &str, Option<usize>, &str); 7] = [
    (
        "StoreError",
        "OSError",
        None,
        "An object-store request failed (an OSError naming the URL, and a CkptioError).",
    ),
    (
        "StoreCredentialsError",
        "PermissionError",
        Some(0),
        "No credentials were found for the store (variables, storage_options, instance or container).",
    ),
    (
        "StorePermissionError",
        "PermissionError",
        Some(0),
        "The store refused the request (a wrong key or signature, or its policy).",
    ),
    (
        "StoreNotFoundError",
        "FileNotFoundError",
        Some(0),
        "No such bucket, or no such key (the message says which).",
    ),
    (
        "CommitConflictError",
        "FileExistsError",
        Some(0),
        "A conditional write or read lost: another writer committed first, or the object changed while it was read.",
    ),
    (
        "StoreThrottledError",
        "ConnectionError",
        Some(0),
        "The store kept answering SlowDown (503) or 429 past the retries.",
    ),
    (
        "StoreConnectionError",
        "ConnectionError",
        Some(0),
        "The store could not be reached (refused, reset or timed out past the retries).",
    ),
];

static STORE_TYPES: pyo3::sync::PyOnceLock<Vec<Py<PyType>>> = pyo3::sync::PyOnceLock::new();

/// The store's exception classes, by name, made once per interpreter.
pub fn store_classes(py: Python<'_>) -> PyResult<Vec<(&'static str, Bound<'_, PyType>)>> {
    let types = STORE_TYPES.get_or_try_init(py, || {
        let builtins = py.import("builtins")?;
        let make = builtins.getattr("type")?;
        let mut made: Vec<Py<PyType>> = Vec::new();
        for (name, os_base, parent, doc) in STORE_CLASSES {
            let os = builtins.getattr(os_base)?;
            let bases = match parent {
                None => PyTuple::new(py, [os, py.get_type::<CkptioError>().into_any()])?,
                Some(i) => PyTuple::new(py, [os, made[i].bind(py).clone().into_any()])?,
            };
            let ns = PyDict::new(py);
            ns.set_item("__module__", "ckptio")?;
            ns.set_item("__doc__", doc)?;
            let cls = make.call1((name, bases, ns))?.cast_into::<PyType>()?;
            made.push(cls.unbind());
        }
        Ok::<_, PyErr>(made)
    })?;
    Ok(STORE_CLASSES
        .iter()
        .zip(types)
        .map(|(c, t)| (c.0, t.bind(py).clone()))
        .collect())
}

fn store_class(py: Python<'_>, kind: StoreErrorKind) -> PyResult<Bound<'_, PyType>> {
    let name = match kind {
        StoreErrorKind::NoCredentials => "StoreCredentialsError",
        StoreErrorKind::AccessDenied => "StorePermissionError",
        StoreErrorKind::NoSuchBucket | StoreErrorKind::NoSuchKey => "StoreNotFoundError",
        StoreErrorKind::Conflict => "CommitConflictError",
        StoreErrorKind::Throttled => "StoreThrottledError",
        StoreErrorKind::ConnectionLost => "StoreConnectionError",
        _ => "StoreError",
    };
    let classes = store_classes(py)?;
    let found = classes.into_iter().find(|(n, _)| *n == name);
    found
        .map(|(_, cls)| cls)
        .ok_or_else(|| pyo3::exceptions::PyOSError::new_err(format!("no class {name}")))
}
