//! Sparse MLA decode over a virtual block table (DESIGN §3), described once.
//!
//! Two kernels:
//! - **split**: workgroup (head block, split, token) attends its `block_h` heads of token `t`
//!   over one chunk of the token's top-k list, `block_n` slots at a time: gather the rows,
//!   `S = q · Kᵀ`, mask, online softmax, `O += P · V` (V = the first `d_v` columns of the
//!   same rows). It writes either the final output (one split) or a normalised partial
//!   `(o_s, lse_s)` per split.
//! - **combine**: one workgroup per (token, head) merges the partials:
//!   `lse = logsumexp_s lse_s`, `out = Σ_s exp(lse_s − lse) · o_s`.
//!
//! Conventions from [`crate::mla`]: invalid indices are masked and never read; a row with
//! no valid index gets `out = 0`, `lse = +inf`; an empty split carries a masked lse.

use super::{pack_params, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, BLayout, Elem, Expr, Kernel, TileElem, Ty};
use crate::kir::ops::{combine_lse, is_masked, online_softmax_update, SoftmaxState, MASKED};
use crate::kir::Lowering;
use crate::mla::{CacheFormat, CacheGeometry, DecodeLayout, DecodeShape, MlaDims, FP8_TILE};
use crate::{Error, Result};
use std::sync::Arc;

/// Compile-time knobs of the decode kernels. Everything else (tokens, heads, topk, slots,
/// splits, scale) is a run-time parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeConfig {
    pub dims: MlaDims,
    pub format: CacheFormat,
    /// Heads per workgroup (rows of the q tile).
    pub block_h: u32,
    /// Top-k slots per step (rows of the gathered KV tile).
    pub block_n: u32,
    pub threads: u32,
    /// Element type of P (the A operand of P · V): f32 keeps the scalar path exact to f32.
    pub p_elem: TileElem,
    /// The split kernel writes the final output (only valid with one split).
    pub final_output: bool,
    pub lowering: Lowering,
}

impl DecodeConfig {
    /// The portable configuration: fits WebGPU's 16 KiB of workgroup memory and 256 threads.
    /// fp8 rows need a byte tile for the raw rows next to the f32 tile of dequantised ones,
    /// so fp8 takes 2 slots per step (15432 B) where bf16 takes 4 (14256 B).
    pub fn portable(dims: MlaDims, format: CacheFormat) -> Self {
        DecodeConfig {
            dims,
            format,
            block_h: 8,
            block_n: match format {
                CacheFormat::Bf16 => 4,
                CacheFormat::Fp8DsMla => 2,
            },
            threads: 128,
            p_elem: TileElem::F32,
            final_output: false,
            lowering: Lowering::Scalar,
        }
    }

    /// The scalar CUDA configuration (48 KB of static shared memory is always available):
    /// 16 slots per step for bf16 (39296 B), 8 for fp8 (43488 B with the raw-row tile).
    pub fn cuda_scalar(dims: MlaDims, format: CacheFormat) -> Self {
        DecodeConfig {
            dims,
            format,
            block_h: 16,
            block_n: match format {
                CacheFormat::Bf16 => 16,
                CacheFormat::Fp8DsMla => 8,
            },
            threads: 128,
            p_elem: TileElem::F32,
            final_output: false,
            lowering: Lowering::Scalar,
        }
    }

    /// The tensor-core configuration (CUDA, [`Lowering::Mma`]) for `heads` query heads. Every
    /// one fits SM120's 101376 bytes of shared memory per block (the lowering checks):
    /// - H ≤ 16 (memory-bound): 16 heads x 32 slots per step, a 2-deep ring of gathered rows
    ///   (2 x 37 KB) next to the q tile (18 KB);
    /// - H > 16: 32 heads x 32 slots in one stage: fewer CTAs read each row;
    /// - fp8_ds_mla: the same head blocks with rings of raw rows sized to fit beside the
    ///   dequantised tile.
    pub fn tensor_core(dims: MlaDims, format: CacheFormat, heads: u32) -> Self {
        // Measured on the H200 (benches/NOTES.md): the kernel is bound by per-step latency
        // (barriers, the online softmax), so few, large steps win over deep rings. 8 warps;
        // two workgroups per multiprocessor (<= 128 registers, <= 99 KB shared memory each
        // on an H100/H200; SM120 fits one). fp8 adds a ring of raw 656-byte rows beside the
        // tile they are dequantised into (two bf16 planes, hi + lo, of the f32 values).
        // H > 16, bf16: 32 slots per step in a single stage (75 KB) beat 16 in a 3-deep ring
        // by 1.3x; the other workgroup on the multiprocessor covers the gather latency.
        // H <= 16: the hint of 2 per multiprocessor is what their 95-99 KB of shared memory
        // allows anyway; without it ptxas aims at 3 (78-80 registers): fp8 then spilled on
        // sm_80, and both ran 1.07x (bf16) to 1.17x (fp8) slower at T = 128 on the H200.
        let (block_h, block_n, threads, stages, min_workgroups) = match (heads <= 16, format) {
            (true, CacheFormat::Bf16) => (16, 32, 256, 2, 2),
            (true, CacheFormat::Fp8DsMla) => (16, 16, 256, 4, 2),
            (false, CacheFormat::Bf16) => (32, 32, 256, 1, 2),
            (false, CacheFormat::Fp8DsMla) => (32, 16, 256, 2, 2),
        };
        DecodeConfig {
            dims,
            format,
            block_h,
            block_n,
            threads,
            p_elem: TileElem::Bf16,
            final_output: false,
            lowering: Lowering::Mma {
                stages,
                min_workgroups,
            },
        }
    }

