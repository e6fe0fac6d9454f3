//! The kernel description language: types, expressions, statements and the tile ops.
//!
//! A [`Kernel`] is one compute entry point with a 1-D workgroup. It reads scalar
//! parameters (a uniform struct in WGSL, a by-value struct in CUDA), binds storage buffers
//! and declares workgroup (shared) arrays. Its body mixes scalar statements with
//! [`TileOp`]s. Tile ops say *what* happens to a tile; a lowering pass
//! ([`super::lower_scalar`], later a tensor-core one) rewrites them into scalar statements
//! (and, for CUDA, target intrinsics) before an emitter prints the result. Emitters never
//! see a tile op, and nothing here knows about MLA.

use std::fmt;

/// Scalar value types.
///
/// `Bf16` and `F8E4M3` are storage types: a value of one of them is the raw bits, and the only
/// things to do with it are [`Expr::Cvt`] to `F32` (and back for bf16, via
/// [`Func::PackBf16x2`]). In WGSL they are carried as `u32`, in CUDA as `unsigned short` /
/// `unsigned char`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    F32,
    I32,
    U32,
    Bool,
    Bf16,
    F8E4M3,
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Ty::F32 => "f32",
            Ty::I32 => "i32",
            Ty::U32 => "u32",
            Ty::Bool => "bool",
            Ty::Bf16 => "bf16",
            Ty::F8E4M3 => "e4m3",
        };
        f.write_str(s)
    }
}

/// Element type of a storage buffer. `Bf16` packs two elements per 32-bit word and `U8`
/// four (little-endian), which is how WGSL sees them; CUDA sees them as `unsigned short*`
/// and `unsigned char*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    I32,
    U32,
    Bf16,
    U8,
}

impl Elem {
    pub fn bytes(&self) -> u32 {
        match self {
            Elem::F32 | Elem::I32 | Elem::U32 => 4,
            Elem::Bf16 => 2,
            Elem::U8 => 1,
        }
    }

    /// The type [`Expr::Load`] yields for this element.
    pub fn value_ty(&self) -> Ty {
        match self {
            Elem::F32 => Ty::F32,
            Elem::I32 => Ty::I32,
            Elem::U32 => Ty::U32,
            Elem::Bf16 => Ty::Bf16,
            Elem::U8 => Ty::U32,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::I32 => "i32",
            Elem::U32 => "u32",
            Elem::Bf16 => "bf16",
            Elem::U8 => "u8",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// A storage buffer binding. `doc` carries the shape, e.g. `[tokens, heads, 576]`.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferDecl {
    pub name: String,
    pub elem: Elem,
    pub access: Access,
    pub doc: String,
}

/// A scalar kernel parameter (4 bytes each, in declaration order).
#[derive(Clone, Debug, PartialEq)]
pub struct ParamDecl {
    pub name: String,
    pub ty: Ty,
    pub doc: String,
}

/// A workgroup-shared array of 32-bit elements (`F32`, `I32` or `U32`).
#[derive(Clone, Debug, PartialEq)]
pub struct SharedDecl {
    pub name: String,
    pub ty: Ty,
    pub len: u32,
    /// `(array, byte offset)`: this array is a view of another's memory starting that many
    /// bytes in, and takes none of its own (a tile's typed window, see
    /// [`SharedTileDecl::alias`]).
    pub alias: Option<(String, u32)>,
}

/// A per-thread (private / register) array.
#[derive(Clone, Debug, PartialEq)]
pub struct PrivateDecl {
    pub name: String,
    pub ty: Ty,
    pub len: u32,
}

/// Element type of a shared tile. Physical layout (strides, padding, swizzle) belongs to the
/// lowering, so a description reaches a tile's elements only through tile ops and
/// [`Expr::TileLoad`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileElem {
    F32,
    Bf16,
    /// Raw bytes (e.g. fp8 rows as they sit in the cache).
    U8,
    /// e4m3fn values, one byte each (no infinities, 0x7f / 0xff NaN, max 448): read as f32
    /// by [`Expr::TileLoad`]; as an mma operand exact in bf16, so a product with it needs no
    /// rounding of the tile.
    E4m3,
    /// IEEE binary16, two per 32-bit word (written rounded to nearest even). Where P of an
    /// fp8_ds_mla `P · V` lives: P is in [0, 1], where f16 keeps 11 bits (bf16 8), and the
    /// tensor-core lowering multiplies it with the e4m3 rows as f16 (see `lower_mma::e4m3`).
    F16,
}

impl TileElem {
    pub fn bytes(&self) -> u32 {
        match self {
            TileElem::F32 => 4,
            TileElem::Bf16 | TileElem::F16 => 2,
            TileElem::U8 | TileElem::E4m3 => 1,
        }
    }
}

/// A 2-D tile in workgroup memory, `[rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedTileDecl {
    pub name: String,
    pub elem: TileElem,
    pub rows: u32,
    pub cols: u32,
    /// `(tile, byte offset)`: a typed window of another tile's rows — row `r` of this tile
    /// starts `byte offset` bytes into row `r` of that tile, which holds it whole (one gather
    /// of the other tile fills both). None: a tile of its own.
    pub alias: Option<(String, u32)>,
}

