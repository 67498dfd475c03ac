//! `Engine`: the I/O thread pool with its reusable buffers, as Python sees it.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::engine::{Engine as CoreEngine, EngineConfig};
use crate::io::file::DirectMode;

use super::direct_mode;

/// A pool of I/O threads with its reusable buffers.
#[pyclass(frozen, module = "ckptio._native")]
pub struct Engine {
    pub(super) inner: Arc<CoreEngine>,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (threads=None, chunk_size=None, direct=None, memory_threads=None, memory_path=None))]
    fn new(
        threads: Option<usize>,
        chunk_size: Option<usize>,
        direct: Option<&str>,
        memory_threads: Option<usize>,
        memory_path: Option<&str>,
    ) -> PyResult<Self> {
        let mut cfg = EngineConfig::from_env()?;
        if let Some(t) = threads {
            cfg.set_threads(t);
        }
        if let Some(t) = memory_threads {
            cfg.memory_threads = t;
        }
        if let Some(c) = chunk_size {
            cfg.set_chunk_size(c);
        }
        if let Some(d) = direct_mode(direct)? {
            cfg.direct = d;
        }
        if let Some(m) = memory_path {
            cfg.memory_path = m.parse()?;
        }
        Ok(Engine {
            inner: Arc::new(CoreEngine::new(cfg)?),
        })
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.config().threads
    }

    /// Threads for files in memory (tmpfs).
    #[getter]
    fn memory_threads(&self) -> usize {
        self.inner.config().memory_threads
    }

    #[getter]
    fn chunk_size(&self) -> usize {
        self.inner.config().chunk_size
    }

    /// Chunk size for files in memory (tmpfs).
    #[getter]
    fn memory_chunk_size(&self) -> usize {
        self.inner.config().memory_chunk_size
    }

    #[getter]
    fn direct(&self) -> &'static str {
        match self.inner.config().direct {
            DirectMode::Auto => "auto",
            DirectMode::Off => "off",
            DirectMode::Required => "on",
        }
    }

    /// How files whose bytes are in memory are read: "map", "pread" or "off".
    #[getter]
    fn memory_path(&self) -> &'static str {
        self.inner.config().memory_path.name()
    }

    /// Host memory held by the engine's reusable staging buffers.
    fn pooled_bytes(&self) -> usize {
        self.inner.pooled_bytes()
    }

    /// Pinned host memory held by the engine's bounce buffers.
    fn pinned_bytes(&self) -> usize {
        self.inner.pinned_bytes()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Engine(threads={}, memory_threads={}, chunk_size={}, memory_chunk_size={}, direct={:?}, memory_path={:?})",
            c.threads,
            c.memory_threads,
            c.chunk_size,
            c.memory_chunk_size,
            self.direct(),
            self.memory_path()
        )
    }
}