    /// 32-bit words per cache row.
    pub fn row_words(&self) -> u32 {
        self.format.row_bytes(self.dims) / 4
    }

    fn suffix(&self) -> String {
        let lowering = match self.lowering {
            Lowering::Scalar => "scalar".to_string(),
            Lowering::Mma {
                stages,
                min_workgroups,
            } => {
                let occupancy = if min_workgroups > 0 {
                    format!("o{min_workgroups}")
                } else {
                    String::new()
                };
                format!("mma{stages}w{}{occupancy}", self.threads / 32)
            }
        };
        format!(
            "{}_d{}_{}_h{}n{}{}",
            self.format.name(),
            self.dims.d_qk(),
            lowering,
            self.block_h,
            self.block_n,
            if self.final_output { "_final" } else { "" }
        )
    }

    pub fn split_name(&self) -> String {
        format!("sparse_mla_decode_split_{}", self.suffix())
    }

    pub fn combine_name(&self) -> String {
        format!(
            "sparse_mla_decode_combine_d{}_t{}",
            self.dims.d_v(),
            self.threads
        )
    }
}

/// A config plus the run-time choice of splits for one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodePlan {
    pub config: DecodeConfig,
    pub splits: u32,
    /// Top-k entries per split (a multiple of `block_n`).
    pub chunk: u32,
}

impl DecodePlan {
    /// Choose splits so that the grid has about `target_workgroups` workgroups (e.g. a few per
    /// multiprocessor), never more splits than blocks of top-k; `splits` overrides.
    /// `max_steps` caps the `block_n` steps one workgroup may take (a device limit, see
    /// [`crate::runtime::gpu::Device::max_steps_per_workgroup`]); an override that breaks
    /// it is an error, not silently changed.
    pub fn new(
        config: DecodeConfig,
        shape: &DecodeShape,
        target_workgroups: u32,
        splits: Option<u32>,
        max_steps: Option<u32>,
    ) -> Result<Self> {
        let head_blocks = shape.heads.div_ceil(config.block_h);
        let blocks = shape.topk.div_ceil(config.block_n);
        let min_splits = max_steps.map(|m| blocks.div_ceil(m.max(1))).unwrap_or(1);
        let want = match splits {
            Some(0) => return Err(Error::arg("splits", "at least 1", 0)),
            Some(s) if s < min_splits => {
                return Err(Error::arg(
                    "splits",
                    format!(
                        "at least {min_splits} on this device (at most {} steps of {} slots per workgroup)",
                        max_steps.unwrap_or(0),
                        config.block_n
                    ),
                    s,
                ))
            }
            Some(s) => s,
            None => {
                let base = shape.tokens.saturating_mul(head_blocks).max(1);
                target_workgroups.div_ceil(base).clamp(1, 64).max(min_splits)
            }
        };
        let want = want.min(blocks).max(1);
        let chunk = blocks.div_ceil(want) * config.block_n;
        let splits = shape.topk.div_ceil(chunk);
        let mut config = config;
        config.final_output = splits == 1;
        Ok(DecodePlan {
            config,
            splits,
            chunk,
        })
    }

