//! `safetensors_header`: a safetensors header read by the core
//! ([`crate::format::safetensors`]) rather than a Python call per tensor.

use std::collections::HashMap;

use pyo3::prelude::*;

use crate::format::safetensors;

type Entries = Vec<(String, String, Vec<u64>, u64, u64)>;
/// (metadata as [(key, value)] or None, entries)
type Read = (Option<Vec<(String, String)>>, Entries);

/// Read and check a safetensors header (the JSON after the length):
/// (metadata as [(key, value)] or None, [(name, dtype, shape, begin, end)]
/// in file order), or None where the Python validator must read it.
/// `itemsizes`: bytes per element of each dtype name readable here.
#[pyfunction]
pub(super) fn safetensors_header(
    py: Python<'_>,
    json: &[u8],
    data_len: u64,
    itemsizes: HashMap<String, u64>,
) -> Option<Read> {
    let json = json.to_vec();
    py.detach(|| {
        let h = safetensors::parse_header(&json, data_len, |d| itemsizes.get(d).copied())?;
        let entries = h
            .entries
            .into_iter()
            .map(|e| (e.name, e.dtype, e.shape, e.begin, e.end))
            .collect();
        Some((h.metadata, entries))
    })
}
