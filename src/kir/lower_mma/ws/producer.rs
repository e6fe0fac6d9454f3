//! The producer warps' side of the ring ([`super`]): which rows each producer lane copies,
//! the index loads it issues a step ahead, the copies and flags of a step into its stage, and
//! the L2 prefetches further ahead.

use super::super::gather::Gather;
use super::super::{add, bin, for_const, intr, let_, lt, mul, u, var, Cx, Result, WARP};
use super::producer_warps;
use crate::kir::ir::*;
use std::collections::HashSet;

/// The global loads of `e` whose own index reads no buffer (each once, in order of
/// appearance): what a gather's source expression can have in flight before it is needed.
fn leaf_global_loads(e: &Expr, out: &mut Vec<Expr>) {
    e.visit(&mut |x| {
        if let Expr::Load { index, .. } | Expr::LoadWord { index, .. } = x {
            let mut reads = false;
            index.visit(&mut |y| reads |= matches!(y, Expr::Load { .. } | Expr::LoadWord { .. }));
            if !reads && !out.contains(x) {
                out.push(x.clone());
            }
        }
    });
}

/// `e` over the words of `pairs` loaded for slot `slot` (with none, `e` as it is, its loads
/// in place).
fn source(e: &Expr, pairs: &[(Expr, String)], slot: &str) -> Expr {
    e.clone()
        .map(&mut |x| match pairs.iter().find(|(load, _)| *load == x) {
            Some((load, arr)) => Expr::PrivateLoad {
                arr: arr.clone(),
                ty: load.ty(),
                index: Box::new(var(slot, Ty::U32)),
            },
            None => x,
        })
}

/// A ring's step counts: `count` (its steps; with warp groups, this group's), `prefetch` (the
/// steps whose index loads may be issued) and the pipeline step of a (group-local) step.
pub(in super::super) struct RingCounts {
    pub count: Expr,
    pub prefetch: Expr,
    pub step_of: Box<dyn Fn(Expr) -> Expr>,
}

/// What the producer warps issue for a ring ([`Cx::consumer_loop`]).
pub(in super::super) struct Producers<'a> {
    /// The pipeline's step variable.
    v: &'a str,
    gathers: Vec<Gather<'a>>,
    /// Rows a stage holds, and how many a producer lane copies (`slots`, `slot_rows` apart).
    rows: u32,
    slots: u32,
    slot_rows: u32,
    /// True on the producer warps.
    pub cond: Expr,
    /// A producer lane's first row.
    lane: Expr,
    pub counts: RingCounts,
    /// Each gather's source expression, and its leaf loads with the registers they are loaded
    /// into a step ahead (`prefetched`) or for the L2 prefetch (`l2_words`, with `l2_ahead`).
    src_exprs: Vec<Expr>,
    prefetched: Vec<Vec<(Expr, String)>>,
    l2_words: Vec<Vec<(Expr, String)>>,
    bars: String,
}

impl<'a> Producers<'a> {
    /// The producer lanes' rows and the registers of their prefetched index words.
    pub(in super::super) fn plan(
        cx: &mut Cx,
        v: &'a str,
        gathers: Vec<Gather<'a>>,
        counts: RingCounts,
        bars: String,
    ) -> Result<Self> {
        let rows = match gathers.first() {
            Some(g) => cx.tile(&g.dst)?.decl.rows,
            None => return Err(cx.err(format!("pipeline {v} gathers nothing"))),
        };
        let pw = producer_warps(cx.warps);
        let first_producer = cx.warps - pw;
        let cond = bin(BinOp::Ge, cx.lane.warp.clone(), u(first_producer));
        // row of producer lane `lane` of producer warp `warp - first_producer`, slot `slot`:
        // consecutive rows on consecutive warps, so each warp's lanes 0.. take rows / pw
        let mut lane = add(
            bin(BinOp::Sub, cx.lane.warp.clone(), u(first_producer)),
            mul(cx.lane.lane.clone(), u(pw)),
        );
        // groups that share the ring each fill every `groups`-th row of it, from their own:
        // the issue (one bulk copy at a time a warp) is split as v7 splits it over its warps
        let fillers = if cx.shares_ring() {
            let group = cx
                .group_expr()
                .ok_or_else(|| cx.err("a shared ring without warp groups".into()))?;
            lane = add(mul(lane, u(cx.groups)), group);
            cx.groups
        } else {
            1
        };
        let slots = rows.div_ceil(pw * WARP * fillers);
        let mut prefetched = Vec::new();
        let mut l2_words = Vec::new();
        let mut src_exprs = Vec::new();
        for g in &gathers {
            let e = cx.expr(&g.src_word)?;
            let mut loads = Vec::new();
            leaf_global_loads(&e, &mut loads);
            let mut pairs = Vec::new();
            let mut l2_pairs = Vec::new();
            for l in loads {
                let arr = cx.private(&format!("{}_pre", g.dst), l.ty(), slots);
                pairs.push((l.clone(), arr));
                if cx.l2_ahead > 0 {
                    let arr = cx.private(&format!("{}_l2", g.dst), l.ty(), slots);
                    l2_pairs.push((l, arr));
                }
            }
            src_exprs.push(e);
            prefetched.push(pairs);
            l2_words.push(l2_pairs);
        }
        Ok(Producers {
            v,
            gathers,
            rows,
            slots,
            slot_rows: pw * WARP * fillers,
            cond,
            lane,
            counts,
            src_exprs,
            prefetched,
            l2_words,
            bars,
        })
    }

