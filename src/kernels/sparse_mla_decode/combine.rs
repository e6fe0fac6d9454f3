//! The combine kernel: merges a row's split partials.
//!
//! One workgroup per (head, token, column chunk). Its `W` threads are `G` split groups of
//! `W / G` lanes (`G` a run-time parameter, [`combine_groups`]): group `g` folds the splits
//! `g, g + G, ...` and lane `c` columns `c` and `c + W/G` of the chunk (`2W / G` columns). With
//! few rows (T = 1) the host picks many groups, so a row's splits are loaded at once instead
//! of one after the other (that walk was 7.9 µs of the 20 at T = 1 on the H200,
//! benches/NOTES.md); with many rows one group, a workgroup per row, no more workgroups than
//! the GPU runs at once. Each group folds its splits in one pass like an online softmax
//! (running max, weight sum, rescaled sums), so no lse is needed before the loads; the
//! groups' (max, sum, columns) meet in shared memory.

use super::DecodeConfig;
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::kir::ops::{is_masked, MASKED};
use crate::{Error, Result};

/// Columns each lane sums.
const PER_LANE: u32 = 2;
/// The fewest lanes of a group (the row segment one load instruction covers: 64 bytes).
const MIN_LANES: u32 = 16;
/// Combine workgroups the host aims for (about one wave of 256-thread workgroups on a
/// 132-multiprocessor GPU): more groups only while the grid stays below it.
const TARGET_WORKGROUPS: u32 = 1024;

/// The most split groups a combine workgroup of `threads` threads takes.
pub fn max_combine_groups(threads: u32) -> u32 {
    (threads / MIN_LANES).max(1)
}

/// Split groups of the combine for `rows` = T x H rows of `splits` splits, `threads` per
/// workgroup: the largest power of two ≤ min(splits, threads / 16, 1024 / rows), at least 1.
pub fn combine_groups(rows: u32, splits: u32, threads: u32) -> u32 {
    let fill = (TARGET_WORKGROUPS / rows.max(1)).max(1);
    let x = splits.min(max_combine_groups(threads)).min(fill).max(1);
    1 << (31 - x.leading_zeros())
}

/// The combine grid for `groups` split groups ([`combine_groups`]): (H, T, column chunks).
pub fn combine_grid(heads: u32, tokens: u32, d_v: u32, groups: u32, threads: u32) -> [u32; 3] {
    let chunk = PER_LANE * threads / groups.max(1);
    [heads, tokens, d_v.div_ceil(chunk)]
}

/// The combine kernel.
pub fn combine_kernel(cfg: &DecodeConfig) -> Result<Kernel> {
    let dv = cfg.dims.d_v();
    let threads = cfg.threads;
    if !threads.is_power_of_two() || threads < MIN_LANES || dv % 2 != 0 {
        return Err(Error::arg(
            "config",
            format!("threads a power of two ≥ {MIN_LANES}, d_v even"),
            format!("threads {threads}, d_v {dv}"),
        ));
    }
    let max_groups = max_combine_groups(threads);
    let mut b = KernelBuilder::new(cfg.combine_name(), threads);
    b.doc(format!(
        "Sparse MLA decode, combine stage: merges S normalised partials of width {dv}."
    ));
    b.doc(format!(
        "Grid: x = heads, y = tokens, z = ceil({dv} / ({} / G)) column chunks; G = groups (a power of two <= {max_groups}).",
        PER_LANE * threads
    ));
    b.doc("lse = logsumexp_s lse_s; out = sum_s exp(lse_s - lse) o_s; all splits empty: out 0, lse +inf.".to_string());
    b.doc("lse[t, h] goes to ((t / lse_s_q) * heads + h) * lse_s_q + t % lse_s_q: lse_s_q = 1 gives [tokens, heads], lse_s_q = s_q FlashMLA's [batch, heads, s_q].".to_string());
    b.doc("Grid y covers the split tokens only: token whole_tokens + y, whose partials are row block y (the split kernel wrote the whole tokens' out and lse).".to_string());
    let heads = b.param("heads", Ty::U32, "H");
    let splits = b.param("splits", Ty::U32, "S");
    let lse_s_q = b.param(
        "lse_s_q",
        Ty::U32,
        "lse layout [tokens / lse_s_q, heads, lse_s_q]; 1 = [tokens, heads]",
    );
    let groups_param = b.param(
        "groups",
        Ty::U32,
        "G, split groups per workgroup: a power of two, at most W / 16 (grid z follows it)",
    );
    let whole_tokens = b.param(
        "whole_tokens",
        Ty::U32,
        "W, tokens the split kernel ran whole before the split ones (0: none)",
    );
    let o_part = b.buffer(
        "o_part",
        Elem::F32,
        Access::Read,
        &format!("[tokens - whole_tokens, heads, splits, {dv}]"),
    );
    let lse_part = b.buffer(
        "lse_part",
        Elem::F32,
        Access::Read,
        "[tokens - whole_tokens, heads, splits]",
    );
    let out = b.buffer(
        "out",
        Elem::Bf16,
        Access::ReadWrite,
        &format!("[tokens, heads, {dv}]"),
    );
    let lse_out = b.buffer(
        "lse",
        Elem::F32,
        Access::ReadWrite,
        "[tokens / lse_s_q, heads, lse_s_q]",
    );
    let io = MergeIo {
        heads,
        splits,
        whole_tokens: Some(whole_tokens.clone()),
        lse_s_q,
        groups: groups_param,
        o_part,
        lse_part,
        out,
        lse_out,
        sh: merge_shared(&mut b, MergeForm::COMBINE, threads),
    };
    let h = b.let_("h", workgroup_id(0));
    let t = b.let_("t", workgroup_id(1) + whole_tokens);
    merge_segment(
        &mut b,
        cfg,
        MergeForm::COMBINE,
        &io,
        None,
        (h, t, workgroup_id(2)),
    );
    b.finish()
}

