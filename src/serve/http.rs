//! The HTTP side: routes, the OpenAI response shapes (whole and as server-sent events), the
//! per-choice drivers that turn engine tokens into text, and the graceful shutdown.
//!
//! A generation request becomes one engine job per choice (`n` × prompts). Each job has a
//! driver task: it detokenizes, applies stop strings, times the tokens, and sends pieces of
//! text to the response. When the client goes away the response (or the SSE stream) is
//! dropped, the drivers see it at once and raise their jobs' cancel flags, and the engine
//! frees the sequences before its next step.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use super::api::{
    check_context, parse_body, ApiError, ChatRequest, CompletionRequest, GenParams, Prompt,
    DEFAULT_COMPLETION_TOKENS, MAX_CHOICES,
};
use super::engine::{Engine, Event, Finish, Job};
use super::metrics::Metrics;
use super::text::{Detokenizer, StopMatcher};
use super::ServeOptions;
use crate::chat::ChatTemplate;
use crate::model::TextTokenizer;
use crate::util::Rng;

pub struct AppState {
    pub opts: ServeOptions,
    pub engine: Engine,
    pub tokenizer: Option<Arc<TextTokenizer>>,
    pub chat: Option<ChatTemplate>,
    pub metrics: Arc<Metrics>,
    in_flight: AtomicUsize,
    draining: watch::Sender<bool>,
    created: u64,
    next_id: AtomicU64,
    seeds: std::sync::Mutex<Rng>,
}

impl AppState {
    pub fn new(
        opts: ServeOptions,
        engine: Engine,
        tokenizer: Option<Arc<TextTokenizer>>,
        chat: Option<ChatTemplate>,
        metrics: Arc<Metrics>,
    ) -> Self {
        AppState {
            opts,
            engine,
            tokenizer,
            chat,
            metrics,
            in_flight: AtomicUsize::new(0),
            draining: watch::channel(false).0,
            created: unix_now(),
            next_id: AtomicU64::new(1),
            seeds: std::sync::Mutex::new(Rng::new(Rng::fresh_seed())),
        }
    }

    /// Generation requests not yet answered in full.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn draining(&self) -> bool {
        *self.draining.borrow()
    }

    fn request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:08x}{n:08x}", self.created as u32)
    }

    fn fresh_seed(&self) -> u64 {
        self.seeds
            .lock()
            .map(|mut r| r.next_u64())
            .unwrap_or_else(|_| Rng::fresh_seed())
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        (status, Json(self.body())).into_response()
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(not_found)
        .with_state(state)
}

/// Serves until `stop` fires, then drains: no new connections, 503 for new requests on open
/// ones, in-flight requests finish — for at most the drain timeout, after which the engine is
/// stopped (what still runs ends with an error event) and the server returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let app = router(state.clone());
    let st = state.clone();
    let graceful = async move {
        let _ = stop.await;
        st.draining.send_replace(true);
    };
    let server = std::future::IntoFuture::into_future(
        axum::serve(listener, app).with_graceful_shutdown(graceful),
    );
    tokio::pin!(server);
    let mut draining = state.draining.subscribe();
    let deadline = async {
        let _ = draining.wait_for(|d| *d).await;
        tokio::time::sleep(state.opts.drain_timeout).await;
    };
    tokio::select! {
        r = &mut server => {
            if let Err(e) = r {
                log::error!("server: {e}");
            }
            return;
        }
        _ = deadline => {}
    }
    eprintln!(
        "mla-serve: {} requests still running after the {:.0} s drain timeout: ending them",
        state.in_flight(),
        state.opts.drain_timeout.as_secs_f64()
    );
    state.engine.shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
}

/// SIGINT (Ctrl-C) or SIGTERM; returns which.
pub async fn wait_for_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let r = if s.draining() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    };
    s.metrics.request("/health", r.status().as_u16());
    r
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    s.metrics.request("/metrics", 200);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
        .into_response()
}

fn model_card(s: &AppState) -> Value {
    json!({
        "id": s.opts.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "sparse-mla",
        "max_model_len": s.engine.limits.max_tokens_per_sequence(),
    })
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    s.metrics.request("/v1/models", 200);
    Json(json!({"object": "list", "data": [model_card(&s)]})).into_response()
}

