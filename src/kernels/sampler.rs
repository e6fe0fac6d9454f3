//! The sampler: a row of logits in, one token id (with its logprob and the row's count of
//! non-finite logits) out, so that only 12 bytes per row cross to the host. Greedy, or
//! temperature → top-k → top-p, then a draw in ascending id order with the host's uniform
//! `u`; the definition is in [`crate::reference::sampler`].
//!
//! One workgroup per row (grid-stride over rows). Nothing is sorted: every selection is a
//! threshold on the order keys of the raw logits (temperature > 0 keeps their order, so the
//! top-k of z is the top-k of the logits, and p falls as the key falls).
//! - Pass 1 (every mode): the non-finite count, the argmax (ties to the lowest id), and the
//!   running max and sum of `exp` for `log_softmax`. Greedy stops here.
//! - Top-k threshold `θk`: the k-th largest key, found digit by digit from the top (a 2-bit
//!   digit, then ten 3-bit ones): per pass each thread counts its elements at or above the 7
//!   candidates `θ + j·2^shift`, one tree sums the 7 counts, and `θ` takes the largest `j`
//!   whose count still reaches k. Kept: every key above `θk`, and the first `need = k −
//!   #(key > θk)` of the keys equal to it, in id order.
//! - Top-p threshold `θp`: the same search on the mass above `θk` at or above a candidate,
//!   for the target `top_p ·` (kept mass, `Σ_{key > θk} p + need · p(θk)`: ties share one
//!   p). The kept ties at `θk` need not enter the search: when the mass above `θk` misses
//!   the target the cut is at `θk` itself, and `θ = max(θp, θk)` says so. So the strided
//!   passes never need the order of ties.
//! - Final set: keys above `θ` and the first `n` keys equal to `θ` in id order, `n` the
//!   fewest ties that reach the target (at most those kept). Each thread owns a contiguous
//!   chunk of ids: a u32 scan of the chunks' tie counts tells each thread which of its ties
//!   are in; an f32 scan of the chunk masses finds the chunk where `u ·` (final mass) falls;
//!   its thread walks the chunk in id order.
//!
//! Rounding: the chunk scan need not be monotone, and a chunk's walk need not add up to the
//! scanned mass bit for bit. The picked chunk is the first with mass whose inclusive sum
//! exceeds the target (else the last with mass), and its walk takes the first live token
//! that passes the target (else its last live token): always a token of the final set with
//! p > 0.
//!
//! Loop trips per thread at V = 131072: 512 per pass, 26 passes with both filters (11 per
//! search): ~13 K, well under llvmpipe's 65535.

use super::blocks::{
    block_argmax_u32, block_exclusive_scan_u32, block_max, block_scan_f32, block_sum,
    block_sum_u32, block_sums, f32_from_order_key, f32_order_key_zeros_equal, not_finite,
};
use super::view::{DType, View, ViewArgs};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::reference::sampler::{sample_row, SampleParams};
use crate::reference::tensor::{f32s, put_f32s, put_i32s, read_view};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;
/// Counts are summed as f32 in the searches: exact below 2^24.
pub const MAX_VOCAB: u32 = 1 << 24;
/// Candidates per search pass (a 3-bit digit of the key).
const PIVOTS: u32 = 7;
/// Passes per search: one 2-bit digit (bits 31..30), then ten 3-bit digits.
const SEARCH_PASSES: u32 = 11;

/// Which phases a sampler kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SampleMode {
    /// Temperature 0: the argmax.
    Greedy,
    /// Temperature > 0, with or without each filter.
    Sample { top_k: bool, top_p: bool },
}

impl SampleMode {
    pub fn name(&self) -> String {
        match self {
            SampleMode::Greedy => "sample_greedy".into(),
            SampleMode::Sample { top_k, top_p } => format!(
                "sample_temperature{}{}",
                if *top_k { "_topk" } else { "" },
                if *top_p { "_topp" } else { "" }
            ),
        }
    }

    /// Every kernel variant.
    pub fn all() -> [SampleMode; 5] {
        [
            SampleMode::Greedy,
            SampleMode::Sample {
                top_k: false,
                top_p: false,
            },
            SampleMode::Sample {
                top_k: true,
                top_p: false,
            },
            SampleMode::Sample {
                top_k: false,
                top_p: true,
            },
            SampleMode::Sample {
                top_k: true,
                top_p: true,
            },
        ]
    }
}

