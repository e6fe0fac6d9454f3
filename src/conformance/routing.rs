//! Cases of the decisions the model makes on the device: MoE routing (noaux_tc, GLM's one
//! group and DeepSeek's 8 groups / 4 kept, groups of one expert, E up to 1024, top_k up to
//! 32, normalised or not) and the sampler (greedy with ties, temperature, top-k, top-p, all
//! three, ties at the thresholds, V up to 130 000, rows with NaN / inf logits).
//!
//! Both ops make discrete choices from f32 arithmetic that the float64 reference redoes, so
//! inputs are drawn where no choice sits on a rounding boundary:
//! - routing: each token's choice values `c` are a random permutation of a grid (spacing
//!   0.9 / E) plus noise of a tenth of the spacing; the bias is small, and the logits are
//!   `logit(c − bias)`. A draw whose kept groups or chosen experts are separated by less than
//!   1e-4 in the reference is drawn again.
//! - sampling: logits are a permutation of one spaced multiset (spacing 0.02 plus a quarter
//!   of it of noise, or a coarse grid with many exact ties), the same multiset in every row
//!   so that one top_p fits all rows: top_p sits halfway across a kept token's mass (of at
//!   least 2e-3 of the total), and each row's `u` halfway across a token's interval of the
//!   final CDF (at least 1e-3 wide, as the reference computes it).

use super::ops::{f32_bytes, i32_bytes, Compare, Instance, OpCase};
use crate::kernels::expert_shard::LocalExpertsOp;
use crate::kernels::moe_route::MoeRouteOp;
use crate::kernels::sampler::SampleOp;
use crate::kernels::view::View;
use crate::reference::moe_route::{group_scores, ranked_candidates, RouteParams};
use crate::reference::sampler::{bad_count, final_set, kept_by_mass, SampleParams};
use crate::util::Rng;
use crate::{Error, Result};

/// f32 weights and logprobs against float64.
const TOL: f64 = 1e-5;
/// An i32 no op output takes.
const ID_POISON: i32 = 0x5a5a_5a5a;

/// A strided view `[rows, cols]` with NaN around it, and the buffer length.
fn padded(rows: u32, cols: u32, pad: u32) -> (View, usize) {
    let v = View {
        offset: pad as u64 + 1,
        rows,
        cols,
        stride: cols + pad,
    };
    (v, v.end() as usize + pad as usize)
}

fn shuffle<T>(rng: &mut Rng, v: &mut [T]) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

// ---------------------------------------------------------------- routing

/// The smallest gap between neighbours that decide the routing of one token; exact ties (of
/// experts or groups with identical inputs, which f32 and f64 both see as ties) do not count.
fn route_margin(c: &[f64], p: &RouteParams) -> f64 {
    let gap = |a: f64, b: f64| if a == b { f64::INFINITY } else { a - b };
    let mut margin = f64::INFINITY;
    if p.topk_group < p.n_group {
        let mut g = group_scores(c, p.n_group);
        g.sort_by(|a, b| b.total_cmp(a));
        margin = margin.min(gap(g[p.topk_group - 1], g[p.topk_group]));
    }
    let cand = ranked_candidates(c, p);
    let last = p.top_k.min(cand.len() - 1);
    for j in 0..last {
        margin = margin.min(gap(cand[j].0, cand[j + 1].0));
    }
    margin
}

fn moe_case(
    tokens: u32,
    experts: u32,
    (n_group, topk_group): (u32, u32),
    top_k: u32,
    norm: bool,
    ties: bool,
) -> OpCase {
    let name = format!(
        "moe_route/e{experts}_g{n_group}-{topk_group}_k{top_k}_t{tokens}{}{}",
        if norm { "_norm" } else { "" },
        if ties { "_ties" } else { "" }
    );
    OpCase::new(name, move |rng: &mut Rng| -> Result<Instance> {
        let params = RouteParams {
            n_group: n_group as usize,
            topk_group: topk_group as usize,
            top_k: top_k as usize,
            norm_topk_prob: norm,
            routed_scaling_factor: 2.5,
        };
        let (rows, bias) = draw_routing(rng, tokens, experts as usize, &params, ties)?;
        let (lv, len) = padded(tokens, experts, 3);
        let mut logits = vec![f32::NAN; len];
        for t in 0..tokens as u64 {
            for e in 0..experts as u64 {
                logits[lv.index(t, e)] = rows[(t * experts as u64 + e) as usize];
            }
        }
        let outs = (tokens * top_k) as usize + 5;
        Ok(Instance {
            op: Box::new(MoeRouteOp {
                logits: lv,
                n_group,
                topk_group,
                top_k,
                norm_topk_prob: norm,
                routed_scaling_factor: 2.5,
            }),
            buffers: vec![
                ("logits", f32_bytes(&logits)),
                ("bias", f32_bytes(&bias)),
                ("ids", i32_bytes(&vec![ID_POISON; outs])),
                ("weights", f32_bytes(&vec![f32::NAN; outs])),
            ],
            outputs: vec![
                ("ids", Compare::Exact),
                ("weights", Compare::F32 { rel_l2: TOL }),
            ],
            detail: format!("T{tokens} E{experts} groups {topk_group}/{n_group} top {top_k}"),
        })
    })
}

