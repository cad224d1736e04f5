//! The policy library (`examples/policies`) end to end: the reference agent loop
//! (`examples/agent-loop`) drives a scripted fake model and fake tools through a real gateway with
//! real runsc sandboxes, calling it at before_model, after_model, before_tool and after_tool. The
//! policies are the shipped files, with only their settings tightened for a short script.

use serde_json::{Value, json};
use sluice_agent_loop::hooks::{HookError, Hooks};
use sluice_agent_loop::model::{Model, ModelReply, ModelRequest, ScriptedModel, Usage};
use sluice_agent_loop::tools::FakeTools;
use sluice_agent_loop::{Agent, AgentConfig, Ending};
use sluice_e2e::{Harness, action, from_proto};
use sluice_proto::Action;

/// The documents of `examples/policies/<name>/hookchain.yaml`, each passed through `tweak`, as YAML.
fn policy(name: &str, mut tweak: impl FnMut(&mut Value)) -> String {
    let path = format!(
        "{}/../examples/policies/{name}/hookchain.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("policy file");
    let mut chains: Vec<Value> = serde_saphyr::from_multiple(&text).expect("policy YAML");
    chains.iter_mut().for_each(&mut tweak);
    serde_saphyr::to_string_multiple(&chains).expect("to YAML")
}

fn settings(chain: &mut Value) -> &mut Value {
    &mut chain["spec"]["hooks"][0]["settings"]
}

/// Makes a chain the platform's enforced baseline for every target.
fn enforce(chain: &mut Value, name: &str) {
    chain["metadata"]["namespace"] = json!("sluice-system");
    chain["metadata"]["name"] = json!(name);
    chain["spec"]["enforced"] = json!(true);
    chain["spec"]["target"] = json!("*");
}

async fn agent<M: Model>(h: &Harness, target: &str, model: M, config: AgentConfig) -> Agent<M> {
    let mut hooks = Hooks::connect(
        &format!("http://{}", h.gateway().addr),
        "default",
        target,
        "conv-1",
    )
    .await
    .expect("connect");
    hooks.context.insert("user_id".into(), "user-1".into());
    let tools = FakeTools::with_files(&[
        ("a.txt", &"A".repeat(300)),
        ("b.txt", &"B".repeat(300)),
        ("c.txt", &"C".repeat(300)),
        ("d.txt", &"D".repeat(300)),
    ]);
    Agent::new(hooks, model, tools, config)
}

fn read(id: &str, path: &str, usage: Usage) -> sluice_agent_loop::model::ModelReply {
    ScriptedModel::calls(id, "read_file", json!({"path": path}), usage)
}

fn hook_names(d: &sluice_agent_loop::hooks::Decision) -> Vec<(&str, Action)> {
    d.hooks.iter().map(|(n, a)| (n.as_str(), *a)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_stops_at_the_turn_limit() {
    let chain = policy("turn-limit", |c| settings(c)["max_turns"] = json!(3));
    let h = Harness::start(&[("turn-limit.yaml", &chain)]).await;
    let endless = ScriptedModel::repeating(ScriptedModel::calls(
        "c",
        "list_files",
        json!({}),
        Usage::new(10, 5),
    ));
    let mut a = agent(&h, "agent-turn-limit", endless, AgentConfig::default()).await;

    let ending = a.run("Keep going.").await.expect("the loop runs");
    assert_eq!(
        ending,
        Ending::Stopped {
            trigger_point: "before_model",
            message: "The agent stopped after 3 model calls (turn limit).".into(),
            hook: "turn-limit".into(),
        }
    );
    assert_eq!(
        a.model.seen.len(),
        3,
        "three model calls were made, the fourth was not"
    );
    let checks = a.decisions("before_model");
    let turns: Vec<(i64, Action)> = checks
        .iter()
        .map(|d| (d.sent["turn"].as_i64().unwrap(), d.action))
        .collect();
    assert_eq!(
        turns,
        vec![
            (1, Action::Pass),
            (2, Action::Pass),
            (3, Action::Pass),
            (4, Action::Block)
        ]
    );
    // Tools ran between the turns (after_model/before_tool/after_tool have no chain: NOT_FOUND passes).
    assert_eq!(a.tools.ran.len(), 3);
    assert!(a.decisions("before_tool").iter().all(|d| !d.served));
    h.stop_and_check_leaks().await;
}

/// The price ceiling's input estimate, computed here independently of the hook: characters of the
/// call's messages and tools as compact JSON / 4, rounded up.
fn input_estimate(messages: &Value, tools: &Value) -> u64 {
    let chars = messages.to_string().chars().count() + tools.to_string().chars().count();
    chars.div_ceil(4) as u64
}

/// A scripted model that reports as input tokens exactly the estimate of what it was sent (a stand-in
/// for a tokenizer), so the budget arithmetic can be checked against what was actually spent.
struct Metered(ScriptedModel);

impl Model for Metered {
    fn complete(&mut self, request: &ModelRequest) -> ModelReply {
        let mut reply = self.0.complete(request);
        reply.usage.input_tokens = input_estimate(&json!(request.messages), &json!(request.tools));
        reply
    }
}

/// fake-model prices, in micro-dollars a token.
const RATE_IN: u64 = 3;
const RATE_OUT: u64 = 15;

fn cost_micro(usage: &Value) -> u64 {
    usage["input_tokens"].as_u64().unwrap_or(0) * RATE_IN
        + usage["output_tokens"].as_u64().unwrap_or(0) * RATE_OUT
}

/// Micro-dollars of the worst case of the before_model call `sent`:
/// spent + input estimate * input rate + max_tokens * output rate.
fn worst_case_micro(sent: &Value) -> u64 {
    cost_micro(&sent["usage_so_far"])
        + input_estimate(&sent["messages"], &sent["tools"]) * RATE_IN
        + sent["max_tokens"].as_u64().unwrap() * RATE_OUT
}

fn usd(micro: u64) -> String {
    format!("{}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_price_ceiling_blocks_exactly_the_call_that_would_cross_the_budget() {
    // fake-model costs 3 / 15 USD per million tokens; every call reads a.txt, reports 500 output
    // tokens (max_tokens 1000) and as input tokens the estimate of what it was sent.
    let step = || read("c", "a.txt", Usage::new(0, 500));

    // First, with no chain at all, what the loop sends before each of the first four calls, and so
    // the worst case of each: the history grows, so each call's input grows too.
    let probe = Harness::start(&[]).await;
    let script = Metered(ScriptedModel::new(vec![
        step(),
        step(),
        step(),
        ScriptedModel::says("Done.", Usage::new(0, 500)),
    ]));
    let mut a = agent(&probe, "agent-price-probe", script, AgentConfig::default()).await;
    a.run("Read a.txt until told to stop.").await.unwrap();
    let worst: Vec<u64> = a
        .decisions("before_model")
        .iter()
        .map(|d| worst_case_micro(&d.sent))
        .collect();
    assert_eq!(worst.len(), 4);
    assert!(worst.windows(2).all(|w| w[0] < w[1]), "{worst:?}");
    probe.stop_and_check_leaks().await;

    // A budget the third call can reach exactly (it goes ahead, the fourth is blocked), and one a
    // micro-dollar under it (the third is blocked).
    let budgets = [
        ("agent-price-exact", worst[2], 4u64),
        ("agent-price-under", worst[2] - 1, 3),
    ];
    // Without the input estimate the third call would have passed even the lower budget: the call's
    // own input is what decides it.
    let sent_third = a.decisions("before_model")[2].sent.clone();
    assert!(
        cost_micro(&sent_third["usage_so_far"]) + 1000 * RATE_OUT < worst[2],
        "the input estimate must matter for this test"
    );
    let mut files = Vec::new();
    for (target, budget, _) in budgets {
        files.push((
            format!("{target}.yaml"),
            policy("price-ceiling", |c| {
                c["metadata"]["name"] = json!(target);
                c["spec"]["target"] = json!(target);
                settings(c)["budget_usd"] = json!(usd(budget));
            }),
        ));
    }
    let files: Vec<(&str, &str)> = files
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    let h = Harness::start(&files).await;

    for (target, budget, expected_blocked_turn) in budgets {
        let endless = Metered(ScriptedModel::repeating(step()));
        let mut a = agent(&h, target, endless, AgentConfig::default()).await;
        let ending = a.run("Read a.txt until told to stop.").await.unwrap();
        let Ending::Stopped {
            trigger_point,
            message,
            hook,
        } = ending
        else {
            panic!("{target}: the loop was not stopped: {ending:?}");
        };
        assert_eq!(
            (trigger_point, hook.as_str()),
            ("before_model", "price-ceiling")
        );
        assert!(message.starts_with("Price ceiling:"), "{message}");
        let checks = a.decisions("before_model");
        // The first call whose worst case exceeds the budget, computed here from what was sent.
        let first_over = checks
            .iter()
            .position(|d| worst_case_micro(&d.sent) > budget)
            .map(|i| i as u64 + 1);
        assert_eq!(first_over, Some(expected_blocked_turn), "{target}");
        assert_eq!(
            checks.len() as u64,
            expected_blocked_turn,
            "{target}: blocked at the first call over budget, not one later"
        );
        assert!(
            checks[..checks.len() - 1]
                .iter()
                .all(|d| d.action == Action::Pass)
                && checks.last().unwrap().action == Action::Block,
            "{target}"
        );
        assert_eq!(
            a.model.0.seen.len() as u64,
            expected_blocked_turn - 1,
            "{target}: every call up to the budget was made, not one more"
        );
        // What was actually spent (the usage the model reported) stays within the budget.
        let blocked = checks.last().unwrap();
        assert_eq!(blocked.sent["turn"], json!(expected_blocked_turn));
        assert_eq!(blocked.sent["usage_so_far"], a.usage_so_far.to_json());
        let spent = cost_micro(&a.usage_so_far.to_json());
        assert!(
            spent <= budget,
            "{target}: spent {} of {}",
            usd(spent),
            usd(budget)
        );
        assert!(
            message.contains(&format!("of ${}", usd(budget).trim_end_matches('0'))),
            "{message}"
        );
    }
    h.stop_and_check_leaks().await;
}

/// Characters / 4 of the messages, as the policies estimate tokens (tool calls as compact JSON here,
/// a few characters shorter than Python's; the script keeps far from the threshold either way).
fn estimate_tokens(messages: &Value) -> usize {
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m["content"].as_str().map(str::len).unwrap_or(0)
                + m.get("tool_calls")
                    .map(|c| c.to_string().len())
                    .unwrap_or(0)
        })
        .sum::<usize>()
        / 4
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_summarises_older_turns_through_llm_run_above_the_threshold() {
    let services = sluice_example_services::Services::start(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    services.credit.set_balance("user-1", 1000);
    let caps = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/capabilities.yaml"
    ))
    .unwrap()
    .replace(
        "http://127.0.0.1:7001",
        &format!("http://{}", services.llm_addr),
    )
    .replace(
        "http://127.0.0.1:7002",
        &format!("http://{}", services.credit_addr),
    );
    // fake-small has a 400-token window: compaction above 320 estimated tokens. keep_recent 2 falls
    // between the two results of a parallel call, and the transcript is held to 400 characters.
    let chain = policy("context-compaction", |c| {
        settings(c)["keep_recent"] = json!(2);
        settings(c)["max_prompt_chars"] = json!(400);
    });
    // The same policy with keep_recent 0: a settings error (not a crash), and the chain fails Open.
    let zero = policy("context-compaction", |c| {
        c["metadata"]["name"] = json!("compaction-zero");
        c["spec"]["target"] = json!("agent-compaction-zero");
        settings(c)["keep_recent"] = json!(0);
    });
    let h = Harness::start(&[
        ("caps.yaml", &caps),
        ("compaction.yaml", &chain),
        ("zero.yaml", &zero),
    ])
    .await;
    let u = Usage::new(100, 20);
    let parallel = ModelReply {
        message: json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "name": "read_file", "arguments": {"path": "c.txt"}},
            {"id": "c4", "name": "read_file", "arguments": {"path": "d.txt"}},
        ]}),
        usage: u,
    };
    let model = ScriptedModel::new(vec![
        read("c1", "a.txt", u),
        read("c2", "b.txt", u),
        parallel,
        ScriptedModel::says("All four files are read.", u),
    ]);
    let config = AgentConfig {
        model: "fake-small".into(),
        ..Default::default()
    };
    let mut a = agent(&h, "agent-compaction", model, config).await;
    let ending = a.run("Read the four files. Then report.").await.unwrap();
    assert_eq!(ending, Ending::Answered("All four files are read.".into()));

    let checks = a.decisions("before_model");
    let actions: Vec<Action> = checks.iter().map(|d| d.action).collect();
    assert_eq!(
        actions,
        vec![Action::Pass, Action::Pass, Action::Pass, Action::Modify],
        "compaction runs only once the conversation is over the threshold"
    );
    assert!(estimate_tokens(&checks[2].sent["messages"]) < 320 - 15);
    assert!(estimate_tokens(&checks[3].sent["messages"]) > 320 + 15);

    // The fourth model call sees: the system prompt, the task verbatim, the summary, and the parallel
    // call with both its results (keep_recent 2 alone would have kept only the results).
    let before = checks[3].sent["messages"].as_array().unwrap();
    let seen = &a.model.seen[3].messages;
    assert_eq!(seen.len(), 6, "{seen:#?}");
    assert_eq!(seen[0], before[0], "leading system messages are kept");
    assert_eq!(
        seen[1], before[1],
        "the first user message is kept verbatim"
    );
    assert_eq!(
        seen[2],
        json!({"role": "system", "content": "Summary of the earlier conversation: Summary: user: Read the four files."})
    );
    assert_eq!(
        seen[3..],
        before[before.len() - 3..],
        "recent turns are kept as they were"
    );
    assert_eq!(
        seen[3]["tool_calls"],
        json!([
            {"id": "c3", "name": "read_file", "arguments": {"path": "c.txt"}},
            {"id": "c4", "name": "read_file", "arguments": {"path": "d.txt"}},
        ]),
        "the results keep their calls"
    );
    for request in &a.model.seen {
        assert_calls_and_results_together(&request.messages);
    }
    assert!(
        !serde_json::to_string(seen)
            .unwrap()
            .contains(&"A".repeat(300))
    );
    // The summary came from the LLM service, through the credit gate, with the older turns in the
    // prompt: each message shortened, the start (the task) never cut off.
    let llm: Vec<_> = services
        .calls()
        .into_iter()
        .filter(|c| c.service == "llm")
        .collect();
    assert_eq!(llm.len(), 1);
    let prompt = llm[0].payload["prompt"].as_str().unwrap();
    let transcript = prompt
        .strip_prefix("Summarise this conversation so the assistant can continue from it: ")
        .expect(prompt);
    assert!(
        transcript.starts_with("user: Read the four files. Then report.\n"),
        "{transcript}"
    );
    assert!(transcript.chars().count() <= 400, "{transcript}");
    assert!(
        transcript.contains("a.txt")
            && transcript.contains("b.txt")
            && transcript.contains(" [...] ")
            && !transcript.contains("c.txt")
            && !transcript.contains("d.txt"),
        "{transcript}"
    );
    assert_eq!(
        llm[0].caller.get("user_id").map(String::as_str),
        Some("user-1")
    );
    // The application keeps the compacted history.
    assert_eq!(a.messages[..3], seen[..3]);

    // keep_recent 0 is refused with a clear error; failurePolicy Open lets the call go ahead as it was.
    let r = h
        .run_value(
            "agent-compaction-zero",
            "before_model",
            checks[3].sent.clone(),
        )
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Pass);
    assert!(
        r.hooks[0]
            .error
            .contains("settings.keep_recent must be an integer of at least 1, got 0"),
        "{:?}",
        r.hooks
    );
    h.stop_and_check_leaks().await;
    services.stop();
}

