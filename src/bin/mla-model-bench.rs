//! mla-model-bench: whole-model decode at true width — a GLM-5- or DeepSeek-V3.2-shaped stack
//! of a few layers with random weights made on the GPU (bf16 or block-scaled FP8), caches of
//! 4 K or 32 K positions per sequence filled with random valid rows, decoded at batch 1, 8 and
//! 32 through the same `Model::step` + device sampler loop `mla-run` uses. Per row: the step
//! time, its bytes roofline (weights touched + caches read over the copy bandwidth measured at
//! start) and fraction, the split into indexer / attention / MLP / other, the previous linear
//! kernel (v1) beside the current one, and the projection to the whole model.

use clap::Parser;
use sparse_mla::kernels::fill::{CopyOp, FillMode, FillOp};
use sparse_mla::kernels::linear::set_baseline;
use sparse_mla::mla::CacheFormat;
use sparse_mla::model::config::MlpKind;
use sparse_mla::model::device::DenseGemm;
use sparse_mla::model::memory::gib;
use sparse_mla::model::synthetic::{self, Shape};
use sparse_mla::model::{
    CacheOptions, KvCache, Logits, Model, Sampler, SamplerConfig, SeqId, StepInput,
};
use sparse_mla::runtime::profile::{format_rows, ProfileRow, Profiled};
use sparse_mla::runtime::{open_device, Backend, CacheWriteBuffers, DeviceSpec};
use sparse_mla::{Error, Result};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// Decode speed of a true-width GLM-5 / DeepSeek-V3.2 stack on one GPU, projected to the
/// whole model. Run on the machine with the GPU (binaries from tools/build-gpu.sh).
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// Model shapes: glm5, deepseek-v32.
    #[arg(long, value_delimiter = ',', default_value = "glm5,deepseek-v32")]
    shape: Vec<String>,
    /// Weight formats: fp8 (e4m3 + 128 x 128 scales), bf16.
    #[arg(long, value_delimiter = ',', default_value = "fp8,bf16")]
    weights: Vec<String>,
    /// Positions already in each sequence's cache.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768")]
    context: Vec<usize>,
    /// Sequences decoded together.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batch: Vec<usize>,
    /// Dense layers of the stack (first).
    #[arg(long, default_value_t = 1)]
    dense: usize,
    /// MoE layers of the stack.
    #[arg(long, default_value_t = 3)]
    moe: usize,
    /// Timed decode steps per row (median reported).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// KV cache rows: bf16 or fp8 (fp8_ds_mla).
    #[arg(long, default_value = "bf16")]
    kv_cache: String,
    /// Device: cuda, cuda:N, wgpu.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Skip the v1 linear kernel (the previous version) rows.
    #[arg(long)]
    no_baseline: bool,
    /// Force the dense linear's weight rows per warp (1 = before batch sharing of x reads,
    /// 4), to compare with the default policy (1 at one token, 4 from four).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["1", "4"]))]
    linear_rows: Option<String>,
    /// Who runs the dense linears in the main rows (auto, kernels, cublas; see
    /// `mla-run --help`). Each row is also timed with each fixed policy that differs from
    /// it (kernels only; cuBLAS only where there is cuBLAS), so all are measured in one run.
    #[arg(long, default_value = "auto",
          value_parser = clap::builder::PossibleValuesParser::new(["auto", "kernels", "cublas"]))]
    gemm: String,
    /// Also time every operation of 3 steps per row (each between two waits for the GPU)
    /// and print, after the table, each row's ops with the most time first: which op of a
    /// step to look at (the main columns are timed without it).
    #[arg(long)]
    profile_ops: bool,
}

fn parse_shape(s: &str) -> Result<Shape> {
    match s {
        "glm5" => Ok(Shape::Glm5),
        "deepseek-v32" => Ok(Shape::DeepseekV32),
        other => Err(Error::arg("--shape", "glm5 or deepseek-v32", other)),
    }
}

/// Device-to-device copy bandwidth (bytes read + written per second) over 2 GiB.
fn copy_bandwidth(b: &dyn Backend) -> Result<f64> {
    let words: u32 = 1 << 29;
    let src = b.alloc(words as u64 * 4)?;
    let dst = b.alloc(words as u64 * 4)?;
    b.run_op(
        &FillOp {
            words,
            mode: FillMode::F32 { lo: -1.0, hi: 1.0 },
            seed: 7,
        },
        &[("dst", &src)],
    )?;
    let op = CopyOp { words };
    // The device's copy engine where the backend exposes one (CUDA), else our copy kernel.
    let copy = || -> Result<()> {
        if !b.device_copy(&src, &dst, words as u64 * 4)? {
            b.run_op(&op, &[("src", &src), ("dst", &dst)])?;
        }
        Ok(())
    };
    copy()?;
    b.synchronize()?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        copy()?;
        b.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(2.0 * words as f64 * 4.0 / best)
}