/// Expert parallelism's id map: `n` ids drawn over `[-2, experts + 2)` (so negative ids, every
/// rank's experts and ids past the last expert all occur) for the rank holding
/// `[base, base + count)`; the words past `n` must stay as they were.
fn local_experts_case(n: u32, experts: u32, base: u32, count: u32) -> OpCase {
    let name = format!("local_experts/n{n}_e{experts}_{base}-{}", base + count);
    OpCase::new(name, move |rng: &mut Rng| -> Result<Instance> {
        let ids: Vec<i32> = (0..n)
            .map(|_| rng.below(experts as u64 + 4) as i32 - 2)
            .collect();
        Ok(Instance {
            op: Box::new(LocalExpertsOp { n, base, count }),
            buffers: vec![
                ("ids", i32_bytes(&ids)),
                ("local", i32_bytes(&vec![ID_POISON; n as usize + 3])),
            ],
            outputs: vec![("local", Compare::Exact)],
            detail: format!("{n} ids, rank experts {base}..{}", base + count),
        })
    })
}

/// Logits `[tokens, E]` (packed) and bias `[E]` whose reference routing has margins. With
/// `ties`, a quarter of the experts copy another expert's logit and bias (exact ties of c)
/// and group 1 copies group 0 (a tie of group scores).
fn draw_routing(
    rng: &mut Rng,
    tokens: u32,
    e: usize,
    p: &RouteParams,
    ties: bool,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let spacing = 0.9 / e as f64;
    'draw: for _ in 0..100 {
        let mut bias: Vec<f32> = (0..e).map(|_| rng.uniform(-0.02, 0.02)).collect();
        let mut copies: Vec<(usize, usize)> = Vec::new();
        if ties {
            let per = e / p.n_group;
            if p.n_group > 1 {
                copies.extend((0..per).map(|j| (j, per + j)));
            }
            for _ in 0..e / 4 {
                let pair = rng.distinct(e as u64, 2);
                let (from, to) = (pair[0] as usize, pair[1] as usize);
                if copies.iter().all(|&(a, b)| b != from && b != to && a != to) {
                    copies.push((from, to));
                }
            }
            for &(from, to) in &copies {
                bias[to] = bias[from];
            }
        }
        let mut logits = Vec::with_capacity(tokens as usize * e);
        for _ in 0..tokens {
            let mut c: Vec<f64> = (0..e)
                .map(|j| 0.05 + spacing * (j as f64 + 0.1 * (2.0 * rng.unit() - 1.0)))
                .collect();
            shuffle(rng, &mut c);
            let mut row: Vec<f32> = c
                .iter()
                .zip(&bias)
                .map(|(c, &b)| {
                    let s = c - b as f64;
                    (s / (1.0 - s)).ln() as f32
                })
                .collect();
            for &(from, to) in &copies {
                row[to] = row[from];
            }
            // The margins as the reference sees the f32 logits.
            let c: Vec<f64> = row
                .iter()
                .zip(&bias)
                .map(|(&x, &b)| 1.0 / (1.0 + (-(x as f64)).exp()) + b as f64)
                .collect();
            if route_margin(&c, p) < 1e-4 {
                continue 'draw;
            }
            logits.extend(row);
        }
        return Ok((logits, bias));
    }
    Err(Error::arg(
        "routing case",
        "a draw with margins of 1e-4 within 100 tries",
        "none",
    ))
}

// ---------------------------------------------------------------- sampling

/// How a case's logits are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Logits {
    /// A spaced multiset (spacing 0.02, noise 0.005), permuted per row.
    Spaced,
    /// A coarse grid (steps of 0.25 over 24 values): many exact ties, permuted per row.
    Ties,
    /// Independent coarse rows whose maximum appears three times (greedy ties; V > 256).
    MaxTies,
}

#[derive(Clone, Copy, Debug)]
struct SampleSpec {
    rows: u32,
    vocab: u32,
    /// 0: greedy; negative: drawn in [0.6, 1.4).
    temperature: f32,
    top_k: u32,
    top_p: bool,
    logits: Logits,
    /// Rows 1.. get NaN / inf logits.
    bad: bool,
}

