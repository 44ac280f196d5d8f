//! The bodies of the fuzz targets for what clients send the API (`fuzz/fuzz_targets/`):
//! JSON bodies (chat completions, jobs, bulks, batches with their webhooks and
//! idempotency keys) and multipart uploads. Each runs the handler's own parse and check
//! code, without the database, and panics only when an invariant breaks; `cargo test`
//! replays their seeds (`fuzz/corpus/<target>/`) and random inputs through
//! `tollgate::fuzz_bodies::replay`, as the core crate's are.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::OnceLock;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart};
use axum::http::{HeaderValue, Request, StatusCode};
use chrono::{DateTime, TimeZone, Utc};
use serde_json::Value;
use tollgate::config::{Config, Quotas};
use tollgate::estimate::{self, MAX_CHOICES};
use tollgate::routing;
use tollgate::sanitize::first_nul;
use tollgate::store::StoredFiles;
use tollgate::tenants::{Caller, Tenant};
use tollgate::vocab::ApiErrorCode;
use tollgate::webhook_signing::Secret;

use crate::batches::{Checked, check_create};
use crate::error::ApiError;
use crate::files::{Counter, FileSink, Form, MAX_TEXT_FIELD_BYTES, read_form};
use crate::jobs::{json_body, new_job, submission};
use crate::requests::validate_chat_request;

/// The deployment the bodies are checked against: one OpenAI model behind a route, an
/// Anthropic one, small bulk and body limits so that the fuzzers reach them.
const CONFIG: &str = r#"
[server]
max_body_bytes = 2048
max_bulk_jobs = 6
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://127.0.0.1:1/v1"
keys = [{ name = "k1", value = "sk-1" }]
models = ["gpt-4o-mini", "gpt-4o"]
[[providers]]
name = "ant"
kind = "anthropic"
base_url = "http://127.0.0.1:1"
keys = [{ name = "k1", value = "ak-1" }]
models = ["claude-3-5-haiku-latest"]
[[routes]]
alias = "fast"
targets = ["oai/gpt-4o-mini", "ant/claude-3-5-haiku-latest"]
[[tenants]]
name = "acme"
api_key = "tk-acme"
"#;

fn config() -> &'static Config {
    static CONFIG_PARSED: OnceLock<Config> = OnceLock::new();
    CONFIG_PARSED.get_or_init(|| match Config::parse(CONFIG, "fuzz") {
        Ok(config) => config,
        Err(e) => panic!("the fuzz bodies' config: {e}"),
    })
}

fn tenant() -> Caller {
    Caller::of(Tenant::plain("acme", config()))
}

/// The acceptance time of every job the bodies make.
fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
        .single()
        .unwrap_or_default()
}

/// A refusal is a client error with a reason, never a server error.
fn assert_refusal(e: &ApiError) {
    assert!(
        e.status.is_client_error() && e.status != StatusCode::NOT_FOUND,
        "{e:?}"
    );
    assert!(!e.message.is_empty(), "{e:?}");
    assert_ne!(e.code, ApiErrorCode::InternalError, "{e:?}");
}

/// A `POST /v1/chat/completions` body, read and checked as the handler does before the
/// job is made. Invariants: a refusal is a 4xx with its code (a refused field's names the
/// field); an accepted body holds no NUL, and its reservation is finite and non-negative:
/// input tokens at least the character rule for every model, output tokens the cap per
/// choice times the choices (plus a predicted output's tokens).
pub fn chat_body(data: &[u8]) {
    let request = match json_body(Ok(Bytes::copy_from_slice(data))) {
        Ok(request) => request,
        Err(e) => {
            assert_refusal(&e);
            assert!(
                matches!(e.code, ApiErrorCode::InvalidJson | ApiErrorCode::NulCharacter),
                "{e:?}"
            );
            return;
        }
    };
    assert!(first_nul(&request).is_none(), "a NUL got through");
    match validate_chat_request(&request, "") {
        Ok(model) => reservation(&request, &model),
        Err(e) => {
            assert_refusal(&e);
            assert!(e.param.is_some(), "a refused field is named: {e:?}");
        }
    }
}

