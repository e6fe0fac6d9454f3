//! The mbarrier-ring form of the tensor-core lowering ([`crate::kir::Lowering::MmaWs`]).
//!
//! The kernel's one top-level pipeline becomes a ring of `stages` shared-memory stages
//! handed over with mbarriers instead of workgroup barriers:
//! - the upper half of the warps — which hold no rows of the split-K products — are also the
//!   *producers* ([`producer_warps`]): at step `i`, right after the step's first workgroup
//!   barrier (the split-K sum, while the lower half sums and runs the softmax), each waits
//!   until every thread has released the stage of step `i - 1` (mbarrier `empty[stage]`, one
//!   arrival per thread), writes its rows' validity flags for step `i + stages - 1`, issues
//!   their copies (`cp.async.bulk` with a transaction count on sm_90 and later, `cp.async`
//!   before; the helper decides per row) and arrives on `full[stage]` (one arrival per
//!   producer lane); then it loads the top-k words of the step after, which are not used
//!   until that step's copies are issued, a step later;
//! - every warp waits on `full[stage]`, computes, and releases the stage.
//!
//! No workgroup barrier orders a stage; the compute's own barriers (online softmax, split-K
//! sums) remain. A dedicated producer warp was tried first: a ninth warp makes ptxas allocate
//! registers for twelve (168 per thread), and the split-K product with q in registers spilled.
//! The ring starts zeroed, so a row without a source holds finite values (see
//! [`TileOp::GatherRows`] with flags).

use super::{
    add, bin, dedupe_barriers, for_const, intr, let_, local_id, lt, mul, u, var, Cx, Error, Result,
    WARP,
};
use crate::kir::expr::select;
use crate::kir::ir::*;
use std::collections::HashSet;

/// Warps that issue the ring's copies: the upper half (the split-K holders, which run the
/// softmax while the copies are issued, are at most the lower half; see `Cx::new`). One warp
/// issuing all rows was the step's critical path: `cp.async.bulk` takes uniform operands, so
/// a warp issues its lanes' copies one lane at a time (32 per step; ncu on the H200).
pub(super) fn producer_warps(warps: u32) -> u32 {
    (warps / 2).max(1)
}

/// mbarrier bookkeeping of the producer/consumer form.
#[derive(Clone, Debug)]
pub(super) struct WsInfo {
    /// Shared array of the mbarriers (two words each): `full[0..stages]`, then
    /// `empty[0..stages]`.
    pub bars: String,
}

impl WsInfo {
    pub(super) fn plan(cx: &mut Cx) -> Result<WsInfo> {
        let bars = cx.fresh("ring_barriers");
        cx.new_shared.push(SharedDecl {
            alias: None,
            name: bars.clone(),
            ty: Ty::U32,
            len: 4 * cx.stages,
        });
        Ok(WsInfo { bars })
    }
}

