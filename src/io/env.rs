//! `CKPTIO_*` environment variables that hold sizes or counts, parsed in one
//! place: every layer that reads one (the engine's threads and chunks, the GPU
//! layer's cap on pinned memory) applies the same rules, and a malformed value
//! is an error naming the variable, never silently ignored.

use crate::{Error, Result};

/// "16M", "4k", "1G" or a plain number.
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: usize = match c.to_ascii_lowercase() {
                'k' => 1 << 10,
                'm' => 1 << 20,
                'g' => 1 << 30,
                _ => return Err(format!("unknown size suffix in {s:?}")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("not a size: {s:?}"))
}

/// A size or count from the environment variable `name` (None where unset).
pub fn size(name: &str) -> Result<Option<usize>> {
    std::env::var(name)
        .ok()
        .map(|v| parse_size(&v).map_err(|e| Error::invalid(format!("{name}: {e}"))))
        .transpose()
}
