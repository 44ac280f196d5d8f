//! AWS Bedrock's Converse API: `POST {base_url}/model/{model}/converse` (and
//! `/converse-stream`), each request signed with SigV4 (service `bedrock`, the provider's
//! `region`) by AWS's own signer, `aws-sigv4`. A key is an access key pair, held as
//! `ACCESS_KEY_ID:SECRET_ACCESS_KEY`, with `:SESSION_TOKEN` for temporary credentials
//! (`tollgate::config::KeyConfig::resolve`; the token goes as `x-amz-security-token`). The model
//! is a model id or an inference profile id (`us.anthropic.claude-3-5-haiku-20241022-v1:0`),
//! percent-encoded as one path segment.
//!
//! Requests arrive in OpenAI chat format and are translated: `system` → `system` blocks,
//! each message's content → content blocks (text, `data:` images as `image` bytes), an
//! assistant's tool calls → `toolUse` blocks, `tool` messages → `toolResult` blocks of a
//! user turn (consecutive turns of one role merged, as Converse requires them to
//! alternate), sampling fields → `inferenceConfig` whose `maxTokens` is always the cap the
//! gate reserved, function tools → `toolConfig`. The answer comes back as a chat
//! completion with its usage (`inputTokens` plus the cache's reads and writes as input).
//!
//! ConverseStream answers in AWS's binary event stream ([`super::aws_events`]):
//! `messageStart`, `contentBlockStart`/`Delta`/`Stop`, `messageStop` and, last, `metadata`
//! with the usage, translated into OpenAI chunks ([`Events`]). Bedrock sends no rate-limit
//! headers: its throttling (`ThrottlingException`, 429) is learned from as any header-less
//! provider's ([`tollgate::vocab::Dialect::None`]); the error type comes in
//! `x-amzn-ErrorType`.

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use reqwest::RequestBuilder;
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderMap};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value, json};
use tollgate::config::ProviderConfig;
use tollgate::model::Usage;
use tollgate::retry::{Failure, FailureClass, classify_response};
use tollgate::vocab::{Endpoint, ReasonCode};

use super::aws_events::EXCEPTION;
use super::openai::{content_text, stop_sequences};
use super::sse::SseEvent;
use super::streaming::{ChunkHead, Framing, StreamEvents, StreamOut};
use super::{Mode, ProviderApi, Success, Unexpressed, arguments_object, array, data_url, int};

/// An AWS Bedrock provider.
pub struct Bedrock {
    base_url: String,
    region: String,
}

impl Bedrock {
    pub fn from_config(p: &ProviderConfig) -> Self {
        Self {
            base_url: super::base_url(p),
            region: p.region.clone().unwrap_or_default(),
        }
    }
}

impl ProviderApi for Bedrock {
    fn url(&self, model: &str, _endpoint: Endpoint, mode: Mode) -> String {
        let operation = match mode {
            Mode::Whole => "converse",
            Mode::Stream => "converse-stream",
        };
        format!("{}/model/{}/{operation}", self.base_url, path_segment(model))
    }

    /// Nothing: the signature covers the body, so [`Bedrock::request`] signs the whole
    /// request.
    fn authorize(&self, request: RequestBuilder, _key: &SecretString) -> RequestBuilder {
        request
    }

    fn body(&self, _model: &str, _endpoint: Endpoint, request: &Value, _mode: Mode) -> Value {
        translate_request(request)
    }

    fn parse_success(&self, body: &[u8], _endpoint: Endpoint, model: &str) -> Result<Success, String> {
        parse_success(body, model)
    }

    fn stream_events(&self, _endpoint: Endpoint, model: &str) -> Option<Box<dyn StreamEvents>> {
        Some(Box::new(Events::new(model)))
    }

