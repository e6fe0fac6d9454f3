//! Sparse MLA decode over a virtual block table (docs/math.md), described once.
//!
//! Two kernels:
//! - **split**: workgroup (head block, split, token) attends its `block_h` heads of token `t`
//!   over one chunk of the token's top-k list, `block_n` slots at a time: gather the rows,
//!   `S = q · Kᵀ`, mask, online softmax, `O += P · V` (V = the first `d_v` columns of the
//!   same rows). It writes the final output itself (one split, a run-time case) or a normalised partial
//!   `(o_s, lse_s)` per split.
//! - **combine**: one workgroup per (head, token, column chunk) merges the partials:
//!   `lse = logsumexp_s lse_s`, `out = Σ_s exp(lse_s − lse) · o_s`.
//!
//! Conventions from [`crate::mla`]: invalid indices are masked and never read; a row with
//! no valid index gets `out = 0`, `lse = +inf`; an empty split carries a masked lse.

use super::{pack_params, Launch, ParamValue};
use crate::kir::ir::{Kernel, TileElem};
use crate::kir::{DeferPv, Lowering, RowSoftmax};
use crate::mla::{CacheFormat, CacheGeometry, DecodeLayout, DecodeShape, MlaDims};
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

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
            lowering: Lowering::Scalar,
        }
    }

    /// The scalar CUDA configuration (48 KB of static shared memory is always available):
    /// 16 slots per step for bf16 (39296 B), 8 for fp8 (43488 B with the raw-row tile).
    pub fn cuda_scalar(dims: MlaDims, format: CacheFormat) -> Self {
        DecodeConfig {
            dims,
            format,
            // fp8: four 128-column output accumulators; 8 heads per workgroup keep them in
            // registers (16 spilled 16 B on sm_80, 256 threads spilled more)
            block_h: match format {
                CacheFormat::Bf16 => 16,
                CacheFormat::Fp8DsMla => 8,
            },
            block_n: match format {
                CacheFormat::Bf16 => 16,
                CacheFormat::Fp8DsMla => 8,
            },
            threads: 128,
            p_elem: TileElem::F32,
            lowering: Lowering::Scalar,
        }
    }

    /// The v7 tensor-core configuration (CUDA, [`Lowering::MmaWs`]) for `heads` query heads:
    /// 8 warps, the last also issuing the ring's copies; one workgroup per multiprocessor
    /// (registers: 160-255 per thread; SM120's budget: everything fits 101376 bytes of shared
    /// memory, the lowering checks):
    /// - H ≤ 16 (memory-bound): 16 heads x 32 slots per step;
    /// - H > 16: 32 heads x 32 slots;
    ///
    /// each with a 2-deep ring of rows as they are (bf16 2 x 37 KB, fp8_ds_mla 2 x 21 KB).
    /// fp8's deeper rings (4 at H ≤ 16, 3 above) were slower on the H200 at either
    /// occupancy: 2 stages 1.06–1.07x at H 64 / 128, 1.00–1.04x at H ≤ 16 (benches/NOTES.md,
    /// v14).
    ///
    /// q lives in registers (each warp its K slice of the split-K score product).
    ///
    /// bf16 at H ≤ 16: the producers also ask L2 for the rows of the step after the one
    /// they copy ([`Lowering::MmaWs`]'s `l2_ahead` 1), 1.025–1.066x on the H200 at T 8–128;
    /// further ahead, fp8, 32-head blocks and the large-batch kernel ran slower with it
    /// (benches/NOTES.md, v21).
    ///
    /// The scores are held in rows for the softmax ([`Self::V7_ROW_SOFTMAX`]).
    pub fn tensor_core_v7(dims: MlaDims, format: CacheFormat, heads: u32) -> Self {
        let block_h = if heads <= 16 { 16 } else { 32 };
        let l2_ahead = u32::from(heads <= 16 && format == CacheFormat::Bf16);
        Self::tensor_core_custom(dims, format, block_h, 32, 2)
            .with_l2_ahead(l2_ahead)
            .with_row_softmax(Self::V7_ROW_SOFTMAX)
    }

    /// The tensor-core configuration for `heads` query heads on a GPU that holds two v6
    /// workgroups per multiprocessor (H100, H200): [`Self::tensor_core_on`] with 2. What
    /// `mla-export` writes as the production kernels.
    pub fn tensor_core(dims: MlaDims, format: CacheFormat, heads: u32) -> Self {
        match Self::tensor_core_on(dims, format, heads, || {
            Ok::<u32, std::convert::Infallible>(2)
        }) {
            Ok(config) => config,
            Err(never) => match never {},
        }
    }

    /// The tensor-core configuration the CUDA backend runs, given how many workgroups of the
    /// bf16 v6 split kernel ([`Self::tensor_core_v6`]) the GPU holds per multiprocessor:
    /// - fp8_ds_mla: v7 ([`Self::tensor_core_v7`]), faster than v6 on every measured row on
    ///   the H200 at either occupancy (benches/NOTES.md, v8);
    /// - bf16: v6 where two of its workgroups fit a multiprocessor (it hides its step's
    ///   latency behind the other one), v7 where only one does (SM120: 100 KB of shared
    ///   memory per multiprocessor). At the H200's default occupancy v6 was faster on most
    ///   bf16 rows; held to SM120's occupancy, v7 on every row but the smallest calls, which
    ///   [`Self::for_call`] sends to v6 ([`Self::is_v6_call`]).
    ///
    /// `v6_per_sm` is asked only for bf16 (it compiles the v6 kernel to ask the driver).
    pub fn tensor_core_on<E>(
        dims: MlaDims,
        format: CacheFormat,
        heads: u32,
        v6_per_sm: impl FnOnce() -> std::result::Result<u32, E>,
    ) -> std::result::Result<Self, E> {
        Ok(match format {
            CacheFormat::Bf16 if v6_per_sm()? >= 2 => Self::tensor_core_v6(dims, format, heads),
            _ => Self::tensor_core_v7(dims, format, heads),
        })
    }

    /// v7 in 16-head blocks for a call of more than 16 heads (none at 16 or fewer, where
    /// [`Self::tensor_core_v7`] already takes them): the configuration of a narrow call
    /// ([`Self::is_narrow_call`]). No L2 prefetch: with it these calls ran 0–4 % slower.
    pub fn tensor_core_narrow(dims: MlaDims, format: CacheFormat, heads: u32) -> Option<Self> {
        (heads > 16).then(|| {
            Self::tensor_core_custom(dims, format, 16, 32, 2).with_row_softmax(Self::V7_ROW_SOFTMAX)
        })
    }

    /// Is `shape` a narrow call: more than 16 heads and `NARROW_FACTOR · T · ⌈H/16⌉ ≤ SMs`
    /// (at most 12 blocks of 16 heads on 132 SMs)? [`Self::for_call`] runs such a call on
    /// [`Self::tensor_core_narrow`], whatever the cache format and the v6 residency, unless
    /// it is one of bf16's v6 calls ([`Self::is_v6_call`], taken before). Twice
    /// the head blocks of v7's 32-head ones leave each of them half the splits, so the
    /// partials to merge halve and each workgroup walks twice the steps. Measured on the
    /// H200 at both occupancies, same binary (benches/NOTES.md, v24), against what ran
    /// before (v6 for bf16 at ≤ 4 blocks, else v7 in 32-head blocks): 1.01–1.10x on every
    /// bf16 call of ≤ 12 blocks (H 32 T 1–6, H 48 T 1–4, H 64 T 1–3, H 96 T 1–2, H 128
    /// T 1), 1.04–1.29x on fp8_ds_mla; 0.92–0.99x at 16–18 blocks (H 64 T 4, H 128 T 2,
    /// H 48 T 6, H 96 T 3), where the rule stops.
    pub fn is_narrow_call(shape: &DecodeShape, sm_count: u32) -> bool {
        Self::tensor_core_narrow(shape.dims, shape.format, shape.heads).is_some()
            && Self::NARROW_FACTOR * Self::blocks16(shape) <= sm_count as u64
    }

    /// The factor of [`Self::is_narrow_call`]: 12 blocks of 16 heads on the H200's 132
    /// multiprocessors won, 16 lost.
    pub const NARROW_FACTOR: u64 = 11;

    /// The configuration of an fp8_ds_mla narrow call of at least
    /// [`Self::NARROW_WIDE_MIN_BLOCKS`] 16-head blocks ([`Self::is_narrow_wide_call`]; none
    /// at 16 heads or fewer, nor for bf16): fp8's large-batch kernel (v7 with
    /// 64-row steps, [`Self::tensor_core_batch`]) in 16-head blocks, in place of
    /// [`Self::tensor_core_narrow`]'s 32-row steps. Measured on the H200
    /// at both occupancies, same binary, two runs (benches/NOTES.md, v26): 1.01–1.06x at 6–12
    /// blocks (H 32 T 3–6, H 48 T 2–4, H 64 T 2–3, H 96 T 1–2, H 128 T 1) but for H 24 T 5
    /// (0.94x: its split count leaves the 64-row plan unmerged where the 32-row one merges);
    /// level at 4 blocks and 0.95x at 2, where each workgroup walks one or two steps.
    pub fn tensor_core_narrow_wide(dims: MlaDims, format: CacheFormat, heads: u32) -> Option<Self> {
        (format == CacheFormat::Fp8DsMla && heads > 16)
            .then(|| Self::tensor_core_batch(dims, format, 16))
            .flatten()
    }

    /// Is `shape` a narrow call ([`Self::is_narrow_call`]) that runs
    /// [`Self::tensor_core_narrow_wide`]: an fp8_ds_mla one of at least
    /// [`Self::NARROW_WIDE_MIN_BLOCKS`] 16-head blocks?
    pub fn is_narrow_wide_call(shape: &DecodeShape, sm_count: u32) -> bool {
        Self::tensor_core_narrow_wide(shape.dims, shape.format, shape.heads).is_some()
            && Self::is_narrow_call(shape, sm_count)
            && Self::blocks16(shape) >= Self::NARROW_WIDE_MIN_BLOCKS
    }

    /// The fewest 16-head blocks, `T · ⌈H/16⌉`, of an fp8_ds_mla narrow call that runs
    /// [`Self::tensor_core_narrow_wide`].
    pub const NARROW_WIDE_MIN_BLOCKS: u64 = 6;

    /// The large-batch configuration for `heads` ≤ 16 (none above), one workgroup per
    /// multiprocessor within SM120's budget:
    /// - bf16: two warp groups of 4 warps in one workgroup, each walking every other 32-slot
    ///   step with its own one-stage ring of 32 rows (2 x 37 KB of rings, 87744 B in all).
    ///   Where the batch fills the GPU without splits, one workgroup's step is a chain of
    ///   waits (the rows, the split-K sum, the row max, P); two chains on the multiprocessor
    ///   hide each other's. Measured on the H200 at SM120's occupancy (benches/NOTES.md, v11,
    ///   v14): 1.10x v7 at T = 128, level at T = 32, 0.85x at T = 1 (where v7 stays). The
    ///   producers also ask L2 for the rows of each group's next step, after the step's first
    ///   barrier (its own rows have landed by then): 1.045–1.061x at T 64–256 on the H200
    ///   (T 128 120.4 -> 113.5 µs). Asked at the top of the step, next to the copies the step
    ///   waits for, it was 0.93–0.95x; two steps ahead 1.01–1.02x (benches/NOTES.md, v21).
    /// - fp8_ds_mla: v7 (one group of 8 warps) with 64-row steps in a two-stage ring
    ///   (2 x 42 KB of 656-byte rows, 96064 B in all). The fewer, larger steps halve the
    ///   chains of waits a workgroup walks where fp8's two groups of 32-row steps each walked
    ///   theirs: on the H200, same binary, both occupancies (benches/NOTES.md, v26), 0.997–1.094x
    ///   the two-group kernel on every call it takes at H 8 / 16 from T 10 to 512 (T 12–16
    ///   1.06–1.09x, T 96 and 160 1.06–1.08x, T 128 and 256–512 level to 1.01x).
    pub fn tensor_core_batch(dims: MlaDims, format: CacheFormat, heads: u32) -> Option<Self> {
        (heads <= 16).then(|| match format {
            CacheFormat::Bf16 => {
                Self::tensor_core_grouped(dims, format, (16, 32, 1), 4, 2).with_l2_ahead(1)
            }
            // P in f16: its P . V multiplies P with the e4m3 rows as f16 (one conversion a
            // pair, no f32 step; kir::lower_mma::e4m3's running scale keeps them in f16's
            // range). 1.02-1.03x at T 128, level at T 32 and on its narrow calls (H200, both
            // occupancies); the 16- and 32-head v7 kernels keep bf16 P: their fixed cost a
            // step (one vote) made the small calls 1-4 % slower (benches/NOTES.md v27).
            // Scores held in rows, as v7's: 1.004-1.036x on an H100 at H 8 / 16 T 32 / 128
            // (fp8 H 16 T 128 103.3 -> 100.0 µs), both occupancies (benches/NOTES.md v36).
            CacheFormat::Fp8DsMla => Self {
                p_elem: TileElem::F16,
                ..Self::tensor_core_custom(dims, format, 16, 64, 2)
            }
            .with_row_softmax(RowSoftmax::Rows),
        })
    }

    /// Is `shape` a large batch for a GPU of `sm_count` multiprocessors, one the large-batch
    /// kernel ([`Self::tensor_core_batch`]) runs at H ≤ 16:
    /// - bf16, only where the split model ([`DecodePlan::model_splits`], one workgroup per SM)
    ///   gives each of its workgroups at least [`Self::BATCH_MIN_STEPS`] steps. Its two warp
    ///   groups walk alternate steps, so a short or odd walk leaves one group idle at the end:
    ///   at SM120's occupancy on the H200 (132 SMs, topk 2048) it beat v7 by 2–9 % where the
    ///   model split a call 2 or 3 ways (21–32 steps: T 36–44, 56–64), was level at 4 (16
    ///   steps: T 28–32) and 1–4 % slower at 5 or more (≤ 13 steps: T 16–24, 48–52)
    ///   (benches/NOTES.md, v22). Past one wave the model splits again (T 133–165: 16 steps),
    ///   and there v7 was 1.07x and v6 1.11x the batch kernel on an H100, as v7 was 1.04–1.08x
    ///   at 13–16 steps below one wave (T 80–96) at SM120's occupancy (v36). Given the steps:
    /// - bf16 where one bf16 v6 workgroup fills a multiprocessor (SM120): every call that is
    ///   not a small one ([`Self::is_small_call`]);
    /// - bf16 where two or more v6 workgroups fit (`v6_per_sm`, H100/H200): v6 keeps the call
    ///   until its blocks fill four fifths of them, `5 · T · ⌈H/16⌉ ≥ 4 · SMs`: on the H200 v6
    ///   was 6–8 % faster at T 80–96, the batch kernel 5–7 % at T 112–128 (benches/NOTES.md,
    ///   v14; the crossover measured again with the batch kernel's L2 prefetch, v22);
    /// - fp8_ds_mla: any call that is not a small one ([`Self::is_small_call`]),
    ///   `16 · T · ⌈H/16⌉ > SMs`: the two-group kernel of before beat v7 from T = 8 (1.02–1.15x
    ///   at T 8–80 on the H200, 0.87–0.96x at T 1–4; benches/NOTES.md, v14), and the 64-row
    ///   kernel that replaced it beats both past T 10 (v26).
    ///
    /// `v6_per_sm` is read only for bf16 calls between the two bf16 thresholds.
    pub fn is_large_batch(shape: &DecodeShape, sm_count: u32, v6_per_sm: u32) -> bool {
        let (blocks, sms) = (Self::blocks16(shape), sm_count as u64);
        match shape.format {
            CacheFormat::Bf16 => {
                (5 * blocks >= 4 * sms || (v6_per_sm < 2 && !Self::is_small_call(shape, sm_count)))
                    && Self::batch_steps(shape, sm_count) >= Self::BATCH_MIN_STEPS
            }
            CacheFormat::Fp8DsMla => !Self::is_small_call(shape, sm_count),
        }
    }

    /// The fewest steps a workgroup of the bf16 large-batch kernel walks on a call it runs
    /// ([`Self::is_large_batch`]), at any v6 residency.
    pub const BATCH_MIN_STEPS: u32 = 20;

    /// Steps each workgroup of the large-batch kernel walks for `shape` under the split
    /// model's choice at one workgroup per multiprocessor (its register budget: 255 a
    /// thread, 256 threads): `⌈⌈topk / block_n⌉ / splits⌉`; 0 where no batch kernel exists
    /// for the head count.
    fn batch_steps(shape: &DecodeShape, sm_count: u32) -> u32 {
        let Some(batch) = Self::tensor_core_batch(shape.dims, shape.format, shape.heads) else {
            return 0;
        };
        let splits = DecodePlan::model_splits(&batch, shape, sm_count, sm_count);
        shape.topk.div_ceil(batch.block_n).div_ceil(splits.max(1))
    }

    /// The 16-head blocks of a call, `T · ⌈H/16⌉`: the unit of the size rules
    /// ([`Self::is_large_batch`], [`Self::is_small_call`]).
    pub fn blocks16(shape: &DecodeShape) -> u64 {
        shape.tokens as u64 * shape.heads.div_ceil(16) as u64
    }

    /// Is `shape` a small call for a GPU of `sm_count` multiprocessors: 16 times its 16-head
    /// blocks at most the multiprocessors, `16 · T · ⌈H/16⌉ ≤ SMs` (T ≤ 8 at H ≤ 16 on 132
    /// SMs). The split model then gives each workgroup a few steps (≤ 4 of topk 2048's 64),
    /// where v6's step, with no ring to fill, beats v7's even at one v6 workgroup per
    /// multiprocessor: bf16 at SM120's occupancy on the H200, 0.83–0.98× v7's time at
    /// H ≤ 16 T ≤ 8, H 32 T ≤ 4, H 64 T ≤ 2, H 128 T = 1, and 1.09–1.33× past that
    /// (benches/NOTES.md, v13).
    pub fn is_small_call(shape: &DecodeShape, sm_count: u32) -> bool {
        16 * Self::blocks16(shape) <= sm_count as u64
    }

    /// Does a bf16 call run a v6 kernel, `f · T · ⌈H/16⌉ ≤ SMs`, with `f` by the head count
    /// and the v6 residency `v6_per_sm`:
    /// - 16 at H ≤ 16 where two or more v6 workgroups fit a multiprocessor (H100/H200): every
    ///   small call ([`Self::is_small_call`]);
    /// - 20 at H ≤ 16 where one fits (SM120), and above 16 heads at any residency, where the
    ///   call runs v6 in 16-head blocks ([`Self::tensor_core_v6_narrow`]).
    ///
    /// Each of them a small call. Past it v7 is the faster: at H ≤ 16 measured on the H200,
    /// same binary, both occupancies (benches/NOTES.md, v23): v6 won at T ≤ 6 (1.01–1.05×)
    /// and at SM120's occupancy v7 at T 7–8 (1.03–1.05×), where on the H200's own occupancy the
    /// two were within 4 % either way (v6 ahead at H 8, v7 at H 16 T 8). Above 16 heads
    /// (v25), against v7 in 16-head blocks (the narrow calls' kernel), v6 in 16-head blocks won
    /// on every call of ≤ 6 blocks at both occupancies (H 32 T 1–3 1.02–1.05×, H 48 T 1–2
    /// 1.01–1.04×, H 64 T 1 1.04–1.05×, H 96 T 1 level), and at 8 blocks lost at SM120's
    /// (H 32 T 4 0.98×, H 64 T 2 0.97×) and at H 128 T 1 on the H200 (0.99×).
    pub fn is_v6_call(shape: &DecodeShape, sm_count: u32, v6_per_sm: u32) -> bool {
        // above 16 heads the call runs v6 in 16-head blocks, at any residency
        let blocks16 = Self::tensor_core_v6_narrow(shape.dims, CacheFormat::Bf16, shape.heads);
        let f = if blocks16.is_none() && v6_per_sm >= 2 {
            16
        } else {
            20
        };
        f * Self::blocks16(shape) <= sm_count as u64
    }

    /// The bf16 v6 configuration in 16-head blocks for a call of more than 16 heads (none at
    /// 16 or fewer, where [`Self::tensor_core_v6`] takes them, nor for fp8_ds_mla, whose v6 is
    /// slower than v7): what [`Self::for_call`] runs where such a call is a v6 call
    /// ([`Self::is_v6_call`]). Its v6 kernel for H ≤ 16, so no new kernel.
    pub fn tensor_core_v6_narrow(dims: MlaDims, format: CacheFormat, heads: u32) -> Option<Self> {
        (heads > 16 && format == CacheFormat::Bf16)
            .then(|| Self::tensor_core_v6(dims, CacheFormat::Bf16, 16))
    }

    /// The configuration the CUDA backend runs for one call: for a bf16 call of more than 16
    /// heads that is a v6 call ([`Self::is_v6_call`]) v6 in 16-head blocks
    /// ([`Self::tensor_core_v6_narrow`]); [`Self::tensor_core_narrow`] for
    /// a narrow call ([`Self::is_narrow_call`]; [`Self::tensor_core_narrow_wide`] where
    /// [`Self::is_narrow_wide_call`]); [`Self::tensor_core_batch`] for a
    /// large batch ([`Self::is_large_batch`]); for a bf16 small call
    /// ([`Self::is_small_call`]) v6 where [`Self::is_v6_call`], else v7; v7 for a call of
    /// more than 16 heads whose v7 blocks fill one wave or take several
    /// ([`Self::bf16_wide_runs_v7`]); else [`Self::tensor_core_on`]. `v6_per_sm` is asked at
    /// most once, and only for bf16 calls the answer decides: none of those but the small
    /// calls at H ≤ 16 between `is_v6_call`'s two factors, and not a large batch at every v6
    /// residency.
    pub fn for_call<E>(
        shape: &DecodeShape,
        sm_count: u32,
        v6_per_sm: impl FnOnce() -> std::result::Result<u32, E>,
    ) -> std::result::Result<Self, E> {
        let (dims, format, heads) = (shape.dims, shape.format, shape.heads);
        // (above 16 heads is_v6_call does not depend on the residency)
        if let Some(v6) = Self::tensor_core_v6_narrow(dims, format, heads)
            .filter(|_| Self::is_v6_call(shape, sm_count, 1))
        {
            return Ok(v6);
        }
        if let Some(wide) = Self::tensor_core_narrow_wide(dims, format, heads)
            .filter(|_| Self::is_narrow_wide_call(shape, sm_count))
        {
            return Ok(wide);
        }
        if let Some(narrow) = Self::tensor_core_narrow(dims, format, heads)
            .filter(|_| Self::is_narrow_call(shape, sm_count))
        {
            return Ok(narrow);
        }
        if format == CacheFormat::Bf16 && Self::is_small_call(shape, sm_count) {
            // v6 or v7 by Self::is_v6_call; the residency is asked only where it decides (at
            // H <= 16 between the call's two factors)
            let (at_one, at_more) = (
                Self::is_v6_call(shape, sm_count, 1),
                Self::is_v6_call(shape, sm_count, 2),
            );
            let v6 = if at_one == at_more {
                at_one
            } else {
                v6_per_sm()? >= 2
            };
            return Ok(if v6 {
                Self::tensor_core_v6(dims, format, heads)
            } else {
                Self::tensor_core_v7(dims, format, heads)
            });
        }
        let batch = Self::tensor_core_batch(dims, format, heads);
        // large at the strictest residency rule: large whatever the GPU holds
        if let Some(batch) = batch.filter(|_| Self::is_large_batch(shape, sm_count, u32::MAX)) {
            return Ok(batch);
        }
        if format == CacheFormat::Bf16 && Self::bf16_wide_runs_v7(shape, sm_count) {
            // v7 at any v6 residency: the one-workgroup-per-SM choice
            return Self::tensor_core_on(dims, format, heads, || Ok(1));
        }
        let per_sm = match format {
            CacheFormat::Bf16 => v6_per_sm()?,
            CacheFormat::Fp8DsMla => 1,
        };
        match batch {
            Some(batch) if Self::is_large_batch(shape, sm_count, per_sm) => Ok(batch),
            _ => Self::tensor_core_on(dims, format, heads, || Ok(per_sm)),
        }
    }

    /// The decode kernel a GPU backend runs for `shape` on `sm_count` multiprocessors, with the
    /// run-time switches of the environment: [`Self::for_call`] (`v6_per_sm`: the GPU's
    /// residency of the bf16 v6 split kernel, asked only where it decides), or the version
    /// forced with `SPARSE_MLA_DECODE_KERNEL=v6|v7|batch` (`batch`: the large-batch kernel
    /// where one exists for the head count, else v7); then the forms:
    /// - `SPARSE_MLA_ROW_SOFTMAX=0|1|lazy`: how the scores are held for the softmax
    ///   ([`Self::with_row_softmax`]); unset, each kernel keeps its own (v7 in rows,
    ///   [`Self::V7_ROW_SOFTMAX`], and fp8's one-group large-batch kernel; bf16's two-group
    ///   one in fragments). `0` holds them in fragments, `lazy` moves the running max only
    ///   past a margin. A row form on a call planned on bf16's large-batch kernel (two warp
    ///   groups) is refused: compute-sanitizer's racecheck reports hazards in its row forms
    ///   that are not yet explained (v32: only in bf16 cases; fp8's one-group large-batch
    ///   kernel ran clean in rows, v32 and v36).
    /// - `SPARSE_MLA_DEFER_PV=1|early` (off by default) runs each step's `O += P · V` in the
    ///   next step, beside its scores (`1`, bf16) or before its wait (`early`)
    ///   ([`Self::with_defer_pv`]), on the kernels where the form applies (scores in
    ///   fragments; the kernel's name ends in `d` or `de`). Timed slower (v35).
    ///
    /// The CUDA backend and `mla-bench` both plan through this, so that a benchmark of a
    /// switch times the kernels the switch selects.
    pub fn for_call_from_env(
        shape: &DecodeShape,
        sm_count: u32,
        v6_per_sm: impl FnOnce() -> Result<u32>,
    ) -> Result<Self> {
        let (dims, format, heads) = (shape.dims, shape.format, shape.heads);
        let config = match std::env::var("SPARSE_MLA_DECODE_KERNEL").as_deref() {
            Err(_) | Ok("") | Ok("auto") => Self::for_call(shape, sm_count, v6_per_sm)?,
            Ok("v6") => Self::tensor_core_v6(dims, format, heads),
            Ok("v7") => Self::tensor_core_v7(dims, format, heads),
            Ok("batch") => Self::tensor_core_batch(dims, format, heads)
                .unwrap_or_else(|| Self::tensor_core_v7(dims, format, heads)),
            Ok(other) => {
                return Err(Error::arg(
                    "SPARSE_MLA_DECODE_KERNEL",
                    "auto, v6, v7 or batch",
                    other,
                ))
            }
        };
        config.with_env_forms(shape)
    }

    /// This configuration with the forms the environment asks for,
    /// `SPARSE_MLA_ROW_SOFTMAX` (where set) and `SPARSE_MLA_DEFER_PV` (where the form applies);
    /// a row form on a kernel of several warp groups is refused ([`Self::for_call_from_env`]).
    /// `shape` names the call in that error.
    pub fn with_env_forms(self, shape: &DecodeShape) -> Result<Self> {
        self.with_forms(RowSoftmax::from_env()?, DeferPv::from_env()?, shape)
    }

    /// [`Self::with_env_forms`] with the switches' values given: `rows` where set (`None`:
    /// the kernel's own form), `defer` where it applies.
    pub fn with_forms(
        self,
        rows: Option<RowSoftmax>,
        defer: DeferPv,
        shape: &DecodeShape,
    ) -> Result<Self> {
        if rows.is_some_and(|r| r != RowSoftmax::Off) && self.groups() > 1 {
            return Err(Error::arg(
                "SPARSE_MLA_ROW_SOFTMAX",
                "0 for a call on bf16's two-group large-batch kernel (its row forms have an \
                 unexplained compute-sanitizer racecheck report, benches/NOTES.md v32)",
                format!(
                    "{} for {} heads x {} tokens",
                    rows.map_or("", RowSoftmax::env_value),
                    shape.heads,
                    shape.tokens
                ),
            ));
        }
        let config = rows.map_or(self, |r| self.with_row_softmax(r));
        Ok(config.with_defer_pv(defer))
    }

    /// The kernel's family ([`Self::family`]) and the experiments' forms it takes, as a
    /// benchmark labels it: `v7`, `v7 d` (P · V deferred), `v7 r de`, ...
    pub fn label(&self) -> String {
        let mut s = self.family().to_string();
        if let Lowering::MmaWs {
            row_softmax,
            defer_pv,
            ..
        } = self.lowering
        {
            for f in [row_softmax.suffix(), defer_pv.suffix()] {
                if !f.is_empty() {
                    s = format!("{s} {f}");
                }
            }
        }
        s
    }

    /// Does a bf16 call of more than 16 heads run v7 whatever the GPU's v6 residency: not a
    /// v6 call, and v7's 32-head blocks `b = T · ⌈H/32⌉` either take more than one wave
    /// (`b > SMs`) or fill one, `b · ⌊SMs/b⌋ ≥ 7/8 · SMs` (its splits can give each
    /// multiprocessor one workgroup and leave at most an eighth idle)? Where two bf16 v6
    /// workgroups fit a multiprocessor (H100/H200), [`Self::for_call`] then runs v7 for bf16,
    /// not v6. On the H200 v7 was 1.03–1.11× faster on one-wave calls (H 32 T 8–128, H 64
    /// T 4–64, H 128 T 2–32; benches/NOTES.md, v17), and since its softmax's exponentials
    /// went to `ex2.approx` (v28) 1.03–1.13× faster on every call of several waves measured
    /// (H 32 T 192–256, H 64 T 96–256, H 128 T 48–256), where v6 had been 1.05× faster. v6
    /// stays where v7's single partial wave leaves SMs idle: H 32 T 48 0.93× with v7 (but
    /// H 32 T 96 and H 64 T 48, also partial, ran 1.05× faster on v7: kept on v6, not
    /// special-cased). At H ≤ 16 v6 stays (v7 0.96× at H 16 T 32).
    pub fn bf16_wide_runs_v7(shape: &DecodeShape, sm_count: u32) -> bool {
        // the head block v7 takes for this head count: the rule is for its 32-head blocks
        let block = Self::tensor_core_v7(shape.dims, CacheFormat::Bf16, shape.heads).block_h;
        if block <= 16 || Self::is_v6_call(shape, sm_count, 1) {
            return false;
        }
        let b = shape.tokens as u64 * shape.heads.div_ceil(block) as u64;
        let sms = sm_count as u64;
        b >= 1 && (b > sms || 8 * b * (sms / b) >= 7 * sms)
    }

    /// How v7's one-group kernels ([`Self::tensor_core_v7`], [`Self::tensor_core_narrow`])
    /// hold their scores for the online softmax: in rows ([`RowSoftmax::Rows`]: each row's
    /// max on its own lanes, no exchange of row maxima through shared memory, one workgroup
    /// barrier a step fewer). Timed on an H100 against the fragment form, one binary,
    /// interleaved runs, both occupancies (benches/NOTES.md, v35): bf16 1.06–1.10x at H 128
    /// T 8–128 and 1.02–1.04x at H 64, fp8_ds_mla 1.05–1.22x at H 64–128 and 1.08x at H 32
    /// T 128, level at H 32 T ≤ 32 and at H ≤ 16 (0.99–1.02x). `SPARSE_MLA_ROW_SOFTMAX=0`
    /// runs the fragment form. fp8's one-group large-batch kernel (64-row steps) holds its
    /// scores in rows too ([`Self::tensor_core_batch`], v36); bf16's two-group one keeps
    /// fragments: racecheck reported hazards in its row forms that are not explained (v32).
    pub const V7_ROW_SOFTMAX: RowSoftmax = RowSoftmax::Rows;

    /// A v7 tensor-core configuration with the given head block, step and ring depth.
    pub fn tensor_core_custom(
        dims: MlaDims,
        format: CacheFormat,
        block_h: u32,
        block_n: u32,
        stages: u32,
    ) -> Self {
        DecodeConfig {
            dims,
            format,
            block_h,
            block_n,
            threads: 256,
            p_elem: TileElem::Bf16,
            lowering: Lowering::MmaWs {
                stages,
                groups: 1,
                l2_ahead: 0,
                row_softmax: RowSoftmax::Off,
                defer_pv: DeferPv::Off,
            },
        }
    }

    /// This configuration asking L2 for the rows `l2_ahead` steps past the ring's copies
    /// (the producers of v7 and the large-batch kernel, [`Lowering::MmaWs`]; every thread of
    /// a row's gather in v6, [`Lowering::Mma`]); the scalar lowering as it is.
    pub fn with_l2_ahead(mut self, l2_ahead: u32) -> Self {
        match self.lowering {
            Lowering::MmaWs {
                l2_ahead: ref mut a,
                ..
            }
            | Lowering::Mma {
                l2_ahead: ref mut a,
                ..
            } => *a = l2_ahead,
            Lowering::Scalar => {}
        }
        self
    }

    /// This configuration with its scores held as `form` says for the online softmax
    /// ([`Lowering::MmaWs`]'s `row_softmax`); other lowerings as they are.
    pub fn with_row_softmax(mut self, form: RowSoftmax) -> Self {
        if let Lowering::MmaWs {
            row_softmax: ref mut r,
            ..
        } = self.lowering
        {
            *r = form;
        }
        self
    }

    /// This configuration with each step's closing `O += P · V` run where `form` says
    /// ([`Lowering::MmaWs`]'s `defer_pv`) — where the form applies ([`DeferPv::unmet`]: a v7
    /// kernel in one warp group with a ring of two or more stages and its scores in
    /// fragments, and for [`DeferPv::Top`] bf16 rows; fp8_ds_mla's ring kernels take f16
    /// products). Any other configuration is returned as it is (its name says so: a deferred
    /// kernel's ends in `d` or `de`). [`DeferPv::Off`] applies to every configuration.
    pub fn with_defer_pv(mut self, form: DeferPv) -> Self {
        let f16_products = self.format != CacheFormat::Bf16;
        if let Lowering::MmaWs {
            defer_pv: ref mut d,
            stages,
            groups,
            row_softmax,
            ..
        } = self.lowering
        {
            if form
                .unmet((stages, groups), row_softmax, f16_products)
                .is_none()
            {
                *d = form;
            }
        }
        self
    }

    /// Where this configuration runs each step's `O += P · V` ([`DeferPv::Off`] outside
    /// [`Lowering::MmaWs`]).
    pub fn defer_pv(&self) -> DeferPv {
        match self.lowering {
            Lowering::MmaWs { defer_pv, .. } => defer_pv,
            _ => DeferPv::Off,
        }
    }

    /// Steps past the ring's copies whose rows are asked of L2 (0: none, and always for the
    /// scalar lowering).
    pub fn l2_ahead(&self) -> u32 {
        match self.lowering {
            Lowering::MmaWs { l2_ahead, .. } | Lowering::Mma { l2_ahead, .. } => l2_ahead,
            Lowering::Scalar => 0,
        }
    }

    /// How the kernel holds its scores for the online softmax ([`RowSoftmax::Off`] outside
    /// [`Lowering::MmaWs`]).
    pub fn row_softmax(&self) -> RowSoftmax {
        match self.lowering {
            Lowering::MmaWs { row_softmax, .. } => row_softmax,
            _ => RowSoftmax::Off,
        }
    }

    /// The kernel family, in the words of benches/NOTES.md: `v6`, `v7`, `batch` (the
    /// large-batch kernel, [`Self::is_batch`]) or `scalar`.
    pub fn family(&self) -> &'static str {
        match self.lowering {
            Lowering::Mma { .. } => "v6",
            Lowering::MmaWs { .. } if self.is_batch() => "batch",
            Lowering::MmaWs { .. } => "v7",
            Lowering::Scalar => "scalar",
        }
    }

    /// Is this a large-batch configuration: [`Self::tensor_core_batch`]'s (bf16: v7 in two
    /// warp groups; fp8_ds_mla: v7 with 64-row steps), or any v7 in warp groups?
    pub fn is_batch(&self) -> bool {
        let plain = |c: Self| {
            c.with_row_softmax(RowSoftmax::Off)
                .with_defer_pv(DeferPv::Off)
        };
        matches!(self.lowering, Lowering::MmaWs { groups, .. } if groups > 1)
            || Some(plain(*self))
                == Self::tensor_core_batch(self.dims, self.format, self.block_h).map(plain)
    }

    /// Warp groups of a grouped v7 configuration ([`Lowering::MmaWs`]); 1 otherwise.
    pub fn groups(&self) -> u32 {
        match self.lowering {
            Lowering::MmaWs { groups, .. } => groups.max(1),
            _ => 1,
        }
    }

    /// A v7 configuration whose workgroup is `groups` independent groups of `warps` warps
    /// each (see [`Lowering::MmaWs`]): each group walks every `groups`-th step of the split with
    /// its own `stages`-deep ring of `block_n`-slot steps.
    pub fn tensor_core_grouped(
        dims: MlaDims,
        format: CacheFormat,
        (block_h, block_n, stages): (u32, u32, u32),
        warps: u32,
        groups: u32,
    ) -> Self {
        DecodeConfig {
            threads: 32 * warps * groups,
            lowering: Lowering::MmaWs {
                stages,
                groups,
                l2_ahead: 0,
                row_softmax: RowSoftmax::Off,
                defer_pv: DeferPv::Off,
            },
            ..Self::tensor_core_custom(dims, format, block_h, block_n, stages)
        }
    }

    /// The v6 tensor-core configuration (CUDA, [`Lowering::Mma`], the baseline) for `heads`
    /// query heads. Every
    /// one fits SM120's 101376 bytes of shared memory per block (the lowering checks):
    /// - H ≤ 16 (memory-bound): 16 heads x 32 slots per step, a 2-deep ring of gathered rows
    ///   (2 x 37 KB) next to the q tile (18 KB);
    /// - H > 16: 32 heads x 32 slots in one stage: fewer CTAs read each row;
    /// - fp8_ds_mla: the same head blocks with rings of raw rows sized to fit beside the
    ///   dequantised tile.
    pub fn tensor_core_v6(dims: MlaDims, format: CacheFormat, heads: u32) -> Self {
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
            lowering: Lowering::Mma {
                stages,
                min_workgroups,
                // L2 asked for the next step's rows (`v6:…p1` in mla-bench) was 1-5 % slower
                // on the H200 at H <= 16, 5-8 % at H > 16 (benches/NOTES.md, v25)
                l2_ahead: 0,
            },
        }
    }

    /// 32-bit words per cache row.
    pub fn row_words(&self) -> u32 {
        self.format.row_bytes(self.dims) / 4
    }

    /// The kernel's lowering and blocks, the part of its name past the format and dims (e.g.
    /// `ws2w8r_h32n32`): what tells two kernels of one format apart.
    pub fn kernel_tag(&self) -> String {
        let lowering = match self.lowering {
            Lowering::Scalar => "scalar".to_string(),
            Lowering::Mma {
                stages,
                min_workgroups,
                l2_ahead,
            } => {
                let occupancy = if min_workgroups > 0 {
                    format!("o{min_workgroups}")
                } else {
                    String::new()
                };
                let p = if l2_ahead > 0 {
                    format!("p{l2_ahead}")
                } else {
                    String::new()
                };
                format!("mma{stages}w{}{occupancy}{p}", self.threads / 32)
            }
            Lowering::MmaWs {
                stages,
                groups,
                l2_ahead,
                row_softmax,
                defer_pv,
            } => {
                let g = if groups > 1 {
                    format!("g{groups}")
                } else {
                    String::new()
                };
                let p = if l2_ahead > 0 {
                    format!("p{l2_ahead}")
                } else {
                    String::new()
                };
                let r = row_softmax.suffix();
                let d = defer_pv.suffix();
                format!("ws{stages}w{}{g}{p}{r}{d}", self.threads / 32)
            }
        };
        format!("{lowering}_h{}n{}", self.block_h, self.block_n)
    }

    fn suffix(&self) -> String {
        format!(
            "{}_d{}_{}",
            self.format.name(),
            self.dims.d_qk(),
            self.kernel_tag()
        )
    }

    pub fn split_name(&self) -> String {
        format!("sparse_mla_decode_split_{}", self.suffix())
    }

    /// The split kernel that merges its own partials ([`merge`]).
    pub fn merged_name(&self) -> String {
        format!("{}_merged", self.split_name())
    }

    /// The split kernel that runs whole tokens before the split ones ([`DecodePlan::whole_tokens`]).
    pub fn whole_name(&self) -> String {
        format!("{}_whole", self.split_name())
    }

    /// The name of the split kernel in `form`.
    pub fn split_kernel_name(&self, form: SplitForm) -> String {
        match form {
            SplitForm::Plain => self.split_name(),
            SplitForm::Merged => self.merged_name(),
            SplitForm::Whole => self.whole_name(),
        }
    }

    /// Does this configuration have a whole-token form ([`whole_kernel`])? Every tensor-core
    /// one; the scalar lowering's plans never take whole tokens (on wgpu a device's loop limit
    /// caps the steps a workgroup walks).
    pub fn has_whole_form(&self) -> bool {
        self.lowering != Lowering::Scalar
    }

    /// Does this configuration have a merged form ([`merged_kernel`])? The bf16 v6
    /// tensor-core kernels (the backend's small bf16 calls) and v7 in one warp group (fp8's
    /// small calls and its large-batch kernel, bf16 above 16 heads where its blocks fill a wave).
    /// fp8_ds_mla's v6 kernels have no room left for the merge's 4 KB of shared memory within
    /// SM120's 101376 bytes; bf16's large-batch kernel (warp groups) runs one split.
    pub fn has_merged_form(&self) -> bool {
        match self.lowering {
            Lowering::Mma { .. } => self.format == CacheFormat::Bf16,
            Lowering::MmaWs { groups, .. } => groups == 1,
            Lowering::Scalar => false,
        }
    }

    pub fn combine_name(&self) -> String {
        format!(
            "sparse_mla_decode_combine_d{}_t{}",
            self.dims.d_v(),
            self.threads
        )
    }
}

