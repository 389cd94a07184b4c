//! The manifest: what a checkpoint holds and where every piece lives. See the crate docs for
//! the format.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use lowbit_io::json::{Json, Limits, Object, ParseError, Reader};

use crate::error::CkptError;

/// The format version this build writes and reads.
pub const FORMAT_VERSION: u64 = 1;
/// The `format` field of every manifest.
pub const FORMAT_NAME: &str = "lowbit-ckpt";
/// The only element type stored so far.
pub const DTYPE_F32: &str = "F32";
/// Elements of one logical tensor at most (2^40): larger claims are hostile, not models.
pub const MAX_NUMEL: u64 = 1 << 40;
/// Dimensions of a shape at most.
pub const MAX_RANK: usize = 8;

/// The manifest member holding [`fnv1a64`] of the manifest's scalars: the canonical text
/// ([`Json::to_text`]) of the manifest object without `tensors` and without this member.
pub const SCALARS_HASH: &str = "scalars_fnv1a64";

/// FNV-1a, 64 bits (offset basis 0xcbf29ce484222325, prime 0x100000001b3), over the piece's
/// bytes as stored (little-endian f32). Detects torn writes and bit rot, not tampering.
pub use lowbit_io::hash::fnv1a64;

/// Free-form run metadata carried by a checkpoint and given back on load.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// The training step the checkpoint was taken after (also the directory's `step-N`).
    pub step: u64,
    /// The training configuration (flags that define the model and the plan, …).
    pub config: BTreeMap<String, String>,
    /// The data position (epoch, sample offset, …).
    pub data: BTreeMap<String, String>,
    /// RNG states.
    pub rng: BTreeMap<String, String>,
}

/// One leaf optimizer's scalars.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptimizerEntry {
    /// The owner id (`OptimizerId.0`).
    pub owner: u32,
    /// The update rule's name.
    pub rule: String,
    /// Steps taken.
    pub steps: u64,
}

/// One stored piece: elements `[start, end)` of the flattened logical tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The data file (a plain file name in the checkpoint directory).
    pub file: String,
    /// The safetensors key of the piece in that file.
    pub key: String,
    /// First element in the flattened global tensor.
    pub start: u64,
    /// One past the last element.
    pub end: u64,
    /// Byte offset of the piece's data in the file.
    pub offset: u64,
    /// [`fnv1a64`] of the piece's bytes.
    pub hash: u64,
}

/// One logical tensor: a parameter's master or one of its optimizer state tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// `"{parameter}/{state}"`, e.g. `l0.weight/master`, `l0.weight/exp_avg`.
    pub name: String,
    /// The parameter's name.
    pub param: String,
    /// `master` or the rule's state name.
    pub state: String,
    /// The owner of the parameter.
    pub owner: u32,
    /// The global shape.
    pub shape: Vec<u64>,
    /// Element type (`F32`).
    pub dtype: String,
    /// The pieces, sorted by `start`, tiling `[0, numel)` exactly once.
    pub pieces: Vec<Piece>,
}

impl TensorEntry {
    /// Elements of the global tensor (its shape is checked when the manifest is read).
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A data file and its size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    /// A plain file name in the checkpoint directory.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
}

/// The parsed, validated manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// Run metadata.
    pub meta: Meta,
    /// Leaf optimizers, by owner.
    pub optimizers: Vec<OptimizerEntry>,
    /// Data files.
    pub files: Vec<FileEntry>,
    /// Logical tensors.
    pub tensors: Vec<TensorEntry>,
}

fn str_map(m: &BTreeMap<String, String>) -> Json {
    Json::Obj(
        m.iter()
            .map(|(k, v)| (k.clone(), Json::Str(v.clone())))
            .collect(),
    )
}

/// An object with its members in key order (the canonical order of manifests and rank
/// indexes).
pub(crate) fn obj(pairs: Vec<(&str, Json)>) -> Json {
    let sorted: BTreeMap<String, Json> =
        pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    Json::Obj(sorted.into())
}

fn hex(h: u64) -> Json {
    Json::Str(format!("{h:016x}"))
}

/// A hash as the manifest writes it: exactly 16 hex digits.
fn parse_hex(h: &str) -> Option<u64> {
    (h.len() == 16)
        .then(|| u64::from_str_radix(h, 16).ok())
        .flatten()
}

