//! Warp groups ([`crate::kir::Lowering::MmaWs`] with `groups > 1`): one workgroup, several
//! independent copies of a kernel lowered for a smaller workgroup.
//!
//! Why: a step of the producer/consumer form is a chain (wait for the rows, S, its split-K
//! sum, the row max, P, P · V) with workgroup barriers between its links; with one workgroup per
//! multiprocessor (SM120's shared-memory budget) nothing else runs while the chain waits. Groups
//! of a few warps, each walking its own steps with its own ring and barriers, put several short
//! chains on the multiprocessor at once — what a second workgroup per multiprocessor does on an
//! H100, inside SM120's one.
//!
//! How: the kernel describes one group's work (its workgroup size is the group's). It is
//! lowered as usual, with the pipeline's steps dealt out round-robin (group `g` takes steps
//! `g`, `g + groups`, ...), then [`replicate`] makes the copies: every shared array gets one
//! copy per group (indices offset by the group), the thread index becomes the index within the
//! group, and each workgroup barrier inside the pipeline becomes a named barrier of the group's
//! threads (id `1 + group`; the groups' step counts differ by one when the steps do not divide
//! evenly). Barriers at the top level (the prologue, the states stored after the pipeline) are
//! passed once by every thread and stay the workgroup's. After the pipeline the states meet:
//!
//! ```text
//! M   = max_g m_g                     per row (the running maxima)
//! f_g = exp(m_g − M)
//! L   = Σ_g f_g · l_g
//! O   = Σ_g f_g · O_g                 (through shared memory, one group at a time)
//! ```
//!
//! and group 0, now holding `(M, L, O)` as if it had walked every step, runs the rest of the
//! kernel (the epilogue) alone.

use super::softmax::SoftmaxRegs;
use super::{add, bin, intr, let_, local_id, mul, priv_load, u, var, Cx, Result};
use crate::kir::expr::{exp, f32_bits, f32_from_bits, select, shared_load};
use crate::kir::ir::*;
use crate::kir::GroupBy;
use std::collections::HashMap;

/// Comments that mark where [`replicate`] splits the lowered body: the per-group code before
/// the merge, the merge of the accumulators, the epilogue (group 0).
const MERGE_MARK: &str = "warp groups: merge the groups' softmax states and accumulators";
const COMBINE_MARK: &str = "warp groups: group 0 adds the other groups' accumulators, scaled";
const EPILOGUE_MARK: &str = "warp groups: the rest of the kernel runs in group 0";

/// What the lowering of a grouped kernel records for [`replicate`].
#[derive(Clone, Debug, Default)]
pub(super) struct GroupPlan {
    /// Name of the variable holding this thread's group (`local_id / group threads`).
    pub(super) group_var: String,
    /// Name of the variable holding the thread's index within its group.
    pub(super) tid_var: String,
    /// The shared row state `(m, l, rows)` of each online softmax merged after the pipeline.
    states: Vec<(String, String, u32)>,
    /// Shared array of the merge factors `f_g` ([groups, rows] per state, one workgroup copy).
    factors: String,
    /// Name the merge uses for the accumulator exchange: an alias of `ring`, the largest ring
    /// array (dead once every group has left the pipeline), resolved once the copies are made
    /// (the exchange spans the workgroup, not one group's copy).
    exchange: String,
    ring: String,
}

impl GroupPlan {
    pub(super) fn new(group_var: String, tid_var: String) -> Self {
        GroupPlan {
            group_var,
            tid_var,
            ..Default::default()
        }
    }
}