/// What the gate reserves for an accepted chat request sent as `model`.
fn reservation(request: &Value, model: &str) {
    assert!(!model.is_empty());
    let cap = estimate::output_cap(request);
    let choices = estimate::choices(request);
    assert!(
        cap >= 1 && (1..=MAX_CHOICES).contains(&choices),
        "cap {cap}, choices {choices}"
    );
    let output = i64::from(estimate::output_tokens(request));
    let plain = cap.saturating_mul(choices).min(i64::from(i32::MAX));
    if request.pointer("/prediction/content").is_some() {
        assert!(output >= plain, "output {output} < {cap} × {choices}");
    } else {
        assert_eq!(output, plain, "output is the cap × the choices");
    }
    let chars = estimate::char_rule(request);
    assert!(chars >= 0);
    let models = ["gpt-4o", "gpt-4o-mini", "claude-3-5-haiku-latest", model];
    let mut most = 0;
    for m in models.iter().map(|m| Some(*m)).chain([None]) {
        let input = estimate::input_tokens(request, m);
        assert!(input >= chars, "{m:?}: {input} below the character rule {chars}");
        most = most.max(input);
    }
    assert_eq!(estimate::route_input_tokens(request, models), most);
}

/// The bodies of `POST /v1/jobs` (with an `Idempotency-Key` header), `POST /v1/jobs/bulk`
/// and `POST /v1/batches` (with a webhook). The first byte picks the endpoint (`% 3`)
/// and whether a header comes first (`/ 3 % 2`: then the bytes up to the first `\n` are
/// the `Idempotency-Key`); the rest is the body. Invariants: every refusal is a 4xx with
/// its code; an accepted job has the limits' values (priority, key, metadata, deadline,
/// a model that resolves) and no NUL; an accepted bulk's items are what each would be if
/// submitted alone, with distinct keys; an accepted batch's window, expiry, class,
/// metadata and webhook secret are within their bounds.
pub fn job_bodies(data: &[u8]) {
    let Some((&knob, rest)) = data.split_first() else {
        return;
    };
    let (header, body) = match (knob / 3 % 2, rest.iter().position(|&b| b == b'\n')) {
        (1, Some(at)) => (HeaderValue::from_bytes(&rest[..at]).ok(), &rest[at + 1..]),
        _ => (None, rest),
    };
    match knob % 3 {
        0 => single_job(body, header.as_ref()),
        1 => bulk(body),
        _ => batch(body),
    }
}

fn single_job(body: &[u8], header: Option<&HeaderValue>) {
    let job = json_body(Ok(Bytes::copy_from_slice(body)))
        .and_then(|value| submission(value, header))
        .and_then(|s| new_job(config(), &tenant(), s, now()));
    match job {
        Err(e) => assert_refusal(&e),
        Ok(job) => {
            assert!((-1000..=1000).contains(&job.priority));
            assert!(
                job.idempotency_key
                    .as_ref()
                    .is_none_or(|k| (1..=255).contains(&k.len()))
            );
            assert!(
                job.metadata
                    .as_ref()
                    .is_none_or(|m| m.is_object() && m.to_string().len() <= 16 * 1024)
            );
            assert!(job.deadline > now() && !job.stream);
            assert!(routing::resolve(config(), &job.model, job.endpoint).is_ok());
            assert!(job.estimated_input_tokens >= 0 && job.estimated_output_tokens >= 1);
            assert!(
                first_nul(&job.request).is_none()
                    && job.metadata.as_ref().is_none_or(|m| first_nul(m).is_none())
            );
        }
    }
}

fn bulk(body: &[u8]) {
    let jobs = match crate::bulk::prepare(config(), &tenant(), body, now()) {
        Ok(prepared) => prepared.jobs,
        Err(e) => {
            assert_refusal(&e);
            return;
        }
    };
    assert!((1..=config().server.max_bulk_jobs).contains(&jobs.len()));
    let mut keys = HashSet::new();
    let items = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|mut v| v.get_mut("jobs").map(Value::take));
    let items = items
        .as_ref()
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    assert_eq!(items.len(), jobs.len(), "an accepted bulk is an object of `jobs`");
    for (job, item) in jobs.iter().zip(items) {
        assert!(
            job.idempotency_key
                .as_ref()
                .is_none_or(|k| keys.insert(k.clone())),
            "a key twice"
        );
        let request: Value = match serde_json::from_str(job.request.get()) {
            Ok(request) => request,
            Err(e) => panic!("a bulk item's request kept as text that is not JSON: {e}"),
        };
        assert!(first_nul(&request).is_none());
        let alone = submission(item.clone(), None).and_then(|s| new_job(config(), &tenant(), s, now()));
        let alone = match alone {
            Ok(alone) => alone,
            Err(e) => panic!("an item of an accepted bulk is refused alone: {e:?}"),
        };
        assert_eq!(alone.request, request);
        assert_eq!(
            (
                &alone.model,
                alone.class,
                alone.priority,
                &alone.idempotency_key,
                alone.deadline
            ),
            (
                &job.model,
                job.class,
                job.priority,
                &job.idempotency_key,
                job.deadline
            )
        );
        assert_eq!(
            (alone.estimated_input_tokens, alone.estimated_output_tokens),
            (job.estimated_input_tokens, job.estimated_output_tokens)
        );
    }
}

