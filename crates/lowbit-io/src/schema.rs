//! The on-disk schema of a quantized file: the component tensors a quantized tensor becomes
//! (names, dtypes, shapes in either scale layout) and the `lowbit.*` keys of `__metadata__`.
//!
//! `quantize` and `dequantize` both take their shapes from here, so the writer and the reader
//! cannot drift apart.
//!
//! # Metadata keys (format version 1)
//! | key                     | value                                        |
//! |-------------------------|----------------------------------------------|
//! | `lowbit.format_version` | `1`                                          |
//! | `lowbit.writer`         | `lowbit <crate version>`                     |
//! | `lowbit.recipe`         | `mxfp8`, `mxfp8-e5m2` or `nvfp4`             |
//! | `lowbit.copies`         | `rowwise`, `columnwise` or `both`            |
//! | `lowbit.2d`             | `true` or `false`                            |
//! | `lowbit.scale_layout`   | `compact` or `swizzled`                      |
//! | `lowbit.nan_policy`     | `te` or `error`                              |
//! | `lowbit.tensor.<NAME>`  | `{"dtype":"BF16","shape":[3,37,45]}`         |
//!
//! One `lowbit.tensor.<NAME>` entry exists per quantized tensor; its value is JSON so that other
//! tools (Python's `json.loads`) read it directly.

use std::collections::HashMap;

use lowbit_formats::{Copies, Fp8Kind, NanPolicy, ScaleLayout, layout};
use safetensors::Dtype;

/// Prefix of every metadata key this tool writes; input keys with it are dropped on quantize.
pub const KEY_PREFIX: &str = "lowbit.";
/// Metadata key whose presence marks a file written by `lowbit quantize`.
pub const KEY_VERSION: &str = "lowbit.format_version";
/// The format version written and the only one read.
pub const FORMAT_VERSION: &str = "1";
const KEY_WRITER: &str = "lowbit.writer";
const KEY_RECIPE: &str = "lowbit.recipe";
const KEY_COPIES: &str = "lowbit.copies";
const KEY_2D: &str = "lowbit.2d";
const KEY_SCALE_LAYOUT: &str = "lowbit.scale_layout";
const KEY_NAN_POLICY: &str = "lowbit.nan_policy";
/// Prefix of the per-tensor keys (`lowbit.tensor.<NAME>`).
pub const TENSOR_KEY_PREFIX: &str = "lowbit.tensor.";

/// Suffix of the rowwise element tensor.
pub const ROWWISE_DATA: &str = "rowwise_data";
/// Suffix of the rowwise scale tensor.
pub const ROWWISE_SCALE_INV: &str = "rowwise_scale_inv";
/// Suffix of the columnwise element tensor.
pub const COLUMNWISE_DATA: &str = "columnwise_data";
/// Suffix of the columnwise scale tensor.
pub const COLUMNWISE_SCALE_INV: &str = "columnwise_scale_inv";
/// Suffix of the NVFP4 global amax tensor.
pub const AMAX: &str = "amax";
/// Every suffix a quantized tensor may produce.
pub const ALL_SUFFIXES: [&str; 5] = [
    ROWWISE_DATA,
    ROWWISE_SCALE_INV,
    COLUMNWISE_DATA,
    COLUMNWISE_SCALE_INV,
    AMAX,
];

/// The quantization recipe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Recipe {
    /// MXFP8 with E4M3 elements and one E8M0 scale per 32 elements (TE's default).
    #[cfg_attr(feature = "clap", value(name = "mxfp8"))]
    Mxfp8,
    /// MXFP8 with E5M2 elements (wider range, less precision).
    #[cfg_attr(feature = "clap", value(name = "mxfp8-e5m2"))]
    Mxfp8E5m2,
    /// NVFP4: E2M1 elements, an E4M3 scale per 16 elements and a global fp32 amax.
    #[cfg_attr(feature = "clap", value(name = "nvfp4"))]
    Nvfp4,
}

impl Recipe {
    /// The name used on the command line, in metadata and in demo file names.
    pub fn as_str(self) -> &'static str {
        match self {
            Recipe::Mxfp8 => "mxfp8",
            Recipe::Mxfp8E5m2 => "mxfp8-e5m2",
            Recipe::Nvfp4 => "nvfp4",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Recipe::Mxfp8, Recipe::Mxfp8E5m2, Recipe::Nvfp4]
            .into_iter()
            .find(|r| r.as_str() == s)
    }

    /// The fp8 element type of an MXFP8 recipe; `None` for NVFP4.
    pub fn fp8_kind(self) -> Option<Fp8Kind> {
        match self {
            Recipe::Mxfp8 => Some(Fp8Kind::E4M3),
            Recipe::Mxfp8E5m2 => Some(Fp8Kind::E5M2),
            Recipe::Nvfp4 => None,
        }
    }
}

