//! The stream path's window: chunks are buffered to `flushChars`; the chain runs on (held-back tail +
//! new text); all but the last `lookbackChars` characters of the result are committed and that tail
//! becomes the next batch's prefix, so a pattern split across chunks is seen whole before any of it is
//! shown. Counted in characters, never splitting one.
//!
//! One exception: when the chain changed the very end of its batch, that change may be a match cut
//! short by the batch's end (`sam.jones@example.co` masked before its `m` arrived, the first digits
//! of a card number), and committing any of the result would show the mask followed by the rest of
//! the match. Nothing of such a run is committed: the batch is held back as it was and runs again
//! with what follows, until the chain leaves its end alone. (Hooks answer with text, not
//! positions, so which raw text a change replaced cannot be known; guessing it with a diff goes
//! wrong on repeated text.) A batch held past `HOLD_CHARS` is settled as it is, so a hook that
//! always rewrites the end cannot stall a stream.

/// Splits `text` so that the second part holds its last `keep` characters (never splitting one).
pub(crate) fn split_tail(text: &str, keep: usize) -> (&str, &str) {
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
pub(crate) struct Window {
    /// Raw text received since the last flush.
    pending: String,
    pending_chars: usize,
    /// Text held back from the last flush: processed, then (when the chain changed the batch's end)
    /// the raw text that change replaced.
    tail: String,
    /// Whether `tail` ends in raw text, which must go through the chain before it is shown.
    tail_has_raw: bool,
    flush_chars: usize,
    lookback_chars: usize,
}

impl Window {
    pub(crate) fn new(flush_chars: usize, lookback_chars: usize) -> Self {
        Self {
            flush_chars: flush_chars.max(1),
            lookback_chars,
            ..Default::default()
        }
    }

    /// Adds received text; true when enough is buffered to run the chain.
    pub(crate) fn push(&mut self, chunk: &str) -> bool {
        self.pending.push_str(chunk);
        self.pending_chars += chunk.chars().count();
        self.pending_chars >= self.flush_chars
    }

    /// Bytes received and not yet run.
    pub(crate) fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// The batch to run now (held-back tail + new text), or None when nothing new arrived and
    /// nothing held back still needs the chain.
    pub(crate) fn take_batch(&mut self) -> Option<String> {
        if self.pending.is_empty() && !self.tail_has_raw {
            return None;
        }
        self.pending_chars = 0;
        self.tail_has_raw = false;
        let mut batch = std::mem::take(&mut self.tail);
        batch.push_str(&std::mem::take(&mut self.pending));
        Some(batch)
    }

    /// Takes the chain's result for `batch`; returns the part safe to commit now. On the last batch
    /// everything is committed.
    pub(crate) fn settle(&mut self, batch: &str, result: &str, last: bool) -> String {
        if last {
            return result.to_string();
        }
        if self.lookback_chars > 0
            && end_changed(batch, result)
            && batch.chars().count() < self.hold_chars()
        {
            self.tail = batch.to_string();
            self.tail_has_raw = true;
            return String::new();
        }
        let (commit, tail) = split_tail(result, self.lookback_chars);
        self.tail = tail.to_string();
        commit.to_string()
    }

    /// What is still held back, released as-is at the end when no new text came after it (never
    /// raw text: `take_batch` hands that to the chain first).
    pub(crate) fn release_tail(&mut self) -> String {
        debug_assert!(!self.tail_has_raw, "raw text is run before it is released");
        std::mem::take(&mut self.tail)
    }

    /// The longest batch held back whole because the chain changed its end.
    fn hold_chars(&self) -> usize {
        HOLD_CHARS.max(4 * (self.flush_chars + self.lookback_chars))
    }
}

/// A batch held back whole grows to at least this many characters before it is settled anyway.
const HOLD_CHARS: usize = 1024;

/// Whether the chain changed the last character of `batch` (or removed it).
fn end_changed(batch: &str, result: &str) -> bool {
    batch.chars().next_back() != result.chars().next_back()
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
        assert_eq!(w.settle(&batch, &batch, false), "ab");
        w.push("e");
        assert_eq!(
            w.take_batch().unwrap(),
            "cde",
            "the held-back tail prefixes the next batch"
        );
        assert_eq!(w.settle("cde", "cde", true), "cde");
        assert_eq!(w.take_batch(), None);
        assert_eq!(w.release_tail(), "");
    }

    #[test]
    fn a_batch_whose_end_the_chain_changed_is_held_back_whole() {
        let mut w = Window::new(4, 8);
        w.push("we will gladly mail sam@example.co");
        let batch = w.take_batch().unwrap();
        assert_eq!(w.settle(&batch, "we will gladly mail [email]", false), "");
        assert!(w.tail_has_raw);
        w.push("m now");
        let batch = w.take_batch().unwrap();
        assert_eq!(batch, "we will gladly mail sam@example.com now");
        assert_eq!(
            w.settle(&batch, "we will gladly mail [email] now", false),
            "we will gladly mail [em",
            "an end the chain leaves alone settles as usual"
        );
        assert!(!w.tail_has_raw);
    }

    #[test]
    fn held_back_text_is_run_before_the_stream_ends() {
        let mut w = Window::new(1, 8);
        w.push("pin 1234");
        let batch = w.take_batch().unwrap();
        assert_eq!(w.settle(&batch, "pin [n]", false), "");
        assert_eq!(w.take_batch().as_deref(), Some("pin 1234"));
        assert_eq!(w.settle("pin 1234", "pin [n]", true), "pin [n]");
        assert_eq!(w.take_batch(), None);
    }

    #[test]
    fn a_batch_is_held_back_only_up_to_its_bound_or_without_a_lookback() {
        let long = "y".repeat(HOLD_CHARS);
        let mut w = Window::new(4, 8);
        assert_eq!(
            w.settle(&long, &"Y".repeat(HOLD_CHARS), false).len(),
            HOLD_CHARS - 8
        );
        assert!(!w.tail_has_raw);
        let mut w = Window::new(4, 0);
        assert_eq!(w.settle("pin 1234", "pin [n]", false), "pin [n]");
        assert!(!w.tail_has_raw);
    }
}
