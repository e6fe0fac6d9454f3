//! mla-bench: sparse MLA decode on the CUDA GPU, against the roofline (docs/performance.md), the scalar
//! lowering and a PyTorch peer, every timed row next to its correctness check on the same
//! inputs.

use clap::Parser;
use cudarc::driver::{result as drv, sys as drv_sys, CudaEvent, CudaSlice};
use sparse_mla::kernels::sparse_mla_decode::{
    launches, DecodeConfig, DecodePlan, Fp8Values, MergePolicy,
};
use sparse_mla::kernels::{pack_params, Launch, ParamValue};
use sparse_mla::kir::builder::*;
use sparse_mla::kir::ir::{Access, Elem, Kernel, Ty};
use sparse_mla::kir::{Lowering, RowSoftmax};
use sparse_mla::mla::{CacheFormat, DecodeLayout, DecodeShape, MlaDims};
use sparse_mla::reference::numerics::{bf16_bits, bf16_from_bits};
use sparse_mla::reference::sparse_mla::{decode as reference_decode, DecodeInputs};
use sparse_mla::runtime::cuda::CudaDevice;
use sparse_mla::runtime::gpu::Device;
use sparse_mla::util::{rel_l2, Rng};
use sparse_mla::{Error, Result};
use std::collections::HashMap;
use std::process::ExitCode;

/// Time sparse MLA decode (topk 2048, page 64) over a cache of random rows at random distinct
/// slots (≥ 2 GiB), with CUDA events around each call, L2 flushed before each, input sets
/// rotated; report the median against the roofline of this GPU (its device-to-device copy
/// bandwidth, measured at start, and its bf16 mma.sync peak from a table of parts: 645
/// TFLOP/s on an H200), beside the scalar lowering and a PyTorch peer (tools/peer_bench.py)
/// on the same shapes.
/// The first timed column is the kernel the CUDA backend runs for the call (v6, v7 or the
/// large-batch kernel, `DecodeConfig::for_call_from_env`: the backend's switches
/// SPARSE_MLA_DECODE_KERNEL, SPARSE_MLA_ROW_SOFTMAX and SPARSE_MLA_FP8_VALUES apply, and
/// the label names the forms taken, e.g. `v7 r`); with
/// --sm120-occupancy also the one it runs on an SM120 GPU of the same SM count, timed at
/// SM120's occupancy. The v7 column (csv: `kernel`, timed first) takes the forms of
/// SPARSE_MLA_ROW_SOFTMAX and SPARSE_MLA_FP8_VALUES too.
/// Each row carries a check of that run's output against the float64 reference (a few
/// tokens, all heads).
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Head counts.
    #[arg(long, value_delimiter = ',', default_value = "8,16,64,128")]
    heads: Vec<u32>,
    /// Token counts (batch x s_q).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    tokens: Vec<u32>,
    /// Cache formats: bf16, fp8_ds_mla.
    #[arg(long, value_delimiter = ',', default_value = "bf16,fp8_ds_mla")]
    cache: Vec<String>,
    #[arg(long, default_value_t = 2048)]
    topk: u32,
    /// Timed repetitions per row (median reported).
    #[arg(long, default_value_t = 50)]
    reps: usize,
    /// Untimed runs before timing.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Cache size in GiB per format (random slots are drawn over all of it).
    #[arg(long, default_value_t = 2.25)]
    cache_gib: f64,
    /// Tokens checked against the float64 reference per row.
    #[arg(long, default_value_t = 2)]
    check_tokens: u32,
    /// Also time the scalar lowering.
    #[arg(long)]
    scalar: bool,
    /// Skip the v6 kernel (the baseline timed beside the current one).
    #[arg(long)]
    no_baseline: bool,
    /// Also time every kernel with the shared-memory carve-out at 44 % (100 KB per SM on an
    /// H200: SM120's budget, one 99 KB workgroup per multiprocessor), its splits planned for
    /// that residency as the backend would on an SM120 GPU (csv / json: splits_sm120).
    #[arg(long)]
    sm120_occupancy: bool,
    /// Skip the PyTorch peer.
    #[arg(long)]
    no_peer: bool,
    /// Time the split kernel and the combine as two launches even where the backend merges
    /// them into one cooperative launch (v6 and v7 calls with several splits where the merge
    /// pays and the grid fits the GPU at once; `SPARSE_MLA_MERGE=0` does the same in the
    /// backend, and `SPARSE_MLA_MERGE=all` merges every call the form can run, where it pays
    /// or not).
    /// Timed rows of the merged form say `merged` after the kernel.
    #[arg(long)]
    no_merge: bool,
    /// The peer script.
    #[arg(long, default_value = "tools/peer_bench.py")]
    peer: String,
    /// Force the split count of the tensor-core rows (default: the cost model).
    #[arg(long)]
    splits: Option<u32>,
    /// Time these split counts for every row instead, of the kernel the backend runs for the
    /// row on this GPU (v6, v7 or the large-batch kernel), e.g. 1,2,4,8.
    #[arg(long, value_delimiter = ',')]
    sweep_splits: Vec<u32>,
    /// Also time these variants: of the current kernel (v7) as BLOCK_H x BLOCK_N x STAGES,
    /// optionally wWARPS (8 unless given) and gGROUPS (warp groups of WARPS warps each, see
    /// `Lowering::MmaWs`, dealing out the steps) or hGROUPS (warp groups of WARPS warps each
    /// splitting the BLOCK_H heads over one shared ring, `GroupBy::Heads`) and pAHEAD (the
    /// producers ask L2 for the rows AHEAD steps past the ring's copies), then r or f (the
    /// scores held in rows or in fragments for the softmax; else fragments, but rows for
    /// bf16 head groups), then v (fp8_ds_mla's values for P . V decoded once a step into a
    /// shared bf16 tile, `Fp8Values::Shared`; bf16 ignores it); of the baseline (v6) as
    /// v6:BLOCK_H x BLOCK_N x STAGES x MIN_WORKGROUPS (the occupancy hint), e.g.
    /// 16x16x4,16x32x2w16,16x32x1w4g2p2,64x32x2w2h4,64x32x2w2h4r,64x32x2w2h4rv,v6:16x16x2x2,
    /// v6:16x32x2x2p1. bf16's wide-call kernel is 64x32x2w2h4.
    #[arg(long, value_delimiter = ',')]
    variants: Vec<String>,
    /// Output: table (comfy-table), json (one object per row), csv.
    #[arg(long, default_value = "table")]
    format: String,
}

/// The bf16 `mma.sync` m16n8k16 peak (f32 accumulate) by GPU name: what the kernels' FLOP
/// roofline is (they use no wgmma / tcgen05). H200: measured (docs/hardware.md); the H100
/// SXM (named "H100 80GB HBM3"): the H200's, the same 132 SMs at the same clocks; SM120 parts:
/// datasheet dense FP16/BF16 tensor rates with f32 accumulate, unmeasured.
const MMA_PEAKS: &[(&str, f64, &str)] = &[
    ("H200", 645e12, "measured"),
    ("H100 80GB HBM3", 645e12, "the H200's: same SMs and clocks"),
    ("RTX PRO 6000", 500e12, "datasheet"),
    ("RTX 5090", 209e12, "datasheet"),
];
const PAGE: u32 = 64;
/// Words of junk written before each timed call so the cache rows are not in L2 (60 MB).
const FLUSH_BYTES: usize = 256 << 20;
/// Input sets (q, indices) rotated between repetitions.
const SETS: usize = 4;

