//! The tokenizer: the checkpoint's `tokenizer.json` loaded through the `tokenizers` crate, text to
//! ids (special tokens written in the text included), ids back to text, and streaming
//! detokenisation ([`IncrementalDecoder`]) that never emits a character before all its bytes
//! have been generated.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Result, anyhow, bail};

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids of the added tokens `tokenizer.json` flags as special (control tokens such as
    /// `<|im_end|>`, as opposed to tags the model writes as text such as `<think>`).
    special: HashSet<u32>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a checkpoint directory.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("loading tokenizer {}: {e}", path.display()))?;
        Ok(Self::from_inner(inner))
    }

    /// Loads a tokenizer from the text of a `tokenizer.json` (built-in models make theirs in code).
    pub fn from_json(json: &str) -> Result<Self> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| anyhow!("parsing tokenizer JSON: {e}"))?;
        Ok(Self::from_inner(inner))
    }

    fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        let special = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        Self { inner, special }
    }

    /// Encodes text. Added tokens written in the text (`<|im_start|>`, `<think>`, ...) become
    /// their single ids, as a rendered chat prompt needs; no tokens are added around the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        // `encode_fast` skips computing offsets, which nothing here uses.
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("encoding text: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes ids to text, special tokens included. Bytes that do not form valid UTF-8 (a
    /// character cut off at the end, say) come out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        // The `tokenizers` crate silently drops ids it does not know; an id outside the
        // vocabulary (a padded logit row, for instance) is a bug upstream worth reporting.
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            bail!("token id {id} is not in the vocabulary");
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("decoding ids: {e}"))
    }

    /// The id of a token given by its text (`<|im_end|>`, say), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The raw bytes a token stands for: a byte-level BPE token can hold part of a UTF-8
    /// character, which its decoded text cannot show. Tokens of a byte-level vocabulary map back
    /// through GPT-2's byte alphabet; added tokens, and tokens of other tokenizers, give the
    /// UTF-8 of their text.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        let added = self
            .inner
            .get_added_vocabulary()
            .simple_id_to_token(id)
            .is_some();
        if byte_level
            && !added
            && let Some(bytes) = self
                .inner
                .id_to_token(id)
                .and_then(|token| token.chars().map(byte_level_byte).collect())
        {
            return Ok(bytes);
        }
        Ok(self.decode(&[id])?.into_bytes())
    }

    /// The number of tokens, added tokens included (the model's embedding may have more rows).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// Starts streaming detokenisation of a sequence of generated ids.
    pub fn incremental_decoder(&self) -> IncrementalDecoder<'_> {
        IncrementalDecoder {
            tokenizer: self,
            ids: Vec::new(),
            read: 0,
        }
    }
}

/// Whether GPT-2's byte-level alphabet writes `byte` as the character of the same code point.
fn byte_level_keeps(byte: u8) -> bool {
    (b'!'..=b'~').contains(&byte) || (0xa1..=0xac).contains(&byte) || byte >= 0xae
}

/// The character GPT-2's byte-level alphabet (used by Qwen's tokenizer) writes for a byte: the
/// byte itself when printable, else one of 256, 257, ... in byte order.
pub fn byte_level_char(byte: u8) -> char {
    if byte_level_keeps(byte) {
        return char::from(byte);
    }
    let shifted = (0..byte).filter(|&b| !byte_level_keeps(b)).count() as u32;
    char::from_u32(256 + shifted).expect("a code point below 512")
}

/// The byte a character of GPT-2's byte-level alphabet stands for.
fn byte_level_byte(c: char) -> Option<u8> {
    match u32::from(c) {
        code @ 0..=255 => Some(code as u8).filter(|&b| byte_level_keeps(b)),
        code @ 256..=511 => (0..=255u8)
            .filter(|&b| !byte_level_keeps(b))
            .nth((code - 256) as usize),
        _ => None,
    }
}

/// What a lossy UTF-8 decode writes for bytes that are not (yet) a valid character.
const REPLACEMENT: char = '\u{FFFD}';

/// Streaming detokenisation: turns ids, one at a time, into the text they complete.
///
/// A byte-level BPE token can end partway through a multi-byte character, which decodes to
/// U+FFFD until the next tokens bring the missing bytes. While the decoded window ends in U+FFFD,
/// text is therefore held back, except what is provably final. Concatenating every [`push`](Self::push) and
/// [`finish`](Self::finish) gives [`Tokenizer::decode`] of all the ids.
///
/// Only a window of recent ids is decoded per token (the scheme of TGI's prefix and read
/// offsets): `ids[..read]` is context whose text has already been emitted, kept because some
/// decoders render a token differently depending on what precedes it; `ids[read..]` are ids whose
/// text is still pending.
pub struct IncrementalDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    read: usize,
}

impl IncrementalDecoder<'_> {
    /// Adds one id and returns the text it completes (often empty while a character is split).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids)?;
        let (settled, settled_text) = if !text.ends_with(REPLACEMENT) {
            (self.ids.len(), text)
        } else if let Some(head) = self.final_head(&text)? {
            (self.ids.len() - 1, head)
        } else {
            return Ok(String::new());
        };
        let new = self.new_text(&settled_text)?;
        self.ids.drain(..self.read);
        self.read = settled - self.read;
        Ok(new)
    }

    /// The text of all but the last id, if it is final although the window's text ends in U+FFFD.
    ///
    /// The trailing U+FFFD may be a character still missing bytes, but also a real U+FFFD or
    /// bytes that never form a character; waiting for text without one could then grow the
    /// window without bound. Lossy UTF-8 decoding gives one U+FFFD per maximal invalid
    /// sequence, so decoding the window in two pieces gives the same text as decoding it whole
    /// exactly when no character (or invalid sequence) straddles the cut: the text before the
    /// cut is then final whatever comes next. A straddling sequence spans at most four bytes,
    /// and every id at least one, so the window stays a few ids long.
    fn final_head(&self, text: &str) -> Result<Option<String>> {
        let cut = self.ids.len() - 1;
        if cut <= self.read {
            return Ok(None);
        }
        let head = self.tokenizer.decode(&self.ids[..cut])?;
        let tail = self.tokenizer.decode(&self.ids[cut..])?;
        let separable = text.strip_prefix(head.as_str()) == Some(tail.as_str());
        Ok(separable.then_some(head))
    }

    /// Returns the text still pending at the end of the sequence, U+FFFD for a character whose
    /// remaining bytes never came.
    pub fn finish(self) -> Result<String> {
        let text = self.tokenizer.decode(&self.ids)?;
        self.new_text(&text)
    }

    /// The part of `text` (decoded from the start of the window) after the context's text.
    fn new_text(&self, text: &str) -> Result<String> {
        let context = self.tokenizer.decode(&self.ids[..self.read])?;
        match text.strip_prefix(context.as_str()) {
            Some(new) => Ok(new.to_owned()),
            // Byte-level decoding only ever appends; a decoder that rewrote text already
            // emitted could not be streamed.
            None => bail!("decoding more ids changed text already emitted ({context:?})"),
        }
    }
}
