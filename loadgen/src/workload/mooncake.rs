//! Mooncake (FAST '25) JSONL traces: one request per line,
//! `{"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>, "hash_ids": [..]}`,
//! where `hash_ids` names the prompt's 512-token blocks (the last one possibly partial).
//!
//! Reading checks every line and reports the first bad one by its 1-based line number; blank
//! lines are skipped and unknown fields ignored. Timestamps may be integers or decimals of
//! milliseconds; they need not be sorted (the [`Trace`] keeps the file's order, which is the
//! order seed 000 replays; a live run sends them in it, each no earlier than its timestamp).
//! Writing emits integer milliseconds (rounded down), so a written trace reads back equal
//! when arrivals are whole milliseconds.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::prompt::BlockIds;
use super::{Request, Segment, TRACE_BLOCK_SIZE, Trace, content_blocks};

/// Why a trace could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot open trace {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading line {line}")]
    Read {
        line: usize,
        #[source]
        source: io::Error,
    },
    #[error("line {line}: not a Mooncake request")]
    Json {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("line {line}: {problem}")]
    Invalid { line: usize, problem: LineProblem },
    #[error("writing the trace")]
    Write(#[source] io::Error),
}

/// What is wrong with a well-formed JSON line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LineProblem {
    #[error("timestamp {0} is not a finite, non-negative number of milliseconds")]
    Timestamp(f64),
    #[error("input_length is 0; a request needs at least one prompt token")]
    EmptyPrompt,
    #[error(
        "input_length {input_length} needs ceil({input_length} / {TRACE_BLOCK_SIZE}) = {expected} \
         hash_ids, got {got}"
    )]
    HashIdCount { input_length: usize, expected: usize, got: usize },
    #[error("the segments' lengths add up to {}, not input_length {input_length}", segments.map_or("more than a usize holds".into(), |n| n.to_string()))]
    SegmentTokens { input_length: usize, segments: Option<usize> },
    #[error(
        "hash id {hash_id} (block {block}) does not name the same segments' content as elsewhere \
         in the trace"
    )]
    SegmentIds { block: usize, hash_id: u64 },
    #[error(
        "this line {} segments where the first line {}: one hash id would name two contents \
         (a live run takes tokens from segments, else from ids)",
        if *with { "has" } else { "has no" },
        if *with { "has none" } else { "has them" }
    )]
    MixedSegments { with: bool },
}

#[derive(Deserialize)]
struct InLine {
    timestamp: f64,
    input_length: usize,
    output_length: u32,
    hash_ids: Vec<u64>,
    /// A generated trace's prompt segments (not Mooncake's; empty in its traces).
    #[serde(default)]
    segments: Vec<Segment>,
}

#[derive(Serialize)]
struct OutLine<'a> {
    timestamp: u128,
    input_length: usize,
    output_length: u32,
    hash_ids: &'a [u64],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    segments: &'a [Segment],
}

/// Reads a Mooncake trace file.
pub fn read_file(path: &Path) -> Result<Trace, TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Open { path: path.to_owned(), source })?;
    read(BufReader::new(file))
}

/// Reads a Mooncake trace, in the file's order; fails on the first bad line.
pub fn read(reader: impl BufRead) -> Result<Trace, TraceError> {
    let mut requests = Vec::new();
    let mut segment_ids = SegmentIds::default();
    for (index, line) in reader.lines().enumerate() {
        let line_no = index + 1;
        let line = line.map_err(|source| TraceError::Read { line: line_no, source })?;
        if line.trim().is_empty() {
            continue;
        }
        let raw: InLine =
            serde_json::from_str(&line).map_err(|source| TraceError::Json { line: line_no, source })?;
        let request = parse(raw)
            .and_then(|r| segment_ids.check(&r).map(|()| r))
            .map_err(|problem| TraceError::Invalid { line: line_no, problem })?;
        requests.push(request);
    }
    Ok(Trace::in_order(requests))
}

fn parse(raw: InLine) -> Result<Request, LineProblem> {
    if !(raw.timestamp.is_finite() && raw.timestamp >= 0.0) {
        return Err(LineProblem::Timestamp(raw.timestamp));
    }
    let arrival = Duration::try_from_secs_f64(raw.timestamp / 1000.0)
        .map_err(|_| LineProblem::Timestamp(raw.timestamp))?;
    if raw.input_length == 0 {
        return Err(LineProblem::EmptyPrompt);
    }
    let expected = content_blocks(raw.input_length);
    if raw.hash_ids.len() != expected {
        return Err(LineProblem::HashIdCount {
            input_length: raw.input_length,
            expected,
            got: raw.hash_ids.len(),
        });
    }
    let segment_tokens = raw.segments.iter().try_fold(0usize, |sum, s| sum.checked_add(s.len));
    if !raw.segments.is_empty() && segment_tokens != Some(raw.input_length) {
        return Err(LineProblem::SegmentTokens { input_length: raw.input_length, segments: segment_tokens });
    }
    Ok(Request {
        arrival,
        input_len: raw.input_length,
        output_len: raw.output_length,
        hash_ids: raw.hash_ids,
        segments: raw.segments,
    })
}

/// Checks that generated requests' hash ids name what their segments do: the ids the
/// generator's [`BlockIds`] gives the segments, read in the file's order, map one to one onto
/// the file's (which live runs, taking tokens from the segments, and the simulator, taking
/// blocks from the ids, rely on).
#[derive(Default)]
struct SegmentIds {
    /// Whether the first line had segments: every line must do as it did.
    with_segments: Option<bool>,
    ids: BlockIds,
    to_file: HashMap<u64, u64>,
    from_file: HashMap<u64, u64>,
}

