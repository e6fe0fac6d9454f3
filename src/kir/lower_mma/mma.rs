//! Tensor-core products (`mma.sync` m16n8k16 fed by `ldmatrix`) into accumulators.

use super::context::Cx;
use crate::kir::expr::{add, bin, for_const, intr, let_, mul, priv_load, u, var};
use crate::kir::ir::*;
use crate::Result;

impl Cx<'_> {
    pub(super) fn mma(
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
        if tb.decl.elem == TileElem::E4m3 && layout == BLayout::KN && ta.store == TileElem::F16 {
            let scale = scale.ok_or_else(|| {
                self.err(format!(
                    "mma into {acc}: an f16 A with e4m3 B is the scaled P . V form only"
                ))
            })?;
            return self.mma_e4m3_kn_f16(acc, a, b, scale, out);
        }
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
}