/// A 2-D f32 accumulator tile held in registers, spread over the workgroup's threads. Which
/// thread holds which element is the lowering's choice; a description reaches elements
/// only through [`TileOp::AccForEach`].
#[derive(Clone, Debug, PartialEq)]
pub struct AccTileDecl {
    pub name: String,
    pub rows: u32,
    pub cols: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Builtin {
    /// Thread index within the workgroup (`local_invocation_index` / `threadIdx.x`).
    LocalId,
    /// Workgroup index along an axis (0 = x, 1 = y, 2 = z).
    WorkgroupId(u8),
    /// Workgroup count along an axis.
    NumWorkgroups(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnOp {
    Neg,
    Not,
    BitNot,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Min,
    Max,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
    BitAnd,
    BitOr,
    BitXor,
    Shl,
    Shr,
}

impl BinOp {
    pub fn is_comparison(&self) -> bool {
        matches!(
            self,
            BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::Eq | BinOp::Ne
        )
    }
}

/// Built-in functions. Each emitter prints its own spelling; the conversions of storage types
/// are here so that their lowering (software in WGSL, inline PTX in CUDA) stays in the emitter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Func {
    /// Natural exponential, f32.
    Exp,
    /// Natural exponential, f32, approximate (relative error about 2^-22 plus |x| · 2^-24
    /// from rounding `x · log2 e`, results below 2^-126 flushed to 0): CUDA's
    /// `ex2.approx.ftz` of `x · log2 e`, two instructions where [`Func::Exp`] (`expf`) is
    /// about eight; WGSL's `exp`. For the online softmax's
    /// probabilities and rescale factors, which are rounded to bf16 / f16 (P) or feed f32
    /// sums whose tolerance is far above it, and the split merge's weights.
    ExpFast,
    /// 2^x, f32, approximate (relative error about 2^-22, results below 2^-126 flushed to 0,
    /// 2^-inf = 0): CUDA's `ex2.approx.ftz`, one instruction; WGSL's `exp2`. For exponents a
    /// lowering has already multiplied by log2 e, folded into an FMA with what it subtracts.
    Exp2Fast,
    /// Natural logarithm, f32.
    Log,
    Sqrt,
    Abs,
    /// `fma(a, b, c) = a·b + c`.
    Fma,
    /// Pack two f32 into a u32 holding two bf16 (round to nearest even; `a` in the low half).
    PackBf16x2,
    /// Reinterpret bits: f32 → u32.
    F32Bits,
    /// Reinterpret bits: u32 → f32.
    F32FromBits,
    /// Count of leading zero bits of a u32 (32 for 0).
    Clz,
    /// Two e4m3 values (bits 0..16 of a u32) in the form [`Func::E4m3x2Lo`] / `Hi` read, a
    /// u32 meaningful to nothing else: on CUDA sm_89+ the pair converted to two f16 in one
    /// instruction, elsewhere the bytes unchanged.
    E4m3x2Prep,
    /// The first (low) of the two values of an [`Func::E4m3x2Prep`] result, as f32.
    E4m3x2Lo,
    /// The second (high) of the two values of an [`Func::E4m3x2Prep`] result, as f32.
    E4m3x2Hi,
    /// Four f32 to four e4m3 bytes of a u32 (round to nearest even, saturating at ±448; the
    /// first argument in the low byte). CUDA only (operands of [`Intrinsic::MmaE4m3`]).
    PackE4m3x4,
    /// No arguments, bool, a compile-time constant of the CUDA C: does the GPU compiled for
    /// run [`Intrinsic::MmaE4m3`] as one instruction (sm_89, sm_120)? sm_90's ptxas lowers it
    /// to e4m3 → f16 conversions and two f16 products (its fp8 tensor cores are wgmma's only),
    /// so code picks the bf16 form there. CUDA only.
    E4m3MmaNative,
    /// Pack two f32 into a u32 holding two f16 (round to nearest even; `a` in the low half).
    PackF16x2,
    /// The low / high f16 of a u32, as f32.
    F16Lo,
    F16Hi,
    /// Two f16 pairs multiplied lane by lane (f16 result, round to nearest even).
    MulF16x2,
    /// Two e4m3 values (bits 0..16 of a u32) as an f16 pair, each times
    /// 1 / [`Func::E4m3F16Unit`]: exact (on CUDA sm_89+ one `cvt`; before, the bits moved
    /// into place, which is the value times 2^-8).
    E4m3x2F16,
    /// No arguments, f32: the factor [`Func::E4m3x2F16`]'s values are short of the e4m3
    /// values (1 where the conversion is exact, 256 where it moves bits).
    E4m3F16Unit,
}

/// An expression. Every node knows its type ([`Expr::ty`]) without an environment.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    F32(f32),
    I32(i32),
    U32(u32),
    Bool(bool),
    /// A local variable, by name.
    Var(String, Ty),
    /// A kernel parameter, by name.
    Param(String, Ty),
    Builtin(Builtin),
    Un(UnOp, Box<Expr>),
    Bin(BinOp, Box<Expr>, Box<Expr>),
    /// `if cond { a } else { b }`, both evaluated.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// Numeric conversion between f32 / i32 / u32, and storage-type decode (bf16 / e4m3 → f32).
    Cvt(Ty, Box<Expr>),
    Call(Func, Vec<Expr>),
    /// Element `index` of a buffer, typed by the buffer's element ([`Elem::value_ty`]).
    Load {
        buf: String,
        elem: Elem,
        index: Box<Expr>,
    },
    /// The 32-bit word `index` of any buffer (packed elements included), as u32.
    LoadWord {
        buf: String,
        index: Box<Expr>,
    },
    /// Element of a shared array.
    SharedLoad {
        arr: String,
        ty: Ty,
        index: Box<Expr>,
    },
    /// Element of a private array.
    PrivateLoad {
        arr: String,
        ty: Ty,
        index: Box<Expr>,
    },
    /// Element (row, col) of a shared tile: f32 for F32, Bf16 and E4m3 tiles, u32 for U8 tiles.
    /// Removed by lowering.
    TileLoad {
        tile: String,
        elem: TileElem,
        row: Box<Expr>,
        col: Box<Expr>,
    },
    /// The 32-bit word `word` of tile row `row`, as u32: bytes `4·word .. 4·word + 4` of the
    /// row, little-endian (two bf16, four bytes, or one f32's bits). How packed data that is
    /// not one element wide (an f32 scale inside a byte row) is read. Removed by lowering.
    TileWord {
        tile: String,
        row: Box<Expr>,
        word: Box<Expr>,
    },
}

impl Expr {
    pub fn ty(&self) -> Ty {
        match self {
            Expr::F32(_) => Ty::F32,
            Expr::I32(_) => Ty::I32,
            Expr::U32(_) => Ty::U32,
            Expr::Bool(_) => Ty::Bool,
            Expr::Var(_, t) | Expr::Param(_, t) => *t,
            Expr::Builtin(_) => Ty::U32,
            Expr::Un(UnOp::Not, _) => Ty::Bool,
            Expr::Un(_, a) => a.ty(),
            Expr::Bin(op, a, _) => {
                if op.is_comparison() {
                    Ty::Bool
                } else {
                    a.ty()
                }
            }
            Expr::Select(_, a, _) => a.ty(),
            Expr::Cvt(t, _) => *t,
            Expr::Call(f, args) => match f {
                Func::PackBf16x2
                | Func::F32Bits
                | Func::E4m3x2Prep
                | Func::PackE4m3x4
                | Func::PackF16x2
                | Func::MulF16x2
                | Func::E4m3x2F16 => Ty::U32,
                Func::E4m3MmaNative => Ty::Bool,
                Func::F32FromBits
                | Func::E4m3x2Lo
                | Func::E4m3x2Hi
                | Func::F16Lo
                | Func::F16Hi
                | Func::E4m3F16Unit => Ty::F32,
                _ => args.first().map(|a| a.ty()).unwrap_or(Ty::F32),
            },
            Expr::Load { elem, .. } => elem.value_ty(),
            Expr::LoadWord { .. } => Ty::U32,
            Expr::SharedLoad { ty, .. } | Expr::PrivateLoad { ty, .. } => *ty,
            Expr::TileLoad { elem, .. } => match elem {
                TileElem::U8 => Ty::U32,
                _ => Ty::F32,
            },
            Expr::TileWord { .. } => Ty::U32,
        }
    }