/// Every tool message answers a call made earlier in `messages`, and every call is answered.
fn assert_calls_and_results_together(messages: &[Value]) {
    for (i, m) in messages.iter().enumerate() {
        for call in m["tool_calls"].as_array().into_iter().flatten() {
            assert!(
                messages[i + 1..]
                    .iter()
                    .any(|r| r["role"] == "tool" && r["tool_call_id"] == call["id"]),
                "call {} has no result: {messages:#?}",
                call["id"]
            );
        }
        if m["role"] == "tool" {
            assert!(
                messages[..i].iter().any(|c| c["tool_calls"]
                    .as_array()
                    .is_some_and(|calls| calls.iter().any(|c| c["id"] == m["tool_call_id"]))),
                "result {} has no call: {messages:#?}",
                m["tool_call_id"]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_mode_hides_write_tools_and_blocks_a_forced_write() {
    let h = Harness::start(&[("read-only.yaml", &policy("read-only", |_| {}))]).await;
    let u = Usage::new(10, 5);
    let model = ScriptedModel::new(vec![
        read("c1", "a.txt", u),
        // The model calls a tool it was not offered.
        ScriptedModel::calls(
            "c2",
            "write_file",
            json!({"path": "a.txt", "content": "gone"}),
            u,
        ),
        ScriptedModel::says("I could not write.", u),
    ]);
    let mut a = agent(&h, "agent-read-only", model, AgentConfig::default()).await;
    let ending = a.run("Clean up a.txt.").await.unwrap();
    assert_eq!(ending, Ending::Answered("I could not write.".into()));

    assert_eq!(a.model.seen.len(), 3);
    for request in &a.model.seen {
        assert_eq!(request.tool_names(), vec!["read_file", "list_files"]);
    }
    assert!(a.tools.ran_tool("read_file"));
    assert!(!a.tools.ran_tool("write_file"), "the write never ran");
    assert_eq!(a.tools.files["a.txt"], "A".repeat(300));
    let checks = a.decisions("before_tool");
    assert_eq!(
        checks.iter().map(|d| d.action).collect::<Vec<_>>(),
        vec![Action::Pass, Action::Block]
    );
    let told = &a.model.seen[2].messages.last().unwrap()["content"];
    assert_eq!(
        told,
        &json!(
            "error: the call was blocked by policy: Read-only mode: the tool 'write_file' may not run."
        )
    );
    h.stop_and_check_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_path_guard_refuses_escapes_and_the_context_warning_is_injected() {
    let h = Harness::start(&[
        ("path-guard.yaml", &policy("path-guard", |_| {})),
        ("warning.yaml", &policy("context-warning", |_| {})),
    ])
    .await;
    let u = Usage::new(10, 5);
    let model = ScriptedModel::new(vec![
        read("c1", "../../etc/passwd", u),
        read("c2", "a.txt", u),
        ScriptedModel::says("Done.", u),
    ]);
    let mut a = agent(&h, "agent-path-guard", model, AgentConfig::default()).await;
    assert_eq!(
        a.run("Read the files.").await.unwrap(),
        Ending::Answered("Done.".into())
    );
    let ran: Vec<&str> = a
        .tools
        .ran
        .iter()
        .map(|(_, args)| args["path"].as_str().unwrap())
        .collect();
    assert_eq!(ran, vec!["a.txt"], "the escaping read never ran");
    assert!(
        a.model.seen[1].messages.last().unwrap()["content"]
            .as_str()
            .unwrap()
            .contains("argument path='../../etc/passwd' is outside the project root /workspace")
    );

    // fake-small: 400 tokens; warn above 60% (960 characters). Each read adds 300 characters.
    let model = ScriptedModel::new(vec![
        read("c1", "a.txt", u),
        read("c2", "b.txt", u),
        read("c3", "c.txt", u),
        ScriptedModel::says("Done.", u),
    ]);
    let config = AgentConfig {
        model: "fake-small".into(),
        ..Default::default()
    };
    let mut a = agent(&h, "agent-context-warning", model, config).await;
    assert_eq!(
        a.run("Read a, b and c.").await.unwrap(),
        Ending::Answered("Done.".into())
    );
    let warnings: Vec<usize> = a
        .model
        .seen
        .iter()
        .map(|r| {
            r.messages
                .iter()
                .filter(|m| {
                    m["content"]
                        .as_str()
                        .unwrap_or("")
                        .starts_with("Context usage:")
                })
                .count()
        })
        .collect();
    assert_eq!(warnings, vec![0, 0, 0, 1], "one warning, once over 60%");
    let last = a.model.seen[3].messages.last().unwrap();
    assert_eq!(last["role"], json!("system"));
    assert!(
        last["content"]
            .as_str()
            .unwrap()
            .contains("% of the context window is used")
    );
    h.stop_and_check_leaks().await;
}

/// A before_tool chain that rewrites a call, and an after_model chain that breaks the reply's shape.
const LOOP_CHAINS: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: rename, namespace: default}
spec:
  target: agent-rename
  triggerPoint: before_tool
  pool: {warm: 1, max: 8}
  hooks:
    - name: list-means-read
      action: modify
      code: |
        def execute(context, settings):
            call = context["outgoing"]
            if call["name"] != "list_files":
                return {"action": "pass"}
            return {"action": "modify", "outgoing": {"name": "read_file", "arguments": {"path": "a.txt"}}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: bad-message, namespace: default}
spec:
  target: agent-bad-message
  triggerPoint: after_model
  pool: {warm: 1, max: 8}
  hooks:
    - name: flatten
      action: modify
      code: |
        def execute(context, settings):
            return {"action": "modify", "outgoing": dict(context["outgoing"], message="just text")}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_keeps_calls_with_their_results_and_can_require_chains() {
    let h = Harness::start(&[("loop.yaml", LOOP_CHAINS)]).await;
    let u = Usage::new(10, 5);
    let both = |a: &str, b: &str| ModelReply {
        message: json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "p1", "name": a, "arguments": {"path": "a.txt"}},
            {"id": "p2", "name": b, "arguments": {"path": "b.txt"}},
        ]}),
        usage: u,
    };

    // A rewritten call: the tool message carries the name of the call that actually ran.
    let model = ScriptedModel::new(vec![
        both("list_files", "read_file"),
        ScriptedModel::says("Done.", u),
    ]);
    let mut a = agent(&h, "agent-rename", model, AgentConfig::default()).await;
    assert_eq!(
        a.run("Go.").await.unwrap(),
        Ending::Answered("Done.".into())
    );
    let results: Vec<(&str, &str)> = a
        .messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap(),
                m["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(results, vec![("p1", "read_file"), ("p2", "read_file")]);
    assert_eq!(a.tools.ran.len(), 2);
    assert!(!a.tools.ran_tool("list_files"));
    assert_calls_and_results_together(&a.messages);

    // A required trigger point with no chain stops the loop; the assistant message still goes into
    // the history together with an error result for each of its calls, and no tool ran.
    let model = ScriptedModel::new(vec![both("read_file", "read_file")]);
    let mut a = agent(&h, "agent-none", model, AgentConfig::default()).await;
    a.hooks = a.hooks.clone().requiring(&["before_tool"]);
    let err = a.run("Go.").await.unwrap_err();
    assert!(
        matches!(
            &err,
            HookError::Required { trigger_point: "before_tool", target } if target == "agent-none"
        ),
        "{err}"
    );
    assert!(a.tools.ran.is_empty());
    let roles: Vec<&str> = a
        .messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, vec!["system", "user", "assistant", "tool", "tool"]);
    assert!(
        a.messages[3]["content"]
            .as_str()
            .unwrap()
            .contains("no chain serves before_tool"),
        "{}",
        a.messages[3]
    );
    assert_calls_and_results_together(&a.messages);
    // Not required: the same target runs without any chain (NOT_FOUND passes).
    let model = ScriptedModel::new(vec![ScriptedModel::says("Hi.", u)]);
    let mut a = agent(&h, "agent-none", model, AgentConfig::default()).await;
    assert_eq!(a.run("Go.").await.unwrap(), Ending::Answered("Hi.".into()));

    // An after_model rewrite whose message is not an object never reaches the loop: the gateway
    // refuses a rewrite that breaks the payload's shape, and nothing is appended. (The loop's own
    // `HookError::BadField` check stays as a second line.)
    let model = ScriptedModel::new(vec![ScriptedModel::says("Hi.", u)]);
    let mut a = agent(&h, "agent-bad-message", model, AgentConfig::default()).await;
    match a.run("Go.").await.unwrap() {
        Ending::Stopped {
            trigger_point,
            message,
            ..
        } => {
            assert_eq!(trigger_point, "after_model");
            assert!(
                message.contains("must keep \"message\" as an object"),
                "{message}"
            );
        }
        other => panic!("expected the gateway to stop the malformed rewrite, got {other:?}"),
    }
    assert_eq!(a.messages.len(), 2, "{:?}", a.messages);
    h.stop_and_check_leaks().await;
}