/// Random valid cache rows in every slot of every layer (the cache-write kernel encodes
/// them, so fp8_ds_mla rows have proper scales), random bf16 indexer keys.
fn fill_caches(model: &Model, cache: &KvCache) -> Result<()> {
    let b = model.device().backend();
    let opts = cache.options();
    let slots = (opts.pages() * opts.page_size) as u32;
    let c = &model.config;
    let chunk = slots.min(65536);
    let latent = b.alloc(chunk as u64 * c.kv_lora_rank as u64 * 2)?;
    let rope = b.alloc(chunk as u64 * c.qk_rope_head_dim as u64 * 2)?;
    let slot_buf = b.alloc(chunk as u64 * 4)?;
    for l in 0..c.num_hidden_layers {
        let kv = cache
            .latent_buffer(l)
            .ok_or_else(|| Error::Model(format!("layer {l}: no latent cache")))?;
        let mut first = 0u32;
        while first < slots {
            let n = chunk.min(slots - first);
            for (buf, words) in [
                (&latent, n * c.kv_lora_rank as u32 / 2),
                (&rope, n * c.qk_rope_head_dim as u32 / 2),
            ] {
                b.run_op(
                    &FillOp {
                        words,
                        mode: FillMode::Bf16 { scale: 2.0 },
                        seed: first ^ l as u32,
                    },
                    &[("dst", buf)],
                )?;
            }
            let ids: Vec<u8> = (first..first + n)
                .flat_map(|s| (s as i32).to_le_bytes())
                .collect();
            b.write(&slot_buf, &ids)?;
            let shape = cache.write_shape(c, n);
            // The buffers hold `chunk` rows; the last call writes fewer.
            let (l_view, r_view, s_view);
            let bufs = if n == chunk {
                CacheWriteBuffers {
                    latent: &latent,
                    rope: &rope,
                    slot_mapping: &slot_buf,
                    kv_cache: kv,
                }
            } else {
                l_view = b.alloc(n as u64 * c.kv_lora_rank as u64 * 2)?;
                r_view = b.alloc(n as u64 * c.qk_rope_head_dim as u64 * 2)?;
                s_view = b.alloc(n as u64 * 4)?;
                b.run_op(
                    &FillOp {
                        words: n * c.kv_lora_rank as u32 / 2,
                        mode: FillMode::Bf16 { scale: 2.0 },
                        seed: 3,
                    },
                    &[("dst", &l_view)],
                )?;
                b.run_op(
                    &FillOp {
                        words: n * c.qk_rope_head_dim as u32 / 2,
                        mode: FillMode::Bf16 { scale: 2.0 },
                        seed: 4,
                    },
                    &[("dst", &r_view)],
                )?;
                b.write(&s_view, &ids)?;
                CacheWriteBuffers {
                    latent: &l_view,
                    rope: &r_view,
                    slot_mapping: &s_view,
                    kv_cache: kv,
                }
            };
            b.cache_write(&shape, &bufs)?;
            first += n;
        }
        if let Some(keys) = cache.key_buffer(l) {
            let words = u32::try_from(keys.len() / 4)
                .map_err(|_| Error::Model("key cache over 2^32 words".into()))?;
            b.run_op(
                &FillOp {
                    words,
                    mode: FillMode::Bf16 { scale: 1.0 },
                    seed: 0x51 + l as u32,
                },
                &[("dst", keys)],
            )?;
        }
    }
    b.synchronize()
}

