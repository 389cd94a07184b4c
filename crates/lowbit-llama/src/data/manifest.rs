//! The shard directory's `manifest.json`: its typed form, its writer and its strict reader.
//!
//! ```json
//! {"format": "lowbit-token-shards", "version": 1,
//!  "tokenizer": "gpt2", "vocab": 50257, "eot": 50256, "dtype": "u16",
//!  "validation_fraction": 0.1, "shard_tokens": 100000000,
//!  "splits": {"train":      {"documents": 38, "tokens": 1234, "shards": [
//!                              {"file": "train-00000.bin", "tokens": 1234, "fnv1a64": "…"}]},
//!             "validation": {"documents": 4, "tokens": 56, "shards": […]}},
//!  "inputs": [{"path": "hamlet.txt", "bytes": 180000, "fnv1a64": "…", "split": "train"}]}
//! ```
//! Hashes are FNV-1a 64 of the file's bytes as 16 lowercase hex digits. Every key is required,
//! none other is allowed, at every level.

use std::path::Path;

use lowbit_io::Json;

use super::{DataError, Result, Tokenizer};

/// The manifest's file name inside a shard directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The `format` member of every manifest this crate writes.
pub const FORMAT: &str = "lowbit-token-shards";
/// The `version` member this reader accepts (and the writer writes).
pub const VERSION: u64 = 1;

/// The element type of the shard files (little-endian, no header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// Two bytes per token: every id of a vocabulary ≤ 65536.
    U16,
    /// Four bytes per token.
    U32,
}

impl Dtype {
    /// The narrowest type holding every id below `vocab`.
    pub fn for_vocab(vocab: u32) -> Dtype {
        if vocab <= 1 << 16 {
            Dtype::U16
        } else {
            Dtype::U32
        }
    }
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            Dtype::U16 => 2,
            Dtype::U32 => 4,
        }
    }
    /// The manifest's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::U16 => "u16",
            Dtype::U32 => "u32",
        }
    }
}

/// One shard file of a split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardRecord {
    /// The file name inside the directory (no path separators).
    pub file: String,
    /// Tokens in the file (its size is `tokens × dtype width`).
    pub tokens: u64,
    /// FNV-1a 64 of the file's bytes.
    pub fnv1a64: u64,
}

/// One split (train or validation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SplitRecord {
    /// Documents in the split (each preceded by end-of-text in the token stream).
    pub documents: u64,
    /// Tokens in the split: the sum of its shards' tokens.
    pub tokens: u64,
    /// Its shards, in stream order.
    pub shards: Vec<ShardRecord>,
}

/// One input file as it was when it was prepared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRecord {
    /// The path as given to [`super::prepare`].
    pub path: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// FNV-1a 64 of its bytes.
    pub fnv1a64: u64,
    /// Where it went: `train`, `validation`, or `both` (a lone document split in two).
    pub split: String,
}

/// A shard directory's manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    /// The tokenizer that produced the ids.
    pub tokenizer: Tokenizer,
    /// Every id is below it (the tokenizer's vocabulary).
    pub vocab: u32,
    /// The end-of-text id before every document.
    pub eot: u32,
    /// The shard files' element type.
    pub dtype: Dtype,
    /// The validation fraction the split was made with.
    pub validation_fraction: f64,
    /// The most tokens per shard file.
    pub shard_tokens: u64,
    /// The training split.
    pub train: SplitRecord,
    /// The validation split (no shards when the fraction was 0).
    pub validation: SplitRecord,
    /// The input files, in the order given.
    pub inputs: Vec<InputRecord>,
}

fn hex(h: u64) -> Json {
    Json::str(format!("{h:016x}"))
}

fn shard_json(s: &ShardRecord) -> Json {
    Json::obj([
        ("file", Json::str(&s.file)),
        ("tokens", Json::UInt(s.tokens)),
        ("fnv1a64", hex(s.fnv1a64)),
    ])
}

fn split_json(s: &SplitRecord) -> Json {
    Json::obj([
        ("documents", Json::UInt(s.documents)),
        ("tokens", Json::UInt(s.tokens)),
        (
            "shards",
            Json::Arr(s.shards.iter().map(shard_json).collect()),
        ),
    ])
}