/// A tenant chain that tries everything to get around the baseline: resets the turn counter, offers
/// the write tools again, and fails open.
const TENANT: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: tenant-model, namespace: default}
spec:
  target: agent-x
  triggerPoint: before_model
  failurePolicy: Open
  pool: {warm: 1, max: 8}
  hooks:
    - name: loosen
      action: modify
      code: |
        def execute(context, settings):
            call = context["outgoing"]
            call["turn"] = 1
            call["tools"] = call["tools"] + [{"name": "write_file"}]
            return {"action": "modify", "outgoing": call}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: tenant-tool, namespace: default}
spec:
  target: agent-x
  triggerPoint: before_tool
  failurePolicy: Open
  pool: {warm: 1, max: 8}
  hooks:
    - name: watch
      action: detect
      code: |
        def execute(context, settings):
            return {"action": "detect", "findings": {"tool": context["outgoing"]["name"]}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: tenant-output, namespace: default}
spec:
  target: agent-x
  triggerPoint: output
  streaming: {flushChars: 8, lookbackChars: 16}
  pool: {warm: 1, max: 8}
  hooks:
    - name: look
      action: detect
      code: |
        def execute(context, settings):
            return {"action": "detect", "findings": {"saw_secret": "SECRET" in context["outgoing"]}}
