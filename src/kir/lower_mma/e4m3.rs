//! e4m3 operands of the tensor-core products.
//!
//! In an `[N, K]` product (the scores) on a GPU with a one-instruction e4m3 product (sm_89,
//! sm_120: [`Func::E4m3MmaNative`]), the e4m3 bytes are the B operand as they are —
//! `ldmatrix.x2` gives each lane the m16n8k32 layout directly, nothing converted — and the
//! resident A tile is held as two e4m3 terms (`hi`, `lo`, times a per-warp power of
//! two: [`Cx::resident_gather`]), two m16n8k32 products per 32 k. Elsewhere (sm_80, and sm_90,
//! whose ptxas turns that instruction into conversions and two f16 products) the `[N, K]`
//! product is an f16 one (every e4m3 value is exact in f16; the resident A tile is held as
//! f16 times a per-warp power of two), and every `[K, N]` product multiplies the e4m3 tile as
//! bf16 (exact too): `ldmatrix` reads the bytes as 16-bit pairs and each register is widened
//! to two f16x2 (one `cvt` a pair) or bf16x2 (four instructions more a pair).
//! Read that way a lane holds 4 consecutive bytes, so the K order inside each 16-wide k step
//! is permuted — logical k `2q, 2q+1` is stored k `4q, 4q+1` and `2q+8, 2q+9` is `4q+2, 4q+3`
//! — and the A fragments are loaded with the same permutation (`[N, K]` products). In a
//! `[K, N]` product (`P · V`) `ldmatrix.trans` gives each lane bytes of two columns: the
//! accumulator is *interleaved*, its fragment pair `(2j, 2j+1)` holding the even and the odd
//! columns of 16 (see [`interleaved`]).
//!
//! **Per-row scales** ([`TileOp::MmaScaled`]): `[N, K]` — each product into a temporary,
//! added to the partial times the scale of its column; `[K, N]` (e4m3 B, `P · V`) — each
//! widened B value times the scale of its k row before it is rounded to bf16 (scaling the A
//! fragment (P) per tile instead cost 1.08x at fp8 H 128, benches/NOTES.md v15).

use super::ksplit::all_products;
use super::resident::ResidentView;
use super::{add, bin, for_const, intr, let_, mul, priv_load, u, var, AccInfo, Cx, TileInfo, WARP};
use crate::kir::expr::priv_load_u;
use crate::kir::ir::*;
use crate::Result;

/// Is `acc` the output of a `[K, N]` product with an e4m3 B operand?
pub(super) fn interleaved(cx: &Cx, acc: &str) -> bool {
    all_products(&cx.kernel.body)
        .iter()
        .any(|(a, _, b, layout)| {
            a == acc
                && *layout == BLayout::KN
                && cx
                    .kernel
                    .shared_tile(&b.tile)
                    .is_some_and(|t| t.elem == TileElem::E4m3)
        })
}

/// The widening of one register of 4 e4m3 bytes (`x`) into two bf16x2: bytes (0, 1) and
/// (2, 3), or with `interleave` bytes (0, 2) and (1, 3), each output's low and high value
/// times `scales` (f32) first if given: in a `[K, N]` product both outputs hold the same two
/// k rows, so one pair of scales serves. Each pair is converted at once
/// ([`Func::E4m3x2Prep`]: one `cvt.rn.f16x2.e4m3x2` on sm_89+) into the lets `prep`, then
/// its halves to f32 and the two packed as bf16x2; byte by byte it took two shifts, two masks
/// and two single-value conversions more per pair, the largest share of the fp8 step's
/// issued instructions (ncu, H200, benches/NOTES.md).
pub(super) fn widen_scaled(
    x: Expr,
    interleave: bool,
    prep: [&str; 2],
    scales: Option<(Expr, Expr)>,
) -> (Vec<Stmt>, Expr, Expr) {
    let (p0, p1) = if interleave {
        (
            bin(
                BinOp::BitOr,
                bin(BinOp::BitAnd, x.clone(), u(0xFF)),
                bin(BinOp::BitAnd, bin(BinOp::Shr, x.clone(), u(8)), u(0xFF00)),
            ),
            bin(
                BinOp::BitOr,
                bin(BinOp::BitAnd, bin(BinOp::Shr, x.clone(), u(8)), u(0xFF)),
                bin(BinOp::BitAnd, bin(BinOp::Shr, x, u(16)), u(0xFF00)),
            ),
        )
    } else {
        (
            bin(BinOp::BitAnd, x.clone(), u(0xFFFF)),
            bin(BinOp::Shr, x, u(16)),
        )
    };
    let stmts = vec![
        let_(prep[0], Expr::Call(Func::E4m3x2Prep, vec![p0])),
        let_(prep[1], Expr::Call(Func::E4m3x2Prep, vec![p1])),
    ];
    let pack = |name: &str| {
        let v = var(name, Ty::U32);
        let (lo, hi) = (
            Expr::Call(Func::E4m3x2Lo, vec![v.clone()]),
            Expr::Call(Func::E4m3x2Hi, vec![v]),
        );
        let (lo, hi) = match &scales {
            Some((s_lo, s_hi)) => (
                bin(BinOp::Mul, lo, s_lo.clone()),
                bin(BinOp::Mul, hi, s_hi.clone()),
            ),
            None => (lo, hi),
        };
        Expr::Call(Func::PackBf16x2, vec![lo, hi])
    };
    (stmts, pack(prep[0]), pack(prep[1]))
}

