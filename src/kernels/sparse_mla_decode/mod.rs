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
//!
//! Here: the configurations ([`DecodeConfig`]: block shapes, lowering, forms, kernel names)
//! and the kernels and launches of a plan. Apart: which configuration a call runs
//! (`choice.rs`), the call's splits, whole tokens and merge (`plan.rs`, [`DecodePlan`]), and
//! the kernel descriptions (`split.rs`, `v6.rs`, `combine.rs`, `merge.rs`, `io.rs`).

use super::{pack_params, Launch, ParamValue};
use crate::kir::ir::{Kernel, TileElem};
use crate::kir::{GroupBy, Lowering, RowSoftmax};
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
    /// How fp8_ds_mla's `P · V` takes its e4m3 values (tensor-core lowerings).
    pub fp8_values: Fp8Values,
}

/// How fp8_ds_mla's `P · V` takes the step's e4m3 values in a tensor-core kernel. The scores
/// take them as they are either way (exact, each tile's scale folded into its partial).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fp8Values {
    /// Every warp widens the values it multiplies in registers, each times its tile's scale,
    /// and rounds them to bf16: the work is done once per warp that reads a row.
    #[default]
    PerWarp,
    /// The step's values are decoded once, `bf16(e4m3 × scale)`, into a shared bf16 tile
    /// that every warp (of every warp group) reads: the same values, converted once per row,
    /// between two workgroup barriers. mla-bench's variants take it (`…v`); the backend does
    /// not: on an H100 it ran 0.76–0.97× v7 as v7's own 32-head blocks, and 0.78–0.96× in
    /// 64-head blocks at H 64 and 128 (benches/NOTES.md v41). (On sm_90 the scores' e4m3 product is still
    /// converted per warp; on SM120 it is native, and this would leave no per-warp
    /// conversion at all: not measurable here.)
    Shared,
}