/// The fewest rows (T · H) a merged call has. The in-kernel merge costs about what the
/// combine kernel does at T = 1 (a meeting, then one round of loads: ~3.5 µs of the merged
/// kernel on the H200), so it pays where the combine grows with the rows: H 8 T 1 ran 12.5 µs
/// as two launches and 13.2 merged, H 16 T 1 14.0 against 13.2, H 8 T 2 15.1 against 13.7
/// (benches/NOTES.md, v19).
pub const MERGE_MIN_ROWS: u64 = 16;

/// Where a backend takes the merged kernel: `SPARSE_MLA_MERGE` = `0` ([`Self::Off`]), `1` or
/// unset ([`Self::WherePays`]), `all` ([`Self::WhereCan`]: every call it can run, where it
/// pays or not — for measuring the rule on another GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MergePolicy {
    Off,
    WherePays,
    WhereCan,
}

impl MergePolicy {
    /// The policy `SPARSE_MLA_MERGE` asks for.
    pub fn from_env() -> Result<Self> {
        match std::env::var("SPARSE_MLA_MERGE").as_deref() {
            Err(_) | Ok("") | Ok("1") => Ok(MergePolicy::WherePays),
            Ok("0") => Ok(MergePolicy::Off),
            Ok("all") => Ok(MergePolicy::WhereCan),
            Ok(other) => Err(Error::arg("SPARSE_MLA_MERGE", "0, 1 or all", other)),
        }
    }
}

