//! The shared-memory plan of a lowered kernel: where each shared array lives in the block's
//! shared memory, and whether the whole fits SM120's per-block limit. Kept apart from the
//! lowerings (as FlashMLA keeps its shared-memory plan in `config.h`): the lowerings check
//! their output with it, the CUDA emitter places dynamic shared memory by it, the CUDA
//! runtime refuses a kernel by it and the export header sizes launches by it.

use super::ir::{Kernel, SharedDecl};
use crate::{Error, Result};

/// Shared memory per block on SM120 (RTX PRO 6000, RTX 5090): 99 KB. Every CUDA kernel must
/// fit it, whatever GPU it is compiled for, so that what runs on one runs on the other.
pub const MAX_SHARED_BYTES: u64 = 101_376;

/// Shared arrays start on 16-byte boundaries (`cp.async` of 16 bytes, `ldmatrix` rows).
const ALIGN: u64 = 16;

/// Byte offsets of each shared array (16-byte aligned, in declaration order) and the total.
/// An alias ([`SharedDecl::alias`]) lies inside the array it names (declared before it) and
/// takes no memory of its own.
pub fn shared_layout(shared: &[SharedDecl]) -> (Vec<u64>, u64) {
    let mut offsets: Vec<u64> = Vec::with_capacity(shared.len());
    let mut at = 0u64;
    for s in shared {
        if let Some((parent, bytes)) = &s.alias {
            let base = shared
                .iter()
                .zip(&offsets)
                .find(|(d, _)| d.name == *parent)
                .map(|(_, o)| *o)
                .expect("an alias names an array declared before it");
            offsets.push(base + *bytes as u64);
            continue;
        }
        offsets.push(at);
        at += (s.len as u64 * 4).div_ceil(ALIGN) * ALIGN;
    }
    (offsets, at)
}

/// The bytes of shared memory `kernel` needs per block, or an error naming the kernel when
/// that is more than [`MAX_SHARED_BYTES`].
pub fn check_fits(kernel: &Kernel) -> Result<u64> {
    let (_, bytes) = shared_layout(&kernel.shared);
    if bytes > MAX_SHARED_BYTES {
        return Err(Error::ResourceLimit {
            kernel: kernel.name.clone(),
            resource: "shared memory per block (SM120 limit, bytes)".into(),
            needed: bytes,
            limit: MAX_SHARED_BYTES,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::ir::Ty;

    fn decl(len: u32) -> SharedDecl {
        SharedDecl {
            alias: None,
            name: format!("a{len}"),
            ty: Ty::U32,
            len,
        }
    }

    #[test]
    fn arrays_start_on_16_byte_boundaries() {
        let (offsets, total) = shared_layout(&[decl(1), decl(4), decl(5)]);
        assert_eq!(offsets, vec![0, 16, 32]);
        assert_eq!(total, 64);
    }
}