impl Fp8Values {
    /// The form's value of `SPARSE_MLA_FP8_VALUES`: `per-warp` or `shared`.
    pub fn env_value(self) -> &'static str {
        match self {
            Fp8Values::PerWarp => "per-warp",
            Fp8Values::Shared => "shared",
        }
    }

    /// `SPARSE_MLA_FP8_VALUES`'s value: `per-warp` (or unset) or `shared`.
    pub fn from_env() -> Result<Self> {
        let forms = [Fp8Values::PerWarp, Fp8Values::Shared];
        Ok(
            crate::kir::form_from_env("SPARSE_MLA_FP8_VALUES", &forms, Self::env_value)?
                .unwrap_or_default(),
        )
    }
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
            fp8_values: Fp8Values::PerWarp,
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
            fp8_values: Fp8Values::PerWarp,
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

    /// The tensor-core configuration for `heads` query heads outside the size rules of
    /// [`Self::for_call`]: [`Self::tensor_core_on`], v7 on every GPU. What `mla-export` writes
    /// as a configuration's production kernel.
    pub fn tensor_core(dims: MlaDims, format: CacheFormat, heads: u32) -> Self {
        match Self::tensor_core_on(dims, format, heads, || {
            Ok::<u32, std::convert::Infallible>(2)
        }) {
            Ok(config) => config,
            Err(never) => match never {},
        }
    }

    /// The tensor-core configuration the CUDA backend runs outside the size rules of
    /// [`Self::for_call`], given how many workgroups of the bf16 v6 split kernel
    /// ([`Self::tensor_core_v6`]) the GPU holds per multiprocessor: v7
    /// ([`Self::tensor_core_v7`]) at any residency since v42, so `v6_per_sm` is not asked.
    /// - fp8_ds_mla: v7, faster than v6 on every measured row on the H200 at either occupancy
    ///   (benches/NOTES.md, v8);
    /// - bf16 at 16 heads or fewer: v7 at any residency since v41 (the smallest calls aside,
    ///   [`Self::is_v6_call`]). At two v6 workgroups an SM, v7 was 1.02–1.18× faster than v6
    ///   on an H100, two rounds (H 8 / 16 at T 16, 32, 133 and 160; benches/NOTES.md v41), and
    ///   1.04–1.06× on the H200 in one round (v37: H 16 T 8 and 32).
    /// - bf16 above 16 heads: v6 had kept the calls v7's 32-head blocks fill in less than one
    ///   wave where two v6 workgroups fit a multiprocessor (H100/H200), hiding its step's
    ///   latency behind the other workgroup; v7 has caught it up there (1.023x geomean on an
    ///   H100, 0.92–1.18x, benches/NOTES.md v42 (3); [`Self::bf16_wide_runs_v7`]).
    ///
    /// The residency stays a parameter of the plan ([`Self::for_call`], the C header's
    /// `v6_per_sm`) so that a rule that reads it can come back without changing callers.
    pub fn tensor_core_on<E>(
        dims: MlaDims,
        format: CacheFormat,
        heads: u32,
        v6_per_sm: impl FnOnce() -> std::result::Result<u32, E>,
    ) -> std::result::Result<Self, E> {
        // no rule reads the residency since v42
        drop(v6_per_sm);
        Ok(Self::tensor_core_v7(dims, format, heads))
    }

    /// v7 in 16-head blocks for a call of more than 16 heads (none at 16 or fewer, where
    /// [`Self::tensor_core_v7`] already takes them): the configuration of a narrow call
    /// ([`Self::is_narrow_call`]). No L2 prefetch: with it these calls ran 0–4 % slower.
    pub fn tensor_core_narrow(dims: MlaDims, format: CacheFormat, heads: u32) -> Option<Self> {
        (heads > 16).then(|| {
            Self::tensor_core_custom(dims, format, 16, 32, 2).with_row_softmax(Self::V7_ROW_SOFTMAX)
        })
    }

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
                fp8_values: Fp8Values::PerWarp,
                ..Self::tensor_core_custom(dims, format, 16, 64, 2)
            }
            .with_row_softmax(RowSoftmax::Rows),
        })
    }

    /// The bf16 v6 configuration in 16-head blocks for a call of more than 16 heads (none at
    /// 16 or fewer, where [`Self::tensor_core_v6`] takes them, nor for fp8_ds_mla, whose v6 is
    /// slower than v7): what [`Self::for_call`] runs where such a call is a v6 call
    /// ([`Self::is_v6_call`]). Its v6 kernel for H ≤ 16, so no new kernel.
    pub fn tensor_core_v6_narrow(dims: MlaDims, format: CacheFormat, heads: u32) -> Option<Self> {
        (heads > 16 && format == CacheFormat::Bf16)
            .then(|| Self::tensor_core_v6(dims, CacheFormat::Bf16, 16))
    }

    /// This configuration with the forms the environment asks for,
    /// `SPARSE_MLA_ROW_SOFTMAX` (where set) and `SPARSE_MLA_FP8_VALUES` (where the form
    /// applies); a row form on a kernel of several warp groups is refused
    /// ([`Self::for_call_from_env`]). `shape` names the call in that error.
    /// `SPARSE_MLA_DEFER_PV` (each step's `O += P · V` deferred into the next step: timed
    /// slower in v35, removed in v43) is refused unless unset, empty or `0`, so a script that
    /// still sets it does not time the default under another name.
    pub fn with_env_forms(self, shape: &DecodeShape) -> Result<Self> {
        if let Ok(v) = std::env::var("SPARSE_MLA_DEFER_PV") {
            if !matches!(v.as_str(), "" | "0") {
                return Err(Error::arg(
                    "SPARSE_MLA_DEFER_PV",
                    "unset: the deferred P . V was timed slower and removed (benches/NOTES.md \
                     v35, v43)",
                    v,
                ));
            }
        }
        Ok(self
            .with_forms(RowSoftmax::from_env()?, shape)?
            .with_fp8_values(Fp8Values::from_env()?))
    }

    /// [`Self::with_env_forms`]'s row form given: `rows` where set (`None`: the kernel's own
    /// form).
    pub fn with_forms(self, rows: Option<RowSoftmax>, shape: &DecodeShape) -> Result<Self> {
        if rows.is_some_and(|r| r != RowSoftmax::Off) && self.groups() > self.head_groups() {
            return Err(Error::arg(
                "SPARSE_MLA_ROW_SOFTMAX",
                "0 for a call forced onto bf16's two-group large-batch kernel (its row forms \
                 have an unexplained compute-sanitizer racecheck report, benches/NOTES.md v32)",
                format!(
                    "{} for {} heads x {} tokens",
                    rows.map_or("", RowSoftmax::env_value),
                    shape.heads,
                    shape.tokens
                ),
            ));
        }
        Ok(rows.map_or(self, |r| self.with_row_softmax(r)))
    }

    /// The kernel's family ([`Self::family`]) and the experiments' forms it takes, as a
    /// benchmark labels it: `v7`, `v7 r` (scores in rows), `v7 h4 r`, `batch r v`, ...
    pub fn label(&self) -> String {
        let mut s = self.family().to_string();
        if self.head_groups() > 1 {
            s = format!("{s} h{}", self.head_groups());
        }
        if let Lowering::MmaWs { row_softmax, .. } = self.lowering {
            let v = match self.fp8_values {
                Fp8Values::Shared => "v",
                Fp8Values::PerWarp => "",
            };
            for f in [row_softmax.suffix(), v] {
                if !f.is_empty() {
                    s = format!("{s} {f}");
                }
            }
        }
        s
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
            fp8_values: Fp8Values::PerWarp,
            lowering: Lowering::MmaWs {
                stages,
                groups: 1,
                l2_ahead: 0,
                row_softmax: RowSoftmax::Off,
                group_by: GroupBy::Steps,
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

    /// This configuration with fp8_ds_mla's `P · V` values taken as `form` says (a v7
    /// tensor-core configuration whose P is bf16; any other is returned as it is: fp8's
    /// large-batch kernel multiplies P in f16, [`Self::tensor_core_batch`]).
    pub fn with_fp8_values(mut self, form: Fp8Values) -> Self {
        if matches!(self.lowering, Lowering::MmaWs { .. })
            && self.format == CacheFormat::Fp8DsMla
            && self.p_elem == TileElem::Bf16
        {
            self.fp8_values = form;
        }
        self
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
    /// warp groups; fp8_ds_mla: v7 with 64-row steps), or any v7 whose warp groups deal out
    /// the steps? (Groups that split the heads are v7's 32-head blocks, [`GroupBy::Heads`].)
    pub fn is_batch(&self) -> bool {
        let plain = |c: Self| c.with_row_softmax(RowSoftmax::Off);
        matches!(self.lowering, Lowering::MmaWs { groups, group_by: GroupBy::Steps, .. } if groups > 1)
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

    /// Warp groups that split the workgroup's heads ([`GroupBy::Heads`]); 1 otherwise.
    pub fn head_groups(&self) -> u32 {
        match self.lowering {
            Lowering::MmaWs {
                groups,
                group_by: GroupBy::Heads,
                ..
            } => groups.max(1),
            _ => 1,
        }
    }

    /// The configuration as one warp group's description sees it: `block_h` the group's
    /// heads where the groups split them ([`Self::head_groups`]), else as it is. The host
    /// plans with `block_h`, the workgroup's heads.
    pub fn group_view(&self) -> Self {
        Self {
            block_h: self.block_h / self.head_groups(),
            ..*self
        }
    }

    /// bf16's kernel for wide calls ([`Self::is_wide_call`]; none for fp8_ds_mla): v7 in
    /// 64-head blocks, four warp groups of 2 warps with 16 heads each over one shared 2-stage
    /// ring of 32-slot steps ([`Self::tensor_core_heads`]), scores in rows. Each gathered row
    /// serves 64 heads where 32-head blocks read it twice, and each group's chain holds the
    /// registers of 16 heads (255 a thread: q's fragments and 128 of the output; on sm_120
    /// ptxas keeps one word on the stack, stored before the step loop and read after it;
    /// 99904 B of shared memory, within SM120's 101376). Measured on an H100, same binary,
    /// two rounds (benches/NOTES.md, v40): against v7, both occupancies, 1.05–1.42x at
    /// H 64 T 12–128 and H 128 T 8–128, level at H 64 T 10 and H 128 T 6, 0.83–0.94x below
    /// (H 64 T 4–8, H 128 T 4); against v6, where the backend ran it at the H100's own
    /// occupancy, 1.22–1.42x (H 64 T 24–56, H 128 T 12–24). The other head-group forms lost:
    /// 32-head blocks as two groups 0.84–0.99x, 16-row steps, and every fp8_ds_mla form
    /// (0.37–0.89x).
    pub fn tensor_core_wide(dims: MlaDims, format: CacheFormat) -> Option<Self> {
        (format == CacheFormat::Bf16)
            .then(|| Self::tensor_core_heads(dims, format, (64, 32, 2), 2, 4))
    }

    /// A v7 configuration whose workgroup of `block_h` heads is `groups` groups of `warps`
    /// warps, each with `block_h / groups` of the heads over every step, sharing one
    /// `stages`-deep ring of `block_n`-slot steps ([`GroupBy::Heads`]): each row gathered once
    /// for all the workgroup's heads, as in one group of `block_h` heads, but two step chains
    /// instead of one, each holding the registers of `block_h / groups` heads (benches/NOTES.md
    /// v38, timed in v40: [`Self::tensor_core_wide`] is the form adopted). bf16 holds its
    /// scores in rows, as v7 does; fp8_ds_mla in fragments (v7's 32-head form in rows spills
    /// 8 bytes on sm_120 at 255 registers, in fragments none on any arch).
    pub fn tensor_core_heads(
        dims: MlaDims,
        format: CacheFormat,
        (block_h, block_n, stages): (u32, u32, u32),
        warps: u32,
        groups: u32,
    ) -> Self {
        let mut c =
            Self::tensor_core_grouped(dims, format, (block_h, block_n, stages), warps, groups);
        if let Lowering::MmaWs {
            ref mut group_by, ..
        } = c.lowering
        {
            *group_by = GroupBy::Heads;
        }
        c.with_row_softmax(match format {
            CacheFormat::Bf16 => RowSoftmax::Rows,
            CacheFormat::Fp8DsMla => RowSoftmax::Off,
        })
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
                group_by: GroupBy::Steps,
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
            fp8_values: Fp8Values::PerWarp,
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
                group_by,
            } => {
                let g = match group_by {
                    _ if groups <= 1 => String::new(),
                    GroupBy::Steps => format!("g{groups}"),
                    GroupBy::Heads => format!("h{groups}"),
                };
                let p = if l2_ahead > 0 {
                    format!("p{l2_ahead}")
                } else {
                    String::new()
                };
                let r = row_softmax.suffix();
                let v = match self.fp8_values {
                    Fp8Values::Shared if self.format == CacheFormat::Fp8DsMla => "v",
                    _ => "",
                };
                format!("ws{stages}w{}{g}{p}{r}{v}", self.threads / 32)
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

mod choice;
mod combine;
mod io;
pub mod merge;
mod plan;
mod split;
mod v6;

pub use combine::{combine_grid, combine_groups, combine_kernel};
pub use plan::{DecodePlan, MergePolicy, SplitForm, WholeTokens, MERGE_MIN_ROWS, WHOLE_MIN_GAIN};
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
        // small bf16 calls, bf16 at H <= 16 past them (v7 at any residency: no large batch
        // since v42), fp8: never
        assert_eq!(ask(CacheFormat::Bf16, 16, 4), ("v6", false));
        assert_eq!(ask(CacheFormat::Bf16, 16, 128), ("v7", false));
        assert_eq!(ask(CacheFormat::Bf16, 16, 80), ("v7", false));
        assert_eq!(ask(CacheFormat::Fp8DsMla, 16, 64), ("batch", false));
        assert_eq!(ask(CacheFormat::Fp8DsMla, 64, 64), ("v7", false));
        // bf16 calls v7 fills in one wave or more: never
        assert_eq!(ask(CacheFormat::Bf16, 64, 64), ("v7", false));
        assert_eq!(ask(CacheFormat::Bf16, 64, 128), ("v7", false));
        // bf16 small calls at H <= 16 (v42): at any residency
        assert_eq!(ask(CacheFormat::Bf16, 16, 5), ("v7", false));
        assert_eq!(ask(CacheFormat::Bf16, 16, 8), ("v7", false));
        // above 16 heads in one partial wave: v7 at any residency (v42), so no call asks
        assert_eq!(ask(CacheFormat::Bf16, 32, 48), ("v7", false));
        assert_eq!(ask(CacheFormat::Bf16, 96, 36), ("v7", false));
    }

    #[test]
    fn bf16_small_calls_run_v6_where_it_measured_faster() {
        // (H, T, v6) on 132 SMs at any residency: an H100, v6 against v7 forced, both
        // occupancies (benches/NOTES.md v42): v6 at T <= 4, v7 1.01-1.07x at T 5-8 (level at
        // H 1-2 T 7-8)
        for (heads, tokens, want) in [
            (1, 1, true),
            (8, 1, true),
            (8, 4, true),
            (16, 4, true),
            (1, 5, false),
            (16, 5, false),
            (16, 6, false),
            (8, 7, false),
            (8, 8, false),
            (16, 8, false),
        ] {
            for per_sm in [1, 2, 3] {
                let got = pick(CacheFormat::Bf16, heads, tokens, per_sm);
                let expect = if want { "v6" } else { "v7" };
                assert_eq!(got, expect, "H {heads} T {tokens} at {per_sm} v6 per SM");
            }
            let s = shape(CacheFormat::Bf16, heads, tokens);
            assert_eq!(DecodeConfig::is_v6_call(&s, 132), want);
            assert!(DecodeConfig::is_small_call(&s, 132), "H {heads} T {tokens}");
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
            assert_eq!(DecodeConfig::is_v6_call(&s, 132), want);
            for per_sm in [1, 2] {
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
        assert!(!DecodeConfig::is_v6_call(&s, 132));
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
                        && DecodeConfig::is_v6_call(&s, 132)
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
    fn bf16_above_16_heads_runs_v7_at_any_residency_past_the_v6_calls() {
        // (H, T) on 132 SMs: the calls the rule before v42 gave v6 where two v6 workgroups fit
        // an SM (v7's one partial wave), where v7 was 1.023x geomean on an H100 (benches/
        // NOTES.md v42 (3); slower at H 24 / 32 T 48, 0.92-0.94x, and T 80), and calls of one wave
        // or more, where v7 had won since v17 / v28
        for (heads, tokens) in [
            (32, 16),
            (32, 36),
            (32, 48),
            (32, 80),
            (32, 112),
            (48, 24),
            (48, 48),
            (96, 16),
            (96, 36),
            (32, 8),
            (32, 256),
            (64, 4),
            (128, 2),
        ] {
            let s = shape(CacheFormat::Bf16, heads, tokens);
            assert!(
                DecodeConfig::bf16_wide_runs_v7(&s, 132),
                "H {heads} T {tokens}"
            );
            for per_sm in [1, 2, 3] {
                let c = DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(per_sm)).unwrap();
                assert_eq!(
                    (c.family(), c.block_h),
                    ("v7", 32),
                    "H {heads} T {tokens} at {per_sm}"
                );
            }
        }
        // not the v6 calls (v6 in 16-head blocks), nor H <= 16
        for (heads, tokens) in [(32, 1), (96, 1), (16, 32), (8, 128)] {
            let s = shape(CacheFormat::Bf16, heads, tokens);
            assert!(
                !DecodeConfig::bf16_wide_runs_v7(&s, 132),
                "H {heads} T {tokens}"
            );
        }
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
        // f T ceil(H/16) <= SMs with f 32 at H <= 16 (is_v6_call)
        for (heads, small, next) in [(16, 4, 5), (8, 4, 5)] {
            assert_eq!(pick(Bf16, heads, small, 1), "v6", "H {heads} T {small}");
            assert_eq!(pick(Bf16, heads, next, 1), "v7", "H {heads} T {next}");
            assert_eq!(
                pick(Fp8DsMla, heads, small, 1),
                "v7",
                "fp8 H {heads} T {small}"
            );
        }
        assert_eq!(pick(Bf16, 128, 1, 1), "v7");
        // two per SM (H100/H200): the same (v42): v7 past the smallest calls
        assert_eq!(pick(Bf16, 16, 4, 2), "v6");
        assert_eq!(pick(Bf16, 16, 5, 2), "v7");
        assert_eq!(pick(Bf16, 16, 9, 2), "v7");
        assert_eq!(pick(Bf16, 32, 48, 2), "v7");
        assert_eq!(pick(Bf16, 128, 40, 2), "v7");
        // fp8_ds_mla: the large-batch kernel for every call at H <= 16 past the small ones,
        // v7 above 16 heads
        for v6 in [1, 2] {
            assert_eq!(pick(Fp8DsMla, 16, 8, v6), "v7");
            assert_eq!(pick(Fp8DsMla, 16, 9, v6), "batch");
            assert_eq!(pick(Fp8DsMla, 8, 9, v6), "batch");
            assert_eq!(pick(Fp8DsMla, 32, 100, v6), "v7");
        }
        // bf16 at H <= 16 past the small calls: v7 at every T and v6 residency, never its
        // large-batch kernel (v42: v7 level or 1.01-1.08x faster at T 40-512 on the H200,
        // benches/NOTES.md v41 (3)), which took T 34-44, 53-66, 80-88 and 106-132 before
        for v6 in [1, 2, 3] {
            for t in [9, 34, 44, 53, 66, 80, 88, 106, 132, 192, 264, 512, 4096] {
                assert_eq!(pick(Bf16, 16, t, v6), "v7", "H 16 T {t} v6_per_sm {v6}");
                assert_eq!(pick(Bf16, 8, t, v6), "v7", "H 8 T {t} v6_per_sm {v6}");
                assert_eq!(pick(Bf16, 1, t, v6), "v7", "H 1 T {t} v6_per_sm {v6}");
            }
        }
    }

    #[test]
    fn wide_calls_run_bf16_in_64_head_blocks_over_one_ring() {
        let dims = MlaDims::PRODUCTION;
        assert_eq!(
            DecodeConfig::tensor_core_wide(dims, CacheFormat::Fp8DsMla),
            None
        );
        let c = DecodeConfig::tensor_core_wide(dims, CacheFormat::Bf16).unwrap();
        // the host plans the workgroup's 64 heads, the description one group's 16
        assert_eq!((c.block_h, c.block_n, c.threads), (64, 32, 256));
        assert_eq!(
            (c.groups(), c.head_groups(), c.group_view().block_h),
            (4, 4, 16)
        );
        assert_eq!(c.family(), "v7");
        assert_eq!(c.label(), "v7 h4 r");
        assert!(c.split_name().contains("_ws2w8h4r_h64n32"));
        assert!(!c.is_batch() && !c.has_merged_form() && c.has_whole_form());
        // the row forms are not refused, as they are on the groups that deal out steps
        let sh = shape(CacheFormat::Bf16, 128, 150);
        assert!(c.with_forms(Some(RowSoftmax::Rows), &sh).is_ok());
        let batch = DecodeConfig::tensor_core_batch(dims, CacheFormat::Bf16, 16).unwrap();
        assert!(batch.with_forms(Some(RowSoftmax::Rows), &sh).is_err());
        // the calls as measured (benches/NOTES.md v40, 132 SMs): from 12 blocks of 64 heads,
        // at whole blocks only, bf16 only, at either v6 residency
        let pick = |format, heads, tokens, per_sm| {
            let s = shape(format, heads, tokens);
            let c = DecodeConfig::for_call(&s, 132, || Ok::<u32, ()>(per_sm)).unwrap();
            assert_eq!(
                DecodeConfig::is_wide_call(&s, 132),
                format == CacheFormat::Bf16 && heads % 64 == 0 && 11 * tokens * heads / 64 >= 132
            );
            Some(c) == DecodeConfig::tensor_core_wide(dims, format)
        };
        for per_sm in [1, 2] {
            for (heads, tokens) in [(64, 12), (64, 16), (64, 32), (64, 128), (128, 6), (128, 8)] {
                assert!(
                    pick(CacheFormat::Bf16, heads, tokens, per_sm),
                    "H {heads} T {tokens}"
                );
            }
            for (heads, tokens) in [(128, 128), (256, 3), (64, 256), (128, 1000)] {
                assert!(
                    pick(CacheFormat::Bf16, heads, tokens, 1),
                    "H {heads} T {tokens}"
                );
            }
            for (heads, tokens) in [(64, 8), (64, 10), (128, 4), (128, 5), (96, 64), (80, 128)] {
                assert!(
                    !pick(CacheFormat::Bf16, heads, tokens, per_sm),
                    "H {heads} T {tokens}"
                );
            }
            for (heads, tokens) in [(64, 128), (128, 128), (128, 8)] {
                assert!(!pick(CacheFormat::Fp8DsMla, heads, tokens, per_sm));
            }
        }
        // also where v6 kept a partial wave at two v6 workgroups per SM (1.22-1.42x there);
        // the factor scales with the SMs (170: 16 blocks)
        for (heads, tokens) in [(64, 24), (64, 48), (128, 12), (128, 24)] {
            assert!(
                pick(CacheFormat::Bf16, heads, tokens, 2),
                "H {heads} T {tokens}"
            );
        }
        let s = shape(CacheFormat::Bf16, 64, 14);
        assert!(DecodeConfig::is_wide_call(&s, 132) && !DecodeConfig::is_wide_call(&s, 170));
    }
}
