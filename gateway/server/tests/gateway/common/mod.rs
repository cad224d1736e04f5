//! What the security tests share: a throwaway PKI made with rcgen, TLS clients of the real gateway,
//! and a capability service that answers with the `caller` it was sent.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};
use serde_json::{Value, json};
use sluice_proto::convert::{from_proto, to_proto};
use sluice_proto::{
    self as proto, capability_service_server::CapabilityService, gateway_client::GatewayClient,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// A certificate authority that signs server and client certificates.
pub(crate) struct Ca {
    pub(crate) pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its private key, PEM.
pub(crate) struct Leaf {
    pub(crate) cert: String,
    pub(crate) key: String,
}

impl Ca {
    pub(crate) fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    fn leaf(&self, sans: Vec<SanType>, usage: ExtendedKeyUsagePurpose) -> Leaf {
        self.leaf_until(sans, usage, 4096)
    }

    fn leaf_until(&self, sans: Vec<SanType>, usage: ExtendedKeyUsagePurpose, year: i32) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.not_after = rcgen::date_time_ymd(year, 1, 1);
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub(crate) fn server(&self) -> Leaf {
        self.server_until(4096)
    }

    /// A server certificate for `localhost` and 127.0.0.1, valid until January 1st of `year`.
    pub(crate) fn server_until(&self, year: i32) -> Leaf {
        self.leaf_until(
            vec![
                SanType::DnsName("localhost".try_into().unwrap()),
                SanType::IpAddress([127, 0, 0, 1].into()),
            ],
            ExtendedKeyUsagePurpose::ServerAuth,
            year,
        )
    }

    /// A client certificate with one URI SAN (a SPIFFE ID, say).
    pub(crate) fn client_uri(&self, uri: &str) -> Leaf {
        self.leaf(
            vec![SanType::URI(uri.try_into().unwrap())],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// A client certificate with one DNS SAN.
    pub(crate) fn client_dns(&self, dns: &str) -> Leaf {
        self.leaf(
            vec![SanType::DnsName(dns.try_into().unwrap())],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }
}

/// Writes `leaf` as `<name>.crt` and `<name>.key` under `dir`, replacing what was there at once
/// (as cert-manager's Secret volume does: a rename, never a half-written file).
pub(crate) fn install(dir: &Path, name: &str, leaf: &Leaf) {
    for (ext, text) in [("crt", &leaf.cert), ("key", &leaf.key)] {
        let tmp = dir.join(format!(".{name}.{ext}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(format!("{name}.{ext}"))).unwrap();
    }
}

/// A client of the gateway at `port` over TLS, trusting `ca`, presenting `identity` if given.
/// Errors (a refused handshake) come back instead of panicking.
pub(crate) async fn tls_client(
    port: u16,
    ca: &str,
    identity: Option<&Leaf>,
) -> Result<GatewayClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(&id.cert, &id.key));
    }
    let channel = Channel::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(GatewayClient::new(channel))
}

/// A Run request at `input` for `namespace`/bot, with a `caller` key in its context (which must
/// never pass for the caller), and the bearer token if given.
pub(crate) fn run_request(
    namespace: &str,
    token: Option<&str>,
) -> tonic::Request<proto::RunRequest> {
    let mut req = tonic::Request::new(proto::RunRequest {
        namespace: namespace.into(),
        target: "bot".into(),
        trigger_point: "input".into(),
        payload: Some(proto::run_request::Payload::Text("hi".into())),
        context: [
            ("caller".to_string(), "forged".to_string()),
            ("user_id".to_string(), "u-1".to_string()),
        ]
        .into(),
        session_id: String::new(),
    });
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    req
}

/// A capability service that answers every call with the `caller` map it was sent, and keeps them.
#[derive(Clone, Default)]
pub(crate) struct Whoami {
    pub(crate) callers: Arc<Mutex<Vec<HashMap<String, String>>>>,
}

#[tonic::async_trait]
impl CapabilityService for Whoami {
    async fn execute(
        &self,
        request: tonic::Request<proto::ExecuteRequest>,
    ) -> Result<tonic::Response<proto::ExecuteResponse>, tonic::Status> {
        let r = request.into_inner();
        let _ = r.payload.as_ref().map(from_proto);
        self.callers.lock().unwrap().push(r.caller.clone());
        Ok(tonic::Response::new(proto::ExecuteResponse {
            result: Some(to_proto(&json!({"caller": r.caller}))),
            consumed: None,
        }))
    }
}

impl Whoami {
    /// Serves it on a free loopback port; answers its URL.
    pub(crate) async fn serve(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = proto::capability_service_server::CapabilityServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        format!("http://{addr}")
    }
}

/// Chains at `input` for target `bot` in each of `namespaces`: one hook asking `whoami` and
/// answering with the `caller` it got back, as JSON text.
pub(crate) fn chains(namespaces: &[&str], whoami_url: &str) -> String {
    let mut docs = vec![];
    for ns in namespaces {
        docs.push(format!(
            r#"apiVersion: sluice.dev/v1alpha1
kind: Capability
metadata: {{name: whoami, namespace: {ns}}}
spec: {{endpoint: {{grpc: "{whoami_url}"}}}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {{name: who, namespace: {ns}}}
spec:
  target: bot
  triggerPoint: input
  pool: {{warm: 1, max: 2}}
  hooks:
    - name: ask
      action: modify
      capabilities: [whoami]
      code: |
        import json
        def execute(context, settings):
            r = context.host_call("whoami", {{}})
            return {{"action": "modify", "outgoing": json.dumps(r["caller"], sort_keys=True)}}
"#
        ));
    }
    docs.join("---\n")
}

/// The caller map a run's hook got back from `whoami`.
pub(crate) fn caller_of(r: &proto::RunResponse) -> Value {
    match &r.payload {
        Some(proto::run_response::Payload::Text(t)) => serde_json::from_str(t).unwrap(),
        other => panic!("no text payload: {other:?} ({r:?})"),
    }
}
