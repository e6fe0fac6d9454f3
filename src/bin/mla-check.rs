//! mla-check: the conformance suite on every backend this machine has.

use clap::Parser;
use sparse_mla::conformance::model::{fixtures_dir, model_cases};
use sparse_mla::conformance::{all_cases, Outcome};
use sparse_mla::runtime::{discover, BackendKind};
use sparse_mla::util::Rng;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Run the sparse-mla conformance suite on every backend found: each wgpu adapter
/// (Vulkan / Metal / DX12, and lavapipe on the CPU), each CUDA device, and the CPU
/// reference. Every case draws fresh random inputs, poisons the outputs and compares with
/// a float64 reference (docs/math.md tolerances).
///
/// Then the whole-model cases on each backend: the tiny GLM-5 and DeepSeek-V3.2 checkpoints
/// (tests/fixtures) against transformers' goldens with bf16 and fp8_ds_mla caches, FP8 weights
/// against their dequantised copy, batched steps against separate ones, a steady decode step
/// with no device allocation, a failed step that changes nothing, and the model sharded 1, 2
/// and 4 ways on the one device (model/tp*: heads, MLP width and experts split, the sums
/// through host memory) against itself unsharded.
///
/// Exits 1 when any case fails, and when no GPU (or lavapipe) backend could run at all,
/// so a green run always means kernels ran somewhere real. Absent backends are listed as
/// skipped with the reason.
///
/// Environment: WGPU_BACKEND (e.g. vulkan), WGPU_ADAPTER_NAME (substring), and for CUDA,
/// libnvrtc on LD_LIBRARY_PATH.
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// Only these backends (repeatable): cpu, wgpu, cuda.
    #[arg(long = "backend", value_name = "KIND")]
    backends: Vec<String>,
    /// Only cases whose name contains this.
    #[arg(long)]
    case: Option<String>,
    /// Seed for the inputs (default: fresh each run; printed in the table).
    #[arg(long)]
    seed: Option<u64>,
    /// Output: table (markdown, through comfy-table) or json (one object: rows, skipped, totals).
    #[arg(long, value_enum, default_value = "table")]
    format: OutputFormat,
    /// List the cases and exit.
    #[arg(long)]
    list: bool,
    /// Skip the whole-model cases.
    #[arg(long)]
    no_model: bool,
    /// Directory of the model fixtures (default: $SPARSE_MLA_FIXTURES, else tests/fixtures of
    /// the source tree the binary was built from, else ./tests/fixtures).
    #[arg(long, value_name = "DIR")]
    fixtures: Option<PathBuf>,
    /// Instead of the suite: N random sparse-decode launches per backend (H 1-128, topk
    /// 1-4096, T 1-256, page sizes, invalid indices, splits, both cache formats), each checked
    /// against the float64 reference, under a watchdog (exit 3 on a hang).
    #[arg(long, value_name = "N")]
    stress: Option<usize>,
    /// Stress: the largest T x H x topk of one launch (bounds the host reference's time).
    #[arg(long, value_name = "PAIRS", default_value_t = 1 << 19)]
    max_pairs: u64,
    /// Stress: seconds one launch may take before it counts as a hang.
    #[arg(long, value_name = "S", default_value_t = 60.0)]
    watchdog: f64,
    /// Run the dense linear with this many weight rows per warp at every batch (default: the
    /// policy, 1 at one token and 4 from four), to check a variant before it becomes the policy.
    #[arg(long, value_name = "R", value_parser = clap::builder::PossibleValuesParser::new(["1", "4"]))]
    linear_rows: Option<String>,
}

