//! Text the operator writes into objects whose fields the API server bounds (condition messages,
//! Event notes): cut at a character boundary, never refused.

/// `s` in at most `max_bytes` bytes: whole when it fits, else cut at a character boundary with `…`
/// (counted) at the end.
pub(crate) fn bounded(mut s: String, max_bytes: usize) -> String {
    if s.len() > max_bytes {
        let mut cut = max_bytes.saturating_sub('…'.len_utf8());
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::bounded;

    #[test]
    fn text_is_cut_at_a_character_boundary_within_the_bound() {
        assert_eq!(bounded("short".into(), 1000), "short");
        let long = bounded("é".repeat(800), 1000);
        assert!(long.len() <= 1000 && long.ends_with('…'), "{}", long.len());
        assert!(long.trim_end_matches('…').chars().all(|c| c == 'é'));
        let exact = "x".repeat(300);
        assert_eq!(bounded(exact.clone(), 300), exact);
    }
}
