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
//!   and one barrier per step (see [`softmax`]).
//! - **gathers**: 16-byte `cp.async.cg` with zero-fill (src-size 0) for rows without a source;
//!   a few consecutive threads per row so each row is read in contiguous runs. Inside a
//!   pipeline the loads of the next `stages - 1` steps are in flight while a step computes.

use super::ir::*;
use super::lower_scalar::{collect_names, visit_tile_ops_with};
use crate::{Error, Result};
use softmax::SoftmaxRegs;
use std::collections::{HashMap, HashSet};

/// Shared memory per block on SM120 (RTX PRO 6000, RTX 5090): 99 KB. Every kernel this
/// lowering produces must fit it, whatever GPU it is compiled for.
pub const MAX_SHARED_BYTES: u64 = 101_376;

const WARP: u32 = 32;

mod ksplit;
mod softmax;
mod ws;

pub use ws::lower_ws;

/// Byte offsets of each shared array (16-byte aligned, in declaration order) and the total.
pub fn shared_layout(shared: &[SharedDecl]) -> (Vec<u64>, u64) {
    let mut offsets = Vec::with_capacity(shared.len());
    let mut at = 0u64;
    for s in shared {
        offsets.push(at);
        at += (s.len as u64 * 4).div_ceil(16) * 16;
    }
    (offsets, at)
}

/// Lower every tile op of `kernel` for tensor cores, with `stages` ring buffers per pipelined
/// gather, for `min_workgroups` workgroups per multiprocessor (0: no occupancy hint).
pub fn lower(kernel: &Kernel, stages: u32, min_workgroups: u32) -> Result<Kernel> {
    let mut cx = Cx::new(kernel, stages, false)?;
    cx.min_workgroups = min_workgroups;
    let body = cx.stmts(&kernel.body)?;
    let mut out = kernel.clone();
    out.min_workgroups = min_workgroups;
    let mut full = std::mem::take(&mut cx.prelude);
    full.extend(body);
    out.body = dedupe_barriers(full);
    out.shared_tiles.clear();
    out.acc_tiles.clear();
    out.shared.extend(cx.new_shared);
    out.privates.extend(cx.new_privates);
    let (_, bytes) = shared_layout(&out.shared);
    if bytes > MAX_SHARED_BYTES {
        return Err(Error::ResourceLimit {
            kernel: kernel.name.clone(),
            resource: "shared memory per block (SM120 limit, bytes)".into(),
            needed: bytes,
            limit: MAX_SHARED_BYTES,
        });
    }
    Ok(out)
}

#[derive(Clone)]
struct TileInfo {
    decl: SharedTileDecl,
    /// How elements are stored: the declared element, except that an F32 tile that feeds an
    /// mma is kept as bf16 (see `split`).
    store: TileElem,
    /// An f32 mma operand held as two bf16 planes, `hi = bf16(v)` then `lo = bf16(v - hi)`
    /// (`plane_words` apart): about 16 significant bits, so products with it stay close to
    /// f32. Each mma with it is two tensor-core products.
    split: bool,
    /// 32-bit words per (padded) row.
    stride: u32,
    /// Written by a pipeline's load stage: `stages` copies, addressed by the step's stage.
    ringed: bool,
}

impl TileInfo {
    /// Words of one plane of one ring stage.
    fn words(&self) -> u32 {
        self.stride * self.decl.rows
    }
    /// Word offset of the `lo` plane of a split tile.
    fn plane_words(&self) -> u32 {
        self.words()
    }
}

struct GatherPlan {
    rows: u32,
    tpr: u32,
    rows_per_pass: u32,
    passes: u32,
}

#[derive(Clone)]
struct AccInfo {
    decl: AccTileDecl,
    /// Warp grid over the fragment grid: `gm` warps along M, `gn` along N.
    gn: u32,
    /// Fragments per warp along M and N.
    fmw: u32,
    fnw: u32,
    /// Warps that hold fragments (`gm · gn`); the others hold none.
    used: u32,
    /// First row / column of this warp's rectangle (u32 variables).
    row0: Expr,
    col0: Expr,
    /// Column-block index of this warp (`warp % gn`).
    wn: Expr,
    /// Fragment pairs `(2j, 2j + 1)` of a warp cover 16 interleaved columns: fragment `2j`
    /// holds the even ones, `2j + 1` the odd ones (the output of a `[K, N]` product with an
    /// e4m3 operand, see `ksplit`).
    interleave: bool,
    /// The product into this accumulator is split along K over the warps (see `ksplit`).
    ksplit: Option<ksplit::KSplit>,
}

impl AccInfo {
    fn frags(&self) -> u32 {
        self.fmw * self.fnw
    }
}

/// Per-lane values every warp-level op uses, bound once at the top of the kernel.
struct Lane {
    warp: Expr,
    /// `local_id % 32`.
    lane: Expr,
    /// `lane / 4`: row of the lane's elements within a fragment.
    group: Expr,
    /// `lane % 4`: column pair of the lane's elements within a fragment.
    quad: Expr,
    /// `lane % 16`: the row this lane addresses for an A fragment (and the k row of a
    /// `[K, N]` B pair).
    r16: Expr,
    /// `(lane / 16) · 8`: the column block this lane addresses for an A fragment (and the n
    /// block of a `[K, N]` B pair).
    c8: Expr,
    /// `lane % 8 + (lane / 16) · 8`: the n row this lane addresses for an `[N, K]` B pair.
    n_nk: Expr,
    /// `lane & 8`: the k column block this lane addresses for an `[N, K]` B pair.
    k_nk: Expr,
}

struct Cx<'k> {
    kernel: &'k Kernel,
    w: u32,
    warps: u32,
    stages: u32,
    tiles: HashMap<String, TileInfo>,
    accs: HashMap<String, AccInfo>,
    used: HashSet<String>,
    counter: u32,
    new_shared: Vec<SharedDecl>,
    new_privates: Vec<PrivateDecl>,
    prelude: Vec<Stmt>,
    lane: Lane,
    reduce_scratch: Option<String>,
    /// Shared scratch of the split-K partial sums.
    split_scratch: Option<String>,
    /// The ring stage of the step being loaded or computed, inside a pipeline.
    stage: Option<Expr>,
    /// Workgroups per multiprocessor the kernel is compiled for (0: no hint).
    min_workgroups: u32,
    /// Tiles gathered outside a pipeline whose copies are committed but not yet waited for:
    /// the wait (and barrier) comes just before the first statement that uses them.
    pending: Vec<String>,
    /// Shared table through which the warps of an online softmax exchange row values.
    softmax_table: Option<String>,
    /// Online-softmax states held in registers across the steps of the pipeline being
    /// lowered, by the name of their row-max array.
    resident: HashMap<String, SoftmaxRegs>,
    /// The producer/consumer form ([`lower_ws`]): `w` and `warps` count the consumers.
    ws: Option<ws::WsInfo>,
    /// Split-K accumulators whose partials hold products not yet summed.
    partial_live: HashSet<String>,
    /// A operands kept in registers (tile name -> per-op registers).
    resident_a: HashMap<String, ksplit::ResidentA>,
}

fn var(name: &str, ty: Ty) -> Expr {
    Expr::Var(name.to_string(), ty)
}
fn u(v: u32) -> Expr {
    Expr::U32(v)
}
fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
    Expr::Bin(op, Box::new(a), Box::new(b))
}
/// `a + b`, folding zeros so generated addresses stay readable.
fn add(a: Expr, b: Expr) -> Expr {
    match (&a, &b) {
        (_, Expr::U32(0)) => a,
        (Expr::U32(0), _) => b,
        (Expr::U32(x), Expr::U32(y)) => u(x + y),
        _ => bin(BinOp::Add, a, b),
    }
}
/// `a · b`, folding ones and zeros.
fn mul(a: Expr, b: Expr) -> Expr {
    match (&a, &b) {
        (_, Expr::U32(1)) => a,
        (Expr::U32(1), _) => b,
        (_, Expr::U32(0)) | (Expr::U32(0), _) => u(0),
        (Expr::U32(x), Expr::U32(y)) => u(x * y),
        _ => bin(BinOp::Mul, a, b),
    }
}
fn lt(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Lt, a, b)
}
fn local_id() -> Expr {
    Expr::Builtin(Builtin::LocalId)
}
fn shared_load(arr: &str, ty: Ty, index: Expr) -> Expr {
    Expr::SharedLoad {
        arr: arr.into(),
        ty,
        index: Box::new(index),
    }
}
fn priv_load(arr: &str, index: Expr) -> Expr {
    Expr::PrivateLoad {
        arr: arr.into(),
        ty: Ty::F32,
        index: Box::new(index),
    }
}
fn bits_to_f32(bits: Expr) -> Expr {
    Expr::Call(Func::F32FromBits, vec![bits])
}
fn let_(name: &str, value: Expr) -> Stmt {
    Stmt::Let {
        name: name.into(),
        value,
    }
}
fn for_const(var: &str, end: u32, body: Vec<Stmt>) -> Stmt {
    Stmt::For {
        var: var.into(),
        start: u(0),
        end: u(end),
        step: u(1),
        body,
    }
}
fn intr(i: Intrinsic) -> Stmt {
    Stmt::Intrinsic(i)
}
fn floor_pow2(x: u32) -> u32 {
    if x == 0 {
        0
    } else {
        1 << (31 - x.leading_zeros())
    }
}