impl Cx<'_> {
    /// Do warp groups deal out the pipeline's steps ([`GroupBy::Steps`] with more than one
    /// group)?
    pub(super) fn deals_steps(&self) -> bool {
        self.groups > 1 && self.group_by == GroupBy::Steps
    }

    /// Do warp groups split the heads and share one ring ([`GroupBy::Heads`])?
    pub(super) fn shares_ring(&self) -> bool {
        self.groups > 1 && self.group_by == GroupBy::Heads
    }

    /// The group of this thread (u32), in a grouped lowering.
    pub(super) fn group_expr(&self) -> Option<Expr> {
        self.group.as_ref().map(|g| var(&g.group_var, Ty::U32))
    }

    /// Steps `0..count` dealt out to the groups: how many this thread's group takes, and the
    /// global step of its local step `at`. Groups that split the heads walk every step.
    pub(super) fn group_steps(&self, count: Expr) -> (Expr, impl Fn(Expr) -> Expr) {
        let groups = if self.deals_steps() { self.groups } else { 1 };
        let group = self.group_expr().unwrap_or(u(0));
        let local = if groups > 1 {
            select(
                bin(BinOp::Gt, count.clone(), group.clone()),
                bin(
                    BinOp::Div,
                    add(bin(BinOp::Sub, count, group.clone()), u(groups - 1)),
                    u(groups),
                ),
                u(0),
            )
        } else {
            count
        };
        let step_of = move |at: Expr| {
            if groups > 1 {
                add(group.clone(), mul(at, u(groups)))
            } else {
                at
            }
        };
        (local, step_of)
    }

    /// After the pipeline and the softmax states' store: the merge of this group's
    /// accumulators into group 0's (see the module doc), between the two marks.
    pub(super) fn group_merge(&mut self, resident: &[SoftmaxRegs]) -> Result<Vec<Stmt>> {
        let groups = self.groups;
        let group = self
            .group_expr()
            .ok_or_else(|| self.err("group merge without warp groups".into()))?;
        let mut out = vec![Stmt::Comment(MERGE_MARK.into())];
        let factors = self.fresh("group_factor");
        let exchange = self.fresh("group_exchange");
        let ring = self
            .ring_arrays()
            .into_iter()
            .filter_map(|n| self.new_shared.iter().find(|d| d.name == n).cloned())
            .max_by_key(|d| d.len)
            .ok_or_else(|| self.err("warp groups need a pipeline ring".into()))?;
        // f32 values through the ring's words
        let ring_ty = ring.ty;
        let ex_load = |idx: Expr| match ring_ty {
            Ty::F32 => shared_load(&exchange, Ty::F32, idx),
            ty => f32_from_bits(shared_load(&exchange, ty, idx)),
        };
        let ex_value = |v: Expr| match ring_ty {
            Ty::F32 => v,
            _ => f32_bits(v),
        };
        let mut states = Vec::new();
        let mut accs: Vec<(String, u32, u32)> = Vec::new(); // (acc, factor row offset, exchange base)
        let mut exchange_words = 0;
        for r in resident {
            let rows = self.acc(r.s_name())?.decl.rows;
            let base = states.len() as u32 * groups;
            states.push((r.m.clone(), r.l_name().to_string(), rows));
            for o in r.out_names() {
                let decl = self.acc(o)?.decl.clone();
                if decl.rows != rows {
                    return Err(self.err(format!(
                        "accumulator {o} has {} rows, its softmax state {rows}",
                        decl.rows
                    )));
                }
                accs.push((o.clone(), base, exchange_words));
                exchange_words += decl.rows * decl.cols;
            }
        }
        if ring.len * groups < exchange_words * (groups - 1) {
            return Err(self.err(format!(
                "warp groups: the accumulators need {} words to meet, the ring {} has {}",
                exchange_words * (groups - 1),
                ring.name,
                ring.len * groups
            )));
        }
        // every group's accumulators whole (a split-K accumulator summed, by every group)
        for (acc, _, _) in &accs {
            self.materialize(acc, &mut out)?;
        }
        // word `k` of pair (row, col) of group g's copy of an accumulator in the exchange
        let ex_at = move |g: u32, ex_base: u32, cols: u32, rn: &str, cn: &str, k: u32| {
            add(
                add(
                    u((g - 1) * exchange_words + ex_base),
                    mul(var(rn, Ty::U32), u(cols)),
                ),
                add(var(cn, Ty::U32), u(k)),
            )
        };
        // 1. groups 1.. write their accumulators, unscaled, each into its own exchange slot:
        //    no group but group 0 reads anything another group wrote
        for g in 1..groups {
            let mut body = Vec::new();
            for (acc, _, ex_base) in &accs {
                let cols = self.acc(acc)?.decl.cols;
                let (rn, cn) = (self.fresh("row"), self.fresh("col"));
                let (a, ex) = (acc.clone(), exchange.clone());
                let ex_value = &ex_value;
                let ex_base = *ex_base;
                body.extend(self.for_each_pair(acc, &rn, &cn, |_, at0, at1| {
                    let mut s = Vec::new();
                    for (k, reg) in [(0, at0), (1, at1)] {
                        s.push(Stmt::SharedStore {
                            arr: ex.clone(),
                            index: ex_at(g, ex_base, cols, &rn, &cn, k),
                            value: ex_value(priv_load(&a, reg)),
                        });
                    }
                    Ok(s)
                })?);
            }
            out.push(Stmt::If {
                cond: bin(BinOp::Eq, group.clone(), u(g)),
                then: body,
                els: vec![],
            });
        }
        out.push(Stmt::Comment(COMBINE_MARK.into()));
        // 2. group 0: O = f_0 · O_0 + Σ_g f_g · O_g (factors from the merge of the states)
        let mut body = Vec::new();
        for (acc, base, ex_base) in &accs {
            let (rows, cols) = {
                let d = &self.acc(acc)?.decl;
                (d.rows, d.cols)
            };
            let (rn, cn) = (self.fresh("row"), self.fresh("col"));
            let a = acc.clone();
            let ex_load = &ex_load;
            let factors = &factors;
            let f = |g: u32| {
                shared_load(
                    factors,
                    Ty::F32,
                    add(u((base + g) * rows), var(&rn, Ty::U32)),
                )
            };
            body.extend(self.for_each_pair(acc, &rn, &cn, |_, at0, at1| {
                let mut s = Vec::new();
                for (k, reg) in [(0, at0), (1, at1)] {
                    let mut v = bin(BinOp::Mul, priv_load(&a, reg.clone()), f(0));
                    for g in 1..groups {
                        let idx = ex_at(g, *ex_base, cols, &rn, &cn, k);
                        v = fadd(v, bin(BinOp::Mul, f(g), ex_load(idx)));
                    }
                    s.push(Stmt::PrivateStore {
                        arr: a.clone(),
                        index: reg,
                        value: v,
                    });
                }
                Ok(s)
            })?);
        }
        out.push(Stmt::If {
            cond: bin(BinOp::Eq, group, u(0)),
            then: body,
            els: vec![],
        });
        out.push(Stmt::Comment(EPILOGUE_MARK.into()));
        let plan = self.group.as_mut().ok_or_else(|| crate::Error::Kir {
            kernel: String::new(),
            message: "group merge without warp groups".into(),
        })?;
        plan.states = states;
        plan.factors = factors;
        plan.exchange = exchange;
        plan.ring = ring.name;
        Ok(out)
    }
}

