//! Which part of each checkpoint tensor a rank holds (docs/sharding.md), checked against the
//! config and the checkpoint before anything is uploaded.
//!
//! | tensor | rank r of N holds |
//! |---|---|
//! | q_b_proj | the rows of its heads `[r·H/N, (r+1)·H/N)` |
//! | kv_b_proj (→ W_UKᵀ, W_UV) | the same heads' blocks (built on the host) |
//! | o_proj | the columns of those heads |
//! | dense and shared-expert gate / up | rows `[r·I/N, (r+1)·I/N)` of the intermediate dim |
//! | dense and shared-expert down | the same columns |
//! | routed experts | whole experts `[r·E/N, (r+1)·E/N)` |
//! | everything else | all of it (replicated) |

use super::super::config::{MlpKind, ModelConfig};
use super::super::weights::Checkpoint;
use crate::{Error, Result};
use safetensors::Dtype;

/// Rank `rank` of a model sharded `world` ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    pub rank: usize,
    pub world: usize,
}

impl ShardSpec {
    /// The unsharded model: one rank holding everything.
    pub const WHOLE: ShardSpec = ShardSpec { rank: 0, world: 1 };

    /// This rank's part of `n` things as `(start, len)` (`n` divisible by the world size,
    /// which [`check_tp`] checks).
    pub fn part(&self, n: usize) -> (usize, usize) {
        let len = n / self.world.max(1);
        (self.rank * len, len)
    }
}

/// The part of a `[rows, cols]` tensor one rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    Whole,
    /// Rows `start .. start + len`.
    Rows(usize, usize),
    /// Columns `start .. start + len`.
    Cols(usize, usize),
}

impl Cut {
    /// The shape of the part.
    pub fn shape(&self, [rows, cols]: [usize; 2]) -> [usize; 2] {
        match *self {
            Cut::Whole => [rows, cols],
            Cut::Rows(_, n) => [n, cols],
            Cut::Cols(_, n) => [rows, n],
        }
    }

    /// The same part of the tensor's FP8 block-scale grid (the cut on block boundaries, or
    /// ending at the tensor's end).
    pub fn in_blocks(&self, block: [usize; 2]) -> Cut {
        let blocks =
            |start: usize, len: usize, b: usize| (start / b, (start + len).div_ceil(b) - start / b);
        match *self {
            Cut::Whole => Cut::Whole,
            Cut::Rows(s, n) => {
                let (s, n) = blocks(s, n, block[0]);
                Cut::Rows(s, n)
            }
            Cut::Cols(s, n) => {
                let (s, n) = blocks(s, n, block[1]);
                Cut::Cols(s, n)
            }
        }
    }
}

/// The `cut` part of a row-major `[rows, cols]` matrix of `elem`-byte values.
pub fn cut_bytes(data: &[u8], elem: usize, [rows, cols]: [usize; 2], cut: Cut) -> Vec<u8> {
    let row = cols * elem;
    match cut {
        Cut::Whole => data[..rows * row].to_vec(),
        Cut::Rows(s, n) => data[s * row..(s + n) * row].to_vec(),
        Cut::Cols(s, n) => {
            let mut out = Vec::with_capacity(rows * n * elem);
            for r in 0..rows {
                out.extend_from_slice(&data[r * row + s * elem..r * row + (s + n) * elem]);
            }
            out
        }
    }
}

/// Refuses a cut of a block-scaled FP8 tensor that does not fall on its blocks (a rank's
/// part must be a whole number of blocks, or end at the tensor's end), naming `--tp`.
pub fn check_cut(
    name: &str,
    shape: [usize; 2],
    cut: Cut,
    block: [usize; 2],
    spec: ShardSpec,
) -> Result<()> {
    let (axis, start, len, b, dim) = match cut {
        Cut::Whole => return Ok(()),
        Cut::Rows(s, n) => ("rows", s, n, block[0], shape[0]),
        Cut::Cols(s, n) => ("columns", s, n, block[1], shape[1]),
    };
    let on_blocks = start % b == 0 && (len % b == 0 || start + len == dim);
    if on_blocks {
        return Ok(());
    }
    Err(Error::arg(
        "--tp",
        format!(
            "a shard count whose shards of `{name}` ({shape:?}, FP8 in {block:?} blocks) are whole blocks of {b} {axis}"
        ),
        format!(
            "{}: rank {} would hold {axis} {start}..{} and cut a block",
            spec.world,
            spec.rank,
            start + len
        ),
    ))
}

fn divides(world: usize, n: usize, what: &str) -> Result<()> {
    if n % world != 0 {
        return Err(Error::arg(
            "--tp",
            format!("a divisor of {what} ({n})"),
            world,
        ));
    }
    Ok(())
}