/// How a quantized tensor's components are named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Naming {
    /// `W.rowwise_data`, `W.rowwise_scale_inv`, … with `lowbit.tensor.*` keys (what `lowbit
    /// dequantize` reads).
    #[default]
    Lowbit,
    /// compressed-tensors' `nvfp4-pack-quantized` (vLLM): for `X.weight`, `X.weight_packed`
    /// (the rowwise data), `X.weight_scale` (compact rowwise scales) and
    /// `X.weight_global_scale` (NVFP4's `S_enc = 448 · 6 / amax`, a divisor). NVFP4 rowwise
    /// compact only.
    CompressedTensors,
}

/// Metadata key naming a file's [`Naming`] when it is not lowbit's own.
pub const KEY_NAMING: &str = "lowbit.naming";

/// `rowwise`, `columnwise` or `both`.
pub fn copies_str(c: Copies) -> &'static str {
    match c {
        Copies::Rowwise => "rowwise",
        Copies::Columnwise => "columnwise",
        Copies::Both => "both",
    }
}

/// `compact` or `swizzled`.
pub fn layout_str(l: ScaleLayout) -> &'static str {
    match l {
        ScaleLayout::Compact => "compact",
        ScaleLayout::Swizzled => "swizzled",
    }
}

/// `te` or `error`.
pub fn nan_policy_str(p: NanPolicy) -> &'static str {
    match p {
        NanPolicy::Te => "te",
        NanPolicy::Error => "error",
    }
}

/// The file-wide settings a quantized file was written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Recipe.
    pub recipe: Recipe,
    /// Which copies exist.
    pub copies: Copies,
    /// 2D (tile) scaling.
    pub two_d: bool,
    /// Layout of every scale tensor.
    pub layout: ScaleLayout,
    /// NaN/Inf policy used at quantization time (informational for the reader).
    pub nan_policy: NanPolicy,
}

impl Settings {
    /// Adds the file-wide `lowbit.*` keys.
    pub fn write_metadata(&self, map: &mut HashMap<String, String>) {
        let entries = [
            (KEY_VERSION, FORMAT_VERSION.to_owned()),
            (KEY_WRITER, format!("lowbit {}", env!("CARGO_PKG_VERSION"))),
            (KEY_RECIPE, self.recipe.as_str().to_owned()),
            (KEY_COPIES, copies_str(self.copies).to_owned()),
            (KEY_2D, self.two_d.to_string()),
            (KEY_SCALE_LAYOUT, layout_str(self.layout).to_owned()),
            (KEY_NAN_POLICY, nan_policy_str(self.nan_policy).to_owned()),
        ];
        for (k, v) in entries {
            map.insert(k.to_owned(), v);
        }
    }

    /// Reads the file-wide keys; the error says which key is missing or malformed.
    pub fn read_metadata(map: &HashMap<String, String>) -> Result<Self, String> {
        fn get<'m, T>(
            map: &'m HashMap<String, String>,
            key: &str,
            parse: impl Fn(&'m str) -> Option<T>,
        ) -> Result<T, String> {
            let v = map
                .get(key)
                .ok_or_else(|| format!("metadata key {key} is missing"))?;
            parse(v).ok_or_else(|| format!("metadata key {key} has unknown value {v:?}"))
        }
        match map.get(KEY_VERSION).map(String::as_str) {
            Some(FORMAT_VERSION) => {}
            Some(v) => {
                return Err(format!(
                    "unsupported lowbit format version {v:?} (this build reads version \
                     {FORMAT_VERSION})"
                ));
            }
            None => return Err(format!("metadata key {KEY_VERSION} is missing")),
        }
        Ok(Settings {
            recipe: get(map, KEY_RECIPE, Recipe::parse)?,
            copies: get(map, KEY_COPIES, |s| {
                [Copies::Rowwise, Copies::Columnwise, Copies::Both]
                    .into_iter()
                    .find(|c| copies_str(*c) == s)
            })?,
            two_d: get(map, KEY_2D, |s| s.parse().ok())?,
            layout: get(map, KEY_SCALE_LAYOUT, |s| {
                [ScaleLayout::Compact, ScaleLayout::Swizzled]
                    .into_iter()
                    .find(|l| layout_str(*l) == s)
            })?,
            nan_policy: get(map, KEY_NAN_POLICY, |s| {
                [NanPolicy::Te, NanPolicy::Error]
                    .into_iter()
                    .find(|p| nan_policy_str(*p) == s)
            })?,
        })
    }
}