    /// The tensor-core plan ([`DecodeConfig::tensor_core`]) with splits from a cost model of
    /// the GPU: `resident` split workgroups run at once (multiprocessors x workgroups per
    /// multiprocessor). `splits` overrides the model.
    ///
    /// Time is counted in workgroup steps (one `block_n` gather + its math): a split count
    /// `s` costs `waves(s) x (steps(s) + FIXED)` plus, when `s > 1`, the combine (a launch,
    /// about a step, and the partials written and read again, in step-sized byte units).
    /// Small batches thus split until the GPU is full; large ones stay whole, with no combine.
    pub fn tensor_core(shape: &DecodeShape, resident: u32, splits: Option<u32>) -> Result<Self> {
        let config = DecodeConfig::tensor_core(shape.dims, shape.format, shape.heads);
        let splits = match splits {
            Some(s) => Some(s),
            None => Some(Self::model_splits(&config, shape, resident)),
        };
        Self::new(config, shape, resident, splits, None)
    }

    /// The split count the cost model of [`Self::tensor_core`] picks.
    pub fn model_splits(config: &DecodeConfig, shape: &DecodeShape, resident: u32) -> u32 {
        // Per-workgroup cost outside the step loop: q load, pipeline fill, epilogue.
        const FIXED: f64 = 2.0;
        let resident = resident.max(1) as u64;
        let blocks = shape.topk.div_ceil(config.block_n).max(1);
        let base = shape.tokens as u64 * shape.heads.div_ceil(config.block_h) as u64;
        let step_bytes =
            resident as f64 * (config.block_n * config.format.row_bytes(config.dims)) as f64;
        let rows = shape.tokens as f64 * shape.heads as f64;
        let mut best = (f64::MAX, 1);
        for s in 1..=blocks.min(128) {
            let steps = blocks.div_ceil(s) as f64;
            let waves = (base * s as u64).div_ceil(resident) as f64;
            let mut t = waves * (steps + FIXED);
            if s > 1 {
                // the combine: a launch, a dependent walk over the splits (4 in flight at a
                // time), and the partials written and read back
                let partial_bytes = rows * s as f64 * (config.dims.d_v() as f64 + 1.0) * 4.0 * 2.0;
                t += 1.0 + s as f64 / 16.0 + partial_bytes / step_bytes;
            }
            // a smaller count wins ties: less combine traffic for the same time
            if t < best.0 - 1e-9 {
                best = (t, s);
            }
        }
        best.1
    }

    pub fn grid_split(&self, shape: &DecodeShape) -> [u32; 3] {
        [
            shape.heads.div_ceil(self.config.block_h),
            self.splits,
            shape.tokens,
        ]
    }
}

/// Check the call's shape against what the kernels can address. Buffer sizes are checked by
/// the backend that owns them.
pub fn check_shape(shape: &DecodeShape, config: &DecodeConfig) -> Result<()> {
    shape.validate()?;
    if shape.dims != config.dims || shape.format != config.format {
        return Err(Error::arg(
            "config",
            format!("{:?} {:?}", shape.dims, shape.format),
            format!("{:?} {:?}", config.dims, config.format),
        ));
    }
    if shape.tokens > 65535 {
        return Err(Error::arg(
            "tokens",
            "at most 65535 per call (grid z limit)",
            shape.tokens,
        ));
    }
    let words = shape.num_slots() * config.row_words() as u64;
    if words >= i32::MAX as u64 {
        return Err(Error::arg(
            "cache",
            "fewer than 2^31 32-bit words per cache buffer (8 GiB); split the cache per layer",
            format!("{} words", words),
        ));
    }
    let q_words = shape.q_elems() / 2;
    if q_words >= i32::MAX as u64 {
        return Err(Error::arg(
            "q",
            "fewer than 2^31 words",
            format!("{} words", q_words),
        ));
    }
    Ok(())
}

