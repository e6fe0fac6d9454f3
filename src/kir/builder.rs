//! A builder that makes kernel descriptions read like the algorithm: expressions with
//! ordinary operators, nested blocks through closures, typed handles for buffers, shared
//! arrays and tiles. Mistakes in a description (a type mismatch, a tile shape that does not
//! fit) are collected and returned by [`KernelBuilder::finish`] as one error.

use super::expr::bin;
use super::ir::*;
use crate::{Error, Result};
use std::collections::HashMap;
use std::ops;

// ---------------------------------------------------------------- expression sugar

// The constructors are shared with the lowerings (one set, folded the same way).
pub use super::expr::{
    abs, clz, exp, exp_fast, f, f32_bits, f32_from_bits, fma, i, local_id, log, num_workgroups,
    pack_bf16x2, select, sqrt, u, workgroup_id,
};

/// The two e4m3 values in bits 0..16 of a u32 as f32 (low byte first), converted as a pair
/// (one instruction on CUDA sm_89 and later).
pub fn e4m3x2_to_f32(b: &mut KernelBuilder, name: &str, pair: Expr) -> [Expr; 2] {
    let prep = b.let_(name, Expr::Call(Func::E4m3x2Prep, vec![pair]));
    [
        Expr::Call(Func::E4m3x2Lo, vec![prep.clone()]),
        Expr::Call(Func::E4m3x2Hi, vec![prep]),
    ]
}

impl Expr {
    fn bin(self, op: BinOp, rhs: Expr) -> Expr {
        bin(op, self, rhs)
    }
    pub fn lt(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Lt, rhs)
    }
    pub fn le(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Le, rhs)
    }
    pub fn gt(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Gt, rhs)
    }
    pub fn ge(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Ge, rhs)
    }
    pub fn eq_(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Eq, rhs)
    }
    pub fn ne_(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Ne, rhs)
    }
    pub fn and(self, rhs: Expr) -> Expr {
        self.bin(BinOp::And, rhs)
    }
    pub fn or(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Or, rhs)
    }
    pub fn min(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Min, rhs)
    }
    pub fn max(self, rhs: Expr) -> Expr {
        self.bin(BinOp::Max, rhs)
    }
    #[allow(clippy::should_implement_trait)]
    pub fn not(self) -> Expr {
        Expr::Un(UnOp::Not, Box::new(self))
    }
    /// Numeric conversion (or storage-type decode) to `ty`.
    pub fn cvt(self, ty: Ty) -> Expr {
        Expr::Cvt(ty, Box::new(self))
    }
    pub fn as_u32(self) -> Expr {
        self.cvt(Ty::U32)
    }
    pub fn as_i32(self) -> Expr {
        self.cvt(Ty::I32)
    }
    pub fn as_f32(self) -> Expr {
        self.cvt(Ty::F32)
    }
}

// `+` and `*` fold u32 constants like the lowerings' constructors ([`super::expr`]).
macro_rules! binop {
    ($tr:ident, $m:ident, $make:expr) => {
        impl ops::$tr for Expr {
            type Output = Expr;
            fn $m(self, rhs: Expr) -> Expr {
                $make(self, rhs)
            }
        }
        impl ops::$tr<&Expr> for &Expr {
            type Output = Expr;
            fn $m(self, rhs: &Expr) -> Expr {
                $make(self.clone(), rhs.clone())
            }
        }
        impl ops::$tr<Expr> for &Expr {
            type Output = Expr;
            fn $m(self, rhs: Expr) -> Expr {
                $make(self.clone(), rhs)
            }
        }
        impl ops::$tr<&Expr> for Expr {
            type Output = Expr;
            fn $m(self, rhs: &Expr) -> Expr {
                $make(self, rhs.clone())
            }
        }
    };
}
binop!(Add, add, super::expr::add);
binop!(Sub, sub, |a, b| bin(BinOp::Sub, a, b));
binop!(Mul, mul, super::expr::mul);
binop!(Div, div, |a, b| bin(BinOp::Div, a, b));
binop!(Rem, rem, |a, b| bin(BinOp::Rem, a, b));
binop!(BitAnd, bitand, |a, b| bin(BinOp::BitAnd, a, b));
binop!(BitOr, bitor, |a, b| bin(BinOp::BitOr, a, b));
binop!(BitXor, bitxor, |a, b| bin(BinOp::BitXor, a, b));
binop!(Shl, shl, |a, b| bin(BinOp::Shl, a, b));
binop!(Shr, shr, |a, b| bin(BinOp::Shr, a, b));

