//! A reference agent loop: how an application puts Sluice around every model call and every tool
//! call. The model and the tools are in-process fakes (`model.rs`, `tools.rs`); the gateway, its
//! chains and its sandboxes are real. Each turn:
//!
//! 1. `before_model` `{model, messages, tools, max_tokens, usage_so_far, turn}`: block/skip ends the
//!    conversation (turn limit, price ceiling); a rewrite is used for the call (compaction, injected
//!    messages, dropped tools). Rewritten `messages` become the loop's history, so a compaction sticks.
//! 2. the model call, with exactly what came back from the gateway;
//! 3. `after_model` `{message, usage}`: block/skip withholds the reply and ends the conversation;
//! 4. for each tool call, `before_tool` `{name, arguments}`: block refuses the call (the model is told
//!    why and the loop goes on), skip answers in the tool's place with the hook's message, a rewrite
//!    changes the call; then the tool runs;
//! 5. `after_tool` `{name, result, error}`: a rewrite changes what the model sees, block withholds it.
//!
//! A trigger point without any chain (NOT_FOUND) lets the payload through, unless the `Hooks` list it
//! as required; any other gateway error ends the loop with that error rather than running the agent
//! without its policies. The history never holds a tool call without its result: the assistant
//! message and all its results are added together (an error result for a call that was not made).

pub mod hooks;
pub mod model;
pub mod tools;

use hooks::{Decision, HookError, Hooks};
use model::{Model, ModelRequest, Usage};
use serde_json::{Value, json};
use sluice_proto::Action;
use tools::FakeTools;

/// What the application asks of the model on every call.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub model: String,
    pub max_tokens: u64,
    pub system_prompt: String,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            model: "fake-model".into(),
            max_tokens: 1000,
            system_prompt: "You are a coding agent working in /workspace.".into(),
        }
    }
}

/// How a conversation ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Ending {
    /// The model answered without calling a tool (or a `skip` answered in its place).
    Answered(String),
    /// A hook blocked at `trigger_point`; `message` is for the user.
    Stopped {
        trigger_point: &'static str,
        message: String,
        hook: String,
    },
}

/// Everything the loop did, in order, for the demo's printout and the tests.
#[derive(Clone, Debug)]
pub enum Event {
    Checked(Decision),
    ModelCalled { turn: u64, request: ModelRequest },
    ToolRan { name: String, arguments: Value },
    ToolRefused { name: String, message: String },
}

pub struct Agent<M: Model> {
    pub hooks: Hooks,
    pub model: M,
    pub tools: FakeTools,
    pub config: AgentConfig,
    /// The conversation as the application keeps it.
    pub messages: Vec<Value>,
    pub usage_so_far: Usage,
    /// Model calls made or attempted so far.
    pub turn: u64,
    pub events: Vec<Event>,
}

impl<M: Model> Agent<M> {
    pub fn new(hooks: Hooks, model: M, tools: FakeTools, config: AgentConfig) -> Self {
        Self {
            hooks,
            model,
            tools,
            config,
            messages: vec![],
            usage_so_far: Usage::default(),
            turn: 0,
            events: vec![],
        }
    }

    async fn check(
        &mut self,
        trigger_point: &'static str,
        payload: Value,
    ) -> Result<Decision, HookError> {
        let decision = self.hooks.check(trigger_point, payload).await?;
        self.events.push(Event::Checked(decision.clone()));
        Ok(decision)
    }

    fn stopped(d: &Decision) -> Ending {
        Ending::Stopped {
            trigger_point: d.trigger_point,
            message: d.message.clone(),
            hook: d.stopped_by().unwrap_or_default().to_string(),
        }
    }

