//! The small element-wise model kernels: SiLU·mul (SwiGLU), dtype casts between f32 and bf16,
//! the embedding gather, and the indexer's key-cache write. Each thread takes elements in a
//! grid-stride loop; views are strided f32 / bf16 matrices (bf16 outputs are written in whole
//! 32-bit words, two elements at a time, so their offsets, strides and widths are even).

use super::view::{load_f32, DType, View, ViewArgs, WeightLayout, WeightType};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Kernel, Ty};
use crate::reference::numerics::bf16_bits;
use crate::reference::tensor::{i32s, read_view, write_view, HostWeight};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;

fn grid_for(total: u64) -> [u32; 3] {
    [total.div_ceil(THREADS as u64).clamp(1, 65535) as u32, 1, 1]
}

/// A grid-stride loop over `total` (u32) work items.
fn each(
    b: &mut KernelBuilder,
    total: crate::kir::ir::Expr,
    body: impl FnOnce(&mut KernelBuilder, crate::kir::ir::Expr),
) {
    let stride = b.let_("stride", num_workgroups(0) * u(THREADS));
    b.for_(
        "e",
        workgroup_id(0) * u(THREADS) + local_id(),
        total,
        stride,
        body,
    );
}

fn same_shape(a: &View, b: &View, arg: &str) -> Result<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(Error::arg(
            arg,
            format!("[{}, {}]", a.rows, a.cols),
            format!("[{}, {}]", b.rows, b.cols),
        ));
    }
    Ok(())
}

// ------------------------------------------------------------------------ SiLU · mul

fn silu_mul_kernel(_: &()) -> Result<Kernel> {
    let mut b = KernelBuilder::new("silu_mul", THREADS);
    b.doc("SwiGLU's gate: y[r, c] = silu(g[r, c]) * u[r, c], silu(v) = v / (1 + exp(-v)); f32 views (g and u may be two halves of one row).".to_string());
    b.doc("Grid: x = min(ceil(rows * cols / 256), 65535), grid-stride.".to_string());
    let rows = b.param("rows", Ty::U32, "rows");
    let cols = b.param("cols", Ty::U32, "columns");
    let gv = ViewArgs::declare(&mut b, "g", "the gate");
    let uv = ViewArgs::declare(&mut b, "u", "the up projection");
    let yv = ViewArgs::declare(&mut b, "y", "the output");
    let x = b.buffer(
        "x",
        Elem::F32,
        Access::Read,
        "f32 holding the views g and u",
    );
    let y = b.buffer("y", Elem::F32, Access::ReadWrite, "[rows, cols] f32 (view)");
    each(&mut b, rows * cols.clone(), |b, e| {
        let r = b.let_("r", e.clone() / cols.clone());
        let c = b.let_("c", e % cols.clone());
        let g = b.let_("gv", x.at(gv.at(r.clone(), c.clone())));
        let up = b.let_("uv", x.at(uv.at(r.clone(), c.clone())));
        let silu = g.clone() / (f(1.0) + exp(-g));
        b.store(&y, yv.at(r, c), silu * up);
    });
    b.finish()
}

/// `y = silu(g) ⊙ u`, `g` and `u` views of one buffer `x` (the gate and up halves of a fused
/// projection). Buffers: `x`, `y`.
#[derive(Clone, Copy, Debug)]
pub struct SiluMulOp {
    pub g: View,
    pub u: View,
    pub y: View,
}

impl Op for SiluMulOp {
    fn name(&self) -> String {
        format!("silu_mul [{}, {}]", self.y.rows, self.y.cols)
    }

    fn bindings(&self) -> Vec<Binding> {
        let need = self
            .g
            .min_bytes(DType::F32)
            .max(self.u.min_bytes(DType::F32));
        vec![
            Binding::read("x", need, "gate and up f32"),
            Binding::write("y", self.y.min_bytes(DType::F32), "y f32"),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        for (v, n) in [(&self.g, "g"), (&self.u, "u"), (&self.y, "y")] {
            v.validate(n)?;
        }
        same_shape(&self.g, &self.u, "u")?;
        same_shape(&self.g, &self.y, "y")?;
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), silu_mul_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("rows".into(), ParamValue::U32(self.y.rows)),
            ("cols".into(), ParamValue::U32(self.y.cols)),
        ];
        p.extend(self.g.params("g"));
        p.extend(self.u.params("u"));
        p.extend(self.y.params("y"));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: grid_for(self.y.rows as u64 * self.y.cols as u64),
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let x = bufs.get("x")?;
        let g = read_view(x, DType::F32, &self.g, "g")?;
        let up = read_view(x, DType::F32, &self.u, "u")?;
        let y: Vec<f64> = g
            .iter()
            .zip(&up)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        write_view(bufs.get_mut("y")?, DType::F32, &self.y, &y, "y")
    }
}