async fn model(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let r = if id == s.opts.model_name {
        Json(model_card(&s)).into_response()
    } else {
        unknown_model(&s, &id).into_response()
    };
    s.metrics.request("/v1/models", r.status().as_u16());
    r
}

async fn not_found(State(s): State<Arc<AppState>>, uri: axum::http::Uri) -> Response {
    s.metrics.request("other", 404);
    ApiError {
        status: 404,
        message: format!(
            "no route {}: this server has /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics",
            uri.path()
        ),
        kind: "not_found_error",
        param: None,
        code: None,
    }
    .into_response()
}

fn unknown_model(s: &AppState, asked: &str) -> ApiError {
    ApiError {
        status: 404,
        message: format!(
            "the model `{asked}` does not exist: this server serves `{}`",
            s.opts.model_name
        ),
        kind: "invalid_request_error",
        param: Some("model".into()),
        code: Some("model_not_found"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn endpoint(self) -> &'static str {
        match self {
            Kind::Completion => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
        }
    }
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let arrived = Instant::now();
    let r = match prepare_completion(&s, &body) {
        Ok(g) => generate(s.clone(), g, arrived).await,
        Err(e) => e.into_response(),
    };
    s.metrics
        .request(Kind::Completion.endpoint(), r.status().as_u16());
    r
}

async fn chat_completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let arrived = Instant::now();
    let r = match prepare_chat(&s, &body) {
        Ok(g) => generate(s.clone(), g, arrived).await,
        Err(e) => e.into_response(),
    };
    s.metrics
        .request(Kind::Chat.endpoint(), r.status().as_u16());
    r
}

/// A prompt's token ids, and (for `echo`) its text.
type PromptIds = (Vec<u32>, Option<String>);

/// A checked generation request, ready to submit.
struct Generation {
    kind: Kind,
    params: GenParams,
    /// Each prompt's token ids, and (for `echo`) its text.
    prompts: Vec<PromptIds>,
    max_tokens: usize,
}

fn check_common(s: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    if s.draining() {
        return Err(ApiError::server(
            503,
            "the server is shutting down and takes no new requests",
        ));
    }
    match model {
        Some(m) if *m != s.opts.model_name => Err(unknown_model(s, m)),
        _ => Ok(()),
    }
}

fn tokenizer_for<'a>(s: &'a AppState, param: &str) -> Result<&'a TextTokenizer, ApiError> {
    s.tokenizer.as_deref().ok_or_else(|| {
        ApiError::invalid(
            param,
            "the model directory has no tokenizer.json: give the prompt as token ids",
        )
    })
}

fn prepare_completion(s: &AppState, body: &[u8]) -> Result<Generation, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    check_common(s, &req.model)?;
    let params = req.params()?;
    let encode = |t: &str| -> Result<Vec<u32>, ApiError> {
        tokenizer_for(s, "prompt")?
            .encode(t)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))
    };
    let texts = |v: Vec<String>| -> Result<Vec<PromptIds>, ApiError> {
        v.into_iter().map(|t| Ok((encode(&t)?, Some(t)))).collect()
    };
    let prompts = match req.prompt.clone() {
        None => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` is required: a string, a list of strings, or token ids",
            ))
        }
        Some(Prompt::Text(t)) => texts(vec![t])?,
        Some(Prompt::Texts(v)) => texts(v)?,
        Some(Prompt::Ids(ids)) => vec![(ids, None)],
        Some(Prompt::IdLists(v)) => v.into_iter().map(|ids| (ids, None)).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` is an empty list"));
    }
    if prompts.len() * params.n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts × n = {} asks for {} choices; at most {MAX_CHOICES}",
                prompts.len(),
                params.n,
                prompts.len() * params.n
            ),
        ));
    }
    let vocab = s.engine.limits.vocab_size;
    let mut max_tokens = 0;
    for (ids, _) in &prompts {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {bad} is not below the vocabulary size {vocab}"),
            ));
        }
        max_tokens = check_context(
            ids.len(),
            params.max_tokens,
            Some(DEFAULT_COMPLETION_TOKENS),
            &s.engine.limits,
            "prompt",
        )?;
    }
    // With several prompts and no max_tokens, the shortest room applies to all.
    if params.max_tokens.is_none() {
        for (ids, _) in &prompts {
            max_tokens = max_tokens.min(check_context(
                ids.len(),
                None,
                Some(DEFAULT_COMPLETION_TOKENS),
                &s.engine.limits,
                "prompt",
            )?);
        }
    }
    let echo = req.echo;
    let prompts = prompts
        .into_iter()
        .map(|(ids, text)| {
            let text = if echo {
                Some(text.unwrap_or_else(|| {
                    s.tokenizer
                        .as_ref()
                        .and_then(|t| t.decode(&ids).ok())
                        .unwrap_or_default()
                }))
            } else {
                None
            };
            (ids, text)
        })
        .collect();
    Ok(Generation {
        kind: Kind::Completion,
        params,
        prompts,
        max_tokens,
    })
}