/// How a workgroup merges one row segment: the columns a lane sums, how many splits a group
/// loads before folding them (`None`: a plain loop, one split at a time), and the fewest
/// groups (so that the widest chunk, `per_lane W / min_groups` columns, fits d_v).
#[derive(Clone, Copy, Debug)]
pub(super) struct MergeForm {
    pub per_lane: u32,
    pub unroll: Option<u32>,
    pub min_groups: u32,
}

impl MergeForm {
    /// The combine kernel's form.
    pub const COMBINE: MergeForm = MergeForm {
        per_lane: PER_LANE,
        unroll: None,
        min_groups: 1,
    };

    /// Columns of one group's chunk at `groups` groups of `threads` threads.
    pub fn chunk(&self, threads: u32, groups: u32) -> u32 {
        self.per_lane * threads / groups.max(self.min_groups).max(1)
    }
}

/// The merge's parameters, buffers and shared arrays.
pub(super) struct MergeIo {
    pub heads: Expr,
    pub splits: Expr,
    /// W: token `t`'s partials are row block `t - W` (`None`: W = 0).
    pub whole_tokens: Option<Expr>,
    pub lse_s_q: Expr,
    /// G, the split groups asked for (clamped in the kernel).
    pub groups: Expr,
    pub o_part: Buf,
    pub lse_part: Buf,
    pub out: Buf,
    pub lse_out: Buf,
    /// Per group its max and weight sum, then G chunks of weighted column sums
    /// ([`merge_shared`]).
    pub sh: (Shared, Shared, Shared),
}

/// The merge's shared arrays for `form` at `threads` threads: per group its max and weight
/// sum, then G chunks of weighted column sums.
pub(super) fn merge_shared(
    b: &mut KernelBuilder,
    form: MergeForm,
    threads: u32,
) -> (Shared, Shared, Shared) {
    let max_groups = max_combine_groups(threads);
    (
        b.shared("group_max", Ty::F32, max_groups),
        b.shared("group_sum", Ty::F32, max_groups),
        b.shared("group_out", Ty::F32, form.per_lane * threads),
    )
}

/// The split groups and chunk of a merge, computed once where a workgroup merges several
/// segments.
#[derive(Clone)]
pub(super) struct MergeGeom {
    pub groups: Expr,
    pub log_lanes: Expr,
    pub lanes: Expr,
    pub chunk: Expr,
}

impl MergeGeom {
    /// The geometry of `form` for the groups `io.groups` asks for (clamped to a power of two
    /// in [`MergeForm::min_groups`], W / 16]).
    pub fn new(b: &mut KernelBuilder, form: MergeForm, threads: u32, io: &MergeIo) -> MergeGeom {
        let max_groups = max_combine_groups(threads);
        let log_g = b.let_(
            "log_g",
            u(31)
                - clz(io
                    .groups
                    .clone()
                    .max(u(form.min_groups.max(1)))
                    .min(u(max_groups))),
        );
        let groups = b.let_("groups", u(1) << log_g.clone());
        let log_lanes = b.let_("log_lanes", u(threads.trailing_zeros()) - log_g.clone());
        let lanes = b.let_("lanes", u(1) << log_lanes.clone());
        let chunk = b.let_("chunk", lanes.clone() * u(form.per_lane));
        MergeGeom {
            groups,
            log_lanes,
            lanes,
            chunk,
        }
    }
}

