//! The bodies of the fuzz targets for what providers answer (`fuzz/fuzz_targets/`): chat
//! responses and error answers of every adapter, their event streams, and the results
//! files of their batch APIs. Each runs the adapters' own reading code and panics only
//! when an invariant breaks; `cargo test` replays their seeds (`fuzz/corpus/<target>/`)
//! and random inputs through `tollgate::fuzz_bodies::replay`, as the core crate's are.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Bytes;
use reqwest::header::HeaderMap;
use serde_json::Value;
use tollgate::attempt::MAX_USAGE_TOKENS;
use tollgate::config::Config;
use tollgate::model::Usage;
use tollgate::retry::Failure;
use tollgate::vocab::{Endpoint, ReasonCode};

use crate::providers::batch_api::{LineResult, jsonl};
use crate::providers::sse::{SseEvent, SseParser};
use crate::providers::streaming::ChatStream;
use crate::providers::{ProviderApi, adapter};

/// One provider of each kind.
const CONFIG: &str = r#"
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://127.0.0.1:1/v1"
keys = [{ name = "k", value = "sk-1" }]
models = ["gpt-4o-mini"]
[[providers]]
name = "az"
kind = "azure"
base_url = "http://127.0.0.1:1"
keys = [{ name = "k", value = "az-1" }]
models = ["gpt-4o-deploy"]
[[providers]]
name = "ant"
kind = "anthropic"
base_url = "http://127.0.0.1:1"
keys = [{ name = "k", value = "ak-1" }]
models = ["claude-3-5-haiku-latest"]
[[providers]]
name = "gem"
kind = "gemini"
base_url = "http://127.0.0.1:1"
keys = [{ name = "k", value = "g-1" }]
models = ["gemini-2.0-flash"]
[[tenants]]
name = "t"
api_key = "tk-test"
"#;

/// The adapters, by the byte that picks one; and the model each serves.
fn adapters() -> &'static [(Box<dyn ProviderApi>, String)] {
    static ADAPTERS: OnceLock<Vec<(Box<dyn ProviderApi>, String)>> = OnceLock::new();
    ADAPTERS.get_or_init(|| {
        let config = match Config::parse(CONFIG, "fuzz") {
            Ok(config) => config,
            Err(e) => panic!("the fuzz bodies' config: {e}"),
        };
        config
            .providers
            .iter()
            .map(|p| (adapter(p), p.models[0].clone()))
            .collect()
    })
}

/// A usage an adapter read: each count non-negative and bounded (at most the three
/// fields an adapter adds up, each clamped to [`MAX_USAGE_TOKENS`]).
fn assert_usage(usage: &Usage) {
    for n in [usage.input_tokens, usage.output_tokens, usage.cached_tokens] {
        assert!((0..=3 * MAX_USAGE_TOKENS).contains(&n), "{usage:?}");
    }
}

/// A failure read from a provider's answer: a code, a message, a sane `retry_after`.
fn assert_failure(f: &Failure) {
    assert!(!f.message.is_empty(), "{f:?}");
    let century = Duration::from_secs(100 * 365 * 86_400);
    assert!(f.retry_after.is_none_or(|d| d <= century), "{f:?}");
}

/// A provider's answer to a chat call. The first byte picks the adapter (`% 4`: OpenAI,
/// Azure, Anthropic, Gemini) and the status (`/ 4`: 200, or an error status); the rest is
/// the body. Invariants: a 2xx body is an OpenAI chat completion whose usage is
/// non-negative and bounded (and, where the adapter translated it, the body's `usage`
/// says the same), or a reason it is not; an error body is classified with a message
/// and a `retry_after` under a century.
pub fn provider_responses(data: &[u8]) {
    let Some((&knob, body)) = data.split_first() else {
        return;
    };
    let (api, model) = &adapters()[usize::from(knob % 4)];
    let status = [
        200, 200, 400, 401, 403, 404, 413, 429, 500, 503, 529, 402, 408, 422, 504, 200,
    ][usize::from(knob / 4 % 16)];
    if status != 200 {
        assert_failure(&api.classify_error(status, &HeaderMap::new(), body));
        return;
    }
    let success = match api.parse_success(body, Endpoint::ChatCompletions, model) {
        Ok(success) => success,
        Err(reason) => {
            assert!(!reason.is_empty());
            return;
        }
    };
    assert_usage(&success.usage);
    assert!(success.body.get("choices").is_some(), "{}", success.body);
    if knob % 4 >= 2 {
        // Translated: the body is tollgate's, and says what was read.
        let u = &success.usage;
        match success.body.get("usage") {
            Some(usage) => {
                assert_eq!(usage["prompt_tokens"], u.input_tokens);
                assert_eq!(usage["completion_tokens"], u.output_tokens);
                assert_eq!(usage["total_tokens"], u.input_tokens + u.output_tokens);
            }
            None => assert_eq!(*u, Usage::default()),
        }
    }
}

