//! The `text/event-stream` parser every stream shares ([`SseParser`]): bytes in,
//! [`SseEvent`]s out, whatever the provider. What an event means is the adapter's
//! ([`super::streaming::StreamEvents`]).

use std::collections::VecDeque;

/// Largest SSE event (or line) accepted, in bytes; a provider that sends more without an
/// event boundary is broken, and buffering it without bound would be a memory leak.
const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// One server-sent event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
}

/// Incremental `text/event-stream` parser (WHATWG HTML §9.2.6): bytes in any split,
/// lines ended by `\r\n`, `\n` or `\r`, comments (`: keep-alive`) ignored, `data:`
/// lines of one event joined with `\n`, `id:` and `retry:` ignored, a leading BOM
/// dropped. Unlike the spec, at the end of input a last line without its line ending
/// and an event without its blank line are still delivered ([`SseParser::finish`]):
/// a provider that closes right after `data: [DONE]` has still said it.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the line being read.
    line: Vec<u8>,
    /// The last line ended with `\r`: a `\n` right after it belongs to it.
    after_cr: bool,
    /// A line has been completed (the BOM can only precede the first).
    seen_line: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
    ready: VecDeque<SseEvent>,
}

impl SseParser {
    /// Feeds bytes; complete events become available from [`SseParser::next_event`].
    /// Errors when an event grows beyond [`MAX_EVENT_BYTES`].
    pub fn push(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        if self.after_cr && !bytes.is_empty() {
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
            self.after_cr = false;
        }
        while let Some(i) = bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&bytes[..i]);
            let ended_by_cr = bytes[i] == b'\r';
            bytes = &bytes[i + 1..];
            self.take_line();
            if ended_by_cr {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        self.line.extend_from_slice(bytes);
        if self.line.len() + self.data.len() > MAX_EVENT_BYTES {
            return Err(format!(
                "provider sent a stream event larger than {MAX_EVENT_BYTES} bytes"
            ));
        }
        Ok(())
    }

    /// End of input: delivers what is still buffered (see the type's doc).
    pub fn finish(&mut self) {
        if !self.line.is_empty() {
            self.take_line();
        }
        self.dispatch();
    }

    pub fn next_event(&mut self) -> Option<SseEvent> {
        self.ready.pop_front()
    }

    fn take_line(&mut self) {
        let mut raw = std::mem::take(&mut self.line);
        self.on_line(&String::from_utf8_lossy(&raw));
        // Keep the allocation for the next line.
        raw.clear();
        self.line = raw;
    }

    fn on_line(&mut self, mut line: &str) {
        if !self.seen_line {
            self.seen_line = true;
            line = line.strip_prefix('\u{feff}').unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch();
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_owned()),
            _ => {}
        }
    }

    fn dispatch(&mut self) {
        let event = self.event.take();
        if self.has_data {
            self.has_data = false;
            self.ready.push_back(SseEvent {
                event,
                data: std::mem::take(&mut self.data),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // ---- SSE parser ----

    fn parse_in_pieces(input: &[u8], piece: usize) -> Vec<SseEvent> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for chunk in input.chunks(piece.max(1)) {
            p.push(chunk).unwrap();
            out.extend(std::iter::from_fn(|| p.next_event()));
        }
        p.finish();
        out.extend(std::iter::from_fn(|| p.next_event()));
        out
    }

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
        }
    }

    #[test]
    fn sse_lines_split_anywhere() {
        let input = "data: {\"a\":1}\n\nevent: message_start\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        let expected = vec![
            ev(None, "{\"a\":1}"),
            ev(Some("message_start"), "{\"b\":2}"),
            ev(None, "[DONE]"),
        ];
        for piece in 1..=input.len() {
            assert_eq!(
                parse_in_pieces(input.as_bytes(), piece),
                expected,
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn sse_crlf_and_lone_cr() {
        let crlf = "event: ping\r\ndata: x\r\n\r\ndata: y\r\n\r\n";
        let cr = "event: ping\rdata: x\r\rdata: y\r\r";
        let expected = vec![ev(Some("ping"), "x"), ev(None, "y")];
        for input in [crlf, cr] {
            for piece in 1..=input.len() {
                assert_eq!(
                    parse_in_pieces(input.as_bytes(), piece),
                    expected,
                    "{input:?} / {piece}"
                );
            }
        }
    }

    #[test]
    fn sse_comments_multiline_data_and_fields() {
        let input = ": keep-alive\n\n:\ndata: one\ndata:two\ndata\nid: 7\nretry: 10\nfoo: bar\n\n\
                     event: lonely\n\ndata: after\n\n";
        assert_eq!(
            parse_in_pieces(input.as_bytes(), 3),
            // A comment alone is no event; the event type without data is dropped.
            vec![ev(None, "one\ntwo\n"), ev(None, "after")]
        );
        // Only one space after the colon is stripped; a BOM before the first line is dropped.
        let input = "\u{feff}data:  two spaces\n\n";
        assert_eq!(
            parse_in_pieces(input.as_bytes(), 1),
            vec![ev(None, " two spaces")]
        );
        // UTF-8 split between pushes.
        let input = "data: h\u{e9}llo \u{1f600}\n\n";
        assert_eq!(
            parse_in_pieces(input.as_bytes(), 1),
            vec![ev(None, "h\u{e9}llo \u{1f600}")]
        );
    }

    #[test]
    fn sse_end_of_input_delivers_the_rest() {
        assert_eq!(parse_in_pieces(b"data: [DONE]", 4), vec![ev(None, "[DONE]")]);
        assert_eq!(parse_in_pieces(b"data: a\ndata: b\n", 4), vec![ev(None, "a\nb")]);
        assert!(parse_in_pieces(b": only a comment", 4).is_empty());
    }

    #[test]
    fn sse_refuses_unbounded_events() {
        let mut p = SseParser::default();
        let big = vec![b'x'; MAX_EVENT_BYTES / 2 + 1];
        p.push(b"data: ").unwrap();
        p.push(&big).unwrap();
        p.push(b"\ndata: ").unwrap();
        assert!(p.push(&big).is_err());
    }
}