impl ops::Neg for Expr {
    type Output = Expr;
    fn neg(self) -> Expr {
        Expr::Un(UnOp::Neg, Box::new(self))
    }
}

// ---------------------------------------------------------------- handles

/// A storage buffer of the kernel.
#[derive(Clone, Debug)]
pub struct Buf {
    pub name: String,
    pub elem: Elem,
}

impl Buf {
    /// Element `index` (u32), typed per [`Elem::value_ty`].
    pub fn at(&self, index: Expr) -> Expr {
        Expr::Load {
            buf: self.name.clone(),
            elem: self.elem,
            index: Box::new(index),
        }
    }
    /// 32-bit word `index` as u32.
    pub fn word(&self, index: Expr) -> Expr {
        Expr::LoadWord {
            buf: self.name.clone(),
            index: Box::new(index),
        }
    }
}

/// A shared (workgroup) array.
#[derive(Clone, Debug)]
pub struct Shared {
    pub name: String,
    pub ty: Ty,
    pub len: u32,
}

impl Shared {
    pub fn at(&self, index: Expr) -> Expr {
        Expr::SharedLoad {
            arr: self.name.clone(),
            ty: self.ty,
            index: Box::new(index),
        }
    }
}

/// A shared tile `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct STile {
    pub name: String,
    pub elem: TileElem,
    pub rows: u32,
    pub cols: u32,
}

impl STile {
    /// The whole tile as a matmul operand.
    pub fn all(&self) -> TileView {
        self.view(0, 0, self.rows, self.cols)
    }
    /// A window `[rows, cols]` starting at (row0, col0).
    pub fn view(&self, row0: u32, col0: u32, rows: u32, cols: u32) -> TileView {
        TileView {
            tile: self.name.clone(),
            row0,
            col0,
            rows,
            cols,
        }
    }
    /// Columns `[col0, col0 + cols)` of every row.
    pub fn cols(&self, col0: u32, cols: u32) -> TileView {
        self.view(0, col0, self.rows, cols)
    }
    /// Element (row, col): f32 for F32 / Bf16 tiles, u32 for U8 tiles.
    pub fn at(&self, row: Expr, col: Expr) -> Expr {
        Expr::TileLoad {
            tile: self.name.clone(),
            elem: self.elem,
            row: Box::new(row),
            col: Box::new(col),
        }
    }
    /// The 32-bit word `word` of row `row` as u32 (see [`Expr::TileWord`]).
    pub fn word(&self, row: Expr, word: Expr) -> Expr {
        Expr::TileWord {
            tile: self.name.clone(),
            row: Box::new(row),
            word: Box::new(word),
        }
    }
}

/// An f32 accumulator tile `[rows, cols]` in registers.
#[derive(Clone, Debug)]
pub struct Acc {
    pub name: String,
    pub rows: u32,
    pub cols: u32,
}

/// What [`KernelBuilder::acc_for_each`] binds for its body.
pub struct Elems {
    /// Row of the pair (u32).
    pub row: Expr,
    /// Column of the first element of the pair (u32, even).
    pub col: Expr,
    /// The value at (row, col); assign to it with [`KernelBuilder::set`].
    pub v0: Expr,
    /// The value at (row, col + 1).
    pub v1: Expr,
}

// ---------------------------------------------------------------- builder

/// Identifiers the emitted code reserves.
const RESERVED: &[&str] = &[
    "p",
    "pass",
    "uniform",
    "storage",
    "workgroup",
    "private",
    "function",
    "override",
    "enable",
    "requires",
    "discard",
    "continuing",
    "alias",
    "loop",
    "fn",
    "let",
    "var",
    "ptr",
    "array",
    "atomic",
    "bitcast",
    "select",
    "vec2",
    "vec3",
    "vec4",
    "mat2x2",
    "f16",
    "f32",
    "i32",
    "u32",
    "bool",
    "true",
    "false",
    "short",
    "int",
    "long",
    "float",
    "double",
    "char",
    "signed",
    "unsigned",
    "struct",
    "union",
    "enum",
    "default",
    "case",
    "switch",
    "break",
    "continue",
    "return",
    "const",
    "static",
    "volatile",
    "register",
    "extern",
    "inline",
    "goto",
    "typedef",
    "sizeof",
    "template",
    "class",
    "namespace",
    "this",
    "new",
    "delete",
    "public",
    "protected",
    "virtual",
    "auto",
    "half",
    "asm",
    "do",
    "while",
    "for",
    "if",
    "else",
    "void",
    "restrict",
    "module",
    "target",
    "active",
    "common",
    "filter",
    "mod",
];

