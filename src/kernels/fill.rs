//! Buffers filled on the device, for benchmarks at true model width (where uploading tens
//! of gigabytes of random weights from the host would take longer than the benchmark): every
//! 32-bit word is a function of (seed, word index) through an integer hash, so the host can
//! reproduce any word. And a plain word copy, which measures the device's copy bandwidth.

use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Expr, Kernel, Ty};
use crate::reference::numerics::bf16_bits;
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;

/// What each word becomes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FillMode {
    /// Four e4m3 bytes of magnitude in [2^-6, 2^2), random sign (never NaN).
    E4m3,
    /// Two bf16 values, uniform in `[-scale, scale)`.
    Bf16 { scale: f32 },
    /// One f32, uniform in `[lo, hi)`.
    F32 { lo: f32, hi: f32 },
}

impl FillMode {
    fn code(&self) -> u32 {
        match self {
            FillMode::E4m3 => 0,
            FillMode::Bf16 { .. } => 1,
            FillMode::F32 { .. } => 2,
        }
    }

    /// (a, b) of `a + b · unit`: bf16 `(-scale, 2 scale)`, f32 `(lo, hi - lo)`.
    fn affine(&self) -> (f32, f32) {
        match *self {
            FillMode::E4m3 => (0.0, 0.0),
            FillMode::Bf16 { scale } => (-scale, 2.0 * scale),
            FillMode::F32 { lo, hi } => (lo, hi - lo),
        }
    }
}

