//! Reading and writing the views and weights of the model kernels on host bytes, for the
//! references: values come out as f64 and go back rounded to their storage type.

use super::numerics::{bf16_bits, bf16_from_bits, e4m3_to_f32};
use crate::kernels::view::{DType, View, WeightLayout, WeightType};
use crate::{Error, Result};

fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

fn bf16_at(b: &[u8], i: usize) -> f32 {
    bf16_from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}

/// Element `i` of an activation buffer.
pub fn elem(b: &[u8], dtype: DType, i: usize) -> f64 {
    match dtype {
        DType::F32 => f32_at(b, i) as f64,
        DType::Bf16 => bf16_at(b, i) as f64,
    }
}

fn check(b: &[u8], dtype: DType, v: &View, arg: &str) -> Result<()> {
    if (b.len() as u64) < v.min_bytes(dtype) {
        return Err(Error::arg(
            arg,
            format!("at least {} bytes", v.min_bytes(dtype)),
            b.len(),
        ));
    }
    Ok(())
}

/// The view's elements row by row (`[rows, cols]`, packed), as f64.
pub fn read_view(b: &[u8], dtype: DType, v: &View, arg: &str) -> Result<Vec<f64>> {
    check(b, dtype, v, arg)?;
    let mut out = Vec::with_capacity(v.rows as usize * v.cols as usize);
    for r in 0..v.rows as u64 {
        for c in 0..v.cols as u64 {
            out.push(elem(b, dtype, v.index(r, c)));
        }
    }
    Ok(out)
}

/// Stores `values` (`[rows, cols]`, packed) into the view, rounded to `dtype` (bf16: nearest
/// even). Nothing outside the view changes.
pub fn write_view(b: &mut [u8], dtype: DType, v: &View, values: &[f64], arg: &str) -> Result<()> {
    check(b, dtype, v, arg)?;
    if values.len() != v.rows as usize * v.cols as usize {
        return Err(Error::arg(
            arg,
            format!("{} x {} values", v.rows, v.cols),
            values.len(),
        ));
    }
    for r in 0..v.rows as u64 {
        for c in 0..v.cols as u64 {
            let x = values[(r * v.cols as u64 + c) as usize] as f32;
            let i = v.index(r, c);
            match dtype {
                DType::F32 => b[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes()),
                DType::Bf16 => b[2 * i..2 * i + 2].copy_from_slice(&bf16_bits(x).to_le_bytes()),
            }
        }
    }
    Ok(())
}

/// A weight matrix on the host: its values and (FP8) its f32 scales.
pub struct HostWeight<'a> {
    pub layout: WeightLayout,
    pub values: &'a [u8],
    pub scales: Option<&'a [u8]>,
}

impl HostWeight<'_> {
    /// Row `row` as f64, dequantised (`e4m3 × scale_inv` for FP8).
    pub fn row(&self, row: u32) -> Vec<f64> {
        let l = &self.layout;
        let cols = l.cols as usize;
        let base = row as usize * cols;
        match l.wtype {
            WeightType::F32 => (0..cols)
                .map(|c| f32_at(self.values, base + c) as f64)
                .collect(),
            WeightType::Bf16 => (0..cols)
                .map(|c| bf16_at(self.values, base + c) as f64)
                .collect(),
            WeightType::Fp8 { .. } => {
                let s = self.scales.unwrap_or(&[]);
                (0..cols)
                    .map(|c| {
                        let q = e4m3_to_f32(self.values[base + c]) as f64;
                        q * f32_at(s, l.scale_index(row, c as u32)) as f64
                    })
                    .collect()
            }
        }
    }

    pub fn check(&self, arg: &str) -> Result<()> {
        self.layout.validate(arg)?;
        if (self.values.len() as u64) < self.layout.bytes() {
            return Err(Error::arg(
                arg,
                format!("at least {} bytes of weights", self.layout.bytes()),
                self.values.len(),
            ));
        }
        let need = self.layout.scale_bytes();
        if need > 0 && self.scales.map(|s| s.len() as u64).unwrap_or(0) < need {
            return Err(Error::arg(
                arg,
                format!("{need} bytes of FP8 scales"),
                self.scales.map(|s| s.len()).unwrap_or(0),
            ));
        }
        Ok(())
    }
}

/// i32 values of a buffer.
pub fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// f32 values of a buffer.
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Writes i32 values at the start of a buffer.
pub fn put_i32s(b: &mut [u8], v: &[i32]) {
    for (d, x) in b.chunks_exact_mut(4).zip(v) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// Writes f32 values at the start of a buffer.
pub fn put_f32s(b: &mut [u8], v: &[f32]) {
    for (d, x) in b.chunks_exact_mut(4).zip(v) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}