fn prepare_chat(s: &AppState, body: &[u8]) -> Result<Generation, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    check_common(s, &req.model)?;
    let params = req.params()?;
    let messages = req.messages()?;
    let template = s.chat.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "messages",
            "the model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja): use /v1/completions",
        )
    })?;
    let tok = tokenizer_for(s, "messages")?;
    let text = template
        .render(&messages, req.add_generation_prompt.unwrap_or(true))
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let ids = tok
        .encode_with(&text, false)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    if params.n > MAX_CHOICES {
        return Err(ApiError::invalid("n", format!("at most {MAX_CHOICES}")));
    }
    let max_tokens = check_context(
        ids.len(),
        params.max_tokens,
        None,
        &s.engine.limits,
        "messages",
    )?;
    Ok(Generation {
        kind: Kind::Chat,
        params,
        prompts: vec![(ids, None)],
        max_tokens,
    })
}

/// A token as a response reports it.
#[derive(Clone, Debug)]
struct TokenInfo {
    id: u32,
    text: String,
    logprob: f32,
    top: Vec<(String, f32)>,
}

/// What a driver sends the response.
#[derive(Debug)]
enum Piece {
    Text {
        index: usize,
        text: String,
        tokens: Vec<TokenInfo>,
    },
    End {
        index: usize,
        reason: &'static str,
        completion_tokens: usize,
    },
    Failed {
        index: usize,
        message: String,
    },
}

/// Counts the request in flight while it lives; raises its jobs' cancel flags when dropped
/// (a response that ended early, a client that went away).
struct Flight {
    state: Arc<AppState>,
    cancels: Vec<Arc<AtomicBool>>,
}

