//! AWS's binary event stream (`application/vnd.amazon.eventstream`), the framing of
//! Bedrock's ConverseStream, read into the same [`SseEvent`]s the text streams give: each
//! message's `:event-type` header becomes the event's name and its JSON payload the data.
//! A message of `:message-type` `exception` (or `error`) becomes an event named
//! `exception:<type>` (its `:exception-type` or `:error-code`), which the adapter
//! classifies. The frames (prelude, headers, CRCs) are decoded by
//! `aws-smithy-eventstream`, AWS's own crate.

use std::collections::VecDeque;

use aws_smithy_eventstream::frame::{DecodedFrame, MessageFrameDecoder};
use aws_smithy_types::event_stream::Message;
use bytes::{Buf, BytesMut};

use super::sse::SseEvent;

/// Largest frame buffered, in bytes, as for server-sent events: a provider that sends
/// more without completing a message is broken.
const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

/// The prefix of the name an exception message is read under.
pub const EXCEPTION: &str = "exception:";

/// Incremental reader: bytes in any split, events out.
#[derive(Debug, Default)]
pub struct AwsEventReader {
    buffer: BytesMut,
    decoder: MessageFrameDecoder,
    ready: VecDeque<SseEvent>,
}

impl AwsEventReader {
    /// Feeds bytes; complete messages become events. Errors on a frame that is broken
    /// (a bad CRC or length) or larger than [`MAX_FRAME_BYTES`].
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.buffer.extend_from_slice(bytes);
        loop {
            match self.decoder.decode_frame(&mut self.buffer) {
                Ok(DecodedFrame::Complete(message)) => self.ready.push_back(event(&message)),
                Ok(DecodedFrame::Incomplete) => break,
                Err(e) => return Err(format!("provider sent a broken event-stream frame: {e}")),
            }
        }
        if self.buffer.remaining() > MAX_FRAME_BYTES {
            return Err(format!(
                "provider sent an event-stream frame larger than {MAX_FRAME_BYTES} bytes"
            ));
        }
        Ok(())
    }

    pub fn next_event(&mut self) -> Option<SseEvent> {
        self.ready.pop_front()
    }
}

/// A string header of `message`.
fn header<'a>(message: &'a Message, name: &str) -> Option<&'a str> {
    message
        .headers()
        .iter()
        .find(|h| h.name().as_str() == name)
        .and_then(|h| h.value().as_string().ok())
        .map(|v| v.as_str())
}

fn event(message: &Message) -> SseEvent {
    let name = match header(message, ":message-type") {
        Some("exception" | "error") => {
            let kind = header(message, ":exception-type")
                .or_else(|| header(message, ":error-code"))
                .unwrap_or("unknown");
            format!("{EXCEPTION}{kind}")
        }
        _ => header(message, ":event-type").unwrap_or_default().to_owned(),
    };
    let data = match header(message, ":error-message") {
        Some(text) if message.payload().is_empty() => serde_json::json!({"message": text}).to_string(),
        _ => String::from_utf8_lossy(message.payload()).into_owned(),
    };
    SseEvent {
        event: Some(name),
        data,
    }
}

/// One event message as Bedrock frames it: `:event-type` `name`, a JSON `payload`.
/// For the tests here and the mock's twin.
#[cfg(test)]
pub(crate) fn frame(name: &str, payload: &serde_json::Value) -> Vec<u8> {
    use aws_smithy_types::event_stream::{Header, HeaderValue};
    let message = Message::new(payload.to_string().into_bytes())
        .add_header(Header::new(
            ":event-type",
            HeaderValue::String(name.to_owned().into()),
        ))
        .add_header(Header::new(
            ":content-type",
            HeaderValue::String("application/json".into()),
        ))
        .add_header(Header::new(":message-type", HeaderValue::String("event".into())));
    let mut out = Vec::new();
    match aws_smithy_eventstream::frame::write_message_to(&message, &mut out) {
        Ok(()) => out,
        Err(e) => panic!("a test frame: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn frames_in_any_split_become_named_events() {
        let mut bytes = frame("messageStart", &json!({"role": "assistant"}));
        bytes.extend(frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"text": "hi"}}),
        ));
        for split in [1, 7, bytes.len()] {
            let mut reader = AwsEventReader::default();
            for piece in bytes.chunks(split) {
                reader.push(piece).unwrap();
            }
            let names: Vec<Option<String>> = std::iter::from_fn(|| reader.next_event())
                .map(|e| e.event)
                .collect();
            assert_eq!(
                names,
                [
                    Some("messageStart".to_owned()),
                    Some("contentBlockDelta".to_owned())
                ],
                "split {split}"
            );
        }
        let mut broken = frame("messageStart", &json!({}));
        let last = broken.len() - 1;
        broken[last] ^= 0xff;
        assert!(
            AwsEventReader::default().push(&broken).is_err(),
            "a bad CRC is an error"
        );
    }
}