/// `--stress N`: the random-launch run on every backend asked for; exit 1 on any wrong
/// output or refused launch (a hang exits 3 from the watchdog).
fn stress(args: &Args, kinds: &[BackendKind], n: usize) -> ExitCode {
    use sparse_mla::conformance::stress::{run, StressOptions};
    if n == 0 || !args.watchdog.is_finite() || args.watchdog <= 0.0 || args.max_pairs == 0 {
        eprintln!("mla-check: --stress, --max-pairs and --watchdog must be positive");
        return ExitCode::from(2);
    }
    let mut ok = true;
    let mut ran = false;
    for (kind, backend) in discover(kinds) {
        let backend = match backend {
            Ok(b) => b,
            Err(e) => {
                eprintln!("SKIPPED {kind}: {e}");
                continue;
            }
        };
        ran |= backend.kind() != BackendKind::Cpu;
        let seed = args.seed.unwrap_or_else(Rng::fresh_seed);
        eprintln!(
            "== stress {kind}: {}: {n} launches, seed {seed}",
            backend.device_name()
        );
        let opts = StressOptions {
            launches: n,
            seed,
            max_pairs: args.max_pairs,
            watchdog_s: args.watchdog,
            threads: 0,
        };
        let step = (n / 10).max(1);
        let r = run(backend.as_ref(), &opts, &mut |done| {
            if done % step == 0 {
                eprintln!("   {done}/{n}");
            }
        });
        for f in &r.failures {
            eprintln!("   FAIL {f}");
        }
        println!(
            "stress {kind} | {} | launches {} | wrong {} | errors {} | hangs {} | splits refused {} | worst rel L2 {:.2e} | worst lse {:.2e} | slowest {:.3} s | {:.1} s | seed {seed} | {}",
            backend.device_name(),
            r.launches,
            r.wrong,
            r.errors,
            r.hangs,
            r.refused_splits,
            r.worst_rel_l2,
            r.worst_lse,
            r.slowest_s,
            r.seconds,
            if r.passed() { "PASS" } else { "FAIL" }
        );
        ok &= r.passed();
    }
    if !ran {
        eprintln!("mla-check: no GPU (or lavapipe) backend could run the stress");
        return ExitCode::FAILURE;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum OutputFormat {
    Table,
    Json,
}

struct Row {
    backend: String,
    device: String,
    outcome: Result<Outcome, String>,
    case: String,
}

fn main() -> ExitCode {
    env_logger::init();
    let args = Args::parse();
    if let Some(r) = &args.linear_rows {
        sparse_mla::kernels::linear::set_rows_per_warp(r.parse().unwrap_or(0));
        eprintln!("mla-check: dense linear with {r} weight row(s) per warp at every batch");
    }
    let cases: Vec<_> = all_cases()
        .into_iter()
        .filter(|c| {
            args.case
                .as_ref()
                .is_none_or(|f| c.name().contains(f.as_str()))
        })
        .collect();
    let models: Vec<_> = if args.no_model {
        Vec::new()
    } else {
        model_cases()
            .into_iter()
            .filter(|c| {
                args.case
                    .as_ref()
                    .is_none_or(|f| c.name.contains(f.as_str()))
            })
            .collect()
    };
    let fixtures = args.fixtures.clone().unwrap_or_else(fixtures_dir);
    if args.list {
        for c in &cases {
            println!("{}", c.name());
        }
        for c in &models {
            println!("{}", c.name);
        }
        return ExitCode::SUCCESS;
    }
    let kinds: Vec<BackendKind> = if args.backends.is_empty() {
        vec![BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda]
    } else {
        match args
            .backends
            .iter()
            .map(|b| BackendKind::parse(b))
            .collect()
        {
            Ok(k) => k,
            Err(e) => {
                eprintln!("mla-check: {e}");
                return ExitCode::from(2);
            }
        }
    };
    if let Some(n) = args.stress {
        return stress(&args, &kinds, n);
    }
    if cases.is_empty() && models.is_empty() {
        eprintln!(
            "mla-check: no case matches --case {:?}",
            args.case.unwrap_or_default()
        );
        return ExitCode::from(2);
    }
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    let mut gpu_ran = false;
    for (kind, backend) in discover(&kinds) {
        let backend = match backend {
            Ok(b) => b,
            Err(e) => {
                skipped.push(format!("{kind}: {e}"));
                continue;
            }
        };
        if backend.kind() != BackendKind::Cpu {
            gpu_ran = true;
        }
        let device = backend.device_name();
        eprintln!("== {kind}: {device}");
        for case in &cases {
            let seed = args.seed.unwrap_or_else(Rng::fresh_seed);
            let outcome = case.run(backend.as_ref(), seed).map_err(|e| e.to_string());
            match &outcome {
                Ok(o) => eprintln!(
                    "   {:<44} {}",
                    o.case,
                    if o.passed() { "ok" } else { "FAIL" }
                ),
                Err(e) => eprintln!("   {:<44} ERROR {e}", case.name()),
            }
            rows.push(Row {
                backend: kind.clone(),
                device: device.clone(),
                outcome,
                case: case.name(),
            });
        }
        if models.is_empty() {
            continue;
        }
        if !fixtures.join("glm_moe_dsa-tiny").is_dir() {
            skipped.push(format!(
                "{kind} model cases: no fixtures at {} (give --fixtures DIR)",
                fixtures.display()
            ));
            continue;
        }
        let shared: Arc<dyn sparse_mla::runtime::Backend> = Arc::from(backend);
        for case in &models {
            let outcome = case
                .run(shared.clone(), &fixtures)
                .map_err(|e| e.to_string());
            match &outcome {
                Ok(o) => eprintln!(
                    "   {:<44} {}",
                    o.case,
                    if o.passed() { "ok" } else { "FAIL" }
                ),
                Err(e) => eprintln!("   {:<44} ERROR {e}", case.name),
            }
            rows.push(Row {
                backend: kind.clone(),
                device: device.clone(),
                outcome,
                case: case.name.clone(),
            });
        }
    }
    let failures: Vec<&Row> = rows
        .iter()
        .filter(|r| !matches!(&r.outcome, Ok(o) if o.passed()))
        .collect();
    let passed = rows.len() - failures.len();
    let cpu_only_asked = kinds == [BackendKind::Cpu];
    let nothing_real = !gpu_ran && !cpu_only_asked;
    match args.format {
        OutputFormat::Json => {
            println!(
                "{}",
                report_json(&rows, &skipped, passed, failures.len(), nothing_real)
            );
        }
        OutputFormat::Table => {
            println!("{}", table(&rows));
            for s in &skipped {
                println!("SKIPPED {s}");
            }
            for r in &failures {
                match &r.outcome {
                    Ok(o) => println!(
                        "FAILED {} on {} (seed {}): {}",
                        r.case,
                        r.backend,
                        o.seed,
                        o.failures.join("; ")
                    ),
                    Err(e) => println!("FAILED {} on {}: {e}", r.case, r.backend),
                }
            }
            println!(
                "{passed} passed, {} failed, {} backends skipped",
                failures.len(),
                skipped.len()
            );
        }
    }
    if !failures.is_empty() {
        return ExitCode::FAILURE;
    }
    if nothing_real {
        let why = "no GPU or lavapipe backend could run: nothing was checked on a real device";
        match args.format {
            OutputFormat::Table => println!("{why}"),
            OutputFormat::Json => eprintln!("{why}"),
        }
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// The results as a markdown table: full device names, the seed of each case, the backend's
/// choices (`detail`) in a column of their own, never cut.
fn table(rows: &[Row]) -> comfy_table::Table {
    use comfy_table::{presets::ASCII_MARKDOWN, CellAlignment, Table};
    let mut t = Table::new();
    t.load_preset(ASCII_MARKDOWN);
    t.set_header([
        "backend", "device", "case", "seed", "rel L2", "max abs", "lse err", "detail", "result",
        "ms",
    ]);
    for r in rows {
        let cells: Vec<String> = match &r.outcome {
            Ok(o) => vec![
                r.backend.clone(),
                r.device.clone(),
                o.case.clone(),
                o.seed.to_string(),
                format!("{:.2e}", o.rel_l2),
                format!("{:.2e}", o.max_abs),
                format!("{:.2e}", o.lse_err),
                o.detail.clone(),
                if o.passed() { "ok" } else { "FAIL" }.into(),
                format!("{:.1}", o.seconds * 1e3),
            ],
            Err(e) => vec![
                r.backend.clone(),
                r.device.clone(),
                r.case.clone(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                e.lines().next().unwrap_or("").to_string(),
                "ERROR".into(),
                "-".into(),
            ],
        };
        t.add_row(cells);
    }
    for i in [3, 4, 5, 6, 9] {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// The results as one JSON object (`--format json`).
fn report_json(
    rows: &[Row],
    skipped: &[String],
    passed: usize,
    failed: usize,
    nothing_real: bool,
) -> String {
    use serde_json::json;
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| match &r.outcome {
            Ok(o) => json!({
                "backend": r.backend, "device": r.device, "case": o.case, "seed": o.seed,
                "rel_l2": o.rel_l2, "max_abs": o.max_abs, "lse_err": o.lse_err,
                "detail": o.detail, "passed": o.passed(), "failures": o.failures,
                "ms": o.seconds * 1e3,
            }),
            Err(e) => json!({
                "backend": r.backend, "device": r.device, "case": r.case,
                "passed": false, "error": e,
            }),
        })
        .collect();
    json!({
        "rows": rows, "skipped": skipped, "passed": passed, "failed": failed,
        "no_real_device": nothing_real,
    })
    .to_string()
}