/// Merge the splits of row (`h`, `t`) over column chunk `z`: `G` split groups of `W / G`
/// lanes; group `g` folds the splits `g, g + G, ...` and lane `c` sums columns `c + k W/G`
/// (`k < per_lane`) of the chunk; the groups meet in shared memory. Every thread of the
/// workgroup takes part (it ends with the meeting's barrier read-side: a caller that merges
/// again puts a barrier between).
pub(super) fn merge_segment(
    b: &mut KernelBuilder,
    cfg: &DecodeConfig,
    form: MergeForm,
    io: &MergeIo,
    geom: Option<&MergeGeom>,
    (h, t, z): (Expr, Expr, Expr),
) {
    let dv = cfg.dims.d_v();
    let threads = cfg.threads;
    let per_lane = form.per_lane;
    // the widest chunk (the fewest groups) divides d_v: every chunk does, no column guards
    let ragged = dv % form.chunk(threads, form.min_groups) != 0;
    let MergeIo {
        heads,
        splits,
        whole_tokens,
        lse_s_q,
        o_part,
        lse_part,
        out,
        lse_out,
        sh,
        ..
    } = io;
    let (sh_m, sh_l, sh_o) = sh;
    let lid = b.let_("lid", local_id());
    let row = b.let_("row", t.clone() * heads.clone() + h.clone());
    let part_row = match whole_tokens {
        Some(w) => b.let_(
            "part_row",
            (t.clone() - w.clone()) * heads.clone() + h.clone(),
        ),
        None => row.clone(),
    };
    let lse_at = b.let_(
        "lse_at",
        (t.clone() / lse_s_q.clone() * heads.clone() + h) * lse_s_q.clone() + t % lse_s_q.clone(),
    );
    b.comment(format!(
        "G split groups of W / G lanes; a chunk of {per_lane}W / G columns"
    ));
    let geom = geom
        .cloned()
        .unwrap_or_else(|| MergeGeom::new(b, form, threads, io));
    let MergeGeom {
        groups,
        log_lanes,
        lanes,
        chunk,
        ..
    } = geom;
    let c0 = b.let_("c0", z.clone() * chunk.clone());
    let g = b.let_("g", lid.clone() >> log_lanes);
    let lane = b.let_("lane", lid.clone() & (lanes.clone() - u(1)));

    // One pass, no lse first: each group folds its splits like an online softmax (running
    // max m, weight sum l, rescaled column sums), so the partials' loads need nothing loaded
    // before them. The loads are not behind a branch: every split's workgroup writes its
    // o_part rows (0 for an empty split), so each is in bounds and initialised; an empty
    // split (masked lse) adds weight 0.
    if form.unroll.is_none() {
        b.comment(if per_lane == 2 {
            "group g folds splits g, g + G, ...: lane c sums columns c and c + W/G of the chunk"
                .to_string()
        } else {
            format!("group g folds splits g, g + G, ...: lane c sums columns c + k W/G of the chunk, k < {per_lane}")
        });
    }
    let m = b.var("m", f(MASKED));
    let l = b.var("l", f(0.0));
    let accs: Vec<Expr> = (0..per_lane)
        .map(|j| b.var(&format!("acc{j}"), f(0.0)))
        .collect();
    // split `sp`'s lse and columns (`real` false: nothing loaded, weight 0)
    let load = |b: &mut KernelBuilder, sp: Expr, real: Option<Expr>| {
        let part = b.let_("part", part_row.clone() * splits.clone() + sp);
        let ls = lse_part.at(part.clone());
        let ls = b.let_(
            "part_lse",
            match &real {
                Some(r) => select(r.clone(), ls, f(MASKED)),
                None => ls,
            },
        );
        let at = b.let_("at", part * u(dv) + c0.clone() + lane.clone());
        let os: Vec<Expr> = (0..per_lane)
            .map(|j| {
                let off = lanes.clone() * u(j);
                let v = o_part.at(at.clone() + off.clone());
                let col_ok = ragged.then(|| (c0.clone() + lane.clone() + off).lt(u(dv)));
                match (&real, col_ok) {
                    (None, None) => v,
                    (Some(r), None) => select(r.clone(), v, f(0.0)),
                    (None, Some(c)) => select(c, v, f(0.0)),
                    (Some(r), Some(c)) => select(r.clone().and(c), v, f(0.0)),
                }
            })
            .map(|v| b.let_("o", v))
            .collect();
        let valid = b.let_("valid", is_masked(ls.clone()).not());
        (ls, os, valid)
    };
    // The weights' exponentials are `exp_fast` (`ex2.approx` on CUDA, ~2^-22 + |x| · 2^-24
    // relative): they sit on the call's last chain at small T, where `expf` ran 1.01-1.03x
    // slower on the H200 (benches/NOTES.md, v28); lse and the outputs are unchanged to
    // within 1e-7.
    let fold = |b: &mut KernelBuilder, (ls, os, valid): (Expr, Vec<Expr>, Expr)| {
        let nm = b.let_(
            "nm",
            select(valid.clone(), m.clone().max(ls.clone()), m.clone()),
        );
        let keep = b.let_("keep", exp_fast(m.clone() - nm.clone()));
        let w = b.let_("w", select(valid, exp_fast(ls - nm.clone()), f(0.0)));
        b.set(&l, l.clone() * keep.clone() + w.clone());
        for (acc, o) in accs.iter().zip(os) {
            b.set(acc, acc.clone() * keep.clone() + w.clone() * o);
        }
        b.set(&m, nm);
    };
    match form.unroll {
        None => {
            b.for_("sp", g.clone(), splits.clone(), groups.clone(), |b, sp| {
                let loaded = load(b, sp, None);
                fold(b, loaded);
            });
        }
        Some(unroll) => {
            // As a plain loop (even unrolled by the compiler) each split's loads waited for
            // the previous split's fold: one L2 round trip per split (benches/NOTES.md,
            // v18). Here a pass issues `unroll` splits' loads before its first fold. A split
            // past the last loads nothing and weighs 0 (its index clamped to the last, so a
            // select that reads both sides stays in bounds).
            b.comment(format!(
                "group g folds splits g, g + G, ..., {unroll} a pass with their loads first: lane c sums columns c + k W/G of the chunk, k < {per_lane}"
            ));
            let last = b.let_("last_split", splits.clone().max(u(1)) - u(1));
            let stride = b.let_("pass_stride", groups.clone() * u(unroll));
            b.for_("sp0", g.clone(), splits.clone(), stride, |b, sp0| {
                let mut loaded = Vec::new();
                for k in 0..unroll {
                    let sp = b.let_("sp", sp0.clone() + groups.clone() * u(k));
                    let real = b.let_("real", sp.clone().lt(splits.clone()));
                    loaded.push(load(b, sp.min(last.clone()), Some(real)));
                }
                for x in loaded {
                    fold(b, x);
                }
            });
        }
    }
    for (j, acc) in accs.iter().enumerate() {
        b.shared_store(
            sh_o,
            g.clone() * chunk.clone() + lane.clone() + lanes.clone() * u(j as u32),
            acc.clone(),
        );
    }
    b.if_(lane.clone().eq_(u(0)), |b| {
        b.shared_store(sh_m, g.clone(), m.clone());
        b.shared_store(sh_l, g.clone(), l.clone());
    });
    b.barrier();

    b.comment("the groups meet: lse = M + log sum_g e^(m_g - M) l_g, out = sum_g e^(m_g - M) acc_g / (that sum)");
    let mx = b.var("lse_max", f(MASKED));
    b.for_("gi", u(0), groups.clone(), u(1), |b, gi| {
        b.set(&mx, mx.clone().max(sh_m.at(gi)));
    });
    let sum = b.var("lse_sum", f(0.0));
    b.for_("gi", u(0), groups.clone(), u(1), |b, gi| {
        b.set(
            &sum,
            sum.clone() + sh_l.at(gi.clone()) * exp_fast(sh_m.at(gi) - mx.clone()),
        );
    });
    let empty = b.let_("all_empty", sum.clone().le(f(0.0)));
    let inv = b.let_(
        "inv_sum",
        select(empty.clone(), f(0.0), f(1.0) / sum.clone()),
    );
    b.for_threads("p", chunk.clone() / u(2), |b, p| {
        let c = b.let_("c", p * u(2));
        let write = |b: &mut KernelBuilder| {
            let y0 = b.var("y0", f(0.0));
            let y1 = b.var("y1", f(0.0));
            b.for_("gi", u(0), groups.clone(), u(1), |b, gi| {
                let wg = b.let_("wg", exp_fast(sh_m.at(gi.clone()) - mx.clone()));
                let at = b.let_("at", gi * chunk.clone() + c.clone());
                b.set(&y0, y0.clone() + wg.clone() * sh_o.at(at.clone()));
                b.set(&y1, y1.clone() + wg * sh_o.at(at + u(1)));
            });
            b.store_word(
                out,
                (row.clone() * u(dv) + c0.clone() + c.clone()) / u(2),
                pack_bf16x2(y0.clone() * inv.clone(), y1.clone() * inv.clone()),
            );
        };
        if ragged {
            b.if_((c0.clone() + c.clone()).lt(u(dv)), write);
        } else {
            write(b);
        }
    });
    b.if_(lid.eq_(u(0)).and(z.eq_(u(0))), |b| {
        b.store(
            lse_out,
            lse_at.clone(),
            select(
                empty.clone(),
                f(f32::INFINITY),
                mx.clone() + log(sum.clone().max(f(1e-30))),
            ),
        );
    });
}
