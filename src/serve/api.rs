//! The OpenAI request bodies `mla-serve` takes, the checks that turn them into generation
//! settings, and the error object every 4xx / 5xx carries:
//! `{"error": {"message", "type", "param", "code"}}`, with `param` naming the field at fault.
//!
//! Fields OpenAI defines that change the output and that are not implemented here
//! (penalties, `logit_bias`, `best_of`, `suffix`, tools, `response_format`) are refused when
//! set to anything but their neutral value, rather than silently ignored; unknown fields are
//! ignored, as OpenAI's own server does.

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::engine::Limits;
use crate::model::SamplerConfig;

/// An API error: the HTTP status and OpenAI's error object.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn server(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// Parses a JSON body; a failure names the field (`messages[0].content`) where there is one.
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ApiError {
            param: None,
            ..ApiError::invalid("", "the request body is empty: send a JSON object")
        });
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError {
                param: None,
                ..ApiError::invalid("", format!("the request body is not valid JSON: {inner}"))
            };
        }
        if path == "." || path.is_empty() {
            return ApiError {
                param: None,
                ..ApiError::invalid("", format!("the request body: {inner}"))
            };
        }
        let detail = if inner.to_string().contains("untagged enum") {
            match path.split('.').next().unwrap_or("") {
                "prompt" => "expected a string, a list of strings, a list of token ids or a list of lists of token ids".to_string(),
                "stop" => "expected a string or a list of strings".to_string(),
                p if p.starts_with("messages") => {
                    "expected a string or a list of {\"type\": \"text\", \"text\": ...} parts".to_string()
                }
                _ => inner.to_string(),
            }
        } else {
            inner.to_string()
        };
        ApiError::invalid(&path, format!("`{path}`: {detail}"))
    })
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints share: sampling, limits, streaming, and the refused extras.
#[derive(Clone, Debug, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub ignore_eos: bool,
    pub return_token_ids: bool,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
}

/// A request body: its own fields and [`Common`]'s, declared in the struct itself (serde's
/// `flatten` would hide the path of a bad field from the error).
macro_rules! request {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* }) => {
        $(#[$m])*
        #[derive(Clone, Debug, Deserialize)]
        pub struct $name {
            $($(#[$fm])* pub $f: $t,)*
            pub model: Option<String>,
            pub max_tokens: Option<i64>,
            pub temperature: Option<f32>,
            pub top_p: Option<f32>,
            /// Not OpenAI's (vLLM's): keep the k most likely tokens; 0 or −1 is off.
            pub top_k: Option<i64>,
            pub seed: Option<u64>,
            pub stop: Option<Stop>,
            #[serde(default)]
            pub stream: bool,
            pub stream_options: Option<StreamOptions>,
            pub n: Option<i64>,
            /// Not OpenAI's (vLLM's): keep going past end-of-sequence tokens.
            #[serde(default)]
            pub ignore_eos: bool,
            /// Not OpenAI's (vLLM's): add `token_ids` (and `prompt_token_ids`) to each choice.
            #[serde(default)]
            pub return_token_ids: bool,
            pub presence_penalty: Option<f32>,
            pub frequency_penalty: Option<f32>,
            pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
        }

        impl $name {
            pub fn common(&self) -> Common {
                Common {
                    model: self.model.clone(),
                    max_tokens: self.max_tokens,
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    seed: self.seed,
                    stop: self.stop.clone(),
                    stream: self.stream,
                    stream_options: self.stream_options.clone(),
                    n: self.n,
                    ignore_eos: self.ignore_eos,
                    return_token_ids: self.return_token_ids,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    logit_bias: self.logit_bias.clone(),
                }
            }
        }
    };
}

request! {
    /// `POST /v1/completions`.
    pub struct CompletionRequest {
        pub prompt: Option<Prompt>,
        /// Top alternatives per token, 0–20 (`None`: no logprobs).
        pub logprobs: Option<i64>,
        #[serde(default)]
        pub echo: bool,
        pub best_of: Option<i64>,
        pub suffix: Option<String>,
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct MessageIn {
    pub role: String,
    pub content: Option<Content>,
}

request! {
    /// `POST /v1/chat/completions`.
    pub struct ChatRequest {
        pub messages: Option<Vec<MessageIn>>,
        /// The newer name of `max_tokens`.
        pub max_completion_tokens: Option<i64>,
        #[serde(default)]
        pub logprobs: bool,
        pub top_logprobs: Option<i64>,
        pub tools: Option<Vec<serde_json::Value>>,
        pub response_format: Option<serde_json::Value>,
        /// Not OpenAI's (vLLM's): render the template without opening the assistant's turn.
        pub add_generation_prompt: Option<bool>,
    }
}

/// The most stop strings a request may give.
pub const MAX_STOPS: usize = 16;
/// The most alternatives per token.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// The most choices one request may ask for (`n` × prompts).
pub const MAX_CHOICES: usize = 16;
/// OpenAI's default `max_tokens` for /v1/completions.
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// Checked generation settings of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    /// `None`: not given (the endpoint's default applies).
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    pub seed_given: bool,
    /// `Some(n)`: report logprobs with n alternatives.
    pub logprobs: Option<usize>,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub n: usize,
    pub stop_at_eos: bool,
    pub return_token_ids: bool,
}

fn refuse_set<T: PartialEq>(v: &Option<T>, neutral: T, param: &str) -> Result<(), ApiError> {
    match v {
        Some(x) if *x != neutral => Err(ApiError::invalid(
            param,
            format!("`{param}` is not supported by this server; leave it out"),
        )),
        _ => Ok(()),
    }
}

impl Common {
    /// The settings, given the request's own logprobs field (already checked).
    pub fn params(&self, logprobs: Option<usize>) -> Result<GenParams, ApiError> {
        refuse_set(&self.presence_penalty, 0.0, "presence_penalty")?;
        refuse_set(&self.frequency_penalty, 0.0, "frequency_penalty")?;
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid(
                "logit_bias",
                "`logit_bias` is not supported by this server; leave it out",
            ));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be a positive count, or 0 / -1 for off; got {k}"),
                ))
            }
        };
        let max_tokens = match self.max_tokens {
            None => None,
            Some(m) if m >= 1 => Some(m as usize),
            Some(m) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("`max_tokens` must be at least 1, got {m}"),
                ))
            }
        };
        let stops = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOPS} stop strings, got {}", stops.len()),
            ));
        }
        if stops.iter().any(|s| s.is_empty()) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        let n = match self.n.unwrap_or(1) {
            n if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
            n => {
                return Err(ApiError::invalid(
                    "n",
                    format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
                ))
            }
        };
        Ok(GenParams {
            max_tokens,
            sampling: SamplerConfig {
                temperature,
                top_p,
                top_k,
                seed: self.seed.unwrap_or(0),
            },
            seed_given: self.seed.is_some(),
            logprobs,
            stops,
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            n,
            stop_at_eos: !self.ignore_eos,
            return_token_ids: self.return_token_ids,
        })
    }
}