pub struct KernelBuilder {
    kernel: Kernel,
    blocks: Vec<Vec<Stmt>>,
    names: HashMap<String, u32>,
    errors: Vec<String>,
}

impl KernelBuilder {
    pub fn new(name: impl Into<String>, workgroup_size: u32) -> Self {
        KernelBuilder {
            kernel: Kernel {
                name: name.into(),
                doc: Vec::new(),
                workgroup_size,
                params: Vec::new(),
                buffers: Vec::new(),
                shared: Vec::new(),
                privates: Vec::new(),
                shared_tiles: Vec::new(),
                acc_tiles: Vec::new(),
                body: Vec::new(),
                min_workgroups: 0,
                index_terms: false,
                // Every kernel waits for its predecessor first and lets its successor launch
                // early: a stream of them (a decode step) keeps its order and hides each
                // launch behind the kernel before it.
                grid_dependency: GridDependency {
                    early_dependents: true,
                    waits_for_previous: true,
                    cooperative: false,
                },
            },
            blocks: vec![Vec::new()],
            // Names a description variable must not take: `p` is the parameter block in the
            // emitted CUDA C, the rest are WGSL or C keywords (`fresh` then adds a suffix).
            names: RESERVED.iter().map(|n| (n.to_string(), 1)).collect(),
            errors: Vec::new(),
        }
    }

    /// How the kernel overlaps its launch with its neighbours in the stream (CUDA only).
    pub fn grid_dependency(&mut self, dependency: GridDependency) {
        self.kernel.grid_dependency = dependency;
    }

    /// A line for the generated file's header.
    pub fn doc(&mut self, line: impl Into<String>) {
        self.kernel.doc.push(line.into());
    }

    /// A fresh identifier based on `base` (unique in the kernel).
    pub fn fresh(&mut self, base: &str) -> String {
        let n = self.names.entry(base.to_string()).or_insert(0);
        let name = if *n == 0 {
            base.to_string()
        } else {
            format!("{base}_{n}")
        };
        *n += 1;
        name
    }

    fn error(&mut self, msg: String) {
        self.errors.push(msg);
    }

    fn push(&mut self, s: Stmt) {
        self.blocks.last_mut().expect("block stack").push(s);
    }

    fn block(&mut self, f: impl FnOnce(&mut Self)) -> Vec<Stmt> {
        self.blocks.push(Vec::new());
        f(self);
        self.blocks.pop().expect("block stack")
    }

    fn check_bin(&mut self, e: &Expr) {
        e.visit(&mut |x| {
            if let Expr::Bin(op, a, b) = x {
                let (ta, tb) = (a.ty(), b.ty());
                let ok = match op {
                    BinOp::Shl | BinOp::Shr => tb == Ty::U32,
                    _ => ta == tb,
                };
                if !ok {
                    self.errors
                        .push(format!("operands of {op:?} differ: {ta} vs {tb}"));
                }
            }
        });
    }

    // --- declarations

    pub fn param(&mut self, name: &str, ty: Ty, doc: &str) -> Expr {
        self.names.insert(name.to_string(), 1);
        self.kernel.params.push(ParamDecl {
            name: name.into(),
            ty,
            doc: doc.into(),
        });
        Expr::Param(name.into(), ty)
    }

    pub fn buffer(&mut self, name: &str, elem: Elem, access: Access, doc: &str) -> Buf {
        self.names.insert(name.to_string(), 1);
        self.kernel.buffers.push(BufferDecl {
            name: name.into(),
            elem,
            access,
            doc: doc.into(),
        });
        Buf {
            name: name.into(),
            elem,
        }
    }

    pub fn shared(&mut self, name: &str, ty: Ty, len: u32) -> Shared {
        let name = self.fresh(name);
        self.kernel.shared.push(SharedDecl {
            alias: None,
            name: name.clone(),
            ty,
            len,
        });
        Shared { name, ty, len }
    }

    pub fn shared_tile(&mut self, name: &str, elem: TileElem, rows: u32, cols: u32) -> STile {
        let name = self.fresh(name);
        if elem == TileElem::Bf16 && cols % 2 != 0
            || matches!(elem, TileElem::U8 | TileElem::E4m3) && cols % 4 != 0
        {
            self.error(format!(
                "tile {name}: {cols} columns do not fill whole words"
            ));
        }
        self.kernel.shared_tiles.push(SharedTileDecl {
            name: name.clone(),
            elem,
            rows,
            cols,
            alias: None,
        });
        STile {
            name,
            elem,
            rows,
            cols,
        }
    }

