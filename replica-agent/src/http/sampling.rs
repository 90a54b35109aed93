//! The sampling parameters of a generation request, checked as vLLM's `SamplingParams`
//! checks them (`_verify_args`, then greedy sampling with `n` > 1), worded as it words them.
//! The simulated text ignores them; a request vLLM would refuse is refused here too.
//!
//! An absent or null field takes vLLM's default. Numbers must be JSON numbers (pydantic's
//! lax mode also reads numeric strings; not done here).

use kvroute_proto::openai::request::MAX_N;
use serde_json::Value;
use serde_json::value::RawValue;

use super::error::ApiError;

/// The request's fields this module reads, in [`Sampling::parse`]'s order.
pub(super) const FIELDS: [&str; 10] = [
    "n",
    "temperature",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "stop",
];

/// Below this temperature vLLM samples greedily, where `n` must be 1.
const GREEDY_TEMPERATURE: f64 = 1e-5;

/// What the server keeps of a request's sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sampling {
    /// Choices a prompt.
    pub n: u32,
    /// Tokens each choice must have before it may stop; checked against each prompt's
    /// `max_tokens` by [`Sampling::check_max_tokens`].
    pub min_tokens: u64,
}

impl Sampling {
    /// The fields of [`FIELDS`], in that order.
    pub fn parse(fields: [Option<&RawValue>; FIELDS.len()]) -> Result<Self, ApiError> {
        let [n, temperature, presence, frequency, repetition, top_p, top_k, min_p, min_tokens, stop] =
            fields.map(|raw| raw.map(|r| serde_json::from_str::<Value>(r.get())));
        let n = choices(n)?;
        for (param, value) in [("presence_penalty", presence), ("frequency_penalty", frequency)] {
            let value = number(param, value, 0.0)?;
            if !(-2.0..=2.0).contains(&value) {
                return Err(ApiError::bad_request(format!("{param} must be in [-2, 2], got {}.", py(value))));
            }
        }
        let repetition = number("repetition_penalty", repetition, 1.0)?;
        if repetition <= 0.0 {
            return Err(ApiError::bad_request(format!(
                "repetition_penalty must be greater than zero, got {}.",
                py(repetition)
            )));
        }
        let temperature = number("temperature", temperature, 1.0)?;
        if temperature < 0.0 {
            return Err(ApiError::invalid_field(
                "temperature",
                format!("temperature must be non-negative, got {}.", py(temperature)),
            ));
        }
        let top_p = number("top_p", top_p, 1.0)?;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_field(
                "top_p",
                format!("top_p must be in (0, 1], got {}.", py(top_p)),
            ));
        }
        let top_k = integer("top_k", top_k, 0)?;
        if top_k < -1 {
            return Err(ApiError::bad_request(format!(
                "top_k must be 0 (disable), or at least 1, got {top_k}."
            )));
        }
        let min_p = number("min_p", min_p, 0.0)?;
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::bad_request(format!("min_p must be in [0, 1], got {}.", py(min_p))));
        }
        let min_tokens = integer("min_tokens", min_tokens, 0)?;
        let Ok(min_tokens) = u64::try_from(min_tokens) else {
            return Err(ApiError::bad_request(format!(
                "min_tokens must be greater than or equal to 0, got {min_tokens}."
            )));
        };
        if stops(stop)?.iter().any(|s| s.is_empty()) {
            return Err(ApiError::bad_request("stop cannot contain an empty string."));
        }
        if n > 1 && temperature < GREEDY_TEMPERATURE {
            return Err(ApiError::invalid_field(
                "n",
                format!("n must be 1 when using greedy sampling, got {n}."),
            ));
        }
        Ok(Self { n, min_tokens })
    }

    /// Refuses `min_tokens` past a prompt's `max_tokens` (what the request asked, or what
    /// the replica gave it).
    pub fn check_max_tokens(&self, max_tokens: u32) -> Result<(), ApiError> {
        match self.min_tokens > u64::from(max_tokens) {
            true => Err(ApiError::bad_request(format!(
                "min_tokens must be less than or equal to max_tokens={max_tokens}, got {}.",
                self.min_tokens
            ))),
            false => Ok(()),
        }
    }
}

type Field = Option<serde_json::Result<Value>>;

/// `n`, checked as vLLM 0.33 checks it (null is 1, where vLLM refuses it for completions).
fn choices(raw: Field) -> Result<u32, ApiError> {
    let n = integer("n", raw, 1)?;
    if n < 1 {
        return Err(ApiError::bad_request(format!("n must be at least 1, got {n}.")));
    }
    if n > i64::from(MAX_N) {
        return Err(ApiError::bad_request(format!(
            "n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES \
             environment variable."
        )));
    }
    Ok(n as u32)
}