impl Drop for Flight {
    fn drop(&mut self) {
        for c in &self.cancels {
            c.store(true, Ordering::Relaxed);
        }
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn token_text(tok: Option<&TextTokenizer>, id: u32) -> String {
    match tok {
        Some(t) => t.decode(&[id]).unwrap_or_default(),
        None => format!("token_id:{id}"),
    }
}

/// One choice: engine events in, pieces of the response out.
#[allow(clippy::too_many_arguments)]
async fn drive(
    index: usize,
    mut events: mpsc::UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
    tok: Option<Arc<TextTokenizer>>,
    stops: Vec<String>,
    want_logprobs: bool,
    echo: Option<String>,
    out: mpsc::Sender<Piece>,
    metrics: Arc<Metrics>,
    arrived: Instant,
) {
    let mut detok = Detokenizer::new();
    let mut stop = StopMatcher::new(stops);
    let mut held: Vec<TokenInfo> = Vec::new();
    let mut generated = 0usize;
    let mut last: Option<Instant> = None;
    if let Some(text) = echo {
        if out
            .send(Piece::Text {
                index,
                text,
                tokens: Vec::new(),
            })
            .await
            .is_err()
        {
            cancel.store(true, Ordering::Relaxed);
            return;
        }
    }
    loop {
        let ev = tokio::select! {
            ev = events.recv() => ev,
            _ = out.closed() => {
                // The response is gone (client disconnected): free the sequence now.
                cancel.store(true, Ordering::Relaxed);
                return;
            }
        };
        let piece = match ev {
            Some(Event::Token(g)) => {
                let now = Instant::now();
                match last {
                    None => metrics
                        .ttft
                        .observe(now.duration_since(arrived).as_secs_f64()),
                    Some(t) => metrics.itl.observe(now.duration_since(t).as_secs_f64()),
                }
                last = Some(now);
                generated += 1;
                let text = match tok.as_deref() {
                    Some(t) => detok.push(t, g.id),
                    None => String::new(),
                };
                if want_logprobs || tok.is_none() {
                    held.push(TokenInfo {
                        id: g.id,
                        text: token_text(tok.as_deref(), g.id),
                        logprob: g.logprob,
                        top: g
                            .top
                            .iter()
                            .map(|&(id, lp)| (token_text(tok.as_deref(), id), lp))
                            .collect(),
                    });
                } else {
                    held.push(TokenInfo {
                        id: g.id,
                        text: String::new(),
                        logprob: g.logprob,
                        top: Vec::new(),
                    });
                }
                let shown = stop.push(&text);
                if stop.stopped() {
                    cancel.store(true, Ordering::Relaxed);
                    let _ = out
                        .send(Piece::Text {
                            index,
                            text: shown,
                            tokens: std::mem::take(&mut held),
                        })
                        .await;
                    Piece::End {
                        index,
                        reason: "stop",
                        completion_tokens: generated,
                    }
                } else {
                    // Sent even when the text is held back (a partial character, a possible
                    // stop string): the client sees every token as it comes, for its timing
                    // and its logprobs; the text follows when it is final.
                    Piece::Text {
                        index,
                        text: shown,
                        tokens: std::mem::take(&mut held),
                    }
                }
            }
            Some(Event::Done(f)) => {
                let rest = match tok.as_deref() {
                    Some(t) => detok.finish(t),
                    None => String::new(),
                };
                let mut text = stop.push(&rest);
                text.push_str(&stop.finish());
                if !text.is_empty() || !held.is_empty() {
                    let _ = out
                        .send(Piece::Text {
                            index,
                            text,
                            tokens: std::mem::take(&mut held),
                        })
                        .await;
                }
                metrics.e2e.observe(arrived.elapsed().as_secs_f64());
                let reason = match f {
                    _ if stop.stopped() => "stop",
                    Finish::Eos => "stop",
                    Finish::Length => "length",
                };
                Piece::End {
                    index,
                    reason,
                    completion_tokens: generated,
                }
            }
            Some(Event::Failed(message)) => Piece::Failed { index, message },
            None => Piece::Failed {
                index,
                message: "the engine stopped".into(),
            },
        };
        let end = !matches!(piece, Piece::Text { .. });
        if out.send(piece).await.is_err() {
            cancel.store(true, Ordering::Relaxed);
            return;
        }
        if end {
            return;
        }
    }
}

/// Submits one job per choice and starts its driver; returns the pieces' receiver.
fn start(
    s: &Arc<AppState>,
    g: &Generation,
    arrived: Instant,
) -> Result<(mpsc::Receiver<Piece>, Flight), ApiError> {
    let waiting = s.metrics.waiting.get() as usize;
    let choices = g.prompts.len() * g.params.n;
    if waiting + choices > s.opts.max_queue {
        return Err(ApiError {
            status: 429,
            message: format!(
                "{waiting} requests are waiting for a batch slot (the limit is --max-queue {}): retry later",
                s.opts.max_queue
            ),
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
        });
    }
    s.in_flight.fetch_add(1, Ordering::Relaxed);
    let mut flight = Flight {
        state: s.clone(),
        cancels: Vec::new(),
    };
    let (tx, rx) = mpsc::channel::<Piece>(64);
    let base_seed = if g.params.seed_given {
        g.params.sampling.seed
    } else {
        s.fresh_seed()
    };
    for (p, (ids, echo)) in g.prompts.iter().enumerate() {
        for j in 0..g.params.n {
            let index = p * g.params.n + j;
            let (etx, erx) = mpsc::unbounded_channel();
            let cancel = Arc::new(AtomicBool::new(false));
            let mut sampling = g.params.sampling;
            // Choice i of a seeded request draws from seed + i: distinct and replayable.
            sampling.seed = base_seed.wrapping_add(index as u64);
            let job = Job {
                prompt: ids.clone(),
                max_tokens: g.max_tokens,
                sampling,
                top_logprobs: g.params.logprobs.unwrap_or(0),
                stop_at_eos: g.params.stop_at_eos,
                events: etx,
                cancel: cancel.clone(),
            };
            if s.engine.submit(job).is_err() {
                return Err(ApiError::server(
                    503,
                    "the engine has stopped: the server is shutting down",
                ));
            }
            flight.cancels.push(cancel.clone());
            tokio::spawn(drive(
                index,
                erx,
                cancel,
                s.tokenizer.clone(),
                g.params.stops.clone(),
                g.params.logprobs.is_some(),
                echo.clone(),
                tx.clone(),
                s.metrics.clone(),
                arrived,
            ));
        }
    }
    Ok((rx, flight))
}

async fn generate(s: Arc<AppState>, g: Generation, arrived: Instant) -> Response {
    let (rx, flight) = match start(&s, &g, arrived) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let ctx = ResponseCtx {
        kind: g.kind,
        id: s.request_id(match g.kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }),
        created: unix_now(),
        model: s.opts.model_name.clone(),
        logprobs: g.params.logprobs,
        return_token_ids: g.params.return_token_ids,
        prompt_tokens: g.prompts.iter().map(|(p, _)| p.len()).sum(),
        prompt_ids: g.prompts.iter().map(|(p, _)| p.clone()).collect(),
        n: g.params.n,
    };
    if g.params.stream {
        stream_response(
            ctx,
            rx,
            flight,
            g.params.include_usage,
            g.prompts.len() * g.params.n,
        )
    } else {
        whole_response(ctx, rx, flight, g.prompts.len() * g.params.n).await
    }
}

struct ResponseCtx {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    logprobs: Option<usize>,
    return_token_ids: bool,
    prompt_tokens: usize,
    prompt_ids: Vec<Vec<u32>>,
    n: usize,
}

impl ResponseCtx {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    /// The logprobs object of some tokens (`None` when the request asked for none).
    /// `offset` is the completion text's length before these tokens (completions only).
    fn logprobs(&self, tokens: &[TokenInfo], offset: &mut usize) -> Value {
        let Some(top) = self.logprobs else {
            return Value::Null;
        };
        match self.kind {
            Kind::Completion => {
                let mut offsets = Vec::new();
                for t in tokens {
                    offsets.push(*offset);
                    *offset += t.text.len();
                }
                json!({
                    "tokens": tokens.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": if top == 0 { Value::Null } else {
                        tokens.iter().map(|t| {
                            let mut m = serde_json::Map::new();
                            for (text, lp) in &t.top {
                                m.entry(text.clone()).or_insert(json!(lp));
                            }
                            Value::Object(m)
                        }).collect::<Vec<_>>().into()
                    },
                    "text_offset": offsets,
                })
            }
            Kind::Chat => {
                let entry = |text: &str, lp: f32| json!({"token": text, "logprob": lp, "bytes": text.as_bytes()});
                json!({
                    "content": tokens.iter().map(|t| {
                        let mut e = entry(&t.text, t.logprob);
                        e["top_logprobs"] = t.top.iter().map(|(x, lp)| entry(x, *lp)).collect::<Vec<_>>().into();
                        e
                    }).collect::<Vec<_>>()
                })
            }
        }
    }
}