/// The metadata key recording a quantized tensor's original dtype and shape.
pub fn tensor_key(name: &str) -> String {
    format!("{TENSOR_KEY_PREFIX}{name}")
}

/// `{"dtype":"BF16","shape":[3,37,45]}`.
pub fn encode_original(dtype: Dtype, shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!(r#"{{"dtype":"{dtype}","shape":[{}]}}"#, dims.join(","))
}

/// Inverse of [`encode_original`] (whitespace-tolerant); `None` if malformed or if the dtype is
/// not one `quantize` accepts.
pub fn decode_original(s: &str) -> Option<(Dtype, Vec<usize>)> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    let rest = s.strip_prefix(r#"{"dtype":""#)?;
    let (dtype, rest) = rest.split_once('"')?;
    let dims = rest.strip_prefix(r#","shape":["#)?.strip_suffix("]}")?;
    let dtype = match dtype {
        "BF16" => Dtype::BF16,
        "F16" => Dtype::F16,
        "F32" => Dtype::F32,
        _ => return None,
    };
    let shape = if dims.is_empty() {
        Vec::new()
    } else {
        dims.split(',')
            .map(|d| d.parse().ok())
            .collect::<Option<_>>()?
    };
    Some((dtype, shape))
}

/// The `(rows, cols)` matrix view of a tensor shape: `[d0, …, N]` → `(d0·…, N)`; a 1D tensor is
/// one row, a 0-D scalar is `1 × 1`. `None` if the product overflows.
pub fn matrix_dims(shape: &[usize]) -> Option<(usize, usize)> {
    match shape.split_last() {
        None => Some((1, 1)),
        Some((&cols, lead)) => lead
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .map(|rows| (rows, cols)),
    }
}

/// `NAME.SUFFIX`.
pub fn component(name: &str, suffix: &str) -> String {
    format!("{name}.{suffix}")
}

/// Which quantized copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    /// Blocks along rows.
    Rowwise,
    /// Blocks down columns.
    Columnwise,
}

impl Which {
    /// `rowwise` or `columnwise`.
    pub fn as_str(self) -> &'static str {
        match self {
            Which::Rowwise => "rowwise",
            Which::Columnwise => "columnwise",
        }
    }

    fn suffixes(self) -> (&'static str, &'static str) {
        match self {
            Which::Rowwise => (ROWWISE_DATA, ROWWISE_SCALE_INV),
            Which::Columnwise => (COLUMNWISE_DATA, COLUMNWISE_SCALE_INV),
        }
    }
}

/// Name, dtype and shape of one stored component tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Tensor name in the file.
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl Part {
    /// Its entry in an output file's layout (the byte count saturates: shapes recorded in a
    /// corrupt file may be absurd, and are compared with the stored ones before use).
    pub fn spec(&self) -> crate::files::Spec {
        let elems = self.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d));
        crate::files::Spec {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            len: elems.saturating_mul(self.dtype.bitsize()) / 8,
        }
    }
}

/// The data and scale components of one copy, plus the compact scale dims the library uses.
#[derive(Clone, Debug)]
pub struct CopyParts {
    /// Element tensor.
    pub data: Part,
    /// Scale tensor (in the file's layout).
    pub scales: Part,
    /// `(rows, cols)` of the compact scale matrix.
    pub compact_scales: (usize, usize),
}

