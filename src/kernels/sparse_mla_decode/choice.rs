//! Which decode configuration a call runs: the size rules ([`DecodeConfig::for_call`] and the
//! predicates it asks, each with the measurement that set it) and the environment's
//! overrides ([`DecodeConfig::for_call_from_env`]). The configurations themselves are built
//! in the parent module; the call's splits are [`super::DecodePlan`]'s.

use super::DecodeConfig;
use crate::mla::{CacheFormat, DecodeShape};
use crate::{Error, Result};

impl DecodeConfig {
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

    /// Is `shape` a wide call: bf16, whole 64-head blocks (`H` a multiple of 64) and
    /// `WIDE_FACTOR · T · H/64 ≥ SMs` (at least 12 such blocks on 132 SMs)? [`Self::for_call`]
    /// runs [`Self::tensor_core_wide`] there, at any v6 residency. Measured on an H100
    /// (132 SMs), same binary (benches/NOTES.md, v40): against v7 in 32-head blocks, both
    /// occupancies, 1.05–1.42x from 12 blocks at H 64 (T 12–128) and from 16 at H 128
    /// (T 8–128), level at 10–12 (H 64 T 10, H 128 T 6), 0.83–0.94x at 4–8 (H 64 T 4–8,
    /// H 128 T 4); against v6 in 32-head blocks, which the backend ran on the H100's own
    /// occupancy where v7's one wave is partial, 1.22–1.42x (H 64 T 24–56, H 128 T 12–24).
    /// Head counts between multiples of 64 are not measured and keep 32-head blocks.
    pub fn is_wide_call(shape: &DecodeShape, sm_count: u32) -> bool {
        Self::tensor_core_wide(shape.dims, shape.format).is_some_and(|w| {
            shape.heads % w.block_h == 0
                && Self::WIDE_FACTOR * shape.tokens as u64 * (shape.heads / w.block_h) as u64
                    >= sm_count as u64
        })
    }

    /// The factor of [`Self::is_wide_call`]: 12 blocks of 64 heads on 132 multiprocessors
    /// were level or faster, 8 slower.
    pub const WIDE_FACTOR: u64 = 11;

    /// Is `shape` a large batch for a GPU of `sm_count` multiprocessors, one the large-batch
    /// kernel ([`Self::tensor_core_batch`]) runs at H ≤ 16: an fp8_ds_mla call that is not a
    /// small one ([`Self::is_small_call`]), `16 · T · ⌈H/16⌉ > SMs`. The two-group kernel of
    /// before beat v7 from T = 8 (1.02–1.15x at T 8–80 on the H200, 0.87–0.96x at T 1–4;
    /// benches/NOTES.md, v14), and the 64-row kernel that replaced it beats both past T 10
    /// (v26); on the H200 it still led v7 by 1.13–1.19x at H 8 / 16, T 40–512 (v41 (3)).
    ///
    /// Never for bf16: its large-batch kernel (two warp groups walking alternate steps) is
    /// still built and can be forced (`SPARSE_MLA_DECODE_KERNEL=batch`), but v7 has caught it
    /// up (scores held in rows, v35; the 16-head prefetch). On the H200 v7 was level with it or
    /// faster at every T measured at H 8 / 16, at both occupancies: at SM120's, 1.06–1.08x at
    /// T 40–64, 1.03x at T 128, 1.04x at T 200, 1.01x at T 256, level at T 512 (v41 (3)); the
    /// H100 said the same at T 128–200 (v41 (2)). The rule it had (20 steps or more a
    /// workgroup under the split model, and the call's blocks filling four fifths of the SMs
    /// where two v6 workgroups fit one) was set when it led v7 by 2–9 % (v14, v22, v36).
    /// Dropping it (v42, the binary before against this one on the H200, two rounds):
    /// 1.01–1.05x on the calls it had taken at the H200's occupancy (T 128 112.3 → 110.2 µs),
    /// 1.01–1.09x at SM120's.
    pub fn is_large_batch(shape: &DecodeShape, sm_count: u32) -> bool {
        Self::plans_large_batch(shape.format) && !Self::is_small_call(shape, sm_count)
    }