/// Lower a kernel with one top-level pipeline into the producer/consumer form (see the
/// module doc); a kernel without a pipeline gets the plain tensor-core lowering.
///
/// `groups` > 1: `kernel` is one group's work and the workgroup holds `groups` copies of it
/// (see [`super::groups`]).
///
/// `row_softmax`: split-K accumulators that an online softmax reads are held in rows (see
/// [`crate::kir::Lowering::MmaWs`]).
pub fn lower_ws(
    kernel: &Kernel,
    stages: u32,
    groups: u32,
    l2_ahead: u32,
    (row_softmax, defer_pv): (crate::kir::RowSoftmax, crate::kir::DeferPv),
) -> Result<Kernel> {
    let at = kernel
        .body
        .iter()
        .position(|s| matches!(s, Stmt::Tile(TileOp::Pipeline { .. })));
    let Some(_) = at else {
        return super::lower(kernel, stages, 0, 0);
    };
    let pipelines = kernel
        .body
        .iter()
        .filter(|s| matches!(s, Stmt::Tile(TileOp::Pipeline { .. })))
        .count();
    let err = |message: String| Error::Kir {
        kernel: kernel.name.clone(),
        message,
    };
    if pipelines != 1 || nested_pipeline(&kernel.body) {
        return Err(err(
            "the producer/consumer lowering takes exactly one pipeline, at the top level".into(),
        ));
    }
    let mut cx = Cx::new(kernel, stages, true, groups, row_softmax)?;
    cx.min_workgroups = 1;
    cx.l2_ahead = l2_ahead;
    cx.defer_pv = defer_pv;
    if groups > 1 {
        let (group_var, tid_var) = (cx.fresh("warp_group"), cx.fresh("group_tid"));
        cx.group = Some(super::groups::GroupPlan::new(group_var, tid_var));
    }
    let info = cx.ws.clone().ok_or_else(|| err("no ring plan".into()))?;
    let threads = cx.w;
    let mut lowered = cx.stmts(&kernel.body)?;
    let hoist = std::mem::take(&mut cx.hoist);
    if !hoist.is_empty() {
        let at = hoist_point(&lowered, &hoist).map_err(err)?;
        lowered.splice(at..at, hoist);
    }

    let mut body = std::mem::take(&mut cx.prelude);
    body.extend(lowered);
    let body = dedupe_barriers(body);

    let mut out = kernel.clone();
    out.min_workgroups = 1;
    out.index_terms = true;
    out.body = body;
    out.shared_tiles.clear();
    out.acc_tiles.clear();
    out.shared.extend(cx.new_shared);
    out.privates.extend(cx.new_privates);
    let warps = threads / WARP;
    if let Some(plan) = cx.group.as_ref().filter(|_| groups > 1) {
        let (body, shared) = super::groups::replicate(
            std::mem::take(&mut out.body),
            &out.shared,
            std::slice::from_ref(&info.bars),
            threads,
            groups,
            plan,
        )
        .map_err(err)?;
        out.body = dedupe_barriers(body);
        out.shared = shared;
        out.workgroup_size = threads * groups;
        // Plain subscripts: the bf16 two-group kernel ran 0.98x with its shared arrays
        // addressed as pointer + terms (H200, H 16 T 128), where every one-group kernel
        // gained (benches/NOTES.md, v29).
        out.index_terms = false;
        out.doc.push(format!(
            "{groups} warp groups of {warps} warps, each with its own ring: group g walks steps g, g + {groups}, ...; their softmax states and accumulators merged after the pipeline, the epilogue in group 0."
        ));
        out.doc.push(format!(
            "mbarrier ring per group: {stages} stages; warps {}-{} of a group also issue its gathers (cp.async.bulk on sm_90 and later, cp.async before).",
            warps - producer_warps(warps),
            warps - 1
        ));
        crate::kir::shared_plan::check_fits(&out)?;
        return Ok(out);
    }
    out.doc.push(format!(
        "mbarrier ring: {stages} stages; warps {}-{} also issue the gathers (cp.async.bulk on sm_90 and later, cp.async before).",
        warps - producer_warps(warps),
        warps - 1
    ));
    crate::kir::shared_plan::check_fits(&out)?;
    Ok(out)
}

/// Where `hoist` can go in `body`: right after the last top-level `let` of a name it reads
/// (names it reads that no top-level `let` binds are the kernel's own: parameters, the
/// prelude's lane names). An error if it reads a name bound anywhere else in `body`.
fn hoist_point(body: &[Stmt], hoist: &[Stmt]) -> std::result::Result<usize, String> {
    let mut read = HashSet::new();
    crate::kir::walk::free_reads(hoist, &mut read);
    let mut at = 0;
    let mut top = HashSet::new();
    for (i, s) in body.iter().enumerate() {
        if let Stmt::Let { name, .. } = s {
            top.insert(name.clone());
            if read.contains(name) {
                at = i + 1;
            }
        }
    }
    let mut nested = HashSet::new();
    crate::kir::walk::collect_names(body, &mut nested);
    if let Some(n) = read
        .iter()
        .find(|n| !top.contains(*n) && nested.contains(*n))
    {
        return Err(format!(
            "the first step's index loads read `{n}`, which is not a top-level let"
        ));
    }
    Ok(at)
}

fn nested_pipeline(stmts: &[Stmt]) -> bool {
    fn inner(stmts: &[Stmt]) -> bool {
        stmts.iter().any(|s| match s {
            Stmt::Tile(TileOp::Pipeline { .. }) => true,
            Stmt::If { then, els, .. } => inner(then) || inner(els),
            Stmt::For { body, .. } => inner(body),
            Stmt::Tile(TileOp::AccForEach { body, .. }) => inner(body),
            _ => false,
        })
    }
    stmts.iter().any(|s| match s {
        Stmt::If { then, els, .. } => inner(then) || inner(els),
        Stmt::For { body, .. } => inner(body),
        Stmt::Tile(TileOp::Pipeline { load, compute, .. }) => inner(load) || inner(compute),
        _ => false,
    })
}

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

struct Gather<'a> {
    dst: &'a str,
    dst_word0: u32,
    words: u32,
    src: &'a str,
    row: &'a str,
    src_word: &'a Expr,
    flags: Option<&'a String>,
}

