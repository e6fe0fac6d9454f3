//! The C side of an export: what a launch of the generated decode kernels needs, stated in the
//! header (dynamic shared memory, grid, block, `block_n`, split rule, scratch sizes, strides,
//! limits, the variant per head count) and computed by `static inline` helpers, so an
//! integrator's C/C++ does what the CUDA backend (`runtime/cuda.rs`) does.
//!
//! Everything here is derived from the kernel configurations and the plan code of
//! [`crate::kernels::sparse_mla_decode`]: the variant table comes from scanning
//! [`DecodeConfig::tensor_core_on`] over head counts and v6 occupancies (`v6_per_sm`: bf16 v6 or
//! v7), the large-batch kernels the plan takes from [`DecodeConfig::tensor_core_batch`]
//! ([`DecodeConfig::plans_large_batch`]: fp8_ds_mla's); the choice between
//! them ([`DecodeConfig::for_call`]: [`DecodeConfig::is_large_batch`] on the SM count, else
//! `v6_per_sm`) and the split rule
//! ([`DecodePlan::model_splits`]) are written again in C (tests/export_header.rs compiles them
//! with the host C compiler and compares them with the Rust choice and plan over a grid of
//! shapes and SM counts).

use crate::emit::cuda;
use crate::kernels::sparse_mla_decode::{lowered_kernels, DecodeConfig, DecodePlan};
use crate::kir::{Kernel, Lowering};
use crate::mla::{CacheFormat, DecodeShape, MlaDims};
use crate::{Error, Result};
use std::fmt::Write;
use std::sync::Arc;

/// Which lowering of the decode kernels an export carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportLowering {
    /// The tensor-core kernels the CUDA backend runs (`DecodeConfig::tensor_core_on`: v6 or
    /// v7; a per-configuration export carries `DecodeConfig::tensor_core`'s).
    Mma,
    /// Loops over shared memory (`DecodeConfig::cuda_scalar` on CUDA, the portable
    /// configuration on WGSL).
    Scalar,
}

impl ExportLowering {
    pub fn name(&self) -> &'static str {
        match self {
            ExportLowering::Mma => "mma",
            ExportLowering::Scalar => "scalar",
        }
    }
}

/// One decode kernel variant as the CUDA runtime picks it: the head range it serves, for bf16
/// the range of v6 residency it is chosen at, its configuration and its lowered kernels.
#[derive(Clone)]
pub struct DecodeVariant {
    pub format: CacheFormat,
    /// Head counts `heads_min..=heads_max` (`None`: no upper bound).
    pub heads_min: u32,
    pub heads_max: Option<u32>,
    /// Workgroups of the bf16 v6 split kernel one multiprocessor holds
    /// ([`DecodeConfig::tensor_core_on`]'s `v6_per_sm`) at which the runtime picks this
    /// variant: `v6_per_sm_min..=v6_per_sm_max` (`None`: no upper bound; `1..`: at any).
    pub v6_per_sm_min: u32,
    pub v6_per_sm_max: Option<u32>,
    pub config: DecodeConfig,
    pub split: Arc<Kernel>,
    pub combine: Arc<Kernel>,
}

impl DecodeVariant {
    pub fn contains(&self, heads: u32) -> bool {
        heads >= self.heads_min && self.heads_max.is_none_or(|m| heads <= m)
    }

    /// Is this the variant at `v6_per_sm` v6 workgroups per multiprocessor.
    pub fn serves_v6_per_sm(&self, v6_per_sm: u32) -> bool {
        v6_per_sm >= self.v6_per_sm_min && self.v6_per_sm_max.is_none_or(|m| v6_per_sm <= m)
    }

    pub fn range_text(&self) -> String {
        match self.heads_max {
            Some(m) if m == self.heads_min => format!("H = {m}"),
            Some(m) => format!("{} <= H <= {m}", self.heads_min),
            None if self.heads_min == 1 => "any H".into(),
            None => format!("H >= {}", self.heads_min),
        }
    }

    /// The v6 residency this variant is chosen at, as a C condition's text (`any`).
    pub fn v6_text(&self) -> String {
        match self.v6_per_sm_max {
            Some(m) if m == self.v6_per_sm_min => format!("v6_per_sm = {m}"),
            Some(m) => format!("{} <= v6_per_sm <= {m}", self.v6_per_sm_min),
            None if self.v6_per_sm_min <= 1 => "any v6_per_sm".into(),
            None => format!("v6_per_sm >= {}", self.v6_per_sm_min),
        }
    }

    /// Which kernel family this is, in the words of docs and benches/NOTES.md.
    pub fn family(&self) -> &'static str {
        match self.config.lowering {
            Lowering::Mma { .. } => "v6",
            Lowering::MmaWs { .. } if self.config.is_batch() => "the large-batch kernel",
            Lowering::MmaWs { .. } => "v7",
            Lowering::Scalar => "the scalar kernel",
        }
    }

    /// Dynamic shared memory of the split kernel (the one-split twin has the same layout).
    pub fn dynamic_smem(&self) -> u32 {
        cuda::dynamic_shared_bytes(&self.split)
    }
}

/// The configuration the CUDA path uses for `heads` under `lowering` on a GPU that holds two
/// bf16 v6 workgroups per multiprocessor ([`DecodeConfig::tensor_core`]): what a
/// per-configuration export carries.
pub fn cuda_config(lowering: ExportLowering, format: CacheFormat, heads: u32) -> DecodeConfig {
    match lowering {
        ExportLowering::Mma => DecodeConfig::tensor_core(MlaDims::PRODUCTION, format, heads),
        ExportLowering::Scalar => DecodeConfig::cuda_scalar(MlaDims::PRODUCTION, format),
    }
}

/// The configuration the CUDA backend runs for `heads` under `lowering` on a GPU that holds
/// `v6_per_sm` bf16 v6 split workgroups per multiprocessor ([`DecodeConfig::tensor_core_on`]).
pub fn cuda_config_on(
    lowering: ExportLowering,
    format: CacheFormat,
    heads: u32,
    v6_per_sm: u32,
) -> DecodeConfig {
    match lowering {
        ExportLowering::Mma => {
            match DecodeConfig::tensor_core_on(MlaDims::PRODUCTION, format, heads, || {
                Ok::<u32, std::convert::Infallible>(v6_per_sm)
            }) {
                Ok(config) => config,
                Err(never) => match never {},
            }
        }
        ExportLowering::Scalar => DecodeConfig::cuda_scalar(MlaDims::PRODUCTION, format),
    }
}

/// Head counts are scanned up to here for the points where the configuration changes; the
/// last range is open-ended (the choice is a function of `heads <= N` comparisons).
const SCAN_HEADS: u32 = 1024;

/// v6 residencies are scanned up to here likewise (the choice compares `v6_per_sm >= N`).
const SCAN_V6_PER_SM: u32 = 8;

/// The head ranges of `choice` (None: no kernel at that head count), each with its lowered
/// kernels, for the v6 residencies `v6`.
fn scan_heads(
    format: CacheFormat,
    (v6_per_sm_min, v6_per_sm_max): (u32, Option<u32>),
    choice: impl Fn(u32) -> Option<DecodeConfig>,
) -> Result<Vec<DecodeVariant>> {
    let mut ranges: Vec<(u32, u32, DecodeConfig)> = Vec::new();
    let mut open = false;
    for h in 1..=SCAN_HEADS {
        match (choice(h), ranges.last_mut()) {
            (Some(c), Some((_, hi, cfg))) if open && *cfg == c => *hi = h,
            (Some(c), _) => {
                ranges.push((h, h, c));
                open = true;
            }
            (None, _) => open = false,
        }
    }
    ranges
        .into_iter()
        .map(|(lo, hi, config)| {
            let (split, combine) = lowered_kernels(&config)?;
            Ok(DecodeVariant {
                format,
                heads_min: lo,
                heads_max: if hi == SCAN_HEADS { None } else { Some(hi) },
                v6_per_sm_min,
                v6_per_sm_max,
                config,
                split,
                combine,
            })
        })
        .collect()
}

/// Every variant of `lowering` for `format`, by v6 residency and then head count, by scanning
/// the runtime's configuration choice ([`DecodeConfig::tensor_core_on`]) over both (so the
/// table is the runtime's choice, not a copy of it). fp8_ds_mla and the scalar lowering have
/// one set of head ranges at any residency; bf16 tensor cores have v7 at one v6 workgroup per
/// multiprocessor and v6 at two or more.
pub fn decode_variants(
    lowering: ExportLowering,
    format: CacheFormat,
) -> Result<Vec<DecodeVariant>> {
    let table = |n: u32| -> Vec<DecodeConfig> {
        (1..=SCAN_HEADS)
            .map(|h| cuda_config_on(lowering, format, h, n))
            .collect()
    };
    // runs of residencies with the same choice at every head count
    let mut runs: Vec<(u32, u32, Vec<DecodeConfig>)> = Vec::new();
    for n in 1..=SCAN_V6_PER_SM {
        let t = table(n);
        match runs.last_mut() {
            Some((_, hi, prev)) if *prev == t => *hi = n,
            _ => runs.push((n, n, t)),
        }
    }
    let mut variants: Vec<DecodeVariant> = Vec::new();
    for (lo, hi, _) in runs {
        let max = (hi != SCAN_V6_PER_SM).then_some(hi);
        for v in scan_heads(format, (lo, max), |h| {
            Some(cuda_config_on(lowering, format, h, lo))
        })? {
            // a head range with the same kernel at the residencies just below: one variant
            match variants.iter_mut().find(|m| {
                (m.heads_min, m.heads_max, m.config) == (v.heads_min, v.heads_max, v.config)
                    && m.v6_per_sm_max.is_some_and(|x| x + 1 == v.v6_per_sm_min)
            }) {
                Some(m) => m.v6_per_sm_max = v.v6_per_sm_max,
                None => variants.push(v),
            }
        }
    }
    Ok(variants)
}

