//! Training data: a synthetic order-2 Markov source whose entropy rate is computed exactly (so
//! the loss floor is known), or the bytes of a text file.
//!
//! Every sample is a pure function of `(seed, index)`: a context of `context` tokens and the
//! token that follows. Ranks and microbatches therefore split a global batch without sharing
//! state, and any split sees the same samples.

use std::path::Path;

use crate::model::SplitMix64;

/// Where samples come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// The synthetic Markov source.
    Markov(MarkovSource),
    /// Windows of a byte string (vocabulary 256).
    Text(TextSource),
}

/// An order-2 Markov chain over `vocab` tokens: `P(c | a, b)` is a softmax of random logits,
/// fixed by the seed. Contexts are drawn from the chain's stationary distribution, so the best
/// possible cross-entropy of predicting a token from any longer context is exactly the entropy
/// rate `H = Σ_ab π(a,b) · H(P(· | a, b))`.
#[derive(Clone, Debug)]
pub struct MarkovSource {
    vocab: usize,
    /// `P(c | a, b)`, row `a·vocab + b`.
    p: Vec<f64>,
    /// Stationary distribution of the pair `(a, b)`.
    pi: Vec<f64>,
    /// `P(c | a, b)` cumulative, row `a·vocab + b`, in f64.
    cdf: Vec<f64>,
    /// Stationary distribution of the pair `(a, b)`, cumulative.
    pair_cdf: Vec<f64>,
    entropy_rate: f64,
}

/// Logit scale of the transition rows: makes the rows peaked enough that context matters
/// (entropy rate well under `ln vocab`) but not deterministic.
const LOGIT_SCALE: f64 = 3.0;

impl MarkovSource {
    /// The chain of `vocab` tokens fixed by `seed`.
    pub fn new(vocab: usize, seed: u64) -> MarkovSource {
        let v = vocab;
        let mut rng = SplitMix64(seed ^ 0x6d61_726b_6f76);
        let mut p = vec![0f64; v * v * v];
        for row in p.chunks_exact_mut(v) {
            let logits: Vec<f64> = (0..v)
                .map(|_| LOGIT_SCALE * f64::from(rng.uniform()))
                .collect();
            let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
            let s: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
            for (o, l) in row.iter_mut().zip(&logits) {
                *o = (l - mx).exp() / s;
            }
        }
        // Stationary distribution of pairs by power iteration: (a, b) → (b, c).
        let mut pi = vec![1.0 / (v * v) as f64; v * v];
        for _ in 0..10_000 {
            let mut next = vec![0f64; v * v];
            for a in 0..v {
                for b in 0..v {
                    let w = pi[a * v + b];
                    for c in 0..v {
                        next[b * v + c] += w * p[(a * v + b) * v + c];
                    }
                }
            }
            let delta: f64 = next.iter().zip(&pi).map(|(x, y)| (x - y).abs()).sum();
            pi = next;
            if delta < 1e-15 {
                break;
            }
        }
        let entropy_rate = pi
            .iter()
            .zip(p.chunks_exact(v))
            .map(|(w, row)| {
                w * row
                    .iter()
                    .filter(|&&q| q > 0.0)
                    .map(|q| -q * q.ln())
                    .sum::<f64>()
            })
            .sum();
        let cumulative = |xs: &[f64]| -> Vec<f64> {
            xs.iter()
                .scan(0.0, |acc, x| {
                    *acc += x;
                    Some(*acc)
                })
                .collect()
        };
        let cdf = p.chunks_exact(v).flat_map(cumulative).collect();
        MarkovSource {
            vocab,
            cdf,
            pair_cdf: cumulative(&pi),
            p,
            pi,
            entropy_rate,
        }
    }

    /// The entropy rate in nats: the loss floor of next-token prediction.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    fn draw(cdf: &[f64], u: f64) -> usize {
        let total = cdf.last().copied().unwrap_or(1.0);
        cdf.iter()
            .position(|&c| u * total < c)
            .unwrap_or(cdf.len() - 1)
    }

    /// `P(· | last two tokens of t)`.
    fn next_dist(&self, t: &[u32]) -> Vec<f64> {
        let v = self.vocab;
        let (a, b) = (t[t.len() - 2] as usize, t[t.len() - 1] as usize);
        self.p[(a * v + b) * v..(a * v + b + 1) * v].to_vec()
    }

    fn sample(&self, rng: &mut SplitMix64, context: usize, out: &mut Vec<u32>) {
        let v = self.vocab;
        let pair = Self::draw(&self.pair_cdf, unit(rng));
        let (mut a, mut b) = (pair / v, pair % v);
        out.push(a as u32);
        out.push(b as u32);
        while out.len() < context + 1 {
            let c = Self::draw(&self.cdf[(a * v + b) * v..(a * v + b + 1) * v], unit(rng));
            out.push(c as u32);
            (a, b) = (b, c);
        }
    }
}

