//! Next-token sampling on the device: greedy, or temperature → top-k → top-p (the order
//! transformers applies them), one uniform per row drawn here with the project's seeded
//! [`Rng`] so a run can be replayed. The definition (and its float64 reference, which the CPU
//! backend runs) is in [`crate::reference::sampler`]; only the chosen id and its logprob come
//! back to the host.

use super::device::{Device, Tensor};
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
        self.validate_as("temperature", "top_p")
    }

    /// [`Self::validate`], the errors naming the fields as the caller's user spells them
    /// (`--temperature`, `--top-p` for a command line).
    pub fn validate_as(&self, temperature: &str, top_p: &str) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::arg(
                temperature,
                "a finite value ≥ 0 (0 = greedy)",
                self.temperature,
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::arg(top_p, "a value in (0, 1] (1 = off)", self.top_p));
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

/// `log Σ exp(logits)`, computed in f64 from the largest value.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    m + logits
        .iter()
        .map(|&x| (x as f64 - m).exp())
        .sum::<f64>()
        .ln()
}

/// `log softmax(logits)[id]`, computed in f64.
pub fn log_prob(logits: &[f32], id: u32) -> f32 {
    (logits[id as usize] as f64 - log_sum_exp(logits)) as f32
}

/// The uniform in [0, 1) a row's draw uses: one per sampled token, so a server that keeps a
/// generator per request replays a single-stream run with the same seed.
pub fn draw_uniform(rng: &mut Rng) -> f32 {
    (rng.unit() as f32).min(1.0 - f32::EPSILON / 2.0)
}

/// One sampled token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Token {
    pub id: u32,
    /// `log_softmax(logits)[id]` of the raw logits.
    pub logprob: f32,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Sampler {
            cfg,
            rng: Rng::new(cfg.seed),
        })
    }

    pub fn config(&self) -> SamplerConfig {
        self.cfg
    }

    /// One token per row of `logits [R, vocab]`, on the logits' device. A row with a NaN or
    /// infinite logit is an error naming the row (nothing is sampled from it).
    pub fn sample(&mut self, device: &Device, logits: &Tensor) -> Result<Vec<Token>> {
        let uniforms: Vec<f32> = (0..logits.rows())
            .map(|_| draw_uniform(&mut self.rng))
            .collect();
        let top_k = u32::try_from(self.cfg.top_k).unwrap_or(u32::MAX);
        let out = device.sample(
            logits,
            &uniforms,
            self.cfg.temperature,
            top_k,
            self.cfg.top_p,
        )?;
        out.into_iter()
            .enumerate()
            .map(|(row, (id, logprob, bad))| {
                if bad > 0 || id < 0 {
                    return Err(Error::Model(format!(
                        "the logits of row {row} hold {bad} NaN or infinite values: nothing to sample"
                    )));
                }
                Ok(Token {
                    id: id as u32,
                    logprob,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::CpuBackend;
    use std::sync::Arc;

    fn device() -> Device {
        Device::new(Arc::new(CpuBackend::new()))
    }

    fn draw(cfg: SamplerConfig, logits: &[f32], n: usize) -> Vec<u32> {
        let d = device();
        let t = d.tensor_from(1, logits.len() as u32, logits).unwrap();
        let mut s = Sampler::new(cfg).unwrap();
        (0..n).map(|_| s.sample(&d, &t).unwrap()[0].id).collect()
    }

    #[test]
    fn greedy_is_argmax_with_low_ties() {
        assert_eq!(
            draw(SamplerConfig::default(), &[0.1, 3.0, 3.0, -1.0], 1),
            vec![1]
        );
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0, 4.9, 0.0, -2.0, 4.8];
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 2,
            seed: 3,
            ..Default::default()
        };
        let got = draw(cfg, &logits, 200);
        assert!(got.iter().all(|i| [0, 1].contains(i)), "{got:?}");
        assert!(
            got.contains(&0) && got.contains(&1),
            "both kept tokens are drawn"
        );
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_p: 0.01,
            seed: 3,
            ..Default::default()
        };
        assert!(draw(cfg, &logits, 50).iter().all(|&i| i == 0));
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
        assert_eq!(draw(cfg, &logits, 20), draw(cfg, &logits, 20));
    }

    #[test]
    fn non_finite_logits_are_an_error_naming_the_row() {
        let d = device();
        let t = d
            .tensor_from(2, 3, &[1.0, 2.0, 3.0, 1.0, f32::NAN, 0.0])
            .unwrap();
        let mut s = Sampler::new(SamplerConfig::default()).unwrap();
        let e = s.sample(&d, &t).unwrap_err().to_string();
        assert!(e.contains("row 1") && e.contains("NaN"), "{e}");
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
