//! Exact top-k of the indexer's score rows, described once: for token t with
//! `n = min(positions[t] + 1, columns)` candidate positions, the `k = min(topk, n)` positions
//! of the largest scores, ties to the lower position, written in **ascending position order**
//! to `indices[t, 0..k]`, the rest of the row −1. A NaN score ranks below every number.
//! While `n ≤ topk` every position is selected and the scores are not read at all.
//!
//! One workgroup (256 threads) per token. The k-th largest score is found exactly by a
//! bisection over the 32-bit order-preserving keys of the scores (each step counts the keys at
//! or above the midpoint across the workgroup); the positions above that threshold, and the
//! lowest-positioned ones equal to it, are then compacted in order with two exclusive scans
//! over per-thread contiguous ranges.

use super::blocks::{block_exclusive_scan_u32, block_sums_u32, f32_order_key};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::reference::tensor::{f32s, i32s, put_i32s};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;
/// Ways of the threshold search: one pass counts `WAYS - 1` thresholds at once.
const WAYS: u32 = 8;
/// Passes that narrow 2^32 keys to one: ceil(32 / log2(WAYS)).
const PASSES: u32 = 11;

fn topk_kernel(_: &()) -> Result<Kernel> {
    let mut b = KernelBuilder::new("topk_positions", THREADS);
    b.doc("Exact top-k per row: indices[t, :] = the k = min(topk, n) positions of the largest scores[t, 0..n), n = min(positions[t] + 1, columns), ties to the lower position, in ascending order; -1 after them.".to_string());
    b.doc(
        "NaN ranks below every number. n <= topk selects 0..n without reading scores.".to_string(),
    );
    b.doc("Grid: x = tokens (<= 65535). Threshold by bisection over the f32 order keys (32 counting steps), then an ordered compaction.".to_string());
    let topk = b.param("topk", Ty::U32, "columns of indices (K)");
    let columns = b.param("columns", Ty::U32, "columns of scores");
    let scores = b.buffer("scores", Elem::F32, Access::Read, "[T, columns] f32");
    let positions = b.buffer(
        "positions",
        Elem::I32,
        Access::Read,
        "[T] i32 position of each token",
    );
    let indices = b.buffer(
        "indices",
        Elem::I32,
        Access::ReadWrite,
        "[T, topk] i32 positions (-1: none)",
    );
    let red = b.shared("red", Ty::U32, THREADS * (WAYS - 1));

    let t = b.let_("t", workgroup_id(0));
    let pos = b.let_("pos", positions.at(t.clone()));
    let n = b.let_(
        "n",
        select(
            pos.clone().ge(i(0)),
            (pos.as_u32() + u(1)).min(columns.clone()),
            u(0),
        ),
    );
    let k = b.let_("k", n.clone().min(topk.clone()));
    let row = b.let_("row", t.clone() * columns.clone());
    let out = b.let_("out", t * topk.clone());

    b.if_else(
        n.clone().le(topk.clone()),
        |b| {
            b.comment("every position is selected");
            b.for_threads("j", topk.clone(), |b, j| {
                let v = select(j.clone().lt(n.clone()), j.clone().as_i32(), i(-1));
                b.store(&indices, out.clone() + j, v);
            });
        },
        |b| {
            b.comment("the k-th largest key: the largest tau with count(key >= tau) >= k, by an 8-way search: each pass counts the keys at or above 7 thresholds spread over [lo, hi] at once, and keeps the eighth of the range that holds tau (11 passes for 32-bit keys)");
            let lo = b.var("lo", u(0));
            let hi = b.var("hi", u(0xffff_ffff));
            b.for_("pass", u(0), u(PASSES), u(1), |b, _| {
                let span = b.let_("span", hi.clone() - lo.clone());
                // WAYS * step > span, without overflow.
                let step = b.let_("step", span.clone() / u(WAYS) + u(1));
                let thresholds: Vec<Expr> = (1..WAYS)
                    .map(|j| b.let_(&format!("m{j}"), lo.clone() + step.clone() * u(j)))
                    .collect();
                // A threshold past hi (j * step > span) counts nothing: it is never chosen.
                let inside: Vec<Expr> = (1..WAYS)
                    .map(|j| b.let_(&format!("in{j}"), (step.clone() * u(j)).le(span.clone())))
                    .collect();
                let counts: Vec<Expr> = (1..WAYS).map(|j| b.var(&format!("c{j}"), u(0))).collect();
                b.for_threads("e", n.clone(), |b, e| {
                    let key = f32_order_key(b, scores.at(row.clone() + e));
                    for ((m, c), ins) in thresholds.iter().zip(&counts).zip(&inside) {
                        let hit = key.clone().ge(m.clone()).and(ins.clone());
                        b.set(c, c.clone() + select(hit, u(1), u(0)));
                    }
                });
                let totals = block_sums_u32(b, &red, THREADS, &counts);
                b.if_(span.gt(u(0)), |b| {
                    // The largest threshold that still has k keys at or above it is the new lo;
                    // the next one, less one, the new hi.
                    let new_lo = b.var("new_lo", lo.clone());
                    let new_hi = b.var("new_hi", hi.clone());
                    for j in (0..(WAYS - 1) as usize).rev() {
                        let ok = inside[j].clone().and(totals[j].clone().ge(k.clone()));
                        let above = if j + 1 < (WAYS - 1) as usize {
                            select(inside[j + 1].clone(), thresholds[j + 1].clone() - u(1), hi.clone())
                        } else {
                            hi.clone()
                        };
                        b.if_(ok.and(new_lo.clone().eq_(lo.clone())), |b| {
                            b.set(&new_lo, thresholds[j].clone());
                            b.set(&new_hi, above);
                        });
                    }
                    // No threshold has k keys: tau is below the first one.
                    let first_fails = totals[0].clone().lt(k.clone()).or(inside[0].clone().not());
                    b.if_(first_fails, |b| {
                        b.set(&new_hi, select(inside[0].clone(), thresholds[0].clone() - u(1), hi.clone()));
                    });
                    b.set(&lo, new_lo.clone());
                    b.set(&hi, new_hi.clone());
                });
            });
            let tau = b.let_("tau", lo.clone());

            b.comment("each thread's contiguous range: count keys above tau and equal to it");
            let chunk = b.let_("chunk", (n.clone() + u(THREADS - 1)) / u(THREADS));
            let begin = b.let_("begin", (local_id() * chunk.clone()).min(n.clone()));
            let end = b.let_("end", (begin.clone() + chunk.clone()).min(n.clone()));
            let gt = b.var("gt", u(0));
            let eq = b.var("eq", u(0));
            b.for_("e", begin.clone(), end.clone(), u(1), |b, e| {
                let key = f32_order_key(b, scores.at(row.clone() + e));
                b.set(
                    &gt,
                    gt.clone() + select(key.clone().gt(tau.clone()), u(1), u(0)),
                );
                b.set(&eq, eq.clone() + select(key.eq_(tau.clone()), u(1), u(0)));
            });
            let (_, gt_total) = block_exclusive_scan_u32(b, &red, THREADS, gt.clone());
            let (eq_before, _) = block_exclusive_scan_u32(b, &red, THREADS, eq.clone());
            let need_eq = b.let_("need_eq", k.clone() - gt_total);
            b.comment("equal keys are taken lowest position first, up to need_eq of them");
            let take_eq = b.let_(
                "take_eq",
                select(
                    eq_before.clone().ge(need_eq.clone()),
                    u(0),
                    (need_eq.clone() - eq_before.clone()).min(eq.clone()),
                ),
            );
            let (dst, _) = block_exclusive_scan_u32(b, &red, THREADS, gt.clone() + take_eq.clone());
            let w = b.var("w", dst);
            let eq_seen = b.var("eq_seen", u(0));
            b.for_("e", begin, end, u(1), |b, e| {
                let key = f32_order_key(b, scores.at(row.clone() + e.clone()));
                let is_eq = b.let_("is_eq", key.clone().eq_(tau.clone()));
                let take = key
                    .gt(tau.clone())
                    .or(is_eq.clone().and(eq_seen.clone().lt(take_eq.clone())));
                b.if_(take, |b| {
                    b.store(&indices, out.clone() + w.clone(), e.as_i32());
                    b.set(&w, w.clone() + u(1));
                });
                b.set(&eq_seen, eq_seen.clone() + select(is_eq, u(1), u(0)));
            });
            b.for_threads("j", topk.clone(), |b, j| {
                b.if_(j.clone().ge(k.clone()), |b| {
                    b.store(&indices, out.clone() + j, i(-1));
                });
            });
        },
    );
    let mut k = b.finish()?;
    // One workgroup per token is the whole grid at decode batches, so occupancy is not the
    // limit; without the bound, ptxas for sm_89 cut registers to 40 for occupancy and spilled.
    k.min_workgroups = 1;
    Ok(k)
}

