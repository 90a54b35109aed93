//! `truncate_prompt_tokens` and `truncation_side`: which of a prompt's tokens vLLM (0.33)
//! keeps, so that the router hashes the prompt the replica caches.
//!
//! - `truncate_prompt_tokens: k` keeps `k` tokens of a longer prompt; null keeps them all.
//!   `-1` keeps the model's context length less the request's output tokens (`max_tokens`;
//!   unset, a completion's 16 and a chat's 0), as vLLM's renderer does: the router reads the context length from the
//!   replicas' model cards (`max_model_len`), and truncates nothing until it has one. (A
//!   Responses request's `truncation: "auto"` is `-1`.) `0` empties the prompt, which vLLM
//!   refuses; below `-1` is refused too.
//! - `truncation_side: "left"` keeps the last `k` of the whole encoding (a BOS the tokenizer
//!   adds included, so it goes); `"right"` the first `k`.
//! - No side: the tokenizer's own, which vLLM makes `"left"` for generating models, applied
//!   by the tokenizer itself: the special tokens it adds stay, and the last `k` less their
//!   count of the text's tokens go between them (`[BOS, d, e, f]` for `a b c d e f`, k = 4).
//!   Token-id prompts and rendered chats (no special tokens added) simply keep their last
//!   `k`.

use serde_json::value::RawValue;

use super::{count, lax_integer};
use crate::openai::error::RequestError;

/// Which of a prompt's tokens are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncation {
    /// How many.
    pub keep: Keep,
    /// `truncation_side`; none is the tokenizer's (left, special tokens kept).
    pub side: Option<Side>,
}

/// How many of a prompt's tokens are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// `truncate_prompt_tokens: k`, at least 1.
    Tokens(usize),
    /// `-1`: the model's context length less `output`, the request's output tokens.
    Context { output: u64 },
}

/// `truncation_side`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Left,
    Right,
}

const PARAM: &str = "truncate_prompt_tokens";

impl Truncation {
    /// The request's fields (absent or null: none); `output` is its output tokens
    /// (`max_tokens`), which `-1` leaves room for.
    pub(super) fn parse(
        keep: Option<&RawValue>,
        side: Option<&RawValue>,
        output: Option<u64>,
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
        // (-1 as pydantic's lax mode reads it: `-1.0` and `"-1"` too.)
        if keep.and_then(lax_integer) == Some(-1) {
            return Ok(Some(Truncation { keep: Keep::Context { output: output.unwrap_or(0) }, side }));
        }
        let keep = count(keep, PARAM).map_err(|_| RequestError::InvalidField {
            param: PARAM,
            expected: "an integer of at least -1",
        })?;
        match keep {
            None => Ok(None),
            Some(0) => {
                Err(RequestError::InvalidField { param: PARAM, expected: "not 0: the prompt would be empty" })
            }
            Some(keep) => {
                Ok(Some(Truncation { keep: Keep::Tokens(usize::try_from(keep).unwrap_or(usize::MAX)), side }))
            }
        }
    }

    /// How many tokens are kept, given the model's context length (`None`: unknown, when `-1`
    /// keeps them all).
    pub fn kept(&self, context: Option<u64>) -> Option<usize> {
        match self.keep {
            Keep::Tokens(k) => Some(k),
            Keep::Context { output } => {
                context.map(|c| usize::try_from(c.saturating_sub(output)).unwrap_or(usize::MAX))
            }
        }
    }

    /// `ids` truncated, for a model of `context` tokens if known; `specials` are the ids the
    /// tokenizer added to them (its encoding of an empty text with special tokens), none for
    /// token ids and chats.
    pub fn apply(&self, mut ids: Vec<u32>, specials: &[u32], context: Option<u64>) -> Vec<u32> {
        let Some(k) = self.kept(context) else { return ids };
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
        Truncation::parse(Some(&raw(keep)), side.as_deref(), Some(16))
    }

    #[test]
    fn fields_read_as_vllm_takes_them() {
        assert_eq!(parse("4", None).unwrap(), Some(Truncation { keep: Keep::Tokens(4), side: None }));
        assert_eq!(
            parse("\"4\"", Some("\"left\"")).unwrap(),
            Some(Truncation { keep: Keep::Tokens(4), side: Some(Side::Left) })
        );
        // The context length less the output tokens: vLLM's `max_input_tokens`.
        for minus_one in ["-1", "-1.0", "\"-1\""] {
            let to_context = Truncation { keep: Keep::Context { output: 16 }, side: Some(Side::Right) };
            assert_eq!(parse(minus_one, Some("\"right\"")).unwrap(), Some(to_context), "{minus_one}");
        }
        assert_eq!(Truncation::parse(None, None, None).unwrap(), None);
        for bad in ["-2", "0", "1.5", "\"x\""] {
            assert!(parse(bad, None).is_err(), "{bad}");
        }
        assert!(parse("4", Some("\"middle\"")).is_err());
    }

    /// Expected ids: Hugging Face `tokenizers` with vLLM's left truncation (BOS 1 kept), and
    /// vLLM's slicing for an explicit side.
    #[test]
    fn kept_as_vllm_keeps_them() {
        let t = |side| Truncation { keep: Keep::Tokens(4), side };
        let bos_text = vec![1, 10, 11, 12, 13, 14, 15];
        assert_eq!(t(None).apply(bos_text.clone(), &[1], None), [1, 13, 14, 15]);
        assert_eq!(t(Some(Side::Left)).apply(bos_text.clone(), &[1], None), [12, 13, 14, 15]);
        assert_eq!(t(Some(Side::Right)).apply(bos_text.clone(), &[1], None), [1, 10, 11, 12]);
        assert_eq!(t(None).apply(vec![10, 11, 12, 13, 14, 15], &[], None), [12, 13, 14, 15]);
        // A tokenizer that adds a BOS and an EOS.
        assert_eq!(t(None).apply(vec![1, 10, 11, 12, 13, 14, 2], &[1, 2], None), [1, 13, 14, 2]);
        // Short enough: untouched.
        assert_eq!(t(None).apply(vec![1, 10, 11], &[1], None), [1, 10, 11]);
        // -1: a context of 6 tokens, 2 of them for the output; unknown, nothing is cut.
        let to_context = Truncation { keep: Keep::Context { output: 2 }, side: None };
        assert_eq!(to_context.apply(vec![10, 11, 12, 13, 14, 15], &[], Some(6)), [12, 13, 14, 15]);
        assert_eq!(to_context.apply(vec![10, 11, 12, 13, 14, 15], &[], None), [10, 11, 12, 13, 14, 15]);
    }
}