impl SegmentIds {
    fn check(&mut self, request: &Request) -> Result<(), LineProblem> {
        let with = !request.segments.is_empty();
        if *self.with_segments.get_or_insert(with) != with {
            return Err(LineProblem::MixedSegments { with });
        }
        if !with {
            return Ok(());
        }
        let (named, _) = self.ids.assign(&request.segments);
        for (block, (&ours, &theirs)) in named.iter().zip(&request.hash_ids).enumerate() {
            let same = *self.to_file.entry(ours).or_insert(theirs) == theirs
                && *self.from_file.entry(theirs).or_insert(ours) == ours;
            if !same {
                return Err(LineProblem::SegmentIds { block, hash_id: theirs });
            }
        }
        Ok(())
    }
}

/// Writes `trace` in Mooncake format, one request per line.
pub fn write(trace: &Trace, mut out: impl Write) -> Result<(), TraceError> {
    for r in &trace.requests {
        let line = OutLine {
            timestamp: r.arrival.as_millis(),
            input_length: r.input_len,
            output_length: r.output_len,
            hash_ids: &r.hash_ids,
            segments: &r.segments,
        };
        serde_json::to_writer(&mut out, &line).map_err(|e| TraceError::Write(e.into()))?;
        out.write_all(b"\n").map_err(TraceError::Write)?;
    }
    out.flush().map_err(TraceError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_str(s: &str) -> Result<Trace, TraceError> {
        read(s.as_bytes())
    }

    #[test]
    fn reads_in_the_files_order_and_round_trips() {
        let text = "{\"timestamp\": 20, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n\
                    \n\
                    {\"timestamp\": 10.5, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [1], \"extra\": true}\n";
        let trace = read_str(text).unwrap();
        assert_eq!(trace.len(), 2);
        assert_eq!(trace.requests[0].hash_ids, [1, 2]);
        assert_eq!(trace.requests[1].arrival, Duration::from_micros(10_500));

        let mut whole = trace.clone();
        whole.requests[1].arrival = Duration::from_millis(10);
        let mut buf = Vec::new();
        write(&whole, &mut buf).unwrap();
        assert_eq!(read_str(std::str::from_utf8(&buf).unwrap()).unwrap(), whole);
    }

    /// A generated trace's ids must name what its segments do (live runs take tokens from
    /// the segments, the simulator blocks from the ids); renumbered alike, they still do.
    #[test]
    fn segments_and_hash_ids_must_agree() {
        let line = |segment: u64, ids: &str| {
            format!(
                "{{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": {ids}, \
                 \"segments\": [{{\"id\": {segment}, \"len\": 600}}]}}\n"
            )
        };
        read_str(&(line(3, "[7, 8]") + &line(3, "[7, 8]") + &line(4, "[9, 10]"))).unwrap();
        for (second, block, hash_id) in [(line(3, "[7, 9]"), 1, 9), (line(4, "[7, 10]"), 0, 7)] {
            let err = read_str(&(line(3, "[7, 8]") + &second)).unwrap_err();
            let TraceError::Invalid { line: 2, problem: LineProblem::SegmentIds { block: b, hash_id: h } } =
                err
            else {
                panic!("{err:?}")
            };
            assert_eq!((b, h), (block, hash_id));
        }
        // A line without segments among lines with them (or the other way round) would give
        // an id two contents: a concatenation of a generated trace and a Mooncake one.
        let plain = "{\"timestamp\": 1, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [7, 8]}\n";
        for (text, with) in
            [(line(3, "[7, 8]") + plain, false), (plain.to_owned() + &line(3, "[7, 8]"), true)]
        {
            let err = read_str(&text).unwrap_err();
            assert!(
                matches!(err, TraceError::Invalid { line: 2, problem: LineProblem::MixedSegments { with: w } } if w == with),
                "{err:?}"
            );
        }
    }

    #[test]
    fn bad_lines_are_reported_by_number() {
        let good = "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}";
        let cases = [
            ("not json", 2, "Json"),
            ("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}", 2, "Json"),
            (
                "{\"timestamp\": -1, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}",
                2,
                "Timestamp",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}",
                2,
                "EmptyPrompt",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [1]}",
                2,
                "HashIdCount",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1], \
                 \"segments\": [{\"id\": 3, \"len\": 4}]}",
                2,
                "SegmentTokens",
            ),
        ];
        for (bad, line, kind) in cases {
            let err = read_str(&format!("{good}\n{bad}\n{good}\n")).unwrap_err();
            let (got_line, got_kind) = match &err {
                TraceError::Json { line, .. } => (*line, "Json"),
                TraceError::Invalid { line, problem: LineProblem::Timestamp(_) } => (*line, "Timestamp"),
                TraceError::Invalid { line, problem: LineProblem::EmptyPrompt } => (*line, "EmptyPrompt"),
                TraceError::Invalid { line, problem: LineProblem::HashIdCount { .. } } => {
                    (*line, "HashIdCount")
                }
                TraceError::Invalid { line, problem: LineProblem::SegmentTokens { .. } } => {
                    (*line, "SegmentTokens")
                }
                other => panic!("unexpected error {other:?}"),
            };
            assert_eq!((got_line, got_kind), (line, kind), "for {bad}");
        }
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = read_file(Path::new("/nonexistent/trace.jsonl")).unwrap_err();
        assert!(matches!(err, TraceError::Open { ref path, .. } if path.ends_with("trace.jsonl")));
    }
}
