//! `Engine`: the I/O thread pool with its reusable buffers, as Python sees it.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

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
    #[pyo3(signature = (threads=None, chunk_size=None, direct=None, memory_threads=None, idle_release=None, memory_path=None))]
    fn new(
        threads: Option<usize>,
        chunk_size: Option<usize>,
        direct: Option<&str>,
        memory_threads: Option<usize>,
        idle_release: Option<f64>,
        memory_path: Option<&str>,
    ) -> PyResult<Self> {
        let mut cfg = EngineConfig::from_env()?;
        if let Some(s) = idle_release {
            if !(s.is_finite() && (0.0..1e9).contains(&s)) {
                return Err(crate::Error::invalid(format!(
                    "idle_release must be a number of seconds >= 0, not {s}"
                ))
                .into());
            }
            cfg.idle_release = Some(std::time::Duration::from_secs_f64(s));
        }
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

    /// Host memory held by the engine's idle staging buffers.
    fn pooled_bytes(&self) -> usize {
        self.inner.pooled_bytes()
    }

    /// Pinned host memory held by the engine's idle bounce buffers.
    fn pinned_bytes(&self) -> usize {
        self.inner.pinned_bytes()
    }

    /// Give back the memory of the engine's idle buffers (staging and pinned);
    /// the engine stays usable and allocates again when it needs to. Returns
    /// the bytes given back.
    fn release_buffers(&self, py: Python<'_>) -> usize {
        py.detach(|| self.inner.release_buffers())
    }

    /// Give back every idle buffer and keep none from now on (each transfer
    /// then allocates and frees its own); the engine stays usable. Returns the
    /// bytes given back.
    fn close(&self, py: Python<'_>) -> usize {
        py.detach(|| self.inner.close())
    }

    /// Seconds an idle thread's buffers are kept before they go back
    /// (CKPTIO_IDLE_RELEASE); None: kept until released.
    #[getter]
    fn idle_release(&self) -> Option<f64> {
        self.inner.config().idle_release.map(|d| d.as_secs_f64())
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

/// Give back the idle buffers of every engine in the process (staging and
/// pinned bounce buffers) and the file mapping kept for the next read;
/// returns the buffer bytes given back.
#[pyfunction]
pub(super) fn release_buffers(py: Python<'_>) -> usize {
    py.detach(crate::engine::release_buffers)
}

/// Pinned host memory: what ckptio holds now (every engine's bounce buffers
/// and every stager's pinned buffers) and the cap (CKPTIO_PINNED_LIMIT).
#[pyfunction]
pub(super) fn pinned_memory(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("held", crate::gpu::budget::held())?;
    d.set_item("limit", crate::gpu::budget::limit()?)?;
    Ok(d)
}

/// CKPTIO_THREADS as the engine reads it (None where unset; ValueError when
/// malformed or outside 1..=256), for the Python code that needs it too.
#[pyfunction]
pub(super) fn env_threads() -> PyResult<Option<usize>> {
    Ok(crate::engine::threads_from_env()?)
}