/// The hash of word `i` under `seed` (a murmur-style finaliser), as the kernel computes it.
pub fn hash(seed: u32, i: u32) -> u32 {
    let mut x = seed ^ i.wrapping_mul(0x9e37_79b9);
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

fn hash_expr(b: &mut KernelBuilder, seed: &Expr, i: Expr) -> Expr {
    let x = b.var("h", seed.clone() ^ (i * u(0x9e37_79b9)));
    b.set(&x, x.clone() ^ (x.clone() >> u(16)));
    b.set(&x, x.clone() * u(0x7feb_352d));
    b.set(&x, x.clone() ^ (x.clone() >> u(15)));
    b.set(&x, x.clone() * u(0x846c_a68b));
    b.let_("hashed", x.clone() ^ (x >> u(16)))
}

/// An e4m3 byte from 8 random bits: sign, exponent field 1..=8, mantissa.
fn e4m3_byte(bits: u32) -> u32 {
    (bits & 0x80) | ((1 + ((bits >> 3) & 7)) << 3) | (bits & 7)
}

/// Word `i` of a fill, on the host.
pub fn fill_word(mode: FillMode, seed: u32, i: u32) -> u32 {
    let h = hash(seed, i);
    let (a, b) = mode.affine();
    match mode {
        FillMode::E4m3 => (0..4).fold(0, |w, k| w | (e4m3_byte((h >> (8 * k)) & 0xff) << (8 * k))),
        FillMode::Bf16 { .. } => {
            let lo = a + b * ((h & 0xffff) as f32 / 65536.0);
            let hi = a + b * ((h >> 16) as f32 / 65536.0);
            bf16_bits(lo) as u32 | ((bf16_bits(hi) as u32) << 16)
        }
        FillMode::F32 { .. } => (a + b * ((h >> 8) as f32 / 16_777_216.0)).to_bits(),
    }
}

fn fill_kernel(code: &u32) -> Result<Kernel> {
    let name = ["fill_e4m3", "fill_bf16", "fill_f32"]
        .get(*code as usize)
        .ok_or_else(|| Error::arg("fill mode", "0, 1 or 2", code))?;
    let mut b = KernelBuilder::new(*name, THREADS);
    b.doc("Random fill: word i = f(hash(seed, i)) (the hash and f are in kernels::fill, for the host to replay).".to_string());
    b.doc(
        "Grid: x = min(ceil(words / 256), 65535), y = rounds of 65535 * 256 words; grid-stride."
            .to_string(),
    );
    let words = b.param("words", Ty::U32, "32-bit words to write");
    let seed = b.param("seed", Ty::U32, "seed of the hash");
    let a = b.param("a", Ty::F32, "offset of the uniform value");
    let scale = b.param("scale", Ty::F32, "span of the uniform value");
    let dst = b.buffer("dst", Elem::U32, Access::ReadWrite, "[words] u32");
    let stride = b.let_("stride", num_workgroups(0) * u(THREADS));
    b.for_(
        "i",
        workgroup_id(0) * u(THREADS) + local_id(),
        words,
        stride,
        |b, i_| {
            let h = hash_expr(b, &seed, i_.clone());
            let w = match code {
                0 => {
                    let mut w: Option<Expr> = None;
                    for k in 0..4 {
                        let bits = (h.clone() >> u(8 * k)) & u(0xff);
                        let byte = (bits.clone() & u(0x80))
                            | ((u(1) + ((bits.clone() >> u(3)) & u(7))) << u(3))
                            | (bits & u(7));
                        let shifted = byte << u(8 * k);
                        w = Some(match w {
                            None => shifted,
                            Some(p) => p | shifted,
                        });
                    }
                    w.unwrap_or_else(|| u(0))
                }
                1 => {
                    let lo = a.clone()
                        + scale.clone() * ((h.clone() & u(0xffff)).as_f32() * f(1.0 / 65536.0));
                    let hi = a.clone()
                        + scale.clone() * ((h.clone() >> u(16)).as_f32() * f(1.0 / 65536.0));
                    pack_bf16x2(lo, hi)
                }
                _ => f32_bits(
                    a.clone()
                        + scale.clone() * ((h.clone() >> u(8)).as_f32() * f(1.0 / 16_777_216.0)),
                ),
            };
            b.store(&dst, i_, w);
        },
    );
    b.finish()
}

/// Fills the first `words` words of `dst`. Buffer: `dst`.
#[derive(Clone, Copy, Debug)]
pub struct FillOp {
    pub words: u32,
    pub mode: FillMode,
    pub seed: u32,
}

impl Op for FillOp {
    fn name(&self) -> String {
        format!("fill {} words {:?}", self.words, self.mode)
    }

    fn bindings(&self) -> Vec<Binding> {
        vec![Binding::write("dst", self.words as u64 * 4, "filled words")]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        static K: KernelCache<u32> = KernelCache::new();
        let k = lowered(&K, self.mode.code(), fill_kernel)?;
        let (a, scale) = self.mode.affine();
        let p: Vec<(String, ParamValue)> = vec![
            ("words".into(), ParamValue::U32(self.words)),
            ("seed".into(), ParamValue::U32(self.seed)),
            ("a".into(), ParamValue::F32(a)),
            ("scale".into(), ParamValue::F32(scale)),
        ];
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: stride_grid(self.words),
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let dst = bufs.get_mut("dst")?;
        for (i, w) in dst
            .chunks_exact_mut(4)
            .take(self.words as usize)
            .enumerate()
        {
            w.copy_from_slice(&fill_word(self.mode, self.seed, i as u32).to_le_bytes());
        }
        Ok(())
    }
}

/// The grid of a grid-stride loop over `words`: one thread per word, at most 65535 workgroups.
fn stride_grid(words: u32) -> [u32; 3] {
    let wgs = (words as u64).div_ceil(THREADS as u64).clamp(1, 65535) as u32;
    [wgs, 1, 1]
}

fn copy_kernel(_: &()) -> Result<Kernel> {
    let mut b = KernelBuilder::new("copy_words", THREADS);
    b.doc("dst[i] = src[i] for i < words (grid-stride): the device's copy bandwidth as our kernels see it.".to_string());
    let words = b.param("words", Ty::U32, "32-bit words to copy");
    let src = b.buffer("src", Elem::U32, Access::Read, "[words] u32");
    let dst = b.buffer("dst", Elem::U32, Access::ReadWrite, "[words] u32");
    let stride = b.let_("stride", num_workgroups(0) * u(THREADS));
    b.for_(
        "i",
        workgroup_id(0) * u(THREADS) + local_id(),
        words,
        stride,
        |b, i_| {
            b.store(&dst, i_.clone(), src.at(i_));
        },
    );
    b.finish()
}

/// `dst[..words] = src[..words]`. Buffers: `src`, `dst`.
#[derive(Clone, Copy, Debug)]
pub struct CopyOp {
    pub words: u32,
}

impl Op for CopyOp {
    fn name(&self) -> String {
        format!("copy {} words", self.words)
    }

    fn bindings(&self) -> Vec<Binding> {
        vec![
            Binding::read("src", self.words as u64 * 4, "source words"),
            Binding::write("dst", self.words as u64 * 4, "destination words"),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), copy_kernel)?;
        let p: Vec<(String, ParamValue)> = vec![("words".into(), ParamValue::U32(self.words))];
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: stride_grid(self.words),
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        let n = self.words as usize * 4;
        let (src, dst) = bufs.read_write("src", "dst")?;
        dst[..n].copy_from_slice(&src[..n]);
        Ok(())
    }
}

/// Every kernel of this module, lowered.
pub fn all_variants() -> Result<Vec<Kernel>> {
    let mut v: Vec<Kernel> = (0..3)
        .map(|c| crate::kir::lower(&fill_kernel(&c)?, crate::kir::Lowering::Scalar))
        .collect::<Result<_>>()?;
    v.push(crate::kir::lower(
        &copy_kernel(&())?,
        crate::kir::Lowering::Scalar,
    )?);
    Ok(v)
}