async fn whole_response(
    ctx: ResponseCtx,
    mut rx: mpsc::Receiver<Piece>,
    flight: Flight,
    choices: usize,
) -> Response {
    struct Acc {
        text: String,
        tokens: Vec<TokenInfo>,
        reason: Option<&'static str>,
        count: usize,
    }
    let mut acc: Vec<Acc> = (0..choices)
        .map(|_| Acc {
            text: String::new(),
            tokens: Vec::new(),
            reason: None,
            count: 0,
        })
        .collect();
    let mut open = choices;
    while open > 0 {
        match rx.recv().await {
            Some(Piece::Text {
                index,
                text,
                tokens,
            }) => {
                acc[index].text.push_str(&text);
                acc[index].tokens.extend(tokens);
            }
            Some(Piece::End {
                index,
                reason,
                completion_tokens,
            }) => {
                acc[index].reason = Some(reason);
                acc[index].count = completion_tokens;
                open -= 1;
            }
            Some(Piece::Failed { index, message }) => {
                drop(flight);
                return ApiError::server(500, format!("choice {index}: {message}")).into_response();
            }
            None => {
                drop(flight);
                return ApiError::server(500, "the generation ended without a result")
                    .into_response();
            }
        }
    }
    drop(flight);
    let completion_tokens: usize = acc.iter().map(|a| a.count).sum();
    let out: Vec<Value> = acc
        .iter()
        .enumerate()
        .map(|(index, a)| {
            let mut offset = 0;
            let logprobs = ctx.logprobs(&a.tokens, &mut offset);
            let mut c = match ctx.kind {
                Kind::Completion => json!({
                    "index": index,
                    "text": a.text,
                    "logprobs": logprobs,
                    "finish_reason": a.reason,
                }),
                Kind::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": a.text},
                    "logprobs": logprobs,
                    "finish_reason": a.reason,
                }),
            };
            if ctx.return_token_ids {
                c["token_ids"] = a.tokens.iter().map(|t| t.id).collect::<Vec<_>>().into();
                c["prompt_token_ids"] = ctx.prompt_ids[index / ctx.n].clone().into();
            }
            c
        })
        .collect();
    let mut body = ctx.envelope(false, out);
    body["usage"] = ctx.usage(completion_tokens);
    Json(body).into_response()
}