/// docs/performance.md: best peer on the H200 (bf16, topk 2048), µs.
fn design_best_peer(h: u32, t: u32) -> Option<f64> {
    match (h, t) {
        (8, 1) => Some(23.1),
        (8, 32) => Some(45.2),
        (8, 128) => Some(127.9),
        (16, 128) => Some(131.6),
        (64, 32) => Some(120.7),
        (64, 128) => Some(428.1),
        (128, 8) => Some(65.5),
        (128, 32) => Some(213.8),
        (128, 128) => Some(838.1),
        _ => None,
    }
}

fn main() -> ExitCode {
    env_logger::init();
    let args = Args::parse();
    if !matches!(args.format.as_str(), "table" | "json" | "csv") {
        eprintln!(
            "mla-bench: --format must be table, json or csv, not {}",
            args.format
        );
        return ExitCode::from(2);
    }
    // before any cudarc call: without a driver cudarc would panic on first use
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("mla-bench: no CUDA driver (libcuda.so) on this machine: it needs an NVIDIA GPU");
        return ExitCode::from(2);
    }
    if let Some(why) = sparse_mla::runtime::cuda::nvrtc_unavailable() {
        eprintln!("mla-bench: {why}");
        return ExitCode::from(2);
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mla-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------- random cache rows

/// lowbias32: a stateless 32-bit hash, the same on the GPU (fill kernel) and the host (check).
fn hash_host(x: u32) -> u32 {
    let mut x = x;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

fn hash_expr(b: &mut KernelBuilder, x: sparse_mla::kir::ir::Expr) -> sparse_mla::kir::ir::Expr {
    let x = b.let_("h", x.clone() ^ (x >> u(16)));
    let x = b.let_("h", x * u(0x7feb_352d));
    let x = b.let_("h", x.clone() ^ (x >> u(15)));
    let x = b.let_("h", x * u(0x846c_a68b));
    b.let_("h", x.clone() ^ (x >> u(16)))
}

/// Uniform in [-1, 1), exact in f32 (so bf16 rounding agrees on host and GPU).
fn unit_host(h: u32) -> f32 {
    f32::from_bits(0x3F80_0000 | (h >> 9)) * 2.0 - 3.0
}

/// An e4m3fn byte with exponent field 4..=11 (magnitudes 2^-3 .. 30): never NaN.
fn e4m3_byte_host(h: u32) -> u32 {
    (h & 0x87) | ((4 + ((h >> 3) & 7)) << 3)
}

/// Word `i` of the cache (all rows packed) as the fill kernel writes it.
fn cache_word_host(format: CacheFormat, seed: u32, i: u32) -> u32 {
    let pair = |i: u32| {
        let lo = bf16_bits(unit_host(hash_host((2 * i) ^ seed))) as u32;
        let hi = bf16_bits(unit_host(hash_host((2 * i + 1) ^ seed))) as u32;
        lo | (hi << 16)
    };
    match format {
        CacheFormat::Bf16 => pair(i),
        CacheFormat::Fp8DsMla => {
            let w = i % 164;
            if w < 128 {
                (0..4)
                    .map(|k| e4m3_byte_host(hash_host((4 * i + k) ^ seed)) << (8 * k))
                    .fold(0, |a, b| a | b)
            } else if w < 132 {
                // scale in [1/16, 1/8)
                (f32::from_bits(0x3F80_0000 | (hash_host(i ^ seed) >> 9)) * 0.0625).to_bits()
            } else {
                pair(i)
            }
        }
    }
}

/// The kir kernel that fills a cache buffer with [`cache_word_host`]'s words.
fn fill_kernel(format: CacheFormat) -> Result<Kernel> {
    let mut b = KernelBuilder::new(format!("bench_fill_cache_{}", format.name()), 256);
    b.doc(
        "Benchmark input: cache words from a stateless hash (mla-bench checks them on the host).",
    );
    let n = b.param("n_words", Ty::U32, "words to write");
    let seed = b.param("seed", Ty::U32, "hash seed");
    let cache = b.buffer("cache", Elem::U32, Access::ReadWrite, "[n_words]");
    let start = b.let_("start", workgroup_id(0) * u(256) + local_id());
    let stride = b.let_("stride", num_workgroups(0) * u(256));
    b.for_("i", start, n, stride, |b, i| {
        let unit = |b: &mut KernelBuilder, k: sparse_mla::kir::ir::Expr| {
            let h = hash_expr(b, k ^ seed.clone());
            f32_from_bits(u(0x3F80_0000) | (h >> u(9))) * f(2.0) - f(3.0)
        };
        let pair = |b: &mut KernelBuilder| {
            let lo = unit(b, u(2) * i.clone());
            let lo = b.let_("lo", lo);
            let hi = unit(b, u(2) * i.clone() + u(1));
            let hi = b.let_("hi", hi);
            pack_bf16x2(lo, hi)
        };
        match format {
            CacheFormat::Bf16 => {
                let w = pair(b);
                b.store(&cache, i.clone(), w);
            }
            CacheFormat::Fp8DsMla => {
                let w = b.let_("w", i.clone() % u(164));
                b.if_else(
                    w.clone().lt(u(128)),
                    |b| {
                        let word = b.var("word", u(0));
                        for k in 0..4 {
                            let h = hash_expr(b, (u(4) * i.clone() + u(k)) ^ seed.clone());
                            let byte =
                                (h.clone() & u(0x87)) | ((u(4) + ((h >> u(3)) & u(7))) << u(3));
                            b.set(&word, word.clone() | (byte << u(8 * k)));
                        }
                        b.store(&cache, i.clone(), word);
                    },
                    |b| {
                        b.if_else(
                            w.lt(u(132)),
                            |b| {
                                let h = hash_expr(b, i.clone() ^ seed.clone());
                                let s = f32_from_bits(u(0x3F80_0000) | (h >> u(9))) * f(0.0625);
                                b.store(&cache, i.clone(), f32_bits(s));
                            },
                            |b| {
                                let w = pair(b);
                                b.store(&cache, i.clone(), w);
                            },
                        );
                    },
                );
            }
        }
    });
    let k = b.finish()?;
    sparse_mla::kir::lower(&k, Lowering::Scalar)
}

// ---------------------------------------------------------------- GPU plumbing

struct Gpu {
    dev: CudaDevice,
    modules: HashMap<String, sparse_mla::runtime::cuda::CudaModule>,
}

impl Gpu {
    /// Compile (once) and set the kernel's shared-memory carve-out (percent; -1 default).
    fn prepare(&mut self, l: &Launch, carveout: i32) -> Result<()> {
        if !self.modules.contains_key(&l.kernel.name) {
            let m = self.dev.compile(&l.kernel)?;
            self.modules.insert(l.kernel.name.clone(), m);
        }
        self.dev
            .set_shared_carveout(&self.modules[&l.kernel.name], carveout)
    }

    fn run(&mut self, l: &Launch, named: &[(&str, &CudaSlice<u8>)]) -> Result<()> {
        if !self.modules.contains_key(&l.kernel.name) {
            let m = self.dev.compile(&l.kernel)?;
            self.modules.insert(l.kernel.name.clone(), m);
        }
        let module = &self.modules[&l.kernel.name];
        let mut bufs = Vec::new();
        for decl in &l.kernel.buffers {
            let b = named
                .iter()
                .find(|(n, _)| *n == decl.name)
                .map(|(_, b)| *b)
                .ok_or_else(|| Error::runtime("bench", format!("no buffer `{}`", decl.name)))?;
            bufs.push(b);
        }
        self.dev.launch(module, &l.kernel, l.grid, &l.params, &bufs)
    }

    fn event(&self) -> Result<CudaEvent> {
        self.dev
            .context()
            .new_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| Error::runtime("bench", format!("event: {e:?}")))
    }

    fn flush(&self, buf: &CudaSlice<u8>, value: u8) -> Result<()> {
        use cudarc::driver::DevicePtr;
        let stream = self.dev.stream();
        let (ptr, _g) = buf.device_ptr(stream);
        unsafe { drv::memset_d8_async(ptr, value, FLUSH_BYTES, stream.cu_stream()) }
            .map_err(|e| Error::runtime("bench", format!("memset: {e:?}")))
    }
}

fn bytes_of_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

struct Inputs {
    q: Vec<CudaSlice<u8>>,
    indices: Vec<CudaSlice<u8>>,
    /// Set 0 on the host, for the check.
    q0: Vec<f32>,
    idx0: Vec<i32>,
}

struct Timing {
    median_us: f64,
    splits: u32,
    /// Tokens run whole before the split ones ([`DecodePlan::whole_tokens`]).
    whole: u32,
    /// One launch of the kernel that merges its own partials.
    merged: bool,
    check: Check,
}

#[derive(Clone, Copy)]
struct Check {
    rel_l2: f64,
    lse_err: f64,
    ok: bool,
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:.1e}/{:.0e}",
            if self.ok { "ok" } else { "FAIL" },
            self.rel_l2,
            self.lse_err
        )
    }
}

