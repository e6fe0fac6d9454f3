//! `mla-serve` over loopback with a real HTTP client, on the tiny GLM-5 on every backend
//! present (CPU reference, wgpu / lavapipe; an absent one is skipped with its reason, or fails
//! when SPARSE_MLA_REQUIRE names it): whole and streamed answers equal the plain
//! single-sequence decode, 16 concurrent clients each get exactly their own tokens, a client
//! that disconnects frees its sequence, preemption under a small page pool changes no output,
//! shutdown drains in-flight requests, and every bad request is a 4xx naming the field (the
//! HTTP-only cases on the CPU reference alone).

#![cfg(feature = "serve")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sparse_mla::chat::{ChatMessage, ChatTemplate};
use sparse_mla::model::{CacheOptions, Logits, Model, Sampler, SamplerConfig, TextTokenizer};
use sparse_mla::runtime::{Backend, BackendKind};
use sparse_mla::serve::{EngineOptions, ServeOptions, Server};

const FIXTURE: &str = "glm_moe_dsa-tiny";
const NAME: &str = "tiny";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(FIXTURE)
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::from_file(&fixture().join("tokenizer.json")).unwrap()
}

fn engine_opts(max_seqs: usize, page_size: usize, pages: Option<usize>) -> EngineOptions {
    EngineOptions {
        cache: CacheOptions {
            page_size,
            max_seq_len: 256,
            max_seqs,
            num_pages: pages,
            ..Default::default()
        },
        max_step_tokens: 128,
        cuda_graphs: false,
    }
}

fn start(backend: Arc<dyn Backend>, engine: EngineOptions) -> Server {
    let opts = ServeOptions {
        addr: "127.0.0.1:0".parse().unwrap(),
        model_name: NAME.into(),
        engine,
        max_queue: 64,
        drain_timeout: Duration::from_secs(20),
    };
    let dir = fixture();
    let load = Box::new(move || Model::load(&dir, backend, &mut |_, _| {}));
    Server::start(
        opts,
        load,
        Some(Arc::new(tokenizer())),
        ChatTemplate::from_model_dir(&fixture()).unwrap(),
    )
    .expect("server starts")
}

/// A client whose timeout only catches a server that never answers: through lavapipe on a
/// 2-core machine with a build beside it, one preempted request took over 120 s (CI run of
/// 2026-12-03), so the bound is far above any honest wait and far below CI's limit.
fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()
        .unwrap()
}

/// What one sequence decoded alone gives: `n` tokens (end-of-sequence ignored), sampled as
/// `cfg` says — the single-stream loop of `mla-run`.
struct Reference {
    model: Model,
}

impl Reference {
    fn new(backend: Arc<dyn Backend>) -> Self {
        Reference {
            model: Model::load(&fixture(), backend, &mut |_, _| {}).unwrap(),
        }
    }

    fn decode(&self, prompt: &[u32], n: usize, cfg: SamplerConfig) -> Vec<u32> {
        let mut seq = self
            .model
            .new_sequence(CacheOptions {
                max_seq_len: 256,
                ..Default::default()
            })
            .unwrap();
        let mut sampler = Sampler::new(cfg).unwrap();
        let mut logits = self
            .model
            .forward_on_device(&mut seq, prompt, Logits::Last)
            .unwrap();
        let mut out = Vec::new();
        for i in 0..n {
            let id = sampler.sample(self.model.device(), &logits).unwrap()[0].id;
            out.push(id);
            if i + 1 < n {
                logits = self
                    .model
                    .forward_on_device(&mut seq, &[id], Logits::Last)
                    .unwrap();
            }
        }
        out
    }
}

fn post(c: &reqwest::blocking::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = c.post(url).json(body).send().expect("request sent");
    let status = r.status().as_u16();
    (status, r.json().expect("a JSON body"))
}

