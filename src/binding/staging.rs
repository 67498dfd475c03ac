//! Staging for async checkpoints: `HostPin` (pinning state of a host buffer),
//! parallel copies into pinned buffers, and device snapshot copies.

use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::Owned;
use crate::gpu::Memory;
use crate::Error;

use super::Owners;

/// Pinning state of host memory owned by `owner` (a staging buffer's storage):
/// page-locked whole by the first copy that reaches it (copies into it go in
/// `chunk_size` pieces, pinned bytes count against the pinned-memory cap),
/// unlocked on `close()` or when this object goes. Holds `owner`, so the
/// memory stays mapped for as long as it may be pinned.
#[pyclass(frozen, module = "ckptio._native")]
pub struct HostPin {
    // Held only to clone or take its contents, never across a detach or I/O.
    // The pin goes before the owner (tuple order).
    inner: Mutex<Option<(Arc<crate::gpu::staging::HostPin>, Py<PyAny>)>>,
    nbytes: u64,
}

impl HostPin {
    fn get(&self) -> PyResult<Arc<crate::gpu::staging::HostPin>> {
        crate::sync::lock(&self.inner)
            .as_ref()
            .map(|(p, _)| p.clone())
            .ok_or_else(|| PyValueError::new_err("the HostPin is closed"))
    }
}

#[pymethods]
impl HostPin {
    /// `addr..addr+nbytes`: host memory of `owner` (a storage, tensor or
    /// HostMemory, whose memory must hold the range), which this pin holds.
    #[new]
    #[pyo3(signature = (owner, addr, nbytes, pin=true, chunk_size=67108864))]
    fn new(
        owner: Bound<'_, PyAny>,
        addr: u64,
        nbytes: u64,
        pin: bool,
        chunk_size: u64,
    ) -> PyResult<Self> {
        let e = super::owners::extent_of(&owner)?;
        Owned::new([e]).check(Memory::Host, addr, nbytes, || {
            "the pinned range".to_string()
        })?;
        // SAFETY: the range lies inside `owner`'s host memory (checked above),
        // which `owner` keeps mapped for as long as the pin lives (both sit
        // in `inner`, the pin dropped first).
        let p = unsafe { crate::gpu::staging::HostPin::new(addr, nbytes, chunk_size, pin) }?;
        Ok(HostPin {
            inner: Mutex::new(Some((Arc::new(p), owner.unbind()))),
            nbytes,
        })
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Bytes page-locked so far (0 once closed).
    fn pinned_bytes(&self) -> u64 {
        crate::sync::lock(&self.inner)
            .as_ref()
            .map_or(0, |(p, _)| p.pinned_bytes())
    }

    /// Unlock the memory (after copies in flight finish), then let go of the
    /// owner. Idempotent.
    fn close(&self, py: Python<'_>) {
        let taken = crate::sync::lock(&self.inner).take();
        if let Some((pin, owner)) = taken {
            py.detach(move || drop(pin));
            drop(owner);
        }
    }
}

/// Pin every one of `pins` not yet pinned, on `threads` threads (the GIL
/// released); returns the bytes now pinned. Memory the driver refuses stays pageable.
#[pyfunction]
#[pyo3(signature = (pins, threads=8))]
pub(super) fn stage_pin(
    py: Python<'_>,
    pins: Vec<Bound<'_, HostPin>>,
    threads: usize,
) -> PyResult<u64> {
    let pins = pins
        .iter()
        .map(|p| p.get().get())
        .collect::<PyResult<Vec<_>>>()?;
    Ok(py.detach(move || {
        let refs: Vec<&crate::gpu::staging::HostPin> = pins.iter().map(|p| p.as_ref()).collect();
        crate::gpu::staging::pin_all(&refs, threads)
    }))
}

/// Queue device-to-device copies `(dst, src, nbytes)` on the CUDA stream
/// `stream` (a raw CUstream of `device`, e.g. ``torch.cuda.Stream.cuda_stream``)
/// and return at once: the device snapshot of a stager, without a kernel launch
/// or a tensor object per storage. Both ranges of every copy must lie in the
/// memory `owners` hold on `device`; they are held while the copies are
/// queued; the copies run later, so the caller keeps the ranges alive until
/// the stream has run them (synchronizes it before letting go).
#[pyfunction]
pub(super) fn stage_device_copy(
    py: Python<'_>,
    device: i32,
    stream: u64,
    copies: Vec<(u64, u64, u64)>,
    owners: Owners,
) -> PyResult<()> {
    if device < 0 {
        return Err(Error::invalid(format!("device must be >= 0, not {device}")).into());
    }
    let mut jobs = Vec::with_capacity(copies.len());
    for (i, &(dst, src, len)) in copies.iter().enumerate() {
        if len == 0 {
            continue;
        }
        if dst == 0 || src == 0 || dst.checked_add(len).is_none() || src.checked_add(len).is_none()
        {
            return Err(Error::invalid(format!(
                "device copy {i}: null or overflowing range (dst {dst:#x}, src {src:#x}, {len} bytes)"
            ))
            .into());
        }
        jobs.push((dst, src, len as usize));
    }
    // Once every job's numbers are sound (those errors come first).
    let mem = Memory::Cuda(device);
    for (i, &(dst, src, len)) in copies.iter().enumerate() {
        owners.check(mem, dst, len, || format!("device copy {i} destination"))?;
        owners.check(mem, src, len, || format!("device copy {i} source"))?;
    }
    py.detach(|| {
        let cuda = crate::gpu::cuda::driver()?;
        // SAFETY: both ranges lie inside device memory of `owners` (checked
        // above), which keep it allocated while the copies are queued, and the
        // caller until the stream has run them, on a stream of `device` it
        // hands (documented contract).
        unsafe { cuda.memcpy_dtod_async_on(device, stream as *mut std::ffi::c_void, &jobs) }
    })?;
    owners.release();
    Ok(())
}

/// One staging copy as Python hands it: (source address, source device (-1 host),
/// destination pin, destination offset, nbytes).
type RawCopy<'py> = (u64, i32, Bound<'py, HostPin>, u64, u64);

