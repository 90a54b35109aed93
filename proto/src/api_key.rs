//! API keys checked as vLLM checks its `--api-key`: a request to a path under `/v1`, or to
//! SGLang's `/generate` (which SGLang's `--api-key` guards too), a browser's `OPTIONS`
//! preflight excepted, must carry `Authorization: Bearer <key>` with one of the keys; every
//! other path stays open (`/health`, `/metrics`, ...).

/// Whether a request of `method` to `path` needs a key.
pub fn needs_key(method: &http::Method, path: &str) -> bool {
    let generates = path.starts_with("/v1") || path == crate::openai::request::sglang::GENERATE_PATH;
    generates && method != http::Method::OPTIONS
}

/// Whether `authorization` (the header's value, if any) is `Bearer <key>` (the scheme in any
/// case) for one of `keys`. Digests of the same length are compared, each in full, for every
/// key: the time taken tells nothing of a key's length, of how much of a guess was right, nor
/// of which key it was near.
pub fn bearer_matches<K: AsRef<str>>(authorization: Option<&[u8]>, keys: &[K]) -> bool {
    matching(authorization, keys).is_some()
}

/// Which of `keys` `authorization` is `Bearer <key>` for ([`bearer_matches`], which compares
/// with every key in full, whichever matches).
pub fn matching<K: AsRef<str>>(authorization: Option<&[u8]>, keys: &[K]) -> Option<usize> {
    let (scheme, given) = authorization.and_then(|value| split_once(value, b' '))?;
    let given = digest(given);
    let matched = keys.iter().enumerate().fold(None, |matched, (i, key)| {
        let equal = constant_time_eq(&given, &digest(key.as_ref().as_bytes()));
        if equal && matched.is_none() { Some(i) } else { matched }
    });
    matched.filter(|_| scheme.eq_ignore_ascii_case(b"bearer"))
}

/// 128 bits of `value`: equal for equal values, and for different ones all but never (a
/// guess cannot be made to collide with a key it does not know).
fn digest(value: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128(value).to_le_bytes()
}

/// Equality whose time depends only on the lengths, not on where the bytes differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn split_once(value: &[u8], at: u8) -> Option<(&[u8], &[u8])> {
    let i = value.iter().position(|&b| b == at)?;
    Some((&value[..i], &value[i + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_of_one_of_the_keys_passes() {
        let keys = ["first", "second"];
        let check = |value: &str| bearer_matches(Some(value.as_bytes()), &keys);
        assert!(check("Bearer first") && check("Bearer second") && check("bearer second"));
        assert_eq!(matching(Some(b"Bearer second".as_slice()), &keys), Some(1));
        assert_eq!(matching(Some(b"Basic second".as_slice()), &keys), None);
        for refused in ["Bearer third", "Bearer firs", "Bearer first ", "Basic first", "first", "Bearer", ""]
        {
            assert!(!check(refused), "{refused:?}");
        }
        assert!(!bearer_matches(None, &keys));
        assert!(!bearer_matches(Some(b"Bearer first"), &[] as &[&str]));
    }

    #[test]
    fn only_paths_under_v1_need_a_key_and_not_a_preflight() {
        assert!(needs_key(&http::Method::POST, "/v1/completions"));
        assert!(needs_key(&http::Method::GET, "/v1/models"));
        assert!(!needs_key(&http::Method::OPTIONS, "/v1/completions"));
        assert!(!needs_key(&http::Method::GET, "/health"));
        assert!(!needs_key(&http::Method::POST, "/tokenize"));
        assert!(needs_key(&http::Method::POST, "/generate"));
    }
}
