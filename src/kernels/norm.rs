//! Row normalisations: RMSNorm (`w ⊙ x / sqrt(mean(x²) + eps)`, the decoder's norms, q_a and
//! kv_a's latent norms) and LayerNorm with bias (the indexer's key norm). f32 views in and
//! out, an f32 weight (and bias) vector. One workgroup per row (grid-stride over rows), the
//! row's reductions as workgroup trees.

use super::blocks::block_sum;
use super::view::{DType, View, ViewArgs};
use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::reference::norm::{layer_norm, rms_norm};
use crate::reference::tensor::{f32s, read_view, write_view};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;

/// Which normalisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormKind {
    Rms,
    /// LayerNorm with a bias.
    Layer,
}

fn norm_kernel(kind: &NormKind) -> Result<Kernel> {
    let name = match kind {
        NormKind::Rms => "rms_norm",
        NormKind::Layer => "layer_norm",
    };
    let mut b = KernelBuilder::new(name, THREADS);
    match kind {
        NormKind::Rms => b.doc(
            "RMSNorm per row: y[r, c] = w[c] * (x[r, c] / sqrt(mean_c(x[r, c]^2) + eps)); f32 views."
                .to_string(),
        ),
        NormKind::Layer => b.doc(
            "LayerNorm per row: y[r, c] = (x[r, c] - mean) / sqrt(var + eps) * w[c] + bias[c] (biased variance); f32 views."
                .to_string(),
        ),
    }
    b.doc(format!(
        "Grid: x = min(rows, 65535), a grid-stride loop over rows; {THREADS} threads per row."
    ));
    let rows = b.param("rows", Ty::U32, "rows of x and y");
    let cols = b.param("cols", Ty::U32, "columns (the normalised width)");
    let eps = b.param("eps", Ty::F32, "epsilon inside the square root");
    let xv = ViewArgs::declare(&mut b, "x", "x [rows, cols]");
    let yv = ViewArgs::declare(&mut b, "y", "y [rows, cols]");
    let x = b.buffer("x", Elem::F32, Access::Read, "[rows, cols] f32 (view)");
    let w = b.buffer("w", Elem::F32, Access::Read, "[cols] f32 weight");
    let bias = (*kind == NormKind::Layer)
        .then(|| b.buffer("bias", Elem::F32, Access::Read, "[cols] f32 bias"));
    let y = b.buffer("y", Elem::F32, Access::ReadWrite, "[rows, cols] f32 (view)");
    let red = b.shared("red", Ty::F32, THREADS);
    let n = b.let_("n", cols.clone().as_f32());

    // A row is walked 4 x THREADS columns per step, the 4 loads of a thread independent (and,
    // in the sums, 4 accumulators), then the last partial step one column at a time: with one
    // load per iteration, a 6144-wide row costs 24 dependent memory round trips per pass,
    // which made each norm ~15 us at T = 1 on the H200 (tools/gpu-profile-step.sh).
    let quad = b.let_("quad", (cols.clone() / u(4 * THREADS)) * u(4 * THREADS));
    b.for_("r", workgroup_id(0), rows, num_workgroups(0), |b, r| {
        let mean = match kind {
            NormKind::Rms => None,
            NormKind::Layer => {
                let tot = row_sum(b, &red, &quad, &cols, |b, c| {
                    b.let_("v", x.at(xv.at(r.clone(), c)))
                });
                Some(b.let_("mean", tot / n.clone()))
            }
        };
        b.comment("sum of squares (of deviations, for LayerNorm) over the row");
        let tot = row_sum(b, &red, &quad, &cols, |b, c| {
            let v = x.at(xv.at(r.clone(), c));
            let d = match &mean {
                Some(m) => b.let_("d", v - m.clone()),
                None => b.let_("d", v),
            };
            b.let_("sq", d.clone() * d)
        });
        let inv = b.let_("inv", f(1.0) / sqrt(tot / n.clone() + eps.clone()));
        row_each(b, &quad, &cols, |b, c| {
            let v = b.let_("v", x.at(xv.at(r.clone(), c.clone())));
            let out = match (&mean, &bias) {
                (Some(m), Some(bias)) => {
                    (v - m.clone()) * inv.clone() * w.at(c.clone()) + bias.at(c.clone())
                }
                _ => w.at(c.clone()) * (v * inv.clone()),
            };
            b.store(&y, yv.at(r.clone(), c), out);
        });
    });
    b.finish()
}

