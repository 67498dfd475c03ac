//! torch.save pickles of state dicts, natively: `unpickle` (read by the
//! core's reader, [`crate::format::pickle`], objects made once the storages
//! exist) and `StateDictPickler` (the bytes torch's pickler writes, without a
//! Python call per object: the walk over the objects is here, the pickling
//! rules in [`crate::format::statedict`]).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use std::collections::HashMap;

use crate::format::pickle::{self, Parsed, Value};
use crate::format::statedict::{self, Batch, Encoder, Global, Storages};

/// A pickle read, waiting for its storages: `storages` lists them, `build`
/// makes the object once they exist.
#[pyclass(frozen, module = "ckptio._native")]
pub struct Unpickled {
    /// Its values; those the result does not reach (call arguments) are not made.
    parsed: Parsed,
}

/// Read a torch.save pickle (`data.pkl`) of the subset ckptio reads itself
/// (plain tensors, Parameters, dicts, OrderedDicts, lists, tuples, str, int,
/// float, bool, None); None for anything else, which torch.load must read.
#[pyfunction]
pub(super) fn unpickle(py: Python<'_>, data: &[u8]) -> Option<Unpickled> {
    // `data` borrows an immutable bytes object the caller holds.
    py.detach(|| {
        let parsed = pickle::parse(data).ok()?;
        Some(Unpickled { parsed })
    })
}

#[pymethods]
impl Unpickled {
    /// The storages the pickle names, in order of first appearance:
    /// [(key, storage class name in module torch, location, numel)].
    fn storages(&self) -> Vec<(String, String, String, u64)> {
        self.parsed
            .storages
            .iter()
            .map(|s| (s.key.clone(), s.class.clone(), s.location.clone(), s.numel))
            .collect()
    }

    /// Tensors the result holds (Parameters counted with their data).
    fn tensors(&self) -> usize {
        self.parsed
            .values
            .iter()
            .zip(&self.parsed.reached)
            .filter(|(v, r)| **r && matches!(v, Value::Tensor { .. }))
            .count()
    }

