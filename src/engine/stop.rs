//! Stop conditions: stop strings matched across the boundaries of streamed text chunks.

use std::mem;

/// What a [`StopChecker`] lets through for one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCheck {
    /// Text that can no longer be part of a stop string, safe to send to the client now.
    pub text: String,
    /// The stop string that ended the text, once one has been matched.
    pub matched_stop: Option<String>,
}

/// Cuts a stream of text at the first stop string in it, holding back text that could be the
/// start of one until later chunks resolve it. The stop string and everything after it are never
/// released.
///
/// "First" means the occurrence that ends earliest (the longest one on a tie): that is where
/// generation would stop if text arrived one character at a time, so the result does not depend
/// on how the text is split into chunks.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop_strings: Vec<String>,
    /// Bytes a held suffix can span: anything longer would already contain a whole stop string.
    longest_partial_len: usize,
    /// Received text not yet released: a suffix that is a proper prefix of some stop string.
    held: String,
    matched_stop: Option<String>,
}

impl StopChecker {
    /// Empty stop strings are ignored: they would match before any text. With no stop strings
    /// every chunk is released as it comes.
    pub fn new<S: Into<String>>(stop_strings: impl IntoIterator<Item = S>) -> Self {
        let stop_strings: Vec<String> = stop_strings
            .into_iter()
            .map(Into::into)
            .filter(|stop| !stop.is_empty())
            .collect();
        let longest_partial_len = stop_strings
            .iter()
            .map(|stop| stop.len() - 1)
            .max()
            .unwrap_or(0);
        Self {
            stop_strings,
            longest_partial_len,
            held: String::new(),
            matched_stop: None,
        }
    }

    /// Takes the next chunk of generated text. Once a stop string has matched, every later call
    /// releases nothing and reports that same stop string.
    pub fn push(&mut self, chunk: &str) -> StopCheck {
        if self.matched_stop.is_some() {
            return StopCheck {
                text: String::new(),
                matched_stop: self.matched_stop.clone(),
            };
        }
        self.held.push_str(chunk);
        if let Some((start, stop_index)) = self.first_complete_stop() {
            let mut text = mem::take(&mut self.held);
            text.truncate(start);
            self.matched_stop = Some(self.stop_strings[stop_index].clone());
            return StopCheck {
                text,
                matched_stop: self.matched_stop.clone(),
            };
        }
        let still_held = self.held.split_off(self.partial_stop_start());
        StopCheck {
            text: mem::replace(&mut self.held, still_held),
            matched_stop: None,
        }
    }

    /// Ends the stream: the held text turned out not to start a stop string, so it is released,
    /// unless a stop string has matched.
    pub fn finish(self) -> String {
        if self.matched_stop.is_some() {
            String::new()
        } else {
            self.held
        }
    }

    /// The byte offset and the index of the stop string of the occurrence in the held text that
    /// ends first. Nothing before the held text can start a match, so searching it is enough.
    fn first_complete_stop(&self) -> Option<(usize, usize)> {
        self.stop_strings
            .iter()
            .enumerate()
            .filter_map(|(index, stop)| self.held.find(stop.as_str()).map(|start| (start, index)))
            .min_by_key(|&(start, index)| (start + self.stop_strings[index].len(), start))
    }

