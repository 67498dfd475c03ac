//! ckptio core: fast, crash-safe checkpoint I/O.
//!
//! The core knows nothing of Python. Its parts, one module each:
//! - [`zipmap`]: maps a torch.save (zip) archive to record name -> data offset.
//! - [`align`]: alignment of files and memory, aligned host buffers.
//! - [`file`]: a file opened for O_DIRECT where the filesystem takes it, with
//!   positional read/write loops that survive short transfers and EINTR.
//! - [`engine`]: a pool of I/O threads moving (pointer, length, file offset)
//!   segments between memory and a file in parallel chunks.
//! - [`persist`]: crash-safe replacement of a file (temp file, fsync, rename, fsync dir).
//! - [`cuda`], [`cufile`]: libcuda and libcufile, loaded at run time.
//! - [`gpu`]: per-file choice of cuFile or the pinned bounce pipeline for device memory.
//! - [`staging`]: parallel copies of tensor memory into host buffers pinned on first use
//!   (snapshots for async checkpoints).
//! - [`integrity`]: the zip CRC-32 fields of files ckptio writes, and checking them.
//! - [`fault`]: test-only fault injection and a log of durable operations.
//!
//! The Python binding lives in `binding` behind the `python` feature.

pub mod align;
pub mod cuda;
pub mod cufile;
pub mod engine;
pub mod error;
pub mod fault;
pub mod file;
pub mod gpu;
pub mod integrity;
pub mod persist;
pub mod staging;
pub mod zipmap;

#[cfg(feature = "python")]
mod binding;

pub use error::{Error, Result};