/// A bf16x2 word times two f32 scales (low, high half), rounded back to bf16x2.
pub(super) fn scale_pair(w: Expr, lo: Expr, hi: Expr) -> Expr {
    Expr::Call(
        Func::PackBf16x2,
        vec![
            bin(BinOp::Mul, bf16_lo(w.clone()), lo),
            bin(BinOp::Mul, bf16_hi(w), hi),
        ],
    )
}

/// The low bf16 of a word, as f32.
pub(super) fn bf16_lo(w: Expr) -> Expr {
    Expr::Call(Func::F32FromBits, vec![bin(BinOp::Shl, w, u(16))])
}

/// The high bf16 of a word, as f32.
pub(super) fn bf16_hi(w: Expr) -> Expr {
    Expr::Call(
        Func::F32FromBits,
        vec![bin(BinOp::BitAnd, w, u(0xFFFF_0000))],
    )
}

/// `scale` with its row variable bound to `row`.
pub(super) fn scale_at(scale: &(String, Expr), row: Expr) -> Expr {
    let name = scale.0.clone();
    scale.1.clone().map(&mut |x| match x {
        Expr::Var(ref n, Ty::U32) if *n == name => row.clone(),
        other => other,
    })
}

impl Cx<'_> {
    /// The e4m3 `[N, K]` split-K product: per k32 step of the warp's slice, B's bytes by one
    /// `ldmatrix.x2` per n fragment (row n; k bytes 0-15, then 16-31: the m16n8k32 B layout
    /// as they land, nothing converted), times the resident view's `hi` terms, then its `lo`
    /// terms, into the same fragments (the fm x ng fragments are the independent chains; a
    /// second set of accumulators for the `lo` terms spilled the 32-head kernel).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ksplit_e4m3(
        &mut self,
        body: &mut Vec<Stmt>,
        target: &str,
        v: &ResidentView,
        tb: &TileInfo,
        bb: Expr,
        b: &TileView,
        nf: &Expr,
        fm: u32,
        ng: u32,
        slice: Expr,
    ) {
        let steps = v.cols / 32 / v.gk;
        let af = self.private("a_frag", Ty::U32, 4);
        let bf = self.private("b_frag", Ty::U32, 2);
        let (kk, i, j) = (self.fresh("kk"), self.fresh("mi"), self.fresh("nj"));
        let (kkv, iv, jv) = (var(&kk, Ty::U32), var(&i, Ty::U32), var(&j, Ty::U32));
        let k_step = add(mul(slice, u(steps)), kkv.clone());
        let word = add(
            self.b_row_word(bb, tb.stride, nf, &jv),
            add(
                add(u(b.col0 / 4), mul(k_step, u(8))),
                mul(bin(BinOp::Shr, self.lane.r16.clone(), u(3)), u(4)),
            ),
        );
        let mut n_body = vec![intr(Intrinsic::LdMatrix {
            count: 2,
            trans: false,
            arr: b.tile.clone(),
            word,
            dst: bf.clone(),
            dst0: u(0),
        })];
        let mut m_body = Vec::new();
        for regs in [&v.regs, &v.lo_regs] {
            for r in 0..4 {
                m_body.push(Stmt::PrivateStore {
                    arr: af.clone(),
                    index: u(r),
                    value: priv_load_u(
                        regs,
                        add(mul(add(mul(iv.clone(), u(steps)), kkv.clone()), u(4)), u(r)),
                    ),
                });
            }
            m_body.push(intr(Intrinsic::MmaE4m3 {
                c: target.to_string(),
                c0: mul(add(mul(iv.clone(), u(ng)), jv.clone()), u(4)),
                a: af.clone(),
                a0: u(0),
                b: bf.clone(),
                b0: u(0),
            }));
        }
        n_body.push(for_const(&i, fm, m_body));
        body.push(for_const(&kk, steps, vec![for_const(&j, ng, n_body)]));
    }

    /// B fragments of an e4m3 `[K, N]` operand for n fragment pairs, each widened value
    /// times its k row's scale when `k_scales` (the lane's rows `2q, 2q + 1, 2q + 8, 2q + 9`)
    /// is given: see [`Cx::mma_e4m3_kn`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn e4m3_kn_b(
        &mut self,
        tb: &TileInfo,
        base: Expr,
        k_row: Expr,
        n_byte: Expr,
        raw: &str,
        bf: &str,
        k_scales: Option<&[Expr; 4]>,
    ) -> Vec<Stmt> {
        let mut out = vec![self.kn_b_ldmatrix(tb, base, k_row, n_byte, raw)];
        // even fragment: b0 = bytes (0, 2) of the k 0-7 matrix, b1 = of the k 8-15 one;
        // odd fragment: bytes (1, 3)
        let names: Vec<String> = (0..4).map(|_| self.fresh("e4m3_pair")).collect();
        // with scales: matrix 0 holds k rows 2q, 2q + 1 of each lane, matrix 1 2q + 8, 2q + 9;
        // loaded after the fragment's ldmatrix, so they are not held across it
        let k_scales = k_scales.map(|k| self.bind_k_scales(k, &mut out));
        let pair = |i: usize| {
            k_scales
                .as_ref()
                .map(|k| (k[2 * i].clone(), k[2 * i + 1].clone()))
        };
        let (l0, e0, o0) = widen_scaled(
            priv_load_u(raw, u(0)),
            true,
            [&names[0], &names[1]],
            pair(0),
        );
        let (l1, e1, o1) = widen_scaled(
            priv_load_u(raw, u(1)),
            true,
            [&names[2], &names[3]],
            pair(1),
        );
        out.extend(l0);
        out.extend(l1);
        for (k, v) in [(0, e0), (1, e1), (2, o0), (3, o1)] {
            out.push(Stmt::PrivateStore {
                arr: bf.to_string(),
                index: u(k),
                value: v,
            });
        }
        out
    }

    /// The A fragment registers `af[0..4]` times the per-k scales of a `[K, N]` product's
    /// rows `k0 + 2q + {0, 1, 8, 9}`.
    pub(super) fn scale_a_frag(
        &mut self,
        af: &str,
        a0: Expr,
        scale: &(String, Expr),
        k0: Expr,
    ) -> Result<Vec<Stmt>> {
        let mut out = Vec::new();
        let ks = self.k_scales(scale, k0)?;
        let bound = self.bind_k_scales(&ks, &mut out);
        let sv = |k: usize| bound[k].clone();
        for r in 0..4u32 {
            let (lo, hi) = if r < 2 {
                (sv(0), sv(1))
            } else {
                (sv(2), sv(3))
            };
            let idx = add(a0.clone(), u(r));
            out.push(Stmt::PrivateStore {
                arr: af.to_string(),
                index: idx.clone(),
                value: scale_pair(priv_load_u(af, idx), lo, hi),
            });
        }
        Ok(out)
    }

    /// The per-k scales of a `[K, N]` product's rows `k0 + 2q + {0, 1, 8, 9}` (q: the
    /// lane's quad), the k rows of this lane's A and B fragment values, as expressions: the
    /// caller binds them ([`Cx::bind_k_scales`]) where they are used, so they are not held in
    /// registers across the fragment loads (the sm_120 32-head kernel is at 255).
    pub(super) fn k_scales(&mut self, scale: &(String, Expr), k0: Expr) -> Result<[Expr; 4]> {
        let q2 = mul(self.lane.quad.clone(), u(2));
        let at = |off: u32| self.expr(&scale_at(scale, add(add(k0.clone(), q2.clone()), u(off))));
        Ok([at(0)?, at(1)?, at(8)?, at(9)?])
    }

    /// Lets in `out` holding the four k scales; their values.
    fn bind_k_scales(&mut self, ks: &[Expr; 4], out: &mut Vec<Stmt>) -> [Expr; 4] {
        let names: Vec<String> = (0..4).map(|_| self.fresh("k_scale")).collect();
        for (n, e) in names.iter().zip(ks.iter()) {
            out.push(let_(n, e.clone()));
        }
        let v = |i: usize| var(&names[i], Ty::F32);
        [v(0), v(1), v(2), v(3)]
    }

    /// `acc += A · B` with B an e4m3 `[K, N]` view (optionally scaled per k row) and A bf16 in
    /// shared memory: the accumulator is interleaved (fragment pair `(2j, 2j+1)` = 16
    /// columns, even and odd).
    pub(super) fn mma_e4m3_kn(
        &mut self,
        acc: &str,
        a: &TileView,
        b: &TileView,
        scale: Option<(String, Expr)>,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let KnFrame {
            info,
            tb,
            bb,
            af,
            bf,
            raw,
            kk,
            i,
            jp,
            mut body,
            mut k_body,
            k_row,
            n_byte,
        } = self.kn_frame(acc, a, b)?;
        let (fmw, fnw) = (info.fmw, info.fnw);
        let mma_pairs = |cx: &Self, pair_body: &mut Vec<Stmt>| {
            cx.kn_mma_pairs(acc, &info, (&af, &bf, &i, &jp), false, pair_body)
        };
        match &scale {
            None => {
                let mut pair_body = self.e4m3_kn_b(&tb, bb, k_row, n_byte, &raw, &bf, None);
                mma_pairs(self, &mut pair_body);
                k_body.push(for_const(&jp, fnw / 2, pair_body));
            }
            Some(sc) => {
                // The scales go on B (V, widened anyway), not on A (P): a scaled A fragment
                // is a bf16 unpack, two multiplies and a pack per register, per m fragment,
                // per tile; B's are two multiplies per widened register (1.02-1.06x on the
                // H200, benches/NOTES.md v15). Either way one bf16 rounding of a scaled
                // value. Where the GPU has the e4m3 score product (sm_89, sm_120) q is held
                // as two e4m3 terms and the 32-head kernel is at 255 registers: B's scales
                // spilled 8 B on sm_120 there, so those keep scaling A.
                let ks = self.k_scales(sc, k_row.clone())?;
                let mut on_b = Vec::new();
                let mut pair_b = self.e4m3_kn_b(
                    &tb,
                    bb.clone(),
                    k_row.clone(),
                    n_byte.clone(),
                    &raw,
                    &bf,
                    Some(&ks),
                );
                mma_pairs(self, &mut pair_b);
                on_b.push(for_const(&jp, fnw / 2, pair_b));
                let mut on_a = Vec::new();
                for m in 0..fmw {
                    on_a.extend(self.scale_a_frag(&af, u(4 * m), sc, k_row.clone())?);
                }
                let mut pair_a = self.e4m3_kn_b(&tb, bb, k_row, n_byte, &raw, &bf, None);
                mma_pairs(self, &mut pair_a);
                on_a.push(for_const(&jp, fnw / 2, pair_a));
                k_body.push(Stmt::If {
                    cond: Expr::Call(Func::E4m3MmaNative, vec![]),
                    then: on_a,
                    els: on_b,
                });
            }
        }
        body.push(for_const(&kk, a.cols / 16, k_body));
        out.extend(self.for_used_warps(&info, body));
        Ok(())
    }
}