    /// A typed window of `parent`'s rows: row `r` of the new tile is `cols` elements of
    /// `elem` starting `byte_offset` bytes into row `r` of `parent` (16-byte aligned, inside
    /// the row). It takes no memory; a gather into `parent` fills it. For rows whose parts
    /// have different types (fp8_ds_mla: e4m3 latent, f32 scales, bf16 rope), gathered whole
    /// by one copy each. Tensor-core lowerings only.
    pub fn shared_alias(
        &mut self,
        parent: &STile,
        name: &str,
        elem: TileElem,
        byte_offset: u32,
        cols: u32,
    ) -> STile {
        let name = self.fresh(name);
        let (bytes, parent_bytes) = (cols * elem.bytes(), parent.cols * parent.elem.bytes());
        if byte_offset % 16 != 0 || bytes % 4 != 0 || byte_offset + bytes > parent_bytes {
            self.error(format!(
                "tile {name}: bytes {byte_offset}..{} are not a 16-byte aligned window of whole \
                 words inside the {parent_bytes}-byte rows of {}",
                byte_offset + bytes,
                parent.name
            ));
        }
        let parent_is_alias = self
            .kernel
            .shared_tile(&parent.name)
            .is_some_and(|t| t.alias.is_some());
        if parent_is_alias {
            self.error(format!("tile {name}: {} is itself an alias", parent.name));
        }
        self.kernel.shared_tiles.push(SharedTileDecl {
            name: name.clone(),
            elem,
            rows: parent.rows,
            cols,
            alias: Some((parent.name.clone(), byte_offset)),
        });
        STile {
            name,
            elem,
            rows: parent.rows,
            cols,
        }
    }

    pub fn acc_tile(&mut self, name: &str, rows: u32, cols: u32) -> Acc {
        let name = self.fresh(name);
        if cols % 2 != 0 {
            self.error(format!(
                "accumulator {name}: columns must be even, got {cols}"
            ));
        }
        self.kernel.acc_tiles.push(AccTileDecl {
            name: name.clone(),
            rows,
            cols,
        });
        Acc { name, rows, cols }
    }

    // --- scalar statements

    pub fn comment(&mut self, text: impl Into<String>) {
        self.push(Stmt::Comment(text.into()));
    }

    /// Immutable binding; returns the variable.
    pub fn let_(&mut self, name: &str, value: Expr) -> Expr {
        self.check_bin(&value);
        let name = self.fresh(name);
        let ty = value.ty();
        self.push(Stmt::Let {
            name: name.clone(),
            value,
        });
        Expr::Var(name, ty)
    }

    /// Mutable variable; returns it (assign with [`Self::set`]).
    pub fn var(&mut self, name: &str, value: Expr) -> Expr {
        self.check_bin(&value);
        let name = self.fresh(name);
        let ty = value.ty();
        self.push(Stmt::Var {
            name: name.clone(),
            value,
        });
        Expr::Var(name, ty)
    }

    pub fn set(&mut self, var: &Expr, value: Expr) {
        self.check_bin(&value);
        match var {
            Expr::Var(name, ty) => {
                if *ty != value.ty() {
                    self.error(format!("assigning {} to {name}: {ty}", value.ty()));
                }
                self.push(Stmt::Assign {
                    name: name.clone(),
                    value,
                })
            }
            other => self.error(format!("assignment to a non-variable {other:?}")),
        }
    }

    pub fn store(&mut self, buf: &Buf, index: Expr, value: Expr) {
        self.check_bin(&value);
        if !matches!(buf.elem, Elem::F32 | Elem::I32 | Elem::U32) {
            self.error(format!(
                "store to {} ({}): use store_word for packed elements",
                buf.name,
                buf.elem.name()
            ));
        } else if value.ty() != buf.elem.value_ty() {
            self.error(format!("store of {} into {}", value.ty(), buf.name));
        }
        self.push(Stmt::Store {
            buf: buf.name.clone(),
            index,
            value,
        });
    }

    /// `buf[index] = v0; buf[index + 1] = v1` in one 8-byte store ([`Intrinsic::StoreF32x2`]):
    /// an F32 buffer whose base is 8-byte aligned, `index` even. CUDA only: the WGSL emitter
    /// refuses intrinsics, so a description also lowered for WGSL stores the two values.
    pub fn store_f32x2(&mut self, buf: &Buf, index: Expr, v0: Expr, v1: Expr) {
        self.check_bin(&v0);
        self.check_bin(&v1);
        if buf.elem != Elem::F32 || v0.ty() != Ty::F32 || v1.ty() != Ty::F32 {
            self.error(format!(
                "store_f32x2 into {} ({}): needs an f32 buffer and two f32 values",
                buf.name,
                buf.elem.name()
            ));
        }
        self.push(Stmt::Intrinsic(Intrinsic::StoreF32x2 {
            buf: buf.name.clone(),
            index,
            v0,
            v1,
        }));
    }

