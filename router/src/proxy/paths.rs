//! The paths the router answers itself, and the ones it refuses to pass through.
//!
//! A `/v1/*` path the router does not route, or one of the engines' own paths outside `/v1/`
//! ([`passes_through`]), goes to a replica as it is. The replica's server
//! (uvicorn for vLLM and SGLang) percent-decodes it before matching, and Starlette redirects a
//! trailing slash: `/v1/%63ompletions` would run as a completion that skipped the router's
//! limits and placement, and `/v1/completions/` would answer with a redirect to the replica's
//! own address. Such spellings of the router's own paths are refused, and so are dot
//! segments, which no OpenAI path has.

use percent_encoding::percent_decode_str;

use super::error::ProxyError;

/// Paths the router answers itself (routes or serves), with the method each takes.
const OWN: [(&str, &str); 13] = [
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/messages", "POST"),
    ("/v1/responses", "POST"),
    ("/generate", "POST"),
    ("/v1/models", "GET, HEAD"),
    ("/v1/load_lora_adapter", "POST"),
    ("/v1/unload_lora_adapter", "POST"),
    ("/load_lora_adapter", "POST"),
    ("/unload_lora_adapter", "POST"),
    ("/health", "GET, HEAD"),
    ("/ready", "GET, HEAD"),
    ("/metrics", "GET, HEAD"),
];

/// The engines' own paths outside `/v1/` that pass through like `/v1/*` ones: vLLM's tokenizer,
/// pooling, scoring and reranking endpoints and its `/version`, and SGLang's `/encode`. Not the ones that
/// generate text some other way (vLLM's `/invocations`; SGLang's `/generate` is routed): through
/// them a generation would skip the router's placement and its prompt and completion limits.
const ENGINE: [&str; 9] = [
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/encode",
    "/v2/rerank",
    "/version",
];

/// Whether a path the router does not answer itself goes to a replica: `/v1/*`, and the
/// engines' other paths in [`ENGINE`] (each with what follows a `/`).
pub fn passes_through(path: &str) -> bool {
    path.starts_with("/v1/")
        || ENGINE.iter().any(|prefix| {
            path.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
}

/// The method `path` takes, if the router answers it itself.
pub fn allowed(path: &str) -> Option<&'static str> {
    OWN.iter().find(|(own, _)| *own == path).map(|(_, method)| *method)
}

/// Refuses a path that passes through but that the replica would read as one of the router's
/// own (or a stored response's, which goes to the replica keeping it), with dot segments, or
/// with control characters: Starlette's route patterns end in `$`, which matches before a
/// final newline, so `/v1/completions%0A` reached a replica as its completions route.
pub fn check_passthrough(path: &str) -> Result<(), ProxyError> {
    let decoded = percent_decode_str(path).decode_utf8_lossy();
    if decoded.split('/').any(|segment| segment == "." || segment == "..") {
        return Err(ProxyError::BadPath(format!("the path {path} has dot segments")));
    }
    if decoded.chars().any(char::is_control) {
        return Err(ProxyError::BadPath(format!("the path {path} has control characters")));
    }
    let plain = decoded.trim_end_matches('/');
    let stored = |p: &str| super::responses::target(p).is_some();
    if plain != path && (allowed(plain).is_some() || stored(plain) && !stored(path)) {
        return Err(ProxyError::BadPath(format!(
            "the path {path} is {plain} spelled otherwise; send {plain}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_paths_spelled_otherwise_are_refused() {
        for path in [
            "/v1/%63ompletions",
            "/v1/completions/",
            "/v1/chat%2Fcompletions",
            "/v1/chat/completions//",
            "/v1/%6dodels",
            "/v1/./completions",
            "/v1/x/../completions",
            "/v1/x/%2E%2E/completions",
            "/v1/completions%0A",
            "/v1/chat/completions%0a",
            "/v1/load_lora_adapter%0A",
            "/v1/embeddings%09",
            "/v1/responses%2Fresp_1",
            "/v1/%72esponses/resp_1/cancel",
        ] {
            assert!(matches!(check_passthrough(path), Err(ProxyError::BadPath(_))), "{path}");
        }
    }

    #[test]
    fn other_paths_pass() {
        for path in [
            "/v1/embeddings",
            "/v1/files/file-abc%20",
            "/v1/models/org%2Fname",
            "/v1/score/",
            "/v1/responses/resp%5F1",
        ] {
            assert!(check_passthrough(path).is_ok(), "{path}");
        }
    }

    #[test]
    fn engine_paths_pass_through_and_others_do_not() {
        let engine = [
            "/v1/embeddings",
            "/v2/rerank",
            "/tokenize",
            "/detokenize",
            "/pooling",
            "/classify",
            "/score",
            "/rerank",
            "/encode",
            "/version",
            "/v1/x/y",
        ];
        for path in engine {
            assert!(passes_through(path), "{path}");
        }
        let others = [
            "/",
            "/v1",
            "/v2/models/m/load",
            "/tokenizer",
            "/versions",
            "/v10/x",
            "/generate",
            "/invocations",
        ];
        for path in others {
            assert!(!passes_through(path), "{path}");
        }
    }

    #[test]
    fn own_paths_take_one_method() {
        assert_eq!(allowed("/v1/completions"), Some("POST"));
        assert_eq!(allowed("/metrics"), Some("GET, HEAD"));
        assert_eq!(allowed("/v1/embeddings"), None);
    }
}
