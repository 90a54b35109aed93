//! Parsing `prompt`: a string, a list of strings, a list of token ids or a list of token-id
//! lists. Visitors classify every element instead of failing, so each malformed shape
//! becomes its own [`RequestError`] rather than a serde message.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::Prompt;
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
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element::<Item<'de>>()? {
                items.push(item);
            }
            Ok(classify(items))
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
    let mut de = serde_json::Deserializer::from_str(raw.get());
    de::Deserializer::deserialize_any(&mut de, PromptVisitor).map_err(RequestError::Json)?
}

/// Turns a top-level prompt array into a [`Prompt`]: all elements must be of one kind.
fn classify(items: Vec<Item<'_>>) -> Result<Prompt<'_>, RequestError> {
    let Some(first) = items.first() else { return Err(RequestError::EmptyPrompt) };
    match first {
        Item::Text(_) => items
            .into_iter()
            .map(|i| match i {
                Item::Text(t) => Ok(t),
                _ => Err(RequestError::BadPromptType),
            })
            .collect::<Result<_, _>>()
            .map(Prompt::TextBatch),
        Item::Id(_) | Item::BadId => {
            let mut ids = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Item::Id(id) => ids.push(id),
                    Item::BadId => return Err(RequestError::BadTokenId),
                    _ => return Err(RequestError::BadPromptType),
                }
            }
            Ok(Prompt::Tokens(ids))
        }
        Item::Ids(_) => {
            let mut batch = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Item::Ids(ids) if ids.is_empty() => return Err(RequestError::EmptyPrompt),
                    Item::Ids(ids) => batch.push(ids),
                    Item::BadId => return Err(RequestError::BadTokenId),
                    _ => return Err(RequestError::BadPromptType),
                }
            }
            Ok(Prompt::TokensBatch(batch))
        }
        Item::Other => Err(RequestError::BadPromptType),
    }
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
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Item<'de>, E> {
                Ok(Item::BadId)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Item<'de>, E> {
                Ok(Item::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Item<'de>, E> {
                Ok(Item::Other)
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
    use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};

    use super::Item;

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
}
