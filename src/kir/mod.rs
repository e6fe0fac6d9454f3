//! kir: the kernel description language.
//!
//! - [`ir`]: types, expressions, statements and tile ops;
//! - [`builder`]: how descriptions are written;
//! - [`expr`]: the expression and statement constructors the builder and the lowerings share;
//! - [`ops`]: composite tile ops (online softmax, split combine);
//! - [`numeric`]: bit-exact number routines in integer ops (f32 division, e4m3 encode);
//! - [`walk`]: the rewrite every lowering is, and the visits over a body;
//! - [`shared_plan`]: where a lowered kernel's shared arrays live, and SM120's limit on them;
//! - [`lower_scalar`]: the portable lowering of tile ops to loops over workgroup memory;
//! - [`lower_mma`]: the CUDA tensor-core lowering (`mma.sync`, `ldmatrix`, `cp.async`).
//!
//! Lowerings are chosen per target by [`Lowering`]; emitters print lowered kernels only.

pub mod builder;
pub mod expr;
pub mod ir;
pub mod lower_mma;
pub mod lower_scalar;
pub mod numeric;
pub mod ops;
pub mod shared_plan;
pub mod walk;

pub use ir::Kernel;

/// How tile ops become scalar code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lowering {
    /// Loops over workgroup memory: every target.
    Scalar,
    /// CUDA tensor cores: `mma.sync` m16n8k16 bf16 fed by `ldmatrix`, gathers by `cp.async`
    /// into a ring of `stages` shared-memory buffers inside a pipeline. Only the SM120 common
    /// instruction set (sm_80 and later); at most [`shared_plan::MAX_SHARED_BYTES`] of shared
    /// memory per block.
    /// `min_workgroups`: the register-allocation hint of the lowered kernel (0: none).
    /// `l2_ahead` > 0: each step also asks L2 for the rows `l2_ahead` steps past the copies
    /// it issues (0: no prefetch).
    Mma {
        stages: u32,
        min_workgroups: u32,
        l2_ahead: u32,
    },
    /// CUDA tensor cores with a producer warp (`v7`): one extra warp gathers each pipeline
    /// step into a `stages`-deep ring (`cp.async.bulk` + mbarrier transaction counts on sm_90
    /// and later, `cp.async` arriving on the mbarrier before), the other warps compute, stages
    /// handed over with mbarriers instead of workgroup barriers; an S-like product is split
    /// along K over the warps with its loop-invariant A operand in registers. One workgroup
    /// per multiprocessor (SM120's shared-memory budget).
    ///
    /// `groups` > 1: the kernel describes the work of one *group* of warps; the workgroup
    /// holds `groups` of them, each an independent copy with its own ring, scratch and
    /// barriers (named, one id per group), walking every `groups`-th step of the pipeline.
    /// After the pipeline the groups' online-softmax states and accumulators are merged and
    /// group 0 runs the rest of the kernel. Several short dependency chains then share one
    /// multiprocessor instead of one long one (benches/NOTES.md, v11).
    ///
    /// `l2_ahead` > 0: the producer warps also ask L2 for the rows of the step `l2_ahead`
    /// steps past the last one whose copies are in flight, so those copies wait for L2, not
    /// DRAM, and a stage's shared memory is held for a shorter time (0: no prefetch).
    ///
    /// `row_softmax`: how a split-K accumulator that the online softmax reads is held
    /// ([`RowSoftmax`]).
    ///
    /// `group_by`: what the warp groups split ([`GroupBy`]): the steps (above), or the heads.
    MmaWs {
        stages: u32,
        groups: u32,
        l2_ahead: u32,
        row_softmax: RowSoftmax,
        group_by: GroupBy,
    },
}

/// What the warp groups of [`Lowering::MmaWs`] split between them (with `groups` > 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GroupBy {
    /// The pipeline's steps: each group walks every `groups`-th step with its own ring, and
    /// the groups' softmax states and accumulators meet after the pipeline (see
    /// `lower_mma::groups`).
    #[default]
    Steps,
    /// The workgroup's rows of output (heads): group `g` is the description's workgroup
    /// `groups · x + g` along x (the head block), so each group computes its own rows over
    /// every step, and the groups share one ring: each row is gathered once for all of them,
    /// each group's producer warps issue every `groups`-th row of a step, and a stage is
    /// refilled once every thread of every group has released it. Nothing meets after the pipeline: each group writes
    /// its own rows. Two independent step chains over the same rows, with no more registers
    /// a thread than one group's (benches/NOTES.md, v38).
    Heads,
}

