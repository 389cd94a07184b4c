//! One JSON value type with its reader and writers, for every JSON the project reads or writes:
//! checkpoint manifests, `lowbit train --json` and `lowbit ckpt inspect --json`, cargo's
//! machine-readable output and golden files in tests.
//!
//! - Objects keep their members in insertion (file) order; the reader refuses a key that occurs
//!   twice in one object. [`Json::sort_keys`] gives the canonical order where a hash is taken.
//! - Numbers read as [`Json::UInt`] (an integer literal ≥ 0), [`Json::Int`] (a negative integer
//!   literal) or [`Json::Num`] (any other number, as the nearest f64); an integer literal that
//!   does not fit its 64-bit type is refused rather than rounded. [`Json::F32`] is written with
//!   the shortest decimal that reads back to the same f32 and is never produced by the reader.
//!   Non-finite numbers are written as `null` (JSON has none).
//! - The reader never panics and is bounded ([`Limits`]: nesting depth and text length); every
//!   failure is a [`ParseError`] with the byte offset. Its time is linear in the text (duplicate
//!   keys are found through a hash set beyond a few members) and a tree takes a few times the
//!   text's bytes (strings and containers at their exact sizes); [`Reader`] walks a document
//!   whose large parts must not be one tree at once (a checkpoint manifest's tensor list).
//! - Two writers: compact ([`std::fmt::Display`]) and a diffable one ([`Json::to_text`]: an
//!   object's members and an array's nested containers one per line).
//!
//! Strings are escaped per RFC 8259 §7 (quote, backslash and every control character below
//! U+0020); `\u` escapes are read with surrogate pairs, and a lone surrogate is refused.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

mod reader;
pub use reader::Reader;

/// A JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer (the writer also accepts non-negative ones).
    Int(i64),
    /// Any other number, written with the shortest decimal that reads back to the same f64.
    Num(f64),
    /// An f32, written with the shortest decimal that reads back to the same f32.
    F32(f32),
    /// A string.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object.
    Obj(Object),
}

/// The members of a JSON object, in insertion order (keys are unique when read from text).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Object(Vec<(String, Json)>);

impl Object {
    /// An empty object.
    pub fn new() -> Self {
        Object(Vec::new())
    }

    /// The member `key`, if present (looked up as in a `BTreeMap<String, Json>`).
    pub fn get<Q>(&self, key: &Q) -> Option<&Json>
    where
        String: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        self.0
            .iter()
            .find(|(k, _)| k.borrow() == key)
            .map(|(_, v)| v)
    }

    /// The member `key`, mutably, if present.
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut Json>
    where
        String: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        self.0
            .iter_mut()
            .find(|(k, _)| k.borrow() == key)
            .map(|(_, v)| v)
    }

    /// Sets `key` to `value`: replaces the member in place if present, else appends it. Returns
    /// the value replaced.
    pub fn insert(&mut self, key: impl Into<String>, value: Json) -> Option<Json> {
        let key = key.into();
        match self.get_mut(key.as_str()) {
            Some(v) => Some(std::mem::replace(v, value)),
            None => {
                self.0.push((key, value));
                None
            }
        }
    }

    /// Removes the member `key` and returns its value.
    pub fn remove(&mut self, key: &str) -> Option<Json> {
        let i = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.remove(i).1)
    }

    /// The members in order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Json)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }

    /// How many members there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<String>> FromIterator<(K, Json)> for Object {
    fn from_iter<I: IntoIterator<Item = (K, Json)>>(iter: I) -> Self {
        Object(iter.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }
}

impl From<BTreeMap<String, Json>> for Object {
    /// Members in key order.
    fn from(m: BTreeMap<String, Json>) -> Self {
        Object(m.into_iter().collect())
    }
}

impl IntoIterator for Object {
    type Item = (String, Json);
    type IntoIter = std::vec::IntoIter<(String, Json)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// What the reader accepts at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Nesting of arrays and objects deeper than this is refused (a hostile document cannot
    /// exhaust the stack).
    pub max_depth: usize,
    /// Texts longer than this many bytes are refused before any parsing.
    pub max_len: usize,
}

impl Default for Limits {
    /// Depth 64 and 1 GiB of text.
    fn default() -> Self {
        Limits {
            max_depth: 64,
            max_len: 1 << 30,
        }
    }
}

/// Why a text is not a JSON document the reader accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} at byte {at}")]
pub struct ParseError {
    /// What was wrong.
    pub what: String,
    /// The byte offset where it was found.
    pub at: usize,
}

static NULL: Json = Json::Null;