    /// The `count` workgroups of group `group` meet ([`Intrinsic::GroupSync`], on the words
    /// `2 group` and `2 group + 1` of the u32 buffer `counters`, zeroed before the first
    /// launch): the global writes of each before it are visible to all after it. Uniform
    /// control flow only. The kernel becomes cooperative (every workgroup resident at once,
    /// or the launch fails); CUDA only: the WGSL emitter refuses it.
    pub fn group_sync(&mut self, counters: &Buf, group: Expr, count: Expr) {
        self.check_bin(&group);
        self.check_bin(&count);
        if counters.elem != Elem::U32 || group.ty() != Ty::U32 || count.ty() != Ty::U32 {
            self.error(format!(
                "group_sync on {} ({}): needs a u32 buffer, a u32 group and a u32 count",
                counters.name,
                counters.elem.name()
            ));
        }
        self.kernel.grid_dependency.cooperative = true;
        self.push(Stmt::Intrinsic(Intrinsic::GroupSync {
            counters: counters.name.clone(),
            group,
            count,
        }));
    }

    pub fn store_word(&mut self, buf: &Buf, index: Expr, value: Expr) {
        self.check_bin(&value);
        if value.ty() != Ty::U32 {
            self.error(format!("store_word into {} needs u32", buf.name));
        }
        self.push(Stmt::StoreWord {
            buf: buf.name.clone(),
            index,
            value,
        });
    }

    pub fn shared_store(&mut self, arr: &Shared, index: Expr, value: Expr) {
        self.check_bin(&value);
        if value.ty() != arr.ty {
            self.error(format!(
                "shared store of {} into {} ({})",
                value.ty(),
                arr.name,
                arr.ty
            ));
        }
        self.push(Stmt::SharedStore {
            arr: arr.name.clone(),
            index,
            value,
        });
    }

    pub fn if_(&mut self, cond: Expr, then: impl FnOnce(&mut Self)) {
        self.if_else(cond, then, |_| {});
    }

    pub fn if_else(
        &mut self,
        cond: Expr,
        then: impl FnOnce(&mut Self),
        els: impl FnOnce(&mut Self),
    ) {
        self.check_bin(&cond);
        if cond.ty() != Ty::Bool {
            self.error(format!("if condition is {}", cond.ty()));
        }
        let then = self.block(then);
        let els = self.block(els);
        self.push(Stmt::If { cond, then, els });
    }

    /// `for (var = start; var < end; var += step) body(var)`.
    pub fn for_(
        &mut self,
        name: &str,
        start: Expr,
        end: Expr,
        step: Expr,
        body: impl FnOnce(&mut Self, Expr),
    ) {
        let var = self.fresh(name);
        let ty = start.ty();
        if end.ty() != ty || step.ty() != ty {
            self.error(format!("loop {var}: bounds of mixed types"));
        }
        let v = Expr::Var(var.clone(), ty);
        let body = self.block(|b| body(b, v));
        self.push(Stmt::For {
            var,
            start,
            end,
            step,
            body,
        });
    }

    /// A block-strided loop: each thread takes `local_id, local_id + W, ...` below `end` (u32).
    pub fn for_threads(&mut self, name: &str, end: Expr, body: impl FnOnce(&mut Self, Expr)) {
        let w = u(self.kernel.workgroup_size);
        self.for_(name, local_id(), end, w, body);
    }

    pub fn barrier(&mut self) {
        self.push(Stmt::Barrier);
    }

    // --- tile ops

    /// See [`TileOp::GatherRows`]. `src_word(row)` gives the first word of the row in `src`
    /// as i32, negative for "no row" (zero-filled, not read).
    pub fn gather_rows(
        &mut self,
        dst: &STile,
        dst_word0: u32,
        words: u32,
        src: &Buf,
        src_word: impl FnOnce(&mut Self, Expr) -> Expr,
    ) {
        self.gather(dst, dst_word0, words, src, None, src_word);
    }