fn stream_response(
    ctx: ResponseCtx,
    mut rx: mpsc::Receiver<Piece>,
    flight: Flight,
    include_usage: bool,
    choices: usize,
) -> Response {
    let (tx, sse_rx) = mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        // Holding the flight here: it ends (and cancels what still runs) with this task.
        let _flight = flight;
        let send = |v: Value| {
            let tx = tx.clone();
            async move {
                tx.send(SseEvent::default().data(v.to_string()))
                    .await
                    .is_ok()
            }
        };
        let mut offsets = vec![0usize; choices];
        let mut completion_tokens = 0;
        if ctx.kind == Kind::Chat {
            for index in 0..choices {
                let c = json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                if !send(ctx.envelope(true, vec![c])).await {
                    return;
                }
            }
        }
        let mut open = choices;
        while open > 0 {
            let piece = tokio::select! {
                p = rx.recv() => p,
                _ = tx.closed() => return,
            };
            let chunk = match piece {
                Some(Piece::Text {
                    index,
                    text,
                    tokens,
                }) => {
                    let logprobs = ctx.logprobs(&tokens, &mut offsets[index]);
                    let mut c = match ctx.kind {
                        Kind::Completion => {
                            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": null})
                        }
                        Kind::Chat => {
                            json!({"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null})
                        }
                    };
                    if ctx.return_token_ids {
                        c["token_ids"] = tokens.iter().map(|t| t.id).collect::<Vec<_>>().into();
                    }
                    ctx.envelope(true, vec![c])
                }
                Some(Piece::End {
                    index,
                    reason,
                    completion_tokens: n,
                }) => {
                    open -= 1;
                    completion_tokens += n;
                    let c = match ctx.kind {
                        Kind::Completion => {
                            json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason})
                        }
                        Kind::Chat => {
                            json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason})
                        }
                    };
                    ctx.envelope(true, vec![c])
                }
                Some(Piece::Failed { index, message }) => {
                    let _ =
                        send(ApiError::server(500, format!("choice {index}: {message}")).body())
                            .await;
                    return;
                }
                None => return,
            };
            if !send(chunk).await {
                return;
            }
        }
        if include_usage {
            let mut u = ctx.envelope(true, Vec::new());
            u["usage"] = ctx.usage(completion_tokens);
            if !send(u).await {
                return;
            }
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    let stream = futures_util::stream::unfold(sse_rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(5)))
        .into_response()
}