/// The components of copy `which` of a `rows × cols` matrix quantized with `s`.
pub fn copy_parts(name: &str, s: &Settings, which: Which, rows: usize, cols: usize) -> CopyParts {
    let (data_suffix, scale_suffix) = which.suffixes();
    let (data_dtype, data_shape, scale_dtype, compact) = match (s.recipe.fp8_kind(), which) {
        (Some(kind), Which::Rowwise) => (
            fp8_dtype(kind),
            [rows, cols],
            Dtype::F8_E8M0,
            (rows, cols.div_ceil(lowbit_formats::mxfp8::BLOCK)),
        ),
        (Some(kind), Which::Columnwise) => (
            fp8_dtype(kind),
            [rows, cols],
            Dtype::F8_E8M0,
            (rows.div_ceil(lowbit_formats::mxfp8::BLOCK), cols),
        ),
        (None, Which::Rowwise) => (
            Dtype::U8,
            [rows, cols.div_ceil(2)],
            Dtype::F8_E4M3,
            (rows, cols.div_ceil(lowbit_formats::nvfp4::BLOCK)),
        ),
        (None, Which::Columnwise) => (
            Dtype::U8,
            [cols, rows.div_ceil(2)],
            Dtype::F8_E4M3,
            (cols, rows.div_ceil(lowbit_formats::nvfp4::BLOCK)),
        ),
    };
    let scale_shape = match s.layout {
        ScaleLayout::Compact => [compact.0, compact.1],
        ScaleLayout::Swizzled if is_mxfp8_columnwise(s.recipe, which) => {
            // TE stores these as the swizzle of the transpose, shaped [row blocks, cols] padded.
            let (pc, pr) = layout::swizzled_dims(compact.1, compact.0);
            [pr, pc]
        }
        ScaleLayout::Swizzled => {
            let (pr, pc) = layout::swizzled_dims(compact.0, compact.1);
            [pr, pc]
        }
    };
    CopyParts {
        data: Part {
            name: component(name, data_suffix),
            dtype: data_dtype,
            shape: data_shape.to_vec(),
        },
        scales: Part {
            name: component(name, scale_suffix),
            dtype: scale_dtype,
            shape: scale_shape.to_vec(),
        },
        compact_scales: compact,
    }
}

/// The NVFP4 global amax component.
pub fn amax_part(name: &str) -> Part {
    Part {
        name: component(name, AMAX),
        dtype: Dtype::F32,
        shape: vec![1],
    }
}

fn is_mxfp8_columnwise(recipe: Recipe, which: Which) -> bool {
    recipe.fp8_kind().is_some() && which == Which::Columnwise
}

/// The safetensors dtype of an fp8 element type.
pub fn fp8_dtype(kind: Fp8Kind) -> Dtype {
    match kind {
        Fp8Kind::E4M3 => Dtype::F8_E4M3,
        Fp8Kind::E5M2 => Dtype::F8_E5M2,
    }
}

/// Compact scales → the bytes stored under `s.layout`.
pub fn store_scales(
    s: &Settings,
    which: Which,
    compact: Vec<u8>,
    (rows, cols): (usize, usize),
) -> Vec<u8> {
    match s.layout {
        ScaleLayout::Compact => compact,
        ScaleLayout::Swizzled if is_mxfp8_columnwise(s.recipe, which) => {
            layout::swizzle_mxfp8_columnwise(&compact, rows, cols)
        }
        ScaleLayout::Swizzled => layout::swizzle(&compact, rows, cols),
    }
}

/// Stored scale bytes → compact scales. The caller has checked the stored shape against
/// [`copy_parts`], so the length matches what the unswizzle expects.
pub fn load_scales(
    s: &Settings,
    which: Which,
    stored: &[u8],
    (rows, cols): (usize, usize),
) -> Vec<u8> {
    match s.layout {
        ScaleLayout::Compact => stored.to_vec(),
        ScaleLayout::Swizzled if is_mxfp8_columnwise(s.recipe, which) => {
            layout::unswizzle_mxfp8_columnwise(stored, rows, cols)
        }
        ScaleLayout::Swizzled => layout::unswizzle(stored, rows, cols),
    }
}

/// `[3, 37, 45]`.
pub fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn original_round_trips() {
        for shape in [vec![], vec![7], vec![3, 37, 45], vec![0, 4]] {
            let s = encode_original(Dtype::BF16, &shape);
            assert_eq!(decode_original(&s), Some((Dtype::BF16, shape)));
        }
        assert_eq!(
            decode_original(r#"{ "dtype": "F32", "shape": [2, 3] }"#),
            Some((Dtype::F32, vec![2, 3]))
        );
        assert_eq!(decode_original(r#"{"dtype":"F64","shape":[2]}"#), None);
        assert_eq!(decode_original(r#"{"dtype":"F32","shape":[x]}"#), None);
    }

    #[test]
    fn matrix_dims_of_shapes() {
        assert_eq!(matrix_dims(&[]), Some((1, 1)));
        assert_eq!(matrix_dims(&[5]), Some((1, 5)));
        assert_eq!(matrix_dims(&[3, 37, 45]), Some((111, 45)));
        assert_eq!(matrix_dims(&[usize::MAX, 2, 1]), None);
    }

    #[test]
    fn settings_round_trip() {
        let s = Settings {
            recipe: Recipe::Mxfp8E5m2,
            copies: Copies::Columnwise,
            two_d: true,
            layout: ScaleLayout::Swizzled,
            nan_policy: NanPolicy::Error,
        };
        let mut m = HashMap::new();
        s.write_metadata(&mut m);
        assert_eq!(Settings::read_metadata(&m), Ok(s));
    }
}
