//! Composite tile ops: the online-softmax update and the split-K combine, written once from
//! the primitives so that every lowering gets them. This is the place to learn the
//! algorithm; nothing here knows about MLA.
//!
//! Masking uses a finite sentinel instead of −inf ([`MASKED`]): WGSL does not promise IEEE
//! infinities, and a finite sentinel keeps `max`, `exp` and subtraction free of NaN
//! (`MASKED − MASKED = 0`, `exp(MASKED − x) = 0` for any real `x`).

use super::builder::*;
use super::ir::*;

/// The score of a masked (invalid) element, and the running max before any valid element.
pub const MASKED: f32 = -3.0e38;
/// Anything below this is [`MASKED`].
pub const MASKED_BELOW: f32 = -1.0e38;

/// Row state of an online softmax over `rows` rows, in shared memory: what the code around
/// the updates reads and writes (a lowering may hold it elsewhere while a loop of updates
/// runs, as the tensor-core one keeps it in registers).
pub struct SoftmaxState {
    /// Running max of the scores seen so far (`MASKED` before any).
    pub m: Shared,
    /// Running sum of `exp(s − m)`.
    pub l: Shared,
    /// Per-row rescale of the previous accumulators for the current block.
    alpha: Shared,
    /// Row max / row sum of the current block.
    block: Shared,
    rows: u32,
}

impl SoftmaxState {
    /// Declares the state (4 × `rows` f32 of shared memory); initialise with [`Self::init`].
    pub fn declare(b: &mut KernelBuilder, rows: u32) -> Self {
        SoftmaxState {
            m: b.shared("row_max", Ty::F32, rows),
            l: b.shared("row_sum", Ty::F32, rows),
            alpha: b.shared("row_rescale", Ty::F32, rows),
            block: b.shared("block_reduce", Ty::F32, rows),
            rows,
        }
    }

    /// `m = MASKED`, `l = 0`, then a barrier.
    pub fn init(&self, b: &mut KernelBuilder) {
        b.for_threads("r", u(self.rows), |b, r| {
            b.shared_store(&self.m, r.clone(), f(MASKED));
            b.shared_store(&self.l, r, f(0.0));
        });
        b.barrier();
    }
}

/// Is a score masked?
pub fn is_masked(score: Expr) -> Expr {
    score.lt(f(MASKED_BELOW))
}

/// One step of the online softmax over a block of scores `s [rows, n]` (already scaled, masked
/// elements equal to [`MASKED`]):
///
/// ```text
/// m_new  = max(m, rowmax(s))
/// alpha  = exp(m − m_new)            rescale of everything accumulated so far
/// p      = exp(s − m_new)            0 where masked
/// l      = l · alpha + rowsum(p)
/// o_i   *= alpha                     for every accumulator o_i
/// m      = m_new
/// ```
///
/// Leaves `p` in `s` and in the shared tile `p_tile` (the A operand of the next `P · V`).
///
/// One tile op ([`TileOp::OnlineSoftmax`]) whose definition is the code below: the scalar
/// lowering runs exactly that, through the shared row state; the tensor-core lowering keeps
/// the row state in registers instead (`lower_mma`).
pub fn online_softmax_update(
    b: &mut KernelBuilder,
    st: &SoftmaxState,
    s: &Acc,
    outs: &[&Acc],
    p_tile: &STile,
) {
    b.comment("online softmax: new row max, rescale factor, probabilities, row sum");
    b.online_softmax(s, (&st.m, &st.l), outs, p_tile, |b| {
        b.acc_row_reduce(s, Reduce::Max, &st.block);
        b.for_threads("r", u(st.rows), |b, r| {
            let m_old = b.let_("m_old", st.m.at(r.clone()));
            let m_new = b.let_("m_new", m_old.clone().max(st.block.at(r.clone())));
            b.shared_store(&st.alpha, r.clone(), exp(m_old - m_new.clone()));
            b.shared_store(&st.m, r, m_new);
        });
        b.barrier();
        b.acc_for_each(s, |b, e| {
            let m = b.let_("m", st.m.at(e.row.clone()));
            for v in [&e.v0, &e.v1] {
                b.set(
                    v,
                    select(is_masked(v.clone()), f(0.0), exp(v.clone() - m.clone())),
                );
            }
        });
        b.acc_row_reduce(s, Reduce::Sum, &st.block);
        b.for_threads("r", u(st.rows), |b, r| {
            let l = st.l.at(r.clone()) * st.alpha.at(r.clone()) + st.block.at(r.clone());
            b.shared_store(&st.l, r, l);
        });
        b.barrier();
        for o in outs {
            b.acc_for_each(o, |b, e| {
                let a = b.let_("alpha", st.alpha.at(e.row.clone()));
                b.set(&e.v0, e.v0.clone() * a.clone());
                b.set(&e.v1, e.v1.clone() * a);
            });
        }
        b.acc_to_shared(s, p_tile);
    });
}
