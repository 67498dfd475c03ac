//! Reads the header of a safetensors file (the JSON after its 8-byte length)
//! without a Python call per tensor.
//!
//! A header names every tensor: `{"name": {"dtype": "F32", "shape": [2, 3],
//! "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}`. This
//! reader accepts headers whose every part is as safetensors writes it and
//! validates them as `ckptio.safetensors` does (known dtype, offsets matching
//! the shape, tensors tiling the data section without gap or overlap, no
//! duplicate key). For anything else it returns None: the Python validator
//! then reads the header and says precisely what is wrong (or accepts an
//! unusual but valid one), so errors keep one wording.

use std::collections::HashSet;

/// One tensor of the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Byte range in the data section.
    pub begin: u64,
    pub end: u64,
}

/// A header read and checked: its metadata and its tensors in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub metadata: Option<Vec<(String, String)>>,
    pub entries: Vec<TensorEntry>,
}

struct Json<'a> {
    s: &'a [u8],
    i: usize,
}

/// Nesting deeper than this in an unknown field is refused (no recursion bomb).
const MAX_DEPTH: usize = 64;

impl Json<'_> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.s.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }

    /// The 4 hex digits of a `\u` escape: exactly 4, nothing else
    /// (`u32::from_str_radix` alone would take a sign: `\u+041`).
    fn hex4(&mut self) -> Option<u32> {
        let h = self.s.get(self.i..self.i + 4)?;
        if !h.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        self.i += 4;
        h.iter()
            .try_fold(0, |acc, &c| Some(acc * 16 + char::from(c).to_digit(16)?))
    }

    /// A number exactly as JSON (RFC 8259) writes it:
    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`, and finite as an f64
    /// (serde_json, which safetensors reads headers with, refuses `1e400`).
    fn number(&mut self) -> Option<()> {
        self.ws();
        let start = self.i;
        let digits = |j: &mut Self| {
            let at = j.i;
            while j.s.get(j.i).is_some_and(u8::is_ascii_digit) {
                j.i += 1;
            }
            (j.i > at).then_some(())
        };
        if self.s.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match self.s.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => digits(self)?,
            _ => return None,
        }
        if self.s.get(self.i) == Some(&b'.') {
            self.i += 1;
            digits(self)?;
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            digits(self)?;
        }
        let v: f64 = std::str::from_utf8(&self.s[start..self.i])
            .ok()?
            .parse()
            .ok()?;
        v.is_finite().then_some(())
    }

    fn string(&mut self) -> Option<String> {
        self.eat(b'"')?;
        let mut out = Vec::new();
        loop {
            let c = *self.s.get(self.i)?;
            self.i += 1;
            match c {
                b'"' => return String::from_utf8(out).ok(),
                b'\\' => {
                    let e = *self.s.get(self.i)?;
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let cp = if (0xD800..0xDC00).contains(&hi) {
                                // A surrogate pair; a lone surrogate cannot be a Rust string.
                                if self.s.get(self.i..self.i + 2)? != b"\\u" {
                                    return None;
                                }
                                self.i += 2;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return None;
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            char::from_u32(cp)?
                        }
                        _ => return None,
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                0..=0x1f => return None,
                _ => out.push(c),
            }
        }
    }

    /// A non-negative integer as JSON writes it (no sign, fraction, exponent or leading zero).
    fn uint(&mut self) -> Option<u64> {
        self.ws();
        let start = self.i;
        while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        let digits = &self.s[start..self.i];
        if digits.is_empty() || (digits.len() > 1 && digits[0] == b'0') {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = self.s.get(self.i) {
            return None;
        }
        std::str::from_utf8(digits).ok()?.parse().ok()
    }

    fn uints(&mut self) -> Option<Vec<u64>> {
        self.eat(b'[')?;
        let mut v = Vec::new();
        if self.eat(b']').is_some() {
            return Some(v);
        }
        loop {
            v.push(self.uint()?);
            if self.eat(b']').is_some() {
                return Some(v);
            }
            self.eat(b',')?;
        }
    }

    /// Any JSON value, dropped (an entry's unknown field).
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'[' => {
                self.i += 1;
                if self.eat(b']').is_some() {
                    return Some(());
                }
                loop {
                    self.skip(depth + 1)?;
                    if self.eat(b']').is_some() {
                        return Some(());
                    }
                    self.eat(b',')?;
                }
            }
            b'{' => self.object(|j, _| j.skip(depth + 1)),
            b't' | b'f' | b'n' => {
                for lit in [&b"true"[..], b"false", b"null"] {
                    if self.s[self.i..].starts_with(lit) {
                        self.i += lit.len();
                        return Some(());
                    }
                }
                None
            }
            _ => self.number(),
        }
    }

    /// An object: `field` reads each member's value (the key given); a
    /// duplicate key is refused.
    fn object(&mut self, mut field: impl FnMut(&mut Self, String) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        let mut keys = HashSet::new();
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            let k = self.string()?;
            if !keys.insert(k.clone()) {
                return None;
            }
            self.eat(b':')?;
            field(self, k)?;
            if self.eat(b'}').is_some() {
                return Some(());
            }
            self.eat(b',')?;
        }
    }
}

/// Read and check a header (`json`: the bytes after the length; `data_len`:
/// the bytes after the header; `itemsize`: bytes per element of a dtype
/// name, None for a dtype not readable here). None where the header is not
/// one this reader vouches for.
pub fn parse_header(
    json: &[u8],
    data_len: u64,
    itemsize: impl Fn(&str) -> Option<u64>,
) -> Option<Header> {
    let mut j = Json { s: json, i: 0 };
    let mut metadata = None;
    let mut entries = Vec::new();
    j.object(|j, key| {
        if key == "__metadata__" {
            let mut m = Vec::new();
            j.object(|j, k| {
                m.push((k, j.string()?));
                Some(())
            })?;
            metadata = Some(m);
            return Some(());
        }
        let (mut dtype, mut shape, mut offsets) = (None, None, None);
        j.object(|j, field| {
            match field.as_str() {
                "dtype" => dtype = Some(j.string()?),
                "shape" => shape = Some(j.uints()?),
                "data_offsets" => offsets = Some(j.uints()?),
                _ => j.skip(0)?,
            }
            Some(())
        })?;
        let (dtype, shape) = (dtype?, shape?);
        let [begin, end] = offsets?[..] else {
            return None;
        };
        let need = shape
            .iter()
            .try_fold(itemsize(&dtype)?, |acc, &d| acc.checked_mul(d))?;
        // torch's sizes are int64: a dimension past it (even beside a 0) is no tensor.
        let int64 = i64::MAX as u64;
        if end.checked_sub(begin)? != need || end > data_len || need > int64 {
            return None;
        }
        if shape.iter().any(|&d| d > int64) {
            return None;
        }
        entries.push(TensorEntry {
            name: key,
            dtype,
            shape,
            begin,
            end,
        });
        Some(())
    })?;
    if j.peek().is_some() {
        return None;
    }
    // Tensors tile the data section: no gap, no overlap, nothing after.
    entries.sort_by_key(|e| (e.begin, e.end));
    let mut at = 0;
    for e in &entries {
        if e.begin != at {
            return None;
        }
        at = e.end;
    }
    (at == data_len).then_some(Header { metadata, entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(d: &str) -> Option<u64> {
        match d {
            "F32" => Some(4),
            "BF16" => Some(2),
            "U8" => Some(1),
            _ => None,
        }
    }

    #[test]
    fn headers_as_safetensors_writes_them() {
        let h = br#"{"__metadata__":{"format":"pt","k\u00e9":"\ud83d\ude00"},"b":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"e":{"dtype":"U8","shape":[0],"data_offsets":[30,30]}}   "#;
        let got = parse_header(h, 30, size).unwrap();
        assert_eq!(
            got.metadata,
            Some(vec![
                ("format".into(), "pt".into()),
                ("ké".into(), "😀".into())
            ])
        );
        let names: Vec<&str> = got.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "e"]);
        assert_eq!(got.entries[0].shape, [2, 3]);
        // Unknown fields are skipped, as the Python reader skips them.
        let h = br#"{"a":{"x":[1,{"y":null}],"dtype":"U8","shape":[],"data_offsets":[0,1],"z":-1.5e3}}"#;
        assert_eq!(
            parse_header(h, 1, size).unwrap().entries[0].shape,
            Vec::<u64>::new()
        );
        // Every JSON number (RFC 8259) serde_json reads: an underflow is 0, an
        // integer past u64 an f64.
        for num in [
            "0",
            "-0",
            "7",
            "-12",
            "0.5",
            "-0.0",
            "1e5",
            "1E+5",
            "2e-3",
            "1.5E-300",
            "1e-400",
            "18446744073709551616",
            "1.7976931348623157e308",
        ] {
            let h =
                format!(r#"{{"a":{{"z":{num},"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#);
            assert!(parse_header(h.as_bytes(), 1, size).is_some(), "{num}");
        }
        let h = br#"{"\u0041\u00e9":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        assert_eq!(parse_header(h, 1, size).unwrap().entries[0].name, "A\u{e9}");
        assert_eq!(
            parse_header(b"{}", 0, size),
            Some(Header {
                metadata: None,
                entries: vec![]
            })
        );
    }

    #[test]
    fn anything_unusual_is_left_to_the_python_reader() {
        for (h, len) in [
            (&br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#[..], 16),
            (br#"{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#, 8),
            (br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8),
            (br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 9),
            (br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#, 12),
            (br#"{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#, 8),
            (br#"{"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}}"#, 8),
            (br#"{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}"#, 8),
            (br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}}"#, 8),
            (br#"{"a":{"dtype":"F32","shape":[2]}}"#, 0),
            (br#"{"__metadata__":{"k":1}}"#, 0),
            (br#"{"k":"\ud800"}"#, 0),
            (b"{\"a\":\"x\ny\"}", 0),
            (br#"{"a":{"dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,0]}}"#, 0),
            (br#"{"a":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}"#, 0),
            (br#"{} x"#, 0),
            (br#"["a"]"#, 0),
            (br#"{"a":"#, 0),
            // Not JSON, or not what serde_json reads: a \u escape is exactly 4
            // hex digits; a number has no sign but '-', digits on both sides
            // of its '.', no leading zero, and is a finite f64.
            (br#"{"\u+041":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1),
            (br#"{"\u 041":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1),
            (br#"{"\u-041":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1),
            (br#"{"\u004":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1),
            (br#"{"\ud83d\u+e00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1),
            (br#"{"\udc00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1),
            (br#"{"\ud800\u0041":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1),
        ] {
            assert_eq!(parse_header(h, len, size), None, "{}", String::from_utf8_lossy(h));
        }
        for num in [
            "+1",
            ".5",
            "1.",
            "+.5e-3",
            "01",
            "-01",
            "00",
            "-",
            "1e",
            "1e+",
            "1.e5",
            "0x1",
            "1_0",
            "NaN",
            "Infinity",
            "-Infinity",
            "inf",
            "1E400",
            "-1e400",
            &"9".repeat(400),
        ] {
            let h =
                format!(r#"{{"a":{{"z":{num},"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#);
            assert_eq!(parse_header(h.as_bytes(), 1, size), None, "{num}");
        }
        let deep = format!(
            r#"{{"a":{{"dtype":"U8","shape":[],"data_offsets":[0,1],"x":{}{}}}}}"#,
            "[".repeat(100),
            "]".repeat(100)
        );
        assert_eq!(parse_header(deep.as_bytes(), 1, size), None);
    }
}