impl Manifest {
    /// The manifest as JSON, members in the documented order.
    pub fn to_json(&self) -> Json {
        let inputs = self.inputs.iter().map(|i| {
            Json::obj([
                ("path", Json::str(&i.path)),
                ("bytes", Json::UInt(i.bytes)),
                ("fnv1a64", hex(i.fnv1a64)),
                ("split", Json::str(&i.split)),
            ])
        });
        Json::obj([
            ("format", Json::str(FORMAT)),
            ("version", Json::UInt(VERSION)),
            ("tokenizer", Json::str(self.tokenizer.name())),
            ("vocab", Json::UInt(u64::from(self.vocab))),
            ("eot", Json::UInt(u64::from(self.eot))),
            ("dtype", Json::str(self.dtype.name())),
            ("validation_fraction", Json::Num(self.validation_fraction)),
            ("shard_tokens", Json::UInt(self.shard_tokens)),
            (
                "splits",
                Json::obj([
                    ("train", split_json(&self.train)),
                    ("validation", split_json(&self.validation)),
                ]),
            ),
            ("inputs", Json::Arr(inputs.collect())),
        ])
    }

    /// Reads and validates a manifest's text (`path` only names it in errors).
    ///
    /// # Errors
    /// [`DataError::Json`] if it is not JSON; [`DataError::Manifest`] naming the key for an
    /// unknown format or version, a missing or unknown key, a wrong type, an unknown tokenizer
    /// or dtype, a vocabulary or end-of-text id other than the tokenizer's, a dtype too narrow,
    /// counts that do not add up, or a shard file name with a path in it.
    pub fn parse(text: &str, path: &Path) -> Result<Manifest> {
        let json = Json::parse(text).map_err(|source| DataError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let r = Reader { path };
        let top = r.object(&json, "the manifest")?;
        // Format and version first, so a file of another kind gets that error, not a key's.
        let format = r.string(top, "format")?;
        if format != FORMAT {
            return Err(r.err(format!("format {format:?} is not {FORMAT:?}")));
        }
        let version = r.uint(top, "version")?;
        if version != VERSION {
            return Err(r.err(format!(
                "version {version} is not supported (this reader reads version {VERSION})"
            )));
        }
        r.keys(
            top,
            "the manifest",
            &[
                "format",
                "version",
                "tokenizer",
                "vocab",
                "eot",
                "dtype",
                "validation_fraction",
                "shard_tokens",
                "splits",
                "inputs",
            ],
        )?;
        let tokenizer = Tokenizer::from_name(r.string(top, "tokenizer")?)
            .map_err(|e| r.err(format!("tokenizer: {e}")))?;
        let vocab = r.uint(top, "vocab")?;
        if vocab != u64::from(tokenizer.vocab()) {
            return Err(r.err(format!(
                "vocab {vocab} is not the {tokenizer} tokenizer's {}",
                tokenizer.vocab()
            )));
        }
        let eot = r.uint(top, "eot")?;
        if eot != u64::from(tokenizer.eot()) {
            return Err(r.err(format!(
                "eot {eot} is not the {tokenizer} tokenizer's {}",
                tokenizer.eot()
            )));
        }
        let dtype = match r.string(top, "dtype")? {
            "u16" => Dtype::U16,
            "u32" => Dtype::U32,
            other => return Err(r.err(format!("dtype {other:?} is not u16 or u32"))),
        };
        if dtype == Dtype::U16 && vocab > 1 << 16 {
            return Err(r.err(format!(
                "dtype u16 cannot hold the ids of vocabulary {vocab}"
            )));
        }
        let fraction = top
            .get("validation_fraction")
            .and_then(Json::as_f64)
            .filter(|f| (0.0..1.0).contains(f))
            .ok_or_else(|| r.err("validation_fraction must be a number in [0, 1)".into()))?;
        let shard_tokens = r.uint(top, "shard_tokens")?;
        if shard_tokens == 0 {
            return Err(r.err("shard_tokens must be positive".into()));
        }
        let splits = r.object(r.member(top, "splits")?, "splits")?;
        r.keys(splits, "splits", &["train", "validation"])?;
        let train = r.split(r.member(splits, "train")?, "splits.train")?;
        let validation = r.split(r.member(splits, "validation")?, "splits.validation")?;
        let inputs = match r.member(top, "inputs")? {
            Json::Arr(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| r.input(item, &format!("inputs[{i}]")))
                .collect::<Result<Vec<_>>>()?,
            _ => return Err(r.err("inputs must be an array".into())),
        };
        Ok(Manifest {
            tokenizer,
            vocab: tokenizer.vocab(),
            eot: tokenizer.eot(),
            dtype,
            validation_fraction: fraction,
            shard_tokens,
            train,
            validation,
            inputs,
        })
    }
}

/// Typed lookups that name the manifest and the key in every error.
struct Reader<'a> {
    path: &'a Path,
}