/// The threshold search: the largest key `θ` whose measure reaches `target`, where the
/// measure of a candidate `c` is the workgroup sum of `weight(x, key)` (f32, >= 0) over the
/// elements with key `>= c`; it falls as `c` rises, with f32 sums too (rounding is monotone
/// and every candidate's sum adds the same terms in the same order). `θ` is 0 when no
/// candidate reaches the target.
fn search(
    b: &mut KernelBuilder,
    red: &crate::kir::builder::Shared,
    vocab: &Expr,
    load: &dyn Fn(&mut KernelBuilder, Expr) -> (Expr, Expr),
    weight: &dyn Fn(&mut KernelBuilder, &Expr, &Expr) -> Expr,
    target: Expr,
) -> Expr {
    let theta = b.var("theta", u(0));
    b.for_("digit", u(0), u(SEARCH_PASSES), u(1), |b, d| {
        let shift = b.let_(
            "shift",
            select(d.clone().eq_(u(0)), u(30), u(30) - u(3) * d.clone()),
        );
        let cands: Vec<Expr> = (1..=PIVOTS)
            .map(|j| b.let_("cand", theta.clone() + (u(j) << shift.clone())))
            .collect();
        let acc: Vec<Expr> = (1..=PIVOTS).map(|_| b.var("acc", f(0.0))).collect();
        b.for_threads("v", vocab.clone(), |b, v| {
            let (x, key) = load(b, v);
            let wv = weight(b, &x, &key);
            let w = b.let_("w", wv);
            for (a, c) in acc.iter().zip(&cands) {
                b.set(
                    a,
                    a.clone() + select(key.clone().ge(c.clone()), w.clone(), f(0.0)),
                );
            }
        });
        let totals = block_sums(b, red, THREADS, &acc);
        // The first digit has 2 bits: candidates j >= 4 do not exist there.
        let mut steps = u(0);
        for (j, t) in (1..=PIVOTS).zip(&totals) {
            let valid = d.clone().gt(u(0)).or(Expr::Bool(j < 4));
            let reached = t.clone().ge(target.clone());
            steps = steps + select(valid.and(reached), u(1), u(0));
        }
        let steps = b.let_("steps", steps);
        b.set(&theta, theta.clone() + (steps << shift));
    });
    theta
}

