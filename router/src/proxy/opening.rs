//! [`Opening`]: where a streamed Responses API answer's output begins.
//!
//! vLLM sends a `/v1/responses` stream's `response.created` and `response.in_progress`
//! events before it reads anything from the engine, so they come at once, however long the
//! request then waits in the queue and in prefill; the first event of any other type comes
//! with the first output. Until then the request's prefill is still to do: its pending
//! prefill and credits stay, the wait is the first-byte timeout's, and time to first byte is
//! not yet taken.
//!
//! Events are told apart by their `event:` line, which vLLM (and the replica agent) writes
//! before each event's `data:`. A stream without them (an event whose `data:` comes
//! first) cannot be read this way: its output counts as begun at its first byte, as any other
//! stream's.

/// The event types a Responses stream opens with, before its output.
const OPENING: [&[u8]; 2] = [b"response.created", b"response.in_progress"];

/// The longest event line worth reading whole: `event: response.in_progress\r`.
const LONGEST: usize = 32;

/// Reads a Responses stream's bytes, frame by frame, until its output begins.
#[derive(Debug, Default)]
pub struct Opening {
    /// The current line's first bytes (at most [`LONGEST`]), while they may still matter.
    line: Vec<u8>,
    /// The rest of the current line does not matter (a `data:` line, a comment).
    skipping: bool,
    /// The current event has named its type (an opening one).
    named: bool,
}

impl Opening {
    /// Reads the next bytes of the stream: whether they begin its output (an event of another
    /// type than the opening ones, or one that names no type).
    pub fn output_begins(&mut self, mut data: &[u8]) -> bool {
        while let Some((&byte, rest)) = data.split_first() {
            if self.skipping {
                let Some(end) = memchr::memchr(b'\n', data) else { return false };
                self.skipping = false;
                data = &data[end + 1..];
                continue;
            }
            data = rest;
            if byte == b'\n' {
                if self.line_ended() {
                    return true;
                }
                continue;
            }
            self.line.push(byte);
            if self.line.starts_with(b"data:") {
                if !self.named {
                    return true;
                }
                self.skip_line();
            } else if self.line.starts_with(b"event:") {
                if self.line.len() > LONGEST {
                    return true;
                }
            } else if !(b"data:".starts_with(&self.line)
                || b"event:".starts_with(&self.line)
                || self.line == b"\r")
            {
                // `id:`, `retry:`, a `:` comment: nothing to tell. (A lone `\r` may be a CRLF
                // blank line, which ends the event.)
                self.skip_line();
            }
        }
        false
    }

    fn skip_line(&mut self) {
        self.line.clear();
        self.skipping = true;
    }

    /// The current line ended: whether it began the output.
    fn line_ended(&mut self) -> bool {
        let line = std::mem::take(&mut self.line);
        let line = line.strip_suffix(b"\r").unwrap_or(&line);
        if line.is_empty() {
            // A blank line ends the event.
            self.named = false;
            return false;
        }
        let Some(name) = line.strip_prefix(b"event:") else { return false };
        let name = name.strip_prefix(b" ").unwrap_or(name);
        self.named = true;
        !OPENING.contains(&name)
    }
}