/// The bf16 v6 split kernels by head count ([`DecodeConfig::tensor_core_v6`]): the kernel
/// whose occupancy the runtime asks for `v6_per_sm` (`decode_kernel_choice` in
/// runtime/cuda.rs), whatever the call's cache format.
pub fn v6_probe_variants() -> Result<Vec<DecodeVariant>> {
    scan_heads(CacheFormat::Bf16, (1, None), |h| {
        Some(DecodeConfig::tensor_core_v6(
            MlaDims::PRODUCTION,
            CacheFormat::Bf16,
            h,
        ))
    })
}

/// The large-batch variants for `format` (`DecodeConfig::tensor_core_batch`, which the CUDA
/// backend runs instead of the head-count variant when `DecodeConfig::is_large_batch`, at any
/// v6 residency), by scanning the configuration choice over head counts like
/// [`decode_variants`]: the head ranges that have one (H <= 16 today); none for a format whose
/// large-batch kernel the plan never takes (`DecodeConfig::plans_large_batch`: bf16).
pub fn batch_variants(format: CacheFormat) -> Result<Vec<DecodeVariant>> {
    if !DecodeConfig::plans_large_batch(format) {
        return Ok(Vec::new());
    }
    scan_heads(format, (1, None), |h| {
        DecodeConfig::tensor_core_batch(MlaDims::PRODUCTION, format, h)
    })
}

/// The narrow-call variants for `format` (`DecodeConfig::tensor_core_narrow`, which the CUDA
/// backend runs first when `DecodeConfig::is_narrow_call`, at any v6 residency), by scanning
/// the configuration choice over head counts like [`batch_variants`] (H > 16).
pub fn narrow_variants(format: CacheFormat) -> Result<Vec<DecodeVariant>> {
    scan_heads(format, (1, None), |h| {
        DecodeConfig::tensor_core_narrow(MlaDims::PRODUCTION, format, h)
    })
}

/// bf16's kernel for wide calls (`DecodeConfig::tensor_core_wide`, which the CUDA backend
/// runs where `DecodeConfig::is_wide_call`, at any v6 residency): v7 in 64-head blocks, for
/// H >= 64 (whole blocks only, by the rule).
pub fn wide_variant() -> Result<Option<DecodeVariant>> {
    let Some(config) = DecodeConfig::tensor_core_wide(MlaDims::PRODUCTION, CacheFormat::Bf16)
    else {
        return Ok(None);
    };
    let (split, combine) = lowered_kernels(&config)?;
    Ok(Some(DecodeVariant {
        format: CacheFormat::Bf16,
        heads_min: config.block_h,
        heads_max: None,
        v6_per_sm_min: 1,
        v6_per_sm_max: None,
        config,
        split,
        combine,
    }))
}

/// Shared memory per multiprocessor of an arch (bytes), for the resident-workgroup estimate
/// of an export made without the GPU (the runtime asks the driver instead).
fn smem_per_sm(arch: &str) -> Option<u32> {
    Some(match arch {
        "sm_80" => 167_936,
        "sm_86" | "sm_89" | "sm_120" => 102_400,
        "sm_90" | "sm_100" => 233_472,
        _ => return None,
    })
}

/// Workgroups of the variant's split kernel one multiprocessor of `arch` holds, estimated
/// from shared memory (1 KB reserved per block) and the register hint of the lowering. The
/// CUDA backend reads the real number from the driver's occupancy calculator.
pub fn estimate_per_sm(config: &DecodeConfig, split: &Kernel, arch: &str) -> u32 {
    let Some(sm) = smem_per_sm(arch) else {
        return 1;
    };
    let (_, smem) = crate::kir::shared_plan::shared_layout(&split.shared);
    let by_smem = (sm as u64 / (smem + 1024)).max(1) as u32;
    let by_regs = match config.lowering {
        // __launch_bounds__(256, n): ptxas fits the registers of n workgroups, not more
        Lowering::Mma { min_workgroups, .. } if min_workgroups > 0 => min_workgroups,
        Lowering::Mma { .. } => 1,
        Lowering::MmaWs { .. } => 1,
        Lowering::Scalar => 2048 / config.threads,
    };
    by_smem.min(by_regs).max(1)
}

fn kernel_facts(k: &Kernel) -> String {
    format!(
        "{}: {} threads, dynamic shared memory {} B",
        k.name,
        k.workgroup_size,
        cuda::dynamic_shared_bytes(k)
    )
}

/// One branch of a C chooser: `if (cond) { the plan's kernel fields from `v`; return 0; }`.
fn plan_fill(s: &mut String, indent: &str, cond: &str, v: &DecodeVariant) {
    let _ = write!(
        s,
        "{indent}if ({cond}) {{\n{indent}    p->split_kernel = \"{}\"; p->combine_kernel = \"{}\";\n{indent}    p->block_h = {}u; p->block_n = {}u; p->threads = {}u; p->combine_threads = {}u; p->dynamic_smem = {}u;\n{indent}    return 0;\n{indent}}}\n",
        v.split.name,
        v.combine.name,
        v.config.block_h,
        v.config.block_n,
        v.split.workgroup_size,
        v.combine.workgroup_size,
        v.dynamic_smem()
    );
}

