//! The GPU layer: libcuda and libcufile loaded at run time, and the two ways
//! device memory reaches a file.
//!
//! - [`cuda`]: the CUDA driver API (dlopen), streams, pinned and registered host memory.
//! - [`cufile`]: cuFile (GPUDirect Storage) (dlopen), file handles, buffer registrations.
//! - [`budget`]: one cap on the host memory ckptio pins, process-wide.
//! - [`order`]: the caller's stream order, which every device transfer follows.
//! - [`path`]: the per-file choice between cuFile and the bounce pipeline.
//! - [`bounce`]: one I/O thread's pinned double buffers and streams.
//! - [`staging`]: parallel copies of tensor memory into host buffers pinned on
//!   first use (snapshots for async checkpoints).

pub(crate) mod bounce;
pub mod budget;
pub mod cuda;
pub mod cufile;
pub(crate) mod order;
pub mod path;
pub mod staging;

pub(crate) use bounce::{BounceLane, InFlight, SlotPiece};
pub use path::{open_device_path, Backend, DevicePath};

/// Resolves `name` in `lib` (libcuda or libcufile, opened with dlopen) and
/// copies the function pointer out.
///
/// # Safety
/// `T` must be the exact C type of the symbol `name`. The pointer must not be
/// called after `lib` is unloaded. Here the libraries are owned by `static`s
/// and never unloaded.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &str) -> std::result::Result<T, String> {
    // SAFETY: the caller guarantees that `T` is the symbol's type.
    let sym = unsafe { lib.get::<T>(name.as_bytes()) };
    sym.map(|s| *s)
        .map_err(|e| format!("symbol {name} not found: {e}"))
}

/// Where a segment's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    Host,
    /// Device memory of CUDA device `n`.
    Cuda(i32),
}
