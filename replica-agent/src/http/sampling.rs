//! The sampling parameters of a generation request, checked as vLLM's `SamplingParams`
//! checks them (`_verify_args`, then greedy sampling with `n` > 1), worded as it words them.
//! The simulated text ignores them; a request vLLM would refuse is refused here too.
//!
//! An absent or null field takes vLLM's default. A number may be written as a string, as
//! pydantic's lax mode reads it.

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

/// [`FIELDS`] as SGLang's `sampling_params` name them (`/generate`): `min_new_tokens`.
pub(super) const NATIVE_FIELDS: [&str; FIELDS.len()] = {
    let mut fields = FIELDS;
    fields[8] = "min_new_tokens";
    fields
};

/// Below this temperature vLLM samples greedily, where `n` must be 1.
const GREEDY_TEMPERATURE: f64 = 1e-5;

/// A request's sampling parameters, read ([`Sampling::parse`]: type errors, as pydantic
/// finds them when the request is read) and then checked ([`Sampling::check`]: ranges, as
/// `SamplingParams` finds them once each prompt's length was checked against the context).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Sampling {
    /// Choices a prompt.
    pub n: i64,
    temperature: f64,
    presence_penalty: f64,
    frequency_penalty: f64,
    repetition_penalty: f64,
    top_p: f64,
    top_k: i64,
    min_p: f64,
    min_tokens: i64,
    /// `stop` holds an empty string.
    empty_stop: bool,
    /// Read as SGLang reads it (`/generate`), which samples several choices greedily too.
    sglang: bool,
}

impl Default for Sampling {
    /// vLLM's defaults.
    fn default() -> Self {
        Sampling {
            n: 1,
            temperature: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            min_tokens: 0,
            empty_stop: false,
            sglang: false,
        }
    }
}

impl Sampling {
    /// The fields of [`FIELDS`], in that order; absent or null is vLLM's default.
    pub fn parse(fields: [Option<&RawValue>; FIELDS.len()]) -> Result<Self, ApiError> {
        let [n, temperature, presence, frequency, repetition, top_p, top_k, min_p, min_tokens, stop] =
            fields.map(|raw| raw.map(|r| serde_json::from_str::<Value>(r.get())));
        let d = Sampling::default();
        Ok(Sampling {
            n: integer("n", n, d.n)?,
            temperature: number("temperature", temperature, d.temperature)?,
            presence_penalty: number("presence_penalty", presence, d.presence_penalty)?,
            frequency_penalty: number("frequency_penalty", frequency, d.frequency_penalty)?,
            repetition_penalty: number("repetition_penalty", repetition, d.repetition_penalty)?,
            top_p: number("top_p", top_p, d.top_p)?,
            top_k: integer("top_k", top_k, d.top_k)?,
            min_p: number("min_p", min_p, d.min_p)?,
            min_tokens: integer("min_tokens", min_tokens, d.min_tokens)?,
            empty_stop: stops(stop)?.iter().any(String::is_empty),
            sglang: false,
        })
    }

    /// Checks the parameters for a prompt whose `max_tokens` is `max_tokens` (what the
    /// request asked, or what the context leaves when it asked nothing), in vLLM's order.
    pub fn check(&self, max_tokens: u64) -> Result<(), ApiError> {
        let bad = |message: String| Err(ApiError::bad_request(message));
        let n = self.n;
        if n < 1 {
            return bad(format!("n must be at least 1, got {n}."));
        }
        if n > i64::from(MAX_N) {
            return bad(format!(
                "n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES \
                 environment variable."
            ));
        }
        for (param, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return bad(format!("{param} must be in [-2, 2], got {}.", py(value)));
            }
        }
        if self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be greater than zero, got {}.",
                py(self.repetition_penalty)
            ));
        }
        if self.temperature < 0.0 {
            let message = format!("temperature must be non-negative, got {}.", py(self.temperature));
            return Err(ApiError::invalid_field("temperature", message));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ApiError::invalid_field(
                "top_p",
                format!("top_p must be in (0, 1], got {}.", py(self.top_p)),
            ));
        }
        if self.top_k < -1 {
            return bad(format!("top_k must be 0 (disable), or at least 1, got {}.", self.top_k));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}.", py(self.min_p)));
        }
        if max_tokens < 1 {
            let message = format!("max_tokens must be at least 1, got {max_tokens}.");
            return Err(ApiError::invalid_field("max_tokens", message));
        }
        let Ok(min_tokens) = u64::try_from(self.min_tokens) else {
            return bad(format!("min_tokens must be greater than or equal to 0, got {}.", self.min_tokens));
        };
        if min_tokens > max_tokens {
            return bad(format!(
                "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
            ));
        }
        if self.empty_stop {
            return bad("stop cannot contain an empty string.".into());
        }
        if n > 1 && self.temperature < GREEDY_TEMPERATURE && !self.sglang {
            return Err(ApiError::invalid_field(
                "n",
                format!("n must be 1 when using greedy sampling, got {n}."),
            ));
        }
        Ok(())
    }

    /// As SGLang checks it: several greedy choices allowed.
    pub fn as_sglang(self) -> Self {
        Sampling { sglang: true, ..self }
    }

    /// Tokens each choice must have before it may stop (0 if the request's is negative,
    /// which [`Self::check`] refuses).
    pub fn min_tokens(&self) -> u64 {
        u64::try_from(self.min_tokens).unwrap_or(0)
    }

    /// Choices a prompt, once [`Self::check`]ed.
    pub fn choices(&self) -> u32 {
        u32::try_from(self.n).unwrap_or(1)
    }
}

