//! References of the linear kernels ([`crate::kernels::linear`]), in float64.

use super::tensor::HostWeight;

/// `y[t, n] = Σ_k x[t, k] · W[n, k]` for `x [T, K]` (packed) and `W [N, K]`: `[T, N]`.
pub fn linear(x: &[f64], tokens: usize, w: &HostWeight) -> Vec<f64> {
    let (n_out, k) = (w.layout.rows as usize, w.layout.cols as usize);
    let mut y = vec![0.0; tokens * n_out];
    for n in 0..n_out {
        let row = w.row(n as u32);
        for t in 0..tokens {
            let xt = &x[t * k..(t + 1) * k];
            y[t * n_out + n] = xt.iter().zip(&row).map(|(a, b)| a * b).sum();
        }
    }
    y
}

/// Which block of `n` weight rows output row `r` of a grouped linear uses.
#[derive(Clone, Copy, Debug)]
pub enum RowSelect<'a> {
    /// Head `r % heads` (per-head matrices: W_UK, W_UV).
    Heads(u32),
    /// Expert `ids[r]`; an id outside `[0, groups)` contributes nothing.
    Experts { ids: &'a [i32], groups: u32 },
}

impl RowSelect<'_> {
    /// The block of row `r`, or `None` when it contributes nothing.
    pub fn block(&self, r: usize) -> Option<u32> {
        match self {
            RowSelect::Heads(h) => Some((r % *h as usize) as u32),
            RowSelect::Experts { ids, groups } => {
                let id = ids[r];
                (id >= 0 && (id as u32) < *groups).then_some(id as u32)
            }
        }
    }
}

/// Grouped linear over `rows` output rows: `z[r, n] = Σ_k x[r / x_div, k] · W[b(r) · n_out + n, k]`
/// with `b(r)` from `select`. Without `combine` the result is `z [rows, n_out]`; with
/// `combine = (k, weights)` it is `y[t, n] = Σ_{j < k} weights[t·k + j] · z[t·k + j, n]`,
/// `[rows / k, n_out]` (a token's routed experts summed with their routing weights).
pub fn grouped_linear(
    x: &[f64],
    x_div: usize,
    w: &HostWeight,
    n_out: usize,
    rows: usize,
    select: RowSelect,
    combine: Option<(usize, &[f32])>,
) -> Vec<f64> {
    let k = w.layout.cols as usize;
    let mut z = vec![0.0; rows * n_out];
    for r in 0..rows {
        let Some(b) = select.block(r) else { continue };
        let xr = &x[(r / x_div) * k..(r / x_div + 1) * k];
        for n in 0..n_out {
            let row = w.row(b * n_out as u32 + n as u32);
            z[r * n_out + n] = xr.iter().zip(&row).map(|(a, b)| a * b).sum();
        }
    }
    match combine {
        None => z,
        Some((kk, weights)) => {
            let tokens = rows / kk;
            let mut y = vec![0.0; tokens * n_out];
            for t in 0..tokens {
                for j in 0..kk {
                    let r = t * kk + j;
                    if select.block(r).is_none() {
                        continue;
                    }
                    let wj = weights[r] as f64;
                    for n in 0..n_out {
                        y[t * n_out + n] += wj * z[r * n_out + n];
                    }
                }
            }
            y
        }
    }
}
