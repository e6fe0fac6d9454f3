//! What both descriptions of the split kernel share: the header lines, parameters and
//! buffers (the launch interface, fixed), and the epilogue that writes a split's rows.

use super::{DecodeConfig, Lowering};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Ty};
use crate::kir::ops::{SoftmaxState, MASKED};
use crate::mla::CacheFormat;

/// The split kernel's parameters and buffers.
pub(super) struct SplitIo {
    pub heads: Expr,
    pub topk: Expr,
    pub num_slots: Expr,
    pub splits: Expr,
    pub chunk: Expr,
    /// W, the tokens run whole before the split ones (a multiple of `splits`): only in the
    /// whole-token form ([`super::DecodeConfig::whole_name`]).
    pub whole_tokens: Option<Expr>,
    pub has_len: Expr,
    pub scale: Expr,
    pub page_size: Expr,
    pub row_stride: Expr,
    pub page_stride: Expr,
    pub lse_s_q: Expr,
    pub q: Buf,
    pub cache: Buf,
    pub indices: Buf,
    pub topk_length: Buf,
    pub out: Buf,
    pub lse_out: Buf,
    pub o_part: Buf,
    pub lse_part: Buf,
}

/// Header lines, parameters and buffers of the split kernel of `cfg`; `whole`: its
/// whole-token form (a `whole_tokens` parameter and the grid that goes with it).
pub(super) fn declare(b: &mut KernelBuilder, cfg: &DecodeConfig, whole: bool) -> SplitIo {
    let (d, dv) = (cfg.dims.d_qk(), cfg.dims.d_v());
    b.doc(format!(
        "Sparse MLA decode, split stage: cache {} ({} B/row), d_qk {d}, d_v {dv}, {} heads x {} slots per step, {} lowering.",
        cfg.format.name(),
        cfg.format.row_bytes(cfg.dims),
        // (a description of one group of heads: the workgroup's)
        cfg.block_h * cfg.head_groups(),
        cfg.block_n,
        cfg.lowering.name()
    ));
    if !whole {
        b.doc("Grid: x = ceil(heads / block_h) head blocks, y = splits, z = tokens.".to_string());
    } else {
        b.doc("Grid: x = ceil(heads / block_h) head blocks, y = splits, z = whole_tokens / splits + tokens - whole_tokens.".to_string());
        b.doc("Tokens [0, whole_tokens) run whole, one workgroup each (z < whole_tokens / splits: token z * splits + y), and write out and lse; token whole_tokens + z' (z' = z - whole_tokens / splits) is split, split y. whole_tokens = 0: z = token.".to_string());
    }
    b.doc(
        "Invalid index (< 0, >= num_slots, or j >= topk_length[t]): masked, never read."
            .to_string(),
    );
    b.doc("Row of slot s at word (s / page_size) * page_stride_w + (s % page_size) * row_stride_w of kv_cache.".to_string());
    if cfg.format == CacheFormat::Fp8DsMla {
        b.doc("fp8_ds_mla row, 656 bytes: [0,512) 512 x e4m3fn latent | [512,528) 4 x f32 scales, one per 128 values | [528,656) 64 x bf16 rope, unquantised.".to_string());
        b.doc("Dequant: c[i] = e4m3(byte[i]) * scale[i / 128] in f32 (e4m3fn: no infinities, 0x7f/0xff NaN, max 448); both scale flavours (pow2, arbitrary) read the same.".to_string());
    }
    b.doc(format!("splits = 1: writes out (bf16) and lse (f32; +inf for a row with no valid index) itself; splits > 1: per-split o_part (normalised, f32) and lse_part (-3e38 when the split is empty){} for the combine. The buffers of the other case are bound but not touched.", if whole { " of the split tokens, token whole_tokens + i at partial row i," } else { "" }));
    b.doc("lse[t, h] goes to ((t / lse_s_q) * heads + h) * lse_s_q + t % lse_s_q: lse_s_q = 1 gives [tokens, heads], lse_s_q = s_q FlashMLA's [batch, heads, s_q].".to_string());

    let tokens = b.param("tokens", Ty::U32, "T, query tokens (batch x s_q)");
    let heads = b.param("heads", Ty::U32, "H, query heads");
    let topk = b.param("topk", Ty::U32, "top-k entries per token");
    let num_slots = b.param("num_slots", Ty::U32, "num_pages x page_size");
    let splits = b.param("splits", Ty::U32, "S, splits of the top-k list");
    let chunk = b.param(
        "chunk",
        Ty::U32,
        "top-k entries per split (multiple of block_n)",
    );
    let whole_tokens = whole.then(|| {
        b.param(
            "whole_tokens",
            Ty::U32,
            "W, tokens run whole before the split ones: a multiple of splits, at most tokens",
        )
    });
    let has_len = b.param("has_topk_length", Ty::U32, "1: topk_length is given");
    let scale = b.param("scale", Ty::F32, "softmax scale");
    let page_size = b.param("page_size", Ty::U32, "slots per page");
    let row_stride = b.param(
        "row_stride_w",
        Ty::U32,
        "32-bit words from one cache row to the next",
    );
    let page_stride = b.param(
        "page_stride_w",
        Ty::U32,
        "32-bit words from one cache page to the next",
    );
    let lse_s_q = b.param(
        "lse_s_q",
        Ty::U32,
        "lse layout [tokens / lse_s_q, heads, lse_s_q]; 1 = [tokens, heads] (splits = 1)",
    );
    let _ = tokens;

    let q = b.buffer(
        "q",
        Elem::Bf16,
        Access::Read,
        &format!("[tokens, heads, {d}]"),
    );
    let cache_elem = match cfg.format {
        CacheFormat::Bf16 => Elem::Bf16,
        CacheFormat::Fp8DsMla => Elem::U8,
    };
    let cache = b.buffer(
        "kv_cache",
        cache_elem,
        Access::Read,
        &format!(
            "[num_pages, page_size, {}] {} rows (strided)",
            cfg.format.row_bytes(cfg.dims),
            cfg.format.name()
        ),
    );
    let indices = b.buffer("indices", Elem::I32, Access::Read, "[tokens, topk] slots");
    let topk_length = b.buffer(
        "topk_length",
        Elem::I32,
        Access::Read,
        "[tokens] (any 1-element buffer when has_topk_length = 0)",
    );
    let out = b.buffer(
        "out",
        Elem::Bf16,
        Access::ReadWrite,
        &format!("[tokens, heads, {dv}] (splits = 1)"),
    );
    let lse_out = b.buffer(
        "lse",
        Elem::F32,
        Access::ReadWrite,
        "[tokens / lse_s_q, heads, lse_s_q] (splits = 1)",
    );
    let part_tokens = if whole {
        "tokens - whole_tokens"
    } else {
        "tokens"
    };
    let o_part = b.buffer(
        "o_part",
        Elem::F32,
        Access::ReadWrite,
        &format!("[{part_tokens}, heads, splits, {dv}] (splits > 1)"),
    );
    let lse_part = b.buffer(
        "lse_part",
        Elem::F32,
        Access::ReadWrite,
        &format!("[{part_tokens}, heads, splits] (splits > 1)"),
    );

    SplitIo {
        heads,
        topk,
        num_slots,
        splits,
        chunk,
        whole_tokens,
        has_len,
        scale,
        page_size,
        row_stride,
        page_stride,
        lse_s_q,
        q,
        cache,
        indices,
        topk_length,
        out,
        lse_out,
        o_part,
        lse_part,
    }
}

