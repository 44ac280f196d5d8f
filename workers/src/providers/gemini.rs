//! Google Gemini `generateContent`: `POST {base_url}/v1beta/models/{model}:generateContent`
//! with an `x-goog-api-key` header. Requests arrive in OpenAI chat format and are
//! translated (`system` → `systemInstruction`, `assistant` → role `model`, sampling
//! fields → `generationConfig`, whose `maxOutputTokens` is always the cap the gate
//! reserved: `tollgate::estimate::output_cap`; function tools → `functionDeclarations`
//! with their JSON Schema, `tool_choice` → `toolConfig`, an assistant's tool calls →
//! `functionCall` parts, `tool` messages → `functionResponse` parts, `data:` image URLs →
//! `inlineData`, a JSON schema `response_format` → `responseJsonSchema`); the response is
//! translated back (`functionCall` parts → tool calls), usage from `usageMetadata`. Gemini sends no rate-limit headers: its 429 bodies (`QuotaFailure`,
//! `RetryInfo`) are read by `tollgate::ratelimit` and classified by
//! `tollgate::retry::classify_response`. A stream goes to
//! `streamGenerateContent?alt=sse`, whose events are each a partial
//! `GenerateContentResponse`, translated into OpenAI chunks ([`Events`]).

use std::collections::HashMap;

use reqwest::RequestBuilder;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value, json};
use tollgate::config::ProviderConfig;
use tollgate::model::Usage;
use tollgate::vocab::Endpoint;

use super::batch_api::BatchApi;
use super::gemini_batch::GeminiBatch;
use super::openai::{content_text, stop_sequences};
use super::sse::SseEvent;
use super::streaming::{self, ChunkHead, StreamEvents, StreamOut};
use super::{Mode, ProviderApi, Success, Unexpressed, arguments_object, array, data_url, int};
use tollgate::retry::Failure;

/// A Google Gemini API provider.
pub struct Gemini {
    base_url: String,
    batch: GeminiBatch,
}

impl Gemini {
    pub fn from_config(p: &ProviderConfig) -> Self {
        Self {
            base_url: super::base_url(p),
            batch: GeminiBatch::from_config(p),
        }
    }
}

impl ProviderApi for Gemini {
    fn url(&self, model: &str, _endpoint: Endpoint, mode: Mode) -> String {
        format!("{}/v1beta/models/{model}:{}", self.base_url, action(mode))
    }

    fn authorize(&self, request: RequestBuilder, key: &SecretString) -> RequestBuilder {
        request.header("x-goog-api-key", key.expose_secret())
    }

    fn body(&self, _model: &str, _endpoint: Endpoint, request: &Value, _mode: Mode) -> Value {
        translate_request(request)
    }

    fn parse_success(&self, body: &[u8], _endpoint: Endpoint, model: &str) -> Result<Success, String> {
        parse_success(body, model)
    }

    fn stream_events(&self, _endpoint: Endpoint, _model: &str) -> Option<Box<dyn StreamEvents>> {
        Some(Box::new(Events::default()))
    }

    fn unexpressed(&self, _model: &str, request: &Value) -> Option<Unexpressed> {
        unexpressed(request)
    }

    fn batch(&self) -> Option<&dyn BatchApi> {
        Some(&self.batch)
    }
}

/// The method a call of `mode` names after the model: `generateContent`, or
/// `streamGenerateContent` with server-sent events (`alt=sse`; without it Google streams
/// one JSON array).
pub(super) fn action(mode: Mode) -> &'static str {
    match mode {
        Mode::Whole => "generateContent",
        Mode::Stream => "streamGenerateContent?alt=sse",
    }
}

/// Chat fields the translation below does not carry to Gemini.
const UNEXPRESSED_FIELDS: [&str; 6] = [
    "n",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "functions",
    "function_call",
];