/// Checks that `config` (and, for FP8 block boundaries, `ckpt`) can be split `world` ways:
/// heads, routed experts and the dense / shared-expert intermediate widths divide by it, and
/// no rank's part of an FP8 weight cuts a block. Errors name `--tp`.
pub fn check_tp(c: &ModelConfig, ckpt: Option<&Checkpoint>, world: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::arg("--tp", "at least 1 shard", 0));
    }
    if world == 1 {
        return Ok(());
    }
    divides(world, c.num_attention_heads, "num_attention_heads")?;
    let dense = c.mlp_layer_types.contains(&MlpKind::Dense);
    let moe = c.mlp_layer_types.contains(&MlpKind::Moe);
    if dense {
        divides(world, c.intermediate_size, "intermediate_size")?;
    }
    if moe {
        divides(world, c.n_routed_experts, "n_routed_experts")?;
        if c.n_shared_experts > 0 {
            divides(
                world,
                c.moe_intermediate_size * c.n_shared_experts,
                "the shared experts' width (moe_intermediate_size x n_shared_experts)",
            )?;
        }
    }
    let Some(ckpt) = ckpt else { return Ok(()) };
    for rank in 0..world {
        let spec = ShardSpec { rank, world };
        for (name, cut) in split_tensors(c, spec) {
            let Some(meta) = ckpt.meta(&name) else {
                continue; // check_checkpoint names a missing tensor
            };
            if meta.dtype != Dtype::F8_E4M3 || meta.shape.len() != 2 {
                continue;
            }
            let block = ckpt.fp8_block(&name)?;
            check_cut(&name, [meta.shape[0], meta.shape[1]], cut, block, spec)?;
        }
    }
    Ok(())
}

/// Every checkpoint tensor that is split by rows or columns, with rank `spec`'s cut (the
/// routed experts are split whole and kv_b_proj on the host: neither is listed).
pub fn split_tensors(c: &ModelConfig, spec: ShardSpec) -> Vec<(String, Cut)> {
    let (h0, hn) = spec.part(c.num_attention_heads);
    let mut v = Vec::new();
    for l in 0..c.num_hidden_layers {
        let a = format!("model.layers.{l}.self_attn");
        let qk = c.qk_head_dim();
        v.push((format!("{a}.q_b_proj.weight"), Cut::Rows(h0 * qk, hn * qk)));
        let vd = c.v_head_dim;
        v.push((format!("{a}.o_proj.weight"), Cut::Cols(h0 * vd, hn * vd)));
        let m = format!("model.layers.{l}.mlp");
        let swiglu = |prefix: String, inter: usize, v: &mut Vec<(String, Cut)>| {
            let (i0, n) = spec.part(inter);
            v.push((format!("{prefix}.gate_proj.weight"), Cut::Rows(i0, n)));
            v.push((format!("{prefix}.up_proj.weight"), Cut::Rows(i0, n)));
            v.push((format!("{prefix}.down_proj.weight"), Cut::Cols(i0, n)));
        };
        match c.mlp_layer_types[l] {
            MlpKind::Dense => swiglu(m, c.intermediate_size, &mut v),
            MlpKind::Moe if c.n_shared_experts > 0 => swiglu(
                format!("{m}.shared_experts"),
                c.moe_intermediate_size * c.n_shared_experts,
                &mut v,
            ),
            MlpKind::Moe => {}
        }
    }
    v
}

/// [`split_tensors`] by name: what the loader looks a tensor's cut up in (absent: whole).
pub fn cuts(c: &ModelConfig, spec: ShardSpec) -> std::collections::HashMap<String, Cut> {
    if spec.world <= 1 {
        return Default::default();
    }
    split_tensors(c, spec).into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_cuts_take_each_rows_part() {
        // [2, 4] u8: rows 0..2 of columns 1..3.
        let m = [0u8, 1, 2, 3, 10, 11, 12, 13];
        assert_eq!(
            cut_bytes(&m, 1, [2, 4], Cut::Cols(1, 2)),
            vec![1, 2, 11, 12]
        );
        assert_eq!(
            cut_bytes(&m, 2, [2, 2], Cut::Rows(1, 1)),
            vec![10, 11, 12, 13]
        );
    }

    #[test]
    fn block_cuts_follow_the_grid() {
        assert_eq!(Cut::Rows(256, 128).in_blocks([128, 128]), Cut::Rows(2, 1));
        // The last shard may end inside the last (partial) block.
        assert_eq!(Cut::Cols(128, 72).in_blocks([128, 128]), Cut::Cols(1, 1));
        let spec = ShardSpec { rank: 1, world: 2 };
        assert!(check_cut("w", [256, 200], Cut::Cols(128, 72), [128, 128], spec).is_ok());
        let e = check_cut("w", [448, 32], Cut::Rows(224, 224), [128, 128], spec)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--tp") && e.contains("cut a block"), "{e}");
    }
}