fn fadd(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Add, a, b)
}

/// Make `groups` copies of the body of a kernel lowered for one group of `group_threads`
/// threads (see the module doc). `shared` is the lowered kernel's shared arrays: each becomes
/// one copy per group (the returned declarations), `mbarriers` those that hold mbarriers (two
/// words each, addressed by mbarrier). Returns the new body and shared declarations.
pub(super) fn replicate(
    body: Vec<Stmt>,
    shared: &[SharedDecl],
    mbarriers: &[String],
    group_threads: u32,
    groups: u32,
    plan: &GroupPlan,
) -> std::result::Result<(Vec<Stmt>, Vec<SharedDecl>), String> {
    let lens: HashMap<String, u32> = shared.iter().map(|d| (d.name.clone(), d.len)).collect();
    let group = var(&plan.group_var, Ty::U32);
    let rw = Replicas {
        lens: &lens,
        mbarriers,
        group: group.clone(),
        tid: var(&plan.tid_var, Ty::U32),
        group_threads,
        groups,
        heads: false,
    };
    let mark = |text: &str| {
        body.iter()
            .position(|s| matches!(s, Stmt::Comment(c) if c == text))
            .ok_or_else(|| format!("grouped lowering: no `{text}` in the lowered body"))
    };
    let (merge, combine, epilogue) = (mark(MERGE_MARK)?, mark(COMBINE_MARK)?, mark(EPILOGUE_MARK)?);
    if plan.states.is_empty() {
        return Err("grouped lowering: no online-softmax state to merge after the pipeline".into());
    }
    let mut out = vec![
        Stmt::Comment(format!(
            "{groups} warp groups of {group_threads} threads: group g walks steps g, g + {groups}, ..."
        )),
        let_(&plan.group_var, bin(BinOp::Div, local_id(), u(group_threads))),
        let_(&plan.tid_var, bin(BinOp::Rem, local_id(), u(group_threads))),
    ];
    // a barrier at the top level (the prologue, the states stored after the pipeline) is
    // passed once by every thread of every group: it stays the workgroup's barrier; only those
    // inside the pipeline, whose step counts differ per group, become the group's own
    out.extend(body[..merge].iter().map(|s| match s {
        Stmt::Barrier => Stmt::Barrier,
        other => rw.stmt(other),
    }));
    // the merge's own shared arrays (the exchange, the factors) are the workgroup's, not a
    // group's copy; groups 1.. write their accumulators into the exchange
    let exchange = |s: Vec<Stmt>| rename_shared(s, &plan.exchange, &plan.ring);
    // every group has stored its state and left its ring: groups 1.. write their accumulators
    // into the exchange while group 0 merges the states (M, f_g, L per row). Only group 0
    // reads what another group wrote: compute-sanitizer's racecheck reports group 0's writes
    // read by a group that walked fewer steps as hazards, across the barrier that orders them
    // (a false report; benches/NOTES.md, v12)
    out.push(Stmt::Comment(MERGE_MARK.into()));
    out.push(Stmt::Barrier);
    out.extend(exchange(rw.stmts(&body[merge + 1..combine])));
    for (k, (m, l, rows)) in plan.states.iter().enumerate() {
        let r = format!("merge_row{k}");
        let rv = var(&r, Ty::U32);
        let at = |g: u32| add(u(g * rows), rv.clone());
        let mut b = Vec::new();
        let mx = format!("merge_max{k}");
        b.push(Stmt::Var {
            name: mx.clone(),
            value: shared_load(m, Ty::F32, at(0)),
        });
        for g in 1..groups {
            b.push(Stmt::Assign {
                name: mx.clone(),
                value: bin(
                    BinOp::Max,
                    var(&mx, Ty::F32),
                    shared_load(m, Ty::F32, at(g)),
                ),
            });
        }
        let sum = format!("merge_sum{k}");
        b.push(Stmt::Var {
            name: sum.clone(),
            value: Expr::F32(0.0),
        });
        for g in 0..groups {
            let fname = format!("merge_f{k}_{g}");
            b.push(let_(
                &fname,
                exp(bin(
                    BinOp::Sub,
                    shared_load(m, Ty::F32, at(g)),
                    var(&mx, Ty::F32),
                )),
            ));
            b.push(Stmt::Assign {
                name: sum.clone(),
                value: fadd(
                    var(&sum, Ty::F32),
                    bin(
                        BinOp::Mul,
                        var(&fname, Ty::F32),
                        shared_load(l, Ty::F32, at(g)),
                    ),
                ),
            });
            b.push(Stmt::SharedStore {
                arr: plan.factors.clone(),
                index: add(u((k as u32 * groups + g) * rows), rv.clone()),
                value: var(&fname, Ty::F32),
            });
        }
        b.push(Stmt::SharedStore {
            arr: m.clone(),
            index: rv.clone(),
            value: var(&mx, Ty::F32),
        });
        b.push(Stmt::SharedStore {
            arr: l.clone(),
            index: rv.clone(),
            value: var(&sum, Ty::F32),
        });
        out.push(Stmt::If {
            cond: bin(BinOp::Eq, group.clone(), u(0)),
            then: vec![Stmt::For {
                var: r.clone(),
                start: var(&plan.tid_var, Ty::U32),
                end: u(*rows),
                step: u(group_threads),
                body: b,
            }],
            els: vec![],
        });
    }
    out.push(Stmt::Barrier);
    // the accumulators meet in group 0
    out.extend(exchange(rw.stmts(&body[combine..epilogue])));
    out.push(Stmt::Comment(EPILOGUE_MARK.into()));
    out.push(Stmt::If {
        cond: bin(BinOp::Eq, group, u(0)),
        then: rw.stmts(&body[epilogue + 1..]),
        els: vec![],
    });

    let mut decls: Vec<SharedDecl> = shared
        .iter()
        .map(|d| SharedDecl {
            len: d.len * groups,
            ..d.clone()
        })
        .collect();
    decls.push(SharedDecl {
        alias: None,
        name: plan.factors.clone(),
        ty: Ty::F32,
        len: plan.states.len() as u32 * groups * plan.states.iter().map(|s| s.2).max().unwrap_or(0),
    });
    Ok((out, decls))
}