/// The shared frame of an e4m3 `[K, N]` product ([`Cx::kn_frame`]).
struct KnFrame {
    info: AccInfo,
    tb: TileInfo,
    /// B's tile base (the ring stage's).
    bb: Expr,
    /// Private registers: A fragments, B fragments, B's raw bytes.
    af: String,
    bf: String,
    raw: String,
    /// Loop names: k step, m fragment, n fragment pair.
    kk: String,
    i: String,
    jp: String,
    body: Vec<Stmt>,
    k_body: Vec<Stmt>,
    k_row: Expr,
    n_byte: Expr,
}

/// The running scale of an fp8_ds_mla `P · V` in f16 ([`Cx::mma_e4m3_kn_f16`]): the
/// accumulators of its products hold `O · K` rather than `O`, for one per-thread f32 `K`
/// (private `k[0]`) that makes every operand fit f16.
///
/// A product `acc += P · (E · s)` (E the e4m3 rows, s their per-row scales) runs as
/// `acc += P · (E · r)` with `r = s · K` rounded to f16, so `V · r ≤ 448 · LIMIT` cannot
/// overflow f16 (65504), and `K` is chosen so the largest scale seen so far meets `LIMIT`:
/// rows with scales far below the largest lose f16's subnormal precision only below
/// `2^-14 / LIMIT` of it. At the top of each step each lane takes the largest `|s|` of one
/// row and the warp votes; where the step's largest `m` is past `LIMIT / K`, or below
/// `LOW · LIMIT / K` (`K` starts at `K0`), `K` becomes `LIMIT / m` and the accumulators are
/// multiplied by the ratio: rare, and never for scales in [2^-12, 1].
/// Within the pipeline the accumulators are read only by the online softmax's per-row
/// rescale (linear, so it commutes with `K`); after it they are divided by `K` once
/// ([`Cx::units_end`]), so everything downstream sees `O`.
pub(super) struct Units {
    /// The products of the set, in program order: accumulator, B view, scale.
    pub(super) ops: Vec<(String, TileView, (String, Expr))>,
    /// Rows of the products' K dimension.
    pub(super) k_rows: u32,
    /// Private f32 `[1]`: `K` (−1: not set).
    pub(super) k: String,
}

