//! The portable lowering of tile ops to scalar statements: plain loops over workgroup
//! memory, one thread per element pair. Both emitters can print its output; it is what
//! WGSL always uses and the CUDA fallback.
//!
//! Layouts chosen here:
//! - a shared tile is a row-major array of 32-bit words (F32 tiles of f32), no padding;
//! - an accumulator tile `[M, N]` is spread in element pairs: thread `t` holds pairs
//!   `p = t + i·W` (`i = 0, 1, …`), pair `p` being elements `2p, 2p + 1` of the row-major
//!   tile, in a private array of `2·ceil(M·N / 2W)` f32.
//!
//! Every op that writes shared memory is fenced by a barrier before (write-after-read) and
//! after (read-after-write).

use super::expr::{
    acc_pair_update, add, bin, f32_from_bits, local_id, lt, mul, priv_load, shared_load,
    tile_pair_store, u, var,
};
use super::ir::*;
use super::walk::{
    collect_names, rewrite_expr, rewrite_stmt, rewrite_stmts, visit_tile_ops, Rewrite,
};
use crate::{Error, Result};
use std::collections::{HashMap, HashSet};

/// Lower every tile op of `kernel` to scalar statements.
pub fn lower(kernel: &Kernel) -> Result<Kernel> {
    let mut cx = Cx::new(kernel)?;
    let body = cx.stmts(&kernel.body)?;
    let mut out = kernel.clone();
    out.body = body;
    out.shared_tiles.clear();
    out.acc_tiles.clear();
    out.shared.extend(cx.new_shared);
    out.privates.extend(cx.new_privates);
    Ok(out)
}

struct TileInfo {
    decl: SharedTileDecl,
    /// 32-bit words per row.
    stride: u32,
}

struct AccInfo {
    decl: AccTileDecl,
    /// Pairs held per thread.
    per_thread: u32,
}

struct Cx<'k> {
    kernel: &'k Kernel,
    w: u32,
    tiles: HashMap<String, TileInfo>,
    accs: HashMap<String, AccInfo>,
    used: HashSet<String>,
    counter: u32,
    new_shared: Vec<SharedDecl>,
    new_privates: Vec<PrivateDecl>,
    /// Shared scratch for row reductions, sized for the largest reduced accumulator.
    reduce_scratch: Option<String>,
}

