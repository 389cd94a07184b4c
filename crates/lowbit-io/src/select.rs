//! Which float tensors `quantize` quantizes: glob filters and the default rule.
//!
//! The default keeps what low-precision training keeps in high precision (Transformer Engine
//! quantizes only the inputs of its GEMMs; norms, biases, the embedding and the output head
//! stay bf16/fp32): a float tensor is quantized only if it has at least two dimensions and its
//! name, lower-cased, matches none of `*norm*`, `*embed*`, `*.bias` (or is `bias`) and
//! `*lm_head*`. The head is kept because TE's recipes leave it in bf16 (its logits feed a
//! softmax over the whole vocabulary, where fp8 error is largest) and lowbit's Llama trains it in
//! high precision too (`matrix: false` for `lm_head.weight`). `lowbit ckpt export` and `lowbit
//! quantize` share this rule ([`default_keep`]).
//!
//! Filters ([`Select`]): an `--exclude` match always keeps a tensor; otherwise `--all` or an
//! `--include` match quantizes it, and when includes are given a tensor matching none is kept;
//! with neither, the default rule decides. Patterns are shell globs over the whole name: `*`
//! (any run of characters, dots included), `?` (one character), `[abc]`, `[a-z]`, `[!a-z]` (or
//! `[^a-z]`); a backslash makes the next character literal.

use std::fmt;

/// A glob pattern over tensor names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glob {
    text: String,
    toks: Vec<Tok>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Lit(char),
    Any,
    Star,
    /// A bracket class: negated, and its items (ranges; a single character is `c..=c`).
    Class(bool, Vec<(char, char)>),
}

/// A malformed pattern.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("glob {pattern:?}: {what}")]
pub struct GlobError {
    /// The pattern as given.
    pub pattern: String,
    /// What is wrong with it.
    pub what: &'static str,
}

impl Glob {
    /// Parses `pattern`; an unterminated `[`, an empty class or a trailing backslash is an error.
    pub fn new(pattern: &str) -> Result<Self, GlobError> {
        let err = |what| GlobError {
            pattern: pattern.to_owned(),
            what,
        };
        let chars: Vec<char> = pattern.chars().collect();
        let mut toks = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            match chars[i] {
                '*' => {
                    if toks.last() != Some(&Tok::Star) {
                        toks.push(Tok::Star);
                    }
                }
                '?' => toks.push(Tok::Any),
                '\\' => {
                    i += 1;
                    toks.push(Tok::Lit(*chars.get(i).ok_or(err("trailing backslash"))?));
                }
                '[' => {
                    let mut j = i + 1;
                    let negated = matches!(chars.get(j), Some('!' | '^'));
                    if negated {
                        j += 1;
                    }
                    let mut items = Vec::new();
                    // A `]` first in the class is a literal, as in shells.
                    let mut first = true;
                    loop {
                        let c = *chars.get(j).ok_or(err("unterminated ["))?;
                        if c == ']' && !first {
                            break;
                        }
                        first = false;
                        let lo = if c == '\\' {
                            j += 1;
                            *chars.get(j).ok_or(err("trailing backslash"))?
                        } else {
                            c
                        };
                        if chars.get(j + 1) == Some(&'-')
                            && chars.get(j + 2).is_some_and(|&h| h != ']')
                        {
                            let hi = chars[j + 2];
                            if hi < lo {
                                return Err(err("range out of order in [...]"));
                            }
                            items.push((lo, hi));
                            j += 3;
                        } else {
                            items.push((lo, lo));
                            j += 1;
                        }
                    }
                    toks.push(Tok::Class(negated, items));
                    i = j;
                }
                c => toks.push(Tok::Lit(c)),
            }
            i += 1;
        }
        Ok(Glob {
            text: pattern.to_owned(),
            toks,
        })
    }

    /// The pattern as given.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the whole of `name` matches (linear backtracking over the last `*`, so no
    /// pattern is exponential).
    pub fn matches(&self, name: &str) -> bool {
        let s: Vec<char> = name.chars().collect();
        let (mut p, mut i) = (0, 0);
        let mut star: Option<(usize, usize)> = None;
        while i < s.len() {
            match self.toks.get(p) {
                Some(Tok::Star) => {
                    star = Some((p, i));
                    p += 1;
                    continue;
                }
                Some(t) if t.accepts(s[i]) => {
                    p += 1;
                    i += 1;
                    continue;
                }
                _ => {}
            }
            match star {
                Some((sp, si)) => {
                    p = sp + 1;
                    i = si + 1;
                    star = Some((sp, si + 1));
                }
                None => return false,
            }
        }
        self.toks[p..].iter().all(|t| *t == Tok::Star)
    }
}

