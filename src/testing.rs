//! Helpers for tests, shared by the library's test suites and the lead's: a seed that can be
//! replayed, and comparisons that never let NaN pass.

use crate::util::Rng;

/// The seed of a randomised test: `SPARSE_MLA_SEED` when set (to replay a failure; every
/// randomised test prints the seed it used), else a fresh one.
pub fn test_seed() -> u64 {
    match std::env::var("SPARSE_MLA_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("SPARSE_MLA_SEED must be an unsigned integer, got {s:?}")),
        Err(_) => Rng::fresh_seed(),
    }
}

/// How two arrays compare: every statistic is NaN-aware (a NaN or an infinity where the
/// reference is finite makes `worst_abs` infinite and `nonfinite` non-zero).
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// ‖got − want‖ / ‖want‖ over the finite pairs (0 / 0 = 0); infinite when a non-finite
    /// value sits where the reference is finite.
    pub rel_l2: f64,
    /// Largest |got − want|; infinite when any pair is not comparable.
    pub worst_abs: f64,
    /// Index of the worst pair.
    pub worst_at: usize,
    /// Pairs where exactly one side is non-finite, or both are but differ (NaN vs ±inf,
    /// +inf vs −inf).
    pub nonfinite: usize,
    pub len: usize,
}

impl Comparison {
    /// Does it pass a relative-L2 bound and an absolute bound, with no non-finite mismatch?
    pub fn within(&self, rel_l2: f64, abs: f64) -> bool {
        self.nonfinite == 0 && self.rel_l2 <= rel_l2 && self.worst_abs <= abs
    }
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rel L2 {:.3e}, max abs {:.3e} at {}, {} non-finite mismatches of {}",
            self.rel_l2, self.worst_abs, self.worst_at, self.nonfinite, self.len
        )
    }
}

/// Compare `got` with the reference `want`. Equal infinities (same sign) and NaN where the
/// reference is NaN count as equal; anything else non-finite is a mismatch.
pub fn compare(got: &[f64], want: &[f64]) -> Comparison {
    assert_eq!(got.len(), want.len(), "compare: lengths differ");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    let mut c = Comparison {
        rel_l2: 0.0,
        worst_abs: 0.0,
        worst_at: 0,
        nonfinite: 0,
        len: got.len(),
    };
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = if g.is_finite() && w.is_finite() {
            num += (g - w) * (g - w);
            den += w * w;
            (g - w).abs()
        } else if (g.is_nan() && w.is_nan()) || (g.is_infinite() && g == w) {
            0.0
        } else {
            c.nonfinite += 1;
            f64::INFINITY
        };
        // `>` is false for NaN; d is never NaN here
        if d > c.worst_abs || (i == 0 && d == f64::INFINITY) {
            c.worst_abs = d;
            c.worst_at = i;
        }
    }
    c.rel_l2 = if c.nonfinite > 0 {
        f64::INFINITY
    } else if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    };
    c
}

/// [`compare`] of f32 results against an f64 reference.
pub fn compare_f32(got: &[f32], want: &[f64]) -> Comparison {
    let g: Vec<f64> = got.iter().map(|&x| x as f64).collect();
    compare(&g, want)
}

/// The largest |got − want| over pairs, NaN-aware (a NaN or a mismatched infinity gives
/// +inf): what `fold(0.0, f64::max)` over differences gets wrong, since `f64::max` drops NaN.
pub fn max_abs_diff(got: &[f64], want: &[f64]) -> f64 {
    compare(got, want).worst_abs
}

/// Panic unless every element differs from `poison` bit for bit: each output was written.
pub fn assert_all_written(what: &str, bits: &[u32], poison: u32) {
    if let Some(i) = bits.iter().position(|&b| b == poison) {
        let n = bits.iter().filter(|&&b| b == poison).count();
        panic!(
            "{what}: {n} of {} elements still hold the poison {poison:#010x} (first at {i})",
            bits.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_never_passes() {
        let c = compare(&[1.0, f64::NAN], &[1.0, 2.0]);
        assert_eq!(c.nonfinite, 1);
        assert!(!c.within(1.0, 1.0));
        assert_eq!(max_abs_diff(&[f64::NAN], &[0.0]), f64::INFINITY);
        assert!(compare(&[f64::INFINITY], &[f64::INFINITY]).within(0.0, 0.0));
        assert!(!compare(&[f64::NEG_INFINITY], &[f64::INFINITY]).within(1.0, 1.0));
        assert!(compare(&[1.0, 2.0], &[1.0, 2.0]).within(0.0, 0.0));
        let c = compare(&[1.5, 2.0], &[1.0, 2.0]);
        assert!((c.worst_abs - 0.5).abs() < 1e-12 && c.worst_at == 0);
    }
}