    /// Calls `f` on this node and every sub-expression, parents first.
    pub fn visit(&self, f: &mut dyn FnMut(&Expr)) {
        f(self);
        match self {
            Expr::Un(_, a) | Expr::Cvt(_, a) => a.visit(f),
            Expr::Bin(_, a, b) => {
                a.visit(f);
                b.visit(f);
            }
            Expr::Select(c, a, b) => {
                c.visit(f);
                a.visit(f);
                b.visit(f);
            }
            Expr::Call(_, args) => args.iter().for_each(|a| a.visit(f)),
            Expr::Load { index, .. }
            | Expr::LoadWord { index, .. }
            | Expr::SharedLoad { index, .. }
            | Expr::PrivateLoad { index, .. } => index.visit(f),
            Expr::TileLoad { row, col, .. } => {
                row.visit(f);
                col.visit(f);
            }
            Expr::TileWord { row, word, .. } => {
                row.visit(f);
                word.visit(f);
            }
            _ => {}
        }
    }

    /// Rebuilds the expression bottom-up, letting `f` replace any node.
    pub fn map(self, f: &mut dyn FnMut(Expr) -> Expr) -> Expr {
        let e = match self {
            Expr::Un(op, a) => Expr::Un(op, Box::new(a.map(f))),
            Expr::Cvt(t, a) => Expr::Cvt(t, Box::new(a.map(f))),
            Expr::Bin(op, a, b) => Expr::Bin(op, Box::new(a.map(f)), Box::new(b.map(f))),
            Expr::Select(c, a, b) => {
                Expr::Select(Box::new(c.map(f)), Box::new(a.map(f)), Box::new(b.map(f)))
            }
            Expr::Call(func, args) => {
                Expr::Call(func, args.into_iter().map(|a| a.map(f)).collect())
            }
            Expr::Load { buf, elem, index } => Expr::Load {
                buf,
                elem,
                index: Box::new(index.map(f)),
            },
            Expr::LoadWord { buf, index } => Expr::LoadWord {
                buf,
                index: Box::new(index.map(f)),
            },
            Expr::SharedLoad { arr, ty, index } => Expr::SharedLoad {
                arr,
                ty,
                index: Box::new(index.map(f)),
            },
            Expr::PrivateLoad { arr, ty, index } => Expr::PrivateLoad {
                arr,
                ty,
                index: Box::new(index.map(f)),
            },
            Expr::TileLoad {
                tile,
                elem,
                row,
                col,
            } => Expr::TileLoad {
                tile,
                elem,
                row: Box::new(row.map(f)),
                col: Box::new(col.map(f)),
            },
            Expr::TileWord { tile, row, word } => Expr::TileWord {
                tile,
                row: Box::new(row.map(f)),
                word: Box::new(word.map(f)),
            },
            other => other,
        };
        f(e)
    }
}

/// A rectangular window of a shared tile, used as a matmul operand.
#[derive(Clone, Debug, PartialEq)]
pub struct TileView {
    pub tile: String,
    pub row0: u32,
    pub col0: u32,
    pub rows: u32,
    pub cols: u32,
}

/// How the B operand of [`TileOp::Mma`] is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BLayout {
    /// The view is `[N, K]` (each output column's K values contiguous): `C += A · viewᵀ`.
    NK,
    /// The view is `[K, N]`: `C += A · view`.
    KN,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Max,
    Sum,
}