impl Tok {
    fn accepts(&self, c: char) -> bool {
        match self {
            Tok::Lit(l) => *l == c,
            Tok::Any => true,
            Tok::Star => false,
            Tok::Class(neg, items) => items.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *neg,
        }
    }
}

impl std::str::FromStr for Glob {
    type Err = GlobError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Glob::new(s)
    }
}

impl fmt::Display for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Why a float tensor is kept in its dtype (copied bit for bit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Fewer than two dimensions (its rank).
    Rank(usize),
    /// Its name looks like a norm's (`*norm*`).
    Norm,
    /// Its name looks like an embedding's (`*embed*`).
    Embedding,
    /// Its name looks like a bias (`*.bias`).
    Bias,
    /// The output head (`*lm_head*`).
    Head,
    /// Matched this `--exclude` pattern.
    Excluded(String),
    /// Includes were given and none matched.
    NotIncluded,
    /// Not in the caller's own list ([`crate::quantize::Options::only`]).
    NotListed,
}

impl fmt::Display for Keep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Keep::Rank(r) => write!(f, "{r}-D"),
            Keep::Norm => f.write_str("norm"),
            Keep::Embedding => f.write_str("embedding"),
            Keep::Bias => f.write_str("bias"),
            Keep::Head => f.write_str("output head"),
            Keep::Excluded(p) => write!(f, "--exclude {p}"),
            Keep::NotIncluded => f.write_str("no --include"),
            Keep::NotListed => f.write_str("not listed"),
        }
    }
}

/// The default rule: `None` for a GEMM weight (quantized), else why the tensor is kept.
pub fn default_keep(name: &str, shape: &[usize]) -> Option<Keep> {
    if shape.len() < 2 {
        return Some(Keep::Rank(shape.len()));
    }
    let lower = name.to_lowercase();
    if lower.contains("norm") {
        Some(Keep::Norm)
    } else if lower.contains("embed") {
        Some(Keep::Embedding)
    } else if lower == "bias" || lower.ends_with(".bias") {
        Some(Keep::Bias)
    } else if lower.contains("lm_head") {
        Some(Keep::Head)
    } else {
        None
    }
}

/// The tensor filters of a quantization (see the module doc for the precedence).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Select {
    /// Quantize every float tensor not excluded (the default rule is off).
    pub all: bool,
    /// Quantize the tensors matching any of these (the default rule is off when non-empty).
    pub include: Vec<Glob>,
    /// Keep the tensors matching any of these, whatever else says.
    pub exclude: Vec<Glob>,
}

impl Select {
    /// Every float tensor (the behaviour before filters existed).
    pub fn all() -> Self {
        Select {
            all: true,
            ..Select::default()
        }
    }