/// Bytes a decode step of `batch` tokens at `context` must move: the weights it touches and
/// the cache rows it reads (per layer: top-k latent rows and every indexer key).
fn step_bytes(model: &Model, batch: usize, context: usize, format: CacheFormat) -> (f64, Vec<f64>) {
    let c = &model.config;
    let w = |rows: usize, cols: usize, fp8: bool| {
        (rows * cols) as f64 * if fp8 { 1.0 + 4.0 / 16384.0 } else { 2.0 }
    };
    let fp8 = c.fp8.is_some();
    let (h, heads) = (c.hidden_size, c.num_attention_heads);
    let attn = w(c.q_lora_rank, h, fp8)
        + w(heads * c.qk_head_dim(), c.q_lora_rank, fp8)
        + w(c.kv_lora_rank + c.qk_rope_head_dim, h, fp8)
        + w(heads * c.kv_lora_rank, c.qk_nope_head_dim, false)
        + w(heads * c.v_head_dim, c.kv_lora_rank, false)
        + w(h, heads * c.v_head_dim, fp8);
    let indexer = w(c.index_n_heads * c.index_head_dim, c.q_lora_rank, fp8)
        + w(c.index_head_dim, h, fp8)
        + w(c.index_n_heads, h, false);
    let row = format.row_bytes(c.mla_dims()) as f64;
    let caches = batch as f64
        * (c.index_topk.min(context) as f64 * row + context as f64 * c.index_head_dim as f64 * 2.0);
    let e = c.n_routed_experts as f64;
    let touched = e * (1.0 - (1.0 - c.num_experts_per_tok as f64 / e).powi(batch as i32));
    let expert = w(3 * c.moe_intermediate_size, h, fp8);
    let mut per_layer = Vec::new();
    for kind in &c.mlp_layer_types {
        let mlp = match kind {
            MlpKind::Dense => w(3 * c.intermediate_size, h, fp8),
            MlpKind::Moe => {
                w(c.n_routed_experts, h, false) + (touched + c.n_shared_experts as f64) * expert
            }
        };
        per_layer.push(attn + indexer + caches + mlp);
    }
    let other = w(c.vocab_size, h, false) + (batch * h * 2) as f64;
    (other, per_layer)
}

struct Row {
    step_s: f64,
    v1_s: Option<f64>,
    /// The step with the project's kernels for every linear (no cuBLAS).
    kernels_s: Option<f64>,
    /// The step with cuBLAS for every dense linear.
    vendor_s: Option<f64>,
    /// With the decode step replayed from a CUDA graph.
    graph_s: Option<f64>,
    phases: Vec<(String, f64)>,
    dense_s: f64,
    moe_s: f64,
    other_s: f64,
    /// Each op's total over 3 steps (`--profile-ops`).
    ops: Vec<ProfileRow>,
}

