//! Layout conversion on load: a parameter the model asks for that the checkpoint does not hold
//! can be assembled from element ranges of parameters it does hold ([`Alias`]). One rule covers
//! both directions of grouped ↔ per-expert weights (Megatron-LM PR #5464): a per-expert tensor is one slice
//! of the grouped `[experts, out, in]` tensor, and a grouped tensor is the concatenation of the
//! per-expert ones, state by state (masters and every optimizer state tensor alike).

/// Elements `[start, start + len)` of a stored parameter (flattened), for every state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The stored parameter's name.
    pub param: String,
    /// First element.
    pub start: u64,
    /// Elements.
    pub len: u64,
}

/// Where the elements of `param` come from when the checkpoint has no tensor of that name: the
/// concatenation of `sources`, in order. Used only for parameters the checkpoint lacks, so a
/// checkpoint in the model's own layout loads directly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    /// The parameter as the loading model names it.
    pub param: String,
    /// Its elements, in order.
    pub sources: Vec<Segment>,
}

impl Alias {
    /// `param` is elements `[start, start + len)` of the stored `source`.
    pub fn slice(
        param: impl Into<String>,
        source: impl Into<String>,
        start: u64,
        len: u64,
    ) -> Alias {
        Alias {
            param: param.into(),
            sources: vec![Segment {
                param: source.into(),
                start,
                len,
            }],
        }
    }

    /// `param` is the whole stored tensors `parts` (each `part_len` elements) one after another.
    pub fn stacked(param: impl Into<String>, parts: &[String], part_len: u64) -> Alias {
        Alias {
            param: param.into(),
            sources: parts
                .iter()
                .map(|p| Segment {
                    param: p.clone(),
                    start: 0,
                    len: part_len,
                })
                .collect(),
        }
    }

    /// Part `i` of `parts` is slice `i` (of `part_len` elements) of the stored `stacked`: the
    /// inverse of [`Alias::stacked`].
    pub fn unstacked(stacked: &str, parts: &[String], part_len: u64) -> Vec<Alias> {
        parts
            .iter()
            .enumerate()
            .map(|(i, p)| Alias::slice(p.clone(), stacked, i as u64 * part_len, part_len))
            .collect()
    }

    /// Elements of the assembled tensor (saturating: an absurd alias fails the numel check).
    pub fn numel(&self) -> u64 {
        self.sources
            .iter()
            .fold(0u64, |a, s| a.saturating_add(s.len))
    }
}

/// How a load maps the model's parameters onto the checkpoint's tensors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Assembly rules for parameters the checkpoint does not hold under their own name.
    pub aliases: Vec<Alias>,
}

impl LoadOptions {
    /// These options plus `aliases`.
    pub fn with_aliases(mut self, aliases: impl IntoIterator<Item = Alias>) -> Self {
        self.aliases.extend(aliases);
        self
    }

    /// The alias of `param`, if any (the first one given).
    pub fn alias(&self, param: &str) -> Option<&Alias> {
        self.aliases.iter().find(|a| a.param == param)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacked_and_unstacked_are_inverse_layouts() {
        let parts: Vec<String> = (0..3).map(|e| format!("experts.{e}.w")).collect();
        let g = Alias::stacked("experts.w", &parts, 8);
        assert_eq!(g.numel(), 24);
        assert_eq!(g.sources[2].param, "experts.2.w");
        let d = Alias::unstacked("experts.w", &parts, 8);
        assert_eq!(d.len(), 3);
        assert_eq!(d[1].param, "experts.1.w");
        assert_eq!(
            d[1].sources,
            [Segment {
                param: "experts.w".into(),
                start: 8,
                len: 8
            }]
        );
        let o = LoadOptions::default().with_aliases(d);
        assert_eq!(o.alias("experts.2.w").map(|a| a.sources[0].start), Some(16));
        assert!(o.alias("experts.w").is_none());
        // An absurd alias saturates instead of overflowing (and then fails the numel check).
        let huge = Alias::stacked("x", &parts, u64::MAX);
        assert_eq!(huge.numel(), u64::MAX);
    }
}
