//! `mla-serve`: an OpenAI-compatible HTTP server over the model, with continuous batching.
//!
//! ```text
//!  HTTP clients ──► axum handlers (tokio) ──Job──► engine thread (owns Model + KvCache)
//!        ▲               │  detokenize, stop strings,        │ admit / prefill / decode
//!        └── SSE / JSON ─┘  OpenAI JSON shapes   ◄──tokens───┘ all sequences in one step
//! ```
//!
//! - [`engine`]: the one thread that touches the device. Between decode steps it admits
//!   waiting requests (their prefill joins the next step), runs every running sequence through
//!   one [`crate::model::Model::step`], samples each row with its request's own settings and
//!   seed, and sends the tokens back. All sequences draw pages from one pool; when it runs
//!   out the newest sequence is preempted and later recomputed from its prompt and the tokens
//!   it already produced, so its output is the same as if it had never been interrupted.
//! - [`api`]: the OpenAI request and response bodies, and the checks that turn a bad request
//!   into a 4xx naming the field.
//! - [`text`]: streaming detokenization and stop strings.
//! - [`http`]: the routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//!   `/health`, `/metrics`), SSE streaming, cancellation on disconnect, graceful shutdown.
//! - [`metrics`]: the Prometheus counters, gauges and histograms.

pub mod api;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod text;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::chat::ChatTemplate;
use crate::model::{Model, TextTokenizer};
use crate::{Error, Result};

pub use engine::{EngineOptions, Limits};
pub use metrics::EngineStats;

/// What loads the model; it runs on the engine thread, where the model then lives.
pub type ModelLoader = Box<dyn FnOnce() -> Result<Model> + Send>;

/// Everything the server is started with.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Address to listen on (port 0: any free port; [`Server::addr`] says which).
    pub addr: SocketAddr,
    /// The name `/v1/models` lists and requests must use (`model`).
    pub model_name: String,
    pub engine: EngineOptions,
    /// Requests waiting for a batch slot beyond which new ones get 429.
    pub max_queue: usize,
    /// How long a SIGINT / SIGTERM (or [`Server::shutdown`]) waits for in-flight requests.
    pub drain_timeout: Duration,
}

/// A running server: its HTTP front on a tokio runtime, its engine on a thread of its own.
pub struct Server {
    addr: SocketAddr,
    state: Arc<http::AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Server {
    /// Loads the model on the engine thread (`load` runs there: device work stays on one
    /// thread), binds the address and starts serving. Returns once requests can be served.
    pub fn start(
        opts: ServeOptions,
        load: ModelLoader,
        tokenizer: Option<Arc<TextTokenizer>>,
        chat: Option<ChatTemplate>,
    ) -> Result<Server> {
        let metrics = Arc::new(metrics::Metrics::new());
        let engine = engine::Engine::spawn(opts.engine, load, metrics.clone())?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("mla-serve-http")
            .enable_all()
            .build()
            .map_err(|e| Error::Io {
                path: "tokio runtime".into(),
                source: e,
            })?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(opts.addr))
            .map_err(|e| Error::Io {
                path: format!("listening on {}", opts.addr),
                source: e,
            })?;
        let addr = listener.local_addr().map_err(|e| Error::Io {
            path: "local address".into(),
            source: e,
        })?;
        let state = Arc::new(http::AppState::new(
            opts.clone(),
            engine,
            tokenizer,
            chat,
            metrics,
        ));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let app_state = state.clone();
        let thread = std::thread::Builder::new()
            .name("mla-serve-runtime".into())
            .spawn(move || {
                runtime.block_on(http::serve(listener, app_state.clone(), stop_rx));
                app_state.engine.shutdown();
                // In-flight handlers that outlived the drain bound end with the runtime.
                runtime.shutdown_timeout(Duration::from_secs(1));
                Ok(())
            })
            .map_err(|e| Error::Io {
                path: "server thread".into(),
                source: e,
            })?;
        Ok(Server {
            addr,
            state,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What the engine has done so far (sequences running and waiting, pages, preemptions).
    pub fn stats(&self) -> EngineStats {
        self.state.metrics.engine_stats()
    }

    /// Stops taking requests, lets the in-flight ones finish (up to the drain timeout), stops
    /// the engine and returns when all is down.
    pub fn shutdown(mut self) -> Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.join()
    }

    /// Blocks until the server stops (after a SIGINT / SIGTERM when signals are on).
    pub fn join(&mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| Error::Model("the server thread panicked".into()))?,
            None => Ok(()),
        }
    }

    /// Makes SIGINT / SIGTERM start the graceful shutdown (the `mla-serve` binary's choice;
    /// tests stop servers with [`Server::shutdown`]).
    pub fn stop_on_signals(&mut self) {
        let Some(tx) = self.stop.take() else {
            return;
        };
        let state = self.state.clone();
        std::thread::Builder::new()
            .name("mla-serve-signals".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        log::error!("no signal handler: {e}");
                        return;
                    }
                };
                rt.block_on(async {
                    let which = http::wait_for_signal().await;
                    eprintln!(
                        "mla-serve: {which}: draining {} in-flight requests (at most {:.0} s), then exiting",
                        state.in_flight(),
                        state.opts.drain_timeout.as_secs_f64()
                    );
                });
                let _ = tx.send(());
            })
            .ok();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = self.join();
    }
}