/// `K · max|s| ≤ LIMIT`: `V · r ≤ 448 · 128 = 57344`, below f16's 65504.
const UNITS_LIMIT: f32 = 128.0;
/// `K` re-chosen also where a step's largest scale is below `LOW · LIMIT / K`, so `r` stays
/// in f16's normal range for the scales the cache has now.
const UNITS_LOW: f32 = 1.0 / 4096.0;
/// `K` before the first step: the scales in [2^-12, 1] (an fp8_ds_mla scale is a tile's
/// largest magnitude / 448) run without a change of `K`, so a call of one step pays no
/// shuffles (measured 2-4 % at T <= 8 with `K` set on the first step).
const UNITS_K0: f32 = UNITS_LIMIT;

impl Cx<'_> {
    /// The `[K, N]` e4m3 products with a scale and an f16 A tile (P) among `stmts`: `(acc,
    /// a, b, scale)`.
    fn f16_kn_products(&self, stmts: &[Stmt]) -> Vec<(String, TileView, TileView, (String, Expr))> {
        let mut out = Vec::new();
        crate::kir::walk::visit_tile_ops_with(stmts, false, &mut |op| {
            if let TileOp::MmaScaled {
                acc,
                a,
                b,
                b_layout: BLayout::KN,
                row,
                scale,
            } = op
            {
                let f16_a = self
                    .tiles
                    .get(&a.tile)
                    .is_some_and(|t| t.store == TileElem::F16);
                let e4m3_b = self
                    .tiles
                    .get(&b.tile)
                    .is_some_and(|t| t.decl.elem == TileElem::E4m3);
                if f16_a && e4m3_b {
                    out.push((
                        acc.clone(),
                        a.clone(),
                        b.clone(),
                        (row.clone(), scale.clone()),
                    ));
                }
            }
        });
        out
    }

    /// Before a pipeline whose steps run f16 `P · V` products: their running scale (see
    /// [`Units`]), `K` not set yet. The accumulators may be read inside the steps only by
    /// those products and the online softmax.
    pub(super) fn units_begin(&mut self, compute: &[Stmt], out: &mut Vec<Stmt>) -> Result<()> {
        let products = self.f16_kn_products(compute);
        if products.is_empty() {
            return Ok(());
        }
        let k_rows = products[0].1.cols;
        if products.iter().any(|p| p.1.cols != k_rows) {
            return Err(
                self.err("f16 [K, N] e4m3 products of one pipeline step must share their K".into())
            );
        }
        let accs: Vec<String> = products.iter().map(|p| p.0.clone()).collect();
        let mut bad = None;
        crate::kir::walk::visit_tile_ops_with(compute, false, &mut |op| {
            let named = match op {
                TileOp::AccFill { acc, .. }
                | TileOp::Mma { acc, .. }
                | TileOp::AccForEach { acc, .. }
                | TileOp::AccRowReduce { acc, .. }
                | TileOp::AccToShared { acc, .. } => Some(acc),
                _ => None,
            };
            if let Some(a) = named.filter(|a| accs.contains(a)) {
                bad = Some(a.clone());
            }
        });
        if let Some(a) = bad {
            return Err(self.err(format!(
                "{a} takes f16 P . V products (held times a running scale inside the \
                 pipeline) and is read or written by another op inside the same steps; read \
                 it after the pipeline"
            )));
        }
        let k = self.private("units_k", Ty::F32, 1);
        out.push(Stmt::Comment(
            "f16 P . V: the accumulators hold O times K, a running scale".into(),
        ));
        out.push(Stmt::PrivateStore {
            arr: k.clone(),
            index: u(0),
            value: Expr::F32(UNITS_K0),
        });
        let units = Units {
            ops: products
                .into_iter()
                .map(|(acc, _, b, sc)| (acc, b, sc))
                .collect(),
            k_rows,
            k,
        };
        // the accumulators as they are, times K
        out.extend(self.units_scale_all(&units, Expr::F32(UNITS_K0))?);
        self.units = Some(units);
        Ok(())
    }

    /// At the top of a pipeline step (its rows landed), before its compute is lowered: the
    /// running scale's update ([`Cx::units_update`]). Nothing without f16 products.
    pub(super) fn units_step(&mut self) -> Result<Vec<Stmt>> {
        let Some(units) = self.units.take() else {
            return Ok(Vec::new());
        };
        let update = self.units_update(&units);
        self.units = Some(units);
        update
    }

    /// After the pipeline: the accumulators of the f16 products back to `O` (divided by `K`;
    /// unchanged where it was never set).
    pub(super) fn units_end(&mut self, out: &mut Vec<Stmt>) -> Result<()> {
        let Some(units) = self.units.take() else {
            return Ok(());
        };
        let kv = priv_load(&units.k, u(0));
        let inv = self.fresh("units_inv");
        out.push(Stmt::Comment(
            "f16 P . V: the accumulators back to O".into(),
        ));
        out.push(let_(&inv, bin(BinOp::Div, Expr::F32(1.0), kv)));
        out.extend(self.units_scale_all(&units, var(&inv, Ty::F32))?);
        Ok(())
    }

    /// Every accumulator of the set times `f`.
    fn units_scale_all(&mut self, units: &Units, f: Expr) -> Result<Vec<Stmt>> {
        let mut out = Vec::new();
        let mut seen: Vec<&str> = Vec::new();
        for (acc, _, _) in &units.ops {
            if seen.contains(&acc.as_str()) {
                continue;
            }
            seen.push(acc);
            let info = self.acc(acc)?.clone();
            let i = self.fresh("units_i");
            let at = var(&i, Ty::U32);
            let lp = for_const(
                &i,
                4 * info.frags(),
                vec![Stmt::PrivateStore {
                    arr: acc.clone(),
                    index: at.clone(),
                    value: bin(BinOp::Mul, priv_load(acc, at), f.clone()),
                }],
            );
            out.extend(self.for_used_warps(&info, vec![lp]));
        }
        Ok(out)
    }

    /// `K` brought down to `LIMIT / m` where the step's largest scale `m` would pass
    /// `LIMIT`, or set on the first nonzero one (see [`Units`]), the accumulators rescaled
    /// with it. The test is a lane's own row and one vote (no shuffle chain, no division):
    /// its cost sits on every step's chain, where its rare branch does not.
    fn units_update(&mut self, units: &Units) -> Result<Vec<Stmt>> {
        let mut out = vec![Stmt::Comment(
            "f16 P . V: K lowered where this step's largest scale would overflow".into(),
        )];
        let m = self.fresh("units_m");
        let mv = var(&m, Ty::F32);
        out.push(Stmt::Var {
            name: m.clone(),
            value: Expr::F32(0.0),
        });
        let base_row = units.ops[0].1.row0;
        for pass in 0..units.k_rows.div_ceil(WARP) {
            // rows past the step's (lanes of a last partial pass) read its last row again
            let r = add(self.lane.lane.clone(), u(pass * WARP));
            let r = if (pass + 1) * WARP > units.k_rows {
                bin(BinOp::Min, r, u(units.k_rows - 1))
            } else {
                r
            };
            for (_, b, sc) in &units.ops {
                if b.row0 != base_row {
                    return Err(self.err(
                        "f16 [K, N] e4m3 products of one step must read the same rows".into(),
                    ));
                }
                let s = self.expr(&scale_at(sc, add(u(base_row), r.clone())))?;
                out.push(Stmt::Assign {
                    name: m.clone(),
                    value: bin(BinOp::Max, mv.clone(), Expr::Call(Func::Abs, vec![s])),
                });
            }
        }
        let (kc, mk, vote) = (
            self.fresh("units_k_old"),
            self.fresh("units_mk"),
            self.fresh("units_vote"),
        );
        let kcv = var(&kc, Ty::F32);
        let mkv = var(&mk, Ty::F32);
        out.push(let_(&kc, priv_load(&units.k, u(0))));
        out.push(let_(&mk, bin(BinOp::Mul, mv.clone(), kcv.clone())));
        out.push(intr(Intrinsic::VoteAny {
            dst: vote.clone(),
            pred: bin(
                BinOp::And,
                bin(BinOp::Gt, mv.clone(), Expr::F32(0.0)),
                bin(
                    BinOp::Or,
                    bin(BinOp::Gt, mkv.clone(), Expr::F32(UNITS_LIMIT)),
                    bin(BinOp::Lt, mkv, Expr::F32(UNITS_LIMIT * UNITS_LOW)),
                ),
            ),
        }));
        // the rare branch (the first step, a new largest scale): the warp's largest scale
        let mut then = self.lanes_reduce(&m, WARP, BinOp::Max);
        let (kn, ratio) = (self.fresh("units_k_new"), self.fresh("units_ratio"));
        then.push(let_(
            &kn,
            bin(
                BinOp::Min,
                bin(BinOp::Div, Expr::F32(UNITS_LIMIT), mv),
                Expr::F32(2f32.powi(100)),
            ),
        ));
        then.push(let_(&ratio, bin(BinOp::Div, var(&kn, Ty::F32), kcv)));
        then.extend(self.units_scale_all(units, var(&ratio, Ty::F32))?);
        then.push(Stmt::PrivateStore {
            arr: units.k.clone(),
            index: u(0),
            value: var(&kn, Ty::F32),
        });
        out.push(Stmt::If {
            cond: var(&vote, Ty::Bool),
            then,
            els: vec![],
        });
        Ok(out)
    }

    /// `acc += P · (E · s)`, P an f16 tile, E an e4m3 `[K, N]` view scaled per k row: as f16
    /// products, `E`'s pairs converted in one instruction each and multiplied by `s · K` in
    /// f16 (see [`Units`]). Outside a pipeline that set up the running scale, the product sets
    /// up and resolves its own.
    pub(super) fn mma_e4m3_kn_f16(
        &mut self,
        acc: &str,
        a: &TileView,
        b: &TileView,
        scale: (String, Expr),
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let own = self.units.is_none();
        if own {
            let op = vec![Stmt::Tile(TileOp::MmaScaled {
                acc: acc.to_string(),
                a: a.clone(),
                b: b.clone(),
                b_layout: BLayout::KN,
                row: scale.0.clone(),
                scale: scale.1.clone(),
            })];
            self.units_begin(&op, out)?;
            let step = self.units_step()?;
            out.extend(step);
        }
        let units = self
            .units
            .take()
            .ok_or_else(|| self.err("f16 P . V without its running scale".into()))?;
        let result = self.mma_e4m3_kn_f16_in(acc, a, b, &scale, &units, out);
        self.units = Some(units);
        result?;
        if own {
            self.units_end(out)?;
        }
        Ok(())
    }

    fn mma_e4m3_kn_f16_in(
        &mut self,
        acc: &str,
        a: &TileView,
        b: &TileView,
        scale: &(String, Expr),
        units: &Units,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        if !units.ops.iter().any(|o| o.0 == acc) {
            return Err(self.err(format!("{acc}: not among the f16 products of this step")));
        }
        let KnFrame {
            info,
            tb,
            bb,
            af,
            bf,
            raw,
            kk,
            i,
            jp,
            mut body,
            mut k_body,
            k_row,
            n_byte,
        } = self.kn_frame(acc, a, b)?;
        let k_unit = self.fresh("units_kq");
        // s · K in the units of the conversion (times 256 where it moves bits)
        body.push(let_(
            &k_unit,
            bin(
                BinOp::Mul,
                priv_load(&units.k, u(0)),
                Expr::Call(Func::E4m3F16Unit, vec![]),
            ),
        ));
        // the lane's k rows 2q, 2q + 1 (matrix 0) and 2q + 8, 2q + 9 (matrix 1), as f16 pairs
        let ks = self.k_scales(scale, k_row.clone())?;
        let kq = var(&k_unit, Ty::F32);
        let r = [self.fresh("units_r01"), self.fresh("units_r89")];
        for (h, name) in r.iter().enumerate() {
            k_body.push(let_(
                name,
                Expr::Call(
                    Func::PackF16x2,
                    vec![
                        bin(BinOp::Mul, ks[2 * h].clone(), kq.clone()),
                        bin(BinOp::Mul, ks[2 * h + 1].clone(), kq.clone()),
                    ],
                ),
            ));
        }
        let mut pair_body = vec![self.kn_b_ldmatrix(&tb, bb, k_row, n_byte, &raw)];
        // even fragment: bytes (0, 2) of each matrix's register, odd: (1, 3)
        for (m, rp) in r.iter().enumerate() {
            let x = priv_load_u(&raw, u(m as u32));
            let even = bin(
                BinOp::BitOr,
                bin(BinOp::BitAnd, x.clone(), u(0xFF)),
                bin(BinOp::BitAnd, bin(BinOp::Shr, x.clone(), u(8)), u(0xFF00)),
            );
            let odd = bin(
                BinOp::BitOr,
                bin(BinOp::BitAnd, bin(BinOp::Shr, x.clone(), u(8)), u(0xFF)),
                bin(BinOp::BitAnd, bin(BinOp::Shr, x, u(16)), u(0xFF00)),
            );
            for (slot, pair) in [(m as u32, even), (2 + m as u32, odd)] {
                pair_body.push(Stmt::PrivateStore {
                    arr: bf.clone(),
                    index: u(slot),
                    value: Expr::Call(
                        Func::MulF16x2,
                        vec![Expr::Call(Func::E4m3x2F16, vec![pair]), var(rp, Ty::U32)],
                    ),
                });
            }
        }
        self.kn_mma_pairs(acc, &info, (&af, &bf, &i, &jp), true, &mut pair_body);
        k_body.push(for_const(&jp, info.fnw / 2, pair_body));
        body.push(for_const(&kk, a.cols / 16, k_body));
        out.extend(self.for_used_warps(&info, body));
        Ok(())
    }

    /// What the bf16 and f16 forms of an e4m3 `[K, N]` product share: the checks, the
    /// registers and loop names, the lane's A row (`body`), each k step's A fragments
    /// (`k_body`), and the k row and n byte of the step and fragment pair.
    fn kn_frame(&mut self, acc: &str, a: &TileView, b: &TileView) -> Result<KnFrame> {
        let info = self.acc(acc)?.clone();
        if !info.interleave {
            return Err(self.err(format!(
                "{acc}: an e4m3 [K, N] product needs an interleaved accumulator"
            )));
        }
        let ta = self.tile(&a.tile)?.clone();
        let tb = self.tile(&b.tile)?.clone();
        if a.cols % 16 != 0 || a.col0 % 8 != 0 || b.col0 % 16 != 0 {
            return Err(self.err(format!(
                "mma into {acc}: K must be a multiple of 16 and the e4m3 columns start on 16 bytes"
            )));
        }
        let ab = self.tile_base(&ta)?;
        let bb = self.tile_base(&tb)?;
        let af = self.private("a_frag", Ty::U32, 4 * info.fmw);
        let bf = self.private("b_frag", Ty::U32, 4);
        let raw = self.private("b_raw", Ty::U32, 2);
        let (kk, i, jp) = (self.fresh("kk"), self.fresh("mi"), self.fresh("np"));
        let (kkv, iv, jpv) = (var(&kk, Ty::U32), var(&i, Ty::U32), var(&jp, Ty::U32));
        let a_base = self.fresh("a_lane_word");
        let body = vec![let_(
            &a_base,
            add(
                add(
                    ab,
                    mul(
                        add(add(u(a.row0), info.row0.clone()), self.lane.r16.clone()),
                        u(ta.stride),
                    ),
                ),
                bin(BinOp::Shr, add(u(a.col0), self.lane.c8.clone()), u(1)),
            ),
        )];
        let k_body = vec![for_const(
            &i,
            info.fmw,
            vec![intr(Intrinsic::LdMatrix {
                count: 4,
                trans: false,
                arr: a.tile.clone(),
                word: add(
                    var(&a_base, Ty::U32),
                    add(mul(iv.clone(), u(16 * ta.stride)), mul(kkv.clone(), u(8))),
                ),
                dst: af.clone(),
                dst0: mul(iv, u(4)),
            })],
        )];
        let k_row = add(u(b.row0), mul(kkv, u(16)));
        let n_byte = add(add(u(b.col0), info.col0.clone()), mul(jpv, u(16)));
        Ok(KnFrame {
            info,
            tb,
            bb,
            af,
            bf,
            raw,
            kk,
            i,
            jp,
            body,
            k_body,
            k_row,
            n_byte,
        })
    }

    /// The two mma of a fragment pair (even, odd columns: B registers 0-1, 2-3) for every m
    /// fragment, bf16 or f16 operands.
    fn kn_mma_pairs(
        &self,
        acc: &str,
        info: &AccInfo,
        (af, bf, i, jp): (&str, &str, &str, &str),
        f16: bool,
        pair_body: &mut Vec<Stmt>,
    ) {
        let (iv, jpv) = (var(i, Ty::U32), var(jp, Ty::U32));
        for (half, b0) in [(0u32, 0u32), (1, 2)] {
            let (c, a, b) = (acc.to_string(), af.to_string(), bf.to_string());
            let c0 = mul(
                add(
                    mul(iv.clone(), u(info.fnw)),
                    add(mul(jpv.clone(), u(2)), u(half)),
                ),
                u(4),
            );
            let (a0, b0) = (mul(iv.clone(), u(4)), u(b0));
            let mma = if f16 {
                Intrinsic::MmaF16 {
                    c,
                    c0,
                    a,
                    a0,
                    b,
                    b0,
                }
            } else {
                Intrinsic::MmaBf16 {
                    c,
                    c0,
                    a,
                    a0,
                    b,
                    b0,
                }
            };
            pair_body.push(for_const(i, info.fmw, vec![intr(mma)]));
        }
    }

    /// The `ldmatrix.x2.trans` of an e4m3 `[K, N]` B pair: matrices (k 0-7, 16 columns
    /// from `n_byte`), (k 8-15, same columns), lanes 0-15 giving the rows.
    fn kn_b_ldmatrix(
        &self,
        tb: &TileInfo,
        base: Expr,
        k_row: Expr,
        n_byte: Expr,
        raw: &str,
    ) -> Stmt {
        let word = add(
            add(
                base,
                mul(
                    add(k_row, bin(BinOp::BitAnd, self.lane.r16.clone(), u(15))),
                    u(tb.stride),
                ),
            ),
            bin(BinOp::Shr, n_byte, u(2)),
        );
        intr(Intrinsic::LdMatrix {
            count: 2,
            trans: true,
            arr: tb.decl.name.clone(),
            word,
            dst: raw.to_string(),
            dst0: u(0),
        })
    }
}
