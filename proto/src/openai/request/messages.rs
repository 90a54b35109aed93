//! Parsing `messages`: role, content (a string, null, or text parts joined with `"\n"`: as
//! vLLM, plain strings and `text`, `input_text`, `output_text`, `refusal` and `thinking`
//! parts; any other part, an image or audio, is left out of the text and its type kept in
//! [`Message::media`]) and every other key kept raw for the chat template. A system
//! message's plain and `text` parts lose Claude Code's attribution line, as vLLM 0.33's
//! (`_strip_claude_code_billing_header`). Visitors record a
//! [`MessageProblem`] instead of failing, so the error names the message at fault.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{BILLING_HEADER, Message, Part, Str, object};
use crate::openai::error::{MessageProblem, RequestError};

/// What one message parsed to, without failing the parse.
enum MessageResult<'a> {
    Ok(Message<'a>),
    Problem(MessageProblem),
}

pub(super) fn parse_messages<'a>(raw: &'a RawValue) -> Result<Vec<Message<'a>>, RequestError> {
    let not_array = || RequestError::InvalidField { param: "messages", expected: "an array of messages" };
    if !raw.get().starts_with('[') {
        return Err(not_array());
    }
    let results: Vec<MessageResult<'a>> = serde_json::from_str(raw.get()).map_err(|_| not_array())?;
    if results.is_empty() {
        return Err(RequestError::EmptyMessages);
    }
    results
        .into_iter()
        .enumerate()
        .map(|(index, r)| match r {
            MessageResult::Ok(m) => Ok(m),
            MessageResult::Problem(problem) => Err(RequestError::InvalidMessage { index, problem }),
        })
        .collect()
}

/// A JSON value seen only as "a string" or "something else" (drained).
enum MaybeStr<'a> {
    Str(Cow<'a, str>),
    Null,
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for MaybeStr<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match <&'de RawValue>::deserialize(d)? {
            raw if raw.get() == "null" => Ok(MaybeStr::Null),
            raw if raw.get().starts_with('"') => serde_json::from_str::<Str<'de>>(raw.get())
                .map(|s| MaybeStr::Str(s.0))
                .map_err(de::Error::custom),
            _ => Ok(MaybeStr::Other),
        }
    }
}

/// `content`: null, a string, or a list of parts.
enum Content<'a> {
    Null,
    Text(Cow<'a, str>),
    /// The text and tool-reference parts, the type of the first part that is neither, and
    /// for each of those parts whether it is a plain string or typed `text` (the parts vLLM
    /// looks at for Claude Code's attribution line, [`strip_billing_header`]).
    Parts(Vec<Part<'a>>, Option<Cow<'a, str>>, Vec<bool>),
    /// Neither null, a string nor a list.
    Bad,
    /// A part that is not an object with a string `type`, or a text part whose text is not a
    /// string.
    BadPart,
}

/// A content part object's fields that decide its text (a repeated key's last value wins).
struct RawPart<'a> {
    kind: Option<MaybeStr<'a>>,
    text: Option<MaybeStr<'a>>,
    refusal: Option<MaybeStr<'a>>,
    thinking: Option<MaybeStr<'a>>,
    /// A `tool_reference` part's.
    name: Option<MaybeStr<'a>>,
    /// For a part without a `type`: the first of [`UNTYPED_MEDIA`] it has.
    untyped_media: Option<&'static str>,
}

/// The keys that make a part without a `type` a media part, in the order vLLM looks for them
/// (`input_audio` only when not null).
const UNTYPED_MEDIA: [&str; 7] =
    ["image_url", "image_pil", "image_embeds", "audio_embeds", "audio_url", "input_audio", "video_url"];

