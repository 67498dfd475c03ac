//! The objects that own a call's memory: held until the call returns, and the
//! extents read from them, while attached, that every address of the call is
//! checked against before any byte moves ([`crate::engine::Owned`]).
//!
//! Soundness does not rest on the Python caller: an extent comes from the
//! owner object itself, never from the addresses the caller hands.
//!
//! - `torch.UntypedStorage`: `data_ptr()`, `nbytes()`, `device`;
//! - `torch.Tensor` (and subclasses, e.g. Parameter): its untyped storage's
//!   extent (all of it: a view's bytes may lie anywhere in it), on the
//!   tensor's device;
//! - ckptio's `HostMemory`: its mapping, read in Rust;
//! - anything else is a `TypeError` naming it; memory on a device other than
//!   the CPU or CUDA is a `ValueError`.
//!
//! A range outside every owner is a `ValueError` naming it (the core's
//! `InvalidArgument`). Cost: a few attribute reads per owner (about 0.3 us;
//! the exact types are recognised by identity, a device by comparison with
//! the call's earlier ones), then one sort and a binary search per range.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::engine::{Extent, Memory, Owned, Segment};

use super::hostmem::HostMemory;

/// torch's types and the CPU device, looked up once.
struct Torch {
    storage: Py<PyType>,
    tensor: Py<PyType>,
    cpu: Py<PyAny>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn torch(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import(intern!(py, "torch"))?;
        Ok::<_, PyErr>(Torch {
            storage: torch
                .getattr("UntypedStorage")?
                .cast_into::<PyType>()?
                .unbind(),
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            cpu: torch.getattr("device")?.call1(("cpu",))?.unbind(),
        })
    })
}

/// What an owner is, by its type.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Storage,
    Tensor,
    HostMemory,
}

/// Reads owners' extents; remembers the call's last type and devices, so a
/// list of one kind of owner on one device costs a comparison each.
struct Reader<'py> {
    py: Python<'py>,
    torch: &'py Torch,
    last_type: Option<(Bound<'py, PyType>, Kind)>,
    devices: Vec<(Bound<'py, PyAny>, Memory)>,
}

impl<'py> Reader<'py> {
    fn new(py: Python<'py>) -> PyResult<Self> {
        Ok(Reader {
            py,
            torch: torch(py)?,
            last_type: None,
            devices: Vec::new(),
        })
    }

    fn kind(&mut self, o: &Bound<'py, PyAny>, what: &dyn Fn() -> String) -> PyResult<Kind> {
        let ty = o.get_type();
        if let Some((t, k)) = &self.last_type {
            if t.is(&ty) {
                return Ok(*k);
            }
        }
        let (storage, tensor) = (
            self.torch.storage.bind(self.py),
            self.torch.tensor.bind(self.py),
        );
        let k = if ty.is(storage) {
            Kind::Storage
        } else if ty.is(tensor) || ty.is_subclass(tensor)? {
            Kind::Tensor
        } else if o.is_instance_of::<HostMemory>() {
            Kind::HostMemory
        } else if ty.is_subclass(storage)? {
            Kind::Storage
        } else {
            return Err(PyTypeError::new_err(format!(
                "{} is a {}: the memory of a native call must be owned by a \
                 torch.UntypedStorage, a torch.Tensor or a ckptio HostMemory",
                what(),
                ty.name().map_or_else(|_| "?".into(), |n| n.to_string())
            )));
        };
        self.last_type = Some((ty, k));
        Ok(k)
    }

    /// The memory a torch.device names: the CPU, or a CUDA device.
    fn device(&mut self, d: Bound<'py, PyAny>, what: &dyn Fn() -> String) -> PyResult<Memory> {
        if d.eq(self.torch.cpu.bind(self.py))? {
            return Ok(Memory::Host);
        }
        for (seen, m) in &self.devices {
            if d.eq(seen)? {
                return Ok(*m);
            }
        }
        let ty: String = d.getattr(intern!(self.py, "type"))?.extract()?;
        let index: Option<i32> = d.getattr(intern!(self.py, "index"))?.extract()?;
        let m = match (ty.as_str(), index) {
            ("cuda", Some(i)) => Memory::Cuda(i),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{} is on device {}: ckptio moves cpu and cuda memory only",
                    what(),
                    d.str().map_or_else(|_| ty.clone(), |s| s.to_string())
                )))
            }
        };
        self.devices.push((d, m));
        Ok(m)
    }

    fn storage_extent(&self, st: &Bound<'py, PyAny>, memory: Memory) -> PyResult<Extent> {
        let py = self.py;
        // An UntypedStorage's len() is its nbytes(), through a type slot: half
        // the cost of the method call (a subclass may redefine either).
        let len = if st.get_type().is(self.torch.storage.bind(py)) {
            st.len()? as u64
        } else {
            st.call_method0(intern!(py, "nbytes"))?.extract()?
        };
        Ok(Extent {
            memory,
            addr: st.call_method0(intern!(py, "data_ptr"))?.extract()?,
            len,
        })
    }

    /// `o`'s extent; `what` names it in errors ("owner 3").
    fn extent(&mut self, o: &Bound<'py, PyAny>, what: &dyn Fn() -> String) -> PyResult<Extent> {
        let py = self.py;
        match self.kind(o, what)? {
            Kind::Storage => {
                let memory = self.device(o.getattr(intern!(py, "device"))?, what)?;
                self.storage_extent(o, memory)
            }
            Kind::Tensor => {
                // is_cpu / get_device() cost 40 ns where .device costs 0.5 us.
                let memory = if o.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
                    Memory::Host
                } else if o.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
                    Memory::Cuda(o.call_method0(intern!(py, "get_device"))?.extract()?)
                } else {
                    self.device(o.getattr(intern!(py, "device"))?, what)?
                };
                let st = o.call_method0(intern!(py, "untyped_storage"))?;
                self.storage_extent(&st, memory)
            }
            Kind::HostMemory => Ok(o.cast::<HostMemory>()?.get().extent()),
        }
    }
}

