//! Reference of noaux_tc MoE routing ([`crate::kernels::moe_route`]), DeepSeek-V3 / GLM-5
//! (docs/models.md), in float64.
//!
//! Per token: `s_e = sigmoid(logit_e)`, `c_e = s_e + bias_e`; experts form `n_group` groups of
//! `E / n_group` consecutive ids; a group scores the sum of its two best `c` (its one `c`
//! when the group holds one expert); the best `topk_group` groups are kept; the `top_k` best
//! `c` among the kept groups' experts are chosen, best first; weight = the chosen `s`
//! (unbiased), over `Σ chosen s + 1e-20` when normalising, times the scaling factor.
//! Orders are by value descending, ties to the lower index; NaN ranks below every number.

use std::cmp::Ordering;

/// The routing parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteParams {
    pub n_group: usize,
    pub topk_group: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
}

/// `(value, index)` pairs best first: value descending (NaN last), then index ascending.
pub fn best_first(a: &(f64, usize), b: &(f64, usize)) -> Ordering {
    let v = match (a.0.is_nan(), b.0.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        // −0 and +0 are equal here, as they are to `==`.
        (false, false) => b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal),
    };
    v.then(a.1.cmp(&b.1))
}

/// The group score of every group of `c` (one token's choice values).
pub fn group_scores(c: &[f64], n_group: usize) -> Vec<f64> {
    let per = c.len() / n_group;
    (0..n_group)
        .map(|g| {
            let mut v: Vec<(f64, usize)> = (g * per..(g + 1) * per).map(|e| (c[e], e)).collect();
            v.sort_by(best_first);
            v.iter().take(2).map(|x| x.0).sum()
        })
        .collect()
}

/// The kept groups of one token, best first.
pub fn kept_groups(c: &[f64], p: &RouteParams) -> Vec<usize> {
    let mut g: Vec<(f64, usize)> = group_scores(c, p.n_group)
        .into_iter()
        .enumerate()
        .map(|(i, s)| (s, i))
        .collect();
    g.sort_by(best_first);
    g.iter().take(p.topk_group).map(|x| x.1).collect()
}

/// The candidates (experts of kept groups) of one token as `(c, id)`, best first.
pub fn ranked_candidates(c: &[f64], p: &RouteParams) -> Vec<(f64, usize)> {
    let per = c.len() / p.n_group;
    let groups = kept_groups(c, p);
    let mut cand: Vec<(f64, usize)> = (0..c.len())
        .filter(|e| groups.contains(&(e / per)))
        .map(|e| (c[e], e))
        .collect();
    cand.sort_by(best_first);
    cand
}

/// Routing of `logits [T, E]` (row-major) with `bias [E]`: `ids [T, top_k]` and
/// `weights [T, top_k]`. The caller checks the parameters (the op does).
pub fn moe_route(logits: &[f64], bias: &[f64], p: &RouteParams) -> (Vec<i32>, Vec<f64>) {
    let e = bias.len();
    let mut ids = Vec::new();
    let mut weights = Vec::new();
    for row in logits.chunks_exact(e) {
        let s: Vec<f64> = row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
        let c: Vec<f64> = s.iter().zip(bias).map(|(s, b)| s + b).collect();
        let chosen: Vec<usize> = ranked_candidates(&c, p)
            .iter()
            .take(p.top_k)
            .map(|x| x.1)
            .collect();
        let total: f64 = chosen.iter().map(|&i| s[i]).sum::<f64>() + 1e-20;
        for &i in &chosen {
            let w = if p.norm_topk_prob { s[i] / total } else { s[i] };
            ids.push(i as i32);
            weights.push(w * p.routed_scaling_factor);
        }
    }
    (ids, weights)
}

/// Expert parallelism: the ids of `ids` as the rank holding experts `[base, base + count)`
/// sees them — `id − base` inside that range, −1 (an expert another rank holds) outside.
pub fn local_expert_ids(ids: &[i32], base: u32, count: u32) -> Vec<i32> {
    let (lo, hi) = (base as i64, base as i64 + count as i64);
    ids.iter()
        .map(|&id| {
            let id = id as i64;
            if (lo..hi).contains(&id) {
                (id - lo) as i32
            } else {
                -1
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_then_experts_best_first() {
        // 4 experts in 2 groups; group 1 holds the two best choices.
        let logits = [0.0, -1.0, 2.0, 1.0];
        let p = RouteParams {
            n_group: 2,
            topk_group: 1,
            top_k: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        };
        let (ids, w) = moe_route(&logits, &[0.0; 4], &p);
        assert_eq!(ids, vec![2, 3]);
        let (s2, s3) = (1.0 / (1.0 + (-2.0f64).exp()), 1.0 / (1.0 + (-1.0f64).exp()));
        assert!((w[0] - 2.0 * s2 / (s2 + s3)).abs() < 1e-12);
    }

    #[test]
    fn the_bias_selects_but_does_not_weigh() {
        let p = RouteParams {
            n_group: 1,
            topk_group: 1,
            top_k: 1,
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
        };
        let (ids, w) = moe_route(&[1.0, 0.0], &[0.0, 0.5], &p);
        assert_eq!(ids, vec![1]);
        assert!((w[0] - 0.5).abs() < 1e-12);
    }

    #[test]
    fn ties_go_to_the_lower_id_and_nan_ranks_last() {
        let mut v = [(1.0, 3), (f64::NAN, 0), (1.0, 1), (-0.0, 4), (0.0, 2)];
        v.sort_by(best_first);
        let order: Vec<usize> = v.iter().map(|x| x.1).collect();
        assert_eq!(order, vec![1, 3, 2, 4, 0]);
    }
}
