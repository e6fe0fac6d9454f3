//! Reference of the sampler ([`crate::kernels::sampler`]), literally, with sorting, in float64.
//!
//! Per row of logits, with `u` in [0, 1) drawn by the host:
//! - a row holding any non-finite logit is *bad*: id −1, logprob NaN, `bad` = their number
//!   (the host turns it into an error);
//! - greedy (temperature 0): the argmax, ties to the lowest id;
//! - otherwise `z_i = logit_i / temperature`; top-k (k > 0) keeps the k best by (z desc, id
//!   asc); `p_i ∝ exp(z_i − max z)` over the kept; top-p (< 1) sorts the kept by (p desc, id
//!   asc) and keeps the shortest prefix whose mass reaches `top_p ·` (kept mass), at least one
//!   token; then the final set is walked in **ascending id order** and the first id whose
//!   cumulative mass exceeds `u ·` (final mass) is returned (the last one if rounding runs
//!   past).
//! - the logprob is `log_softmax(logits)[id]` of the raw logits, whatever the temperature
//!   (as transformers reports it).

use std::cmp::Ordering;

/// The sampler's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0: greedy.
    pub temperature: f64,
    /// 0: off.
    pub top_k: usize,
    /// 1: off.
    pub top_p: f64,
}

/// What the sampler gives for one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    /// −1 for a bad row.
    pub id: i32,
    /// NaN for a bad row.
    pub logprob: f64,
    /// Non-finite logits in the row.
    pub bad: u32,
}

/// Non-finite logits in `row`.
pub fn bad_count(row: &[f32]) -> u32 {
    row.iter().filter(|x| !x.is_finite()).count() as u32
}

/// `log_softmax(row)[id]` (a finite row).
pub fn log_softmax_at(row: &[f32], id: usize) -> f64 {
    let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row[id] as f64 - lse
}

/// The largest logit's id, ties to the lowest (a finite row).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if (x as f64) > (row[best] as f64) {
            best = i;
        }
    }
    best
}

/// `(value, id)` best first: value descending, then id ascending (finite values).
fn best_first(a: &(f64, usize), b: &(f64, usize)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// The kept tokens after temperature and top-k, with their unnormalised probabilities
/// `exp(z − max z)`, as `(p, id)` sorted by (p desc, id asc) (a finite row, temperature > 0).
pub fn kept_by_mass(row: &[f32], temperature: f64, top_k: usize) -> Vec<(f64, usize)> {
    let mut z: Vec<(f64, usize)> = row
        .iter()
        .enumerate()
        .map(|(i, &x)| (x as f64 / temperature, i))
        .collect();
    z.sort_by(best_first);
    if top_k > 0 {
        z.truncate(top_k);
    }
    let zmax = z[0].0;
    let mut p: Vec<(f64, usize)> = z.iter().map(|&(z, i)| ((z - zmax).exp(), i)).collect();
    p.sort_by(best_first);
    p
}

/// The final set of a sampling row, `(id, p)` in ascending id order (unnormalised p).
pub fn final_set(row: &[f32], s: &SampleParams) -> Vec<(usize, f64)> {
    let mut kept = kept_by_mass(row, s.temperature, s.top_k);
    if s.top_p < 1.0 {
        let target = s.top_p * kept.iter().map(|x| x.0).sum::<f64>();
        let mut mass = 0.0;
        let mut keep = kept.len();
        for (n, x) in kept.iter().enumerate() {
            mass += x.0;
            if mass >= target {
                keep = n + 1;
                break;
            }
        }
        kept.truncate(keep);
    }
    let mut set: Vec<(usize, f64)> = kept.iter().map(|&(p, i)| (i, p)).collect();
    set.sort_by_key(|x| x.0);
    set
}

/// The id `u` draws from a final set (ascending ids).
pub fn draw(set: &[(usize, f64)], u: f64) -> usize {
    let target = u * set.iter().map(|x| x.1).sum::<f64>();
    let mut cum = 0.0;
    for &(i, p) in set {
        cum += p;
        if cum > target {
            return i;
        }
    }
    set[set.len() - 1].0
}

/// The sampler on one row.
pub fn sample_row(row: &[f32], u: f64, s: &SampleParams) -> Sampled {
    let bad = bad_count(row);
    if bad > 0 || row.is_empty() {
        return Sampled {
            id: -1,
            logprob: f64::NAN,
            bad,
        };
    }
    let id = if s.temperature == 0.0 {
        argmax(row)
    } else {
        draw(&final_set(row, s), u)
    };
    Sampled {
        id: id as i32,
        logprob: log_softmax_at(row, id),
        bad,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GREEDY: SampleParams = SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };

    #[test]
    fn greedy_ties_to_the_lowest_id() {
        let r = sample_row(&[0.5, 2.0, -1.0, 2.0], 0.9, &GREEDY);
        assert_eq!(r.id, 1);
        assert!(
            (r.logprob.exp()
                - (2.0f64).exp() / ((0.5f64).exp() + 2.0 * (2.0f64).exp() + (-1.0f64).exp()))
            .abs()
                < 1e-12
        );
    }

    #[test]
    fn the_walk_is_in_id_order() {
        // Equal masses: u picks by position among ascending ids, whatever the logit order.
        let row = [0.0f32, 0.0, 0.0, 0.0];
        let s = SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        };
        for (u, want) in [(0.0, 0), (0.3, 1), (0.6, 2), (0.99, 3)] {
            assert_eq!(sample_row(&row, u, &s).id, want);
        }
    }

    #[test]
    fn top_k_ties_keep_the_lower_ids_and_top_p_keeps_at_least_one() {
        let row = [1.0f32, 3.0, 1.0, 1.0, -2.0];
        let s = SampleParams {
            temperature: 1.0,
            top_k: 3,
            top_p: 1.0,
        };
        let ids: Vec<usize> = final_set(&row, &s).iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        let s = SampleParams { top_p: 1e-6, ..s };
        let ids: Vec<usize> = final_set(&row, &s).iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1]);
    }

    #[test]
    fn a_bad_row_is_reported() {
        let r = sample_row(&[1.0, f32::NAN, f32::INFINITY], 0.5, &GREEDY);
        assert_eq!((r.id, r.bad), (-1, 2));
        assert!(r.logprob.is_nan());
    }
}