/// Milliseconds to 2 decimals, `-` for a row not timed.
fn ms(t: Option<f64>) -> String {
    t.map(|t| format!("{:.2}", t * 1e3))
        .unwrap_or_else(|| "-".into())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Timed decode steps of every sequence: the median wall time of a step (the sampler's read
/// of the ids is the step's one wait for the GPU).
fn time_steps(
    model: &Model,
    cache: &mut KvCache,
    seqs: &[SeqId],
    warmup: usize,
    steps: usize,
) -> Result<f64> {
    let mut sampler = Sampler::new(SamplerConfig::default())?;
    let mut ids: Vec<u32> = (0..seqs.len() as u32)
        .map(|i| (i * 7919 + 11) % model.config.vocab_size as u32)
        .collect();
    let mut times = Vec::with_capacity(steps);
    for s in 0..warmup + steps {
        let toks: Vec<[u32; 1]> = ids.iter().map(|&i| [i]).collect();
        let inputs: Vec<StepInput> = seqs
            .iter()
            .zip(&toks)
            .map(|(&seq, t)| StepInput { seq, tokens: t })
            .collect();
        let t0 = Instant::now();
        let logits = model.step(cache, &inputs, Logits::Last, None)?;
        let out = sampler.sample(model.device(), &logits)?;
        let dt = t0.elapsed().as_secs_f64();
        ids = out.iter().map(|t| t.id).collect();
        if s >= warmup {
            times.push(dt);
        }
    }
    Ok(median(times))
}

fn run_row(
    model: &Model,
    args: &Args,
    format: CacheFormat,
    context: usize,
    batch: usize,
    ops: Option<&Profiled>,
) -> Result<Row> {
    // Eager, kernels-only, cuBLAS-only, v1, graph and profiled passes each add their steps
    // to every sequence.
    let extra = 6 * (args.warmup + args.steps) + 32;
    let vendor = model.device().backend().gemm_available().is_ok();
    let mut cache = model.new_cache(CacheOptions {
        format,
        page_size: 64,
        max_seq_len: context + extra,
        max_seqs: batch,
        num_pages: None,
    })?;
    let seqs: Vec<SeqId> = (0..batch)
        .map(|_| cache.add_sequence())
        .collect::<Result<_>>()?;
    let grow: Vec<(SeqId, usize)> = seqs.iter().map(|&s| (s, context)).collect();
    cache.reserve(&grow)?;
    fill_caches(model, &cache)?;
    let step_s = time_steps(model, &mut cache, &seqs, args.warmup, args.steps)?;
    // The same steps with each fixed policy, where it differs from the main one.
    let gemm = model.device().dense_gemm();
    let mut fixed = |other: DenseGemm| -> Result<Option<f64>> {
        if other == gemm || (other == DenseGemm::Vendor && !vendor) {
            return Ok(None);
        }
        model.device().set_dense_gemm(other)?;
        let t = time_steps(model, &mut cache, &seqs, 1, args.steps.min(5));
        model.device().set_dense_gemm(gemm)?;
        t.map(Some)
    };
    let kernels_s = fixed(DenseGemm::Kernels)?;
    let vendor_s = fixed(DenseGemm::Vendor)?;
    let v1_s = if args.no_baseline {
        None
    } else {
        set_baseline(true);
        let t = time_steps(model, &mut cache, &seqs, 1, args.steps.min(5));
        set_baseline(false);
        Some(t?)
    };
    // Graphs: the step is recorded on its second sight, then replayed.
    model.set_graphs(true);
    let before = model.graph_counts();
    let graphed = time_steps(model, &mut cache, &seqs, 3, args.steps);
    let after = model.graph_counts();
    model.set_graphs(false);
    let graph_s = match graphed {
        Ok(t) if after.1 > before.1 => Some(t),
        Ok(_) => None,
        Err(e) => return Err(e),
    };
    let ops = match ops {
        Some(p) => {
            p.reset();
            p.set_on(true);
            let t = time_steps(model, &mut cache, &seqs, 0, 3);
            p.set_on(false);
            t?;
            p.rows()
        }
        None => Vec::new(),
    };
    model.device().set_profiling(true);
    let profiled = time_steps(model, &mut cache, &seqs, 0, 3);
    let profile = model.device().set_profiling(false).unwrap_or_default();
    profiled?;
    let mut phases: std::collections::BTreeMap<String, f64> = Default::default();
    let (mut dense, mut moe, mut other, mut n_dense, mut n_moe) = (0.0, 0.0, 0.0, 0usize, 0usize);
    let steps = 3.0;
    for ((layer, name), (secs, _)) in &profile.phases {
        let per_step = secs / steps;
        *phases.entry(name.to_string()).or_default() += per_step;
        match layer {
            Some(l) => match model.config.mlp_layer_types[*l] {
                MlpKind::Dense => dense += per_step,
                MlpKind::Moe => moe += per_step,
            },
            None => other += per_step,
        }
    }
    for k in &model.config.mlp_layer_types {
        match k {
            MlpKind::Dense => n_dense += 1,
            MlpKind::Moe => n_moe += 1,
        }
    }
    // Scale the profiled split (each mark waits for the GPU) to the unprofiled step.
    let total = dense + moe + other;
    let f = if total > 0.0 { step_s / total } else { 1.0 };
    Ok(Row {
        step_s,
        v1_s,
        kernels_s,
        vendor_s,
        graph_s,
        phases: phases.into_iter().map(|(k, v)| (k, v * f)).collect(),
        dense_s: dense * f / n_dense.max(1) as f64,
        moe_s: moe * f / n_moe.max(1) as f64,
        other_s: other * f,
        ops,
    })
}

fn run(args: &Args) -> Result<()> {
    let spec = DeviceSpec::parse(&args.device)?;
    if let Some(r) = &args.linear_rows {
        sparse_mla::kernels::linear::set_rows_per_warp(r.parse().unwrap_or(0));
        println!("dense linear: {r} weight row(s) per warp at every batch (--linear-rows)");
    }
    let (backend, _) = open_device(spec)?;
    let profiled = args.profile_ops.then(|| {
        let p = Arc::new(Profiled::new(backend.clone()));
        p.set_on(false);
        p
    });
    let backend = match &profiled {
        Some(p) => p.clone() as Arc<dyn Backend>,
        None => backend,
    };
    let mut op_tables = String::new();
    println!("device: {}", backend.device_name());
    println!(
        "dense linears: --gemm {} (cuBLAS: {})",
        args.gemm,
        match backend.gemm_available() {
            Ok(()) => "available".to_string(),
            Err(why) => why,
        }
    );
    let bw = copy_bandwidth(backend.as_ref())?;
    println!("copy bandwidth (read + write): {:.2} TB/s", bw / 1e12);
    let format = CacheFormat::parse(&args.kv_cache)?;
    println!(
        "| shape | weights | ctx | batch | step ms | tok/s | roofline ms | % roof | graph step ms (% roof) | kernels-only / cuBLAS-only step ms | v1 step ms | dense layer ms (% roof) | MoE layer ms (% roof) | other ms | indexer / attention / mlp / other ms | whole model tok/s (graph) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for shape in &args.shape {
        let shape = parse_shape(shape)?;
        for wt in &args.weights {
            let fp8 = match wt.as_str() {
                "fp8" => true,
                "bf16" => false,
                other => return Err(Error::arg("--weights", "fp8 or bf16", other)),
            };
            let t0 = Instant::now();
            let model =
                synthetic::build(shape, args.dense, args.moe, fp8, backend.clone(), 0x5eed)?;
            model
                .device()
                .set_dense_gemm(DenseGemm::parse("--gemm", &args.gemm)?)?;
            eprintln!(
                "{} {wt}: {} of weights made on the device in {:.1} s",
                shape.name(),
                gib(model.weight_bytes()),
                t0.elapsed().as_secs_f64()
            );
            for &ctx in &args.context {
                for &batch in &args.batch {
                    let row = run_row(&model, args, format, ctx, batch, profiled.as_deref())?;
                    if profiled.is_some() {
                        op_tables += &format!(
                            "\nops of {} {wt} ctx {ctx} batch {batch}, 3 eager steps, each op between two waits:\n{}",
                            shape.name(),
                            format_rows(&row.ops, 3)
                        );
                    }
                    let (other_b, layers_b) = step_bytes(&model, batch, ctx, format);
                    let total_b = other_b + layers_b.iter().sum::<f64>();
                    let roof = total_b / bw;
                    let dense_b = model
                        .config
                        .mlp_layer_types
                        .iter()
                        .zip(&layers_b)
                        .find(|(k, _)| **k == MlpKind::Dense)
                        .map(|(_, b)| *b)
                        .unwrap_or(0.0);
                    let moe_b = model
                        .config
                        .mlp_layer_types
                        .iter()
                        .zip(&layers_b)
                        .find(|(k, _)| **k == MlpKind::Moe)
                        .map(|(_, b)| *b)
                        .unwrap_or(0.0);
                    let (fd, fm) = shape.full_layers();
                    let whole = fd as f64 * row.dense_s + fm as f64 * row.moe_s + row.other_s;
                    // The graph's saving, spread over the layers in proportion.
                    let g = row.graph_s.map(|t| t / row.step_s).unwrap_or(1.0);
                    let phases: Vec<String> = ["indexer", "attention", "mlp", "other"]
                        .iter()
                        .map(|p| {
                            let v = row
                                .phases
                                .iter()
                                .find(|(k, _)| k == p)
                                .map(|(_, v)| *v)
                                .unwrap_or(0.0);
                            format!("{:.2}", v * 1e3)
                        })
                        .collect();
                    println!(
                        "| {} | {wt} | {ctx} | {batch} | {:.2} | {:.0} | {:.2} | {:.0} % | {} | {} / {} | {} | {:.2} ({:.0} %) | {:.2} ({:.0} %) | {:.2} | {} | {:.1} ({:.1}) |",
                        shape.name(),
                        row.step_s * 1e3,
                        batch as f64 / row.step_s,
                        roof * 1e3,
                        100.0 * roof / row.step_s,
                        row.graph_s
                            .map(|t| format!("{:.2} ({:.0} %)", t * 1e3, 100.0 * roof / t))
                            .unwrap_or_else(|| "-".into()),
                        ms(row.kernels_s),
                        ms(row.vendor_s),
                        row.v1_s.map(|t| format!("{:.2}", t * 1e3)).unwrap_or_else(|| "-".into()),
                        row.dense_s * 1e3,
                        100.0 * dense_b / bw / row.dense_s,
                        row.moe_s * 1e3,
                        100.0 * moe_b / bw / row.moe_s,
                        row.other_s * 1e3,
                        phases.join(" / "),
                        batch as f64 / whole,
                        batch as f64 / (whole * g),
                    );
                }
            }
        }
    }
    print!("{op_tables}");
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mla-model-bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}