/// What of an OpenAI chat request [`translate_request`] cannot carry: the fields above,
/// `parallel_tool_calls: false` (Gemini has no such switch), tools that are not functions,
/// a `response_format` other than text, `json_object` or `json_schema`, tool call
/// arguments that are not a JSON object, a tool result answering no call of the
/// conversation, images not given inline (`data:` URLs), and parts other than text and
/// images.
pub(super) fn unexpressed(request: &Value) -> Option<Unexpressed> {
    if let Some(refused) = super::chat_refusals(request, &UNEXPRESSED_FIELDS, "Gemini") {
        return Some(refused);
    }
    let refuse =
        |param: String, message: &str| Unexpressed::at(param, format!("{message}{}", super::ROUTE_ELSEWHERE));
    if let Some(format) = request.pointer("/response_format/type").and_then(Value::as_str)
        && !matches!(format, "text" | "json_object" | "json_schema")
    {
        return refuse(
            "response_format".to_owned(),
            "tollgate sends Gemini text or JSON output only",
        );
    }
    let calls = call_names(request);
    for (i, m) in array(request, "messages").iter().enumerate() {
        if m.get("role").and_then(Value::as_str) == Some("tool")
            && !m
                .get("tool_call_id")
                .and_then(Value::as_str)
                .is_some_and(|id| calls.contains_key(id))
        {
            return refuse(
                format!("messages[{i}].tool_call_id"),
                "a tool result must answer a tool call of the conversation (Gemini names the function it answers)",
            );
        }
    }
    super::text_and_inline_images(
        request,
        "Gemini",
        |_| true,
        "send the image as a base64 `data:` URL",
    )
}

/// The function name of each tool call of the conversation, by call id.
fn call_names(request: &Value) -> HashMap<&str, &Value> {
    array(request, "messages")
        .iter()
        .flat_map(|m| array(m, "tool_calls"))
        .filter_map(|c| Some((c.get("id")?.as_str()?, c.pointer("/function/name")?)))
        .collect()
}

/// A chat message's content as Gemini parts: text, and `data:` images inline.
fn parts(content: Option<&Value>) -> Vec<Value> {
    let Some(Value::Array(items)) = content else {
        return vec![json!({"text": content_text(content)})];
    };
    items
        .iter()
        .filter_map(|p| match p.get("type").and_then(Value::as_str) {
            Some("image_url") => {
                let url = p.pointer("/image_url/url").and_then(Value::as_str)?;
                let (mime, data) = data_url(url)?;
                Some(json!({"inlineData": {"mimeType": mime, "data": data}}))
            }
            _ => Some(json!({"text": p.get("text").and_then(Value::as_str).unwrap_or_default()})),
        })
        .collect()
}

/// OpenAI chat request → Gemini `GenerateContentRequest` (the model is in the URL).
pub(super) fn translate_request(request: &Value) -> Value {
    let mut system = Vec::new();
    let mut contents: Vec<Value> = Vec::new();
    let names = call_names(request);
    for m in array(request, "messages") {
        match m.get("role").and_then(Value::as_str).unwrap_or("user") {
            "system" | "developer" => system.push(json!({"text": content_text(m.get("content"))})),
            "assistant" => {
                let text = content_text(m.get("content"));
                let calls = array(m, "tool_calls");
                let mut parts: Vec<Value> = Vec::new();
                if !text.is_empty() || calls.is_empty() {
                    parts.push(json!({"text": text}));
                }
                parts.extend(calls.iter().map(|c| {
                    json!({"functionCall": {"id": c.get("id"), "name": c.pointer("/function/name"),
                                            "args": arguments_object(c).unwrap_or_else(|| json!({}))}})
                }));
                contents.push(json!({"role": "model", "parts": parts}));
            }
            "tool" => {
                // The results of one turn's calls go back together, as one user turn.
                let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or_default();
                let answer = json!({"functionResponse": {"id": id, "name": names.get(id),
                    "response": {"result": content_text(m.get("content"))}}});
                let answers_before = contents.last_mut().filter(|c| {
                    c["role"] == "user"
                        && array(c, "parts")
                            .iter()
                            .all(|p| p.get("functionResponse").is_some())
                });
                match answers_before.and_then(|c| c["parts"].as_array_mut()) {
                    Some(parts) => parts.push(answer),
                    None => contents.push(json!({"role": "user", "parts": [answer]})),
                }
            }
            _ => contents.push(json!({"role": "user", "parts": parts(m.get("content"))})),
        }
    }
    let mut config = Map::new();
    config.insert(
        "maxOutputTokens".into(),
        json!(tollgate::estimate::output_cap(request)),
    );
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("seed", "seed"),
        ("presence_penalty", "presencePenalty"),
        ("frequency_penalty", "frequencyPenalty"),
    ] {
        if let Some(v) = request.get(from).filter(|v| v.is_number()) {
            config.insert(to.into(), v.clone());
        }
    }
    if let Some(stop) = stop_sequences(request) {
        config.insert("stopSequences".into(), stop);
    }
    match request.pointer("/response_format/type").and_then(Value::as_str) {
        Some("json_object") => {
            config.insert("responseMimeType".into(), json!("application/json"));
        }
        Some("json_schema") => {
            config.insert("responseMimeType".into(), json!("application/json"));
            config.insert(
                "responseJsonSchema".into(),
                request
                    .pointer("/response_format/json_schema/schema")
                    .cloned()
                    .unwrap_or_else(|| json!({})),
            );
        }
        _ => {}
    }
    let mut out = Map::new();
    out.insert("contents".into(), Value::Array(contents));
    if !system.is_empty() {
        out.insert("systemInstruction".into(), json!({"parts": system}));
    }
    let declarations: Vec<Value> = array(request, "tools")
        .iter()
        .map(|t| {
            let f = t.get("function").unwrap_or(&Value::Null);
            let mut declaration = json!({"name": f.get("name")});
            for (from, to) in [
                ("description", "description"),
                ("parameters", "parametersJsonSchema"),
            ] {
                if let Some(v) = f.get(from).filter(|v| !v.is_null()) {
                    declaration[to] = v.clone();
                }
            }
            declaration
        })
        .collect();
    if !declarations.is_empty() {
        out.insert("tools".into(), json!([{"functionDeclarations": declarations}]));
    }
    if let Some(choice) = request.get("tool_choice").filter(|v| !v.is_null()) {
        let config = match choice.as_str() {
            Some("none") => json!({"mode": "NONE"}),
            Some("required") => json!({"mode": "ANY"}),
            Some(_) => json!({"mode": "AUTO"}),
            None => json!({"mode": "ANY", "allowedFunctionNames": [choice.pointer("/function/name")]}),
        };
        out.insert("toolConfig".into(), json!({"functionCallingConfig": config}));
    }
    out.insert("generationConfig".into(), Value::Object(config));
    Value::Object(out)
}