impl Json {
    /// An object from `(key, value)` pairs, in their order.
    pub fn obj<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Json)>) -> Json {
        Json::Obj(pairs.into_iter().collect())
    }

    /// A string value.
    pub fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    /// An unsigned count (`null` if it does not fit a u64).
    pub fn uint(v: impl TryInto<u64>) -> Json {
        v.try_into().map_or(Json::Null, Json::UInt)
    }

    /// Parses `text` (one value, surrounding whitespace allowed) within the default [`Limits`].
    ///
    /// # Errors
    /// The first problem and its byte offset, as for [`Json::parse_with`].
    pub fn parse(text: &str) -> Result<Json, ParseError> {
        Json::parse_with(text, Limits::default())
    }

    /// Parses `text` (one value, surrounding whitespace allowed) within `limits`.
    ///
    /// # Errors
    /// The first problem and its byte offset.
    pub fn parse_with(text: &str, limits: Limits) -> Result<Json, ParseError> {
        if text.len() > limits.max_len {
            return Err(ParseError {
                what: format!("text longer than {} bytes", limits.max_len),
                at: limits.max_len,
            });
        }
        let mut p = Parser {
            b: text.as_bytes(),
            i: 0,
            max_depth: limits.max_depth,
        };
        let v = p.value(0)?;
        p.ws();
        if p.i != p.b.len() {
            return p.err("trailing characters");
        }
        Ok(v)
    }

    /// The member `key` of an object; `null` if absent or if this is not an object (so lookups
    /// chain: `v.get("a").get("b")`). [`Json::member`] tells absent from `null`.
    pub fn get(&self, key: &str) -> &Json {
        self.member(key).unwrap_or(&NULL)
    }

    /// The member `key` of an object, if this is one and has it.
    pub fn member(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.get(key),
            _ => None,
        }
    }

    /// The number as an f64, if this is one (integers convert to the nearest f64).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Json::UInt(n) => Some(n as f64),
            Json::Int(n) => Some(n as f64),
            Json::Num(x) => Some(x),
            Json::F32(x) => Some(f64::from(x)),
            _ => None,
        }
    }

    /// The value as a u64, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Json::UInt(n) => Some(n),
            Json::Int(n) => u64::try_from(n).ok(),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if this is an array (else none).
    pub fn arr(&self) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            _ => &[],
        }
    }

    /// Whether this is `true`.
    pub fn is_true(&self) -> bool {
        matches!(self, Json::Bool(true))
    }

    /// The keys, if this is an object (else none).
    pub fn keys(&self) -> Vec<&str> {
        match self {
            Json::Obj(m) => m.keys().map(String::as_str).collect(),
            _ => Vec::new(),
        }
    }

    /// Whether this array holds the string `s`.
    pub fn contains_str(&self, s: &str) -> bool {
        self.arr().iter().any(|v| v.as_str() == Some(s))
    }

    /// The member `key`, which must exist (a strict reader for tests and tools).
    ///
    /// # Panics
    /// If it does not.
    pub fn key(&self, key: &str) -> &Json {
        self.member(key)
            .unwrap_or_else(|| panic!("no key {key} in {:?}", self.keys()))
    }

    /// The number (strict).
    ///
    /// # Panics
    /// If this is not a number.
    pub fn number(&self) -> f64 {
        self.as_f64()
            .unwrap_or_else(|| panic!("not a number: {self:?}"))
    }

    /// The string (strict).
    ///
    /// # Panics
    /// If this is not a string.
    pub fn text(&self) -> &str {
        self.as_str()
            .unwrap_or_else(|| panic!("not a string: {self:?}"))
    }

    /// The boolean (strict).
    ///
    /// # Panics
    /// If this is not a boolean.
    pub fn flag(&self) -> bool {
        match self {
            Json::Bool(b) => *b,
            other => panic!("not a bool: {other:?}"),
        }
    }

    /// Puts every object's members, at every depth, in key order: the canonical form, whose
    /// text does not depend on the order the members were built or read in.
    pub fn sort_keys(&mut self) {
        match self {
            Json::Obj(m) => {
                m.0.sort_by(|a, b| a.0.cmp(&b.0));
                m.0.iter_mut().for_each(|(_, v)| v.sort_keys());
            }
            Json::Arr(a) => a.iter_mut().for_each(Json::sort_keys),
            _ => {}
        }
    }

    /// Writes the value, arrays of containers and objects one member per line (a diffable
    /// manifest), nested `indent` levels deep (two spaces a level).
    pub fn write(&self, out: &mut String, indent: usize) {
        match self {
            Json::Arr(items) => {
                let nested = items
                    .iter()
                    .any(|i| matches!(i, Json::Obj(_) | Json::Arr(_)));
                out.push('[');
                for (k, i) in items.iter().enumerate() {
                    if k > 0 {
                        out.push(',');
                    }
                    if nested {
                        newline(out, indent + 1);
                    }
                    i.write(out, indent + 1);
                }
                if nested && !items.is_empty() {
                    newline(out, indent);
                }
                out.push(']');
            }
            Json::Obj(m) => {
                out.push('{');
                for (k, (key, v)) in m.iter().enumerate() {
                    if k > 0 {
                        out.push(',');
                    }
                    newline(out, indent + 1);
                    push_string(out, key);
                    out.push_str(": ");
                    v.write(out, indent + 1);
                }
                if !m.is_empty() {
                    newline(out, indent);
                }
                out.push('}');
            }
            scalar => {
                let _ = write!(out, "{scalar}");
            }
        }
    }

    /// The value as diffable text ([`Json::write`]), with a trailing newline.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        self.write(&mut s, 0);
        s.push('\n');
        s
    }
}

