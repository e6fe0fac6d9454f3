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

use super::{add, bin, dedupe_barriers, intr, let_, local_id, lt, u, var, Cx, Error, Result, WARP};
use crate::kir::ir::*;
use producer::{Producers, RingCounts};
use std::collections::HashSet;

mod producer;

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
/// (see `lower_mma/groups.rs`), which deal out the steps or split the heads (`group_by`).
///
/// `row_softmax`: split-K accumulators that an online softmax reads are held in rows (see
/// [`crate::kir::Lowering::MmaWs`]).
pub fn lower_ws(
    kernel: &Kernel,
    stages: u32,
    (groups, group_by): (u32, crate::kir::GroupBy),
    l2_ahead: u32,
    row_softmax: crate::kir::RowSoftmax,
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
    cx.group_by = group_by;
    if groups > 1 {
        let (group_var, tid_var) = (cx.fresh("warp_group"), cx.fresh("group_tid"));
        cx.group = Some(super::groups::GroupPlan::new(group_var, tid_var));
    }
    let info = cx.ws.clone().ok_or_else(|| err("no ring plan".into()))?;
    let threads = cx.w;
    let shares_ring = cx.shares_ring();
    let mut lowered = cx.stmts(&kernel.body)?;
    let hoist = std::mem::take(&mut cx.hoist);
    if !hoist.is_empty() {
        let at = hoist_point(&lowered, &hoist).map_err(err)?;
        lowered.splice(at..at, hoist);
    }

    let mut body = std::mem::take(&mut cx.prelude);
    body.extend(lowered);
    let body = dedupe_barriers(body);

    let ring_arrays = cx.ring_arrays();
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
        let producers = format!("{}-{}", warps - producer_warps(warps), warps - 1);
        let (replicated, docs) = if shares_ring {
            let mut ring = ring_arrays;
            ring.push(info.bars.clone());
            // a tile rows are decoded into is the workgroup's, like the ring (see
            // `Cx::dequant_rows`)
            crate::kir::walk::visit_tile_ops_with(&kernel.body, false, &mut |op| {
                if let TileOp::DequantRows { dst, .. } = op {
                    ring.push(dst.clone());
                }
            });
            (
                super::groups::replicate_heads(
                    std::mem::take(&mut out.body),
                    &out.shared,
                    (&ring, std::slice::from_ref(&info.bars)),
                    threads,
                    groups,
                    plan,
                ),
                [
                    format!("{groups} warp groups of {warps} warps, each with its own heads (group g: head block {groups} x + g of the grid's x), walking every step over one shared ring; each group writes its own rows."),
                    format!("mbarrier ring: {stages} stages, shared by the groups; warps {producers} of each group issue every {groups}-th row's gather from the group's own (cp.async.bulk on sm_90 and later, cp.async before); a stage is refilled once every thread of every group has released it."),
                ],
            )
        } else {
            (
                super::groups::replicate(
                    std::mem::take(&mut out.body),
                    &out.shared,
                    std::slice::from_ref(&info.bars),
                    threads,
                    groups,
                    plan,
                ),
                [
                    format!("{groups} warp groups of {warps} warps, each with its own ring: group g walks steps g, g + {groups}, ...; their softmax states and accumulators merged after the pipeline, the epilogue in group 0."),
                    format!("mbarrier ring per group: {stages} stages; warps {producers} of a group also issue its gathers (cp.async.bulk on sm_90 and later, cp.async before)."),
                ],
            )
        };
        let (body, shared) = replicated.map_err(err)?;
        out.body = dedupe_barriers(body);
        out.shared = shared;
        out.workgroup_size = threads * groups;
        if !shares_ring {
            // Plain subscripts: the bf16 two-group kernel ran 0.98x with its shared arrays
            // addressed as pointer + terms (H200, H 16 T 128), where every one-group kernel
            // gained (benches/NOTES.md, v29).
            out.index_terms = false;
        }
        out.doc.extend(docs);
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
            // the copies: every producer lane of every group that fills the ring; the
            // release: every thread of every group that reads it
            let groups = if self.shares_ring() { self.groups } else { 1 };
            init.push(intr(Intrinsic::MbarInit {
                bars: info.bars.clone(),
                index: u(s),
                count: WARP * producer_warps(threads / WARP) * groups,
            }));
            let readers = threads * groups;
            init.push(intr(Intrinsic::MbarInit {
                bars: info.bars.clone(),
                index: u(stages + s),
                count: readers,
            }));
        }
        // (groups that share the ring: once, by group 0's first thread)
        let mut first = bin(BinOp::Eq, local_id(), u(0));
        if self.shares_ring() {
            let group = self
                .group_expr()
                .ok_or_else(|| self.err("a shared ring without warp groups".into()))?;
            first = bin(BinOp::And, first, bin(BinOp::Eq, group, u(0)));
        }
        body.push(Stmt::If {
            cond: first,
            then: init,
            els: vec![],
        });
        body.push(intr(Intrinsic::FenceProxyAsync));
        body.push(Stmt::Barrier);
        Ok(body)
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
        let bars = match &self.ws {
            Some(info) => info.bars.clone(),
            None => return Err(self.err("no ring plan".into())),
        };
        let gathers = self.load_gathers(v, load)?;
        // The first step's index loads go where their names allow (see `ring_prologue`); with
        // q staged in the ring's last stage (`layout`), the ring's set-up and the first
        // steps' copies too, with the step count they read, ahead of q's staging: nothing
        // they write is read before the first step, and the last stage is not filled before
        // it. (`staged_late` implies one warp group and two or more stages: see `layout`)
        let hoisted = bound.is_some() && self.hoist.is_empty();
        let early = hoisted && self.staged_late;
        let (counts, prefetch_lets) = self.ring_counts(v, (count, bound), early, out)?;
        let producers = Producers::plan(self, v, gathers, counts, bars)?;
        out.push(Stmt::Comment(format!(
            "pipeline {v}: {}-stage mbarrier ring; the producer warps issue the first {} steps",
            self.stages,
            self.stages - 1
        )));
        self.ring_prologue(&producers, (hoisted, early), prefetch_lets, out)?;
        let resident = self.resident_softmax(load, compute)?;
        for r in &resident {
            out.extend(self.softmax_load(r)?);
            self.resident.insert(r.m.clone(), r.clone());
        }
        self.ring_steps(&producers, compute, out)?;
        self.units_end(out)?;
        for r in &resident {
            self.resident.remove(&r.m);
            out.extend(self.softmax_store(r)?);
        }
        if self.deals_steps() {
            out.extend(self.group_merge(&resident)?);
        }
        Ok(())
    }

    /// The ring's step counts, their lets into `out` (or the hoisted prologue, `early`), and
    /// the lets of the prefetch bound, which go with the first step's index loads.
    fn ring_counts(
        &mut self,
        v: &str,
        (count, bound): (&Expr, Option<&Expr>),
        early: bool,
        out: &mut Vec<Stmt>,
    ) -> Result<(RingCounts, Vec<Stmt>)> {
        let count_name = self.fresh(&format!("{v}_count"));
        let count_let = let_(&count_name, self.expr(count)?);
        self.place(early, out, [count_let]);
        // with warp groups, this group's steps: `countv` of them, local step `at` being
        // pipeline step `step_of(at)`; the ring and its parities count local steps
        let (local, step_of) = self.group_steps(var(&count_name, Ty::U32));
        let countv = if self.deals_steps() {
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
        let prefetch = match bound {
            Some(b) => {
                let n = self.fresh(&format!("{v}_bound"));
                prefetch_lets.push(let_(&n, self.expr(b)?));
                let (local, _) = self.group_steps(var(&n, Ty::U32));
                if self.deals_steps() {
                    let g = self.fresh(&format!("{v}_group_bound"));
                    prefetch_lets.push(let_(&g, local));
                    var(&g, Ty::U32)
                } else {
                    var(&n, Ty::U32)
                }
            }
            None => countv.clone(),
        };
        let counts = RingCounts {
            count: countv,
            prefetch,
            step_of: Box::new(step_of),
        };
        Ok((counts, prefetch_lets))
    }

    /// Before the loop: the first step's index loads, the ring's set-up, the copies of the
    /// first `stages - 1` steps and, with `l2_ahead`, the first L2 prefetches.
    fn ring_prologue(
        &mut self,
        p: &Producers,
        (hoisted, early): (bool, bool),
        prefetch_lets: Vec<Stmt>,
        out: &mut Vec<Stmt>,
    ) -> Result<()> {
        let s = self.stages;
        // Step 0's index loads: with a load-free bound they need nothing the kernel computes
        // after its first lets, so they are hoisted there (`lower_ws`), ahead of q's loads and
        // the ring's set-up, whose latency they then overlap (at T = 1 a workgroup's whole
        // time is the chain index load -> row copy -> step). Without one, right before the
        // ring's set-up.
        let first_addr = p.on_producers(vec![p.addr(self, u(0))]);
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
                first.push(p.addr(self, u(k)));
            }
            first.push(Stmt::If {
                cond: lt(u(k), p.counts.count.clone()),
                then: p.issue(self, u(k))?,
                els: vec![],
            });
        }
        if s > 1 {
            first.push(p.addr(self, u(s - 1)));
        }
        let first = p.on_producers(first);
        self.place(early, out, [first]);
        let l2_ahead = self.l2_ahead;
        if l2_ahead > 0 {
            // the steps whose copies the first `l2_ahead` loop steps issue: asked for with
            // their loads in place (after q's staging, so those loads do not delay it), then
            // the words of the first step the loop asks L2 for
            // (with one stage, step 0's copies go out at the loop's first step, right after:
            // no time for L2 to help)
            let mut warm = Vec::new();
            for at in (s - 1..s - 1 + l2_ahead).filter(|&at| at > 0) {
                warm.push(p.l2_prefetch(self, u(at), false));
            }
            warm.push(p.l2_addr(self, u(s - 1 + l2_ahead)));
            out.push(Stmt::Comment(format!(
                "pipeline {}: the producer warps ask L2 for the rows {l2_ahead} steps past the copies",
                p.v()
            )));
            out.push(p.on_producers(warm));
        }
        Ok(())
    }

    /// The loop over the ring's steps.
    fn ring_steps(&mut self, p: &Producers, compute: &[Stmt], out: &mut Vec<Stmt>) -> Result<()> {
        let (s, v, bars) = (self.stages, p.v(), p.bars().to_string());
        let countv = p.counts.count.clone();
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
                bars: bars.clone(),
                index: empty_index,
                parity: empty_parity,
            })],
            els: vec![],
        };
        let mut rest = p.issue(self, aheadv.clone())?;
        rest.push(p.addr(self, add(aheadv.clone(), u(1))));
        let mut l2_part = Vec::new();
        if self.l2_ahead > 0 {
            // L2 is asked for the rows of step `ahead + l2_ahead` from the words loaded at the
            // previous issue, then for the next one's words
            let far = add(aheadv.clone(), u(self.l2_ahead));
            l2_part.push(p.l2_prefetch(self, far.clone(), true));
            l2_part.push(p.l2_addr(self, add(far, u(1))));
        }
        let saved = self.stage.replace(stage.clone());
        // The f16 products' running scale first (the rows have landed): its loads and vote
        // placed before the step's first barrier, in the shadow of S's products, measured
        // 1.0-1.07x slower than here (H200).
        let mut computed = self.units_step()?;
        computed.extend(self.stmts(compute)?);
        self.stage = saved;
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
        let on_producers = |then: Vec<Stmt>| {
            p.on_producers(vec![
                let_(&ahead, add(itv.clone(), u(s - 1))),
                Stmt::If {
                    cond: lt(aheadv.clone(), countv.clone()),
                    then,
                    els: vec![],
                },
            ])
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
            let_(v, (p.counts.step_of)(itv.clone())),
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
                bars: bars.clone(),
                index: stage.clone(),
                parity: bin(BinOp::BitAnd, bin(BinOp::Div, itv.clone(), u(s)), u(1)),
            }),
        ];
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
                    bars,
                    index: add(u(s), stage),
                })],
                els: vec![],
            });
        }
        out.push(Stmt::For {
            var: it,
            start: u(0),
            end: countv,
            step: u(1),
            body,
        });
        Ok(())
    }
}
