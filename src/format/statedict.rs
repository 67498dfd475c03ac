//! torch.save's pickle of a state dict, as torch writes it: the opcodes
//! CPython's C pickler emits at protocol 2 with torch's `persistent_id` and
//! `Tensor.__reduce_ex__`, for dicts, lists, tuples, str, int, float, bool,
//! None, `collections.OrderedDict` (attributes included), plain tensors and
//! Parameters.
//!
//! This module holds the rules; the binding walks the Python objects, asks
//! what each one is, and calls the [`Encoder`] in the order the walk meets
//! them. The rules, each as CPython or torch has it:
//!
//! - **Memo.** Every container, str, global and reduced object is memoized
//!   (BINPUT) by identity; a second sight is a BINGET ([`Encoder::memoized`]).
//!   The caller's identities are object addresses (multiples of 4); the ones
//!   made here for objects torch builds each time but CPython memoizes (the
//!   string "storage", a location, a storage key) end in binary 01 or 11.
//! - **Batches** ([`dict_batches`], [`ordered_dict_batches`],
//!   [`list_batches`]): CPython's `batch_dict_exact`, `batch_dict` and
//!   `batch_list_exact`, 1,000 items a batch.
//! - **Tuples** ([`Encoder::tuple_end`]): TUPLE1-3 or MARK...TUPLE; a tuple
//!   that its own items reached is dropped from the stack and fetched from
//!   the memo.
//! - **Storages** ([`Storages`]): keys "0", "1"... by first appearance of a
//!   storage, `numel` in elements of the tensor's dtype, one dtype per memory
//!   (torch raises otherwise; the caller lets torch's pickler say so).
//! - **Tensors** ([`Encoder::tensor`]): `_rebuild_tensor_v2(persistent id,
//!   offset, size, stride, requires_grad, OrderedDict())` with the persistent
//!   id `("storage", <class>, key, location, numel)`; **Parameters**
//!   ([`Encoder::parameter_end`]): `_rebuild_parameter(data, requires_grad,
//!   OrderedDict())`.

use std::collections::HashMap;
use std::ops::Range;

use super::pickle::{op, Writer};

/// A module-level function or class, named as GLOBAL names it, and its
/// identity for the memo.
#[derive(Clone, Copy, Debug)]
pub struct Global<'a> {
    pub id: u64,
    pub module: &'a str,
    pub name: &'a str,
}

/// One batch of a container's items: a MARK first where `mark`, the items,
/// then `end` (SETITEM, SETITEMS, APPEND or APPENDS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub items: Range<usize>,
    pub mark: bool,
    pub end: u8,
}

const BATCH: usize = 1000;

/// A dict's `n` items (CPython's `batch_dict_exact`): one item alone is a
/// SETITEM; more go in MARK...SETITEMS batches of 1,000, and a last full
/// batch is followed by an empty one.
pub fn dict_batches(n: usize) -> Vec<Batch> {
    match n {
        0 => Vec::new(),
        1 => vec![Batch {
            items: 0..1,
            mark: false,
            end: op::SETITEM,
        }],
        _ => {
            let mut out = Vec::new();
            let mut at = 0;
            loop {
                let k = (n - at).min(BATCH);
                out.push(Batch {
                    items: at..at + k,
                    mark: true,
                    end: op::SETITEMS,
                });
                at += k;
                if k != BATCH {
                    return out;
                }
            }
        }
    }
}

/// An OrderedDict's `n` items, pickled from an iterator (CPython's
/// `batch_dict`): batches of 1,000, a batch of one item as a SETITEM, no
/// empty batch.
pub fn ordered_dict_batches(n: usize) -> Vec<Batch> {
    (0..n)
        .step_by(BATCH)
        .map(|at| {
            let k = (n - at).min(BATCH);
            Batch {
                items: at..at + k,
                mark: k > 1,
                end: if k > 1 { op::SETITEMS } else { op::SETITEM },
            }
        })
        .collect()
}

/// A list's `n` items (CPython's `batch_list_exact`): one item alone is an
/// APPEND; more go in MARK...APPENDS batches of 1,000 (a last batch of one
/// item included).
pub fn list_batches(n: usize) -> Vec<Batch> {
    match n {
        0 => Vec::new(),
        1 => vec![Batch {
            items: 0..1,
            mark: false,
            end: op::APPEND,
        }],
        _ => (0..n)
            .step_by(BATCH)
            .map(|at| Batch {
                items: at..(at + BATCH).min(n),
                mark: true,
                end: op::APPENDS,
            })
            .collect(),
    }
}