    /// Where the longest suffix of the held text that begins some stop string starts (the held
    /// text's length when none does). Only char boundaries are tried, so a multi-byte character
    /// is never split.
    fn partial_stop_start(&self) -> usize {
        let earliest = self.held.len().saturating_sub(self.longest_partial_len);
        self.held
            .char_indices()
            .map(|(offset, _)| offset)
            .skip_while(|&offset| offset < earliest)
            .find(|&offset| {
                let suffix = &self.held[offset..];
                self.stop_strings
                    .iter()
                    .any(|stop| stop.starts_with(suffix))
            })
            .unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks` and returns everything released (including by `finish`) and the stop matched.
    fn run(stops: &[&str], chunks: &[&str]) -> (String, Option<String>) {
        let mut checker = StopChecker::new(stops.iter().copied());
        let mut released = String::new();
        let mut matched_stop = None;
        for chunk in chunks {
            let check = checker.push(chunk);
            released.push_str(&check.text);
            matched_stop = check.matched_stop;
        }
        released.push_str(&checker.finish());
        (released, matched_stop)
    }

    /// The specification, on the whole text at once: cut at the occurrence that ends first.
    fn reference(stops: &[&str], text: &str) -> (String, Option<String>) {
        let first = stops
            .iter()
            .filter(|stop| !stop.is_empty())
            .filter_map(|stop| text.find(stop).map(|start| (start, *stop)))
            .min_by_key(|&(start, stop)| (start + stop.len(), start));
        match first {
            Some((start, stop)) => (text[..start].to_string(), Some(stop.to_string())),
            None => (text.to_string(), None),
        }
    }

    fn matched(stop: &str) -> Option<String> {
        Some(stop.to_string())
    }

    #[test]
    fn without_stop_strings_chunks_pass_straight_through() {
        let mut checker = StopChecker::new(Vec::<String>::new());
        assert_eq!(checker.push("Hello").text, "Hello");
        assert_eq!(checker.push(", wor").text, ", wor");
        assert_eq!(checker.finish(), "");
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let mut checker = StopChecker::new(["", "END"]);
        assert_eq!(checker.push("abc").text, "abc");
        assert_eq!(run(&[""], &["abc"]), ("abc".to_string(), None));
    }

    #[test]
    fn text_that_may_start_a_stop_string_is_held_until_resolved() {
        let mut checker = StopChecker::new(["</stop>"]);
        assert_eq!(checker.push("answer </s").text, "answer ");
        assert_eq!(checker.push("ection>").text, "</section>");
        assert_eq!(checker.push(" <").text, " ");
        assert_eq!(checker.finish(), "<");
    }

    #[test]
    fn a_stop_string_split_across_many_chunks_is_matched_and_dropped() {
        let mut checker = StopChecker::new(["<|im_end|>"]);
        let chunks = [
            "Done",
            ".<",
            "|",
            "im",
            "_",
            "end",
            "|",
            "> trailing",
            "more",
        ];
        let checks: Vec<StopCheck> = chunks.iter().map(|chunk| checker.push(chunk)).collect();
        assert_eq!(checks[0].text, "Done");
        assert_eq!(checks[1].text, ".");
        assert!(checks[2..].iter().all(|check| check.text.is_empty()));
        assert!(checks[..7].iter().all(|check| check.matched_stop.is_none()));
        assert_eq!(checks[7].matched_stop, matched("<|im_end|>"));
        assert_eq!(checks[8].matched_stop, matched("<|im_end|>"));
        assert_eq!(checker.finish(), "");
    }

    #[test]
    fn text_after_the_stop_string_in_the_same_chunk_is_dropped() {
        assert_eq!(
            run(&["STOP"], &["keep STOP drop", " more"]),
            ("keep ".to_string(), matched("STOP"))
        );
    }

    #[test]
    fn a_failed_partial_match_releases_text_that_starts_a_new_candidate() {
        assert_eq!(
            run(&["ab"], &["a", "a", "b"]),
            ("a".to_string(), matched("ab"))
        );
        assert_eq!(
            run(&["abcd"], &["abc", "abcd"]),
            ("abc".to_string(), matched("abcd"))
        );
    }

    #[test]
    fn overlapping_stop_strings_stop_at_the_one_completed_first() {
        // "bc" is complete before "abcd" could be, whatever the chunking.
        assert_eq!(
            run(&["abcd", "bc"], &["abcd"]),
            ("a".to_string(), matched("bc"))
        );
        assert_eq!(
            run(&["abcd", "bc"], &["a", "b", "c", "d"]),
            ("a".to_string(), matched("bc"))
        );
        // Both end at the same place: the longer one removes more.
        assert_eq!(
            run(&["c", "abc"], &["xab", "c"]),
            ("x".to_string(), matched("abc"))
        );
        // A longer candidate that fails still lets a shorter one inside it match.
        assert_eq!(
            run(&["abcd", "bce"], &["a", "b", "c", "e"]),
            ("a".to_string(), matched("bce"))
        );
    }

    #[test]
    fn multi_byte_characters_are_never_split() {
        let mut checker = StopChecker::new(["日本語", "é!"]);
        assert_eq!(checker.push("こんにちは日本").text, "こんにちは");
        assert_eq!(checker.push("人 café").text, "日本人 caf");
        let check = checker.push("!");
        assert_eq!(check.text, "");
        assert_eq!(check.matched_stop, matched("é!"));
        // "ã" shares its first UTF-8 byte with "é" but is not a prefix of "é!".
        assert_eq!(run(&["é!"], &["sã", "o"]), ("são".to_string(), None));
    }

    #[test]
    fn any_chunking_gives_the_same_result_as_the_whole_text() {
        let cases: [(&[&str], &str); 6] = [
            (&["abcd", "bc"], "xxabcdyy"),
            (&["aab", "ab"], "caaab"),
            (
                &["</think>", "<|im_end|>"],
                "let me think</thi</think>answer<|im_end|>",
            ),
            (&["ß日", "日本"], "aßß日本"),
            (&["never"], "nevertheless"),
            (&["xyz", "nev"], "ne ne nev"),
        ];
        for (stops, text) in cases {
            let expected = reference(stops, text);
            let chars: Vec<(usize, char)> = text.char_indices().collect();
            let one_char_chunks: Vec<&str> = chars
                .iter()
                .map(|&(offset, c)| &text[offset..offset + c.len_utf8()])
                .collect();
            assert_eq!(run(stops, &one_char_chunks), expected, "{text:?} by char");
            assert_eq!(run(stops, &[text]), expected, "{text:?} whole");
            for &(split, _) in &chars {
                assert_eq!(
                    run(stops, &[&text[..split], &text[split..]]),
                    expected,
                    "{text:?} split at {split}"
                );
            }
        }
    }
}
