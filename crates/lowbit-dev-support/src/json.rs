//! A small JSON reader for cargo's machine-readable output (`cargo metadata`,
//! `--message-format=json`) and `lowbit train --json`, so its users need no parser dependency.

use std::collections::BTreeMap;

/// A JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// A number (as f64).
    Num(f64),
    /// A string.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object.
    Obj(BTreeMap<String, Json>),
}

impl Json {
    /// Parses one JSON document.
    pub fn parse(text: &str) -> Result<Json, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            i: 0,
        };
        let v = p.value()?;
        p.ws();
        if p.i != p.s.len() {
            return Err(format!("trailing characters at byte {}", p.i));
        }
        Ok(v)
    }

    /// The member `key` of an object (`Null` if absent or not an object).
    pub fn get(&self, key: &str) -> &Json {
        match self {
            Json::Obj(m) => m.get(key).unwrap_or(&Json::Null),
            _ => &Json::Null,
        }
    }

    /// The number, if this is one.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Json::Num(x) => Some(*x),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn str(&self) -> Option<&str> {
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

    /// The keys, if this is an object.
    pub fn keys(&self) -> Vec<&str> {
        match self {
            Json::Obj(m) => m.keys().map(String::as_str).collect(),
            _ => Vec::new(),
        }
    }

    /// The member `key`, which must exist (strict reader for tests).
    ///
    /// # Panics
    /// If it does not.
    pub fn key(&self, key: &str) -> &Json {
        assert!(
            self.keys().contains(&key),
            "no key {key} in {:?}",
            self.keys()
        );
        self.get(key)
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
        self.str()
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

    /// Whether this array holds the string `s`.
    pub fn contains_str(&self, s: &str) -> bool {
        self.arr().iter().any(|v| v.str() == Some(s))
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn err<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("{what} at byte {}", self.i))
    }

    fn eat(&mut self, lit: &str) -> Result<(), String> {
        if self.s[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            Ok(())
        } else {
            self.err(&format!("expected `{lit}`"))
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        self.ws();
        match self.s.get(self.i) {
            None => self.err("unexpected end"),
            Some(b'n') => self.eat("null").map(|()| Json::Null),
            Some(b't') => self.eat("true").map(|()| Json::Bool(true)),
            Some(b'f') => self.eat("false").map(|()| Json::Bool(false)),
            Some(b'"') => self.string().map(Json::Str),
            Some(b'[') => {
                let mut a = Vec::new();
                self.seq(b']', |p| {
                    a.push(p.value()?);
                    Ok(())
                })?;
                Ok(Json::Arr(a))
            }
            Some(b'{') => {
                let mut m = BTreeMap::new();
                self.seq(b'}', |p| {
                    p.ws();
                    if p.s.get(p.i) != Some(&b'"') {
                        return p.err("expected a key");
                    }
                    let k = p.string()?;
                    p.ws();
                    p.eat(":")?;
                    m.insert(k, p.value()?);
                    Ok(())
                })?;
                Ok(Json::Obj(m))
            }
            Some(_) => {
                let start = self.i;
                while self.i < self.s.len()
                    && matches!(
                        self.s[self.i],
                        b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
                    )
                {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                t.parse().map(Json::Num).or_else(|_| self.err("bad value"))
            }
        }
    }

    /// The elements of an array or the members of an object: from its opening bracket (the
    /// current byte) through `close`, `item` parsing each element between the commas.
    fn seq(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Result<(), String>,
    ) -> Result<(), String> {
        self.i += 1;
        self.ws();
        if self.s.get(self.i) == Some(&close) {
            self.i += 1;
            return Ok(());
        }
        loop {
            item(self)?;
            self.ws();
            match self.s.get(self.i) {
                Some(b',') => self.i += 1,
                Some(&c) if c == close => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return self.err(&format!("expected `,` or `{}`", close as char)),
            }
        }
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let h = self.s.get(self.i..self.i + 4).ok_or("short \\u escape")?;
        let h = std::str::from_utf8(h).map_err(|_| "bad \\u escape")?;
        self.i += 4;
        u32::from_str_radix(h, 16).map_err(|_| "bad \\u escape".to_string())
    }

    fn string(&mut self) -> Result<String, String> {
        self.i += 1; // opening quote
        let mut out = String::new();
        loop {
            let start = self.i;
            while self.i < self.s.len() && !matches!(self.s[self.i], b'"' | b'\\') {
                self.i += 1;
            }
            out.push_str(std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?);
            match self.s.get(self.i) {
                None => return self.err("unterminated string"),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(_) => {
                    self.i += 1;
                    let c = *self.s.get(self.i).ok_or("unterminated escape")?;
                    self.i += 1;
                    match c {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let mut cp = self.hex4()?;
                            if (0xd800..0xdc00).contains(&cp)
                                && self.s[self.i..].starts_with(b"\\u")
                            {
                                self.i += 2;
                                let lo = self.hex4()?;
                                cp = 0x10000
                                    + ((cp - 0xd800) << 10)
                                    + (lo.wrapping_sub(0xdc00) & 0x3ff);
                            }
                            out.push(char::from_u32(cp).unwrap_or('\u{fffd}'));
                        }
                        _ => return self.err("bad escape"),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Json;

    #[test]
    fn parses_cargo_like_messages() {
        let v = Json::parse(
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"nccl",
               "required-features":["cuda"]},"profile":{"test":true},"executable":"/t/x\u00e9\"y",
               "n":-1.5e3,"none":null,"list":[]}"#,
        )
        .unwrap();
        assert_eq!(v.get("reason").str(), Some("compiler-artifact"));
        assert!(v.get("target").get("kind").contains_str("test"));
        assert!(
            v.get("target")
                .get("required-features")
                .contains_str("cuda")
        );
        assert!(v.get("profile").get("test").is_true());
        assert_eq!(v.get("executable").str(), Some("/t/xé\"y"));
        assert_eq!(v.get("n"), &Json::Num(-1500.0));
        assert_eq!(v.get("missing"), &Json::Null);
        assert!(Json::parse("{\"a\":}").is_err());
        assert!(Json::parse("[1,2] x").is_err());
    }

    #[test]
    fn parses_nested_and_empty_containers() {
        let v = Json::parse(r#"[ 1 , [2, {}], {"k": [true, null], "e": []} ]"#).unwrap();
        let a = v.arr();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0], Json::Num(1.0));
        assert_eq!(a[1].arr()[0], Json::Num(2.0));
        assert_eq!(a[1].arr()[1].keys(), Vec::<&str>::new());
        assert!(a[2].get("k").arr()[0].is_true());
        assert_eq!(a[2].get("k").arr()[1], Json::Null);
        assert_eq!(a[2].get("e"), &Json::Arr(Vec::new()));
        assert_eq!(Json::parse("{}").unwrap(), Json::Obj(Default::default()));
        for bad in [
            "[1 2]",
            "[1,]",
            "{\"a\":1,}",
            "{1:2}",
            "{\"a\" 1}",
            "[",
            "{",
        ] {
            assert!(Json::parse(bad).is_err(), "{bad}");
        }
    }
}