impl Cx<'_> {
    /// Shared arrays of the ring (tiles a pipeline's load stage writes).
    pub(super) fn ring_arrays(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .tiles
            .iter()
            // an alias is zeroed, and reused, with its parent
            .filter(|(_, t)| t.ringed && t.decl.alias.is_none())
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }

    /// `stmts` into the hoisted prologue (`early`) or in place (`out`).
    fn place(&mut self, early: bool, out: &mut Vec<Stmt>, stmts: impl IntoIterator<Item = Stmt>) {
        if early {
            self.hoist.extend(stmts);
        } else {
            out.extend(stmts);
        }
    }

    /// The ring's set-up: its mbarriers initialised, then a workgroup barrier.
    fn ring_init(&mut self) -> Result<Vec<Stmt>> {
        let info = self
            .ws
            .clone()
            .ok_or_else(|| self.err("no ring plan".into()))?;
        let (threads, stages) = (self.w, self.stages);
        // (no stage is zeroed: the producers zero each row that has no source, and every
        // row's validity flag is written at every step)
        let mut body = vec![Stmt::Comment("the ring's mbarriers initialised".into())];
        let mut init = Vec::new();
        for s in 0..stages {
            init.push(intr(Intrinsic::MbarInit {
                bars: info.bars.clone(),
                index: u(s),
                count: WARP * producer_warps(threads / WARP),
            }));
            init.push(intr(Intrinsic::MbarInit {
                bars: info.bars.clone(),
                index: u(stages + s),
                count: threads,
            }));
        }
        body.push(Stmt::If {
            cond: bin(BinOp::Eq, local_id(), u(0)),
            then: init,
            els: vec![],
        });
        body.push(intr(Intrinsic::FenceProxyAsync));
        body.push(Stmt::Barrier);
        Ok(body)
    }

    fn ws_gathers<'a>(&mut self, load: &'a [Stmt]) -> Result<Vec<Gather<'a>>> {
        let mut out = Vec::new();
        for s in load {
            match s {
                Stmt::Tile(TileOp::GatherRows {
                    dst,
                    dst_word0,
                    words,
                    src,
                    row,
                    src_word,
                    flags,
                }) => {
                    out.push(Gather {
                        dst,
                        dst_word0: *dst_word0,
                        words: *words,
                        src,
                        row,
                        src_word,
                        flags: flags.as_ref(),
                    });
                }
                Stmt::Comment(_) => {}
                other => {
                    return Err(self.err(format!(
                        "pipeline load stage may hold only gathers, found {other:?}"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// The ring loop: every warp's wait, compute and release of step `i`, with the producer
    /// warps' issue of step `i + stages - 1` after the compute's first barrier.
    pub(super) fn consumer_loop(
        &mut self,
        v: &str,
        (count, bound): (&Expr, Option<&Expr>),
        load: &[Stmt],
        compute: &[Stmt],
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let info = self
            .ws
            .clone()
            .ok_or_else(|| self.err("no ring plan".into()))?;
        let s = self.stages;
        let gathers = self.ws_gathers(load)?;
        let rows = match gathers.first() {
            Some(g) => self.tile(g.dst)?.decl.rows,
            None => return Err(self.err(format!("pipeline {v} gathers nothing"))),
        };
        let pw = producer_warps(self.warps);
        let first_producer = self.warps - pw;
        let slots = rows.div_ceil(pw * WARP);
        let producer = bin(BinOp::Ge, self.lane.warp.clone(), u(first_producer));
        // row of producer lane `lane` of producer warp `warp - first_producer`, slot `slot`:
        // consecutive rows on consecutive warps, so each warp's lanes 0.. take rows / pw
        let lane = add(
            bin(BinOp::Sub, self.lane.warp.clone(), u(first_producer)),
            mul(self.lane.lane.clone(), u(pw)),
        );
        let slot_rows = pw * WARP;
        // `then` for each row `r` of this producer lane (`lane + slot_rows * slot`, below `rows`)
        let lane_rows = |slot: &str, r: &str, then: Vec<Stmt>| {
            for_const(
                slot,
                slots,
                vec![
                    let_(r, add(lane.clone(), mul(var(slot, Ty::U32), u(slot_rows)))),
                    Stmt::If {
                        cond: lt(var(r, Ty::U32), u(rows)),
                        then,
                        els: vec![],
                    },
                ],
            )
        };
        // The first step's index loads go where their names allow (see below); with q
        // staged in the ring's last stage (`layout`), the ring's set-up and the first steps'
        // copies too, with the step count they read, ahead of q's staging: nothing they write
        // is read before the first step, and the last stage is not filled before it.
        // (`staged_late` implies one warp group and two or more stages: see `layout`)
        let hoisted = bound.is_some() && self.hoist.is_empty();
        let early = hoisted && self.staged_late;
        let count_name = self.fresh(&format!("{v}_count"));
        let count_let = let_(&count_name, self.expr(count)?);
        self.place(early, out, [count_let]);
        // with warp groups, this group's steps: `countv` of them, local step `at` being
        // pipeline step `step_of(at)`; the ring and its parities count local steps
        let (local, step_of) = self.group_steps(var(&count_name, Ty::U32));
        let countv = if self.groups > 1 {
            let n = self.fresh(&format!("{v}_group_count"));
            out.push(let_(&n, local));
            var(&n, Ty::U32)
        } else {
            var(&count_name, Ty::U32)
        };
        // The steps whose index loads may be issued: below the description's load-free bound
        // where it gives one (so the first step's index loads need not wait for a load that
        // `count` reads, e.g. topk_length), else below `count`.
        let mut prefetch_lets = Vec::new();
        let prefetch_countv = match bound {
            Some(b) => {
                let n = self.fresh(&format!("{v}_bound"));
                prefetch_lets.push(let_(&n, self.expr(b)?));
                let (local, _) = self.group_steps(var(&n, Ty::U32));
                if self.groups > 1 {
                    let g = self.fresh(&format!("{v}_group_bound"));
                    prefetch_lets.push(let_(&g, local));
                    var(&g, Ty::U32)
                } else {
                    var(&n, Ty::U32)
                }
            }
            None => countv.clone(),
        };

        // The index loads of step `at`, issued a step before its copies: each producer lane
        // loads the raw words its rows' source expressions read (rows lane + 32 * slot) into
        // registers and does not use them until the copies of step `at` are issued, a whole
        // step later. Computing the source right after the load made the producer warp (a
        // consumer too) wait for the load at every step, and the others wait at the next
        // workgroup barrier.
        let mut prefetched: Vec<Vec<(Expr, String)>> = Vec::new();
        // with `l2_ahead`, the words of the step whose rows the producers ask L2 for next
        let mut l2_words: Vec<Vec<(Expr, String)>> = Vec::new();
        let l2_ahead = self.l2_ahead;
        let mut src_exprs: Vec<Expr> = Vec::new();
        for g in &gathers {
            let e = self.expr(g.src_word)?;
            let mut loads = Vec::new();
            leaf_global_loads(&e, &mut loads);
            let mut pairs = Vec::new();
            let mut l2_pairs = Vec::new();
            for l in loads {
                let arr = self.private(&format!("{}_pre", g.dst), l.ty(), slots);
                pairs.push((l.clone(), arr));
                if l2_ahead > 0 {
                    let arr = self.private(&format!("{}_l2", g.dst), l.ty(), slots);
                    l2_pairs.push((l, arr));
                }
            }
            src_exprs.push(e);
            prefetched.push(pairs);
            l2_words.push(l2_pairs);
        }
        // the leaf loads of step `at`'s sources into the registers of `words`
        let load_words = |cx: &mut Cx, at: Expr, words: &[Vec<(Expr, String)>]| -> Result<Stmt> {
            let mut body = vec![let_(v, step_of(at.clone()))];
            for (g, pairs) in gathers.iter().zip(words) {
                if pairs.is_empty() {
                    continue;
                }
                let slot = cx.fresh("slot");
                let r = cx.fresh("gather_row");
                let rv = var(&r, Ty::U32);
                let mut then = vec![let_(g.row, rv.clone())];
                for (load, arr) in pairs {
                    then.push(Stmt::PrivateStore {
                        arr: arr.clone(),
                        index: var(&slot, Ty::U32),
                        value: load.clone(),
                    });
                }
                body.push(lane_rows(&slot, &r, then));
            }
            Ok(Stmt::If {
                cond: lt(at, prefetch_countv.clone()),
                then: body,
                els: vec![],
            })
        };
        let addr = |cx: &mut Cx, at: Expr| load_words(cx, at, &prefetched);
        // a source expression over the words of `pairs` loaded for slot `slot` (with none,
        // the expression as it is, its loads in place)
        let source = |e: &Expr, pairs: &[(Expr, String)], slot: &str| {
            e.clone()
                .map(&mut |x| match pairs.iter().find(|(load, _)| *load == x) {
                    Some((load, arr)) => Expr::PrivateLoad {
                        arr: arr.clone(),
                        ty: load.ty(),
                        index: Box::new(var(slot, Ty::U32)),
                    },
                    None => x,
                })
        };
        // L2 prefetches of step `at`'s valid rows, from the words of `l2_words` (`loaded`)
        // or with the source's loads in place
        let l2_prefetch = |cx: &mut Cx, at: Expr, loaded: bool| -> Stmt {
            let mut body = vec![let_(v, step_of(at.clone()))];
            for ((g, e), pairs) in gathers.iter().zip(&src_exprs).zip(&l2_words) {
                let slot = cx.fresh("slot");
                let r = cx.fresh("gather_row");
                let rv = var(&r, Ty::U32);
                let src = source(e, if loaded { pairs } else { &[] }, &slot);
                let mut row = vec![let_(g.row, rv)];
                row.extend(cx.l2_prefetch_row(g.src, src, g.words));
                body.push(lane_rows(&slot, &r, row));
            }
            Stmt::If {
                cond: lt(at, countv.clone()),
                then: body,
                els: vec![],
            }
        };
        // flags and row copies of step `at` into its stage, then the arrival on full[stage]
        let issue = |cx: &mut Cx, at: Expr| -> Result<Vec<Stmt>> {
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
            let sw_names: Vec<String> = gathers.iter().map(|_| cx.fresh("src_i32")).collect();
            row_body.push(let_(v, step_of(at.clone())));
            for (((g, n), e), pairs) in gathers
                .iter()
                .zip(&sw_names)
                .zip(&src_exprs)
                .zip(&prefetched)
            {
                // the source expression over the words prefetched a step ago
                let src = source(e, pairs, &slot);
                row_body.push(let_(g.row, rv.clone()));
                row_body.push(let_(n, src));
            }
            let mut flagged = HashSet::new();
            for (g, n) in gathers.iter().zip(&sw_names) {
                let swv = var(n, Ty::I32);
                let valid = bin(BinOp::Ge, swv.clone(), Expr::I32(0));
                if let Some(flags) = g.flags {
                    if flagged.insert(flags.clone()) {
                        let ft = cx.tile(flags)?.clone();
                        let base = cx.tile_base(&ft)?;
                        row_body.push(Stmt::SharedStore {
                            arr: flags.clone(),
                            index: add(base, rv.clone()),
                            value: Expr::Select(
                                Box::new(valid.clone()),
                                Box::new(Expr::F32(1.0)),
                                Box::new(Expr::F32(0.0)),
                            ),
                        });
                    }
                }
                let t = cx.tile(g.dst)?.clone();
                let base = cx.tile_base(&t)?;
                let dst_word = add(add(base, mul(rv.clone(), u(t.stride))), u(g.dst_word0));
                // A row without a source is zeroed here, so that it stays finite (its
                // scores are masked and P is 0 there, but 0 · NaN is NaN): no stage is
                // zeroed up front. The fence orders these generic writes before the bulk
                // copies that later steps issue into the same row, through the full and
                // empty barriers.
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
                        bars: info.bars.clone(),
                        index: stage.clone(),
                    })],
                    els: zero_row,
                });
            }
            cx.stage = saved;
            body.push(lane_rows(&slot, &r, row_body));
            body.push(intr(Intrinsic::CopyArrive {
                bars: info.bars.clone(),
                index: stage,
            }));
            Ok(body)
        };

        out.push(Stmt::Comment(format!(
            "pipeline {v}: {s}-stage mbarrier ring; the producer warps issue the first {} steps",
            s - 1
        )));
        // Step 0's index loads: with a load-free bound they need nothing the kernel computes
        // after its first lets, so they are hoisted there (`lower_ws`), ahead of q's loads and
        // the ring's set-up, whose latency they then overlap (at T = 1 a workgroup's whole
        // time is the chain index load -> row copy -> step). Without one, right before the
        // ring's set-up.
        let first_addr = Stmt::If {
            cond: producer.clone(),
            then: vec![addr(self, u(0))?],
            els: vec![],
        };
        if hoisted {
            self.hoist.extend(prefetch_lets);
            self.hoist.push(first_addr);
        } else {
            out.extend(prefetch_lets);
            out.push(first_addr);
        }
        let init = self.ring_init()?;
        self.place(early, out, init);
        let mut first = Vec::new();
        for k in 0..s - 1 {
            if k > 0 {
                first.push(addr(self, u(k))?);
            }
            first.push(Stmt::If {
                cond: lt(u(k), countv.clone()),
                then: issue(self, u(k))?,
                els: vec![],
            });
        }
        if s > 1 {
            first.push(addr(self, u(s - 1))?);
        }
        let first = Stmt::If {
            cond: producer.clone(),
            then: first,
            els: vec![],
        };
        self.place(early, out, [first]);
        if l2_ahead > 0 {
            // the steps whose copies the first `l2_ahead` loop steps issue: asked for with
            // their loads in place (after q's staging, so those loads do not delay it), then
            // the words of the first step the loop asks L2 for
            // (with one stage, step 0's copies go out at the loop's first step, right after:
            // no time for L2 to help)
            let mut warm = Vec::new();
            for at in (s - 1..s - 1 + l2_ahead).filter(|&at| at > 0) {
                warm.push(l2_prefetch(self, u(at), false));
            }
            warm.push(load_words(self, u(s - 1 + l2_ahead), &l2_words)?);
            out.push(Stmt::Comment(format!(
                "pipeline {v}: the producer warps ask L2 for the rows {l2_ahead} steps past the copies"
            )));
            out.push(Stmt::If {
                cond: producer.clone(),
                then: warm,
                els: vec![],
            });
        }
        let resident = self.resident_softmax(load, compute)?;
        for r in &resident {
            out.extend(self.softmax_load(r)?);
            self.resident.insert(r.m.clone(), r.clone());
        }
        let it = self.fresh(&format!("{v}_i"));
        let itv = var(&it, Ty::U32);
        let stage_name = self.fresh("stage");
        let stage = var(&stage_name, Ty::U32);
        // the producer: step i + s - 1 into the stage step i - 1 released
        let ahead = self.fresh("ahead");
        let aheadv = var(&ahead, Ty::U32);
        // the producer's wait for the release of the stage it refills (step i - 1's)
        let (empty_index, empty_parity) = if s > 1 {
            let prev = bin(BinOp::Sub, itv.clone(), u(1));
            (
                add(u(s), bin(BinOp::Rem, prev.clone(), u(s))),
                bin(BinOp::BitAnd, bin(BinOp::Div, prev, u(s)), u(1)),
            )
        } else {
            (
                u(s),
                bin(BinOp::BitAnd, bin(BinOp::Sub, itv.clone(), u(1)), u(1)),
            )
        };
        let empty_wait = Stmt::If {
            cond: bin(BinOp::Ge, itv.clone(), u(1)),
            then: vec![intr(Intrinsic::MbarWait {
                bars: info.bars.clone(),
                index: empty_index,
                parity: empty_parity,
            })],
            els: vec![],
        };
        let mut rest = issue(self, aheadv.clone())?;
        rest.push(addr(self, add(aheadv.clone(), u(1)))?);
        let mut l2_part = Vec::new();
        if l2_ahead > 0 {
            // L2 is asked for the rows of step `ahead + l2_ahead` from the words loaded at the
            // previous issue, then for the next one's words
            let far = add(aheadv.clone(), u(l2_ahead));
            l2_part.push(l2_prefetch(self, far.clone(), true));
            l2_part.push(load_words(self, add(far, u(1)), &l2_words)?);
        }
        let saved = self.stage.replace(stage.clone());
        // The f16 products' running scale first (the rows have landed): its loads and vote
        // placed before the step's first barrier, in the shadow of S's products, measured
        // 1.0-1.07x slower than here (H200).
        let mut computed = self.units_step()?;
        computed.extend(self.stmts(compute)?);
        self.stage = saved;
        // where each step's closing P · V runs (`deferred_pv`)
        let deferred = self.deferred_pv(v, compute, &computed)?;
        let tail = match &deferred {
            Some(sh) => computed.split_off(sh.last_barrier + 1),
            None => Vec::new(),
        };
        let first_barrier = computed.iter().position(|s| matches!(s, Stmt::Barrier));
        // With one stage the copies go out at the top of the step, and the step waits for
        // them: L2 is asked for the later rows after the step's first barrier instead, when
        // the step's own rows have landed and do not queue behind the prefetches.
        let l2_late = s == 1 && first_barrier.is_some() && !l2_part.is_empty();
        if !l2_late {
            rest.append(&mut l2_part);
        }
        // `then` on the producer warps, for step `ahead` (`stages - 1` past this one) if it
        // exists
        let on_producers = |then: Vec<Stmt>| Stmt::If {
            cond: producer.clone(),
            then: vec![
                let_(&ahead, add(itv.clone(), u(s - 1))),
                Stmt::If {
                    cond: lt(aheadv.clone(), countv.clone()),
                    then,
                    els: vec![],
                },
            ],
            els: vec![],
        };
        // `wait`: the producer waits for the stage's release (see below for when it need not)
        let produce = |wait: bool| {
            let mut when = if wait {
                vec![empty_wait.clone()]
            } else {
                vec![]
            };
            when.extend(rest.clone());
            vec![
                Stmt::Comment(format!(
                    "pipeline {v}: the producer warps issue the rows {} steps ahead",
                    s - 1
                )),
                on_producers(when),
            ]
        };
        let mut body = vec![
            let_(v, step_of(itv.clone())),
            let_(
                &stage_name,
                if s > 1 {
                    bin(BinOp::Rem, itv.clone(), u(s))
                } else {
                    u(0)
                },
            ),
            Stmt::Comment(format!("pipeline {v}: wait for this step's rows, compute")),
            intr(Intrinsic::MbarWait {
                bars: info.bars.clone(),
                index: stage.clone(),
                parity: bin(BinOp::BitAnd, bin(BinOp::Div, itv.clone(), u(s)), u(1)),
            }),
        ];
        if let Some(sh) = &deferred {
            let prev = self.fresh("prev_stage");
            let before = bin(BinOp::Rem, add(itv.clone(), u(s - 1)), u(s));
            let mut pv = vec![Stmt::Comment(format!(
                "pipeline {v}: O += P . V of the previous step{}",
                if sh.early {
                    ""
                } else {
                    " (P is 0 before the first)"
                }
            ))];
            if sh.early {
                // before the wait, in its own block: skipped at step 0
                let wait = body.pop();
                pv.push(let_(&prev, before));
                pv.extend(rename_var(&tail, &stage_name, &prev));
                body.push(Stmt::If {
                    cond: bin(BinOp::Gt, itv.clone(), u(0)),
                    then: pv,
                    els: vec![],
                });
                body.extend(wait);
            } else {
                // step i - 1's stage; at step 0, this step's own (landed, finite) rows under
                // a P that is all zeros, so the product adds exactly 0 without a branch that
                // would keep it apart from the scores
                pv.push(let_(
                    &prev,
                    select(bin(BinOp::Eq, itv.clone(), u(0)), stage.clone(), before),
                ));
                pv.extend(rename_var(&tail, &stage_name, &prev));
                body.extend(pv);
            }
        }
        // The producer's issue goes right after the step's first workgroup barrier (the
        // split-K sum): the warps that do not hold S — the producer among them — wait there
        // for the holders' sum and softmax anyway. Issued at the top of the step instead, its
        // 32 row copies (one lane at a time: cp.async.bulk is a uniform instruction) made the
        // other warps wait at that barrier for the producer (ncu, H200). The stage it fills
        // was released at the end of the previous step, so any point of the step is safe —
        // except with one stage, where the rows it issues are this step's own, waited for at
        // the top.
        // After that first barrier every thread has finished the previous step, the last
        // reader of the stage the producer fills: the barrier orders those reads before the
        // copies, so with one warp group the stage needs no release (no arrivals, no wait on
        // the empty mbarrier): v7 1.00-1.05x (H200, benches/NOTES.md v16). The warp-group
        // kernel keeps its release: without it the fp8 one ran 0.98x at T = 128.
        let released = self.groups > 1 || first_barrier.filter(|_| s > 1).is_none();
        // the step's statements with `mid` right after its first barrier (at `at`)
        let split_at_barrier = |at: usize, mid: Vec<Stmt>| {
            let mut out = computed[..=at].to_vec();
            out.extend(mid);
            out.extend_from_slice(&computed[at + 1..]);
            out
        };
        match first_barrier.filter(|_| s > 1) {
            Some(at) => body.extend(split_at_barrier(at, produce(released))),
            None => {
                // before this step's wait (`body` so far: the step's names and the wait)
                let mut top = produce(true);
                top.append(&mut body);
                body = top;
                match first_barrier.filter(|_| l2_late) {
                    Some(at) => body.extend(split_at_barrier(at, vec![on_producers(l2_part)])),
                    None => body.extend(computed),
                }
            }
        }
        if released {
            body.push(Stmt::Comment(format!(
                "pipeline {v}: release the stage to the producer"
            )));
            // only a stage the producer will fill again is released (every arrival is waited
            // for); every thread arrives for its own reads of the stage (ldmatrix lanes
            // included), so the order is one a tool sees without reasoning about __syncwarp
            body.push(Stmt::If {
                cond: lt(add(itv.clone(), u(s)), countv.clone()),
                then: vec![intr(Intrinsic::MbarArrive {
                    bars: info.bars.clone(),
                    index: add(u(s), stage),
                })],
                els: vec![],
            });
        }
        if let Some(sh) = &deferred {
            out.extend(sh.zero_p.iter().cloned());
        }
        out.push(Stmt::For {
            var: it,
            start: u(0),
            end: countv.clone(),
            step: u(1),
            body,
        });
        if deferred.is_some() {
            // the last step's P · V, on the stage the loop's last step computed on
            let mut last = vec![let_(
                &stage_name,
                bin(BinOp::Rem, bin(BinOp::Sub, countv.clone(), u(1)), u(s)),
            )];
            last.extend(tail);
            out.push(Stmt::Comment(format!(
                "pipeline {v}: O += P . V of the last step"
            )));
            out.push(Stmt::If {
                cond: bin(BinOp::Gt, countv, u(0)),
                then: last,
                els: vec![],
            });
        }
        self.units_end(out)?;
        for r in &resident {
            self.resident.remove(&r.m);
            out.extend(self.softmax_store(r)?);
        }
        if self.groups > 1 {
            out.extend(self.group_merge(&resident)?);
        }
        Ok(())
    }
}