/// The comment block every C header of an export opens with: conventions, buffers, launch
/// rules and limits, with the variant table of `variants` and the large-batch kernels of
/// `batch` (none in a per-configuration header).
fn launch_rules(
    variants: &[DecodeVariant],
    batch: &[DecodeVariant],
    wide: Option<&DecodeVariant>,
) -> String {
    let mut s = String::new();
    let by_v6 = variants
        .iter()
        .any(|v| v.v6_per_sm_min > 1 || v.v6_per_sm_max.is_some());
    if by_v6 && variants.len() == 1 {
        s.push_str(
            "// WHICH KERNEL. The runtime picks the variant by cache format, head count H and, for bf16,\n\
             //   v6_per_sm (ONE KERNEL above); this export's:\n",
        );
    } else if by_v6 {
        s.push_str(
            "// WHICH KERNEL. The runtime picks the variant by cache format, head count H and, for bf16,\n\
             //   v6_per_sm: the workgroups of the bf16 v6 split kernel for H one multiprocessor holds\n\
             //   (cuOccupancyMaxActiveBlocksPerMultiprocessor at its threads and SMEM: 2 on an H100/H200,\n\
             //   1 on SM120 and sm_86/89; sparse_mla_v6_kernel() names that kernel for H whatever the\n\
             //   call's format, sparse_mla_v6_per_sm() asks the driver; fp8_ds_mla does not depend on it):\n",
        );
    } else {
        s.push_str(
            "// WHICH KERNEL. The runtime picks the variant by cache format and head count H:\n",
        );
    }
    for v in variants {
        let cond = if by_v6 {
            format!("{:<16} ", v.v6_text())
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "//   {:<10} {:<14} {cond}block_h {:>2}, block_n {:>2}: {}",
            v.format.name(),
            v.range_text(),
            v.config.block_h,
            v.config.block_n,
            v.split.name,
        );
    }
    let mut combines: Vec<&str> = Vec::new();
    for v in variants.iter().chain(batch) {
        if !combines.contains(&v.combine.name.as_str()) {
            combines.push(v.combine.name.as_str());
        }
    }
    let _ = writeln!(
        s,
        "//   and for splits > 1 the combine {}.",
        combines.join(" / ")
    );
    s.push_str(
        "//   Each variant has one split kernel NAME: with splits == 1 it writes out and lse itself\n\
         //   (no combine), with more it writes per-split partials for the combine.\n",
    );
    if !batch.is_empty() {
        let narrow_tag =
            DecodeConfig::tensor_core_narrow(batch[0].config.dims, CacheFormat::Bf16, 17)
                .expect("a narrow configuration above 16 heads")
                .kernel_tag();
        let ranges: Vec<String> = batch
            .iter()
            .map(|v| format!("{} {}", v.format.name(), v.range_text()))
            .collect();
        let _ = writeln!(
            s,
            "//   Except for a narrow call (sparse_mla_is_narrow_call: more than 16 heads and\n\
             //   {narrow_f} * T * ceil(H / 16) <= SM count), which runs v7 in 16-head blocks (*_{narrow_tag}) at\n\
             //   any cache format and v6_per_sm (fp8_ds_mla from {wide_b} such blocks, T * ceil(H / 16) >= {wide_b}:\n\
             //   its large-batch kernel, 64-row steps, in 16-head blocks), and a large batch (sparse_mla_is_large_batch; LARGE BATCHES below) at\n\
             //     {}:\n\
             //   it runs the large-batch kernel of its format instead, at any v6_per_sm (LARGE BATCHES\n\
             //   below); and the smallest calls with a bf16 cache (sparse_mla_is_v6_call: f * T *\n\
             //   ceil(H / 16) <= SM count, f {v6n_f} above 16 heads, else {v6_f}, at any v6_per_sm)\n\
             //   run the v6 kernel of H (its step beats v7's where each workgroup takes a few steps),\n\
             //   the other small calls v7. The plan helpers decide all of it as the runtime does (DecodeConfig::for_call):\n\
             //   sparse_mla_decode_variant(format, H, T, topk, sms, v6_per_sm, ...) and\n\
             //   sparse_mla_plan_decode(..., sms, v6_per_sm, resident, ...) take the multiprocessor\n\
             //   count `sms` and `v6_per_sm`.",
            ranges.join(", "),
            narrow_f = DecodeConfig::NARROW_FACTOR,
            v6_f = DecodeConfig::V6_FACTOR,
            v6n_f = DecodeConfig::V6_NARROW_FACTOR,
            wide_b = DecodeConfig::NARROW_WIDE_MIN_BLOCKS,
        );
    }
    if let Some(w) = wide {
        let _ = writeln!(
            s,
            "//   A wide call (sparse_mla_is_wide_call: bf16, H a multiple of {h} and\n\
             //   {f} * T * H / {h} >= SM count) runs v7 in {h}-head blocks at any v6_per_sm, before\n\
             //   every rule above: four warp groups of 16 heads over one ring, each row read once for\n\
             //   {h} heads ({}, block_h {h}).",
            w.split.name,
            h = w.config.block_h,
            f = DecodeConfig::WIDE_FACTOR,
        );
    }
    s.push_str(
        "//\n\
         // COMPILE. Each .cu is self-contained (no #include): `nvcc -cubin -arch=sm_90 FILE.cu`, or\n\
         // NVRTC with --gpu-architecture=sm_XX, for sm_80 or later (sm_120 needs CUDA >= 12.8).\n\
         // Load with cuModuleLoadData and cuModuleGetFunction(NAME): names are extern \"C\".\n\
         //\n\
         // SHARED MEMORY. A kernel whose shared arrays exceed 48 KB takes all of them dynamically:\n\
         // before its first launch call\n\
         //   cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM)\n\
         //   (runtime API: cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM))\n\
         // and launch with sharedMemBytes = SMEM. Launching with 0 is an illegal memory access.\n",
    );
    for v in variants.iter().chain(batch).chain(wide) {
        let _ = writeln!(s, "//   {}", kernel_facts(&v.split));
    }
    for c in &combines {
        if let Some(v) = variants.iter().chain(batch).find(|v| v.combine.name == *c) {
            let _ = writeln!(s, "//   {}", kernel_facts(&v.combine));
        }
    }
    s.push_str(
        "//   Every kernel fits SM120's 101376 B per block; none needs more than the 48 KB default\n\
         //   unless listed above with a non-zero size.\n\
         //\n\
         // SPLITS. topk is cut into `splits` chunks of `chunk` entries (a multiple of block_n):\n\
         //   blocks = ceil(topk / block_n); chunk = ceil(blocks / want) * block_n;\n\
         //   splits = ceil(topk / chunk)      (so every split but the last is full).\n\
         // `want` comes from a cost model over the workgroups the GPU runs at once:\n\
         //   resident = (cuOccupancyMaxActiveBlocksPerMultiprocessor of the split kernel NAME the\n\
         //               call runs, plan->split_kernel, at its threads and SMEM)\n\
         //              x CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT (sparse_mla_resident())\n\
         //   (per kernel: on an H100/H200 2 per SM for v6, 1 for v7 and the large-batch kernel;\n\
         //   1 for each tensor-core kernel on SM120 and sm_86/89);\n\
         //   sparse_mla_model_splits() below is that model, exactly as the runtime computes it.\n\
         //   Any splits in 1..blocks give the same result up to rounding; only speed differs.\n\
         //   (The sparse-mla runtime also runs batches just past a whole number of waves as full\n\
         //   waves of whole tokens and the rest split, with split kernels of another grid that\n\
         //   are not exported; the plans here split every token alike, 1.1-1.3x slower there.)\n\
         //\n\
         // LAUNCHES (blockDim = (threads, 1, 1) of each kernel):\n\
         //   NAME, grid (ceil(H / block_h), splits, T). splits == 1: it writes out and lse.\n\
         //   splits > 1: it writes the partials\n\
         //                  o_part   f32 [T, H, splits, 512]  (T*H*splits*2048 bytes; 8-byte aligned)\n\
         //                  lse_part f32 [T, H, splits]       (T*H*splits*4 bytes)\n\
         //                then the combine, grid plan->combine_grid (H, T, column chunks), on the\n\
         //                same stream: out and lse.\n\
         //   NAME takes all eight buffers either way; the two it does not write are not touched\n\
         //   (with one split, pass out and lse again for o_part and lse_part).\n\
         //   Arguments: the kernel's NAME_params struct by value, then one device pointer per\n\
         //   buffer in the order its comment lists (cuLaunchKernel's kernelParams).\n\
         //   The partials are scratch: any memory of that size, reused per call, never read back.\n\
         //\n\
         // BUFFERS (row-major, no padding unless stated):\n\
         //   q        bf16 [T, H, 576] contiguous, latent 512 then rope 64; 16-byte aligned.\n\
         //   kv_cache [num_pages, page_size, row] rows of 1152 B (bf16) or 656 B (fp8_ds_mla);\n\
         //            strided: row of slot s at word (s / page_size) * page_stride_w\n\
         //            + (s % page_size) * row_stride_w; strides in 32-bit words (byte strides must\n\
         //            be multiples of 4, >= the row, page >= page_size rows); 16-byte aligned base.\n\
         //   indices  i32 [T, topk] contiguous physical slots (slot = page * page_size + offset).\n\
         //   topk_length i32 [T] (optional; has_topk_length = 0 still needs a valid pointer to\n\
         //            4 readable bytes: pass indices).\n\
         //   out      bf16 [T, H, 512] contiguous.\n\
         //   lse      f32, lse[t, h] at ((t / lse_s_q) * H + h) * lse_s_q + t % lse_s_q:\n\
         //            lse_s_q = 1 gives [T, H]; lse_s_q = s_q gives FlashMLA's [batch, H, s_q].\n\
         //   Multi-token decode (MTP): T = batch * s_q, token t = b * s_q + i, so q [b, s_q, H, 576],\n\
         //   indices [b, s_q, topk] and out [b, s_q, H, 512] are FlashMLA's layouts unchanged.\n\
         //\n\
         // LIMITS (checked by sparse_mla_plan_decode / sparse_mla_cache_strides):\n\
         //   1 <= T <= 65535 (grid z); H >= 1; topk >= 1; T % lse_s_q == 0; sms >= 1; v6_per_sm >= 1;\n\
         //   num_slots = num_pages * page_size <= 2^31 - 1 (slots are i32);\n\
         //   a cache buffer spans fewer than 2^31 32-bit words (8 GiB): split the cache per layer;\n\
         //   q spans fewer than 2^31 words.\n\
         //\n\
         // CONVENTIONS (docs/math.md): index j of token t is invalid when < 0, >= num_slots, or\n\
         // j >= topk_length[t]; an invalid slot is never read (NaN in unreferenced rows cannot\n\
         // reach the output); lse = ln sum_j exp(scale * q . k_j) (natural log, f32); a row with no\n\
         // valid index gets out = 0 and lse = +inf.\n\
         //\n\
         // CACHE ROWS (docs/formats.md): bf16 = 576 x bf16 (latent 512, then rope 64), 1152 bytes.\n\
         // fp8_ds_mla = [0,512) e4m3fn latent | [512,528) 4 x f32 scales, one per 128 values |\n\
         // [528,656) 64 x bf16 rope: 656 bytes; c[i] = e4m3(byte[i]) * scale[i / 128].\n",
    );
    s
}

