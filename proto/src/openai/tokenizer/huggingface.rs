//! A Hugging Face `tokenizer.json`, run by the `tokenizers` crate, and where it can resume
//! part-way through a text: right after an added token (see [`super::resume`]).
//!
//! `tokenizers` first cuts a text at its added tokens (leftmost-longest matches), then
//! normalizes, pre-tokenizes and merges each part alone. So the ids after an added token do
//! not depend on the text before it, provided that
//! - every added token is matched as plain text: not normalized, stripping no whitespace,
//!   not only as a whole word (otherwise its match reads the text around it);
//! - nothing truncates or pads, and special tokens are not encoded as text;
//! - the post-processor only puts ids in front (a BOS), not after the text;
//! - no part of the pipeline looks at where its part sits in the whole text
//!   (`Metaspace` with `prepend_scheme: first` does).
//!
//! The first two are read off the tokenizer; all of them are checked by encoding a few
//! texts with added tokens both whole and in parts at their added tokens, with and without
//! special tokens, which must give the same ids. A tokenizer that fails resumes nowhere, and the router then does not cache
//! its tokenization ([`Tokenizer::resume`] says why).

use std::fmt;
use std::path::Path;

use aho_corasick::{AhoCorasick, MatchKind};

use super::resume::{Point, Points, Resume};
use super::{LoadError, RequestError, Tokenizer};

/// A Hugging Face `tokenizer.json`, run by the `tokenizers` crate.
pub struct HuggingFace {
    inner: tokenizers::Tokenizer,
    /// `inner` reading special tokens' texts as text ([`Tokenizer::encode_ordinary`]), made
    /// when first asked for (gpt-oss fleets only).
    ordinary: std::sync::OnceLock<tokenizers::Tokenizer>,
    vocab_size: u32,
    /// How to resume after added tokens, or why not.
    resume: Result<AddedTokens, String>,
}

impl HuggingFace {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| LoadError::Io { path: path.into(), source })?;
        Self::load(&bytes, path)
    }

    /// Loads a `tokenizer.json` from memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, LoadError> {
        Self::load(bytes, Path::new("<bytes>"))
    }

    fn load(bytes: &[u8], path: &Path) -> Result<Self, LoadError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|source| LoadError::Tokenizer { path: path.into(), source })?;
        // vLLM rejects prompt ids above the largest id the tokenizer knows, added tokens included.
        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |&max| max.saturating_add(1));
        let resume = AddedTokens::check(&inner, vocab_size);
        Ok(Self { inner, ordinary: std::sync::OnceLock::new(), vocab_size, resume })
    }

    /// The underlying `tokenizers` tokenizer (for decoding, token strings, ...).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Puts `bos` in front of every text encoded with special tokens and `eos` after it, and
    /// nothing else, as transformers 5 rebuilds the post-processor when the tokenizer config
    /// sets `add_bos_token` or `add_eos_token` ([`crate::openai::chat_template::bos_eos_flags`]).
    /// A token the vocabulary lacks is not added.
    pub fn with_bos_eos(mut self, bos: Option<&str>, eos: Option<&str>) -> Result<Self, String> {
        let known =
            |token: Option<&str>| token.and_then(|t| self.inner.token_to_id(t).map(|id| (t.to_owned(), id)));
        let (bos, eos) = (known(bos), known(eos));
        let around = |seq: &str, type_id: u32| {
            let mut pieces = Vec::new();
            pieces.extend(bos.as_ref().map(|(t, _)| format!("{t}:{type_id}")));
            pieces.push(format!("{seq}:{type_id}"));
            pieces.extend(eos.as_ref().map(|(t, _)| format!("{t}:{type_id}")));
            pieces
        };
        let mut pair = around("$A", 0);
        pair.extend(around("$B", 1));
        let template = tokenizers::processors::template::TemplateProcessing::builder()
            .try_single(around("$A", 0))?
            .try_pair(pair)?
            .special_tokens(bos.iter().chain(&eos).cloned().collect::<Vec<_>>())
            .build()
            .map_err(|e| e.to_string())?;
        self.inner.with_post_processor(Some(template));
        self.resume = AddedTokens::check(&self.inner, self.vocab_size);
        Ok(self)
    }

    fn encode_ids(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RequestError> {
        let encoding = self.inner.encode_fast(text, add_special_tokens).map_err(RequestError::Tokenizer)?;
        Ok(encoding.get_ids().to_vec())
    }
}

impl fmt::Debug for HuggingFace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HuggingFace").field("vocab_size", &self.vocab_size).finish_non_exhaustive()
    }
}

impl Tokenizer for HuggingFace {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RequestError> {
        self.encode_ids(text, add_special_tokens)
    }

    fn encode_ordinary(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        let ordinary = self.ordinary.get_or_init(|| {
            let mut ordinary = self.inner.clone();
            ordinary.set_encode_special_tokens(true);
            ordinary
        });
        let encoding = ordinary.encode_fast(text, false).map_err(RequestError::Tokenizer)?;
        Ok(encoding.get_ids().to_vec())
    }

    fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    fn decode(&self, ids: &[u32]) -> Option<String> {
        self.inner.decode(ids, false).ok()
    }