/// [`SCALARS_HASH`] of the manifest object `v`. Everything it leaves out is checked otherwise:
/// a piece's bytes by its hash when read, its place by the validation (ranges, offsets within
/// the listed file sizes, exact tiling), names and shapes against the loading model.
fn scalars_hash(v: &Json) -> u64 {
    let head = match v {
        Json::Obj(m) => m
            .iter()
            .filter(|(k, _)| *k != "tensors" && *k != SCALARS_HASH)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        _ => Object::new(),
    };
    // Keys in order at every depth, whatever order the file listed them in: the hash is of the
    // canonical text.
    let mut head = Json::Obj(head);
    head.sort_keys();
    fnv1a64(head.to_text().as_bytes())
}

/// A plain file name: no separators, not `.`/`..`, not empty, printable ASCII.
pub(crate) fn plain_name(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.len() <= 255
        && s.bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'\\')
}

impl Manifest {
    /// The manifest as JSON.
    pub fn to_json(&self) -> Json {
        let optimizers = self
            .optimizers
            .iter()
            .map(|o| {
                obj(vec![
                    ("owner", Json::UInt(u64::from(o.owner))),
                    ("rule", Json::Str(o.rule.clone())),
                    ("steps", Json::UInt(o.steps)),
                ])
            })
            .collect();
        let files = self
            .files
            .iter()
            .map(|f| {
                obj(vec![
                    ("name", Json::Str(f.name.clone())),
                    ("bytes", Json::UInt(f.bytes)),
                ])
            })
            .collect();
        let tensors = self
            .tensors
            .iter()
            .map(|t| {
                let pieces = t
                    .pieces
                    .iter()
                    .map(|p| {
                        obj(vec![
                            ("file", Json::Str(p.file.clone())),
                            ("key", Json::Str(p.key.clone())),
                            ("start", Json::UInt(p.start)),
                            ("end", Json::UInt(p.end)),
                            ("offset", Json::UInt(p.offset)),
                            ("fnv1a64", hex(p.hash)),
                        ])
                    })
                    .collect();
                obj(vec![
                    ("name", Json::Str(t.name.clone())),
                    ("param", Json::Str(t.param.clone())),
                    ("state", Json::Str(t.state.clone())),
                    ("owner", Json::UInt(u64::from(t.owner))),
                    (
                        "shape",
                        Json::Arr(t.shape.iter().map(|&d| Json::UInt(d)).collect()),
                    ),
                    ("dtype", Json::Str(t.dtype.clone())),
                    ("pieces", Json::Arr(pieces)),
                ])
            })
            .collect();
        let mut v = obj(vec![
            ("format", Json::Str(FORMAT_NAME.into())),
            ("version", Json::UInt(FORMAT_VERSION)),
            ("step", Json::UInt(self.meta.step)),
            ("config", str_map(&self.meta.config)),
            ("data", str_map(&self.meta.data)),
            ("rng", str_map(&self.meta.rng)),
            ("hash", Json::Str("fnv1a64".into())),
            ("optimizers", Json::Arr(optimizers)),
            ("files", Json::Arr(files)),
            ("tensors", Json::Arr(tensors)),
        ]);
        let h = hex(scalars_hash(&v));
        if let Json::Obj(m) = &mut v {
            m.insert(SCALARS_HASH, h);
        }
        v.sort_keys();
        v
    }

    /// Parses and validates the manifest `text` read from `file` (streaming: the tensor list
    /// is read entry by entry, never held as one JSON tree, so the memory is the text and the
    /// manifest built from it, a small multiple of the text).
    ///
    /// # Errors
    /// [`CkptError::Manifest`] (JSON or a rule of the format, with the byte offset of a JSON
    /// error), [`CkptError::Version`] (a well-formed manifest of another format version).
    pub fn parse(file: &Path, text: &str) -> crate::Result<Manifest> {
        Self::from_text(text).map_err(|e| match e {
            Ok(found) => CkptError::Version {
                file: file.to_path_buf(),
                found,
                supported: FORMAT_VERSION,
            },
            Err(msg) => CkptError::Manifest {
                file: file.to_path_buf(),
                msg,
            },
        })
    }

    /// [`Manifest::parse`] without a file to name. `Err(Ok(version))` is a well-formed
    /// manifest of another format version; `Err(Err(msg))` anything else wrong.
    pub(crate) fn from_text(text: &str) -> Result<Manifest, Result<u64, String>> {
        let (head, tensors) = read_streaming(text).map_err(|e| Err(e.to_string()))?;
        Self::assemble(&head, tensors)
    }

