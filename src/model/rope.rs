//! Rotary position embedding: the frequency table (plain or YaRN, as transformers computes
//! it) and the rotation itself in the two layouts the models use.
//!
//! Layout note: transformers' interleaved RoPE returns the rotated pairs de-interleaved
//! (`[x0', x2', …, x1', x3', …]`); we keep each rotated pair where it was (`[x0', x1', …]`),
//! as vLLM does. Query and key get the same permutation, so every dot product, and therefore
//! the model, is the same; the cache rows keep vLLM's / FlashMLA's byte order.

use super::config::{yarn_get_mscale, RopeConfig, RopeScaling, RopeStyle};

/// `dim / 2` inverse frequencies and the factor cos and sin are multiplied by.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub inv_freq: Vec<f32>,
    /// YaRN's `attention_factor` (1 for plain RoPE).
    pub attention_factor: f32,
}

impl RopeTable {
    /// The table for rotating `dim` values (qk_rope_head_dim).
    pub fn new(cfg: &RopeConfig, dim: usize) -> Self {
        let base = cfg.theta;
        let half = dim / 2;
        let pos_freq = |i: usize| base.powf((2 * i) as f64 / dim as f64);
        match &cfg.scaling {
            RopeScaling::Default => RopeTable {
                inv_freq: (0..half).map(|i| (1.0 / pos_freq(i)) as f32).collect(),
                attention_factor: 1.0,
            },
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let factor = *factor;
                let attention_factor =
                    attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                        (Some(m), Some(a)) if *m != 0.0 && *a != 0.0 => {
                            yarn_get_mscale(factor, *m) / yarn_get_mscale(factor, *a)
                        }
                        _ => yarn_get_mscale(factor, 1.0),
                    });
                // Dimension (of `dim`) at which a frequency makes `rotations` turns over the
                // original context; frequencies between the two bounds are blended.
                let correction_dim = |rotations: f64| {
                    dim as f64
                        * (original_max_position_embeddings
                            / (rotations * 2.0 * std::f64::consts::PI))
                            .ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                let inv_freq = (0..half)
                    .map(|i| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        let f = pos_freq(i);
                        let v = (1.0 / (factor * f)) * (1.0 - extrapolation)
                            + (1.0 / f) * extrapolation;
                        v as f32
                    })
                    .collect();
                RopeTable {
                    inv_freq,
                    attention_factor: attention_factor as f32,
                }
            }
        }
    }

    /// cos and sin (already multiplied by the attention factor) for one position, `dim / 2`
    /// each. The angle is formed in f32 as transformers does.
    pub fn cos_sin(&self, pos: u32) -> (Vec<f32>, Vec<f32>) {
        let p = pos as f32;
        self.inv_freq
            .iter()
            .map(|&f| {
                let a = f * p;
                (
                    a.cos() * self.attention_factor,
                    a.sin() * self.attention_factor,
                )
            })
            .unzip()
    }
}

/// Rotates `x` (`dim` values) in place by the angles whose cos / sin are given (`dim / 2` each).
pub fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = x.len() / 2;
    debug_assert_eq!(cos.len(), half);
    match style {
        RopeStyle::Interleaved => {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = b * cos[i] + a * sin[i];
            }
        }
        RopeStyle::HalfSplit => {
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies() {
        let t = RopeTable::new(
            &RopeConfig {
                theta: 10000.0,
                scaling: RopeScaling::Default,
            },
            64,
        );
        assert_eq!(t.inv_freq.len(), 32);
        assert_eq!(t.inv_freq[0], 1.0);
        assert!((t.inv_freq[1] - 10000f64.powf(-2.0 / 64.0) as f32).abs() < 1e-7);
        assert_eq!(t.attention_factor, 1.0);
    }

    #[test]
    fn rotation_preserves_norm_and_pairs_match_layouts() {
        let x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let cos = [0.6f32, 0.8, 1.0, 0.0];
        let sin = [0.8f32, 0.6, 0.0, 1.0];
        let mut a = x.clone();
        rotate(&mut a, &cos, &sin, RopeStyle::Interleaved);
        // Interleaved pair 0 is (x0, x1) = (1, 2), rotated by (0.6, 0.8).
        assert!((a[0] - (1.0 * 0.6 - 2.0 * 0.8)).abs() < 1e-6);
        assert!((a[1] - (2.0 * 0.6 + 1.0 * 0.8)).abs() < 1e-6);
        let mut b = x.clone();
        rotate(&mut b, &cos, &sin, RopeStyle::HalfSplit);
        // Half-split pair 0 is (x0, x4) = (1, 5).
        assert!((b[0] - (1.0 * 0.6 - 5.0 * 0.8)).abs() < 1e-6);
        assert!((b[4] - (5.0 * 0.6 + 1.0 * 0.8)).abs() < 1e-6);
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((n(&a) - n(&x)).abs() < 1e-3 && (n(&b) - n(&x)).abs() < 1e-3);
    }
}