/// Exact top-k of score rows. Buffers: `scores` (`[tokens, columns]` f32), `positions`
/// (`[tokens]` i32), `indices` (`[tokens, topk]` i32, written in full).
#[derive(Clone, Copy, Debug)]
pub struct TopkOp {
    pub tokens: u32,
    pub columns: u32,
    pub topk: u32,
}

impl TopkOp {
    fn validate(&self) -> Result<()> {
        for (n, v) in [
            ("tokens", self.tokens),
            ("columns", self.columns),
            ("topk", self.topk),
        ] {
            if v == 0 {
                return Err(Error::arg(n, "at least 1", 0));
            }
        }
        if self.tokens > 65535 {
            return Err(Error::arg("tokens", "at most 65535 per call", self.tokens));
        }
        if self.topk > i32::MAX as u32 || self.columns > i32::MAX as u32 {
            return Err(Error::arg(
                "topk / columns",
                "below 2^31 (positions are i32)",
                self.topk.max(self.columns),
            ));
        }
        Ok(())
    }
}

/// The reference: per row, the `k` best `(score, position)` by score descending, ties to the
/// lower position, NaN lowest; listed in ascending position order, −1 padded.
pub fn topk_reference(scores: &[f32], columns: usize, positions: &[i32], topk: usize) -> Vec<i32> {
    let mut out = vec![-1i32; positions.len() * topk];
    for (t, &p) in positions.iter().enumerate() {
        let n = if p < 0 {
            0
        } else {
            (p as usize + 1).min(columns)
        };
        let k = n.min(topk);
        let row = &scores[t * columns..t * columns + n];
        let mut order: Vec<usize> = (0..n).collect();
        let key = |v: f32| {
            if v.is_nan() {
                f64::NEG_INFINITY
            } else {
                v as f64
            }
        };
        // NaN below -inf: compare by (is_nan, value).
        order.sort_by(|&a, &b| {
            let (va, vb) = (row[a], row[b]);
            match (va.is_nan(), vb.is_nan()) {
                (true, true) => a.cmp(&b),
                (true, false) => std::cmp::Ordering::Greater,
                (false, true) => std::cmp::Ordering::Less,
                _ => key(vb).total_cmp(&key(va)).then(a.cmp(&b)),
            }
        });
        let mut chosen: Vec<usize> = order[..k].to_vec();
        chosen.sort_unstable();
        for (j, c) in chosen.into_iter().enumerate() {
            out[t * topk + j] = c as i32;
        }
    }
    out
}