/// A float field; absent or null is `default`.
fn number(param: &str, raw: Field, default: f64) -> Result<f64, ApiError> {
    let unreadable = || ApiError::invalid_field(param, format!("'{param}' must be a number"));
    match raw {
        None | Some(Ok(Value::Null)) => Ok(default),
        Some(Ok(Value::Number(x))) => x.as_f64().ok_or_else(unreadable),
        Some(_) => Err(unreadable()),
    }
}

/// An integer field (a float without a fraction counts, as pydantic reads one); absent or
/// null is `default`.
fn integer(param: &str, raw: Field, default: i64) -> Result<i64, ApiError> {
    let not_integer = || ApiError::invalid_field(param, format!("'{param}' must be an integer"));
    match raw {
        None | Some(Ok(Value::Null)) => Ok(default),
        Some(Ok(Value::Number(n))) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 1e15).map(|f| f as i64))
            .ok_or_else(not_integer),
        Some(_) => Err(not_integer()),
    }
}

/// `stop`: a string or a list of strings.
fn stops(raw: Field) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid_field("stop", "'stop' must be a string or a list of strings");
    match raw {
        None | Some(Ok(Value::Null)) => Ok(Vec::new()),
        Some(Ok(Value::String(s))) => Ok(vec![s]),
        Some(Ok(Value::Array(items))) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => Ok(s),
                _ => Err(bad()),
            })
            .collect(),
        Some(_) => Err(bad()),
    }
}

/// A float as Python prints it: `2.0`, not `2`.
fn py(x: f64) -> String {
    match x.fract() == 0.0 && x.abs() < 1e16 {
        true => format!("{x:.1}"),
        false => x.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Sampling, String> {
        let fields = kvroute_proto::openai::request::parse_object(json.as_bytes(), &FIELDS).unwrap();
        Sampling::parse(fields).map_err(|e| e.error.message)
    }

    /// vLLM's `SamplingParams._verify_args`, field by field.
    #[test]
    fn out_of_range_parameters_are_refused_in_vllms_words() {
        for (body, said) in [
            (r#"{"presence_penalty": 2.5}"#, "presence_penalty must be in [-2, 2], got 2.5."),
            (r#"{"frequency_penalty": -3}"#, "frequency_penalty must be in [-2, 2], got -3.0."),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty must be greater than zero, got 0.0."),
            (r#"{"temperature": -1}"#, "temperature must be non-negative, got -1.0."),
            (r#"{"top_p": 0}"#, "top_p must be in (0, 1], got 0.0."),
            (r#"{"top_p": 1.5}"#, "top_p must be in (0, 1], got 1.5."),
            (r#"{"top_k": -2}"#, "top_k must be 0 (disable), or at least 1, got -2."),
            (r#"{"min_p": 1.1}"#, "min_p must be in [0, 1], got 1.1."),
            (r#"{"min_tokens": -1}"#, "min_tokens must be greater than or equal to 0, got -1."),
            (r#"{"stop": ""}"#, "stop cannot contain an empty string."),
            (r#"{"stop": ["a", ""]}"#, "stop cannot contain an empty string."),
            (r#"{"n": 2, "temperature": 0}"#, "n must be 1 when using greedy sampling, got 2."),
            (r#"{"n": 0}"#, "n must be at least 1, got 0."),
            (r#"{"top_p": "high"}"#, "'top_p' must be a number"),
            (r#"{"top_k": 1.5}"#, "'top_k' must be an integer"),
        ] {
            assert_eq!(parse(body).unwrap_err(), said, "{body}");
        }
    }

    #[test]
    fn defaults_and_edges_are_accepted() {
        for body in [
            r#"{}"#,
            r#"{"presence_penalty": null, "top_p": null, "stop": null, "n": null}"#,
            r#"{"presence_penalty": -2, "frequency_penalty": 2, "top_p": 1, "top_k": -1, "min_p": 0}"#,
            r#"{"stop": ["a", "b"], "temperature": 0, "min_tokens": 3.0}"#,
        ] {
            assert!(parse(body).is_ok(), "{body}: {:?}", parse(body));
        }
        assert_eq!(parse(r#"{"n": 3, "min_tokens": 4}"#), Ok(Sampling { n: 3, min_tokens: 4 }));
    }

    #[test]
    fn min_tokens_may_not_pass_max_tokens() {
        let sampling = parse(r#"{"min_tokens": 8}"#).unwrap();
        assert!(sampling.check_max_tokens(8).is_ok());
        let refused = sampling.check_max_tokens(7).unwrap_err();
        assert_eq!(refused.error.message, "min_tokens must be less than or equal to max_tokens=7, got 8.");
    }
}
