//! The CUDA tensor-core lowering of tile ops: the same semantics as [`super::lower_scalar`]
//! (which is the definition to compare with), mapped onto warps and the PTX instructions of
//! the SM120 common set (sm_80 and later): `mma.sync` m16n8k16 bf16 → f32, `ldmatrix`,
//! `cp.async`, `shfl.sync`. No wgmma, tcgen05 or clusters.
//!
//! Layouts chosen here:
//! - **shared tiles**: row-major, each row padded to an odd number of 16-byte chunks, so the 8
//!   rows an `ldmatrix` reads fall in 8 different bank groups (conflict-free). A tile that a
//!   pipeline's load stage gathers into is a ring of `stages` such tiles. An f32 tile that is
//!   an mma operand (e.g. fp8 rows dequantised by a `SharedMap`: e4m3 x an arbitrary f32
//!   scale is not a bf16 value) is stored as two bf16 planes, `hi + lo`, and multiplied
//!   twice, so the product keeps ~16 bits instead of bf16's 8 (scores accurate enough for
//!   the lse tolerance).
//! - **accumulators** `[M, N]` (M a multiple of 16, N of 8) are a grid of m16n8 fragments,
//!   split over a `gm x gn` grid of warps; each warp holds a rectangle of fragments in the
//!   PTX C layout: lane `l` holds rows `l/4` and `l/4 + 8`, columns `2(l%4)`, `2(l%4)+1`
//!   of each fragment, i.e. two element pairs per fragment.
//! - **mma**: the warp owning an accumulator fragment computes it; A fragments through
//!   `ldmatrix.x4`, B through `ldmatrix.x4` (`[N, K]` storage) or `ldmatrix.x4.trans`
//!   (`[K, N]` storage).
//! - **row reductions**: within a thread, then the four lanes of a row (`shfl.xor` 1, 2), then
//!   across the warps of a row through shared memory.
//! - **online softmax**: row state in registers, one exchange of row maxima between the warps
//!   and one barrier per step (see `softmax`).
//! - **gathers**: 16-byte `cp.async.cg` with zero-fill (src-size 0) for rows without a source;
//!   a few consecutive threads per row so each row is read in contiguous runs. Inside a
//!   pipeline the loads of the next `stages - 1` steps are in flight while a step computes.
//!
//! This file drives the lowering (a `Rewrite` pass: which tile op goes where, the waits for
//! gathers in flight); each job has its file: `context` (the lowering's state), `layout`
//! (where tiles and accumulators live), `gather`, `pipeline`, `mma`, `reduce`,
//! `store` (writes into shared tiles), `softmax`, `ksplit` (split-K products),
//! `resident` (A operands in registers), `e4m3` (e4m3 operands), `rows` (a split-K
//! accumulator held in rows), `ws` (the producer/consumer form) and `barriers`.

// the constructors the job files take from here
use super::expr::{
    acc_pair_update, add, bin, exp2_fast, exp_fast, fma, for_const, intr, let_, local_id, lt, mul,
    priv_load, shared_load, u, var,
};
use super::ir::*;
use super::shared_plan;
use super::walk::{rewrite_expr, rewrite_stmts, visit_tile_ops_with, Rewrite};
use crate::{Error, Result};
use barriers::{dedupe_barriers, stmt_mentions};
use context::{AccInfo, Cx, TileInfo};
use layout::{tile_elem, tile_word};

const WARP: u32 = 32;

mod barriers;
mod context;
mod e4m3;
mod gather;
mod groups;
mod ksplit;
mod layout;
mod mma;
mod pipeline;
mod reduce;
mod resident;
mod rows;
mod softmax;
mod store;
mod ws;

pub use ws::lower_ws;

/// Lower every tile op of `kernel` for tensor cores, with `stages` ring buffers per pipelined
/// gather, for `min_workgroups` workgroups per multiprocessor (0: no occupancy hint), asking
/// L2 for the rows `l2_ahead` steps past each step's copies (0: no prefetch).
pub fn lower(kernel: &Kernel, stages: u32, min_workgroups: u32, l2_ahead: u32) -> Result<Kernel> {
    let mut cx = Cx::new(kernel, stages, false, 1, crate::kir::RowSoftmax::Off)?;
    cx.min_workgroups = min_workgroups;
    cx.l2_ahead = l2_ahead;
    let body = cx.stmts(&kernel.body)?;
    let mut out = kernel.clone();
    out.min_workgroups = min_workgroups;
    out.index_terms = true;
    let mut full = std::mem::take(&mut cx.prelude);
    full.extend(body);
    out.body = dedupe_barriers(full);
    out.shared_tiles.clear();
    out.acc_tiles.clear();
    out.shared.extend(cx.new_shared);
    out.privates.extend(cx.new_privates);
    shared_plan::check_fits(&out)?;
    Ok(out)
}

impl Cx<'_> {
    fn stmts(&mut self, stmts: &[Stmt]) -> Result<Vec<Stmt>> {
        rewrite_stmts(self, stmts)
    }

    fn expr(&self, e: &Expr) -> Result<Expr> {
        rewrite_expr(self, e)
    }
}