type Obj = lowbit_io::json::Object;

impl Reader<'_> {
    fn err(&self, what: String) -> DataError {
        DataError::Manifest {
            path: self.path.to_path_buf(),
            what,
        }
    }

    fn object<'j>(&self, v: &'j Json, what: &str) -> Result<&'j Obj> {
        match v {
            Json::Obj(o) => Ok(o),
            _ => Err(self.err(format!("{what} must be an object"))),
        }
    }

    fn keys(&self, o: &Obj, what: &str, allowed: &[&str]) -> Result<()> {
        if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(self.err(format!("unknown key {k:?} in {what}")));
        }
        if let Some(k) = allowed.iter().find(|k| o.get(**k).is_none()) {
            return Err(self.err(format!("missing key {k:?} in {what}")));
        }
        Ok(())
    }

    fn member<'j>(&self, o: &'j Obj, key: &str) -> Result<&'j Json> {
        o.get(key)
            .ok_or_else(|| self.err(format!("missing key {key:?}")))
    }

    fn string<'j>(&self, o: &'j Obj, key: &str) -> Result<&'j str> {
        self.member(o, key)?
            .as_str()
            .ok_or_else(|| self.err(format!("{key} must be a string")))
    }

    fn uint(&self, o: &Obj, key: &str) -> Result<u64> {
        match self.member(o, key)? {
            Json::UInt(n) => Ok(*n),
            _ => Err(self.err(format!("{key} must be a non-negative integer"))),
        }
    }

    fn hash(&self, o: &Obj, key: &str, what: &str) -> Result<u64> {
        let s = self.string(o, key)?;
        if s.len() != 16
            || !s
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(self.err(format!("{what}.{key} must be 16 lowercase hex digits")));
        }
        u64::from_str_radix(s, 16).map_err(|_| self.err(format!("{what}.{key} is not hex")))
    }

    fn split(&self, v: &Json, what: &str) -> Result<SplitRecord> {
        let o = self.object(v, what)?;
        self.keys(o, what, &["documents", "tokens", "shards"])?;
        let documents = self.uint(o, "documents")?;
        let tokens = self.uint(o, "tokens")?;
        let Json::Arr(items) = self.member(o, "shards")? else {
            return Err(self.err(format!("{what}.shards must be an array")));
        };
        let mut shards = Vec::with_capacity(items.len());
        let mut sum = 0u64;
        for (i, item) in items.iter().enumerate() {
            let at = format!("{what}.shards[{i}]");
            let s = self.object(item, &at)?;
            self.keys(s, &at, &["file", "tokens", "fnv1a64"])?;
            let file = self.string(s, "file")?;
            let plain = !file.is_empty()
                && file != "."
                && file != ".."
                && file != super::MANIFEST_FILE
                && !file.contains(['/', '\\', '\0']);
            if !plain {
                return Err(self.err(format!("{at}.file {file:?} is not a plain file name")));
            }
            let n = self.uint(s, "tokens")?;
            sum = sum
                .checked_add(n)
                .ok_or_else(|| self.err(format!("{what}: token counts overflow")))?;
            shards.push(ShardRecord {
                file: file.to_owned(),
                tokens: n,
                fnv1a64: self.hash(s, "fnv1a64", &at)?,
            });
        }
        if sum != tokens {
            return Err(self.err(format!(
                "{what}.tokens is {tokens} but its shards hold {sum}"
            )));
        }
        if documents > tokens {
            return Err(self.err(format!(
                "{what}.documents ({documents}) exceeds its tokens ({tokens}): each document \
                 has at least its end-of-text"
            )));
        }
        Ok(SplitRecord {
            documents,
            tokens,
            shards,
        })
    }

    fn input(&self, v: &Json, what: &str) -> Result<InputRecord> {
        let o = self.object(v, what)?;
        self.keys(o, what, &["path", "bytes", "fnv1a64", "split"])?;
        let split = self.string(o, "split")?;
        if !["train", "validation", "both"].contains(&split) {
            return Err(self.err(format!(
                "{what}.split {split:?} is not train, validation or both"
            )));
        }
        Ok(InputRecord {
            path: self.string(o, "path")?.to_owned(),
            bytes: self.uint(o, "bytes")?,
            fnv1a64: self.hash(o, "fnv1a64", what)?,
            split: split.to_owned(),
        })
    }
}
