//! The operations the GLM-5 / DeepSeek-V3.2 forward pass needs, as one trait. The forward
//! ([`super::forward`]) is written once against it; the CPU backend ([`super::cpu`]) is the
//! first implementation and a CUDA backend implements the same trait with no change to the
//! forward.
//!
//! Conventions every implementation keeps:
//! - a [`ModelBackend::Tensor`] is a row-major `[rows, cols]` matrix of real values (f32
//!   semantics; a backend may store bf16 where its kernels round anyway);
//! - an [`ModelBackend::Index`] is a row-major `[rows, cols]` i32 matrix; −1 marks an unused entry;
//! - a [`ModelBackend::Cache`] is `[num_pages, page_size, row_bytes]` bytes; slot =
//!   page × page_size + offset (DESIGN §3, §4). Rows a sequence has not written are never read;
//! - linear weights have nn.Linear's layout `[out, in]` and compute `y = x · wᵀ`;
//! - shapes are checked at this boundary: a mismatch is an `Error::InvalidArgument` naming
//!   the argument, never a panic.

use super::config::RopeStyle;
use super::rope::RopeTable;
use crate::mla::{CacheFormat, MlaDims, ScaleFlavour};
use crate::Result;

/// Byte layout of one paged cache: `[num_pages, page_size, row_bytes]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    pub num_pages: usize,
    pub page_size: usize,
    pub row_bytes: usize,
}

impl CacheLayout {
    pub fn num_slots(&self) -> usize {
        self.num_pages * self.page_size
    }
}

/// The logical → physical map of one sequence (vLLM's block table, DESIGN §3):
/// `slot(pos) = block_table[pos / page_size] · page_size + pos % page_size`.
#[derive(Clone, Copy, Debug)]
pub struct BlockTableRef<'a> {
    /// `[max_pages]` physical page of each logical page; −1 where none is assigned.
    pub block_table: &'a [i32],
    pub page_size: usize,
}

impl BlockTableRef<'_> {
    /// The physical slot of a logical position; −1 when `pos < 0`, past the table, or the
    /// page is unassigned.
    pub fn slot(&self, pos: i32) -> i32 {
        crate::reference::vbt::slot(self.block_table, self.page_size as u32, pos)
    }
}

/// One sparse MLA attention call (absorbed form, one shared latent KV head).
#[derive(Clone, Copy, Debug)]
pub struct MlaCall {
    pub heads: usize,
    pub dims: MlaDims,
    pub format: CacheFormat,
    /// Softmax scale (config's `softmax_scale`).
    pub scale: f32,
}

/// One lightning-indexer top-k call.
#[derive(Clone, Copy, Debug)]
pub struct IndexerCall {
    pub heads: usize,
    pub head_dim: usize,
    /// `head_dim^-0.5`, applied to each head's dot product before the ReLU.
    pub softmax_scale: f32,
    /// `heads^-0.5`, applied to the head weights.
    pub weight_scale: f32,
    /// Width of each output row (`min(index_topk, positions)`).
    pub topk: usize,
}

/// noaux_tc routing parameters (DeepSeek-V3 / GLM-5).
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

/// A SwiGLU MLP: `down(silu(gate · x) ⊙ (up · x))`.
pub struct Mlp<T> {
    pub gate: T,
    pub up: T,
    pub down: T,
}

pub trait ModelBackend {
    /// A `[rows, cols]` matrix on the device.
    type Tensor;
    /// A `[rows, cols]` i32 matrix on the device.
    type Index;
    /// A paged byte cache on the device.
    type Cache;

    /// For messages and reports ("cpu", "cuda:0").
    fn name(&self) -> String;