/// The storages a pickle names, by first appearance (torch's
/// `persistent_id`): each storage (by identity) gets the next key; each
/// (storage, dtype) its element count.
#[derive(Default)]
pub struct Storages {
    keys: HashMap<i64, usize>,
    refs: HashMap<(i64, usize), (usize, i64)>,
    /// Address -> dtype: torch's check that one memory has one dtype.
    dtypes: HashMap<u64, usize>,
    count: usize,
}

/// A storage as the pickle names it: its key's index and its numel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageRef {
    pub key: usize,
    pub numel: i64,
    /// First time this storage is named (the caller records it).
    pub new: bool,
}

/// torch refuses to save one memory under two dtypes.
#[derive(Debug, PartialEq, Eq)]
pub struct TwoDtypes;

impl Storages {
    /// The storage `identity` (torch's `_cdata`) seen by a tensor of `dtype`
    /// (an identity too), if already named with that dtype.
    pub fn known(&self, identity: i64, dtype: usize) -> Option<StorageRef> {
        self.refs
            .get(&(identity, dtype))
            .map(|&(key, numel)| StorageRef {
                key,
                numel,
                new: false,
            })
    }

    /// Name the storage `identity` of `nbytes` at `addr` for a tensor of
    /// `dtype` with `itemsize`-byte elements (after [`Storages::known`]
    /// said no).
    pub fn name(
        &mut self,
        identity: i64,
        dtype: usize,
        addr: u64,
        nbytes: u64,
        itemsize: u64,
    ) -> Result<StorageRef, TwoDtypes> {
        if addr != 0 && *self.dtypes.entry(addr).or_insert(dtype) != dtype {
            return Err(TwoDtypes);
        }
        let (key, new) = match self.keys.get(&identity) {
            Some(&k) => (k, false),
            None => {
                let k = self.count;
                self.count += 1;
                self.keys.insert(identity, k);
                (k, true)
            }
        };
        let numel = (nbytes / itemsize.max(1)) as i64;
        self.refs.insert((identity, dtype), (key, numel));
        Ok(StorageRef { key, numel, new })
    }
}

/// A plain tensor as its reduce pickles it.
#[derive(Clone, Debug)]
pub struct Tensor<'a> {
    /// Its identity (memoized after the reduce).
    pub id: u64,
    pub storage: StorageRef,
    /// Its storage's device (-1: CPU) and torch's location tag for it.
    pub device: i32,
    pub location: &'a str,
    pub offset: i64,
    pub size: &'a [i64],
    pub stride: &'a [i64],
    pub requires_grad: bool,
}

/// Memo identity of the string "storage" (identities made here end in 01
/// for strings and locations, 11 for storage keys).
const ID_STORAGE_STR: u64 = 1;

