//! The split kernel (v7): attention of `block_h` heads of one token over one chunk of its
//! top-k list, `block_n` slots per step.
//!
//! Per step: gather the step's cache rows by slot, with each row's validity recorded once
//! beside them (`row_valid`); `S = q · Kᵀ`; mask by the recorded validity; online softmax;
//! `O += P · V`. The chunk is cut at `topk_length[t]`, so steps past it are not taken.
//!
//! fp8_ds_mla is **one product**, its rows never dequantised into a tile: the e4m3 latent
//! bytes are the operand (exact in bf16) and each 128-wide tile's scale is folded into the
//! product, `S = Σ_tiles scale_tile · (q_tile · E_tileᵀ) + q_rope · ropeᵀ` and
//! `O_tile += P · (E_tile · scale_tile)` ([`KernelBuilder::mma_scaled`]), so the scores stay
//! f32-exact up to the accumulation and the bytes a step moves are the row's 656.

use super::io::{declare, owner, write_outputs};
use super::merge;
use super::{DecodeConfig, Fp8Values, SplitForm};
use crate::kir::builder::*;
use crate::kir::ir::{BLayout, Expr, Kernel, TileElem, Ty};
use crate::kir::ops::{online_softmax_update, SoftmaxState, MASKED};
use crate::kir::Lowering;
use crate::mla::{CacheFormat, FP8_TILE};
use crate::Result;

/// The v7 split kernel.
pub fn split_kernel_v7(cfg: &DecodeConfig) -> Result<Kernel> {
    split_kernel_v7_with(cfg, SplitForm::Plain)
}

