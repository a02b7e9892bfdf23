//! Splitting a reply into reasoning and content as it streams: Qwen3.6 thinks inside
//! `<think>...</think>` before it answers.
//!
//! With thinking enabled, Qwen's template ends the prompt with `<think>\n`, so the reply starts
//! inside the thought; other templates (or thinking models prompted differently) let the reply
//! open `<think>` itself. Both are handled: [`ReasoningSplitter::new`] is told whether the prompt
//! opened a thought. The newlines the template puts around the tags are not part of either text.
//! Pushing text in any chunking gives the same result as pushing it whole.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Text sorted into the two channels of a reply.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace seen: the reply may still open `<think>`.
    Start,
    /// Inside the thought; `fresh` until its first non-whitespace character.
    Reasoning { fresh: bool },
    /// The answer; `fresh` until its first non-whitespace character.
    Content { fresh: bool },
}

/// Sorts streamed reply text into reasoning and content.
#[derive(Debug)]
pub struct ReasoningSplitter {
    phase: Phase,
    /// Text received and not yet sorted: a possible tag, or whitespace that may precede one.
    pending: String,
}

impl ReasoningSplitter {
    /// `prompt_opened_thought`: the prompt ends inside `<think>` (the reply starts as reasoning).
    pub fn new(prompt_opened_thought: bool) -> Self {
        Self {
            phase: if prompt_opened_thought {
                Phase::Reasoning { fresh: true }
            } else {
                Phase::Start
            },
            pending: String::new(),
        }
    }

    /// Takes the next piece of the reply and returns what can be sorted now.
    pub fn push(&mut self, text: &str) -> Split {
        self.pending.push_str(text);
        let mut out = Split::default();
        loop {
            match self.phase {
                Phase::Start => {
                    let trimmed = self.pending.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.pending = rest.to_owned();
                        self.phase = Phase::Reasoning { fresh: true };
                    } else if OPEN.starts_with(trimmed) {
                        return out;
                    } else {
                        self.phase = Phase::Content { fresh: true };
                    }
                }
                Phase::Reasoning { fresh } => {
                    if fresh {
                        if !self.trim_section_start() {
                            return out;
                        }
                        self.phase = Phase::Reasoning { fresh: false };
                    }
                    if let Some(at) = self.pending.find(CLOSE) {
                        out.reasoning.push_str(self.pending[..at].trim_end());
                        self.pending.drain(..at + CLOSE.len());
                        self.phase = Phase::Content { fresh: true };
                        continue;
                    }
                    // Hold a possible start of `</think>` and the whitespace before it.
                    let cut = self.pending.len() - partial_tag_len(&self.pending, CLOSE);
                    let cut = self.pending[..cut].trim_end().len();
                    out.reasoning.push_str(&self.pending[..cut]);
                    self.pending.drain(..cut);
                    return out;
                }
                Phase::Content { fresh } => {
                    if fresh {
                        if !self.trim_section_start() {
                            return out;
                        }
                        self.phase = Phase::Content { fresh: false };
                    }
                    out.content.push_str(&self.pending);
                    self.pending.clear();
                    return out;
                }
            }
        }
    }

    /// Drops the whitespace that opens a section; false while nothing else has arrived.
    fn trim_section_start(&mut self) -> bool {
        let trimmed = self.pending.trim_start();
        if trimmed.is_empty() {
            self.pending.clear();
            return false;
        }
        self.pending = trimmed.to_owned();
        true
    }

    /// Ends the reply: text held back turned out to be plain text of its channel.
    pub fn finish(&mut self) -> Split {
        let pending = std::mem::take(&mut self.pending);
        match self.phase {
            Phase::Reasoning { .. } => Split {
                reasoning: pending.trim_end().to_owned(),
                content: String::new(),
            },
            Phase::Start | Phase::Content { .. } => Split {
                reasoning: String::new(),
                content: pending.trim_start().to_owned(),
            },
        }
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag`.
pub fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_whole(opened: bool, text: &str) -> Split {
        let mut s = ReasoningSplitter::new(opened);
        let mut out = s.push(text);
        let end = s.finish();
        out.reasoning.push_str(&end.reasoning);
        out.content.push_str(&end.content);
        out
    }

    /// Every chunking by characters and every split in two give the whole-text result.
    fn check_chunkings(opened: bool, text: &str, expected: Split) {
        assert_eq!(split_whole(opened, text), expected, "whole {text:?}");
        let chars: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let mut s = ReasoningSplitter::new(opened);
        let mut out = Split::default();
        for (k, &i) in chars.iter().enumerate() {
            let end = chars.get(k + 1).copied().unwrap_or(text.len());
            let part = s.push(&text[i..end]);
            out.reasoning.push_str(&part.reasoning);
            out.content.push_str(&part.content);
        }
        let end = s.finish();
        out.reasoning.push_str(&end.reasoning);
        out.content.push_str(&end.content);
        assert_eq!(out, expected, "by char {text:?}");
        for &i in &chars {
            let mut s = ReasoningSplitter::new(opened);
            let mut out = s.push(&text[..i]);
            let b = s.push(&text[i..]);
            let end = s.finish();
            for p in [b, end] {
                out.reasoning.push_str(&p.reasoning);
                out.content.push_str(&p.content);
            }
            assert_eq!(out, expected, "split at {i} {text:?}");
        }
    }

    fn split(reasoning: &str, content: &str) -> Split {
        Split {
            reasoning: reasoning.into(),
            content: content.into(),
        }
    }

    #[test]
    fn a_prompt_that_opened_the_thought_starts_in_reasoning() {
        check_chunkings(
            true,
            "Let me think.\nOk.\n</think>\n\nThe answer is 4.",
            split("Let me think.\nOk.", "The answer is 4."),
        );
    }

    #[test]
    fn a_reply_may_open_the_thought_itself() {
        check_chunkings(
            false,
            "<think>\nhmm </thinking> no\n</think>\n\nHi <think> there",
            split("hmm </thinking> no", "Hi <think> there"),
        );
    }

    #[test]
    fn without_a_thought_everything_is_content() {
        check_chunkings(false, "\n\nHello <", split("", "Hello <"));
        check_chunkings(false, "<thin", split("", "<thin"));
    }

    #[test]
    fn an_unfinished_thought_is_all_reasoning() {
        check_chunkings(
            true,
            "still thinking </thi",
            split("still thinking </thi", ""),
        );
        check_chunkings(true, "", split("", ""));
    }

    #[test]
    fn an_empty_thought_gives_empty_reasoning() {
        check_chunkings(true, "\n\n</think>\n\nOk", split("", "Ok"));
    }

    #[test]
    fn partial_tags_are_found_at_char_boundaries() {
        assert_eq!(partial_tag_len("abc</th", "</think>"), 4);
        assert_eq!(partial_tag_len("abc", "</think>"), 0);
        assert_eq!(partial_tag_len("é<", "</think>"), 1);
        assert_eq!(partial_tag_len("</think>", "</think>"), 0);
    }
}