fn top_count(v: i64, param: &str) -> Result<usize, ApiError> {
    if (0..=MAX_TOP_LOGPROBS).contains(&v) {
        Ok(v as usize)
    } else {
        Err(ApiError::invalid(
            param,
            format!("`{param}` must be between 0 and {MAX_TOP_LOGPROBS}, got {v}"),
        ))
    }
}

impl CompletionRequest {
    pub fn params(&self) -> Result<GenParams, ApiError> {
        refuse_set(&self.best_of, 1, "best_of")?;
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid(
                "suffix",
                "`suffix` is not supported by this server; leave it out",
            ));
        }
        let logprobs = self
            .logprobs
            .map(|v| top_count(v, "logprobs"))
            .transpose()?;
        self.common().params(logprobs)
    }
}

impl ChatRequest {
    pub fn params(&self) -> Result<GenParams, ApiError> {
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid(
                "tools",
                "tool calling is not supported by this server; leave `tools` out",
            ));
        }
        if let Some(rf) = &self.response_format {
            if rf.get("type").and_then(|t| t.as_str()) != Some("text") {
                return Err(ApiError::invalid(
                    "response_format",
                    "only `{\"type\": \"text\"}` is supported",
                ));
            }
        }
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (false, Some(_)) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ))
            }
            (false, None) => None,
            (true, t) => Some(top_count(t.unwrap_or(0), "top_logprobs")?),
        };
        let mut p = self.common().params(logprobs)?;
        if let Some(m) = self.max_completion_tokens {
            if m < 1 {
                return Err(ApiError::invalid(
                    "max_completion_tokens",
                    format!("`max_completion_tokens` must be at least 1, got {m}"),
                ));
            }
            p.max_tokens = Some(m as usize);
        }
        Ok(p)
    }

    /// The messages as the template sees them; a message list that is missing or empty,
    /// or a part that is not text, is an error naming it.
    pub fn messages(&self) -> Result<Vec<crate::chat::ChatMessage>, ApiError> {
        let msgs = match &self.messages {
            None => {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` is required: a list of {\"role\", \"content\"} objects",
                ))
            }
            Some(m) if m.is_empty() => {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` is empty: give at least one message",
                ))
            }
            Some(m) => m,
        };
        msgs.iter()
            .enumerate()
            .map(|(i, m)| {
                if !["system", "developer", "user", "assistant", "tool"].contains(&m.role.as_str())
                {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!(
                            "`messages[{i}].role` must be system, developer, user, assistant or tool; got {:?}",
                            m.role
                        ),
                    ));
                }
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut s = String::new();
                        for (k, p) in parts.iter().enumerate() {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => s.push_str(t),
                                _ => {
                                    return Err(ApiError::invalid(
                                        &format!("messages[{i}].content[{k}]"),
                                        format!(
                                            "only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, got type {:?}",
                                            p.kind
                                        ),
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                let role = if m.role == "developer" {
                    "system"
                } else {
                    &m.role
                };
                Ok(crate::chat::ChatMessage::new(role, &content))
            })
            .collect()
    }
}