    /// Takes the user's message and runs turns until the model answers or a hook stops it.
    pub async fn run(&mut self, user: &str) -> Result<Ending, HookError> {
        if self.messages.is_empty() && !self.config.system_prompt.is_empty() {
            self.messages
                .push(json!({"role": "system", "content": self.config.system_prompt}));
        }
        self.messages.push(json!({"role": "user", "content": user}));
        loop {
            self.turn += 1;
            let d = self
                .check(
                    "before_model",
                    json!({
                        "model": self.config.model,
                        "messages": self.messages,
                        "tools": self.tools.definitions(),
                        "max_tokens": self.config.max_tokens,
                        "usage_so_far": self.usage_so_far.to_json(),
                        "turn": self.turn,
                    }),
                )
                .await?;
            match d.action {
                Action::Block => return Ok(Self::stopped(&d)),
                Action::Skip => {
                    self.messages
                        .push(json!({"role": "assistant", "content": d.message}));
                    return Ok(Ending::Answered(d.message));
                }
                _ => {}
            }
            let call = d.payload;
            if let Some(Value::Array(messages)) = call.get("messages") {
                self.messages = messages.clone();
            }
            let request = ModelRequest {
                model: call["model"]
                    .as_str()
                    .unwrap_or(&self.config.model)
                    .to_string(),
                messages: self.messages.clone(),
                tools: call["tools"].as_array().cloned().unwrap_or_default(),
                max_tokens: call["max_tokens"]
                    .as_u64()
                    .unwrap_or(self.config.max_tokens),
            };
            let reply = self.model.complete(&request);
            self.events.push(Event::ModelCalled {
                turn: self.turn,
                request,
            });
            self.usage_so_far.add(reply.usage);

            let d = self
                .check(
                    "after_model",
                    json!({"message": reply.message, "usage": reply.usage.to_json()}),
                )
                .await?;
            if d.stops() {
                return Ok(Self::stopped(&d));
            }
            let message = d.payload["message"].clone();
            if !message.is_object() {
                return Err(HookError::BadField {
                    trigger_point: "after_model",
                    field: "message",
                    expected: "an object",
                });
            }
            let calls = message["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if calls.is_empty() {
                self.messages.push(message.clone());
                return Ok(Ending::Answered(
                    message["content"].as_str().unwrap_or_default().to_string(),
                ));
            }
            // The assistant message and a result for each of its calls go into the history together,
            // so the history never holds a call without its result (which model APIs refuse). When a
            // check fails, every call not answered yet gets an error result, and then the loop ends.
            let mut results = Vec::with_capacity(calls.len());
            let mut failed = None;
            for call in &calls {
                let (name, content) = if failed.is_some() {
                    (
                        call["name"].clone(),
                        "error: no result: an earlier call of this turn failed".into(),
                    )
                } else {
                    match self.tool_call(call).await {
                        Ok(answer) => answer,
                        Err(e) => {
                            let content = format!("error: no result: {e}");
                            failed = Some(e);
                            (call["name"].clone(), content)
                        }
                    }
                };
                results.push(json!({
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": name,
                    "content": content,
                }));
            }
            self.messages.push(message);
            self.messages.extend(results);
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }

    /// One tool call through before_tool, the tool, and after_tool: the name of the call as it was
    /// made (a hook may rewrite it) and what the model is told.
    async fn tool_call(&mut self, call: &Value) -> Result<(Value, String), HookError> {
        let d = self
            .check(
                "before_tool",
                json!({"name": call["name"], "arguments": call["arguments"]}),
            )
            .await?;
        let name = d.payload["name"].as_str().unwrap_or_default().to_string();
        let named = |content: String| (Value::String(name.clone()), content);
        match d.action {
            Action::Block => {
                self.events.push(Event::ToolRefused {
                    name: name.clone(),
                    message: d.message.clone(),
                });
                return Ok(named(format!(
                    "error: the call was blocked by policy: {}",
                    d.message
                )));
            }
            Action::Skip => return Ok(named(d.message)),
            _ => {}
        }
        let arguments = d.payload["arguments"].clone();
        let (result, error) = match self.tools.call(&name, &arguments) {
            Ok(r) => (r, Value::Null),
            Err(e) => (Value::Null, Value::String(e)),
        };
        self.events.push(Event::ToolRan {
            name: name.clone(),
            arguments,
        });
        let d = self
            .check(
                "after_tool",
                json!({"name": name, "result": result, "error": error}),
            )
            .await?;
        if d.stops() {
            return Ok(named(format!(
                "error: the result was withheld by policy: {}",
                d.message
            )));
        }
        Ok(named(match (&d.payload["error"], &d.payload["result"]) {
            (Value::String(e), _) => format!("error: {e}"),
            (_, Value::String(s)) => s.clone(),
            (_, other) => other.to_string(),
        }))
    }

    /// The gateway's decisions at one trigger point, in order.
    pub fn decisions(&self, trigger_point: &str) -> Vec<&Decision> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::Checked(d) if d.trigger_point == trigger_point => Some(d),
                _ => None,
            })
            .collect()
    }
}
