//! The gateway process's logs and OpenTelemetry traces. Logs go to stderr (text or JSON, filtered by
//! `RUST_LOG`). Traces are off unless the standard OpenTelemetry environment asks for them
//! (`docs/operations.md`, "Tracing"): then every `tracing` span the engine and the capability runner
//! make (run, claim, hook, host_call, capability_request) is exported over OTLP (gRPC or
//! HTTP/protobuf), under a server span per gRPC request whose parent is the request's W3C
//! `traceparent`. The engine knows nothing of OpenTelemetry; the wiring is all here.

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// How spans are sent to the collector (`OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtlpProtocol {
    Grpc,
    HttpProtobuf,
}

/// Whether and how to export traces, as the OpenTelemetry environment variables say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracingConfig {
    pub protocol: OtlpProtocol,
    /// `OTEL_SERVICE_NAME`, else `sluice-gateway`.
    pub service_name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum TracingError {
    #[error(
        "{var}={value:?} is not a supported OTLP protocol (use grpc or http/protobuf; http/json is not supported)"
    )]
    Protocol { var: &'static str, value: String },
    #[error("{var}={value:?}: only the otlp traces exporter (or none) is supported")]
    Exporter { var: &'static str, value: String },
    #[error("building the OTLP span exporter: {0}")]
    ExporterBuild(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("installing the log subscriber: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

impl TracingConfig {
    /// Reads the environment through `var`. `None`: tracing is off, because nothing configures it
    /// (no `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
    /// `OTEL_TRACES_EXPORTER=otlp`), or `OTEL_SDK_DISABLED=true`, or `OTEL_TRACES_EXPORTER=none`.
    /// The exporter itself reads the endpoint, headers and timeout variables.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, TracingError> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let exporter = set("OTEL_TRACES_EXPORTER");
        match exporter.as_deref().map(str::trim) {
            Some("none") => return Ok(None),
            Some("otlp") | None => {}
            Some(other) => {
                return Err(TracingError::Exporter {
                    var: "OTEL_TRACES_EXPORTER",
                    value: other.to_string(),
                });
            }
        }
        let configured = exporter.is_some()
            || set("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
            || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some();
        if !configured {
            return Ok(None);
        }
        let protocol = match [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]
        .into_iter()
        .find_map(|v| set(v).map(|value| (v, value)))
        {
            // The specification's default.
            None => OtlpProtocol::HttpProtobuf,
            Some((_, value)) if value.trim() == "grpc" => OtlpProtocol::Grpc,
            Some((_, value)) if value.trim() == "http/protobuf" => OtlpProtocol::HttpProtobuf,
            Some((var, value)) => return Err(TracingError::Protocol { var, value }),
        };
        let service_name = set("OTEL_SERVICE_NAME").unwrap_or_else(|| "sluice-gateway".into());
        Ok(Some(Self {
            protocol,
            service_name,
        }))
    }
}

/// Flushes and stops the trace exporter when the process ends.
pub struct TracingGuard {
    provider: Option<SdkTracerProvider>,
}

impl TracingGuard {
    /// Whether spans are being exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans still buffered and stops the exporter.
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        // The SDK's shutdown waits synchronously for the exporter task: kept off the async workers.
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(e)) = done {
            eprintln!("sluice-gateway: flushing traces at shutdown failed: {e}");
        }
    }
}

/// Installs the process's subscriber: logs on stderr (`json` or text, `RUST_LOG`, default info) and,
/// when `tracing` says so, the OTLP span exporter. Must run inside the Tokio runtime.
pub fn init(
    log_format: &str,
    tracing: Option<&TracingConfig>,
) -> Result<TracingGuard, TracingError> {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = if log_format == "json" {
        logs.json().with_filter(filter).boxed()
    } else {
        logs.with_filter(filter).boxed()
    };
    let provider = tracing.map(provider).transpose()?;
    let otel = provider.as_ref().map(|p| {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        // Sluice's own spans (the per-request server span is at debug, out of the text log's way)
        // and its events at info and above as span events. Not the libraries' (h2, hyper, tonic):
        // their spans are noise here, and the exporter's own requests would be traced in a loop.
        let filter = tracing_subscriber::filter::filter_fn(|m| {
            m.target().starts_with("sluice") && (m.is_span() || *m.level() <= tracing::Level::INFO)
        });
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("sluice-gateway"))
            .with_filter(filter)
    });
    tracing_subscriber::registry()
        .with(logs)
        .with(otel)
        .try_init()?;
    if let Some(t) = tracing {
        tracing::info!(protocol = ?t.protocol, service = %t.service_name, "exporting traces over OTLP");
    }
    Ok(TracingGuard { provider })
}

fn provider(config: &TracingConfig) -> Result<SdkTracerProvider, TracingError> {
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = match config.protocol {
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?,
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .build()?,
    };
    // Exports run on the Tokio runtime (the gRPC and HTTP clients need it), batched; the batch
    // settings follow `OTEL_BSP_*`.
    let processor =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .build())
}

/// Reads W3C trace context from a gRPC request's metadata.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The server span of one gRPC request (`sluice.v1.Gateway/Run`, ...): its parent is the
/// request's `traceparent`, when it carries one and tracing is on.
pub(crate) fn request_span(metadata: &tonic::metadata::MetadataMap, method: &str) -> tracing::Span {
    let span = tracing::debug_span!(
        "grpc_request",
        otel.name = method,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.method = method,
    );
    let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Metadata(metadata)));
    // Fails only when no OpenTelemetry layer is installed (tracing off): nothing to link then.
    let _ = span.set_parent(parent);
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(vars: &[(&str, &str)]) -> Result<Option<TracingConfig>, TracingError> {
        TracingConfig::from_env(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn tracing_is_off_unless_the_environment_configures_it() {
        assert_eq!(config(&[]).unwrap(), None);
        assert_eq!(config(&[("OTEL_SERVICE_NAME", "x")]).unwrap(), None);
        assert_eq!(
            config(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]).unwrap(),
            None
        );
        let on = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")];
        assert!(config(&on).unwrap().is_some());
        assert_eq!(
            config(&[on[0], ("OTEL_SDK_DISABLED", "true")]).unwrap(),
            None
        );
        assert_eq!(
            config(&[on[0], ("OTEL_TRACES_EXPORTER", "none")]).unwrap(),
            None
        );
        assert!(
            config(&[("OTEL_TRACES_EXPORTER", "otlp")])
                .unwrap()
                .is_some(),
            "otlp with the default endpoint"
        );
        assert!(
            config(&[(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://c:4318/v1/traces"
            )])
            .unwrap()
            .is_some()
        );
    }

    #[test]
    fn protocol_and_service_name_follow_the_specification() {
        let on = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317");
        let c = config(&[on]).unwrap().unwrap();
        assert_eq!(c.protocol, OtlpProtocol::HttpProtobuf, "the spec's default");
        assert_eq!(c.service_name, "sluice-gateway");
        let c = config(&[
            on,
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "edge-gateway"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(c.protocol, OtlpProtocol::Grpc, "the traces variable wins");
        assert_eq!(c.service_name, "edge-gateway");
    }

    #[test]
    fn unsupported_settings_are_refused_with_the_variable_named() {
        let on = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        let e = config(&[on, ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]).unwrap_err();
        assert!(
            e.to_string().contains("OTEL_EXPORTER_OTLP_PROTOCOL")
                && e.to_string().contains("http/json"),
            "{e}"
        );
        let e = config(&[("OTEL_TRACES_EXPORTER", "zipkin")]).unwrap_err();
        assert!(e.to_string().contains("zipkin"), "{e}");
    }
}