type Field = Option<serde_json::Result<Value>>;

/// A float field; absent or null is `default`.
fn number(param: &str, raw: Field, default: f64) -> Result<f64, ApiError> {
    let unreadable = || ApiError::invalid_field(param, format!("'{param}' must be a number"));
    match raw {
        None | Some(Ok(Value::Null)) => Ok(default),
        Some(Ok(Value::Number(x))) => x.as_f64().ok_or_else(unreadable),
        // pydantic's lax mode reads a number written as a string, and a boolean as 0 or 1.
        Some(Ok(Value::String(x))) => x.trim().parse::<f64>().map_err(|_| unreadable()),
        Some(Ok(Value::Bool(b))) => Ok(f64::from(u8::from(b))),
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
        // As the shared parser's counts: a whole number written as a string ("2", "2.0"),
        // a boolean as 0 or 1.
        Some(Ok(Value::String(n))) => n
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|f| f.fract() == 0.0 && f.abs() < 1e15)
            .map(|f| f as i64)
            .ok_or_else(not_integer),
        Some(Ok(Value::Bool(b))) => Ok(i64::from(b)),
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

    /// Parsed, then checked for a prompt with `max_tokens` 16.
    fn refusal(json: &str) -> Option<String> {
        let fields = kvroute_proto::openai::request::parse_object(json.as_bytes(), &FIELDS).unwrap();
        Sampling::parse(fields).and_then(|s| s.check(16)).err().map(|e| e.error.message)
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
            (r#"{"top_p": "1.5"}"#, "top_p must be in (0, 1], got 1.5."),
            (r#"{"top_k": -2}"#, "top_k must be 0 (disable), or at least 1, got -2."),
            (r#"{"min_p": 1.1}"#, "min_p must be in [0, 1], got 1.1."),
            (r#"{"min_tokens": -1}"#, "min_tokens must be greater than or equal to 0, got -1."),
            (r#"{"min_tokens": 17}"#, "min_tokens must be less than or equal to max_tokens=16, got 17."),
            (r#"{"stop": ""}"#, "stop cannot contain an empty string."),
            (r#"{"stop": ["a", ""]}"#, "stop cannot contain an empty string."),
            (r#"{"n": 2, "temperature": 0}"#, "n must be 1 when using greedy sampling, got 2."),
            (r#"{"n": 0}"#, "n must be at least 1, got 0."),
            (r#"{"top_p": "high"}"#, "'top_p' must be a number"),
            (r#"{"top_k": 1.5}"#, "'top_k' must be an integer"),
            // vLLM's order: the penalties before top_p, min_tokens before stop and greedy `n`.
            (r#"{"top_p": 0, "presence_penalty": 9}"#, "presence_penalty must be in [-2, 2], got 9.0."),
            (
                r#"{"stop": [""], "min_tokens": 20, "n": 2, "temperature": 0}"#,
                "min_tokens must be less than or equal to max_tokens=16, got 20.",
            ),
        ] {
            assert_eq!(refusal(body).as_deref(), Some(said), "{body}");
        }
    }

    #[test]
    fn defaults_edges_and_numeric_strings_are_accepted() {
        for body in [
            r#"{}"#,
            r#"{"presence_penalty": null, "top_p": null, "stop": null, "n": null}"#,
            r#"{"presence_penalty": -2, "frequency_penalty": 2, "top_p": 1, "top_k": -1, "min_p": 0}"#,
            r#"{"stop": ["a", "b"], "temperature": 0, "min_tokens": 16.0}"#,
            r#"{"n": "2", "temperature": "0.7", "top_p": " 0.9 "}"#,
            r#"{"n": "2.0", "top_k": true, "min_tokens": "3.", "temperature": true}"#,
        ] {
            assert_eq!(refusal(body), None, "{body}");
        }
        let fields = kvroute_proto::openai::request::parse_object(br#"{"n": 3}"#, &FIELDS).unwrap();
        assert_eq!(Sampling::parse(fields).unwrap().choices(), 3);
    }

    #[test]
    fn max_tokens_must_leave_room_for_one_token() {
        let refused = Sampling::default().check(0).unwrap_err();
        assert_eq!(refused.error.message, "max_tokens must be at least 1, got 0.");
        assert_eq!(refused.error.param.as_deref(), Some("max_tokens"));
    }
}