/// The events of a body read in pieces of `piece` bytes.
fn sse_events(body: &[u8], piece: usize) -> Result<Vec<SseEvent>, String> {
    let mut parser = SseParser::default();
    let mut events = Vec::new();
    for part in body.chunks(piece) {
        parser.push(part)?;
        events.extend(std::iter::from_fn(|| parser.next_event()));
    }
    parser.finish();
    events.extend(std::iter::from_fn(|| parser.next_event()));
    Ok(events)
}

/// What a stream came to: its chunks (as JSON, `created` taken out: it is the clock's),
/// whether each was the usage chunk, the failure it ended in, its usage, whether the
/// provider ended it.
type Streamed = (Vec<(Value, bool)>, Option<(ReasonCode, Option<u16>)>, Usage, bool);

fn stream(which: usize, body: &[u8], piece: usize) -> Streamed {
    let Some(events) = adapters()[which]
        .0
        .stream_events(Endpoint::ChatCompletions, &adapters()[which].1)
    else {
        panic!("adapter {which} does not stream");
    };
    let pieces = body.chunks(piece).map(Bytes::copy_from_slice).collect();
    let mut s = ChatStream::over(events, pieces);
    futures::executor::block_on(async {
        let mut chunks = Vec::new();
        let mut failure = None;
        while let Some(item) = s.next_chunk().await {
            match item {
                Ok(text) => {
                    let mut chunk: Value = match serde_json::from_str(&text) {
                        Ok(chunk) => chunk,
                        Err(e) => panic!("a chunk that is not JSON ({e}): {text}"),
                    };
                    if let Some(obj) = chunk.as_object_mut() {
                        obj.remove("created");
                    }
                    chunks.push((chunk, s.last_was_usage()));
                }
                Err(f) => {
                    assert_failure(&f);
                    assert!(s.next_chunk().await.is_none(), "nothing after a failure");
                    failure = Some((f.code, f.status));
                    break;
                }
            }
        }
        (chunks, failure, s.usage(), s.finished())
    })
}

/// A provider's event stream. The first byte picks the adapter (`% 3`: OpenAI's chunks,
/// Anthropic's events, Gemini's responses) and the size of the pieces it arrives in; the
/// rest is the body.
/// Invariants: the events, and the chunks, failure and usage they become, do not depend
/// on how the body was split; every chunk is JSON; usage is non-negative and bounded; a
/// stream ends either with the provider's end marker or in a failure, never silently;
/// the usage chunk, when there is one, is the last.
pub fn sse_stream(data: &[u8]) {
    let Some((&knob, body)) = data.split_first() else {
        return;
    };
    let piece = 1 + usize::from(knob / 2 % 32) * 3;
    let whole = body.len().max(1);
    assert_eq!(
        sse_events(body, piece),
        sse_events(body, whole),
        "events depend on the split"
    );
    // OpenAI's chunks (also Azure's), Anthropic's events, or Gemini's responses.
    let which = [0, 2, 3][usize::from(knob % 3)];
    let split = stream(which, body, piece);
    assert_eq!(
        split,
        stream(which, body, whole),
        "the stream depends on the split"
    );
    let (chunks, failure, usage, finished) = split;
    assert_usage(&usage);
    assert!(
        finished || failure.is_some(),
        "a stream ended without its end marker and no failure"
    );
    if let Some(at) = chunks.iter().position(|(_, usage)| *usage) {
        assert_eq!(at + 1, chunks.len(), "the usage chunk is the last");
    }
}

/// A results body of a provider's batch API. The first byte picks the adapter (`% 2`:
/// OpenAI, Anthropic) and the endpoint of the batch (`/ 2`); the rest is the body, read by
/// that adapter as a JSONL file and by Gemini's as a responses file or a batch object with
/// inline answers; each of its JSON lines is also read as each one's batch object.
/// Invariants: every result is keyed by an id of the body (OpenAI's and Anthropic's by a
/// `custom_id` of a line); a success has a non-negative, bounded usage and choices; a
/// failure has a batch reason code; reading a batch object never panics, and an ended
/// batch is one whose status says so.
pub fn provider_batch_results(data: &[u8]) {
    let Some((&knob, file)) = data.split_first() else {
        return;
    };
    let gemini = adapters()[3].0.batch();
    let Some((api, gemini)) = adapters()[if knob % 2 == 0 { 0 } else { 2 }]
        .0
        .batch()
        .zip(gemini)
    else {
        panic!("the adapters have no batch API");
    };
    let endpoint = Endpoint::all()[usize::from(knob / 2) % Endpoint::all().len()];
    let mut out = HashMap::new();
    api.parse_results(endpoint, file, &mut out);
    let ids: Vec<String> = jsonl(file)
        .filter_map(|line| line.get("custom_id")?.as_str().map(str::to_owned))
        .collect();
    for (id, result) in &out {
        assert!(ids.contains(id), "{id:?} is not a custom_id of the file");
        assert_line_result(result);
    }
    let mut gemini_out = HashMap::new();
    gemini.parse_results(Endpoint::ChatCompletions, file, &mut gemini_out);
    let mut keys = Vec::new();
    for doc in jsonl(file).chain(serde_json::from_slice::<serde_json::Value>(file).ok()) {
        keys_in(&doc, &mut keys);
    }
    for (key, result) in &gemini_out {
        assert!(keys.contains(key), "{key:?} is not a key of the body");
        assert_line_result(result);
    }
    for line in jsonl(file) {
        for api in [api, gemini] {
            let status = api.parse_status(&line);
            assert!(!status.ended || !status.status.is_empty(), "{status:?}");
            let _ = api.tagged(&line, "pack-1");
        }
    }
}

