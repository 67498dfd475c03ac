//! torch.save pickles of state dicts, natively: `unpickle` (read by the
//! core's reader, [`crate::format::pickle`], objects made once the storages
//! exist) and `StateDictPickler` (the bytes torch's pickler writes, without a
//! Python call per object).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::format::pickle::{self, op, Parsed, Value};

/// A pickle read, waiting for its storages: `storages` lists them, `build`
/// makes the object once they exist.
#[pyclass(frozen, module = "ckptio._native")]
pub struct Unpickled {
    parsed: Parsed,
    /// Values the result reaches (the rest are call arguments: not made).
    reached: Vec<bool>,
}

/// Read a torch.save pickle (`data.pkl`) of the subset ckptio reads itself
/// (plain tensors, Parameters, dicts, OrderedDicts, lists, tuples, str, int,
/// float, bool, None); None for anything else, which torch.load must read.
#[pyfunction]
pub(super) fn unpickle(py: Python<'_>, data: &[u8]) -> Option<Unpickled> {
    let data = data.to_vec();
    py.detach(|| {
        let parsed = pickle::parse(&data).ok()?;
        let reached = pickle::reachable(&parsed.values, parsed.root);
        Some(Unpickled { parsed, reached })
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
            .zip(&self.reached)
            .filter(|(v, r)| **r && matches!(v, Value::Tensor { .. }))
            .count()
    }

    /// Make the object: `rebuild_tensor(storage index, offset, size, stride,
    /// requires_grad, hooks)` for each tensor, `rebuild_parameter(tensor,
    /// requires_grad, hooks)` for each Parameter, `ordered_dict()` for each
    /// OrderedDict; containers filled after every object exists (so memo
    /// references keep aliasing and cycles), attributes set on OrderedDicts.
    fn build<'py>(
        &self,
        py: Python<'py>,
        rebuild_tensor: &Bound<'py, PyAny>,
        rebuild_parameter: &Bound<'py, PyAny>,
        ordered_dict: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let values = &self.parsed.values;
        let mut objs: Vec<Option<Bound<'py, PyAny>>> = Vec::with_capacity(values.len());
        let get =
            |objs: &Vec<Option<Bound<'py, PyAny>>>, i: usize| -> PyResult<Bound<'py, PyAny>> {
                objs.get(i).and_then(Clone::clone).ok_or_else(|| {
                    pyo3::exceptions::PyRuntimeError::new_err("pickle value used before it is made")
                })
            };
        for (i, v) in values.iter().enumerate() {
            if !self.reached[i] {
                objs.push(None);
                continue;
            }
            let o: Bound<'py, PyAny> = match v {
                Value::None => py.None().into_bound(py),
                Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
                Value::Int(n) => PyInt::new(py, *n).into_any(),
                Value::Float(x) => PyFloat::new(py, *x).into_any(),
                Value::Str(s) => PyString::new(py, s).into_any(),
                Value::Tuple(items) => {
                    let parts = items
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
                } => rebuild_tensor.call1((
                    *storage,
                    *offset,
                    PyTuple::new(py, size)?,
                    PyTuple::new(py, stride)?,
                    *requires_grad,
                    get(&objs, *hooks)?,
                ))?,
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
            if !self.reached[i] {
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
/// `Tensor.__reduce_ex__`, for dicts, lists, tuples, str, int, float, bool,
/// None, OrderedDicts (with attributes), plain tensors and Parameters. `dump`
/// returns None for anything else (the caller's Python pickler then takes it).
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

/// Synthetic memo identities: object addresses end in binary 00, these in 01
/// (the "storage" string, then locations) or 11 (storage keys).
const ID_STORAGE_STR: u64 = 1;

/// A storage the pickle names: (key, address, nbytes, device or -1, the
/// storage object).
type Stored = (String, u64, u64, i32, Py<PyAny>);

struct Walk<'py, 'a> {
    cfg: &'a StateDictPickler,
    py: Python<'py>,
    w: pickle::Writer,
    /// Memoized objects, kept alive so that no address is reused meanwhile.
    keep: Vec<Bound<'py, PyAny>>,
    /// In key order.
    storages: Vec<Stored>,
    keys: std::collections::HashMap<i64, usize>,
    /// data_ptr -> dtype (torch's check that one memory has one dtype)
    dtypes: std::collections::HashMap<u64, usize>,
    /// (storage _cdata, dtype) -> (its key's index, numel)
    refs: std::collections::HashMap<(i64, usize), (usize, i64)>,
    locations: std::collections::HashMap<i32, (u64, String)>,
    next_id: u64,
    depth: usize,
}

/// Past this depth the walk gives up (CPython's pickler would raise
/// RecursionError near 1000; the Python pickler then says so).
const MAX_DEPTH: usize = 500;

impl<'py> Walk<'py, '_> {
    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        (self.next_id << 2) | 1
    }

    fn id(o: &Bound<'py, PyAny>) -> u64 {
        o.as_ptr() as u64
    }

    fn memoized(&mut self, o: &Bound<'py, PyAny>) -> bool {
        match self.w.memo_get(Self::id(o)) {
            Some(i) => {
                self.w.get(i);
                true
            }
            None => false,
        }
    }

    fn put_obj(&mut self, o: &Bound<'py, PyAny>) {
        self.w.put(Some(Self::id(o)));
        self.keep.push(o.clone());
    }

    /// GLOBAL of a module-level function or class, memoized by identity.
    fn global(&mut self, o: &Bound<'py, PyAny>) -> Walked<()> {
        if self.memoized(o) {
            return Ok(());
        }
        let module: String = o.getattr(intern!(self.py, "__module__"))?.extract()?;
        let name: String = o.getattr(intern!(self.py, "__qualname__"))?.extract()?;
        self.w.global(&module, &name);
        self.put_obj(o);
        Ok(())
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
            self.w.none();
            return Ok(());
        }
        let t = o.get_type();
        if t.is(self.py.get_type::<PyBool>()) {
            self.w.bool(o.is_truthy()?);
            return Ok(());
        }
        if t.is(self.py.get_type::<PyInt>()) {
            let v: i64 = o.extract().map_err(|_| Stop::Unsupported)?;
            self.w.int(v);
            return Ok(());
        }
        if t.is(self.py.get_type::<PyFloat>()) {
            self.w.float(o.extract()?);
            return Ok(());
        }
        if self.memoized(o) {
            return Ok(());
        }
        if t.is(self.py.get_type::<PyString>()) {
            let s = o.cast::<PyString>()?;
            let s = s.to_str().map_err(|_| Stop::Unsupported)?;
            self.w.str(s);
            self.put_obj(o);
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

    /// CPython's batch_dict_exact: one item as SETITEM, else batches of
    /// 1000 (and an empty one after a last full batch).
    fn dict(&mut self, d: &Bound<'py, PyDict>) -> Walked<()> {
        self.w.op(op::EMPTY_DICT);
        self.put_obj(d.as_any());
        let items: Vec<_> = d.iter().collect();
        match items.len() {
            0 => {}
            1 => {
                self.save(&items[0].0)?;
                self.save(&items[0].1)?;
                self.w.op(op::SETITEM);
            }
            _ => {
                let mut rest = &items[..];
                loop {
                    self.w.op(op::MARK);
                    let n = rest.len().min(1000);
                    for (k, v) in &rest[..n] {
                        self.save(k)?;
                        self.save(v)?;
                    }
                    self.w.op(op::SETITEMS);
                    rest = &rest[n..];
                    if n != 1000 {
                        break;
                    }
                }
            }
        }
        if d.len() != items.len() {
            return Err(Stop::Unsupported);
        }
        Ok(())
    }

    /// CPython's batch_dict over an iterator (an OrderedDict's items): one
    /// item as SETITEM, else batches of 1000, no empty batch.
    fn dict_items(&mut self, items: &[(Bound<'py, PyAny>, Bound<'py, PyAny>)]) -> Walked<()> {
        if items.len() == 1 {
            self.save(&items[0].0)?;
            self.save(&items[0].1)?;
            self.w.op(op::SETITEM);
            return Ok(());
        }
        for batch in items.chunks(1000) {
            if batch.len() == 1 {
                self.save(&batch[0].0)?;
                self.save(&batch[0].1)?;
                self.w.op(op::SETITEM);
                continue;
            }
            self.w.op(op::MARK);
            for (k, v) in batch {
                self.save(k)?;
                self.save(v)?;
            }
            self.w.op(op::SETITEMS);
        }
        Ok(())
    }

    fn list(&mut self, l: &Bound<'py, PyList>) -> Walked<()> {
        self.w.op(op::EMPTY_LIST);
        self.put_obj(l.as_any());
        let items: Vec<_> = l.iter().collect();
        match items.len() {
            0 => {}
            1 => {
                self.save(&items[0])?;
                self.w.op(op::APPEND);
            }
            _ => {
                for batch in items.chunks(1000) {
                    self.w.op(op::MARK);
                    for x in batch {
                        self.save(x)?;
                    }
                    self.w.op(op::APPENDS);
                }
            }
        }
        Ok(())
    }

    fn tuple(&mut self, t: &Bound<'py, PyTuple>) -> Walked<()> {
        let n = t.len();
        if n == 0 {
            self.w.op(op::EMPTY_TUPLE);
            return Ok(());
        }
        if n > 3 {
            self.w.op(op::MARK);
        }
        for x in t.iter() {
            self.save(&x)?;
        }
        // A tuple reached again through its own items is memoized by now:
        // drop what was pushed and refer to it (CPython's save_tuple).
        if let Some(i) = self.w.memo_get(Self::id(t.as_any())) {
            if n > 3 {
                self.w.op(op::POP_MARK);
            } else {
                for _ in 0..n {
                    self.w.op(op::POP);
                }
            }
            self.w.get(i);
            return Ok(());
        }
        self.w.op(if n > 3 {
            op::TUPLE
        } else {
            op::TUPLE1 + n as u8 - 1
        });
        self.put_obj(t.as_any());
        Ok(())
    }

    /// A tuple of ints made here (sizes, strides): memoized with a new index.
    fn int_tuple(&mut self, v: &[i64]) {
        if v.is_empty() {
            self.w.op(op::EMPTY_TUPLE);
            return;
        }
        if v.len() > 3 {
            self.w.op(op::MARK);
        }
        for &x in v {
            self.w.int(x);
        }
        self.w.op(if v.len() > 3 {
            op::TUPLE
        } else {
            op::TUPLE1 + v.len() as u8 - 1
        });
        self.w.put(None);
    }

    /// `collections.OrderedDict()` as the reduce makes it: GLOBAL, (), REDUCE.
    fn new_ordered_dict(&mut self) -> Walked<()> {
        let od = self.cfg.ordered_dict.bind(self.py).clone();
        self.global(&od)?;
        self.w.op(op::EMPTY_TUPLE);
        self.w.op(op::REDUCE);
        Ok(())
    }

    fn ordered_dict(&mut self, o: &Bound<'py, PyAny>) -> Walked<()> {
        self.new_ordered_dict()?;
        self.put_obj(o);
        let items: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = o
            .call_method0(intern!(self.py, "items"))?
            .try_iter()?
            .map(|kv| kv.and_then(|kv| kv.extract()))
            .collect::<PyResult<_>>()?;
        self.dict_items(&items)?;
        let state = o.getattr(intern!(self.py, "__dict__"))?;
        if state.len()? > 0 {
            self.save(&state)?;
            self.w.op(op::BUILD);
        }
        Ok(())
    }

    fn parameter(&mut self, p: &Bound<'py, PyAny>) -> Walked<()> {
        if p.getattr(intern!(self.py, "__dict__"))?.len()? > 0 {
            return Err(Stop::Unsupported);
        }
        let f = self.cfg.rebuild_parameter.bind(self.py).clone();
        self.global(&f)?;
        let data = p.getattr(intern!(self.py, "data"))?;
        self.save(&data)?;
        self.w
            .bool(p.getattr(intern!(self.py, "requires_grad"))?.is_truthy()?);
        self.new_ordered_dict()?;
        self.w.put(None);
        self.w.op(op::TUPLE1 + 2);
        self.w.put(None);
        self.w.op(op::REDUCE);
        self.put_obj(p);
        Ok(())
    }

    /// torch's `Tensor.__reduce_ex__` for a plain CPU or CUDA tensor, its
    /// storage named as torch's `persistent_id` names it.
    fn tensor(&mut self, t: &Bound<'py, PyAny>) -> Walked<()> {
        let py = self.py;
        let dtype = t.getattr(intern!(self.py, "dtype"))?;
        let classes = self.cfg.storage_classes.bind(py);
        let Some(class) = classes.get_item(&dtype)? else {
            return Err(Stop::Unsupported);
        };
        let plain = (t.getattr(intern!(self.py, "is_cpu"))?.is_truthy()?
            || t.getattr(intern!(self.py, "is_cuda"))?.is_truthy()?)
            && t.getattr(intern!(self.py, "layout"))?
                .is(self.cfg.strided.bind(py))
            && !t.getattr(intern!(self.py, "is_quantized"))?.is_truthy()?
            && !t.getattr(intern!(self.py, "is_nested"))?.is_truthy()?
            && !t
                .getattr(intern!(self.py, "_backward_hooks"))?
                .is_truthy()?
            && t.getattr(intern!(self.py, "__dict__"))?.len()? == 0
            && self.cfg.tensor_metadata.bind(py).call1((t,))?.len()? == 0;
        if !plain {
            return Err(Stop::Unsupported);
        }
        let st = t.call_method0(intern!(self.py, "untyped_storage"))?;
        let cdata: i64 = st.getattr(intern!(self.py, "_cdata"))?.extract()?;
        let dev: i32 = t.call_method0(intern!(self.py, "get_device"))?.extract()?;
        let dkey = dtype.as_ptr() as usize;
        let (key_index, numel) = match self.refs.get(&(cdata, dkey)) {
            Some(&r) => r,
            None => {
                let ptr: u64 = st.call_method0(intern!(self.py, "data_ptr"))?.extract()?;
                let nbytes: u64 = st.call_method0(intern!(self.py, "nbytes"))?.extract()?;
                if ptr != 0 && *self.dtypes.entry(ptr).or_insert(dkey) != dkey {
                    // torch raises here; let the Python pickler say it.
                    return Err(Stop::Unsupported);
                }
                let key_index = match self.keys.get(&cdata) {
                    Some(&k) => k,
                    None => {
                        let k = self.storages.len();
                        self.storages
                            .push((k.to_string(), ptr, nbytes, dev, st.clone().unbind()));
                        self.keys.insert(cdata, k);
                        k
                    }
                };
                let item: u64 = t
                    .call_method0(intern!(self.py, "element_size"))?
                    .extract()?;
                let r = (key_index, (nbytes / item.max(1)) as i64);
                self.refs.insert((cdata, dkey), r);
                if !self.locations.contains_key(&dev) {
                    let loc: String = self.cfg.location_tag.bind(py).call1((&st,))?.extract()?;
                    let id = self.fresh_id();
                    self.locations.insert(dev, (id, loc));
                }
                r
            }
        };
        let f = self.cfg.rebuild_tensor.bind(py).clone();
        self.global(&f)?;
        self.w.op(op::MARK);
        // The persistent id ("storage", class, key, location, numel): a new
        // tuple each time, as torch's persistent_id returns one.
        self.w.op(op::MARK);
        match self.w.memo_get(ID_STORAGE_STR) {
            Some(i) => self.w.get(i),
            None => {
                self.w.str("storage");
                self.w.put(Some(ID_STORAGE_STR));
            }
        }
        self.global(&class)?;
        let key_id = ((key_index as u64) << 2) | 3;
        match self.w.memo_get(key_id) {
            Some(i) => self.w.get(i),
            None => {
                let key = self.storages[key_index].0.clone();
                self.w.str(&key);
                self.w.put(Some(key_id));
            }
        }
        let (loc_id, loc) = self.locations[&dev].clone();
        match self.w.memo_get(loc_id) {
            Some(i) => self.w.get(i),
            None => {
                self.w.str(&loc);
                self.w.put(Some(loc_id));
            }
        }
        self.w.int(numel);
        self.w.op(op::TUPLE);
        self.w.put(None);
        self.w.op(op::BINPERSID);
        self.w.int(
            t.call_method0(intern!(self.py, "storage_offset"))?
                .extract()?,
        );
        let size: Vec<i64> = t.call_method0(intern!(self.py, "size"))?.extract()?;
        self.int_tuple(&size);
        let stride: Vec<i64> = t.call_method0(intern!(self.py, "stride"))?.extract()?;
        self.int_tuple(&stride);
        self.w
            .bool(t.getattr(intern!(self.py, "requires_grad"))?.is_truthy()?);
        self.new_ordered_dict()?;
        self.w.put(None);
        self.w.op(op::TUPLE);
        self.w.put(None);
        self.w.op(op::REDUCE);
        self.put_obj(t);
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
            w: pickle::Writer::new(),
            keep: Vec::new(),
            storages: Vec::new(),
            keys: Default::default(),
            dtypes: Default::default(),
            refs: Default::default(),
            locations: Default::default(),
            next_id: 0,
            depth: 0,
        };
        match walk.save(obj) {
            Ok(()) => {}
            Err(Stop::Unsupported) => return Ok(None),
            Err(Stop::Py(e)) => return Err(e),
        }
        let bytes = walk.w.finish();
        Ok(Some((PyBytes::new(py, &bytes), walk.storages)))
    }
}
