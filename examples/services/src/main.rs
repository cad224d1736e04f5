//! `sluice-example-services`: the fake LLM (gRPC) and the credit ledger (HTTP) behind
//! `examples/capabilities.yaml`. Every user starts with `--balance` credits.

use clap::Parser;
use std::net::SocketAddr;

#[derive(Parser)]
#[command(about = "Example services behind the example Capabilities")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:7001")]
    llm: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:7002")]
    credit: SocketAddr,
    /// Starting balance of the example users (user-1, user-2, user-3).
    #[arg(long, default_value_t = 20)]
    balance: i64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let services = sluice_example_services::Services::start(args.llm, args.credit).await?;
    for user in ["user-1", "user-2", "user-3"] {
        services.credit.set_balance(user, args.balance);
    }
    tracing::info!(llm = %services.llm_addr, credit = %services.credit_addr, "example services listening");
    tokio::signal::ctrl_c().await?;
    services.stop();
    Ok(())
}