/// The deferred P · V of a ring loop ([`Cx::deferred_pv`]).
pub(super) struct DeferredPv {
    /// Index in the lowered step of its last workgroup barrier: what follows it is P · V.
    pub last_barrier: usize,
    /// P's tile zeroed, then a barrier: what step 0's deferred product reads as P (empty for
    /// [`crate::kir::DeferPv::Early`], which skips step 0's).
    pub zero_p: Vec<Stmt>,
    /// [`crate::kir::DeferPv::Early`]: before the step's wait, skipped at step 0.
    pub early: bool,
}

/// `stmts` with every read of the variable `from` reading `to` instead.
fn rename_var(stmts: &[Stmt], from: &str, to: &str) -> Vec<Stmt> {
    stmts
        .iter()
        .cloned()
        .map(|st| {
            st.map(
                &mut |e| match e {
                    Expr::Var(n, t) if n == from => Expr::Var(to.to_string(), t),
                    e => e,
                },
                &mut |s| s,
            )
        })
        .collect()
}

/// Does `stmts` hold a barrier of any kind, at any depth?
fn has_barrier(stmts: &[Stmt]) -> bool {
    stmts.iter().any(|s| match s {
        Stmt::Barrier => true,
        Stmt::Intrinsic(
            Intrinsic::NamedBarrier { .. }
            | Intrinsic::MbarWait { .. }
            | Intrinsic::MbarArrive { .. }
            | Intrinsic::MbarInit { .. },
        ) => true,
        Stmt::If { then, els, .. } => has_barrier(then) || has_barrier(els),
        Stmt::For { body, .. } => has_barrier(body),
        _ => false,
    })
}