fn sample_rows(rng: &mut Rng, s: &SampleSpec) -> Vec<Vec<f32>> {
    let v = s.vocab as usize;
    match s.logits {
        Logits::Spaced | Logits::Ties => {
            let shift = rng.uniform(-2.0, 2.0) as f64;
            let base: Vec<f32> = (0..v)
                .map(|j| match s.logits {
                    Logits::Spaced => {
                        (0.02 * (j as f64 - v as f64 / 2.0 + 0.25 * (2.0 * rng.unit() - 1.0))
                            + shift) as f32
                    }
                    _ => (rng.below(24) as f32 - 12.0) * 0.25,
                })
                .collect();
            (0..s.rows)
                .map(|_| {
                    let mut row = base.clone();
                    shuffle(rng, &mut row);
                    row
                })
                .collect()
        }
        Logits::MaxTies => (0..s.rows)
            .map(|_| {
                let mut row: Vec<f32> = (0..v)
                    .map(|_| (rng.below(24) as f32 - 12.0) * 0.25)
                    .collect();
                // The lowest tie `a` shares a thread with `a + 256` in a strided pass.
                let top = row.iter().fold(f32::MIN, |a, &b| a.max(b)) + 0.25;
                let a = rng.below(v as u64 - 256) as usize;
                let b = a + 1 + rng.below((v - a - 1) as u64) as usize;
                for id in [a, a + 256, b] {
                    row[id] = top;
                }
                row
            })
            .collect(),
    }
}

/// top_p halfway across the mass of a kept token of row 0 (at least 2e-3 of the kept mass,
/// within the first 64), checked to cut every clean row at the same count.
fn choose_top_p(rng: &mut Rng, rows: &[Vec<f32>], t: f64, top_k: usize) -> Result<f32> {
    let kept = kept_by_mass(&rows[0], t, top_k);
    let total: f64 = kept.iter().map(|x| x.0).sum();
    let mut cum = 0.0;
    let mut options = Vec::new();
    for (n, x) in kept.iter().take(64).enumerate() {
        if x.0 / total >= 2e-3 {
            options.push((n + 1, (cum + x.0 / 2.0) / total));
        }
        cum += x.0;
    }
    if options.is_empty() {
        return Err(Error::arg(
            "sampling case",
            "a kept token with mass",
            "none",
        ));
    }
    let (count, top_p) = options[rng.below(options.len() as u64) as usize];
    let top_p = top_p as f32;
    let s = SampleParams {
        temperature: t,
        top_k,
        top_p: top_p as f64,
    };
    for row in rows.iter().filter(|r| bad_count(r) == 0) {
        let n = final_set(row, &s).len();
        if n != count {
            return Err(Error::arg(
                "sampling case",
                format!("top_p {top_p} keeping {count} tokens in every row"),
                n,
            ));
        }
    }
    Ok(top_p)
}

/// A draw halfway across the interval of a token of the final set (at least 1e-3 of the
/// final mass wide; the widest when none is).
fn choose_u(rng: &mut Rng, row: &[f32], s: &SampleParams) -> f32 {
    if bad_count(row) > 0 {
        return rng.unit() as f32;
    }
    let set = final_set(row, s);
    let total: f64 = set.iter().map(|x| x.1).sum();
    let mut cum = 0.0;
    let mut options = Vec::new();
    let mut widest = (0.0, 0.0);
    let mut mids = Vec::with_capacity(set.len());
    for &(_, p) in &set {
        let mid = (cum + p / 2.0) / total;
        mids.push(mid);
        if p / total >= 1e-3 {
            options.push(mid);
        }
        if p > widest.0 {
            widest = (p, mid);
        }
        cum += p;
    }
    if options.is_empty() {
        return widest.1 as f32;
    }
    // A third of the draws land on the last token of the lowest p (where a threshold cuts
    // ties), a third on any token of the lowest p, when those are wide enough.
    let low = set.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
    let at_low: Vec<f64> = mids
        .iter()
        .zip(&set)
        .filter(|(_, x)| x.1 == low && low / total >= 1e-3)
        .map(|(m, _)| *m)
        .collect();
    match (at_low.last(), rng.below(3)) {
        (Some(&m), 0) => m as f32,
        (Some(_), 1) => at_low[rng.below(at_low.len() as u64) as usize] as f32,
        _ => options[rng.below(options.len() as u64) as usize] as f32,
    }
}