/// Padded row stride in words: whole 16-byte chunks, an odd number of them.
fn padded_stride(row_bytes: u32) -> u32 {
    let chunks = row_bytes.div_ceil(16);
    let chunks = if chunks % 2 == 0 { chunks + 1 } else { chunks };
    chunks * 4
}

/// The warp grid for an `[m, n]` accumulator: as many warps busy as the fragment grid
/// allows, then the fewest shared-memory bytes per k step (A is re-read by each warp along
/// N, B by each warp along M).
fn warp_grid(fm: u32, fn_: u32, warps: u32) -> (u32, u32) {
    let mut best = (1, 1);
    let mut best_key = (0u32, u64::MAX);
    for gm in (1..=fm).filter(|g| fm % g == 0) {
        for gn in (1..=fn_).filter(|g| fn_ % g == 0) {
            if gm * gn > warps {
                continue;
            }
            let bytes = gn as u64 * fm as u64 * 512 + gm as u64 * fn_ as u64 * 256;
            let key = (gm * gn, bytes);
            if key.0 > best_key.0 || (key.0 == best_key.0 && key.1 < best_key.1) {
                best = (gm, gn);
                best_key = key;
            }
        }
    }
    best
}

impl<'k> Cx<'k> {
    fn new(kernel: &'k Kernel, stages: u32, ws_mode: bool) -> Result<Self> {
        let err = |message: String| Error::Kir {
            kernel: kernel.name.clone(),
            message,
        };
        let w = kernel.workgroup_size;
        if w == 0 || w % WARP != 0 {
            return Err(err(format!(
                "the mma lowering needs whole warps: workgroup size {w} is not a multiple of 32"
            )));
        }
        if stages == 0 {
            return Err(err(
                "the mma lowering needs at least 1 pipeline stage".into()
            ));
        }
        let mut used = HashSet::new();
        collect_names(&kernel.body, &mut used);
        for n in kernel
            .params
            .iter()
            .map(|p| &p.name)
            .chain(kernel.buffers.iter().map(|b| &b.name))
            .chain(kernel.shared.iter().map(|s| &s.name))
            .chain(kernel.privates.iter().map(|s| &s.name))
            .chain(kernel.shared_tiles.iter().map(|s| &s.name))
            .chain(kernel.acc_tiles.iter().map(|s| &s.name))
        {
            used.insert(n.clone());
        }
        let placeholder = || u(0);
        let mut cx = Cx {
            kernel,
            w,
            warps: w / WARP,
            stages,
            tiles: HashMap::new(),
            accs: HashMap::new(),
            used,
            counter: 0,
            new_shared: Vec::new(),
            new_privates: Vec::new(),
            prelude: Vec::new(),
            lane: Lane {
                warp: placeholder(),
                lane: placeholder(),
                group: placeholder(),
                quad: placeholder(),
                r16: placeholder(),
                c8: placeholder(),
                n_nk: placeholder(),
                k_nk: placeholder(),
            },
            reduce_scratch: None,
            split_scratch: None,
            stage: None,
            min_workgroups: 0,
            pending: Vec::new(),
            softmax_table: None,
            resident: HashMap::new(),
            ws: None,
            partial_live: HashSet::new(),
            resident_a: HashMap::new(),
        };
        cx.bind_lane();
        if ws_mode {
            cx.ws = Some(ws::WsInfo::plan(&mut cx)?);
        }

        // Tiles a pipeline's load stage writes become rings.
        let mut ringed = HashSet::new();
        visit_tile_ops_with(&kernel.body, false, &mut |op| {
            if let TileOp::Pipeline { load, .. } = op {
                visit_tile_ops_with(load, false, &mut |inner| {
                    if let TileOp::GatherRows { dst, flags, .. } = inner {
                        ringed.insert(dst.clone());
                        if let Some(f) = flags {
                            ringed.insert(f.clone());
                        }
                    }
                });
            }
        });
        // F32 tiles that are mma operands, and tiles anything gathers raw words into.
        let (mut operands, mut gathered) = (HashSet::new(), HashSet::new());
        visit_tile_ops_with(&kernel.body, false, &mut |op| match op {
            TileOp::Mma { a, b, .. } | TileOp::MmaScaled { a, b, .. } => {
                operands.insert(a.tile.clone());
                operands.insert(b.tile.clone());
            }
            TileOp::GatherRows { dst, .. } => {
                gathered.insert(dst.clone());
            }
            _ => {}
        });
        let resident_tiles = ksplit::resident_candidates(&cx);
        for t in &kernel.shared_tiles {
            if resident_tiles.contains(&t.name) {
                // in registers (loaded from global memory by `ksplit`), no shared memory
                let store = t.elem;
                let row_bytes = t.cols * store.bytes();
                cx.tiles.insert(
                    t.name.clone(),
                    TileInfo {
                        decl: t.clone(),
                        store,
                        split: false,
                        stride: padded_stride(row_bytes),
                        ringed: false,
                    },
                );
                continue;
            }
            let narrow = t.elem == TileElem::F32 && operands.contains(&t.name);
            if narrow && gathered.contains(&t.name) {
                return Err(cx.err(format!(
                    "tile {} is f32, an mma operand and gathered into: the mma lowering keeps \
                     f32 operand tiles in bf16, so it cannot take raw f32 words; gather bf16 \
                     rows or convert them with a shared_map first",
                    t.name
                )));
            }
            let store = if narrow { TileElem::Bf16 } else { t.elem };
            let row_bytes = t.cols * store.bytes();
            if row_bytes % 4 != 0 {
                return Err(cx.err(format!("tile {} rows are not whole words", t.name)));
            }
            let info = TileInfo {
                decl: t.clone(),
                store,
                split: narrow,
                stride: padded_stride(row_bytes),
                ringed: ringed.contains(&t.name),
            };
            let copies = if info.ringed { stages } else { 1 } * if narrow { 2 } else { 1 };
            cx.new_shared.push(SharedDecl {
                name: t.name.clone(),
                ty: if store == TileElem::F32 {
                    Ty::F32
                } else {
                    Ty::U32
                },
                len: info.words() * copies,
            });
            cx.tiles.insert(t.name.clone(), info);
        }
        for a in &kernel.acc_tiles {
            if a.rows % 16 != 0 || a.cols % 8 != 0 {
                return Err(cx.err(format!(
                    "accumulator {} is [{}x{}]: the mma lowering needs rows a multiple of 16 \
                     and columns of 8 (m16n8 fragments)",
                    a.name, a.rows, a.cols
                )));
            }
            let (fm, fn_) = (a.rows / 16, a.cols / 8);
            let split = ksplit::plan_for(&cx, a);
            // A split-K accumulator is summed into its holders, which then run the softmax
            // on it: spread over up to half the warps (v7 put whole rows on one warp, and the
            // other seven waited at the next barrier for its serial sum, mask, row max and
            // exp: 62 % of the step's stall samples, ncu on the H200). The other half — the
            // producer warp among them — issues the next rows meanwhile (see `ws`).
            let (gm, gn) = if split.is_some() {
                warp_grid(fm, fn_, (cx.warps / 2).max(1))
            } else {
                warp_grid(fm, fn_, cx.warps)
            };
            let (fmw, fnw) = (fm / gm, fn_ / gn);
            let interleave = ksplit::interleaved(&cx, &a.name);
            if interleave && fnw % 2 != 0 {
                return Err(cx.err(format!(
                    "accumulator {} is the output of an e4m3 [K, N] product: each warp needs an \
                     even number of its n fragments, got {fnw}",
                    a.name
                )));
            }
            let wn = cx.fresh(&format!("{}_wn", a.name));
            let row0 = cx.fresh(&format!("{}_row0", a.name));
            let col0 = cx.fresh(&format!("{}_col0", a.name));
            let warp = cx.lane.warp.clone();
            cx.prelude
                .push(let_(&wn, bin(BinOp::Rem, warp.clone(), u(gn))));
            cx.prelude
                .push(let_(&row0, mul(bin(BinOp::Div, warp, u(gn)), u(fmw * 16))));
            cx.prelude
                .push(let_(&col0, mul(var(&wn, Ty::U32), u(fnw * 8))));
            let info = AccInfo {
                decl: a.clone(),
                gn,
                fmw,
                fnw,
                used: gm * gn,
                row0: var(&row0, Ty::U32),
                col0: var(&col0, Ty::U32),
                wn: var(&wn, Ty::U32),
                interleave,
                ksplit: split,
            };
            cx.new_privates.push(PrivateDecl {
                name: a.name.clone(),
                ty: Ty::F32,
                len: 4 * info.frags(),
            });
            cx.accs.insert(a.name.clone(), info);
        }
        let mut reduce_len = 0;
        visit_tile_ops_with(&kernel.body, false, &mut |op| {
            if let TileOp::AccRowReduce { acc, .. } = op {
                if let Some(a) = cx.accs.get(acc) {
                    reduce_len = reduce_len.max(a.gn * a.decl.rows);
                }
            }
        });
        if reduce_len > 0 {
            let name = cx.fresh("reduce_scratch");
            cx.new_shared.push(SharedDecl {
                name: name.clone(),
                ty: Ty::F32,
                len: reduce_len,
            });
            cx.reduce_scratch = Some(name);
        }
        cx.declare_softmax_table()?;
        ksplit::declare(&mut cx)?;
        Ok(cx)
    }

