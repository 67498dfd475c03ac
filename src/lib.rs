//! ckptio core: fast, crash-safe checkpoint I/O.
//!
//! The core knows nothing of Python. Its layers, one folder each, each using
//! only the layers below it:
//!
//! ```text
//!   binding (PyO3, `python` feature)   one file per Python class
//!      |
//!   format    zipmap, integrity        what is inside a checkpoint
//!      |
//!   engine    config, lane             threads moving (memory, file range) segments
//!      |            \
//!   gpu       cuda, cufile, path, bounce, staging
//!      |
//!   io        align, file, persist, fault
//! ```
//!
//! [`error`] is the one error type every layer returns.

pub mod engine;
pub mod error;
pub mod format;
pub mod gpu;
pub mod io;
mod sync;
mod workers;

#[cfg(feature = "python")]
mod binding;

pub use error::{Error, Result};