/// Which token and split a split-kernel workgroup owns.
#[derive(Clone)]
pub(super) struct Owner {
    /// The token.
    pub t: Expr,
    /// Its split (0 for a whole token).
    pub split: Expr,
    /// The token runs whole: this workgroup writes out and lse itself.
    pub whole: Expr,
    /// The token's row block in the partials, `t - whole_tokens` (split tokens only).
    pub part_t: Expr,
}

/// The token and split of this workgroup: tokens [0, W) whole, `splits` of them a z-index
/// (token `z · splits + y`); the rest split, token `W + z - W / splits`, split `y`. With
/// `W` = 0 that is the plain grid (z the token, y the split).
///
/// Only the whole-token form maps (its own kernel, launched only for plans with whole
/// tokens): in every kernel a token that is not `blockIdx.z` cost the 32-head v7 kernel 5 %
/// at H 128 on an H100 (the same registers, another schedule of its loop; benches/NOTES.md
/// v37), so the plain kernels keep the plain grid.
pub(super) fn owner(b: &mut KernelBuilder, io: &SplitIo) -> Owner {
    let Some(w) = io.whole_tokens.clone() else {
        b.comment("which token, split and head block this workgroup owns");
        let t = b.let_("t", workgroup_id(2));
        return Owner {
            t: t.clone(),
            split: b.let_("split", workgroup_id(1)),
            whole: Expr::Bool(false),
            part_t: t,
        };
    };
    b.comment("which token and split this workgroup owns: the first whole_tokens tokens whole, splits of them per z; the rest split, one split per y");
    let (z, y) = (workgroup_id(2), workgroup_id(1));
    let whole_z = b.let_("whole_z", w.clone() / io.splits.clone());
    let whole = b.let_("whole", z.clone().lt(whole_z.clone()));
    let t = b.let_(
        "t",
        select(
            whole.clone(),
            z.clone() * io.splits.clone() + y.clone(),
            w.clone() + z - whole_z,
        ),
    );
    let split = b.let_("split", select(whole.clone(), u(0), y));
    Owner {
        part_t: t.clone() - w,
        t,
        split,
        whole,
    }
}