/// `finishReason` → OpenAI `finish_reason`.
fn finish_reason(reason: Option<&str>) -> &'static str {
    match reason {
        Some("MAX_TOKENS") => "length",
        Some("SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII" | "IMAGE_SAFETY") => {
            "content_filter"
        }
        _ => "stop",
    }
}

/// Gemini `GenerateContentResponse` → OpenAI chat completion. A prompt blocked before
/// generation (no candidates, `promptFeedback.blockReason`) is an empty `content_filter`
/// answer, as OpenAI reports its own refusals.
pub(super) fn parse_success(body: &[u8], model: &str) -> Result<Success, String> {
    let r: Value = serde_json::from_slice(body)
        .map_err(|e| format!("provider answered 2xx with a body that is not JSON: {e}"))?;
    let candidate = r.pointer("/candidates/0");
    let blocked = r.pointer("/promptFeedback/blockReason").is_some();
    if candidate.is_none() && !blocked {
        return Err("provider answered 2xx without `candidates`".to_owned());
    }
    let parts = candidate
        .and_then(|c| c.pointer("/content/parts"))
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let text: String = answer_texts(parts).collect();
    let tool_calls: Vec<Value> = parts
        .iter()
        .filter_map(|p| p.get("functionCall"))
        .enumerate()
        .map(|(i, call)| tool_call(call, i))
        .collect();
    let finish = match candidate {
        None => "content_filter",
        Some(_) if !tool_calls.is_empty() => "tool_calls",
        Some(c) => finish_reason(c.get("finishReason").and_then(Value::as_str)),
    };
    let reported = r.get("usageMetadata").is_some_and(Value::is_object);
    let u = r.get("usageMetadata").cloned().unwrap_or(Value::Null);
    let Usage {
        input_tokens: input,
        output_tokens: output,
        cached_tokens: cached,
    } = usage_of(&u);
    let thoughts = int(&u, &["thoughtsTokenCount"]);
    let usage = reported.then(|| {
        json!({
            "prompt_tokens": input,
            "completion_tokens": output,
            "total_tokens": input + output,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": thoughts},
        })
    });
    let model = r.get("modelVersion").and_then(Value::as_str).unwrap_or(model);
    let body = super::completion(
        r.get("responseId").cloned().unwrap_or(Value::Null),
        Value::String(model.to_owned()),
        text,
        tool_calls,
        finish,
        usage,
    );
    Ok(Success {
        body,
        usage: Usage {
            input_tokens: input,
            output_tokens: output,
            cached_tokens: cached,
        },
    })
}