    /// Validates a manifest already parsed as one JSON tree (the unit tests' way in). `Err(Ok(version))` is a
    /// well-formed manifest of another format version; `Err(Err(msg))` anything else wrong.
    #[cfg(test)]
    pub(crate) fn from_json(v: &Json) -> Result<Manifest, Result<u64, String>> {
        let tensors = match v.member("tensors") {
            Some(Json::Arr(list)) => {
                let mut names = BTreeSet::new();
                Some(list.iter().map(|t| tensor_entry(t, &mut names)).collect())
            }
            _ => None,
        };
        Self::assemble(v, tensors)
    }

    /// The manifest from its members other than `tensors` (`head`; a `tensors` member there is
    /// one that is not an array) and its tensor entries as read (`None`: missing or not an
    /// array; an error: the first entry that broke a rule of its own). The rules are checked in
    /// the order of the format: format and version, the scalars, every tensor, the hash last.
    fn assemble(
        head: &Json,
        tensors: Option<Result<Vec<TensorEntry>, String>>,
    ) -> Result<Manifest, Result<u64, String>> {
        if head.member("format") != Some(&Json::Str(FORMAT_NAME.into())) {
            return Err(Err(format!("`format` is not \"{FORMAT_NAME}\"")));
        }
        let version = uint(head, "version").map_err(Err)?;
        if version != FORMAT_VERSION {
            return Err(Ok(version));
        }
        Self::assemble_v1(head, tensors).map_err(Err)
    }