fn batch(body: &[u8]) {
    let limits = &config().batches;
    let checked = json_body(Ok(Bytes::copy_from_slice(body))).and_then(|v| check_create(v, limits));
    let Checked {
        req,
        endpoint,
        window,
        output_expires_secs,
        class,
    } = match checked {
        Ok(checked) => checked,
        Err(e) => {
            assert_refusal(&e);
            return;
        }
    };
    assert!(window.as_secs() >= 1 && window.as_secs() <= limits.max_completion_window_secs);
    assert!(
        crate::files::EXPIRES_AFTER_RANGE.contains(&output_expires_secs)
            || output_expires_secs == limits.output_expires_secs as i64
    );
    assert_ne!(class, tollgate::model::JobClass::Interactive);
    assert!(tollgate::vocab::Endpoint::all().contains(&endpoint));
    assert!(req.metadata.as_ref().is_none_or(|m| {
        m.len() <= 16
            && m.iter()
                .all(|(k, v)| k.chars().count() <= 64 && v.chars().count() <= 512)
    }));
    if let Some(hook) = &req.webhook {
        use secrecy::ExposeSecret;
        assert!(Secret::parse(hook.secret.expose_secret()).is_ok());
    }
}

/// The `file` field as a sink sees it.
#[derive(Debug, Default, PartialEq)]
struct Memory {
    filename: Option<String>,
    data: Vec<u8>,
    finished: bool,
}

impl FileSink for Memory {
    fn begin(&mut self, filename: String) {
        assert!(self.filename.is_none(), "a second `file` reached the sink");
        self.filename = Some(filename);
    }

    async fn write(&mut self, data: &[u8]) -> Result<(), ApiError> {
        assert!(self.filename.is_some() && !self.finished);
        self.data.extend_from_slice(data);
        Ok(())
    }

    async fn finish(&mut self) -> Result<(), ApiError> {
        self.finished = true;
        Ok(())
    }
}

/// What the tenant of the fuzzed uploads may keep stored.
const QUOTA_BYTES: u64 = 600;

/// The boundary of the fuzzed multipart bodies.
pub const BOUNDARY: &str = "b0undary";

/// What one read of an upload came to: the form and the file, or the refusal's status.
type Upload = Result<(Form, Memory, (u64, u64)), StatusCode>;

/// Reads `body` as a `POST /v1/files` form arriving in pieces of `piece` bytes, with
/// limits of `max_bytes`, `max_lines` and a tenant that keeps `stored` bytes.
fn read_upload(body: &[u8], piece: usize, max_bytes: u64, max_lines: u64, stored: i64) -> Upload {
    let pieces: Vec<Result<Bytes, Infallible>> = body
        .chunks(piece)
        .map(|p| Ok(Bytes::copy_from_slice(p)))
        .collect();
    let request = Request::builder()
        .method("POST")
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(Body::from_stream(futures::stream::iter(pieces)));
    let Ok(request) = request else {
        panic!("the fuzz request could not be built");
    };
    futures::executor::block_on(async {
        let mut multipart = match Multipart::from_request(request, &()).await {
            Ok(multipart) => multipart,
            Err(e) => panic!("a multipart request was refused before its body: {e:?}"),
        };
        let quotas = Quotas {
            max_files: 10,
            max_stored_file_bytes: QUOTA_BYTES,
        };
        let stored = StoredFiles {
            files: 1,
            bytes: stored,
        };
        let mut counter = Counter::new(max_bytes, max_lines, quotas, stored);
        let mut sink = Memory::default();
        match read_form(&mut multipart, &mut counter, &mut sink).await {
            Ok(form) => Ok((form, sink, counter.counted())),
            Err(e) => {
                assert_refusal(&e);
                Err(e.status)
            }
        }
    })
}

