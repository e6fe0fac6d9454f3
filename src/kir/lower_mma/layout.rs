//! Where everything lives: [`Cx::new`] lays out the shared tiles (padded rows, rings, split
//! planes) and the accumulators (warp grids), and the element addressing of that layout.

use super::context::AccInfo;
use super::context::Cx;
use super::context::Lane;
use super::context::TileInfo;
use super::{e4m3, ksplit, resident, ws, WARP};
use crate::kir::expr::{add, bin, f32_from_bits, let_, local_id, mul, shared_load, u, var};
use crate::kir::ir::*;
use crate::kir::walk::{collect_names, visit_tile_ops_with};
use crate::{Error, Result};
use std::collections::{HashMap, HashSet};

/// Padded row stride in words: whole 16-byte chunks, an odd number of them.
pub(super) fn padded_stride(row_bytes: u32) -> u32 {
    let chunks = row_bytes.div_ceil(16);
    let chunks = if chunks % 2 == 0 { chunks + 1 } else { chunks };
    chunks * 4
}

/// The warp grid for an `[m, n]` accumulator: as many warps busy as the fragment grid
/// allows, then the fewest shared-memory bytes per k step (A is re-read by each warp along
/// N, B by each warp along M).
pub(super) fn warp_grid(fm: u32, fn_: u32, warps: u32) -> (u32, u32) {
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
    pub(super) fn new(
        kernel: &'k Kernel,
        stages: u32,
        ws_mode: bool,
        groups: u32,
        row_softmax: crate::kir::RowSoftmax,
    ) -> Result<Self> {
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
            hoist: Vec::new(),
            staged_late: false,
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
            summed: HashSet::new(),
            resident_a: HashMap::new(),
            groups: groups.max(1),
            group_by: crate::kir::GroupBy::Steps,
            group: None,
            units: None,
            l2_ahead: 0,
            row_softmax,
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
                    if let TileOp::GatherRows(g) = inner {
                        ringed.insert(g.dst.clone());
                        if let Some(f) = &g.flags {
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
            TileOp::GatherRows(g) => {
                gathered.insert(g.dst.clone());
            }
            _ => {}
        });
        let resident_tiles = resident::resident_candidates(&cx);
        let mut staged: Vec<String> = Vec::new();
        for t in &kernel.shared_tiles {
            if let Some((parent, offset)) = &t.alias {
                // a typed window of the parent's rows: its stride, stages and memory
                let p = cx.tiles.get(parent).cloned().ok_or_else(|| {
                    cx.err(format!(
                        "tile {}: its parent {parent} is not in shared memory",
                        t.name
                    ))
                })?;
                if p.split || (t.elem == TileElem::F32 && operands.contains(&t.name)) {
                    return Err(cx.err(format!(
                        "tile {}: an alias cannot be an f32 mma operand or alias one",
                        t.name
                    )));
                }
                // (a tile held in registers has no shared array to alias)
                let len = cx
                    .new_shared
                    .iter()
                    .find(|d| d.name == *parent)
                    .map(|d| d.len)
                    .ok_or_else(|| {
                        cx.err(format!(
                            "tile {}: its parent {parent} is not in shared memory",
                            t.name
                        ))
                    })?;
                let info = TileInfo {
                    decl: t.clone(),
                    store: t.elem,
                    split: false,
                    stride: p.stride,
                    ringed: p.ringed,
                };
                cx.new_shared.push(SharedDecl {
                    name: t.name.clone(),
                    ty: if t.elem == TileElem::F32 {
                        Ty::F32
                    } else {
                        Ty::U32
                    },
                    // the parent's length: the same stages, and the same offsets per warp group
                    len,
                    alias: Some((parent.clone(), *offset)),
                });
                cx.tiles.insert(t.name.clone(), info);
                continue;
            }
            if resident_tiles.contains(&t.name) {
                // in registers (loaded by `ksplit`), no shared memory of its own: with one warp
                // group it is staged through the ring's memory where that fits (placed below,
                // once the ring is)
                if cx.groups == 1 {
                    staged.push(t.name.clone());
                }
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
                alias: None,
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
        // A resident tile is staged in the first ring array whose memory holds its rows: the
        // whole workgroup copies it there with 16-byte copies, then each warp reads its
        // fragments from shared memory — instead of every warp loading its slice from global
        // memory four bytes at a time (at T = 1 those loads were 30 % of a v7 workgroup's
        // stall samples, ncu, H200). Warp groups keep the global loads: staged, the fp8 batch
        // kernel ran 0.96x at T = 128 (H200), where the one-time load is a small share of a
        // workgroup's time anyway.
        //
        // Where one stage holds the rows and the ring has more than one, they go in its last
        // stage: the producers fill stages 0..stages-2 before the first step and the last one
        // only after the first step's first barrier, which every thread reaches after its
        // reads of the staging; so the ring's set-up and first copies need not wait for q
        // (`staged_late`, `ws`): at T = 1 the row copies then fly while q is loaded, where
        // they were issued only once q had landed. Else the rows go at the ring's start, and
        // the ring's set-up comes after every thread's reads.
        for name in staged {
            let info = cx.tiles[&name].clone();
            let bytes = info.decl.rows * info.stride * 4;
            let parent = cx
                .new_shared
                .iter()
                .find(|d| {
                    d.alias.is_none()
                        && cx.tiles.get(&d.name).is_some_and(|t| t.ringed)
                        && d.len * 4 >= bytes
                })
                .map(|d| (d.name.clone(), d.len));
            if let Some((parent, len)) = parent {
                let stage_words = cx.tiles[&parent].words();
                let late = stages > 1 && len == stage_words * stages && stage_words * 4 >= bytes;
                let offset = if late {
                    (stages - 1) * stage_words * 4
                } else {
                    0
                };
                cx.staged_late |= late;
                cx.new_shared.push(SharedDecl {
                    name: name.clone(),
                    ty: Ty::U32,
                    len: if late { stage_words } else { len },
                    alias: Some((parent, offset)),
                });
            }
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
            // producer warps — issues the next rows meanwhile (see `ws`).
            let (gm, gn) = if split.is_some() {
                warp_grid(fm, fn_, (cx.warps / 2).max(1))
            } else {
                warp_grid(fm, fn_, cx.warps)
            };
            let (fmw, fnw) = (fm / gm, fn_ / gn);
            let interleave = e4m3::interleaved(&cx, &a.name);
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
            let rows = if split.is_some() {
                cx.rows_form(a)
            } else {
                None
            };
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
                rows,
            };
            cx.new_privates.push(PrivateDecl {
                name: a.name.clone(),
                ty: Ty::F32,
                len: info.elems(),
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
                alias: None,
                name: name.clone(),
                ty: Ty::F32,
                len: reduce_len,
            });
            cx.reduce_scratch = Some(name);
        }
        cx.declare_softmax_table()?;
        ksplit::declare(&mut cx)?;
        resident::declare(&mut cx)?;
        Ok(cx)
    }

    pub(super) fn bind_lane(&mut self) {
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
}

/// Element (row, col) of a shared tile in this lowering's layout.
pub(super) fn tile_elem(info: &TileInfo, base: Expr, row: Expr, col: Expr) -> Expr {
    if info.split {
        let hi = bf16_elem(info, base.clone(), row.clone(), col.clone());
        let lo = bf16_elem(info, add(base, u(info.plane_words())), row, col);
        return bin(BinOp::Add, hi, lo);
    }
    bf16_elem(info, base, row, col)
}

/// Element (row, col) of one plane of a shared tile.
pub(super) fn bf16_elem(info: &TileInfo, base: Expr, row: Expr, col: Expr) -> Expr {
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
            f32_from_bits(bin(
                BinOp::Shl,
                bin(BinOp::BitAnd, bin(BinOp::Shr, word, shift), u(0xFFFF)),
                u(16),
            ))
        }
        TileElem::F16 => {
            let word = shared_load(
                name,
                Ty::U32,
                add(row_word, bin(BinOp::Shr, col.clone(), u(1))),
            );
            let shift = bin(BinOp::Mul, bin(BinOp::BitAnd, col, u(1)), u(16));
            Expr::Call(Func::F16Lo, vec![bin(BinOp::Shr, word, shift)])
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
pub(super) fn tile_word(info: &TileInfo, base: Expr, row: Expr, word: Expr) -> Expr {
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
