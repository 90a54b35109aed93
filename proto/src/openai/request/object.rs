//! A JSON object's known fields, read as Python's `json.loads` reads an object, and so as
//! vLLM reads a request: a key that appears more than once has its last value; `null` is the
//! same as absent.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::Str;

/// The values of `names` in the JSON object `json` (the whole input), raw; every other key's
/// value is checked to be JSON and skipped.
pub(super) fn fields<'a, const N: usize>(
    json: &'a [u8],
    names: &[&str; N],
) -> serde_json::Result<[Option<&'a RawValue>; N]> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let out = Fields { names, borrow: PhantomData }.deserialize(&mut de)?;
    de.end()?;
    Ok(out)
}

/// [`fields`] of one object inside a larger value, for its `Deserialize`.
pub(super) fn fields_of<'de, D: Deserializer<'de>, const N: usize>(
    d: D,
    names: &[&str; N],
) -> Result<[Option<&'de RawValue>; N], D::Error> {
    Fields { names, borrow: PhantomData }.deserialize(d)
}

struct Fields<'n, 'de, const N: usize> {
    names: &'n [&'n str; N],
    borrow: PhantomData<&'de ()>,
}

impl<'de, const N: usize> DeserializeSeed<'de> for Fields<'_, 'de, N> {
    type Value = [Option<&'de RawValue>; N];

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, const N: usize> Visitor<'de> for Fields<'_, 'de, N> {
    type Value = [Option<&'de RawValue>; N];

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = [None; N];
        while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
            match self.names.iter().position(|name| *name == key) {
                Some(k) => out[k] = map.next_value::<Option<&'de RawValue>>()?,
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(out)
    }
}
