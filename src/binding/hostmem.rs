//! `HostMemory`: fresh private host memory with huge pages asked for (what the
//! host storages of a load and private staging buffers are made of), and
//! `advise_huge` for shared memory mapped elsewhere, and `detach_mapping` for
//! a file mapping whose tensors must outlive the file's contents.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::error::Error;
use crate::io::hugepage::{self, AnonMap};
use crate::io::mapped;

/// `nbytes` of private anonymous memory, zero-filled on first touch, advised
/// MADV_HUGEPAGE before anything touches it (unless CKPTIO_HUGE_PAGES=0), and
/// unmapped when this object goes. Python wraps it as a torch storage that
/// keeps this object alive.
#[pyclass(frozen, module = "ckptio._native")]
pub struct HostMemory {
    map: AnonMap,
}

impl HostMemory {
    /// Its memory, for the owner checks of native calls.
    pub(super) fn extent(&self) -> crate::engine::Extent {
        crate::engine::Extent {
            memory: crate::engine::Memory::Host,
            addr: self.map.as_ptr() as u64,
            len: self.map.len() as u64,
        }
    }
}

#[pymethods]
impl HostMemory {
    #[new]
    #[pyo3(signature = (nbytes, huge=true))]
    fn new(nbytes: usize, huge: bool) -> PyResult<Self> {
        Ok(HostMemory {
            map: AnonMap::new(nbytes, huge)?,
        })
    }

    #[getter]
    fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.map.len()
    }

    /// Whether MADV_HUGEPAGE was given (the kernel decides whether it grants it).
    #[getter]
    fn huge(&self) -> bool {
        self.map.huge_advised()
    }

    /// Bytes of this memory now in huge pages (from /proc/self/smaps).
    fn huge_bytes(&self) -> Option<u64> {
        hugepage::huge_bytes_at(self.map.as_ptr() as usize)
    }
}

/// Ask for huge pages on `[addr, addr+nbytes)` (memory mapped by someone else,
/// e.g. a shared staging buffer, not touched yet) where the host hands them
/// to shared memory and CKPTIO_HUGE_PAGES allows; returns whether it asked.
/// The caller keeps the range mapped for the call.
#[pyfunction]
pub(super) fn advise_huge(addr: u64, nbytes: usize, shared: bool) -> bool {
    let possible = if shared {
        hugepage::shared_huge_possible()
    } else {
        hugepage::private_huge_possible()
    };
    if !possible || !hugepage::advice_enabled() || addr % 4096 != 0 || nbytes == 0 {
        return false;
    }
    // SAFETY: advice only: the caller's mapping stays as it is where the kernel
    // refuses (an address it does not know is EINVAL/ENOMEM, not a fault).
    unsafe { libc::madvise(addr as *mut libc::c_void, nbytes, libc::MADV_HUGEPAGE) == 0 }
}

/// Make torch's private mapping `[addr, addr+nbytes)` of the file `path`
/// (open as `fd`) anonymous memory with the same bytes at the same address
/// ([`mapped::detach`]): tensors a load handed to user code (hooks) that
/// still view it stop depending on the file. For ckptio's own callers
/// (`ckptio.formats.mapped.Mapped.detach`), with a mapping they hold; any
/// range that is not private writable mappings of that file is a ValueError.
#[pyfunction]
pub(super) fn detach_mapping(
    py: Python<'_>,
    addr: u64,
    nbytes: usize,
    path: PathBuf,
    fd: i32,
) -> PyResult<()> {
    py.detach(|| {
        let addr = usize::try_from(addr).map_err(|_| Error::invalid("address out of range"))?;
        if nbytes > 0 && !mapped::maps_private_file(addr, nbytes, fd)? {
            return Err(Error::invalid(format!(
                "{}: [{addr:#x}, +{nbytes}) is not a private writable mapping of the file",
                path.display()
            )));
        }
        // SAFETY: the range is private writable mappings of the file (checked
        // just now); the caller holds the mapping (a storage) for the call and
        // no load writes it any more.
        unsafe { mapped::detach(addr, nbytes, &path) }
    })?;
    Ok(())
}
