//! Reads the pickles torch.save writes for state dicts, without running Python
//! per opcode.
//!
//! torch.load unpickles `data.pkl` with a pure-Python unpickler when
//! `weights_only` (the default since torch 2.6): about 30 opcodes per tensor,
//! ~35 us each, 0.7 s for 20,000 tensors. This reader accepts a fixed subset:
//! containers (dict, list, tuple, `collections.OrderedDict` with attributes),
//! str, int (64-bit), float, bool and None, and tensors as torch.save pickles
//! plain ones: `torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
//! requires_grad, OrderedDict())` over a storage named by a persistent id
//! `("storage", torch.<X>Storage, key, location, numel)`, and
//! `torch._utils._rebuild_parameter(tensor, requires_grad, OrderedDict())`.
//! Anything else (another global, another call, another opcode, a malformed
//! stream) is [`Unsupported`]: the caller hands the file to torch.load, which
//! decides. What is accepted is a strict subset of what torch's weights_only
//! unpickler accepts, and describes the same objects: the caller rebuilds
//! them with the same torch calls. So the opcodes are those of protocol 2 that
//! torch's `_weights_only_unpickler` reads (not DUP, POP, POP_MARK, nor any of
//! protocols 3-5: FRAME, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE...), PROTO
//! names protocol 2 (torch warns of any other), and a storage class is one of
//! the `torch.<X>Storage` globals torch allows (not `torch.UntypedStorage`,
//! which it allows as `torch.storage.UntypedStorage` only).
//!
//! The result is a graph of [`Value`]s by index (memo references keep
//! aliasing: a list pickled twice is one list), built bottom-up: every value's
//! parts have smaller indexes than it, but the items of a dict or list, which
//! are set after it is made.

use std::collections::HashMap;

/// Why a pickle is not read here (the caller falls back to torch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported(pub String);

type R<T> = std::result::Result<T, Unsupported>;

fn no<T>(why: impl Into<String>) -> R<T> {
    Err(Unsupported(why.into()))
}

/// A storage named by the pickle's persistent ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageRef {
    pub key: String,
    /// The storage class's name in module `torch` (`FloatStorage`, `HalfStorage`...).
    pub class: String,
    pub location: String,
    /// Elements of the class's dtype.
    pub numel: u64,
}

/// A tuple's items in the arena of a [`Parsed`] ([`Parsed::tuple`]): not a
/// vector per tuple (four allocations a tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    start: u32,
    len: u32,
}

/// One object of the pickle.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    /// Its items ([`Parsed::tuple`]); `ints`: all of them ints.
    Tuple {
        items: Span,
        ints: bool,
    },
    List(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    /// `collections.OrderedDict`: items, then attributes set by BUILD.
    OrderedDict {
        items: Vec<(usize, usize)>,
        attrs: Vec<(String, usize)>,
    },
    /// A storage (index into [`Parsed::storages`]); only ever a tensor's
    /// first argument, never reachable from the result.
    Storage(usize),
    /// A storage class (`torch.FloatStorage`), named in persistent ids only;
    /// never reachable from the result.
    StorageClass(&'static str),
    /// `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`.
    Tensor {
        storage: usize,
        offset: i64,
        /// Sizes and strides ([`Parsed::dims`]): the items of tuples of ints,
        /// at most [`MAX_DIMS`], referred to (a memoized tuple is not copied
        /// per tensor).
        size: Span,
        stride: Span,
        requires_grad: bool,
        /// The (empty) OrderedDict set as the tensor's `_backward_hooks`.
        hooks: usize,
    },
    /// `_rebuild_parameter(tensor, requires_grad, hooks)`.
    Parameter {
        tensor: usize,
        requires_grad: bool,
        hooks: usize,
    },
}

/// A pickle read: its values, the one it returns, and the storages it names
/// (in order of first appearance).
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub values: Vec<Value>,
    pub root: usize,
    pub storages: Vec<StorageRef>,
    /// Per value: whether the result reaches it ([`reachable`]).
    pub reached: Vec<bool>,
    /// The tuples' items.
    items: Vec<usize>,
}

/// Dims a tensor read natively may have (torch.load reads the others).
pub const MAX_DIMS: usize = 64;

impl Parsed {
    /// A tuple's items.
    pub fn tuple(&self, s: Span) -> &[usize] {
        span(&self.items, s)
    }

    /// A tensor's sizes or strides (`s` of a [`Value::Tensor`]), in `out`.
    pub fn dims<'a>(&self, s: Span, out: &'a mut [i64; MAX_DIMS]) -> &'a [i64] {
        let n = (s.len as usize).min(MAX_DIMS);
        for (o, &k) in out.iter_mut().zip(self.tuple(s)) {
            // An int: the reader made a tensor only of tuples of ints.
            *o = if let Value::Int(v) = self.values[k] {
                v
            } else {
                0
            };
        }
        &out[..n]
    }
}

fn span<T>(arena: &[T], s: Span) -> &[T] {
    &arena[s.start as usize..s.start as usize + s.len as usize]
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Global {
    RebuildTensor,
    RebuildParameter,
    OrderedDict,
    StorageClass(&'static str),
}

#[derive(Debug, Clone, PartialEq)]
enum Item {
    Mark,
    Val(usize),
    Global(Global),
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return no("pickle ends early");
        };
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> R<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> R<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn str(&mut self, n: usize) -> R<String> {
        match std::str::from_utf8(self.take(n)?) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => no("a string is not UTF-8"),
        }
    }
    fn line(&mut self) -> R<&'a str> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return no("GLOBAL without a newline");
        };
        let s = std::str::from_utf8(&rest[..n]).or_else(|_| no("GLOBAL name is not UTF-8"))?;
        self.pos += n + 1;
        Ok(s)
    }
}