    /// By the error type in `x-amzn-ErrorType`: a model not ready yet is an overload, not a
    /// rate limit to learn from; a service quota exceeded (400) is a rate limit; an error
    /// of the model itself (424) is the provider's error. The message is Bedrock's own.
    fn classify_error(&self, status: u16, headers: &HeaderMap, body: &[u8]) -> Failure {
        let mut failure = classify_response(status, headers, body);
        let kind = headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(':').next())
            .unwrap_or_default();
        reclassify(&mut failure, kind, status);
        let message: Option<Value> = serde_json::from_slice(body).ok();
        if let Some(text) = message
            .as_ref()
            .and_then(|m| m.get("message").or_else(|| m.get("Message")))
            .and_then(Value::as_str)
        {
            failure.message = if kind.is_empty() {
                text.to_owned()
            } else {
                format!("{kind}: {text}")
            };
        }
        failure
    }

    fn keeps_header(&self, name: &str) -> bool {
        super::rate_limit_header(name) || name == "x-amzn-errortype"
    }

    fn unexpressed(&self, _model: &str, request: &Value) -> Option<Unexpressed> {
        unexpressed(request)
    }

    /// The request signed: URL, body, then the SigV4 headers over them. A key that is not
    /// an access key pair (a runtime key given wrong) is sent unsigned, and Bedrock's 403
    /// marks it unusable.
    fn request(
        &self,
        http: &reqwest::Client,
        key: &SecretString,
        model: &str,
        endpoint: Endpoint,
        request: &Value,
        mode: Mode,
    ) -> RequestBuilder {
        let url = self.url(model, endpoint, mode);
        let body = self.body(model, endpoint, request, mode).to_string().into_bytes();
        let accept = match mode {
            Mode::Whole => "application/json",
            Mode::Stream => Framing::AwsEventStream.content_type(),
        };
        let mut builder = http
            .post(&url)
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, accept);
        match signature(key, &self.region, &url, &body, SystemTime::now()) {
            Ok(headers) => {
                for (name, value) in headers {
                    builder = builder.header(name, value);
                }
            }
            Err(reason) => tracing::warn!(%reason, "bedrock request sent unsigned"),
        }
        builder.body(body)
    }
}

/// The SigV4 headers (`authorization`, `x-amz-date`, and `x-amz-security-token` for
/// temporary keys) of a POST of `body` to `url` with the content type JSON.
pub fn signature(
    key: &SecretString,
    region: &str,
    url: &str,
    body: &[u8],
    at: SystemTime,
) -> Result<Vec<(String, String)>, String> {
    let mut parts = key.expose_secret().splitn(3, ':');
    let (Some(id), Some(secret)) = (parts.next(), parts.next()) else {
        return Err("the key is not ACCESS_KEY_ID:SECRET_ACCESS_KEY[:SESSION_TOKEN]".to_owned());
    };
    let token = parts.next().map(str::to_owned);
    let identity: Identity = Credentials::new(id, secret, token, None, "tollgate").into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("bedrock")
        .time(at)
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| e.to_string())?
        .into();
    let headers = [("content-type", "application/json")];
    let signable = SignableRequest::new("POST", url, headers.into_iter(), SignableBody::Bytes(body))
        .map_err(|e| e.to_string())?;
    let (instructions, _) = sign(signable, &params).map_err(|e| e.to_string())?.into_parts();
    Ok(instructions
        .headers()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect())
}

/// `failure` (classified by its status) by Bedrock's error type where the two differ.
fn reclassify(failure: &mut Failure, kind: &str, status: u16) {
    let (class, code) = match kind {
        "ModelNotReadyException" => (FailureClass::Overload, ReasonCode::ProviderOverloaded),
        "ServiceQuotaExceededException" => (FailureClass::Capacity, ReasonCode::RateLimited),
        "ModelErrorException" => (FailureClass::Overload, ReasonCode::ProviderError),
        "ModelStreamErrorException" => (FailureClass::Overload, ReasonCode::ProviderError),
        _ => return,
    };
    failure.class = class;
    failure.code = code;
    failure.status = Some(status);
}

/// `model` as one percent-encoded path segment: all but RFC 3986's unreserved characters
/// encoded (`:` of a versioned id becomes `%3A`).
fn path_segment(model: &str) -> String {
    model
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Chat fields Converse has no counterpart for.
const UNEXPRESSED_FIELDS: [&str; 9] = [
    "n",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "functions",
    "function_call",
    "seed",
    "presence_penalty",
    "frequency_penalty",
];

/// The image formats Converse takes, by media type.
fn image_format(media_type: &str) -> Option<&'static str> {
    Some(match media_type {
        "image/png" => "png",
        "image/jpeg" | "image/jpg" => "jpeg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        _ => return None,
    })
}