/// A `POST /v1/files` body through the handler's bounded field reading: the first byte
/// sets the piece size the body arrives in and the limits (bytes, lines, what the tenant
/// keeps stored: nothing or 500 of its 600 bytes); the rest is the multipart body (boundary [`BOUNDARY`]). Invariants:
/// refusals are 4xx with a code; a form read has short fields within their bound and an
/// `expires_after` in range; the file reached the sink whole, once, within the byte,
/// line and quota limits, its lines counted right; and the outcome does not depend on
/// how the body was split.
pub fn multipart_upload(data: &[u8]) {
    let Some((&knob, body)) = data.split_first() else {
        return;
    };
    let piece = 1 + usize::from(knob % 16) * 7;
    let max_bytes = 64 << (knob / 16 % 4);
    let max_lines = 1 + u64::from(knob / 64) * 3;
    let stored = 500 * i64::from(knob / 128);
    let read = read_upload(body, piece, max_bytes, max_lines, stored);
    let whole = read_upload(body, body.len().max(1), max_bytes, max_lines, stored);
    match (&read, &whole) {
        (Ok(a), Ok(b)) => assert_eq!(a.1, b.1, "the file depends on how the body was split"),
        (Err(_), Err(_)) => {}
        _ => panic!("split in pieces of {piece}: {read:?}; whole: {whole:?}"),
    }
    let Ok((form, file, (bytes, lines))) = read else {
        return;
    };
    assert!(
        form.purpose
            .as_ref()
            .is_none_or(|p| p.len() <= MAX_TEXT_FIELD_BYTES)
    );
    assert!(
        form.expires_secs
            .is_none_or(|s| crate::files::EXPIRES_AFTER_RANGE.contains(&s))
    );
    assert_eq!(form.file, file.filename.is_some());
    assert_eq!(form.file, file.finished, "a file that began was finished");
    assert!(
        file.filename
            .as_ref()
            .is_none_or(|n| n.chars().count() <= 255 && !n.contains('\0'))
    );
    assert_eq!(bytes, file.data.len() as u64);
    assert!(bytes <= max_bytes && bytes + stored as u64 <= QUOTA_BYTES);
    let non_blank = file
        .data
        .split(|&b| b == b'\n')
        .filter(|l| l.iter().any(|b| !b.is_ascii_whitespace()))
        .count() as u64;
    assert_eq!(lines, non_blank);
    assert!(lines <= max_lines);
}

#[cfg(test)]
mod tests {
    use tollgate::fuzz_bodies::replay;

    use super::*;

    #[test]
    fn fuzz_bodies_chat_body() {
        replay("chat_body", 2000, chat_body);
    }

    #[test]
    fn fuzz_bodies_job_bodies() {
        replay("job_bodies", 2000, job_bodies);
    }

    /// The seeds reach what the bodies check of accepted input, not only refusals.
    #[test]
    fn fuzz_bodies_seeds_are_accepted_where_they_are_meant_to_be() {
        let body =
            |target: &str, name: &str| tollgate::fuzz_bodies::seed(target, name).unwrap()[1..].to_vec();
        let chat: Value = serde_json::from_slice(
            &tollgate::fuzz_bodies::seed("chat_body", "image_tools_prediction").unwrap(),
        )
        .unwrap();
        assert_eq!(validate_chat_request(&chat, "").unwrap(), "fast");
        let single = json_body(Ok(body("job_bodies", "single").into())).and_then(|v| submission(v, None));
        assert!(new_job(config(), &tenant(), single.unwrap(), now()).is_ok());
        assert_eq!(
            crate::bulk::prepare(config(), &tenant(), &body("job_bodies", "bulk"), now())
                .unwrap()
                .jobs
                .len(),
            3
        );
        let batch = check_create(
            json_body(Ok(body("job_bodies", "batch").into())).unwrap(),
            &config().batches,
        );
        assert!(batch.unwrap().req.webhook.is_some());
        let (form, file, (_, lines)) =
            read_upload(&body("multipart_upload", "upload"), 1, 128, 4, 0).unwrap();
        assert_eq!(
            (form.purpose.as_deref(), form.expires_secs, lines),
            (Some("batch"), Some(3600), 2)
        );
        assert_eq!(file.filename.as_deref(), Some("in.jsonl"));
        assert!(read_upload(&body("multipart_upload", "upload_pieces"), 36, 128, 4, 0).is_ok());
        let refused = read_upload(&body("multipart_upload", "too_many_fields"), 8, 128, 4, 0).unwrap_err();
        assert_eq!(refused, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn fuzz_bodies_multipart_upload() {
        replay("multipart_upload", 2000, multipart_upload);
    }
}