    /// The pipeline's step variable.
    pub(in super::super) fn v(&self) -> &'a str {
        self.v
    }

    /// The ring's mbarrier array.
    pub(in super::super) fn bars(&self) -> &str {
        &self.bars
    }

    /// `then` on the producer warps.
    pub(in super::super) fn on_producers(&self, then: Vec<Stmt>) -> Stmt {
        Stmt::If {
            cond: self.cond.clone(),
            then,
            els: vec![],
        }
    }

    /// `then` for each row `r` of this producer lane (`lane + slot_rows * slot`, below `rows`).
    fn lane_rows(&self, slot: &str, r: &str, then: Vec<Stmt>) -> Stmt {
        for_const(
            slot,
            self.slots,
            vec![
                let_(
                    r,
                    add(
                        self.lane.clone(),
                        mul(var(slot, Ty::U32), u(self.slot_rows)),
                    ),
                ),
                Stmt::If {
                    cond: lt(var(r, Ty::U32), u(self.rows)),
                    then,
                    els: vec![],
                },
            ],
        )
    }

    /// The leaf loads of step `at`'s sources into the registers of `words`.
    fn load_words(&self, cx: &mut Cx, at: Expr, words: &[Vec<(Expr, String)>]) -> Stmt {
        let mut body = vec![let_(self.v, (self.counts.step_of)(at.clone()))];
        for (g, pairs) in self.gathers.iter().zip(words) {
            if pairs.is_empty() {
                continue;
            }
            let slot = cx.fresh("slot");
            let r = cx.fresh("gather_row");
            let rv = var(&r, Ty::U32);
            let mut then = vec![let_(&g.row, rv.clone())];
            for (load, arr) in pairs {
                then.push(Stmt::PrivateStore {
                    arr: arr.clone(),
                    index: var(&slot, Ty::U32),
                    value: load.clone(),
                });
            }
            body.push(self.lane_rows(&slot, &r, then));
        }
        Stmt::If {
            cond: lt(at, self.counts.prefetch.clone()),
            then: body,
            els: vec![],
        }
    }

    /// The index loads of step `at`, issued a step before its copies: each producer lane
    /// loads the raw words its rows' source expressions read into registers and does not use
    /// them until the copies of step `at` are issued, a whole step later. Computing the source
    /// right after the load made the producer warp (a consumer too) wait for the load at every
    /// step, and the others wait at the next workgroup barrier.
    pub(in super::super) fn addr(&self, cx: &mut Cx, at: Expr) -> Stmt {
        self.load_words(cx, at, &self.prefetched)
    }

    /// With `l2_ahead`, the words of step `at`, whose rows the producers ask L2 for next.
    pub(in super::super) fn l2_addr(&self, cx: &mut Cx, at: Expr) -> Stmt {
        self.load_words(cx, at, &self.l2_words)
    }

    /// L2 prefetches of step `at`'s valid rows, from the words [`Self::l2_addr`] loaded
    /// (`loaded`) or with the source's loads in place.
    pub(in super::super) fn l2_prefetch(&self, cx: &mut Cx, at: Expr, loaded: bool) -> Stmt {
        let mut body = vec![let_(self.v, (self.counts.step_of)(at.clone()))];
        for ((g, e), pairs) in self.gathers.iter().zip(&self.src_exprs).zip(&self.l2_words) {
            let slot = cx.fresh("slot");
            let r = cx.fresh("gather_row");
            let rv = var(&r, Ty::U32);
            let src = source(e, if loaded { pairs } else { &[] }, &slot);
            let mut row = vec![let_(&g.row, rv)];
            row.extend(cx.l2_prefetch_row(&g.src, src, g.words));
            body.push(self.lane_rows(&slot, &r, row));
        }
        Stmt::If {
            cond: lt(at, self.counts.count.clone()),
            then: body,
            els: vec![],
        }
    }

    /// Flags and row copies of step `at` into its stage, then the arrival on `full[stage]`.
    pub(in super::super) fn issue(&self, cx: &mut Cx, at: Expr) -> Result<Vec<Stmt>> {
        let s = cx.stages;
        let stage_name = cx.fresh("load_stage");
        let stage = var(&stage_name, Ty::U32);
        let mut body = vec![let_(
            &stage_name,
            if s > 1 {
                bin(BinOp::Rem, at.clone(), u(s))
            } else {
                u(0)
            },
        )];
        let saved = cx.stage.replace(stage.clone());
        let slot = cx.fresh("slot");
        let r = cx.fresh("gather_row");
        let rv = var(&r, Ty::U32);
        let mut row_body = Vec::new();
        let sw_names: Vec<String> = self.gathers.iter().map(|_| cx.fresh("src_i32")).collect();
        row_body.push(let_(self.v, (self.counts.step_of)(at.clone())));
        for (((g, n), e), pairs) in self
            .gathers
            .iter()
            .zip(&sw_names)
            .zip(&self.src_exprs)
            .zip(&self.prefetched)
        {
            // the source expression over the words prefetched a step ago
            let src = source(e, pairs, &slot);
            row_body.push(let_(&g.row, rv.clone()));
            row_body.push(let_(n, src));
        }
        let mut flagged = HashSet::new();
        for (g, n) in self.gathers.iter().zip(&sw_names) {
            let swv = var(n, Ty::I32);
            let valid = bin(BinOp::Ge, swv.clone(), Expr::I32(0));
            if let Some(flags) = &g.flags {
                if flagged.insert(flags) {
                    let ft = cx.tile(flags)?.clone();
                    let base = cx.tile_base(&ft)?;
                    row_body.push(Stmt::SharedStore {
                        arr: flags.to_string(),
                        index: add(base, rv.clone()),
                        value: Expr::Select(
                            Box::new(valid.clone()),
                            Box::new(Expr::F32(1.0)),
                            Box::new(Expr::F32(0.0)),
                        ),
                    });
                }
            }
            let t = cx.tile(&g.dst)?.clone();
            let base = cx.tile_base(&t)?;
            let dst_word = add(add(base, mul(rv.clone(), u(t.stride))), u(g.dst_word0));
            // A row without a source is zeroed here, so that it stays finite (its scores are
            // masked and P is 0 there, but 0 · NaN is NaN): no stage is zeroed up front. The
            // fence orders these generic writes before the bulk copies that later steps issue
            // into the same row, through the full and empty barriers.
            let zi = cx.fresh("zero_w");
            let ty = cx
                .new_shared
                .iter()
                .find(|d| d.name == g.dst)
                .map_or(Ty::U32, |d| d.ty);
            let zero_row = vec![
                Stmt::For {
                    var: zi.clone(),
                    start: u(0),
                    end: u(g.words),
                    step: u(1),
                    body: vec![Stmt::SharedStore {
                        arr: g.dst.to_string(),
                        index: add(dst_word.clone(), var(&zi, Ty::U32)),
                        value: if ty == Ty::F32 { Expr::F32(0.0) } else { u(0) },
                    }],
                },
                intr(Intrinsic::FenceProxyAsync),
            ];
            row_body.push(Stmt::If {
                cond: valid,
                then: vec![intr(Intrinsic::CopyAsync {
                    bytes: 4 * g.words,
                    dst: g.dst.to_string(),
                    dst_word,
                    src: g.src.to_string(),
                    src_word: Expr::Cvt(Ty::U32, Box::new(swv)),
                    bars: self.bars.clone(),
                    index: stage.clone(),
                })],
                els: zero_row,
            });
        }
        cx.stage = saved;
        body.push(self.lane_rows(&slot, &r, row_body));
        body.push(intr(Intrinsic::CopyArrive {
            bars: self.bars.clone(),
            index: stage,
        }));
        Ok(body)
    }
}
