//! W3C trace context on capability requests: the `traceparent` (and `tracestate`) of the span a
//! request is made in goes out with it, as HTTP headers or gRPC metadata, so the application service
//! behind a capability continues the caller's trace. What is written is the globally installed
//! propagator's (the gateway installs W3C trace context when tracing is on); with tracing off the
//! span has no OpenTelemetry context and nothing is added.

use opentelemetry::propagation::Injector;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct Headers<'a>(&'a mut hyper::header::HeaderMap);

impl Injector for Headers<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(key.as_bytes()),
            hyper::header::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct Metadata<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for Metadata<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            value.parse(),
        ) {
            self.0.insert(k, v);
        }
    }
}

fn current() -> opentelemetry::Context {
    tracing::Span::current().context()
}

/// Adds the current span's trace context to an HTTP request's headers.
pub(crate) fn inject_http(headers: &mut hyper::header::HeaderMap) {
    let cx = current();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut Headers(headers))
    });
}

/// Adds the current span's trace context to a gRPC request's metadata.
pub(crate) fn inject_grpc(metadata: &mut tonic::metadata::MetadataMap) {
    let cx = current();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut Metadata(metadata))
    });
}
