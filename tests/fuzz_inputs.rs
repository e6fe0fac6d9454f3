//! Bounded fuzzing of everything a user hands the loader: `config.json`, the safetensors
//! header, the sharded index and `tokenizer.json`. Each case mutates one checked-in tiny
//! checkpoint (structured edits with values chosen to break size arithmetic — 2^32 + 1,
//! 2^60, 1e39, 1e-300, −1, wrong types — plus raw byte edits), then loads it the way
//! `mla-run` does (config, checkpoint, memory plan, weights on the CPU backend, one forward
//! step) under a deadline. The rule: no panic, no abort, no hang — a clear error or a
//! working model. A failing input is written under the temp dir and named in the message.
//!
//! `SPARSE_MLA_FUZZ_CASES` sets the cases per target (default 150; CI uses the default, a
//! few seconds each); `SPARSE_MLA_SEED` replays a run.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sparse_mla::model::config::ModelConfig;
use sparse_mla::model::memory;
use sparse_mla::model::tokenizer::TextTokenizer;
use sparse_mla::model::weights::Checkpoint;
use sparse_mla::model::{CacheOptions, Logits, Model};
use sparse_mla::runtime::cpu::CpuBackend;
use sparse_mla::testing::test_seed;
use sparse_mla::util::Rng;

/// One case may take this long before it counts as a hang (the tiny model loads and runs a
/// step in well under a second).
const DEADLINE: Duration = Duration::from_secs(30);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn cases() -> usize {
    std::env::var("SPARSE_MLA_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150)
}

/// A model directory under the temp dir: the fixture's files (copied or linked), some
/// replaced by the case.
struct CaseDir(PathBuf);

impl CaseDir {
    fn new(target: &str, case: usize, base: &Path) -> Self {
        let p = std::env::temp_dir().join(format!(
            "sparse-mla-fuzz-{target}-{case}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        for e in std::fs::read_dir(base).unwrap() {
            let e = e.unwrap();
            std::os::unix::fs::symlink(e.path(), p.join(e.file_name())).unwrap();
        }
        CaseDir(p)
    }

    fn put(&self, name: &str, bytes: &[u8]) {
        let path = self.0.join(name);
        let _ = std::fs::remove_file(&path);
        std::fs::write(path, bytes).unwrap();
    }

    /// Keep the directory (the failing input) and say where it is.
    fn keep(self) -> String {
        let s = self.0.display().to_string();
        std::mem::forget(self);
        s
    }
}

impl Drop for CaseDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What loading a case gave: an error message, or a model that ran a step.
enum Verdict {
    Error(String),
    Ran,
}

/// Loads `dir` as mla-run does and runs one step of two tokens on the CPU backend.
fn load_and_step(dir: &Path) -> Verdict {
    let r = (|| -> sparse_mla::Result<()> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir, config.fp8.map(|f| f.block))?;
        let opts = CacheOptions {
            max_seq_len: 64,
            ..CacheOptions::default()
        };
        opts.validate()?;
        let plan = memory::plan(&config, &ckpt, &opts, 2)?;
        // The tiny checkpoint holds a few MiB; a plan past 1 GiB must have been refused by
        // the shape check below, so do not let the case allocate it.
        if plan.total() > 1 << 30 {
            sparse_mla::model::params::check_checkpoint(&config, &ckpt)?;
            panic!(
                "the checkpoint passed its checks but the plan wants {} bytes",
                plan.total()
            );
        }
        let model = Model::from_checkpoint(
            config,
            &ckpt,
            std::sync::Arc::new(CpuBackend::new()),
            &mut |_, _| {},
        )?;
        let mut seq = model.new_sequence(opts)?;
        let vocab = model.config.vocab_size as u32;
        model.forward(&mut seq, &[1 % vocab, 2 % vocab], Logits::Last)?;
        Ok(())
    })();
    match r {
        Ok(()) => Verdict::Ran,
        Err(e) => Verdict::Error(e.to_string()),
    }
}