/// Whether the frame a stream's output begins in reports an error, after a success status:
/// vLLM's and SGLang's `data: {"error": ...}`, an `event: error` (Anthropic's Messages, the
/// Responses API) or `event: response.failed`. Such a request stopped before its output, or
/// never ran: its prompt is not known to be cached.
pub fn fails_in_band(data: &[u8]) -> bool {
    data.split(|&b| b == b'\n').any(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(name) = line.strip_prefix(b"event:") {
            let name = name.trim_ascii();
            return name == b"error" || name == b"response.failed";
        }
        line.strip_prefix(b"data:").is_some_and(|json| json.trim_ascii_start().starts_with(b"{\"error\""))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_in_the_stream_are_told_from_output() {
        let errors = [
            "data: {\"error\": {\"message\": \"m\", \"type\": \"BadRequestError\", \"code\": 400}}\n\n",
            "data:{\"error\":{\"message\":\"m\"}}\r\n\r\n",
            "event: error\ndata: {\"type\": \"error\", \"error\": {}}\n\n",
            ERROR,
            "event: response.failed\r\ndata: {}\r\n\r\n",
        ];
        for error in errors {
            assert!(fails_in_band(error.as_bytes()), "{error}");
        }
        let outputs = [
            "data: {\"id\":\"c\",\"choices\":[{\"text\":\"error\"}]}\n\n",
            "event: message_start\ndata: {\"type\":\"message_start\"}\n\n",
            ADDED,
            "{\"error\": \"a JSON answer, not a stream\"}",
        ];
        for output in outputs {
            assert!(!fails_in_band(output.as_bytes()), "{output}");
        }
    }

    const CREATED: &str =
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{}}\n\n";
    const IN_PROGRESS: &str = "event: response.in_progress\ndata: {\"type\":\"response.in_progress\"}\n\n";
    const ADDED: &str =
        "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\"}\n\n";
    const ERROR: &str = "event: error\ndata: {\"type\":\"error\"}\n\n";

    /// Feeds `frames` in order: the index of the frame the output begins in.
    fn begins_at(frames: &[&[u8]]) -> Option<usize> {
        let mut opening = Opening::default();
        frames.iter().position(|frame| opening.output_begins(frame))
    }

    #[test]
    fn the_opening_events_are_not_output() {
        let frames = [CREATED.as_bytes(), IN_PROGRESS.as_bytes(), ADDED.as_bytes()];
        assert_eq!(begins_at(&frames), Some(2));
        assert_eq!(begins_at(&frames[..2]), None);
    }

    #[test]
    fn events_split_anywhere_are_read_alike() {
        let stream = [CREATED, IN_PROGRESS, ERROR].concat().into_bytes();
        let output = CREATED.len() + IN_PROGRESS.len();
        // The output's `event:` line is told at its end.
        let told = output + "event: error\n".len();
        for cut in 1..stream.len() {
            let (a, b) = stream.split_at(cut);
            let expected = if cut >= told { 0 } else { 1 };
            assert_eq!(begins_at(&[a, b]), Some(expected), "cut at {cut}");
        }
        // Byte by byte, too.
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(begins_at(&bytes), Some(told - 1));
    }

    #[test]
    fn one_frame_with_the_opening_and_the_output_begins_it() {
        assert_eq!(begins_at(&[[CREATED, IN_PROGRESS, ADDED].concat().as_bytes()]), Some(0));
    }

    #[test]
    fn crlf_lines_comments_and_ids_are_read() {
        let stream = ": keep-alive\r\n\r\nid: 1\r\nevent: response.created\r\ndata: {}\r\n\r\n\
                      event:response.in_progress\r\ndata: {}\r\n\r\n";
        assert_eq!(begins_at(&[stream.as_bytes()]), None);
        let error = "event: error\r\ndata: {}\r\n\r\n";
        assert_eq!(begins_at(&[stream.as_bytes(), error.as_bytes()]), Some(1));
    }

    #[test]
    fn an_event_without_its_type_line_begins_the_output() {
        // Nothing to tell its type by before its data: it counts, as any stream's first byte.
        let unnamed = "data: {\"type\":\"response.created\"}\n\n";
        assert_eq!(begins_at(&[unnamed.as_bytes()]), Some(0));
        // After a named event too, whose end is a CRLF blank line.
        let named = "event: response.created\r\ndata: {}\r\n\r\n";
        assert_eq!(begins_at(&[named.as_bytes(), b"data: {}\r\n\r\n"]), Some(1));
    }

    #[test]
    fn a_long_event_name_begins_the_output_before_its_line_ends() {
        let long = "event: response.output_text.annotation.added";
        assert_eq!(begins_at(&[CREATED.as_bytes(), long.as_bytes()]), Some(1));
    }
}