/// The answer's text of `parts`, without the model's thoughts.
fn answer_texts(parts: &[Value]) -> impl Iterator<Item = &str> {
    parts
        .iter()
        .filter(|p| p.get("thought").and_then(Value::as_bool) != Some(true))
        .filter_map(|p| p.get("text").and_then(Value::as_str))
}

/// A `functionCall` part as the OpenAI tool call number `i` of the answer.
fn tool_call(call: &Value, i: usize) -> Value {
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .map_or_else(|| format!("call_{i}"), str::to_owned);
    let arguments = call.get("args").cloned().unwrap_or_else(|| json!({}));
    json!({"id": id, "type": "function",
           "function": {"name": call.get("name"), "arguments": arguments.to_string()}})
}

/// `usageMetadata` as usage: thinking is billed as output.
fn usage_of(u: &Value) -> Usage {
    Usage {
        input_tokens: int(u, &["promptTokenCount"]),
        output_tokens: int(u, &["candidatesTokenCount"]) + int(u, &["thoughtsTokenCount"]),
        cached_tokens: int(u, &["cachedContentTokenCount"]),
    }
}

/// Translates `streamGenerateContent` events into OpenAI chunks. Each event is a partial
/// `GenerateContentResponse`: the first brings the role chunk, each text part a content
/// chunk, each `functionCall` part a whole tool call; the event whose candidate has a
/// `finishReason` (or a prompt blocked before any candidate) brings the finish chunk, then
/// the usage chunk from its `usageMetadata`, and ends the stream (Google sends no end
/// marker of its own). An event carrying an `error` is the failure, by its `code`.
#[derive(Default)]
pub(super) struct Events {
    head: Option<ChunkHead>,
    tool_calls: usize,
}