/// The plan helpers in C: variant choice, split model, limits, cache strides. No CUDA headers.
/// `batch`: the large-batch kernels the variant choice takes first when
/// `sparse_mla_is_large_batch` (none in a per-configuration header: its choice is its one
/// kernel per head range). `v6_probe`: the bf16 v6 split kernels by head count, whose
/// occupancy is `v6_per_sm` (`sparse_mla_v6_kernel`), when the choice depends on it; `None`
/// in a per-configuration header, whose variant is chosen at any `v6_per_sm`.
fn plan_code(
    variants: &[DecodeVariant],
    batch: &[DecodeVariant],
    narrow: &[DecodeVariant],
    v6_probe: Option<&[DecodeVariant]>,
    wide: Option<&DecodeVariant>,
) -> Result<String> {
    let first = variants
        .first()
        .ok_or_else(|| Error::arg("variants", "at least one", 0))?;
    let dims = first.config.dims;
    // v7's 16-head block up to `narrow_max` heads (DecodeConfig::bf16_wide_runs_v7: above it)
    let v7_block = |h| DecodeConfig::tensor_core_v7(dims, CacheFormat::Bf16, h).block_h;
    let narrow_max = (1..=SCAN_HEADS)
        .take_while(|&h| v7_block(h) <= 16)
        .last()
        .unwrap_or(0);
    // bf16 v6 in 16-head blocks above `v6n_max` heads (DecodeConfig::tensor_core_v6_narrow)
    let v6n = |h| DecodeConfig::tensor_core_v6_narrow(dims, CacheFormat::Bf16, h);
    let v6n_max = (1..=SCAN_HEADS)
        .take_while(|&h| v6n(h).is_none())
        .last()
        .unwrap_or(0);
    let v6n_block = v6n(v6n_max + 1)
        .ok_or_else(|| {
            Error::arg(
                "heads",
                "a bf16 v6 configuration in 16-head blocks",
                v6n_max + 1,
            )
        })?
        .block_h;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"/* ---- the plan: which kernel, how many splits, what scratch (plain C, no CUDA headers) ---- */
#ifdef SPARSE_MLA_PLAN_DEFINED
#error "include one sparse-mla launch header per translation unit (sparse_mla.h or one per-configuration header)"
#endif
#define SPARSE_MLA_PLAN_DEFINED 1

#define SPARSE_MLA_D_QK {d_qk}u
#define SPARSE_MLA_D_V {d_v}u
#define SPARSE_MLA_MAX_TOKENS 65535u
#define SPARSE_MLA_MAX_SLOTS 2147483647ull
#define SPARSE_MLA_MAX_WORDS 2147483647ull /* per cache buffer: 8 GiB */

enum sparse_mla_cache_format {{ SPARSE_MLA_CACHE_BF16 = 0, SPARSE_MLA_CACHE_FP8_DS_MLA = 1 }};

/* Bytes of one cache row. */
static inline unsigned sparse_mla_row_bytes(int format) {{
    return format == SPARSE_MLA_CACHE_FP8_DS_MLA ? {fp8}u : {bf16}u;
}}

typedef struct sparse_mla_decode_plan {{
    const char* split_kernel;   /* NAME: splits == 1 writes out / lse, more o_part / lse_part */
    const char* combine_kernel; /* merges the partials when splits > 1 */
    unsigned block_h, block_n;
    unsigned threads;           /* blockDim.x of the split kernels */
    unsigned combine_threads;   /* blockDim.x of the combine */
    unsigned dynamic_smem;      /* sharedMemBytes of the split kernels (and the attribute) */
    unsigned splits, chunk;
    unsigned grid[3];           /* of split_kernel */
    unsigned combine_grid[3];   /* (H, T, column chunks); unused when splits == 1 */
    unsigned combine_groups;    /* the combine's `groups` parameter */
    unsigned long long o_part_bytes;   /* f32 [T, H, splits, 512]; 0 when splits == 1 */
    unsigned long long lse_part_bytes; /* f32 [T, H, splits]; 0 when splits == 1 */
}} sparse_mla_decode_plan;

/* Is a call a small one on a GPU of `sms` multiprocessors (DecodeConfig::is_small_call):
   16 x tokens x ceil(heads / 16) <= sms. The split model gives each workgroup a few steps
   there, and for bf16 the v6 kernel is the faster at any v6_per_sm. */
static inline int sparse_mla_is_small_call(unsigned heads, unsigned tokens, unsigned sms) {{
    unsigned long long blocks = (unsigned long long)tokens * (((unsigned long long)heads + 15u) / 16u);
    return 16u * blocks <= (unsigned long long)sms;
}}

/* Does a bf16 call run a v6 kernel (DecodeConfig::is_v6_call), at any v6_per_sm:
   f x tokens x ceil(heads / 16) <= sms, f = {v6_f} at up to {v6n_max} heads, else {v6n_f}. Above {v6n_max} heads
   such a call runs v6 in {v6n_block}-head blocks (sparse_mla_v6_kernel({v6n_block}u, p)). Each such call
   is a small one; past it v7 is the faster (measured at both occupancies, benches/NOTES.md
   v25, v42). `v6_per_sm` is not read (headers before v42 read it at up to {v6n_max} heads; kept so
   that their callers compile). */
static inline int sparse_mla_is_v6_call(unsigned heads, unsigned tokens, unsigned sms, unsigned v6_per_sm) {{
    unsigned long long blocks = (unsigned long long)tokens * (((unsigned long long)heads + 15u) / 16u);
    unsigned long long f = heads <= {v6n_max}u ? {v6_f}u : {v6n_f}u;
    (void)v6_per_sm;
    return f * blocks <= (unsigned long long)sms;
}}

/* The split count of the runtime's cost model (DecodePlan::model_splits in
   src/kernels/sparse_mla_decode/mod.rs) for a kernel of p->block_h x p->block_n: time in
   workgroup steps, for each wave of workgroups slow(k) x (steps + 2), k the workgroups the wave
   puts on one multiprocessor (each co-resident one worth half a workgroup's speed:
   slow(k) = k / (1 + (k - 1) / 2)), plus for splits > 1 the combine (a launch, the partials'
   bytes written and read, at half a gathered byte: they stay in L2); the smallest count wins
   ties. `resident`: workgroups the GPU runs at once, `sms`: its multiprocessors. */
static inline double sparse_mla_wave_time(unsigned long long per_sm) {{
    return per_sm <= 1u ? 1.0 : (double)per_sm / (1.0 + 0.5 * (double)(per_sm - 1u));
}}

static inline unsigned sparse_mla_model_splits(const sparse_mla_decode_plan* p, int format, unsigned heads,
                                               unsigned tokens, unsigned topk, unsigned resident,
                                               unsigned sms) {{
    const double fixed = 2.0;
    unsigned long long res = resident ? resident : 1u;
    unsigned long long m = sms ? sms : 1u;
    unsigned blocks = (topk + p->block_n - 1u) / p->block_n;
    unsigned long long base = (unsigned long long)tokens * ((heads + p->block_h - 1u) / p->block_h);
    double full_wave, step_bytes;
    double rows = (double)tokens * (double)heads;
    double best_t = 1.7976931348623157e308;
    unsigned best = 1u, s, max_s;
    if (m > res) m = res;
    full_wave = sparse_mla_wave_time((res + m - 1u) / m);
    step_bytes = (double)res * (double)(p->block_n * sparse_mla_row_bytes(format)) / full_wave;
    if (blocks == 0u) blocks = 1u;
    max_s = blocks < 128u ? blocks : 128u;
    for (s = 1u; s <= max_s; ++s) {{
        double steps = (double)((blocks + s - 1u) / s);
        unsigned long long wg = base * s, rest = wg % res;
        double waves = (double)(wg / res) * full_wave + (rest ? sparse_mla_wave_time((rest + m - 1u) / m) : 0.0);
        double t = waves * (steps + fixed);
        if (s > 1u) {{
            double partial_bytes = rows * (double)s * ((double)SPARSE_MLA_D_V + 1.0) * 4.0 * 2.0;
            t += 1.0 + 0.5 * partial_bytes / step_bytes;
        }}
        if (t < best_t - 1e-9) {{ best_t = t; best = s; }}
    }}
    return best;
}}

/* Is a call of `tokens` tokens and `heads` heads a large batch on a GPU of `sms` multiprocessors
   (DecodeConfig::is_large_batch), one the large-batch kernel runs at H <= 16: fp8_ds_mla when it
   is not a small call. Never for bf16: v7 was level with its large-batch kernel or faster at
   every batch measured on the H200 (benches/NOTES.md v41 (3)), and that kernel is not exported.
   `topk` and `v6_per_sm` are not read (headers before v42 read them for bf16; kept so that
   their callers compile). */
static inline int sparse_mla_is_large_batch(int format, unsigned heads, unsigned tokens, unsigned topk,
                                            unsigned sms, unsigned v6_per_sm) {{
    (void)topk;
    (void)v6_per_sm;
    return format == SPARSE_MLA_CACHE_FP8_DS_MLA && !sparse_mla_is_small_call(heads, tokens, sms);
}}

/* Does a bf16 call of more than {narrow_max} heads run v7 at any v6_per_sm (DecodeConfig::bf16_wide_runs_v7):
   every one that is not a v6 call. Until v42, where two v6 workgroups fit a multiprocessor, v6
   kept the calls whose v7 blocks fill less than one wave; on an H100 v7 was 1.023x geomean
   on those, 0.92-1.18x (benches/NOTES.md v42 (3)). */
static inline int sparse_mla_bf16_wide_runs_v7(unsigned heads, unsigned tokens, unsigned sms) {{
    return heads > {narrow_max}u && !sparse_mla_is_v6_call(heads, tokens, sms, 1u);
}}

{narrow_fn}{v6_fn}{wide_fn}/* The kernel of one call{batch_doc}
   `topk`: indices per token, as given to sparse_mla_plan_decode (not read by the
   choice since v42). `sms`: CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
   of the GPU. `v6_per_sm`: workgroups of the
   bf16 v6 split kernel for `heads` one multiprocessor holds ({v6_doc}).
   Fills the kernel names, block sizes, threads and shared memory. Returns 0 on success, else a
   message naming the argument. */
static inline const char* sparse_mla_decode_variant(int format, unsigned heads, unsigned tokens, unsigned topk,
                                                    unsigned sms, unsigned v6_per_sm, sparse_mla_decode_plan* p) {{
    if (format != SPARSE_MLA_CACHE_BF16 && format != SPARSE_MLA_CACHE_FP8_DS_MLA)
        return "format: expected SPARSE_MLA_CACHE_BF16 or SPARSE_MLA_CACHE_FP8_DS_MLA";
    if (heads == 0) return "heads: expected at least 1";
    if (sms == 0u) return "sms: expected the multiprocessor count of the GPU (at least 1)";
    if (v6_per_sm == 0u) return "v6_per_sm: expected the workgroups of the bf16 v6 split kernel one multiprocessor holds (at least 1)";
"#,
        d_qk = dims.d_qk(),
        d_v = dims.d_v(),
        narrow_max = narrow_max,
        v6n_max = v6n_max,
        v6n_block = v6n_block,
        v6_f = DecodeConfig::V6_FACTOR,
        v6n_f = DecodeConfig::V6_NARROW_FACTOR,
        fp8 = CacheFormat::Fp8DsMla.row_bytes(dims),
        bf16 = CacheFormat::Bf16.row_bytes(dims),
        batch_doc = if batch.is_empty() {
            ": this export's kernel for the cache format and head count. It has no\n   \
             large-batch kernel and no other variant (see the top of this header): `tokens`,\n   \
             `sms` and `v6_per_sm` do not change the choice here, where the runtime and\n   \
             sparse_mla.h of the standard set can pick another kernel."
        } else {
            ", as the runtime picks it (DecodeConfig::for_call): for bf16 above 16 heads\n   \
             v6 in 16-head blocks where sparse_mla_is_v6_call(heads, tokens, sms, v6_per_sm); v7 in\n   \
             16-head blocks for a narrow call (sparse_mla_is_narrow_call(heads, tokens, sms)); else by cache format\n   \
             and head count, for fp8_ds_mla at H <= 16 by the call's size on the GPU (its large-batch\n   \
             kernel when sparse_mla_is_large_batch(format, heads, tokens, topk, sms, v6_per_sm)); for a bf16 small call\n   \
             (sparse_mla_is_small_call(heads, tokens, sms)) v6 where sparse_mla_is_v6_call(heads, tokens,\n   \
             sms, v6_per_sm), else v7; v7 for every other call above 16 heads\n   \
             (sparse_mla_bf16_wide_runs_v7(heads, tokens, sms)), else v7: since v42 no rule reads\n   \
             v6_per_sm, and every GPU gets the same choice. fp8_ds_mla runs v7 at any v6_per_sm."
        },
        v6_doc = if v6_probe.is_some() {
            "sparse_mla_v6_per_sm() on\n   the function of sparse_mla_v6_kernel(heads); no rule reads it since v42, so any value\n   >= 1 gives the same choice"
        } else {
            "not read by this\n   export, but checked: at least 1"
        },
        narrow_fn = match narrow.first() {
            Some(n) => format!(
                "/* Is a call a narrow one (DecodeConfig::is_narrow_call): at least {min} heads and\n   \
                 {f} x tokens x ceil(heads / 16) <= sms. The runtime runs v7 in 16-head blocks there,\n   \
                 whatever the cache format and v6_per_sm (on the H200 1.01-1.29x the kernels before,\n   \
                 benches/NOTES.md v24), except the bf16 v6 calls (sparse_mla_is_v6_call). */\n\
                 static inline int sparse_mla_is_narrow_call(unsigned heads, unsigned tokens, unsigned sms) {{\n    \
                 unsigned long long blocks = (unsigned long long)tokens * (((unsigned long long)heads + 15u) / 16u);\n    \
                 return heads >= {min}u && {f}u * blocks <= (unsigned long long)sms;\n\
                 }}\n\n",
                min = n.heads_min,
                f = DecodeConfig::NARROW_FACTOR,
            ),
            None => String::new(),
        },
        wide_fn = match wide {
            Some(w) => format!(
                "/* Is a call a wide one (DecodeConfig::is_wide_call): bf16, heads a multiple of {h} and\n   \
                 {f} x tokens x heads / {h} >= sms. The runtime runs v7 in {h}-head blocks there\n   \
                 ({name}), at any v6_per_sm (on an H100\n   \
                 1.05-1.42x the 32-head kernels from 12 such blocks on 132 SMs, benches/NOTES.md v40). */\n\
                 static inline int sparse_mla_is_wide_call(int format, unsigned heads, unsigned tokens, unsigned sms) {{\n    \
                 return format == SPARSE_MLA_CACHE_BF16 && heads % {h}u == 0u\n        \
                 && {f}ull * tokens * (heads / {h}u) >= (unsigned long long)sms;\n\
                 }}\n\n",
                h = w.config.block_h,
                f = DecodeConfig::WIDE_FACTOR,
                name = w.split.name,
            ),
            None => String::new(),
        },
        v6_fn = match v6_probe {
            Some(v6) => v6_kernel_fn(v6),
            None => String::new(),
        },
    );
    // one `if` per kernel: its head range within its format
    let case = |s: &mut String, v: &DecodeVariant, indent: &str| {
        let fmt = match v.format {
            CacheFormat::Bf16 => "SPARSE_MLA_CACHE_BF16",
            CacheFormat::Fp8DsMla => "SPARSE_MLA_CACHE_FP8_DS_MLA",
        };
        let mut cond = format!("format == {fmt} && heads >= {}u", v.heads_min);
        if let Some(m) = v.heads_max {
            let _ = write!(cond, " && heads <= {m}u");
        }
        if v6_probe.is_some() {
            if v.v6_per_sm_min > 1 {
                let _ = write!(cond, " && v6_per_sm >= {}u", v.v6_per_sm_min);
            }
            if let Some(m) = v.v6_per_sm_max {
                let _ = write!(cond, " && v6_per_sm <= {m}u");
            }
        }
        plan_fill(s, indent, &cond, v);
    };
    if let Some(w) = wide {
        // bf16's wide calls: its 64-head kernel at any v6_per_sm, before the other rules
        // (DecodeConfig::for_call)
        plan_fill(
            &mut s,
            "    ",
            "sparse_mla_is_wide_call(format, heads, tokens, sms)",
            w,
        );
    }
    if v6_probe.is_some() {
        // bf16 above 16 heads: v6 in 16-head blocks (DecodeConfig::tensor_core_v6_narrow)
        // where is_v6_call, whose answer there does not depend on v6_per_sm
        let _ = write!(
            s,
            "    if (format == SPARSE_MLA_CACHE_BF16 && heads > {v6n_max}u && sparse_mla_is_v6_call(heads, tokens, sms, v6_per_sm))\n        \
             return sparse_mla_v6_kernel({v6n_block}u, p);\n"
        );
    }
    if !narrow.is_empty() {
        s.push_str("    if (sparse_mla_is_narrow_call(heads, tokens, sms)) {\n");
        // fp8_ds_mla's narrow calls of NARROW_WIDE_MIN_BLOCKS or more: its large-batch kernel
        // (64-row steps) in 16-head blocks (DecodeConfig::is_narrow_wide_call)
        let wide = DecodeConfig::tensor_core_narrow_wide(dims, CacheFormat::Fp8DsMla, 17);
        if let Some(v) = batch.iter().find(|v| Some(v.config) == wide) {
            let cond = format!(
                "format == SPARSE_MLA_CACHE_FP8_DS_MLA && (unsigned long long)tokens * (((unsigned long long)heads + 15u) / 16u) >= {}ull",
                DecodeConfig::NARROW_WIDE_MIN_BLOCKS
            );
            plan_fill(&mut s, "        ", &cond, v);
        }
        for v in narrow {
            case(&mut s, v, "        ");
        }
        s.push_str("    }\n");
    }
    if batch.is_empty() {
        s.push_str(
            "    (void)tokens; /* no large-batch kernel in this export */\n    (void)topk;\n",
        );
    } else {
        s.push_str(
            "    if (sparse_mla_is_large_batch(format, heads, tokens, topk, sms, v6_per_sm)) {\n",
        );
        for v in batch {
            case(&mut s, v, "        ");
        }
        s.push_str("    }\n");
    }
    if v6_probe.is_some() {
        // bf16 small calls: the v6 kernel of the head count where is_v6_call, else the
        // variant table's v7
        s.push_str(
            "    if (format == SPARSE_MLA_CACHE_BF16 && sparse_mla_is_small_call(heads, tokens, sms)\n        \
             && sparse_mla_is_v6_call(heads, tokens, sms, v6_per_sm))\n        \
             return sparse_mla_v6_kernel(heads, p);\n",
        );
        // the calls that run v7 at any residency (small ones, bf16_wide_runs_v7) take the
        // table's one-workgroup-per-SM variant, where the table still depends on it
        if variants
            .iter()
            .any(|v| v.v6_per_sm_min > 1 || v.v6_per_sm_max.is_some())
        {
            s.push_str(
                "    if (format == SPARSE_MLA_CACHE_BF16 && (sparse_mla_is_small_call(heads, tokens, sms)\n        \
                 || sparse_mla_bf16_wide_runs_v7(heads, tokens, sms)))\n        \
                 v6_per_sm = 1u;\n",
            );
        }
    }
    for v in variants {
        case(&mut s, v, "    ");
    }
    let mut ranges: Vec<String> = Vec::new();
    for v in variants {
        let r = format!("{} {}", v.format.name(), v.range_text());
        if !ranges.contains(&r) {
            ranges.push(r);
        }
    }
    let _ = write!(
        s,
        r#"    return "heads: no kernel of this export serves this format and head count (exported: {ranges})";
}}

/* Everything one decode call needs: kernel, splits, chunk, grids, scratch sizes; limits checked.
   The kernel is sparse_mla_decode_variant(format, heads, tokens, topk, sms, v6_per_sm). `sms`: the
   GPU's CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT; `v6_per_sm`: as there. `resident`:
   workgroups of that kernel the GPU runs at once (sparse_mla_resident() on its function).
   splits = 0: the cost model for `resident` workgroups; else that many (capped at the blocks
   of topk, as the runtime does). Returns 0 on success, else a message naming the argument. */
static inline const char* sparse_mla_plan_decode(int format, unsigned heads, unsigned tokens, unsigned topk,
                                                 unsigned long long num_slots, unsigned lse_s_q, unsigned sms,
                                                 unsigned v6_per_sm, unsigned resident, unsigned splits,
                                                 sparse_mla_decode_plan* p) {{
    const char* err = sparse_mla_decode_variant(format, heads, tokens, topk, sms, v6_per_sm, p);
    unsigned blocks, want;
    unsigned long long words;
    if (err) return err;
    if (tokens == 0u || tokens > SPARSE_MLA_MAX_TOKENS) return "tokens: expected 1..65535 (grid z)";
    if (topk == 0u) return "topk: expected at least 1";
    if (num_slots == 0ull) return "num_slots: expected at least 1";
    if (num_slots > SPARSE_MLA_MAX_SLOTS) return "num_slots: expected at most 2^31 - 1 (slots are i32)";
    words = num_slots * (sparse_mla_row_bytes(format) / 4u);
    if (words >= SPARSE_MLA_MAX_WORDS) return "kv_cache: expected fewer than 2^31 32-bit words (8 GiB); split the cache per layer";
    if ((unsigned long long)tokens * heads * SPARSE_MLA_D_QK / 2u >= SPARSE_MLA_MAX_WORDS) return "q: expected fewer than 2^31 32-bit words";
    if (lse_s_q == 0u || tokens % lse_s_q != 0u) return "lse_s_q: expected a divisor of tokens (tokens = batch x s_q)";
    blocks = (topk + p->block_n - 1u) / p->block_n;
    want = splits ? splits : sparse_mla_model_splits(p, format, heads, tokens, topk, resident, sms);
    if (want > blocks) want = blocks;
    if (want == 0u) want = 1u;
    p->chunk = ((blocks + want - 1u) / want) * p->block_n;
    p->splits = (topk + p->chunk - 1u) / p->chunk;
    p->grid[0] = (heads + p->block_h - 1u) / p->block_h;
    p->grid[1] = p->splits;
    p->grid[2] = tokens;
    p->combine_grid[0] = heads;
    p->combine_grid[1] = tokens;
    {{
        /* the combine's split groups (combine_groups in src/kernels/sparse_mla_decode/combine.rs):
           the largest power of two <= min(splits, combine_threads / 16, 1024 / (T x H)), at
           least 1; its column chunk 2 x combine_threads / groups */
        unsigned long long rows = (unsigned long long)tokens * heads;
        unsigned x = p->splits, cap = p->combine_threads / 16u, g = 1u, chunk;
        unsigned long long fill = rows ? 1024ull / rows : 1024ull;
        if (cap < 1u) cap = 1u;
        if (x > cap) x = cap;
        if (fill < 1ull) fill = 1ull;
        if ((unsigned long long)x > fill) x = (unsigned)fill;
        while (g * 2u <= x) g *= 2u;
        chunk = 2u * p->combine_threads / g;
        p->combine_groups = g;
        p->combine_grid[2] = (SPARSE_MLA_D_V + chunk - 1u) / chunk;
    }}
    if (p->splits > 1u) {{
        unsigned long long rows = (unsigned long long)tokens * heads * p->splits;
        p->o_part_bytes = rows * SPARSE_MLA_D_V * 4u;
        p->lse_part_bytes = rows * 4u;
    }} else {{
        p->o_part_bytes = 0ull;
        p->lse_part_bytes = 0ull;
    }}
    return 0;
}}

/* Cache strides in 32-bit words from byte strides (0: packed), checked as the runtime checks
   them. Returns 0 on success, else a message naming the argument. */
static inline const char* sparse_mla_cache_strides(int format, unsigned num_pages, unsigned page_size,
                                                   unsigned long long row_stride_bytes,
                                                   unsigned long long page_stride_bytes,
                                                   unsigned* row_stride_w, unsigned* page_stride_w) {{
    unsigned long long row = sparse_mla_row_bytes(format);
    unsigned long long rs = row_stride_bytes ? row_stride_bytes : row;
    unsigned long long ps;
    unsigned long long last;
    if (page_size == 0u) return "page_size: expected at least 1";
    if (num_pages == 0u) return "num_pages: expected at least 1";
    if (rs % 4u != 0u || rs < row) return "row stride: expected a multiple of 4 bytes, at least the row";
    ps = page_stride_bytes ? page_stride_bytes : rs * page_size;
    if (ps % 4u != 0u || ps < rs * page_size) return "page stride: expected a multiple of 4 bytes, at least page_size x row stride";
    if ((unsigned long long)num_pages * page_size > SPARSE_MLA_MAX_SLOTS) return "num_pages x page_size: expected at most 2^31 - 1 slots";
    last = (unsigned long long)(num_pages - 1u) * ps + (unsigned long long)(page_size - 1u) * rs + row;
    if (last / 4u >= SPARSE_MLA_MAX_WORDS) return "kv_cache: expected fewer than 2^31 32-bit words (8 GiB); split the cache per layer";
    *row_stride_w = (unsigned)(rs / 4u);
    *page_stride_w = (unsigned)(ps / 4u);
    return 0;
}}
"#,
        ranges = ranges.join(", ")
    );
    s.push_str(&driver_code(variants, v6_probe.is_some())?);
    Ok(s)
}

