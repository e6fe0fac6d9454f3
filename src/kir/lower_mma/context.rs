//! The state of one tensor-core lowering ([`Cx`]): the layout chosen for each shared tile
//! and accumulator, the per-lane values, fresh names, and the declarations it adds.

use super::softmax::SoftmaxRegs;
use super::{groups, ksplit, resident, ws};
use crate::kir::expr::{lt, mul, u};
use crate::kir::ir::*;
use crate::{Error, Result};
use std::collections::{HashMap, HashSet};

#[derive(Clone)]
pub(super) struct TileInfo {
    pub(super) decl: SharedTileDecl,
    /// How elements are stored: the declared element, except that an F32 tile that feeds an
    /// mma is kept as bf16 (see `split`).
    pub(super) store: TileElem,
    /// An f32 mma operand held as two bf16 planes, `hi = bf16(v)` then `lo = bf16(v - hi)`
    /// (`plane_words` apart): about 16 significant bits, so products with it stay close to
    /// f32. Each mma with it is two tensor-core products.
    pub(super) split: bool,
    /// 32-bit words per (padded) row.
    pub(super) stride: u32,
    /// Written by a pipeline's load stage: `stages` copies, addressed by the step's stage.
    pub(super) ringed: bool,
}

impl TileInfo {
    /// Words of one plane of one ring stage.
    pub(super) fn words(&self) -> u32 {
        self.stride * self.decl.rows
    }
    /// Word offset of the `lo` plane of a split tile.
    pub(super) fn plane_words(&self) -> u32 {
        self.words()
    }
}

#[derive(Clone)]
pub(super) struct AccInfo {
    pub(super) decl: AccTileDecl,
    /// Warp grid over the fragment grid: `gm` warps along M, `gn` along N.
    pub(super) gn: u32,
    /// Fragments per warp along M and N.
    pub(super) fmw: u32,
    pub(super) fnw: u32,
    /// Warps that hold fragments (`gm · gn`); the others hold none.
    pub(super) used: u32,
    /// First row / column of this warp's rectangle (u32 variables).
    pub(super) row0: Expr,
    pub(super) col0: Expr,
    /// Column-block index of this warp (`warp % gn`).
    pub(super) wn: Expr,
    /// Fragment pairs `(2j, 2j + 1)` of a warp cover 16 interleaved columns: fragment `2j`
    /// holds the even ones, `2j + 1` the odd ones (the output of a `[K, N]` product with an
    /// e4m3 operand, see `ksplit`).
    pub(super) interleave: bool,
    /// The product into this accumulator is split along K over the warps (see `ksplit`).
    pub(super) ksplit: Option<ksplit::KSplit>,
    /// Held in rows, not fragments (a split-K accumulator whose sum the softmax reads; see
    /// [`RowsForm`]).
    pub(super) rows: Option<super::rows::RowsForm>,
}

impl AccInfo {
    pub(super) fn frags(&self) -> u32 {
        self.fmw * self.fnw
    }

    /// Registers per thread (the length of its private array).
    pub(super) fn elems(&self) -> u32 {
        match &self.rows {
            Some(r) => r.cols,
            None => 4 * self.frags(),
        }
    }
}

/// Per-lane values every warp-level op uses, bound once at the top of the kernel.
pub(super) struct Lane {
    pub(super) warp: Expr,
    /// `local_id % 32`.
    pub(super) lane: Expr,
    /// `lane / 4`: row of the lane's elements within a fragment.
    pub(super) group: Expr,
    /// `lane % 4`: column pair of the lane's elements within a fragment.
    pub(super) quad: Expr,
    /// `lane % 16`: the row this lane addresses for an A fragment (and the k row of a
    /// `[K, N]` B pair).
    pub(super) r16: Expr,
    /// `(lane / 16) · 8`: the column block this lane addresses for an A fragment (and the n
    /// block of a `[K, N]` B pair).
    pub(super) c8: Expr,
    /// `lane % 8 + (lane / 16) · 8`: the n row this lane addresses for an `[N, K]` B pair.
    pub(super) n_nk: Expr,
    /// `lane & 8`: the k column block this lane addresses for an `[N, K]` B pair.
    pub(super) k_nk: Expr,
}