struct Vm {
    values: Vec<Value>,
    stack: Vec<Item>,
    /// Memo by index: picklers number entries from 0 in order (each a PUT of
    /// the pickle's, so this grows no faster than the pickle is read); an index
    /// out of that order goes to `sparse` (a 5-byte LONG_BINPUT of index 2^32-1
    /// once made a 1.5 GiB table here).
    memo: Vec<Option<Item>>,
    sparse: HashMap<u32, Item>,
    storages: Vec<StorageRef>,
    by_key: HashMap<String, usize>,
    /// The tuples' items ([`Parsed::tuple`]).
    items: Vec<usize>,
    /// Per value: its depth as a dict key (a plain value 1, a tuple of keys one
    /// more than its deepest item), 0 where it cannot be one. Set once, when the
    /// value is made (a tuple's items are made before it and never change):
    /// walking the items instead took 2^k steps for a tuple made of k memoized
    /// pairs of itself (a 450-byte pickle), and overflowed the stack for
    /// 300,000 nested tuples.
    keys: Vec<u8>,
}

/// Keys nested deeper than this are refused (torch.load then decides): no
/// state dict holds one, and hashing one recurses in the interpreter.
const MAX_KEY_DEPTH: u8 = 32;

impl Vm {
    fn push(&mut self, v: Value) -> usize {
        let depth = match &v {
            Value::None | Value::Bool(_) | Value::Int(_) | Value::Float(_) | Value::Str(_) => 1,
            Value::Tuple { items, .. } => {
                let mut deepest = 0u8;
                for &i in span(&self.items, *items) {
                    match self.keys[i] {
                        0 => {
                            deepest = MAX_KEY_DEPTH;
                            break;
                        }
                        d => deepest = deepest.max(d),
                    }
                }
                if deepest >= MAX_KEY_DEPTH {
                    0
                } else {
                    deepest + 1
                }
            }
            _ => 0,
        };
        self.values.push(v);
        self.keys.push(depth);
        let i = self.values.len() - 1;
        self.stack.push(Item::Val(i));
        i
    }

    fn pop(&mut self) -> R<Item> {
        match self.stack.pop() {
            Some(Item::Mark) | None => no("stack underflow"),
            Some(x) => Ok(x),
        }
    }

    fn pop_val(&mut self) -> R<usize> {
        match self.pop()? {
            Item::Val(i) => Ok(i),
            _ => no("a global where a value is needed"),
        }
    }

    /// Everything above the topmost mark, which goes too.
    fn pop_mark(&mut self) -> R<Vec<Item>> {
        let Some(m) = self.stack.iter().rposition(|x| *x == Item::Mark) else {
            return no("no MARK on the stack");
        };
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        Ok(items)
    }

    fn vals(items: Vec<Item>) -> R<Vec<usize>> {
        items
            .into_iter()
            .map(|x| match x {
                Item::Val(i) => Ok(i),
                _ => no("a global inside a container"),
            })
            .collect()
    }

    fn top_val(&self) -> R<usize> {
        match self.stack.last() {
            Some(Item::Val(i)) => Ok(*i),
            _ => no("no value on the stack"),
        }
    }

    fn is_key(&self, k: usize) -> bool {
        self.keys[k] != 0
    }

    fn set_items(&mut self, target: usize, pairs: Vec<usize>) -> R<()> {
        if pairs.len() % 2 != 0 {
            return no("SETITEMS with an odd count");
        }
        let mut kv = Vec::with_capacity(pairs.len() / 2);
        for c in pairs.chunks_exact(2) {
            if !self.is_key(c[0]) {
                return no("a dict key that is not a plain value");
            }
            kv.push((c[0], c[1]));
        }
        match &mut self.values[target] {
            Value::Dict(items) | Value::OrderedDict { items, .. } => items.extend(kv),
            _ => return no("SETITEM on something other than a dict"),
        }
        Ok(())
    }

    fn append(&mut self, target: usize, items: Vec<usize>) -> R<()> {
        match &mut self.values[target] {
            Value::List(v) => v.extend(items),
            _ => return no("APPEND on something other than a list"),
        }
        Ok(())
    }

    fn int(&self, i: usize) -> R<i64> {
        match self.values[i] {
            Value::Int(n) => Ok(n),
            _ => no("an int argument is not an int"),
        }
    }

    fn bool(&self, i: usize) -> R<bool> {
        match self.values[i] {
            Value::Bool(b) => Ok(b),
            _ => no("a bool argument is not a bool"),
        }
    }

    /// The items of tuple `i`, if it is one of ints.
    fn ints(&self, i: usize) -> R<Span> {
        match self.values[i] {
            Value::Tuple { items, ints: true } => Ok(items),
            _ => no("sizes or strides are not a tuple of ints"),
        }
    }

    /// A tuple of `items` pushed.
    fn tuple(&mut self, items: impl IntoIterator<Item = usize>) -> R<()> {
        let start = self.items.len();
        self.items.extend(items);
        let all = &self.items[start..];
        let ints = all.iter().all(|&k| matches!(self.values[k], Value::Int(_)));
        let (Ok(start), Ok(len)) = (u32::try_from(start), u32::try_from(all.len())) else {
            return no("a pickle too large");
        };
        self.push(Value::Tuple {
            items: Span { start, len },
            ints,
        });
        Ok(())
    }