/// The least gain (model time of the best uniform split over the whole-token plan's) for
/// which [`DecodePlan::model_whole`] takes whole tokens: the model's terms are fitted to
/// within a few percent, so a smaller gain is not worth a plan of another shape.
pub const WHOLE_MIN_GAIN: f64 = 1.05;

/// Whole tokens before the split ones, as `SPARSE_MLA_WHOLE_TOKENS` asks: unset, the cost
/// model's choice ([`DecodePlan::model_whole`]); `0`, never (every token split alike); N,
/// the largest multiple of the splits ≤ min(N, T - 1) (tests: whole and split tokens in
/// one call wherever T exceeds the splits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WholeTokens {
    Model,
    Off,
    Forced(u32),
}

impl WholeTokens {
    /// The policy `SPARSE_MLA_WHOLE_TOKENS` asks for.
    pub fn from_env() -> Result<Self> {
        match std::env::var("SPARSE_MLA_WHOLE_TOKENS").as_deref() {
            Err(_) | Ok("") => Ok(WholeTokens::Model),
            Ok("0") => Ok(WholeTokens::Off),
            Ok(n) => n.parse::<u32>().map(WholeTokens::Forced).map_err(|_| {
                Error::arg(
                    "SPARSE_MLA_WHOLE_TOKENS",
                    "unset (the cost model), 0 (off) or a token count",
                    n,
                )
            }),
        }
    }
}