// ------------------------------------------------------------------------ casts

fn cast_kernel(to: &DType) -> Result<Kernel> {
    let (name, from) = match to {
        DType::Bf16 => ("cast_f32_to_bf16", DType::F32),
        DType::F32 => ("cast_bf16_to_f32", DType::Bf16),
    };
    let mut b = KernelBuilder::new(name, THREADS);
    b.doc(format!(
        "Cast {} -> {} (bf16: round to nearest even), strided views.",
        from.name(),
        to.name()
    ));
    b.doc("Grid: x = min(ceil(items / 256), 65535), grid-stride; bf16 outputs two per thread (one word).".to_string());
    let rows = b.param("rows", Ty::U32, "rows");
    let cols = b.param("cols", Ty::U32, "columns (even for bf16 outputs)");
    let xv = ViewArgs::declare(&mut b, "x", "the input");
    let yv = ViewArgs::declare(&mut b, "y", "the output");
    let x = b.buffer("x", from.elem(), Access::Read, "input (view)");
    let y = b.buffer("y", to.elem(), Access::ReadWrite, "output (view)");
    match to {
        DType::Bf16 => {
            let pairs = b.let_("pairs", cols.clone() / u(2));
            each(&mut b, rows * pairs.clone(), |b, e| {
                let r = b.let_("r", e.clone() / pairs.clone());
                let c = b.let_("c", (e % pairs.clone()) * u(2));
                let lo = x.at(xv.at(r.clone(), c.clone()));
                let hi = x.at(xv.at(r.clone(), c.clone() + u(1)));
                b.store_word(&y, yv.at(r, c) / u(2), pack_bf16x2(lo, hi));
            });
        }
        DType::F32 => {
            each(&mut b, rows * cols.clone(), |b, e| {
                let r = b.let_("r", e.clone() / cols.clone());
                let c = b.let_("c", e % cols.clone());
                let v = load_f32(&x, DType::Bf16, xv.at(r.clone(), c.clone()));
                b.store(&y, yv.at(r, c), v);
            });
        }
    }
    b.finish()
}

/// `y = x` converted between f32 and bf16. Buffers: `x`, `y`.
#[derive(Clone, Copy, Debug)]
pub struct CastOp {
    pub x: View,
    pub y: View,
    /// The output type; the input is the other one.
    pub to: DType,
}

impl CastOp {
    fn from(&self) -> DType {
        match self.to {
            DType::Bf16 => DType::F32,
            DType::F32 => DType::Bf16,
        }
    }
}