    fn empty_od(&self, i: usize) -> R<usize> {
        match &self.values[i] {
            Value::OrderedDict { .. } => Ok(i),
            _ => no("backward hooks are not an OrderedDict"),
        }
    }

    fn reduce(&mut self, f: Global, args: usize) -> R<Value> {
        let Value::Tuple { items, .. } = self.values[args] else {
            return no("REDUCE arguments are not a tuple");
        };
        let a = span(&self.items, items);
        match f {
            Global::OrderedDict if a.is_empty() => Ok(Value::OrderedDict {
                items: Vec::new(),
                attrs: Vec::new(),
            }),
            Global::RebuildTensor if a.len() == 6 => {
                let Value::Storage(storage) = self.values[a[0]] else {
                    return no("a tensor without a storage");
                };
                let size = self.ints(a[2])?;
                let stride = self.ints(a[3])?;
                if size.len != stride.len {
                    return no("sizes and strides of different lengths");
                }
                if size.len as usize > MAX_DIMS {
                    return no(format!("a tensor of {} dims", size.len));
                }
                Ok(Value::Tensor {
                    storage,
                    offset: self.int(a[1])?,
                    size,
                    stride,
                    requires_grad: self.bool(a[4])?,
                    hooks: self.empty_od(a[5])?,
                })
            }
            Global::RebuildParameter if a.len() == 3 => {
                if !matches!(self.values[a[0]], Value::Tensor { .. }) {
                    return no("a parameter of something other than a tensor");
                }
                Ok(Value::Parameter {
                    tensor: a[0],
                    requires_grad: self.bool(a[1])?,
                    hooks: self.empty_od(a[2])?,
                })
            }
            other => no(format!("a call of {other:?} with {} arguments", a.len())),
        }
    }

    fn persistent(&mut self, pid: usize) -> R<Value> {
        let Value::Tuple { items, .. } = self.values[pid] else {
            return no("a persistent id that is not a tuple");
        };
        let [tag, class, key, location, numel] = *span(&self.items, items) else {
            return no("a persistent id of another length");
        };
        let (Value::Str(tag), Value::StorageClass(class), Value::Str(key), Value::Str(location)) = (
            &self.values[tag],
            &self.values[class],
            &self.values[key],
            &self.values[location],
        ) else {
            return no("a persistent id that is not (\"storage\", class, key, location, numel)");
        };
        if tag != "storage" {
            return no("a persistent id that is not a storage");
        }
        let numel = u64::try_from(self.int(numel)?).or_else(|_| no("negative numel"))?;
        let i = match self.by_key.get(key.as_str()) {
            Some(&i) => {
                let r = &self.storages[i];
                if (r.class.as_str(), &r.location, r.numel) != (*class, location, numel) {
                    // One key read as two dtypes or sizes: torch's special cases.
                    return no(format!("storage {key} named twice differently"));
                }
                i
            }
            None => {
                let r = StorageRef {
                    key: key.clone(),
                    class: (*class).to_owned(),
                    location: location.clone(),
                    numel,
                };
                self.by_key.insert(key.clone(), self.storages.len());
                self.storages.push(r);
                self.storages.len() - 1
            }
        };
        Ok(Value::Storage(i))
    }
}

/// The storage classes in module `torch` that torch's weights_only unpickler
/// allows by name (`torch._storage_classes` but TypedStorage and
/// UntypedStorage, which it names in `torch.storage`).
const STORAGE_CLASSES: [&str; 17] = [
    "BFloat16Storage",
    "BoolStorage",
    "ByteStorage",
    "CharStorage",
    "ComplexDoubleStorage",
    "ComplexFloatStorage",
    "DoubleStorage",
    "FloatStorage",
    "HalfStorage",
    "IntStorage",
    "LongStorage",
    "QInt32Storage",
    "QInt8Storage",
    "QUInt2x4Storage",
    "QUInt4x2Storage",
    "QUInt8Storage",
    "ShortStorage",
];

fn global(module: &str, name: &str) -> R<Global> {
    Ok(match (module, name) {
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensor,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch", n) => match STORAGE_CLASSES.iter().find(|&&c| c == n) {
            Some(c) => Global::StorageClass(c),
            None => return no(format!("global {module}.{name}")),
        },
        _ => return no(format!("global {module}.{name}")),
    })
}