/// The `data:` payloads of an SSE response, up to `[DONE]` (which must come).
fn sse(c: &reqwest::blocking::Client, url: &str, body: &Value) -> Vec<Value> {
    let r = c.post(url).json(body).send().expect("request sent");
    assert_eq!(r.status().as_u16(), 200);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.expect("stream reads");
        if let Some(data) = line.strip_prefix("data: ") {
            if data == "[DONE]" {
                return out;
            }
            out.push(serde_json::from_str(data).expect("each event is JSON"));
        }
    }
    panic!("the stream ended without [DONE]: {out:?}");
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token_ids")
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Streamed chunks of one choice: (text, token ids, finish_reason).
fn gather(chunks: &[Value], chat: bool) -> (String, Vec<u32>, String) {
    let (mut text, mut ids, mut finish) = (String::new(), Vec::new(), String::new());
    for c in chunks {
        for ch in c["choices"].as_array().unwrap() {
            let t = if chat {
                ch["delta"]["content"].as_str()
            } else {
                ch["text"].as_str()
            };
            text.push_str(t.unwrap_or(""));
            if let Some(v) = ch.get("token_ids") {
                ids.extend(ids_of(v));
            }
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (text, ids, finish)
}

fn greedy() -> SamplerConfig {
    SamplerConfig::default()
}

fn sampled(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 20,
        seed,
    }
}

fn sampling_json(cfg: &SamplerConfig) -> Value {
    json!({"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "seed": cfg.seed})
}

fn merge(mut a: Value, b: Value) -> Value {
    for (k, v) in b.as_object().unwrap() {
        a[k] = v.clone();
    }
    a
}

/// Polls the server's counters until `ok` holds (or panics after `secs`).
fn wait_for(
    server: &Server,
    secs: u64,
    what: &str,
    ok: impl Fn(&sparse_mla::serve::EngineStats) -> bool,
) {
    let t0 = Instant::now();
    loop {
        let s = server.stats();
        if ok(&s) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn whole_and_streamed_equal_the_plain_decode(kind: BackendKind, n: usize) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    let server = start(backend.clone(), engine_opts(4, 64, None));
    let reference = Reference::new(backend);
    let c = client();
    let url = format!("{}/v1/completions", server.url());
    let tok = tokenizer();
    let text = "The lightning indexer scores every earlier token";
    let prompt = tok.encode(text).unwrap();
    for cfg in [greedy(), sampled(7)] {
        let want = reference.decode(&prompt, n, cfg);
        let body = merge(
            json!({"model": NAME, "prompt": text, "max_tokens": n, "ignore_eos": true, "return_token_ids": true}),
            sampling_json(&cfg),
        );
        let (status, whole) = post(&c, &url, &body);
        assert_eq!(status, 200, "{whole}");
        let choice = &whole["choices"][0];
        assert_eq!(
            ids_of(&choice["token_ids"]),
            want,
            "{cfg:?}: whole vs alone"
        );
        assert_eq!(ids_of(&choice["prompt_token_ids"]), prompt);
        assert_eq!(choice["text"], tok.decode(&want).unwrap());
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(whole["object"], "text_completion");
        assert_eq!(whole["usage"]["prompt_tokens"], prompt.len());
        assert_eq!(whole["usage"]["completion_tokens"], n);
        assert_eq!(whole["usage"]["total_tokens"], prompt.len() + n);

        let chunks = sse(
            &c,
            &url,
            &merge(
                body.clone(),
                json!({"stream": true, "stream_options": {"include_usage": true}}),
            ),
        );
        let (s_text, s_ids, finish) = gather(&chunks, false);
        assert_eq!(s_ids, want, "{cfg:?}: streamed vs alone");
        assert_eq!(s_text, choice["text"].as_str().unwrap());
        assert_eq!(finish, "length");
        let usage = &chunks.last().unwrap()["usage"];
        assert_eq!(usage["completion_tokens"], n, "{chunks:?}");
        assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    }
    // Token ids in, logprobs out: each chosen token's logprob, and the top-3 around it.
    let (status, v) = post(
        &c,
        &url,
        &json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 3, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3, "{lp}");
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            chosen <= 0.0 && (best - chosen).abs() < 1e-4,
            "greedy picks the top: {lp}"
        );
    }
}

fn chat_renders_the_template(kind: BackendKind) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    let server = start(backend.clone(), engine_opts(4, 64, None));
    let reference = Reference::new(backend);
    let c = client();
    let url = format!("{}/v1/chat/completions", server.url());
    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "What does the indexer do?"),
    ];
    let template = ChatTemplate::from_model_dir(&fixture()).unwrap().unwrap();
    let rendered = template.render(&messages, true).unwrap();
    let prompt = tokenizer().encode_with(&rendered, false).unwrap();
    let want = reference.decode(&prompt, 8, greedy());
    let body = json!({
        "model": NAME,
        "messages": messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
        "max_tokens": 8, "temperature": 0, "ignore_eos": true, "return_token_ids": true,
    });
    let (status, v) = post(&c, &url, &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(ids_of(&choice["prompt_token_ids"]), prompt);
    assert_eq!(ids_of(&choice["token_ids"]), want);
    assert_eq!(choice["message"]["role"], "assistant");
    let chunks = sse(&c, &url, &merge(body, json!({"stream": true})));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let (text, ids, finish) = gather(&chunks, true);
    assert_eq!(ids, want);
    assert_eq!(text, choice["message"]["content"].as_str().unwrap());
    assert_eq!(finish, "length");
}