/// Gather rows of 32-bit words from a buffer into a shared tile:
/// for each tile row `r < dst.rows`, with `row` bound to `r`:
/// if `src_word(r)` is `>= 0` (i32), `dst[r, words starting at dst_word0]` =
/// `src[src_word(r) .. + words]`, else those words are zero-filled and `src` is not read.
/// Widths in 32-bit words; `dst_word0 + words` fits the tile's row.
///
/// With `flags` (an F32 tile `[1, dst.rows]`): `flags[0, r]` = 1.0 when row `r` had a
/// source, else 0.0 — the row's validity, computed once where the gather is; and a row
/// without a source then holds unspecified *finite* values instead of zeros (what an
/// earlier gather of this workgroup left there, or zeros), so a reader must look at the
/// flag.
#[derive(Clone, Debug, PartialEq)]
pub struct RowGather {
    pub dst: String,
    pub dst_word0: u32,
    pub words: u32,
    pub src: String,
    pub row: String,
    pub src_word: Expr,
    pub flags: Option<String>,
}

/// Tile-level operations. Each is defined by its effect on whole tiles; lowerings choose the
/// thread mapping. Unless noted, a tile op is a workgroup-wide collective: every thread of the
/// workgroup reaches it (uniform control flow) and its results are visible to all threads
/// afterwards.
#[derive(Clone, Debug, PartialEq)]
pub enum TileOp {
    /// Gather rows of 32-bit words from a buffer into a shared tile: see [`RowGather`].
    GatherRows(RowGather),
    /// `acc = value` everywhere.
    AccFill { acc: String, value: f32 },
    /// `acc[M, N] += A[M, K] · B` with f32 accumulation; `a` a `[M, K]` view, `b` a `[N, K]` or
    /// `[K, N]` view per `b_layout`. Operands F32 or Bf16 tiles.
    Mma {
        acc: String,
        a: TileView,
        b: TileView,
        b_layout: BLayout,
    },
    /// `acc += A · B'` as [`TileOp::Mma`], where `B'` is `b` with each of its storage rows `r`
    /// (the rows of the tile `b` views: N for [`BLayout::NK`], K for [`BLayout::KN`])
    /// multiplied by `scale` (f32, with `row` bound to `r` as u32): a per-row dequantisation
    /// scale folded into the product (e4m3 values times their tile's scale), the operand
    /// itself left as stored.
    MmaScaled {
        acc: String,
        a: TileView,
        b: TileView,
        b_layout: BLayout,
        row: String,
        scale: Expr,
    },
    /// For every pair of adjacent elements `(row, col)`, `(row, col + 1)` of `acc` (`col`
    /// even), run `body` with the named variables bound: `row`, `col` (u32) and the mutable
    /// f32 `v0`, `v1` holding the two values; what the body leaves in `v0`, `v1` is written back.
    /// The body runs per thread, not collectively: no barriers or tile ops inside.
    AccForEach {
        acc: String,
        row: String,
        col: String,
        v0: String,
        v1: String,
        body: Vec<Stmt>,
    },
    /// `dst[r] = reduce_c acc[r, c]` for every row `r` (`dst` a shared f32 array, len ≥ rows).
    AccRowReduce {
        acc: String,
        op: Reduce,
        dst: String,
    },
    /// Write the accumulator into a shared tile of the same shape (bf16 tiles round to nearest).
    AccToShared { acc: String, dst: String },
    /// `dst[r, c] = value` for every row `r` and every column `c` in `col0 .. col0 + cols`
    /// (the whole row unless a window is given), with `row`, `col` bound. Columns outside the
    /// window are left as they are. The window covers whole 32-bit words of the tile.
    SharedMap {
        dst: String,
        row: String,
        col: String,
        col0: u32,
        cols: u32,
        value: Expr,
    },
    /// `dst[r, c] = e4m3(src[r, c]) · scale` for every element of `dst` (a bf16 tile of at
    /// most `src`'s columns; `src` an e4m3 tile with the same rows), `scale` an f32
    /// expression with `row` bound to `r` and `group` to `c / per` (u32): a per-row scale for
    /// each `per` consecutive columns (fp8_ds_mla: one per 128-value tile), `per` a multiple
    /// of 4. The values are rounded to bf16 once, after the scale. Values outside `dst`'s
    /// columns are left as they are.
    DequantRows {
        dst: String,
        src: String,
        row: String,
        group: String,
        per: u32,
        scale: Expr,
    },
    /// One step of the online softmax over the scores `s [rows, n]` (scaled; masked elements
    /// below `ops::MASKED_BELOW`), with the running row max `m` and row sum `l` in shared f32
    /// arrays (`len ≥ rows`):
    /// `m_new = max(m, rowmax(s))`, `alpha = exp(m − m_new)`, `p = exp(s − m_new)` (0 where
    /// masked), `l = l·alpha + rowsum(p)`, every accumulator of `outs` (`[rows, *]`) scaled
    /// by `alpha` row by row, `m = m_new`; `p` is left in `s` and in the shared tile `p_tile`
    /// (`[rows, n]`, as [`TileOp::AccToShared`] writes it).
    ///
    /// `expansion` is the definition in primitive statements (written by
    /// `kir::ops::online_softmax_update`; it may use scratch shared arrays of its own, whose
    /// contents afterwards are unspecified): a lowering without a native form of the op lowers
    /// it instead. Afterwards `m` and `l` hold the new state for every thread, as after any
    /// tile op.
    OnlineSoftmax {
        s: String,
        m: String,
        l: String,
        outs: Vec<String>,
        p_tile: String,
        expansion: Vec<Stmt>,
    },
    /// A loop over `count` (uniform) steps in two stages: `load` (only `GatherRows`) brings
    /// step `var`'s tiles into shared memory, then `compute` consumes them. A lowering may run
    /// the load of later steps ahead of the compute of earlier ones (a multi-stage ring); the
    /// scalar lowering runs them in order. Shared tiles written by `load` are read only by
    /// the `compute` of the same step.
    ///
    /// `bound`, when given, is a step count that reads no buffer, at least `count`, for
    /// every step below which the global loads in `load`'s source expressions (not its row
    /// copies) are in bounds: a lowering may issue those loads before `count` itself is
    /// known (when `count` waits on a load of its own, e.g. `topk_length`).
    Pipeline {
        var: String,
        count: Expr,
        bound: Option<Expr>,
        load: Vec<Stmt>,
        compute: Vec<Stmt>,
    },
}