    fn bind_lane(&mut self) {
        let bind = |cx: &mut Self, base: &str, value: Expr| {
            let n = cx.fresh(base);
            cx.prelude.push(let_(&n, value));
            var(&n, Ty::U32)
        };
        self.prelude.push(Stmt::Comment(
            "warp and lane of this thread (tensor-core lowering)".into(),
        ));
        let warp = bind(self, "warp", bin(BinOp::Div, local_id(), u(WARP)));
        let lane = bind(self, "lane", bin(BinOp::Rem, local_id(), u(WARP)));
        let group = bind(self, "lane_group", bin(BinOp::Shr, lane.clone(), u(2)));
        let quad = bind(self, "lane_quad", bin(BinOp::BitAnd, lane.clone(), u(3)));
        let r16 = bind(self, "lane_r16", bin(BinOp::BitAnd, lane.clone(), u(15)));
        let c8 = bind(
            self,
            "lane_c8",
            bin(BinOp::Shl, bin(BinOp::Shr, lane.clone(), u(4)), u(3)),
        );
        let n_nk = bind(
            self,
            "lane_n8",
            bin(
                BinOp::BitOr,
                bin(BinOp::BitAnd, lane.clone(), u(7)),
                c8.clone(),
            ),
        );
        let k_nk = bind(self, "lane_k8", bin(BinOp::BitAnd, lane.clone(), u(8)));
        self.lane = Lane {
            warp,
            lane,
            group,
            quad,
            r16,
            c8,
            n_nk,
            k_nk,
        };
    }

    /// Registers per thread the compiler may use under the occupancy hint.
    fn register_budget(&self) -> u32 {
        (65536 / (self.w * self.min_workgroups.max(1))).min(255)
    }

    fn err(&self, message: String) -> Error {
        Error::Kir {
            kernel: self.kernel.name.clone(),
            message,
        }
    }

