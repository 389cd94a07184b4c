//! The safetensors header on its own: the tensors of a header text that `safetensors` has
//! already accepted, and the header of a file whose tensor sizes are known before their bytes
//! (written byte for byte as `safetensors::serialize` plus our sorted `__metadata__` write it).
//!
//! `safetensors` validates a header only together with the whole file in memory (its last check
//! compares the offsets with the buffer's length) and keeps its JSON reader private, so reading
//! a header alone takes two steps: `SafeTensors::read_metadata` on the header bytes checks
//! everything but that length (refusing with `MetadataIncompleteBuffer` once the rest is
//! valid), then [`tensors`] extracts the entries from the now known-good text and
//! `Metadata::new` checks their offsets again. Writing needs no data either: offsets follow from
//! the sizes.

use std::collections::HashMap;

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;

use crate::json::{Json, Limits, push_string, push_string_serde};

/// safetensors' limit on the header length.
pub const MAX_HEADER: u64 = 100_000_000;

/// Every dtype this version of safetensors names, to map a header's text back to one.
const DTYPES: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

/// The tensors and `__metadata__` of a header text, in file order, read by [`crate::json`].
/// Callers run this only on text `safetensors` has accepted, so an error means the two readers
/// disagree (this one refuses a key twice in one object, where `serde_json` keeps the last).
#[allow(clippy::type_complexity)]
pub fn tensors(
    json: &str,
) -> Result<(Vec<(String, TensorInfo)>, Option<HashMap<String, String>>), String> {
    // serde_json's recursion limit and safetensors' length limit: what they accepted fits.
    let limits = Limits {
        max_depth: 128,
        max_len: MAX_HEADER as usize,
    };
    let Json::Obj(top) = Json::parse_with(json, limits).map_err(|e| e.to_string())? else {
        return Err("the header is not a JSON object".into());
    };
    let (mut tensors, mut metadata) = (Vec::new(), None);
    for (key, v) in top {
        if key == "__metadata__" {
            metadata = match v {
                Json::Null => None,
                Json::Obj(m) => Some(
                    m.into_iter()
                        .map(|(k, v)| match v {
                            Json::Str(s) => Ok((k, s)),
                            _ => Err(format!("metadata `{k}` is not a string")),
                        })
                        .collect::<Result<_, _>>()?,
                ),
                _ => return Err("`__metadata__` is not an object".into()),
            };
        } else {
            let info = tensor_info(&v).ok_or_else(|| format!("tensor `{key}`: bad entry"))?;
            tensors.push((key, info));
        }
    }
    Ok((tensors, metadata))
}

/// A tensor entry: `dtype`, `shape` and `data_offsets` (other members are ignored, as
/// `safetensors` ignores them).
fn tensor_info(v: &Json) -> Option<TensorInfo> {
    let name = v.member("dtype")?.as_str()?;
    let dtype = *DTYPES.iter().find(|d| d.to_string() == name)?;
    let uints = |key: &str| -> Option<Vec<usize>> {
        match v.member(key)? {
            Json::Arr(a) => a
                .iter()
                .map(|d| usize::try_from(d.as_u64()?).ok())
                .collect(),
            _ => None,
        }
    };
    let &[start, end] = uints("data_offsets")?.as_slice() else {
        return None;
    };
    Some(TensorInfo {
        dtype,
        shape: uints("shape")?,
        data_offsets: (start, end),
    })
}

/// A tensor of a file to be written: its size is known before its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes of data.
    pub len: usize,
}