impl TileOp {
    /// A [`TileOp::DequantRows`] as the [`TileOp::SharedMap`] that defines it, over `dst`'s
    /// `cols` columns (`col` a name unused in the kernel): what a lowering without a form of
    /// its own runs.
    pub fn dequant_as_map(&self, col: &str, cols: u32) -> Option<TileOp> {
        let TileOp::DequantRows {
            dst,
            src,
            row,
            group,
            per,
            scale,
        } = self
        else {
            return None;
        };
        let c = Expr::Var(col.to_string(), Ty::U32);
        let group_of = Expr::Bin(BinOp::Div, Box::new(c.clone()), Box::new(Expr::U32(*per)));
        let scale = scale.clone().map(&mut |x| match x {
            Expr::Var(ref n, Ty::U32) if n == group => group_of.clone(),
            other => other,
        });
        let value = Expr::TileLoad {
            tile: src.clone(),
            elem: TileElem::E4m3,
            row: Box::new(Expr::Var(row.clone(), Ty::U32)),
            col: Box::new(c),
        };
        Some(TileOp::SharedMap {
            dst: dst.clone(),
            row: row.clone(),
            col: col.to_string(),
            col0: 0,
            cols,
            value: Expr::Bin(BinOp::Mul, Box::new(value), Box::new(scale)),
        })
    }
}

