//! Reading samples from Prometheus' text exposition format (0.0.4), as vLLM, SGLang and the
//! kvroute agent serve it on `/metrics`: the router reads replicas' load gauges with it, the
//! load generator their counters.
//!
//! Parsing is deliberately small: a sample line is `name{labels} value [timestamp]` (an
//! exemplar after it is ignored); a line whose label set or value does not parse is passed
//! over.

/// Sum of every sample of `name` on a Prometheus text page, `None` if it has none.
pub fn sum(page: &str, name: &str) -> Option<f64> {
    samples(page, name).map(|s| s.value).reduce(|a, b| a + b)
}

/// The values of `label` over the samples of `name`, in page order, each once.
pub fn label_values(page: &str, name: &str, label: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for sample in samples(page, name) {
        if let Some(value) = sample.label(label)
            && !out.iter().any(|v| v == value)
        {
            out.push(value.to_owned());
        }
    }
    out
}

/// One sample line: its labels (values unescaped) and its value.
pub struct Sample<'a> {
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find_map(|(k, v)| (*k == key).then_some(v.as_str()))
    }
}

/// The well-formed samples of `name` on a page, in page order: `name{labels} value
/// [timestamp] [# exemplar]`; a line whose label set or value does not parse is skipped.
pub fn samples<'a>(page: &'a str, name: &'a str) -> impl Iterator<Item = Sample<'a>> {
    page.lines().filter_map(move |line| {
        let rest = line.trim_start().strip_prefix(name)?;
        let (labels, rest) = match rest.strip_prefix('{') {
            Some(rest) => parse_labels(rest)?,
            None if rest.starts_with([' ', '\t']) => (Vec::new(), rest),
            None => return None,
        };
        let value = rest.split_whitespace().next()?.parse().ok()?;
        Some(Sample { labels, value })
    })
}

/// The `key="value"` pairs of a label set (the text after its `{`), values unescaped, and
/// the text after its closing `}`; `None` if it is malformed. It stops at that `}`, so an
/// exemplar's labels (`... 1 # {trace_id="x"} 1`) are not read as the sample's.
fn parse_labels(mut rest: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut pairs = Vec::new();
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if let Some(after) = rest.strip_prefix('}') {
            return Some((pairs, after));
        }
        let (key, after) = rest.split_once("=\"")?;
        let key = key.trim();
        let mut name = key.chars();
        if !(name.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            return None;
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()? {
                    (_, 'n') => value.push('\n'),
                    (_, c) => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        pairs.push((key, value));
        rest = &after[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: the label parser ran on past a sample's `}`, taking an exemplar's labels
    /// as pairs of the sample (under a key starting with the `}`), and `sum` took the first
    /// `}` for the end of the label set, losing a sample with a `}` inside a label value.
    #[test]
    fn a_label_set_ends_at_its_closing_brace() {
        let (pairs, rest) = parse_labels("zone=\"z\"} 1 # {replica=\"x\"} 1").unwrap();
        assert_eq!((pairs, rest), (vec![("zone", "z".to_string())], " 1 # {replica=\"x\"} 1"));
        assert_eq!(parse_labels("zone=\"z\" 1"), None);
        assert_eq!(parse_labels("} 1 # {replica=\"x\"} 1"), Some((vec![], " 1 # {replica=\"x\"} 1")));
        let page = "kvroute_router_replica_requests_total{zone=\"z\"} 1 # {replica=\"x\"} 1\n\
                    kvroute_router_replica_requests_total{replica=\"a}\"} 2\n";
        assert_eq!(label_values(page, "kvroute_router_replica_requests_total", "replica"), ["a}"]);
        assert_eq!(sum(page, "kvroute_router_replica_requests_total"), Some(3.0));
    }
}