/// Runs `f` on its own thread under [`DEADLINE`]; a panic or a timeout fails the test with
/// the input's directory kept.
fn guarded(target: &str, what: &str, dir: CaseDir, f: fn(&Path) -> Verdict) -> Verdict {
    let (tx, rx) = mpsc::channel();
    let path = dir.0.clone();
    let t0 = Instant::now();
    std::thread::Builder::new()
        .name(format!("fuzz-{target}"))
        .spawn(move || {
            let r = std::panic::catch_unwind(|| f(&path));
            let _ = tx.send(r);
        })
        .unwrap();
    match rx.recv_timeout(DEADLINE) {
        Ok(Ok(v)) => {
            if let Verdict::Error(e) = &v {
                if std::env::var_os("SPARSE_MLA_FUZZ_VERBOSE").is_some() {
                    eprintln!("{target} {what}: {e}");
                }
                assert!(
                    !e.trim().is_empty(),
                    "{target}: empty error message for {what}"
                );
            }
            v
        }
        Ok(Err(_)) => panic!(
            "{target}: a panic for {what} (input kept at {})",
            dir.keep()
        ),
        Err(_) => panic!(
            "{target}: no answer after {:?} for {what} (a hang; input kept at {})",
            t0.elapsed(),
            dir.keep()
        ),
    }
}

/// Values that break size arithmetic, narrowing and float conversion.
fn nasty(rng: &mut Rng) -> Value {
    let pick = [
        json!(0),
        json!(1),
        json!(-1),
        json!(7),
        json!(3),
        json!(4_294_967_296u64 + 1),
        json!(1u64 << 60),
        json!(1u64 << 31),
        json!(u64::MAX),
        json!(1e39),
        json!(1e-300),
        json!(-0.0),
        json!(0.5),
        json!(1e308),
        json!("64"),
        json!(null),
        json!(true),
        json!([]),
        json!([1, 2]),
        json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1e30, "original_max_position_embeddings": 0}),
        json!({"rope_type": "nope"}),
        json!(["full", "shared"]),
    ];
    pick[rng.below(pick.len() as u64) as usize].clone()
}

/// A value near the original: doubled, halved, +1, −1.
fn nudge(rng: &mut Rng, v: &Value) -> Value {
    match v.as_u64() {
        Some(n) => match rng.below(4) {
            0 => json!(n.saturating_mul(2)),
            1 => json!(n / 2),
            2 => json!(n + 1),
            _ => json!(n.saturating_sub(1)),
        },
        None => nasty(rng),
    }
}

fn mutate_bytes(rng: &mut Rng, bytes: &mut Vec<u8>, lo: usize, hi: usize) {
    for _ in 0..1 + rng.below(3) {
        // the window as the bytes are now: an earlier removal may have shortened them
        let hi = hi.min(bytes.len());
        if hi <= lo {
            return;
        }
        let at = lo + rng.below((hi - lo) as u64) as usize;
        match rng.below(4) {
            0 => bytes[at] ^= 1 << rng.below(8),
            1 => bytes[at] = b"0123456789{}[]\",:-e."[rng.below(20) as usize],
            2 => {
                bytes.remove(at);
            }
            _ => bytes.insert(at, rng.below(256) as u8),
        }
    }
}

fn mutate_config(rng: &mut Rng, text: &str) -> Vec<u8> {
    if rng.below(5) == 0 {
        let mut b = text.as_bytes().to_vec();
        let n = b.len();
        mutate_bytes(rng, &mut b, 0, n);
        return b;
    }
    let mut v: Value = serde_json::from_str(text).unwrap();
    let obj = v.as_object_mut().unwrap();
    let keys: Vec<String> = obj.keys().cloned().collect();
    for _ in 0..1 + rng.below(2) {
        let k = &keys[rng.below(keys.len() as u64) as usize];
        match rng.below(5) {
            0 => {
                obj.remove(k);
            }
            1 | 2 => {
                // (a key the first mutation removed is nudged from null)
                let old = obj.get(k).cloned().unwrap_or(Value::Null);
                obj.insert(k.clone(), nudge(rng, &old));
            }
            _ => {
                obj.insert(k.clone(), nasty(rng));
            }
        }
    }
    if rng.below(6) == 0 {
        // The keys an older or newer checkpoint may carry.
        let extra = [
            "num_experts",
            "rope_scaling",
            "quantization_config",
            "index_topk_pattern",
            "moe_layer_freq",
        ];
        obj.insert(
            extra[rng.below(extra.len() as u64) as usize].to_string(),
            nasty(rng),
        );
    }
    serde_json::to_vec(&v).unwrap()
}