    fn fresh(&mut self, base: &str) -> String {
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

    fn private(&mut self, base: &str, ty: Ty, len: u32) -> String {
        let name = self.fresh(base);
        self.new_privates.push(PrivateDecl {
            name: name.clone(),
            ty,
            len: len.max(1),
        });
        name
    }

    fn tile(&self, name: &str) -> Result<&TileInfo> {
        self.tiles
            .get(name)
            .ok_or_else(|| self.err(format!("no shared tile `{name}`")))
    }

    fn acc(&self, name: &str) -> Result<&AccInfo> {
        self.accs
            .get(name)
            .ok_or_else(|| self.err(format!("no accumulator tile `{name}`")))
    }

    /// Word offset of the current ring stage of a tile (0 for an ordinary tile).
    fn tile_base(&self, t: &TileInfo) -> Result<Expr> {
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
    fn for_used_warps(&self, acc: &AccInfo, body: Vec<Stmt>) -> Vec<Stmt> {
        if acc.used == self.warps {
            body
        } else {
            vec![Stmt::If {
                cond: lt(self.lane.warp.clone(), u(acc.used)),
                then: body,
                els: vec![],
            }]
        }
    }

    fn stmts(&mut self, stmts: &[Stmt]) -> Result<Vec<Stmt>> {
        let mut out = Vec::new();
        for s in stmts {
            self.stmt(s, &mut out)?;
        }
        Ok(out)
    }

    fn stmt(&mut self, s: &Stmt, out: &mut Vec<Stmt>) -> Result<()> {
        if !self.pending.is_empty() && stmt_mentions(s, &self.pending) {
            out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
            out.push(Stmt::Barrier);
            self.pending.clear();
        }
        match s {
            Stmt::Tile(op) => self.tile_op(op, out)?,
            Stmt::If { cond, then, els } => out.push(Stmt::If {
                cond: self.expr(cond)?,
                then: self.stmts(then)?,
                els: self.stmts(els)?,
            }),
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => out.push(Stmt::For {
                var: var.clone(),
                start: self.expr(start)?,
                end: self.expr(end)?,
                step: self.expr(step)?,
                body: self.stmts(body)?,
            }),
            Stmt::Let { name, value } => out.push(Stmt::Let {
                name: name.clone(),
                value: self.expr(value)?,
            }),
            Stmt::Var { name, value } => out.push(Stmt::Var {
                name: name.clone(),
                value: self.expr(value)?,
            }),
            Stmt::Assign { name, value } => out.push(Stmt::Assign {
                name: name.clone(),
                value: self.expr(value)?,
            }),
            Stmt::Store { buf, index, value } => out.push(Stmt::Store {
                buf: buf.clone(),
                index: self.expr(index)?,
                value: self.expr(value)?,
            }),
            Stmt::StoreWord { buf, index, value } => out.push(Stmt::StoreWord {
                buf: buf.clone(),
                index: self.expr(index)?,
                value: self.expr(value)?,
            }),
            Stmt::SharedStore { arr, index, value } => out.push(Stmt::SharedStore {
                arr: arr.clone(),
                index: self.expr(index)?,
                value: self.expr(value)?,
            }),
            Stmt::PrivateStore { arr, index, value } => out.push(Stmt::PrivateStore {
                arr: arr.clone(),
                index: self.expr(index)?,
                value: self.expr(value)?,
            }),
            Stmt::Comment(_) | Stmt::Barrier | Stmt::Intrinsic(_) => out.push(s.clone()),
        }
        Ok(())
    }

    /// Replace tile element loads by shared-array loads in this lowering's layout.
    fn expr(&self, e: &Expr) -> Result<Expr> {
        let mut failure = None;
        let lowered = e.clone().map(&mut |x| match x {
            Expr::TileLoad { tile, row, col, .. } => {
                match self.tile(&tile).and_then(|t| Ok((t, self.tile_base(t)?))) {
                    Ok((info, base)) => tile_elem(info, base, *row, *col),
                    Err(err) => {
                        failure = Some(err);
                        Expr::F32(0.0)
                    }
                }
            }
            Expr::TileWord { tile, row, word } => {
                match self.tile(&tile).and_then(|t| Ok((t, self.tile_base(t)?))) {
                    Ok((info, base)) => tile_word(info, base, *row, *word),
                    Err(err) => {
                        failure = Some(err);
                        Expr::U32(0)
                    }
                }
            }
            other => other,
        });
        match failure {
            Some(err) => Err(err),
            None => Ok(lowered),
        }
    }

    /// For each element pair this thread holds of `acc`: `body(private index of the first,
    /// of the second)`, with `row`, `col` bound. Pairs are (c0, c1) and (c2, c3) of each
    /// fragment; in an interleaved accumulator (see `ksplit`), value `e` of fragments `2j` and
    /// `2j + 1`.
    fn for_each_pair(
        &mut self,
        acc: &str,
        row: &str,
        col: &str,
        body: impl FnOnce(&mut Self, Expr, Expr) -> Result<Vec<Stmt>>,
    ) -> Result<Vec<Stmt>> {
        let info = self.acc(acc)?.clone();
        let (f, h) = (self.fresh("frag"), self.fresh("half"));
        let (fv, hv) = (var(&f, Ty::U32), var(&h, Ty::U32));
        if info.interleave {
            let e = self.fresh("e");
            let ev = var(&e, Ty::U32);
            let half_n = info.fnw / 2;
            // fragment pair `f`: fragments (f / half_n) * fnw + 2 (f % half_n) and the next
            let fa = add(
                mul(bin(BinOp::Div, fv.clone(), u(half_n)), u(info.fnw)),
                mul(bin(BinOp::Rem, fv.clone(), u(half_n)), u(2)),
            );
            let v = add(mul(hv.clone(), u(2)), ev.clone());
            let at0 = add(mul(fa.clone(), u(4)), v.clone());
            let at1 = add(mul(add(fa, u(1)), u(4)), v);
            let mut inner = vec![
                let_(
                    row,
                    add(
                        add(
                            info.row0.clone(),
                            mul(bin(BinOp::Div, fv.clone(), u(half_n)), u(16)),
                        ),
                        add(mul(hv, u(8)), self.lane.group.clone()),
                    ),
                ),
                let_(
                    col,
                    add(
                        add(
                            info.col0.clone(),
                            mul(bin(BinOp::Rem, fv, u(half_n)), u(16)),
                        ),
                        add(mul(self.lane.quad.clone(), u(4)), mul(ev, u(2))),
                    ),
                ),
            ];
            inner.extend(body(self, at0, at1)?);
            let lp = for_const(
                &f,
                info.frags() / 2,
                vec![for_const(&h, 2, vec![for_const(&e, 2, inner)])],
            );
            return Ok(self.for_used_warps(&info, vec![lp]));
        }
        let at = add(mul(fv.clone(), u(4)), mul(hv.clone(), u(2)));
        let mut inner = vec![
            let_(
                row,
                add(
                    add(
                        info.row0.clone(),
                        mul(bin(BinOp::Div, fv.clone(), u(info.fnw)), u(16)),
                    ),
                    add(mul(hv, u(8)), self.lane.group.clone()),
                ),
            ),
            let_(
                col,
                add(
                    add(
                        info.col0.clone(),
                        mul(bin(BinOp::Rem, fv, u(info.fnw)), u(8)),
                    ),
                    mul(self.lane.quad.clone(), u(2)),
                ),
            ),
        ];
        let at1 = add(at.clone(), u(1));
        inner.extend(body(self, at, at1)?);
        let lp = for_const(&f, info.frags(), vec![for_const(&h, 2, inner)]);
        Ok(self.for_used_warps(&info, vec![lp]))
    }

    fn tile_op(&mut self, op: &TileOp, out: &mut Vec<Stmt>) -> Result<()> {
        match op {
            TileOp::AccFill { acc, value } => {
                self.partial_live.remove(acc);
                let len = 4 * self.acc(acc)?.frags();
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
            TileOp::GatherRows {
                dst,
                dst_word0,
                words,
                src,
                row,
                src_word,
                flags,
            } => {
                if self.resident_a.contains_key(dst) {
                    let loads = self.resident_gather(dst, src, row, src_word)?;
                    out.extend(loads);
                    return Ok(());
                }
                // Barrier: earlier readers of the tile (write-after-read). The wait comes
                // when something first uses the tile, so other work overlaps the copies.
                out.push(Stmt::Barrier);
                self.gather(
                    dst,
                    *dst_word0,
                    *words,
                    src,
                    row,
                    src_word,
                    flags.as_deref(),
                    out,
                )?;
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
                    let mut s = vec![
                        Stmt::Var {
                            name: v0.clone(),
                            value: priv_load(&acc_name, at.clone()),
                        },
                        Stmt::Var {
                            name: v1.clone(),
                            value: priv_load(&acc_name, at1.clone()),
                        },
                    ];
                    s.extend(body);
                    s.push(Stmt::PrivateStore {
                        arr: acc_name.clone(),
                        index: at,
                        value: var(&v0, Ty::F32),
                    });
                    s.push(Stmt::PrivateStore {
                        arr: acc_name.clone(),
                        index: at1,
                        value: var(&v1, Ty::F32),
                    });
                    Ok(s)
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
                for o in outs {
                    self.materialize(o, out)?;
                }
                self.online_softmax(s, (m, l), outs, p_tile, out)?
            }
            TileOp::SharedMap {
                dst,
                row,
                col,
                col0,
                cols,
                value,
            } => self.shared_map(dst, row, col, (*col0, *cols), value, out)?,
            TileOp::Pipeline {
                var: v,
                count,
                load,
                compute,
            } => {
                if self.ws.is_some() {
                    // the q gather (cp.async) is waited for before the loop
                    if !self.pending.is_empty() {
                        out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
                        out.push(Stmt::Barrier);
                        self.pending.clear();
                    }
                    return self.consumer_loop(v, count, load, compute, out);
                }
                // Tiles still in flight are older than the ring's groups, so the first
                // step's wait covers them; after the loop (which may not run) wait for all.
                let in_flight = !self.pending.is_empty();
                self.pending.clear();
                self.pipeline(v, count, load, compute, out)?;
                if in_flight {
                    out.push(Stmt::Barrier);
                }
            }
        }
        Ok(())
    }

    /// The stores of [`TileOp::AccToShared`] (no barriers): each thread writes the element
    /// pairs it holds.
    fn acc_to_shared_stores(&mut self, acc: &str, dst: &str) -> Result<Vec<Stmt>> {
        let info = self.tile(dst)?.clone();
        if info.ringed {
            return Err(self.err(format!(
                "accumulator {acc} written into {dst}, a tile a pipeline gathers into"
            )));
        }
        let (stride, elem, plane) = (info.stride, info.store, info.plane_words());
        let split = info
            .split
            .then(|| ["x0", "x1", "hi"].map(|n| self.fresh(n)));
        let (row, col) = (self.fresh("row"), self.fresh("col"));
        let (rv, cv) = (var(&row, Ty::U32), var(&col, Ty::U32));
        let acc_name = acc.to_string();
        let dst_name = dst.to_string();
        let s = self.for_each_pair(acc, &row, &col, |_, at, at1| {
            let v0 = priv_load(&acc_name, at);
            let v1 = priv_load(&acc_name, at1);
            Ok(match elem {
                TileElem::Bf16 if split.is_some() => {
                    let at = add(mul(rv.clone(), u(stride)), bin(BinOp::Shr, cv, u(1)));
                    let names = split.clone().unwrap_or_default();
                    split_store(&dst_name, at, plane, v0, v1, &names)
                }
                TileElem::Bf16 => vec![Stmt::SharedStore {
                    arr: dst_name.clone(),
                    index: add(mul(rv.clone(), u(stride)), bin(BinOp::Shr, cv, u(1))),
                    value: Expr::Call(Func::PackBf16x2, vec![v0, v1]),
                }],
                _ => {
                    let at = add(mul(rv.clone(), u(stride)), cv);
                    vec![
                        Stmt::SharedStore {
                            arr: dst_name.clone(),
                            index: at.clone(),
                            value: v0,
                        },
                        Stmt::SharedStore {
                            arr: dst_name.clone(),
                            index: add(at, u(1)),
                            value: v1,
                        },
                    ]
                }
            })
        })?;
        Ok(s)
    }

    /// The ring pipeline: loads of steps `step + 1 .. step + stages - 1` are in flight while
    /// step `step` computes. One commit group per step (empty past the end), so
    /// `wait_group(stages - 1)` always means "this step's copies have landed". The source
    /// addresses of each load are computed one iteration before its copies are issued, so
    /// the index loads they need are off the critical path.
    fn pipeline(
        &mut self,
        v: &str,
        count: &Expr,
        load: &[Stmt],
        compute: &[Stmt],
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let s = self.stages;
        let count_name = self.fresh(&format!("{v}_count"));
        out.push(let_(&count_name, self.expr(count)?));
        let count = var(&count_name, Ty::U32);
        // the gathers of the load stage, each with its source-word registers
        struct G<'a> {
            plan: GatherPlan,
            srcs: String,
            dst: &'a str,
            dst_word0: u32,
            words: u32,
            src: &'a str,
            row: &'a str,
            src_word: &'a Expr,
            flags: Option<&'a str>,
            comment: Option<String>,
        }
        let mut gathers = Vec::new();
        let mut comment = None;
        for st in load {
            match st {
                Stmt::Tile(TileOp::GatherRows {
                    dst,
                    dst_word0,
                    words,
                    src,
                    row,
                    src_word,
                    flags,
                }) => {
                    let plan = self.gather_plan(dst, *dst_word0, *words)?;
                    let srcs = self.private(&format!("{dst}_src"), Ty::I32, plan.passes);
                    gathers.push(G {
                        plan,
                        srcs,
                        dst,
                        dst_word0: *dst_word0,
                        words: *words,
                        src,
                        row,
                        src_word,
                        flags: flags.as_deref(),
                        comment: comment.take(),
                    });
                }
                Stmt::Comment(c) => comment = Some(c.clone()),
                other => {
                    return Err(self.err(format!(
                        "pipeline {v}: the load stage may hold only gathers, found {other:?}"
                    )))
                }
            }
        }
        // address phase of step `at`, if it exists
        let addr = |cx: &mut Self, at: Expr| -> Result<Stmt> {
            let mut body = vec![let_(v, at.clone())];
            for g in &gathers {
                body.push(cx.gather_addr(&g.plan, g.row, g.src_word, &g.srcs)?);
            }
            Ok(Stmt::If {
                cond: lt(at, count.clone()),
                then: body,
                els: vec![],
            })
        };
        // copy phase of step `at` into its ring stage, if it exists
        let copy = |cx: &mut Self, at: Expr| -> Result<Stmt> {
            let stage_name = cx.fresh("load_stage");
            let mut body = Vec::new();
            if s > 1 {
                body.push(let_(&stage_name, bin(BinOp::Rem, at.clone(), u(s))));
            }
            let saved = cx.stage.replace(var(&stage_name, Ty::U32));
            for g in &gathers {
                if let Some(c) = &g.comment {
                    body.push(Stmt::Comment(c.clone()));
                }
                body.push(cx.gather_copy(
                    &g.plan,
                    g.dst,
                    (g.dst_word0, g.words),
                    g.src,
                    &g.srcs,
                    g.flags,
                )?);
            }
            cx.stage = saved;
            Ok(Stmt::If {
                cond: lt(at, count.clone()),
                then: body,
                els: vec![],
            })
        };
        out.push(Stmt::Comment(format!(
            "pipeline {v}: {s}-stage ring of cp.async gathers; first load the steps ahead"
        )));
        // Barrier: the ring may still be read by earlier code (write-after-read).
        out.push(Stmt::Barrier);
        // Online-softmax row state that lives in registers while the loop runs.
        let resident = self.resident_softmax(load, compute)?;
        for r in &resident {
            out.extend(self.softmax_load(r)?);
            self.resident.insert(r.m.clone(), r.clone());
        }
        if s > 1 {
            let pre = self.fresh("prefetch");
            let body = vec![
                addr(self, var(&pre, Ty::U32))?,
                copy(self, var(&pre, Ty::U32))?,
                intr(Intrinsic::CpAsyncCommit),
            ];
            out.push(for_const(&pre, s - 1, body));
        }
        out.push(addr(self, u(s - 1))?);
        let it = self.fresh(&format!("{v}_i"));
        let itv = var(&it, Ty::U32);
        let mut body = vec![Stmt::Comment(format!(
            "pipeline {v}: copy the rows {} steps ahead, then the addresses of the step after",
            s - 1
        ))];
        body.push(copy(self, add(itv.clone(), u(s - 1)))?);
        body.push(addr(self, add(itv.clone(), u(s)))?);
        body.push(intr(Intrinsic::CpAsyncCommit));
        body.push(intr(Intrinsic::CpAsyncWait { pending: s - 1 }));
        body.push(Stmt::Barrier);
        body.push(Stmt::Comment(format!("pipeline {v}: compute")));
        body.push(let_(v, itv.clone()));
        let stage_name = self.fresh("stage");
        if s > 1 {
            body.push(let_(&stage_name, bin(BinOp::Rem, itv, u(s))));
        }
        let saved = self.stage.replace(var(&stage_name, Ty::U32));
        body.extend(self.stmts(compute)?);
        self.stage = saved;
        // Barrier: the next iteration's load overwrites the stage computed on one step ago.
        body.push(Stmt::Barrier);
        out.push(Stmt::For {
            var: it,
            start: u(0),
            end: count,
            step: u(1),
            body,
        });
        out.push(intr(Intrinsic::CpAsyncWait { pending: 0 }));
        for r in &resident {
            self.resident.remove(&r.m);
            out.extend(self.softmax_store(r)?);
        }
        Ok(())
    }

    /// How a gather spreads over the threads: `tpr` consecutive threads share a row, each
    /// taking every `tpr`-th 16-byte chunk (so a warp reads contiguous runs); `passes` rounds
    /// of `W / tpr` rows.
    fn gather_plan(&self, dst: &str, dst_word0: u32, words: u32) -> Result<GatherPlan> {
        let info = self.tile(dst)?;
        let rows = info.decl.rows;
        if dst_word0 + words > info.stride {
            return Err(self.err(format!(
                "gather into {dst}: words {dst_word0}..{} exceed the row",
                dst_word0 + words
            )));
        }
        let chunks = words / 4;
        let tpr = floor_pow2((self.w / rows).max(1)).min(chunks.max(1).next_power_of_two());
        let rows_per_pass = self.w / tpr;
        Ok(GatherPlan {
            rows,
            tpr,
            rows_per_pass,
            passes: rows.div_ceil(rows_per_pass),
        })
    }

    /// `row` of pass `p` for this thread.
    fn gather_row(plan: &GatherPlan, p: Expr) -> Expr {
        add(
            bin(BinOp::Div, local_id(), u(plan.tpr)),
            mul(p, u(plan.rows_per_pass)),
        )
    }

    /// The address phase of a gather: each thread's source word (or −1) per pass into the
    /// private array `srcs`. Its global loads (e.g. of top-k indices) complete while other
    /// work runs, when the copies are issued later.
    fn gather_addr(
        &mut self,
        plan: &GatherPlan,
        row: &str,
        src_word: &Expr,
        srcs: &str,
    ) -> Result<Stmt> {
        let p = self.fresh("gather_pass");
        let r = self.fresh("gather_row");
        let rv = var(&r, Ty::U32);
        let store = |value: Expr| Stmt::PrivateStore {
            arr: srcs.into(),
            index: var(&p, Ty::U32),
            value,
        };
        let body = vec![
            let_(&r, Self::gather_row(plan, var(&p, Ty::U32))),
            Stmt::If {
                cond: lt(rv.clone(), u(plan.rows)),
                then: vec![let_(row, rv), store(self.expr(src_word)?)],
                els: vec![store(Expr::I32(-1))],
            },
        ];
        Ok(for_const(&p, plan.passes, body))
    }

    /// The copy phase of a gather: issue the copies (no commit, no wait) from the source
    /// words in `srcs`.
    #[allow(clippy::too_many_arguments)]
    fn gather_copy(
        &mut self,
        plan: &GatherPlan,
        dst: &str,
        (dst_word0, words): (u32, u32),
        src: &str,
        srcs: &str,
        flags: Option<&str>,
    ) -> Result<Stmt> {
        let info = self.tile(dst)?.clone();
        let flag_at = match flags {
            Some(f) => {
                let t = self.tile(f)?.clone();
                Some((f.to_string(), self.tile_base(&t)?))
            }
            None => None,
        };
        let base = self.tile_base(&info)?;
        let tpr = plan.tpr;
        let chunks = words / 4;
        let p = self.fresh("gather_pass");
        let r = self.fresh("gather_row");
        let rv = var(&r, Ty::U32);
        let (sw, valid, dbase) = (
            self.fresh("src_word"),
            self.fresh("src_valid"),
            self.fresh("dst_word"),
        );
        let (swv, validv, dbv) = (
            var(&sw, Ty::U32),
            var(&valid, Ty::Bool),
            var(&dbase, Ty::U32),
        );
        let src_i = self.fresh("src_i32");
        let sub = bin(BinOp::Rem, local_id(), u(tpr));
        // copies of `bytes` for element indices c = sub + i·tpr < n, at word offset w0: a
        // constant trip count, so the loop unrolls and each copy's offset is an immediate
        let copy_loop = |cx: &mut Self, bytes: u32, n: u32, w0: u32| -> Stmt {
            let (i, c) = (cx.fresh("copy_i"), cx.fresh("chunk"));
            let cv = var(&c, Ty::U32);
            let step = bytes / 4;
            // this thread's first element is `sub`; the rest are constant offsets from it,
            // printed as separate pointer terms so they become instruction immediates
            let lane0 = mul(sub.clone(), u(step));
            let off = add(u(w0), mul(var(&i, Ty::U32), u(tpr * step)));
            let copy = intr(Intrinsic::CpAsync {
                bytes,
                dst: dst.to_string(),
                dst_word: bin(BinOp::Add, add(dbv.clone(), lane0.clone()), off.clone()),
                src: src.to_string(),
                src_word: bin(BinOp::Add, add(swv.clone(), lane0), off),
                valid: validv.clone(),
            });
            let body = if n % tpr == 0 {
                vec![copy]
            } else {
                vec![Stmt::If {
                    cond: lt(cv.clone(), u(n)),
                    then: vec![copy],
                    els: vec![],
                }]
            };
            let mut full = vec![let_(&c, add(sub.clone(), mul(var(&i, Ty::U32), u(tpr))))];
            full.extend(body);
            for_const(&i, n.div_ceil(tpr), full)
        };
        let mut row_body = vec![
            let_(
                &src_i,
                Expr::PrivateLoad {
                    arr: srcs.into(),
                    ty: Ty::I32,
                    index: Box::new(var(&p, Ty::U32)),
                },
            ),
            let_(&valid, bin(BinOp::Ge, var(&src_i, Ty::I32), Expr::I32(0))),
            let_(
                &sw,
                Expr::Select(
                    Box::new(validv.clone()),
                    Box::new(Expr::Cvt(Ty::U32, Box::new(var(&src_i, Ty::I32)))),
                    Box::new(u(0)),
                ),
            ),
            let_(
                &dbase,
                add(add(base, mul(rv.clone(), u(info.stride))), u(dst_word0)),
            ),
        ];
        if let Some((f, fbase)) = flag_at {
            row_body.push(Stmt::If {
                cond: bin(BinOp::Eq, sub.clone(), u(0)),
                then: vec![Stmt::SharedStore {
                    arr: f,
                    index: add(fbase, rv.clone()),
                    value: Expr::Select(
                        Box::new(validv.clone()),
                        Box::new(Expr::F32(1.0)),
                        Box::new(Expr::F32(0.0)),
                    ),
                }],
                els: vec![],
            });
        }
        let words_path = copy_loop(self, 4, words, 0);
        if chunks > 0 && dst_word0 % 4 == 0 {
            // 16-byte copies when the source row is 16-byte aligned, else 4-byte ones.
            let mut fast = vec![copy_loop(self, 16, chunks, 0)];
            if words % 4 != 0 {
                let tail = copy_loop(self, 4, words % 4, chunks * 4);
                fast.push(tail);
            }
            row_body.push(Stmt::If {
                cond: bin(BinOp::Eq, bin(BinOp::BitAnd, swv.clone(), u(3)), u(0)),
                then: fast,
                els: vec![words_path],
            });
        } else {
            row_body.push(words_path);
        }
        let body = vec![
            let_(&r, Self::gather_row(plan, var(&p, Ty::U32))),
            Stmt::If {
                cond: lt(rv, u(plan.rows)),
                then: row_body,
                els: vec![],
            },
        ];
        Ok(for_const(&p, plan.passes, body))
    }

    /// Issue the copies of one `GatherRows` (no commit, no wait).
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &mut self,
        dst: &str,
        dst_word0: u32,
        words: u32,
        src: &str,
        row: &str,
        src_word: &Expr,
        flags: Option<&str>,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let plan = self.gather_plan(dst, dst_word0, words)?;
        let srcs = self.private(&format!("{dst}_src"), Ty::I32, plan.passes);
        out.push(self.gather_addr(&plan, row, src_word, &srcs)?);
        out.push(self.gather_copy(&plan, dst, (dst_word0, words), src, &srcs, flags)?);
        Ok(())
    }

    fn mma(
        &mut self,
        acc: &str,
        a: &TileView,
        b: &TileView,
        layout: BLayout,
        scale: Option<(String, Expr)>,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self.acc(acc)?.clone();
        if info.ksplit.is_some() {
            return self.mma_ksplit(acc, a, b, scale, out);
        }
        let ta = self.tile(&a.tile)?.clone();
        let tb = self.tile(&b.tile)?.clone();
        if tb.decl.elem == TileElem::E4m3 && layout == BLayout::KN && ta.store == TileElem::Bf16 {
            return self.mma_e4m3_kn(acc, a, b, scale, out);
        }
        if scale.is_some() || tb.decl.elem == TileElem::E4m3 {
            return Err(self.err(format!(
                "mma into {acc}: scaled and e4m3 products are lowered as [K, N] products with a \
                 bf16 A operand or as split-K [N, K] products (Lowering::MmaWs)"
            )));
        }
        for t in [&ta, &tb] {
            if t.store != TileElem::Bf16 {
                return Err(self.err(format!(
                    "mma into {acc}: the tensor-core lowering multiplies bf16 tiles; {} is {:?} \
                     (use a bf16 tile, e.g. p_elem = Bf16)",
                    t.decl.name, t.decl.elem
                )));
            }
        }
        let k_len = a.cols;
        if k_len % 16 != 0 {
            return Err(self.err(format!(
                "mma into {acc}: K = {k_len} is not a multiple of 16 (m16n8k16)"
            )));
        }
        let (b_n0, b_k0) = match layout {
            BLayout::NK => (b.row0, b.col0),
            BLayout::KN => (b.col0, b.row0),
        };
        if a.col0 % 8 != 0 || b.col0 % 8 != 0 {
            return Err(self.err(format!(
                "mma into {acc}: operand column offsets ({}, {}) must be multiples of 8 \
                 (16-byte ldmatrix rows)",
                a.col0, b.col0
            )));
        }
        let (sa, sb) = (ta.stride, tb.stride);
        let (fmw, fnw) = (info.fmw, info.fnw);
        let ab = self.tile_base(&ta)?;
        let bb = self.tile_base(&tb)?;
        // Split (hi + lo) operands: one product per plane pair, the lo x lo term dropped.
        let a_planes: Vec<u32> = if ta.split {
            vec![0, ta.plane_words()]
        } else {
            vec![0]
        };
        let b_planes: Vec<u32> = if tb.split {
            vec![0, tb.plane_words()]
        } else {
            vec![0]
        };
        let mut products = vec![(0usize, 0usize)];
        if tb.split {
            products.push((0, 1));
        }
        if ta.split {
            products.push((1, 0));
        }
        let af = self.private("a_frag", Ty::U32, 4 * fmw * a_planes.len() as u32);
        let bf = self.private("b_frag", Ty::U32, 4 * b_planes.len() as u32);
        let (a_base, b_base) = (self.fresh("a_lane_word"), self.fresh("b_lane_word"));
        let l = &self.lane;
        // Word of the first row this lane addresses, at k = 0.
        let a_word = add(
            add(
                ab,
                mul(add(add(u(a.row0), info.row0.clone()), l.r16.clone()), u(sa)),
            ),
            bin(BinOp::Shr, add(u(a.col0), l.c8.clone()), u(1)),
        );
        let b_word = match layout {
            BLayout::NK => add(
                add(
                    bb,
                    mul(add(add(u(b_n0), info.col0.clone()), l.n_nk.clone()), u(sb)),
                ),
                bin(BinOp::Shr, add(u(b_k0), l.k_nk.clone()), u(1)),
            ),
            BLayout::KN => add(
                add(bb, mul(add(u(b_k0), l.r16.clone()), u(sb))),
                bin(
                    BinOp::Shr,
                    add(add(u(b_n0), info.col0.clone()), l.c8.clone()),
                    u(1),
                ),
            ),
        };
        let (kk, i, jp, j) = (
            self.fresh("kk"),
            self.fresh("mi"),
            self.fresh("nj"),
            self.fresh("nj"),
        );
        let (iv, jpv, jv) = (var(&i, Ty::U32), var(&jp, Ty::U32), var(&j, Ty::U32));
        let trans = layout == BLayout::KN;
        // One k step (16 deep) of every fragment this warp owns, accumulated into `target`.
        let kstep = |kkv: Expr, target: &str| -> Vec<Stmt> {
            let mut kbody = Vec::new();
            for (p, plane) in a_planes.iter().enumerate() {
                let p = p as u32;
                kbody.push(for_const(
                    &i,
                    fmw,
                    vec![intr(Intrinsic::LdMatrix {
                        count: 4,
                        trans: false,
                        arr: a.tile.clone(),
                        word: add(
                            add(var(&a_base, Ty::U32), u(*plane)),
                            add(mul(iv.clone(), u(16 * sa)), mul(kkv.clone(), u(8))),
                        ),
                        dst: af.clone(),
                        dst0: add(mul(iv.clone(), u(4)), u(4 * fmw * p)),
                    })],
                ));
            }
            // B fragments of n tiles (2jp, 2jp + 1) in one ldmatrix.x4 (an odd last one in .x2),
            // each pair used by its mma right away so only 4 B registers per plane stay live.
            let b_at = |n_tile: Expr, plane: u32| -> Expr {
                let base = add(var(&b_base, Ty::U32), u(plane));
                match layout {
                    BLayout::NK => add(base, add(mul(n_tile, u(8 * sb)), mul(kkv.clone(), u(8)))),
                    BLayout::KN => add(base, add(mul(kkv.clone(), u(16 * sb)), mul(n_tile, u(4)))),
                }
            };
            // (first n tile, tiles in this group, its loop variable if any)
            let mut groups: Vec<(Expr, u32)> = Vec::new();
            if fnw >= 2 {
                groups.push((mul(jpv.clone(), u(2)), 2));
            }
            if fnw % 2 == 1 {
                groups.push((u(fnw - 1), 1));
            }
            for (gi, (n0, count)) in groups.into_iter().enumerate() {
                let mut body = Vec::new();
                for (q, plane) in b_planes.iter().enumerate() {
                    body.push(intr(Intrinsic::LdMatrix {
                        count: 2 * count,
                        trans,
                        arr: b.tile.clone(),
                        word: b_at(n0.clone(), *plane),
                        dst: bf.clone(),
                        dst0: u(4 * q as u32),
                    }));
                }
                for &(p, q) in &products {
                    body.push(for_const(
                        &i,
                        fmw,
                        vec![for_const(
                            &j,
                            count,
                            vec![intr(Intrinsic::MmaBf16 {
                                c: target.to_string(),
                                c0: mul(
                                    add(mul(iv.clone(), u(fnw)), add(n0.clone(), jv.clone())),
                                    u(4),
                                ),
                                a: af.clone(),
                                a0: add(mul(iv.clone(), u(4)), u(4 * fmw * p as u32)),
                                b: bf.clone(),
                                b0: add(mul(jv.clone(), u(2)), u(4 * q as u32)),
                            })],
                        )],
                    ));
                }
                if gi == 0 && fnw >= 2 {
                    kbody.push(for_const(&jp, fnw / 2, body));
                } else {
                    kbody.extend(body);
                }
            }
            kbody
        };
        // A long chain of mma into the same few fragments waits on each result: with few
        // fragments per warp, alternate k steps between `chains` accumulators (the first is
        // `acc` itself, the others start at zero) and add them up at the end.
        let ks = k_len / 16;
        let frags = fmw * fnw;
        // More chains cost 4 registers per fragment each: 2 at most within a 128-register
        // budget (two 256-thread workgroups per multiprocessor), else 4, and 4 when split
        // operands already put two dependent products in every k step.
        let most = if self.register_budget() <= 128 && products.len() == 1 {
            2
        } else {
            4
        };
        let chains = if ks >= 8 {
            (most / frags).clamp(1, most)
        } else {
            1
        };
        let mut body = vec![let_(&a_base, a_word), let_(&b_base, b_word)];
        if chains == 1 {
            body.push(for_const(&kk, ks, kstep(var(&kk, Ty::U32), acc)));
        } else {
            let parts: Vec<String> = (1..chains)
                .map(|_| self.private(&format!("{acc}_chain"), Ty::F32, 4 * frags))
                .collect();
            let e = self.fresh("e");
            for part in &parts {
                body.push(for_const(
                    &e,
                    4 * frags,
                    vec![Stmt::PrivateStore {
                        arr: part.clone(),
                        index: var(&e, Ty::U32),
                        value: Expr::F32(0.0),
                    }],
                ));
            }
            let mut round = Vec::new();
            for c in 0..chains {
                let at = add(mul(var(&kk, Ty::U32), u(chains)), u(c));
                let target = if c == 0 {
                    acc
                } else {
                    parts[c as usize - 1].as_str()
                };
                round.extend(kstep(at, target));
            }
            body.push(for_const(&kk, ks / chains, round));
            for k in (ks / chains) * chains..ks {
                body.extend(kstep(u(k), acc));
            }
            let sum = parts
                .iter()
                .fold(priv_load(acc, var(&e, Ty::U32)), |x, part| {
                    bin(BinOp::Add, x, priv_load(part, var(&e, Ty::U32)))
                });
            body.push(for_const(
                &e,
                4 * frags,
                vec![Stmt::PrivateStore {
                    arr: acc.to_string(),
                    index: var(&e, Ty::U32),
                    value: sum,
                }],
            ));
        }
        out.extend(self.for_used_warps(&info, body));
        Ok(())
    }

    fn row_reduce(&mut self, acc: &str, op: Reduce, dst: &str, out: &mut Vec<Stmt>) -> Result<()> {
        let info = self.acc(acc)?.clone();
        let rows = info.decl.rows;
        let scratch = self
            .reduce_scratch
            .clone()
            .ok_or_else(|| self.err("row reduce without scratch".into()))?;
        let combine = match op {
            Reduce::Max => BinOp::Max,
            Reduce::Sum => BinOp::Add,
        };
        let (i, h) = (self.fresh("mi"), self.fresh("half"));
        let (iv, hv) = (var(&i, Ty::U32), var(&h, Ty::U32));
        let x = self.fresh("red");
        let xv = var(&x, Ty::F32);
        // element k of the thread's row (i, h): fragments (i, j), values 2h, 2h + 1
        let elem = |j: u32, e: u32| {
            priv_load(
                acc,
                add(
                    mul(add(mul(iv.clone(), u(info.fnw)), u(j)), u(4)),
                    add(mul(hv.clone(), u(2)), u(e)),
                ),
            )
        };
        let mut inner = vec![Stmt::Var {
            name: x.clone(),
            value: bin(combine, elem(0, 0), elem(0, 1)),
        }];
        for j in 1..info.fnw {
            for e in 0..2 {
                inner.push(Stmt::Assign {
                    name: x.clone(),
                    value: bin(combine, xv.clone(), elem(j, e)),
                });
            }
        }
        for mask in [1, 2] {
            let o = self.fresh("other");
            inner.push(intr(Intrinsic::ShflXor {
                dst: o.clone(),
                value: xv.clone(),
                lane_mask: mask,
            }));
            inner.push(Stmt::Assign {
                name: x.clone(),
                value: bin(combine, xv.clone(), var(&o, Ty::F32)),
            });
        }
        let row = add(
            add(info.row0.clone(), mul(iv, u(16))),
            add(mul(hv, u(8)), self.lane.group.clone()),
        );
        inner.push(Stmt::If {
            cond: bin(BinOp::Eq, self.lane.quad.clone(), u(0)),
            then: vec![Stmt::SharedStore {
                arr: scratch.clone(),
                index: add(mul(info.wn.clone(), u(rows)), row),
                value: xv,
            }],
            els: vec![],
        });
        let per_warp = for_const(&i, info.fmw, vec![for_const(&h, 2, inner)]);
        out.extend(self.for_used_warps(&info, vec![per_warp]));
        out.push(Stmt::Barrier);
        // across the warps that share rows
        let (r, g, y) = (self.fresh("r"), self.fresh("g"), self.fresh("red"));
        let (r_v, g_v, y_v) = (var(&r, Ty::U32), var(&g, Ty::U32), var(&y, Ty::F32));
        let mut final_body = vec![Stmt::Var {
            name: y.clone(),
            value: shared_load(&scratch, Ty::F32, r_v.clone()),
        }];
        if info.gn > 1 {
            final_body.push(Stmt::For {
                var: g.clone(),
                start: u(1),
                end: u(info.gn),
                step: u(1),
                body: vec![Stmt::Assign {
                    name: y.clone(),
                    value: bin(
                        combine,
                        y_v.clone(),
                        shared_load(&scratch, Ty::F32, add(mul(g_v, u(rows)), r_v.clone())),
                    ),
                }],
            });
        }
        final_body.push(Stmt::SharedStore {
            arr: dst.into(),
            index: r_v,
            value: y_v,
        });
        out.push(Stmt::For {
            var: r,
            start: local_id(),
            end: u(rows),
            step: u(self.w),
            body: final_body,
        });
        out.push(Stmt::Barrier);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn shared_map(
        &mut self,
        dst: &str,
        row: &str,
        col: &str,
        (col0, cols): (u32, u32),
        value: &Expr,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self.tile(dst)?.clone();
        let base = self.tile_base(&info)?;
        let (rows, stride, elem) = (info.decl.rows, info.stride, info.store);
        let per_word = 4 / elem.bytes();
        if col0 % per_word != 0 || cols % per_word != 0 || col0 + cols > info.decl.cols {
            return Err(self.err(format!(
                "shared_map into {dst}: columns {col0}..{} are not whole words of its {} storage",
                col0 + cols,
                if info.store != info.decl.elem {
                    "bf16"
                } else {
                    "row"
                }
            )));
        }
        let (word0, words_per_row) = (col0 / per_word, cols / per_word);
        let value = self.expr(value)?;
        let col_plus = |k: u32| {
            let c = col.to_string();
            value.clone().map(&mut |x| match x {
                Expr::Var(ref n, Ty::U32) if *n == c => add(x, u(k)),
                other => other,
            })
        };
        // One thread per 32-bit word of the window (padding excluded).
        let idx = self.fresh("word_i");
        let iv = var(&idx, Ty::U32);
        let word_value = match elem {
            TileElem::F32 => col_plus(0),
            TileElem::Bf16 => Expr::Call(Func::PackBf16x2, vec![col_plus(0), col_plus(1)]),
            TileElem::U8 | TileElem::E4m3 => {
                let mut w = bin(BinOp::BitAnd, col_plus(0), u(0xFF));
                for k in 1..4 {
                    let byte = bin(BinOp::BitAnd, col_plus(k), u(0xFF));
                    w = bin(BinOp::BitOr, w, bin(BinOp::Shl, byte, u(8 * k)));
                }
                w
            }
        };
        let rv = var(row, Ty::U32);
        let cw = self.fresh("col_word");
        let at = add(add(base, mul(rv.clone(), u(stride))), var(&cw, Ty::U32));
        let store = if info.split {
            let names = ["x0", "x1", "hi"].map(|n| self.fresh(n));
            split_store(
                dst,
                at,
                info.plane_words(),
                col_plus(0),
                col_plus(1),
                &names,
            )
        } else {
            vec![Stmt::SharedStore {
                arr: dst.into(),
                index: at,
                value: word_value,
            }]
        };
        out.push(Stmt::Barrier);
        out.push(Stmt::For {
            var: idx,
            start: local_id(),
            end: u(rows * words_per_row),
            step: u(self.w),
            body: [
                vec![
                    let_(row, bin(BinOp::Div, iv.clone(), u(words_per_row))),
                    let_(&cw, add(bin(BinOp::Rem, iv, u(words_per_row)), u(word0))),
                    let_(col, mul(var(&cw, Ty::U32), u(per_word))),
                ],
                store,
            ]
            .concat(),
        });
        out.push(Stmt::Barrier);
        Ok(())
    }
}

/// Does `s` use any of the shared tiles `names` (a pipeline: only through its load stage,
/// whose first wait covers older copies)?
fn stmt_mentions(s: &Stmt, names: &[String]) -> bool {
    let hit = |n: &String| names.contains(n);
    let expr_hit = |e: &Expr| {
        let mut found = false;
        e.visit(&mut |x| match x {
            Expr::TileLoad { tile, .. } | Expr::TileWord { tile, .. } => found |= hit(tile),
            _ => {}
        });
        found
    };
    let all = |v: &[Stmt]| v.iter().any(|s| stmt_mentions(s, names));
    match s {
        Stmt::Let { value, .. } | Stmt::Var { value, .. } | Stmt::Assign { value, .. } => {
            expr_hit(value)
        }
        Stmt::Store { index, value, .. }
        | Stmt::StoreWord { index, value, .. }
        | Stmt::SharedStore { index, value, .. }
        | Stmt::PrivateStore { index, value, .. } => expr_hit(index) || expr_hit(value),
        Stmt::If { cond, then, els } => expr_hit(cond) || all(then) || all(els),
        Stmt::For {
            start,
            end,
            step,
            body,
            ..
        } => expr_hit(start) || expr_hit(end) || expr_hit(step) || all(body),
        Stmt::Comment(_) | Stmt::Barrier => false,
        Stmt::Intrinsic(_) => true,
        Stmt::Tile(op) => match op {
            TileOp::GatherRows { dst, src_word, .. } => hit(dst) || expr_hit(src_word),
            TileOp::AccFill { .. } | TileOp::AccRowReduce { .. } => false,
            TileOp::Mma { a, b, .. } => hit(&a.tile) || hit(&b.tile),
            TileOp::MmaScaled { a, b, scale, .. } => {
                hit(&a.tile) || hit(&b.tile) || expr_hit(scale)
            }
            TileOp::AccForEach { body, .. } => all(body),
            TileOp::AccToShared { dst, .. } => hit(dst),
            TileOp::SharedMap { dst, value, .. } => hit(dst) || expr_hit(value),
            TileOp::Pipeline { load, .. } => all(load),
            TileOp::OnlineSoftmax { p_tile, .. } => hit(p_tile),
        },
    }
}

/// Drop a barrier that directly follows another (comments between them aside), in every
/// block: two in a row order nothing more than one.
fn dedupe_barriers(stmts: Vec<Stmt>) -> Vec<Stmt> {
    let mut out: Vec<Stmt> = Vec::with_capacity(stmts.len());
    let mut last_barrier = false;
    for s in stmts {
        let s = match s {
            Stmt::If { cond, then, els } => Stmt::If {
                cond,
                then: dedupe_barriers(then),
                els: dedupe_barriers(els),
            },
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => Stmt::For {
                var,
                start,
                end,
                step,
                body: dedupe_barriers(body),
            },
            other => other,
        };
        match s {
            Stmt::Barrier if last_barrier => continue,
            Stmt::Barrier => last_barrier = true,
            Stmt::Comment(_) => {}
            _ => last_barrier = false,
        }
        out.push(s);
    }
    out
}

/// `hi` then `lo` words of two f32 values in a split tile: `hi = bf16x2(v0, v1)`,
/// `lo = bf16x2(v0 - hi0, v1 - hi1)`. `names`: fresh names for v0, v1 and hi.
fn split_store(
    arr: &str,
    at: Expr,
    plane: u32,
    v0: Expr,
    v1: Expr,
    names: &[String; 3],
) -> Vec<Stmt> {
    let [x0, x1, hi] = names;
    let (x0v, x1v, hiv) = (var(x0, Ty::F32), var(x1, Ty::F32), var(hi, Ty::U32));
    let hi0 = bits_to_f32(bin(BinOp::Shl, hiv.clone(), u(16)));
    let hi1 = bits_to_f32(bin(BinOp::BitAnd, hiv.clone(), u(0xFFFF_0000)));
    vec![
        let_(x0, v0),
        let_(x1, v1),
        let_(
            hi,
            Expr::Call(Func::PackBf16x2, vec![x0v.clone(), x1v.clone()]),
        ),
        Stmt::SharedStore {
            arr: arr.into(),
            index: at.clone(),
            value: hiv,
        },
        Stmt::SharedStore {
            arr: arr.into(),
            index: add(at, u(plane)),
            value: Expr::Call(
                Func::PackBf16x2,
                vec![bin(BinOp::Sub, x0v, hi0), bin(BinOp::Sub, x1v, hi1)],
            ),
        },
    ]
}

/// Element (row, col) of a shared tile in this lowering's layout.
fn tile_elem(info: &TileInfo, base: Expr, row: Expr, col: Expr) -> Expr {
    if info.split {
        let hi = bf16_elem(info, base.clone(), row.clone(), col.clone());
        let lo = bf16_elem(info, add(base, u(info.plane_words())), row, col);
        return bin(BinOp::Add, hi, lo);
    }
    bf16_elem(info, base, row, col)
}

/// Element (row, col) of one plane of a shared tile.
fn bf16_elem(info: &TileInfo, base: Expr, row: Expr, col: Expr) -> Expr {
    let name = &info.decl.name;
    let row_word = add(base, mul(row, u(info.stride)));
    match info.store {
        TileElem::F32 => shared_load(name, Ty::F32, add(row_word, col)),
        TileElem::Bf16 => {
            let word = shared_load(
                name,
                Ty::U32,
                add(row_word, bin(BinOp::Shr, col.clone(), u(1))),
            );
            let shift = bin(BinOp::Mul, bin(BinOp::BitAnd, col, u(1)), u(16));
            bits_to_f32(bin(
                BinOp::Shl,
                bin(BinOp::BitAnd, bin(BinOp::Shr, word, shift), u(0xFFFF)),
                u(16),
            ))
        }
        TileElem::U8 | TileElem::E4m3 => {
            let word = shared_load(
                name,
                Ty::U32,
                add(row_word, bin(BinOp::Shr, col.clone(), u(2))),
            );
            let shift = bin(BinOp::Mul, bin(BinOp::BitAnd, col, u(3)), u(8));
            let byte = bin(BinOp::BitAnd, bin(BinOp::Shr, word, shift), u(0xFF));
            if info.store == TileElem::E4m3 {
                crate::kir::lower_scalar::e4m3_value(byte)
            } else {
                byte
            }
        }
    }
}

/// Word `word` of row `row` of a shared tile, as u32 (for an f32 tile kept in split bf16
/// planes: the bits of `hi + lo`).
fn tile_word(info: &TileInfo, base: Expr, row: Expr, word: Expr) -> Expr {
    let name = &info.decl.name;
    let row_word = add(base, mul(row, u(info.stride)));
    match (info.decl.elem, info.store) {
        (TileElem::F32, TileElem::F32) => Expr::Call(
            Func::F32Bits,
            vec![shared_load(name, Ty::F32, add(row_word, word))],
        ),
        (TileElem::F32, _) => {
            // f32 element `word` is column `word` of the split planes
            Expr::Call(Func::F32Bits, vec![tile_elem(info, row_word, u(0), word)])
        }
        _ => shared_load(name, Ty::U32, add(row_word, word)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_rows_are_an_odd_number_of_chunks() {
        assert_eq!(padded_stride(1152), 73 * 4);
        assert_eq!(padded_stride(64), 5 * 4);
        assert_eq!(padded_stride(48), 3 * 4);
    }

    #[test]
    fn warp_grid_keeps_warps_busy_and_reads_little() {
        // O [16 x 512] over 4 warps: each warp a 16 x 128 strip
        assert_eq!(warp_grid(1, 64, 4), (1, 4));
        // O [32 x 512] over 8 warps: m32 x n64 per warp re-reads the least
        assert_eq!(warp_grid(2, 64, 8), (1, 8));
        // S [32 x 16] over 8 warps: 4 fragments, one per warp
        assert_eq!(warp_grid(2, 2, 8), (2, 2));
    }
}