/// The header of a file holding `specs` and `metadata` (length prefix, JSON, space padding to a
/// multiple of 8), and the absolute file offset of each spec's data, in the order of `specs`.
///
/// The data order is safetensors': dtype alignment descending, then name. Tensor entries are
/// written as `serde_json` writes them; the metadata object comes first with its keys sorted, so
/// identical inputs give identical files (`safetensors::serialize` would write it in hash-map
/// order).
pub fn layout(specs: &[Spec], metadata: &HashMap<String, String>) -> Option<(Vec<u8>, Vec<u64>)> {
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&specs[a], &specs[b]);
        b.dtype.cmp(&a.dtype).then(a.name.cmp(&b.name))
    });
    let mut json = String::from("{");
    if !metadata.is_empty() {
        let mut sorted: Vec<(&String, &String)> = metadata.iter().collect();
        sorted.sort();
        json.push_str("\"__metadata__\":{");
        for (i, (k, v)) in sorted.into_iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            push_string(&mut json, k);
            json.push(':');
            push_string(&mut json, v);
        }
        json.push('}');
    }
    let mut relative = vec![0usize; specs.len()];
    let mut offset = 0usize;
    for &i in &order {
        let s = &specs[i];
        let end = offset.checked_add(s.len)?;
        if json.len() > 1 {
            json.push(',');
        }
        push_string_serde(&mut json, &s.name);
        let dims: Vec<String> = s.shape.iter().map(usize::to_string).collect();
        json.push_str(&format!(
            r#":{{"dtype":"{}","shape":[{}],"data_offsets":[{offset},{end}]}}"#,
            s.dtype,
            dims.join(",")
        ));
        relative[i] = offset;
        offset = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    if json.len() as u64 > MAX_HEADER {
        return None;
    }
    let start = 8 + json.len() as u64;
    let mut out = Vec::with_capacity(start as usize);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    Some((
        out,
        relative.into_iter().map(|r| start + r as u64).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn specs() -> Vec<(Spec, Vec<u8>)> {
        let names = ["w", "a\"b\\c", "ctl\u{8}\u{c}\u{1}\n\té", "z"];
        let dtypes = [Dtype::F32, Dtype::U8, Dtype::BF16, Dtype::F8_E4M3];
        names
            .iter()
            .zip(dtypes)
            .enumerate()
            .map(|(i, (n, dtype))| {
                let shape = vec![2, i + 1];
                let len = 2 * (i + 1) * dtype.bitsize() / 8;
                let spec = Spec {
                    name: (*n).to_owned(),
                    dtype,
                    shape,
                    len,
                };
                (spec, (0..len).map(|b| b as u8).collect())
            })
            .collect()
    }

    #[test]
    fn layout_is_the_bytes_safetensors_writes_and_reads_back() {
        let s = specs();
        let views: Vec<(String, TensorView<'_>)> = s
            .iter()
            .map(|(sp, d)| {
                let v = TensorView::new(sp.dtype, sp.shape.clone(), d).unwrap();
                (sp.name.clone(), v)
            })
            .collect();
        let want = safetensors::serialize(views, None).unwrap();
        let only: Vec<Spec> = s.iter().map(|(sp, _)| sp.clone()).collect();
        let (header, offsets) = layout(&only, &HashMap::new()).unwrap();
        assert_eq!(want[..header.len()], header[..]);
        for ((_, data), off) in s.iter().zip(&offsets) {
            let off = *off as usize;
            assert_eq!(&want[off..off + data.len()], data.as_slice());
        }
        // And the reader finds the same entries.
        let text = std::str::from_utf8(&header[8..]).unwrap();
        let (got, metadata) = tensors(text).unwrap();
        assert_eq!(metadata, None);
        for (sp, off) in only.iter().zip(&offsets) {
            let (_, info) = got.iter().find(|(n, _)| *n == sp.name).unwrap();
            assert_eq!((info.dtype, &info.shape), (sp.dtype, &sp.shape));
            assert_eq!(info.data_offsets.0 as u64 + header.len() as u64, *off);
        }
    }

    #[test]
    fn reader_takes_what_safetensors_takes() {
        let text = r#" { "__metadata__" : { "k" : "v\u0041" } , "t" : { "extra" : [1, {"x": null}, -2.5e3, true],
            "data_offsets" : [ 0 , 8 ] , "shape" : [ 2 ] , "dtype" : "F32" } } "#;
        let (t, m) = tensors(text).unwrap();
        assert_eq!(m.unwrap()["k"], "vA");
        assert_eq!(t[0].0, "t");
        assert_eq!(
            (t[0].1.dtype, t[0].1.shape.clone(), t[0].1.data_offsets),
            (Dtype::F32, vec![2], (0, 8))
        );
        assert!(tensors(r#"{"t":{"dtype":"F32","shape":[2]}}"#).is_err());
        assert!(tensors(r#"{"__metadata__":null}"#).unwrap().1.is_none());
    }
}
