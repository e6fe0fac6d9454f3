//! The CPU backend: f32 math in plain Rust; sparse MLA through the project's kernel
//! reference ([`crate::reference::sparse_mla::decode`]) and cache rows through
//! [`crate::reference::cache`], so CI runs the model over the same definitions the GPU
//! kernels are checked against.
//!
//! Single-threaded on purpose: the tiny checked-in models take well under a millisecond per
//! layer and token, where spawning threads costs more than it saves.

use super::backend::{
    BlockTableRef, CacheLayout, IndexerCall, MlaCall, Mlp, ModelBackend, Routing,
};
use super::config::RopeStyle;
use super::rope::{rotate, RopeTable};
use crate::mla::{CacheFormat, DecodeShape, MlaDims, ScaleFlavour};
use crate::reference::cache::encode_row;
use crate::reference::numerics::{bf16_bits, bf16_from_bits, round_bf16};
use crate::reference::sparse_mla::{decode, DecodeInputs};
use crate::{Error, Result};

/// `[rows, cols]` f32, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// `[rows, cols]` i32, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuIndex {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<i32>,
}

/// `[num_pages, page_size, row_bytes]` bytes.
pub struct CpuCache {
    pub layout: CacheLayout,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

fn shape_err(arg: &str, expected: impl ToString, actual: impl ToString) -> Error {
    Error::arg(arg, expected, actual)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent partial sums: lets the compiler vectorise, and keeps the rounding
    // close to a BLAS sgemm's.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn check_slot(cache: &CpuCache, slot: i32, arg: &str) -> Result<usize> {
    let n = cache.layout.num_slots();
    if slot < 0 || slot as usize >= n {
        return Err(shape_err(arg, format!("a slot in 0..{n}"), slot));
    }
    Ok(slot as usize)
}

/// The `k` best entries of `(score, id)` pairs: larger score first, ties to the smaller id.
fn top_k_ids(mut scored: Vec<(f32, usize)>, k: usize) -> Vec<usize> {
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    scored.into_iter().take(k).map(|(_, i)| i).collect()
}

impl ModelBackend for CpuBackend {
    type Tensor = CpuTensor;
    type Index = CpuIndex;
    type Cache = CpuCache;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CpuTensor> {
        if data.len() != rows * cols {
            return Err(shape_err(
                "data",
                format!("{rows}×{cols} values"),
                data.len(),
            ));
        }
        Ok(CpuTensor {
            rows,
            cols,
            data: data.to_vec(),
        })
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn upload_index(&self, rows: usize, cols: usize, data: &[i32]) -> Result<CpuIndex> {
        if data.len() != rows * cols {
            return Err(shape_err(
                "index",
                format!("{rows}×{cols} values"),
                data.len(),
            ));
        }
        Ok(CpuIndex {
            rows,
            cols,
            data: data.to_vec(),
        })
    }

    fn download_index(&self, t: &CpuIndex) -> Result<Vec<i32>> {
        Ok(t.data.clone())
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn reshape(&self, t: CpuTensor, rows: usize, cols: usize) -> Result<CpuTensor> {
        if rows * cols != t.rows * t.cols {
            return Err(shape_err(
                "reshape",
                format!("{} values", t.rows * t.cols),
                format!("{rows}×{cols}"),
            ));
        }
        Ok(CpuTensor { rows, cols, ..t })
    }

    fn slice_cols(&self, t: &CpuTensor, start: usize, len: usize) -> Result<CpuTensor> {
        if start + len > t.cols {
            return Err(shape_err(
                "slice_cols",
                format!("columns within {}", t.cols),
                start + len,
            ));
        }
        let mut data = Vec::with_capacity(t.rows * len);
        for r in 0..t.rows {
            data.extend_from_slice(&t.row(r)[start..start + len]);
        }
        Ok(CpuTensor {
            rows: t.rows,
            cols: len,
            data,
        })
    }

    fn slice_rows(&self, t: &CpuTensor, start: usize, len: usize) -> Result<CpuTensor> {
        if start + len > t.rows {
            return Err(shape_err(
                "slice_rows",
                format!("rows within {}", t.rows),
                start + len,
            ));
        }
        Ok(CpuTensor {
            rows: len,
            cols: t.cols,
            data: t.data[start * t.cols..(start + len) * t.cols].to_vec(),
        })
    }

    fn concat_cols(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor> {
        if a.rows != b.rows {
            return Err(shape_err("concat_cols", format!("{} rows", a.rows), b.rows));
        }
        let mut data = Vec::with_capacity(a.rows * (a.cols + b.cols));
        for r in 0..a.rows {
            data.extend_from_slice(a.row(r));
            data.extend_from_slice(b.row(r));
        }
        Ok(CpuTensor {
            rows: a.rows,
            cols: a.cols + b.cols,
            data,
        })
    }

    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        let mut data = Vec::with_capacity(ids.len() * table.cols);
        for &id in ids {
            if id as usize >= table.rows {
                return Err(shape_err(
                    "token id",
                    format!("below the vocabulary size {}", table.rows),
                    id,
                ));
            }
            data.extend_from_slice(table.row(id as usize));
        }
        Ok(CpuTensor {
            rows: ids.len(),
            cols: table.cols,
            data,
        })
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        if x.cols != w.cols {
            return Err(shape_err("linear input width", w.cols, x.cols));
        }
        let mut data = Vec::with_capacity(x.rows * w.rows);
        for r in 0..x.rows {
            let xr = x.row(r);
            data.extend((0..w.rows).map(|o| dot(xr, w.row(o))));
        }
        Ok(CpuTensor {
            rows: x.rows,
            cols: w.rows,
            data,
        })
    }

    fn head_linear(&self, x: &CpuTensor, w: &CpuTensor, heads: usize) -> Result<CpuTensor> {
        if heads == 0 || x.cols % heads != 0 || w.rows % heads != 0 {
            return Err(shape_err("heads", "a divisor of both widths", heads));
        }
        let (k, n) = (x.cols / heads, w.rows / heads);
        if w.cols != k {
            return Err(shape_err("head_linear weight width", k, w.cols));
        }
        let mut data = Vec::with_capacity(x.rows * heads * n);
        for r in 0..x.rows {
            let xr = x.row(r);
            for h in 0..heads {
                let xh = &xr[h * k..(h + 1) * k];
                data.extend((0..n).map(|o| dot(xh, w.row(h * n + o))));
            }
        }
        Ok(CpuTensor {
            rows: x.rows,
            cols: heads * n,
            data,
        })
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        if w.data.len() != x.cols {
            return Err(shape_err("rms_norm weight", x.cols, w.data.len()));
        }
        let mut data = Vec::with_capacity(x.data.len());
        for r in 0..x.rows {
            let xr = x.row(r);
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / x.cols as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            data.extend(xr.iter().zip(&w.data).map(|(v, g)| g * (v * inv)));
        }
        Ok(CpuTensor { data, ..*x })
    }

    fn layer_norm(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        b: &CpuTensor,
        eps: f32,
    ) -> Result<CpuTensor> {
        if w.data.len() != x.cols || b.data.len() != x.cols {
            return Err(shape_err(
                "layer_norm weight / bias",
                x.cols,
                w.data.len().min(b.data.len()),
            ));
        }
        let mut data = Vec::with_capacity(x.data.len());
        for r in 0..x.rows {
            let xr = x.row(r);
            let mean = xr.iter().sum::<f32>() / x.cols as f32;
            let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / x.cols as f32;
            let inv = 1.0 / (var + eps).sqrt();
            data.extend(
                xr.iter()
                    .zip(w.data.iter().zip(&b.data))
                    .map(|(v, (g, bb))| (v - mean) * inv * g + bb),
            );
        }
        Ok(CpuTensor { data, ..*x })
    }

    fn rope(
        &self,
        x: &CpuTensor,
        start: usize,
        positions: &[u32],
        table: &RopeTable,
        style: RopeStyle,
    ) -> Result<CpuTensor> {
        let width = 2 * table.inv_freq.len();
        if start + width > x.cols {
            return Err(shape_err(
                "rope columns",
                format!("within {}", x.cols),
                start + width,
            ));
        }
        if positions.is_empty() || x.rows % positions.len() != 0 {
            return Err(shape_err(
                "positions",
                format!("a divisor of {} rows", x.rows),
                positions.len(),
            ));
        }
        let group = x.rows / positions.len();
        let mut out = x.clone();
        for (g, &pos) in positions.iter().enumerate() {
            let (cos, sin) = table.cos_sin(pos);
            for r in g * group..(g + 1) * group {
                let row = &mut out.data[r * x.cols + start..r * x.cols + start + width];
                rotate(row, &cos, &sin, style);
            }
        }
        Ok(out)
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor> {
        if (a.rows, a.cols) != (b.rows, b.cols) {
            return Err(shape_err(
                "add",
                format!("{}×{}", a.rows, a.cols),
                format!("{}×{}", b.rows, b.cols),
            ));
        }
        let data = a.data.iter().zip(&b.data).map(|(x, y)| x + y).collect();
        Ok(CpuTensor { data, ..*a })
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(shape_err(
                "silu_mul",
                format!("{}×{}", gate.rows, gate.cols),
                format!("{}×{}", up.rows, up.cols),
            ));
        }
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(g, u)| silu(*g) * u)
            .collect();
        Ok(CpuTensor { data, ..*gate })
    }

    fn alloc_cache(&self, layout: CacheLayout) -> Result<CpuCache> {
        Ok(CpuCache {
            layout,
            bytes: vec![0u8; layout.num_slots() * layout.row_bytes],
        })
    }

    fn write_latent_rows(
        &self,
        cache: &mut CpuCache,
        rows: &CpuTensor,
        slots: &[i32],
        format: CacheFormat,
        dims: MlaDims,
        flavour: ScaleFlavour,
    ) -> Result<()> {
        let (latent, d) = (dims.latent as usize, dims.d_qk() as usize);
        let rb = format.row_bytes(dims) as usize;
        if rows.cols != d || rows.rows != slots.len() {
            return Err(shape_err(
                "latent rows",
                format!("{}×{d}", slots.len()),
                format!("{}×{}", rows.rows, rows.cols),
            ));
        }
        if rb != cache.layout.row_bytes {
            return Err(shape_err("cache row bytes", cache.layout.row_bytes, rb));
        }
        for (t, &slot) in slots.iter().enumerate() {
            let s = check_slot(cache, slot, "slots")?;
            let v: Vec<f32> = rows.row(t).iter().map(|&x| round_bf16(x)).collect();
            let row = encode_row(format, dims, &v[..latent], &v[latent..], flavour);
            cache.bytes[s * rb..(s + 1) * rb].copy_from_slice(&row);
        }
        Ok(())
    }

    fn write_index_keys(
        &self,
        cache: &mut CpuCache,
        keys: &CpuTensor,
        slots: &[i32],
    ) -> Result<()> {
        let rb = keys.cols * 2;
        if rb != cache.layout.row_bytes || keys.rows != slots.len() {
            return Err(shape_err(
                "index keys",
                format!(
                    "{}×{} (bf16 rows of {} bytes)",
                    slots.len(),
                    cache.layout.row_bytes / 2,
                    cache.layout.row_bytes
                ),
                format!("{}×{}", keys.rows, keys.cols),
            ));
        }
        for (t, &slot) in slots.iter().enumerate() {
            let s = check_slot(cache, slot, "slots")?;
            for (i, &v) in keys.row(t).iter().enumerate() {
                let o = s * rb + 2 * i;
                cache.bytes[o..o + 2].copy_from_slice(&bf16_bits(v).to_le_bytes());
            }
        }
        Ok(())
    }

    fn indexer_topk(
        &self,
        q: &CpuTensor,
        w: &CpuTensor,
        keys: &CpuCache,
        table: BlockTableRef,
        positions: &[u32],
        call: IndexerCall,
    ) -> Result<CpuIndex> {
        let (t_n, hi, d) = (positions.len(), call.heads, call.head_dim);
        if q.rows != t_n * hi || q.cols != d {
            return Err(shape_err(
                "indexer q",
                format!("{}×{d}", t_n * hi),
                format!("{}×{}", q.rows, q.cols),
            ));
        }
        if w.rows != t_n || w.cols != hi {
            return Err(shape_err(
                "indexer weights",
                format!("{t_n}×{hi}"),
                format!("{}×{}", w.rows, w.cols),
            ));
        }
        if keys.layout.row_bytes != 2 * d {
            return Err(shape_err("indexer key rows", 2 * d, keys.layout.row_bytes));
        }
        let key_of = |pos: u32| -> Result<Vec<f32>> {
            let s = check_slot(keys, table.slot(pos as i32), "indexer key slot")?;
            let row = &keys.bytes[s * 2 * d..(s + 1) * 2 * d];
            Ok(row
                .chunks_exact(2)
                .map(|c| bf16_from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect())
        };
        let max_pos = positions.iter().copied().max().unwrap_or(0);
        let key_rows: Vec<Vec<f32>> = (0..=max_pos).map(key_of).collect::<Result<_>>()?;
        let mut out = vec![-1i32; t_n * call.topk];
        for (t, &p) in positions.iter().enumerate() {
            let qt: Vec<f32> = q.data[t * hi * d..(t + 1) * hi * d]
                .iter()
                .map(|&x| round_bf16(x))
                .collect();
            let wt = w.row(t);
            let scored: Vec<(f32, usize)> = (0..=p as usize)
                .map(|s| {
                    let k = &key_rows[s];
                    let score = (0..hi)
                        .map(|h| {
                            let qk = dot(&qt[h * d..(h + 1) * d], k) * call.softmax_scale;
                            qk.max(0.0) * (wt[h] * call.weight_scale)
                        })
                        .sum::<f32>();
                    (score, s)
                })
                .collect();
            for (j, s) in top_k_ids(scored, call.topk).into_iter().enumerate() {
                out[t * call.topk + j] = s as i32;
            }
        }
        Ok(CpuIndex {
            rows: t_n,
            cols: call.topk,
            data: out,
        })
    }

    fn positions_to_slots(&self, positions: &CpuIndex, table: BlockTableRef) -> Result<CpuIndex> {
        Ok(CpuIndex {
            data: positions.data.iter().map(|&p| table.slot(p)).collect(),
            ..*positions
        })
    }

    fn sparse_mla(
        &self,
        q: &CpuTensor,
        cache: &CpuCache,
        slots: &CpuIndex,
        call: MlaCall,
    ) -> Result<CpuTensor> {
        let d = call.dims.d_qk() as usize;
        if q.cols != call.heads * d || q.rows != slots.rows {
            return Err(shape_err(
                "sparse_mla q",
                format!("{}×{}", slots.rows, call.heads * d),
                format!("{}×{}", q.rows, q.cols),
            ));
        }
        let shape = DecodeShape {
            tokens: q.rows as u32,
            heads: call.heads as u32,
            topk: slots.cols as u32,
            num_pages: cache.layout.num_pages as u32,
            page_size: cache.layout.page_size as u32,
            dims: call.dims,
            format: call.format,
            scale: call.scale,
            has_topk_length: false,
        };
        shape.validate()?;
        if shape.row_bytes() as usize != cache.layout.row_bytes {
            return Err(shape_err(
                "cache row bytes",
                shape.row_bytes(),
                cache.layout.row_bytes,
            ));
        }
        let q_bf16: Vec<f32> = q.data.iter().map(|&x| round_bf16(x)).collect();
        let outputs = decode(&DecodeInputs {
            shape,
            q: &q_bf16,
            cache: &cache.bytes,
            indices: &slots.data,
            topk_length: None,
        });
        // The kernel stores out as bf16.
        let data = outputs.out.iter().map(|&x| round_bf16(x as f32)).collect();
        Ok(CpuTensor {
            rows: q.rows,
            cols: call.heads * call.dims.d_v() as usize,
            data,
        })
    }

    fn moe_route(
        &self,
        logits: &CpuTensor,
        bias: &CpuTensor,
        r: Routing,
    ) -> Result<(CpuIndex, CpuTensor)> {
        let e = logits.cols;
        if bias.data.len() != e {
            return Err(shape_err("routing bias", e, bias.data.len()));
        }
        if r.n_group == 0 || e % r.n_group != 0 || r.top_k > e {
            return Err(shape_err(
                "routing",
                format!("groups dividing {e} experts"),
                r.n_group,
            ));
        }
        let per_group = e / r.n_group;
        let mut ids = Vec::with_capacity(logits.rows * r.top_k);
        let mut weights = Vec::with_capacity(logits.rows * r.top_k);
        for t in 0..logits.rows {
            let scores: Vec<f32> = logits
                .row(t)
                .iter()
                .map(|&x| 1.0 / (1.0 + (-x).exp()))
                .collect();
            let choice: Vec<f32> = scores.iter().zip(&bias.data).map(|(s, b)| s + b).collect();
            let group_scores: Vec<(f32, usize)> = (0..r.n_group)
                .map(|g| {
                    let mut v: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    (v[0] + v.get(1).copied().unwrap_or(0.0), g)
                })
                .collect();
            let groups = top_k_ids(group_scores, r.topk_group);
            let candidates: Vec<(f32, usize)> = (0..e)
                .filter(|i| groups.contains(&(i / per_group)))
                .map(|i| (choice[i], i))
                .collect();
            let chosen = top_k_ids(candidates, r.top_k);
            let mut w: Vec<f32> = chosen.iter().map(|&i| scores[i]).collect();
            if r.norm_topk_prob {
                let sum = w.iter().sum::<f32>() + 1e-20;
                w.iter_mut().for_each(|x| *x /= sum);
            }
            ids.extend(chosen.iter().map(|&i| i as i32));
            weights.extend(w.iter().map(|x| x * r.routed_scaling_factor));
        }
        Ok((
            CpuIndex {
                rows: logits.rows,
                cols: r.top_k,
                data: ids,
            },
            CpuTensor {
                rows: logits.rows,
                cols: r.top_k,
                data: weights,
            },
        ))
    }

    fn moe_experts(
        &self,
        x: &CpuTensor,
        ids: &CpuIndex,
        weights: &CpuTensor,
        experts: &[Mlp<CpuTensor>],
    ) -> Result<CpuTensor> {
        if ids.rows != x.rows || (weights.rows, weights.cols) != (ids.rows, ids.cols) {
            return Err(shape_err(
                "moe ids / weights",
                format!("{} rows", x.rows),
                ids.rows,
            ));
        }
        let mut out = vec![0.0f32; x.rows * x.cols];
        for t in 0..x.rows {
            let xt = self.slice_rows(x, t, 1)?;
            for j in 0..ids.cols {
                let id = ids.data[t * ids.cols + j];
                let expert = usize::try_from(id)
                    .ok()
                    .and_then(|i| experts.get(i))
                    .ok_or_else(|| {
                        shape_err("expert id", format!("below {}", experts.len()), id)
                    })?;
                let h = self.silu_mul(
                    &self.linear(&xt, &expert.gate)?,
                    &self.linear(&xt, &expert.up)?,
                )?;
                let y = self.linear(&h, &expert.down)?;
                let wj = weights.data[t * ids.cols + j];
                for (o, v) in out[t * x.cols..(t + 1) * x.cols].iter_mut().zip(&y.data) {
                    *o += wj * v;
                }
            }
        }
        Ok(CpuTensor {
            rows: x.rows,
            cols: x.cols,
            data: out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_respects_groups_and_bias() {
        let b = CpuBackend;
        // 4 experts in 2 groups; expert 3 has the highest raw score but its group loses.
        let logits = b.upload(1, 4, &[2.0, 1.9, -3.0, 2.5]).unwrap();
        let bias = b.upload(1, 4, &[0.0, 0.0, 0.0, 0.0]).unwrap();
        let r = Routing {
            top_k: 2,
            n_group: 2,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        };
        let (ids, w) = b.moe_route(&logits, &bias, r).unwrap();
        assert_eq!(ids.data, vec![0, 1]);
        assert!((w.data.iter().sum::<f32>() - 2.0).abs() < 1e-6);
        // A bias changes the choice but not the weights' source (the unbiased scores).
        let bias = b.upload(1, 4, &[0.0, 0.0, 10.0, 0.0]).unwrap();
        let (ids, w) = b.moe_route(&logits, &bias, r).unwrap();
        assert_eq!(ids.data, vec![2, 3]);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let expect = s(-3.0) / (s(-3.0) + s(2.5)) * 2.0;
        assert!((w.data[0] - expect).abs() < 1e-6);
    }

    #[test]
    fn indexer_picks_the_best_causal_positions() {
        let b = CpuBackend;
        let d = 4;
        let layout = CacheLayout {
            num_pages: 2,
            page_size: 2,
            row_bytes: 2 * d,
        };
        let mut cache = b.alloc_cache(layout).unwrap();
        // Keys e_0..e_3 scaled: position s has key (s+1)·e_s; the block table swaps the pages.
        let keys: Vec<f32> = (0..4)
            .flat_map(|s| (0..d).map(move |i| if i == s { (s + 1) as f32 } else { 0.0 }))
            .collect();
        let keys = b.upload(4, d, &keys).unwrap();
        let bt = [1, 0];
        let table = BlockTableRef {
            block_table: &bt,
            page_size: 2,
        };
        let slots: Vec<i32> = (0..4).map(|p| table.slot(p)).collect();
        b.write_index_keys(&mut cache, &keys, &slots).unwrap();
        // One head, q = (1, -1, 1, 1): scores relu(1, -2, 3, 4) → ranking 3, 2, 0 (1 is 0).
        let q = b.upload(1, d, &[1.0, -1.0, 1.0, 1.0]).unwrap();
        let w = b.upload(1, 1, &[1.0]).unwrap();
        let call = IndexerCall {
            heads: 1,
            head_dim: d,
            softmax_scale: 1.0,
            weight_scale: 1.0,
            topk: 2,
        };
        let idx = b.indexer_topk(&q, &w, &cache, table, &[3], call).unwrap();
        assert_eq!(idx.data, vec![3, 2]);
        // At position 1 only positions 0 and 1 exist: ties at 0 go to the lower position.
        let idx = b
            .indexer_topk(&q, &w, &cache, table, &[1], IndexerCall { topk: 3, ..call })
            .unwrap();
        assert_eq!(idx.data, vec![0, 1, -1]);
        let phys = b.positions_to_slots(&idx, table).unwrap();
        assert_eq!(phys.data, vec![2, 3, -1]);
    }
}
