//! The tokenizers: GPT-2's byte-level BPE (tiktoken's `r50k_base`, embedded in the `tiktoken-rs`
//! crate, so nothing is downloaded) and a byte tokenizer for tests and tiny models.

use tiktoken_rs::CoreBPE;

use super::{DataError, Result};

/// A tokenizer with an end-of-text id that separates documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tokenizer {
    /// GPT-2's BPE (`r50k_base`): vocabulary 50257, end-of-text `<|endoftext|>` = 50256.
    Gpt2,
    /// Ids 0..=255 are the bytes of the UTF-8 text, 256 is end-of-text; vocabulary 257.
    Bytes,
}

/// GPT-2's BPE, built once (on first use, about 0.3 s) from the vocabulary that `tiktoken-rs`
/// embeds. Building it fails only if that crate's embedded data is broken (a defect of the
/// build, not of any input), which `tiktoken-rs` reports by panicking.
fn gpt2() -> &'static CoreBPE {
    tiktoken_rs::r50k_base_singleton()
}

impl Tokenizer {
    /// Every tokenizer, in the order [`Tokenizer::name`] lists them.
    pub const ALL: [Tokenizer; 2] = [Tokenizer::Gpt2, Tokenizer::Bytes];

    /// The name used in manifests and on the command line (`gpt2`, `bytes`).
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Gpt2 => "gpt2",
            Tokenizer::Bytes => "bytes",
        }
    }

    /// The tokenizer named `name` (as [`Tokenizer::name`] writes it).
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] for any other name, listing the known ones.
    pub fn from_name(name: &str) -> Result<Tokenizer> {
        Tokenizer::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| {
                DataError::Tokenizer(format!("unknown tokenizer {name:?} (known: gpt2, bytes)"))
            })
    }

    /// The vocabulary size: every id is below it.
    pub fn vocab(self) -> u32 {
        match self {
            Tokenizer::Gpt2 => 50257,
            Tokenizer::Bytes => 257,
        }
    }

    /// The end-of-text id, written before every document.
    pub fn eot(self) -> u32 {
        match self {
            Tokenizer::Gpt2 => 50256,
            Tokenizer::Bytes => 256,
        }
    }

    /// The ids of `text`. GPT-2 encodes "ordinary" text: a literal `<|endoftext|>` in the input
    /// is encoded as the characters it is, never as the end-of-text id, so a document cannot
    /// forge a document boundary.
    pub fn encode(self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Gpt2 => gpt2().encode_ordinary(text),
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
        }
    }

    /// The text of `ids`; byte sequences that are not UTF-8 (a multi-byte character cut by a
    /// window, or GPT-2 byte tokens out of order) become U+FFFD. End-of-text decodes as
    /// `<|endoftext|>`.
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] naming the first id that is not below [`Tokenizer::vocab`].
    pub fn decode(self, ids: &[u32]) -> Result<String> {
        if let Some((at, &id)) = ids.iter().enumerate().find(|&(_, &id)| id >= self.vocab()) {
            return Err(DataError::Tokenizer(format!(
                "{}: id {id} at position {at} is not below the vocabulary {}",
                self.name(),
                self.vocab()
            )));
        }
        let bytes = match self {
            Tokenizer::Gpt2 => gpt2()
                .decode_bytes(ids)
                .map_err(|e| DataError::Tokenizer(format!("gpt2: {e}")))?,
            Tokenizer::Bytes => {
                let mut out = Vec::with_capacity(ids.len());
                for &id in ids {
                    match u8::try_from(id) {
                        Ok(b) => out.push(b),
                        Err(_) => out.extend_from_slice(b"<|endoftext|>"),
                    }
                }
                out
            }
        };
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The last position `p` in `text` (a byte offset, `0 < p < text.len()`) where it can be
    /// cut so that `encode(text) == encode(&text[..p]) ++ encode(&text[p..])`, if there is one.
    ///
    /// GPT-2's pre-tokenizer (the regex of tiktoken's `r50k_base`: contractions,
    /// `` ?\p{L}+``, `` ?\p{N}+``, `` ?[^\s\p{L}\p{N}]+``, `\s+(?!\S)`, `\s+`) has no
    /// look-behind, and BPE merges never cross its pieces; between an ASCII letter and
    /// `" "` + ASCII letter a piece always ends (a letter run stops at the space) and the next
    /// one (`" word"`) always starts, whatever precedes or follows, so cutting there changes no
    /// piece. The byte tokenizer can be cut anywhere; the same rule is used for both so that
    /// the cut points, and so a lone document's split, do not depend on the tokenizer.
    pub fn safe_cut(text: &str) -> Option<usize> {
        let b = text.as_bytes();
        (1..b.len().saturating_sub(1)).rev().find(|&p| {
            b[p] == b' ' && b[p - 1].is_ascii_alphabetic() && b[p + 1].is_ascii_alphabetic()
        })
    }

    /// The first cut point (as [`Tokenizer::safe_cut`]) at or after byte `from`.
    pub fn safe_cut_after(text: &str, from: usize) -> Option<usize> {
        let b = text.as_bytes();
        (from.max(1)..b.len().saturating_sub(1)).find(|&p| {
            b[p] == b' ' && b[p - 1].is_ascii_alphabetic() && b[p + 1].is_ascii_alphabetic()
        })
    }
}

impl std::fmt::Display for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