/// 16 clients at once, each a different prompt, length, sampler and mode: every one gets
/// exactly the tokens its prompt gives decoded alone.
/// `lengths`: how many different prompt lengths (each new step shape costs lavapipe a compile).
fn sixteen_concurrent_clients(kind: BackendKind, max_new: usize, lengths: usize) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    let server = start(backend.clone(), engine_opts(16, 64, None));
    let reference = Reference::new(backend);
    let tok = tokenizer();
    let words = [
        "sparse",
        "latent",
        "attention",
        "reads",
        "only",
        "the",
        "slots",
        "it",
        "picks",
        "from",
        "a",
        "paged",
        "cache",
        "of",
        "rows",
    ];
    let jobs: Vec<(Vec<u32>, usize, SamplerConfig, bool)> = (0..16)
        .map(|i| {
            let text: Vec<&str> = (0..3 + i % lengths)
                .map(|k| words[(i * 5 + k) % words.len()])
                .collect();
            let prompt = tok.encode(&text.join(" ")).unwrap();
            let n = 2 + (i * 3) % (max_new - 1);
            let cfg = if i % 2 == 0 {
                greedy()
            } else {
                sampled(100 + i as u64)
            };
            (prompt, n, cfg, i % 3 == 0)
        })
        .collect();
    let t0 = Instant::now();
    let want: Vec<Vec<u32>> = jobs
        .iter()
        .map(|(p, n, cfg, _)| reference.decode(p, *n, *cfg))
        .collect();
    eprintln!(
        "{}: one at a time: {:.1} s",
        kind.name(),
        t0.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    let url = format!("{}/v1/completions", server.url());
    let barrier = Arc::new(std::sync::Barrier::new(jobs.len()));
    let handles: Vec<_> = jobs
        .iter()
        .cloned()
        .map(|(prompt, n, cfg, stream)| {
            let (url, barrier) = (url.clone(), barrier.clone());
            std::thread::spawn(move || {
                let c = client();
                let body = merge(
                    json!({"prompt": prompt, "max_tokens": n, "ignore_eos": true, "return_token_ids": true, "stream": stream}),
                    sampling_json(&cfg),
                );
                barrier.wait();
                if stream {
                    gather(&sse(&c, &url, &body), false).1
                } else {
                    let (status, v) = post(&c, &url, &body);
                    assert_eq!(status, 200, "{v}");
                    ids_of(&v["choices"][0]["token_ids"])
                }
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let got = h.join().expect("client thread");
        assert_eq!(
            got, want[i],
            "client {i} ({:?}, stream {}) got another sequence's tokens or wrong ones",
            jobs[i].2, jobs[i].3
        );
    }
    eprintln!(
        "{}: 16 at once: {:.1} s",
        kind.name(),
        t0.elapsed().as_secs_f64()
    );
    // They really ran together: some step held more than one sequence.
    let c = client();
    let metrics = c
        .get(format!("{}/metrics", server.url()))
        .send()
        .unwrap()
        .text()
        .unwrap();
    let alone: u64 = series(&metrics, "mla_serve_batch_size_bucket{le=\"1\"}");
    let steps: u64 = series(&metrics, "mla_serve_batch_size_count");
    assert!(steps > alone, "no step batched two sequences:\n{metrics}");
    assert!(
        series(
            &metrics,
            "mla_serve_requests_total{endpoint=\"/v1/completions\",status=\"200\"}"
        ) == 16
    );
    wait_for(&server, 10, "all sequences retired", |s| {
        s.running == 0 && s.free_pages == s.total_pages
    });
}

fn series(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .map(|v| v.trim().parse::<f64>().unwrap() as u64)
        })
        .unwrap_or_else(|| panic!("no series {name} in\n{metrics}"))
}

fn disconnect_frees_the_sequence(kind: BackendKind) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    let server = start(backend, engine_opts(4, 64, None));
    let c = client();
    let body =
        json!({"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": true, "stream": true});
    let r = c
        .post(format!("{}/v1/completions", server.url()))
        .json(&body)
        .send()
        .unwrap();
    let mut lines = BufReader::new(r).lines();
    let mut events = 0;
    while events < 3 {
        let l = lines.next().expect("stream open").unwrap();
        if l.starts_with("data: ") {
            events += 1;
        }
    }
    assert_eq!(server.stats().running, 1);
    drop(lines);
    wait_for(&server, 10, "the dropped stream's sequence is freed", |s| {
        s.running == 0 && s.cancelled == 1 && s.free_pages == s.total_pages
    });
    let generated = server.stats().generated_tokens;
    assert!(generated < 200, "it stopped early: {generated} tokens");

    // A whole (non-streamed) request whose client gives up is freed too.
    let short = reqwest::blocking::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let body = json!({"prompt": [5, 6, 7, 8], "max_tokens": 240, "ignore_eos": true});
    let r = short
        .post(format!("{}/v1/completions", server.url()))
        .json(&body)
        .send();
    assert!(r.is_err(), "the client timed out first");
    wait_for(
        &server,
        10,
        "the abandoned request's sequence is freed",
        |s| s.running == 0 && s.cancelled == 2 && s.free_pages == s.total_pages,
    );
}