/// `max_tokens` checked against the context: the prompt must leave room for one token, and
/// an explicit `max_tokens` must fit after the prompt. `default` applies when none was given
/// (`None`: all the room left).
pub fn check_context(
    prompt_tokens: usize,
    max_tokens: Option<usize>,
    default: Option<usize>,
    limits: &Limits,
    prompt_param: &str,
) -> Result<usize, ApiError> {
    let context = limits.max_tokens_per_sequence();
    if prompt_tokens == 0 {
        return Err(ApiError::invalid(
            prompt_param,
            format!("`{prompt_param}` holds no tokens: give at least one"),
        ));
    }
    if prompt_tokens >= context {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "this server's context is {context} tokens, but the prompt alone is {prompt_tokens} tokens (leave room for at least one generated token)"
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = context - prompt_tokens;
    match max_tokens {
        Some(m) if m > room => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "this server's context is {context} tokens, but you asked for {} ({prompt_tokens} in the prompt, {m} to generate); lower `max_tokens` to at most {room}",
                prompt_tokens + m
            ),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m),
        None => Ok(default.map_or(room, |d| d.min(room))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_seq_len: 100,
            page_size: 16,
            total_pages: 4,
            vocab_size: 384,
            max_batch: 4,
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let e = parse_body::<CompletionRequest>(br#"{"prompt": "x", "temperature": "hot"}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        let e = parse_body::<CompletionRequest>(br#"{"prompt": {"a": 1}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("list of token ids"), "{}", e.message);
        let e = parse_body::<ChatRequest>(br#"{"messages": [{"role": "user"}, {"content": "x"}]}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1]"), "{e:?}");
        let e = parse_body::<ChatRequest>(b"{\"messages\": [").unwrap_err();
        assert!(
            e.param.is_none() && e.message.contains("not valid JSON"),
            "{e:?}"
        );
        let e = parse_body::<ChatRequest>(b"  ").unwrap_err();
        assert!(e.message.contains("empty"));
    }

    #[test]
    fn settings_are_checked() {
        let req = |s: &str| parse_body::<CompletionRequest>(s.as_bytes()).unwrap();
        let p = req(r#"{"prompt": "x", "temperature": 0, "top_k": -1, "stop": "\n", "seed": 3}"#)
            .params()
            .unwrap();
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.stops, vec!["\n".to_string()]);
        assert!(p.seed_given && p.stop_at_eos);
        for (body, param) in [
            (r#"{"temperature": 3}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -2}"#, "top_k"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"logprobs": 21}"#, "logprobs"),
            (r#"{"stop": ["a", ""]}"#, "stop"),
            (r#"{"presence_penalty": 0.5}"#, "presence_penalty"),
            (r#"{"logit_bias": {"1": 5}}"#, "logit_bias"),
            (r#"{"best_of": 2}"#, "best_of"),
        ] {
            let e = req(body).params().unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert_eq!(e.status, 400);
        }
        assert!(req(r#"{"presence_penalty": 0, "logit_bias": {}}"#)
            .params()
            .is_ok());
    }

    #[test]
    fn chat_messages_are_checked() {
        let req = |s: &str| parse_body::<ChatRequest>(s.as_bytes()).unwrap();
        assert_eq!(
            req(r#"{"messages": []}"#)
                .messages()
                .unwrap_err()
                .param
                .as_deref(),
            Some("messages")
        );
        assert_eq!(
            req(r#"{}"#).messages().unwrap_err().param.as_deref(),
            Some("messages")
        );
        let e = req(r#"{"messages": [{"role": "robot", "content": "x"}]}"#)
            .messages()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = req(
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
        )
        .messages()
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        let m = req(r#"{"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#)
            .messages()
            .unwrap();
        assert_eq!(m[0].role, "system");
        assert_eq!(m[0].content, "ab");
        let e = req(r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#)
            .params()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = req(r#"{"messages": [], "tools": [{"type": "function"}]}"#)
            .params()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"));
    }

    #[test]
    fn context_limits() {
        let l = limits();
        // The pool (4 pages of 16) is smaller than max_seq_len: it is the bound.
        assert_eq!(check_context(10, Some(54), None, &l, "prompt"), Ok(54));
        let e = check_context(10, Some(55), None, &l, "prompt").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        let e = check_context(64, None, None, &l, "messages").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(check_context(10, None, Some(16), &l, "prompt"), Ok(16));
        assert_eq!(check_context(60, None, Some(16), &l, "prompt"), Ok(4));
        assert_eq!(check_context(60, None, None, &l, "prompt"), Ok(4));
        assert!(check_context(0, None, None, &l, "prompt").is_err());
    }
}
