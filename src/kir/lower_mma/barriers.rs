//! Barrier bookkeeping: which statements use tiles with copies in flight, and dropping a
//! barrier that directly follows another.

use crate::kir::ir::*;

/// Does `s` use any of the shared tiles `names` (a pipeline: only through its load stage,
/// whose first wait covers older copies)?
pub(super) fn stmt_mentions(s: &Stmt, names: &[String]) -> bool {
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
            TileOp::GatherRows(g) => hit(&g.dst) || expr_hit(&g.src_word),
            TileOp::AccFill { .. } | TileOp::AccRowReduce { .. } => false,
            TileOp::Mma { a, b, .. } => hit(&a.tile) || hit(&b.tile),
            TileOp::MmaScaled { a, b, scale, .. } => {
                hit(&a.tile) || hit(&b.tile) || expr_hit(scale)
            }
            TileOp::AccForEach { body, .. } => all(body),
            TileOp::AccToShared { dst, .. } => hit(dst),
            TileOp::SharedMap { dst, value, .. } => hit(dst) || expr_hit(value),
            TileOp::DequantRows {
                dst, src, scale, ..
            } => hit(dst) || hit(src) || expr_hit(scale),
            TileOp::Pipeline { load, .. } => all(load),
            TileOp::OnlineSoftmax { p_tile, .. } => hit(p_tile),
        },
    }
}

/// Drop a barrier that directly follows another (comments between them aside), in every
/// block: two in a row order nothing more than one.
pub(super) fn dedupe_barriers(stmts: Vec<Stmt>) -> Vec<Stmt> {
    let mut out: Vec<Stmt> = Vec::with_capacity(stmts.len());
    let mut last_barrier = false;
    for s in stmts {
        let s = s.map_blocks(&mut dedupe_barriers);
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