/// What of a chat request [`translate_request`] cannot carry: the fields above,
/// `parallel_tool_calls: false`, tools that are not functions, a `response_format` other
/// than text, tool call arguments that are not a JSON object, images not inline or of
/// another type than PNG, JPEG, GIF and WebP, and parts other than text and images.
fn unexpressed(request: &Value) -> Option<Unexpressed> {
    if let Some(refused) = super::chat_refusals(request, &UNEXPRESSED_FIELDS, "Bedrock") {
        return Some(refused);
    }
    let refuse =
        |param: String, message: &str| Unexpressed::at(param, format!("{message}{}", super::ROUTE_ELSEWHERE));
    if request
        .pointer("/response_format/type")
        .and_then(Value::as_str)
        .is_some_and(|t| t != "text")
    {
        return refuse(
            "response_format".to_owned(),
            "tollgate sends Bedrock's Converse text output only",
        );
    }
    super::text_and_inline_images(
        request,
        "Bedrock",
        |media| image_format(media).is_some(),
        "a base64 `data:` URL of PNG, JPEG, GIF or WebP",
    )
}

/// A chat message's content as Converse content blocks: text, and `data:` images.
fn blocks(content: Option<&Value>) -> Vec<Value> {
    let Some(Value::Array(parts)) = content else {
        let text = content_text(content);
        return if text.is_empty() {
            Vec::new()
        } else {
            vec![json!({"text": text})]
        };
    };
    parts
        .iter()
        .filter_map(|p| match p.get("type").and_then(Value::as_str) {
            Some("image_url") => {
                let (media, data) = data_url(p.pointer("/image_url/url").and_then(Value::as_str)?)?;
                Some(json!({"image": {"format": image_format(media)?, "source": {"bytes": data}}}))
            }
            _ => Some(json!({"text": p.get("text").and_then(Value::as_str).unwrap_or_default()})),
        })
        .collect()
}

/// Appends `content` as a turn of `role`, merged into the last turn when it is of the
/// same role.
fn push_turn(turns: &mut Vec<Value>, role: &str, content: Vec<Value>) {
    if content.is_empty() {
        return;
    }
    if let Some(last) = turns.last_mut().filter(|t| t["role"] == role)
        && let Some(blocks) = last["content"].as_array_mut()
    {
        blocks.extend(content);
        return;
    }
    turns.push(json!({"role": role, "content": content}));
}

/// OpenAI chat request → Converse request (the model is in the URL).
pub(super) fn translate_request(request: &Value) -> Value {
    let mut system = Vec::new();
    let mut turns: Vec<Value> = Vec::new();
    for m in array(request, "messages") {
        match m.get("role").and_then(Value::as_str).unwrap_or("user") {
            "system" | "developer" => system.push(json!({"text": content_text(m.get("content"))})),
            "assistant" => {
                let mut content = blocks(m.get("content"));
                content.extend(array(m, "tool_calls").iter().map(|c| {
                    json!({"toolUse": {"toolUseId": c.get("id"), "name": c.pointer("/function/name"),
                                       "input": arguments_object(c).unwrap_or_else(|| json!({}))}})
                }));
                push_turn(&mut turns, "assistant", content);
            }
            "tool" => {
                let result = json!({"toolResult": {"toolUseId": m.get("tool_call_id"),
                    "content": [{"text": content_text(m.get("content"))}]}});
                push_turn(&mut turns, "user", vec![result]);
            }
            _ => push_turn(&mut turns, "user", blocks(m.get("content"))),
        }
    }
    let mut config = Map::new();
    config.insert("maxTokens".into(), json!(tollgate::estimate::output_cap(request)));
    for (from, to) in [("temperature", "temperature"), ("top_p", "topP")] {
        if let Some(v) = request.get(from).filter(|v| v.is_number()) {
            config.insert(to.into(), v.clone());
        }
    }
    if let Some(stop) = stop_sequences(request) {
        config.insert("stopSequences".into(), stop);
    }
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(turns));
    if !system.is_empty() {
        out.insert("system".into(), Value::Array(system));
    }
    out.insert("inferenceConfig".into(), Value::Object(config));
    let tools: Vec<Value> = array(request, "tools")
        .iter()
        .map(|t| {
            let f = t.get("function").unwrap_or(&Value::Null);
            let schema = f
                .get("parameters")
                .filter(|p| !p.is_null())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            let mut spec = json!({"name": f.get("name"), "inputSchema": {"json": schema}});
            if let Some(d) = f.get("description").filter(|d| !d.is_null()) {
                spec["description"] = d.clone();
            }
            json!({"toolSpec": spec})
        })
        .collect();
    let choice = request.get("tool_choice").filter(|v| !v.is_null());
    // Converse has no "none": the tools are then not offered, unless the conversation
    // already used them (Converse requires their config then).
    let none = choice.and_then(Value::as_str) == Some("none");
    let used = array(request, "messages")
        .iter()
        .any(|m| !array(m, "tool_calls").is_empty() || m.get("role").and_then(Value::as_str) == Some("tool"));
    if !tools.is_empty() && (!none || used) {
        let mut tool_config = json!({"tools": tools});
        match choice {
            Some(Value::String(c)) if c == "required" => tool_config["toolChoice"] = json!({"any": {}}),
            Some(Value::String(_)) | None => {}
            Some(c) => tool_config["toolChoice"] = json!({"tool": {"name": c.pointer("/function/name")}}),
        }
        out.insert("toolConfig".into(), tool_config);
    }
    Value::Object(out)
}