/// The form of a lowering switch that the environment variable `var` names: `forms[0]` when
/// it is unset or empty, else the form whose `value` it is; any other value is an error
/// naming the variable and listing the values.
pub(crate) fn form_from_env<T: Copy>(
    var: &str,
    forms: &[T],
    value: fn(T) -> &'static str,
) -> crate::Result<Option<T>> {
    match std::env::var(var).as_deref() {
        Err(_) | Ok("") => Ok(None),
        Ok(v) => forms
            .iter()
            .copied()
            .find(|f| value(*f) == v)
            .map(Some)
            .ok_or_else(|| {
                let names: Vec<&str> = forms.iter().map(|f| value(*f)).collect();
                let (last, rest) = names.split_last().expect("at least one form");
                crate::Error::arg(var, format!("{} or {last}", rest.join(", ")), v)
            }),
    }
}

/// How [`Lowering::MmaWs`] holds a split-K accumulator that an online softmax reads.
///
/// v7's kernels and fp8_ds_mla's large-batch kernel hold it in rows
/// (`DecodeConfig::V7_ROW_SOFTMAX`, timed in benches/NOTES.md v35 and v36); bf16's two-group
/// large-batch kernel in fragments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RowSoftmax {
    /// In mma fragments: a row's columns on several warps, its maxima exchanged through
    /// shared memory behind a workgroup barrier.
    #[default]
    Off,
    /// In rows (each row's columns over a few adjacent lanes of the holder warps): the row
    /// maxima need no exchange and no barrier; the outputs' rescale factors go out with P
    /// and are applied after P's barrier (see `lower_mma::rows`).
    Rows,
}

impl RowSoftmax {
    /// The kernel-name suffix: "" or "r".
    pub fn suffix(self) -> &'static str {
        match self {
            RowSoftmax::Off => "",
            RowSoftmax::Rows => "r",
        }
    }

    /// The form's value of `SPARSE_MLA_ROW_SOFTMAX`: "0" or "1".
    pub fn env_value(self) -> &'static str {
        match self {
            RowSoftmax::Off => "0",
            RowSoftmax::Rows => "1",
        }
    }

    /// `SPARSE_MLA_ROW_SOFTMAX`'s value, `0` or `1`; `None` where it is unset or empty (each
    /// kernel then keeps its own form: rows for v7, fragments elsewhere). The lazy running max
    /// (`lazy`, v35) was removed in v43: it timed below the plain row form.
    pub fn from_env() -> crate::Result<Option<Self>> {
        let forms = [RowSoftmax::Off, RowSoftmax::Rows];
        form_from_env("SPARSE_MLA_ROW_SOFTMAX", &forms, Self::env_value)
    }
}

impl Lowering {
    pub fn name(&self) -> &'static str {
        match self {
            Lowering::Scalar => "scalar",
            Lowering::Mma { .. } => "mma",
            Lowering::MmaWs { .. } => "mma-ws",
        }
    }
}

/// Lower a description for a target.
pub fn lower(kernel: &Kernel, lowering: Lowering) -> crate::Result<Kernel> {
    match lowering {
        Lowering::Scalar => lower_scalar::lower(kernel),
        Lowering::Mma {
            stages,
            min_workgroups,
            l2_ahead,
        } => lower_mma::lower(kernel, stages, min_workgroups, l2_ahead),
        Lowering::MmaWs {
            stages,
            groups,
            l2_ahead,
            row_softmax,
            group_by,
        } => lower_mma::lower_ws(kernel, stages, (groups, group_by), l2_ahead, row_softmax),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A switch's variable: unset or empty is none, each form's value is that form,
    /// anything else an error that names the variable and lists the values. (A variable of
    /// its own: the process's environment is shared by every test thread.)
    #[test]
    fn a_switch_reads_its_variable_and_refuses_other_values() {
        let var = "SPARSE_MLA_TEST_KIR_SWITCH";
        let forms = [RowSoftmax::Off, RowSoftmax::Rows];
        std::env::remove_var(var);
        assert_eq!(
            form_from_env(var, &forms, RowSoftmax::env_value).ok(),
            Some(None)
        );
        for (v, want) in [
            ("", None),
            ("0", Some(RowSoftmax::Off)),
            ("1", Some(RowSoftmax::Rows)),
        ] {
            std::env::set_var(var, v);
            assert_eq!(
                form_from_env(var, &forms, RowSoftmax::env_value).ok(),
                Some(want)
            );
        }
        std::env::set_var(var, "lazy");
        let e = form_from_env(var, &forms, RowSoftmax::env_value).expect_err("refused");
        let text = e.to_string();
        assert!(text.contains(var) && text.contains("0 or 1") && text.contains("lazy"));
        std::env::remove_var(var);
    }
}
