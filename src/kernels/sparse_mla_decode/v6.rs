//! The v6 description of the split kernel, kept as the baseline (`mla-bench --baseline`):
//! fp8 rows dequantised into an f32 tile (held by the tensor-core lowering as hi + lo bf16
//! planes: two products), validity recomputed from the indices wherever it is needed. The
//! v6 tensor-core configurations ([`super::DecodeConfig::tensor_core_v6`]) lower it with
//! [`crate::kir::Lowering::Mma`].

use super::io::{declare, owner, write_outputs, SplitIo};
use super::merge;
use super::{DecodeConfig, SplitForm};
use crate::kir::builder::*;
use crate::kir::ir::{BLayout, Expr, Kernel, TileElem, Ty};
use crate::kir::ops::{online_softmax_update, SoftmaxState, MASKED};
use crate::mla::{CacheFormat, MlaDims, FP8_TILE};
use crate::Result;

/// The v6 split kernel.
pub fn split_kernel_v6(cfg: &DecodeConfig) -> Result<Kernel> {
    split_kernel_v6_with(cfg, SplitForm::Plain)
}

/// The v6 split kernel; `merged`: it merges its own partials ([`super::merge`]).
pub fn split_kernel_v6_with(cfg: &DecodeConfig, form: SplitForm) -> Result<Kernel> {
    let merged = form == SplitForm::Merged;
    let (d, dv) = (cfg.dims.d_qk(), cfg.dims.d_v());
    let row_words = cfg.row_words();
    let mut b = KernelBuilder::new(cfg.split_kernel_name(form), cfg.threads);
    let io = declare(&mut b, cfg, form == SplitForm::Whole);
    let extra = merged.then(|| merge::declare(&mut b));
    let SplitIo {
        heads,
        topk,
        num_slots,
        chunk,
        has_len,
        scale,
        page_size,
        row_stride,
        page_stride,
        q,
        cache,
        indices,
        topk_length,
        ..
    } = &io;
    let (heads, topk, num_slots, chunk, has_len, scale) = (
        heads.clone(),
        topk.clone(),
        num_slots.clone(),
        chunk.clone(),
        has_len.clone(),
        scale.clone(),
    );
    let (page_size, row_stride, page_stride) =
        (page_size.clone(), row_stride.clone(), page_stride.clone());
    let q_tile = b.shared_tile("q_tile", TileElem::Bf16, cfg.block_h, d);
    // bf16 rows are gathered straight into the K/V tile. fp8 rows are gathered raw into a
    // byte tile and dequantised into an f32 K/V tile: e4m3 × an arbitrary f32 scale is not a
    // bf16 value, and an f32 tile keeps the dequantised cache exact.
    let (kv_tile, raw_tile) = match cfg.format {
        CacheFormat::Bf16 => (
            b.shared_tile("kv_tile", TileElem::Bf16, cfg.block_n, d),
            None,
        ),
        CacheFormat::Fp8DsMla => (
            b.shared_tile("kv_tile", TileElem::F32, cfg.block_n, d),
            Some(b.shared_tile("raw_rows", TileElem::U8, cfg.block_n, row_words * 4)),
        ),
    };
    let p_tile = b.shared_tile("p_tile", cfg.p_elem, cfg.block_h, cfg.block_n);
    let s = b.acc_tile("scores", cfg.block_h, cfg.block_n);
    let o = b.acc_tile("o_acc", cfg.block_h, dv);
    let st = SoftmaxState::declare(&mut b, cfg.block_h);

    let own = owner(&mut b, &io);
    let (t, split) = (own.t.clone(), own.split.clone());
    let h0 = b.let_("h0", workgroup_id(0) * u(cfg.block_h));
    let j_begin = b.let_("j_begin", split.clone() * chunk.clone());
    let chunk_end = j_begin.clone() + chunk;
    // a whole token's workgroup walks the whole list
    let j_end = b.let_(
        "j_end",
        match io.whole_tokens {
            Some(_) => select(own.whole.clone(), topk.clone(), chunk_end),
            None => chunk_end,
        }
        .min(topk.clone()),
    );
    let steps = b.let_(
        "steps",
        select(
            j_end.clone().gt(j_begin.clone()),
            (j_end.clone() - j_begin.clone() + u(cfg.block_n - 1)) / u(cfg.block_n),
            u(0),
        ),
    );
    // topk_length[t] clamped to [0, topk]; read at index 0 of the dummy when absent.
    let len_raw = b.let_(
        "len_raw",
        topk_length.at(select(has_len.clone().ne_(u(0)), t.clone(), u(0))),
    );
    let valid_len = b.let_(
        "valid_len",
        select(
            has_len.ne_(u(0)),
            len_raw.max(i(0)).as_u32().min(topk.clone()),
            topk.clone(),
        ),
    );

    // The one place the validity rule is written for the kernels: entry j of token t.
    let slot_of = |j: Expr| -> (Expr, Expr) {
        let jj = j.clone().min(topk.clone() - u(1));
        let idx = indices.at(t.clone() * topk.clone() + jj);
        // the index first: its read (clamped, always in bounds) need not wait for
        // topk_length's, as it would behind `j < valid_len` in a short-circuit `&&`
        let valid = idx
            .clone()
            .ge(i(0))
            .and(idx.clone().as_u32().lt(num_slots.clone()))
            .and(j.clone().lt(j_end.clone()))
            .and(j.lt(valid_len.clone()));
        (valid, idx)
    };

    b.comment("load the q rows of this head block (rows past `heads` are zeros)");
    b.gather_rows(&q_tile, 0, d / 2, q, |_, r| {
        let h = h0.clone() + r;
        select(
            h.clone().lt(heads.clone()),
            ((t.clone() * heads.clone() + h) * u(d / 2)).as_i32(),
            i(-1),
        )
    });
    st.init(&mut b);
    b.acc_fill(&o, 0.0);

    b.pipeline(
        "step",
        steps,
        |b, step| {
            b.comment("gather this step's cache rows by slot (invalid slots: zero rows, not read)");
            let dst = raw_tile.as_ref().unwrap_or(&kv_tile);
            b.gather_rows(dst, 0, row_words, cache, |_, r| {
                let j = j_begin.clone() + step.clone() * u(cfg.block_n) + r;
                let (valid, idx) = slot_of(j);
                let slot = idx.as_u32();
                let word = slot.clone() / page_size.clone() * page_stride.clone()
                    + slot % page_size.clone() * row_stride.clone();
                select(valid, word.as_i32(), i(-1))
            });
        },
        |b, step| {
            if let Some(raw) = &raw_tile {
                dequant_fp8_rows(b, cfg.dims, raw, &kv_tile);
            }
            b.comment("scores S = q . K^T over the full d_qk");
            b.acc_fill(&s, 0.0);
            b.mma(&s, q_tile.all(), kv_tile.cols(0, d), BLayout::NK);
            b.comment("scale, and mask invalid entries");
            b.acc_for_each(&s, |b, e| {
                for (k, v) in [(0, &e.v0), (1, &e.v1)] {
                    let j = b.let_(
                        "j",
                        j_begin.clone() + step.clone() * u(cfg.block_n) + e.col.clone() + u(k),
                    );
                    let (valid, _) = slot_of(j);
                    b.set(v, select(valid, v.clone() * scale.clone(), f(MASKED)));
                }
            });
            online_softmax_update(b, &st, &s, &[&o], &p_tile);
            b.comment("O += P . V, V = the first d_v columns of the gathered rows");
            b.mma(&o, p_tile.all(), kv_tile.cols(0, dv), BLayout::KN);
        },
    );

    let own = write_outputs(&mut b, cfg, &io, (&own, &h0), &st, &[(&o, 0)]);
    if let Some(extra) = &extra {
        merge::merge_in_kernel(&mut b, cfg, &io, extra, &own);
    }
    b.finish()
}

