//! Every kernel the model runs besides the attention ones (which are in
//! [`super::standard_set`]): each variant of each model op, lowered the way the backends run
//! it (scalar lowering on every target). The compile checks take every one of them through
//! NVRTC for sm_80 / 89 / 90 / 120 and through naga.

use crate::kir::Kernel;
use crate::Result;

/// All model-op kernel variants.
pub fn model_kernels() -> Result<Vec<Kernel>> {
    let mut v = Vec::new();
    v.extend(super::linear::all_variants()?);
    v.extend(super::norm::all_variants()?);
    v.extend(super::rope::all_variants()?);
    v.extend(super::elementwise::all_variants()?);
    v.extend(super::expert_shard::all_variants()?);
    v.extend(super::indexer::all_variants()?);
    v.extend(super::topk::all_variants()?);
    v.extend(super::fill::all_variants()?);
    v.push(crate::kir::lower(
        &super::moe_route::moe_route_kernel()?,
        crate::kir::Lowering::Scalar,
    )?);
    for mode in super::sampler::SampleMode::all() {
        v.push(crate::kir::lower(
            &super::sampler::sample_kernel(&mode)?,
            crate::kir::Lowering::Scalar,
        )?);
    }
    Ok(v)
}
