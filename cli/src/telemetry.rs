//! What the process tells its operators beyond its API: its log (text for people, or one
//! JSON object per line for a log pipeline; colour only on a terminal) and, when an OTLP
//! endpoint is configured by the standard `OTEL_EXPORTER_OTLP_*` variables, a trace per
//! job (`tollgate::job_trace`).

use std::io::IsTerminal;

use anyhow::bail;
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields`.
    Json,
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (else `default_filter`).
pub fn init_log(format: LogFormat, default_filter: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    let log = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => log.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => log.json().with_ansi(false).init(),
    }
}

/// A variable of the environment, unless unset or empty.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Job traces over OTLP, when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and `OTEL_TRACES_EXPORTER` is not `none`): gRPC
/// when `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`) is
/// `grpc`, else `http/protobuf`; the service is `OTEL_SERVICE_NAME`, else `tollgate`. The
/// provider returned is to be shut down at exit, which sends what is left.
pub fn init_traces() -> anyhow::Result<Option<SdkTracerProvider>> {
    if var("OTEL_TRACES_EXPORTER").as_deref() == Some("none")
        || var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .is_none()
    {
        return Ok(None);
    }
    let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".to_owned());
    let exporter = match protocol.as_str() {
        "grpc" => SpanExporter::builder().with_tonic().build()?,
        "http/protobuf" => SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()?,
        other => bail!("OTEL_EXPORTER_OTLP_PROTOCOL={other}: tollgate sends `grpc` or `http/protobuf`"),
    };
    let mut resource = Resource::builder();
    if var("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("tollgate");
    }
    let processor = BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    tollgate::job_trace::enable();
    tracing::info!(protocol, "job traces go to the OTLP endpoint");
    Ok(Some(provider))
}
