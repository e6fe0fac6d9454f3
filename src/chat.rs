//! Chat templates: the Jinja template a Hugging Face model ships (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`) rendered with minijinja, the way transformers'
//! `apply_chat_template` renders it — `trim_blocks` and `lstrip_blocks` on, `bos_token` /
//! `eos_token` and `add_generation_prompt` in the context, `raise_exception(...)` for the
//! template's own checks, and the Python string methods (`.strip()`, `.startswith()`, ...)
//! that templates call. The rendered text already holds the special tokens, so it is
//! tokenized without adding more (`TextTokenizer::encode_with(text, false)`).

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// `tokenizer_config.json`: what a chat template reads from it.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// transformers ≥ 4.43 writes the template to a file of its own.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// One message of a conversation, as the templates see it (`message.role`, `message.content`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template and the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Where the template came from (for error messages).
    origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// A special token in tokenizer_config.json: a string, or an AddedToken object.
fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// The template of a model directory: `chat_template.jinja` when present, else
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of
    /// which `default` — else the first — is taken). `Ok(None)`: the model has none.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
        let cfg: serde_json::Value = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::Io {
                path: cfg_path.display().to_string(),
                source: e,
            })?;
            serde_json::from_str(&text)
                .map_err(|e| Error::Model(format!("{}: not valid JSON: {e}", cfg_path.display())))?
        } else {
            serde_json::Value::Null
        };
        let bos = token_text(cfg.get("bos_token"));
        let eos = token_text(cfg.get("eos_token"));
        let file = dir.join(CHAT_TEMPLATE_FILE);
        if file.is_file() {
            let source = std::fs::read_to_string(&file).map_err(|e| Error::Io {
                path: file.display().to_string(),
                source: e,
            })?;
            return Self::new(&source, bos, eos, &file.display().to_string()).map(Some);
        }
        let origin = format!("{} chat_template", cfg_path.display());
        let source = match cfg.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => {
                let named = |want: Option<&str>| {
                    list.iter().find_map(|t| {
                        let name = t.get("name")?.as_str()?;
                        if want.is_none_or(|w| w == name) {
                            t.get("template")?.as_str().map(str::to_string)
                        } else {
                            None
                        }
                    })
                };
                named(Some("default"))
                    .or_else(|| named(None))
                    .ok_or_else(|| {
                        Error::Model(format!(
                            "{origin}: a list without a {{\"name\", \"template\"}} entry"
                        ))
                    })?
            }
            Some(other) => {
                return Err(Error::Model(format!(
                    "{origin}: expected a string or a list of named templates, got {other}"
                )))
            }
        };
        Self::new(&source, bos, eos, &origin).map(Some)
    }

    /// Compiles `source`; a syntax error names `origin` and the line.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
        origin: &str,
    ) -> Result<Self> {
        let mut env = Environment::new();
        // transformers renders with jinja2's trim_blocks and lstrip_blocks.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Model(format!("chat template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        // transformers' tojson: plain JSON, no HTML escaping, keys in the order given.
        env.add_filter(
            "tojson",
            |v: Value, indent: Option<usize>| -> Result<Value, minijinja::Error> {
                let text = match indent {
                    Some(n) => {
                        let mut out = Vec::new();
                        let pad = vec![b' '; n];
                        let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
                        let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
                        v.serialize(&mut ser).map_err(|e| {
                            minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string())
                        })?;
                        String::from_utf8_lossy(&out).into_owned()
                    }
                    None => serde_json::to_string(&v).map_err(|e| {
                        minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string())
                    })?,
                };
                Ok(Value::from_safe_string(text))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| {
                Error::Model(format!(
                    "{origin}: the chat template does not compile: {e:#}"
                ))
            })?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            origin: origin.to_string(),
        })
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The conversation as the model reads it; `add_generation_prompt` ends it with the
    /// assistant's turn opened. A template's `raise_exception` comes back as the error text.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Model(format!("{}: {e}", self.origin)))?;
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        tmpl.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => Error::Model(format!(
                "the chat template refused the conversation: {}",
                e.detail().unwrap_or("no reason given")
            )),
            _ => Error::Model(format!("the chat template failed to render: {e:#}")),
        })
    }
}