    /// Does [`Self::for_call`] run the large-batch kernel of `format` on any call
    /// ([`Self::is_large_batch`])? fp8_ds_mla's only: bf16's is built but never planned. The
    /// standard export set and `cuda/sparse_mla.h` carry the kernels this answers yes for.
    pub fn plans_large_batch(format: CacheFormat) -> bool {
        format == CacheFormat::Fp8DsMla
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
    /// (benches/NOTES.md, v13). Since v42 v6 takes only the smallest of them at H ≤ 16
    /// (T ≤ 4; [`Self::is_v6_call`]).
    pub fn is_small_call(shape: &DecodeShape, sm_count: u32) -> bool {
        16 * Self::blocks16(shape) <= sm_count as u64
    }

    /// Does a bf16 call run a v6 kernel, `f · T · ⌈H/16⌉ ≤ SMs`, at any v6 residency, with
    /// `f` by the head count:
    /// - [`Self::V6_FACTOR`] (32) at H ≤ 16: T ≤ 4 on 132 SMs, where the split model gives each
    ///   workgroup at most 2 of topk 2048's 64 steps;
    /// - [`Self::V6_NARROW_FACTOR`] (20) above 16 heads, where the call runs v6 in 16-head
    ///   blocks ([`Self::tensor_core_v6_narrow`]).
    ///
    /// Each of them a small call. Past it v7 is the faster. At H ≤ 16 (v42, an H100, same
    /// binary, v6 against v7 forced, 3–4 interleaved rounds, both occupancies): v7 1.01–1.06×
    /// at T 5–8 at the H100's own occupancy (H 16 T 8 23.7 → 22.6 µs) and 1.01–1.07× at T 5–6 at
    /// SM120's, level at H 1–2 T 7–8; v6 kept at T ≤ 4 (v7 0.96–1.02×). The factors before
    /// (16 where two v6 workgroups fit a multiprocessor, 20 where one does) were set on the H200
    /// in v23, when v6 won at T ≤ 6 by 1–5 %; v7 has gained since (scores in rows, the 16-head
    /// prefetch). Above 16 heads (v25), against v7 in 16-head blocks (the narrow calls' kernel),
    /// v6 in 16-head blocks won on every call of ≤ 6 blocks at both occupancies (H 32 T 1–3
    /// 1.02–1.05×, H 48 T 1–2 1.01–1.04×, H 64 T 1 1.04–1.05×, H 96 T 1 level), and at 8
    /// blocks lost at SM120's (H 32 T 4 0.98×, H 64 T 2 0.97×) and at H 128 T 1 on the H200
    /// (0.99×).
    pub fn is_v6_call(shape: &DecodeShape, sm_count: u32) -> bool {
        // above 16 heads the call runs v6 in 16-head blocks
        let f = if Self::tensor_core_v6_narrow(shape.dims, CacheFormat::Bf16, shape.heads).is_some()
        {
            Self::V6_NARROW_FACTOR
        } else {
            Self::V6_FACTOR
        };
        f * Self::blocks16(shape) <= sm_count as u64
    }

    /// The factor of [`Self::is_v6_call`] at H ≤ 16: v6 won at 4 blocks, lost at 5.
    pub const V6_FACTOR: u64 = 32;

    /// The factor of [`Self::is_v6_call`] above 16 heads (v6 in 16-head blocks): v6 won at 6
    /// blocks, lost at 8.
    pub const V6_NARROW_FACTOR: u64 = 20;

    /// The configuration the CUDA backend runs for one call: for a bf16 call of more than 16
    /// heads that is a v6 call ([`Self::is_v6_call`]) v6 in 16-head blocks
    /// ([`Self::tensor_core_v6_narrow`]); [`Self::tensor_core_narrow`] for
    /// a narrow call ([`Self::is_narrow_call`]; [`Self::tensor_core_narrow_wide`] where
    /// [`Self::is_narrow_wide_call`]); fp8_ds_mla's [`Self::tensor_core_batch`]
    /// for a large batch ([`Self::is_large_batch`]); for a bf16 small call
    /// ([`Self::is_small_call`]) v6 where [`Self::is_v6_call`], else v7; v7 for every other
    /// call of more than 16 heads ([`Self::bf16_wide_runs_v7`]); else
    /// [`Self::tensor_core_on`] (v7). Before all of these, a wide call
    /// ([`Self::is_wide_call`]) runs bf16's 64-head kernel ([`Self::tensor_core_wide`]).
    ///
    /// `v6_per_sm` (the GPU's residency of the bf16 v6 split kernel) is asked only where it
    /// would decide, and since v42 no rule leaves it a call to decide: v7 caught v6 up on the
    /// calls it had kept on the H100/H200 (bf16 H ≤ 16 past T 4, and above 16 heads in one
    /// partial wave), so the choice is the same on every GPU. It stays a parameter so that a
    /// later measurement can bring a residency rule back without changing the callers.
    pub fn for_call<E>(
        shape: &DecodeShape,
        sm_count: u32,
        v6_per_sm: impl FnOnce() -> std::result::Result<u32, E>,
    ) -> std::result::Result<Self, E> {
        let (dims, format, heads) = (shape.dims, shape.format, shape.heads);
        if let Some(wide) =
            Self::tensor_core_wide(dims, format).filter(|_| Self::is_wide_call(shape, sm_count))
        {
            return Ok(wide);
        }
        if let Some(v6) = Self::tensor_core_v6_narrow(dims, format, heads)
            .filter(|_| Self::is_v6_call(shape, sm_count))
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
            // at any v6 residency
            return Ok(if Self::is_v6_call(shape, sm_count) {
                Self::tensor_core_v6(dims, format, heads)
            } else {
                Self::tensor_core_v7(dims, format, heads)
            });
        }
        if let Some(batch) = Self::tensor_core_batch(dims, format, heads)
            .filter(|_| Self::is_large_batch(shape, sm_count))
        {
            return Ok(batch);
        }
        // v7 at any residency: for bf16 above 16 heads every call left is one of
        // bf16_wide_runs_v7's, and tensor_core_on asks the residency for no call today
        Self::tensor_core_on(dims, format, heads, v6_per_sm)
    }