/// Make `groups` copies of the body of a kernel lowered for one group of `group_threads`
/// threads whose groups split the heads ([`GroupBy::Heads`]): group `g` is the description's
/// workgroup `groups · x + g` along x, every shared array but the ring's (`ring`: its tiles
/// and mbarriers, which every group reads and fills, row `g` mod `groups` by group `g`) one
/// copy per group,
/// each barrier inside a statement a named barrier of the group (the groups walk the same
/// steps, but apart), the barriers at the top level the workgroup's. Nothing meets after
/// the pipeline: each group writes its own rows. Returns the new body and shared
/// declarations.
pub(super) fn replicate_heads(
    body: Vec<Stmt>,
    shared: &[SharedDecl],
    (ring, mbarriers): (&[String], &[String]),
    group_threads: u32,
    groups: u32,
    plan: &GroupPlan,
) -> std::result::Result<(Vec<Stmt>, Vec<SharedDecl>), String> {
    let in_ring = |d: &SharedDecl| {
        ring.contains(&d.name) || d.alias.as_ref().is_some_and(|(p, _)| ring.contains(p))
    };
    if let Some(d) = shared.iter().find(|d| d.alias.is_some() && !in_ring(d)) {
        return Err(format!(
            "warp groups over heads: shared array {} is a window of {}, which is copied per group",
            d.name,
            d.alias.as_ref().map_or("", |(p, _)| p.as_str())
        ));
    }
    // only the copied arrays have a length here: the ring's keep their indices
    let lens: HashMap<String, u32> = shared
        .iter()
        .filter(|d| !in_ring(d))
        .map(|d| (d.name.clone(), d.len))
        .collect();
    let rw = Replicas {
        lens: &lens,
        mbarriers,
        group: var(&plan.group_var, Ty::U32),
        tid: var(&plan.tid_var, Ty::U32),
        group_threads,
        groups,
        heads: true,
    };
    let mut out = vec![
        Stmt::Comment(format!(
            "{groups} warp groups of {group_threads} threads, each with its own heads over every step: group g is head block {groups} x + g"
        )),
        let_(&plan.group_var, bin(BinOp::Div, local_id(), u(group_threads))),
        let_(&plan.tid_var, bin(BinOp::Rem, local_id(), u(group_threads))),
    ];
    out.extend(body.iter().map(|s| match s {
        Stmt::Barrier => Stmt::Barrier,
        other => rw.stmt(other),
    }));
    let decls = shared
        .iter()
        .map(|d| SharedDecl {
            len: if in_ring(d) { d.len } else { d.len * groups },
            ..d.clone()
        })
        .collect();
    Ok((out, decls))
}