/// `stopReason` → OpenAI `finish_reason`.
fn finish_reason(reason: Option<&str>) -> &'static str {
    match reason {
        Some("max_tokens" | "model_context_window_exceeded") => "length",
        Some("tool_use") => "tool_calls",
        Some("guardrail_intervened" | "content_filtered") => "content_filter",
        _ => "stop",
    }
}

/// Converse's `usage`: input counts the cache's reads and writes, of them the reads
/// cached.
fn usage_of(u: &Value) -> Usage {
    let cached = int(u, &["cacheReadInputTokens"]);
    Usage {
        input_tokens: int(u, &["inputTokens"]) + cached + int(u, &["cacheWriteInputTokens"]),
        output_tokens: int(u, &["outputTokens"]),
        cached_tokens: cached,
    }
}

/// The OpenAI `usage` of `usage`.
fn openai_usage(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    })
}

/// A fresh id for a translated answer: Converse's carry none (the request id is in a
/// header).
fn completion_id() -> Value {
    Value::String(format!("chatcmpl-bedrock-{}", uuid::Uuid::now_v7().simple()))
}

/// Converse response → OpenAI chat completion.
pub(super) fn parse_success(body: &[u8], model: &str) -> Result<Success, String> {
    let r: Value = serde_json::from_slice(body)
        .map_err(|e| format!("provider answered 2xx with a body that is not JSON: {e}"))?;
    let Some(content) = r.pointer("/output/message/content").and_then(Value::as_array) else {
        return Err("provider answered 2xx without `output.message.content`".to_owned());
    };
    let text: String = content
        .iter()
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    let tool_calls: Vec<Value> = content
        .iter()
        .filter_map(|b| b.get("toolUse"))
        .map(|call| {
            let arguments = call.get("input").cloned().unwrap_or_else(|| json!({}));
            json!({"id": call.get("toolUseId"), "type": "function",
                   "function": {"name": call.get("name"), "arguments": arguments.to_string()}})
        })
        .collect();
    let finish = finish_reason(r.get("stopReason").and_then(Value::as_str));
    let usage = r.get("usage").filter(|u| u.is_object()).map(usage_of);
    let body = super::completion(
        completion_id(),
        Value::String(model.to_owned()),
        text,
        tool_calls,
        finish,
        usage.as_ref().map(openai_usage),
    );
    Ok(Success {
        body,
        usage: usage.unwrap_or_default(),
    })
}

