//! The run-time plan of one decode call: a configuration's splits of the top-k list, the
//! tokens run whole before the split ones, and whether the splits merge in the same launch
//! ([`DecodePlan`]), with the cost model that chooses them and the environment switches
//! that override it (`SPARSE_MLA_MERGE`, `SPARSE_MLA_WHOLE_TOKENS`). Which configuration a
//! call runs is [`DecodeConfig::for_call`]'s choice, in the parent module.

use super::{merge, DecodeConfig};
use crate::mla::DecodeShape;
use crate::{Error, Result};

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
    pub(super) fn model_cost(
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