/// Which split kernel of a configuration: the plain one, the one that merges its own partials
/// ([`merge`]), or the one that runs whole tokens before the split ones
/// ([`DecodePlan::whole_tokens`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitForm {
    Plain,
    Merged,
    Whole,
}

/// A config plus the run-time choice of splits for one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodePlan {
    pub config: DecodeConfig,
    pub splits: u32,
    /// Top-k entries per split (a multiple of `block_n`).
    pub chunk: u32,
    /// With more than one split: one launch of the kernel that merges its own partials
    /// ([`merge`]) instead of the split kernel and the combine. Set by a backend that can
    /// launch it cooperatively and has checked that the grid fits the GPU at once.
    pub merged: bool,
    /// Tokens run whole, one workgroup per head block, before the split ones (a multiple of
    /// `splits`; 0: every token split alike). Where a batch just misses a whole number of
    /// waves, full waves of whole tokens and the rest split finish sooner than any uniform
    /// split ([`Self::model_whole`]).
    pub whole_tokens: u32,
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
        shape.validate()?;
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
        Ok(DecodePlan {
            config,
            splits,
            chunk,
            merged: false,
            whole_tokens: 0,
        })
    }

    /// The plan with its first `whole` tokens run whole: a multiple of the splits, at most
    /// the tokens, not with the merged form (whose workgroups of a token all meet).
    pub fn with_whole_tokens(self, shape: &DecodeShape, whole: u32) -> Result<Self> {
        if whole % self.splits != 0 || whole > shape.tokens {
            return Err(Error::arg(
                "whole_tokens",
                format!(
                    "a multiple of the splits ({}) and at most the tokens ({})",
                    self.splits, shape.tokens
                ),
                whole,
            ));
        }
        if whole > 0 && !self.config.has_whole_form() {
            return Err(Error::arg(
                "whole_tokens",
                "0 with the scalar lowering (it has no whole-token form)",
                whole,
            ));
        }
        if whole > 0 && self.merged {
            return Err(Error::arg("whole_tokens", "0 with the merged form", whole));
        }
        Ok(DecodePlan {
            whole_tokens: whole,
            ..self
        })
    }

    /// Tokens whose rows go through the partials: `tokens - whole_tokens` with more than one
    /// split, else 0.
    pub fn split_tokens(&self, shape: &DecodeShape) -> u32 {
        if self.splits > 1 {
            shape.tokens - self.whole_tokens.min(shape.tokens)
        } else {
            0
        }
    }

    /// Rows of the partials (`o_part`, `lse_part`): split tokens x heads x splits.
    pub fn partial_rows(&self, shape: &DecodeShape) -> u64 {
        self.split_tokens(shape) as u64 * shape.heads as u64 * self.splits as u64
    }

    /// The plan of a tensor-core configuration (v6, v7 or the large-batch kernel) with splits
    /// from a cost model of the GPU ([`Self::model_splits`]): `resident` split workgroups run
    /// at once on `sms` multiprocessors. `splits` overrides the model.
    ///
    /// Without `splits`, the model may also run full waves of whole tokens before the rest
    /// split ([`Self::model_whole`]); `SPARSE_MLA_WHOLE_TOKENS=0` turns that off (a
    /// comparison run), a number N takes the model's uniform splits and, of the tokens, the
    /// largest multiple of them ≤ min(N, T - 1) whole (a test of both kinds in one call).
    pub fn with_config(
        config: DecodeConfig,
        shape: &DecodeShape,
        resident: u32,
        sms: u32,
        splits: Option<u32>,
    ) -> Result<Self> {
        Self::with_config_whole(
            config,
            shape,
            resident,
            sms,
            splits,
            WholeTokens::from_env()?,
        )
    }

    /// [`Self::with_config`] with whole tokens as `whole` says, not the environment.
    pub fn with_config_whole(
        config: DecodeConfig,
        shape: &DecodeShape,
        resident: u32,
        sms: u32,
        splits: Option<u32>,
        whole: WholeTokens,
    ) -> Result<Self> {
        if let Some(s) = splits {
            return Self::new(config, shape, resident, Some(s), None);
        }
        let uniform = Self::model_splits(&config, shape, resident, sms);
        if !config.has_whole_form() {
            return Self::new(config, shape, resident, Some(uniform), None);
        }
        match whole {
            WholeTokens::Off => Self::new(config, shape, resident, Some(uniform), None),
            WholeTokens::Model => {
                match Self::model_whole_against(&config, shape, resident, sms, uniform) {
                    Some((whole, s)) => Self::new(config, shape, resident, Some(s), None)?
                        .with_whole_tokens(shape, whole),
                    None => Self::new(config, shape, resident, Some(uniform), None),
                }
            }
            WholeTokens::Forced(n) => {
                let plan = Self::new(config, shape, resident, Some(uniform), None)?;
                let whole = n.min(shape.tokens - 1) / plan.splits * plan.splits;
                plan.with_whole_tokens(shape, whole)
            }
        }
    }

    /// The cost model's time of a call (in its step units) that runs `whole` tokens whole and
    /// the rest in `s` splits ([`Self::model_splits`] says what the units and terms are).
    fn model_cost(
        config: &DecodeConfig,
        shape: &DecodeShape,
        resident: u32,
        sms: u32,
        whole: u32,
        s: u32,
    ) -> f64 {
        // Per-workgroup cost outside the step loop: q load, pipeline fill, epilogue.
        const FIXED: f64 = 2.0;
        let resident = resident.max(1) as u64;
        let sms = (sms.max(1) as u64).min(resident);
        // a wave's time, in steps of one workgroup alone on its multiprocessor
        let slow = |k: u64| {
            if k <= 1 {
                1.0
            } else {
                k as f64 / (1.0 + 0.5 * (k - 1) as f64)
            }
        };
        let full_wave = slow(resident.div_ceil(sms));
        // waves of `n` equal workgroups, in units of one workgroup's time
        let waves = |n: u64| {
            let (full, rest) = (n / resident, n % resident);
            full as f64 * full_wave
                + if rest > 0 {
                    slow(rest.div_ceil(sms))
                } else {
                    0.0
                }
        };
        let blocks = shape.topk.div_ceil(config.block_n).max(1);
        let head_blocks = shape.heads.div_ceil(config.block_h) as u64;
        let whole = whole.min(shape.tokens);
        let split_tokens = (shape.tokens - whole) as u64;
        let s = s.max(1);
        let piece = blocks.div_ceil(s) as f64 + FIXED;
        let mut t = 0.0;
        let mut pieces = split_tokens * head_blocks * s as u64;
        if whole > 0 {
            let n = whole as u64 * head_blocks;
            let len = blocks as f64 + FIXED;
            t += waves(n) * len;
            // the last whole wave's idle slots take pieces meanwhile
            let idle = n.div_ceil(resident) * resident - n;
            pieces = pieces.saturating_sub(idle * (len / piece).floor() as u64);
        }
        t += waves(pieces) * piece;
        if s > 1 && split_tokens > 0 {
            // the combine: a launch and the partials written and read back (its
            // workgroups load a row's splits at once: no walk that grows with s). The
            // partials stay in L2, so their bytes count half a gathered byte (fitted to
            // the H200's split sweeps at T = 1, benches/NOTES.md).
            let step_bytes = resident as f64
                * (config.block_n * config.format.row_bytes(config.dims)) as f64
                / full_wave;
            let rows = split_tokens as f64 * shape.heads as f64;
            let partial_bytes = rows * s as f64 * (config.dims.d_v() as f64 + 1.0) * 4.0 * 2.0;
            t += 1.0 + 0.5 * partial_bytes / step_bytes;
        }
        t
    }

    /// The split count of the cost model: `resident` workgroups of the split kernel run at
    /// once on `sms` multiprocessors.
    ///
    /// Time is counted in workgroup steps (one `block_n` gather + its math): a split count
    /// `s` costs, for each wave of workgroups, `slow(k) x (steps(s) + FIXED)`, plus, when
    /// `s > 1`, the combine (a launch, about a step, and the partials written and read again,
    /// in step-sized byte units). `k` is the workgroups a wave puts on one multiprocessor:
    /// co-resident workgroups share it, each added one worth half a workgroup's speed,
    /// `slow(k) = k / (1 + (k - 1) / 2)` (the H200 runs two v6 workgroups per SM 1.55x as fast
    /// as one). Without that term the model took two 1-step workgroups per SM for one 2-step
    /// workgroup, and lost 5–16 % on bf16 calls of four head blocks (H 8 T 4 to H 128 T 1;
    /// benches/NOTES.md, v14). Small batches thus split until the GPU is full; large ones
    /// stay whole, with no combine.
    pub fn model_splits(
        config: &DecodeConfig,
        shape: &DecodeShape,
        resident: u32,
        sms: u32,
    ) -> u32 {
        let blocks = shape.topk.div_ceil(config.block_n).max(1);
        let mut best = (f64::MAX, 1);
        for s in 1..=blocks.min(128) {
            let t = Self::model_cost(config, shape, resident, sms, 0, s);
            // a smaller count wins ties: less combine traffic for the same time
            if t < best.0 - 1e-9 {
                best = (t, s);
            }
        }
        best.1
    }

    /// Whole tokens and the splits of the rest, where the model has them faster than every
    /// uniform split ([`Self::model_splits`]) by at least [`WHOLE_MIN_GAIN`]; `None` elsewhere.
    ///
    /// A batch just past a whole number of waves of unsplit workgroups (T 133–165 at one
    /// 16-head workgroup per SM on 132 SMs) splits every token alike today, into as many
    /// waves as the splits allow: at T 144 four splits of 16 steps make 5 waves of 18 (the
    /// wave cliff, benches/NOTES.md v36). Here `m` full waves run whole tokens and the
    /// remaining tokens split finely enough to fill one more short wave: 66 + 8 units where
    /// the uniform plan takes 90. `m` is the most full waves the batch has, or one fewer;
    /// the whole tokens are `m` waves' worth, rounded down to a multiple of the splits.
    pub fn model_whole(
        config: &DecodeConfig,
        shape: &DecodeShape,
        resident: u32,
        sms: u32,
    ) -> Option<(u32, u32)> {
        let uniform = Self::model_splits(config, shape, resident, sms);
        Self::model_whole_against(config, shape, resident, sms, uniform)
    }

    /// [`Self::model_whole`] against `uniform`, the model's uniform split count (the plan has
    /// it already: [`Self::model_splits`] is not walked twice a call).
    fn model_whole_against(
        config: &DecodeConfig,
        shape: &DecodeShape,
        resident: u32,
        sms: u32,
        uniform: u32,
    ) -> Option<(u32, u32)> {
        let blocks = shape.topk.div_ceil(config.block_n).max(1);
        let head_blocks = shape.heads.div_ceil(config.block_h).max(1);
        let per_wave = resident.max(1) / head_blocks;
        if per_wave == 0 || blocks < 2 {
            return None;
        }
        let base = Self::model_cost(config, shape, resident, sms, 0, uniform);
        let mut best: Option<(f64, u32, u32)> = None;
        // the most full waves, or one fewer (a longer tail split finer)
        let most = shape.tokens / per_wave;
        for m in most.saturating_sub(1).max(1)..=most {
            for s in 2..=blocks.min(128) {
                // only counts the plan makes as asked (33 of 64 blocks would be 32 chunks of 2)
                if blocks.div_ceil(blocks.div_ceil(s)) != s {
                    continue;
                }
                let whole = m * per_wave / s * s;
                if whole == 0 || whole >= shape.tokens {
                    continue;
                }
                let t = Self::model_cost(config, shape, resident, sms, whole, s);
                if best.is_none_or(|(b, _, _)| t < b - 1e-9) {
                    best = Some((t, whole, s));
                }
            }
        }
        best.filter(|&(t, _, _)| t * WHOLE_MIN_GAIN < base)
            .map(|(_, whole, s)| (whole, s))
    }

    /// The plan with the merged form taken where it can run ([`merge`]): more than one
    /// split, a configuration that has the form, and a grid of at most `resident_merged`
    /// workgroups — how many of the merged kernel the GPU holds at once, for its cooperative
    /// launch (a grid beyond it would be refused). Correct for any such plan; what the
    /// backend takes is [`Self::merged_where_it_pays`].
    pub fn merged_where_it_can(self, shape: &DecodeShape, resident_merged: u32) -> Self {
        let blocks = self
            .grid_split(shape)
            .iter()
            .map(|&d| d as u64)
            .product::<u64>();
        DecodePlan {
            merged: self.splits > 1
                && self.whole_tokens == 0
                && self.config.has_merged_form()
                && blocks <= resident_merged as u64,
            ..self
        }
    }

    /// [`Self::merged_where_it_can`], where it also pays: at least [`MERGE_MIN_ROWS`] rows
    /// (T · H), and one round of merging a workgroup ([`merge::merge_rounds`]: the token's
    /// segments no more than its workgroups).
    pub fn merged_where_it_pays(self, shape: &DecodeShape, resident_merged: u32) -> Self {
        let plan = self.merged_where_it_can(shape, resident_merged);
        let pays = shape.tokens as u64 * shape.heads as u64 >= MERGE_MIN_ROWS
            && merge::merge_rounds(
                shape.heads,
                plan.splits,
                plan.merge_members(shape),
                shape.dims.d_v(),
                plan.config.threads,
            ) == 1;
        DecodePlan {
            merged: plan.merged && pays,
            ..plan
        }
    }

    /// The plan merged as `policy` says ([`MergePolicy`]).
    pub fn merged_by(self, policy: MergePolicy, shape: &DecodeShape, resident_merged: u32) -> Self {
        match policy {
            MergePolicy::Off => self,
            MergePolicy::WherePays => self.merged_where_it_pays(shape, resident_merged),
            MergePolicy::WhereCan => self.merged_where_it_can(shape, resident_merged),
        }
    }

    /// Does the call run as one launch of the merged kernel ([`Self::merged`] with more than
    /// one split)?
    pub fn runs_merged(&self) -> bool {
        self.merged && self.splits > 1
    }

    /// Workgroups of one token, which meet and merge its rows in the merged kernel:
    /// ⌈H / block_h⌉ · S.
    pub fn merge_members(&self, shape: &DecodeShape) -> u32 {
        shape.heads.div_ceil(self.config.block_h) * self.splits
    }

    /// The split kernel's grid: (head blocks, splits, whole tokens / splits + split tokens).
    pub fn grid_split(&self, shape: &DecodeShape) -> [u32; 3] {
        let whole = self.whole_tokens.min(shape.tokens);
        [
            shape.heads.div_ceil(self.config.block_h),
            self.splits,
            whole / self.splits.max(1) + shape.tokens - whole,
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

mod combine;
mod io;
pub mod merge;
mod split;
mod v6;

pub use combine::{combine_grid, combine_groups, combine_kernel};
pub use split::{split_kernel_v7, split_kernel_v7_with};
pub use v6::{split_kernel_v6, split_kernel_v6_with};

/// The split kernel of a config: the v6 description for the v6 tensor-core configurations
/// ([`Lowering::Mma`]), the current one for every other lowering.
pub fn split_kernel(cfg: &DecodeConfig) -> Result<Kernel> {
    match cfg.lowering {
        Lowering::Mma { .. } => split_kernel_v6(cfg),
        _ => split_kernel_v7(cfg),
    }
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
    let merged = plan.runs_merged();
    let (split, combine) = lowered_kernels(&plan.config)?;
    let split = if merged {
        lowered_merged(&plan.config)?
    } else if plan.whole_tokens > 0 {
        lowered_whole(&plan.config)?
    } else {
        split
    };
    let mut values = vec![
        ("tokens", ParamValue::U32(shape.tokens)),
        ("heads", ParamValue::U32(shape.heads)),
        ("topk", ParamValue::U32(shape.topk)),
        ("num_slots", ParamValue::U32(shape.num_slots() as u32)),
        ("splits", ParamValue::U32(plan.splits)),
        ("chunk", ParamValue::U32(plan.chunk)),
        ("whole_tokens", ParamValue::U32(plan.whole_tokens)),
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
    ];
    if merged {
        let groups = merge::merge_groups(
            shape.heads,
            plan.splits,
            plan.merge_members(shape),
            shape.dims.d_v(),
            plan.config.threads,
        );
        values.push(("merge_groups", ParamValue::U32(groups)));
    }
    let split_params = pack_params(&split, &values)?;
    let mut out = vec![Launch {
        kernel: split,
        grid: plan.grid_split(shape),
        params: split_params,
    }];
    let split_tokens = plan.split_tokens(shape);
    if split_tokens > 0 && !merged {
        let threads = combine.workgroup_size;
        let groups = combine_groups(split_tokens * shape.heads, plan.splits, threads);
        let params = pack_params(
            &combine,
            &[
                ("heads", ParamValue::U32(shape.heads)),
                ("splits", ParamValue::U32(plan.splits)),
                ("whole_tokens", ParamValue::U32(plan.whole_tokens)),
                ("lse_s_q", ParamValue::U32(layout.lse.s_q())),
                ("groups", ParamValue::U32(groups)),
            ],
        )?;
        let grid = combine_grid(shape.heads, split_tokens, shape.dims.d_v(), groups, threads);
        out.push(Launch {
            kernel: combine,
            grid,
            params,
        });
    }
    Ok(out)
}

type KernelPair = (Arc<Kernel>, Arc<Kernel>);

/// The lowered split and combine kernels of a config, built once per process.
pub fn lowered_kernels(config: &DecodeConfig) -> Result<KernelPair> {
    static CACHE: KernelCache<KernelPair> = OnceLock::new();
    cached(&CACHE, config, || {
        let split = Arc::new(crate::kir::lower(&split_kernel(config)?, config.lowering)?);
        let combine = Arc::new(crate::kir::lower(
            &combine_kernel(config)?,
            config.lowering,
        )?);
        Ok((split, combine))
    })
}

/// Lowered kernels by config, built once per process.
type KernelCache<V> = OnceLock<Mutex<HashMap<DecodeConfig, V>>>;

/// `cache`'s entry for `config`, made by `build` the first time.
fn cached<V: Clone>(
    cache: &KernelCache<V>,
    config: &DecodeConfig,
    build: impl FnOnce() -> Result<V>,
) -> Result<V> {
    let cache = cache.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(v) = cache.lock().map_err(|_| poisoned())?.get(config) {
        return Ok(v.clone());
    }
    let v = build()?;
    cache
        .lock()
        .map_err(|_| poisoned())?
        .insert(*config, v.clone());
    Ok(v)
}

/// The split kernel of a config that merges its own partials ([`merge`]): the
/// configurations of [`DecodeConfig::has_merged_form`].
pub fn merged_kernel(cfg: &DecodeConfig) -> Result<Kernel> {
    if !cfg.has_merged_form() {
        return Err(Error::arg(
            "config",
            "a bf16 v6 or a one-group v7 tensor-core configuration (the merged form is built for those)",
            format!("{} {}", cfg.format.name(), cfg.family()),
        ));
    }
    match cfg.lowering {
        Lowering::Mma { .. } => split_kernel_v6_with(cfg, SplitForm::Merged),
        _ => split_kernel_v7_with(cfg, SplitForm::Merged),
    }
}

/// The split kernel of a config that runs whole tokens before the split ones
/// ([`DecodePlan::whole_tokens`]): the configurations of [`DecodeConfig::has_whole_form`].
pub fn whole_kernel(cfg: &DecodeConfig) -> Result<Kernel> {
    if !cfg.has_whole_form() {
        return Err(Error::arg(
            "config",
            "a tensor-core configuration (the whole-token form is built for those)",
            cfg.lowering.name(),
        ));
    }
    match cfg.lowering {
        Lowering::Mma { .. } => split_kernel_v6_with(cfg, SplitForm::Whole),
        _ => split_kernel_v7_with(cfg, SplitForm::Whole),
    }
}

/// The lowered whole-token kernel of a config ([`whole_kernel`]), built once per process.
pub fn lowered_whole(config: &DecodeConfig) -> Result<Arc<Kernel>> {
    static CACHE: KernelCache<Arc<Kernel>> = OnceLock::new();
    lowered_by(&CACHE, config, whole_kernel)
}

/// The lowered merged kernel of a config ([`merged_kernel`]), built once per process.
pub fn lowered_merged(config: &DecodeConfig) -> Result<Arc<Kernel>> {
    static CACHE: KernelCache<Arc<Kernel>> = OnceLock::new();
    lowered_by(&CACHE, config, merged_kernel)
}

/// `cache`'s lowered kernel for `config`, described by `describe` the first time.
fn lowered_by(
    cache: &KernelCache<Arc<Kernel>>,
    config: &DecodeConfig,
    describe: fn(&DecodeConfig) -> Result<Kernel>,
) -> Result<Arc<Kernel>> {
    cached(cache, config, || {
        Ok(Arc::new(crate::kir::lower(
            &describe(config)?,
            config.lowering,
        )?))
    })
}

fn poisoned() -> Error {
    Error::runtime("kernels", "kernel cache lock poisoned by an earlier panic")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(format: CacheFormat, heads: u32, tokens: u32) -> DecodeShape {
        DecodeShape {
            tokens,
            heads,
            topk: 2048,
            num_pages: 1024,
            page_size: 64,
            dims: MlaDims::PRODUCTION,
            format,
            scale: 1.0,
            has_topk_length: false,
        }
    }

    /// The family `for_call` picks for a call of `tokens` x `heads` on 132 SMs.
    fn pick(format: CacheFormat, heads: u32, tokens: u32, v6_per_sm: u32) -> &'static str {
        DecodeConfig::for_call(&shape(format, heads, tokens), 132, || {
            Ok::<u32, ()>(v6_per_sm)
        })
        .unwrap()
        .family()
    }

    #[test]
    fn calls_merge_where_the_form_exists_pays_and_fits() {
        let merged = |format: CacheFormat, heads: u32, tokens: u32, splits: u32, resident: u32| {
            let s = shape(format, heads, tokens);
            let config = DecodeConfig::tensor_core_v6(s.dims, format, heads);
            DecodePlan::new(config, &s, resident, Some(splits), None)
                .unwrap()
                .merged_where_it_pays(&s, resident)
                .merged
        };
        // H 16 T 1, 64 splits: 64 workgroups of 264
        assert!(merged(CacheFormat::Bf16, 16, 1, 64, 264));
        // too few rows: H 8 T 1 ran faster as two launches; H 8 T 2 merges
        assert!(!merged(CacheFormat::Bf16, 8, 1, 64, 264));
        assert!(merged(CacheFormat::Bf16, 8, 2, 64, 264));
        // more segments than workgroups: H 16 with 8 splits merges 16 whole rows in 8
        // workgroups (two rounds) and keeps two launches; with 16 splits it merges
        assert!(!merged(CacheFormat::Bf16, 16, 16, 8, 264));
        assert!(merged(CacheFormat::Bf16, 16, 16, 16, 264));
        let s = shape(CacheFormat::Bf16, 64, 32);
        let v7 = DecodeConfig::tensor_core_v7(s.dims, s.format, 64);
        let plan = DecodePlan::new(v7, &s, 132, Some(2), None).unwrap();
        assert!(!plan.merged_where_it_pays(&s, 1000).merged, "16 rounds");
        assert!(plan.merged_where_it_can(&s, 1000).merged);
        // SPARSE_MLA_MERGE's policies: 0 never, 1 the rule, all wherever the form runs
        assert_eq!(plan.merged_by(MergePolicy::Off, &s, 1000), plan);
        assert!(!plan.merged_by(MergePolicy::WherePays, &s, 1000).merged);
        assert!(plan.merged_by(MergePolicy::WhereCan, &s, 1000).merged);
        assert!(
            !plan.merged_by(MergePolicy::WhereCan, &s, 3).merged,
            "grid of 4"
        );
        // one split: nothing to merge
        assert!(!merged(CacheFormat::Bf16, 16, 4, 1, 264));
        // a grid the GPU does not hold at once (4 x 64 > 132)
        assert!(!merged(CacheFormat::Bf16, 16, 4, 64, 132));
        assert!(merged(CacheFormat::Bf16, 16, 4, 33, 132));
        // fp8_ds_mla's v6 kernels have no merged form; its v7 kernels (and bf16's) do, its
        // large-batch kernel (v7 with 64-row steps) too, bf16's (warp groups) not
        assert!(!merged(CacheFormat::Fp8DsMla, 16, 4, 8, 264));
        let s = shape(CacheFormat::Fp8DsMla, 16, 2);
        for (config, has) in [
            (DecodeConfig::tensor_core_v7(s.dims, s.format, 16), true),
            (
                DecodeConfig::tensor_core_v7(s.dims, CacheFormat::Bf16, 64),
                true,
            ),
            (
                DecodeConfig::tensor_core_batch(s.dims, s.format, 16).unwrap(),
                true,
            ),
            (
                DecodeConfig::tensor_core_batch(s.dims, CacheFormat::Bf16, 16).unwrap(),
                false,
            ),
        ] {
            assert_eq!(config.has_merged_form(), has, "{}", config.family());
            let plan = DecodePlan::new(config, &s, 132, Some(32), None).unwrap();
            assert_eq!(plan.merged_where_it_pays(&s, 132).merged, has);
        }
    }

    #[test]
    fn the_v6_residency_is_asked_only_where_it_decides() {
        let ask = |format, heads, tokens| {
            let mut asked = false;
            let family = DecodeConfig::for_call(&shape(format, heads, tokens), 132, || {
                asked = true;
                Ok::<u32, ()>(2)
            })
            .unwrap()
            .family();
            (family, asked)
        };
        // small bf16 calls, bf16 batches large at any residency, fp8: never
        assert_eq!(ask(CacheFormat::Bf16, 16, 4), ("v6", false));
        assert_eq!(ask(CacheFormat::Bf16, 16, 128), ("batch", false));
        assert_eq!(ask(CacheFormat::Fp8DsMla, 16, 64), ("batch", false));
        assert_eq!(ask(CacheFormat::Fp8DsMla, 64, 64), ("v7", false));
        // bf16 calls v7 fills in one wave or more: never
        assert_eq!(ask(CacheFormat::Bf16, 64, 64), ("v7", false));
        assert_eq!(ask(CacheFormat::Bf16, 64, 128), ("v7", false));
        // between the bf16 thresholds, and above 16 heads in one partial wave
        assert_eq!(ask(CacheFormat::Bf16, 16, 80), ("v6", true));
        assert_eq!(ask(CacheFormat::Bf16, 32, 48), ("v6", true));
    }

    #[test]
    fn bf16_small_calls_run_v6_where_it_measured_faster() {
        // (H, T, v6 at two v6 workgroups per SM, v6 at one) on 132 SMs: the rows of
        // benches/h200-v23.txt where the faster kernel differs by more than 1.5 %, and the
        // edges of each factor
        for (heads, tokens, at_two, at_one) in [
            (8, 1, true, true),
            (8, 4, true, true),
            (16, 4, true, true),
            (16, 6, true, true),
            (8, 7, true, false),
            (8, 8, true, false),
            (16, 8, true, false),
        ] {
            for (per_sm, want) in [(2, at_two), (1, at_one)] {
                let got = pick(CacheFormat::Bf16, heads, tokens, per_sm);
                let expect = if want { "v6" } else { "v7" };
                assert_eq!(got, expect, "H {heads} T {tokens} at {per_sm} v6 per SM");
                let s = shape(CacheFormat::Bf16, heads, tokens);
                assert_eq!(DecodeConfig::is_v6_call(&s, 132, per_sm), want);
                assert!(DecodeConfig::is_small_call(&s, 132), "H {heads} T {tokens}");
            }
        }
        // above 16 heads, at either residency: v6 in 16-head blocks against v7 in 16-head
        // blocks (benches/h200-v25.txt call 2, both occupancies, two runs): v6 won every call
        // of <= 6 blocks; at 8, v7 won at SM120's occupancy (H 32 T 4, H 64 T 2) or at the
        // H200's (H 128 T 1)
        for (heads, tokens, want) in [
            (32, 1, true),
            (32, 2, true),
            (32, 3, true),
            (48, 1, true),
            (48, 2, true),
            (64, 1, true),
            (96, 1, true),
            (32, 4, false),
            (64, 2, false),
            (128, 1, false),
        ] {
            let s = shape(CacheFormat::Bf16, heads, tokens);
            for per_sm in [1, 2] {
                assert_eq!(DecodeConfig::is_v6_call(&s, 132, per_sm), want);
                let c = DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(per_sm)).unwrap();
                let expect = if want { ("v6", 16) } else { ("v7", 16) };
                assert_eq!(
                    (c.family(), c.block_h),
                    expect,
                    "H {heads} T {tokens} at {per_sm} v6 per SM"
                );
                if want {
                    assert_eq!(
                        Some(c),
                        DecodeConfig::tensor_core_v6_narrow(s.dims, s.format, heads)
                    );
                    assert_eq!(c, DecodeConfig::tensor_core_v6(s.dims, s.format, 16));
                }
            }
            // fp8_ds_mla keeps v7 in 16-head blocks there (its v6 is slower): 32-row steps
            // below 6 blocks, its large-batch kernel's 64-row steps from 6
            let s = shape(CacheFormat::Fp8DsMla, heads, tokens);
            let c = DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(2)).unwrap();
            let (family, rows) =
                if DecodeConfig::blocks16(&s) >= DecodeConfig::NARROW_WIDE_MIN_BLOCKS {
                    ("batch", 64)
                } else {
                    ("v7", 32)
                };
            assert_eq!(
                (c.family(), c.block_h, c.block_n),
                (family, 16, rows),
                "fp8 H {heads} T {tokens}"
            );
        }
        // every v6 call is a small one: past T 8 at H <= 16 the other rules decide
        let s = shape(CacheFormat::Bf16, 8, 9);
        assert!(!DecodeConfig::is_small_call(&s, 132));
        assert!((1..=4).all(|p| !DecodeConfig::is_v6_call(&s, 132, p)));
        // fp8_ds_mla keeps its own choice: v7 for the small calls
        assert_eq!(pick(CacheFormat::Fp8DsMla, 16, 8, 2), "v7");
    }

    #[test]
    fn narrow_calls_run_v7_in_16_head_blocks_where_it_measured_faster() {
        // (H, T, narrow) on 132 SMs: the H200 rows of benches/h200-v24.txt, both formats,
        // both occupancies; 16-head v7 won every call of <= 12 blocks of 16 heads (b) and lost
        // from 16 (H 64 T 4, H 128 T 2: 0.93-0.95x) and 18 (H 48 T 6, H 96 T 3)
        for (heads, tokens, narrow) in [
            (32, 1, true),
            (32, 2, true),
            (32, 4, true),
            (32, 6, true),
            (48, 1, true),
            (48, 4, true),
            (64, 1, true),
            (64, 3, true),
            (96, 2, true),
            (128, 1, true),
            (32, 8, false),
            (48, 6, false),
            (64, 4, false),
            (96, 3, false),
            (128, 2, false),
            (16, 1, false),
            (8, 1, false),
        ] {
            for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
                let s = shape(format, heads, tokens);
                assert_eq!(
                    DecodeConfig::is_narrow_call(&s, 132),
                    narrow,
                    "H {heads} T {tokens}"
                );
                for per_sm in [1, 2] {
                    let c = DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(per_sm)).unwrap();
                    // bf16's smallest narrow calls run v6 in 16-head blocks (is_v6_call, v25)
                    if format == CacheFormat::Bf16
                        && heads > 16
                        && DecodeConfig::is_v6_call(&s, 132, per_sm)
                    {
                        assert!(
                            narrow,
                            "H {heads} T {tokens}: such a v6 call is a narrow one"
                        );
                        assert_eq!((c.family(), c.block_h), ("v6", 16));
                    } else if narrow
                        && format == CacheFormat::Fp8DsMla
                        && DecodeConfig::blocks16(&s) >= DecodeConfig::NARROW_WIDE_MIN_BLOCKS
                    {
                        // fp8's of 6 blocks or more: its large-batch kernel (v26)
                        assert!(DecodeConfig::is_narrow_wide_call(&s, 132));
                        assert_eq!(
                            Some(c),
                            DecodeConfig::tensor_core_narrow_wide(s.dims, format, heads)
                        );
                        assert_eq!(Some(c), DecodeConfig::tensor_core_batch(s.dims, format, 16));
                        assert_eq!((c.block_h, c.block_n), (16, 64));
                    } else if narrow {
                        assert_eq!(
                            c,
                            DecodeConfig::tensor_core_narrow(s.dims, format, heads).unwrap()
                        );
                        assert_eq!((c.family(), c.block_h, c.l2_ahead()), ("v7", 16, 0));
                    } else {
                        assert!(
                            c.block_h > 16 || heads <= 16,
                            "{format:?} H {heads} T {tokens}: {}",
                            c.split_name()
                        );
                    }
                }
            }
        }
        // fp8's narrow calls on 64-row steps, as measured (v26): from 6 blocks, not at 2-4
        let wide = |heads, tokens| {
            let s = shape(CacheFormat::Fp8DsMla, heads, tokens);
            DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(1))
                .unwrap()
                .block_n
                == 64
        };
        for (heads, tokens) in [(32, 3), (48, 2), (64, 2), (96, 1), (128, 1), (64, 3)] {
            assert!(wide(heads, tokens), "fp8 H {heads} T {tokens}");
        }
        for (heads, tokens) in [(32, 1), (32, 2), (48, 1), (64, 1), (64, 4), (128, 2)] {
            assert!(!wide(heads, tokens), "fp8 H {heads} T {tokens}");
        }
        // the factor scales with the GPU: 170 SMs (RTX 5090) take 15 blocks
        let s = shape(CacheFormat::Bf16, 80, 3);
        assert!(!DecodeConfig::is_narrow_call(&s, 132));
        assert!(DecodeConfig::is_narrow_call(&s, 170));
        // no narrow configuration at 16 heads or fewer
        assert!(
            DecodeConfig::tensor_core_narrow(MlaDims::PRODUCTION, CacheFormat::Bf16, 16).is_none()
        );
    }

    #[test]
    fn bf16_above_16_heads_runs_v7_unless_its_one_wave_leaves_sms_idle() {
        // (H, T, v7 on 132 SMs): H200 rows where the two kernels differ by more than 2 %, v7
        // the faster (true) or v6 (false) — benches/h200-v17.txt call 2 for one wave, and
        // benches/h200-v28.txt call h3 for several (v7 1.03-1.13x since v28) — and the small
        // calls and H <= 16, which the rule leaves alone. Misses, not listed: H 32 T 96 and
        // H 64 T 48 (a partial wave, v7 1.05x faster in h3, the rule keeps v6).
        for (heads, tokens, want) in [
            (32, 8, true),
            (32, 16, true),
            (32, 32, true),
            (32, 48, false),
            (32, 64, true),
            (32, 128, true),
            (32, 192, true),
            (32, 256, true),
            (64, 4, true),
            (64, 8, true),
            (64, 16, true),
            (64, 64, true),
            (64, 96, true),
            (64, 128, true),
            (64, 192, true),
            (64, 256, true),
            (128, 2, true),
            (128, 4, true),
            (128, 8, true),
            (128, 32, true),
            (128, 48, true),
            (128, 64, true),
            (128, 96, true),
            (128, 128, true),
            (128, 256, true),
            (16, 32, false),
        ] {
            let s = shape(CacheFormat::Bf16, heads, tokens);
            assert_eq!(
                DecodeConfig::bf16_wide_runs_v7(&s, 132),
                want,
                "H {heads} T {tokens}"
            );
            let family = DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(2))
                .unwrap()
                .family();
            let expect = if want { "v7" } else { "v6" };
            assert_eq!(family, expect, "H {heads} T {tokens}");
        }
        // one v6 workgroup per SM: v7 past the small calls anyway
        let s = shape(CacheFormat::Bf16, 32, 48);
        let c = DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(1)).unwrap();
        assert_eq!(c.family(), "v7");
    }

    #[test]
    fn the_split_model_picks_what_the_h200_sweeps_measured_fastest() {
        use CacheFormat::{Bf16, Fp8DsMla};
        // (format, H, T, per SM, splits): the fastest of 4..64 in each row of the H200's
        // sweeps (benches/h200-v14.txt call 1; bf16 v6 at two workgroups per SM, fp8 v7 at
        // one), or one within 3 % of it
        for (format, heads, tokens, per_sm, want) in [
            (Bf16, 8, 1, 2, 64),
            (Bf16, 8, 4, 2, 32),
            (Bf16, 8, 8, 2, 32),
            (Bf16, 8, 16, 2, 16),
            (Bf16, 32, 4, 2, 32),
            (Bf16, 64, 2, 2, 32),
            (Bf16, 64, 16, 2, 8),
            (Bf16, 128, 1, 2, 32),
            (Bf16, 128, 4, 2, 16),
            (Bf16, 128, 16, 2, 4),
            (Fp8DsMla, 16, 4, 1, 32),
            (Fp8DsMla, 16, 8, 1, 16),
            (Fp8DsMla, 128, 1, 1, 32),
            (Fp8DsMla, 128, 8, 1, 4),
        ] {
            let config = match format {
                Bf16 => DecodeConfig::tensor_core_v6(MlaDims::PRODUCTION, format, heads),
                _ => DecodeConfig::tensor_core_v7(MlaDims::PRODUCTION, format, heads),
            };
            let got =
                DecodePlan::model_splits(&config, &shape(format, heads, tokens), 132 * per_sm, 132);
            assert_eq!(
                got, want,
                "{format:?} H {heads} T {tokens} at {per_sm} per SM"
            );
        }
    }

    #[test]
    fn whole_tokens_fill_the_wave_a_batch_just_misses() {
        use CacheFormat::{Bf16, Fp8DsMla};
        let dims = MlaDims::PRODUCTION;
        let v7 = DecodeConfig::tensor_core_v7(dims, Bf16, 16);
        let fp8 = DecodeConfig::tensor_core_batch(dims, Fp8DsMla, 16).unwrap();
        let v6 = DecodeConfig::tensor_core_v6(dims, Bf16, 16);
        // (config, format, T, resident): whole tokens and splits of the rest, or none
        for (config, format, tokens, resident, want) in [
            // one 16-head workgroup per SM on 132 SMs: past T 132 the uniform plan takes 5
            // waves of 18 steps (the wave cliff); a full wave of whole tokens, then the rest
            // in one short wave
            (v7, Bf16, 144, 132, Some((132, 11))),
            (v7, Bf16, 133, 132, Some((128, 32))),
            (v7, Bf16, 160, 132, Some((132, 4))),
            (fp8, Fp8DsMla, 144, 132, Some((132, 11))),
            // whole waves, or below one: the uniform plan
            (v7, Bf16, 132, 132, None),
            (v7, Bf16, 128, 132, None),
            (v7, Bf16, 264, 132, None),
            // two v6 workgroups per SM: 5 splits fill 2.7 waves of 264, within 5 % of the best
            (v6, Bf16, 144, 264, None),
        ] {
            let sh = shape(format, 16, tokens);
            assert_eq!(
                DecodePlan::model_whole(&config, &sh, resident, 132),
                want,
                "{format:?} T {tokens} resident {resident}"
            );
        }
        // every choice: whole tokens a multiple of splits the plan makes as asked, fewer than
        // T, and the model's time at least WHOLE_MIN_GAIN below the best uniform split's
        for tokens in (100..700).step_by(7) {
            for (config, format, resident) in
                [(v7, Bf16, 132), (fp8, Fp8DsMla, 132), (v6, Bf16, 264)]
            {
                let sh = shape(format, 16, tokens);
                let Some((whole, s)) = DecodePlan::model_whole(&config, &sh, resident, 132) else {
                    continue;
                };
                let plan = DecodePlan::new(config, &sh, resident, Some(s), None).unwrap();
                assert_eq!(plan.splits, s, "T {tokens}");
                assert!(
                    whole % s == 0 && whole > 0 && whole < tokens,
                    "T {tokens}: {whole} {s}"
                );
                let u = DecodePlan::model_splits(&config, &sh, resident, 132);
                let t = DecodePlan::model_cost(&config, &sh, resident, 132, whole, s);
                assert!(
                    t * WHOLE_MIN_GAIN < DecodePlan::model_cost(&config, &sh, resident, 132, 0, u)
                );
            }
        }
        // the plan: grid z = W / S + the split tokens, partials for the split tokens only
        let sh = shape(Bf16, 16, 144);
        let plan = DecodePlan::new(v7, &sh, 132, Some(11), None)
            .unwrap()
            .with_whole_tokens(&sh, 132)
            .unwrap();
        assert_eq!(plan.grid_split(&sh), [1, 11, 12 + 12]);
        assert_eq!(plan.split_tokens(&sh), 12);
        assert_eq!(plan.partial_rows(&sh), 12 * 16 * 11);
        let launches = launches(&sh, &DecodeLayout::default(), &plan).unwrap();
        assert_eq!(launches.len(), 2);
        assert_eq!(
            launches[0].kernel.name,
            v7.whole_name(),
            "the whole-token form"
        );
        assert_eq!(launches[0].grid, plan.grid_split(&sh));
        assert_eq!(
            launches[1].grid[1], 12,
            "the combine covers the split tokens"
        );
        // the plain kernel keeps the plain grid: no whole_tokens parameter
        let (plain, _) = lowered_kernels(&v7).unwrap();
        assert!(plain.params.iter().all(|p| p.name != "whole_tokens"));
        let whole = lowered_whole(&v7).unwrap();
        assert!(whole.params.iter().any(|p| p.name == "whole_tokens"));
        // all tokens whole: no combine
        let all = DecodePlan::new(v7, &sh, 132, Some(4), None)
            .unwrap()
            .with_whole_tokens(&sh, 144)
            .unwrap();
        assert_eq!(all.partial_rows(&sh), 0);
        assert_eq!(launches_len(&sh, &all), 1);
        // refused: not a multiple of the splits, more than the tokens, with the merged form
        let base = DecodePlan::new(v7, &sh, 132, Some(11), None).unwrap();
        for bad in [131, 154] {
            let e = base.with_whole_tokens(&sh, bad).unwrap_err().to_string();
            assert!(e.contains("whole_tokens"), "{e}");
        }
        let merged = DecodePlan {
            merged: true,
            ..base
        };
        assert!(merged.with_whole_tokens(&sh, 132).is_err());
        let scalar = DecodeConfig::portable(MlaDims::PRODUCTION, Bf16);
        let scalar_plan = DecodePlan::new(scalar, &sh, 132, Some(2), None).unwrap();
        assert!(scalar_plan.with_whole_tokens(&sh, 132).is_err());
        assert_eq!(
            DecodePlan::with_config_whole(scalar, &sh, 132, 132, None, WholeTokens::Forced(100))
                .unwrap()
                .whole_tokens,
            0,
            "the scalar lowering has no whole-token form"
        );
        assert!(
            !base
                .with_whole_tokens(&sh, 132)
                .unwrap()
                .merged_where_it_can(&sh, 100_000)
                .merged
        );
    }

    fn launches_len(sh: &DecodeShape, plan: &DecodePlan) -> usize {
        launches(sh, &DecodeLayout::default(), plan).unwrap().len()
    }

    #[test]
    fn the_backend_choice_at_one_and_two_v6_workgroups_per_sm() {
        use CacheFormat::{Bf16, Fp8DsMla};
        // one v6 workgroup per SM (SM120): v6 only for the smallest bf16 calls,
        // f T ceil(H/16) <= SMs with f 20 (is_v6_call)
        for (heads, small, next) in [(16, 6, 7), (8, 6, 7)] {
            assert_eq!(pick(Bf16, heads, small, 1), "v6", "H {heads} T {small}");
            assert_eq!(pick(Bf16, heads, next, 1), "v7", "H {heads} T {next}");
            assert_eq!(
                pick(Fp8DsMla, heads, small, 1),
                "v7",
                "fp8 H {heads} T {small}"
            );
        }
        assert_eq!(pick(Bf16, 128, 1, 1), "v7");
        // two per SM (H100/H200): bf16 v6 below the large batch, and above 16 heads where
        // v7's one partial wave would leave SMs idle; v7 where its blocks take several waves
        assert_eq!(pick(Bf16, 16, 9, 2), "v6");
        assert_eq!(pick(Bf16, 32, 48, 2), "v6");
        assert_eq!(pick(Bf16, 128, 40, 2), "v7");
        // fp8_ds_mla: the large-batch kernel for every call at H <= 16 past the small ones,
        // v7 above 16 heads
        for v6 in [1, 2] {
            assert_eq!(pick(Fp8DsMla, 16, 8, v6), "v7");
            assert_eq!(pick(Fp8DsMla, 16, 9, v6), "batch");
            assert_eq!(pick(Fp8DsMla, 8, 9, v6), "batch");
            assert_eq!(pick(Fp8DsMla, 32, 100, v6), "v7");
        }
        // a bf16 large batch at H <= 16, only where the split model gives each workgroup 20
        // steps or more (of topk 2048's 64 on 132 SMs: 2 or 3 splits at T 34-44, 53-66,
        // 80-88, 166-220, 1 at T 106-132 and 221-264; 4 or 5 splits, 13-16 steps, at T 27-33,
        // 45-52, 67-79, 89-105 and 133-165): past the small calls at one v6 workgroup per SM,
        // from 5 T ceil(H/16) >= 4 SMs at two
        for (t, want) in [
            (33, "v7"),
            (34, "batch"),
            (44, "batch"),
            (45, "v7"),
            (52, "v7"),
            (53, "batch"),
            (66, "batch"),
            (67, "v7"),
            (79, "v7"),
            (80, "batch"),
            (88, "batch"),
            (96, "v7"),
            (106, "batch"),
            (132, "batch"),
            (144, "v7"),
            (192, "batch"),
            (264, "batch"),
        ] {
            assert_eq!(pick(Bf16, 16, t, 1), want, "H 16 T {t}");
            assert_eq!(pick(Bf16, 8, t, 1), want, "H 8 T {t}");
        }
        assert_eq!(pick(Bf16, 16, 44, 2), "v6");
        assert_eq!(pick(Bf16, 8, 66, 2), "v6");
        assert_eq!(pick(Bf16, 16, 105, 2), "v6");
        assert_eq!(pick(Bf16, 16, 106, 2), "batch");
        assert_eq!(pick(Bf16, 8, 106, 3), "batch");
        // past one wave with 16-step splits: v6 where two fit (1.11x the batch kernel at
        // H 16 T 144 on an H100), v7 at one (1.07x; benches/NOTES.md v36)
        assert_eq!(pick(Bf16, 16, 144, 2), "v6");
        assert_eq!(pick(Bf16, 16, 160, 1), "v7");
        assert_eq!(pick(Bf16, 16, 192, 2), "batch");
    }
}
