//! Expression and statement constructors, shared by the builder and the lowerings, so that
//! every generated address is folded the same way: u32 constants are added and multiplied,
//! `x + 0`, `x · 1` and `x · 0` are dropped (expressions have no side effects, so dropping
//! `x` changes nothing but the text). Only u32 is folded: that is the type of every index,
//! and an ill-typed operand is left for the type check to report.

use super::ir::*;

/// f32 literal.
pub fn f(v: f32) -> Expr {
    Expr::F32(v)
}
/// u32 literal.
pub fn u(v: u32) -> Expr {
    Expr::U32(v)
}
/// i32 literal.
pub fn i(v: i32) -> Expr {
    Expr::I32(v)
}
/// A local variable.
pub fn var(name: &str, ty: Ty) -> Expr {
    Expr::Var(name.to_string(), ty)
}
/// Thread index within the workgroup.
pub fn local_id() -> Expr {
    Expr::Builtin(Builtin::LocalId)
}
/// Workgroup index along axis 0, 1, 2 (x, y, z).
pub fn workgroup_id(axis: u8) -> Expr {
    Expr::Builtin(Builtin::WorkgroupId(axis))
}
/// Number of workgroups in the grid along axis 0, 1, 2 (x, y, z).
pub fn num_workgroups(axis: u8) -> Expr {
    Expr::Builtin(Builtin::NumWorkgroups(axis))
}

pub fn select(cond: Expr, a: Expr, b: Expr) -> Expr {
    Expr::Select(Box::new(cond), Box::new(a), Box::new(b))
}
pub fn exp(x: Expr) -> Expr {
    Expr::Call(Func::Exp, vec![x])
}
/// [`Func::ExpFast`]: e^x, approximate (about 2^-22 + |x| · 2^-24 relative).
pub fn exp_fast(x: Expr) -> Expr {
    Expr::Call(Func::ExpFast, vec![x])
}
/// [`Func::Exp2Fast`]: 2^x, approximate (about 2^-22 relative).
pub fn exp2_fast(x: Expr) -> Expr {
    Expr::Call(Func::Exp2Fast, vec![x])
}
pub fn log(x: Expr) -> Expr {
    Expr::Call(Func::Log, vec![x])
}
pub fn sqrt(x: Expr) -> Expr {
    Expr::Call(Func::Sqrt, vec![x])
}
pub fn abs(x: Expr) -> Expr {
    Expr::Call(Func::Abs, vec![x])
}
pub fn fma(a: Expr, b: Expr, c: Expr) -> Expr {
    Expr::Call(Func::Fma, vec![a, b, c])
}
/// Two f32 → one u32 of two bf16 (round to nearest even), `lo` in the low half.
pub fn pack_bf16x2(lo: Expr, hi: Expr) -> Expr {
    Expr::Call(Func::PackBf16x2, vec![lo, hi])
}
pub fn f32_bits(x: Expr) -> Expr {
    Expr::Call(Func::F32Bits, vec![x])
}
/// Leading zero bits of a u32 (32 for 0).
pub fn clz(x: Expr) -> Expr {
    Expr::Call(Func::Clz, vec![x])
}
/// `a op b`, as written.
pub fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
    Expr::Bin(op, Box::new(a), Box::new(b))
}
/// `a + b`, folded (see the module comment).
pub fn add(a: Expr, b: Expr) -> Expr {
    match (&a, &b) {
        (Expr::U32(x), Expr::U32(y)) => u(x.wrapping_add(*y)),
        (_, Expr::U32(0)) if a.ty() == Ty::U32 => a,
        (Expr::U32(0), _) if b.ty() == Ty::U32 => b,
        _ => bin(BinOp::Add, a, b),
    }
}
/// `a · b`, folded (see the module comment).
pub fn mul(a: Expr, b: Expr) -> Expr {
    match (&a, &b) {
        (Expr::U32(x), Expr::U32(y)) => u(x.wrapping_mul(*y)),
        (_, Expr::U32(1)) if a.ty() == Ty::U32 => a,
        (Expr::U32(1), _) if b.ty() == Ty::U32 => b,
        (_, Expr::U32(0)) if a.ty() == Ty::U32 => u(0),
        (Expr::U32(0), _) if b.ty() == Ty::U32 => u(0),
        _ => bin(BinOp::Mul, a, b),
    }
}
/// `a < b`.
pub fn lt(a: Expr, b: Expr) -> Expr {
    bin(BinOp::Lt, a, b)
}
/// Element `index` of a shared array.
pub fn shared_load(arr: &str, ty: Ty, index: Expr) -> Expr {
    Expr::SharedLoad {
        arr: arr.into(),
        ty,
        index: Box::new(index),
    }
}
/// Element `index` of a private u32 array.
pub fn priv_load_u(arr: &str, index: Expr) -> Expr {
    Expr::PrivateLoad {
        arr: arr.into(),
        ty: Ty::U32,
        index: Box::new(index),
    }
}
/// Element `index` of a private f32 array.
pub fn priv_load(arr: &str, index: Expr) -> Expr {
    Expr::PrivateLoad {
        arr: arr.into(),
        ty: Ty::F32,
        index: Box::new(index),
    }
}
/// The f32 whose bits are `bits`.
pub fn f32_from_bits(bits: Expr) -> Expr {
    Expr::Call(Func::F32FromBits, vec![bits])
}
/// `let name = value;`
pub fn let_(name: &str, value: Expr) -> Stmt {
    Stmt::Let {
        name: name.into(),
        value,
    }
}
/// `for var in 0..end` (a constant trip count).
pub fn for_const(var: &str, end: u32, body: Vec<Stmt>) -> Stmt {
    Stmt::For {
        var: var.into(),
        start: u(0),
        end: u(end),
        step: u(1),
        body,
    }
}
/// An intrinsic as a statement.
pub fn intr(i: Intrinsic) -> Stmt {
    Stmt::Intrinsic(i)
}