/// Every string named `key` in `v`, at any depth.
fn keys_in(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (name, value) in map {
                if let (Some(key), "key") = (value.as_str(), name.as_str()) {
                    out.push(key.to_owned());
                }
                keys_in(value, out);
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|i| keys_in(i, out)),
        _ => {}
    }
}

/// What a batch line's result must be: a success with a bounded usage and choices, or a
/// failure with a batch reason code and a message.
fn assert_line_result(result: &LineResult) {
    match result {
        LineResult::Succeeded { success, .. } => {
            assert_usage(&success.usage);
            assert!(success.body.get("choices").is_some());
        }
        LineResult::Failed { code, message } => {
            assert!(
                matches!(
                    code,
                    ReasonCode::ProviderBadResponse
                        | ReasonCode::ProviderBatchErrored
                        | ReasonCode::ProviderBatchExpired
                        | ReasonCode::ProviderBatchCanceled
                ),
                "{code:?}"
            );
            assert!(!message.is_empty() || *code == ReasonCode::ProviderBatchExpired);
        }
    }
}

#[cfg(test)]
mod tests {
    use tollgate::fuzz_bodies::replay;

    use super::*;

    #[test]
    fn fuzz_bodies_provider_responses() {
        replay("provider_responses", 2000, provider_responses);
    }

    /// The seeds reach what the bodies check of accepted input, not only refusals.
    #[test]
    fn fuzz_bodies_seeds_are_read_where_they_are_meant_to_be() {
        let seed = |target: &str, name: &str| tollgate::fuzz_bodies::seed(target, name).unwrap();
        for (name, input) in [("openai", 10), ("anthropic", 20), ("gemini", 8)] {
            let data = seed("provider_responses", name);
            let (api, model) = &adapters()[usize::from(data[0] % 4)];
            assert_eq!(
                api.parse_success(&data[1..], Endpoint::ChatCompletions, model)
                    .unwrap()
                    .usage
                    .input_tokens,
                input,
                "{name}"
            );
        }
        for name in ["openai", "anthropic"] {
            let data = seed("sse_stream", name);
            let (chunks, failure, usage, finished) =
                stream(if data[0] % 2 == 0 { 0 } else { 2 }, &data[1..], 5);
            assert!(finished && failure.is_none() && chunks.len() >= 3, "{name}");
            assert!(usage.output_tokens > 0 && chunks.last().unwrap().1, "{name}");
        }
        for name in ["openai", "anthropic"] {
            let data = seed("provider_batch_results", name);
            let api = adapters()[if data[0] % 2 == 0 { 0 } else { 2 }]
                .0
                .batch()
                .unwrap();
            let mut out = HashMap::new();
            api.parse_results(Endpoint::ChatCompletions, &data[1..], &mut out);
            assert_eq!(out.len(), 4, "{name}");
            assert!(matches!(out["a"], LineResult::Succeeded { .. }), "{name}");
        }
        // Gemini's responses file, and its batch object holding the answers inline.
        let gemini = adapters()[3].0.batch().unwrap();
        for name in ["gemini_file", "gemini_inline"] {
            let data = seed("provider_batch_results", name);
            let mut out = HashMap::new();
            gemini.parse_results(Endpoint::ChatCompletions, &data[1..], &mut out);
            assert_eq!(out.len(), 2, "{name}");
            assert!(matches!(out["a"], LineResult::Succeeded { .. }), "{name}");
        }
    }

    #[test]
    fn fuzz_bodies_sse_stream() {
        replay("sse_stream", 2000, sse_stream);
    }

    #[test]
    fn fuzz_bodies_provider_batch_results() {
        replay("provider_batch_results", 2000, provider_batch_results);
    }
}