/// The HTTP status an exception of ConverseStream stands for, as Bedrock documents them.
fn exception_status(kind: &str) -> u16 {
    match kind {
        "throttlingException" | "ThrottlingException" => 429,
        "validationException" | "ValidationException" => 400,
        "serviceUnavailableException" | "ServiceUnavailableException" => 503,
        "modelStreamErrorException" | "ModelStreamErrorException" => 424,
        _ => 500,
    }
}

/// Translates ConverseStream's events into OpenAI chunks: `messageStart` → the role chunk,
/// a `toolUse` block's start → a tool call's first delta (id, name), text deltas →
/// content chunks, tool input deltas → that call's argument deltas, `messageStop` → the
/// finish chunk, `metadata` (the last event) → the usage chunk and the end. An exception
/// ends the stream as a failure of the status its type stands for.
pub(super) struct Events {
    head: ChunkHead,
    /// Tool calls started so far: the next one's OpenAI `index`.
    tool_calls: usize,
}

impl Events {
    fn new(model: &str) -> Self {
        Self {
            head: ChunkHead::new(completion_id(), Value::String(model.to_owned())),
            tool_calls: 0,
        }
    }
}

impl StreamEvents for Events {
    fn framing(&self) -> Framing {
        Framing::AwsEventStream
    }

    fn on_event(&mut self, event: SseEvent, out: &mut StreamOut) -> Result<(), Failure> {
        let name = event.event.as_deref().unwrap_or_default();
        if let Some(kind) = name.strip_prefix(EXCEPTION) {
            let mut failure = out.error_event(exception_status(kind), &event.data);
            let message: Option<Value> = serde_json::from_str(&event.data).ok();
            if let Some(text) = message
                .as_ref()
                .and_then(|m| m.get("message"))
                .and_then(Value::as_str)
            {
                failure.message = format!("error event in the stream: {kind}: {text}");
            }
            return Err(failure);
        }
        let v = out.json(&event.data)?;
        match name {
            "messageStart" => {
                out.chunk(self.head.chunk(json!({"role": "assistant", "content": ""}), None));
            }
            "contentBlockStart" => {
                if let Some(tool) = v.pointer("/start/toolUse") {
                    let call = json!({"index": self.tool_calls, "id": tool.get("toolUseId"), "type": "function",
                        "function": {"name": tool.get("name"), "arguments": ""}});
                    self.tool_calls += 1;
                    out.chunk(self.head.chunk(json!({"tool_calls": [call]}), None));
                }
            }
            "contentBlockDelta" => {
                let delta = v.get("delta").unwrap_or(&Value::Null);
                if let Some(text) = delta
                    .get("text")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    out.content(text);
                    out.chunk(self.head.chunk(json!({"content": text}), None));
                }
                if let Some(input) = delta
                    .pointer("/toolUse/input")
                    .and_then(Value::as_str)
                    .filter(|i| !i.is_empty() && self.tool_calls > 0)
                {
                    out.content(input);
                    let call = json!({"index": self.tool_calls - 1, "function": {"arguments": input}});
                    out.chunk(self.head.chunk(json!({"tool_calls": [call]}), None));
                }
            }
            "messageStop" => {
                let finish = finish_reason(v.get("stopReason").and_then(Value::as_str));
                out.chunk(self.head.chunk(json!({}), Some(finish)));
            }
            "metadata" => {
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    let usage = usage_of(u);
                    out.input(usage.input_tokens, usage.cached_tokens);
                    out.output(usage.output_tokens);
                }
                self.head.finish_with_usage(out);
            }
            // contentBlockStop, and reasoning deltas with no OpenAI counterpart.
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use reqwest::header::HeaderValue;
    use serde_json::json;

    use super::*;
    use crate::providers::aws_events::frame;
    use crate::providers::streaming::ChatStream;

    fn adapter() -> Bedrock {
        Bedrock {
            base_url: "https://bedrock-runtime.us-east-1.amazonaws.com".to_owned(),
            region: "us-east-1".to_owned(),
        }
    }

