//! Every kernel described once in kir. Each description takes a config (compile-time shape
//! knobs and block sizes), documents its buffers and launch grid in the header it generates,
//! and has a float64 reference in [`crate::reference`].

pub mod blocks;
pub mod cache_write;
pub mod elementwise;
pub mod expert_shard;
pub mod fill;
pub mod indexer;
pub mod linear;
pub mod model_set;
pub mod moe_route;
pub mod norm;
pub mod rope;
pub mod sampler;
pub mod sparse_mla_decode;
pub mod topk;
pub mod vbt;
pub mod view;

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

/// [`pack_params`] with owned names (the model kernels build some names at run time).
pub fn pack(kernel: &Kernel, values: &[(String, ParamValue)]) -> Result<Vec<u8>> {
    let refs: Vec<(&str, ParamValue)> = values.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    pack_params(kernel, &refs)
}

/// A per-config cache of lowered (scalar) kernels: each config is described and lowered once
/// per process.
pub type KernelCache<C> =
    std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<C, std::sync::Arc<Kernel>>>>;

/// The lowered kernel of `cfg`, from `cache` or built by `build` (scalar lowering).
pub fn lowered<C: Copy + Eq + std::hash::Hash + Send + 'static>(
    cache: &'static KernelCache<C>,
    cfg: C,
    build: impl FnOnce(&C) -> Result<Kernel>,
) -> Result<std::sync::Arc<Kernel>> {
    let map = cache.get_or_init(Default::default);
    if let Some(k) = map.lock().ok().and_then(|m| m.get(&cfg).cloned()) {
        return Ok(k);
    }
    let k = std::sync::Arc::new(crate::kir::lower(
        &build(&cfg)?,
        crate::kir::Lowering::Scalar,
    )?);
    if let Ok(mut m) = map.lock() {
        m.insert(cfg, k.clone());
    }
    Ok(k)
}

/// One kernel launch: which kernel, the workgroup grid, and its parameter block.
#[derive(Clone, Debug)]
pub struct Launch {
    pub kernel: std::sync::Arc<Kernel>,
    pub grid: [u32; 3],
    pub params: Vec<u8>,
}

/// Which language a standard kernel is exported in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Wgsl,
    Cuda,
}

impl Target {
    pub fn name(&self) -> &'static str {
        match self {
            Target::Wgsl => "wgsl",
            Target::Cuda => "cuda",
        }
    }
}

/// One kernel of the standard export set: lowered for its target, with a one-line note for
/// the index of the exported files.
pub struct StandardKernel {
    pub target: Target,
    pub kernel: Kernel,
    pub note: String,
}

/// The standard configurations, each kernel lowered the way the backend of its target runs
/// it. `mla-export --all` writes these to `shaders/` (WGSL) and `cuda/` (CUDA C), and the
/// freshness test compares the checked-in files with them. Heads, topk, page size, tokens,
/// splits, strides and the lse layout are run-time parameters of these kernels, so one file
/// serves every H; per target the set is: decode split / one-split / combine for bf16 and
/// `fp8_ds_mla` rows (the combine is the same for both), the cache write for both row
/// formats, and the block-table conversion.
pub fn standard_set() -> Result<Vec<StandardKernel>> {
    use crate::kir::{lower, Lowering};
    use crate::mla::{CacheFormat, MlaDims};
    use sparse_mla_decode::{combine_kernel, split_kernel, DecodeConfig};
    let mut out = Vec::new();
    let dims = MlaDims::PRODUCTION;
    for target in [Target::Wgsl, Target::Cuda] {
        for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
            let base = match target {
                Target::Wgsl => DecodeConfig::portable(dims, format),
                Target::Cuda => DecodeConfig::cuda_scalar(dims, format),
            };
            out.push(StandardKernel {
                target,
                kernel: lower(&split_kernel(&base)?, base.lowering)?,
                note: format!(
                    "sparse decode, {} cache, split stage: one split writes out and lse, more write per-split partials for the combine",
                    format.name()
                ),
            });
            if format == CacheFormat::Bf16 {
                out.push(StandardKernel {
                    target,
                    kernel: lower(&combine_kernel(&base)?, base.lowering)?,
                    note:
                        "sparse decode, combine stage: merges the split partials (any cache format)"
                            .into(),
                });
            }
            let cw = cache_write::CacheWriteConfig { dims, format };
            out.push(StandardKernel {
                target,
                kernel: lower(&cache_write::kernel(&cw)?, Lowering::Scalar)?,
                note: format!(
                    "cache write: latent + rope (bf16) -> {} rows at a slot mapping",
                    format.name()
                ),
            });
        }
        out.push(StandardKernel {
            target,
            kernel: lower(&vbt::kernel()?, Lowering::Scalar)?,
            note: "virtual block table: logical top-k positions -> physical slots".into(),
        });
    }
    out.extend(tensor_core_set()?);
    Ok(out)
}