/// The sampler kernel of `mode`.
pub fn sample_kernel(mode: &SampleMode) -> Result<Kernel> {
    let mut b = KernelBuilder::new(mode.name(), THREADS);
    let (top_k_on, top_p_on) = match *mode {
        SampleMode::Greedy => (false, false),
        SampleMode::Sample { top_k, top_p } => (top_k, top_p),
    };
    match mode {
        SampleMode::Greedy => b.doc(
            "Greedy sampling: ids[r] = argmax_v logits[r, v] (ties to the lowest id).".to_string(),
        ),
        SampleMode::Sample { .. } => {
            b.doc(format!(
                "Sampling: z = logits / temperature{}{}; p ∝ exp(z − max z); ids[r] = the first id, in ascending id order, whose cumulative p exceeds uniform[r] · Σp.",
                if top_k_on { "; keep the top_k by (z desc, id asc)" } else { "" },
                if top_p_on { "; keep the shortest prefix by (p desc, id asc) whose mass reaches top_p · kept mass" } else { "" },
            ));
        }
    }
    b.doc("logprobs[r] = log_softmax(logits[r])[ids[r]] (raw logits); bad[r] = non-finite logits in the row; a row with bad > 0 gets id -1 and logprob NaN.".to_string());
    b.doc(format!(
        "Grid: x = min(rows, 65535), a grid-stride loop over rows; {THREADS} threads per row."
    ));
    let rows = b.param("rows", Ty::U32, "R, rows of logits");
    let vocab = b.param("vocab", Ty::U32, "V, logits per row");
    let lv = ViewArgs::declare(&mut b, "logits", "logits [R, V]");
    let (inv_temperature, top_k, top_p) = match mode {
        SampleMode::Greedy => (None, None, None),
        SampleMode::Sample { .. } => (
            Some(b.param(
                "inv_temperature",
                Ty::F32,
                "1 / temperature (the host divides once; the kernel has no division)",
            )),
            top_k_on.then(|| b.param("top_k", Ty::U32, "tokens kept by top-k, 1 .. V - 1")),
            top_p_on.then(|| b.param("top_p", Ty::F32, "top-p mass, in (0, 1)")),
        ),
    };
    let logits = b.buffer("logits", Elem::F32, Access::Read, "[R, V] f32 (view)");
    let uniform = inv_temperature.as_ref().map(|_| {
        b.buffer(
            "uniforms",
            Elem::F32,
            Access::Read,
            "[R] f32 in [0, 1): the host's draw",
        )
    });
    let ids = b.buffer("ids", Elem::I32, Access::ReadWrite, "[R] i32 sampled ids");
    let logprobs = b.buffer(
        "logprobs",
        Elem::F32,
        Access::ReadWrite,
        "[R] f32 log_softmax of the sampled id",
    );
    let bad = b.buffer(
        "bad",
        Elem::U32,
        Access::ReadWrite,
        "[R] u32 non-finite logits",
    );
    let red = b.shared("red", Ty::F32, PIVOTS * THREADS);
    let akey = b.shared("akey", Ty::U32, THREADS);
    let aidx = b.shared("aidx", Ty::U32, THREADS);
    let uscan = b.shared("uscan", Ty::U32, THREADS);

    b.for_("r", workgroup_id(0), rows, num_workgroups(0), |b, r| {
        let load = |b: &mut KernelBuilder, v: Expr| -> (Expr, Expr) {
            let x = b.let_("x", logits.at(lv.at(r.clone(), v)));
            let key = f32_order_key_zeros_equal(b, x.clone());
            (x, key)
        };

        b.comment("pass 1: non-finite count, argmax (ties to the lowest id), running max and sum of exp");
        let nbad = b.var("nbad", u(0));
        let bkey = b.var("bkey", u(0));
        let bid = b.var("bid", u(0));
        let m = b.var("m", f(f32::MIN));
        let s = b.var("s", f(0.0));
        b.for_threads("v", vocab.clone(), |b, v| {
            let (x, key) = load(b, v.clone());
            let fin = b.let_("fin", not_finite(x.clone()).not());
            b.set(&nbad, nbad.clone() + select(fin.clone(), u(0), u(1)));
            let better = b.let_("better", fin.clone().and(key.clone().gt(bkey.clone())));
            b.set(&bkey, select(better.clone(), key, bkey.clone()));
            b.set(&bid, select(better, v, bid.clone()));
            // Online sum of exp: rescale when the max moves (one exp either way).
            let d = b.let_("d", x.clone() - m.clone());
            let e = b.let_("e", exp(-abs(d.clone())));
            let grown = select(
                d.gt(f(0.0)),
                fma(s.clone(), e.clone(), f(1.0)),
                s.clone() + e,
            );
            b.set(&s, select(fin.clone(), grown, s.clone()));
            b.set(&m, select(fin, m.clone().max(x), m.clone()));
        });
        let nbad = block_sum_u32(b, &uscan, THREADS, nbad);
        let (_, best) = block_argmax_u32(b, &akey, &aidx, THREADS, bkey, bid);
        let mx = block_max(b, &red, THREADS, m.clone());
        let sum = block_sum(b, &red, THREADS, s * exp(m - mx.clone()));
        let log_sum = b.let_("log_sum", log(sum));
        let ok = b.let_("ok", nbad.clone().eq_(u(0)));
        let logprob = |id: &Expr| (logits.at(lv.at(r.clone(), id.clone())) - mx.clone()) - log_sum.clone();

        let Some(inv_t) = inv_temperature.clone() else {
            b.if_(local_id().eq_(u(0)), |b| {
                write_row(b, &[&ids, &logprobs, &bad], &r, &ok, &nbad, &best, logprob(&best));
            });
            return;
        };

        let prob = |x: Expr| exp((x - mx.clone()) * inv_t.clone());

        // Top-k: θk, the kept ties `need`, and (for top-p) the kept mass.
        let (theta_k, need, kept_mass) = match &top_k {
            Some(k) => {
                b.comment("top-k threshold: the k-th largest key");
                let theta_k = search(
                    b,
                    &red,
                    &vocab,
                    &load,
                    &|_, _, _| f(1.0),
                    k.clone().as_f32(),
                );
                let theta_k = b.let_("theta_k", theta_k);
                b.comment("above the top-k threshold: count (and mass)");
                let n_gt = b.var("n_gt", u(0));
                let m_gt = b.var("m_gt", f(0.0));
                b.for_threads("v", vocab.clone(), |b, v| {
                    let (x, key) = load(b, v);
                    let above = b.let_("above", key.gt(theta_k.clone()));
                    b.set(&n_gt, n_gt.clone() + select(above.clone(), u(1), u(0)));
                    if top_p_on {
                        b.set(&m_gt, m_gt.clone() + select(above, prob(x), f(0.0)));
                    }
                });
                let n_gt = block_sum_u32(b, &uscan, THREADS, n_gt);
                let need = b.let_("need", k.clone() - n_gt);
                let kept = top_p_on.then(|| {
                    let m_gt = block_sum(b, &red, THREADS, m_gt);
                    let p_tk = prob(f32_from_order_key(theta_k.clone()));
                    b.let_("kept_mass", m_gt + need.clone().as_f32() * p_tk)
                });
                (Some(theta_k), Some(need), kept)
            }
            None if top_p_on => {
                b.comment("the mass of the whole row");
                let acc = b.var("mass", f(0.0));
                b.for_threads("v", vocab.clone(), |b, v| {
                    let (x, _) = load(b, v);
                    b.set(&acc, acc.clone() + prob(x));
                });
                let total = block_sum(b, &red, THREADS, acc);
                (None, None, Some(total))
            }
            None => (None, None, None),
        };

        // Top-p: θp over the kept set.
        let (theta_f, target_p) = match (&top_p, &kept_mass) {
            (Some(tp), Some(kept)) => {
                b.comment("top-p threshold: the largest key whose kept mass at or above it reaches top_p * kept mass");
                let target = b.let_("target_p", tp.clone() * kept.clone());
                let weight = |b: &mut KernelBuilder, x: &Expr, key: &Expr| -> Expr {
                    let p = b.let_("prob", prob(x.clone()));
                    match &theta_k {
                        Some(tk) => select(key.clone().gt(tk.clone()), p, f(0.0)),
                        None => p,
                    }
                };
                let theta_p = search(b, &red, &vocab, &load, &weight, target.clone());
                let theta = match &theta_k {
                    Some(tk) => theta_p.max(tk.clone()),
                    None => theta_p,
                };
                (b.let_("theta", theta), Some(target))
            }
            _ => (b.let_("theta", theta_k.clone().unwrap_or(u(0))), None),
        };

        b.comment("final set, per contiguous chunk of ids: mass above the threshold, ties at it");
        let chunk = b.let_("chunk", (vocab.clone() + u(THREADS - 1)) / u(THREADS));
        let lo = b.let_("lo", (local_id() * chunk.clone()).min(vocab.clone()));
        let hi = b.let_("hi", (lo.clone() + chunk.clone()).min(vocab.clone()));
        let x_tf = b.let_("x_tf", f32_from_order_key(theta_f.clone()));
        let p_tf = b.let_("p_tf", prob(x_tf.clone()));
        let m_above = b.var("m_above", f(0.0));
        let ties = b.var("ties", u(0));
        b.for_("v", lo.clone(), hi.clone(), u(1), |b, v| {
            let (x, key) = load(b, v);
            b.set(
                &m_above,
                m_above.clone() + select(key.clone().gt(theta_f.clone()), prob(x), f(0.0)),
            );
            b.set(
                &ties,
                ties.clone() + select(key.eq_(theta_f.clone()), u(1), u(0)),
            );
        });
        let (ties_before, ties_total) = block_exclusive_scan_u32(b, &uscan, THREADS, ties.clone());
        let ties_before = b.let_("ties_before", ties_before);
        // The ties in the final set: the first n_f in id order.
        let n_f = match (&target_p, &theta_k, &need) {
            (Some(target), _, _) => {
                let above = block_sum(b, &red, THREADS, m_above.clone());
                let avail = match (&theta_k, &need) {
                    (Some(tk), Some(n)) => select(theta_f.clone().eq_(tk.clone()), n.clone(), ties_total.clone()),
                    _ => ties_total.clone(),
                };
                let avail = b.let_("avail", avail);
                let shortfall = b.let_("shortfall", target.clone() - above);
                // ceil(shortfall / p) ties, at least one, at most those available; 1 / p as
                // exp(−ln p), capped at e^60 (f32 division is a long sequence with a slow path).
                let inv_p = exp(((mx.clone() - x_tf) * inv_t.clone()).min(f(60.0)));
                let q = b.let_(
                    "q",
                    select(shortfall.clone().gt(f(0.0)), shortfall * inv_p, f(0.0)),
                );
                let q = b.let_("qc", select(q.clone().lt(avail.clone().as_f32()), q, avail.clone().as_f32()));
                let whole = b.let_("whole", q.clone().as_u32());
                let n = whole.clone() + select(whole.as_f32().lt(q), u(1), u(0));
                b.let_("n_f", n.min(avail).max(u(1)))
            }
            (None, Some(_), Some(n)) => n.clone(),
            _ => ties_total.clone(),
        };
        let mine = b.let_(
            "my_ties",
            select(
                ties_before.clone().lt(n_f.clone()),
                (n_f.clone() - ties_before.clone()).min(ties.clone()),
                u(0),
            ),
        );
        // No ties in: no term (p at the threshold is NaN when the threshold is key 0).
        let tie_mass = select(mine.clone().gt(u(0)), mine.as_f32() * p_tf.clone(), f(0.0));
        let mass = b.let_("chunk_mass", m_above + tie_mass);
        let (before, incl, total) = block_scan_f32(b, &red, THREADS, mass.clone());
        let target_u = b.let_(
            "target_u",
            uniform.as_ref().map(|un| un.at(r.clone())).unwrap_or(f(0.0)) * total,
        );
        b.comment("the chunk where the draw falls: the first with mass whose sum passes it, else the last with mass");
        let live = b.let_("live", mass.gt(f(0.0)));
        let passes = b.let_("passes", live.clone().and(target_u.clone().lt(incl)));
        let (pk, pi) = block_argmax_u32(
            b,
            &akey,
            &aidx,
            THREADS,
            select(passes.clone(), u(2), select(live, u(1), u(0))),
            select(passes, local_id(), u(THREADS - 1) - local_id()),
        );
        let picker = b.let_("picker", select(pk.eq_(u(2)), pi.clone(), u(THREADS - 1) - pi));
        b.if_(local_id().eq_(picker).and(ok.clone()), |b| {
            b.comment("walk the chunk in id order");
            let acc = b.var("cum", before);
            let seen = b.var("seen", ties_before.clone());
            let found = b.var("found", u(0));
            let pick = b.var("pick", u(0));
            let last = b.var("last", u(0));
            b.for_("v", lo.clone(), hi.clone(), u(1), |b, v| {
                let (x, key) = load(b, v.clone());
                let tie = b.let_("tie", key.clone().eq_(theta_f.clone()));
                // Bound before `seen` moves on: this tie's rank is the count before it.
                let member = b.let_(
                    "member",
                    key.gt(theta_f.clone())
                        .or(tie.clone().and(seen.clone().lt(n_f.clone()))),
                );
                b.set(&seen, seen.clone() + select(tie, u(1), u(0)));
                let p = b.let_("prob", prob(x));
                let alive = b.let_("alive", member.and(p.clone().gt(f(0.0))));
                b.set(&acc, acc.clone() + select(alive.clone(), p, f(0.0)));
                let take = b.let_(
                    "take",
                    alive
                        .clone()
                        .and(found.clone().eq_(u(0)))
                        .and(acc.clone().gt(target_u.clone())),
                );
                b.set(&pick, select(take.clone(), v.clone(), pick.clone()));
                b.set(&found, select(take, u(1), found.clone()));
                b.set(&last, select(alive, v, last.clone()));
            });
            let id = b.let_("id", select(found.eq_(u(1)), pick, last));
            b.store(&ids, r.clone(), id.clone().as_i32());
            b.store(&logprobs, r.clone(), logprob(&id));
        });
        b.if_(local_id().eq_(u(0)), |b| {
            b.store(&bad, r.clone(), nbad.clone());
            b.if_(ok.clone().not(), |b| {
                b.store(&ids, r.clone(), i(-1));
                b.store(&logprobs, r.clone(), nan());
            });
        });
    });
    let mut k = b.finish()?;
    // One workgroup per row and a handful of rows: occupancy is no concern, and without the
    // hint ptxas aims for it (32 registers on sm_90) and spills a few words.
    k.min_workgroups = 1;
    Ok(k)
}