/// The pickle being written.
pub struct Encoder {
    w: Writer,
    next_id: u64,
    /// Device -> the memo identity of its location string.
    locations: HashMap<i32, u64>,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Encoder {
    pub fn new() -> Encoder {
        Encoder {
            w: Writer::new(),
            next_id: 0,
            locations: HashMap::new(),
        }
    }

    /// The pickle's bytes, STOP added.
    pub fn finish(self) -> Vec<u8> {
        self.w.finish()
    }

    pub fn op(&mut self, op: u8) {
        self.w.op(op);
    }

    /// If `id` was memoized, write the BINGET and say so.
    pub fn memoized(&mut self, id: u64) -> bool {
        match self.w.memo_get(id) {
            Some(i) => {
                self.w.get(i);
                true
            }
            None => false,
        }
    }

    /// Memoize what was just written as `id`.
    pub fn put(&mut self, id: u64) {
        self.w.put(Some(id));
    }

    pub fn none(&mut self) {
        self.w.none();
    }

    pub fn bool(&mut self, b: bool) {
        self.w.bool(b);
    }

    pub fn int(&mut self, v: i64) {
        self.w.int(v);
    }

    pub fn float(&mut self, x: f64) {
        self.w.float(x);
    }

    /// A str (not memoized yet: the caller checked), memoized as `id`.
    pub fn str(&mut self, id: u64, s: &str) {
        self.w.str(s);
        self.w.put(Some(id));
    }

    /// GLOBAL of `g`, or its BINGET once written.
    pub fn global(&mut self, g: Global<'_>) {
        if !self.memoized(g.id) {
            self.w.global(g.module, g.name);
            self.w.put(Some(g.id));
        }
    }

    /// An empty dict, memoized as `id`; its items follow in [`dict_batches`].
    pub fn dict_start(&mut self, id: u64) {
        self.w.op(op::EMPTY_DICT);
        self.w.put(Some(id));
    }

    /// An empty list, memoized as `id`; its items follow in [`list_batches`].
    pub fn list_start(&mut self, id: u64) {
        self.w.op(op::EMPTY_LIST);
        self.w.put(Some(id));
    }

    /// Before a batch's items.
    pub fn batch_start(&mut self, b: &Batch) {
        if b.mark {
            self.w.op(op::MARK);
        }
    }

    /// After a batch's items.
    pub fn batch_end(&mut self, b: &Batch) {
        self.w.op(b.end);
    }

    /// Before a tuple's `n` items (an empty tuple is [`Encoder::tuple_end`] alone).
    pub fn tuple_start(&mut self, n: usize) {
        if n > 3 {
            self.w.op(op::MARK);
        }
    }

    /// After a tuple's `n` items: the tuple, memoized as `id`; or, where its
    /// own items reached it (memoized meanwhile), the items dropped and the
    /// memoized tuple fetched (CPython's `save_tuple`).
    pub fn tuple_end(&mut self, id: u64, n: usize) {
        if n == 0 {
            self.w.op(op::EMPTY_TUPLE);
            return;
        }
        if let Some(i) = self.w.memo_get(id) {
            if n > 3 {
                self.w.op(op::POP_MARK);
            } else {
                for _ in 0..n {
                    self.w.op(op::POP);
                }
            }
            self.w.get(i);
            return;
        }
        self.tuple_op(n);
        self.w.put(Some(id));
    }

    fn tuple_op(&mut self, n: usize) {
        self.w.op(if n > 3 {
            op::TUPLE
        } else {
            op::TUPLE1 + n as u8 - 1
        });
    }

    /// A tuple of ints torch makes each time (a size, a stride): memoized
    /// under a new index nobody refers to.
    pub fn int_tuple(&mut self, v: &[i64]) {
        if v.is_empty() {
            self.w.op(op::EMPTY_TUPLE);
            return;
        }
        self.tuple_start(v.len());
        for &x in v {
            self.w.int(x);
        }
        self.tuple_op(v.len());
        self.w.put(None);
    }

    /// `collections.OrderedDict()` as its reduce makes it: GLOBAL, (), REDUCE
    /// (not memoized: the caller does, where CPython does).
    pub fn new_ordered_dict(&mut self, ordered_dict: Global<'_>) {
        self.global(ordered_dict);
        self.w.op(op::EMPTY_TUPLE);
        self.w.op(op::REDUCE);
    }

    /// An OrderedDict object, memoized as `id`; its items follow in
    /// [`ordered_dict_batches`], then its attributes (a dict) and
    /// [`Encoder::ordered_dict_attrs`] where it has any.
    pub fn ordered_dict_start(&mut self, ordered_dict: Global<'_>, id: u64) {
        self.new_ordered_dict(ordered_dict);
        self.w.put(Some(id));
    }

    /// After the attribute dict of an OrderedDict: BUILD sets them.
    pub fn ordered_dict_attrs(&mut self) {
        self.w.op(op::BUILD);
    }

    /// A plain tensor, by torch's reduce (`rebuild` is
    /// `torch._utils._rebuild_tensor_v2`, `class` the storage class torch
    /// names the dtype's storages by); memoized as `t.id`.
    pub fn tensor(
        &mut self,
        rebuild: Global<'_>,
        class: Global<'_>,
        ordered_dict: Global<'_>,
        t: &Tensor<'_>,
    ) {
        self.global(rebuild);
        self.w.op(op::MARK);
        // The persistent id ("storage", class, key, location, numel): a new
        // tuple each time, as torch's persistent_id returns one; its strings
        // are the same objects each time, so CPython memoizes them.
        self.w.op(op::MARK);
        if !self.memoized(ID_STORAGE_STR) {
            self.str(ID_STORAGE_STR, "storage");
        }
        self.global(class);
        let key_id = ((t.storage.key as u64) << 2) | 3;
        if !self.memoized(key_id) {
            self.str(key_id, &t.storage.key.to_string());
        }
        let loc_id = match self.locations.get(&t.device) {
            Some(&id) => id,
            None => {
                self.next_id += 1;
                let id = (self.next_id << 2) | 1;
                self.locations.insert(t.device, id);
                id
            }
        };
        if !self.memoized(loc_id) {
            self.str(loc_id, t.location);
        }
        self.w.int(t.storage.numel);
        self.w.op(op::TUPLE);
        self.w.put(None);
        self.w.op(op::BINPERSID);
        self.w.int(t.offset);
        self.int_tuple(t.size);
        self.int_tuple(t.stride);
        self.w.bool(t.requires_grad);
        self.new_ordered_dict(ordered_dict);
        self.w.put(None);
        self.w.op(op::TUPLE);
        self.w.put(None);
        self.w.op(op::REDUCE);
        self.w.put(Some(t.id));
    }

    /// A Parameter's start: `rebuild` is `torch._utils._rebuild_parameter`;
    /// its data (a tensor) follows, then [`Encoder::parameter_end`].
    pub fn parameter_start(&mut self, rebuild: Global<'_>) {
        self.global(rebuild);
    }

    /// A Parameter's end, memoized as `id`.
    pub fn parameter_end(&mut self, ordered_dict: Global<'_>, id: u64, requires_grad: bool) {
        self.w.bool(requires_grad);
        self.new_ordered_dict(ordered_dict);
        self.w.put(None);
        self.w.op(op::TUPLE1 + 2);
        self.w.put(None);
        self.w.op(op::REDUCE);
        self.w.put(Some(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn ends(b: &[Batch]) -> Vec<(usize, usize, bool, u8)> {
        b.iter()
            .map(|b| (b.items.start, b.items.end, b.mark, b.end))
            .collect()
    }

    #[test]
    fn batches_follow_cpythons_rules() {
        let (s, ss, a, aa) = (op::SETITEM, op::SETITEMS, op::APPEND, op::APPENDS);
        assert!(dict_batches(0).is_empty());
        assert_eq!(ends(&dict_batches(1)), [(0, 1, false, s)]);
        assert_eq!(ends(&dict_batches(2)), [(0, 2, true, ss)]);
        // A last full batch is followed by an empty one (batch_dict_exact).
        assert_eq!(
            ends(&dict_batches(1000)),
            [(0, 1000, true, ss), (1000, 1000, true, ss)]
        );
        assert_eq!(
            ends(&dict_batches(1001)),
            [(0, 1000, true, ss), (1000, 1001, true, ss)]
        );
        // From an iterator: no empty batch, a lone item is a SETITEM.
        assert!(ordered_dict_batches(0).is_empty());
        assert_eq!(ends(&ordered_dict_batches(1)), [(0, 1, false, s)]);
        assert_eq!(ends(&ordered_dict_batches(1000)), [(0, 1000, true, ss)]);
        assert_eq!(
            ends(&ordered_dict_batches(1001)),
            [(0, 1000, true, ss), (1000, 1001, false, s)]
        );
        // Lists: a lone item is an APPEND, a last batch of one is not.
        assert_eq!(ends(&list_batches(1)), [(0, 1, false, a)]);
        assert_eq!(
            ends(&list_batches(1001)),
            [(0, 1000, true, aa), (1000, 1001, true, aa)]
        );
        assert_eq!(ends(&list_batches(1000)), [(0, 1000, true, aa)]);
    }

    /// `pickle.dumps(x, protocol=2)` for the tuples below (Python 3.11).
    #[test]
    fn tuples_and_recursive_tuples_as_cpython_writes_them() {
        let mut e = Encoder::new();
        // ((1, 2, 3, 4), ()) with the inner tuple memoized.
        e.tuple_start(2);
        e.tuple_start(4);
        for i in 1..=4 {
            e.int(i);
        }
        e.tuple_end(8, 4);
        e.tuple_end(12, 0);
        e.tuple_end(16, 2);
        assert_eq!(hex(&e.finish()), "8002284b014b024b034b04747100298671012e");
        // A tuple its own items reached: the items popped, the tuple fetched.
        let mut e = Encoder::new();
        e.list_start(4);
        e.tuple_start(1);
        // The list holds the tuple, which holds the list: memoized meanwhile.
        e.put(8);
        e.tuple_end(8, 1);
        let b = e.finish();
        assert_eq!(&b[b.len() - 4..], &[op::POP, b'h', 1, b'.']);
    }

    #[test]
    fn globals_strings_and_the_memo() {
        let mut e = Encoder::new();
        let g = Global {
            id: 40,
            module: "collections",
            name: "OrderedDict",
        };
        e.global(g);
        e.global(g);
        assert!(!e.memoized(44));
        e.str(44, "ab");
        assert!(e.memoized(44));
        let want = [
            "8002",
            "63636f6c6c656374696f6e730a4f726465726564446963740a7100", // GLOBAL, BINPUT 0
            "6800",                                                   // BINGET 0
            "5802000000616271016801",                                 // "ab", BINPUT 1, BINGET 1
            "2e",
        ];
        assert_eq!(hex(&e.finish()), want.concat());
    }

    /// `torch.save({"w": w, "v": w[1:], "p": Parameter(torch.ones(2))})` with
    /// `w = torch.tensor([1.0, 2.0, 3.0])`: its `data.pkl` (torch 2.15,
    /// Python 3.11), replayed as the binding's walk meets the objects.
    #[test]
    fn a_state_dict_of_tensors_and_a_parameter_is_torchs_pickle() {
        let torch_bytes = "80027d710028580100000077710163746f7263682e5f7574696c730a5f7265\
            6275696c645f74656e736f725f76320a71022828580700000073746f72616765710363746f726368\
            0a466c6f617453746f726167650a71045801000000307105580300000063707571064b0374710751\
            4b004b038571084b018571098963636f6c6c656374696f6e730a4f72646572656444696374\
            0a710a2952710b74710c52710d580100000076710e6802282868036804680568064b0374710f514b\
            014b028571104b0185711189680a29527112747113527114580100000070711563746f7263682e5f\
            7574696c730a5f72656275696c645f706172616d657465720a711668022828680368045801000000\
            31711768064b02747118514b004b028571194b0185711a89680a2952711b74711c52711d88680a29\
            52711e87711f527120752e";
        let g = |id, module, name| Global { id, module, name };
        let rebuild = g(100, "torch._utils", "_rebuild_tensor_v2");
        let float = g(104, "torch", "FloatStorage");
        let od = g(108, "collections", "OrderedDict");
        let rebuild_param = g(112, "torch._utils", "_rebuild_parameter");
        let (f32_dtype, w_storage, p_storage) = (200usize, 300i64, 304i64);
        let mut st = Storages::default();
        let mut e = Encoder::new();
        e.dict_start(400);
        let b = &dict_batches(3)[0];
        e.batch_start(b);
        let mut tensor = |e: &mut Encoder, id, cdata, addr, numel: i64, offset, size: &[i64]| {
            let storage = match st.known(cdata, f32_dtype) {
                Some(r) => r,
                None => st
                    .name(cdata, f32_dtype, addr, numel as u64 * 4, 4)
                    .unwrap(),
            };
            let t = Tensor {
                id,
                storage,
                device: -1,
                location: "cpu",
                offset,
                size,
                stride: &[1],
                requires_grad: false,
            };
            e.tensor(rebuild, float, od, &t);
        };
        e.str(404, "w");
        tensor(&mut e, 408, w_storage, 0x1000, 3, 0, &[3]);
        e.str(412, "v");
        tensor(&mut e, 416, w_storage, 0x1000, 3, 1, &[2]);
        e.str(420, "p");
        e.parameter_start(rebuild_param);
        tensor(&mut e, 424, p_storage, 0x2000, 2, 0, &[2]);
        e.parameter_end(od, 428, true);
        e.batch_end(b);
        let want: String = torch_bytes.split_whitespace().collect();
        assert_eq!(hex(&e.finish()), want);
    }

    #[test]
    fn storages_are_keyed_by_first_appearance_with_one_dtype_per_memory() {
        let mut s = Storages::default();
        let (f32_, f16_) = (100usize, 200usize);
        assert_eq!(s.known(7, f32_), None);
        let a = s.name(7, f32_, 0x1000, 400, 4).unwrap();
        assert_eq!((a.key, a.numel, a.new), (0, 100, true));
        assert_eq!(s.known(7, f32_), Some(StorageRef { new: false, ..a }));
        let b = s.name(9, f32_, 0x2000, 8, 4).unwrap();
        assert_eq!((b.key, b.new), (1, true));
        // The same memory under another dtype: torch refuses.
        assert_eq!(s.name(7, f16_, 0x1000, 400, 2), Err(TwoDtypes));
        // An empty storage (address 0) may be seen under any dtype.
        assert!(s.name(11, f32_, 0, 0, 4).is_ok());
        assert!(s.name(11, f16_, 0, 0, 2).is_ok());
    }
}