    #[test]
    fn signs_the_request_with_sigv4() {
        let r = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let key = SecretString::from("AKIDEXAMPLE:wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY");
        let model = "us.anthropic.claude-3-5-haiku-20241022-v1:0";
        let req = adapter()
            .request(
                &reqwest::Client::new(),
                &key,
                model,
                Endpoint::ChatCompletions,
                &r,
                Mode::Whole,
            )
            .build()
            .unwrap();
        assert_eq!(
            req.url().as_str(),
            "https://bedrock-runtime.us-east-1.amazonaws.com/model/us.anthropic.claude-3-5-haiku-20241022-v1%3A0/converse"
        );
        let auth = req.headers()["authorization"].to_str().unwrap();
        assert!(
            auth.starts_with("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
                && auth.contains("/us-east-1/bedrock/aws4_request")
                && auth.contains("SignedHeaders=content-type;host;x-amz-date"),
            "{auth}"
        );
        assert!(!auth.contains("wJalr"), "the secret never leaves");
        assert!(req.headers().get("x-amz-date").is_some());
        // The same request signed at the same instant signs the same; another body not.
        let url = req.url().as_str();
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000);
        let one = signature(&key, "us-east-1", url, b"{}", at).unwrap();
        assert_eq!(one, signature(&key, "us-east-1", url, b"{}", at).unwrap());
        assert_ne!(one, signature(&key, "us-east-1", url, b"{ }", at).unwrap());
        assert!(signature(&SecretString::from("no-pair"), "us-east-1", url, b"{}", at).is_err());
        // Temporary credentials: the session token is sent, and signed.
        let temporary = SecretString::from("ASIAEXAMPLE:secret:FwoGZXIvYXdzEXAMPLETOKEN");
        let headers = signature(&temporary, "us-east-1", url, b"{}", at).unwrap();
        let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(header("x-amz-security-token"), Some("FwoGZXIvYXdzEXAMPLETOKEN"));
        assert!(header("authorization").is_some_and(|a| a.contains("x-amz-security-token")));
    }