/// Read a pickle of the subset in the module doc.
pub fn parse(data: &[u8]) -> R<Parsed> {
    let mut r = Reader { data, pos: 0 };
    // About one value per 8 bytes of a state dict's pickle: few regrowths.
    let mut vm = Vm {
        values: Vec::with_capacity(data.len() / 8),
        stack: Vec::new(),
        memo: Vec::new(),
        sparse: HashMap::new(),
        storages: Vec::new(),
        by_key: HashMap::new(),
        items: Vec::with_capacity(data.len() / 8),
        keys: Vec::with_capacity(data.len() / 8),
    };
    loop {
        let op = r.u8()?;
        match op {
            0x80 => {
                // PROTO: torch's weights_only unpickler warns of any but 2.
                let proto = r.u8()?;
                if proto != 2 {
                    return no(format!("pickle protocol {proto}, not 2"));
                }
            }
            b'.' => break,
            b'(' => vm.stack.push(Item::Mark),
            b'}' => {
                vm.push(Value::Dict(Vec::new()));
            }
            b']' => {
                vm.push(Value::List(Vec::new()));
            }
            b')' => vm.tuple([])?,
            b't' => {
                let items = Vm::vals(vm.pop_mark()?)?;
                vm.tuple(items)?;
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let mut items = [0usize; 3];
                for k in (0..n).rev() {
                    items[k] = vm.pop_val()?;
                }
                vm.tuple(items[..n].iter().copied())?;
            }
            b'q' | b'r' => {
                // BINPUT, LONG_BINPUT
                let idx = if op == b'q' {
                    u32::from(r.u8()?)
                } else {
                    r.u32()?
                };
                let Some(top) = vm.stack.last().cloned() else {
                    return no("memo of an empty stack");
                };
                if top == Item::Mark {
                    return no("memo of a mark");
                }
                let at = idx as usize;
                if at < vm.memo.len() {
                    vm.memo[at] = Some(top);
                } else if at == vm.memo.len() {
                    vm.memo.push(Some(top));
                } else {
                    vm.sparse.insert(idx, top);
                }
            }
            b'h' | b'j' => {
                let idx = if op == b'h' {
                    u32::from(r.u8()?)
                } else {
                    r.u32()?
                };
                let found = match vm.memo.get(idx as usize) {
                    Some(Some(x)) => Some(x.clone()),
                    _ => vm.sparse.get(&idx).cloned(),
                };
                let Some(x) = found else {
                    return no("memo index not defined");
                };
                vm.stack.push(x);
            }
            b'J' => {
                let v = r.u32()? as i32;
                vm.push(Value::Int(i64::from(v)));
            }
            b'K' => {
                let v = r.u8()?;
                vm.push(Value::Int(i64::from(v)));
            }
            b'M' => {
                let v = r.u16()?;
                vm.push(Value::Int(i64::from(v)));
            }
            0x8a => {
                // LONG1: little-endian two's complement
                let n = usize::from(r.u8()?);
                if n > 8 {
                    return no("an int over 64 bits");
                }
                let b = r.take(n)?;
                let mut v: i64 = 0;
                for (i, &x) in b.iter().enumerate() {
                    v |= i64::from(x) << (8 * i);
                }
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                vm.push(Value::Int(v));
            }
            b'G' => {
                let b = r.take(8)?;
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                vm.push(Value::Float(f64::from_be_bytes(a)));
            }
            b'N' => {
                vm.push(Value::None);
            }
            0x88 | 0x89 => {
                vm.push(Value::Bool(op == 0x88));
            }
            b'X' => {
                // BINUNICODE
                let n = r.u32()? as usize;
                let s = r.str(n)?;
                vm.push(Value::Str(s));
            }
            b'a' => {
                let v = vm.pop_val()?;
                let l = vm.top_val()?;
                vm.append(l, vec![v])?;
            }
            b'e' => {
                let items = Vm::vals(vm.pop_mark()?)?;
                let l = vm.top_val()?;
                vm.append(l, items)?;
            }
            b's' => {
                let v = vm.pop_val()?;
                let k = vm.pop_val()?;
                let d = vm.top_val()?;
                vm.set_items(d, vec![k, v])?;
            }
            b'u' => {
                let items = Vm::vals(vm.pop_mark()?)?;
                let d = vm.top_val()?;
                vm.set_items(d, items)?;
            }
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                let g = global(module, name)?;
                vm.stack.push(Item::Global(g));
            }
            b'R' => {
                let args = vm.pop_val()?;
                let f = match vm.pop()? {
                    Item::Global(g) => g,
                    _ => return no("REDUCE of something other than a global"),
                };
                let v = vm.reduce(f, args)?;
                vm.push(v);
            }
            b'Q' => {
                // BINPERSID
                let pid = vm.pop_val()?;
                let v = vm.persistent(pid)?;
                vm.push(v);
            }
            b'b' => {
                // BUILD: only attributes of an OrderedDict (state_dict()'s _metadata).
                let state = vm.pop_val()?;
                let target = vm.top_val()?;
                let Value::Dict(pairs) = vm.values[state].clone() else {
                    return no("BUILD with a state that is not a dict");
                };
                let mut named = Vec::with_capacity(pairs.len());
                for (k, v) in pairs {
                    match &vm.values[k] {
                        Value::Str(s) => named.push((s.clone(), v)),
                        _ => return no("BUILD with a non-str attribute name"),
                    }
                }
                match &mut vm.values[target] {
                    Value::OrderedDict { attrs, .. } => attrs.extend(named),
                    _ => return no("BUILD on something other than an OrderedDict"),
                }
            }
            // DUP, POP, POP_MARK, FRAME, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE,
            // BINUNICODE8... : not read by torch's weights_only unpickler.
            other => return no(format!("opcode {other:#04x}")),
        }
        // A storage class is an argument of a persistent id: carry it as a
        // value so that the id tuple can hold it.
        if let Some(Item::Global(Global::StorageClass(c))) = vm.stack.last().cloned() {
            vm.stack.pop();
            vm.push(Value::StorageClass(c));
        }
    }
    if vm.stack.len() != 1 {
        return no("the stack does not end with one value");
    }
    let root = vm.pop_val()?;
    let reached = check_result(&vm.values, &vm.items, root)?;
    Ok(Parsed {
        values: vm.values,
        root,
        storages: vm.storages,
        reached,
        items: vm.items,
    })
}