pub(super) struct Cx<'k> {
    pub(super) kernel: &'k Kernel,
    pub(super) w: u32,
    pub(super) warps: u32,
    pub(super) stages: u32,
    pub(super) tiles: HashMap<String, TileInfo>,
    pub(super) accs: HashMap<String, AccInfo>,
    pub(super) used: HashSet<String>,
    pub(super) counter: u32,
    pub(super) new_shared: Vec<SharedDecl>,
    pub(super) new_privates: Vec<PrivateDecl>,
    pub(super) prelude: Vec<Stmt>,
    /// Statements the ring lowering wants issued as early as their names allow (the first
    /// step's index loads): placed by [`super::ws::lower_ws`] right after the last top-level
    /// `let` they read.
    pub(super) hoist: Vec<Stmt>,
    /// A register-resident tile is staged in the ring's last stage (see `layout`), which no
    /// copy fills before the pipeline's first step: the ring's set-up and its first copies
    /// may then be issued ahead of the staging (see `ws`).
    pub(super) staged_late: bool,
    pub(super) lane: Lane,
    pub(super) reduce_scratch: Option<String>,
    /// Shared scratch of the split-K partial sums.
    pub(super) split_scratch: Option<String>,
    /// The ring stage of the step being loaded or computed, inside a pipeline.
    pub(super) stage: Option<Expr>,
    /// Workgroups per multiprocessor the kernel is compiled for (0: no hint).
    pub(super) min_workgroups: u32,
    /// Tiles gathered outside a pipeline whose copies are committed but not yet waited for:
    /// the wait (and barrier) comes just before the first statement that uses them.
    pub(super) pending: Vec<String>,
    /// Shared table through which the warps of an online softmax exchange row values.
    pub(super) softmax_table: Option<String>,
    /// Online-softmax states held in registers across the steps of the pipeline being
    /// lowered, by the name of their row-max array.
    pub(super) resident: HashMap<String, SoftmaxRegs>,
    /// The producer/consumer form ([`super::lower_ws`]): `w` and `warps` count the consumers.
    pub(super) ws: Option<ws::WsInfo>,
    /// Split-K accumulators whose partials hold products not yet summed.
    pub(super) partial_live: HashSet<String>,
    /// Split-K accumulators summed (a workgroup barrier, then the sum) since their last fill.
    pub(super) summed: HashSet<String>,
    /// A operands kept in registers (tile name -> per-op registers).
    pub(super) resident_a: HashMap<String, resident::ResidentA>,
    /// Warp groups of the workgroup (1: none); `w` and `warps` then count one group's.
    pub(super) groups: u32,
    /// What the warp groups split: the steps or the heads ([`crate::kir::GroupBy`]).
    pub(super) group_by: crate::kir::GroupBy,
    /// Steps past the ring's copies whose rows the producers ask L2 for (0: none; see
    /// [`crate::kir::Lowering::MmaWs`]).
    pub(super) l2_ahead: u32,
    /// With warp groups: what [`groups::replicate`] needs.
    pub(super) group: Option<groups::GroupPlan>,
    /// The running scale of the f16 `P · V` products of the pipeline being lowered.
    pub(super) units: Option<super::e4m3::Units>,
    /// Split-K accumulators that an online softmax reads are held in rows ([`RowsForm`]).
    pub(super) row_softmax: crate::kir::RowSoftmax,
}

impl Cx<'_> {
    /// Registers per thread the compiler may use under the occupancy hint.
    pub(super) fn register_budget(&self) -> u32 {
        (65536 / (self.w * self.min_workgroups.max(1))).min(255)
    }

    pub(super) fn err(&self, message: String) -> Error {
        Error::Kir {
            kernel: self.kernel.name.clone(),
            message,
        }
    }

    pub(super) fn fresh(&mut self, base: &str) -> String {
        if self.used.insert(base.to_string()) {
            return base.to_string();
        }
        loop {
            let name = format!("{base}{}", self.counter);
            self.counter += 1;
            if self.used.insert(name.clone()) {
                return name;
            }
        }
    }

    pub(super) fn private(&mut self, base: &str, ty: Ty, len: u32) -> String {
        let name = self.fresh(base);
        self.new_privates.push(PrivateDecl {
            name: name.clone(),
            ty,
            len: len.max(1),
        });
        name
    }

    pub(super) fn tile(&self, name: &str) -> Result<&TileInfo> {
        self.tiles
            .get(name)
            .ok_or_else(|| self.err(format!("no shared tile `{name}`")))
    }

    pub(super) fn acc(&self, name: &str) -> Result<&AccInfo> {
        self.accs
            .get(name)
            .ok_or_else(|| self.err(format!("no accumulator tile `{name}`")))
    }

    /// A register-resident tile staged through shared memory (see `layout`).
    pub(super) fn is_staged(&self, tile: &str) -> bool {
        // (a resident tile's only shared array is its staging window)
        self.resident_a.contains_key(tile) && self.new_shared.iter().any(|d| d.name == tile)
    }

    /// Word offset of the current ring stage of a tile (0 for an ordinary tile).
    pub(super) fn tile_base(&self, t: &TileInfo) -> Result<Expr> {
        if !t.ringed || self.stages == 1 {
            return Ok(u(0));
        }
        match &self.stage {
            Some(s) => Ok(mul(s.clone(), u(t.words()))),
            None => Err(self.err(format!(
                "tile {} is gathered by a pipeline's load stage, so it may only be used inside \
                 that pipeline",
                t.decl.name
            ))),
        }
    }

    /// Wrap warp-level code so that only the warps holding fragments of `acc` run it.
    pub(super) fn for_used_warps(&self, acc: &AccInfo, body: Vec<Stmt>) -> Vec<Stmt> {
        let used = acc.rows.as_ref().map_or(acc.used, |r| r.used);
        if used == self.warps {
            body
        } else {
            vec![Stmt::If {
                cond: lt(self.lane.warp.clone(), u(used)),
                then: body,
                els: vec![],
            }]
        }
    }
}