/// `sparse_mla_v6_kernel`: the bf16 v6 split kernel for a head count (`v6`, from
/// [`v6_probe_variants`]), the kernel whose occupancy is `v6_per_sm`.
fn v6_kernel_fn(v6: &[DecodeVariant]) -> String {
    let mut s = String::from(
        "/* The kernel whose occupancy is `v6_per_sm`: the bf16 v6 split kernel for `heads`\n   \
         (DecodeConfig::tensor_core_v6), whatever format the calls use (the runtime asks the same).\n   \
         Fills split_kernel, threads and dynamic_smem (and the other kernel facts): load\n   \
         p->split_kernel, then sparse_mla_v6_per_sm(). It plans no call (for bf16 small calls\n   \
         sparse_mla_decode_variant takes this kernel). Returns 0 on success, else a message\n   \
         naming the argument. */\n\
         static inline const char* sparse_mla_v6_kernel(unsigned heads, sparse_mla_decode_plan* p) {\n    \
         if (heads == 0) return \"heads: expected at least 1\";\n",
    );
    for v in v6 {
        let mut cond = format!("heads >= {}u", v.heads_min);
        if let Some(m) = v.heads_max {
            let _ = write!(cond, " && heads <= {m}u");
        }
        plan_fill(&mut s, "    ", &cond, v);
    }
    s.push_str("    return \"heads: no v6 kernel for this head count\";\n}\n\n");
    s
}