impl Rewrite for Cx<'_> {
    fn tile_op(&mut self, op: &TileOp, out: &mut Vec<Stmt>) -> Result<()> {
        match op {
            TileOp::AccFill { acc, value } => {
                let len = 2 * self.acc(acc)?.per_thread;
                let i = self.fresh("fill_i");
                out.push(Stmt::For {
                    var: i.clone(),
                    start: u(0),
                    end: u(len),
                    step: u(1),
                    body: vec![Stmt::PrivateStore {
                        arr: acc.clone(),
                        index: var(&i, Ty::U32),
                        value: Expr::F32(*value),
                    }],
                });
            }
            TileOp::GatherRows(g) => self.gather(g, out)?,
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
            } => self.mma(acc, a, b, *b_layout, Some((row, scale)), out)?,
            TileOp::AccForEach {
                acc,
                row,
                col,
                v0,
                v1,
                body,
            } => {
                let body = self.stmts(body)?;
                let acc_name = acc.clone();
                let (v0, v1) = (v0.clone(), v1.clone());
                let s = self.for_each_pair(acc, row, col, |_, i| {
                    let i0 = mul(i, u(2));
                    let i1 = add(i0.clone(), u(1));
                    Ok(acc_pair_update(&acc_name, (&v0, &v1), i0, i1, body))
                })?;
                out.push(s);
            }
            TileOp::AccRowReduce { acc, op, dst } => self.row_reduce(acc, *op, dst, out)?,
            // The definition itself: shared row state, loops between barriers.
            TileOp::OnlineSoftmax { expansion, .. } => {
                for s in expansion {
                    rewrite_stmt(self, s, out)?;
                }
            }
            TileOp::AccToShared { acc, dst } => {
                let info = self.tile(dst)?;
                let (stride, elem) = (info.stride, info.decl.elem);
                let (row, col) = (self.fresh("row"), self.fresh("col"));
                let (rv, cv) = (var(&row, Ty::U32), var(&col, Ty::U32));
                let acc_name = acc.clone();
                let dst_name = dst.clone();
                let s = self.for_each_pair(acc, &row, &col, |_, i| {
                    let v0 = priv_load(&acc_name, mul(i.clone(), u(2)));
                    let v1 = priv_load(&acc_name, add(mul(i, u(2)), u(1)));
                    Ok(tile_pair_store(
                        &dst_name,
                        elem,
                        rv.clone(),
                        stride,
                        cv,
                        v0,
                        v1,
                    ))
                })?;
                out.push(Stmt::Barrier);
                out.push(s);
                out.push(Stmt::Barrier);
            }
            TileOp::SharedMap {
                dst,
                row,
                col,
                col0,
                cols,
                value,
            } => self.shared_map(dst, row, col, (*col0, *cols), value, out)?,
            TileOp::DequantRows { dst, .. } => {
                let cols = self.tile(dst)?.decl.cols;
                let col = self.fresh("col");
                let map = op
                    .dequant_as_map(&col, cols)
                    .expect("a DequantRows op has a SharedMap form");
                self.tile_op(&map, out)?;
            }
            TileOp::Pipeline {
                var: v,
                count,
                load,
                compute,
                ..
            } => {
                let mut body = vec![Stmt::Comment(format!("pipeline step {v}: load"))];
                body.extend(self.stmts(load)?);
                body.push(Stmt::Comment(format!("pipeline step {v}: compute")));
                body.extend(self.stmts(compute)?);
                body.push(Stmt::Barrier);
                out.push(Stmt::For {
                    var: v.clone(),
                    start: u(0),
                    end: self.expr(count)?,
                    step: u(1),
                    body,
                });
            }
        }
        Ok(())
    }

    /// Replace tile element loads by shared-array loads.
    fn tile_read(&self, read: Expr) -> Result<Expr> {
        Ok(match read {
            Expr::TileLoad { tile, row, col, .. } => tile_elem(self.tile(&tile)?, *row, *col),
            Expr::TileWord { tile, row, word } => tile_word(self.tile(&tile)?, *row, *word),
            other => other,
        })
    }
}

