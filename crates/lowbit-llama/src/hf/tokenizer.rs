//! The tokenizer files of lowbit's tokenizers, as `AutoTokenizer.from_pretrained` loads them
//! offline (`GPT2TokenizerFast` from `tokenizer.json`, or `GPT2Tokenizer` from `vocab.json` +
//! `merges.txt`).
//!
//! - GPT-2 (tiktoken's `r50k_base`): a token's vocabulary string is its bytes under GPT-2's
//!   byte-to-unicode map ([`byte_to_unicode`], `bytes_to_unicode` of OpenAI's `encoder.py`);
//!   the merges are rebuilt from the ranks as `transformers`' tiktoken conversion does (the
//!   `bpe()` of `convert_slow_tokenizer.py`): for each token of two or more bytes, in rank order,
//!   byte-pair-merge its bytes using only ranks below its own until two parts remain; those two
//!   are its merge. `<|endoftext|>` (50256) is the BOS, EOS and unknown token.
//! - Bytes: id `b` is byte `b` (its vocabulary string `byte_to_unicode(b)`), no merges, so the
//!   byte-level BPE maps every byte to its id; `<|endoftext|>` is 256.

use std::collections::HashMap;
use std::path::Path;

use lowbit_io::Json;

use super::{HfError, Result};
use crate::data::Tokenizer;

/// The special token's text.
pub const EOT_TEXT: &str = "<|endoftext|>";

/// The files [`write`] writes, in order.
pub const FILES: [&str; 5] = [
    "vocab.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// GPT-2's byte-to-unicode map: printable Latin-1 bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) map
/// to themselves, the other 68 bytes in increasing order to U+0100, U+0101, …
pub fn byte_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut n = 0;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            n += 1;
            255 + n
        };
        map[b as usize] = char::from_u32(c).expect("below U+0200");
    }
    map
}

/// The vocabulary string of `bytes`.
fn unicode_of(map: &[char; 256], bytes: &[u8]) -> String {
    bytes.iter().map(|&b| map[b as usize]).collect()
}

/// The byte sequence of every id of `tok` below its end-of-text, by id.
pub fn token_bytes(tok: Tokenizer) -> Result<Vec<Vec<u8>>> {
    match tok {
        Tokenizer::Bytes => Ok((0..=255u8).map(|b| vec![b]).collect()),
        Tokenizer::Gpt2 => {
            let bpe = tiktoken_rs::r50k_base_singleton();
            (0..tok.eot())
                .map(|id| {
                    bpe.decode_bytes(&[id]).map_err(|e| {
                        HfError::Values(format!("gpt2: id {id} has no bytes in tiktoken: {e}"))
                    })
                })
                .collect()
        }
    }
}

/// The merges of the byte-level BPE whose ranks are `tokens` (id = rank), rebuilt as
/// `transformers`' tiktoken conversion does (module docs), in rank order.
///
/// # Errors
/// [`HfError::Values`] when a token's bytes do not end in exactly two parts (a vocabulary that
/// is not a BPE's; the embedded GPT-2 one always is).
pub fn merges(tokens: &[Vec<u8>]) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let ranks: HashMap<&[u8], usize> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let mut out = Vec::new();
    for (rank, token) in tokens.iter().enumerate() {
        if token.len() < 2 {
            continue;
        }
        // Parts as ranges of `token`; merge the adjacent pair of lowest rank below `rank`.
        let mut parts: Vec<(usize, usize)> = (0..token.len()).map(|i| (i, i + 1)).collect();
        loop {
            let best = parts
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| {
                    ranks
                        .get(&token[w[0].0..w[1].1])
                        .filter(|&&r| r < rank)
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            parts[i].1 = parts[i + 1].1;
            parts.remove(i + 1);
        }
        if parts.len() != 2 {
            return Err(HfError::Values(format!(
                "token {rank} ({:?}) merges into {} parts, not 2: not a BPE vocabulary",
                String::from_utf8_lossy(token),
                parts.len()
            )));
        }
        out.push((
            token[parts[0].0..parts[0].1].to_vec(),
            token[parts[1].0..parts[1].1].to_vec(),
        ));
    }
    Ok(out)
}

/// The added token entry of `<|endoftext|>` (`tokenizer.json`'s form).
fn added_token(id: u32) -> Json {
    Json::obj([
        ("id", Json::uint(id)),
        ("content", Json::str(EOT_TEXT)),
        ("single_word", Json::Bool(false)),
        ("lstrip", Json::Bool(false)),
        ("rstrip", Json::Bool(false)),
        ("normalized", Json::Bool(true)),
        ("special", Json::Bool(true)),
    ])
}

/// A `ByteLevel` component of `tokenizer.json` (GPT-2's settings: no prefix space).
fn byte_level(add_prefix_space: bool, trim_offsets: bool) -> Json {
    Json::obj([
        ("type", Json::str("ByteLevel")),
        ("add_prefix_space", Json::Bool(add_prefix_space)),
        ("trim_offsets", Json::Bool(trim_offsets)),
        ("use_regex", Json::Bool(true)),
    ])
}

