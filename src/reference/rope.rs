//! Reference of the RoPE kernel ([`crate::kernels::rope`]), in float64.

use crate::kernels::rope::RopeLayout;

/// Rotates one row `x` (`2 · half` values) by the angles whose cos and sin are given (`half`
/// each): interleaved pairs `(x[2i], x[2i+1])`, or half-split pairs `(x[i], x[i + half])`.
pub fn rotate(x: &[f64], cos: &[f64], sin: &[f64], layout: RopeLayout) -> Vec<f64> {
    let half = x.len() / 2;
    let mut y = x.to_vec();
    for i in 0..half {
        let (a, b) = match layout {
            RopeLayout::Interleaved => (2 * i, 2 * i + 1),
            RopeLayout::HalfSplit => (i, i + half),
        };
        y[a] = x[a] * cos[i] - x[b] * sin[i];
        y[b] = x[b] * cos[i] + x[a] * sin[i];
    }
    y
}
