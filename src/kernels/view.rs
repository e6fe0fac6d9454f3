//! The shapes the model kernels share: strided 2-D views of activations, element types, and
//! weight matrices in their checkpoint dtype (f32, bf16, or block-scaled e4m3).
//!
//! A [`View`] names a matrix inside a larger buffer: element `(r, c)` lives at element
//! `offset + r · stride + c`. Views are how the forward slices columns (q's rope part, a
//! head's nope part) and writes into part of a row without copies. Offsets and strides are
//! kernel parameters, in elements of the view's type.

use crate::kernels::ParamValue;
use crate::kir::builder::*;
use crate::kir::ir::{Elem, Expr, Ty};
use crate::{Error, Result};

/// Element type of an activation buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    Bf16,
}

impl DType {
    pub fn bytes(&self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    pub fn elem(&self) -> Elem {
        match self {
            DType::F32 => Elem::F32,
            DType::Bf16 => Elem::Bf16,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }
}

/// A strided 2-D view: element `(r, c)` at element `offset + r · stride + c` of its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct View {
    pub offset: u64,
    pub rows: u32,
    pub cols: u32,
    pub stride: u32,
}

impl View {
    /// A packed `[rows, cols]` matrix at the start of its buffer.
    pub fn packed(rows: u32, cols: u32) -> Self {
        View {
            offset: 0,
            rows,
            cols,
            stride: cols,
        }
    }

    /// Columns `start .. start + len` of every row.
    pub fn cols(&self, start: u32, len: u32) -> Result<View> {
        if start as u64 + len as u64 > self.cols as u64 {
            return Err(Error::arg(
                "columns",
                format!("within the view's {} columns", self.cols),
                format!("{start}..{}", start as u64 + len as u64),
            ));
        }
        Ok(View {
            offset: self.offset + start as u64,
            cols: len,
            ..*self
        })
    }

    /// Rows `start .. start + len`.
    pub fn rows(&self, start: u32, len: u32) -> Result<View> {
        if start as u64 + len as u64 > self.rows as u64 {
            return Err(Error::arg(
                "rows",
                format!("within the view's {} rows", self.rows),
                format!("{start}..{}", start as u64 + len as u64),
            ));
        }
        Ok(View {
            offset: self.offset + start as u64 * self.stride as u64,
            rows: len,
            ..*self
        })
    }

    /// The same elements read as `[rows, cols]`; only for views whose rows are packed.
    pub fn reshape(&self, rows: u32, cols: u32) -> Result<View> {
        let n = self.rows as u64 * self.cols as u64;
        if rows as u64 * cols as u64 != n || (self.rows > 1 && self.stride != self.cols) {
            return Err(Error::arg(
                "reshape",
                format!(
                    "{n} packed elements ({} x {}, stride {})",
                    self.rows, self.cols, self.stride
                ),
                format!("{rows} x {cols}"),
            ));
        }
        Ok(View {
            offset: self.offset,
            rows,
            cols,
            stride: cols,
        })
    }

    /// One past the last element the view reaches (0 for an empty view).
    pub fn end(&self) -> u64 {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        self.offset + (self.rows as u64 - 1) * self.stride as u64 + self.cols as u64
    }

    /// Bytes a buffer of `dtype` needs to hold the view.
    pub fn min_bytes(&self, dtype: DType) -> u64 {
        self.end() * dtype.bytes()
    }

    /// Offsets and strides are u32 kernel parameters; rows may not overlap.
    pub fn validate(&self, arg: &str) -> Result<()> {
        if self.rows > 1 && self.stride < self.cols {
            return Err(Error::arg(
                arg,
                format!("a row stride of at least {} columns", self.cols),
                self.stride,
            ));
        }
        if self.end() > u32::MAX as u64 {
            return Err(Error::arg(
                arg,
                "a view within the first 2^32 elements of its buffer",
                format!("{} elements", self.end()),
            ));
        }
        Ok(())
    }

    /// Element index of `(r, c)`.
    pub fn index(&self, r: u64, c: u64) -> usize {
        (self.offset + r * self.stride as u64 + c) as usize
    }

    /// The two kernel parameters of a view named `name`: `name_off`, `name_stride`.
    pub fn params(&self, name: &str) -> [(String, ParamValue); 2] {
        [
            (format!("{name}_off"), ParamValue::U32(self.offset as u32)),
            (format!("{name}_stride"), ParamValue::U32(self.stride)),
        ]
    }
}

/// The offset and stride parameters of a view inside a kernel.
#[derive(Clone, Debug)]
pub struct ViewArgs {
    pub off: Expr,
    pub stride: Expr,
}

impl ViewArgs {
    /// Declares `name_off` and `name_stride`.
    pub fn declare(b: &mut KernelBuilder, name: &str, what: &str) -> Self {
        ViewArgs {
            off: b.param(
                &format!("{name}_off"),
                Ty::U32,
                &format!("first element of {what}"),
            ),
            stride: b.param(
                &format!("{name}_stride"),
                Ty::U32,
                &format!("elements from one row of {what} to the next"),
            ),
        }
    }