/// The generic parameter struct of the split kernels, checked to be the same for every
/// variant.
fn split_params_struct(variants: &[DecodeVariant]) -> Result<String> {
    let first = &variants[0];
    let fields = |k: &Kernel| -> Vec<(String, crate::kir::ir::Ty)> {
        k.params.iter().map(|p| (p.name.clone(), p.ty)).collect()
    };
    let want = fields(&first.split);
    for v in variants {
        if fields(&v.split) != want {
            return Err(Error::Kir {
                kernel: v.split.name.clone(),
                message: "split kernels of one export must share one parameter list".into(),
            });
        }
    }
    let body = cuda::params_struct(&first.split);
    Ok(body
        .replacen(
            &format!("struct {}_params {{", first.split.name),
            "typedef struct sparse_mla_decode_params {",
            1,
        )
        .replacen("};\n", "} sparse_mla_decode_params;\n", 1))
}

/// Driver-API launch helpers, compiled only where `cuda.h` was included first. `v6`:
/// with `sparse_mla_v6_per_sm` (the header has `sparse_mla_v6_kernel`).
fn driver_code(variants: &[DecodeVariant], v6: bool) -> Result<String> {
    let params = split_params_struct(variants)?;
    let v6_per_sm = if v6 {
        r#"
/* The `v6_per_sm` of sparse_mla_decode_variant / sparse_mla_plan_decode, as the runtime measures
   it (decode_kernel_choice in src/runtime/cuda.rs): workgroups of the bf16 v6 split kernel one
   multiprocessor holds, cuOccupancyMaxActiveBlocksPerMultiprocessor at its threads and dynamic
   shared memory (at least 1). `v6` is the function of v6_kernel->split_kernel, v6_kernel filled
   by sparse_mla_v6_kernel(heads) for the calls' head count (the kernel differs with H, and so
   can its occupancy); its shared memory is allowed here first. Once per GPU and head count. */
static inline CUresult sparse_mla_v6_per_sm(CUfunction v6, const sparse_mla_decode_plan* v6_kernel, unsigned* v6_per_sm) {
    int n = 0;
    CUresult r = sparse_mla_allow_smem(v6, v6_kernel->dynamic_smem);
    if (r != CUDA_SUCCESS) return r;
    r = cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, v6, (int)v6_kernel->threads, (size_t)v6_kernel->dynamic_smem);
    if (r != CUDA_SUCCESS) return r;
    *v6_per_sm = (unsigned)(n > 0 ? n : 1);
    return CUDA_SUCCESS;
}
"#
    } else {
        ""
    };
    Ok(format!(
        r#"
/* ---- launching through the CUDA driver API: only when <cuda.h> was included first ---- */
#if defined(CUDA_VERSION) && !defined(SPARSE_MLA_NO_DRIVER_HELPERS)

/* Every split kernel's NAME_params, field for field. */
{params}
/* The combine's parameters. */
typedef struct sparse_mla_combine_params {{ unsigned heads; unsigned splits; unsigned lse_s_q; unsigned groups; unsigned whole_tokens; }} sparse_mla_combine_params;

/* Device pointers of one call. topk_length = 0: none (indices is passed in its place, the
   kernel reads one word of it). o_part / lse_part: scratch of plan->o_part_bytes /
   plan->lse_part_bytes, only when plan->splits > 1 (0: out / lse are passed in their place,
   never touched). */
typedef struct sparse_mla_decode_buffers {{
    CUdeviceptr q, kv_cache, indices, topk_length, out, lse, o_part, lse_part;
}} sparse_mla_decode_buffers;

/* Allow a kernel its dynamic shared memory (needed once per function, above 48 KB). */
static inline CUresult sparse_mla_allow_smem(CUfunction f, unsigned dynamic_smem) {{
    if (dynamic_smem == 0u) return CUDA_SUCCESS;
    return cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)dynamic_smem);
}}

