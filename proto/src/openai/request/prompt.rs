//! Parsing `prompt`: a string, a list of strings, a list of token ids or a list of token-id
//! lists. Visitors classify every element instead of failing, so each malformed shape
//! becomes its own [`RequestError`] rather than a serde message.
//!
//! The common case, a flat list of plain integer ids, skips serde ([`plain_token_ids`]);
//! whatever that does not accept goes through the visitors. A property test checks both
//! against a naive model.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::Prompt;
use super::ids::plain_token_ids;
use crate::openai::error::RequestError;

/// One element of a top-level prompt array, classified without failing the parse.
enum Item<'a> {
    Text(Cow<'a, str>),
    Id(u32),
    Ids(Vec<u32>),
    /// A number that is not a valid token id.
    BadId,
    /// Anything else (null, bool, object, nested strings, ...).
    Other,
}

pub(super) fn parse_prompt<'a>(raw: &'a RawValue) -> Result<Prompt<'a>, RequestError> {
    struct PromptVisitor;
    impl<'de> Visitor<'de> for PromptVisitor {
        type Value = Result<Prompt<'de>, RequestError>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a prompt")
        }
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Ok(Prompt::Text(Cow::Borrowed(v))))
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok(Ok(Prompt::Text(Cow::Owned(v))))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Ok(Prompt::Text(Cow::Owned(v.to_owned()))))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            prompt_array(seq)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Err(RequestError::BadPromptType))
        }
    }
    let json = raw.get().as_bytes();
    if let Some((ids, _)) = plain_token_ids(json).filter(|&(_, len)| len == json.len()) {
        return Ok(Prompt::Tokens(ids));
    }
    let mut de = serde_json::Deserializer::from_str(raw.get());
    de::Deserializer::deserialize_any(&mut de, PromptVisitor).map_err(RequestError::Json)?
}

/// Turns a top-level prompt array into a [`Prompt`]: all elements must be of the first
/// element's kind, and the first element that is not decides the error. Elements go
/// straight into the result (token ids into a `Vec<u32>`), and after an error the rest are
/// still read (as [`Item`]s, so malformed or too deeply nested JSON fails as before).
fn prompt_array<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<Result<Prompt<'de>, RequestError>, A::Error> {
    let Some(first) = seq.next_element::<Item<'de>>()? else { return Ok(Err(RequestError::EmptyPrompt)) };
    let prompt = match first {
        Item::Text(text) => {
            let mut texts = vec![text];
            collect(&mut seq, |item| match item {
                Item::Text(t) => {
                    texts.push(t);
                    Ok(())
                }
                _ => Err(RequestError::BadPromptType),
            })?
            .map(|()| Prompt::TextBatch(texts))
        }
        Item::Id(_) | Item::BadId => {
            let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOC));
            let mut take = |item| match item {
                Item::Id(id) => {
                    ids.push(id);
                    Ok(())
                }
                Item::BadId => Err(RequestError::BadTokenId),
                _ => Err(RequestError::BadPromptType),
            };
            match take(first) {
                Ok(()) => collect(&mut seq, take)?.map(|()| Prompt::Tokens(ids)),
                Err(e) => drain(&mut seq, e)?,
            }
        }
        Item::Ids(_) => {
            let mut batch = Vec::new();
            let mut take = |item| match item {
                Item::Ids(ids) if ids.is_empty() => Err(RequestError::EmptyPrompt),
                Item::Ids(ids) => {
                    batch.push(ids);
                    Ok(())
                }
                Item::BadId => Err(RequestError::BadTokenId),
                _ => Err(RequestError::BadPromptType),
            };
            match take(first) {
                Ok(()) => collect(&mut seq, take)?.map(|()| Prompt::TokensBatch(batch)),
                Err(e) => drain(&mut seq, e)?,
            }
        }
        Item::Other => drain(&mut seq, RequestError::BadPromptType)?,
    };
    Ok(prompt)
}

/// Feeds the remaining elements to `take` until it refuses one, then drains the rest.
fn collect<'de, A: SeqAccess<'de>>(
    seq: &mut A,
    mut take: impl FnMut(Item<'de>) -> Result<(), RequestError>,
) -> Result<Result<(), RequestError>, A::Error> {
    while let Some(item) = seq.next_element::<Item<'de>>()? {
        if let Err(e) = take(item) {
            return drain(seq, e);
        }
    }
    Ok(Ok(()))
}