/// What the result may not hold: storages and storage classes (torch would
/// hand out storage objects there), hooks that are not empty OrderedDicts.
/// Returns what the result reaches ([`reachable`]).
fn check_result(values: &[Value], items: &[usize], root: usize) -> R<Vec<bool>> {
    for v in values {
        if let Value::Tensor { hooks, .. } | Value::Parameter { hooks, .. } = v {
            match &values[*hooks] {
                Value::OrderedDict { items, attrs } if items.is_empty() && attrs.is_empty() => {}
                _ => return no("backward hooks that are not an empty OrderedDict"),
            }
        }
    }
    let reached = reachable(values, items, root);
    let storage =
        |(v, &r): (&Value, &bool)| r && matches!(v, Value::Storage(_) | Value::StorageClass(_));
    if values.iter().zip(&reached).any(storage) {
        return no("a storage or storage class in the result");
    }
    Ok(reached)
}

/// Which values the result (`root`) reaches through containers, Parameters
/// and tensors' hooks (not through a tensor's storage); `items`: the tuples'.
fn reachable(values: &[Value], items: &[usize], root: usize) -> Vec<bool> {
    let mut seen = vec![false; values.len()];
    let mut todo = vec![root];
    while let Some(i) = todo.pop() {
        if std::mem::replace(&mut seen[i], true) {
            continue;
        }
        match &values[i] {
            Value::Tuple { items: t, .. } => todo.extend(span(items, *t)),
            Value::List(x) => todo.extend(x),
            Value::Dict(kv) => todo.extend(kv.iter().flat_map(|&(k, v)| [k, v])),
            Value::OrderedDict { items, attrs } => {
                todo.extend(items.iter().flat_map(|&(k, v)| [k, v]));
                todo.extend(attrs.iter().map(|a| a.1));
            }
            Value::Parameter { tensor, hooks, .. } => todo.extend([*tensor, *hooks]),
            Value::Tensor { hooks, .. } => todo.push(*hooks),
            Value::None
            | Value::Bool(_)
            | Value::Int(_)
            | Value::Float(_)
            | Value::Str(_)
            | Value::Storage(_)
            | Value::StorageClass(_) => {}
        }
    }
    seen
}

/// Writes pickle opcodes as CPython's C pickler writes them at protocol 2,
/// with its memo: every memoized object gets the next index (BINPUT), and a
/// second sight of an object (by identity, a caller-chosen `u64`) is a BINGET.
/// The caller walks the objects; this only encodes.
pub struct Writer {
    pub buf: Vec<u8>,
    memo: HashMap<u64, u32>,
    next: u32,
}

impl Default for Writer {
    fn default() -> Self {
        Self::new()
    }
}

impl Writer {
    /// A pickle started at protocol 2 (torch.save's).
    pub fn new() -> Writer {
        Writer {
            buf: vec![0x80, 2],
            memo: HashMap::new(),
            next: 0,
        }
    }

    pub fn op(&mut self, op: u8) {
        self.buf.push(op);
    }

    /// The memo index of object `id`, if it was memoized.
    pub fn memo_get(&self, id: u64) -> Option<u32> {
        self.memo.get(&id).copied()
    }

    /// BINGET / LONG_BINGET.
    pub fn get(&mut self, idx: u32) {
        if idx < 256 {
            self.buf.extend_from_slice(&[b'h', idx as u8]);
        } else {
            self.buf.push(b'j');
            self.buf.extend_from_slice(&idx.to_le_bytes());
        }
    }

    /// Memoize the object just written (BINPUT / LONG_BINPUT); `id` None for
    /// an object nothing will refer to again (it still takes an index).
    pub fn put(&mut self, id: Option<u64>) {
        let idx = self.next;
        self.next += 1;
        if let Some(id) = id {
            self.memo.insert(id, idx);
        }
        if idx < 256 {
            self.buf.extend_from_slice(&[b'q', idx as u8]);
        } else {
            self.buf.push(b'r');
            self.buf.extend_from_slice(&idx.to_le_bytes());
        }
    }

    pub fn none(&mut self) {
        self.buf.push(b'N');
    }

    pub fn bool(&mut self, b: bool) {
        self.buf.push(if b { 0x88 } else { 0x89 });
    }

    /// BININT1 / BININT2 / BININT, else LONG1 (CPython's choice).
    pub fn int(&mut self, v: i64) {
        if (0..=0xff).contains(&v) {
            self.buf.extend_from_slice(&[b'K', v as u8]);
        } else if (0..=0xffff).contains(&v) {
            self.buf.push(b'M');
            self.buf.extend_from_slice(&(v as u16).to_le_bytes());
        } else if i32::try_from(v).is_ok() {
            self.buf.push(b'J');
            self.buf.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            // Two's complement, little-endian, in the fewest bytes that keep the sign.
            let mut b = v.to_le_bytes().to_vec();
            while b.len() > 1 {
                let (last, prev) = (b[b.len() - 1], b[b.len() - 2]);
                if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
                    b.pop();
                } else {
                    break;
                }
            }
            self.buf.extend_from_slice(&[0x8a, b.len() as u8]);
            self.buf.extend_from_slice(&b);
        }
    }

    pub fn float(&mut self, x: f64) {
        self.buf.push(b'G');
        self.buf.extend_from_slice(&x.to_be_bytes());
    }

    /// BINUNICODE (protocol 2 has no shorter form).
    pub fn str(&mut self, s: &str) {
        self.buf.push(b'X');
        self.buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(s.as_bytes());
    }

    /// GLOBAL `module.name`.
    pub fn global(&mut self, module: &str, name: &str) {
        self.buf.push(b'c');
        self.buf.extend_from_slice(module.as_bytes());
        self.buf.push(b'\n');
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(b'\n');
    }

    /// The pickle, STOP added.
    pub fn finish(mut self) -> Vec<u8> {
        self.buf.push(b'.');
        self.buf
    }
}