    /// [`Self::gather_rows`] that also records each row's validity in `flags` (an F32 tile
    /// `[1, dst.rows]`: 1.0 for a row with a source, 0.0 without); a row without a source
    /// then holds unspecified finite values (see [`TileOp::GatherRows`]).
    pub fn gather_rows_flagged(
        &mut self,
        dst: &STile,
        dst_word0: u32,
        words: u32,
        src: &Buf,
        flags: &STile,
        src_word: impl FnOnce(&mut Self, Expr) -> Expr,
    ) {
        if flags.elem != TileElem::F32 || flags.rows != 1 || flags.cols != dst.rows {
            self.error(format!(
                "gather into {}: flags {} must be an f32 tile [1, {}]",
                dst.name, flags.name, dst.rows
            ));
        }
        self.gather(
            dst,
            dst_word0,
            words,
            src,
            Some(flags.name.clone()),
            src_word,
        );
    }

    fn gather(
        &mut self,
        dst: &STile,
        dst_word0: u32,
        words: u32,
        src: &Buf,
        flags: Option<String>,
        src_word: impl FnOnce(&mut Self, Expr) -> Expr,
    ) {
        let row = self.fresh("row");
        let e = src_word(self, Expr::Var(row.clone(), Ty::U32));
        if e.ty() != Ty::I32 {
            self.error(format!("gather into {}: src_word must be i32", dst.name));
        }
        let row_words = dst.cols * dst.elem.bytes() / 4;
        if dst_word0 + words > row_words {
            self.error(format!(
                "gather into {}: words {}..{} exceed the row's {} words",
                dst.name,
                dst_word0,
                dst_word0 + words,
                row_words
            ));
        }
        self.push(Stmt::Tile(TileOp::GatherRows(RowGather {
            dst: dst.name.clone(),
            dst_word0,
            words,
            src: src.name.clone(),
            row,
            src_word: e,
            flags,
        })));
    }

    pub fn acc_fill(&mut self, acc: &Acc, value: f32) {
        self.push(Stmt::Tile(TileOp::AccFill {
            acc: acc.name.clone(),
            value,
        }));
    }

    /// `acc += a · b` (see [`TileOp::Mma`]).
    pub fn mma(&mut self, acc: &Acc, a: TileView, b: TileView, b_layout: BLayout) {
        let (bn, bk) = match b_layout {
            BLayout::NK => (b.rows, b.cols),
            BLayout::KN => (b.cols, b.rows),
        };
        if a.rows != acc.rows || bn != acc.cols || a.cols != bk {
            self.error(format!(
                "mma into {} [{}x{}]: A is [{}x{}], B gives N={} K={}",
                acc.name, acc.rows, acc.cols, a.rows, a.cols, bn, bk
            ));
        }
        for v in [&a, &b] {
            match self.kernel.shared_tile(&v.tile) {
                Some(t) if v.row0 + v.rows <= t.rows && v.col0 + v.cols <= t.cols => {}
                _ => self.error(format!("mma operand view {v:?} is outside its tile")),
            }
        }
        self.push(Stmt::Tile(TileOp::Mma {
            acc: acc.name.clone(),
            a,
            b,
            b_layout,
        }));
    }

    /// `acc += a · (b with each storage row r scaled by scale(r))` (see
    /// [`TileOp::MmaScaled`]).
    pub fn mma_scaled(
        &mut self,
        acc: &Acc,
        a: TileView,
        b: TileView,
        b_layout: BLayout,
        scale: impl FnOnce(&mut Self, Expr) -> Expr,
    ) {
        let row = self.fresh("row");
        let value = scale(self, Expr::Var(row.clone(), Ty::U32));
        if value.ty() != Ty::F32 {
            self.error(format!(
                "mma_scaled into {}: the scale must be f32",
                acc.name
            ));
        }
        let before = self.errors.len();
        self.mma(acc, a, b, b_layout);
        if let Some(Stmt::Tile(TileOp::Mma {
            acc,
            a,
            b,
            b_layout,
        })) = self.blocks.last_mut().and_then(|v| v.pop())
        {
            if self.errors.len() == before {
                self.push(Stmt::Tile(TileOp::MmaScaled {
                    acc,
                    a,
                    b,
                    b_layout,
                    row,
                    scale: value,
                }));
            }
        }
    }

