//! Expert parallelism's one kernel: the routed expert ids of a step as one rank sees them.
//!
//! Under expert parallelism (docs/sharding.md) rank r holds the routed experts
//! `[base, base + count)`; the router is replicated, so every rank computes the same global
//! top-k ids. The rank's grouped expert kernel ([`super::linear::GroupedLinearOp`] with
//! [`super::linear::GroupSelect::Experts`]) indexes its own weight, which holds `count`
//! experts, and skips ids outside `[0, count)`: this kernel turns a global id into the local
//! one (`id − base`) or into −1 for an expert another rank holds. A new kernel rather than a
//! base offset on the grouped linear, so that no existing kernel changes.
//!
//! The definition is [`crate::reference::moe_route::local_expert_ids`].

use super::{lowered, pack, KernelCache, Launch, ParamValue};
use crate::kir::builder::*;
use crate::kir::ir::{Access, Elem, Kernel, Ty};
use crate::reference::moe_route::local_expert_ids;
use crate::reference::tensor::{i32s, put_i32s};
use crate::runtime::op::{Binding, HostBuffers, Op};
use crate::{Error, Result};

pub const THREADS: u32 = 256;

fn local_experts_kernel(_: &()) -> Result<Kernel> {
    let mut b = KernelBuilder::new("local_expert_ids", THREADS);
    b.doc("Expert ids as the rank holding experts [base, base + count) sees them: local[e] = ids[e] - base when base <= ids[e] < base + count, else -1 (skipped by the grouped expert kernel).".to_string());
    b.doc("Grid: x = min(ceil(n / 256), 65535), grid-stride.".to_string());
    let n = b.param("n", Ty::U32, "ids (tokens x top_k)");
    let base = b.param("base", Ty::I32, "first expert of the rank");
    let count = b.param("count", Ty::I32, "experts of the rank");
    let ids = b.buffer("ids", Elem::I32, Access::Read, "[n] i32 global expert ids");
    let local = b.buffer(
        "local",
        Elem::I32,
        Access::ReadWrite,
        "[n] i32 local expert ids (-1: another rank's)",
    );
    let stride = b.let_("stride", num_workgroups(0) * u(THREADS));
    b.for_(
        "e",
        workgroup_id(0) * u(THREADS) + local_id(),
        n,
        stride,
        |b, e| {
            let id = b.let_("id", ids.at(e.clone()));
            let mine = id
                .clone()
                .ge(base.clone())
                .and(id.clone().lt(base.clone() + count));
            b.store(&local, e, select(mine, id - base, i(-1)));
        },
    );
    b.finish()
}

/// `local [n] = ids [n]` mapped to the rank's experts `[base, base + count)` (−1 outside).
/// Buffers: `ids`, `local` (both i32, packed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalExpertsOp {
    pub n: u32,
    pub base: u32,
    pub count: u32,
}

impl LocalExpertsOp {
    fn validate(&self) -> Result<()> {
        if self.n == 0 || self.count == 0 {
            return Err(Error::arg(
                "local experts",
                "at least one id and one expert",
                format!("{} ids, {} experts", self.n, self.count),
            ));
        }
        if self.base as u64 + self.count as u64 > i32::MAX as u64 {
            return Err(Error::arg(
                "base + count",
                "below 2^31 (i32 expert ids)",
                self.base as u64 + self.count as u64,
            ));
        }
        Ok(())
    }
}

impl Op for LocalExpertsOp {
    fn name(&self) -> String {
        format!(
            "local_expert_ids [{}] experts {}..{}",
            self.n,
            self.base,
            self.base + self.count
        )
    }

    fn bindings(&self) -> Vec<Binding> {
        let bytes = self.n as u64 * 4;
        vec![
            Binding::read("ids", bytes, "i32 global expert ids"),
            Binding::write("local", bytes, "i32 local expert ids"),
        ]
    }

    fn launches(&self) -> Result<Vec<Launch>> {
        self.validate()?;
        static K: KernelCache<()> = KernelCache::new();
        let k = lowered(&K, (), local_experts_kernel)?;
        let p: Vec<(String, ParamValue)> = vec![
            ("n".into(), ParamValue::U32(self.n)),
            ("base".into(), ParamValue::I32(self.base as i32)),
            ("count".into(), ParamValue::I32(self.count as i32)),
        ];
        Ok(vec![Launch {
            params: pack(&k, &p)?,
            kernel: k,
            grid: [self.n.div_ceil(THREADS).clamp(1, 65535), 1, 1],
        }])
    }

    fn reference(&self, bufs: &mut HostBuffers<'_>) -> Result<()> {
        self.validate()?;
        let ids = i32s(bufs.get("ids")?);
        let local = local_expert_ids(&ids[..self.n as usize], self.base, self.count);
        put_i32s(bufs.get_mut("local")?, &local);
        Ok(())
    }
}

/// The kernel, lowered (for compile checks).
pub fn all_variants() -> Result<Vec<Kernel>> {
    Ok(vec![crate::kir::lower(
        &local_experts_kernel(&())?,
        crate::kir::Lowering::Scalar,
    )?])
}
