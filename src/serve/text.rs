//! Text out of token ids as they arrive: the `tokenizers` crate's streaming decoder (it
//! decodes a short window, never the whole sequence, and holds back a partial UTF-8
//! character), and stop strings, which hold back any tail that could still grow into one.

use crate::model::TextTokenizer;

/// The streaming decoder's state for one sequence.
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl Default for Detokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Detokenizer {
    pub fn new() -> Self {
        Detokenizer {
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// The text `id` completes (empty while a character is still partial).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> String {
        match tokenizers::step_decode_stream(
            tok.hf(),
            vec![id],
            false,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        ) {
            Ok(text) => text.unwrap_or_default(),
            // A decoder whose output is not prefix-stable: start a new window at this token.
            Err(_) => {
                self.ids.clear();
                self.prefix.clear();
                self.prefix_index = 0;
                tok.decode(&[id]).unwrap_or_default()
            }
        }
    }

    /// Whatever is still held back (a dangling partial character comes out as U+FFFD).
    pub fn finish(&mut self, tok: &TextTokenizer) -> String {
        let all = tok.decode(&self.ids).unwrap_or_default();
        let rest = all
            .strip_prefix(self.prefix.as_str())
            .unwrap_or("")
            .to_string();
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        rest
    }
}

/// Stop strings over streamed text: [`StopMatcher::push`] returns what can be shown now.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds text; returns the part that is final (before any stop string, and not a possible
    /// start of one). After a stop string matched, returns nothing more.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Keep the longest tail that is a prefix of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        out
    }

    /// The held tail, at the end of the text (no stop string can complete any more).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("hello E"), "hello ");
        assert_eq!(m.push("N"), "");
        assert_eq!(m.push("x"), "ENx");
        assert_eq!(m.push(" then\n"), " then");
        assert_eq!(m.push("\nmore"), "");
        assert!(m.stopped());
        assert_eq!(m.push("after"), "");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn stop_inside_one_push_and_multibyte_tails() {
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("caféé"), "café");
        assert_eq!(m.finish(), "é");
        let mut m = StopMatcher::new(vec!["ab".into()]);
        assert_eq!(m.push("xxabyy"), "xx");
        assert!(m.stopped());
        let mut none = StopMatcher::new(vec![String::new()]);
        assert_eq!(none.push("text"), "text");
    }

    #[test]
    fn streamed_text_equals_the_whole_decode() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/glm_moe_dsa-tiny/tokenizer.json");
        let tok = TextTokenizer::from_file(&dir).unwrap();
        let ids = tok
            .encode("Multi-head latent attention: é, ü, 字 and 🙂 too.")
            .unwrap();
        let mut d = Detokenizer::new();
        let mut got: String = ids.iter().map(|&i| d.push(&tok, i)).collect();
        got.push_str(&d.finish(&tok));
        assert_eq!(got, tok.decode(&ids).unwrap());
    }
}
