//! `sluice-example-services`: the fake LLM (gRPC) and the credit ledger (HTTP) behind
//! `examples/capabilities.yaml`, the OpenAI-compatible fake LLM behind the gateway's OpenAI proxy,
//! and the MCP server behind its MCP proxy. Every user starts with `--balance` credits.

use anyhow::Context as _;
use clap::Parser;
use sluice_example_services::{Guard, ServerTls};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Example services behind the example Capabilities")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:7001")]
    llm: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:7002")]
    credit: SocketAddr,
    /// The OpenAI-compatible fake LLM (`POST /v1/chat/completions`), the proxy's upstream.
    #[arg(long, default_value = "127.0.0.1:7003")]
    openai: SocketAddr,
    /// The MCP server with the support bot's tools (`POST /mcp`), the MCP proxy's upstream.
    #[arg(long, default_value = "127.0.0.1:7004")]
    mcp: SocketAddr,
    /// Starting balance of the example users (user-1, user-2, user-3).
    #[arg(long, default_value_t = 20)]
    balance: i64,
    /// Refuse calls without this bearer token (a file holding it, as the gateway's credential
    /// set's `token`).
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Serve TLS with this PEM certificate chain (with --tls-key and --client-ca).
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "client_ca"])]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Refuse callers without a client certificate signed by this PEM CA (the gateway's).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    client_ca: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let read =
        |path: &PathBuf| std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    let guard = Guard {
        token: match &args.token_file {
            Some(f) => Some(String::from_utf8(read(f)?)?.trim().to_string()),
            None => None,
        },
        tls: match (&args.tls_cert, &args.tls_key, &args.client_ca) {
            (Some(cert), Some(key), Some(ca)) => Some(ServerTls {
                cert: read(cert)?,
                key: read(key)?,
                client_ca: read(ca)?,
            }),
            _ => None,
        },
    };
    let services =
        sluice_example_services::Services::start_guarded(args.llm, args.credit, guard).await?;
    for user in ["user-1", "user-2", "user-3"] {
        services.credit.set_balance(user, args.balance);
    }
    let openai = sluice_example_services::FakeOpenAi::start(args.openai)
        .await
        .with_context(|| format!("binding {}", args.openai))?;
    let mcp = sluice_example_services::FakeMcp::start(args.mcp)
        .await
        .with_context(|| format!("binding {}", args.mcp))?;
    tracing::info!(llm = %services.llm_addr, credit = %services.credit_addr, openai = %openai.addr, mcp = %mcp.addr, "example services listening");
    tokio::signal::ctrl_c().await?;
    services.stop();
    openai.stop();
    mcp.stop();
    Ok(())
}