/// Reads the rest of the array, then reports `error`.
fn drain<'de, A: SeqAccess<'de>, T>(
    seq: &mut A,
    error: RequestError,
) -> Result<Result<T, RequestError>, A::Error> {
    while seq.next_element::<Item<'de>>()?.is_some() {}
    Ok(Err(error))
}

/// Most elements preallocated from a deserializer's size hint.
const MAX_PREALLOC: usize = 4096;

/// A u64/i64/f64 as a token id, or `None` when out of `0..2^32` or fractional.
fn token_id_u64(v: u64) -> Option<u32> {
    u32::try_from(v).ok()
}

impl<'de> Deserialize<'de> for Item<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = Item<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a prompt element")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Item<'de>, E> {
                Ok(Item::Text(Cow::Borrowed(v)))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Item<'de>, E> {
                Ok(Item::Text(Cow::Owned(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Item<'de>, E> {
                Ok(Item::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item<'de>, E> {
                Ok(token_id_u64(v).map_or(Item::BadId, Item::Id))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item<'de>, E> {
                Ok(u64::try_from(v).ok().and_then(token_id_u64).map_or(Item::BadId, Item::Id))
            }
            // A number with no fractional part is a token id too, as pydantic's lax mode
            // reads `list[int]` (so vLLM): `[1.0, 2.0]`.
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Item<'de>, E> {
                Ok(super::whole_u64(v).and_then(token_id_u64).map_or(Item::BadId, Item::Id))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Item<'de>, E> {
                Ok(Item::Other)
            }
            // pydantic's lax `list[int]` takes `true` and `false` as 1 and 0.
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Item<'de>, E> {
                Ok(Item::Id(u32::from(v)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item<'de>, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Item::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item<'de>, A::Error> {
                // A deserializer's size hint comes from the input: never trust it further
                // than a small preallocation.
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOC));
                let mut verdict = None;
                while let Some(item) = seq.next_element::<Item<'de>>()? {
                    match item {
                        Item::Id(id) => ids.push(id),
                        Item::BadId => verdict = verdict.or(Some(Item::BadId)),
                        _ => verdict = Some(Item::Other),
                    }
                }
                Ok(verdict.unwrap_or(Item::Ids(ids)))
            }
        }
        d.deserialize_any(ItemVisitor)
    }
}

#[cfg(test)]
mod tests {
    use std::mem::discriminant;

    use proptest::prelude::*;
    use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
    use serde_json::Value;
    use serde_json::value::RawValue;

    use super::{Item, parse_prompt};
    use crate::openai::error::RequestError;
    use crate::openai::request::Prompt;

    /// A sequence that claims `usize::MAX` elements and has none, as a hostile binary
    /// encoding could.
    struct Liar;