/// `body` at every column of a row: 4 columns per thread per step below `quad` (a multiple
/// of 4 x THREADS), one per step from there to `cols`.
fn row_each(
    b: &mut KernelBuilder,
    quad: &Expr,
    cols: &Expr,
    mut body: impl FnMut(&mut KernelBuilder, Expr),
) {
    b.for_("c4", local_id(), quad.clone(), u(4 * THREADS), |b, c| {
        for j in 0..4 {
            body(b, c.clone() + u(j * THREADS));
        }
    });
    b.for_(
        "c",
        quad.clone() + local_id(),
        cols.clone(),
        u(THREADS),
        |b, c| body(b, c),
    );
}

/// The workgroup sum over a row of `term(column)`, with 4 accumulators per thread.
fn row_sum(
    b: &mut KernelBuilder,
    red: &crate::kir::builder::Shared,
    quad: &Expr,
    cols: &Expr,
    mut term: impl FnMut(&mut KernelBuilder, Expr) -> Expr,
) -> Expr {
    let acc: Vec<Expr> = (0..4).map(|j| b.var(&format!("acc{j}"), f(0.0))).collect();
    b.for_("c4", local_id(), quad.clone(), u(4 * THREADS), |b, c| {
        let terms: Vec<Expr> = (0..4)
            .map(|j| term(b, c.clone() + u(j * THREADS)))
            .collect();
        for (a, t) in acc.iter().zip(terms) {
            b.set(a, a.clone() + t);
        }
    });
    b.for_(
        "c",
        quad.clone() + local_id(),
        cols.clone(),
        u(THREADS),
        |b, c| {
            let t = term(b, c);
            b.set(&acc[0], acc[0].clone() + t);
        },
    );
    let s = b.let_(
        "part",
        (acc[0].clone() + acc[1].clone()) + (acc[2].clone() + acc[3].clone()),
    );
    block_sum(b, red, THREADS, s)
}

/// A row normalisation. Buffers: `x`, `w` (`[cols]` f32), `bias` (LayerNorm), `y`.
#[derive(Clone, Copy, Debug)]
pub struct NormOp {
    pub kind: NormKind,
    pub x: View,
    pub y: View,
    pub eps: f32,
}

impl NormOp {
    fn validate(&self) -> Result<()> {
        self.x.validate("x")?;
        self.y.validate("y")?;
        if (self.y.rows, self.y.cols) != (self.x.rows, self.x.cols) {
            return Err(Error::arg(
                "y",
                format!("[{}, {}] like x", self.x.rows, self.x.cols),
                format!("[{}, {}]", self.y.rows, self.y.cols),
            ));
        }
        if !self.eps.is_finite() || self.eps <= 0.0 {
            return Err(Error::arg("eps", "a finite positive f32", self.eps));
        }
        Ok(())
    }
}

impl Op for NormOp {
    fn name(&self) -> String {
        format!("{:?} norm [{}, {}]", self.kind, self.x.rows, self.x.cols)
    }

    fn bindings(&self) -> Vec<Binding> {
        let c = self.x.cols as u64;
        let mut v = vec![
            Binding::read("x", self.x.min_bytes(DType::F32), "x f32"),
            Binding::read("w", c * 4, format!("[{c}] f32 norm weight")),
        ];
        if self.kind == NormKind::Layer {
            v.push(Binding::read("bias", c * 4, format!("[{c}] f32 norm bias")));
        }
        v.push(Binding::write("y", self.y.min_bytes(DType::F32), "y f32"));
        v
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<NormKind> = KernelCache::new();
        let k = lowered(&K, self.kind, norm_kernel)?;
        let mut p: Vec<(String, ParamValue)> = vec![
            ("rows".into(), ParamValue::U32(self.x.rows)),
            ("cols".into(), ParamValue::U32(self.x.cols)),
            ("eps".into(), ParamValue::F32(self.eps)),
        ];
        p.extend(self.x.params("x"));
        p.extend(self.y.params("y"));
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: [self.x.rows.min(65535), 1, 1],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let x = read_view(bufs.get("x")?, DType::F32, &self.x, "x")?;
        let cols = self.x.cols as usize;
        let w: Vec<f64> = f32s(bufs.get("w")?)[..cols]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let y = match self.kind {
            NormKind::Rms => rms_norm(&x, cols, &w, self.eps as f64),
            NormKind::Layer => {
                let b: Vec<f64> = f32s(bufs.get("bias")?)[..cols]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                layer_norm(&x, cols, &w, &b, self.eps as f64)
            }
        };
        write_view(bufs.get_mut("y")?, DType::F32, &self.y, &y, "y")
    }
}

/// Both kernels, lowered (for compile checks and exports).
pub fn all_variants() -> Result<Vec<Kernel>> {
    [NormKind::Rms, NormKind::Layer]
        .iter()
        .map(|k| crate::kir::lower(&norm_kernel(k)?, crate::kir::Lowering::Scalar))
        .collect()
}