fn sample_case(name: &str, s: SampleSpec) -> OpCase {
    OpCase::new(
        format!("sample/{name}_v{}_r{}", s.vocab, s.rows),
        move |rng: &mut Rng| -> Result<Instance> {
            let mut rows = sample_rows(rng, &s);
            if s.bad {
                let v = s.vocab as u64;
                let specials = [
                    vec![f32::NAN],
                    vec![f32::INFINITY],
                    vec![f32::NEG_INFINITY, f32::NAN],
                ];
                for (row, vals) in rows.iter_mut().skip(1).zip(&specials) {
                    for (&x, id) in vals.iter().zip(rng.distinct(v, vals.len())) {
                        row[id as usize] = x;
                    }
                }
            }
            let temperature = if s.temperature < 0.0 {
                rng.uniform(0.6, 1.4)
            } else {
                s.temperature
            };
            let top_p = if s.top_p && temperature > 0.0 {
                choose_top_p(rng, &rows, temperature as f64, s.top_k as usize)?
            } else {
                1.0
            };
            let params = SampleParams {
                temperature: temperature as f64,
                top_k: s.top_k as usize,
                top_p: top_p as f64,
            };
            let (lv, len) = padded(s.rows, s.vocab, 5);
            let mut logits = vec![f32::NAN; len];
            for (r, row) in rows.iter().enumerate() {
                for (c, &x) in row.iter().enumerate() {
                    logits[lv.index(r as u64, c as u64)] = x;
                }
            }
            let n = s.rows as usize + 3;
            let mut buffers = vec![
                ("logits", f32_bytes(&logits)),
                ("ids", i32_bytes(&vec![ID_POISON; n])),
                ("logprobs", f32_bytes(&vec![f32::NAN; n])),
                ("bad", i32_bytes(&vec![ID_POISON; n])),
            ];
            let u: Vec<f32> = rows
                .iter()
                .map(|r| {
                    if temperature > 0.0 {
                        choose_u(rng, r, &params)
                    } else {
                        rng.unit() as f32
                    }
                })
                .collect();
            buffers.push(("uniforms", f32_bytes(&u)));
            Ok(Instance {
                op: Box::new(SampleOp {
                    logits: lv,
                    temperature,
                    top_k: s.top_k,
                    top_p,
                }),
                buffers,
                outputs: vec![
                    ("ids", Compare::Exact),
                    ("logprobs", Compare::F32 { rel_l2: TOL }),
                    ("bad", Compare::Exact),
                ],
                detail: format!(
                    "R{} V{} t {temperature:.3} k {} p {top_p:.4}",
                    s.rows, s.vocab, s.top_k
                ),
            })
        },
    )
}

/// Every case of this module.
pub fn routing_cases() -> Vec<OpCase> {
    let glm = (1, 1);
    let ds = (8, 4);
    let mut v = vec![
        moe_case(1, 8, glm, 2, true, false),
        moe_case(3, 64, glm, 8, false, false),
        moe_case(7, 256, glm, 8, true, false),
        moe_case(2, 256, glm, 8, false, false),
        moe_case(5, 256, ds, 8, true, false),
        moe_case(2, 64, ds, 8, false, false),
        // Groups of one expert: a group scores its one c.
        moe_case(4, 8, ds, 2, true, false),
        moe_case(3, 1024, (16, 3), 32, true, false),
        moe_case(6, 64, ds, 8, true, true),
        moe_case(3, 256, glm, 8, false, true),
        local_experts_case(6, 8, 0, 4),
        local_experts_case(24, 8, 6, 2),
        // A decode batch of 300 tokens x 8: more ids than one workgroup's threads.
        local_experts_case(2400, 256, 96, 32),
    ];
    let spec = |rows, vocab, temperature, top_k, top_p, logits| SampleSpec {
        rows,
        vocab,
        temperature,
        top_k,
        top_p,
        logits,
        bad: false,
    };
    use Logits::*;
    v.extend([
        sample_case("greedy_ties", spec(3, 384, 0.0, 0, false, MaxTies)),
        sample_case("greedy", spec(2, 5000, 0.0, 0, false, Spaced)),
        sample_case("temperature", spec(4, 384, -1.0, 0, false, Spaced)),
        sample_case("top_k", spec(3, 5000, 1.0, 50, false, Spaced)),
        sample_case("top_k1", spec(2, 384, -1.0, 1, false, Spaced)),
        sample_case("top_p", spec(2, 5000, 1.0, 0, true, Spaced)),
        sample_case("all", spec(4, 384, -1.0, 100, true, Spaced)),
        sample_case("ties_top_k", spec(2, 384, -1.0, 40, false, Ties)),
        sample_case("ties_all", spec(3, 384, -1.0, 40, true, Ties)),
        sample_case("temperature", spec(1, 130_000, -1.0, 0, false, Spaced)),
        sample_case("all", spec(2, 130_000, -1.0, 2000, true, Spaced)),
        sample_case(
            "bad_greedy",
            SampleSpec {
                bad: true,
                ..spec(4, 384, 0.0, 0, false, Spaced)
            },
        ),
        sample_case(
            "bad_all",
            SampleSpec {
                bad: true,
                ..spec(4, 5000, -1.0, 50, true, Spaced)
            },
        ),
    ]);
    v
}