/// The extent of one owner object (a pin's, a registration's).
pub(super) fn extent_of(owner: &Bound<'_, PyAny>) -> PyResult<Extent> {
    Reader::new(owner.py())?.extent(owner, &|| "the owner".to_string())
}

/// The objects owning a call's memory (a list), held until the call returns,
/// and their extents.
pub(super) struct Owners {
    held: Vec<Py<PyAny>>,
    owned: Owned,
}

impl<'a, 'py> FromPyObject<'a, 'py> for Owners {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let list: Vec<Bound<'py, PyAny>> = obj.extract()?;
        let mut r = Reader::new(obj.py())?;
        let mut extents = Vec::with_capacity(list.len());
        for (i, o) in list.iter().enumerate() {
            extents.push(r.extent(o, &|| format!("owner {i}"))?);
        }
        Ok(Owners {
            held: list.into_iter().map(Bound::unbind).collect(),
            owned: Owned::new(extents),
        })
    }
}

impl Owners {
    /// `[addr, addr + len)` on `memory` must lie inside one owner's memory;
    /// `what()` names the range in the error.
    pub(super) fn check(
        &self,
        memory: Memory,
        addr: u64,
        len: u64,
        what: impl FnOnce() -> String,
    ) -> crate::Result<()> {
        self.owned.check(memory, addr, len, what)
    }

    /// Every segment must lie inside one owner's memory ("segment i").
    pub(super) fn check_segments(&self, segments: &[Segment]) -> crate::Result<()> {
        segments
            .iter()
            .enumerate()
            .try_for_each(|(i, s)| self.check(s.memory, s.addr, s.len, || format!("segment {i}")))
    }

    /// Let go of the owners (attached: each is one reference count).
    pub(super) fn release(self) {
        drop(self.held);
    }
}