    /// Make the object: `rebuild_tensor(storage index, offset, size, stride,
    /// requires_grad, hooks, need, contiguous)` for each tensor (`need`, the
    /// storage elements the view needs, and `contiguous`: see
    /// [`pickle::view_layout`]; -1 for a view no checkpoint holds), `rebuild_parameter(tensor,
    /// requires_grad, hooks)` for each Parameter, `ordered_dict()` for each
    /// OrderedDict; containers filled after every object exists (so memo
    /// references keep aliasing and cycles), attributes set on OrderedDicts.
    ///
    /// `made`: (per storage, a callable making an empty tensor of its dtype and
    /// device; the storages; the elements each holds): a tensor whose view fits
    /// its storage is made here, as `rebuild_tensor` would (`new()`, `set_`,
    /// `requires_grad` where set, `_backward_hooks`), without a Python call of
    /// its own (a third of the time 20,000 tensors took); the rest go to
    /// `rebuild_tensor`, which says what is wrong.
    #[pyo3(signature = (rebuild_tensor, rebuild_parameter, ordered_dict, made=None))]
    fn build<'py>(
        &self,
        py: Python<'py>,
        rebuild_tensor: &Bound<'py, PyAny>,
        rebuild_parameter: &Bound<'py, PyAny>,
        ordered_dict: &Bound<'py, PyAny>,
        made: Option<(Bound<'py, PyList>, Bound<'py, PyList>, Vec<u64>)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let values = &self.parsed.values;
        let mut dims = ([0i64; pickle::MAX_DIMS], [0i64; pickle::MAX_DIMS]);
        let mut objs: Vec<Option<Bound<'py, PyAny>>> = Vec::with_capacity(values.len());
        let get =
            |objs: &Vec<Option<Bound<'py, PyAny>>>, i: usize| -> PyResult<Bound<'py, PyAny>> {
                objs.get(i).and_then(Clone::clone).ok_or_else(|| {
                    pyo3::exceptions::PyRuntimeError::new_err("pickle value used before it is made")
                })
            };
        for (i, v) in values.iter().enumerate() {
            if !self.parsed.reached[i] {
                objs.push(None);
                continue;
            }
            let o: Bound<'py, PyAny> = match v {
                Value::None => py.None().into_bound(py),
                Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
                Value::Int(n) => PyInt::new(py, *n).into_any(),
                Value::Float(x) => PyFloat::new(py, *x).into_any(),
                Value::Str(s) => PyString::new(py, s).into_any(),
                Value::Tuple { items, .. } => {
                    let parts = self
                        .parsed
                        .tuple(*items)
                        .iter()
                        .map(|&k| get(&objs, k))
                        .collect::<PyResult<Vec<_>>>()?;
                    PyTuple::new(py, parts)?.into_any()
                }
                Value::List(_) => PyList::empty(py).into_any(),
                Value::Dict(_) => PyDict::new(py).into_any(),
                Value::OrderedDict { .. } => ordered_dict.call0()?,
                Value::Tensor {
                    storage,
                    offset,
                    size,
                    stride,
                    requires_grad,
                    hooks,
                } => {
                    let size = self.parsed.dims(*size, &mut dims.0);
                    let stride = self.parsed.dims(*stride, &mut dims.1);
                    // -1: a view no checkpoint holds; Python says what is wrong.
                    let (need, contiguous) = match pickle::view_layout(*offset, size, stride) {
                        Some((n, c)) => (n as i64, c),
                        None => (-1, false),
                    };
                    let fits = |limits: &Vec<u64>| {
                        need >= 0 && limits.get(*storage).is_some_and(|&n| need as u64 <= n)
                    };
                    match &made {
                        Some((news, storages, limits)) if fits(limits) => {
                            let t = news.get_item(*storage)?.call0()?.call_method1(
                                intern!(py, "set_"),
                                (
                                    storages.get_item(*storage)?,
                                    *offset,
                                    PyTuple::new(py, size)?,
                                    PyTuple::new(py, stride)?,
                                ),
                            )?;
                            if *requires_grad {
                                t.setattr(intern!(py, "requires_grad"), true)?;
                            }
                            t.setattr(intern!(py, "_backward_hooks"), get(&objs, *hooks)?)?;
                            t
                        }
                        _ => rebuild_tensor.call1((
                            *storage,
                            *offset,
                            PyTuple::new(py, size)?,
                            PyTuple::new(py, stride)?,
                            *requires_grad,
                            get(&objs, *hooks)?,
                            need,
                            contiguous,
                        ))?,
                    }
                }
                Value::Parameter {
                    tensor,
                    requires_grad,
                    hooks,
                } => rebuild_parameter.call1((
                    get(&objs, *tensor)?,
                    *requires_grad,
                    get(&objs, *hooks)?,
                ))?,
                // Never reached from the result (the reader refuses that).
                Value::Storage(_) | Value::StorageClass(_) => py.None().into_bound(py),
            };
            objs.push(Some(o));
        }
        for (i, v) in values.iter().enumerate() {
            if !self.parsed.reached[i] {
                continue;
            }
            let o = get(&objs, i)?;
            match v {
                Value::List(items) => {
                    let l = o.cast::<PyList>()?;
                    for &k in items {
                        l.append(get(&objs, k)?)?;
                    }
                }
                Value::Dict(kv) => {
                    let d = o.cast::<PyDict>()?;
                    for &(k, x) in kv {
                        d.set_item(get(&objs, k)?, get(&objs, x)?)?;
                    }
                }
                Value::OrderedDict { items, attrs } => {
                    for &(k, x) in items {
                        o.set_item(get(&objs, k)?, get(&objs, x)?)?;
                    }
                    if !attrs.is_empty() {
                        // BUILD's dict state: the instance dict updated, as pickle does.
                        let d = o.getattr("__dict__")?;
                        for (name, x) in attrs {
                            d.set_item(name.as_str(), get(&objs, *x)?)?;
                        }
                    }
                }
                _ => {}
            }
        }
        get(&objs, self.parsed.root)
    }
}

/// Why the native walk stopped: an object outside its subset (the Python
/// pickler takes the whole object instead), or a Python error.
enum Stop {
    Unsupported,
    Py(PyErr),
}

impl From<PyErr> for Stop {
    fn from(e: PyErr) -> Self {
        Stop::Py(e)
    }
}

impl From<pyo3::CastError<'_, '_>> for Stop {
    fn from(e: pyo3::CastError<'_, '_>) -> Self {
        Stop::Py(e.into())
    }
}

type Walked<T> = Result<T, Stop>;

