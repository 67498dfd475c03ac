//! ckptio core: fast, crash-safe checkpoint I/O.
//!
//! The core knows nothing of Python. Its layers, one folder each, each using
//! only the layers below it:
//!
//! ```text
//!   binding   (PyO3, `python` feature)  one file per Python class; checks every
//!      |       address range against its owners, runs every blocking call detached
//!   format    zipmap, zipwrite, parts   torch.save archives: read (files, objects),
//!      |                                written in one pass, cut into upload parts
//!      |      integrity                 CRC-32 fields, record checks
//!      |      pickle, statedict         torch's state-dict pickles: read, written
//!      |      safetensors, zstd         safetensors headers, DCP items as zstd frames
//!   engine    Engine, lane, pool        segments cut into chunks, moved by tasks,
//!      |      file (TransferFile)       each in a lane whose buffers are reused;
//!      |      memory, config, owned     the memory path, the knobs, owners' extents
//!   gpu       cuda, cufile, path        libcuda and cuFile (loaded at run time),
//!      |      bounce, order, budget     the bounce pipeline, stream order, the
//!      |      staging                   pinned cap, stagers' copies
//!   io        align, file, persist      O_DIRECT files, atomic replace,
//!             mapped, hugepage, env,    page-cache mappings, huge pages, knobs,
//!             fault                     fault points
//!
//!   store     (`objectstore` feature)   s3:// gs:// az:// objects: multipart
//!             sink, ranged source, one async runtime per process
//!
//!   workers   the process's one pool of worker threads, which every layer's
//!   sync      parallel steps run on; locks and service threads (all layers)
//! ```
//!
//! [`error`] is the one error type every layer returns. Modules are `pub`
//! where the binding or the benches reach them; the rest is `pub(crate)`.

pub mod engine;
pub mod error;
pub mod format;
pub mod gpu;
pub mod io;
#[cfg(feature = "objectstore")]
pub mod store;
mod sync;
mod workers;

#[cfg(feature = "python")]
mod binding;

pub use error::{Error, Result, StoreErrorKind};