    /// Element index of (row, col).
    pub fn at(&self, row: Expr, col: Expr) -> Expr {
        self.off.clone() + row * self.stride.clone() + col
    }
}

/// Loads element `index` of an activation buffer as f32.
pub fn load_f32(buf: &Buf, dtype: DType, index: Expr) -> Expr {
    match dtype {
        DType::F32 => buf.at(index),
        DType::Bf16 => buf.at(index).cvt(Ty::F32),
    }
}

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    Bf16,
    /// e4m3fn values with one f32 inverse scale per `block[0] × block[1]` block
    /// (DeepSeek-V3 / GLM-5 FP8 checkpoints: `weight` and `weight_scale_inv`).
    Fp8 {
        block: [u32; 2],
    },
}

impl WeightType {
    /// Elements per 32-bit word.
    pub fn per_word(&self) -> u32 {
        match self {
            WeightType::F32 => 1,
            WeightType::Bf16 => 2,
            WeightType::Fp8 { .. } => 4,
        }
    }

    pub fn bytes(&self) -> u32 {
        4 / self.per_word()
    }

    pub fn elem(&self) -> Elem {
        match self {
            WeightType::F32 => Elem::F32,
            WeightType::Bf16 => Elem::Bf16,
            WeightType::Fp8 { .. } => Elem::U8,
        }
    }

    /// A short name for kernel names: `f32`, `bf16`, `fp8`.
    pub fn name(&self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::Bf16 => "bf16",
            WeightType::Fp8 { .. } => "fp8",
        }
    }
}

/// A `[rows, cols]` weight matrix (nn.Linear's `[out, in]`), possibly several matrices stacked
/// along the rows. `group_rows` is how many rows each stacked matrix has: the FP8 block grid
/// restarts at each group, as it does when separately quantised checkpoint tensors (an
/// expert's gate and up, every expert of a layer) are stacked into one buffer. Scales of
/// group `g` occupy scale rows `g · ceil(group_rows / block_rows) ..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightLayout {
    pub wtype: WeightType,
    pub rows: u32,
    pub cols: u32,
    pub group_rows: u32,
}

impl WeightLayout {
    pub fn new(wtype: WeightType, rows: u32, cols: u32) -> Self {
        WeightLayout {
            wtype,
            rows,
            cols,
            group_rows: rows,
        }
    }

    pub fn stacked(wtype: WeightType, groups: u32, group_rows: u32, cols: u32) -> Self {
        WeightLayout {
            wtype,
            rows: groups * group_rows,
            cols,
            group_rows,
        }
    }

    pub fn groups(&self) -> u32 {
        self.rows / self.group_rows.max(1)
    }

    /// Scale rows per group and scale columns (FP8 only; (0, 0) otherwise).
    pub fn scale_grid(&self) -> (u32, u32) {
        match self.wtype {
            WeightType::Fp8 { block } => (
                self.group_rows.div_ceil(block[0]),
                self.cols.div_ceil(block[1]),
            ),
            _ => (0, 0),
        }
    }

    /// Bytes of the weight values.
    pub fn bytes(&self) -> u64 {
        self.rows as u64 * self.cols as u64 * self.wtype.bytes() as u64
    }

    /// Bytes of the f32 scales (0 unless FP8).
    pub fn scale_bytes(&self) -> u64 {
        let (sr, sc) = self.scale_grid();
        self.groups() as u64 * sr as u64 * sc as u64 * 4
    }

    /// The kernels read weights as 32-bit words (rows whole words), indexed by u32.
    pub fn validate(&self, arg: &str) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Err(Error::arg(arg, "a non-empty weight", "0 rows or columns"));
        }
        if self.group_rows == 0 || self.rows % self.group_rows != 0 {
            return Err(Error::arg(
                arg,
                format!("groups of rows dividing its {} rows", self.rows),
                self.group_rows,
            ));
        }
        let pw = self.wtype.per_word();
        if self.cols % pw != 0 {
            return Err(Error::arg(
                arg,
                format!(
                    "a column count divisible by {pw} ({} weights are read {pw} per 32-bit word)",
                    self.wtype.name()
                ),
                self.cols,
            ));
        }
        let words = self.rows as u64 * (self.cols / pw) as u64;
        if words > u32::MAX as u64 {
            return Err(Error::arg(
                arg,
                "at most 2^32 32-bit words (16 GiB) per weight buffer",
                format!("{} bytes", words * 4),
            ));
        }
        if let WeightType::Fp8 { block } = self.wtype {
            if block[0] == 0 || block[1] == 0 || block[1] % 4 != 0 {
                return Err(Error::arg(
                    arg,
                    "FP8 blocks of at least one row and a multiple of 4 columns",
                    format!("{block:?}"),
                ));
            }
            // The kernels find a column's scale as floor((col + 0.5) / block_cols) through an
            // f32 reciprocal, exact below 2^22 columns (see kernels::linear).
            if self.cols >= 1 << 22 {
                return Err(Error::arg(
                    arg,
                    "an FP8 weight of fewer than 2^22 columns",
                    self.cols,
                ));
            }
        }
        Ok(())
    }

    /// Index of the scale of element (`row`, `col`) in the f32 scale buffer.
    pub fn scale_index(&self, row: u32, col: u32) -> usize {
        // (The kernels compute the column part through an f32 reciprocal; the test
        // `scale_column_by_reciprocal_is_exact` in kernels::linear checks they agree.)
        let WeightType::Fp8 { block } = self.wtype else {
            return 0;
        };
        let (sr, sc) = self.scale_grid();
        let g = row / self.group_rows;
        let rr = row % self.group_rows;
        ((g * sr + rr / block[0]) as usize) * sc as usize + (col / block[1]) as usize
    }
}
