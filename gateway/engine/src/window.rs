//! The stream path's window: chunks are buffered to `flushChars`; the chain runs on (held-back tail +
//! new text); all but the last `lookbackChars` characters of the result are committed and that tail
//! becomes the next batch's prefix, so a pattern split across chunks is seen whole before any of it is
//! shown. Counted in characters, never splitting one.

/// Splits `text` so that the second part holds its last `keep` characters (never splitting one).
pub fn split_tail(text: &str, keep: usize) -> (&str, &str) {
    let chars = text.chars().count();
    if chars <= keep {
        return ("", text);
    }
    let at = text
        .char_indices()
        .nth(chars - keep)
        .map(|(i, _)| i)
        .unwrap_or(text.len());
    text.split_at(at)
}

/// Splits `text` at the given character positions (taken modulo its length, sorted, deduplicated):
/// how tests and tools cut a reply into chunks.
pub fn chunk_at(text: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut last = 0;
    for c in cuts.into_iter().chain([chars.len()]) {
        if c > last {
            out.push(chars[last..c].iter().collect());
            last = c;
        }
    }
    out
}

/// The stream path's window: what was received but not yet run, and what was run but held back.
#[derive(Debug, Default)]
pub struct Window {
    /// Raw text received since the last flush.
    pending: String,
    pending_chars: usize,
    /// Processed text held back from the last flush.
    tail: String,
    flush_chars: usize,
    lookback_chars: usize,
}

impl Window {
    pub fn new(flush_chars: usize, lookback_chars: usize) -> Self {
        Self {
            flush_chars: flush_chars.max(1),
            lookback_chars,
            ..Default::default()
        }
    }

    /// Adds received text; true when enough is buffered to run the chain.
    pub fn push(&mut self, chunk: &str) -> bool {
        self.pending.push_str(chunk);
        self.pending_chars += chunk.chars().count();
        self.pending_chars >= self.flush_chars
    }

    /// Bytes received and not yet run.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// The batch to run now (held-back tail + new text), or None when nothing new arrived.
    pub fn take_batch(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        self.pending_chars = 0;
        let mut batch = std::mem::take(&mut self.tail);
        batch.push_str(&std::mem::take(&mut self.pending));
        Some(batch)
    }

    /// Takes the chain's result for a batch; returns the part safe to commit now. On the last batch
    /// everything is committed.
    pub fn settle(&mut self, result: &str, last: bool) -> String {
        if last {
            return result.to_string();
        }
        let (commit, tail) = split_tail(result, self.lookback_chars);
        self.tail = tail.to_string();
        commit.to_string()
    }

    /// What is still held back, released as-is at the end when no new text came after it.
    pub fn release_tail(&mut self) -> String {
        std::mem::take(&mut self.tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_tail_counts_characters_not_bytes() {
        assert_eq!(split_tail("héllo wörld", 3), ("héllo wö", "rld"));
        assert_eq!(split_tail("日本語テキスト", 2), ("日本語テキ", "スト"));
        assert_eq!(split_tail("ab", 5), ("", "ab"));
        assert_eq!(split_tail("ab\r\n", 1), ("ab\r", "\n"));
    }

    #[test]
    fn window_holds_back_the_lookback_and_releases_it_at_the_end() {
        let mut w = Window::new(4, 2);
        assert!(!w.push("ab"));
        assert!(w.push("cd"));
        let batch = w.take_batch().unwrap();
        assert_eq!(batch, "abcd");
        assert_eq!(w.settle(&batch, false), "ab");
        w.push("e");
        assert_eq!(
            w.take_batch().unwrap(),
            "cde",
            "the held-back tail prefixes the next batch"
        );
        assert_eq!(w.settle("cde", true), "cde");
        assert_eq!(w.take_batch(), None);
        assert_eq!(w.release_tail(), "");
    }
}