/// The reference of set 0 for the checked tokens: (tokens, out, lse).
struct Reference {
    tokens: Vec<u32>,
    out: Vec<f64>,
    lse: Vec<f64>,
}

fn reference(
    shape: &DecodeShape,
    seed: u32,
    inputs: &Inputs,
    check_tokens: u32,
) -> Result<Reference> {
    let t_n = shape.tokens;
    let mut tokens: Vec<u32> = (0..check_tokens.min(t_n))
        .map(|i| {
            if i == 0 {
                0
            } else {
                (t_n - 1) * i / (check_tokens - 1).max(1)
            }
        })
        .collect();
    tokens.dedup();
    let (h_n, k_n, d) = (
        shape.heads as usize,
        shape.topk as usize,
        shape.dims.d_qk() as usize,
    );
    let row_words = shape.row_bytes() / 4;
    let results: Vec<(Vec<f64>, Vec<f64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = tokens
            .iter()
            .map(|&t| {
                s.spawn(move || {
                    // a one-token problem over a compact cache of this token's rows
                    let mut cache = Vec::with_capacity(k_n * row_words as usize * 4);
                    let mut idx = Vec::with_capacity(k_n);
                    for j in 0..k_n {
                        let slot = inputs.idx0[t as usize * k_n + j] as u32;
                        for w in 0..row_words {
                            cache.extend_from_slice(
                                &cache_word_host(shape.format, seed, slot * row_words + w)
                                    .to_le_bytes(),
                            );
                        }
                        idx.push(j as i32);
                    }
                    let q = &inputs.q0[t as usize * h_n * d..(t as usize + 1) * h_n * d];
                    let one = DecodeShape {
                        tokens: 1,
                        num_pages: (k_n as u32).div_ceil(PAGE),
                        page_size: PAGE,
                        ..*shape
                    };
                    cache.resize(one.cache_bytes() as usize, 0);
                    let r = reference_decode(&DecodeInputs {
                        shape: one,
                        q,
                        cache: &cache,
                        indices: &idx,
                        topk_length: None,
                    });
                    (r.out, r.lse)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for (o, l) in results {
        out.extend(o);
        lse.extend(l);
    }
    Ok(Reference { tokens, out, lse })
}

fn check(shape: &DecodeShape, r: &Reference, out_bytes: &[u8], lse_bytes: &[u8]) -> Check {
    let (h_n, dv) = (shape.heads as usize, shape.dims.d_v() as usize);
    let mut got = Vec::new();
    let mut lse_err = 0.0f64;
    let mut nan = false;
    for (ci, &t) in r.tokens.iter().enumerate() {
        let t = t as usize;
        for v in out_bytes[t * h_n * dv * 2..(t + 1) * h_n * dv * 2].chunks_exact(2) {
            let x = bf16_from_bits(u16::from_le_bytes([v[0], v[1]])) as f64;
            nan |= x.is_nan();
            got.push(x);
        }
        for h in 0..h_n {
            let b = &lse_bytes[(t * h_n + h) * 4..(t * h_n + h + 1) * 4];
            let l = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64;
            let e = (l - r.lse[ci * h_n + h]).abs();
            if e.is_nan() {
                nan = true;
            } else {
                lse_err = lse_err.max(e);
            }
        }
    }
    let rel = rel_l2(&got, &r.out);
    Check {
        rel_l2: rel,
        lse_err,
        ok: !nan && rel <= 1e-2 && lse_err <= 1e-3,
    }
}

struct Bench<'a> {
    args: &'a Args,
    gpu: Gpu,
    flush: CudaSlice<u8>,
    /// The merged kernel's meeting counters: 2 words per token, zeroed once.
    sync: CudaSlice<u8>,
}

struct Row<'a> {
    shape: DecodeShape,
    cache: &'a CudaSlice<u8>,
    inputs: &'a Inputs,
    out: &'a CudaSlice<u8>,
    lse: &'a CudaSlice<u8>,
    o_part: &'a CudaSlice<u8>,
    lse_part: &'a CudaSlice<u8>,
    dummy_len: &'a CudaSlice<u8>,
    reference: &'a Reference,
}

impl Bench<'_> {
    fn time(&mut self, row: &Row, plan: &DecodePlan, carveout: i32) -> Result<Timing> {
        let shape = &row.shape;
        let ls = launches(shape, &DecodeLayout::default(), plan)?;
        for l in &ls {
            self.gpu.prepare(l, carveout)?;
        }
        let named = |set: usize| -> Vec<(&str, &CudaSlice<u8>)> {
            vec![
                ("q", &row.inputs.q[set]),
                ("kv_cache", row.cache),
                ("indices", &row.inputs.indices[set]),
                ("topk_length", row.dummy_len),
                ("out", row.out),
                ("lse", row.lse),
                ("o_part", row.o_part),
                ("lse_part", row.lse_part),
                ("sync", &self.sync),
            ]
        };
        for w in 0..self.args.warmup {
            for l in &ls {
                self.gpu.run(l, &named(w % SETS))?;
            }
        }
        let reps = self.args.reps;
        let mut events = Vec::with_capacity(reps);
        for r in 0..reps {
            self.gpu.flush(&self.flush, (r % 251) as u8)?;
            let (a, b) = (self.gpu.event()?, self.gpu.event()?);
            a.record(self.gpu.dev.stream())
                .map_err(|e| Error::runtime("bench", format!("{e:?}")))?;
            for l in &ls {
                self.gpu.run(l, &named(r % SETS))?;
            }
            b.record(self.gpu.dev.stream())
                .map_err(|e| Error::runtime("bench", format!("{e:?}")))?;
            events.push((a, b));
        }
        self.gpu.dev.synchronize()?;
        let mut us: Vec<f64> = events
            .iter()
            .map(|(a, b)| a.elapsed_ms(b).map(|ms| ms as f64 * 1e3))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::runtime("bench", format!("elapsed: {e:?}")))?;
        us.sort_by(|a, b| a.total_cmp(b));
        // the check: poisoned outputs, set 0, same plan
        self.gpu
            .dev
            .write(row.out, &vec![0xFF; shape.out_elems() as usize * 2])?;
        self.gpu.dev.write(
            row.lse,
            &vec![0xFF; (shape.tokens * shape.heads) as usize * 4],
        )?;
        for l in &ls {
            self.gpu.run(l, &named(0))?;
        }
        let out = self.gpu.dev.read(row.out, shape.out_elems() * 2)?;
        let lse = self
            .gpu
            .dev
            .read(row.lse, (shape.tokens * shape.heads) as u64 * 4)?;
        Ok(Timing {
            median_us: us[us.len() / 2],
            splits: plan.splits,
            whole: plan.whole_tokens,
            merged: plan.runs_merged(),
            check: check(shape, row.reference, &out, &lse),
        })
    }
}

/// The form of a variant, for [`parse_variant`]'s errors.
const VARIANT_FORM: &str = "BLOCK_HxBLOCK_NxSTAGES[wWARPS][gGROUPS|hGROUPS][pAHEAD][r|f][v] (v7; 8 warps unless given; with gGROUPS (groups dealing out the steps) or hGROUPS (groups splitting the BLOCK_H heads over one ring), WARPS per group, 8 in all unless given; pAHEAD, 1-8: L2 asked for the rows AHEAD steps past the copies; r / f: the scores held in rows / fragments, else the form's own; v: fp8_ds_mla's P . V values decoded once a step into a shared bf16 tile, not widened by each warp (bf16 ignores it)) or v6:BLOCK_HxBLOCK_NxSTAGESxMIN_WORKGROUPS[pAHEAD], e.g. 16x16x4, 16x32x2w16, 16x32x1w4g2, 32x32x2w4h2, 64x16x2w2h4r, 64x32x2w2h4rv, 16x32x2p2, v6:16x16x2x2, v6:16x32x2x2p1";

/// A variant: `BLOCK_H x BLOCK_N x STAGES` of the current kernel (v7), or
/// `v6:BLOCK_H x BLOCK_N x STAGES x MIN_WORKGROUPS` of the baseline (its occupancy hint).
fn parse_variant(s: &str, dims: MlaDims, format: CacheFormat) -> Result<DecodeConfig> {
    let (v6, body) = match s.strip_prefix("v6:") {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    // v: fp8_ds_mla's values for P . V decoded once a step into shared memory
    let (body, values) = match (v6, body.strip_suffix('v')) {
        (false, Some(b)) => (b, Fp8Values::Shared),
        _ => (body, Fp8Values::PerWarp),
    };
    // r / f: the scores held in rows / in fragments for the softmax
    let (body, scores) = match (v6, body.strip_suffix('r'), body.strip_suffix('f')) {
        (false, Some(b), _) => (b, Some(RowSoftmax::Rows)),
        (false, _, Some(b)) => (b, Some(RowSoftmax::Off)),
        _ => (body, None),
    };
    let config = parse_variant_blocks(v6, body, s, dims, format)?;
    Ok(match scores {
        Some(form) => config.with_row_softmax(form),
        None => config,
    }
    .with_fp8_values(values))
}

/// [`parse_variant`] past its prefix and suffix.
fn parse_variant_blocks(
    v6: bool,
    body: &str,
    s: &str,
    dims: MlaDims,
    format: CacheFormat,
) -> Result<DecodeConfig> {
    let err = || Error::arg("variants", VARIANT_FORM, s);
    // pL2_AHEAD: the producers ask L2 for the rows that many steps past the copies
    let (body, l2_ahead) = match body.split_once('p') {
        Some((b, p)) => (
            b,
            p.parse::<u32>()
                .ok()
                .filter(|p| (1..=8).contains(p))
                .ok_or_else(err)?,
        ),
        _ => (body, 0),
    };
    // gGROUPS: warp groups that deal out the steps; hGROUPS: that split the heads
    let (body, groups, heads) = match body
        .split_once('g')
        .map(|x| (x, false))
        .or_else(|| body.split_once('h').map(|x| (x, true)))
    {
        Some(((b, g), heads)) if !v6 => (
            b,
            g.parse::<u32>()
                .ok()
                .filter(|g| (2..=8).contains(g))
                .ok_or_else(err)?,
            heads,
        ),
        _ => (body, 1, false),
    };
    let (body, warps) = match body.split_once('w') {
        Some((b, w)) if !v6 => (
            b,
            w.parse::<u32>()
                .ok()
                .filter(|w| (1..=32).contains(w))
                .ok_or_else(err)?,
        ),
        _ => (body, 8 / groups),
    };
    let v: Vec<u32> = body
        .split('x')
        .map(|p| p.parse::<u32>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| err())?;
    match (v6, v.as_slice()) {
        (false, &[h, _, _]) if heads && (h % groups != 0 || (h / groups) % 16 != 0) => {
            Err(Error::arg(
                "variants",
                "BLOCK_H a multiple of 16 x GROUPS with hGROUPS (16 heads a group at least: an mma tile's rows)",
                s,
            ))
        }
        (false, &[h, n, stages]) if heads => Ok(DecodeConfig::tensor_core_heads(
            dims,
            format,
            (h, n, stages),
            warps,
            groups,
        )
        .with_l2_ahead(l2_ahead)),
        (false, &[h, n, stages]) if groups > 1 => {
            Ok(
                DecodeConfig::tensor_core_grouped(dims, format, (h, n, stages), warps, groups)
                    .with_l2_ahead(l2_ahead),
            )
        }
        (false, &[h, n, stages]) => {
            let mut c = DecodeConfig::tensor_core_custom(dims, format, h, n, stages)
                .with_l2_ahead(l2_ahead);
            c.threads = 32 * warps;
            Ok(c)
        }
        (true, &[h, n, stages, min_workgroups]) => {
            let mut c = DecodeConfig::tensor_core_v6(dims, format, h);
            c.block_h = h;
            c.block_n = n;
            c.lowering = Lowering::Mma {
                stages,
                min_workgroups,
                l2_ahead,
            };
            Ok(c)
        }
        _ => Err(err()),
    }
}

struct PeerRow {
    us: f64,
    eager_us: f64,
    rel: f64,
}

fn run_peer(args: &Args, format: CacheFormat) -> HashMap<(u32, u32), PeerRow> {
    let mut out = HashMap::new();
    if args.no_peer {
        return out;
    }
    let shapes: Vec<String> = args
        .heads
        .iter()
        .flat_map(|h| args.tokens.iter().map(move |t| format!("{h}x{t}")))
        .collect();
    let res = std::process::Command::new("python3")
        .env("PYTHONUNBUFFERED", "1")
        .arg(&args.peer)
        .args(["--shapes", &shapes.join(",")])
        .args(["--cache", format.name()])
        .args(["--reps", &args.reps.to_string()])
        .args(["--topk", &args.topk.to_string()])
        .args(["--cache-gib", &args.cache_gib.to_string()])
        .output();
    match res {
        Ok(o) => {
            for line in String::from_utf8_lossy(&o.stdout).lines() {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue;
                };
                let (Some(h), Some(t), Some(us)) =
                    (v["H"].as_u64(), v["T"].as_u64(), v["us"].as_f64())
                else {
                    continue;
                };
                let rel = v["rel_l2"].as_f64().unwrap_or(f64::NAN);
                let eager_us = v["eager_us"].as_f64().unwrap_or(f64::NAN);
                out.insert((h as u32, t as u32), PeerRow { us, eager_us, rel });
            }
            if !o.status.success() {
                eprintln!(
                    "peer ({}) failed: {}",
                    args.peer,
                    String::from_utf8_lossy(&o.stderr)
                        .lines()
                        .last()
                        .unwrap_or("")
                );
            }
        }
        Err(e) => eprintln!("peer: cannot run python3 {}: {e}", args.peer),
    }
    out
}

/// Device-to-device copy bandwidth (bytes read + written per second), best of 5 copies of
/// 1 GiB: the memory roof of this GPU as measured, not as the datasheet says.
fn copy_bandwidth(gpu: &Gpu) -> Result<f64> {
    use cudarc::driver::DevicePtr;
    const BYTES: usize = 1 << 30;
    let a = gpu.dev.alloc(BYTES as u64)?;
    let b = gpu.dev.alloc(BYTES as u64)?;
    let stream = gpu.dev.stream();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let (e0, e1) = (gpu.event()?, gpu.event()?);
        e0.record(stream)
            .map_err(|e| Error::runtime("bench", format!("{e:?}")))?;
        {
            let (pa, _ga) = a.device_ptr(stream);
            let (pb, _gb) = b.device_ptr(stream);
            unsafe { drv::memcpy_dtod_async(pb, pa, BYTES, stream.cu_stream()) }
                .map_err(|e| Error::runtime("bench", format!("copy: {e:?}")))?;
        }
        e1.record(stream)
            .map_err(|e| Error::runtime("bench", format!("{e:?}")))?;
        gpu.dev.synchronize()?;
        let ms = e0
            .elapsed_ms(&e1)
            .map_err(|e| Error::runtime("bench", format!("elapsed: {e:?}")))?;
        best = best.min(ms as f64 * 1e-3);
    }
    Ok(2.0 * BYTES as f64 / best)
}

