//! kir: the kernel description language.
//!
//! - [`ir`]: types, expressions, statements and tile ops;
//! - [`builder`]: how descriptions are written;
//! - [`ops`]: composite tile ops (online softmax, split combine);
//! - [`numeric`]: bit-exact number routines in integer ops (f32 division, e4m3 encode);
//! - [`lower_scalar`]: the portable lowering of tile ops to loops over workgroup memory.
//!
//! Lowerings are chosen per target by [`Lowering`]; emitters print lowered kernels only.

pub mod builder;
pub mod ir;
pub mod lower_scalar;
pub mod numeric;
pub mod ops;

pub use ir::Kernel;

/// How tile ops become scalar code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lowering {
    /// Loops over workgroup memory: every target.
    Scalar,
}

impl Lowering {
    pub fn name(&self) -> &'static str {
        match self {
            Lowering::Scalar => "scalar",
        }
    }
}

/// Lower a description for a target.
pub fn lower(kernel: &Kernel, lowering: Lowering) -> crate::Result<Kernel> {
    match lowering {
        Lowering::Scalar => lower_scalar::lower(kernel),
    }
}