/// What an evaluation item is scored against.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// The observed next token.
    Token(u32),
    /// The true next-token distribution (Markov source): the score is the expected
    /// cross-entropy, with no sampling noise from the target.
    Dist(Vec<f64>),
}

/// One evaluation context.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalItem {
    /// `context` token ids.
    pub tokens: Vec<u32>,
    /// Weight in the eval loss (the weights sum to 1).
    pub weight: f64,
    /// What the prediction is scored against.
    pub target: Target,
}

/// Largest number of contexts the Markov eval set enumerates exhaustively.
const EXACT_EVAL_LIMIT: usize = 1 << 16;

/// The largest `--data` text file, 1 GiB: the file is held in memory whole (a byte-level
/// model's corpus; token corpora of any size are memory-mapped shards, `lowbit data`).
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

/// Windows of a byte string; the last tenth is held out for evaluation.
#[derive(Clone, Debug)]
pub struct TextSource {
    bytes: Vec<u8>,
    /// Windows starting before this are training data, the rest eval data.
    split: usize,
}

impl TextSource {
    /// Reads `path`, a regular file of at most [`MAX_TEXT_BYTES`]; it needs enough bytes for
    /// contexts in both the training and eval parts. A FIFO, device, socket or directory is
    /// refused before it is read ([`lowbit_io::files::open_regular`]: it can neither block
    /// nor stream without end), and so is a larger file, before anything is allocated; the
    /// read itself stops one byte past the limit, so a file growing meanwhile stays bounded.
    pub fn open(path: &Path, context: usize) -> Result<TextSource, String> {
        use std::io::Read;
        let shown = lowbit_io::report::shown(path);
        let (file, meta) = lowbit_io::files::open_regular(path).map_err(|e| e.to_string())?;
        let too_big = |n: u64| {
            format!(
                "{shown} has {n} bytes; --data takes text files of at most {MAX_TEXT_BYTES} \
                 bytes (1 GiB)"
            )
        };
        if meta.len() > MAX_TEXT_BYTES {
            return Err(too_big(meta.len()));
        }
        let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
        file.take(MAX_TEXT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read {shown}: {e}"))?;
        if bytes.len() as u64 > MAX_TEXT_BYTES {
            return Err(too_big(bytes.len() as u64));
        }
        let windows = bytes.len().saturating_sub(context);
        if windows < 20 {
            return Err(format!(
                "{shown} has {} bytes; training on text needs at least {} (context {context} plus 20 \
                 windows)",
                bytes.len(),
                context + 20
            ));
        }
        Ok(TextSource {
            split: windows - windows / 10,
            bytes,
        })
    }
}

/// A uniform f64 in [0, 1) from 53 random bits.
fn unit(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

impl Source {
    /// The evaluation set. For the Markov source with few enough contexts (`vocab^context` ≤
    /// 65536), every context with its stationary probability as weight and the true next-token
    /// distribution as target: the eval loss is then the exact expected cross-entropy, which
    /// is never below the entropy rate (Gibbs' inequality). Otherwise `samples` held-out
    /// samples, equally weighted (Markov ones still scored against the true distribution).
    /// Returns the items and whether the set is exhaustive.
    pub fn eval_set(&self, seed: u64, context: usize, samples: usize) -> (Vec<EvalItem>, bool) {
        if let Source::Markov(m) = self {
            let v = m.vocab;
            let total = u32::try_from(context)
                .ok()
                .and_then(|c| v.checked_pow(c))
                .filter(|&n| n <= EXACT_EVAL_LIMIT && context >= 2);
            if let Some(total) = total {
                let items = (0..total)
                    .map(|mut code| {
                        let mut t = vec![0u32; context];
                        for slot in t.iter_mut().rev() {
                            *slot = (code % v) as u32;
                            code /= v;
                        }
                        let (a, b) = (t[0] as usize, t[1] as usize);
                        let mut w = m.pi[a * v + b];
                        for j in 2..context {
                            let (x, y, z) = (t[j - 2] as usize, t[j - 1] as usize, t[j] as usize);
                            w *= m.p[(x * v + y) * v + z];
                        }
                        EvalItem {
                            weight: w,
                            target: Target::Dist(m.next_dist(&t)),
                            tokens: t,
                        }
                    })
                    .collect();
                return (items, true);
            }
        }
        let weight = 1.0 / samples as f64;
        let items = (0..samples as u64)
            .map(|i| {
                let (mut t, mut y) = (Vec::new(), Vec::new());
                self.sample(seed, i, true, context, &mut t, &mut y);
                let target = match self {
                    Source::Markov(m) if context >= 2 => Target::Dist(m.next_dist(&t)),
                    _ => Target::Token(y[0]),
                };
                EvalItem {
                    tokens: t,
                    weight,
                    target,
                }
            })
            .collect();
        (items, false)
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        match self {
            Source::Markov(m) => m.vocab,
            Source::Text(_) => 256,
        }
    }

    /// What identifies the data: `markov` (fixed by the seed and vocabulary, recorded
    /// separately), or the text's length and FNV-1a 64 of its bytes, so a resumed run refuses
    /// other data.
    pub fn fingerprint(&self) -> String {
        match self {
            Source::Markov(_) => "markov".into(),
            Source::Text(t) => format!(
                "text {} bytes fnv1a64 {:016x}",
                t.bytes.len(),
                lowbit_io::fnv1a64(&t.bytes)
            ),
        }
    }

    /// The loss floor in nats, where it is known (the Markov source's entropy rate).
    pub fn floor(&self) -> Option<f64> {
        match self {
            Source::Markov(m) => Some(m.entropy_rate),
            Source::Text(_) => None,
        }
    }

    /// Appends sample `index` (training or eval) to `tokens` (`context` tokens) and `targets`.
    pub fn sample(
        &self,
        seed: u64,
        index: u64,
        eval: bool,
        context: usize,
        tokens: &mut Vec<u32>,
        targets: &mut Vec<u32>,
    ) {
        let stream: u64 = if eval {
            0x5EED_0E7A_1000_0001
        } else {
            0x5EED_7EA1_0000_0002
        };
        let mut rng =
            SplitMix64(seed ^ stream ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93).rotate_left(17));
        let mut seq = Vec::with_capacity(context + 1);
        match self {
            Source::Markov(m) => m.sample(&mut rng, context, &mut seq),
            Source::Text(t) => {
                let windows = t.bytes.len() - context;
                let start = if eval {
                    t.split + (rng.next_u64() % (windows - t.split) as u64) as usize
                } else {
                    (rng.next_u64() % t.split as u64) as usize
                };
                seq.extend(
                    t.bytes[start..=start + context]
                        .iter()
                        .map(|&b| u32::from(b)),
                );
            }
        }
        targets.push(seq[context]);
        tokens.extend_from_slice(&seq[..context]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stationary_pairs_sum_to_one_and_rate_is_below_uniform() {
        let m = MarkovSource::new(16, 3);
        assert!((m.pair_cdf.last().unwrap() - 1.0).abs() < 1e-9);
        let h = m.entropy_rate();
        assert!(h > 0.3 && h < (16f64).ln() - 0.3, "entropy rate {h}");
    }

    #[test]
    fn empirical_conditional_entropy_matches_the_rate() {
        // Count (a, b, c) triples of sampled contexts: the plug-in estimate of H(c | a, b)
        // must approach the computed rate.
        let m = MarkovSource::new(8, 5);
        let src = Source::Markov(m.clone());
        let mut counts = vec![0u32; 8 * 8 * 8];
        let (mut toks, mut tgts) = (Vec::new(), Vec::new());
        let n = 200_000;
        for i in 0..n {
            toks.clear();
            tgts.clear();
            src.sample(1, i, false, 4, &mut toks, &mut tgts);
            let (a, b, c) = (toks[2] as usize, toks[3] as usize, tgts[0] as usize);
            counts[(a * 8 + b) * 8 + c] += 1;
        }
        let mut h = 0.0;
        for row in counts.chunks_exact(8) {
            let s: u32 = row.iter().sum();
            for &k in row.iter().filter(|&&k| k > 0) {
                let q = f64::from(k) / f64::from(s);
                h -= f64::from(k) / n as f64 * q.ln();
            }
        }
        assert!(
            (h - m.entropy_rate()).abs() < 0.01,
            "{h} vs {}",
            m.entropy_rate()
        );
    }

    #[test]
    fn exhaustive_eval_set_weights_sum_to_one_and_its_floor_is_the_rate() {
        let src = Source::Markov(MarkovSource::new(4, 9));
        let (items, exact) = src.eval_set(1, 4, 100);
        assert!(exact);
        assert_eq!(items.len(), 256);
        let total: f64 = items.iter().map(|i| i.weight).sum();
        assert!((total - 1.0).abs() < 1e-12, "{total}");
        // Scoring the true distribution against itself gives exactly the entropy rate.
        let h: f64 = items
            .iter()
            .map(|i| match &i.target {
                Target::Dist(p) => i.weight * p.iter().map(|q| -q * q.ln()).sum::<f64>(),
                Target::Token(_) => unreachable!(),
            })
            .sum();
        assert!((h - src.floor().unwrap()).abs() < 1e-9, "{h}");
    }

    #[test]
    fn samples_are_pure_functions_of_seed_and_index() {
        let src = Source::Markov(MarkovSource::new(16, 1));
        let get = |seed, i, eval| {
            let (mut t, mut y) = (Vec::new(), Vec::new());
            src.sample(seed, i, eval, 4, &mut t, &mut y);
            (t, y)
        };
        assert_eq!(get(1, 7, false), get(1, 7, false));
        assert_ne!(
            (0..8).map(|i| get(1, i, false)).collect::<Vec<_>>(),
            (0..8).map(|i| get(1, i, true)).collect::<Vec<_>>()
        );
    }
}