/// A quiet NaN from its bits (WGSL literals must be finite).
fn nan() -> Expr {
    f32_from_bits(u(0x7fc0_0000))
}

/// Thread 0's writes of a greedy row.
fn write_row(
    b: &mut KernelBuilder,
    out: &[&crate::kir::builder::Buf; 3],
    r: &Expr,
    ok: &Expr,
    nbad: &Expr,
    id: &Expr,
    logprob: Expr,
) {
    let [ids, logprobs, bad] = *out;
    b.store(bad, r.clone(), nbad.clone());
    b.store(
        ids,
        r.clone(),
        select(ok.clone(), id.clone().as_i32(), i(-1)),
    );
    b.store(logprobs, r.clone(), select(ok.clone(), logprob, nan()));
}

/// One token per row of `logits [R, V]`. Buffers: `logits` (view), `uniforms` (`[R]` f32 in
/// [0, 1), the host's draws; bound but unread when greedy), `ids` (`[R]` i32), `logprobs`
/// (`[R]` f32), `bad` (`[R]` u32). A row with `bad > 0` gets id −1 and logprob NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleOp {
    /// `[R, V]` f32 logits.
    pub logits: View,
    /// 0: greedy (the filters are then ignored).
    pub temperature: f32,
    /// 0: off (as is any k ≥ V).
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
}