---
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: self-made-baseline, namespace: default}
spec:
  enforced: true
  target: "*"
  triggerPoint: after_tool
  hooks:
    - name: nope
      action: block
      code: |
        def execute(context, settings):
            return {"action": "block", "message": "should never run"}
"#;

const PLATFORM_OUTPUT: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: platform-output, namespace: sluice-system}
spec:
  enforced: true
  target: "*"
  triggerPoint: output
  pool: {warm: 1, max: 8}
  hooks:
    - name: redact
      action: modify
      code: |
        def execute(context, settings):
            text = context["outgoing"]
            if "SECRET" not in text:
                return {"action": "pass"}
            return {"action": "modify", "outgoing": text.replace("SECRET", "[platform]")}
"#;

/// A baseline hook that fails on a marker argument, to show its own Closed policy governs it.
const EXPLODE: &str = r#"
def execute(context, settings):
    if context["outgoing"]["arguments"].get("path") == "boom":
        raise RuntimeError("baseline hook broke")
    return {"action": "pass"}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_baseline_runs_first_and_a_tenant_chain_cannot_bypass_it() {
    let turns = policy("turn-limit", |c| {
        enforce(c, "platform-turns");
        settings(c)["max_turns"] = json!(2);
    });
    let writes = policy("read-only", |c| {
        if c["spec"]["triggerPoint"] == "before_tool" {
            enforce(c, "platform-writes");
            let mut hooks = c["spec"]["hooks"].as_array().unwrap().clone();
            hooks.push(json!({"name": "explode", "action": "block", "code": EXPLODE}));
            c["spec"]["hooks"] = json!(hooks);
        } else {
            // Only the before_tool half is part of this baseline.
            c["metadata"]["name"] = json!("unused-read-only");
            c["spec"]["target"] = json!("unused");
        }
    });
    let h = Harness::start(&[
        ("platform-turns.yaml", &turns),
        ("platform-writes.yaml", &writes),
        ("platform-output.yaml", PLATFORM_OUTPUT),
        ("tenant.yaml", TENANT),
    ])
    .await;
    let registry = h.gateway().engine.registry();
    assert!(
        registry
            .errors()
            .iter()
            .any(|e| e.message.contains("\"self-made-baseline\"")
                && e.message.contains("only in the platform namespace")),
        "{:?}",
        registry.errors()
    );

    let u = Usage::new(10, 5);
    let endless = ScriptedModel::new(vec![
        ScriptedModel::calls(
            "c1",
            "write_file",
            json!({"path": "a.txt", "content": "x"}),
            u,
        ),
        read("c2", "a.txt", u),
        read("c3", "b.txt", u),
    ]);
    let mut a = agent(&h, "agent-x", endless, AgentConfig::default()).await;
    let ending = a.run("Go.").await.unwrap();
    // The tenant resets `turn` to 1, but the baseline ran first and saw turn 3.
    assert_eq!(
        ending,
        Ending::Stopped {
            trigger_point: "before_model",
            message: "The agent stopped after 2 model calls (turn limit).".into(),
            hook: "baseline/turn-limit".into(),
        }
    );
    assert_eq!(a.model.seen.len(), 2);
    let checks = a.decisions("before_model");
    assert_eq!(
        hook_names(checks[0]),
        vec![
            ("baseline/turn-limit", Action::Pass),
            ("loosen", Action::Modify)
        ],
        "baseline hooks first, then the tenant's"
    );
    assert_eq!(
        hook_names(checks[2]),
        vec![("baseline/turn-limit", Action::Block)]
    );
    // The tenant offered write_file again; the model called it; the before_tool baseline refused it
    // before the tenant's own before_tool chain could even look.
    assert!(a.model.seen[0].tool_names().contains(&"write_file"));
    assert!(!a.tools.ran_tool("write_file"));
    let tools = a.decisions("before_tool");
    assert_eq!(
        hook_names(tools[0]),
        vec![("baseline/block-write-calls", Action::Block)]
    );
    assert_eq!(
        hook_names(tools[1]),
        vec![
            ("baseline/block-write-calls", Action::Pass),
            ("baseline/explode", Action::Pass),
            ("watch", Action::Detect)
        ]
    );
    // The enforced chain in the tenant's namespace was never served: after_tool has no chain.
    assert!(a.decisions("after_tool").iter().all(|d| !d.served));

    // A baseline hook's failure is governed by the baseline's Closed, not the tenant's Open.
    let r = h
        .run_value(
            "agent-x",
            "before_tool",
            json!({"name": "read_file", "arguments": {"path": "boom"}}),
        )
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Block);
    assert!(
        r.message.contains("\"explode\" failed") && r.message.contains("baseline hook broke"),
        "{}",
        r.message
    );
    assert_eq!(r.terminal_index, Some(1));
    assert_eq!(r.hooks.len(), 2, "the tenant's chain did not run");

    // A target with no chain of its own still gets the baseline, rather than NOT_FOUND.
    let call = |turn: u32| json!({"model": "m", "messages": [], "tools": [], "max_tokens": 1, "usage_so_far": {}, "turn": turn});
    let r = h
        .run_value("agent-unknown", "before_model", call(3))
        .await
        .unwrap();
    assert_eq!((action(&r), r.hooks.len()), (Action::Block, 1));
    let r = h
        .run_value("agent-unknown", "before_model", call(1))
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Pass);
    let missing = h
        .run_value(
            "agent-unknown",
            "after_model",
            json!({"message": {}, "usage": {}}),
        )
        .await;
    assert_eq!(missing.unwrap_err().code(), tonic::Code::NotFound);

    // Streams: the baseline redacts first; the tenant's chain sees only the redacted text.
    let chunks: Vec<String> = ["my SEC", "RET is ", "safe and so is SECRET."]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let s = h.stream("agent-x", "output", &chunks).await;
    assert!(s.status.is_none(), "{:?}", s.status);
    assert!(!s.committed().contains("SECRET"), "{:?}", s.commits);
    assert_eq!(s.committed(), "my [platform] is safe and so is [platform].");
    let f = s.final_.expect("a final");
    assert_eq!(f.hooks[0].name, "baseline/redact");
    assert_eq!(f.hooks[1].name, "look");
    assert_eq!(
        from_proto(f.hooks[1].findings.as_ref().unwrap()),
        json!({"saw_secret": false})
    );

    // The audit names both chains and lists the baseline's hooks first.
    let audit = h.audit();
    let event = audit
        .iter()
        .find(|e| e["trigger_point"] == "before_tool" && e["action"] == "detect")
        .expect("the audit of the read_file check");
    assert_eq!(event["chain"], json!("default/tenant-tool"));
    assert_eq!(
        event["baseline"]["chain"],
        json!("sluice-system/platform-writes")
    );
    assert!(event["baseline"]["sandbox"].is_string() && event["sandbox"].is_string());
    assert_ne!(
        event["baseline"]["sandbox"], event["sandbox"],
        "each chain in its own sandbox"
    );
    let names: Vec<&str> = event["hooks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec!["baseline/block-write-calls", "baseline/explode", "watch"]
    );
    h.stop_and_check_leaks().await;
}

