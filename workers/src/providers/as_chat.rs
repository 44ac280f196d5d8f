//! Jobs of an endpoint their target does not speak, sent to it as chat
//! (`ProviderKind::translates`): Anthropic Messages to every kind but Anthropic
//! ([`super::messages_chat`]), OpenAI Responses to every kind but the OpenAI family
//! ([`super::responses_chat`]). One place says, per endpoint, how the request is refused
//! or translated, and how the chat answer and stream come back in the endpoint's shape.

use serde_json::{Map, Value, json};
use tollgate::config::ProviderKind;
use tollgate::vocab::Endpoint;

use super::{Unexpressed, messages_chat, responses_chat};

/// An endpoint sent as chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsChat {
    Messages,
    Responses,
}

/// Events of the endpoint's stream made from a chat stream's chunks (OpenAI's shape).
pub trait ChunkEvents: Send {
    /// The events one chat chunk makes.
    fn chunk(&mut self, chunk: &Value) -> Vec<Value>;
    /// The events that end the stream, once the chat stream has ended.
    fn end(&mut self) -> Vec<Value>;
}

impl AsChat {
    /// How a request of `endpoint` reaches a target of `kind`: as chat, or (`None`) as it is.
    pub fn of(kind: ProviderKind, endpoint: Endpoint) -> Option<Self> {
        if !kind.translates(endpoint) {
            return None;
        }
        match endpoint {
            Endpoint::Messages => Some(Self::Messages),
            Endpoint::Responses => Some(Self::Responses),
            _ => None,
        }
    }

    /// What of `request` chat cannot express, if anything.
    pub fn unexpressed(self, request: &Value) -> Option<Unexpressed> {
        match self {
            Self::Messages => messages_chat::unexpressed(request),
            Self::Responses => responses_chat::unexpressed(request),
        }
    }

    /// The chat request that asks what `request` asks.
    pub fn chat_request(self, request: &Value) -> Value {
        match self {
            Self::Messages => messages_chat::chat_request(request),
            Self::Responses => responses_chat::chat_request(request),
        }
    }

    /// The endpoint's answer for a chat completion.
    pub fn answer(self, chat: &Value) -> Value {
        match self {
            Self::Messages => messages_chat::message(chat),
            Self::Responses => responses_chat::response(chat),
        }
    }

    /// A fresh translator of a chat stream into the endpoint's events.
    pub fn events(self) -> Box<dyn ChunkEvents> {
        match self {
            Self::Messages => Box::<messages_chat::MessageEvents>::default(),
            Self::Responses => Box::<responses_chat::ResponseEvents>::default(),
        }
    }
}

/// The first top-level field of `request` that is set (not left at what it is when left
/// out: null, false, empty, or one of `default_strings` for its field) and is not one of
/// `translated`: what the translation would drop.
pub(super) fn untranslated_field<'a>(
    request: &'a Value,
    translated: &[&str],
    default_strings: &[(&str, &str)],
) -> Option<&'a str> {
    request.as_object().into_iter().flatten().find_map(|(field, v)| {
        let default = match v {
            Value::Null | Value::Bool(false) => true,
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            Value::String(s) => default_strings.contains(&(field.as_str(), s.as_str())),
            _ => false,
        };
        (!default && !translated.contains(&field.as_str())).then_some(field.as_str())
    })
}

/// `to` with each of `keys` that `from` sets (not null) copied over.
pub(super) fn with_set(mut to: Value, from: &Value, keys: &[&str]) -> Value {
    for key in keys {
        if let Some(v) = from.get(*key).filter(|v| !v.is_null()) {
            to[*key] = v.clone();
        }
    }
    to
}

/// Each `(from, to)` field `request` sets (not null), into `chat` as `to`.
pub(super) fn copy_fields(chat: &mut Map<String, Value>, request: &Value, fields: &[(&str, &str)]) {
    for (from, to) in fields {
        if let Some(v) = request.get(*from).filter(|v| !v.is_null()) {
            chat.insert((*to).into(), v.clone());
        }
    }
}

/// `request`'s `tools` into `chat` as chat function tools, if it has any: each named by
/// its `name`, described and strict as it says, taking its field `parameters`.
pub(super) fn insert_tools(chat: &mut Map<String, Value>, request: &Value, parameters: &str) {
    let tools: Vec<Value> = super::array(request, "tools")
        .iter()
        .map(|t| {
            let function = json!({"name": t.get("name"), "parameters": t.get(parameters)});
            json!({"type": "function", "function": with_set(function, t, &["description", "strict"])})
        })
        .collect();
    if !tools.is_empty() {
        chat.insert("tools".into(), Value::Array(tools));
    }
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::{Value, json};

    use super::ChunkEvents;

    /// What `events` makes of a chat stream of text in two deltas ("Hi", " there"), one
    /// call of `f` with its arguments in two fragments, its finish and the usage (9 in, 4
    /// out).
    pub fn translated(mut events: Box<dyn ChunkEvents>) -> Vec<Value> {
        let chunks = [
            json!({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": " there"}}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1",
                "type": "function", "function": {"name": "f", "arguments": "{\"a\":"}}]}}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                "function": {"arguments": "1}"}}]}}]}),
            json!({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}),
        ];
        let mut all: Vec<Value> = chunks.iter().flat_map(|c| events.chunk(c)).collect();
        all.extend(events.end());
        all
    }

    /// The `type` of each event.
    pub fn types(events: &[Value]) -> Vec<&str> {
        events
            .iter()
            .map(|e| e["type"].as_str().unwrap_or_default())
            .collect()
    }
}
