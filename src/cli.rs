//! What the model binaries (`mla-run`, `mla-serve`) share: finding and checking the model
//! directory, opening the device with the run's memory checked against it, and loading the
//! weights with a progress bar. One copy, so both tools refuse the same things with the same
//! words.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::mla::CacheFormat;
use crate::model::memory::{gib, plan as memory_plan};
use crate::model::tokenizer::TOKENIZER_FILE;
use crate::model::weights::Checkpoint;
use crate::model::{CacheOptions, Model, ModelConfig, ShardedModel, TextTokenizer};
use crate::runtime::{open_device, Backend, BackendKind, DeviceSpec};
use crate::{Error, Result};

/// The checked-in tiny GLM-5 (random weights) the tools run when no `--model` is given.
pub const DEFAULT_FIXTURE: &str = "tests/fixtures/glm_moe_dsa-tiny";

/// Tokens per cache page (vLLM's and FlashMLA's MLA page size).
pub const PAGE_SIZE: usize = 64;

/// KV cache row format, as the `--kv-cache` flag spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheArg {
    /// 1152 B per token: the latent and the rope part in bf16.
    Bf16,
    /// 656 B per token: fp8_ds_mla (fp8 latent with one scale per 128 values, bf16 rope).
    Fp8,
}

impl KvCacheArg {
    pub fn format(self) -> CacheFormat {
        match self {
            KvCacheArg::Bf16 => CacheFormat::Bf16,
            KvCacheArg::Fp8 => CacheFormat::Fp8DsMla,
        }
    }
}

/// The tiny GLM-5 fixture: in this source tree, or under the current directory (a binary
/// carried to another machine with the repository).
pub fn default_model_dir() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join(DEFAULT_FIXTURE);
    if built.is_dir() {
        built
    } else {
        PathBuf::from(DEFAULT_FIXTURE)
    }
}

/// `--model`, or the tiny fixture with a note on stderr saying so (`tool` names the program).
pub fn model_dir_or_default(arg: Option<&Path>, tool: &str) -> PathBuf {
    match arg {
        Some(d) => d.to_path_buf(),
        None => {
            let d = default_model_dir();
            eprintln!(
                "{tool}: no --model given: running the tiny GLM-5 fixture at {} (random weights, so the text is gibberish)",
                d.display()
            );
            d
        }
    }
}

/// A model directory's config (read and checked) and its tokenizer, if it has one.
pub fn read_model_dir(dir: &Path) -> Result<(ModelConfig, Option<TextTokenizer>)> {
    if dir.is_file() {
        return Err(Error::Model(format!(
            "--model {} is a file; give the model directory that holds config.json and the safetensors",
            dir.display()
        )));
    }
    if !dir.is_dir() {
        return Err(Error::Model(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    let config = ModelConfig::from_dir(dir)?;
    let tok_path = dir.join(TOKENIZER_FILE);
    let tokenizer = if tok_path.is_file() {
        Some(TextTokenizer::from_file(&tok_path)?)
    } else {
        None
    };
    Ok((config, tokenizer))
}

/// Opens the device `spec` names and checks that the weights, the caches of `cache` and the
/// activations of a `step_tokens`-token step fit in its free memory, before a weight is read.
/// Says on stderr which device it took (and why, for `auto`).
pub fn open_checked(
    tool: &str,
    spec: DeviceSpec,
    dir: &Path,
    config: &ModelConfig,
    cache: &CacheOptions,
    step_tokens: u64,
) -> Result<(Arc<dyn Backend>, Checkpoint)> {
    let (backend, why) = open_device(spec)?;
    if why.is_empty() {
        eprintln!("{tool}: device {}", backend.device_name());
    } else {
        eprintln!("{tool}: device {} ({why})", backend.device_name());
    }
    let c = config;
    log::info!(
        "config: {} ({}), {} layers, hidden {}, {} heads, {} routed experts ({} per token), index_topk {}, vocab {}{}",
        dir.display(),
        c.arch.model_type(),
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.index_topk,
        c.vocab_size,
        match c.fp8 {
            Some(f) => format!(", FP8 weights in {:?} blocks", f.block),
            None => String::new(),
        }
    );
    let ckpt = Checkpoint::open(dir, config.fp8.map(|f| f.block))?;
    let mem = memory_plan(config, &ckpt, cache, step_tokens.max(1))?;
    log::info!(
        "memory plan: weights {}, caches {} ({} sequences of {} positions, {} cache), activations {}",
        gib(mem.weights),
        gib(mem.caches),
        cache.max_seqs,
        cache.max_seq_len,
        cache.format.name(),
        gib(mem.activations)
    );
    // Built on the host whatever the device (the RoPE table of every position).
    let staging = crate::model::memory::host_staging_bytes(config, cache);
    if let Some((free, _)) = crate::runtime::cpu::host_memory() {
        if staging > free {
            return Err(Error::Model(format!(
                "the cache tables for --max-seq-len {} need {} of host memory while they are built, but {} is free; lower --max-seq-len",
                cache.max_seq_len,
                gib(staging),
                gib(free)
            )));
        }
    }
    if backend.memory_info().is_none() {
        log::info!(
            "{} does not report its memory: the plan ({}) is checked per buffer only",
            backend.device_name(),
            gib(mem.total())
        );
    }
    if let Some((free, total)) = backend.memory_info() {
        log::info!("device memory: {} free of {}", gib(free), gib(total));
        let what = match backend.kind() {
            BackendKind::Cpu => "host",
            _ => "device",
        };
        mem.check(free, what)?;
    }
    Ok((backend, ckpt))
}

fn progress_bar(total: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading weights {bar:40} {pos}/{len} tensors {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

/// Uploads the checkpoint to `backend` split into `world` shards (`--tp`), all on that
/// backend, with a progress bar on stderr.
pub fn load_sharded_with_progress(
    config: &ModelConfig,
    backend: Arc<dyn Backend>,
    ckpt: &Checkpoint,
    world: usize,
) -> Result<ShardedModel> {
    let bar = progress_bar(ShardedModel::tensor_count(config, world) as u64);
    let t0 = Instant::now();
    let model = ShardedModel::from_checkpoint(
        config.clone(),
        ckpt,
        vec![backend; world],
        &mut |done, _| bar.set_position(done as u64),
    );
    bar.finish_and_clear();
    let model = model?;
    log::info!(
        "loaded {} of weights in {:.2} s into {world} shards holding {:?} bytes",
        gib(model.loaded_bytes()),
        t0.elapsed().as_secs_f64(),
        model.rank_weight_bytes()
    );
    Ok(model)
}

/// Uploads the checkpoint to `backend` with a progress bar on stderr.
pub fn load_with_progress(
    config: &ModelConfig,
    backend: Arc<dyn Backend>,
    ckpt: &Checkpoint,
) -> Result<Model> {
    let bar = progress_bar(Model::tensor_count(config) as u64);
    let t0 = Instant::now();
    let model = Model::from_checkpoint(config.clone(), ckpt, backend, &mut |done, _| {
        bar.set_position(done as u64)
    });
    bar.finish_and_clear();
    let model = model?;
    log::info!(
        "loaded {} of weights in {:.2} s ({} on the device)",
        gib(model.loaded_bytes()),
        t0.elapsed().as_secs_f64(),
        gib(model.weight_bytes())
    );
    Ok(model)
}