impl fmt::Display for Json {
    /// The compact form: no whitespace between tokens.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "{b}"),
            Json::UInt(n) => write!(f, "{n}"),
            Json::Int(n) => write!(f, "{n}"),
            Json::Num(x) if x.is_finite() => write!(f, "{x:?}"),
            Json::F32(x) if x.is_finite() => write!(f, "{x:?}"),
            Json::Num(_) | Json::F32(_) => f.write_str("null"),
            Json::Str(s) => write_string(f, s),
            Json::Arr(items) => {
                f.write_char('[')?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_char(',')?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_char(']')
            }
            Json::Obj(m) => {
                f.write_char('{')?;
                for (i, (k, v)) in m.iter().enumerate() {
                    if i > 0 {
                        f.write_char(',')?;
                    }
                    write_string(f, k)?;
                    write!(f, ":{v}")?;
                }
                f.write_char('}')
            }
        }
    }
}

fn newline(out: &mut String, indent: usize) {
    out.push('\n');
    for _ in 0..indent {
        out.push_str("  ");
    }
}

/// Writes `s` as a JSON string literal: quote, backslash and control characters escaped
/// (`\n`, `\r`, `\t` by name, the others as `\u00XX`), everything else as it is.
pub fn write_string(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    write_string_styled(out, s, false)
}

/// Appends `s` as `serde_json` writes a string (as [`write_string`], but backspace and form
/// feed as `\b` and `\f`), so a safetensors header written here has the bytes
/// `safetensors::serialize` would give it.
pub fn push_string_serde(out: &mut String, s: &str) {
    // Writing to a String cannot fail.
    let _ = write_string_styled(out, s, true);
}

fn write_string_styled(out: &mut impl fmt::Write, s: &str, serde: bool) -> fmt::Result {
    out.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => out.write_str("\\\"")?,
            '\\' => out.write_str("\\\\")?,
            '\n' => out.write_str("\\n")?,
            '\r' => out.write_str("\\r")?,
            '\t' => out.write_str("\\t")?,
            '\u{8}' if serde => out.write_str("\\b")?,
            '\u{c}' if serde => out.write_str("\\f")?,
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32)?,
            c => out.write_char(c)?,
        }
    }
    out.write_char('"')
}

/// Appends `s` as a JSON string literal ([`write_string`]).
pub fn push_string(out: &mut String, s: &str) {
    // Writing to a String cannot fail.
    let _ = write_string(out, s);
}

/// The keys of one object being read, for the duplicate check: a linear scan while the object
/// is small, then a set of key hashes (std's randomly keyed SipHash, so no input can make
/// every key collide), confirmed by a scan only on a hash match. An object of n members is
/// checked in O(n), not O(n²).
#[derive(Default)]
struct KeySet(
    Option<std::collections::HashSet<u64>>,
    std::hash::RandomState,
);

impl KeySet {
    const SCAN: usize = 16;