    fn assemble_v1(
        v: &Json,
        tensors: Option<Result<Vec<TensorEntry>, String>>,
    ) -> Result<Manifest, String> {
        if v.member("hash") != Some(&Json::Str("fnv1a64".into())) {
            return Err("`hash` is not \"fnv1a64\"".into());
        }
        let meta = Meta {
            step: uint(v, "step")?,
            config: strings(v, "config")?,
            data: strings(v, "data")?,
            rng: strings(v, "rng")?,
        };
        let mut optimizers = Vec::new();
        let mut owners = BTreeSet::new();
        for o in array(v, "optimizers")? {
            let owner = owner(o)?;
            if !owners.insert(owner) {
                return Err(format!("optimizer owner {owner} listed twice"));
            }
            optimizers.push(OptimizerEntry {
                owner,
                rule: string(o, "rule")?,
                steps: uint(o, "steps")?,
            });
        }
        let mut files = Vec::new();
        let mut sizes = BTreeMap::new();
        for f in array(v, "files")? {
            let name = string(f, "name")?;
            if !plain_name(&name) {
                return Err(format!("file name `{name}` is not a plain file name"));
            }
            let bytes = uint(f, "bytes")?;
            if sizes.insert(name.clone(), bytes).is_some() {
                return Err(format!("file `{name}` listed twice"));
            }
            files.push(FileEntry { name, bytes });
        }
        let tensors = tensors.ok_or_else(|| "`tensors` missing or not an array".to_string())??;
        for t in &tensors {
            check_refs(t, &owners, &sizes)?;
        }
        // Last, so that a manifest that breaks a rule is refused for that rule.
        let h = string(v, SCALARS_HASH)?;
        if parse_hex(&h) != Some(scalars_hash(v)) {
            return Err(format!(
                "`{SCALARS_HASH}` ({h:.20}) does not match the scalars (step, optimizer steps, \
                 configuration, data position, RNG state, files): corrupted"
            ));
        }
        Ok(Manifest {
            meta,
            optimizers,
            files,
            tensors,
        })
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Reads a manifest's text: its members other than `tensors` as one (small) JSON object, and
/// `tensors`, when it is an array, entry by entry into [`TensorEntry`]s (each entry's JSON
/// dropped once converted; after the first entry that breaks a rule the rest are only
/// parsed). A JSON error anywhere is the error, as for a whole-tree parse.
#[allow(clippy::type_complexity)]
fn read_streaming(
    text: &str,
) -> Result<(Json, Option<Result<Vec<TensorEntry>, String>>), ParseError> {
    let mut r = Reader::new(text, Limits::default())?;
    r.begin_object()?;
    let mut head = Object::new();
    let mut keys = BTreeSet::new();
    let mut tensors = None;
    while let Some((key, at)) = r.next_key()? {
        if !keys.insert(key.clone()) {
            return Err(ParseError {
                what: format!("duplicate key `{key}`"),
                at,
            });
        }
        if key == "tensors" && r.peek() == Some(b'[') {
            r.begin_array()?;
            let mut names = BTreeSet::new();
            let mut list: Result<Vec<TensorEntry>, String> = Ok(Vec::new());
            while r.next_element()? {
                let t = r.value()?;
                if let Ok(done) = &mut list {
                    match tensor_entry(&t, &mut names) {
                        Ok(e) => done.push(e),
                        Err(msg) => list = Err(msg),
                    }
                }
            }
            if let Ok(done) = &mut list {
                done.shrink_to_fit();
            }
            tensors = Some(list);
        } else {
            head.insert(key, r.value()?);
        }
    }
    r.finish()?;
    Ok((Json::Obj(head), tensors))
}

/// One tensor entry, checked by the rules that need nothing else of the manifest: its name is
/// `{param}/{state}` and not listed before (`names`), its shape and dtype, its pieces in
/// range of its elements and tiling them exactly once.
fn tensor_entry(t: &Json, names: &mut BTreeSet<String>) -> Result<TensorEntry, String> {
    let name = string(t, "name")?;
    let param = string(t, "param")?;
    let state = string(t, "state")?;
    if name != format!("{param}/{state}") {
        return Err(format!("tensor `{name}` is not named `{param}/{state}`"));
    }
    if !names.insert(name.clone()) {
        return Err(format!("tensor `{name}` listed twice"));
    }
    let owner = owner(t)?;
    let shape: Vec<u64> = array(t, "shape")?
        .iter()
        .map(|d| match d {
            Json::UInt(n) => Ok(*n),
            _ => Err(format!("tensor `{name}`: shape holds a non-integer")),
        })
        .collect::<Result<_, _>>()?;
    if shape.len() > MAX_RANK {
        return Err(format!("tensor `{name}`: {} dimensions", shape.len()));
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&n| n <= MAX_NUMEL)
        .ok_or_else(|| format!("tensor `{name}`: shape {shape:?} is absurdly large"))?;
    let dtype = string(t, "dtype")?;
    if dtype != DTYPE_F32 {
        return Err(format!(
            "tensor `{name}`: dtype `{dtype}` (only F32 is stored)"
        ));
    }
    let list = array(t, "pieces")?;
    let mut pieces = Vec::with_capacity(list.len());
    for p in list {
        let piece = Piece {
            file: string(p, "file")?,
            key: string(p, "key")?,
            start: uint(p, "start")?,
            end: uint(p, "end")?,
            offset: uint(p, "offset")?,
            hash: {
                let h = string(p, "fnv1a64")?;
                parse_hex(&h)
                    .ok_or_else(|| format!("tensor `{name}`: hash `{h}` is not 16 hex digits"))?
            },
        };
        if piece.start >= piece.end || piece.end > numel {
            return Err(format!(
                "tensor `{name}`: piece [{}, {}) out of range of {numel} elements",
                piece.start, piece.end
            ));
        }
        pieces.push(piece);
    }
    pieces.sort_by_key(|p| p.start);
    // Exactly once: sorted by start, each piece begins where the previous ended.
    let mut at = 0;
    for p in &pieces {
        if p.start < at {
            return Err(format!(
                "tensor `{name}`: pieces overlap at element {} (duplicate or overlapping \
                 piece)",
                p.start
            ));
        }
        if p.start > at {
            return Err(format!(
                "tensor `{name}`: elements [{at}, {}) are in no piece (missing piece)",
                p.start
            ));
        }
        at = p.end;
    }
    if at != numel {
        return Err(format!(
            "tensor `{name}`: elements [{at}, {numel}) are in no piece (missing piece)"
        ));
    }
    Ok(TensorEntry {
        name,
        param,
        state,
        owner,
        shape,
        dtype,
        pieces,
    })
}

/// The rules of a tensor entry that need the rest of the manifest: its owner has an optimizer
/// entry, every piece lies in a listed file and within its size.
fn check_refs(
    t: &TensorEntry,
    owners: &BTreeSet<u32>,
    sizes: &BTreeMap<String, u64>,
) -> Result<(), String> {
    let name = &t.name;
    if !owners.contains(&t.owner) {
        return Err(format!(
            "tensor `{name}`: owner {} has no optimizer entry",
            t.owner
        ));
    }
    for piece in &t.pieces {
        let Some(&fbytes) = sizes.get(&piece.file) else {
            return Err(format!(
                "tensor `{name}`: piece in `{}`, which is not a listed file",
                piece.file
            ));
        };
        let fits = (piece.end - piece.start)
            .checked_mul(4)
            .and_then(|b| b.checked_add(piece.offset))
            .is_some_and(|e| e <= fbytes);
        if !fits {
            return Err(format!(
                "tensor `{name}`: piece [{}, {}) at byte {} runs past the end of `{}` \
                 ({fbytes} bytes)",
                piece.start, piece.end, piece.offset, piece.file
            ));
        }
    }
    Ok(())
}

fn uint(v: &Json, key: &str) -> Result<u64, String> {
    match v.member(key) {
        Some(Json::UInt(n)) => Ok(*n),
        _ => Err(format!("`{key}` missing or not a non-negative integer")),
    }
}

fn owner(v: &Json) -> Result<u32, String> {
    u32::try_from(uint(v, "owner")?).map_err(|_| "`owner` out of range".to_string())
}

fn string(v: &Json, key: &str) -> Result<String, String> {
    match v.member(key) {
        Some(Json::Str(s)) => Ok(s.clone()),
        _ => Err(format!("`{key}` missing or not a string")),
    }
}

fn array<'a>(v: &'a Json, key: &str) -> Result<&'a [Json], String> {
    match v.member(key) {
        Some(Json::Arr(a)) => Ok(a),
        _ => Err(format!("`{key}` missing or not an array")),
    }
}