/// The tensor-core split kernels the CUDA backend runs (both head ranges, both formats); their
/// combine is the scalar set's.
fn tensor_core_set() -> Result<Vec<StandardKernel>> {
    use crate::kir::{lower, Lowering};
    use crate::mla::{CacheFormat, MlaDims};
    use sparse_mla_decode::{combine_kernel, split_kernel, DecodeConfig};
    let mut out = Vec::new();
    // the combine both tensor-core versions launch (256 threads)
    let base = DecodeConfig::tensor_core_v6(MlaDims::PRODUCTION, CacheFormat::Bf16, 16);
    out.push(StandardKernel {
        target: Target::Cuda,
        kernel: lower(&combine_kernel(&base)?, Lowering::Scalar)?,
        note: "sparse decode, combine stage of the tensor-core kernels (256 threads)".into(),
    });
    type Choose = fn(MlaDims, CacheFormat, u32) -> DecodeConfig;
    let versions: [(&str, Choose); 2] = [
        ("v6", DecodeConfig::tensor_core_v6),
        ("v7, mbarrier ring", DecodeConfig::tensor_core_v7),
    ];
    // what the backend does with each (DecodeConfig::for_call): v6 is the `Mma` lowering
    let role = |config: &DecodeConfig| {
        const SMALLEST: &str = "the CUDA backend's kernel for the smallest bf16 calls \
                                (above 16 heads too, in 16-head blocks)";
        const NOT_SINCE_V42: &str = "not planned by the CUDA backend since v42 \
                                     (v7 is faster; SPARSE_MLA_DECODE_KERNEL=v6 runs it)";
        const NOT_FP8: &str = "not planned by the CUDA backend \
                               (v7 is faster since v8; SPARSE_MLA_DECODE_KERNEL=v6 runs it)";
        let v6 = matches!(config.lowering, Lowering::Mma { .. });
        match (v6, config.format, config.block_h <= 16) {
            (false, ..) => "the CUDA backend's default",
            (true, CacheFormat::Bf16, true) => SMALLEST,
            (true, CacheFormat::Bf16, false) => NOT_SINCE_V42,
            (true, CacheFormat::Fp8DsMla, _) => NOT_FP8,
        }
    };
    // the large-batch kernels the backend plans (H <= 16 only): fp8's, v7 with 64-row steps
    // (bf16's two-group kernel is not planned since v42, and not exported)
    for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
        let Some(config) = DecodeConfig::tensor_core_batch(MlaDims::PRODUCTION, format, 16)
            .filter(|_| DecodeConfig::plans_large_batch(format))
        else {
            continue;
        };
        out.push(StandardKernel {
            target: Target::Cuda,
            kernel: lower(&split_kernel(&config)?, config.lowering)?,
            note: format!(
                "sparse decode, {} cache, tensor cores v7 with {}-row steps, the CUDA backend's large-batch kernel (H <= 16)",
                format.name(),
                config.block_n
            ),
        });
    }
    // v7 in 16-head blocks for narrow calls above 16 heads (DecodeConfig::is_narrow_call);
    // fp8's is its H <= 16 v7 kernel, exported below
    if let Some(config) =
        DecodeConfig::tensor_core_narrow(MlaDims::PRODUCTION, CacheFormat::Bf16, 64)
    {
        out.push(StandardKernel {
            target: Target::Cuda,
            kernel: lower(&split_kernel(&config)?, config.lowering)?,
            note: format!(
                "sparse decode, bf16 cache, tensor cores v7 in 16-head blocks without the L2 prefetch, the CUDA backend's kernel for narrow calls (H > 16, {} * T * ceil(H / 16) <= SMs)",
                DecodeConfig::NARROW_FACTOR
            ),
        });
    }
    // bf16 v7 in 64-head blocks for wide calls (DecodeConfig::is_wide_call)
    if let Some(config) = DecodeConfig::tensor_core_wide(MlaDims::PRODUCTION, CacheFormat::Bf16) {
        out.push(StandardKernel {
            target: Target::Cuda,
            kernel: lower(&split_kernel(&config)?, config.lowering)?,
            note: format!(
                "sparse decode, bf16 cache, tensor cores v7 in 64-head blocks (four warp groups of 16 heads over one ring), the CUDA backend's kernel for wide calls (H a multiple of 64, {} * T * H / 64 >= SMs)",
                DecodeConfig::WIDE_FACTOR
            ),
        });
    }
    for (version, choose) in versions {
        for format in [CacheFormat::Bf16, CacheFormat::Fp8DsMla] {
            for (heads, range) in [(16, "H <= 16"), (64, "H > 16")] {
                let config = choose(MlaDims::PRODUCTION, format, heads);
                out.push(StandardKernel {
                    target: Target::Cuda,
                    kernel: lower(&split_kernel(&config)?, config.lowering)?,
                    note: format!(
                        "sparse decode, {} cache, tensor cores {version} ({range}), {}",
                        format.name(),
                        role(&config)
                    ),
                });
            }
        }
    }
    Ok(out)
}
