//! A minimal JSON writer for `lowbit train --json` (one object, no dependency): values are built
//! as a tree and printed compactly. Non-finite numbers print as `null`, since JSON has none.

use std::fmt::{self, Write};

/// A JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A number printed with the shortest decimal that reads back to the same f64.
    Num(f64),
    /// An f32 printed with the shortest decimal that reads back to the same f32.
    F32(f32),
    /// A string.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object, keys in insertion order.
    Obj(Vec<(String, Json)>),
}

impl Json {
    /// An object from `(key, value)` pairs.
    pub fn obj<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Json)>) -> Json {
        Json::Obj(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }
    /// A string value.
    pub fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }
    /// An unsigned count.
    pub fn uint(v: impl TryInto<i64>) -> Json {
        v.try_into().map_or(Json::Null, Json::Int)
    }
}

fn write_str(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    f.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => f.write_str("\\\"")?,
            '\\' => f.write_str("\\\\")?,
            '\n' => f.write_str("\\n")?,
            '\r' => f.write_str("\\r")?,
            '\t' => f.write_str("\\t")?,
            c if (c as u32) < 0x20 => write!(f, "\\u{:04x}", c as u32)?,
            c => f.write_char(c)?,
        }
    }
    f.write_char('"')
}

impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "{b}"),
            Json::Int(i) => write!(f, "{i}"),
            Json::Num(x) if x.is_finite() => write!(f, "{x:?}"),
            Json::F32(x) if x.is_finite() => write!(f, "{x:?}"),
            Json::Num(_) | Json::F32(_) => f.write_str("null"),
            Json::Str(s) => write_str(f, s),
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
            Json::Obj(pairs) => {
                f.write_char('{')?;
                for (i, (k, v)) in pairs.iter().enumerate() {
                    if i > 0 {
                        f.write_char(',')?;
                    }
                    write_str(f, k)?;
                    write!(f, ":{v}")?;
                }
                f.write_char('}')
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_compact_json() {
        let v = Json::obj([
            ("a", Json::Int(-3)),
            ("b", Json::F32(0.1)),
            ("c", Json::Num(f64::NAN)),
            ("d", Json::str("q\"\n\u{1}")),
            ("e", Json::Arr(vec![Json::Bool(true), Json::Null])),
            ("f", Json::Num(1e-30)),
        ]);
        assert_eq!(
            v.to_string(),
            r#"{"a":-3,"b":0.1,"c":null,"d":"q\"\n\u0001","e":[true,null],"f":1e-30}"#
        );
    }
}
