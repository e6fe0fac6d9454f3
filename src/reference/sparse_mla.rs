//! Float64 reference of sparse MLA decode (docs/math.md).
//!
//! For each token t and head h, over the valid j of `indices[t]`:
//! `s_j = scale · q[t,h,:] · k_j`, `lse = ln Σ exp(s_j)`, `out = Σ exp(s_j − lse) · k_j[..d_v]`;
//! no valid j → `out = 0`, `lse = +inf`. Invalid slots are never read.

use super::cache::decode_row;
use crate::mla::DecodeShape;

/// Inputs of one decode call, host side. `q` holds the bf16 values of `q [T, H, d_qk]` as
/// f32; `cache` the raw bytes `[num_slots, row_bytes]`; `indices [T, topk]`;
/// `topk_length [T]` when `shape.has_topk_length`.
pub struct DecodeInputs<'a> {
    pub shape: DecodeShape,
    pub q: &'a [f32],
    pub cache: &'a [u8],
    pub indices: &'a [i32],
    pub topk_length: Option<&'a [i32]>,
}

/// Outputs in float64: `out [T, H, d_v]`, `lse [T, H]` (token-major; with `T = B · s_q`
/// these are `[B, s_q, H, d_v]` and `[B, s_q, H]`: see [`crate::mla::LseLayout`] for
/// FlashMLA's `[B, H, s_q]`).
#[derive(Clone, Debug)]
pub struct DecodeOutputs {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    /// Per output element, `Σ_j P_j · |v_j|`: what a relative error of the weights P moves
    /// that element by, at most (an element near 0 can sum terms far larger than itself).
    pub out_abs: Vec<f64>,
}

/// Is `indices[t][j]` a slot to read? The one place the validity rule is written for the host.
pub fn slot_of(inp: &DecodeInputs, t: usize, j: usize) -> Option<usize> {
    let s = &inp.shape;
    if let Some(len) = inp.topk_length {
        if (j as i64) >= len[t] as i64 {
            return None;
        }
    }
    let idx = inp.indices[t * s.topk as usize + j];
    if idx < 0 || idx as u64 >= s.num_slots() {
        None
    } else {
        Some(idx as usize)
    }
}

pub fn decode(inp: &DecodeInputs) -> DecodeOutputs {
    let s = &inp.shape;
    let (t_n, h_n, k_n) = (s.tokens as usize, s.heads as usize, s.topk as usize);
    let (d, dv) = (s.dims.d_qk() as usize, s.dims.d_v() as usize);
    let rb = s.row_bytes() as usize;
    assert_eq!(inp.q.len(), t_n * h_n * d, "q");
    assert_eq!(inp.indices.len(), t_n * k_n, "indices");
    assert!(inp.cache.len() as u64 >= s.cache_bytes(), "cache");
    let mut out = vec![0.0f64; t_n * h_n * dv];
    let mut lse = vec![f64::INFINITY; t_n * h_n];
    let mut out_abs = vec![0.0f64; t_n * h_n * dv];
    for t in 0..t_n {
        let rows: Vec<Vec<f64>> = (0..k_n)
            .filter_map(|j| slot_of(inp, t, j))
            .map(|slot| {
                decode_row(s.format, s.dims, &inp.cache[slot * rb..(slot + 1) * rb])
                    .into_iter()
                    .map(f64::from)
                    .collect()
            })
            .collect();
        if rows.is_empty() {
            continue;
        }
        for h in 0..h_n {
            let q = &inp.q[(t * h_n + h) * d..(t * h_n + h + 1) * d];
            let scores: Vec<f64> = rows
                .iter()
                .map(|k| s.scale as f64 * q.iter().zip(k).map(|(a, b)| *a as f64 * b).sum::<f64>())
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|x| (x - m).exp()).sum();
            let l = m + sum.ln();
            lse[t * h_n + h] = l;
            let at = (t * h_n + h) * dv..(t * h_n + h + 1) * dv;
            let (o, abs) = (&mut out[at.clone()], &mut out_abs[at]);
            for (k, sc) in rows.iter().zip(&scores) {
                let p = (sc - l).exp();
                for ((oi, ai), ki) in o.iter_mut().zip(abs.iter_mut()).zip(k) {
                    *oi += p * ki;
                    *ai += p * ki.abs();
                }
            }
        }
    }
    DecodeOutputs { out, lse, out_abs }
}