/// Copy tensor memory into staging buffers on `threads` threads; returns when
/// every byte has landed. Every source must lie in the memory of `owners`
/// (the pins hold the destinations), which are held until then; nobody may
/// modify the sources meanwhile.
#[pyfunction]
#[pyo3(signature = (copies, owners, threads=8))]
pub(super) fn stage_copy<'py>(
    py: Python<'py>,
    copies: Vec<RawCopy<'py>>,
    owners: Owners,
    threads: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let mut pins: Vec<Arc<crate::gpu::staging::HostPin>> = Vec::new();
    let mut jobs = Vec::with_capacity(copies.len());
    for (i, (src, dev, pin, dst_offset, len)) in copies.into_iter().enumerate() {
        let memory = if dev < 0 {
            Memory::Host
        } else {
            Memory::Cuda(dev)
        };
        owners.check(memory, src, len, || format!("copy {i} source"))?;
        let p = pin.get().get()?;
        let dst = match pins.iter().position(|q| Arc::ptr_eq(q, &p)) {
            Some(i) => i,
            None => {
                pins.push(p);
                pins.len() - 1
            }
        };
        jobs.push(crate::gpu::staging::CopyJob {
            src,
            memory,
            dst,
            dst_offset,
            len,
        });
    }
    let st = py.detach(|| {
        let refs: Vec<&crate::gpu::staging::HostPin> = pins.iter().map(|p| p.as_ref()).collect();
        // SAFETY: every source lies inside the memory of `owners` (checked
        // above), which keep it allocated; the caller leaves it unmodified
        // (documented contract); `pins` hold the destinations, and the core
        // keeps each copy inside its pin and refuses overlapping destinations.
        unsafe { crate::gpu::staging::copy_to_host(&refs, &jobs, threads) }
    })?;
    owners.release();
    let d = PyDict::new(py);
    d.set_item("bytes", st.bytes)?;
    d.set_item("device_bytes", st.device_bytes)?;
    d.set_item("unpinned_device_bytes", st.unpinned_device_bytes)?;
    d.set_item("pieces", st.pieces)?;
    d.set_item("threads", st.threads)?;
    Ok(d)
}