    /// The decode kernel a GPU backend runs for `shape` on `sm_count` multiprocessors, with the
    /// run-time switches of the environment: [`Self::for_call`] (`v6_per_sm`: the GPU's
    /// residency of the bf16 v6 split kernel, asked only where it decides), or the version
    /// forced with `SPARSE_MLA_DECODE_KERNEL=v6|v7|batch|wide` (`batch`: the large-batch
    /// kernel where one exists for the head count, else v7; `wide`: for bf16 above 16 heads
    /// [`Self::tensor_core_wide`], else v7); then the forms:
    /// - `SPARSE_MLA_ROW_SOFTMAX=0|1`: how the scores are held for the softmax
    ///   ([`Self::with_row_softmax`]); unset, each kernel keeps its own (v7 in rows,
    ///   [`Self::V7_ROW_SOFTMAX`], and fp8's one-group large-batch kernel; bf16's two-group
    ///   one in fragments). `0` holds them in fragments. The row form on a call planned on
    ///   bf16's large-batch kernel (two warp groups) is refused: compute-sanitizer's
    ///   racecheck reports hazards in its row forms that are not yet explained (v32: only in
    ///   bf16 cases; fp8's one-group large-batch kernel ran clean in rows, v32 and v36).
    /// - `SPARSE_MLA_FP8_VALUES=shared` (`per-warp` by default) decodes fp8_ds_mla's values
    ///   for `P · V` once a step into a shared tile ([`Self::with_fp8_values`]; the kernel's
    ///   name ends in `v`). Timed slower (v41).
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
            Ok("wide") => Self::tensor_core_wide(dims, format)
                .filter(|_| heads > 16)
                .unwrap_or_else(|| Self::tensor_core_v7(dims, format, heads)),
            Ok(other) => {
                return Err(Error::arg(
                    "SPARSE_MLA_DECODE_KERNEL",
                    "auto, v6, v7, batch or wide",
                    other,
                ))
            }
        };
        config.with_env_forms(shape)
    }

    /// Does a bf16 call of more than 16 heads run v7 whatever the GPU's v6 residency: every
    /// one that is not a v6 call ([`Self::is_v6_call`], v6 in 16-head blocks) since v42. Where
    /// two bf16 v6 workgroups fit a multiprocessor (H100/H200), v6 in 32-head blocks had kept
    /// the calls whose v7 blocks `b = T · ⌈H/32⌉` fill less than one wave
    /// (`b · ⌊SMs/b⌋ < 7/8 · SMs`): on the H200 v7 had been 0.93x there at H 32 T 48 (v17).
    /// v7 has gained since (scores in rows, the 16-head prefetch). On an H100 (benches/NOTES.md
    /// v42 (3)), the binary before against this one, two rounds: 1.023x geomean on the 16
    /// calls that moved (H 24 / 32 / 48 / 96, T 16–112). Above 32 heads every one gained or
    /// held, 1.00–1.18x (H 96 T 36 151.3 → 128.2 µs, H 48 T 48 132.5 → 124.2); at 24–32 heads
    /// it is a wash: 1.02–1.05x at T 36, 96 and 112, but 0.92–0.94x at T 48 (H 32 79.3 → 86.6
    /// µs, as in v17) and 0.97x at T 80. Not special-cased: one rule for every GPU, where the
    /// old one was no better at those head counts. Before that v7 had won 1.03–1.13× on
    /// one-wave calls (v17) and on several (v28).
    pub fn bf16_wide_runs_v7(shape: &DecodeShape, sm_count: u32) -> bool {
        shape.heads > 16 && !Self::is_v6_call(shape, sm_count)
    }
}