/// The v7 split kernel in `form` (merged: one warp group only).
pub fn split_kernel_v7_with(cfg: &DecodeConfig, form: SplitForm) -> Result<Kernel> {
    let merged = form == SplitForm::Merged;
    // with warp groups, the description is one group's work (the lowering replicates it):
    // its threads, and, where the groups split the heads, its heads
    let mut b = KernelBuilder::new(cfg.split_kernel_name(form), cfg.threads / cfg.groups());
    let cfg = &cfg.group_view();
    let (d, dv) = (cfg.dims.d_qk(), cfg.dims.d_v());
    let (latent, rope) = (cfg.dims.latent, cfg.dims.rope);
    let (bh, bn) = (cfg.block_h, cfg.block_n);
    let io = declare(&mut b, cfg, form == SplitForm::Whole);
    let extra = merged.then(|| merge::declare(&mut b));
    if cfg.format == CacheFormat::Fp8DsMla {
        b.doc("fp8_ds_mla as one product: e4m3 bytes are the operand (exact in bf16), each tile's scale folded into S and into P . V.".to_string());
    }

    let q_tile = b.shared_tile("q_tile", TileElem::Bf16, bh, d);
    let valid_flags = b.shared_tile("row_valid", TileElem::F32, 1, bn);
    // bf16 rows: one tile. fp8_ds_mla rows: the three parts of the row, as they are.
    enum Rows {
        Bf16(STile),
        Fp8 {
            latent: STile,
            scales: STile,
            rope: STile,
            /// `latent` holds whole rows (the scales and rope are its typed windows).
            whole: bool,
        },
    }
    let rows = match cfg.format {
        CacheFormat::Bf16 => Rows::Bf16(b.shared_tile("kv_tile", TileElem::Bf16, bn, d)),
        // Tensor cores: each row whole in one tile, the scales and the rope typed windows of
        // it, so a row is one copy. Three copies per row (512 + 16 + 128 bytes) cost 1.25x at
        // H 128 and 1.34x on the large-batch kernel (H200, benches/NOTES.md v15): the
        // producers issue bulk copies one lane at a time.
        CacheFormat::Fp8DsMla if cfg.lowering != Lowering::Scalar => {
            let row_bytes = cfg.format.row_bytes(cfg.dims);
            let whole = b.shared_tile("kv_rows", TileElem::E4m3, bn, row_bytes);
            let scales = b.shared_alias(
                &whole,
                "kv_scales",
                TileElem::F32,
                latent,
                latent / FP8_TILE,
            );
            let rope = b.shared_alias(
                &whole,
                "kv_rope",
                TileElem::Bf16,
                latent + 4 * (latent / FP8_TILE),
                rope,
            );
            Rows::Fp8 {
                latent: whole,
                scales,
                rope,
                whole: true,
            }
        }
        CacheFormat::Fp8DsMla => Rows::Fp8 {
            latent: b.shared_tile("kv_latent", TileElem::E4m3, bn, latent),
            scales: b.shared_tile("kv_scales", TileElem::F32, bn, latent / FP8_TILE),
            rope: b.shared_tile("kv_rope", TileElem::Bf16, bn, rope),
            whole: false,
        },
    };
    // fp8_ds_mla's values for P . V decoded once a step, bf16(e4m3 x scale), into a tile
    // that every warp reads (`Fp8Values::Shared`): the values each warp otherwise widens
    // from the raw rows itself, the same rounding. (The scores keep the raw bytes: rounded
    // to bf16 with an arbitrary scale, K misses the lse tolerance, benches/NOTES.md v4.)
    let v_tile = match &rows {
        Rows::Fp8 { whole: true, .. } if cfg.fp8_values == Fp8Values::Shared => {
            Some(b.shared_tile("v_tile", TileElem::Bf16, bn, dv))
        }
        _ => None,
    };
    let p_tile = b.shared_tile("p_tile", cfg.p_elem, bh, bn);
    let s = b.acc_tile("scores", bh, bn);
    // one accumulator where V is a bf16 tile; for fp8's raw rows one per scale tile
    let outs: Vec<(Acc, u32)> = if cfg.format == CacheFormat::Bf16 || v_tile.is_some() {
        vec![(b.acc_tile("o_acc", bh, dv), 0)]
    } else {
        (0..latent / FP8_TILE)
            .map(|k| (b.acc_tile("o_acc", bh, FP8_TILE), k * FP8_TILE))
            .collect()
    };
    let st = SoftmaxState::declare(&mut b, bh);

    let own = owner(&mut b, &io);
    let (t, split) = (own.t.clone(), own.split.clone());
    let h0 = b.let_("h0", workgroup_id(0) * u(bh));
    let (topk, has_len) = (io.topk.clone(), io.has_len.clone());
    // topk_length[t] clamped to [0, topk]; read at index 0 of the dummy when absent.
    let len_raw = b.let_(
        "len_raw",
        io.topk_length
            .at(select(has_len.clone().ne_(u(0)), t.clone(), u(0))),
    );
    let valid_len = b.let_(
        "valid_len",
        select(
            has_len.ne_(u(0)),
            len_raw.max(i(0)).as_u32().min(topk.clone()),
            topk.clone(),
        ),
    );
    let j_begin = b.let_("j_begin", split.clone() * io.chunk.clone());
    let chunk_end = (j_begin.clone() + io.chunk.clone()).min(topk.clone());
    // a whole token's workgroup walks the whole list
    let chunk_end = b.let_(
        "chunk_end",
        match io.whole_tokens {
            Some(_) => select(own.whole.clone(), topk.clone(), chunk_end),
            None => chunk_end,
        },
    );
    // entries past topk_length are invalid: the chunk stops there
    let j_end = b.let_("j_end", chunk_end.clone().min(valid_len));
    let steps_to = |end: &Expr| {
        select(
            end.clone().gt(j_begin.clone()),
            (end.clone() - j_begin.clone() + u(bn - 1)) / u(bn),
            u(0),
        )
    };
    let steps = b.let_("steps", steps_to(&j_end));
    // The chunk's steps before topk_length is known: the index reads of a step below it are
    // in bounds (clamped to topk - 1), so the first step's need not wait for topk_length's.
    let steps_bound = b.let_("steps_bound", steps_to(&chunk_end));

    // The one place the validity rule is written: the cache word of entry j of token t, or
    // -1 when the entry is invalid (past the chunk or topk_length, negative, or >= num_slots).
    let row_word = |j: Expr, offset: u32| -> Expr {
        let jj = j.clone().min(topk.clone() - u(1));
        let idx = io.indices.at(t.clone() * topk.clone() + jj);
        let valid = j
            .lt(j_end.clone())
            .and(idx.clone().ge(i(0)))
            .and(idx.clone().as_u32().lt(io.num_slots.clone()));
        let slot = idx.as_u32();
        let word = slot.clone() / io.page_size.clone() * io.page_stride.clone()
            + slot % io.page_size.clone() * io.row_stride.clone()
            + u(offset);
        select(valid, word.as_i32(), i(-1))
    };

    b.comment("load the q rows of this head block (rows past `heads` are zeros)");
    let (heads, q) = (io.heads.clone(), io.q.clone());
    b.gather_rows(&q_tile, 0, d / 2, &q, |_, r| {
        let h = h0.clone() + r;
        select(
            h.clone().lt(heads.clone()),
            ((t.clone() * heads.clone() + h) * u(d / 2)).as_i32(),
            i(-1),
        )
    });
    st.init(&mut b);
    for (o, _) in &outs {
        b.acc_fill(o, 0.0);
    }

    let cache = io.cache.clone();
    let scale = io.scale.clone();
    b.pipeline_bounded(
        "step",
        steps,
        Some(steps_bound),
        |b, step| {
            b.comment("gather this step's cache rows by slot, each row's validity recorded once");
            let j_of = |r: Expr| j_begin.clone() + step.clone() * u(bn) + r;
            match &rows {
                Rows::Bf16(kv) => {
                    let words = kv.cols / 2;
                    b.gather_rows_flagged(kv, 0, words, &cache, &valid_flags, |_, r| {
                        row_word(j_of(r), 0)
                    });
                }
                Rows::Fp8 {
                    latent: lt,
                    whole: true,
                    ..
                } => {
                    let words = cfg.row_words();
                    b.gather_rows_flagged(lt, 0, words, &cache, &valid_flags, |_, r| {
                        row_word(j_of(r), 0)
                    });
                }
                Rows::Fp8 {
                    latent: lt,
                    scales,
                    rope: rp,
                    ..
                } => {
                    let (lat_w, sc_w) = (latent / 4, latent / FP8_TILE);
                    b.gather_rows_flagged(lt, 0, lat_w, &cache, &valid_flags, |_, r| {
                        row_word(j_of(r), 0)
                    });
                    b.gather_rows_flagged(scales, 0, sc_w, &cache, &valid_flags, |_, r| {
                        row_word(j_of(r), lat_w)
                    });
                    b.gather_rows_flagged(rp, 0, rope / 2, &cache, &valid_flags, |_, r| {
                        row_word(j_of(r), lat_w + sc_w)
                    });
                }
            }
        },
        |b, _| {
            b.comment("scores S = q . K^T over the full d_qk");
            b.acc_fill(&s, 0.0);
            match &rows {
                Rows::Bf16(kv) => b.mma(&s, q_tile.all(), kv.cols(0, d), BLayout::NK),
                Rows::Fp8 {
                    latent: lt,
                    scales,
                    rope: rp,
                    ..
                } => {
                    for k in 0..latent / FP8_TILE {
                        let c0 = k * FP8_TILE;
                        b.mma_scaled(
                            &s,
                            q_tile.cols(c0, FP8_TILE),
                            lt.cols(c0, FP8_TILE),
                            BLayout::NK,
                            |_, r| scales.at(r, u(k)),
                        );
                    }
                    b.mma(&s, q_tile.cols(latent, rope), rp.all(), BLayout::NK);
                }
            }
            b.comment("scale, and mask the entries whose rows had no source");
            b.acc_for_each(&s, |b, e| {
                for (k, v) in [(0, &e.v0), (1, &e.v1)] {
                    let valid = valid_flags.at(u(0), e.col.clone() + u(k)).gt(f(0.5));
                    b.set(v, select(valid, v.clone() * scale.clone(), f(MASKED)));
                }
            });
            let out_accs: Vec<&Acc> = outs.iter().map(|(o, _)| o).collect();
            online_softmax_update(b, &st, &s, &out_accs, &p_tile);
            b.comment("O += P . V, V = the first d_v columns of the gathered rows");
            match (&rows, &v_tile) {
                (Rows::Bf16(kv), _) => b.mma(&outs[0].0, p_tile.all(), kv.cols(0, dv), BLayout::KN),
                (
                    Rows::Fp8 {
                        latent: lt, scales, ..
                    },
                    Some(vt),
                ) => {
                    b.comment("the step's values decoded once, for every warp");
                    b.dequant_rows(vt, lt, FP8_TILE, |_, r, g| scales.at(r, g));
                    b.mma(&outs[0].0, p_tile.all(), vt.all(), BLayout::KN);
                }
                (
                    Rows::Fp8 {
                        latent: lt, scales, ..
                    },
                    None,
                ) => {
                    for (k, (o, c0)) in outs.iter().enumerate() {
                        b.mma_scaled(
                            o,
                            p_tile.all(),
                            lt.cols(*c0, FP8_TILE),
                            BLayout::KN,
                            |_, r| scales.at(r, u(k as u32)),
                        );
                    }
                }
            }
        },
    );

    let outs: Vec<(&Acc, u32)> = outs.iter().map(|(o, c)| (o, *c)).collect();
    let own = write_outputs(&mut b, cfg, &io, (&own, &h0), &st, &outs);
    if let Some(extra) = &extra {
        merge::merge_in_kernel(&mut b, cfg, &io, extra, &own);
    }
    let _ = Ty::U32;
    b.finish()
}