/// How many leading tokens of `next` a cache holding `cached` can keep: their common prefix,
/// less one when it covers all of `next` (a step needs at least one new token to give logits).
pub fn reusable_prefix(cached: &[u32], next: &[u32]) -> usize {
    let common = cached.iter().zip(next).take_while(|(a, b)| a == b).count();
    common.min(next.len().saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written for these tests in the style of the GLM / DeepSeek templates: a namespace
    /// carried through the loop, a system prompt pulled out first, Python string methods,
    /// an exception for a role it does not know.
    const TEMPLATE: &str = r#"{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] | trim -%}{%- endif -%}
{%- endfor -%}
{%- if ns.system %}[sys]{{ ns.system }}{% endif %}
{% for m in messages %}
{% if m.role == 'user' %}
<|user|>{{ m.content.strip() }}
{% elif m.role == 'assistant' %}
<|assistant|>{{ m.content }}{{ eos_token }}
{% elif m.role != 'system' %}
{{ raise_exception('role ' ~ m.role ~ ' is not supported') }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"#;

    fn tmpl() -> ChatTemplate {
        ChatTemplate::new(TEMPLATE, Some("<s>".into()), Some("</s>".into()), "test").unwrap()
    }

    #[test]
    fn renders_like_transformers_trimmed_blocks() {
        // The expected text is what jinja2 3.1.6 renders with transformers' settings
        // (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks).
        let msgs = [
            ChatMessage::new("system", "  Be brief.  "),
            ChatMessage::new("user", " Hi "),
            ChatMessage::new("assistant", "Hello."),
            ChatMessage::new("user", "Again"),
        ];
        let got = tmpl().render(&msgs, true).unwrap();
        assert_eq!(
            got,
            "<s>[sys]Be brief.<|user|>Hi\n<|assistant|>Hello.</s>\n<|user|>Again\n<|assistant|>"
        );
        let open = tmpl().render(&msgs[..2], false).unwrap();
        assert!(!open.ends_with("<|assistant|>"), "{open:?}");
    }

    #[test]
    fn raise_exception_is_an_error_with_the_templates_words() {
        let e = tmpl()
            .render(&[ChatMessage::new("tool", "x")], true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("role tool is not supported"), "{e}");
    }

    #[test]
    fn syntax_errors_name_the_origin() {
        let e = ChatTemplate::new("{% for %}", None, None, "dir/tokenizer_config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dir/tokenizer_config.json") && e.contains("compile"),
            "{e}"
        );
    }

    #[test]
    fn tojson_is_plain_json_in_key_order() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ '<a&b>' | tojson }}",
            None,
            None,
            "t",
        )
        .unwrap();
        let got = t.render(&[ChatMessage::new("user", "x")], false).unwrap();
        assert_eq!(got, r#"{"role":"user","content":"x"}|"<a&b>""#);
    }

    #[test]
    fn model_dir_templates_string_list_and_file() {
        let dir = std::env::temp_dir().join(format!("chat-tmpl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |s: &str| std::fs::write(dir.join(TOKENIZER_CONFIG_FILE), s).unwrap();
        assert!(ChatTemplate::from_model_dir(&dir).unwrap().is_none());
        write(
            r#"{"eos_token": {"content": "</s>", "__type": "AddedToken"}, "chat_template": "A{{ eos_token }}"}"#,
        );
        let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "A</s>");
        write(
            r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
        );
        let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "D");
        std::fs::write(dir.join(CHAT_TEMPLATE_FILE), "F").unwrap();
        let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "F");
        write("{not json");
        assert!(ChatTemplate::from_model_dir(&dir)
            .unwrap_err()
            .to_string()
            .contains("not valid JSON"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn prefix_reuse_keeps_one_token_to_feed() {
        assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 3]), 2);
        assert_eq!(reusable_prefix(&[1, 2, 3, 4], &[1, 2]), 1);
        assert_eq!(reusable_prefix(&[], &[7]), 0);
        assert_eq!(reusable_prefix(&[9], &[7, 8]), 0);
    }
}