    #[test]
    fn translates_the_conversation_and_the_answer() {
        let r = json!({
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "rain"},
                {"role": "user", "content": "and so?"}
            ],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
            "tool_choice": "required", "temperature": 0.5, "stop": "END", "max_tokens": 50
        });
        let body = translate_request(&r);
        assert_eq!(body["system"], json!([{"text": "be brief"}]));
        let turns = body["messages"].as_array().unwrap();
        assert_eq!(
            turns.len(),
            3,
            "the tool result and the next question are one user turn: {body}"
        );
        assert_eq!(
            turns[1]["content"][0]["toolUse"]["input"],
            json!({"city": "Oslo"})
        );
        assert_eq!(turns[2]["content"][0]["toolResult"]["toolUseId"], "t1");
        assert_eq!(turns[2]["content"][1]["text"], "and so?");
        assert_eq!(
            body["inferenceConfig"],
            json!({"maxTokens": 50, "temperature": 0.5, "stopSequences": ["END"]})
        );
        assert_eq!(body["toolConfig"]["toolChoice"], json!({"any": {}}));
        assert_eq!(
            body["toolConfig"]["tools"][0]["toolSpec"]["inputSchema"]["json"]["type"],
            "object"
        );

        let answer = br#"{"output":{"message":{"role":"assistant","content":[{"text":"Wet."},{"toolUse":{"toolUseId":"t2","name":"w","input":{"city":"Bergen"}}}]}},"stopReason":"tool_use","usage":{"inputTokens":20,"outputTokens":5,"totalTokens":25,"cacheReadInputTokens":4},"metrics":{"latencyMs":80}}"#;
        let s = parse_success(answer, "m").unwrap();
        assert_eq!(s.body["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(s.body["choices"][0]["message"]["content"], "Wet.");
        assert_eq!(
            s.body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Bergen\"}"
        );
        assert_eq!(
            (s.usage.input_tokens, s.usage.output_tokens, s.usage.cached_tokens),
            (24, 5, 4)
        );
        assert_eq!(s.body["usage"]["total_tokens"], 29);
        assert!(parse_success(br#"{"message":"x"}"#, "m").is_err());

        let refused = unexpressed(&json!({"messages": [], "seed": 3})).unwrap();
        assert_eq!(refused.param, "seed");
        let gif = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]});
        assert_eq!(
            unexpressed(&gif).unwrap().param,
            "messages[0].content[0].image_url.url"
        );
    }

    #[test]
    fn classifies_bedrock_errors_by_their_type() {
        let typed = |kind: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                "x-amzn-errortype",
                HeaderValue::from_str(&format!(
                    "{kind}:http://internal.amazon.com/coral/com.amazon.coral.service/"
                ))
                .unwrap(),
            );
            h
        };
        let throttled = adapter().classify_error(
            429,
            &typed("ThrottlingException"),
            br#"{"message":"Too many requests, please wait before trying again."}"#,
        );
        assert_eq!(
            (throttled.class, throttled.code),
            (FailureClass::Capacity, ReasonCode::RateLimited)
        );
        assert_eq!(
            throttled.message,
            "ThrottlingException: Too many requests, please wait before trying again."
        );
        let not_ready =
            adapter().classify_error(429, &typed("ModelNotReadyException"), br#"{"message":"m"}"#);
        assert_eq!(not_ready.class, FailureClass::Overload);
        let quota = adapter().classify_error(
            400,
            &typed("ServiceQuotaExceededException"),
            br#"{"message":"m"}"#,
        );
        assert_eq!(quota.class, FailureClass::Capacity);
        let signature =
            adapter().classify_error(403, &typed("InvalidSignatureException"), br#"{"message":"m"}"#);
        assert_eq!(signature.class, FailureClass::KeyUnusable);
        let invalid = adapter().classify_error(400, &typed("ValidationException"), br#"{"message":"m"}"#);
        assert_eq!(invalid.class, FailureClass::Request);
    }

    #[tokio::test]
    async fn converse_stream_events_become_openai_chunks() {
        let frames = [
            frame("messageStart", &json!({"role": "assistant", "p": "abc"})),
            frame(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 0, "delta": {"text": "Hi"}}),
            ),
            frame("contentBlockStop", &json!({"contentBlockIndex": 0})),
            frame(
                "contentBlockStart",
                &json!({"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "t9", "name": "w"}}}),
            ),
            frame(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 1, "delta": {"toolUse": {"input": "{\"a\":1}"}}}),
            ),
            frame("messageStop", &json!({"stopReason": "tool_use"})),
            frame(
                "metadata",
                &json!({"usage": {"inputTokens": 11, "outputTokens": 7, "totalTokens": 18}, "metrics": {"latencyMs": 5}}),
            ),
        ];
        let bytes: Vec<u8> = frames.concat();
        // In pieces that split frames anywhere.
        let pieces = bytes.chunks(13).map(Bytes::copy_from_slice).collect();
        let mut stream = ChatStream::over(Box::new(Events::new("m")), pieces);
        let (chunks, usage_flags) = stream.flagged().await;
        assert!(stream.finished());
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(deltas[0]["role"], "assistant");
        assert_eq!(deltas[1]["content"], "Hi");
        assert_eq!(deltas[2]["tool_calls"][0]["id"], "t9");
        assert_eq!(deltas[3]["tool_calls"][0]["function"]["arguments"], "{\"a\":1}");
        assert_eq!(chunks[4]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(chunks[5]["usage"]["prompt_tokens"], 11);
        assert_eq!(usage_flags.iter().filter(|u| **u).count(), 1);
        assert!(chunks.iter().all(|c| c["model"] == "m"));

        // A throttling exception mid-stream is a rate limit.
        let exception = {
            use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
            let m = Message::new(br#"{"message":"slow down"}"#.to_vec())
                .add_header(Header::new(
                    ":message-type",
                    HeaderValue::String("exception".into()),
                ))
                .add_header(Header::new(
                    ":exception-type",
                    HeaderValue::String("throttlingException".into()),
                ));
            let mut out = Vec::new();
            aws_smithy_eventstream::frame::write_message_to(&m, &mut out).unwrap();
            out
        };
        let pieces = vec![Bytes::from(frames[0].clone()), Bytes::from(exception)];
        let mut failed = ChatStream::over(Box::new(Events::new("m")), pieces);
        let (_, failure) = failed.drain().await;
        let failure = failure.unwrap();
        assert_eq!(failure.class, FailureClass::Capacity);
        assert!(failure.message.contains("slow down"), "{}", failure.message);
    }
}