    /// Run `body` on every element pair of `acc` (see [`TileOp::AccForEach`]).
    pub fn acc_for_each(&mut self, acc: &Acc, body: impl FnOnce(&mut Self, &Elems)) {
        let (row, col, v0, v1) = (
            self.fresh("row"),
            self.fresh("col"),
            self.fresh("v0"),
            self.fresh("v1"),
        );
        let elems = Elems {
            row: Expr::Var(row.clone(), Ty::U32),
            col: Expr::Var(col.clone(), Ty::U32),
            v0: Expr::Var(v0.clone(), Ty::F32),
            v1: Expr::Var(v1.clone(), Ty::F32),
        };
        let body = self.block(|b| body(b, &elems));
        self.push(Stmt::Tile(TileOp::AccForEach {
            acc: acc.name.clone(),
            row,
            col,
            v0,
            v1,
            body,
        }));
    }

    pub fn acc_row_reduce(&mut self, acc: &Acc, op: Reduce, dst: &Shared) {
        if dst.len < acc.rows || dst.ty != Ty::F32 {
            self.error(format!(
                "row reduce of {} into {}: needs f32 × {}",
                acc.name, dst.name, acc.rows
            ));
        }
        self.push(Stmt::Tile(TileOp::AccRowReduce {
            acc: acc.name.clone(),
            op,
            dst: dst.name.clone(),
        }));
    }

    pub fn acc_to_shared(&mut self, acc: &Acc, dst: &STile) {
        if acc.rows != dst.rows
            || acc.cols != dst.cols
            || matches!(dst.elem, TileElem::U8 | TileElem::E4m3)
        {
            self.error(format!(
                "acc {} [{}x{}] to shared {} [{}x{}] {:?}",
                acc.name, acc.rows, acc.cols, dst.name, dst.rows, dst.cols, dst.elem
            ));
        }
        self.push(Stmt::Tile(TileOp::AccToShared {
            acc: acc.name.clone(),
            dst: dst.name.clone(),
        }));
    }

    /// One online-softmax step as a single tile op (see [`TileOp::OnlineSoftmax`]): `expansion`
    /// writes its definition in primitive statements, which lowerings without a native form
    /// of the op lower instead. Used by [`super::ops::online_softmax_update`].
    pub fn online_softmax(
        &mut self,
        s: &Acc,
        (m, l): (&Shared, &Shared),
        outs: &[&Acc],
        p_tile: &STile,
        expansion: impl FnOnce(&mut Self),
    ) {
        for arr in [m, l] {
            if arr.ty != Ty::F32 || arr.len < s.rows {
                self.error(format!(
                    "online softmax of {}: state {} must be f32 × {}",
                    s.name, arr.name, s.rows
                ));
            }
        }
        for o in outs {
            if o.rows != s.rows {
                self.error(format!(
                    "online softmax of {} [{} rows]: accumulator {} has {} rows",
                    s.name, s.rows, o.name, o.rows
                ));
            }
        }
        if p_tile.rows != s.rows
            || p_tile.cols != s.cols
            || matches!(p_tile.elem, TileElem::U8 | TileElem::E4m3)
        {
            self.error(format!(
                "online softmax of {} [{}x{}]: P tile {} is [{}x{}] {:?}",
                s.name, s.rows, s.cols, p_tile.name, p_tile.rows, p_tile.cols, p_tile.elem
            ));
        }
        let expansion = self.block(expansion);
        self.push(Stmt::Tile(TileOp::OnlineSoftmax {
            s: s.name.clone(),
            m: m.name.clone(),
            l: l.name.clone(),
            outs: outs.iter().map(|o| o.name.clone()).collect(),
            p_tile: p_tile.name.clone(),
            expansion,
        }));
    }

    /// `dst[r, c] = e4m3(src[r, c]) · scale(r, c / per)` for the whole bf16 tile `dst`
    /// (see [`TileOp::DequantRows`]): e4m3 rows decoded once into a tile every warp reads.
    pub fn dequant_rows(
        &mut self,
        dst: &STile,
        src: &STile,
        per: u32,
        scale: impl FnOnce(&mut Self, Expr, Expr) -> Expr,
    ) {
        let (row, group) = (self.fresh("row"), self.fresh("group"));
        let v = scale(
            self,
            Expr::Var(row.clone(), Ty::U32),
            Expr::Var(group.clone(), Ty::U32),
        );
        self.check_bin(&v);
        if v.ty() != Ty::F32 {
            self.error(format!(
                "dequant_rows into {}: the scale must be f32",
                dst.name
            ));
        }
        if dst.elem != TileElem::Bf16 || src.elem != TileElem::E4m3 {
            self.error(format!(
                "dequant_rows into {}: takes an e4m3 tile into a bf16 one, got {:?} into {:?}",
                dst.name, src.elem, dst.elem
            ));
        }
        if dst.rows != src.rows || dst.cols > src.cols || dst.cols % 4 != 0 {
            self.error(format!(
                "dequant_rows into {}: [{}x{}] from [{}x{}] (same rows, at most the source's \
                 columns, a multiple of 4)",
                dst.name, dst.rows, dst.cols, src.rows, src.cols
            ));
        }
        if per == 0 || per % 4 != 0 {
            self.error(format!(
                "dequant_rows into {}: the scale's column group {per} is not a multiple of 4",
                dst.name
            ));
        }
        self.push(Stmt::Tile(TileOp::DequantRows {
            dst: dst.name.clone(),
            src: src.name.clone(),
            row,
            group,
            per,
            scale: v,
        }));
    }