/* Multiprocessors of `dev`: the `sms` of sparse_mla_decode_variant / sparse_mla_plan_decode. */
static inline CUresult sparse_mla_sm_count(CUdevice dev, unsigned* sms) {{
    int n = 0;
    CUresult r = cuDeviceGetAttribute(&n, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    if (r != CUDA_SUCCESS) return r;
    *sms = (unsigned)(n > 0 ? n : 1);
    return CUDA_SUCCESS;
}}
{v6_per_sm}
/* Workgroups of the split kernel `split` the device runs at once (occupancy x multiprocessors):
   the `resident` of sparse_mla_plan_decode, what the runtime feeds the split model. `split` is
   the function of plan->split_kernel as sparse_mla_decode_variant picked it for the call
   (after sparse_mla_allow_smem); each kernel has its own count. */
static inline CUresult sparse_mla_resident(CUfunction split, const sparse_mla_decode_plan* p, CUdevice dev,
                                           unsigned* resident) {{
    int per_sm = 0, sms = 0;
    CUresult r = cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, split, (int)p->threads, (size_t)p->dynamic_smem);
    if (r != CUDA_SUCCESS) return r;
    r = cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    if (r != CUDA_SUCCESS) return r;
    *resident = (unsigned)((per_sm > 0 ? per_sm : 1) * sms);
    return CUDA_SUCCESS;
}}

/* Launch one decode call on `stream` as planned: `split` is the function of
   plan->split_kernel, `combine` of plan->combine_kernel (unused when splits == 1). Only the
   fields of `prm` that describe the call are read here; splits and chunk come from the plan.
   On sm_90 and later either kernel may instead go through cuLaunchKernelEx with
   CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1: each waits for the kernel before
   it in the stream itself (griddepcontrol.wait), so its launch then hides behind that one's
   run (0.6-1.7 us per decode call on an H200); the sparse-mla runtime launches them so. */
static inline CUresult sparse_mla_launch_decode(const sparse_mla_decode_plan* p, CUfunction split, CUfunction combine,
                                                sparse_mla_decode_params prm, const sparse_mla_decode_buffers* b,
                                                CUstream stream) {{
    CUdeviceptr len = b->topk_length ? b->topk_length : b->indices;
    CUdeviceptr o_part = b->o_part ? b->o_part : b->out;
    CUdeviceptr lse_part = b->lse_part ? b->lse_part : b->lse;
    void* args[9];
    CUresult r;
    prm.splits = p->splits;
    prm.chunk = p->chunk;
    prm.has_topk_length = b->topk_length ? 1u : 0u;
    args[0] = &prm; args[1] = (void*)&b->q; args[2] = (void*)&b->kv_cache; args[3] = (void*)&b->indices;
    args[4] = &len; args[5] = (void*)&b->out; args[6] = (void*)&b->lse; args[7] = &o_part; args[8] = &lse_part;
    r = cuLaunchKernel(split, p->grid[0], p->grid[1], p->grid[2], p->threads, 1, 1, p->dynamic_smem, stream, args, 0);
    if (r != CUDA_SUCCESS || p->splits == 1u) return r;
    {{
        sparse_mla_combine_params c;
        void* cargs[5];
        c.heads = prm.heads; c.splits = p->splits; c.lse_s_q = prm.lse_s_q; c.groups = p->combine_groups;
        c.whole_tokens = 0u; /* this header's plans split every token alike */
        cargs[0] = &c; cargs[1] = (void*)&b->o_part; cargs[2] = (void*)&b->lse_part; cargs[3] = (void*)&b->out; cargs[4] = (void*)&b->lse;
        return cuLaunchKernel(combine, p->combine_grid[0], p->combine_grid[1], p->combine_grid[2], p->combine_threads, 1, 1, 0,
                              stream, cargs, 0);
    }}
}}
#endif /* CUDA_VERSION */
"#
    ))
}

/// Every standard CUDA kernel's parameter struct with its buffers.
fn kernel_structs(kernels: &[&Kernel]) -> String {
    let mut h = String::new();
    for k in kernels {
        h.push_str(&format!("// {}\n", k.name));
        for d in &k.doc {
            h.push_str(&format!("//   {d}\n"));
        }
        h.push_str(&format!(
            "//   threads per block: {}; dynamic shared memory: {} B\n",
            k.workgroup_size,
            cuda::dynamic_shared_bytes(k)
        ));
        h.push_str(&format!(
            "//   arguments: ({}_params p, {})\n",
            k.name,
            cuda::buffer_params(k).join(", ")
        ));
        for b in &k.buffers {
            h.push_str(&format!("//     {:<12} {}\n", b.name, b.doc));
        }
        h.push_str(&cuda::params_struct(k));
        h.push('\n');
    }
    h
}

/// The large-batch kernels (`DecodeConfig::tensor_core_batch`, here `batch`) and when the
/// backend runs them.
fn batch_rules(batch: &[DecodeVariant]) -> String {
    let mut s = String::from(
        "//\n\
         // LARGE BATCHES. For H <= 16 the backend runs a third kernel for fp8_ds_mla on every call\n\
         // that is not a small one (16 * T * ceil(H / 16) > SMs): v7 with 64-row steps in a\n\
         // two-stage ring (fewer, larger steps: fewer chains of waits). Same parameters, buffers,\n\
         // grid and split rules as the variants above (block_h 16; block_n as listed below); its\n\
         // own occupancy feeds `resident` (sparse_mla_resident on its function).\n\
         // sparse_mla_decode_variant and sparse_mla_plan_decode pick it from T and the SM count\n\
         // (sparse_mla_is_large_batch). bf16 runs the variants above at every T: its large-batch\n\
         // kernel (two warp groups) is no longer planned or exported, v7 being level or faster:\n",
    );
    for v in batch {
        let _ = writeln!(
            s,
            "//   {:<10} {:<14} {}",
            v.format.name(),
            v.range_text(),
            kernel_facts(&v.split)
        );
    }
    s
}