const DROP_WRITES_BASELINE: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: platform-read-only, namespace: sluice-system}
spec:
  enforced: true
  target: "*"
  triggerPoint: before_model
  pool: {warm: 1, max: 8}
  hooks:
    - name: drop-write-tools
      action: modify
      code: |
        def execute(context, settings):
            p = context["outgoing"]
            kept = [t for t in p["tools"] if not t["name"].startswith("write")]
            if len(kept) == len(p["tools"]):
                return {"action": "pass"}
            return {"action": "modify", "outgoing": dict(p, tools=kept)}
"#;

const READD_TENANT: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: sneaky, namespace: default}
spec:
  target: sneaky-bot
  triggerPoint: before_model
  pool: {warm: 1, max: 8}
  hooks:
    - name: readd-write-tool
      action: modify
      code: |
        def execute(context, settings):
            p = context["outgoing"]
            names = [t["name"] for t in p["tools"]]
            if "write_file" in names:
                return {"action": "pass"}
            return {"action": "modify", "outgoing": dict(p, tools=p["tools"] + [{"name": "write_file"}])}
    - name: note
      action: modify
      code: |
        def execute(context, settings):
            p = context["outgoing"]
            return {"action": "modify", "outgoing": dict(p, messages=p["messages"] + [{"role": "system", "content": "be brief"}])}
