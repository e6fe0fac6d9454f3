//! Every kernel described once in kir. Each description takes a config (compile-time shape
//! knobs and block sizes), documents its buffers and launch grid in the header it generates,
//! and has a float64 reference in [`crate::reference`].

pub mod sparse_mla_decode;

use crate::kir::ir::{Kernel, Ty};
use crate::{Error, Result};

/// A scalar kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParamValue {
    U32(u32),
    I32(i32),
    F32(f32),
}

impl ParamValue {
    fn ty(&self) -> Ty {
        match self {
            ParamValue::U32(_) => Ty::U32,
            ParamValue::I32(_) => Ty::I32,
            ParamValue::F32(_) => Ty::F32,
        }
    }
}

/// The parameter block of `kernel` (4 bytes per parameter, declaration order), from named
/// values. Every declared parameter must be given, with its declared type.
pub fn pack_params(kernel: &Kernel, values: &[(&str, ParamValue)]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(kernel.params.len() * 4);
    for p in &kernel.params {
        let v = values
            .iter()
            .find(|(n, _)| *n == p.name)
            .map(|(_, v)| *v)
            .ok_or_else(|| Error::Kir {
                kernel: kernel.name.clone(),
                message: format!("no value given for parameter `{}`", p.name),
            })?;
        if v.ty() != p.ty {
            return Err(Error::Kir {
                kernel: kernel.name.clone(),
                message: format!("parameter `{}` is {}, given {:?}", p.name, p.ty, v),
            });
        }
        out.extend_from_slice(&match v {
            ParamValue::U32(x) => x.to_le_bytes(),
            ParamValue::I32(x) => x.to_le_bytes(),
            ParamValue::F32(x) => x.to_le_bytes(),
        });
    }
    Ok(out)
}

/// One kernel launch: which kernel, the workgroup grid, and its parameter block.
#[derive(Clone, Debug)]
pub struct Launch {
    pub kernel: std::sync::Arc<Kernel>,
    pub grid: [u32; 3],
    pub params: Vec<u8>,
}