impl Cx<'_> {
    /// Where the ring loop runs each step's closing P · V ([`crate::kir::DeferPv`]): `None`
    /// at the end of the step; else the lowered step's split point, and what goes before the
    /// loop. Deferred, step `i - 1`'s product runs in step `i`, before its first workgroup
    /// barrier: the stage it reads is refilled only after that barrier, and P is rewritten
    /// only after the step's later ones, so neither needs another barrier; the last step's
    /// product follows the loop.
    ///
    /// It needs a step that ends in `O += P · V` alone after its last barrier, in one warp
    /// group with a ring of two or more stages and the scores in fragments: with one stage the
    /// next step's copies overwrite the rows the product reads; warp groups release each
    /// stage through an mbarrier at the end of the step, which would have to follow the
    /// product (not built: bf16's grouped kernel has one stage); and the row forms apply O's
    /// rescale after P's barrier, from factors that do not exist before the first step. [`crate::kir::DeferPv::Top`] needs bf16 rows too. A kernel
    /// outside that is an error (`DecodeConfig::with_defer_pv` asks only where it holds).
    pub(super) fn deferred_pv(
        &mut self,
        v: &str,
        compute: &[Stmt],
        lowered: &[Stmt],
    ) -> Result<Option<DeferredPv>> {
        use crate::kir::DeferPv;
        let form = self.defer_pv;
        if form == DeferPv::Off {
            return Ok(None);
        }
        let refuse = |cx: &Self, why: &str| -> Result<Option<DeferredPv>> {
            Err(cx.err(format!(
                "P . V deferred ({}: SPARSE_MLA_DEFER_PV={}) needs {why}",
                form.suffix(),
                form.env_value()
            )))
        };
        if self.groups > 1 || self.stages < 2 {
            return refuse(self, "one warp group and a ring of two or more stages");
        }
        if self.row_softmax != crate::kir::RowSoftmax::Off {
            return refuse(self, "the scores in fragments");
        }
        if form == DeferPv::Top && self.units.is_some() {
            return refuse(self, "bf16 rows (fp8's f16 products take `early`)");
        }
        let last_op = compute.iter().rfind(|s| !matches!(s, Stmt::Comment(_)));
        let a = match last_op {
            Some(Stmt::Tile(TileOp::Mma { a, .. } | TileOp::MmaScaled { a, .. })) => a,
            _ => return refuse(self, "a step that ends in a product"),
        };
        let ringed = self.tile(&a.tile)?.ringed;
        let decl = self.new_shared.iter().find(|d| d.name == a.tile).cloned();
        let Some(decl) = decl.filter(|d| d.alias.is_none() && !ringed) else {
            return refuse(self, "the product's A operand in a tile of its own (P)");
        };
        let Some(last_barrier) = lowered.iter().rposition(|s| matches!(s, Stmt::Barrier)) else {
            return refuse(self, "a workgroup barrier before the step's product");
        };
        let tail = &lowered[last_barrier + 1..];
        if tail.is_empty() || has_barrier(tail) {
            return refuse(self, "a product after the step's last barrier");
        }
        // the product may read only what is bound before the loop (and the stage, renamed)
        let mut reads = HashSet::new();
        crate::kir::walk::free_reads(tail, &mut reads);
        let mut head = HashSet::new();
        crate::kir::walk::collect_names(&lowered[..=last_barrier], &mut head);
        if let Some(n) = reads.iter().find(|n| *n == v || head.contains(*n)) {
            let why = format!("a product that reads nothing the step computes (it reads `{n}`)");
            return refuse(self, &why);
        }
        if form == DeferPv::Early {
            return Ok(Some(DeferredPv {
                last_barrier,
                zero_p: Vec::new(),
                early: true,
            }));
        }
        let z = self.fresh("zero_p");
        let zero_p = vec![
            Stmt::Comment(format!(
                "{}: zeros, the P of the deferred P . V before the first step",
                decl.name
            )),
            Stmt::For {
                var: z.clone(),
                start: local_id(),
                end: u(decl.len),
                step: u(self.w),
                body: vec![Stmt::SharedStore {
                    arr: decl.name.clone(),
                    index: var(&z, Ty::U32),
                    value: if decl.ty == Ty::F32 {
                        Expr::F32(0.0)
                    } else {
                        u(0)
                    },
                }],
            },
            Stmt::Barrier,
        ];
        Ok(Some(DeferredPv {
            last_barrier,
            zero_p,
            early: false,
        }))
    }
}