/// One element pair of an accumulator's `AccForEach`: its two values read into the mutable
/// locals `v0`, `v1` (registers `at0`, `at1` of `acc`), `body`, and the two written back.
pub fn acc_pair_update(
    acc: &str,
    (v0, v1): (&str, &str),
    at0: Expr,
    at1: Expr,
    body: Vec<Stmt>,
) -> Vec<Stmt> {
    let mut s = vec![
        Stmt::Var {
            name: v0.to_string(),
            value: priv_load(acc, at0.clone()),
        },
        Stmt::Var {
            name: v1.to_string(),
            value: priv_load(acc, at1.clone()),
        },
    ];
    s.extend(body);
    s.push(Stmt::PrivateStore {
        arr: acc.to_string(),
        index: at0,
        value: var(v0, Ty::F32),
    });
    s.push(Stmt::PrivateStore {
        arr: acc.to_string(),
        index: at1,
        value: var(v1, Ty::F32),
    });
    s
}

/// The stores of an accumulator element pair `(v0, v1)` at row `row`, even column `col` of
/// the shared tile `dst` (row stride `stride` words): one packed word for a bf16 or f16 tile, two
/// f32 words otherwise.
pub fn tile_pair_store(
    dst: &str,
    elem: TileElem,
    row: Expr,
    stride: u32,
    col: Expr,
    v0: Expr,
    v1: Expr,
) -> Vec<Stmt> {
    let pack = match elem {
        TileElem::Bf16 => Some(Func::PackBf16x2),
        TileElem::F16 => Some(Func::PackF16x2),
        _ => None,
    };
    if let Some(pack) = pack {
        vec![Stmt::SharedStore {
            arr: dst.to_string(),
            index: add(mul(row, u(stride)), bin(BinOp::Shr, col, u(1))),
            value: Expr::Call(pack, vec![v0, v1]),
        }]
    } else {
        let at = add(mul(row, u(stride)), col);
        vec![
            Stmt::SharedStore {
                arr: dst.to_string(),
                index: at.clone(),
                value: v0,
            },
            Stmt::SharedStore {
                arr: dst.to_string(),
                index: add(at, u(1)),
                value: v1,
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u32_constants_and_identities_fold() {
        let x = var("x", Ty::U32);
        assert_eq!(add(u(2), u(3)), u(5));
        assert_eq!(mul(u(4), u(3)), u(12));
        assert_eq!(add(x.clone(), u(0)), x);
        assert_eq!(add(u(0), x.clone()), x);
        assert_eq!(mul(x.clone(), u(1)), x);
        assert_eq!(mul(u(1), x.clone()), x);
        assert_eq!(mul(x.clone(), u(0)), u(0));
        assert_eq!(mul(u(0), x.clone()), u(0));
        assert_eq!(add(x.clone(), u(1)), bin(BinOp::Add, x.clone(), u(1)));
    }

    #[test]
    fn other_types_are_left_as_written() {
        let y = var("y", Ty::F32);
        assert_eq!(mul(y.clone(), u(0)), bin(BinOp::Mul, y.clone(), u(0)));
        assert_eq!(add(y.clone(), u(0)), bin(BinOp::Add, y, u(0)));
    }
}