impl Op for TopkOp {
    fn name(&self) -> String {
        format!("top-{} of {} x {}", self.topk, self.tokens, self.columns)
    }

    fn bindings(&self) -> Vec<Binding> {
        let t = self.tokens as u64;
        vec![
            Binding::read("scores", t * self.columns as u64 * 4, "f32 score rows"),
            Binding::read("positions", t * 4, "i32 position of each token"),
            Binding::write("indices", t * self.topk as u64 * 4, "i32 top-k positions"),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), topk_kernel)?;
        let p: Vec<(String, ParamValue)> = vec![
            ("topk".into(), ParamValue::U32(self.topk)),
            ("columns".into(), ParamValue::U32(self.columns)),
        ];
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: [self.tokens, 1, 1],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let (t, c) = (self.tokens as usize, self.columns as usize);
        let positions = i32s(bufs.get("positions")?);
        // Rows whose every position is selected need no scores (the kernel does not read them).
        let scores = f32s(bufs.get("scores")?);
        let out = topk_reference(&scores[..t * c], c, &positions[..t], self.topk as usize);
        put_i32s(bufs.get_mut("indices")?, &out);
        Ok(())
    }
}

/// The kernel, lowered (for compile checks and exports).
pub fn all_variants() -> Result<Vec<Kernel>> {
    Ok(vec![crate::kir::lower(
        &topk_kernel(&())?,
        crate::kir::Lowering::Scalar,
    )?])
}