"#;

/// A tenant hook that puts back what the baseline took out has its output checked by the baseline
/// again: the write tool is gone from what the model sees, and the answer says who removed it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_cannot_undo_a_baseline_rewrite() {
    let h = Harness::start(&[
        ("baseline.yaml", DROP_WRITES_BASELINE),
        ("tenant.yaml", READD_TENANT),
    ])
    .await;
    let payload = json!({
        "model": "m", "max_tokens": 10, "usage_so_far": {}, "turn": 1,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "read_file"}, {"name": "write_file"}],
    });
    let r = h
        .run_value("sneaky-bot", "before_model", payload)
        .await
        .unwrap();
    assert_eq!(action(&r), Action::Modify);
    let out = from_proto(match &r.payload {
        Some(sluice_proto::run_response::Payload::Value(v)) => v,
        other => panic!("expected a value payload, got {other:?}"),
    });
    assert_eq!(out["tools"], json!([{"name": "read_file"}]), "{out}");
    // The tenant's other change (an injected message) stands: only what the baseline objects to goes.
    assert_eq!(out["messages"][1]["content"], "be brief");
    let names: Vec<(&str, Action)> = r
        .hooks
        .iter()
        .map(|o| (o.name.as_str(), Action::try_from(o.action).unwrap()))
        .collect();
    assert_eq!(
        names,
        vec![
            ("baseline/drop-write-tools", Action::Modify),
            ("readd-write-tool", Action::Modify),
            ("note", Action::Modify),
            ("baseline-recheck/drop-write-tools", Action::Modify),
        ]
    );
    h.stop_and_check_leaks().await;
}
