//! The walks over a kernel body that every lowering shares: the rewrite a lowering is
//! (`Rewrite`: each statement rebuilt as it is, tile ops and tile element reads replaced by
//! the pass), and the read-only visits (every tile op, every name in use).

use super::ir::*;
use crate::Result;
use std::collections::HashSet;

/// A lowering pass, as [`rewrite_stmts`] drives it: what it does with the two things a
/// lowering removes. Everything else is rebuilt as it is, expressions included.
pub(crate) trait Rewrite {
    /// Append the statements of one tile op to `out`.
    fn tile_op(&mut self, op: &TileOp, out: &mut Vec<Stmt>) -> Result<()>;

    /// An [`Expr::TileLoad`] or [`Expr::TileWord`] (its operands already rewritten) in the
    /// pass's shared-memory layout.
    fn tile_read(&self, read: Expr) -> Result<Expr>;

    /// Called before each statement is rewritten, with the output so far (a pass that
    /// defers waits inserts them here).
    fn before_stmt(&mut self, _s: &Stmt, _out: &mut Vec<Stmt>) {}
}

/// Rewrite a block.
pub(crate) fn rewrite_stmts<R: Rewrite + ?Sized>(
    pass: &mut R,
    stmts: &[Stmt],
) -> Result<Vec<Stmt>> {
    let mut out = Vec::new();
    for s in stmts {
        rewrite_stmt(pass, s, &mut out)?;
    }
    Ok(out)
}

/// Rewrite one statement into `out`.
pub(crate) fn rewrite_stmt<R: Rewrite + ?Sized>(
    pass: &mut R,
    s: &Stmt,
    out: &mut Vec<Stmt>,
) -> Result<()> {
    pass.before_stmt(s, out);
    let e = |pass: &R, e: &Expr| rewrite_expr(pass, e);
    match s {
        Stmt::Tile(op) => pass.tile_op(op, out)?,
        Stmt::If { cond, then, els } => out.push(Stmt::If {
            cond: e(pass, cond)?,
            then: rewrite_stmts(pass, then)?,
            els: rewrite_stmts(pass, els)?,
        }),
        Stmt::For {
            var,
            start,
            end,
            step,
            body,
        } => out.push(Stmt::For {
            var: var.clone(),
            start: e(pass, start)?,
            end: e(pass, end)?,
            step: e(pass, step)?,
            body: rewrite_stmts(pass, body)?,
        }),
        Stmt::Let { name, value } => out.push(Stmt::Let {
            name: name.clone(),
            value: e(pass, value)?,
        }),
        Stmt::Var { name, value } => out.push(Stmt::Var {
            name: name.clone(),
            value: e(pass, value)?,
        }),
        Stmt::Assign { name, value } => out.push(Stmt::Assign {
            name: name.clone(),
            value: e(pass, value)?,
        }),
        Stmt::Store { buf, index, value } => out.push(Stmt::Store {
            buf: buf.clone(),
            index: e(pass, index)?,
            value: e(pass, value)?,
        }),
        Stmt::StoreWord { buf, index, value } => out.push(Stmt::StoreWord {
            buf: buf.clone(),
            index: e(pass, index)?,
            value: e(pass, value)?,
        }),
        Stmt::SharedStore { arr, index, value } => out.push(Stmt::SharedStore {
            arr: arr.clone(),
            index: e(pass, index)?,
            value: e(pass, value)?,
        }),
        Stmt::PrivateStore { arr, index, value } => out.push(Stmt::PrivateStore {
            arr: arr.clone(),
            index: e(pass, index)?,
            value: e(pass, value)?,
        }),
        Stmt::Comment(_) | Stmt::Barrier | Stmt::Intrinsic(_) => out.push(s.clone()),
    }
    Ok(())
}

/// Rewrite an expression: its tile element reads through [`Rewrite::tile_read`], bottom-up.
pub(crate) fn rewrite_expr<R: Rewrite + ?Sized>(pass: &R, e: &Expr) -> Result<Expr> {
    let mut failure = None;
    let lowered = e.clone().map(&mut |x| match x {
        Expr::TileLoad { .. } | Expr::TileWord { .. } => pass.tile_read(x).unwrap_or_else(|err| {
            failure = Some(err);
            Expr::U32(0)
        }),
        other => other,
    });
    match failure {
        Some(err) => Err(err),
        None => Ok(lowered),
    }
}