/// Opcodes the walker writes by name.
pub mod op {
    pub const MARK: u8 = b'(';
    pub const EMPTY_DICT: u8 = b'}';
    pub const EMPTY_LIST: u8 = b']';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const TUPLE: u8 = b't';
    pub const TUPLE1: u8 = 0x85;
    pub const SETITEM: u8 = b's';
    pub const SETITEMS: u8 = b'u';
    pub const APPEND: u8 = b'a';
    pub const APPENDS: u8 = b'e';
    pub const REDUCE: u8 = b'R';
    pub const BUILD: u8 = b'b';
    pub const BINPERSID: u8 = b'Q';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
}

/// The storage elements a view `(offset, size, stride)` needs, as torch's
/// `computeStorageNbytes` counts them, and whether it is row-major (as
/// `is_contiguous` says: dimensions of size 1 may have any stride, an empty
/// view is contiguous); None for a view no checkpoint holds (a negative value,
/// a storage past i64). Python's `unpickled.view_layout` is the same rule for
/// values it cannot trust to be ints and says what is wrong.
pub fn view_layout(offset: i64, size: &[i64], stride: &[i64]) -> Option<(u64, bool)> {
    if offset < 0 || size.len() != stride.len() {
        return None;
    }
    if size.iter().chain(stride).any(|&v| v < 0) {
        return None;
    }
    if size.contains(&0) {
        return Some((0, true));
    }
    let mut need = offset as i128 + 1;
    let mut expected = 1i128;
    let mut contiguous = true;
    for (&s, &st) in size.iter().rev().zip(stride.iter().rev()) {
        // Each term is below 2^126, but many dims could still wrap the sum.
        need = need.checked_add((s as i128 - 1) * st as i128)?;
        if s != 1 && st as i128 != expected {
            contiguous = false;
        }
        expected = expected.saturating_mul(s as i128);
    }
    (need < 1i128 << 63).then_some((need as u64, contiguous))
}

#[cfg(test)]
mod tests {
    #[test]
    fn view_layout_counts_as_torch_does() {
        assert_eq!(view_layout(0, &[], &[]), Some((1, true)));
        assert_eq!(view_layout(3, &[4], &[1]), Some((7, true)));
        assert_eq!(view_layout(0, &[2, 3], &[3, 1]), Some((6, true)));
        assert_eq!(view_layout(0, &[2, 3], &[1, 2]), Some((6, false)));
        assert_eq!(view_layout(0, &[1, 3], &[99, 1]), Some((3, true)));
        assert_eq!(view_layout(5, &[2, 0], &[7, 1]), Some((0, true)));
        assert_eq!(view_layout(0, &[4], &[0]), Some((1, false)));
        assert_eq!(view_layout(-1, &[4], &[1]), None);
        assert_eq!(view_layout(0, &[4], &[-1]), None);
        assert_eq!(view_layout(0, &[1 << 40, 1 << 40], &[1 << 40, 1]), None);
        // Terms each in range whose sum wraps an i128 (it once gave 9).
        let m = i64::MAX;
        assert_eq!(
            view_layout(0, &[25, m, m, m, m], &[1 << 62, m, m, m, m]),
            None
        );
    }

    #[test]
    fn dict_keys_are_checked_once_each_and_not_too_deep() {
        // {T_k: None} with T_k = (T_{k-1}, T_{k-1}) through the memo: walking
        // the items took 2^k steps (k = 60 never ended).
        let mut dag = b"\x80\x02}N".to_vec();
        for _ in 0..60 {
            dag.extend_from_slice(b"q\x00h\x00\x86");
        }
        dag.extend_from_slice(b"Ns.");
        let t = std::time::Instant::now();
        let got = parse(&dag);
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        assert!(got.is_err(), "a key 61 tuples deep is refused");
        // 300,000 nested tuples as a key: no stack overflow, refused.
        let mut deep = b"\x80\x02}N".to_vec();
        deep.extend(std::iter::repeat_n(0x85u8, 300_000));
        deep.extend_from_slice(b"Ns.");
        assert!(parse(&deep).is_err());
        // Up to the bound, nested tuples are keys as in Python.
        for (depth, ok) in [(MAX_KEY_DEPTH - 1, true), (MAX_KEY_DEPTH, false)] {
            let mut p = b"\x80\x02}N".to_vec();
            p.extend(std::iter::repeat_n(0x85u8, usize::from(depth)));
            p.extend_from_slice(b"Ns.");
            assert_eq!(parse(&p).is_ok(), ok, "{depth}");
        }
    }

    use super::*;