fn strings(v: &Json, key: &str) -> Result<BTreeMap<String, String>, String> {
    match v.member(key) {
        Some(Json::Obj(m)) => m
            .iter()
            .map(|(k, v)| match v {
                Json::Str(s) => Ok((k.clone(), s.clone())),
                _ => Err(format!("`{key}.{k}` is not a string")),
            })
            .collect(),
        _ => Err(format!("`{key}` missing or not an object")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest whose members are listed out of key order (hand-edited, or another writer).
    /// Its scalars hash was computed outside this crate, by the canonicalization manifests have
    /// always had (keys sorted at every depth, the diffable writer): older manifests verify.
    const UNSORTED: &str = r#"{"version":1,"format":"lowbit-ckpt","step":7,"hash":"fnv1a64",
"config":{"z":"1","a":"b"},"data":{},"rng":{"seed":"42"},
"optimizers":[{"steps":7,"rule":"adamw","owner":0}],
"files":[{"name":"rank-0.safetensors","bytes":64}],
"tensors":[{"name":"w/master","param":"w","state":"master","owner":0,"shape":[2],"dtype":"F32",
 "pieces":[{"file":"rank-0.safetensors","key":"k","start":0,"end":2,"offset":8,
 "fnv1a64":"0000000000000000"}]}],
"scalars_fnv1a64":"3e6d6ef685119d82"}"#;

    #[test]
    fn the_scalars_hash_is_of_the_canonical_text() {
        let m = Manifest::from_json(&Json::parse(UNSORTED).unwrap()).unwrap();
        assert_eq!(m.meta.step, 7);
        // Written back, the manifest is in key order and carries the same hash.
        let text = m.to_json().to_text();
        assert!(
            text.contains("\"scalars_fnv1a64\": \"3e6d6ef685119d82\""),
            "{text}"
        );
        assert!(text.find("\"config\"") < text.find("\"data\""), "{text}");
        let again = Manifest::from_json(&Json::parse(&text).unwrap()).unwrap();
        assert_eq!(again, m);
        let tampered = UNSORTED.replace("\"step\":7", "\"step\":8");
        let err = Manifest::from_json(&Json::parse(&tampered).unwrap()).unwrap_err();
        assert!(
            matches!(&err, Err(msg) if msg.contains("corrupted")),
            "{err:?}"
        );
        // Numbers the JSON reader accepts but a count is not are refused by the manifest.
        for bad in ["\"step\":7.5", "\"step\":-7", "\"step\":7e0"] {
            let text = UNSORTED.replace("\"step\":7", bad);
            assert!(
                Manifest::from_json(&Json::parse(&text).unwrap()).is_err(),
                "{bad}"
            );
        }
    }
}