/// The backend's kernel of a row, here and on SM120 (see [`BenchRow::backend`]).
#[derive(serde::Serialize, Clone)]
struct Backend {
    /// v6, v7 or batch.
    kernel: String,
    us: f64,
    kernel_sm120: Option<String>,
    us_sm120: Option<f64>,
}

/// One timed kernel of a row.
#[derive(serde::Serialize, Clone)]
struct Timed {
    kernel: String,
    splits: u32,
    us: f64,
    /// The same with the carve-out at 44 % (`--sm120-occupancy`), split as planned for
    /// SM120's residency ([`sm120_resident`]): `splits_sm120`.
    us_sm120: Option<f64>,
    splits_sm120: Option<u32>,
    /// The plan took the merged kernel (`kernel` then ends in " merged").
    merged: bool,
    /// The SM120-occupancy plan took the merged kernel.
    merged_sm120: bool,
    rel_l2: f64,
    lse_err: f64,
    ok: bool,
}

#[derive(serde::Serialize)]
struct BenchRow {
    cache: String,
    /// Seed of the cache contents (hashed on the device) and of the slots and queries.
    cache_seed: u32,
    input_seed: u64,
    heads: u32,
    tokens: u32,
    bytes: f64,
    flops: f64,
    roofline_us: f64,
    current: Timed,
    baseline: Option<Timed>,
    scalar: Option<Timed>,
    variants: Vec<Timed>,
    peer_graph_us: Option<f64>,
    peer_eager_us: Option<f64>,
    peer_rel_l2: Option<f64>,
    design_peer_us: Option<f64>,
    /// What the CUDA backend runs for this call (`DecodeConfig::for_call`): on this GPU, and
    /// with `--sm120-occupancy` on an SM120 GPU of the same SM count (one v6 workgroup per
    /// SM), timed there at SM120's occupancy.
    backend: Backend,
}

