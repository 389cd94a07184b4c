//! Sampling the next token from logits (greedy, or temperature with optional top-k, from a seeded
//! [`SplitMix64`]) and the generation loop over any next-logits function.
//!
//! Everything here is host arithmetic in f64 on the logits a model returns, deterministic for a
//! seed: the same logits and seed give the same tokens on every machine.

use lowbit_io::rng::SplitMix64;

use crate::{LlamaError, Result};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among equal logits).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, over the `top_k` most likely tokens when
    /// given.
    Temperature {
        /// Divides the logits: below 1 sharpens, above 1 flattens (positive, finite).
        temperature: f32,
        /// Keep only this many of the most likely tokens (ties broken by lower id); positive.
        top_k: Option<usize>,
        /// Seed of the generator of the draws.
        seed: u64,
    },
}

/// A [`Sampling`] rule with its generator's state.
#[derive(Clone, Debug)]
pub struct Sampler {
    sampling: Sampling,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler; [`LlamaError::Input`] for a temperature that is not positive and finite or a
    /// `top_k` of 0.
    pub fn new(sampling: Sampling) -> Result<Sampler> {
        let seed = match sampling {
            Sampling::Greedy => 0,
            Sampling::Temperature {
                temperature,
                top_k,
                seed,
            } => {
                if !(temperature.is_finite() && temperature > 0.0) {
                    return Err(LlamaError::Input(format!(
                        "temperature: must be positive and finite, got {temperature}"
                    )));
                }
                if top_k == Some(0) {
                    return Err(LlamaError::Input("top_k: must be positive".into()));
                }
                seed
            }
        };
        Ok(Sampler {
            sampling,
            rng: SplitMix64(seed),
        })
    }

    /// The next token from one position's logits (one per vocabulary entry); refuses empty
    /// logits and non-finite values ([`LlamaError::Input`]).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        check_logits(logits)?;
        match self.sampling {
            Sampling::Greedy => Ok(argmax(logits)),
            Sampling::Temperature {
                temperature, top_k, ..
            } => {
                let k = top_k.unwrap_or(logits.len()).min(logits.len());
                // Ids by decreasing logit, ties by increasing id; the first k are kept.
                let mut order: Vec<u32> = (0..logits.len() as u32).collect();
                if k < logits.len() {
                    order.sort_by(|&a, &b| {
                        logits[b as usize]
                            .total_cmp(&logits[a as usize])
                            .then(a.cmp(&b))
                    });
                    order.truncate(k);
                    order.sort_unstable();
                }
                let mx = order
                    .iter()
                    .map(|&i| f64::from(logits[i as usize]))
                    .fold(f64::NEG_INFINITY, f64::max);
                let t = f64::from(temperature);
                let w: Vec<f64> = order
                    .iter()
                    .map(|&i| ((f64::from(logits[i as usize]) - mx) / t).exp())
                    .collect();
                let total: f64 = w.iter().sum();
                // u in (0, total]: the first id whose running sum reaches it.
                let u = self.rng.unit_open_f64() * total;
                let mut acc = 0.0;
                for (&id, &wi) in order.iter().zip(&w) {
                    acc += wi;
                    if acc >= u {
                        return Ok(id);
                    }
                }
                // Rounding of the running sum: the last kept id with weight.
                Ok(*order
                    .iter()
                    .zip(&w)
                    .rev()
                    .find(|(_, w)| **w > 0.0)
                    .map(|(i, _)| i)
                    .unwrap_or(&order[0]))
            }
        }
    }
}

fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(LlamaError::Input("sampling: no logits".into()));
    }
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(LlamaError::Input(format!(
            "sampling: logit {i} is {} (the model diverged?)",
            logits[i]
        )));
    }
    Ok(())
}

/// The id of the largest logit, the lowest among equals.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Generates up to `max_new` tokens after `prompt`: each step calls `next_logits` on the last
/// `window` tokens so far (the model's sequence length) and appends the sampler's choice.
/// Returns the new tokens only. Refuses an empty prompt and a zero window.
pub fn generate(
    prompt: &[u32],
    max_new: usize,
    window: usize,
    next_logits: &mut dyn FnMut(&[u32]) -> Result<Vec<f32>>,
    sampler: &mut Sampler,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(LlamaError::Input("generate: the prompt is empty".into()));
    }
    if window == 0 {
        return Err(LlamaError::Input(
            "generate: window must be positive".into(),
        ));
    }
    let mut tokens = prompt.to_vec();
    for _ in 0..max_new {
        let start = tokens.len().saturating_sub(window);
        let logits = next_logits(&tokens[start..])?;
        let next = sampler.sample(&logits)?;
        tokens.push(next);
    }
    Ok(tokens.split_off(prompt.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_lowest_of_the_largest() {
        let mut s = Sampler::new(Sampling::Greedy).unwrap();
        assert_eq!(s.sample(&[0.0, 3.0, 1.0, 3.0]).unwrap(), 1);
        assert!(s.sample(&[]).is_err());
        assert!(s.sample(&[0.0, f32::NAN]).is_err());
    }

    #[test]
    fn temperature_sampling_is_seeded_and_follows_the_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), -50.0];
        let rule = Sampling::Temperature {
            temperature: 1.0,
            top_k: None,
            seed: 9,
        };
        let draw = |n| {
            let mut s = Sampler::new(rule).unwrap();
            (0..n)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(50), draw(50));
        let d = draw(6000);
        let ones = d.iter().filter(|&&t| t == 1).count() as f64 / 6000.0;
        assert!((ones - 2.0 / 3.0).abs() < 0.03, "{ones}");
        assert!(!d.contains(&2));
    }

    #[test]
    fn top_k_keeps_the_most_likely() {
        let mut s = Sampler::new(Sampling::Temperature {
            temperature: 5.0,
            top_k: Some(2),
            seed: 1,
        })
        .unwrap();
        for _ in 0..200 {
            let t = s.sample(&[1.0, 4.0, 3.0, 0.5]).unwrap();
            assert!(t == 1 || t == 2, "{t}");
        }
        let mut one = Sampler::new(Sampling::Temperature {
            temperature: 1.0,
            top_k: Some(1),
            seed: 1,
        })
        .unwrap();
        assert_eq!(one.sample(&[1.0, 4.0, 4.0, 0.5]).unwrap(), 1);
        for bad in [0.0, -1.0, f32::INFINITY] {
            let r = Sampler::new(Sampling::Temperature {
                temperature: bad,
                top_k: None,
                seed: 0,
            });
            assert!(matches!(r, Err(LlamaError::Input(_))));
        }
    }

    #[test]
    fn generate_windows_the_context() {
        // A "model" that predicts (last token + 1) mod 5 and records what it saw.
        let mut seen = Vec::new();
        let mut f = |ctx: &[u32]| -> Result<Vec<f32>> {
            seen.push(ctx.to_vec());
            let mut l = vec![0.0; 5];
            l[((ctx[ctx.len() - 1] + 1) % 5) as usize] = 1.0;
            Ok(l)
        };
        let mut s = Sampler::new(Sampling::Greedy).unwrap();
        let out = generate(&[3], 4, 2, &mut f, &mut s).unwrap();
        assert_eq!(out, [4, 0, 1, 2]);
        assert!(generate(&[], 1, 2, &mut f, &mut s).is_err());
        assert!(generate(&[1], 1, 0, &mut f, &mut s).is_err());
        assert_eq!(seen, [vec![3], vec![3, 4], vec![4, 0], vec![0, 1]]);
    }
}
