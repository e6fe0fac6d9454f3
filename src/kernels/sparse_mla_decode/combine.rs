//! The combine kernel: one workgroup per (head, token) merges a row's split partials.

use super::DecodeConfig;
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Kernel, Ty};
use crate::kir::ops::{combine_lse, is_masked};
use crate::Result;

/// The combine kernel: one workgroup per (head, token).
pub fn combine_kernel(cfg: &DecodeConfig) -> Result<Kernel> {
    let dv = cfg.dims.d_v();
    let mut b = KernelBuilder::new(cfg.combine_name(), cfg.threads);
    b.doc(format!(
        "Sparse MLA decode, combine stage: merges S normalised partials of width {dv}."
    ));
    b.doc("Grid: x = heads, y = tokens.".to_string());
    b.doc("lse = logsumexp_s lse_s; out = sum_s exp(lse_s - lse) o_s; all splits empty: out 0, lse +inf.".to_string());
    b.doc("lse[t, h] goes to ((t / lse_s_q) * heads + h) * lse_s_q + t % lse_s_q: lse_s_q = 1 gives [tokens, heads], lse_s_q = s_q FlashMLA's [batch, heads, s_q].".to_string());
    let heads = b.param("heads", Ty::U32, "H");
    let splits = b.param("splits", Ty::U32, "S");
    let lse_s_q = b.param(
        "lse_s_q",
        Ty::U32,
        "lse layout [tokens / lse_s_q, heads, lse_s_q]; 1 = [tokens, heads]",
    );
    let o_part = b.buffer(
        "o_part",
        Elem::F32,
        Access::Read,
        &format!("[tokens, heads, splits, {dv}]"),
    );
    let lse_part = b.buffer(
        "lse_part",
        Elem::F32,
        Access::Read,
        "[tokens, heads, splits]",
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

    let h = b.let_("h", workgroup_id(0));
    let t = b.let_("t", workgroup_id(1));
    let row = b.let_("row", t.clone() * heads.clone() + h.clone());
    let lse_at = b.let_(
        "lse_at",
        (t.clone() / lse_s_q.clone() * heads + h) * lse_s_q.clone() + t % lse_s_q,
    );
    let (lse, empty) = combine_lse(&mut b, splits.clone(), |_, s| {
        lse_part.at(row.clone() * splits.clone() + s)
    });
    // The loads are not behind a branch: every split's workgroup writes its o_part rows (0
    // for an empty split), so each is in bounds and initialised, and an empty split gets
    // weight 0. Behind `if (!masked)` each iteration's loads waited for the previous one's:
    // at T = 1 the combine took longer than the split kernel (ncu, H200; benches/NOTES.md).
    b.comment("weighted sum of the partial outputs, two columns per thread step");
    b.for_threads("c2", u(dv / 2), |b, c2| {
        let c = b.let_("c", c2 * u(2));
        let a0 = b.var("acc0", f(0.0));
        let a1 = b.var("acc1", f(0.0));
        b.for_("s", u(0), splits.clone(), u(1), |b, s| {
            let part = b.let_("part", row.clone() * splits.clone() + s);
            let ls = b.let_("part_lse", lse_part.at(part.clone()));
            let at = b.let_("at", part * u(dv) + c.clone());
            let (o0, o1) = (o_part.at(at.clone()), o_part.at(at + u(1)));
            let w = b.let_(
                "w",
                select(is_masked(ls.clone()), f(0.0), exp(ls - lse.clone())),
            );
            b.set(&a0, a0.clone() + w.clone() * o0);
            b.set(&a1, a1.clone() + w * o1);
        });
        b.store_word(
            &out,
            (row.clone() * u(dv) + c) / u(2),
            pack_bf16x2(a0.clone(), a1.clone()),
        );
    });
    b.if_(local_id().eq_(u(0)), |b| {
        b.store(
            &lse_out,
            lse_at.clone(),
            select(empty.clone(), f(f32::INFINITY), lse.clone()),
        );
    });
    b.finish()
}