    /// Records `k` as the next member of `m`; false if `m` has it already.
    fn insert(&mut self, m: &Object, k: &str) -> bool {
        use std::hash::BuildHasher;
        if m.len() < Self::SCAN {
            return m.get(k).is_none();
        }
        let hasher = &self.1;
        let set = self
            .0
            .get_or_insert_with(|| m.keys().map(|key| hasher.hash_one(key.as_str())).collect());
        set.insert(hasher.hash_one(k)) || m.get(k).is_none()
    }
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
    max_depth: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while let Some(c) = self.b.get(self.i) {
            if matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    fn err<T>(&self, what: &str) -> Result<T, ParseError> {
        self.err_at(what, self.i)
    }

    fn err_at<T>(&self, what: &str, at: usize) -> Result<T, ParseError> {
        Err(ParseError {
            what: what.to_owned(),
            at,
        })
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.b[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, ParseError> {
        if depth > self.max_depth {
            return self.err("nesting too deep");
        }
        self.ws();
        match self.b.get(self.i) {
            None => self.err("unexpected end"),
            Some(b'{') => {
                self.i += 1;
                let mut m = Object::new();
                let mut keys = KeySet::default();
                self.ws();
                if self.eat("}") {
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    if self.b.get(self.i) != Some(&b'"') {
                        return self.err("expected a key");
                    }
                    let at = self.i;
                    let k = self.string()?;
                    self.ws();
                    if !self.eat(":") {
                        return self.err("expected `:`");
                    }
                    let v = self.value(depth + 1)?;
                    if !keys.insert(&m, &k) {
                        return self.err_at(&format!("duplicate key `{k}`"), at);
                    }
                    m.0.push((k, v));
                    self.ws();
                    if self.eat(",") {
                        continue;
                    }
                    if self.eat("}") {
                        m.0.shrink_to_fit();
                        return Ok(Json::Obj(m));
                    }
                    return self.err("expected `,` or `}`");
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.eat("]") {
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value(depth + 1)?);
                    self.ws();
                    if self.eat(",") {
                        continue;
                    }
                    if self.eat("]") {
                        v.shrink_to_fit();
                        return Ok(Json::Arr(v));
                    }
                    return self.err("expected `,` or `]`");
                }
            }
            Some(b'"') => self.string().map(Json::Str),
            Some(b't') if self.eat("true") => Ok(Json::Bool(true)),
            Some(b'f') if self.eat("false") => Ok(Json::Bool(false)),
            Some(b'n') if self.eat("null") => Ok(Json::Null),
            Some(c) if c.is_ascii_digit() || *c == b'-' => self.number(),
            Some(_) => self.err("unexpected character"),
        }
    }

    /// A number per RFC 8259 §6: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
    fn number(&mut self) -> Result<Json, ParseError> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let from = p.i;
            while p.b.get(p.i).is_some_and(u8::is_ascii_digit) {
                p.i += 1;
            }
            p.i - from
        };
        let negative = self.eat("-");
        let int_start = self.i;
        let n = digits(self);
        if n == 0 {
            return self.err("expected a digit");
        }
        if n > 1 && self.b[int_start] == b'0' {
            return self.err_at("leading zero", start);
        }
        let mut integer = true;
        if self.eat(".") {
            integer = false;
            if digits(self) == 0 {
                return self.err("expected a digit after `.`");
            }
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            integer = false;
            self.i += 1;
            if matches!(self.b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if digits(self) == 0 {
                return self.err("expected a digit in the exponent");
            }
        }
        // The slice is ASCII digits and signs, so UTF-8.
        let text = std::str::from_utf8(&self.b[start..self.i]).unwrap_or_default();
        if integer {
            let parsed = if negative {
                text.parse::<i64>().ok().map(Json::Int)
            } else {
                text.parse::<u64>().ok().map(Json::UInt)
            };
            return parsed.map_or_else(|| self.err_at("number too large", start), Ok);
        }
        match text.parse::<f64>() {
            Ok(x) if x.is_finite() => Ok(Json::Num(x)),
            _ => self.err_at("number out of range", start),
        }
    }

    fn hex4(&mut self) -> Result<u32, ParseError> {
        let hex = self
            .b
            .get(self.i..self.i + 4)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u32::from_str_radix(h, 16).ok());
        let Some(code) = hex else {
            return self.err("bad \\u escape");
        };
        self.i += 4;
        Ok(code)
    }

    fn string(&mut self) -> Result<String, ParseError> {
        self.i += 1; // the opening quote
        // Most strings hold no escape: one slice, copied at its exact size.
        let plain = self.b[self.i..]
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20);
        if let Some(n) = plain
            && self.b[self.i + n] == b'"'
        {
            let at = self.i;
            let text = std::str::from_utf8(&self.b[at..at + n]).map_err(|_| ParseError {
                what: "invalid UTF-8 in string".into(),
                at: at + n + 1,
            })?;
            self.i += n + 1;
            return Ok(text.to_owned());
        }
        let mut out = Vec::new();
        loop {
            let Some(&c) = self.b.get(self.i) else {
                return self.err("unterminated string");
            };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let Some(&e) = self.b.get(self.i) else {
                        return self.err("unterminated escape");
                    };
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'u' => {
                            let mut code = self.hex4()?;
                            if (0xd800..0xdc00).contains(&code)
                                && self.b[self.i..].starts_with(b"\\u")
                            {
                                let at = self.i;
                                self.i += 2;
                                let lo = self.hex4()?;
                                if !(0xdc00..0xe000).contains(&lo) {
                                    return self.err_at("unpaired surrogate", at);
                                }
                                code = 0x10000 + ((code - 0xd800) << 10) + (lo - 0xdc00);
                            }
                            match char::from_u32(code) {
                                Some(c) => c,
                                None => return self.err("\\u escape is not a scalar value"),
                            }
                        }
                        _ => return self.err("unknown escape"),
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                c if c < 0x20 => return self.err("control character in string"),
                c => out.push(c),
            }
        }
        String::from_utf8(out).map_err(|_| ParseError {
            what: "invalid UTF-8 in string".into(),
            at: self.i,
        })
    }
}