/// Every name `stmts` binds (lets, vars, loop variables, the names tile ops bind), so that a
/// pass picks fresh names that none of them shadows.
pub(crate) fn collect_names(stmts: &[Stmt], used: &mut HashSet<String>) {
    for s in stmts {
        match s {
            Stmt::Let { name, .. } | Stmt::Var { name, .. } => {
                used.insert(name.clone());
            }
            Stmt::If { then, els, .. } => {
                collect_names(then, used);
                collect_names(els, used);
            }
            Stmt::For { var, body, .. } => {
                used.insert(var.clone());
                collect_names(body, used);
            }
            Stmt::Tile(op) => match op {
                TileOp::AccForEach {
                    row,
                    col,
                    v0,
                    v1,
                    body,
                    ..
                } => {
                    for n in [row, col, v0, v1] {
                        used.insert(n.clone());
                    }
                    collect_names(body, used);
                }
                TileOp::GatherRows(RowGather { row, .. }) | TileOp::MmaScaled { row, .. } => {
                    used.insert(row.clone());
                }
                TileOp::SharedMap { row, col, .. } => {
                    used.insert(row.clone());
                    used.insert(col.clone());
                }
                TileOp::DequantRows { row, group, .. } => {
                    used.insert(row.clone());
                    used.insert(group.clone());
                }
                TileOp::Pipeline {
                    var, load, compute, ..
                } => {
                    used.insert(var.clone());
                    collect_names(load, used);
                    collect_names(compute, used);
                }
                TileOp::OnlineSoftmax { expansion, .. } => collect_names(expansion, used),
                _ => {}
            },
            _ => {}
        }
    }
}

/// Calls `f` on every tile op, nested ones included (the ops of a composite op's
/// expansion too).
pub fn visit_tile_ops(stmts: &[Stmt], f: &mut dyn FnMut(&TileOp)) {
    visit_tile_ops_with(stmts, true, f);
}

/// [`visit_tile_ops`], entering the expansions of composite ops
/// ([`TileOp::OnlineSoftmax`]) only when `expansions` is true: a lowering with a native
/// form of them never lowers what is inside.
pub fn visit_tile_ops_with(stmts: &[Stmt], expansions: bool, f: &mut dyn FnMut(&TileOp)) {
    for s in stmts {
        match s {
            Stmt::If { then, els, .. } => {
                visit_tile_ops_with(then, expansions, f);
                visit_tile_ops_with(els, expansions, f);
            }
            Stmt::For { body, .. } => visit_tile_ops_with(body, expansions, f),
            Stmt::Tile(op) => {
                f(op);
                match op {
                    TileOp::AccForEach { body, .. } => visit_tile_ops_with(body, expansions, f),
                    TileOp::Pipeline { load, compute, .. } => {
                        visit_tile_ops_with(load, expansions, f);
                        visit_tile_ops_with(compute, expansions, f);
                    }
                    TileOp::OnlineSoftmax { expansion, .. } if expansions => {
                        visit_tile_ops_with(expansion, expansions, f)
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
}

/// The names `block` reads that it does not bind itself first (its free names: a nested
/// `let` or loop variable of the same name shadows an outer one).
pub(crate) fn free_reads(block: &[Stmt], into: &mut HashSet<String>) {
    block_reads(block, &HashSet::new(), into);
}

fn expr_reads(e: &Expr, bound: &HashSet<String>, into: &mut HashSet<String>) {
    e.visit(&mut |x| {
        if let Expr::Var(n, _) = x {
            if !bound.contains(n) {
                into.insert(n.clone());
            }
        }
    });
}

// the names `block` reads that it does not bind itself first (a nested `let` of the
// same name shadows an outer one)
fn block_reads(block: &[Stmt], outer: &HashSet<String>, into: &mut HashSet<String>) {
    let mut bound = outer.clone();
    for s in block {
        match s {
            Stmt::Let { name, value } | Stmt::Var { name, value } => {
                expr_reads(value, &bound, into);
                bound.insert(name.clone());
            }
            Stmt::If { cond, then, els } => {
                expr_reads(cond, &bound, into);
                block_reads(then, &bound, into);
                block_reads(els, &bound, into);
            }
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => {
                for e in [start, end, step] {
                    expr_reads(e, &bound, into);
                }
                let mut inner = bound.clone();
                inner.insert(var.clone());
                block_reads(body, &inner, into);
            }
            other => {
                other.clone().map(
                    &mut |x| {
                        if let Expr::Var(n, _) = &x {
                            if !bound.contains(n) {
                                into.insert(n.clone());
                            }
                        }
                        x
                    },
                    &mut |st| st,
                );
            }
        }
    }
}