/// Writes torch.save's pickle of a state dict natively: the bytes CPython's
/// pickler writes at protocol 2 with torch's `persistent_id` and
/// `Tensor.__reduce_ex__` ([`crate::format::statedict`] holds those rules),
/// for dicts, lists, tuples, str, int, float, bool, None, OrderedDicts (with
/// attributes), plain tensors and Parameters. `dump` returns None for anything
/// else (the caller's Python pickler then takes it).
#[pyclass(frozen, module = "ckptio._native")]
pub struct StateDictPickler {
    tensor: Py<PyAny>,
    parameter: Py<PyAny>,
    ordered_dict: Py<PyAny>,
    strided: Py<PyAny>,
    /// dtype -> the storage class torch names its tensors' storages by.
    storage_classes: Py<PyDict>,
    /// torch._C._get_tensor_metadata
    tensor_metadata: Py<PyAny>,
    /// torch.serialization.location_tag
    location_tag: Py<PyAny>,
    rebuild_tensor: Py<PyAny>,
    rebuild_parameter: Py<PyAny>,
}

/// A storage the pickle names: (key, address, nbytes, device or -1, the
/// storage object).
type Stored = (String, u64, u64, i32, Py<PyAny>);

/// The walk over the Python objects: it asks what each one is and hands the
/// encoder what the format needs.
struct Walk<'py, 'a> {
    cfg: &'a StateDictPickler,
    py: Python<'py>,
    enc: Encoder,
    storages: Storages,
    /// Memoized objects, kept alive so that no address is reused meanwhile.
    keep: Vec<Bound<'py, PyAny>>,
    /// In key order.
    stored: Vec<Stored>,
    /// A global's identity -> (module, qualname), read once.
    names: HashMap<u64, (String, String)>,
    /// Device -> torch's location tag.
    locations: HashMap<i32, String>,
    depth: usize,
}

/// Past this depth the walk gives up (CPython's pickler would raise
/// RecursionError near 1000; the Python pickler then says so).
const MAX_DEPTH: usize = 500;

fn id(o: &Bound<'_, PyAny>) -> u64 {
    o.as_ptr() as u64
}

