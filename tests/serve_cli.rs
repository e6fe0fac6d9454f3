//! The `mla-serve` binary as a user runs it (on the CPU reference): it answers what `mla-run`
//! answers for the same prompt, SIGTERM drains an in-flight stream and exits 0, its flags are
//! checked; and `mla-run --chat` keeps the conversation's cache between turns and answers what
//! the server answers for the same conversation.

#![cfg(feature = "serve")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

struct Served {
    child: Child,
    url: String,
    stderr: mpsc::Receiver<String>,
}

impl Served {
    /// Starts `mla-serve --port 0` and reads the address it prints.
    fn start(extra: &[&str]) -> Served {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mla-serve"))
            .args(["--device", "cpu", "--port", "0", "--max-seq-len", "512"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mla-serve starts");
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(|l| l.ok()) {
                let _ = tx.send(line);
            }
        });
        let t0 = Instant::now();
        let url = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("mla-serve says where it serves");
            if let Some(at) = line.find("http://") {
                break line[at..].split_whitespace().next().unwrap().to_string();
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no address: {line}");
        };
        Served {
            child,
            url,
            stderr: rx,
        }
    }

    fn stderr_so_far(&self) -> String {
        self.stderr.try_iter().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn post(url: &str, body: &Value) -> Value {
    let r = client().post(url).json(body).send().expect("request sent");
    assert_eq!(r.status().as_u16(), 200);
    r.json().unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn mla_serve_answers_like_mla_run_and_drains_on_sigterm() {
    let mut s = Served::start(&[]);
    let health: Value = client()
        .get(format!("{}/health", s.url))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(health["status"], "ok");

    // The same prompt, greedy, through mla-run and through the server.
    let prompt = "Mixture of experts layers route each token";
    let run = Command::new(env!("CARGO_BIN_EXE_mla-run"))
        .args([
            "--device", "cpu", "--prompt", prompt, "-n", "12", "--output", "json",
        ])
        .output()
        .unwrap();
    assert!(run.status.success());
    let mut want: Vec<u64> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["id"].as_u64())
        .collect();
    // mla-run prints the end-of-sequence token it stops at; the server does not send it.
    if want.len() < 12 {
        want.pop();
    }
    let v = post(
        &format!("{}/v1/completions", s.url),
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": true}),
    );
    assert_eq!(
        ids(&v["choices"][0]["token_ids"]),
        want,
        "mla-serve vs mla-run"
    );

    // SIGTERM while a stream runs: the stream finishes, then the process exits 0.
    let url = format!("{}/v1/completions", s.url);
    let (first_tx, first_rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let r = client()
            .post(&url)
            .json(&json!({"prompt": [4, 5, 6], "max_tokens": 300, "ignore_eos": true, "stream": true, "return_token_ids": true}))
            .send()
            .unwrap();
        let mut tokens = 0;
        let mut done = false;
        for line in BufReader::new(r).lines().map_while(|l| l.ok()) {
            if line == "data: [DONE]" {
                done = true;
            } else if let Some(data) = line.strip_prefix("data: ") {
                let v: Value = serde_json::from_str(data).unwrap();
                if let Some(t) = v["choices"][0].get("token_ids") {
                    tokens += t.as_array().unwrap().len();
                }
                let _ = first_tx.send(());
            }
        }
        (tokens, done)
    });
    first_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the stream starts");
    let pid = s.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "mla-serve did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let (tokens, done) = reader.join().unwrap();
    assert!(status.success(), "exit status {status}");
    assert!(
        done && tokens == 300,
        "the in-flight stream ran to its end: {tokens} tokens, [DONE] {done}"
    );
    let err = s.stderr_so_far();
    assert!(err.contains("SIGTERM") && err.contains("draining"), "{err}");
}

#[test]
fn mla_run_chat_keeps_the_cache_and_answers_like_the_server() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mla-run"))
        .args([
            "--device",
            "cpu",
            "--chat",
            "-n",
            "8",
            "--output",
            "json",
            "--system",
            "Be terse.",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is a page?\nAnd a slot?\n/exit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let turns: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per turn"))
        .collect();
    assert_eq!(turns.len(), 2, "{turns:?}");
    let reused = turns[1]["reused_tokens"].as_u64().unwrap();
    assert!(
        reused > turns[0]["prompt_tokens"].as_u64().unwrap() / 2,
        "turn 2 reuses the first turn's cache: {turns:?}"
    );

    // The same conversation through the server, in one request: the same second answer.
    let s = Served::start(&[]);
    let v = post(
        &format!("{}/v1/chat/completions", s.url),
        &json!({
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "What is a page?"},
                {"role": "assistant", "content": turns[0]["reply"]},
                {"role": "user", "content": "And a slot?"},
            ],
            "max_tokens": 8, "temperature": 0, "return_token_ids": true,
        }),
    );
    assert_eq!(
        ids(&v["choices"][0]["token_ids"]),
        ids(&turns[1]["ids"]),
        "mla-run --chat turn 2 (cache kept) vs the server (whole conversation)"
    );
    assert_eq!(v["choices"][0]["message"]["content"], turns[1]["reply"]);
}

#[test]
fn mla_serve_help_and_flag_errors() {
    let help = Command::new(env!("CARGO_BIN_EXE_mla-serve"))
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    for word in [
        "curl",
        "/v1/chat/completions",
        "--cache-pages",
        "preempted",
        "SIGTERM",
    ] {
        assert!(text.contains(word), "--help lacks {word}:\n{text}");
    }
    for (args, needle) in [
        (
            vec!["--max-batch", "8", "--max-step-tokens", "4"],
            "--max-batch",
        ),
        (vec!["--device", "tpu"], "--device"),
        (vec!["--model", "/no/such/dir"], "does not exist"),
        (vec!["--drain-timeout=-1"], "--drain-timeout"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_mla-serve"))
            .args(&args)
            .args(["--port", "0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("error") && err.contains(needle) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}