#[test]
fn mutated_configs_load_or_fail_clearly() {
    let seed = test_seed();
    eprintln!("fuzz config.json: seed {seed} (SPARSE_MLA_SEED replays)");
    let mut rng = Rng::new(seed);
    let (mut errors, mut ran) = (0, 0);
    for case in 0..cases() {
        let base = fixture(if case % 2 == 0 {
            "glm_moe_dsa-tiny"
        } else {
            "deepseek_v32-tiny"
        });
        let text = std::fs::read_to_string(base.join("config.json")).unwrap();
        let dir = CaseDir::new("config", case, &base);
        dir.put("config.json", &mutate_config(&mut rng, &text));
        match guarded("config", &format!("case {case}"), dir, load_and_step) {
            Verdict::Error(_) => errors += 1,
            Verdict::Ran => ran += 1,
        }
    }
    eprintln!("fuzz config.json: {errors} clear errors, {ran} ran");
    assert!(errors > 0, "no mutation was refused: the mutator is broken");
}

#[test]
fn mutated_safetensors_headers_load_or_fail_clearly() {
    let seed = test_seed() ^ 0x5afe;
    eprintln!("fuzz safetensors header: seed {seed}");
    let mut rng = Rng::new(seed);
    let base = fixture("glm_moe_dsa-tiny");
    let original = std::fs::read(base.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    let (mut errors, mut ran) = (0, 0);
    for case in 0..cases() {
        let mut bytes = original.clone();
        match rng.below(6) {
            // the length prefix: huge, zero, off by a little
            0 => {
                let n = [
                    0u64,
                    1,
                    u64::MAX,
                    1 << 40,
                    header_len as u64 + 1,
                    header_len as u64 - 1,
                ][rng.below(6) as usize];
                bytes[..8].copy_from_slice(&n.to_le_bytes());
            }
            // truncated file
            1 => bytes.truncate(rng.below(original.len() as u64) as usize),
            // a number inside the header (shapes, offsets) replaced
            2 => {
                let header = String::from_utf8_lossy(&bytes[8..8 + header_len]).to_string();
                let digits: Vec<usize> = header
                    .char_indices()
                    .filter(|(_, c)| c.is_ascii_digit())
                    .map(|(i, _)| i)
                    .collect();
                let at = digits[rng.below(digits.len() as u64) as usize];
                let repl = ["4294967297", "18446744073709551615", "0", "9"][rng.below(4) as usize];
                let mut h = header.into_bytes();
                h.splice(at..at + 1, repl.bytes());
                let mut out = (h.len() as u64).to_le_bytes().to_vec();
                out.extend_from_slice(&h);
                out.extend_from_slice(&original[8 + header_len..]);
                bytes = out;
            }
            // a dtype renamed
            3 => {
                let header = String::from_utf8_lossy(&bytes[8..8 + header_len]).to_string();
                let to = ["F8_E4M3", "I64", "F16", "BOOL", "XYZ"][rng.below(5) as usize];
                let h =
                    header.replacen("\"BF16\"", &format!("\"{to}\""), 1 + rng.below(3) as usize);
                let h = format!("{h:<width$}", width = header_len.max(h.len()));
                let mut out = (h.len() as u64).to_le_bytes().to_vec();
                out.extend_from_slice(h.as_bytes());
                out.extend_from_slice(&original[8 + header_len..]);
                bytes = out;
            }
            // raw bytes of the header
            _ => mutate_bytes(&mut rng, &mut bytes, 8, 8 + header_len),
        }
        let dir = CaseDir::new("safetensors", case, &base);
        dir.put("model.safetensors", &bytes);
        match guarded("safetensors", &format!("case {case}"), dir, load_and_step) {
            Verdict::Error(_) => errors += 1,
            Verdict::Ran => ran += 1,
        }
    }
    eprintln!("fuzz safetensors header: {errors} clear errors, {ran} ran");
    assert!(errors > 0, "no mutation was refused: the mutator is broken");
}

#[test]
fn mutated_shard_indexes_load_or_fail_clearly() {
    let seed = test_seed() ^ 0x1d3;
    eprintln!("fuzz sharded index: seed {seed}");
    let mut rng = Rng::new(seed);
    let base = fixture("glm_moe_dsa-tiny");
    let st = std::fs::read(base.join("model.safetensors")).unwrap();
    let names: Vec<String> = safetensors::SafeTensors::deserialize(&st)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect();
    let (mut errors, mut ran) = (0, 0);
    for case in 0..cases().min(60) {
        let mut map = serde_json::Map::new();
        for n in &names {
            map.insert(n.clone(), json!("model.safetensors"));
        }
        let n = &names[rng.below(names.len() as u64) as usize];
        let bad = [
            json!("model-00002-of-00002.safetensors"),
            json!("../glm_moe_dsa-tiny/model.safetensors"),
            json!("/etc/passwd"),
            json!(""),
            json!(7),
            json!(null),
            json!("config.json"),
            json!("tokenizer.json"),
        ];
        let which = rng.below(bad.len() as u64 + 2) as usize;
        let index = match which {
            w if w < bad.len() => {
                map.insert(n.clone(), bad[w].clone());
                json!({ "metadata": {}, "weight_map": map })
            }
            w if w == bad.len() => json!({ "weight_map": {} }),
            _ => json!({ "weight_map": [1, 2] }),
        };
        let dir = CaseDir::new("index", case, &base);
        dir.put(
            "model.safetensors.index.json",
            &serde_json::to_vec(&index).unwrap(),
        );
        match guarded("index", &format!("case {case}"), dir, load_and_step) {
            Verdict::Error(_) => errors += 1,
            Verdict::Ran => ran += 1,
        }
    }
    eprintln!("fuzz sharded index: {errors} clear errors, {ran} ran");
    assert!(errors > 0, "no mutation was refused: the mutator is broken");
}

/// Loads `dir/tokenizer.json`, encodes a prompt and decodes both the ids and ids the model
/// could emit that the tokenizer does not know.
fn tokenize(dir: &Path) -> Verdict {
    let r = (|| -> sparse_mla::Result<()> {
        let tok = TextTokenizer::from_file(&dir.join("tokenizer.json"))?;
        let ids = tok.encode("The lightning indexer scores every earlier token, ünïcödé 🙂")?;
        tok.decode(&ids)?;
        let _ = tok.decode(&[0, 1, u32::MAX, tok.vocab_size() as u32 + 5]);
        Ok(())
    })();
    match r {
        Ok(()) => Verdict::Ran,
        Err(e) => Verdict::Error(e.to_string()),
    }
}

#[test]
fn mutated_tokenizers_load_or_fail_clearly() {
    let seed = test_seed() ^ 0x70c;
    eprintln!("fuzz tokenizer.json: seed {seed}");
    let mut rng = Rng::new(seed);
    let base = fixture("glm_moe_dsa-tiny");
    let text = std::fs::read_to_string(base.join("tokenizer.json")).unwrap();
    let (mut errors, mut ran) = (0, 0);
    for case in 0..cases() {
        let bytes = if rng.below(2) == 0 {
            let mut b = text.clone().into_bytes();
            let n = b.len();
            mutate_bytes(&mut rng, &mut b, 0, n);
            b
        } else {
            let mut v: Value = serde_json::from_str(&text).unwrap();
            let paths: [&[&str]; 6] = [
                &["model", "vocab"],
                &["model", "merges"],
                &["added_tokens"],
                &["pre_tokenizer"],
                &["decoder"],
                &["model", "type"],
            ];
            let p = paths[rng.below(paths.len() as u64) as usize];
            let mut at = &mut v;
            for k in &p[..p.len() - 1] {
                at = &mut at[*k];
            }
            let last = p[p.len() - 1];
            if rng.below(2) == 0 {
                at[last] = nasty(&mut rng);
            } else if let Some(o) = at[last].as_object_mut() {
                // a vocabulary entry with a huge or negative id
                let k = o.keys().next().cloned();
                if let Some(k) = k {
                    o.insert(k, nasty(&mut rng));
                }
            } else if let Some(a) = at[last].as_array_mut() {
                if !a.is_empty() {
                    let i = rng.below(a.len() as u64) as usize;
                    a[i] = nasty(&mut rng);
                }
            }
            serde_json::to_vec(&v).unwrap()
        };
        let dir = CaseDir::new("tokenizer", case, &base);
        dir.put("tokenizer.json", &bytes);
        match guarded("tokenizer", &format!("case {case}"), dir, tokenize) {
            Verdict::Error(_) => errors += 1,
            Verdict::Ran => ran += 1,
        }
    }
    eprintln!("fuzz tokenizer.json: {errors} clear errors, {ran} ran");
    assert!(errors > 0, "no mutation was refused: the mutator is broken");
}
