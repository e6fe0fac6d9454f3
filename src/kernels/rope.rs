//! Rotary position embedding on a strided f32 view: row `r` is rotated to position
//! `positions[r / group]` (`group` rows per token: one per head), with cos and sin read from a
//! table the host computes once (plain RoPE or YaRN, the attention factor folded in), so the
//! kernel needs no trigonometry and every target uses the same angles. Pairs are interleaved
//! `(x[2i], x[2i+1])` (MLA in both models, GLM-5's indexer) or half-split `(x[i], x[i + half])`
//! (DeepSeek-V3.2's indexer). Out of place: `y` is another buffer (it may be a part of a wider
//! row, e.g. the rope columns of the attention query). A position outside the table gives
//! NaN, never a read outside it.

use super::view::{DType, View, ViewArgs};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Kernel, Ty};
use crate::reference::rope::rotate;
use crate::reference::tensor::{f32s, i32s, read_view, write_view};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;

/// How the rotated values pair up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeLayout {
    Interleaved,
    HalfSplit,
}

fn rope_kernel(cfg: &(RopeLayout, bool)) -> Result<Kernel> {
    let (layout, in_place) = (&cfg.0, cfg.1);
    let name = match layout {
        RopeLayout::Interleaved => "rope_interleaved",
        RopeLayout::HalfSplit => "rope_half_split",
    };
    let name = if in_place {
        format!("{name}_in_place")
    } else {
        name.to_string()
    };
    let mut b = KernelBuilder::new(name, THREADS);
    b.doc(match layout {
        RopeLayout::Interleaved => "RoPE, interleaved pairs (x[2i], x[2i+1]): y[2i] = x[2i] cos - x[2i+1] sin, y[2i+1] = x[2i+1] cos + x[2i] sin.".to_string(),
        RopeLayout::HalfSplit => "RoPE, half-split pairs (x[i], x[i+half]): y[i] = x[i] cos - x[i+half] sin, y[i+half] = x[i+half] cos + x[i] sin.".to_string(),
    });
    b.doc("cos = table[p, 0, i], sin = table[p, 1, i] for p = positions[r / group]; NaN out for p outside [0, table_rows).".to_string());
    b.doc(
        "Grid: x = min(ceil(rows * half / 256), 65535), a grid-stride loop over (row, pair)."
            .to_string(),
    );
    let rows = b.param("rows", Ty::U32, "rows of x and y");
    let half = b.param("half", Ty::U32, "pairs per row (the view is 2 * half wide)");
    let group = b.param("group", Ty::U32, "rows per position (heads per token)");
    let table_rows = b.param("table_rows", Ty::U32, "positions the table covers");
    let xv = ViewArgs::declare(&mut b, "x", "x [rows, 2 * half]");
    let yv = ViewArgs::declare(&mut b, "y", "y [rows, 2 * half]");
    let x =
        (!in_place).then(|| b.buffer("x", Elem::F32, Access::Read, "[rows, 2 * half] f32 (view)"));
    let positions = b.buffer(
        "positions",
        Elem::I32,
        Access::Read,
        "[rows / group] i32 position of each token",
    );
    let table = b.buffer(
        "table",
        Elem::F32,
        Access::Read,
        "[table_rows, 2, half] f32: cos then sin",
    );
    let y = b.buffer(
        "y",
        Elem::F32,
        Access::ReadWrite,
        if in_place {
            "[rows, 2 * half] f32 (view), rotated in place (x_off / x_stride equal y's)"
        } else {
            "[rows, 2 * half] f32 (view)"
        },
    );
    let src = x.as_ref().unwrap_or(&y).clone();
    let total = b.let_("total", rows * half.clone());
    let stride = b.let_("stride", num_workgroups(0) * u(THREADS));
    b.for_(
        "e",
        workgroup_id(0) * u(THREADS) + local_id(),
        total,
        stride,
        |b, e| {
            let r = b.let_("r", e.clone() / half.clone());
            let i_ = b.let_("i", e % half.clone());
            let p = b.let_("p", positions.at(r.clone() / group.clone()));
            let ok = b.let_(
                "ok",
                p.clone()
                    .ge(i(0))
                    .and(p.clone().as_u32().lt(table_rows.clone())),
            );
            let base = b.let_(
                "base",
                select(ok.clone(), p.as_u32(), u(0)) * u(2) * half.clone(),
            );
            let nan = f32_from_bits(u(0x7fc0_0000));
            let c = b.let_(
                "c",
                select(ok.clone(), table.at(base.clone() + i_.clone()), nan.clone()),
            );
            let s = b.let_(
                "s",
                select(ok, table.at(base + half.clone() + i_.clone()), nan),
            );
            let (ca, cb) = match layout {
                RopeLayout::Interleaved => (i_.clone() * u(2), i_.clone() * u(2) + u(1)),
                RopeLayout::HalfSplit => (i_.clone(), i_.clone() + half.clone()),
            };
            let xa = b.let_("xa", src.at(xv.at(r.clone(), ca.clone())));
            let xb = b.let_("xb", src.at(xv.at(r.clone(), cb.clone())));
            b.store(
                &y,
                yv.at(r.clone(), ca),
                xa.clone() * c.clone() - xb.clone() * s.clone(),
            );
            b.store(&y, yv.at(r, cb), xb * c + xa * s);
        },
    );
    b.finish()
}