impl<'py> Walk<'py, '_> {
    /// The memo identity of a module-level function or class, its name read
    /// once.
    fn named(&mut self, o: &Bound<'py, PyAny>) -> Walked<u64> {
        let id = id(o);
        if !self.names.contains_key(&id) {
            let module: String = o.getattr(intern!(self.py, "__module__"))?.extract()?;
            let name: String = o.getattr(intern!(self.py, "__qualname__"))?.extract()?;
            self.names.insert(id, (module, name));
            self.keep.push(o.clone());
        }
        Ok(id)
    }

    fn global_of(names: &HashMap<u64, (String, String)>, id: u64) -> Global<'_> {
        let (module, name) = &names[&id];
        Global { id, module, name }
    }

    fn ordered_dict_global(&mut self) -> Walked<u64> {
        let od = self.cfg.ordered_dict.bind(self.py).clone();
        self.named(&od)
    }

    fn save(&mut self, o: &Bound<'py, PyAny>) -> Walked<()> {
        if self.depth > MAX_DEPTH {
            return Err(Stop::Unsupported);
        }
        self.depth += 1;
        let r = self.save_inner(o);
        self.depth -= 1;
        r
    }

    fn save_inner(&mut self, o: &Bound<'py, PyAny>) -> Walked<()> {
        if o.is_none() {
            self.enc.none();
            return Ok(());
        }
        let t = o.get_type();
        if t.is(self.py.get_type::<PyBool>()) {
            self.enc.bool(o.is_truthy()?);
            return Ok(());
        }
        if t.is(self.py.get_type::<PyInt>()) {
            let v: i64 = o.extract().map_err(|_| Stop::Unsupported)?;
            self.enc.int(v);
            return Ok(());
        }
        if t.is(self.py.get_type::<PyFloat>()) {
            self.enc.float(o.extract()?);
            return Ok(());
        }
        if self.enc.memoized(id(o)) {
            return Ok(());
        }
        if t.is(self.py.get_type::<PyString>()) {
            let s = o.cast::<PyString>()?;
            let s = s.to_str().map_err(|_| Stop::Unsupported)?;
            self.enc.str(id(o), s);
            self.keep.push(o.clone());
        } else if t.is(self.py.get_type::<PyDict>()) {
            self.dict(o.cast::<PyDict>()?)?;
        } else if t.is(self.py.get_type::<PyList>()) {
            self.list(o.cast::<PyList>()?)?;
        } else if t.is(self.py.get_type::<PyTuple>()) {
            self.tuple(o.cast::<PyTuple>()?)?;
        } else if t.is(self.cfg.tensor.bind(self.py)) {
            self.tensor(o)?;
        } else if t.is(self.cfg.ordered_dict.bind(self.py)) {
            self.ordered_dict(o)?;
        } else if t.is(self.cfg.parameter.bind(self.py)) {
            self.parameter(o)?;
        } else {
            return Err(Stop::Unsupported);
        }
        Ok(())
    }

    /// Key-value pairs in `batches`.
    fn pairs(
        &mut self,
        items: &[(Bound<'py, PyAny>, Bound<'py, PyAny>)],
        batches: &[Batch],
    ) -> Walked<()> {
        for b in batches {
            self.enc.batch_start(b);
            for (k, v) in &items[b.items.clone()] {
                self.save(k)?;
                self.save(v)?;
            }
            self.enc.batch_end(b);
        }
        Ok(())
    }

    fn dict(&mut self, d: &Bound<'py, PyDict>) -> Walked<()> {
        self.enc.dict_start(id(d.as_any()));
        self.keep.push(d.as_any().clone());
        let items: Vec<_> = d.iter().collect();
        self.pairs(&items, &statedict::dict_batches(items.len()))?;
        if d.len() != items.len() {
            return Err(Stop::Unsupported);
        }
        Ok(())
    }

    fn list(&mut self, l: &Bound<'py, PyList>) -> Walked<()> {
        self.enc.list_start(id(l.as_any()));
        self.keep.push(l.as_any().clone());
        let items: Vec<_> = l.iter().collect();
        for b in statedict::list_batches(items.len()) {
            self.enc.batch_start(&b);
            for x in &items[b.items.clone()] {
                self.save(x)?;
            }
            self.enc.batch_end(&b);
        }
        Ok(())
    }

    fn tuple(&mut self, t: &Bound<'py, PyTuple>) -> Walked<()> {
        let n = t.len();
        self.enc.tuple_start(n);
        for x in t.iter() {
            self.save(&x)?;
        }
        self.enc.tuple_end(id(t.as_any()), n);
        if n > 0 {
            self.keep.push(t.as_any().clone());
        }
        Ok(())
    }

    fn ordered_dict(&mut self, o: &Bound<'py, PyAny>) -> Walked<()> {
        let od = self.ordered_dict_global()?;
        self.enc
            .ordered_dict_start(Self::global_of(&self.names, od), id(o));
        self.keep.push(o.clone());
        let items: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = o
            .call_method0(intern!(self.py, "items"))?
            .try_iter()?
            .map(|kv| kv.and_then(|kv| kv.extract()))
            .collect::<PyResult<_>>()?;
        self.pairs(&items, &statedict::ordered_dict_batches(items.len()))?;
        let state = o.getattr(intern!(self.py, "__dict__"))?;
        if state.len()? > 0 {
            self.save(&state)?;
            self.enc.ordered_dict_attrs();
        }
        Ok(())
    }

    fn parameter(&mut self, p: &Bound<'py, PyAny>) -> Walked<()> {
        if p.getattr(intern!(self.py, "__dict__"))?.len()? > 0 {
            return Err(Stop::Unsupported);
        }
        let rebuild = self.cfg.rebuild_parameter.bind(self.py).clone();
        let rebuild = self.named(&rebuild)?;
        let od = self.ordered_dict_global()?;
        self.enc
            .parameter_start(Self::global_of(&self.names, rebuild));
        let data = p.getattr(intern!(self.py, "data"))?;
        self.save(&data)?;
        let requires_grad = p.getattr(intern!(self.py, "requires_grad"))?.is_truthy()?;
        self.enc
            .parameter_end(Self::global_of(&self.names, od), id(p), requires_grad);
        self.keep.push(p.clone());
        Ok(())
    }

    /// torch's `Tensor.__reduce_ex__` for a plain CPU or CUDA tensor, its
    /// storage named as torch's `persistent_id` names it.
    fn tensor(&mut self, t: &Bound<'py, PyAny>) -> Walked<()> {
        let py = self.py;
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let classes = self.cfg.storage_classes.bind(py);
        let Some(class) = classes.get_item(&dtype)? else {
            return Err(Stop::Unsupported);
        };
        let plain = (t.getattr(intern!(py, "is_cpu"))?.is_truthy()?
            || t.getattr(intern!(py, "is_cuda"))?.is_truthy()?)
            && t.getattr(intern!(py, "layout"))?
                .is(self.cfg.strided.bind(py))
            && !t.getattr(intern!(py, "is_quantized"))?.is_truthy()?
            && !t.getattr(intern!(py, "is_nested"))?.is_truthy()?
            && !t.getattr(intern!(py, "_backward_hooks"))?.is_truthy()?
            && t.getattr(intern!(py, "__dict__"))?.len()? == 0
            && self.cfg.tensor_metadata.bind(py).call1((t,))?.len()? == 0;
        if !plain {
            return Err(Stop::Unsupported);
        }
        let st = t.call_method0(intern!(py, "untyped_storage"))?;
        let cdata: i64 = st.getattr(intern!(py, "_cdata"))?.extract()?;
        let dev: i32 = t.call_method0(intern!(py, "get_device"))?.extract()?;
        let dkey = dtype.as_ptr() as usize;
        let storage = match self.storages.known(cdata, dkey) {
            Some(r) => r,
            None => {
                let ptr: u64 = st.call_method0(intern!(py, "data_ptr"))?.extract()?;
                let nbytes: u64 = st.call_method0(intern!(py, "nbytes"))?.extract()?;
                let item: u64 = t.call_method0(intern!(py, "element_size"))?.extract()?;
                // torch raises on one memory under two dtypes; let the Python
                // pickler say it.
                let r = self
                    .storages
                    .name(cdata, dkey, ptr, nbytes, item)
                    .map_err(|_| Stop::Unsupported)?;
                if r.new {
                    self.stored
                        .push((r.key.to_string(), ptr, nbytes, dev, st.clone().unbind()));
                }
                if !self.locations.contains_key(&dev) {
                    let loc: String = self.cfg.location_tag.bind(py).call1((&st,))?.extract()?;
                    self.locations.insert(dev, loc);
                }
                r
            }
        };
        let offset: i64 = t.call_method0(intern!(py, "storage_offset"))?.extract()?;
        let size: Vec<i64> = t.call_method0(intern!(py, "size"))?.extract()?;
        let stride: Vec<i64> = t.call_method0(intern!(py, "stride"))?.extract()?;
        let requires_grad = t.getattr(intern!(py, "requires_grad"))?.is_truthy()?;
        let rebuild = self.cfg.rebuild_tensor.bind(py).clone();
        let rebuild = self.named(&rebuild)?;
        let class = self.named(&class)?;
        let od = self.ordered_dict_global()?;
        let names = &self.names;
        self.enc.tensor(
            Self::global_of(names, rebuild),
            Self::global_of(names, class),
            Self::global_of(names, od),
            &statedict::Tensor {
                id: id(t),
                storage,
                device: dev,
                location: &self.locations[&dev],
                offset,
                size: &size,
                stride: &stride,
                requires_grad,
            },
        );
        self.keep.push(t.clone());
        Ok(())
    }
}