/// The per-group view of a lowered body.
struct Replicas<'a> {
    lens: &'a HashMap<String, u32>,
    mbarriers: &'a [String],
    group: Expr,
    tid: Expr,
    group_threads: u32,
    groups: u32,
    /// The groups split the heads: the description's workgroup along x is `groups · x + g`.
    heads: bool,
}

impl Replicas<'_> {
    /// The group's barrier: named barrier `1 + group` of its threads. Each id is a constant
    /// (a branch per group), which ptxas and compute-sanitizer see as distinct barriers.
    fn group_barrier(&self) -> Stmt {
        let bar = |g: u32| {
            intr(Intrinsic::NamedBarrier {
                id: g + 1,
                threads: self.group_threads,
            })
        };
        let mut s = bar(self.groups - 1);
        for g in (0..self.groups - 1).rev() {
            s = Stmt::If {
                cond: bin(BinOp::Eq, self.group.clone(), u(g)),
                then: vec![bar(g)],
                els: vec![s],
            };
        }
        s
    }

    /// Offset of this group's copy of shared array `arr`, in its own index units (words;
    /// mbarriers for the mbarrier arrays); `None` for an array that is not copied.
    fn offset(&self, arr: &str) -> Option<Expr> {
        let len = *self.lens.get(arr)?;
        let unit = if self.mbarriers.iter().any(|m| m == arr) {
            len / 2
        } else {
            len
        };
        Some(mul(self.group.clone(), u(unit)))
    }

    /// `index` (already in the group's view) into this group's copy of `arr`.
    fn shifted(&self, arr: &str, index: Expr) -> Expr {
        match self.offset(arr) {
            Some(off) => add(index, off),
            None => index,
        }
    }

    /// One expression node in the group's view: the thread index within the group, a shared
    /// load from the group's copy.
    fn node(&self, x: Expr) -> Expr {
        match x {
            Expr::Builtin(Builtin::LocalId) => self.tid.clone(),
            Expr::Builtin(Builtin::WorkgroupId(0)) if self.heads => add(
                mul(Expr::Builtin(Builtin::WorkgroupId(0)), u(self.groups)),
                self.group.clone(),
            ),
            Expr::Builtin(Builtin::NumWorkgroups(0)) if self.heads => {
                mul(Expr::Builtin(Builtin::NumWorkgroups(0)), u(self.groups))
            }
            Expr::SharedLoad { arr, ty, index } => match self.offset(&arr) {
                Some(off) => Expr::SharedLoad {
                    arr,
                    ty,
                    index: Box::new(add(*index, off)),
                },
                None => Expr::SharedLoad { arr, ty, index },
            },
            other => other,
        }
    }

    fn stmts(&self, stmts: &[Stmt]) -> Vec<Stmt> {
        stmts.iter().map(|s| self.stmt(s)).collect()
    }

    fn stmt(&self, s: &Stmt) -> Stmt {
        let total = self.group_threads * self.groups;
        s.clone().map(&mut |x| self.node(x), &mut |s| match s {
            Stmt::Barrier => self.group_barrier(),
            // the merge's barriers of the whole workgroup
            Stmt::Intrinsic(Intrinsic::NamedBarrier { id: 0, threads }) if threads == total => {
                Stmt::Barrier
            }
            Stmt::SharedStore { arr, index, value } => Stmt::SharedStore {
                index: self.shifted(&arr, index),
                arr,
                value,
            },
            Stmt::Intrinsic(i) => intr(self.intrinsic(i)),
            other => other,
        })
    }

    /// An intrinsic whose operands are already in the group's view: each array an operand
    /// indexes moved to the group's copy.
    fn intrinsic(&self, mut i: Intrinsic) -> Intrinsic {
        let shift = |arr: &str, e: &mut Expr| {
            *e = self.shifted(arr, std::mem::replace(e, Expr::U32(0)));
        };
        match &mut i {
            Intrinsic::CpAsync { dst, dst_word, .. } => shift(dst, dst_word),
            Intrinsic::LdMatrix { arr, word, .. } => shift(arr, word),
            Intrinsic::MbarInit { bars, index, .. }
            | Intrinsic::MbarArrive { bars, index }
            | Intrinsic::MbarWait { bars, index, .. }
            | Intrinsic::CopyArrive { bars, index } => shift(bars, index),
            Intrinsic::CopyAsync {
                dst,
                dst_word,
                bars,
                index,
                ..
            } => {
                shift(dst, dst_word);
                shift(bars, index);
            }
            _ => {}
        }
        i
    }
}

/// Every access to shared array `from` in `stmts` made to `to` instead (same indices).
fn rename_shared(stmts: Vec<Stmt>, from: &str, to: &str) -> Vec<Stmt> {
    let mut load = |x: Expr| match x {
        Expr::SharedLoad { arr, ty, index } if arr == from => Expr::SharedLoad {
            arr: to.to_string(),
            ty,
            index,
        },
        other => other,
    };
    let mut store = |s: Stmt| match s {
        Stmt::SharedStore { arr, index, value } if arr == from => Stmt::SharedStore {
            arr: to.to_string(),
            index,
            value,
        },
        other => other,
    };
    stmts
        .into_iter()
        .map(|s| s.map(&mut load, &mut store))
        .collect()
}