/// Target intrinsics that a target-specific lowering ([`super::lower_mma`]) emits: async
/// copies, warp-collective matrix loads and products, warp shuffles. Only the CUDA emitter
/// prints them (each as a call of a small helper that holds one PTX instruction); the WGSL
/// emitter rejects a kernel that contains any. "Warp-collective" ops must be reached by all 32
/// lanes of a warp together.
#[derive(Clone, Debug, PartialEq)]
pub enum Intrinsic {
    /// Asynchronous copy of `bytes` (4 or 16) from word `src_word` of buffer `src` into shared
    /// array `dst` at word `dst_word` (both `bytes`-aligned). When `valid` is false nothing is
    /// read and the destination is zero-filled. Visible after [`Intrinsic::CpAsyncWait`] and a
    /// barrier.
    CpAsync {
        bytes: u32,
        dst: String,
        dst_word: Expr,
        src: String,
        src_word: Expr,
        valid: Expr,
    },
    /// Close the group of this thread's copies issued since the last commit.
    CpAsyncCommit,
    /// Wait until at most `pending` of this thread's committed groups are still in flight.
    CpAsyncWait { pending: u32 },
    /// Warp-collective `ldmatrix`: `count` (1, 2 or 4) 8x8 matrices of 16-bit elements from
    /// shared array `arr`; each lane gives one matrix row, starting at word `word` (16-byte
    /// aligned). Lane `l` receives, per matrix `m`, one u32 in `dst[dst0 + m]`: elements
    /// (row l/4, cols 2(l%4), 2(l%4)+1), or with `trans` (rows 2(l%4), 2(l%4)+1, col l/4).
    LdMatrix {
        count: u32,
        trans: bool,
        arr: String,
        word: Expr,
        dst: String,
        dst0: Expr,
    },
    /// Warp-collective `mma.sync` m16n8k16, bf16 operands, f32 accumulate:
    /// `c[c0..c0+4] += a[a0..a0+4] · b[b0..b0+2]` in the PTX fragment layouts (c, a: private
    /// arrays of f32 / u32, b: u32).
    MmaBf16 {
        c: String,
        c0: Expr,
        a: String,
        a0: Expr,
        b: String,
        b0: Expr,
    },
    /// Warp-collective `mma.sync` m16n8k32, e4m3 operands (four per u32), f32 accumulate, in
    /// the PTX fragment layouts: `a0`/`a2` row g, `a1`/`a3` row g + 8, k `4q..4q+3` (`a0`,
    /// `a1`) and `16 + 4q..` (`a2`, `a3`); `b0` / `b1` k `4q..` / `16 + 4q..` of column g.
    /// sm_89 and later in one instruction; before, as two bf16 products of the widened bytes.
    MmaE4m3 {
        c: String,
        c0: Expr,
        a: String,
        a0: Expr,
        b: String,
        b0: Expr,
    },
    /// [`Intrinsic::MmaBf16`] with f16 operands (`mma.sync` m16n8k16 f16, f32 accumulate).
    MmaF16 {
        c: String,
        c0: Expr,
        a: String,
        a0: Expr,
        b: String,
        b0: Expr,
    },
    /// Warp-collective: `let dst = value` of lane `lane ^ lane_mask` (f32).
    ShflXor {
        dst: String,
        value: Expr,
        lane_mask: u32,
    },
    /// Warp-collective: `let dst = any lane's pred` (bool; CUDA's `__any_sync` over the full
    /// warp).
    VoteAny { dst: String, pred: Expr },
    /// `bar.sync id, threads`: a barrier among `threads` threads (whole warps) of the
    /// workgroup, with workgroup-memory ordering; id 0 with every thread is [`Stmt::Barrier`].
    /// The id is a constant (an immediate in the instruction): a grouped lowering gives each
    /// group its own by branching on the group.
    NamedBarrier { id: u32, threads: u32 },
    /// `__syncwarp()`: the warp's lanes meet, memory ordered among them.
    SyncWarp,
    /// Initialise mbarrier `index` of the shared array `bars` (two words each) for `count`
    /// arrivals per phase.
    MbarInit {
        bars: String,
        index: Expr,
        count: u32,
    },
    /// Arrive on an mbarrier (release).
    MbarArrive { bars: String, index: Expr },
    /// Wait until the phase of parity `parity` (u32, 0 or 1) of an mbarrier has completed
    /// (acquire).
    MbarWait {
        bars: String,
        index: Expr,
        parity: Expr,
    },
    /// Copy `bytes` (a multiple of 4) from word `src_word` of buffer `src` to shared array
    /// `dst` at word `dst_word`, asynchronously; its completion is tied to mbarrier `index`
    /// of `bars` by the next [`Intrinsic::CopyArrive`] of this thread. `cp.async.bulk` with a
    /// transaction count where both ends are 16-byte aligned and the GPU has it (sm_90 and
    /// later), `cp.async` copies otherwise.
    CopyAsync {
        bytes: u32,
        dst: String,
        dst_word: Expr,
        src: String,
        src_word: Expr,
        bars: String,
        index: Expr,
    },
    /// Ask the L2 cache to fetch the lines of `bytes` bytes from word `word` of buffer `buf`
    /// (`prefetch.global.L2` per 128-byte line): a hint with no effect on any value, so that
    /// a later copy of them waits for L2 instead of DRAM. The range must lie in the buffer.
    PrefetchL2 { buf: String, word: Expr, bytes: u32 },
    /// Arrive on an mbarrier once this thread's earlier [`Intrinsic::CopyAsync`] have landed
    /// (and its earlier shared-memory writes are visible): one arrival per thread and phase.
    CopyArrive { bars: String, index: Expr },
    /// Order this thread's earlier generic shared-memory writes before later asynchronous
    /// (bulk) copies into the same memory (`fence.proxy.async`, sm_90 and later).
    FenceProxyAsync,
    /// `buf[index] = v0; buf[index + 1] = v1` in one 8-byte store (an F32 buffer; `index`
    /// even, the buffer 8-byte aligned): half the store instructions of two f32 stores, each
    /// covering whole 32-byte sectors where a quad of lanes writes adjacent pairs.
    StoreF32x2 {
        buf: String,
        index: Expr,
        v0: Expr,
        v1: Expr,
    },
    /// The `count` workgroups of group `group` meet: each arrives once, then waits until all
    /// have, and every global write one made before it is visible to the others' reads after
    /// it. The pair of u32 words `2 group`, `2 group + 1` of buffer `counters` (arrivals, then
    /// a generation) holds the meeting; the arrivals are 0 before it and again after (the last
    /// to arrive resets them), so a zeroed buffer serves any number of launches in stream
    /// order. Every thread of the workgroup reaches it (uniform control flow), and the launch
    /// must keep all `count` workgroups resident at once ([`GridDependency::cooperative`]),
    /// or the first ones wait for ones that never start.
    GroupSync {
        counters: String,
        group: Expr,
        count: Expr,
    },
}

