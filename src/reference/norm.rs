//! References of the normalisation kernels ([`crate::kernels::norm`]), in float64.

/// `y = w ⊙ x / sqrt(mean(x²) + eps)` per row of `x [rows, cols]`.
pub fn rms_norm(x: &[f64], cols: usize, w: &[f64], eps: f64) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(cols) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        y.extend(row.iter().zip(w).map(|(v, g)| g * (v * inv)));
    }
    y
}

/// `y = w ⊙ (x − mean) / sqrt(var + eps) + b` per row (biased variance, as torch).
pub fn layer_norm(x: &[f64], cols: usize, w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(cols) {
        let mean = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
        let inv = 1.0 / (var + eps).sqrt();
        y.extend(
            row.iter()
                .zip(w.iter().zip(b))
                .map(|(v, (g, bb))| (v - mean) * inv * g + bb),
        );
    }
    y
}