/// Normalise the output accumulators (`(acc, first output column)`) and write this split's
/// rows and lse. Of [`owner`]'s values only the token `t` is carried across the step loop:
/// the rest is worked out again here (whole: `t < W`; split: y), since carried they cost the
/// 255-register kernels a spill on sm_120. Returns them (for the merge).
pub(super) fn write_outputs(
    b: &mut KernelBuilder,
    cfg: &DecodeConfig,
    io: &SplitIo,
    (own, h0): (&Owner, &Expr),
    st: &SoftmaxState,
    outs: &[(&Acc, u32)],
) -> Owner {
    let t = &own.t;
    let own = match &io.whole_tokens {
        None => own.clone(),
        Some(w) => Owner {
            t: t.clone(),
            // a split token's split (not read for a whole one)
            split: workgroup_id(1),
            whole: b.let_("whole_token", t.clone().lt(w.clone())),
            part_t: b.let_("part_t", t.clone() - w.clone()),
        },
    };
    let dv = cfg.dims.d_v();
    let (heads, splits) = (&io.heads, &io.splits);
    // One kernel for both cases (no `_final` copy): the branch is uniform over the grid, and
    // each side is whole (one branch per element kept the fp8 scalar kernel, at its register
    // cap, 4 bytes over on sm_120).
    let (t, split, part_t) = (&own.t, &own.split, &own.part_t);
    let single = splits.clone().eq_(u(1));
    let single = b.let_(
        "single",
        match io.whole_tokens {
            Some(_) => single.or(own.whole.clone()),
            None => single,
        },
    );
    // The tensor-core kernels write each row's lse first, then l's reciprocal in l's place
    // (l is not read again), so that the rows multiply instead of each element dividing:
    // one division per row, not one per element pair (at T = 1 the epilogue was a fifth of
    // the split kernel's time, ncu, H200). The scalar kernels keep dividing per element,
    // rows first: their accumulators would live across the extra barrier, and the fp8 one,
    // at its register cap, spilled.
    let per_row = !matches!(cfg.lowering, Lowering::Scalar);
    let inv_of = |l: Expr| select(l.clone().gt(f(0.0)), f(1.0) / l, f(0.0));
    let lse = |b: &mut KernelBuilder, final_out: bool| {
        b.for_threads("r", u(cfg.block_h), |b, r| {
            let h = b.let_("h", h0.clone() + r.clone());
            let l = b.let_("l", st.l.at(r.clone()));
            b.if_(h.clone().lt(heads.clone()), |b| {
                let empty = if final_out {
                    f(f32::INFINITY)
                } else {
                    f(MASKED)
                };
                let v = select(
                    l.clone().gt(f(0.0)),
                    st.m.at(r.clone()) + log(l.clone().max(f(1e-30))),
                    empty,
                );
                if final_out {
                    let s_q = &io.lse_s_q;
                    let at = (t.clone() / s_q.clone() * heads.clone() + h) * s_q.clone()
                        + t.clone() % s_q.clone();
                    b.store(&io.lse_out, at, v);
                } else {
                    b.store(
                        &io.lse_part,
                        (part_t.clone() * heads.clone() + h) * splits.clone() + split.clone(),
                        v,
                    );
                }
            });
            if per_row {
                b.shared_store(&st.l, r, inv_of(l));
            }
        });
    };
    // bf16 tensor-core kernels: each row's 1/l read outside the row guard (e.row < block_h:
    // always in the array), so the compiler loads it once for all of the row's pairs (in the
    // guard every pair waited on its own shared load: 13 % of the v6 T = 1 split kernel's
    // stall samples), and each partial pair written as one 8-byte store. Together 0.99–1.08x
    // on the bf16 rows, 1.02–1.08x at T <= 8 (H200, benches/NOTES.md v17). fp8_ds_mla keeps the form below: its O
    // accumulators are interleaved (a thread holds four adjacent columns), and there the
    // 8-byte stores made the 32-head split kernel 0.91x (ncu: the epilogue waited on the
    // stores' register release); the hoist alone was slower on every kernel.
    let pair_store = per_row && cfg.format == CacheFormat::Bf16;
    let rows = |b: &mut KernelBuilder, final_out: bool| {
        for (o, col0) in outs {
            b.acc_for_each(o, |b, e| {
                let h = b.let_("h", h0.clone() + e.row.clone());
                let scaled = |b: &mut KernelBuilder| {
                    let l = st.l.at(e.row.clone());
                    let inv = b.let_("inv_l", if per_row { l } else { inv_of(l) });
                    (e.v0.clone() * inv.clone(), e.v1.clone() * inv)
                };
                let hoisted = pair_store.then(|| scaled(b));
                b.if_(h.clone().lt(heads.clone()), |b| {
                    let (y0, y1) = match &hoisted {
                        Some(y) => y.clone(),
                        None => scaled(b),
                    };
                    let col = e.col.clone() + u(*col0);
                    if final_out {
                        let at = (t.clone() * heads.clone() + h) * u(dv) + col;
                        b.store_word(&io.out, at / u(2), pack_bf16x2(y0, y1));
                    } else {
                        let at = ((part_t.clone() * heads.clone() + h) * splits.clone()
                            + split.clone())
                            * u(dv)
                            + col;
                        let at = b.let_("at", at);
                        if pair_store {
                            // col is even (a fragment's pair), d_v even: one 8-byte store
                            b.store_f32x2(&io.o_part, at, y0, y1);
                        } else {
                            b.store(&io.o_part, at.clone(), y0);
                            b.store(&io.o_part, at + u(1), y1);
                        }
                    }
                });
            });
        }
    };
    let both = |b: &mut KernelBuilder, final_out: bool| {
        b.comment(if final_out {
            "one split: the rows normalised into out, and lse"
        } else {
            "this split's rows normalised into the partials, and its lse"
        });
        if per_row {
            lse(b, final_out);
            b.barrier();
            rows(b, final_out);
        } else {
            rows(b, final_out);
            lse(b, final_out);
        }
    };
    b.if_else(single, |b| both(b, true), |b| both(b, false));
    own
}