impl Intrinsic {
    /// The intrinsic with every expression operand passed through `f` (names unchanged).
    pub fn map_exprs(self, f: &mut dyn FnMut(Expr) -> Expr) -> Intrinsic {
        use Intrinsic::*;
        match self {
            CpAsync {
                bytes,
                dst,
                dst_word,
                src,
                src_word,
                valid,
            } => CpAsync {
                bytes,
                dst,
                dst_word: f(dst_word),
                src,
                src_word: f(src_word),
                valid: f(valid),
            },
            LdMatrix {
                count,
                trans,
                arr,
                word,
                dst,
                dst0,
            } => LdMatrix {
                count,
                trans,
                arr,
                word: f(word),
                dst,
                dst0: f(dst0),
            },
            MmaBf16 {
                c,
                c0,
                a,
                a0,
                b,
                b0,
            } => MmaBf16 {
                c,
                c0: f(c0),
                a,
                a0: f(a0),
                b,
                b0: f(b0),
            },
            MmaE4m3 {
                c,
                c0,
                a,
                a0,
                b,
                b0,
            } => MmaE4m3 {
                c,
                c0: f(c0),
                a,
                a0: f(a0),
                b,
                b0: f(b0),
            },
            MmaF16 {
                c,
                c0,
                a,
                a0,
                b,
                b0,
            } => MmaF16 {
                c,
                c0: f(c0),
                a,
                a0: f(a0),
                b,
                b0: f(b0),
            },
            ShflXor {
                dst,
                value,
                lane_mask,
            } => ShflXor {
                dst,
                value: f(value),
                lane_mask,
            },
            VoteAny { dst, pred } => VoteAny { dst, pred: f(pred) },
            NamedBarrier { id, threads } => NamedBarrier { id, threads },
            MbarInit { bars, index, count } => MbarInit {
                bars,
                index: f(index),
                count,
            },
            MbarArrive { bars, index } => MbarArrive {
                bars,
                index: f(index),
            },
            MbarWait {
                bars,
                index,
                parity,
            } => MbarWait {
                bars,
                index: f(index),
                parity: f(parity),
            },
            CopyAsync {
                bytes,
                dst,
                dst_word,
                src,
                src_word,
                bars,
                index,
            } => CopyAsync {
                bytes,
                dst,
                dst_word: f(dst_word),
                src,
                src_word: f(src_word),
                bars,
                index: f(index),
            },
            CopyArrive { bars, index } => CopyArrive {
                bars,
                index: f(index),
            },
            PrefetchL2 { buf, word, bytes } => PrefetchL2 {
                buf,
                word: f(word),
                bytes,
            },
            StoreF32x2 { buf, index, v0, v1 } => StoreF32x2 {
                buf,
                index: f(index),
                v0: f(v0),
                v1: f(v1),
            },
            GroupSync {
                counters,
                group,
                count,
            } => GroupSync {
                counters,
                group: f(group),
                count: f(count),
            },
            other @ (CpAsyncCommit | CpAsyncWait { .. } | SyncWarp | FenceProxyAsync) => other,
        }
    }
}

/// A statement.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// A comment printed in the generated code: one per phase.
    Comment(String),
    /// Immutable binding.
    Let {
        name: String,
        value: Expr,
    },
    /// Mutable variable.
    Var {
        name: String,
        value: Expr,
    },
    Assign {
        name: String,
        value: Expr,
    },
    /// `buf[index] = value` (F32 / I32 / U32 buffers).
    Store {
        buf: String,
        index: Expr,
        value: Expr,
    },
    /// Word `index` of any buffer `= value` (u32): how packed bf16 / u8 data is written.
    StoreWord {
        buf: String,
        index: Expr,
        value: Expr,
    },
    SharedStore {
        arr: String,
        index: Expr,
        value: Expr,
    },
    PrivateStore {
        arr: String,
        index: Expr,
        value: Expr,
    },
    If {
        cond: Expr,
        then: Vec<Stmt>,
        els: Vec<Stmt>,
    },
    /// `for (var = start; var < end; var += step)`, var typed like `start`.
    For {
        var: String,
        start: Expr,
        end: Expr,
        step: Expr,
        body: Vec<Stmt>,
    },
    /// Workgroup barrier with workgroup-memory ordering. Uniform control flow only.
    Barrier,
    Tile(TileOp),
    /// A target intrinsic (CUDA only), left by a target lowering.
    Intrinsic(Intrinsic),
}

impl Stmt {
    /// The statement with each block directly nested in it (an `if`'s branches, a loop's
    /// body) passed through `f`; other statements as they are. For passes over one block at
    /// a time that recurse themselves.
    pub fn map_blocks(self, f: &mut dyn FnMut(Vec<Stmt>) -> Vec<Stmt>) -> Stmt {
        match self {
            Stmt::If { cond, then, els } => Stmt::If {
                cond,
                then: f(then),
                els: f(els),
            },
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => Stmt::For {
                var,
                start,
                end,
                step,
                body: f(body),
            },
            other => other,
        }
    }

    /// The statement rebuilt bottom-up: every expression node through `e` (as [`Expr::map`]
    /// does; intrinsic operands included), every nested block mapped the same way, then the rebuilt statement itself
    /// through `s` (once; what `s` returns is not walked again). Tile ops are left as they are.
    pub fn map(self, e: &mut dyn FnMut(Expr) -> Expr, s: &mut dyn FnMut(Stmt) -> Stmt) -> Stmt {
        let block =
            |b: Vec<Stmt>, e: &mut dyn FnMut(Expr) -> Expr, s: &mut dyn FnMut(Stmt) -> Stmt| {
                b.into_iter().map(|x| x.map(e, s)).collect::<Vec<_>>()
            };
        let rebuilt = match self {
            Stmt::Let { name, value } => Stmt::Let {
                name,
                value: value.map(e),
            },
            Stmt::Var { name, value } => Stmt::Var {
                name,
                value: value.map(e),
            },
            Stmt::Assign { name, value } => Stmt::Assign {
                name,
                value: value.map(e),
            },
            Stmt::Store { buf, index, value } => Stmt::Store {
                buf,
                index: index.map(e),
                value: value.map(e),
            },
            Stmt::StoreWord { buf, index, value } => Stmt::StoreWord {
                buf,
                index: index.map(e),
                value: value.map(e),
            },
            Stmt::SharedStore { arr, index, value } => Stmt::SharedStore {
                arr,
                index: index.map(e),
                value: value.map(e),
            },
            Stmt::PrivateStore { arr, index, value } => Stmt::PrivateStore {
                arr,
                index: index.map(e),
                value: value.map(e),
            },
            Stmt::If { cond, then, els } => {
                let cond = cond.map(e);
                let then = block(then, e, s);
                Stmt::If {
                    cond,
                    then,
                    els: block(els, e, s),
                }
            }
            Stmt::For {
                var,
                start,
                end,
                step,
                body,
            } => Stmt::For {
                var,
                start: start.map(e),
                end: end.map(e),
                step: step.map(e),
                body: block(body, e, s),
            },
            Stmt::Intrinsic(i) => Stmt::Intrinsic(i.map_exprs(&mut |x| x.map(e))),
            other @ (Stmt::Comment(_) | Stmt::Barrier | Stmt::Tile(_)) => other,
        };
        s(rebuilt)
    }
}