/// The split kernel: attention of `block_h` heads of one token over one chunk of its top-k.
pub fn split_kernel(cfg: &DecodeConfig) -> Result<Kernel> {
    let (d, dv) = (cfg.dims.d_qk(), cfg.dims.d_v());
    let row_words = cfg.row_words();
    let mut b = KernelBuilder::new(cfg.split_name(), cfg.threads);
    b.doc(format!(
        "Sparse MLA decode, split stage: cache {} ({} B/row), d_qk {d}, d_v {dv}, {} heads x {} slots per step, {} lowering.",
        cfg.format.name(),
        cfg.format.row_bytes(cfg.dims),
        cfg.block_h,
        cfg.block_n,
        cfg.lowering.name()
    ));
    b.doc("Grid: x = ceil(heads / block_h) head blocks, y = splits, z = tokens.".to_string());
    b.doc(
        "Invalid index (< 0, >= num_slots, or j >= topk_length[t]): masked, never read."
            .to_string(),
    );
    b.doc("Row of slot s at word (s / page_size) * page_stride_w + (s % page_size) * row_stride_w of kv_cache.".to_string());
    if cfg.format == CacheFormat::Fp8DsMla {
        b.doc("fp8_ds_mla row, 656 bytes: [0,512) 512 x e4m3fn latent | [512,528) 4 x f32 scales, one per 128 values | [528,656) 64 x bf16 rope, unquantised.".to_string());
        b.doc("Dequant: c[i] = e4m3(byte[i]) * scale[i / 128] in f32 (e4m3fn: no infinities, 0x7f/0xff NaN, max 448); both scale flavours (pow2, arbitrary) read the same.".to_string());
    }
    if cfg.final_output {
        b.doc(
            "One split: writes out (bf16) and lse (f32; +inf for a row with no valid index)."
                .to_string(),
        );
        b.doc("lse[t, h] goes to ((t / lse_s_q) * heads + h) * lse_s_q + t % lse_s_q: lse_s_q = 1 gives [tokens, heads], lse_s_q = s_q FlashMLA's [batch, heads, s_q].".to_string());
    } else {
        b.doc("Writes per-split o_part (normalised, f32) and lse_part (-3e38 when the split is empty).".to_string());
    }

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
    let lse_s_q = cfg.final_output.then(|| {
        b.param(
            "lse_s_q",
            Ty::U32,
            "lse layout [tokens / lse_s_q, heads, lse_s_q]; 1 = [tokens, heads]",
        )
    });
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
    let (out, lse_out) = if cfg.final_output {
        (
            b.buffer(
                "out",
                Elem::Bf16,
                Access::ReadWrite,
                &format!("[tokens, heads, {dv}]"),
            ),
            b.buffer(
                "lse",
                Elem::F32,
                Access::ReadWrite,
                "[tokens / lse_s_q, heads, lse_s_q]",
            ),
        )
    } else {
        (
            b.buffer(
                "o_part",
                Elem::F32,
                Access::ReadWrite,
                &format!("[tokens, heads, splits, {dv}]"),
            ),
            b.buffer(
                "lse_part",
                Elem::F32,
                Access::ReadWrite,
                "[tokens, heads, splits]",
            ),
        )
    };

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

    b.comment("which token, split and head block this workgroup owns");
    let t = b.let_("t", workgroup_id(2));
    let split = b.let_("split", workgroup_id(1));
    let h0 = b.let_("h0", workgroup_id(0) * u(cfg.block_h));
    let j_begin = b.let_("j_begin", split.clone() * chunk.clone());
    let j_end = b.let_("j_end", (j_begin.clone() + chunk).min(topk.clone()));
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
        let valid = j
            .clone()
            .lt(j_end.clone())
            .and(j.lt(valid_len.clone()))
            .and(idx.clone().ge(i(0)))
            .and(idx.clone().as_u32().lt(num_slots.clone()));
        (valid, idx)
    };

    b.comment("load the q rows of this head block (rows past `heads` are zeros)");
    b.gather_rows(&q_tile, 0, d / 2, &q, |_, r| {
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
            b.gather_rows(dst, 0, row_words, &cache, |_, r| {
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

    b.comment("normalise and write this split's output rows");
    b.acc_for_each(&o, |b, e| {
        let h = b.let_("h", h0.clone() + e.row.clone());
        b.if_(h.clone().lt(heads.clone()), |b| {
            let l = b.let_("l", st.l.at(e.row.clone()));
            let inv = b.let_("inv_l", select(l.clone().gt(f(0.0)), f(1.0) / l, f(0.0)));
            let (y0, y1) = (e.v0.clone() * inv.clone(), e.v1.clone() * inv);
            if cfg.final_output {
                let at = (t.clone() * heads.clone() + h) * u(dv) + e.col.clone();
                b.store_word(&out, at / u(2), pack_bf16x2(y0, y1));
            } else {
                let at = ((t.clone() * heads.clone() + h) * splits.clone() + split.clone()) * u(dv)
                    + e.col.clone();
                let at = b.let_("at", at);
                b.store(&out, at.clone(), y0);
                b.store(&out, at + u(1), y1);
            }
        });
    });
    b.for_threads("r", u(cfg.block_h), |b, r| {
        let h = b.let_("h", h0.clone() + r.clone());
        b.if_(h.clone().lt(heads.clone()), |b| {
            let l = b.let_("l", st.l.at(r.clone()));
            let empty = if cfg.final_output {
                f(f32::INFINITY)
            } else {
                f(MASKED)
            };
            let v = select(
                l.clone().gt(f(0.0)),
                st.m.at(r) + log(l.max(f(1e-30))),
                empty,
            );
            if let Some(s_q) = &lse_s_q {
                let at = (t.clone() / s_q.clone() * heads.clone() + h) * s_q.clone()
                    + t.clone() % s_q.clone();
                b.store(&lse_out, at, v);
            } else {
                b.store(
                    &lse_out,
                    (t.clone() * heads.clone() + h) * splits.clone() + split.clone(),
                    v,
                );
            }
        });
    });
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
    b.comment("weighted sum of the partial outputs, two columns per thread step");
    b.for_threads("c2", u(dv / 2), |b, c2| {
        let c = b.let_("c", c2 * u(2));
        let a0 = b.var("acc0", f(0.0));
        let a1 = b.var("acc1", f(0.0));
        b.for_("s", u(0), splits.clone(), u(1), |b, s| {
            let part = b.let_("part", row.clone() * splits.clone() + s);
            let ls = b.let_("part_lse", lse_part.at(part.clone()));
            b.if_(is_masked(ls.clone()).not(), |b| {
                let w = b.let_("w", exp(ls - lse.clone()));
                let at = b.let_("at", part * u(dv) + c.clone());
                b.set(&a0, a0.clone() + w.clone() * o_part.at(at.clone()));
                b.set(&a1, a1.clone() + w * o_part.at(at + u(1)));
            });
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

/// The kernels and launches of one decode call. Buffers are bound by name: `q`, `kv_cache`,
/// `indices`, `topk_length`, then `out`, `lse` (one split) or `o_part`, `lse_part` and the
/// combine's `o_part`, `lse_part`, `out`, `lse`. `layout` gives the cache strides and the lse
/// layout (see [`DecodeLayout`]).
pub fn launches(
    shape: &DecodeShape,
    layout: &DecodeLayout,
    plan: &DecodePlan,
) -> Result<Vec<Launch>> {
    check_shape(shape, &plan.config)?;
    let geometry = CacheGeometry::new(
        shape.format,
        shape.dims,
        shape.num_pages,
        shape.page_size,
        layout.cache,
    )?;
    layout.lse.check(shape.tokens)?;
    let (split, combine) = lowered_kernels(&plan.config)?;
    let split_params = pack_params(
        &split,
        &[
            ("tokens", ParamValue::U32(shape.tokens)),
            ("heads", ParamValue::U32(shape.heads)),
            ("topk", ParamValue::U32(shape.topk)),
            ("num_slots", ParamValue::U32(shape.num_slots() as u32)),
            ("splits", ParamValue::U32(plan.splits)),
            ("chunk", ParamValue::U32(plan.chunk)),
            (
                "has_topk_length",
                ParamValue::U32(shape.has_topk_length as u32),
            ),
            ("scale", ParamValue::F32(shape.scale)),
            ("page_size", ParamValue::U32(shape.page_size)),
            ("row_stride_w", ParamValue::U32(geometry.row_stride_words())),
            (
                "page_stride_w",
                ParamValue::U32(geometry.page_stride_words()),
            ),
            ("lse_s_q", ParamValue::U32(layout.lse.s_q())),
        ],
    )?;
    let mut out = vec![Launch {
        kernel: split,
        grid: plan.grid_split(shape),
        params: split_params,
    }];
    if !plan.config.final_output {
        let params = pack_params(
            &combine,
            &[
                ("heads", ParamValue::U32(shape.heads)),
                ("splits", ParamValue::U32(plan.splits)),
                ("lse_s_q", ParamValue::U32(layout.lse.s_q())),
            ],
        )?;
        out.push(Launch {
            kernel: combine,
            grid: [shape.heads, shape.tokens, 1],
            params,
        });
    }
    Ok(out)
}

type KernelPair = (Arc<Kernel>, Arc<Kernel>);

/// The lowered split and combine kernels of a config, built once per process.
pub fn lowered_kernels(config: &DecodeConfig) -> Result<KernelPair> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<DecodeConfig, KernelPair>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(k) = cache.lock().map_err(|_| poisoned())?.get(config) {
        return Ok(k.clone());
    }
    let split = Arc::new(crate::kir::lower(&split_kernel(config)?, config.lowering)?);
    let combine = Arc::new(crate::kir::lower(
        &combine_kernel(config)?,
        config.lowering,
    )?);
    let pair = (split, combine);
    cache
        .lock()
        .map_err(|_| poisoned())?
        .insert(*config, pair.clone());
    Ok(pair)
}

fn poisoned() -> Error {
    Error::runtime("kernels", "kernel cache lock poisoned by an earlier panic")
}