impl<'de> Deserialize<'de> for RawPart<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let read = |raw: Option<&'de RawValue>| {
            raw.map(|raw| serde_json::from_str::<MaybeStr<'de>>(raw.get()).map_err(de::Error::custom))
                .transpose()
        };
        let mut names = ["type", "text", "refusal", "thinking", "name", "", "", "", "", "", "", ""];
        names[5..].copy_from_slice(&UNTYPED_MEDIA);
        let fields = object::fields_of(d, &names)?;
        // Absent and null are both `None` here: vLLM takes a null `input_audio` for no media
        // (and a null `image_url` for an image without a URL, which it then refuses).
        let untyped_media =
            UNTYPED_MEDIA.iter().zip(&fields[5..]).find(|(_, f)| f.is_some()).map(|(k, _)| *k);
        Ok(RawPart {
            kind: read(fields[0])?,
            text: read(fields[1])?,
            refusal: read(fields[2])?,
            thinking: read(fields[3])?,
            name: read(fields[4])?,
            untyped_media,
        })
    }
}

impl<'a> RawPart<'a> {
    /// The text of a part vLLM reads as text (`text`, `input_text`, `output_text`, `refusal`,
    /// `thinking`, each from its own key): `Some(Ok(Some))`; `Some(Ok(None))` when that key is
    /// missing or null (vLLM skips the part; an empty text it skips when it joins the texts,
    /// [`join_text_parts`], and keeps as a part); `Some(Err)` when it is not a string;
    /// `None` for any other type. A `tool_reference` is kept whatever its name (a name that
    /// is not a string is an error).
    fn part(self, kind: &str) -> Option<Result<Option<Part<'a>>, ()>> {
        let (value, aside) = match kind {
            "text" | "input_text" | "output_text" => (self.text, false),
            "refusal" => (self.refusal, true),
            "thinking" => (self.thinking, true),
            "tool_reference" => {
                return Some(match self.name {
                    Some(MaybeStr::Str(name)) => Ok(Some(Part::ToolReference(Some(name)))),
                    None | Some(MaybeStr::Null) => Ok(Some(Part::ToolReference(None))),
                    Some(MaybeStr::Other) => Err(()),
                });
            }
            _ => return None,
        };
        Some(match value {
            Some(MaybeStr::Str(text)) if aside => Ok(Some(Part::Aside(text))),
            Some(MaybeStr::Str(text)) => Ok(Some(Part::Text(text))),
            None | Some(MaybeStr::Null) => Ok(None),
            Some(MaybeStr::Other) => Err(()),
        })
    }
}

impl<'de> Deserialize<'de> for Content<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = <&'de RawValue>::deserialize(d)?;
        let s = raw.get();
        if s == "null" {
            return Ok(Content::Null);
        }
        if s.starts_with('"') {
            return serde_json::from_str::<Str<'de>>(s)
                .map(|t| Content::Text(t.0))
                .map_err(de::Error::custom);
        }
        if !s.starts_with('[') {
            return Ok(Content::Bad);
        }
        let parts: Vec<&'de RawValue> = serde_json::from_str(s).map_err(de::Error::custom)?;
        let mut texts = Vec::with_capacity(parts.len());
        let mut plain = Vec::with_capacity(parts.len());
        let mut media = None;
        for part in parts {
            let bad = || Ok(Content::BadPart);
            // A plain string is a text part, as vLLM reads it.
            if part.get().starts_with('"') {
                texts.push(Part::Text(
                    serde_json::from_str::<Str<'de>>(part.get()).map_err(de::Error::custom)?.0,
                ));
                plain.push(true);
                continue;
            }
            if !part.get().starts_with('{') {
                return bad();
            }
            let mut part: RawPart<'de> = serde_json::from_str(part.get()).map_err(de::Error::custom)?;
            let kind = match (part.kind.take(), part.untyped_media) {
                (Some(MaybeStr::Str(kind)), _) => kind,
                // No `type` (or a null one), but a media key: vLLM reads the part as that media.
                (None | Some(MaybeStr::Null), Some(key)) => Cow::Borrowed(key),
                _ => return bad(),
            };
            let typed_text = kind == "text";
            match part.part(&kind) {
                Some(Ok(Some(part))) => {
                    texts.push(part);
                    plain.push(typed_text);
                }
                Some(Ok(None)) => {}
                Some(Err(())) => return bad(),
                None => {
                    media.get_or_insert(kind);
                }
            }
        }
        Ok(Content::Parts(texts, media, plain))
    }
}

