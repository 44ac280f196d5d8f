//! What `tollgate serve` tells its operators: each job's trace received over OTLP
//! (http/protobuf, and gRPC) by a collector of the test's own, its spans in one tree under the
//! client's `traceparent`; and its log as JSON lines, the request log among them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tollgate_mock::MockProvider;

use crate::durability::{Serve, free_port};
use crate::harness::{ACME, config_text, eventually, fresh_db_with, job, mock_config, serve_connections};

/// The spans a collector was sent, each export checked to come from the service
/// `tollgate`.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Span>>>);

impl Received {
    fn keep(&self, request: ExportTraceServiceRequest) {
        let mut kept = self.0.lock().unwrap();
        for resource in request.resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.clone());
            assert_eq!(
                service.and_then(|v| v.value),
                Some(AnyValue::StringValue("tollgate".into()))
            );
            kept.extend(resource.scope_spans.into_iter().flat_map(|s| s.spans));
        }
    }
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP collector speaking `protocol` (`http/protobuf` or `grpc`) on a port of its
/// own, served by `tasks` until `stop`: what it receives, and its address.
async fn collector(
    protocol: &str,
    tasks: &TaskTracker,
    stop: CancellationToken,
) -> (Received, std::net::SocketAddr) {
    let received = Received::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    if protocol == "grpc" {
        let service = TraceServiceServer::new(received.clone());
        tasks.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    stop.cancelled_owned(),
                )
                .await
                .unwrap()
        });
        return (received, addr);
    }
    let kept = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let kept = kept.clone();
            async move {
                kept.keep(ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export"));
                ExportTraceServiceResponse::default().encode_to_vec()
            }
        }),
    );
    tasks.spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
            .unwrap()
    });
    (received, addr)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The value of `span`'s attribute `key`, as text.
fn attribute(span: &Span, key: &str) -> Option<String> {
    let value = span
        .attributes
        .iter()
        .find(|a| a.key == key)?
        .value
        .clone()?
        .value?;
    Some(match value {
        AnyValue::StringValue(s) => s,
        AnyValue::IntValue(i) => i.to_string(),
        AnyValue::DoubleValue(d) => d.to_string(),
        AnyValue::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

#[tokio::test]
async fn a_job_s_trace_continues_its_client_s_and_the_log_is_json_lines() {
    traced_serve("http/protobuf").await;
}

#[tokio::test]
async fn a_job_s_trace_goes_over_grpc_too() {
    traced_serve("grpc").await;
}

/// Runs `tollgate serve` sending traces over `protocol` and logging JSON, two jobs through
/// it, and checks what the collector received and what the log holds.
async fn traced_serve(protocol: &str) {
    let db = fresh_db_with(serve_connections()).await;
    let mock = MockProvider::new(mock_config()).start_local().await.unwrap();
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let (received, otlp) = collector(protocol, &tasks, stop.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tollgate.toml");
    std::fs::write(&config, config_text(mock.addr, "")).unwrap();
    let log = dir.path().join("stderr.log");
    let port = free_port();
    let api = format!("http://127.0.0.1:{port}");
    let stderr = std::fs::File::create(&log).unwrap();
    let mut serve = Serve::start_with(&config, &db.url, port, |c| {
        c.args(["--log-format", "json"])
            .env("RUST_LOG", "info,sqlx=warn")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{otlp}"))
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .stderr(stderr);
    });
    serve.wait_ready(&api).await;

    // One job under the client's trace, one on its own.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for parent in [Some(format!("00-{client_trace}-{client_span}-01")), None] {
        let mut request = http
            .post(format!("{api}/v1/jobs"))
            .bearer_auth(ACME)
            .json(&job("fast", "traced"));
        if let Some(parent) = parent {
            request = request.header("traceparent", parent);
        }
        let accepted: Value = request.send().await.unwrap().json().await.unwrap();
        ids.push(accepted["id"].as_str().unwrap().to_owned());
    }
    let mut trace_ids = Vec::new();
    for id in &ids {
        let done = crate::harness::wait_finished_at(&http, &api, ACME, id, 30).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        trace_ids.push(done["trace_id"].as_str().unwrap().to_owned());
    }
    assert_eq!(trace_ids[0], client_trace, "the job's trace is its client's");
    assert_ne!(trace_ids[1], client_trace);

    // Each job's trace: job.submit under the client's span (or a root), job.queued and
    // job.attempt under job.submit.
    for (id, trace) in ids.iter().zip(&trace_ids) {
        let tree = eventually(20, "the job's three spans at the collector", || async {
            let spans = received.0.lock().unwrap();
            let of_job: Vec<Span> = spans
                .iter()
                .filter(|s| hex(&s.trace_id) == *trace)
                .cloned()
                .collect();
            let named = |name: &str| of_job.iter().find(|s| s.name == name).cloned();
            Some((named("job.submit")?, named("job.queued")?, named("job.attempt")?))
        })
        .await;
        let (submit, queued, attempt) = tree;
        let expected_parent = if *trace == client_trace {
            client_span.to_owned()
        } else {
            String::new()
        };
        assert_eq!(
            hex(&submit.parent_span_id),
            expected_parent,
            "job.submit's parent"
        );
        assert_eq!(
            attribute(&submit, "tollgate.job.id").as_deref(),
            Some(id.as_str())
        );
        assert_eq!(attribute(&submit, "tollgate.tenant").as_deref(), Some("acme"));
        for child in [&queued, &attempt] {
            assert_eq!(
                hex(&child.parent_span_id),
                hex(&submit.span_id),
                "{} under job.submit",
                child.name
            );
        }
        assert!(
            queued.end_time_unix_nano <= attempt.start_time_unix_nano,
            "admitted before its call"
        );
        assert!(attempt.start_time_unix_nano < attempt.end_time_unix_nano);
        assert_eq!(
            attribute(&attempt, "tollgate.job.state").as_deref(),
            Some("succeeded")
        );
        assert_eq!(
            attribute(&attempt, "http.response.status_code").as_deref(),
            Some("200")
        );
        assert_eq!(attribute(&attempt, "tollgate.provider").as_deref(), Some("oai"));
    }

    // Stopped, every line it logged is a JSON object; the request log has the submissions.
    serve.signal(nix::sys::signal::Signal::SIGTERM);
    let stopped = tokio::task::spawn_blocking(move || serve.child.wait().unwrap());
    tokio::time::timeout(Duration::from_secs(30), stopped)
        .await
        .expect("serve stops on SIGTERM")
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l:?}")))
        .collect();
    assert!(
        lines
            .iter()
            .all(|l| l["level"].is_string() && l["timestamp"].is_string())
    );
    let submissions: Vec<&Value> = lines
        .iter()
        .filter(|l| l["target"] == "tollgate::request" && l["fields"]["route"] == "/v1/jobs")
        .map(|l| &l["fields"])
        .collect();
    assert_eq!(submissions.len(), 2, "{text}");
    for s in submissions {
        assert_eq!(
            (&s["method"], &s["status"], &s["tenant"]),
            (&Value::from("POST"), &Value::from(202), &Value::from("acme"))
        );
        assert!(s["latency_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{s}");
    }
    let polls = lines
        .iter()
        .filter(|l| l["target"] == "tollgate::request" && l["fields"]["route"] == "/v1/jobs/{id}")
        .count();
    assert!(
        polls >= 2,
        "the reads are logged with their route, not their path: {text}"
    );
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}