/// The tokenizer files' contents, `(name, text)` in [`FILES`]' order. `max_len` is
/// `model_max_length` (the model's `max_position_embeddings`).
pub fn files(tok: Tokenizer, max_len: usize) -> Result<Vec<(&'static str, String)>> {
    let map = byte_to_unicode();
    let tokens = token_bytes(tok)?;
    let eot = tok.eot();
    let mut vocab: Vec<(String, Json)> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (unicode_of(&map, t), Json::uint(id)))
        .collect();
    vocab.push((EOT_TEXT.to_string(), Json::uint(eot)));
    let vocab = Json::Obj(vocab.into_iter().collect());
    let merges: Vec<String> = match tok {
        Tokenizer::Bytes => Vec::new(),
        Tokenizer::Gpt2 => merges(&tokens)?
            .iter()
            .map(|(a, b)| format!("{} {}", unicode_of(&map, a), unicode_of(&map, b)))
            .collect(),
    };
    let mut merges_txt = String::from("#version: 0.2\n");
    for m in &merges {
        merges_txt.push_str(m);
        merges_txt.push('\n');
    }
    let tokenizer_json = Json::obj([
        ("version", Json::str("1.0")),
        ("truncation", Json::Null),
        ("padding", Json::Null),
        ("added_tokens", Json::Arr(vec![added_token(eot)])),
        ("normalizer", Json::Null),
        ("pre_tokenizer", byte_level(false, true)),
        ("post_processor", byte_level(true, false)),
        ("decoder", byte_level(true, true)),
        (
            "model",
            Json::obj([
                ("type", Json::str("BPE")),
                ("dropout", Json::Null),
                ("unk_token", Json::Null),
                ("continuing_subword_prefix", Json::str("")),
                ("end_of_word_suffix", Json::str("")),
                ("fuse_unk", Json::Bool(false)),
                ("byte_fallback", Json::Bool(false)),
                ("vocab", vocab.clone()),
                (
                    "merges",
                    Json::Arr(merges.into_iter().map(Json::Str).collect()),
                ),
            ]),
        ),
    ]);
    let special = |key: &str| (key.to_string(), Json::str(EOT_TEXT));
    let tokenizer_config = Json::obj([
        ("add_bos_token".to_string(), Json::Bool(false)),
        ("add_prefix_space".to_string(), Json::Bool(false)),
        (
            "added_tokens_decoder".to_string(),
            Json::obj([(eot.to_string(), {
                let mut t = added_token(eot);
                if let Json::Obj(o) = &mut t {
                    o.remove("id");
                }
                t
            })]),
        ),
        special("bos_token"),
        // Decoding must give back the exact text (no space clean-up).
        ("clean_up_tokenization_spaces".into(), Json::Bool(false)),
        special("eos_token"),
        ("errors".into(), Json::str("replace")),
        ("model_max_length".into(), Json::uint(max_len)),
        ("tokenizer_class".into(), Json::str("GPT2Tokenizer")),
        special("unk_token"),
    ]);
    let special_map = Json::obj([
        special("bos_token"),
        special("eos_token"),
        special("unk_token"),
    ]);
    Ok(vec![
        (FILES[0], vocab.to_text()),
        (FILES[1], merges_txt),
        (FILES[2], tokenizer_json.to_text()),
        (FILES[3], tokenizer_config.to_text()),
        (FILES[4], special_map.to_text()),
    ])
}

/// Writes [`files`] into `dir`; returns their names.
pub(super) fn write(dir: &Path, tok: Tokenizer, max_len: usize) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for (name, text) in files(tok, max_len)? {
        lowbit_io::files::write_atomic(&dir.join(name), text.as_bytes())?;
        names.push(name.to_string());
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        let m = byte_to_unicode();
        assert_eq!(m[b'!' as usize], '!');
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(m[0], 'Ā');
        assert_eq!(m[0xAD], 'Ń');
        let mut all: Vec<char> = m.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 256, "a bijection");
    }

    #[test]
    fn merges_of_a_small_bpe() {
        // Ranks: a b c, then "ab", "abc" (ab + c), "bc", "abcbc": with ranks below its own
        // (< 5), "abcbc" goes a,b,c,b,c → ab,c,b,c → abc,b,c → abc,bc: two parts.
        let toks: Vec<Vec<u8>> = ["a", "b", "c", "ab", "abc", "bc", "abcbc"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        let m = merges(&toks).unwrap();
        let s = |v: &[u8]| String::from_utf8(v.to_vec()).unwrap();
        let got: Vec<(String, String)> = m.iter().map(|(a, b)| (s(a), s(b))).collect();
        let want = [("a", "b"), ("ab", "c"), ("b", "c"), ("abc", "bc")];
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert_eq!((g.0.as_str(), g.1.as_str()), w);
        }
        // A token that is not the merge of two earlier ones is refused.
        let bad: Vec<Vec<u8>> = ["a", "b", "c", "abc"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        assert!(merges(&bad).unwrap_err().to_string().contains("3 parts"));
    }

    #[test]
    fn bytes_vocabulary_is_the_byte_ids() {
        let f = files(Tokenizer::Bytes, 64).unwrap();
        let vocab = Json::parse(&f[0].1).unwrap();
        assert_eq!(vocab.get("Ġ").as_u64(), Some(32));
        assert_eq!(vocab.get("A").as_u64(), Some(65));
        assert_eq!(vocab.get(EOT_TEXT).as_u64(), Some(256));
        assert_eq!(vocab.keys().len(), 257);
        assert_eq!(f[1].1, "#version: 0.2\n");
    }
}