impl StreamEvents for Events {
    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure> {
        let v = out.json(&event.data)?;
        if streaming::is_error_event(&event, &v) {
            let status = v
                .pointer("/error/code")
                .and_then(Value::as_u64)
                .and_then(|c| u16::try_from(c).ok())
                .unwrap_or(500);
            return Err(out.error_event(status, &event.data));
        }
        let head = self.head.get_or_insert_with(|| {
            let head = ChunkHead::new(
                v.get("responseId").cloned().unwrap_or(Value::Null),
                v.get("modelVersion").cloned().unwrap_or(Value::Null),
            );
            out.chunk(head.chunk(json!({"role": "assistant", "content": ""}), None));
            head
        });
        if let Some(u) = v.get("usageMetadata").filter(|u| u.is_object()) {
            let usage = usage_of(u);
            out.input(usage.input_tokens, usage.cached_tokens);
            if u.get("candidatesTokenCount").is_some() {
                out.output(usage.output_tokens);
            }
        }
        let candidate = v.pointer("/candidates/0");
        let parts = candidate
            .and_then(|c| c.pointer("/content/parts"))
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for text in answer_texts(parts).filter(|t| !t.is_empty()) {
            out.content(text);
            out.chunk(head.chunk(json!({"content": text}), None));
        }
        for call in parts.iter().filter_map(|p| p.get("functionCall")) {
            let mut call = tool_call(call, self.tool_calls);
            call["index"] = json!(self.tool_calls);
            self.tool_calls += 1;
            out.content(
                call.pointer("/function/arguments")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
            );
            out.chunk(head.chunk(json!({"tool_calls": [call]}), None));
        }
        let finish = match candidate
            .and_then(|c| c.get("finishReason"))
            .and_then(Value::as_str)
        {
            Some(_) if self.tool_calls > 0 => "tool_calls",
            Some(reason) => finish_reason(Some(reason)),
            None if candidate.is_none() && v.pointer("/promptFeedback/blockReason").is_some() => {
                "content_filter"
            }
            None => return Ok(()),
        };
        out.chunk(head.chunk(json!({}), Some(finish)));
        head.finish_with_usage(out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tollgate::retry::FailureClass;

    use crate::providers::streaming::ChatStream;
    use tollgate::vocab::ReasonCode;

    use super::*;

    fn adapter() -> Gemini {
        let config = tollgate::config::Config::parse(
            r#"
            [[providers]]
            name = "g"
            kind = "gemini"
            base_url = "https://generativelanguage.googleapis.com"
            keys = [{ name = "k", value = "x" }]
            models = ["gemini-2.5-flash"]
            [[tenants]]
            name = "t"
            api_key = "tk-test"
            "#,
            "gemini test",
        )
        .unwrap();
        Gemini::from_config(&config.providers[0])
    }

    #[test]
    fn builds_the_request_plain_and_streamed() {
        let r = json!({"model": "fast", "messages": [{"role": "user", "content": "hi"}]});
        let req = adapter()
            .request(
                &reqwest::Client::new(),
                &SecretString::from("g-key"),
                "gemini-2.0-flash",
                Endpoint::ChatCompletions,
                &r,
                Mode::Whole,
            )
            .build()
            .unwrap();
        assert_eq!(
            req.url().as_str(),
            "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.0-flash:generateContent"
        );
        assert_eq!(req.headers()["x-goog-api-key"], "g-key");
        assert!(req.headers().get("authorization").is_none());
        let body: Value = serde_json::from_slice(req.body().unwrap().as_bytes().unwrap()).unwrap();
        assert_eq!(
            body,
            json!({"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                   "generationConfig": {"maxOutputTokens": tollgate::estimate::DEFAULT_OUTPUT_TOKENS}})
        );
        assert_eq!(
            adapter().url("gemini-2.0-flash", Endpoint::ChatCompletions, Mode::Stream),
            "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse"
        );
        assert!(adapter().batch().is_some(), "Gemini Batch Mode");
    }

    /// Google's events as `streamGenerateContent?alt=sse` sends them: text in pieces, a
    /// thought skipped, a function call whole, the finish reason and usage on the last.
    #[tokio::test]
    async fn stream_events_become_openai_chunks() {
        let events = [
            "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"Hel\"}],\"role\":\"model\"},\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":9,\"totalTokenCount\":9},\"modelVersion\":\"gemini-2.0-flash\",\"responseId\":\"r1\"}\r\n\r\n",
            "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"hmm\",\"thought\":true},{\"text\":\"lo\"}],\"role\":\"model\"},\"index\":0}],\"modelVersion\":\"gemini-2.0-flash\",\"responseId\":\"r1\"}\r\n\r\n",
            "data: {\"candidates\":[{\"content\":{\"parts\":[{\"functionCall\":{\"name\":\"f\",\"args\":{\"a\":1}}}],\"role\":\"model\"},\"finishReason\":\"STOP\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":9,\"candidatesTokenCount\":4,\"thoughtsTokenCount\":2,\"totalTokenCount\":15},\"modelVersion\":\"gemini-2.0-flash\",\"responseId\":\"r1\"}\r\n\r\n",
        ];
        let mut stream = ChatStream::canned(Box::new(Events::default()), &events);
        let (chunks, usage_flags) = stream.flagged().await;
        assert!(stream.finished());
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(deltas[0]["role"], "assistant");
        assert_eq!(
            (deltas[1]["content"].as_str(), deltas[2]["content"].as_str()),
            (Some("Hel"), Some("lo"))
        );
        assert_eq!(deltas[3]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(deltas[3]["tool_calls"][0]["function"]["arguments"], "{\"a\":1}");
        assert_eq!(deltas[3]["tool_calls"][0]["index"], 0);
        assert_eq!(chunks[4]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(chunks[5]["usage"]["completion_tokens"], 6);
        assert_eq!(usage_flags, [false, false, false, false, false, true]);
        assert!(
            chunks
                .iter()
                .all(|c| c["id"] == "r1" && c["model"] == "gemini-2.0-flash")
        );
        assert_eq!(
            (stream.usage().input_tokens, stream.usage().output_tokens),
            (9, 6)
        );

        // Cut before a finish reason: a failure, not a stream that ended well.
        let mut cut = ChatStream::canned(Box::new(Events::default()), &events[..1]);
        let (_, failure) = cut.drain().await;
        assert!(failure.is_some());
        // An error event mid-stream fails by its code.
        let error = "data: {\"error\":{\"code\":503,\"message\":\"The model is overloaded.\",\"status\":\"UNAVAILABLE\"}}\n\n";
        let mut failed = ChatStream::canned(Box::new(Events::default()), &[events[0], error]);
        let (_, failure) = failed.drain().await;
        assert_eq!(failure.map(|f| f.class), Some(FailureClass::Overload));
    }

    #[test]
    fn classifies_error_answers() {
        let headers = reqwest::header::HeaderMap::new();
        let quota = br#"{"error":{"code":429,"message":"You exceeded your current quota. Please retry in 36.429760048s.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier","quotaValue":"15"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"36s"}]}}"#;
        let f = adapter().classify_error(429, &headers, quota);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
        assert!(f.retry_after.is_some());
        let bad_key = br#"{"error":{"code":400,"message":"API key not valid. Please pass a valid API key.","status":"INVALID_ARGUMENT","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID","domain":"googleapis.com"}]}}"#;
        let f = adapter().classify_error(400, &headers, bad_key);
        assert_eq!(
            (f.class, f.code),
            (FailureClass::KeyUnusable, ReasonCode::UpstreamAuthFailed)
        );
        let f = adapter().classify_error(
            400,
            &headers,
            br#"{"error":{"code":400,"message":"bad","status":"INVALID_ARGUMENT"}}"#,
        );
        assert_eq!(f.class, FailureClass::Request);
    }

    #[test]
    fn translates_roles_system_and_generation_config() {
        let r = json!({
            "model": "fast",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "yes?"},
                {"role": "user", "content": "go"}
            ],
            "max_completion_tokens": 77, "temperature": 0.2, "top_p": 0.9, "stop": ["END", "STOP"],
            "response_format": {"type": "json_object"}
        });
        let g = translate_request(&r);
        assert_eq!(g["systemInstruction"], json!({"parts": [{"text": "be brief"}]}));
        assert_eq!(
            g["contents"],
            json!([
                {"role": "user", "parts": [{"text": "hi "}, {"text": "there"}]},
                {"role": "model", "parts": [{"text": "yes?"}]},
                {"role": "user", "parts": [{"text": "go"}]}
            ])
        );
        let c = &g["generationConfig"];
        assert_eq!(c["maxOutputTokens"], 77);
        assert_eq!(c["temperature"], 0.2);
        assert_eq!(c["topP"], 0.9);
        assert_eq!(c["stopSequences"], json!(["END", "STOP"]));
        assert_eq!(c["responseMimeType"], "application/json");
        assert!(g.get("model").is_none());
        let bare = translate_request(
            &json!({"messages": [{"role": "user", "content": "x"}], "stop": "Z", "max_tokens": 5}),
        );
        assert!(bare.get("systemInstruction").is_none());
        assert_eq!(
            bare["generationConfig"],
            json!({"maxOutputTokens": 5, "stopSequences": ["Z"]})
        );
        // Not an object at all: an empty request, no panic.
        assert_eq!(
            translate_request(&json!("nope")),
            json!({"contents": [], "generationConfig": {"maxOutputTokens": 1024}})
        );
    }

    #[test]
    fn translates_tools_calls_results_images_and_schemas() {
        let r = json!({
            "model": "fast",
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Oslo and Bergen?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "rain"}
            ]
        });
        assert_eq!(unexpressed(&r), None);
        let g = translate_request(&r);
        assert_eq!(
            g["contents"],
            json!([
                {"role": "user", "parts": [{"text": "Oslo and Bergen?"},
                    {"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]},
                {"role": "model", "parts": [
                    {"functionCall": {"id": "call_1", "name": "get_weather", "args": {"city": "Oslo"}}},
                    {"functionCall": {"id": "call_2", "name": "get_weather", "args": {}}}]},
                {"role": "user", "parts": [
                    {"functionResponse": {"id": "call_1", "name": "get_weather", "response": {"result": "sunny"}}},
                    {"functionResponse": {"id": "call_2", "name": "get_weather", "response": {"result": "rain"}}}]}
            ])
        );
        assert_eq!(
            g["tools"],
            json!([{"functionDeclarations": [{"name": "get_weather", "description": "Weather",
                "parametersJsonSchema": {"type": "object", "properties": {"city": {"type": "string"}}}}]}])
        );
        assert_eq!(
            g["toolConfig"],
            json!({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}})
        );
        assert_eq!(
            g["generationConfig"]["responseJsonSchema"],
            json!({"type": "object"})
        );
        assert_eq!(g["generationConfig"]["responseMimeType"], "application/json");
        for (choice, mode) in [("none", "NONE"), ("auto", "AUTO"), ("required", "ANY")] {
            let g = translate_request(&json!({"messages": [], "tool_choice": choice}));
            assert_eq!(g["toolConfig"]["functionCallingConfig"]["mode"], mode);
        }

        let called = br#"{"candidates":[{"content":{"parts":[{"text":"Checking."},{"functionCall":{"name":"get_weather","args":{"city":"Oslo"}}}],"role":"model"},"finishReason":"STOP"}],
            "usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":4}}"#;
        let s = parse_success(called, "m").unwrap();
        let choice = &s.body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], "Checking.");
        assert_eq!(
            choice["message"]["tool_calls"],
            json!([{"id": "call_0", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}])
        );
    }