    /// `dst[r, c] = value(r, c)` for the whole shared tile.
    pub fn shared_map(&mut self, dst: &STile, value: impl FnOnce(&mut Self, Expr, Expr) -> Expr) {
        self.shared_map_cols(dst, 0, dst.cols, value);
    }

    /// `dst[r, c] = value(r, c)` for columns `col0 .. col0 + cols` of every row; the other
    /// columns are left as they are. The window must cover whole 32-bit words.
    pub fn shared_map_cols(
        &mut self,
        dst: &STile,
        col0: u32,
        cols: u32,
        value: impl FnOnce(&mut Self, Expr, Expr) -> Expr,
    ) {
        let (row, col) = (self.fresh("row"), self.fresh("col"));
        let v = value(
            self,
            Expr::Var(row.clone(), Ty::U32),
            Expr::Var(col.clone(), Ty::U32),
        );
        self.check_bin(&v);
        if dst.elem == TileElem::E4m3 {
            self.error(format!(
                "shared_map into {}: e4m3 tiles are filled by gathers only",
                dst.name
            ));
        }
        let want = if dst.elem == TileElem::U8 {
            Ty::U32
        } else {
            Ty::F32
        };
        if v.ty() != want {
            self.error(format!(
                "shared_map into {}: value must be {want}",
                dst.name
            ));
        }
        let per_word = 4 / dst.elem.bytes();
        if col0 + cols > dst.cols || col0 % per_word != 0 || cols % per_word != 0 {
            self.error(format!(
                "shared_map into {}: columns {col0}..{} are not whole words of its {} columns",
                dst.name,
                col0 + cols,
                dst.cols
            ));
        }
        self.push(Stmt::Tile(TileOp::SharedMap {
            dst: dst.name.clone(),
            row,
            col,
            col0,
            cols,
            value: v,
        }));
    }

    /// A two-stage loop over `count` steps (see [`TileOp::Pipeline`]).
    pub fn pipeline(
        &mut self,
        name: &str,
        count: Expr,
        load: impl FnOnce(&mut Self, Expr),
        compute: impl FnOnce(&mut Self, Expr),
    ) {
        self.pipeline_bounded(name, count, None, load, compute)
    }

    /// [`Self::pipeline`] with a load-free `bound` on its step count (see
    /// [`TileOp::Pipeline`]): the load stage's index reads of a step below `bound` may be
    /// issued before `count` is known.
    pub fn pipeline_bounded(
        &mut self,
        name: &str,
        count: Expr,
        bound: Option<Expr>,
        load: impl FnOnce(&mut Self, Expr),
        compute: impl FnOnce(&mut Self, Expr),
    ) {
        let var = self.fresh(name);
        if let Some(b) = &bound {
            let mut reads = false;
            b.visit(&mut |x| reads |= matches!(x, Expr::Load { .. } | Expr::LoadWord { .. }));
            if reads {
                self.error(format!(
                    "pipeline {var}: its step bound must read no buffer (it is known before any load)"
                ));
            }
        }
        let v = Expr::Var(var.clone(), Ty::U32);
        let load = self.block(|b| load(b, v.clone()));
        if load
            .iter()
            .any(|s| !matches!(s, Stmt::Tile(TileOp::GatherRows { .. }) | Stmt::Comment(_)))
        {
            self.error(format!(
                "pipeline {var}: the load stage may hold only gather_rows"
            ));
        }
        let compute = self.block(|b| compute(b, v));
        self.push(Stmt::Tile(TileOp::Pipeline {
            var,
            count,
            bound,
            load,
            compute,
        }));
    }

    /// The finished description, or every mistake found while building it.
    pub fn finish(mut self) -> Result<Kernel> {
        self.kernel.body = self.blocks.pop().unwrap_or_default();
        if !self.errors.is_empty() {
            return Err(Error::Kir {
                kernel: self.kernel.name,
                message: self.errors.join("; "),
            });
        }
        Ok(self.kernel)
    }
}
