//! `sluice-agent-loop`: runs one scripted conversation against a running gateway (`make run`) and
//! prints what happened at every trigger point.
//!
//! ```sh
//! cargo run -q -p sluice-agent-loop -- --target agent-read-only --scenario edit
//! cargo run -q -p sluice-agent-loop -- --target agent-turn-limit --scenario endless
//! ```

use clap::{Parser, ValueEnum};
use serde_json::json;
use sluice_agent_loop::hooks::Hooks;
use sluice_agent_loop::model::{ScriptedModel, Usage};
use sluice_agent_loop::tools::FakeTools;
use sluice_agent_loop::{Agent, AgentConfig, Event};
use sluice_proto::client::ClientAuth;

#[derive(Clone, Copy, ValueEnum)]
enum Scenario {
    /// Reads a file, writes a fix, answers.
    Edit,
    /// Keeps reading files and never answers: only a policy stops it.
    Endless,
    /// Reads outside the project root, then answers.
    Escape,
}

#[derive(Parser)]
#[command(
    name = "sluice-agent-loop",
    about = "Reference agent loop around the Sluice gateway"
)]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    gateway: String,
    #[arg(long, default_value = "default")]
    namespace: String,
    #[arg(long, default_value = "agent-read-only")]
    target: String,
    #[arg(long, value_enum, default_value = "edit")]
    scenario: Scenario,
    /// Passed in the caller context (the credit gate of llm.run charges it).
    #[arg(long, default_value = "user-1")]
    user_id: String,
    /// The model name the loop asks for (the policies' pricing and context windows key on it).
    #[arg(long, default_value = "fake-model")]
    model: String,
    /// How to reach a secured gateway (the same options as `sluice call`).
    #[command(flatten)]
    auth: ClientAuth,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut hooks = Hooks::connect_with(
        &args.gateway,
        &args.auth,
        &args.namespace,
        &args.target,
        "demo-1",
    )
    .await?;
    hooks.context.insert("user_id".into(), args.user_id);
    let usage = Usage::new(1200, 80);
    let model = match args.scenario {
        Scenario::Edit => ScriptedModel::new(vec![
            ScriptedModel::calls("c1", "read_file", json!({"path": "src/lib.rs"}), usage),
            ScriptedModel::calls(
                "c2",
                "write_file",
                json!({"path": "src/lib.rs", "content": "fn fixed() {}"}),
                usage,
            ),
            ScriptedModel::says("I fixed the bug in src/lib.rs.", usage),
        ]),
        Scenario::Endless => {
            ScriptedModel::repeating(ScriptedModel::calls("c", "list_files", json!({}), usage))
        }
        Scenario::Escape => ScriptedModel::new(vec![
            ScriptedModel::calls(
                "c1",
                "read_file",
                json!({"path": "../../etc/passwd"}),
                usage,
            ),
            ScriptedModel::says("I could not read that file.", usage),
        ]),
    };
    let tools = FakeTools::with_files(&[("src/lib.rs", "fn broken() {}"), ("README.md", "# demo")]);
    let config = AgentConfig {
        model: args.model,
        ..Default::default()
    };
    let mut agent = Agent::new(hooks, model, tools, config);
    let ending = agent.run("Please fix the bug in src/lib.rs.").await;
    for event in &agent.events {
        match event {
            Event::Checked(d) => {
                let hooks: Vec<String> = d
                    .hooks
                    .iter()
                    .map(|(n, a)| format!("{n}={}", a.as_str_name().to_lowercase()))
                    .collect();
                println!(
                    "{:<13} {:<7} {}{}",
                    d.trigger_point,
                    if d.served {
                        d.action.as_str_name().to_lowercase()
                    } else {
                        "-".into()
                    },
                    hooks.join(" "),
                    if d.message.is_empty() {
                        String::new()
                    } else {
                        format!("  \"{}\"", d.message)
                    }
                );
            }
            Event::ModelCalled { turn, request } => println!(
                "model call    turn {turn}: {} messages, tools {:?}",
                request.messages.len(),
                request.tool_names()
            ),
            Event::ToolRan { name, arguments } => println!("tool ran      {name} {arguments}"),
            Event::ToolRefused { name, message } => println!("tool refused  {name}: {message}"),
        }
    }
    println!("ending: {:?}", ending?);
    Ok(())
}
