//! `mla-run` as a user runs it: no arguments, JSON output, ids without a tokenizer, and the
//! errors a user can hit.

use std::path::Path;
use std::process::{Command, Output};

fn mla_run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mla-run"))
        .args(args)
        .output()
        .expect("mla-run runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn no_arguments_runs_the_tiny_glm5_and_reports_speed() {
    let out = mla_run(&[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("glm_moe_dsa-tiny"),
        "says which model it runs: {stderr}"
    );
    let last = stdout.lines().last().unwrap_or("");
    for word in ["prompt", "prefill", "decode", "tok/s", "peak memory"] {
        assert!(last.contains(word), "last line lacks `{word}`: {last}");
    }
}

#[test]
fn json_output_is_one_object_per_token_and_a_summary() {
    let out = mla_run(&[
        "-n",
        "5",
        "--output",
        "json",
        "--kv-cache",
        "fp8",
        "--temperature",
        "0.7",
        "--seed",
        "9",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    let (tokens, summary) = lines.split_at(lines.len() - 1);
    assert!(!tokens.is_empty() && tokens.len() <= 5);
    for t in tokens {
        assert!(
            t["id"].is_u64() && t["text"].is_string() && t["logprob"].as_f64().unwrap() <= 0.0,
            "{t}"
        );
    }
    assert_eq!(
        summary[0]["generated_tokens"].as_u64().unwrap() as usize,
        tokens.len()
    );
    assert!(summary[0]["decode_tok_s"].is_number());
}

#[test]
fn prompt_ids_work_without_a_tokenizer() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v32-tiny");
    let dir = std::env::temp_dir().join(format!("mla-run-notok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    let d = dir.to_str().unwrap();
    let out = mla_run(&[
        "--model",
        d,
        "--prompt-ids",
        "3,1,4,1,5,9,2,6",
        "-n",
        "4",
        "--output",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let first: serde_json::Value =
        serde_json::from_str(text(&out.stdout).lines().next().unwrap()).unwrap();
    assert!(first["id"].is_u64() && first["text"].is_null(), "{first}");

    let out = mla_run(&["--model", d, "--prompt", "hello"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("tokenizer.json"),
        "{}",
        text(&out.stderr)
    );

    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let out = mla_run(&["--model", d, "--prompt-ids", "1,2"]);
    assert!(
        text(&out.stderr).contains("model.safetensors"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn user_errors_are_one_line_not_panics() {
    for (args, needle) in [
        (vec!["--device", "cuda:0"], "unavailable"),
        (
            vec!["--prompt-ids", "1,2,3,4,5,6", "--max-seq-len", "5"],
            "max-seq-len",
        ),
        (vec!["--prompt-ids", "999999"], "vocabulary"),
        (vec!["--model", "/no/such/dir"], "does not exist"),
        (
            vec![
                "--model",
                concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/tests/fixtures/glm_moe_dsa-tiny/config.json"
                ),
            ],
            "is a file",
        ),
        (vec!["--temperature", "-1"], "--temperature"),
        (vec!["--top-p", "0"], "--top-p"),
        (vec!["--top-p", "1.5"], "--top-p"),
        (vec!["--tp", "0"], "--tp"),
        // The tiny GLM-5 has 4 heads.
        (vec!["--tp", "3"], "num_attention_heads"),
        // 10^8 positions: ~500 GB of cache, refused by the memory plan before allocating
        (
            vec!["--device", "cpu", "--max-seq-len", "100000000"],
            "lower --max-seq-len",
        ),
    ] {
        let out = mla_run(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        let err_lines: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(err_lines.len(), 1, "{args:?}: {stderr}");
        assert!(err_lines[0].contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// `--bench --profile` on the CPU reference: a row per op of the timed steps, the decode and
/// the linears among them, calls that are whole multiples of the steps, shares that add up.
#[test]
fn bench_profile_tables_every_op_of_the_timed_steps() {
    let steps = 4;
    let out = mla_run(&[
        "--device",
        "cpu",
        "--prompt-ids",
        "1,2,3",
        "-n",
        &steps.to_string(),
        "--bench",
        "--profile",
        "--output",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(text(&out.stdout).trim()).expect("one JSON object");
    let rows = v["profile"].as_array().expect("a profile array");
    let names: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    for want in ["sparse_mla_decode", "linear", "norm", "sample"] {
        assert!(
            names.iter().any(|n| n.contains(want)),
            "no `{want}` row: {names:?}"
        );
    }
    // the tiny GLM-5 has 4 layers: one decode call each, every timed step
    let decodes: u64 = rows
        .iter()
        .filter(|r| r["op"].as_str().unwrap().starts_with("sparse_mla_decode"))
        .map(|r| r["calls"].as_u64().unwrap())
        .sum();
    assert_eq!(decodes, 4 * steps, "{rows:?}");
    let mut total = 0.0;
    for r in rows {
        let calls = r["calls"].as_u64().unwrap();
        assert!(calls > 0, "{r}");
        let ms = r["ms_per_step"].as_f64().unwrap();
        let us = r["us_per_call"].as_f64().unwrap();
        assert!(ms > 0.0 && us > 0.0, "{r}");
        let per_step = calls as f64 / steps as f64;
        assert!(
            (us * per_step / 1e3 - ms).abs() <= 1e-6 * ms.max(1.0),
            "{r}"
        );
        total += ms;
    }
    // the ops are most of the step (the rest is the host's loop around them)
    let step = v["median_ms_per_token"].as_f64().unwrap();
    assert!(
        total > 0.3 * step && total < 3.0 * step,
        "{total} ms of ops in a {step} ms step"
    );
    // rows are sorted, the most time first
    let ms: Vec<f64> = rows
        .iter()
        .map(|r| r["ms_per_step"].as_f64().unwrap())
        .collect();
    assert!(ms.windows(2).all(|w| w[0] >= w[1]), "{ms:?}");

    let out = mla_run(&["--profile"]);
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--bench"),
        "{stderr}"
    );
}

/// `mla-run --tp 2` and `--tp 4` (the shards on one device, sums through host memory) on the
/// CPU reference generate the unsharded run's greedy tokens on both fixtures.
#[test]
fn tp_shards_generate_the_unsharded_tokens() {
    use sparse_mla::conformance::model::fixtures_dir;
    let ids = |out: &Output| -> Vec<u64> {
        text(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["id"].as_u64())
            .collect()
    };
    for name in ["glm_moe_dsa-tiny", "deepseek_v32-tiny"] {
        let dir = fixtures_dir().join(name);
        let base = [
            "--device",
            "cpu",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "5,17,3,99,250,8,1,42,7",
            "-n",
            "12",
            "--output",
            "json",
        ];
        let whole = mla_run(&base);
        assert!(whole.status.success(), "{}", text(&whole.stderr));
        let want = ids(&whole);
        assert_eq!(want.len(), 12, "{name}");
        for tp in ["2", "4"] {
            let args: Vec<&str> = base.iter().copied().chain(["--tp", tp]).collect();
            let out = mla_run(&args);
            let stderr = text(&out.stderr);
            assert!(out.status.success(), "{name} --tp {tp}: {stderr}");
            assert!(stderr.contains(&format!("{tp} shards")), "{stderr}");
            assert_eq!(ids(&out), want, "{name} --tp {tp}");
        }
    }
}

/// `mla-run --device wgpu` (lavapipe in CI) on both fixtures gives transformers' greedy
/// tokens for the golden prompt, up to the first step whose golden top-2 gap is under twice
/// the largest logit error the bf16 path shows (≤ 1e-2 on every backend: a smaller gap could
/// flip); from there an equally valid path may differ.
#[test]
fn mla_run_on_wgpu_gives_the_golden_tokens() {
    use sparse_mla::conformance::model::{fixtures_dir, load_golden};
    for name in ["glm_moe_dsa-tiny", "deepseek_v32-tiny"] {
        let dir = fixtures_dir().join(name);
        let g = load_golden(&dir).unwrap();
        let ids: Vec<String> = g.prompt_ids.iter().map(|i| i.to_string()).collect();
        let n = g.generated.len().to_string();
        let out = mla_run(&[
            "--device",
            "wgpu",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            &ids.join(","),
            "-n",
            &n,
            "--output",
            "json",
        ]);
        let stderr = text(&out.stderr);
        if !out.status.success() && stderr.contains("wgpu backend unavailable") {
            // An absent backend is a skip (or a failure where CI requires it).
            assert!(
                !std::env::var("SPARSE_MLA_REQUIRE")
                    .unwrap_or_default()
                    .contains("wgpu"),
                "wgpu required: {stderr}"
            );
            eprintln!("SKIPPED wgpu: {stderr}");
            return;
        }
        assert!(out.status.success(), "{name}: {stderr}");
        let got: Vec<u32> = text(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["id"].as_u64().map(|i| i as u32))
            .collect();
        let gaps = g.meta["greedy_logit_gaps"].as_array().unwrap();
        let trusted = gaps
            .iter()
            .position(|v| v.as_f64().unwrap_or(0.0) < 0.02)
            .unwrap_or(gaps.len());
        assert!(
            trusted >= 3,
            "{name}: only {trusted} steps with a clear golden gap"
        );
        assert_eq!(
            &got[..trusted],
            &g.generated[..trusted],
            "{name}: mla-run --device wgpu vs transformers' greedy tokens"
        );
        eprintln!("{name}: mla-run --device wgpu: {trusted} greedy tokens equal transformers'");
    }
}
