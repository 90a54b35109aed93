//! `truncate_prompt_tokens` and `truncation_side`: which of a prompt's tokens vLLM (0.33)
//! keeps, so that the router hashes the prompt the replica caches.
//!
//! - `truncate_prompt_tokens: k` keeps `k` tokens of a longer prompt; null keeps them all.
//!   `-1` means the model's context length less one, which only the replica knows: taken as
//!   no truncation (a prompt that long is refused without it anyway). `0` empties the prompt,
//!   which vLLM refuses; below `-1` is refused too.
//! - `truncation_side: "left"` keeps the last `k` of the whole encoding (a BOS the tokenizer
//!   adds included, so it goes); `"right"` the first `k`.
//! - No side: the tokenizer's own, which vLLM makes `"left"` for generating models, applied
//!   by the tokenizer itself: the special tokens it adds stay, and the last `k` less their
//!   count of the text's tokens go between them (`[BOS, d, e, f]` for `a b c d e f`, k = 4).
//!   Token-id prompts and rendered chats (no special tokens added) simply keep their last
//!   `k`.

use serde_json::value::RawValue;

use super::count;
use crate::openai::error::RequestError;

/// Which of a prompt's tokens are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncation {
    /// `truncate_prompt_tokens`, at least 1.
    pub keep: usize,
    /// `truncation_side`; none is the tokenizer's (left, special tokens kept).
    pub side: Option<Side>,
}

/// `truncation_side`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Left,
    Right,
}

const PARAM: &str = "truncate_prompt_tokens";

impl Truncation {
    /// The request's fields (absent or null: none).
    pub(super) fn parse(
        keep: Option<&RawValue>,
        side: Option<&RawValue>,
    ) -> Result<Option<Self>, RequestError> {
        let side = match side.map(RawValue::get) {
            None => None,
            Some(r#""left""#) => Some(Side::Left),
            Some(r#""right""#) => Some(Side::Right),
            Some(_) => {
                return Err(RequestError::InvalidField {
                    param: "truncation_side",
                    expected: "\"left\" or \"right\"",
                });
            }
        };
        let keep = match keep {
            Some(raw) if raw.get() == "-1" => None,
            raw => count(raw, PARAM).map_err(|_| RequestError::InvalidField {
                param: PARAM,
                expected: "an integer of at least -1",
            })?,
        };
        match keep {
            None => Ok(None),
            Some(0) => {
                Err(RequestError::InvalidField { param: PARAM, expected: "not 0: the prompt would be empty" })
            }
            Some(keep) => Ok(Some(Truncation { keep: usize::try_from(keep).unwrap_or(usize::MAX), side })),
        }
    }

    /// `ids` truncated; `specials` are the ids the tokenizer added to them (its encoding of
    /// an empty text with special tokens), none for token ids and chats.
    pub fn apply(&self, mut ids: Vec<u32>, specials: &[u32]) -> Vec<u32> {
        let k = self.keep;
        if ids.len() <= k {
            return ids;
        }
        match self.side {
            Some(Side::Right) => {
                ids.truncate(k);
                ids
            }
            Some(Side::Left) => ids.split_off(ids.len() - k),
            None => {
                // The special tokens found around the text: a leading run, the rest trailing.
                let (lead, trail) = (0..=specials.len())
                    .rev()
                    .find(|&i| {
                        ids.len() >= specials.len()
                            && ids.starts_with(&specials[..i])
                            && ids.ends_with(&specials[i..])
                    })
                    .map_or((0, 0), |i| (i, specials.len() - i));
                let text_end = ids.len() - trail;
                let kept = k.saturating_sub(lead + trail).min(text_end - lead);
                ids.drain(lead..text_end - kept);
                ids
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(json: &str) -> Box<RawValue> {
        RawValue::from_string(json.to_owned()).unwrap()
    }

    fn parse(keep: &str, side: Option<&str>) -> Result<Option<Truncation>, RequestError> {
        let side = side.map(raw);
        Truncation::parse(Some(&raw(keep)), side.as_deref())
    }

    #[test]
    fn fields_read_as_vllm_takes_them() {
        assert_eq!(parse("4", None).unwrap(), Some(Truncation { keep: 4, side: None }));
        assert_eq!(
            parse("\"4\"", Some("\"left\"")).unwrap(),
            Some(Truncation { keep: 4, side: Some(Side::Left) })
        );
        assert_eq!(parse("-1", Some("\"right\"")).unwrap(), None, "the context length, unknown here");
        assert_eq!(Truncation::parse(None, None).unwrap(), None);
        for bad in ["-2", "0", "1.5", "\"x\""] {
            assert!(parse(bad, None).is_err(), "{bad}");
        }
        assert!(parse("4", Some("\"middle\"")).is_err());
    }

    /// Expected ids: Hugging Face `tokenizers` with vLLM's left truncation (BOS 1 kept), and
    /// vLLM's slicing for an explicit side.
    #[test]
    fn kept_as_vllm_keeps_them() {
        let t = |side| Truncation { keep: 4, side };
        let bos_text = vec![1, 10, 11, 12, 13, 14, 15];
        assert_eq!(t(None).apply(bos_text.clone(), &[1]), [1, 13, 14, 15]);
        assert_eq!(t(Some(Side::Left)).apply(bos_text.clone(), &[1]), [12, 13, 14, 15]);
        assert_eq!(t(Some(Side::Right)).apply(bos_text.clone(), &[1]), [1, 10, 11, 12]);
        assert_eq!(t(None).apply(vec![10, 11, 12, 13, 14, 15], &[]), [12, 13, 14, 15]);
        // A tokenizer that adds a BOS and an EOS.
        assert_eq!(t(None).apply(vec![1, 10, 11, 12, 13, 14, 2], &[1, 2]), [1, 13, 14, 2]);
        // Short enough: untouched.
        assert_eq!(t(None).apply(vec![1, 10, 11], &[1]), [1, 10, 11]);
    }
}