    /// Whether the float tensor `name` of `shape` is quantized (`None`) or kept, and why.
    pub fn keep(&self, name: &str, shape: &[usize]) -> Option<Keep> {
        if let Some(g) = self.exclude.iter().find(|g| g.matches(name)) {
            return Some(Keep::Excluded(g.as_str().to_owned()));
        }
        if self.all {
            return None;
        }
        if !self.include.is_empty() {
            return match self.include.iter().any(|g| g.matches(name)) {
                true => None,
                false => Some(Keep::NotIncluded),
            };
        }
        default_keep(name, shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, s: &str) -> bool {
        Glob::new(p).unwrap().matches(s)
    }

    #[test]
    fn globs() {
        assert!(m("*", ""));
        assert!(m("*", "model.layers.0.mlp.up_proj.weight"));
        assert!(m(
            "model.layers.*.mlp.*",
            "model.layers.10.mlp.up_proj.weight"
        ));
        assert!(!m(
            "model.layers.*.mlp.*",
            "model.layers.10.self_attn.q_proj.weight"
        ));
        assert!(m("*.weight", "a.weight"));
        assert!(!m("*.weight", "a.weights"));
        assert!(m("layer?", "layer7"));
        assert!(!m("layer?", "layer"));
        assert!(!m("layer?", "layer10"));
        assert!(m("layers.[0-3].*", "layers.2.w"));
        assert!(!m("layers.[0-3].*", "layers.4.w"));
        assert!(m("layers.[!0-3].*", "layers.4.w"));
        assert!(m("layers.[^0-3].*", "layers.9.w"));
        assert!(m("[]x]", "]"));
        assert!(m("a\\*b", "a*b"));
        assert!(!m("a\\*b", "axb"));
        assert!(m("*a*b*c*", "xxaxxbxxcxx"));
        assert!(!m("*a*b*c*", "xxaxxcxxbxx"));
        assert!(m("é?", "éü"));
        // Backtracking stays linear in practice: a long non-match returns promptly.
        let long = "a".repeat(10_000);
        assert!(!m("*a*a*a*a*a*b", &long));
    }

    #[test]
    fn bad_globs() {
        for (p, what) in [
            ("[abc", "unterminated ["),
            ("a\\", "trailing backslash"),
            ("[z-a]", "range out of order in [...]"),
        ] {
            let e = Glob::new(p).unwrap_err();
            assert_eq!(e.what, what, "{p}");
            assert_eq!(e.to_string(), format!("glob {p:?}: {what}"));
        }
    }

    #[test]
    fn default_rule() {
        let cases = [
            (
                "model.layers.0.self_attn.q_proj.weight",
                &[64, 64][..],
                None,
            ),
            ("model.layers.0.mlp.down_proj.weight", &[64, 128], None),
            ("w", &[3, 4, 5], None),
            (
                "model.layers.0.input_layernorm.weight",
                &[64],
                Some(Keep::Rank(1)),
            ),
            ("model.norm.weight", &[64], Some(Keep::Rank(1))),
            ("scalar", &[], Some(Keep::Rank(0))),
            ("enc.LayerNorm.weight", &[2, 64], Some(Keep::Norm)),
            (
                "model.embed_tokens.weight",
                &[256, 64],
                Some(Keep::Embedding),
            ),
            ("proj.bias", &[4, 64], Some(Keep::Bias)),
            ("lm_head.weight", &[256, 64], Some(Keep::Head)),
        ];
        for (name, shape, want) in cases {
            assert_eq!(default_keep(name, shape), want, "{name}");
            assert_eq!(Select::default().keep(name, shape), want, "{name}");
            assert_eq!(Select::all().keep(name, shape), None, "{name}");
        }
    }

    #[test]
    fn precedence() {
        let g = |p: &str| Glob::new(p).unwrap();
        let s = Select {
            all: false,
            include: vec![g("*.mlp.*"), g("model.norm.weight")],
            exclude: vec![g("*down*")],
        };
        assert_eq!(s.keep("l.mlp.up.weight", &[4, 4]), None);
        // An include overrides the default rule (a 1-D norm is quantized when named).
        assert_eq!(s.keep("model.norm.weight", &[4]), None);
        assert_eq!(s.keep("l.attn.q.weight", &[4, 4]), Some(Keep::NotIncluded));
        // An exclude wins over an include and over --all.
        assert_eq!(
            s.keep("l.mlp.down.weight", &[4, 4]),
            Some(Keep::Excluded("*down*".into()))
        );
        let all = Select {
            all: true,
            exclude: vec![g("*down*")],
            ..Select::default()
        };
        assert_eq!(all.keep("x.bias", &[4]), None);
        assert_eq!(
            all.keep("l.mlp.down.weight", &[4, 4]),
            Some(Keep::Excluded("*down*".into()))
        );
        // --include '*' is --all.
        let star = Select {
            include: vec![g("*")],
            ..Select::default()
        };
        for (n, sh) in [("a.bias", &[3][..]), ("norm", &[]), ("w", &[2, 2])] {
            assert_eq!(star.keep(n, sh), all.keep(n, sh));
        }
    }
}