/// `cuda/sparse_mla.h`: launch rules of the production (tensor-core) decode kernels, the plan
/// helpers, and the parameter struct of every standard CUDA kernel.
pub fn c_header(kernels: &[&Kernel]) -> Result<String> {
    let mut variants = decode_variants(ExportLowering::Mma, CacheFormat::Bf16)?;
    variants.extend(decode_variants(ExportLowering::Mma, CacheFormat::Fp8DsMla)?);
    let mut batch = batch_variants(CacheFormat::Bf16)?;
    batch.extend(batch_variants(CacheFormat::Fp8DsMla)?);
    let mut h = String::from(
        "// sparse_mla.h: how to launch the generated CUDA kernels in this folder.\n\
         // Generated by `mla-export --all`; do not edit (change src/kernels/ and re-export).\n\
         //\n\
         // The production decode kernels are the tensor-core (mma.sync) ones below, the kernels\n\
         // the CUDA backend of sparse-mla runs: the v7 mbarrier ring (*_ws*) for both cache formats\n\
         // on every GPU, and for bf16 the v6 kernel (*_mma*) on the smallest calls (sparse_mla_is_v6_call).\n\
         // sparse_mla_decode_variant() below picks among them as the backend does, given the SM\n\
         // count (WHICH KERNEL). The folder also holds the scalar\n\
         // lowering (*_scalar_*: static shared memory, 128 threads) and the v6 fp8 kernels; all\n\
         // launch by the same rules with the block_h x block_n in their names. Cache write and\n\
         // block-table conversion: see their structs at the end.\n//\n",
    );
    let wide = wide_variant()?;
    h.push_str(&launch_rules(&variants, &batch, wide.as_ref()));
    h.push_str(&batch_rules(&batch));
    h.push_str("\n#pragma once\n\n");
    let mut narrow = narrow_variants(CacheFormat::Bf16)?;
    narrow.extend(narrow_variants(CacheFormat::Fp8DsMla)?);
    h.push_str(&plan_code(
        &variants,
        &batch,
        &narrow,
        Some(&v6_probe_variants()?),
        wide.as_ref(),
    )?);
    h.push_str("\n/* ---- every kernel's parameter struct ---- */\n\n");
    h.push_str(&kernel_structs(kernels));
    Ok(h)
}

/// What a per-configuration header serves: its one split kernel for the whole head range,
/// and where the large-batch kernel the backend runs instead for some calls is exported
/// (the standard set: it is not part of a per-configuration export).
fn one_kernel_note(
    shape: &DecodeShape,
    lowering: ExportLowering,
    variant: &DecodeVariant,
    sms: u32,
    arch: &str,
) -> Result<String> {
    let mut s = format!(
        "// ONE KERNEL. This export is one fixed decode kernel, {}, for every call at {}\n\
         // ({} lowering; the combine {} merges its splits):\n\
         //   {}\n\
         // and sparse_mla_plan_decode() below always plans it.\n",
        variant.family(),
        variant.range_text(),
        lowering.name(),
        variant.combine.name,
        variant.split.name,
    );
    // the other variants the backend runs at these heads on a GPU of another v6 occupancy
    for o in decode_variants(lowering, shape.format)?
        .iter()
        .filter(|o| o.contains(shape.heads) && o.split.name != variant.split.name)
    {
        let here = estimate_per_sm(&variant.config, &variant.split, arch);
        let note = if o.serves_v6_per_sm(here) {
            format!("; {arch} by the estimate")
        } else {
            String::new()
        };
        let _ = write!(
            s,
            "// The backend runs it on a GPU where {} (H100/H200); at {}\n\
             // (SM120, sm_86/89{note}) it runs {} instead, in the standard set, not here:\n\
             //   {}\n",
            variant.v6_text(),
            o.v6_text(),
            o.family(),
            o.split.name,
        );
    }
    let overlaps = |b: &DecodeVariant| {
        b.heads_min <= variant.heads_max.unwrap_or(u32::MAX)
            && variant.heads_min <= b.heads_max.unwrap_or(u32::MAX)
    };
    for b in batch_variants(shape.format)?.iter().filter(|b| overlaps(b)) {
        // on a GPU of the v6 occupancy this export's variant serves
        let large = DecodeConfig::is_large_batch(shape, sms);
        let example = if b.contains(shape.heads) && large {
            format!(" (the example call below is one, on {sms} SMs)")
        } else {
            String::new()
        };
        let _ = write!(
            s,
            "// For a large batch at {} (sparse_mla_is_large_batch in cuda/sparse_mla.h), the CUDA backend runs\n\
             // the large-batch kernel instead{example}:\n\
             //   {}\n\
             // It is not in this export. It is in the standard set (`mla-export --all`, cuda/NAME.cu),\n\
             // whose cuda/sparse_mla.h plans both kernels as the backend does. This header's plan is\n\
             // correct for any call, but slower than the backend's for a large batch.\n",
            b.range_text(),
            b.split.name,
        );
    }
    s.push_str("//\n");
    Ok(s)
}

/// The per-configuration launch header: this configuration's facts as macros, the launch rules,
/// the plan helpers restricted to the exported variant, and its kernels' parameter structs.
pub fn config_header(
    shape: &DecodeShape,
    lowering: ExportLowering,
    variant: &DecodeVariant,
    plan: &DecodePlan,
    sms: u32,
    per_sm: u32,
    arch: &str,
) -> Result<String> {
    let grid = plan.grid_split(shape);
    let first = &variant.split;
    let mut h = format!(
        "// Launch header for sparse MLA decode: {} lowering, cache {}, {}, page size {}.\n\
         // Generated by mla-export; do not edit (change src/kernels/ and re-export).\n\
         //\n\
         // The macros are this export's example call: heads {}, tokens {}, topk {}, with the\n\
         // splits the runtime's model picks for {sms} SMs x {per_sm} resident workgroups each\n\
         // (estimated for {arch}; on the GPU, take sparse_mla_resident() or the occupancy API)\n\
         // {}. Heads, tokens, topk, page size and splits are run-time parameters: call\n\
         // sparse_mla_plan_decode() per call shape.\n//\n",
        lowering.name(),
        shape.format.name(),
        variant.range_text(),
        shape.page_size,
        shape.heads,
        shape.tokens,
        shape.topk,
        if plan.splits == 1 {
            "-> one split".to_string()
        } else {
            format!("-> {} splits", plan.splits)
        }
    );
    h.push_str(&one_kernel_note(shape, lowering, variant, sms, arch)?);
    h.push_str(&launch_rules(std::slice::from_ref(variant), &[], None));
    h.push_str("\n#pragma once\n\n");
    let _ = write!(
        h,
        "#define SPARSE_MLA_HEADS {}u\n#define SPARSE_MLA_TOPK {}u\n#define SPARSE_MLA_TOKENS {}u\n\
         #define SPARSE_MLA_PAGE_SIZE {}u\n#define SPARSE_MLA_ROW_BYTES {}u\n\
         #define SPARSE_MLA_BLOCK_H {}u\n#define SPARSE_MLA_BLOCK_N {}u\n\
         #define SPARSE_MLA_SPLITS {}u\n#define SPARSE_MLA_CHUNK {}u\n\
         #define SPARSE_MLA_GRID_X {}u\n#define SPARSE_MLA_GRID_Y {}u\n\
         #define SPARSE_MLA_THREADS {}u\n#define SPARSE_MLA_DYNAMIC_SMEM {}u\n\
         #define SPARSE_MLA_FIRST_KERNEL \"{}\"\n#define SPARSE_MLA_O_PART_BYTES {}ull\n\
         #define SPARSE_MLA_LSE_PART_BYTES {}ull\n\n",
        shape.heads,
        shape.topk,
        shape.tokens,
        shape.page_size,
        shape.row_bytes(),
        plan.config.block_h,
        plan.config.block_n,
        plan.splits,
        plan.chunk,
        grid[0],
        grid[1],
        first.workgroup_size,
        cuda::dynamic_shared_bytes(first),
        first.name,
        if plan.splits > 1 {
            shape.tokens as u64 * shape.heads as u64 * plan.splits as u64 * shape.dims.d_v() as u64 * 4
        } else {
            0
        },
        if plan.splits > 1 {
            shape.tokens as u64 * shape.heads as u64 * plan.splits as u64 * 4
        } else {
            0
        },
    );
    h.push_str(&plan_code(
        std::slice::from_ref(variant),
        &[],
        &[],
        None,
        None,
    )?);
    h.push_str("\n/* ---- the exported kernels' parameter structs ---- */\n\n");
    h.push_str(&kernel_structs(&[&variant.split, &variant.combine]));
    Ok(h)
}