    /// Python 3.11, `pickle.dumps(x, protocol=2)` for the objects named.
    fn py(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn ints_and_floats_as_cpython_writes_them() {
        for (v, hex) in [
            (0i64, "4b00"),
            (255, "4bff"),
            (256, "4d0001"),
            (65535, "4dffff"),
            (65536, "4a00000100"),
            (-1, "4affffffff"),
            (-128, "4a80ffffff"),
            (2147483647, "4affffff7f"),
            (-2147483648, "4a00000080"),
            (2147483648, "8a050000008000"),
            (-2147483649, "8a05ffffff7fff"),
            (1 << 40, "8a06000000000001"),
            (-(1 << 40), "8a060000000000ff"),
            (i64::MAX, "8a08ffffffffffffff7f"),
            (i64::MIN, "8a080000000000000080"),
        ] {
            let mut w = Writer::new();
            w.int(v);
            assert_eq!(w.buf[2..], py(hex)[..], "{v}");
            let mut back = w.buf.clone();
            back.push(b'.');
            let p = parse(&back).unwrap();
            assert_eq!(p.values[p.root], Value::Int(v));
        }
        let mut w = Writer::new();
        w.float(1.5);
        assert_eq!(w.buf[2..], py("473ff8000000000000")[..]);
    }

    #[test]
    fn memo_indices_switch_to_long_form_at_256() {
        let mut w = Writer::new();
        for i in 0..300u64 {
            w.put(Some(i));
        }
        assert_eq!(w.memo_get(255), Some(255));
        w.buf.clear();
        w.get(255);
        w.get(256);
        assert_eq!(w.buf, py("68ff6a00010000"));
    }

    #[test]
    fn a_written_state_dict_reads_back() {
        // {"a": OrderedDict(), "b": [1, 2.5, None, True, "s"]} with the walker's opcodes.
        let mut w = Writer::new();
        w.op(op::EMPTY_DICT);
        w.put(Some(1));
        w.op(op::MARK);
        w.str("a");
        w.put(None);
        w.global("collections", "OrderedDict");
        w.put(Some(2));
        w.op(op::EMPTY_TUPLE);
        w.op(op::REDUCE);
        w.put(None);
        w.str("b");
        w.put(None);
        w.op(op::EMPTY_LIST);
        w.put(None);
        w.op(op::MARK);
        w.int(1);
        w.float(2.5);
        w.none();
        w.bool(true);
        w.str("s");
        w.put(None);
        w.op(op::APPENDS);
        w.op(op::SETITEMS);
        let p = parse(&w.finish()).unwrap();
        let Value::Dict(items) = &p.values[p.root] else {
            panic!("{p:?}")
        };
        assert_eq!(items.len(), 2);
        assert!(matches!(p.values[items[0].1], Value::OrderedDict { .. }));
        let Value::List(l) = &p.values[items[1].1] else {
            panic!()
        };
        assert_eq!(p.values[l[1]], Value::Float(2.5));
        assert_eq!(p.values[l[4]], Value::Str("s".into()));
    }

    /// `[t, t, ...]`: `n` tensors of one storage, their sizes and strides one
    /// tuple of `dims` ones, memoized once and fetched by every later tensor.
    fn tensors_sharing_one_size_tuple(n: usize, dims: usize) -> Vec<u8> {
        let mut w = Writer::new();
        w.op(op::EMPTY_LIST);
        w.put(None);
        for i in 0..n {
            rebuild_head(&mut w, "torch", "FloatStorage", 1);
            if i == 0 {
                w.op(op::MARK);
                for _ in 0..dims {
                    w.int(1);
                }
                w.op(op::TUPLE);
                w.put(Some(1 << 40)); // memo index 1 (the list took 0)
            } else {
                w.get(1);
            }
            w.get(1); // strides: the same tuple
            rebuild_tail(&mut w);
            w.op(op::APPEND);
        }
        w.finish()
    }

    #[test]
    fn a_memoized_size_tuple_is_referred_to_not_copied_per_tensor() {
        // A hostile pickle's size tuple fetched by a million tensors copied its
        // ints a million times (a 5-byte BINGET each).
        let p = parse(&tensors_sharing_one_size_tuple(1000, MAX_DIMS)).unwrap();
        let Value::List(l) = &p.values[p.root] else {
            panic!("{p:?}")
        };
        assert_eq!(l.len(), 1000);
        let spans: Vec<_> = l
            .iter()
            .map(|&t| match &p.values[t] {
                Value::Tensor { size, stride, .. } => (*size, *stride),
                v => panic!("{v:?}"),
            })
            .collect();
        assert!(spans.iter().all(|&(s, t)| s == spans[0].0 && t == s));
        let mut out = [0i64; MAX_DIMS];
        assert_eq!(p.dims(spans[0].0, &mut out), &[1i64; MAX_DIMS][..]);
        // Items: each tensor's own tuples (persistent id, arguments), one size tuple.
        assert!(p.items.len() < 1000 * 12 + MAX_DIMS, "{}", p.items.len());
        // More dims than torch.load is left to read: refused here.
        assert!(parse(&tensors_sharing_one_size_tuple(2, MAX_DIMS + 1)).is_err());
    }

    #[test]
    fn memo_indices_out_of_order_take_no_table_of_their_size() {
        // {"a": [], "b": <the same list>}, memoized under a huge index: as
        // torch.load reads it; a table of 2^26 entries aborted the process.
        for idx in [0x03ff_ffffu32, u32::MAX] {
            let mut pkl = b"\x80\x02}(X\x01\x00\x00\x00a]r".to_vec();
            pkl.extend_from_slice(&idx.to_le_bytes());
            pkl.extend_from_slice(b"X\x01\x00\x00\x00bj");
            pkl.extend_from_slice(&idx.to_le_bytes());
            pkl.extend_from_slice(b"u.");
            let p = parse(&pkl).unwrap();
            let Value::Dict(items) = &p.values[p.root] else {
                panic!("{p:?}")
            };
            assert_eq!(items.len(), 2);
            assert_eq!(items[0].1, items[1].1, "one list under both keys");
            let mut undefined = pkl.clone();
            let at = undefined.len() - 6;
            undefined[at..at + 4].copy_from_slice(&(idx - 1).to_le_bytes());
            assert!(parse(&undefined).is_err());
        }
    }

    /// BINUNICODE of `s`.
    fn x(s: &str) -> Vec<u8> {
        let mut b = vec![b'X'];
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
        b
    }

    fn cat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    #[test]
    fn opcodes_torchs_weights_only_unpickler_does_not_read_are_not_read() {
        // (opcode, a pickle with it, the same object in opcodes torch reads)
        let cases: Vec<(&str, Vec<u8>, Vec<u8>)> = vec![
            (
                "FRAME",
                cat(&[b"\x80\x02\x95", &2u64.to_le_bytes(), b"N."]),
                b"\x80\x02N.".to_vec(),
            ),
            (
                "MEMOIZE",
                b"\x80\x02]\x94.".to_vec(),
                b"\x80\x02]q\x00.".to_vec(),
            ),
            (
                "STACK_GLOBAL",
                cat(&[
                    b"\x80\x02",
                    &x("collections"),
                    &x("OrderedDict"),
                    b"\x93)R.",
                ]),
                b"\x80\x02ccollections\nOrderedDict\n)R.".to_vec(),
            ),
            (
                "SHORT_BINUNICODE",
                b"\x80\x02\x8c\x01a.".to_vec(),
                cat(&[b"\x80\x02", &x("a"), b"."]),
            ),
            (
                "BINUNICODE8",
                cat(&[b"\x80\x02\x8d", &1u64.to_le_bytes(), b"a."]),
                cat(&[b"\x80\x02", &x("a"), b"."]),
            ),
            (
                "DUP",
                b"\x80\x02]2\x86.".to_vec(),
                b"\x80\x02]q\x00h\x00\x86.".to_vec(),
            ),
            ("POP", b"\x80\x02NN0.".to_vec(), b"\x80\x02N.".to_vec()),
            (
                "POP_MARK",
                b"\x80\x02N(N1.".to_vec(),
                b"\x80\x02N.".to_vec(),
            ),
        ];
        for (name, bad, good) in cases {
            assert!(parse(&good).is_ok(), "{name}'s control");
            let e = parse(&bad).unwrap_err();
            assert!(e.0.starts_with("opcode "), "{name}: {e:?}");
        }
    }

    #[test]
    fn only_protocol_2_is_read() {
        // No PROTO (protocols 0 and 1): torch reads it without a warning.
        assert!(parse(b"N.").is_ok());
        assert!(parse(b"\x80\x02N.").is_ok());
        for proto in [0u8, 1, 3, 4, 5, 6] {
            assert!(parse(&[0x80, proto, b'N', b'.']).is_err(), "{proto}");
        }
    }

    #[test]
    fn memoize_is_not_read_pickle_numbers_it_by_the_memo_size() {
        // {'x': 'a' (BINPUT 0), 'y': 'b' (memoized), 'z': BINGET 0}: pickle gives
        // 'a' at 'z'; a count of MEMOIZEs alone put 'b' at index 0.
        let dict = |put_b: &[u8]| {
            cat(&[
                b"\x80\x02}(",
                &x("x"),
                &x("a"),
                b"q\x00",
                &x("y"),
                &x("b"),
                put_b,
                &x("z"),
                b"h\x00u.",
            ])
        };
        let p = parse(&dict(b"q\x01")).unwrap();
        let Value::Dict(items) = &p.values[p.root] else {
            panic!("{p:?}")
        };
        assert_eq!(p.values[items[2].1], Value::Str("a".into()));
        assert!(parse(&dict(b"\x94")).is_err());
    }

    /// `_rebuild_tensor_v2` of 4 elements of a storage of class `module.class`.
    fn tensor_of(module: &str, class: &str) -> Vec<u8> {
        let mut w = Writer::new();
        rebuild_head(&mut w, module, class, 4);
        w.int(4);
        w.op(op::TUPLE1);
        w.int(1);
        w.op(op::TUPLE1);
        rebuild_tail(&mut w);
        w.finish()
    }

    /// A `_rebuild_tensor_v2` call's start: the global, its arguments' mark, the
    /// storage "0" (`numel` elements of class `module.class`, on the CPU), offset 0.
    fn rebuild_head(w: &mut Writer, module: &str, class: &str, numel: i64) {
        w.global("torch._utils", "_rebuild_tensor_v2");
        w.op(op::MARK);
        w.op(op::MARK);
        w.str("storage");
        w.global(module, class);
        w.str("0");
        w.str("cpu");
        w.int(numel);
        w.op(op::TUPLE);
        w.op(op::BINPERSID);
        w.int(0);
    }

    /// A `_rebuild_tensor_v2` call's end: requires_grad False, empty hooks, the call.
    fn rebuild_tail(w: &mut Writer) {
        w.bool(false);
        w.global("collections", "OrderedDict");
        w.op(op::EMPTY_TUPLE);
        w.op(op::REDUCE);
        w.op(op::TUPLE);
        w.op(op::REDUCE);
    }

    #[test]
    fn storage_classes_are_those_torch_allows_by_name() {
        for class in [
            "FloatStorage",
            "ByteStorage",
            "BFloat16Storage",
            "QUInt4x2Storage",
        ] {
            let p = parse(&tensor_of("torch", class)).unwrap();
            assert_eq!(p.storages[0].class, class);
            assert!(matches!(p.values[p.root], Value::Tensor { .. }));
        }
        // torch allows UntypedStorage and TypedStorage as torch.storage.<X> only.
        for (module, class) in [
            ("torch", "UntypedStorage"),
            ("torch", "TypedStorage"),
            ("torch", "FooStorage"),
            ("torch.storage", "UntypedStorage"),
            ("torch.cuda", "FloatStorage"),
        ] {
            assert!(
                parse(&tensor_of(module, class)).is_err(),
                "{module}.{class}"
            );
        }
    }
}
