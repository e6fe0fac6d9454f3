//! Next-token sampling: greedy, or temperature → top-k → top-p (the order transformers
//! applies them), drawn with the project's seeded [`Rng`] so a run can be replayed.

use crate::util::Rng;
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 means greedy (argmax; ties to the lowest id, as `torch.argmax`).
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::arg(
                "temperature",
                "a finite value ≥ 0",
                self.temperature,
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::arg("top_p", "a value in (0, 1]", self.top_p));
        }
        Ok(())
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

/// Index of the largest value; ties to the lowest index; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// `log softmax(logits)[id]`, computed in f64.
pub fn log_prob(logits: &[f32], id: u32) -> f32 {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = m + logits
        .iter()
        .map(|&x| (x as f64 - m).exp())
        .sum::<f64>()
        .ln();
    (logits[id as usize] as f64 - lse) as f32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Sampler {
            cfg,
            rng: Rng::new(cfg.seed),
        })
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature == 0.0 || logits.len() < 2 {
            return argmax(logits);
        }
        let t = self.cfg.temperature as f64;
        let mut cand: Vec<(f64, u32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (v as f64 / t, i as u32))
            .collect();
        cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if self.cfg.top_k > 0 {
            cand.truncate(self.cfg.top_k);
        }
        let m = cand.first().map(|c| c.0).unwrap_or(0.0);
        let mut probs: Vec<f64> = cand.iter().map(|c| (c.0 - m).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        if self.cfg.top_p < 1.0 {
            // Keep tokens until the kept mass reaches top_p (the most likely is always kept).
            let mut mass = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                mass += p;
                if mass >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let z: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= z);
        }
        let u = self.rng.unit();
        let mut acc = 0.0;
        for (p, c) in probs.iter().zip(&cand) {
            acc += p;
            if u < acc {
                return c.1;
            }
        }
        cand[probs.len() - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_with_low_ties() {
        let mut s = Sampler::new(SamplerConfig::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0, 4.9, 0.0, -2.0, 4.8];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 2,
            seed: 3,
            ..Default::default()
        })
        .unwrap();
        for _ in 0..200 {
            assert!([0, 1].contains(&s.sample(&logits)));
        }
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_p: 0.01,
            seed: 3,
            ..Default::default()
        })
        .unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&logits), 0);
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let cfg = SamplerConfig {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 20,
            seed: 42,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let mut s = Sampler::new(cfg).unwrap();
        let b: Vec<u32> = (0..20).map(|_| s.sample(&logits)).collect();
        assert_eq!(a, b);
    }

    #[test]
    fn log_prob_sums_to_one() {
        let logits = [1.0f32, 2.0, 3.0];
        let total: f64 = (0..3).map(|i| (log_prob(&logits, i) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(Sampler::new(SamplerConfig {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplerConfig {
            top_p: 0.0,
            ..Default::default()
        })
        .is_err());
    }
}