    #[test]
    fn what_gemini_cannot_express_is_refused_by_its_field() {
        let param = |extra: Value| {
            let mut r = json!({"messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                r[k] = v.clone();
            }
            unexpressed(&r).map(|u| u.param)
        };
        assert_eq!(
            param(json!({"parallel_tool_calls": false})),
            Some("parallel_tool_calls".into())
        );
        assert_eq!(param(json!({"parallel_tool_calls": true})), None);
        assert_eq!(
            param(json!({"tools": [{"type": "custom", "custom": {"name": "x"}}]})),
            Some("tools[0].type".into())
        );
        let url = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]);
        assert_eq!(
            param(json!({"messages": url})),
            Some("messages[0].content[0].image_url.url".into())
        );
        let stray = json!([{"role": "tool", "tool_call_id": "call_9", "content": "x"}]);
        assert_eq!(
            param(json!({"messages": stray})),
            Some("messages[0].tool_call_id".into())
        );
        let bad = json!([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "[1]"}}]}]);
        assert_eq!(
            param(json!({"messages": bad})),
            Some("messages[0].tool_calls[0].function.arguments".into())
        );
    }

    #[test]
    fn translates_the_response_and_usage() {
        let body = br#"{"candidates":[{"content":{"parts":[{"text":"thinking...","thought":true},{"text":"hello "},{"text":"world"}],"role":"model"},"finishReason":"MAX_TOKENS","index":0}],
            "usageMetadata":{"promptTokenCount":20,"candidatesTokenCount":3,"thoughtsTokenCount":2,"cachedContentTokenCount":8,"totalTokenCount":25},
            "modelVersion":"gemini-2.0-flash-001","responseId":"resp-1"}"#;
        let s = parse_success(body, "gemini-2.0-flash").unwrap();
        assert_eq!(s.body["object"], "chat.completion");
        assert_eq!(s.body["id"], "resp-1");
        assert_eq!(s.body["model"], "gemini-2.0-flash-001");
        assert_eq!(s.body["choices"][0]["message"]["content"], "hello world");
        assert_eq!(s.body["choices"][0]["finish_reason"], "length");
        assert_eq!(
            s.usage,
            Usage {
                input_tokens: 20,
                output_tokens: 5,
                cached_tokens: 8
            }
        );
        assert_eq!(s.body["usage"]["total_tokens"], 25);
        assert_eq!(s.body["usage"]["prompt_tokens_details"]["cached_tokens"], 8);

        for (reason, expected) in [("STOP", "stop"), ("SAFETY", "content_filter"), ("OTHER", "stop")] {
            let body = format!(
                r#"{{"candidates":[{{"content":{{"parts":[{{"text":"x"}}]}},"finishReason":"{reason}"}}],"usageMetadata":{{"promptTokenCount":1}}}}"#
            );
            let s = parse_success(body.as_bytes(), "m").unwrap();
            assert_eq!(s.body["choices"][0]["finish_reason"], expected, "{reason}");
            assert_eq!(s.body["model"], "m");
        }
        let blocked = br#"{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":4,"totalTokenCount":4}}"#;
        let s = parse_success(blocked, "m").unwrap();
        assert_eq!(s.body["choices"][0]["finish_reason"], "content_filter");
        assert_eq!(s.body["choices"][0]["message"]["content"], "");
        assert_eq!(s.usage.input_tokens, 4);
        assert!(parse_success(b"not json", "m").is_err());
        assert!(parse_success(b"{}", "m").is_err());
        assert!(parse_success(br#"{"candidates":"x"}"#, "m").is_err());
    }
}