/// One compute kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// Entry-point name (a C identifier).
    pub name: String,
    /// Lines for the generated file's header: what it computes, shapes, launch grid.
    pub doc: Vec<String>,
    /// Threads per workgroup (1-D).
    pub workgroup_size: u32,
    pub params: Vec<ParamDecl>,
    pub buffers: Vec<BufferDecl>,
    pub shared: Vec<SharedDecl>,
    pub privates: Vec<PrivateDecl>,
    pub shared_tiles: Vec<SharedTileDecl>,
    pub acc_tiles: Vec<AccTileDecl>,
    pub body: Vec<Stmt>,
    /// Register-allocation hint: at least this many workgroups should fit one multiprocessor
    /// (CUDA's `__launch_bounds__(threads, n)`); 0 leaves it to the compiler.
    pub min_workgroups: u32,
    /// How the kernel overlaps its launch with the kernel before or after it in the stream.
    pub grid_dependency: GridDependency,
    /// CUDA: shared-memory elements, and the pointers intrinsics take, are addressed as the
    /// pointer plus each term of the index with a sum times a constant distributed,
    /// `*(arr + a * 4u + 8u)` for `arr[(a + 2u) * 4u]`, so that constant terms become
    /// instructions' immediate offsets (see `emit::cuda`). Off: plain subscripts, and
    /// intrinsics' pointers split at sums only. The tensor-core decode lowerings set it
    /// (measured there: benches/NOTES.md, v29).
    pub index_terms: bool,
}

/// Overlap of a kernel's launch with its neighbours in a CUDA stream (programmatic dependent
/// launch, sm_90 and later): the launch latency of the second kernel of a pair hides behind
/// the first one's run. The WGSL and pre-sm_90 code have no such thing and ignore it.
/// [`crate::kir::builder::KernelBuilder`] sets both for every kernel: each one waits for its
/// predecessor before touching memory, so stream order holds for any chain of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GridDependency {
    /// The next kernel may be launched once every workgroup of this one has started: its
    /// first statement is `griddepcontrol.launch_dependents`. The next kernel still reads
    /// nothing of this one's before it has finished (see `waits_for_previous`).
    pub early_dependents: bool,
    /// The kernel's first statement waits until the previous kernel in the stream has
    /// finished and its writes are visible (`griddepcontrol.wait`), so the host may launch it
    /// with programmatic stream serialisation. Nothing is read or written before the wait.
    pub waits_for_previous: bool,
    /// Every workgroup of the grid must be resident at once (a cooperative launch, which the
    /// driver refuses rather than run partly): the kernel's workgroups wait for each other
    /// ([`Intrinsic::GroupSync`]).
    pub cooperative: bool,
}

impl Kernel {
    /// Bytes of workgroup memory the (lowered) kernel declares (an alias takes none).
    pub fn shared_bytes(&self) -> u64 {
        self.shared
            .iter()
            .filter(|s| s.alias.is_none())
            .map(|s| s.len as u64 * 4)
            .sum()
    }

    pub fn buffer(&self, name: &str) -> Option<&BufferDecl> {
        self.buffers.iter().find(|b| b.name == name)
    }

    pub fn shared_tile(&self, name: &str) -> Option<&SharedTileDecl> {
        self.shared_tiles.iter().find(|t| t.name == name)
    }

    pub fn acc_tile(&self, name: &str) -> Option<&AccTileDecl> {
        self.acc_tiles.iter().find(|t| t.name == name)
    }

    /// Has every tile op been lowered away?
    pub fn is_lowered(&self) -> bool {
        fn any_tile(stmts: &[Stmt]) -> bool {
            stmts.iter().any(|s| match s {
                Stmt::Tile(_) => true,
                Stmt::If { then, els, .. } => any_tile(then) || any_tile(els),
                Stmt::For { body, .. } => any_tile(body),
                _ => false,
            })
        }
        !any_tile(&self.body) && self.shared_tiles.is_empty() && self.acc_tiles.is_empty()
    }

    /// Does the kernel use target intrinsics (so only the CUDA emitter can print it)?
    pub fn uses_intrinsics(&self) -> bool {
        fn any(stmts: &[Stmt]) -> bool {
            stmts.iter().any(|s| match s {
                Stmt::Intrinsic(_) => true,
                Stmt::If { then, els, .. } => any(then) || any(els),
                Stmt::For { body, .. } => any(body),
                _ => false,
            })
        }
        any(&self.body)
    }

    /// Byte size of the parameter block (4 bytes per parameter, no padding).
    pub fn params_bytes(&self) -> usize {
        self.params.len() * 4
    }
}