/// Dequantise gathered `fp8_ds_mla` rows (`raw`, bytes) into the f32 K/V tile `kv`:
/// latent column `c` is `e4m3(byte c) × scale[c / 128]` (the scale being the f32 in word
/// `latent / 4 + c / 128` of the row), rope column `latent + i` the bf16 at byte
/// `latent + 4·tiles + 2i`. A zero-filled row (an invalid slot) dequantises to zeros.
fn dequant_fp8_rows(b: &mut KernelBuilder, dims: MlaDims, raw: &STile, kv: &STile) {
    let (latent, rope) = (dims.latent, dims.rope);
    let tiles = latent / FP8_TILE;
    b.comment("dequantise the fp8 rows: latent = e4m3 x its tile's f32 scale, rope = bf16");
    b.shared_map_cols(kv, 0, latent, |_, r, c| {
        let byte = raw.at(r.clone(), c.clone()).cvt(Ty::F8E4M3).as_f32();
        let scale = f32_from_bits(raw.word(r, u(latent / 4) + c / u(FP8_TILE)));
        byte * scale
    });
    b.shared_map_cols(kv, latent, rope, |_, r, c| {
        let i = c - u(latent);
        let word = raw.word(r, u(latent / 4 + tiles) + i.clone() / u(2));
        let half = (word >> ((i & u(1)) * u(16))) & u(0xFFFF);
        f32_from_bits(half << u(16))
    });
}