    impl<'de> SeqAccess<'de> for Liar {
        type Error = de::value::Error;
        fn next_element_seed<T: DeserializeSeed<'de>>(
            &mut self,
            _: T,
        ) -> Result<Option<T::Value>, Self::Error> {
            Ok(None)
        }
        fn size_hint(&self) -> Option<usize> {
            Some(usize::MAX)
        }
    }

    impl<'de> Deserializer<'de> for Liar {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
            visitor.visit_seq(Liar)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum
            identifier ignored_any
        }
    }

    #[test]
    fn token_array_size_hint_does_not_size_the_allocation() {
        let item: Item<'_> = serde::Deserialize::deserialize(Liar).expect("an empty id list");
        assert!(matches!(item, Item::Ids(ids) if ids.is_empty()));
    }

    /// One prompt element as the parser classifies it (the model's [`Item`]).
    #[derive(Debug, PartialEq)]
    enum Kind {
        Text(String),
        Id(u32),
        Ids(Vec<u32>),
        BadId,
        Other,
    }

    fn kind(v: &Value) -> Kind {
        match v {
            Value::String(s) => Kind::Text(s.clone()),
            Value::Bool(b) => Kind::Id(u32::from(*b)),
            Value::Number(n) => n
                .as_u64()
                .or_else(|| {
                    n.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e20).map(|f| f as u64)
                })
                .and_then(|n| u32::try_from(n).ok())
                .map_or(Kind::BadId, Kind::Id),
            Value::Array(items) => {
                let kinds: Vec<Kind> = items.iter().map(kind).collect();
                if kinds.iter().any(|k| !matches!(k, Kind::Id(_) | Kind::BadId)) {
                    Kind::Other
                } else if kinds.contains(&Kind::BadId) {
                    Kind::BadId
                } else {
                    Kind::Ids(kinds.into_iter().map(|k| if let Kind::Id(id) = k { id } else { 0 }).collect())
                }
            }
            _ => Kind::Other,
        }
    }

    /// The rules in a naive form: classify every element, then check them all against the
    /// first one's kind; the first element that does not fit decides the error.
    fn model(v: &Value) -> Result<Prompt<'static>, RequestError> {
        let Value::Array(items) = v else {
            return match v {
                Value::String(s) => Ok(Prompt::Text(s.clone().into())),
                _ => Err(RequestError::BadPromptType),
            };
        };
        let kinds: Vec<Kind> = items.iter().map(kind).collect();
        match kinds.first() {
            None => Err(RequestError::EmptyPrompt),
            Some(Kind::Text(_)) => kinds
                .into_iter()
                .map(|k| if let Kind::Text(t) = k { Ok(t.into()) } else { Err(RequestError::BadPromptType) })
                .collect::<Result<_, _>>()
                .map(Prompt::TextBatch),
            Some(Kind::Id(_) | Kind::BadId) => kinds
                .into_iter()
                .map(|k| match k {
                    Kind::Id(id) => Ok(id),
                    Kind::BadId => Err(RequestError::BadTokenId),
                    _ => Err(RequestError::BadPromptType),
                })
                .collect::<Result<_, _>>()
                .map(Prompt::Tokens),
            Some(Kind::Ids(_)) => kinds
                .into_iter()
                .map(|k| match k {
                    Kind::Ids(ids) if ids.is_empty() => Err(RequestError::EmptyPrompt),
                    Kind::Ids(ids) => Ok(ids),
                    Kind::BadId => Err(RequestError::BadTokenId),
                    _ => Err(RequestError::BadPromptType),
                })
                .collect::<Result<_, _>>()
                .map(Prompt::TokensBatch),
            Some(Kind::Other) => Err(RequestError::BadPromptType),
        }
    }

    fn element() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            4 => (0u32..40_000).prop_map(Value::from),
            2 => any::<u32>().prop_map(Value::from),
            1 => (0u64..100_000_000_000).prop_map(Value::from),
            1 => Just(Value::from(u32::MAX)),
            1 => Just(Value::from(u64::from(u32::MAX) + 1)),
            1 => Just(Value::from(-1)),
            1 => Just(Value::from(1.5)),
            1 => Just(Value::from(7.0)),
            1 => Just(Value::from(4294967296.0)),
            1 => Just(Value::from(-0.0)),
            1 => "[a-c]{0,2}".prop_map(Value::from),
            1 => Just(Value::Null),
            1 => Just(Value::Bool(true)),
            1 => Just(serde_json::json!({"a": [1]})),
        ];
        leaf.prop_recursive(2, 16, 6, |inner| prop::collection::vec(inner, 0..6).prop_map(Value::Array))
    }

    proptest! {
        #[test]
        fn prompt_arrays_parse_as_the_model_says(prompt in element()) {
            let raw = serde_json::value::to_raw_value(&prompt).unwrap();
            let pretty = RawValue::from_string(serde_json::to_string_pretty(&prompt).unwrap()).unwrap();
            let got = parse_prompt(&raw);
            prop_assert_eq!(format!("{got:?}"), format!("{:?}", parse_prompt(&pretty)), "whitespace changes nothing");
            match (got, model(&prompt)) {
                (Ok(got), Ok(want)) => prop_assert_eq!(got, want),
                (Err(got), Err(want)) => prop_assert_eq!(discriminant(&got), discriminant(&want), "{:?}", prompt),
                (got, want) => prop_assert!(false, "{:?}: got {:?}, want {:?}", prompt, got, want),
            }
        }
    }
}