impl Op for CastOp {
    fn name(&self) -> String {
        format!(
            "cast to {} [{}, {}]",
            self.to.name(),
            self.x.rows,
            self.x.cols
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        vec![
            Binding::read("x", self.x.min_bytes(self.from()), "input"),
            Binding::write("y", self.y.min_bytes(self.to), "output"),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.x.validate("x")?;
        self.y.validate("y")?;
        same_shape(&self.x, &self.y, "y")?;
        if self.to == DType::Bf16
            && (self.y.offset % 2 != 0 || self.y.stride % 2 != 0 || self.y.cols % 2 != 0)
        {
            return Err(Error::arg(
                "y",
                "an even offset, stride and width (bf16 is written two elements per word)",
                format!(
                    "offset {} stride {} cols {}",
                    self.y.offset, self.y.stride, self.y.cols
                ),
            ));
        }
        static K: KernelCache<DType> = KernelCache::new();
        let k = lowered(&K, self.to, cast_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("rows".into(), ParamValue::U32(self.x.rows)),
            ("cols".into(), ParamValue::U32(self.x.cols)),
        ];
        p.extend(self.x.params("x"));
        p.extend(self.y.params("y"));
        let items =
            self.x.rows as u64 * self.x.cols as u64 / if self.to == DType::Bf16 { 2 } else { 1 };
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: grid_for(items),
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let x = read_view(bufs.get("x")?, self.from(), &self.x, "x")?;
        write_view(bufs.get_mut("y")?, self.to, &self.y, &x, "y")
    }
}

// ------------------------------------------------------------------ two-term bf16 split

fn split_bf16_kernel(_: &()) -> Result<Kernel> {
    let mut b = KernelBuilder::new("split_f32_to_bf16_hilo", THREADS);
    b.doc("f32 x [T, cols] (view) to a two-term bf16 split, packed y [2T, cols]: y[t] = bf16(x[t]) (hi), y[T + t] = bf16(x[t] - hi) (lo), round to nearest even; hi + lo carries x to 2^-16 relative. The vendor's bf16 GEMM over all 2T rows then sees f32-accurate activations for the price of one read of the weights.".to_string());
    b.doc("Grid: x = min(ceil(T * cols / 2 / 256), 65535), grid-stride; two elements (one word of each half) per item.".to_string());
    let rows = b.param("rows", Ty::U32, "T");
    let cols = b.param("cols", Ty::U32, "columns (even)");
    let xv = ViewArgs::declare(&mut b, "x", "the input");
    let x = b.buffer("x", Elem::F32, Access::Read, "x [T, cols] f32 (view)");
    let y = b.buffer(
        "y",
        Elem::Bf16,
        Access::ReadWrite,
        "[2T, cols] bf16: hi rows, then lo rows",
    );
    let pairs = b.let_("pairs", cols.clone() / u(2));
    let half = b.let_("half", rows.clone() * pairs.clone());
    each(&mut b, half.clone(), |b, e| {
        let r = b.let_("r", e.clone() / pairs.clone());
        let c = b.let_("c", (e.clone() % pairs.clone()) * u(2));
        let a = b.let_("a", x.at(xv.at(r.clone(), c.clone())));
        let d = b.let_("d", x.at(xv.at(r, c + u(1))));
        let hi = b.let_("hi", pack_bf16x2(a.clone(), d.clone()));
        let lo = pack_bf16x2(
            a - f32_from_bits(hi.clone() << u(16)),
            d - f32_from_bits(hi.clone() & u(0xffff_0000)),
        );
        b.store_word(&y, e.clone(), hi);
        b.store_word(&y, e + half.clone(), lo);
    });
    b.finish()
}

/// f32 `x` split into bf16 hi and lo rows (`y` packed `[2T, cols]`), for the vendor GEMM.
/// Buffers: `x`, `y`.
#[derive(Clone, Copy, Debug)]
pub struct SplitBf16Op {
    pub x: View,
}

impl Op for SplitBf16Op {
    fn name(&self) -> String {
        format!("split to bf16 hi/lo [{}, {}]", self.x.rows, self.x.cols)
    }

    fn bindings(&self) -> Vec<Binding> {
        vec![
            Binding::read("x", self.x.min_bytes(DType::F32), "x f32"),
            Binding::write(
                "y",
                self.x.rows as u64 * self.x.cols as u64 * 4,
                "[2T, cols] bf16 hi, lo",
            ),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.x.validate("x")?;
        if self.x.cols % 2 != 0 {
            return Err(Error::arg(
                "x",
                "an even width (bf16 is written two elements per word)",
                self.x.cols,
            ));
        }
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), split_bf16_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("rows".into(), ParamValue::U32(self.x.rows)),
            ("cols".into(), ParamValue::U32(self.x.cols)),
        ];
        p.extend(self.x.params("x"));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: grid_for(self.x.rows as u64 * self.x.cols as u64 / 2),
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        use crate::reference::numerics::round_bf16;
        let x = read_view(bufs.get("x")?, DType::F32, &self.x, "x")?;
        let n = x.len();
        let y = bufs.get_mut("y")?;
        for (i, &v) in x.iter().enumerate() {
            let v = v as f32;
            let hi = bf16_bits(v);
            let lo = bf16_bits(v - round_bf16(v));
            y[2 * i..2 * i + 2].copy_from_slice(&hi.to_le_bytes());
            y[2 * (n + i)..2 * (n + i) + 2].copy_from_slice(&lo.to_le_bytes());
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------ embedding

fn embedding_kernel(w: &WeightType) -> Result<Kernel> {
    let mut b = KernelBuilder::new(format!("embedding_{}", w.name()), THREADS);
    b.doc(format!(
        "Embedding gather: y[t, c] = table[ids[t], c] ({} table, f32 out); NaN for an id outside [0, vocab).",
        w.name()
    ));
    b.doc("Grid: x = min(ceil(tokens * cols / 256), 65535), grid-stride.".to_string());
    let tokens = b.param("tokens", Ty::U32, "T");
    let cols = b.param("cols", Ty::U32, "hidden size");
    let vocab = b.param("vocab", Ty::U32, "rows of the table");
    let yv = ViewArgs::declare(&mut b, "y", "y [T, cols]");
    let table = b.buffer("table", w.elem(), Access::Read, "[vocab, cols] table");
    let ids = b.buffer("ids", Elem::I32, Access::Read, "[T] i32 token ids");
    let y = b.buffer("y", Elem::F32, Access::ReadWrite, "[T, cols] f32 (view)");
    let dt = match w {
        WeightType::Bf16 => DType::Bf16,
        _ => DType::F32,
    };
    each(&mut b, tokens * cols.clone(), |b, e| {
        let t = b.let_("t", e.clone() / cols.clone());
        let c = b.let_("c", e % cols.clone());
        let id = b.let_("id", ids.at(t.clone()));
        let ok = b.let_(
            "ok",
            id.clone()
                .ge(i(0))
                .and(id.clone().as_u32().lt(vocab.clone())),
        );
        let row = select(ok.clone(), id.as_u32(), u(0));
        let v = load_f32(&table, dt, row * cols.clone() + c.clone());
        b.store(
            &y,
            yv.at(t, c),
            select(ok, v, f32_from_bits(u(0x7fc0_0000))),
        );
    });
    b.finish()
}

/// Rows of an embedding table picked by token ids. Buffers: `table`, `ids` (`[T]` i32), `y`.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddingOp {
    pub table: WeightLayout,
    pub tokens: u32,
    pub y: View,
}

impl Op for EmbeddingOp {
    fn name(&self) -> String {
        format!("embedding {} tokens", self.tokens)
    }

    fn bindings(&self) -> Vec<Binding> {
        vec![
            Binding::read("table", self.table.bytes(), "embedding table"),
            Binding::read("ids", self.tokens as u64 * 4, "i32 token ids"),
            Binding::write("y", self.y.min_bytes(DType::F32), "y f32"),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.y.validate("y")?;
        if !matches!(self.table.wtype, WeightType::Bf16 | WeightType::F32) {
            return Err(Error::arg(
                "table",
                "a bf16 or f32 embedding table",
                self.table.wtype.name(),
            ));
        }
        if self.y.rows != self.tokens || self.y.cols != self.table.cols {
            return Err(Error::arg(
                "y",
                format!("[{}, {}]", self.tokens, self.table.cols),
                format!("[{}, {}]", self.y.rows, self.y.cols),
            ));
        }
        static K: KernelCache<WeightType> = KernelCache::new();
        let k = lowered(&K, self.table.wtype, embedding_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("tokens".into(), ParamValue::U32(self.tokens)),
            ("cols".into(), ParamValue::U32(self.table.cols)),
            ("vocab".into(), ParamValue::U32(self.table.rows)),
        ];
        p.extend(self.y.params("y"));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: grid_for(self.tokens as u64 * self.table.cols as u64),
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let ids = i32s(bufs.get("ids")?);
        let table = HostWeight {
            layout: self.table,
            values: bufs.get("table")?,
            scales: None,
        };
        table.check("table")?;
        let mut y = Vec::with_capacity(self.tokens as usize * self.table.cols as usize);
        for &id in &ids[..self.tokens as usize] {
            if id < 0 || id as u32 >= self.table.rows {
                y.extend(std::iter::repeat_n(f64::NAN, self.table.cols as usize));
            } else {
                y.extend(table.row(id as u32));
            }
        }
        write_view(bufs.get_mut("y")?, DType::F32, &self.y, &y, "y")
    }
}

// ------------------------------------------------------------------------ key rows

fn key_write_kernel(_: &()) -> Result<Kernel> {
    let mut b = KernelBuilder::new("key_cache_write", THREADS);
    b.doc("Indexer key cache write: cache[slot_mapping[t], c] = bf16(x[t, c]) (nearest even) for rows of `width` bf16; a slot outside [0, num_slots) writes nothing.".to_string());
    b.doc("Grid: x = min(ceil(tokens * width / 2 / 256), 65535), grid-stride, one 32-bit word (two values) per item.".to_string());
    let tokens = b.param("tokens", Ty::U32, "T");
    let width = b.param("width", Ty::U32, "values per row (even)");
    let num_slots = b.param("num_slots", Ty::U32, "rows of the cache");
    let xv = ViewArgs::declare(&mut b, "x", "x [T, width]");
    let x = b.buffer("x", Elem::F32, Access::Read, "[T, width] f32 keys (view)");
    let slots = b.buffer(
        "slot_mapping",
        Elem::I32,
        Access::Read,
        "[T] i32 slots (-1: skip)",
    );
    let cache = b.buffer(
        "cache",
        Elem::Bf16,
        Access::ReadWrite,
        "[num_slots, width] bf16",
    );
    let pairs = b.let_("pairs", width.clone() / u(2));
    each(&mut b, tokens * pairs.clone(), |b, e| {
        let t = b.let_("t", e.clone() / pairs.clone());
        let c = b.let_("c", (e % pairs.clone()) * u(2));
        let s = b.let_("s", slots.at(t.clone()));
        b.if_(
            s.clone()
                .ge(i(0))
                .and(s.clone().as_u32().lt(num_slots.clone())),
            |b| {
                let lo = x.at(xv.at(t.clone(), c.clone()));
                let hi = x.at(xv.at(t.clone(), c.clone() + u(1)));
                b.store_word(
                    &cache,
                    (s.as_u32() * width.clone() + c) / u(2),
                    pack_bf16x2(lo, hi),
                );
            },
        );
    });
    b.finish()
}

/// Stores `x [T, width]` as bf16 rows of a `[num_slots, width]` cache at `slot_mapping [T]`.
/// Buffers: `x`, `slot_mapping`, `cache`.
#[derive(Clone, Copy, Debug)]
pub struct KeyWriteOp {
    pub x: View,
    pub num_slots: u32,
}

impl Op for KeyWriteOp {
    fn name(&self) -> String {
        format!("key cache write [{}, {}]", self.x.rows, self.x.cols)
    }

    fn bindings(&self) -> Vec<Binding> {
        vec![
            Binding::read("x", self.x.min_bytes(DType::F32), "keys f32"),
            Binding::read("slot_mapping", self.x.rows as u64 * 4, "i32 slots"),
            Binding::write(
                "cache",
                self.num_slots as u64 * self.x.cols as u64 * 2,
                format!("[{}, {}] bf16 key cache", self.num_slots, self.x.cols),
            ),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.x.validate("x")?;
        if self.x.cols % 2 != 0 {
            return Err(Error::arg("x", "an even width", self.x.cols));
        }
        if self.num_slots as u64 * self.x.cols as u64 / 2 > u32::MAX as u64 {
            return Err(Error::arg(
                "num_slots",
                "a cache under 2^32 words",
                self.num_slots,
            ));
        }
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), key_write_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("tokens".into(), ParamValue::U32(self.x.rows)),
            ("width".into(), ParamValue::U32(self.x.cols)),
            ("num_slots".into(), ParamValue::U32(self.num_slots)),
        ];
        p.extend(self.x.params("x"));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: grid_for(self.x.rows as u64 * self.x.cols as u64 / 2),
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let x = read_view(bufs.get("x")?, DType::F32, &self.x, "x")?;
        let slots = i32s(bufs.get("slot_mapping")?);
        let w = self.x.cols as usize;
        let cache = bufs.get_mut("cache")?;
        for (t, &s) in slots[..self.x.rows as usize].iter().enumerate() {
            if s < 0 || s as u32 >= self.num_slots {
                continue;
            }
            for c in 0..w {
                let o = (s as usize * w + c) * 2;
                cache[o..o + 2].copy_from_slice(&bf16_bits(x[t * w + c] as f32).to_le_bytes());
            }
        }
        Ok(())
    }
}

/// Every kernel of this module, lowered (for compile checks and exports).
pub fn all_variants() -> Result<Vec<Kernel>> {
    let scalar = crate::kir::Lowering::Scalar;
    Ok(vec![
        crate::kir::lower(&silu_mul_kernel(&())?, scalar)?,
        crate::kir::lower(&cast_kernel(&DType::Bf16)?, scalar)?,
        crate::kir::lower(&cast_kernel(&DType::F32)?, scalar)?,
        crate::kir::lower(&embedding_kernel(&WeightType::Bf16)?, scalar)?,
        crate::kir::lower(&embedding_kernel(&WeightType::F32)?, scalar)?,
        crate::kir::lower(&key_write_kernel(&())?, scalar)?,
        crate::kir::lower(&split_bf16_kernel(&())?, scalar)?,
    ])
}