impl<'de> Deserialize<'de> for MessageResult<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MessageVisitor;
        impl<'de> Visitor<'de> for MessageVisitor {
            type Value = MessageResult<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a chat message")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut role = None;
                let mut content = Content::Null;
                let mut extra = Vec::new();
                while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
                    match &*key {
                        "role" => role = Some(map.next_value::<MaybeStr<'de>>()?),
                        "content" => content = map.next_value::<Content<'de>>()?,
                        _ => extra.push((key, map.next_value::<&'de RawValue>()?)),
                    }
                }
                let role = match role {
                    None | Some(MaybeStr::Null) => {
                        return Ok(MessageResult::Problem(MessageProblem::MissingRole));
                    }
                    Some(MaybeStr::Other) => return Ok(MessageResult::Problem(MessageProblem::BadRole)),
                    Some(MaybeStr::Str(r)) => r,
                };
                let mut parts = None;
                let (content, media) = match content {
                    Content::Null => (None, None),
                    Content::Text(t) if role == "system" && t.starts_with(BILLING_HEADER) => {
                        let mut texts = vec![Part::Text(t)];
                        strip_billing_header(&mut texts, &[true]);
                        match texts.pop() {
                            Some(Part::Text(rest)) => (Some(rest), None),
                            // No text left: an empty list, as vLLM has it.
                            _ => {
                                parts = Some(Vec::new());
                                (Some(Cow::Borrowed("")), None)
                            }
                        }
                    }
                    Content::Text(t) => (Some(t), None),
                    Content::Parts(mut texts, media, plain) => {
                        if role == "system" {
                            strip_billing_header(&mut texts, &plain);
                        }
                        let joined = join_text_parts(&texts);
                        parts = Some(texts);
                        (Some(joined), media)
                    }
                    Content::Bad => return Ok(MessageResult::Problem(MessageProblem::BadContent)),
                    Content::BadPart => return Ok(MessageResult::Problem(MessageProblem::BadContentPart)),
                };
                Ok(MessageResult::Ok(Message { role, content, media, extra, parts }))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
        }
        d.deserialize_any(MessageVisitor)
    }
}

/// vLLM (0.33) drops Claude Code's attribution line (`x-anthropic-billing-header: ...;
/// cch=...`, which changes with every request) from a system message's text parts that are
/// plain strings or typed `text` (`plain`), and a part that was nothing else: a gateway
/// that turns Claude Code's requests into chat requests keeps it, and the prefix cache
/// would miss from there on.
fn strip_billing_header(texts: &mut Vec<Part<'_>>, plain: &[bool]) {
    let mut plain = plain.iter();
    texts.retain_mut(|part| {
        let Part::Text(text) = part else {
            plain.next();
            return true;
        };
        if !plain.next().copied().unwrap_or(false) || !text.starts_with(BILLING_HEADER) {
            return true;
        }
        // What follows the first line, if anything.
        let start = match text.find('\n') {
            Some(end) if end + 1 < text.len() => end + 1,
            _ => return false,
        };
        match text {
            Cow::Borrowed(all) => *all = &all[start..],
            Cow::Owned(all) => drop(all.drain(..start)),
        }
        true
    });
}

/// vLLM's "string" content format: the texts that are not empty, joined with a newline.
fn join_text_parts<'a>(parts: &[Part<'a>]) -> Cow<'a, str> {
    let mut texts = parts.iter().filter(|p| !p.text().is_empty());
    match (texts.next(), texts.next()) {
        (None, _) => Cow::Borrowed(""),
        (Some(Part::Text(one)), None) => one.clone(),
        (Some(one), None) => Cow::Owned(one.text().to_owned()),
        (Some(first), Some(second)) => {
            let mut joined = format!("{}\n{}", first.text(), second.text());
            for part in texts {
                joined.push('\n');
                joined.push_str(part.text());
            }
            Cow::Owned(joined)
        }
    }
}