impl<'k> Cx<'k> {
    fn new(kernel: &'k Kernel) -> Result<Self> {
        let w = kernel.workgroup_size;
        let mut used = HashSet::new();
        collect_names(&kernel.body, &mut used);
        for n in kernel
            .params
            .iter()
            .map(|p| &p.name)
            .chain(kernel.buffers.iter().map(|b| &b.name))
            .chain(kernel.shared.iter().map(|s| &s.name))
            .chain(kernel.privates.iter().map(|s| &s.name))
        {
            used.insert(n.clone());
        }
        let mut cx = Cx {
            kernel,
            w,
            tiles: HashMap::new(),
            accs: HashMap::new(),
            used,
            counter: 0,
            new_shared: Vec::new(),
            new_privates: Vec::new(),
            reduce_scratch: None,
        };
        for t in &kernel.shared_tiles {
            if t.alias.is_some() {
                // WGSL has no typed views of one array's memory
                return Err(cx.err(format!(
                    "tile {} is an alias of another tile's rows: tensor-core lowerings only",
                    t.name
                )));
            }
            let row_bytes = t.cols * t.elem.bytes();
            if row_bytes % 4 != 0 {
                return Err(cx.err(format!("tile {} rows are not whole words", t.name)));
            }
            let stride = row_bytes / 4;
            cx.used.insert(t.name.clone());
            cx.new_shared.push(SharedDecl {
                alias: None,
                name: t.name.clone(),
                ty: if t.elem == TileElem::F32 {
                    Ty::F32
                } else {
                    Ty::U32
                },
                len: stride * t.rows,
            });
            cx.tiles.insert(
                t.name.clone(),
                TileInfo {
                    decl: t.clone(),
                    stride,
                },
            );
        }
        for a in &kernel.acc_tiles {
            let pairs = a.rows * a.cols / 2;
            let per_thread = pairs.div_ceil(w);
            cx.used.insert(a.name.clone());
            cx.new_privates.push(PrivateDecl {
                name: a.name.clone(),
                ty: Ty::F32,
                len: 2 * per_thread,
            });
            cx.accs.insert(
                a.name.clone(),
                AccInfo {
                    decl: a.clone(),
                    per_thread,
                },
            );
        }
        let mut reduce_len = 0;
        visit_tile_ops(&kernel.body, &mut |op| {
            if let TileOp::AccRowReduce { acc, .. } = op {
                if let Some(a) = kernel.acc_tile(acc) {
                    reduce_len = reduce_len.max(a.rows * a.cols);
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
        Ok(cx)
    }

    fn err(&self, message: String) -> Error {
        Error::Kir {
            kernel: self.kernel.name.clone(),
            message,
        }
    }

    fn fresh(&mut self, base: &str) -> String {
        loop {
            let name = format!("{base}{}", self.counter);
            self.counter += 1;
            if self.used.insert(name.clone()) {
                return name;
            }
        }
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

    fn stmts(&mut self, stmts: &[Stmt]) -> Result<Vec<Stmt>> {
        rewrite_stmts(self, stmts)
    }

    fn expr(&self, e: &Expr) -> Result<Expr> {
        rewrite_expr(self, e)
    }

    /// `for (i = 0; i < per_thread; i++) { p = tid + i·W; if (p < pairs) { row; col; body(i) } }`
    fn for_each_pair(
        &mut self,
        acc: &str,
        row: &str,
        col: &str,
        body: impl FnOnce(&mut Self, Expr) -> Result<Vec<Stmt>>,
    ) -> Result<Stmt> {
        let info = self.acc(acc)?;
        let (rows, cols, per_thread) = (info.decl.rows, info.decl.cols, info.per_thread);
        let pairs = rows * cols / 2;
        let i = self.fresh("pair_i");
        let p = self.fresh("pair");
        let iv = var(&i, Ty::U32);
        let pv = var(&p, Ty::U32);
        let mut inner = vec![
            Stmt::Let {
                name: row.into(),
                value: bin(BinOp::Div, mul(pv.clone(), u(2)), u(cols)),
            },
            Stmt::Let {
                name: col.into(),
                value: bin(BinOp::Rem, mul(pv.clone(), u(2)), u(cols)),
            },
        ];
        inner.extend(body(self, iv.clone())?);
        Ok(Stmt::For {
            var: i,
            start: u(0),
            end: u(per_thread),
            step: u(1),
            body: vec![
                Stmt::Let {
                    name: p,
                    value: add(local_id(), mul(iv, u(self.w))),
                },
                Stmt::If {
                    cond: lt(pv, u(pairs)),
                    then: inner,
                    els: vec![],
                },
            ],
        })
    }

    fn gather(&mut self, g: &RowGather, out: &mut Vec<Stmt>) -> Result<()> {
        let (dst, src, row) = (g.dst.as_str(), g.src.as_str(), g.row.as_str());
        let (dst_word0, words, src_word, flags) =
            (g.dst_word0, g.words, &g.src_word, g.flags.as_deref());
        let info = self.tile(dst)?;
        let (rows, stride, f32_tile) =
            (info.decl.rows, info.stride, info.decl.elem == TileElem::F32);
        // Phase 1: one thread per row resolves its source word (or −1) into shared memory.
        let offsets = self.fresh(&format!("{dst}_src"));
        self.new_shared.push(SharedDecl {
            alias: None,
            name: offsets.clone(),
            ty: Ty::I32,
            len: rows,
        });
        out.push(Stmt::Barrier);
        let mut resolve = vec![Stmt::SharedStore {
            arr: offsets.clone(),
            index: var(row, Ty::U32),
            value: self.expr(src_word)?,
        }];
        if let Some(flags) = flags {
            // the row's validity, once, next to its source word
            resolve.push(Stmt::SharedStore {
                arr: flags.into(),
                index: var(row, Ty::U32),
                value: Expr::Select(
                    Box::new(bin(
                        BinOp::Ge,
                        shared_load(&offsets, Ty::I32, var(row, Ty::U32)),
                        Expr::I32(0),
                    )),
                    Box::new(Expr::F32(1.0)),
                    Box::new(Expr::F32(0.0)),
                ),
            });
        }
        out.push(Stmt::For {
            var: row.into(),
            start: local_id(),
            end: u(rows),
            step: u(self.w),
            body: resolve,
        });
        out.push(Stmt::Barrier);
        // Phase 2: all threads copy words; rows without a source become zeros.
        let idx = self.fresh("word_i");
        let (r, w, base, val) = (
            self.fresh("r"),
            self.fresh("w"),
            self.fresh("base"),
            self.fresh("word"),
        );
        let (rv, wv, bv, vv) = (
            var(&r, Ty::U32),
            var(&w, Ty::U32),
            var(&base, Ty::I32),
            var(&val, Ty::U32),
        );
        let stored = if f32_tile {
            f32_from_bits(vv.clone())
        } else {
            vv.clone()
        };
        out.push(Stmt::For {
            var: idx.clone(),
            start: local_id(),
            end: u(rows * words),
            step: u(self.w),
            body: vec![
                Stmt::Let {
                    name: r.clone(),
                    value: bin(BinOp::Div, var(&idx, Ty::U32), u(words)),
                },
                Stmt::Let {
                    name: w.clone(),
                    value: bin(BinOp::Rem, var(&idx, Ty::U32), u(words)),
                },
                Stmt::Let {
                    name: base.clone(),
                    value: shared_load(&offsets, Ty::I32, rv.clone()),
                },
                Stmt::Var {
                    name: val.clone(),
                    value: u(0),
                },
                Stmt::If {
                    cond: bin(BinOp::Ge, bv.clone(), Expr::I32(0)),
                    then: vec![Stmt::Assign {
                        name: val,
                        value: Expr::LoadWord {
                            buf: src.into(),
                            index: Box::new(add(Expr::Cvt(Ty::U32, Box::new(bv)), wv.clone())),
                        },
                    }],
                    els: vec![],
                },
                Stmt::SharedStore {
                    arr: dst.into(),
                    index: add(add(mul(rv, u(stride)), u(dst_word0)), wv),
                    value: stored,
                },
            ],
        });
        out.push(Stmt::Barrier);
        Ok(())
    }

    /// `acc += A · B`; with `scale = (row, value)`, each storage row `r` of B is first
    /// multiplied by `value` (`row` bound to `r`), in f32 before the product, as the
    /// dequantised operand would be.
    fn mma(
        &mut self,
        acc: &str,
        a: &TileView,
        b: &TileView,
        layout: BLayout,
        scale: Option<(&String, &Expr)>,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let k_len = a.cols;
        if self.tile(&a.tile)?.decl.elem == TileElem::E4m3 {
            return Err(self.err(format!(
                "mma into {acc}: an e4m3 tile ({}) can only be the B operand",
                a.tile
            )));
        }
        let scale = match scale {
            Some((row, value)) => Some((row.clone(), self.expr(value)?)),
            None => None,
        };
        // the scale of B storage row `r`, as an expression
        let scale_of = |r: Expr| -> Option<Expr> {
            scale.as_ref().map(|(row, value)| {
                let row = row.clone();
                value.clone().map(&mut |x| match x {
                    Expr::Var(ref n, Ty::U32) if *n == row => r.clone(),
                    other => other,
                })
            })
        };
        if k_len % 2 != 0 || a.col0 % 2 != 0 || b.col0 % 2 != 0 {
            return Err(self.err(format!(
                "mma into {acc}: K ({k_len}) and operand column offsets must be even"
            )));
        }
        let ta = self.tile(&a.tile)?;
        let tb = self.tile(&b.tile)?;
        let (ta_stride, ta_elem) = (ta.stride, ta.decl.elem);
        let (tb_stride, tb_elem) = (tb.stride, tb.decl.elem);
        // The k loop is unrolled: some targets cap the total loop iterations an invocation
        // may run (llvmpipe: 65535 over all loops), and fewer back-edges are cheaper anyway.
        let unroll = [8u32, 4, 2, 1]
            .into_iter()
            .find(|u| k_len % (2 * u) == 0)
            .unwrap_or(1);
        let (row, col) = (self.fresh("row"), self.fresh("col"));
        let (rv, cv) = (var(&row, Ty::U32), var(&col, Ty::U32));
        let (s0, s1, k) = (self.fresh("dot0"), self.fresh("dot1"), self.fresh("k"));
        let kv = var(&k, Ty::U32);
        let names: Vec<Vec<String>> = (0..unroll)
            .map(|_| (0..6).map(|_| self.fresh("op")).collect())
            .collect();
        let acc_name = acc.to_string();
        let (a, b) = (a.clone(), b.clone());
        let s = self.for_each_pair(acc, &row, &col, |_, i| {
            let i0 = mul(i.clone(), u(2));
            let i1 = add(i0.clone(), u(1));
            let s0v = var(&s0, Ty::F32);
            let s1v = var(&s1, Ty::F32);
            let mut k_body = Vec::new();
            for (step, names) in names.iter().enumerate() {
                let kk = add(kv.clone(), u(2 * step as u32));
                let mut bind = |name: &str, e: Expr| {
                    k_body.push(Stmt::Let {
                        name: name.into(),
                        value: e,
                    });
                    var(name, Ty::F32)
                };
                // A[row, k], A[row, k+1]
                let (a0e, a1e) = pair_along_row(
                    &a.tile,
                    ta_stride,
                    ta_elem,
                    add(u(a.row0), rv.clone()),
                    add(u(a.col0), kk.clone()),
                );
                let a0 = bind(&names[0], a0e);
                let a1 = bind(&names[1], a1e);
                // b_kc = B(k, c) for k in {k, k+1}, c in {col, col+1}
                let (b00, b01, b10, b11) = match layout {
                    BLayout::NK => {
                        let (x, y) = pair_along_row(
                            &b.tile,
                            tb_stride,
                            tb_elem,
                            add(u(b.row0), rv_col(&cv, 0)),
                            add(u(b.col0), kk.clone()),
                        );
                        let (z, w) = pair_along_row(
                            &b.tile,
                            tb_stride,
                            tb_elem,
                            add(u(b.row0), rv_col(&cv, 1)),
                            add(u(b.col0), kk.clone()),
                        );
                        (x, z, y, w)
                    }
                    BLayout::KN => {
                        let (x, y) = pair_along_row(
                            &b.tile,
                            tb_stride,
                            tb_elem,
                            add(u(b.row0), kk.clone()),
                            add(u(b.col0), cv.clone()),
                        );
                        let (z, w) = pair_along_row(
                            &b.tile,
                            tb_stride,
                            tb_elem,
                            add(add(u(b.row0), kk.clone()), u(1)),
                            add(u(b.col0), cv.clone()),
                        );
                        (x, y, z, w)
                    }
                };
                // per-row scales: rows are columns (NK) or k (KN)
                let (b00, b01, b10, b11) = match layout {
                    BLayout::NK => {
                        let r0 = add(u(b.row0), rv_col(&cv, 0));
                        let r1 = add(u(b.row0), rv_col(&cv, 1));
                        (
                            scaled(b00, scale_of(r0.clone())),
                            scaled(b01, scale_of(r1.clone())),
                            scaled(b10, scale_of(r0)),
                            scaled(b11, scale_of(r1)),
                        )
                    }
                    BLayout::KN => {
                        let k0 = add(u(b.row0), kk.clone());
                        let k1 = add(k0.clone(), u(1));
                        (
                            scaled(b00, scale_of(k0.clone())),
                            scaled(b01, scale_of(k0)),
                            scaled(b10, scale_of(k1.clone())),
                            scaled(b11, scale_of(k1)),
                        )
                    }
                };
                let b00 = bind(&names[2], b00);
                let b01 = bind(&names[3], b01);
                let b10 = bind(&names[4], b10);
                let b11 = bind(&names[5], b11);
                let fma = |x: Expr, y: Expr, z: Expr| Expr::Call(Func::Fma, vec![x, y, z]);
                k_body.push(Stmt::Assign {
                    name: s0.clone(),
                    value: fma(a1.clone(), b10, fma(a0.clone(), b00, s0v.clone())),
                });
                k_body.push(Stmt::Assign {
                    name: s1.clone(),
                    value: fma(a1, b11, fma(a0, b01, s1v.clone())),
                });
            }
            Ok(vec![
                Stmt::Var {
                    name: s0.clone(),
                    value: priv_load(&acc_name, i0.clone()),
                },
                Stmt::Var {
                    name: s1.clone(),
                    value: priv_load(&acc_name, i1.clone()),
                },
                Stmt::For {
                    var: k.clone(),
                    start: u(0),
                    end: u(k_len),
                    step: u(2 * unroll),
                    body: k_body,
                },
                Stmt::PrivateStore {
                    arr: acc_name.clone(),
                    index: i0,
                    value: s0v,
                },
                Stmt::PrivateStore {
                    arr: acc_name.clone(),
                    index: i1,
                    value: s1v,
                },
            ])
        })?;
        out.push(s);
        Ok(())
    }

    fn row_reduce(&mut self, acc: &str, op: Reduce, dst: &str, out: &mut Vec<Stmt>) -> Result<()> {
        let info = self.acc(acc)?;
        let (rows, cols) = (info.decl.rows, info.decl.cols);
        let scratch = self
            .reduce_scratch
            .clone()
            .ok_or_else(|| self.err("row reduce without scratch".into()))?;
        let (row, col) = (self.fresh("row"), self.fresh("col"));
        let (rv, cv) = (var(&row, Ty::U32), var(&col, Ty::U32));
        let acc_name = acc.to_string();
        let sc = scratch.clone();
        let spill = self.for_each_pair(acc, &row, &col, |_, i| {
            let at = add(mul(rv.clone(), u(cols)), cv.clone());
            Ok(vec![
                Stmt::SharedStore {
                    arr: sc.clone(),
                    index: at.clone(),
                    value: priv_load(&acc_name, mul(i.clone(), u(2))),
                },
                Stmt::SharedStore {
                    arr: sc.clone(),
                    index: add(at, u(1)),
                    value: priv_load(&acc_name, add(mul(i, u(2)), u(1))),
                },
            ])
        })?;
        out.push(Stmt::Barrier);
        out.push(spill);
        out.push(Stmt::Barrier);
        let (r, c, x) = (self.fresh("r"), self.fresh("c"), self.fresh("red"));
        let (r_v, c_v, x_v) = (var(&r, Ty::U32), var(&c, Ty::U32), var(&x, Ty::F32));
        let (init, start, combine) = match op {
            Reduce::Max => (
                shared_load(&scratch, Ty::F32, mul(r_v.clone(), u(cols))),
                1,
                BinOp::Max,
            ),
            Reduce::Sum => (Expr::F32(0.0), 0, BinOp::Add),
        };
        out.push(Stmt::For {
            var: r.clone(),
            start: local_id(),
            end: u(rows),
            step: u(self.w),
            body: vec![
                Stmt::Var {
                    name: x.clone(),
                    value: init,
                },
                Stmt::For {
                    var: c.clone(),
                    start: u(start),
                    end: u(cols),
                    step: u(1),
                    body: vec![Stmt::Assign {
                        name: x.clone(),
                        value: bin(
                            combine,
                            x_v.clone(),
                            shared_load(&scratch, Ty::F32, add(mul(r_v.clone(), u(cols)), c_v)),
                        ),
                    }],
                },
                Stmt::SharedStore {
                    arr: dst.into(),
                    index: r_v,
                    value: x_v,
                },
            ],
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
        let info = self.tile(dst)?;
        let (rows, stride, elem) = (info.decl.rows, info.stride, info.decl.elem);
        // One thread per 32-bit word of the window.
        let per_word = 4 / elem.bytes();
        if col0 % per_word != 0 || cols % per_word != 0 || col0 + cols > info.decl.cols {
            return Err(self.err(format!(
                "shared_map into {dst}: columns {col0}..{} are not whole words",
                col0 + cols
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
        let idx = self.fresh("word_i");
        let iv = var(&idx, Ty::U32);
        let word_value = match elem {
            TileElem::F32 => col_plus(0),
            TileElem::Bf16 => Expr::Call(Func::PackBf16x2, vec![col_plus(0), col_plus(1)]),
            TileElem::F16 => Expr::Call(Func::PackF16x2, vec![col_plus(0), col_plus(1)]),
            TileElem::U8 | TileElem::E4m3 => {
                let mut w = bin(BinOp::BitAnd, col_plus(0), u(0xFF));
                for k in 1..4 {
                    let byte = bin(BinOp::BitAnd, col_plus(k), u(0xFF));
                    w = bin(BinOp::BitOr, w, bin(BinOp::Shl, byte, u(8 * k)));
                }
                w
            }
        };
        let (r, w) = (self.fresh("r"), self.fresh("w"));
        let (rv, wv) = (var(&r, Ty::U32), var(&w, Ty::U32));
        out.push(Stmt::Barrier);
        out.push(Stmt::For {
            var: idx,
            start: local_id(),
            end: u(rows * words_per_row),
            step: u(self.w),
            body: vec![
                Stmt::Let {
                    name: r,
                    value: bin(BinOp::Div, iv.clone(), u(words_per_row)),
                },
                Stmt::Let {
                    name: w,
                    value: add(bin(BinOp::Rem, iv, u(words_per_row)), u(word0)),
                },
                Stmt::Let {
                    name: row.into(),
                    value: rv.clone(),
                },
                Stmt::Let {
                    name: col.into(),
                    value: mul(wv.clone(), u(per_word)),
                },
                Stmt::SharedStore {
                    arr: dst.into(),
                    index: add(mul(rv, u(stride)), wv),
                    value: word_value,
                },
            ],
        });
        out.push(Stmt::Barrier);
        Ok(())
    }
}

fn scaled(x: Expr, scale: Option<Expr>) -> Expr {
    match scale {
        Some(s) => bin(BinOp::Mul, x, s),
        None => x,
    }
}

fn rv_col(col: &Expr, k: u32) -> Expr {
    if k == 0 {
        col.clone()
    } else {
        add(col.clone(), u(k))
    }
}

/// Element (row, col) of a shared tile as stored by this lowering.
fn tile_elem(info: &TileInfo, row: Expr, col: Expr) -> Expr {
    let name = &info.decl.name;
    match info.decl.elem {
        TileElem::F32 => shared_load(name, Ty::F32, add(mul(row, u(info.stride)), col)),
        TileElem::Bf16 => {
            let word = shared_load(
                name,
                Ty::U32,
                add(mul(row, u(info.stride)), bin(BinOp::Shr, col.clone(), u(1))),
            );
            // low half for even columns, high half for odd ones
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
                add(mul(row, u(info.stride)), bin(BinOp::Shr, col.clone(), u(1))),
            );
            let shift = bin(BinOp::Mul, bin(BinOp::BitAnd, col, u(1)), u(16));
            Expr::Call(Func::F16Lo, vec![bin(BinOp::Shr, word, shift)])
        }
        TileElem::U8 | TileElem::E4m3 => {
            let word = shared_load(
                name,
                Ty::U32,
                add(mul(row, u(info.stride)), bin(BinOp::Shr, col.clone(), u(2))),
            );
            let shift = bin(BinOp::Mul, bin(BinOp::BitAnd, col, u(3)), u(8));
            let byte = bin(BinOp::BitAnd, bin(BinOp::Shr, word, shift), u(0xFF));
            if info.decl.elem == TileElem::E4m3 {
                e4m3_value(byte)
            } else {
                byte
            }
        }
    }
}

/// The f32 value of an e4m3 byte (u32 holding the bits).
pub(crate) fn e4m3_value(byte: Expr) -> Expr {
    Expr::Cvt(Ty::F32, Box::new(Expr::Cvt(Ty::F8E4M3, Box::new(byte))))
}

/// Word `word` of row `row` of a shared tile, as u32.
fn tile_word(info: &TileInfo, row: Expr, word: Expr) -> Expr {
    let name = &info.decl.name;
    let at = add(mul(row, u(info.stride)), word);
    match info.decl.elem {
        TileElem::F32 => Expr::Call(Func::F32Bits, vec![shared_load(name, Ty::F32, at)]),
        _ => shared_load(name, Ty::U32, at),
    }
}

/// Elements (row, col) and (row, col + 1), `col` even: one word for bf16 tiles.
fn pair_along_row(tile: &str, stride: u32, elem: TileElem, row: Expr, col: Expr) -> (Expr, Expr) {
    match elem {
        TileElem::E4m3 => {
            let word = shared_load(
                tile,
                Ty::U32,
                add(mul(row, u(stride)), bin(BinOp::Shr, col.clone(), u(2))),
            );
            // bytes 2·(col/2 % 2) and the next of the word
            let shift = bin(BinOp::Mul, bin(BinOp::BitAnd, col, u(2)), u(8));
            let lo = bin(BinOp::Shr, word, shift);
            (
                e4m3_value(bin(BinOp::BitAnd, lo.clone(), u(0xFF))),
                e4m3_value(bin(BinOp::BitAnd, bin(BinOp::Shr, lo, u(8)), u(0xFF))),
            )
        }
        TileElem::Bf16 => {
            let word = shared_load(
                tile,
                Ty::U32,
                add(mul(row, u(stride)), bin(BinOp::Shr, col, u(1))),
            );
            (
                f32_from_bits(bin(BinOp::Shl, word.clone(), u(16))),
                f32_from_bits(bin(BinOp::BitAnd, word, u(0xFFFF_0000))),
            )
        }
        TileElem::F16 => {
            let word = shared_load(
                tile,
                Ty::U32,
                add(mul(row, u(stride)), bin(BinOp::Shr, col, u(1))),
            );
            (
                Expr::Call(Func::F16Lo, vec![word.clone()]),
                Expr::Call(Func::F16Hi, vec![word]),
            )
        }
        _ => {
            let at = add(mul(row, u(stride)), col);
            (
                shared_load(tile, Ty::F32, at.clone()),
                shared_load(tile, Ty::F32, add(at, u(1))),
            )
        }
    }
}