/// RoPE of `x` into `y`. Buffers: `x` (not when in place), `positions` (`[rows / group]`
/// i32), `table` (`[table_rows, 2, half]` f32: cos, then sin), `y`.
#[derive(Clone, Copy, Debug)]
pub struct RopeOp {
    pub layout: RopeLayout,
    pub x: View,
    pub y: View,
    /// Rotate `y` in place (`x` must then be the same view; no `x` buffer is bound).
    pub in_place: bool,
    /// Rows per position.
    pub group: u32,
    pub table_rows: u32,
}

impl RopeOp {
    fn validate(&self) -> Result<()> {
        self.x.validate("x")?;
        self.y.validate("y")?;
        if (self.y.rows, self.y.cols) != (self.x.rows, self.x.cols) || self.x.cols % 2 != 0 {
            return Err(Error::arg(
                "y",
                format!("[{}, {}] like x, an even width", self.x.rows, self.x.cols),
                format!("[{}, {}]", self.y.rows, self.y.cols),
            ));
        }
        if self.in_place && self.x != self.y {
            return Err(Error::arg(
                "x",
                "the same view as y (in place)",
                "another view",
            ));
        }
        if self.group == 0 || self.x.rows % self.group != 0 {
            return Err(Error::arg(
                "group",
                format!("a divisor of the {} rows", self.x.rows),
                self.group,
            ));
        }
        Ok(())
    }
}

impl Op for RopeOp {
    fn name(&self) -> String {
        format!("rope {:?} [{}, {}]", self.layout, self.x.rows, self.x.cols)
    }

    fn bindings(&self) -> Vec<Binding> {
        let mut v = Vec::new();
        if !self.in_place {
            v.push(Binding::read("x", self.x.min_bytes(DType::F32), "x f32"));
        }
        v.extend([
            Binding::read(
                "positions",
                (self.x.rows / self.group.max(1)) as u64 * 4,
                "i32 positions",
            ),
            Binding::read(
                "table",
                self.table_rows as u64 * self.x.cols as u64 * 4,
                "[positions, 2, half] f32 cos / sin",
            ),
            Binding::write("y", self.y.min_bytes(DType::F32), "y f32"),
        ]);
        v
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<(RopeLayout, bool)> = KernelCache::new();
        let k = lowered(&K, (self.layout, self.in_place), rope_kernel)?;
        let half = self.x.cols / 2;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("rows".into(), ParamValue::U32(self.x.rows)),
            ("half".into(), ParamValue::U32(half)),
            ("group".into(), ParamValue::U32(self.group)),
            ("table_rows".into(), ParamValue::U32(self.table_rows)),
        ];
        p.extend(self.x.params("x"));
        p.extend(self.y.params("y"));
        let total = self.x.rows as u64 * half as u64;
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: [(total.div_ceil(THREADS as u64)).min(65535) as u32, 1, 1],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let src = if self.in_place { "y" } else { "x" };
        let x = read_view(bufs.get(src)?, DType::F32, &self.x, "x")?;
        let pos = i32s(bufs.get("positions")?);
        let table = f32s(bufs.get("table")?);
        let (w, half) = (self.x.cols as usize, self.x.cols as usize / 2);
        let mut y = Vec::with_capacity(x.len());
        for (r, row) in x.chunks_exact(w).enumerate() {
            let p = pos[r / self.group as usize];
            if p < 0 || p as u32 >= self.table_rows {
                y.extend(std::iter::repeat_n(f64::NAN, w));
                continue;
            }
            let base = p as usize * 2 * half;
            let cos: Vec<f64> = table[base..base + half].iter().map(|&v| v as f64).collect();
            let sin: Vec<f64> = table[base + half..base + w]
                .iter()
                .map(|&v| v as f64)
                .collect();
            y.extend(rotate(row, &cos, &sin, self.layout));
        }
        write_view(bufs.get_mut("y")?, DType::F32, &self.y, &y, "y")
    }
}

/// Every variant, lowered (for compile checks and exports).
pub fn all_variants() -> Result<Vec<Kernel>> {
    let mut v = Vec::new();
    for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
        for in_place in [false, true] {
            v.push(crate::kir::lower(
                &rope_kernel(&(layout, in_place))?,
                crate::kir::Lowering::Scalar,
            )?);
        }
    }
    Ok(v)
}