fn run(args: &Args) -> Result<()> {
    // where rows are timed merged: as the backend merges (SPARSE_MLA_MERGE), or not at all
    let policy = if args.no_merge {
        MergePolicy::Off
    } else {
        MergePolicy::from_env()?
    };
    let dev = CudaDevice::open(args.device)?;
    let name = dev.name();
    let flush = dev.alloc(FLUSH_BYTES as u64)?;
    let sync_bytes = sparse_mla::runtime::gpu::SYNC_WORDS * 4;
    let sync = dev.alloc(sync_bytes)?;
    dev.write(&sync, &vec![0u8; sync_bytes as usize])?;
    let mut bench = Bench {
        args,
        gpu: Gpu {
            dev,
            modules: HashMap::new(),
        },
        flush,
        sync,
    };
    let copy_bw = copy_bandwidth(&bench.gpu)?;
    let (mma_peak, peak_src) = MMA_PEAKS
        .iter()
        .find(|(n, _, _)| name.contains(n))
        .map(|(_, p, s)| (*p, *s))
        .unwrap_or((645e12, "unknown GPU: the H200's"));
    let header = format!(
        "device: {name}; measured device copy {:.2} TB/s; bf16 mma.sync peak {:.0} TFLOP/s ({peak_src}); launches overlapped (programmatic dependent launch): {}",
        copy_bw * 1e-12,
        mma_peak * 1e-12,
        if bench.gpu.dev.dependent_launch() { "yes" } else { "no (SPARSE_MLA_PDL=0, before sm_90, or a driver before CUDA 12.3)" }
    );
    if args.format == "table" {
        println!("{header}");
    }
    let dims = MlaDims::PRODUCTION;
    let mut rows_out: Vec<BenchRow> = Vec::new();
    let mut sweeps = Vec::new();
    let mut failed = false;
    for fmt in &args.cache {
        let format = CacheFormat::parse(fmt)?;
        let row_bytes = format.row_bytes(dims) as u64;
        let slots_wanted = (args.cache_gib * (1u64 << 30) as f64 / row_bytes as f64) as u64;
        let num_pages = slots_wanted.div_ceil(PAGE as u64) as u32;
        let num_slots = num_pages as u64 * PAGE as u64;
        let seed = 0x5eed_0000 ^ (row_bytes as u32);
        let input_seed = 0xbe4c_0001 ^ row_bytes;
        // fill the cache on the GPU
        let words = num_slots * row_bytes / 4;
        let cache = bench.gpu.dev.alloc(words * 4)?;
        let fill = std::sync::Arc::new(fill_kernel(format)?);
        let params = pack_params(
            &fill,
            &[
                ("n_words", ParamValue::U32(words as u32)),
                ("seed", ParamValue::U32(seed)),
            ],
        )?;
        bench.gpu.run(
            &Launch {
                kernel: fill,
                grid: [4096, 1, 1],
                params,
            },
            &[("cache", &cache)],
        )?;
        bench.gpu.dev.synchronize()?;
        if args.format == "table" {
            println!(
                "cache {}: {} slots x {} B = {:.2} GiB, random rows; topk {}, page {PAGE}; {} reps (median), L2 flushed, {SETS} input sets; seeds: cache {seed:#x}, slots and q {input_seed:#x}",
                format.name(),
                num_slots,
                row_bytes,
                (num_slots * row_bytes) as f64 / (1u64 << 30) as f64,
                args.topk,
                args.reps
            );
        }
        let peer = run_peer(args, format);
        let mut rng = Rng::new(input_seed);
        for &h in &args.heads {
            for &t in &args.tokens {
                let shape = DecodeShape {
                    tokens: t,
                    heads: h,
                    topk: args.topk,
                    num_pages,
                    page_size: PAGE,
                    dims,
                    format,
                    scale: 0.0625,
                    has_topk_length: false,
                };
                let mut q = Vec::new();
                let mut indices = Vec::new();
                let mut q0 = Vec::new();
                let mut idx0 = Vec::new();
                for set in 0..SETS {
                    let qf: Vec<f32> = (0..shape.q_elems())
                        .map(|_| bf16_from_bits(bf16_bits(rng.normal())))
                        .collect();
                    let qb: Vec<u8> = qf
                        .iter()
                        .flat_map(|&v| bf16_bits(v).to_le_bytes())
                        .collect();
                    let mut idx = Vec::with_capacity((t * args.topk) as usize);
                    for _ in 0..t {
                        idx.extend(
                            rng.distinct(num_slots, args.topk as usize)
                                .into_iter()
                                .map(|s| s as i32),
                        );
                    }
                    let qd = bench.gpu.dev.alloc(qb.len() as u64)?;
                    bench.gpu.dev.write(&qd, &qb)?;
                    let id = bench.gpu.dev.alloc(idx.len() as u64 * 4)?;
                    bench.gpu.dev.write(&id, &bytes_of_i32(&idx))?;
                    q.push(qd);
                    indices.push(id);
                    if set == 0 {
                        q0 = qf;
                        idx0 = idx;
                    }
                }
                let inputs = Inputs {
                    q,
                    indices,
                    q0,
                    idx0,
                };
                let reference = reference(&shape, seed, &inputs, args.check_tokens)?;
                let max_splits = 128u64;
                let rows = (t * h) as u64;
                let out = bench.gpu.dev.alloc(rows * dims.d_v() as u64 * 2)?;
                let lse = bench.gpu.dev.alloc(rows * 4)?;
                let o_part = bench
                    .gpu
                    .dev
                    .alloc(rows * max_splits * dims.d_v() as u64 * 4)?;
                let lse_part = bench.gpu.dev.alloc(rows * max_splits * 4)?;
                let dummy_len = bench.gpu.dev.alloc(4)?;
                let row = Row {
                    shape,
                    cache: &cache,
                    inputs: &inputs,
                    out: &out,
                    lse: &lse,
                    o_part: &o_part,
                    lse_part: &lse_part,
                    dummy_len: &dummy_len,
                    reference: &reference,
                };
                let bytes = t as f64 * args.topk as f64 * row_bytes as f64
                    + shape.q_elems() as f64 * 2.0
                    + shape.out_elems() as f64 * 2.0;
                let flops = 2.0
                    * t as f64
                    * h as f64
                    * args.topk as f64
                    * (dims.d_qk() + dims.d_v()) as f64;
                let roof_us = (bytes / copy_bw).max(flops / mma_peak) * 1e6;
                // time a config: its cost-model splits (or --splits), default carve-out and,
                // with --sm120-occupancy, SM120's
                let sms = bench.gpu.dev.sm_count();
                let mut time_config =
                    |bench: &mut Bench, config: DecodeConfig, label: &str| -> Result<Timed> {
                        let split_kernel =
                            sparse_mla::kernels::sparse_mla_decode::lowered_kernels(&config)?.0;
                        let resident = bench.gpu.dev.resident_workgroups(&split_kernel)?;

                        // the merged form where the backend would take it: the grid within
                        // what the GPU (or SM120) holds of the merged kernel at once
                        let merged = if policy == MergePolicy::Off {
                            None
                        } else {
                            bench
                                .gpu
                                .dev
                                .resident_merged(&config)?
                                .map(|(k, r)| (r, sm120_resident(&config, &k, r, sms)))
                        };
                        let merge = |plan: DecodePlan, sm120: bool| match merged {
                            Some((r, r120)) => {
                                plan.merged_by(policy, &shape, if sm120 { r120 } else { r })
                            }
                            None => plan,
                        };
                        // planned as the backend plans (the cost model's splits and whole
                        // tokens, SPARSE_MLA_WHOLE_TOKENS; or --splits)
                        let plan = merge(
                            DecodePlan::with_config(config, &shape, resident, sms, args.splits)?,
                            false,
                        );
                        let tm = bench.time(&row, &plan, -1)?;
                        let sm120 = if args.sm120_occupancy {
                            // planned as the backend would on SM120: with its residency
                            let r120 = sm120_resident(
                                &config,
                                &split_kernel,
                                resident,
                                bench.gpu.dev.sm_count(),
                            );
                            let plan120 = merge(
                                DecodePlan::with_config(config, &shape, r120, sms, args.splits)?,
                                true,
                            );
                            let t2 = bench.time(&row, &plan120, 44)?;
                            failed |= !t2.check.ok;
                            Some((t2.median_us, t2.splits, t2.merged, t2.whole))
                        } else {
                            None
                        };
                        failed |= !tm.check.ok;
                        // whole tokens (here | at SM120's occupancy), where either plan has them
                        let whole120 = sm120.map_or(0, |x| x.3);
                        let whole = if tm.whole > 0 || whole120 > 0 {
                            format!(" whole {}|{}", tm.whole, whole120)
                        } else {
                            String::new()
                        };
                        Ok(Timed {
                            kernel: if tm.merged {
                                format!("{label} merged{whole}")
                            } else {
                                format!("{label}{whole}")
                            },
                            splits: tm.splits,
                            us: tm.median_us,
                            us_sm120: sm120.map(|x| x.0),
                            splits_sm120: sm120.map(|x| x.1),
                            merged: tm.merged,
                            merged_sm120: sm120.is_some_and(|x| x.2),
                            rel_l2: tm.check.rel_l2,
                            lse_err: tm.check.lse_err,
                            ok: tm.check.ok,
                        })
                    };
                // v7 with the environment's forms (an A/B of a switch times them here too, and
                // a profile of this column's kernel profiles the form's)
                let config =
                    DecodeConfig::tensor_core_v7(dims, format, h).with_env_forms(&shape)?;
                // the backend's kernel here (this GPU's v6 residency) and on SM120 (one v6
                // workgroup per SM)
                let v6_probe = DecodeConfig::tensor_core_v6(dims, CacheFormat::Bf16, h);
                let v6_kernel =
                    sparse_mla::kernels::sparse_mla_decode::lowered_kernels(&v6_probe)?.0;
                let v6_resident = bench.gpu.dev.resident_workgroups(&v6_kernel)?;
                let v6_here = (v6_resident / sms.max(1)).max(1);
                let v6_sm120 =
                    (sm120_resident(&v6_probe, &v6_kernel, v6_resident, sms) / sms.max(1)).max(1);
                // (with the environment's switches, as the backend plans: an A/B of a switch
                // times the kernels it selects)
                let choice_here = DecodeConfig::for_call_from_env(&shape, sms, || Ok(v6_here))?;
                let choice_sm120 = DecodeConfig::for_call_from_env(&shape, sms, || Ok(v6_sm120))?;
                if !args.sweep_splits.is_empty() {
                    // the split counts of the kernel the backend runs for this call here
                    let config = choice_here;
                    let split_kernel =
                        sparse_mla::kernels::sparse_mla_decode::lowered_kernels(&config)?.0;
                    let resident = bench.gpu.dev.resident_workgroups(&split_kernel)?;
                    // merged where the backend would merge (unless --no-merge)
                    let merged_resident = if policy == MergePolicy::Off {
                        None
                    } else {
                        bench.gpu.dev.resident_merged(&config)?.map(|(_, r)| r)
                    };
                    let mut cells = Vec::new();
                    for &s in &args.sweep_splits {
                        let plan = DecodePlan::new(config, &shape, resident, Some(s), None)?;
                        let plan = match merged_resident {
                            Some(r) => plan.merged_by(policy, &shape, r),
                            None => plan,
                        };
                        let tm = bench.time(&row, &plan, -1)?;
                        failed |= !tm.check.ok;
                        cells.push(format!(
                            "s{}{}:{:.1}{}",
                            tm.splits,
                            if tm.merged { "m" } else { "" },
                            tm.median_us,
                            if tm.check.ok { "" } else { "!" }
                        ));
                    }
                    let model = DecodePlan::model_splits(&config, &shape, resident, sms);
                    let line = format!(
                        "sweep {:<10} {:<5} H {:>3} T {:>3} roof {:>6.1} us  model s{:<3} {}",
                        format.name(),
                        config.label(),
                        h,
                        t,
                        roof_us,
                        model,
                        cells.join("  ")
                    );
                    println!("{line}");
                    sweeps.push(line);
                    continue;
                }
                // every timed configuration, for the backend's choice below
                let mut timed: Vec<(DecodeConfig, Timed)> = Vec::new();
                let current = time_config(&mut bench, config, &config.split_name())?;
                timed.push((config, current.clone()));
                let baseline = if args.no_baseline {
                    None
                } else {
                    let v6 = DecodeConfig::tensor_core_v6(dims, format, h);
                    let tv = time_config(&mut bench, v6, &v6.split_name())?;
                    timed.push((v6, tv.clone()));
                    Some(tv)
                };
                let mut variants = Vec::new();
                for v in &args.variants {
                    let c = parse_variant(v, dims, format)?;
                    let label = if v.starts_with("v6:") {
                        v.clone()
                    } else {
                        format!("v7 {v}")
                    };
                    match time_config(&mut bench, c, &label) {
                        Ok(tv) => {
                            timed.push((c, tv.clone()));
                            variants.push(tv)
                        }
                        Err(e) => eprintln!("variant {v} ({} H {h} T {t}): {e}", format.name()),
                    }
                }
                // the backend's kernel here and on SM120 (`choice_here`, `choice_sm120` above),
                // timed if no column above is it
                let mut backend_time = |bench: &mut Bench, c: DecodeConfig| -> Result<Timed> {
                    if let Some((_, tv)) = timed.iter().find(|(tc, _)| *tc == c) {
                        return Ok(tv.clone());
                    }
                    let tv = time_config(bench, c, &c.split_name())?;
                    timed.push((c, tv.clone()));
                    Ok(tv)
                };
                let here = backend_time(&mut bench, choice_here)?;
                let backend = Backend {
                    kernel: format!(
                        "{}{}",
                        choice_here.label(),
                        if here.merged { " merged" } else { "" }
                    ),
                    us: here.us,
                    kernel_sm120: None,
                    us_sm120: None,
                };
                let backend = if args.sm120_occupancy {
                    let t120 = backend_time(&mut bench, choice_sm120)?;
                    Backend {
                        kernel_sm120: Some(format!(
                            "{}{}",
                            choice_sm120.label(),
                            if t120.merged_sm120 { " merged" } else { "" }
                        )),
                        us_sm120: t120.us_sm120,
                        ..backend
                    }
                } else {
                    backend
                };
                let scalar = if args.scalar {
                    let sc = DecodeConfig::cuda_scalar(dims, format);
                    let plan =
                        DecodePlan::new(sc, &shape, bench.gpu.dev.sm_count() * 2, None, None)?;
                    let r = bench.time(&row, &plan, -1)?;
                    failed |= !r.check.ok;
                    Some(Timed {
                        kernel: "scalar".into(),
                        splits: r.splits,
                        us: r.median_us,
                        us_sm120: None,
                        splits_sm120: None,
                        merged: false,
                        merged_sm120: false,
                        rel_l2: r.check.rel_l2,
                        lse_err: r.check.lse_err,
                        ok: r.check.ok,
                    })
                } else {
                    None
                };
                let pr = peer.get(&(h, t));
                let br = BenchRow {
                    cache: format.name().to_string(),
                    cache_seed: seed,
                    input_seed,
                    heads: h,
                    tokens: t,
                    bytes,
                    flops,
                    roofline_us: roof_us,
                    current,
                    baseline,
                    scalar,
                    variants,
                    peer_graph_us: pr.map(|p| p.us),
                    peer_eager_us: pr.map(|p| p.eager_us),
                    peer_rel_l2: pr.map(|p| p.rel),
                    design_peer_us: design_best_peer(h, t),
                    backend,
                };
                if args.format == "json" {
                    println!(
                        "{}",
                        serde_json::to_string(&br)
                            .map_err(|e| Error::runtime("bench", e.to_string()))?
                    );
                } else if args.format == "table" {
                    eprintln!(
                        "{} H {h} T {t}: {:.1} us ({})",
                        format.name(),
                        br.current.us,
                        if br.current.ok { "ok" } else { "FAIL" }
                    );
                }
                rows_out.push(br);
            }
        }
    }
    match args.format.as_str() {
        "csv" => print_csv(&rows_out),
        "table" => {
            println!();
            println!("{header}");
            println!("roofline: max(bytes / measured copy bandwidth, FLOPs / mma.sync peak); bytes = T*topk*row + q + out, FLOPs = 2*T*H*topk*1088; check: rel L2 of out / max |lse err| vs float64 (first and last tokens)");
            println!("{}", table(&rows_out, args));
            for l in &sweeps {
                println!("{l}");
            }
        }
        _ => {}
    }
    if failed {
        return Err(Error::runtime(
            "bench",
            "a correctness check failed (see FAIL rows)",
        ));
    }
    Ok(())
}

