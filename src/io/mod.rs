//! The I/O layer: files and their alignment, crash-safe replacement, fault points.
//!
//! - [`align`]: alignment as a property of a file, aligned host buffers.
//! - [`file`]: a file opened for O_DIRECT where its filesystem takes it, with
//!   positional read/write loops that survive short transfers and EINTR.
//! - [`persist`]: crash-safe replacement of a file (temp file, fsync, rename,
//!   fsync of the folder).
//! - [`env`]: `CKPTIO_*` sizes and counts from the environment, parsed once.
//! - [`fault`]: test-only fault injection and a log of durable operations.
//! - [`hugepage`]: private anonymous memory with huge pages, and what the host
//!   does with them.
//! - [`mapped`]: a file's bytes copied from a mapping of its page cache (under
//!   a SIGBUS guard), and which of its pages are cached.

pub mod align;
pub(crate) mod env;
pub mod fault;
pub mod file;
pub mod hugepage;
pub mod mapped;
pub mod persist;