#[pymethods]
impl StateDictPickler {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tensor: Py<PyAny>,
        parameter: Py<PyAny>,
        ordered_dict: Py<PyAny>,
        strided: Py<PyAny>,
        storage_classes: Py<PyDict>,
        tensor_metadata: Py<PyAny>,
        location_tag: Py<PyAny>,
        rebuild_tensor: Py<PyAny>,
        rebuild_parameter: Py<PyAny>,
    ) -> Self {
        StateDictPickler {
            tensor,
            parameter,
            ordered_dict,
            strided,
            storage_classes,
            tensor_metadata,
            location_tag,
            rebuild_tensor,
            rebuild_parameter,
        }
    }

    /// (data.pkl's bytes, [(storage key, address, nbytes, device or -1,
    /// storage)] in key order), or None for an object outside the subset.
    /// Each storage object owns its memory (the engine's owner for it).
    #[allow(clippy::type_complexity)]
    fn dump<'py>(
        &self,
        py: Python<'py>,
        obj: &Bound<'py, PyAny>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<Stored>)>> {
        let mut walk = Walk {
            cfg: self,
            py,
            enc: Encoder::new(),
            storages: Storages::default(),
            keep: Vec::new(),
            stored: Vec::new(),
            names: HashMap::new(),
            locations: HashMap::new(),
            depth: 0,
        };
        match walk.save(obj) {
            Ok(()) => {}
            Err(Stop::Unsupported) => return Ok(None),
            Err(Stop::Py(e)) => return Err(e),
        }
        let bytes = walk.enc.finish();
        Ok(Some((PyBytes::new(py, &bytes), walk.stored)))
    }
}