fn fmt_us(t: Option<f64>) -> String {
    t.filter(|v| v.is_finite())
        .map(|v| format!("{v:.1}"))
        .unwrap_or_else(|| "-".into())
}

fn table(rows: &[BenchRow], args: &Args) -> String {
    use comfy_table::{presets::ASCII_MARKDOWN, CellAlignment, Table};
    let mut t = Table::new();
    t.load_preset(ASCII_MARKDOWN);
    let mut head = vec![
        "cache",
        "H",
        "T",
        "roof us",
        "backend us",
        "v7 us",
        "s",
        "% roof",
        "TFLOP/s",
        "check",
    ];
    if args.sm120_occupancy {
        head.extend(["SM120 backend us", "v7 sm120 us", "sm120 / default"]);
    }
    if !args.no_baseline {
        head.extend(["v6 us", "v6 / v7"]);
        if args.sm120_occupancy {
            head.push("v6 sm120 us");
        }
    }
    for v in &args.variants {
        let _ = v;
    }
    let variant_names: Vec<String> = rows
        .first()
        .map(|r| r.variants.iter().map(|v| v.kernel.clone()).collect())
        .unwrap_or_default();
    let mut head: Vec<String> = head.into_iter().map(String::from).collect();
    for v in &variant_names {
        head.push(format!("{v} us"));
    }
    if args.scalar {
        head.push("scalar us".into());
    }
    head.extend([
        "torch graph us".to_string(),
        "torch eager us".to_string(),
        "v7 vs torch".to_string(),
    ]);
    t.set_header(head);
    for r in rows {
        let c = &r.current;
        let mut cells = vec![
            r.cache.clone(),
            r.heads.to_string(),
            r.tokens.to_string(),
            format!("{:.1}", r.roofline_us),
            format!("{} {:.1}", r.backend.kernel, r.backend.us),
            format!("{:.1}", c.us),
            c.splits.to_string(),
            format!("{:.1}%", r.roofline_us / c.us * 100.0),
            format!("{:.1}", r.flops / c.us * 1e-6),
            format!(
                "{} {:.1e}/{:.0e}",
                if c.ok { "ok" } else { "FAIL" },
                c.rel_l2,
                c.lse_err
            ),
        ];
        if args.sm120_occupancy {
            cells.push(format!(
                "{} {}",
                r.backend.kernel_sm120.as_deref().unwrap_or("-"),
                fmt_us(r.backend.us_sm120)
            ));
            cells.push(fmt_us(c.us_sm120));
            cells.push(
                c.us_sm120
                    .map(|s| format!("{:.2}x", s / c.us))
                    .unwrap_or_else(|| "-".into()),
            );
        }
        if let Some(b) = &r.baseline {
            cells.push(format!("{:.1}{}", b.us, if b.ok { "" } else { " FAIL" }));
            cells.push(format!("{:.2}x", b.us / c.us));
            if args.sm120_occupancy {
                cells.push(fmt_us(b.us_sm120));
            }
        }
        for v in &r.variants {
            cells.push(format!(
                "{:.1} s{}{}",
                v.us,
                v.splits,
                if v.ok { "" } else { " FAIL" }
            ));
        }
        if let Some(s) = &r.scalar {
            cells.push(format!("{:.1}", s.us));
        }
        cells.push(fmt_us(r.peer_graph_us));
        cells.push(fmt_us(r.peer_eager_us));
        cells.push(
            r.peer_graph_us
                .map(|p| format!("{:.2}x", p / c.us))
                .unwrap_or_else(|| "-".into()),
        );
        t.add_row(cells);
    }
    for i in 1..9 {
        if let Some(col) = t.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    t.to_string()
}

fn print_csv(rows: &[BenchRow]) {
    println!("cache,heads,tokens,roofline_us,kernel,splits,us,us_sm120,rel_l2,lse_err,ok,peer_graph_us,peer_eager_us,splits_sm120,backend,backend_us,backend_sm120,backend_us_sm120");
    for r in rows {
        let mut all = vec![&r.current];
        all.extend(r.baseline.iter());
        all.extend(r.variants.iter());
        all.extend(r.scalar.iter());
        for k in all {
            println!(
                "{},{},{},{:.2},{},{},{:.2},{},{:.3e},{:.3e},{},{},{},{},{},{:.2},{},{}",
                r.cache,
                r.heads,
                r.tokens,
                r.roofline_us,
                k.kernel,
                k.splits,
                k.us,
                k.us_sm120.map(|v| format!("{v:.2}")).unwrap_or_default(),
                k.rel_l2,
                k.lse_err,
                k.ok,
                r.peer_graph_us
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_default(),
                r.peer_eager_us
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_default(),
                k.splits_sm120.map(|v| v.to_string()).unwrap_or_default(),
                r.backend.kernel,
                r.backend.us,
                r.backend.kernel_sm120.as_deref().unwrap_or(""),
                r.backend
                    .us_sm120
                    .map(|v| format!("{v:.2}"))
                    .unwrap_or_default()
            );
        }
    }
}

/// Workgroups of `config`'s split kernel an SM120 GPU of `sm_count` multiprocessors would run
/// at once, for the `--sm120-occupancy` column's plan: the export's estimate for sm_120
/// (shared memory, the register hint), never more than `resident` (what the driver reports
/// here).
fn sm120_resident(config: &DecodeConfig, kernel: &Kernel, resident: u32, sm_count: u32) -> u32 {
    let per_sm = sparse_mla::export::header::estimate_per_sm(config, kernel, "sm_120");
    resident.min(per_sm * sm_count).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse_to_the_forms_they_name() {
        let dims = MlaDims::PRODUCTION;
        let v = |s: &str| parse_variant(s, dims, CacheFormat::Bf16);
        let heads = v("32x32x2w4h2").unwrap();
        assert_eq!(
            (heads.block_h, heads.head_groups(), heads.threads),
            (32, 2, 256)
        );
        assert!(heads.split_name().contains("_ws2w8h2r_h32n32"));
        let four = v("64x32x2w2h4p1").unwrap();
        assert_eq!(
            (four.block_h, four.head_groups(), four.threads),
            (64, 4, 256)
        );
        assert_eq!(four.l2_ahead(), 1);
        let steps = v("16x32x1w4g2").unwrap();
        assert_eq!((steps.groups(), steps.head_groups()), (2, 1));
        // r / f: the scores in rows / fragments, whatever the form's own
        let fp8 = |s: &str| parse_variant(s, dims, CacheFormat::Fp8DsMla).unwrap();
        assert!(fp8("64x16x2w2h4r")
            .split_name()
            .contains("_ws2w8h4r_h64n16"));
        assert!(fp8("64x16x2w2h4").split_name().contains("_ws2w8h4_h64n16"));
        assert!(v("32x32x2f")
            .unwrap()
            .split_name()
            .contains("_ws2w8_h32n32"));
        // a group of fewer than 16 heads (an mma tile's rows) is refused, as are both kinds
        for bad in [
            "32x32x2w4h4",
            "24x32x2w4h2",
            "32x32x2w4g2h2",
            "32x32x2w4h1",
            "v6:16x32x2x2r",
            "32x32x2rf",
        ] {
            assert!(v(bad).is_err(), "{bad}");
        }
    }
}