    fn resume(&self) -> Result<&dyn Resume, &str> {
        match &self.resume {
            Ok(_) => Ok(self),
            Err(why) => Err(why),
        }
    }
}

impl Resume for HuggingFace {
    fn lookahead(&self) -> usize {
        self.resume.as_ref().map_or(0, |a| a.lookahead)
    }

    fn leading_ids(&self, add_special_tokens: bool) -> &[u32] {
        match &self.resume {
            Ok(added) if add_special_tokens => &added.leading,
            _ => &[],
        }
    }

    fn encode_from(
        &self,
        text: &str,
        start: usize,
        ids: &mut Vec<u32>,
        points: &mut Points,
    ) -> Result<(), RequestError> {
        let rest = &text[start..];
        let base = ids.len();
        ids.extend_from_slice(
            self.inner.encode_fast(rest, false).map_err(RequestError::Tokenizer)?.get_ids(),
        );
        let mut point = Point { byte: start, ids: base };
        if let Ok(added) = &self.resume {
            let ends = added.ends(rest, &ids[base..]);
            for (byte, id_index) in ends {
                let next = Point { byte: start + byte, ids: base + id_index + 1 };
                points.span(point, next.byte);
                point = next;
            }
        }
        points.finish(point);
        Ok(())
    }
}

/// The added tokens of a tokenizer that resumes after them.
struct AddedTokens {
    /// Their contents, matched as `tokenizers` matches them.
    matcher: AhoCorasick,
    /// Which ids are theirs, a bit an id.
    ids: Vec<u64>,
    /// The longest one, plus a character.
    lookahead: usize,
    /// What `encode(text, true)` puts in front of the text's ids.
    leading: Vec<u32>,
}

impl AddedTokens {
    /// How `inner` resumes after its added tokens, or why it cannot (see the module docs).
    fn check(inner: &tokenizers::Tokenizer, vocab_size: u32) -> Result<Self, String> {
        if inner.get_truncation().is_some() || inner.get_padding().is_some() {
            return Err("it truncates or pads".into());
        }
        if inner.get_encode_special_tokens() {
            return Err("it encodes special tokens as text".into());
        }
        let mut tokens: Vec<_> = inner.get_added_tokens_decoder().into_iter().collect();
        tokens.sort_by_key(|(id, _)| *id);
        if let Some((_, t)) =
            tokens.iter().find(|(_, t)| t.normalized || t.lstrip || t.rstrip || t.single_word)
        {
            return Err(format!(
                "its added token {:?} is normalized, strips whitespace or matches whole words only",
                t.content
            ));
        }
        if tokens.is_empty() {
            return Err("it has no added tokens to resume after".into());
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(_, t)| t.content.as_str()))
            .map_err(|e| e.to_string())?;
        let mut ids = vec![0u64; (vocab_size as usize).div_ceil(64)];
        for &(id, _) in &tokens {
            ids[id as usize / 64] |= 1 << (id % 64);
        }
        let lookahead = tokens.iter().map(|(_, t)| t.content.len()).max().unwrap_or(0) + 4;
        let encode = |text: &str, special: bool| {
            inner.encode_fast(text, special).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string())
        };
        let added = Self { matcher, ids, lookahead, leading: encode("", true)? };
        // A few of the added tokens, first and last (a Llama 3 has 256).
        let sample: Vec<&str> = tokens
            .iter()
            .enumerate()
            .filter(|&(i, _)| i < 4 || i + 4 >= tokens.len())
            .map(|(_, (_, t))| t.content.as_str())
            .collect();
        for (i, &a) in sample.iter().enumerate() {
            let b = sample[(i + 1) % sample.len()];
            for probe in [
                format!("{a}user\n\nHello, world!{b}\n{a}assistant\n\nHi  there.{b}"),
                format!("The naïve café 東京 {a} x{b}{a}  \n\tend"),
                format!(" lead {a}{b}trail ü{a}"),
            ] {
                let mut parts = Vec::new();
                let mut from = 0;
                for m in added.matcher.find_iter(&probe) {
                    parts.extend(encode(&probe[from..m.end()], false)?);
                    from = m.end();
                }
                parts.extend(encode(&probe[from..], false)?);
                let with_special: Vec<u32> = added.leading.iter().chain(&parts).copied().collect();
                if encode(&probe, false)? != parts || encode(&probe, true)? != with_special {
                    return Err(format!(
                        "a text encodes differently whole and in parts at its added tokens ({probe:?})"
                    ));
                }
            }
        }
        Ok(added)
    }

    /// For each added token in `text`, in order, its end and the index of its id in `ids`
    /// (the ids of `text`); none when the two do not pair up.
    fn ends(&self, text: &str, ids: &[u32]) -> Vec<(usize, usize)> {
        let is_added = |id: u32| self.ids.get(id as usize / 64).is_some_and(|w| w >> (id % 64) & 1 == 1);
        let matches: Vec<usize> = self.matcher.find_iter(text).map(|m| m.end()).collect();
        let added: Vec<usize> = (0..ids.len()).filter(|&i| is_added(ids[i])).collect();
        if matches.len() != added.len() {
            return Vec::new();
        }
        matches.into_iter().zip(added).collect()
    }
}
