//! A minimal JSON value, writer and reader for the manifest: objects, arrays, strings,
//! non-negative integers (u64), booleans and null. Floats are not needed (every number in a
//! manifest is a count, an offset or a step) and are refused. The reader never panics: depth,
//! length and number range are bounded and every failure is a message with the byte offset.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Nesting deeper than this is refused (a hostile manifest cannot exhaust the stack).
const MAX_DEPTH: usize = 64;

/// A JSON value of the manifest's subset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Json>),
    /// An object, keys sorted (duplicate keys are refused by the reader).
    Object(BTreeMap<String, Json>),
}

impl Json {
    /// The value at `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(m) => m.get(key),
            _ => None,
        }
    }

    /// Writes the value compactly, except that arrays of objects and objects put one member per
    /// line (a diffable manifest).
    pub fn write(&self, out: &mut String, indent: usize) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::UInt(n) => {
                let _ = write!(out, "{n}");
            }
            Json::Str(s) => write_str(out, s),
            Json::Array(items) => {
                let nested = items
                    .iter()
                    .any(|i| matches!(i, Json::Object(_) | Json::Array(_)));
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
            Json::Object(m) => {
                out.push('{');
                for (k, (key, v)) in m.iter().enumerate() {
                    if k > 0 {
                        out.push(',');
                    }
                    newline(out, indent + 1);
                    write_str(out, key);
                    out.push_str(": ");
                    v.write(out, indent + 1);
                }
                if !m.is_empty() {
                    newline(out, indent);
                }
                out.push('}');
            }
        }
    }

    /// The value as text, with a trailing newline.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        self.write(&mut s, 0);
        s.push('\n');
        s
    }

    /// Parses `text` (one value, surrounding whitespace allowed).
    ///
    /// # Errors
    /// A message naming the byte offset of the first problem.
    pub fn parse(text: &str) -> Result<Json, String> {
        let mut p = Parser {
            b: text.as_bytes(),
            i: 0,
        };
        let v = p.value(0)?;
        p.ws();
        if p.i != p.b.len() {
            return Err(format!("trailing characters at byte {}", p.i));
        }
        Ok(v)
    }
}

fn newline(out: &mut String, indent: usize) {
    out.push('\n');
    for _ in 0..indent {
        out.push_str("  ");
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
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

    fn err<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("{what} at byte {}", self.i))
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.b[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, String> {
        if depth > MAX_DEPTH {
            return self.err("nesting too deep");
        }
        self.ws();
        match self.b.get(self.i) {
            None => self.err("unexpected end"),
            Some(b'{') => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.eat("}") {
                    return Ok(Json::Object(m));
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
                    if m.insert(k.clone(), v).is_some() {
                        return Err(format!("duplicate key `{k}` at byte {at}"));
                    }
                    self.ws();
                    if self.eat(",") {
                        continue;
                    }
                    if self.eat("}") {
                        return Ok(Json::Object(m));
                    }
                    return self.err("expected `,` or `}`");
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.eat("]") {
                    return Ok(Json::Array(v));
                }
                loop {
                    v.push(self.value(depth + 1)?);
                    self.ws();
                    if self.eat(",") {
                        continue;
                    }
                    if self.eat("]") {
                        return Ok(Json::Array(v));
                    }
                    return self.err("expected `,` or `]`");
                }
            }
            Some(b'"') => self.string().map(Json::Str),
            Some(b't') if self.eat("true") => Ok(Json::Bool(true)),
            Some(b'f') if self.eat("false") => Ok(Json::Bool(false)),
            Some(b'n') if self.eat("null") => Ok(Json::Null),
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                let mut n: u64 = 0;
                while let Some(c) = self.b.get(self.i).filter(|c| c.is_ascii_digit()) {
                    n = match n
                        .checked_mul(10)
                        .and_then(|n| n.checked_add(u64::from(c - b'0')))
                    {
                        Some(n) => n,
                        None => return Err(format!("number too large at byte {start}")),
                    };
                    self.i += 1;
                }
                if matches!(self.b.get(self.i), Some(b'.' | b'e' | b'E')) {
                    return self.err("only non-negative integers are accepted");
                }
                if self.i - start > 1 && self.b[start] == b'0' {
                    return Err(format!("leading zero at byte {start}"));
                }
                Ok(Json::UInt(n))
            }
            Some(_) => self.err("unexpected character"),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        self.i += 1; // the opening quote
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
                            let hex = self
                                .b
                                .get(self.i..self.i + 4)
                                .and_then(|h| std::str::from_utf8(h).ok())
                                .and_then(|h| u32::from_str_radix(h, 16).ok());
                            let Some(code) = hex else {
                                return self.err("bad \\u escape");
                            };
                            self.i += 4;
                            // Surrogates are not needed by the manifest; refuse them.
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
        String::from_utf8(out).map_err(|_| format!("invalid UTF-8 before byte {}", self.i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_bad_input() {
        let mut m = BTreeMap::new();
        m.insert("a\"b\n".to_string(), Json::UInt(u64::MAX));
        m.insert(
            "x".to_string(),
            Json::Array(vec![
                Json::Null,
                Json::Bool(true),
                Json::Str("é\u{1}".into()),
            ]),
        );
        let v = Json::Object(m);
        assert_eq!(Json::parse(&v.to_text()).unwrap(), v);
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\":1,\"a\":2}",
            "1.5",
            "-1",
            "01",
            "18446744073709551616",
            "\"\\ud800\"",
            "\"abc",
            "[1] x",
            &"[".repeat(10_000),
        ] {
            assert!(Json::parse(bad).is_err(), "{bad:.20}");
        }
    }
}
