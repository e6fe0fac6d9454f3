//! `tokenizer.json` through the `tokenizers` crate, and a streaming decoder that prints text
//! as tokens arrive without splitting a UTF-8 character across two prints.

use std::path::Path;

use crate::{Error, Result};

pub const TOKENIZER_FILE: &str = "tokenizer.json";

pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
}

/// Runs a call into the `tokenizers` crate, which panics (rather than returning an error) on
/// some malformed `tokenizer.json` files (an `expect` in its decoder deserialisation, found
/// by tests/fuzz_inputs.rs): the panic becomes an error naming `what`. The panic hook is
/// silenced for the call so the user sees our message, not a backtrace; loading a tokenizer
/// happens once, at start-up, so muting the hook briefly hides nothing else.
fn no_panic<T>(what: &dyn Fn() -> String, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    r.unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(Error::Model(format!(
            "{}: the tokenizers crate gave up on it ({msg}); the file is malformed",
            what()
        )))
    })
}

impl TextTokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let what = || format!("{}", path.display());
        let inner = no_panic(&what, || {
            tokenizers::Tokenizer::from_file(path).map_err(|e| {
                Error::Model(format!("{}: cannot load tokenizer: {e}", path.display()))
            })
        })?;
        Ok(TextTokenizer { inner })
    }

    /// Token ids of `text`, with the special tokens the tokenizer's post-processor adds
    /// (what transformers' tokenizer call does by default).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Token ids of `text`; `add_special_tokens: false` for text that already holds them (a
    /// rendered chat template, as transformers' `apply_chat_template` tokenizes it).
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Model(format!("cannot tokenize the prompt: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The `tokenizers` tokenizer itself (for its streaming decoder).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The id of a token spelled exactly `text` in the vocabulary (special tokens included).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Model(format!("cannot decode token ids: {e}")))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Decodes a growing id list and hands out only the text that is new and complete.
pub struct TextStream<'a> {
    tok: &'a TextTokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl<'a> TextStream<'a> {
    pub fn new(tok: &'a TextTokenizer) -> Self {
        TextStream {
            tok,
            ids: Vec::new(),
            printed: 0,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty while a multi-byte
    /// character is still partial).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}')
            || text.len() < self.printed
            || !text.is_char_boundary(self.printed)
        {
            return Ok(String::new());
        }
        let new = text[self.printed..].to_string();
        self.printed = text.len();
        Ok(new)
    }

    /// Whatever is left (a dangling partial character comes out as U+FFFD).
    pub fn finish(&mut self) -> Result<String> {
        let text = self.tok.decode(&self.ids)?;
        let new = text.get(self.printed..).unwrap_or("").to_string();
        self.printed = text.len();
        Ok(new)
    }
}