impl Rewrite for Cx<'_> {
    /// A gather outside a pipeline is waited for just before the first statement that uses
    /// its tile.
    fn before_stmt(&mut self, s: &Stmt, out: &mut Vec<Stmt>) {
        if !self.pending.is_empty() && stmt_mentions(s, &self.pending) {
            out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
            out.push(Stmt::Barrier);
            self.pending.clear();
        }
    }

    fn tile_op(&mut self, op: &TileOp, out: &mut Vec<Stmt>) -> Result<()> {
        match op {
            TileOp::AccFill { acc, value } => {
                self.partial_live.remove(acc);
                self.summed.remove(acc);
                let len = self.acc(acc)?.elems();
                let i = self.fresh("fill_i");
                out.push(for_const(
                    &i,
                    len,
                    vec![Stmt::PrivateStore {
                        arr: acc.clone(),
                        index: var(&i, Ty::U32),
                        value: Expr::F32(*value),
                    }],
                ));
            }
            TileOp::GatherRows(g) => {
                let dst = &g.dst;
                if self.resident_a.contains_key(dst) {
                    // (resident candidates are whole-row gathers without flags: `resident`)
                    if g.flags.is_some() {
                        return Err(self.err(format!("{dst}: a resident tile's gather has flags")));
                    }
                    if self.is_staged(dst) {
                        // the whole tile into its staging rows (16-byte copies, missing rows
                        // zero-filled), then each warp's fragments from there
                        out.push(Stmt::Barrier);
                        self.gather(g, out)?;
                        out.push(intr(Intrinsic::CpAsyncCommit));
                        out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
                        out.push(Stmt::Barrier);
                    }
                    let loads = self.resident_gather(g)?;
                    out.extend(loads);
                    return Ok(());
                }
                // Barrier: earlier readers of the tile (write-after-read). The wait comes
                // when something first uses the tile, so other work overlaps the copies.
                out.push(Stmt::Barrier);
                self.gather(g, out)?;
                out.push(intr(Intrinsic::CpAsyncCommit));
                if self.stage.is_some() {
                    out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
                    out.push(Stmt::Barrier);
                } else {
                    self.pending.push(dst.clone());
                }
            }
            TileOp::Mma {
                acc,
                a,
                b,
                b_layout,
            } => self.mma(acc, a, b, *b_layout, None, out)?,
            TileOp::MmaScaled {
                acc,
                a,
                b,
                b_layout,
                row,
                scale,
            } => self.mma(
                acc,
                a,
                b,
                *b_layout,
                Some((row.clone(), scale.clone())),
                out,
            )?,
            TileOp::AccForEach {
                acc,
                row,
                col,
                v0,
                v1,
                body,
            } => {
                self.materialize(acc, out)?;
                let body = self.stmts(body)?;
                let acc_name = acc.clone();
                let (v0, v1) = (v0.clone(), v1.clone());
                let s = self.for_each_pair(acc, row, col, |_, at, at1| {
                    Ok(acc_pair_update(&acc_name, (&v0, &v1), at, at1, body))
                })?;
                out.extend(s);
            }
            TileOp::AccRowReduce { acc, op, dst } => {
                self.materialize(acc, out)?;
                self.row_reduce(acc, *op, dst, out)?
            }
            TileOp::AccToShared { acc, dst } => {
                self.materialize(acc, out)?;
                let stores = self.acc_to_shared_stores(acc, dst)?;
                out.push(Stmt::Barrier);
                out.extend(stores);
                out.push(Stmt::Barrier);
            }
            TileOp::OnlineSoftmax {
                s,
                m,
                l,
                outs,
                p_tile,
                ..
            } => {
                self.materialize(s, out)?;
                // S's split-K sum, since its last fill, ended in a workgroup barrier
                let after_barrier = self.summed.remove(s);
                for o in outs {
                    self.materialize(o, out)?;
                }
                self.online_softmax(s, (m, l), outs, p_tile, after_barrier, out)?
            }
            TileOp::SharedMap {
                dst,
                row,
                col,
                col0,
                cols,
                value,
            } => self.shared_map(dst, row, col, (*col0, *cols), value, out)?,
            TileOp::DequantRows {
                dst,
                src,
                row,
                group,
                per,
                scale,
            } => self.dequant_rows((dst, src), (row, group, *per), scale, out)?,
            TileOp::Pipeline {
                var: v,
                count,
                bound,
                load,
                compute,
            } => {
                self.units_begin(compute, out)?;
                if self.ws.is_some() {
                    // the q gather (cp.async) is waited for before the loop
                    if !self.pending.is_empty() {
                        out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
                        out.push(Stmt::Barrier);
                        self.pending.clear();
                    }
                    // (the f16 products' running scale is resolved inside, before the
                    // warp groups merge their accumulators)
                    return self.consumer_loop(v, (count, bound.as_ref()), load, compute, out);
                }
                // Tiles still in flight are older than the ring's groups, so the first
                // step's wait covers them; after the loop (which may not run) wait for all.
                let in_flight = !self.pending.is_empty();
                self.pending.clear();
                self.pipeline(v, count, load, compute, out)?;
                self.units_end(out)?;
                if in_flight {
                    out.push(Stmt::Barrier);
                }
            }
        }
        Ok(())
    }

    /// Replace tile element loads by shared-array loads in this lowering's layout.
    fn tile_read(&self, read: Expr) -> Result<Expr> {
        Ok(match read {
            Expr::TileLoad { tile, row, col, .. } => {
                let info = self.tile(&tile)?;
                tile_elem(info, self.tile_base(info)?, *row, *col)
            }
            Expr::TileWord { tile, row, word } => {
                let info = self.tile(&tile)?;
                tile_word(info, self.tile_base(info)?, *row, *word)
            }
            other => other,
        })
    }
}
