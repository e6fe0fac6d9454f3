//! The one collective the sharded forward needs: a sum over ranks (all-reduce), behind a
//! trait so that an NCCL implementation can take the host one's place.
//!
//! The trait takes every rank's tensor in one call because one thread drives all the ranks
//! in lockstep; NCCL's single-process multi-GPU form has the same shape (`ncclGroupStart`,
//! one `ncclAllReduce` per rank's communicator and stream, `ncclGroupEnd`). Not built: no
//! machine with several GPUs was available to test it, and NCCL refuses two ranks on one GPU.

use super::super::device::{Device, Tensor};
use crate::kernels::view::DType;
use crate::{Error, Result};

/// A sum across the ranks of a sharded model.
pub trait Collective: Send + Sync {
    /// What the sum runs through, for reports.
    fn name(&self) -> &'static str;

    /// In place: afterwards every rank's tensor holds `Σ_r ranks[r]`. `ranks[r]` is rank r's
    /// tensor on rank r's device; all have the same shape (packed f32).
    fn all_reduce_sum(&self, ranks: &[(&Device, &Tensor)]) -> Result<()>;
}

/// The all-reduce through host memory, on every backend: each rank's tensor is downloaded,
/// the values are summed in f32 in rank order 0, 1, …, N−1 (so the result does not depend on
/// timing or on the backend), and the sum is written back to every rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostCollective;

fn packed_f32(t: &Tensor, rank: usize) -> Result<()> {
    if t.dtype != DType::F32 || t.view.offset != 0 || t.view.stride != t.view.cols {
        return Err(Error::arg(
            "all-reduce tensor",
            "a packed f32 tensor",
            format!("rank {rank}: {} view {:?}", t.dtype.name(), t.view),
        ));
    }
    Ok(())
}

impl Collective for HostCollective {
    fn name(&self) -> &'static str {
        "host memory"
    }

    fn all_reduce_sum(&self, ranks: &[(&Device, &Tensor)]) -> Result<()> {
        let Some((_, first)) = ranks.first() else {
            return Ok(());
        };
        let shape = (first.rows(), first.cols());
        for (r, (_, t)) in ranks.iter().enumerate() {
            packed_f32(t, r)?;
            if (t.rows(), t.cols()) != shape {
                return Err(Error::arg(
                    "all-reduce tensor",
                    format!("[{}, {}] on every rank", shape.0, shape.1),
                    format!("rank {r}: [{}, {}]", t.rows(), t.cols()),
                ));
            }
        }
        if ranks.len() == 1 {
            return Ok(());
        }
        let mut sum = ranks[0].0.download(ranks[0].1)?;
        for (d, t) in &ranks[1..] {
            for (s, v) in sum.iter_mut().zip(d.download(t)?) {
                *s += v;
            }
        }
        let bytes: Vec<u8> = sum.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (d, t) in ranks {
            d.backend().write(t.buffer(), &bytes)?;
        }
        Ok(())
    }
}