impl SampleOp {
    /// The kernel variant these settings run.
    pub fn mode(&self) -> SampleMode {
        if self.temperature == 0.0 {
            SampleMode::Greedy
        } else {
            SampleMode::Sample {
                top_k: self.top_k > 0 && self.top_k < self.logits.cols,
                top_p: self.top_p < 1.0,
            }
        }
    }

    fn validate(&self) -> Result<()> {
        self.logits.validate("logits")?;
        if !(1..=MAX_VOCAB).contains(&self.logits.cols) {
            return Err(Error::arg(
                "logits",
                format!("1 to {MAX_VOCAB} logits per row"),
                self.logits.cols,
            ));
        }
        let greedy = self.temperature == 0.0;
        if !self.temperature.is_finite()
            || self.temperature < 0.0
            || !(greedy || (1.0 / self.temperature).is_finite())
        {
            return Err(Error::arg(
                "temperature",
                "0 (greedy) or a finite value > 0 with a finite reciprocal",
                self.temperature,
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::arg(
                "top_p",
                "a value in (0, 1] (1: off)",
                self.top_p,
            ));
        }
        Ok(())
    }
}

impl Op for SampleOp {
    fn name(&self) -> String {
        format!(
            "sample [{}, {}] t {} k {} p {}",
            self.logits.rows, self.logits.cols, self.temperature, self.top_k, self.top_p
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        let r = self.logits.rows as u64;
        let mut v = vec![Binding::read(
            "logits",
            self.logits.min_bytes(DType::F32),
            format!("[{r}, {}] f32 logits", self.logits.cols),
        )];
        // Bound in greedy mode too (and not read), so that a caller binds the same buffers
        // whatever the settings.
        v.push(Binding::read("uniforms", r * 4, format!("[{r}] f32 draws")));
        v.push(Binding::write("ids", r * 4, format!("[{r}] i32 ids")));
        v.push(Binding::write(
            "logprobs",
            r * 4,
            format!("[{r}] f32 logprobs"),
        ));
        v.push(Binding::write(
            "bad",
            r * 4,
            format!("[{r}] u32 non-finite counts"),
        ));
        v
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<SampleMode> = KernelCache::new();
        let mode = self.mode();
        let k = lowered(&K, mode, sample_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("rows".into(), ParamValue::U32(self.logits.rows)),
            ("vocab".into(), ParamValue::U32(self.logits.cols)),
            (
                "inv_temperature".into(),
                ParamValue::F32(1.0 / self.temperature),
            ),
            ("top_k".into(), ParamValue::U32(self.top_k)),
            ("top_p".into(), ParamValue::F32(self.top_p)),
        ];
        p.extend(self.logits.params("logits"));
        // pack_params takes only the parameters the variant declares.
        let declared: Vec<(String, ParamValue)> = p
            .into_iter()
            .filter(|(n, _)| k.params.iter().any(|d| &d.name == n))
            .collect();
        Ok(vec![Launch {
            params: pack(&k, &declared)?,
            kernel: k,
            grid: [self.logits.rows.min(65535), 1, 1],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let x = read_view(bufs.get("logits")?, DType::F32, &self.logits, "logits")?;
        let cols = self.logits.cols as usize;
        let draws = f32s(bufs.get("uniforms")?);
        let params = SampleParams {
            temperature: self.temperature as f64,
            top_k: self.top_k as usize,
            top_p: self.top_p as f64,
        };
        let (mut ids, mut lps, mut bads) = (Vec::new(), Vec::new(), Vec::new());
        for (row, &u) in x.chunks_exact(cols.max(1)).zip(&draws) {
            let row: Vec<f32> = row.iter().map(|&v| v as f32).collect();
            let s = sample_row(&row, u as f64, &params);
            ids.push(s.id);
            lps.push(s.logprob as f32);
            bads.push(s.bad as i32);
        }
        put_i32s(bufs.get_mut("ids")?, &ids);
        put_f32s(bufs.get_mut("logprobs")?, &lps);
        put_i32s(bufs.get_mut("bad")?, &bads);
        Ok(())
    }
}
