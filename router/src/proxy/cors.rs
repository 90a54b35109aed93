//! CORS on the router's own answers (its errors, `/v1/models`, LoRA changes): a browser
//! shows a script the router's 503 or 400 only if the answer lets the page's origin read
//! it. The replicas' answers pass through with the replicas' own CORS headers (vLLM's
//! allow every origin by default), and preflights go to a replica ([`super`]'s table).
//!
//! `--allowed-origins` as vLLM's: `*` (the default) lets any origin read; a list lets those
//! origins, each answer then naming the request's origin and `Vary: Origin`; an empty list
//! sends no CORS headers. As with Starlette's middleware, only a request with an `Origin`
//! field gets them.

use http::header::{self, HeaderMap, HeaderValue};

/// Which origins may read the router's own answers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AllowedOrigins {
    /// No CORS headers.
    #[default]
    None,
    Any,
    /// These origins, compared as ASCII case-insensitive strings.
    List(Vec<String>),
}

impl AllowedOrigins {
    /// From `--allowed-origins`: `*` anywhere is any origin; blank entries are dropped.
    pub fn new(origins: &[String]) -> Self {
        let origins: Vec<String> = origins
            .iter()
            .map(|o| o.trim().trim_end_matches('/').to_owned())
            .filter(|o| !o.is_empty())
            .collect();
        match origins {
            o if o.is_empty() => AllowedOrigins::None,
            o if o.iter().any(|o| o == "*") => AllowedOrigins::Any,
            o => AllowedOrigins::List(o),
        }
    }

    /// Adds the CORS fields an answer to a request with `request`'s headers gets.
    pub fn apply(&self, request: Option<&HeaderValue>, answer: &mut HeaderMap) {
        let Some(origin) = request else { return };
        match self {
            AllowedOrigins::None => {}
            AllowedOrigins::Any => {
                answer.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
            }
            AllowedOrigins::List(allowed) => {
                answer.append(header::VARY, HeaderValue::from_static("origin"));
                let listed = origin.to_str().is_ok_and(|o| allowed.iter().any(|a| a.eq_ignore_ascii_case(o)));
                if listed {
                    answer.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(policy: &AllowedOrigins, origin: Option<&'static str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        policy.apply(origin.map(HeaderValue::from_static).as_ref(), &mut headers);
        headers
    }

    #[test]
    fn origins_read_the_answers_the_policy_lets_them() {
        let any = AllowedOrigins::new(&["*".into()]);
        assert_eq!(answer(&any, Some("https://app.example"))["access-control-allow-origin"], "*");
        assert!(answer(&any, None).is_empty(), "no Origin, no CORS fields");

        let listed = AllowedOrigins::new(&["https://App.example/".into(), " ".into()]);
        assert_eq!(listed, AllowedOrigins::List(vec!["https://App.example".into()]));
        let allowed = answer(&listed, Some("https://app.example"));
        assert_eq!(allowed["access-control-allow-origin"], "https://app.example");
        assert_eq!(allowed["vary"], "origin");
        let other = answer(&listed, Some("https://evil.example"));
        assert!(other.get("access-control-allow-origin").is_none());
        assert_eq!(other["vary"], "origin", "caches keep the answers apart");

        let none = AllowedOrigins::new(&["".into()]);
        assert_eq!(none, AllowedOrigins::None);
        assert!(answer(&none, Some("https://app.example")).is_empty());
    }
}