/// `requests` requests through a pool of `pages` pages of 16 tokens, which holds about two
/// of them: sequences are preempted and recomputed, and every output is still the one decoded
/// alone.
fn preemption_keeps_outputs(kind: BackendKind, n: usize, requests: u32, pages: usize) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    // Prompts of 8-11 tokens and n new ones need ceil((prompt + n) / 16) pages each.
    let server = start(backend.clone(), engine_opts(8, 16, Some(pages)));
    let reference = Reference::new(backend);
    let jobs: Vec<(Vec<u32>, SamplerConfig)> = (0..requests)
        .map(|i| {
            let prompt: Vec<u32> = (0..8 + i % 4)
                .map(|k| 3 + (i * 37 + k * 11) % 300)
                .collect();
            let cfg = if i % 2 == 0 {
                greedy()
            } else {
                sampled(i as u64)
            };
            (prompt, cfg)
        })
        .collect();
    let want: Vec<Vec<u32>> = jobs
        .iter()
        .map(|(p, cfg)| reference.decode(p, n, *cfg))
        .collect();
    let url = format!("{}/v1/completions", server.url());
    let handles: Vec<_> = jobs
        .iter()
        .cloned()
        .map(|(prompt, cfg)| {
            let url = url.clone();
            std::thread::spawn(move || {
                let body = merge(
                    json!({"prompt": prompt, "max_tokens": n, "ignore_eos": true, "return_token_ids": true}),
                    sampling_json(&cfg),
                );
                let (status, v) = post(&client(), &url, &body);
                assert_eq!(status, 200, "{v}");
                ids_of(&v["choices"][0]["token_ids"])
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), want[i], "request {i} after preemption");
    }
    let s = server.stats();
    assert!(s.preemptions > 0, "the small pool preempted nobody: {s:?}");
    eprintln!(
        "{}: {} preemptions, all 8 outputs as decoded alone",
        kind.name(),
        s.preemptions
    );
    // A request that could never fit the pool alone is refused up front.
    let (status, v) = post(
        &client(),
        &url,
        &json!({"prompt": [1, 2, 3], "max_tokens": pages * 16}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_tokens");
}

fn shutdown_drains_in_flight(kind: BackendKind) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    let server = start(backend, engine_opts(4, 64, None));
    let url = format!("{}/v1/completions", server.url());
    let n = 12;
    let body = json!({"prompt": [9, 8, 7], "max_tokens": n, "ignore_eos": true, "stream": true, "return_token_ids": true});
    let stream = {
        let url = url.clone();
        std::thread::spawn(move || gather(&sse(&client(), &url, &body), false))
    };
    wait_for(&server, 20, "the request runs", |s| s.generated_tokens >= 1);
    let t0 = Instant::now();
    server.shutdown().expect("clean shutdown");
    let (_, ids, finish) = stream.join().unwrap();
    assert_eq!(ids.len(), n, "the in-flight request ran to its end");
    assert_eq!(finish, "length");
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert!(
        client()
            .post(&url)
            .json(&json!({"prompt": "x"}))
            .send()
            .is_err(),
        "the port is closed after shutdown"
    );
}

fn bad_requests_name_the_field(kind: BackendKind) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    let server = start(backend, engine_opts(2, 64, None));
    let c = client();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "x", "model": "gpt-4"}),
            404,
            Some("model"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1000}),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": vec![1u32; 300]}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 999999]}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 1.5}),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 50}),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": 5}),
            400,
            Some("stop"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 99}),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": NAME}),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "x"}]}),
            400,
            Some("messages[0]"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 1000}),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_completion_tokens": 0}),
            400,
            Some("max_completion_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": [{"type": "function"}]}),
            400,
            Some("tools"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "y".repeat(400)}]}),
            400,
            Some("messages"),
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, v) = post(&c, &format!("{}{path}", server.url()), &body);
        assert_eq!(got, status, "{path} {body}: {v}");
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string() && e.get("code").is_some(), "{v}");
        assert_eq!(e["param"].as_str(), param, "{path} {body}: {v}");
    }
    // Not JSON at all, and a route that does not exist.
    let r = c
        .post(format!("{}/v1/completions", server.url()))
        .body("{\"prompt\": ")
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"),
        "{v}"
    );
    let r = c
        .get(format!("{}/v2/nothing", server.url()))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // The server is fine afterwards, and the listing endpoints answer.
    let (status, v) = post(
        &c,
        &format!("{}/v1/completions", server.url()),
        &json!({"prompt": "x", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
    let models: Value = c
        .get(format!("{}/v1/models", server.url()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(models["data"][0]["id"], NAME);
    let health: Value = c
        .get(format!("{}/health", server.url()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(health["status"], "ok");
}

/// A stop string ends the text before it, with finish_reason "stop", whole and streamed.
fn stop_strings(kind: BackendKind) {
    let Some(backend) = common::backend_arc(kind) else {
        return;
    };
    let server = start(backend, engine_opts(2, 64, None));
    let c = client();
    let url = format!("{}/v1/completions", server.url());
    let base = json!({"prompt": "The lightning indexer", "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let (_, v) = post(&c, &url, &base);
    let full = v["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 8, "{full:?}");
    let stop: String = chars[4..6].iter().collect();
    let cut = &full[..full.find(&stop).unwrap()];
    let body = merge(base, json!({"stop": [stop.clone(), "never-there"]}));
    let (_, v) = post(&c, &url, &body);
    assert_eq!(v["choices"][0]["text"], cut, "stop {stop:?} in {full:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (text, _, finish) = gather(&sse(&c, &url, &merge(body, json!({"stream": true}))), false);
    assert_eq!(text, cut);
    assert_eq!(finish, "stop");
    wait_for(&server, 10, "stopped sequences are freed", |s| {
        s.running == 0 && s.free_pages == s.total_pages
    });
}

/// The cases whose outcome depends on the backend's numbers (batched, preempted and streamed
/// outputs against the plain decode), on every backend.
macro_rules! serve_tests {
    ($($backend:ident => $kind:expr, $whole:expr, $concurrent:expr, $preempt:expr;)*) => {
        $(
            mod $backend {
                use super::*;
                #[test]
                fn whole_and_streamed_equal_the_plain_decode() {
                    super::whole_and_streamed_equal_the_plain_decode($kind, $whole);
                }
                #[test]
                fn sixteen_concurrent_clients_get_their_own_tokens() {
                    let (tokens, lengths) = $concurrent;
                    super::sixteen_concurrent_clients($kind, tokens, lengths);
                }
                #[test]
                fn disconnect_frees_the_sequence() {
                    super::disconnect_frees_the_sequence($kind);
                }
                #[test]
                fn preemption_keeps_outputs() {
                    let (n, requests, pages) = $preempt;
                    super::preemption_keeps_outputs($kind, n, requests, pages);
                }
            }
        )*
    };
}

// Tokens of the whole/streamed case; (tokens per request, prompt lengths) of the concurrent
// case; (tokens, requests, pages) of the preemption case. lavapipe runs a step in ~75 ms and
// compiles each new step shape: its cases are smaller (and still cross a page boundary, which
// is what preempts).
serve_tests! {
    cpu => BackendKind::Cpu, 10, (24, 7), (44, 8, 5);
    wgpu => BackendKind::Wgpu, 6, (6, 2), (12, 4, 3);
}

// The HTTP side (templates, stop strings, errors, shutdown) is the same whatever the backend:
// these run on the CPU reference.
#[test]
fn chat_renders_the_template_cpu() {
    chat_renders_the_template(BackendKind::Cpu);
}

#[test]
fn shutdown_drains_in_flight_cpu() {
    shutdown_drains_in_flight(BackendKind::Cpu);
}

#[test]
fn bad_requests_name_the_field_cpu() {
    bad_requests_name_the_field(BackendKind::Cpu);
}

#[test]
fn stop_strings_cpu() {
    stop_strings(BackendKind::Cpu);
}