    // --- data movement -------------------------------------------------------------------
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    fn upload_index(&self, rows: usize, cols: usize, data: &[i32]) -> Result<Self::Index>;
    fn download_index(&self, t: &Self::Index) -> Result<Vec<i32>>;
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);

    // --- views and copies ----------------------------------------------------------------
    /// Same data, read as `[rows, cols]` (rows × cols must not change).
    fn reshape(&self, t: Self::Tensor, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Columns `start..start + len` of every row.
    fn slice_cols(&self, t: &Self::Tensor, start: usize, len: usize) -> Result<Self::Tensor>;
    /// Rows `start..start + len`.
    fn slice_rows(&self, t: &Self::Tensor, start: usize, len: usize) -> Result<Self::Tensor>;
    /// `[a | b]` row by row.
    fn concat_cols(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;

    // --- dense math ----------------------------------------------------------------------
    /// Rows of `table [vocab, hidden]` picked by `ids`: `[ids.len(), hidden]`.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// `x [T, in] · w [out, in]ᵀ → [T, out]`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor>;
    /// Per-head linear: `x [T, heads·k]`, `w [heads·n, k]` (head h's `[n, k]` block) →
    /// `[T, heads·n]`, head h of the output = `x_h · w_hᵀ`. Absorbs W_UK into q and applies W_UV.
    fn head_linear(&self, x: &Self::Tensor, w: &Self::Tensor, heads: usize)
        -> Result<Self::Tensor>;
    /// `w ⊙ x / sqrt(mean(x²) + eps)` per row, `w [1, cols]`.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// `w ⊙ (x − mean) / sqrt(var + eps) + b` per row.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor>;
    /// RoPE on columns `start..start + table.inv_freq.len() · 2` of every row. `x` holds
    /// `positions.len()` groups of `rows / positions.len()` consecutive rows (one per head);
    /// group g is rotated to `positions[g]`.
    fn rope(
        &self,
        x: &Self::Tensor,
        start: usize,
        positions: &[u32],
        table: &RopeTable,
        style: RopeStyle,
    ) -> Result<Self::Tensor>;
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// `silu(gate) ⊙ up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;

    // --- caches --------------------------------------------------------------------------
    fn alloc_cache(&self, layout: CacheLayout) -> Result<Self::Cache>;
    /// Encodes `rows [T, latent + rope]` (DESIGN §4, values rounded to bf16 first) into the
    /// cache at `slots [T]`.
    fn write_latent_rows(
        &self,
        cache: &mut Self::Cache,
        rows: &Self::Tensor,
        slots: &[i32],
        format: CacheFormat,
        dims: MlaDims,
        flavour: ScaleFlavour,
    ) -> Result<()>;
    /// Stores indexer keys `keys [T, head_dim]` as bf16 rows at `slots [T]`.
    fn write_index_keys(
        &self,
        cache: &mut Self::Cache,
        keys: &Self::Tensor,
        slots: &[i32],
    ) -> Result<()>;

    // --- sparse attention ----------------------------------------------------------------
    /// Lightning indexer: for query t (at `positions[t]`) and every earlier-or-equal position s,
    /// `I[t, s] = Σ_h w[t, h]·weight_scale · relu(softmax_scale · q[t, h, :] · k_s)` with q and
    /// k in bf16; returns `[T, call.topk]` logical positions of the largest scores (ties to the
    /// lower position), −1 padded when fewer positions exist. `q [T·heads, head_dim]`,
    /// `w [T, heads]`; keys of position s are read at `table.slot(s)`.
    fn indexer_topk(
        &self,
        q: &Self::Tensor,
        w: &Self::Tensor,
        keys: &Self::Cache,
        table: BlockTableRef,
        positions: &[u32],
        call: IndexerCall,
    ) -> Result<Self::Index>;
    /// Logical positions → physical slots through the block table (−1 stays −1).
    fn positions_to_slots(
        &self,
        positions: &Self::Index,
        table: BlockTableRef,
    ) -> Result<Self::Index>;
    /// Sparse MLA decode (DESIGN §3) of `q [T, heads·(latent + rope)]` over `slots [T, K]` of
    /// `cache`: returns `out [T, heads·latent]`. Goes through the project's kernel (or its
    /// reference), so q and out are bf16 values.
    fn sparse_mla(
        &self,
        q: &Self::Tensor,
        cache: &Self::Cache,
        slots: &Self::Index,
        call: MlaCall,
    ) -> Result<Self::Tensor>;

    // --- mixture of experts --------------------------------------------------------------
    /// noaux_tc routing of `logits [T, experts]` (f32) with `bias [1, experts]`: sigmoid scores;
    /// groups ranked by the sum of their top-2 biased scores, the best `topk_group` kept;
    /// the `top_k` best biased scores among them chosen; weights = unbiased scores of the
    /// chosen, normalised if `norm_topk_prob`, × `routed_scaling_factor`.
    /// Returns (`ids [T, top_k]`, `weights [T, top_k]`).
    fn moe_route(
        &self,
        logits: &Self::Tensor,
        bias: &Self::Tensor,
        routing: Routing,
    ) -> Result<(Self::Index, Self::Tensor)>;
    /// `Σ_j weights[t, j] · expert_{ids[t, j]}(x_t)` for every token.
    fn moe_experts(
        &self,
        x: &Self::Tensor,
        ids: &Self::Index,
        weights: &Self::Tensor,
        experts: &[Mlp<Self::Tensor>],
    ) -> Result<Self::Tensor>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_table_slots_follow_vllm() {
        let bt = [3, -1, 0];
        let t = BlockTableRef {
            block_table: &bt,
            page_size: 4,
        };
        assert_eq!(t.slot(0), 12);
        assert_eq!(t.slot(3), 15);
        assert_eq!(t.slot(4), -1, "unassigned page");
        assert_eq!(t.slot(9), 1);
        assert_eq!(t.slot(12), -1, "past the table");
        assert_eq!(t.slot(-1), -1);
    }
}
