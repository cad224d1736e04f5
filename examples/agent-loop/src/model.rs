//! The model side of the loop. `Model` is what an application would implement over its LLM client;
//! `ScriptedModel` is a deterministic fake that answers from a script and records every request, so
//! the tests can see exactly what the model was shown after the hooks had their say.

use serde_json::{Value, json};

/// Tokens used, as LLM APIs report them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    pub fn new(input_tokens: u64, output_tokens: u64) -> Self {
        Self {
            input_tokens,
            output_tokens,
        }
    }

    pub fn add(&mut self, other: Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
    }

    pub fn to_json(self) -> Value {
        json!({"input_tokens": self.input_tokens, "output_tokens": self.output_tokens})
    }
}

/// One model call as the model receives it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelRequest {
    pub model: String,
    /// `{role, content, tool_calls?, tool_call_id?}` objects.
    pub messages: Vec<Value>,
    /// `{name, description, parameters}` objects: the tools the model may call.
    pub tools: Vec<Value>,
    pub max_tokens: u64,
}

impl ModelRequest {
    pub fn tool_names(&self) -> Vec<&str> {
        self.tools
            .iter()
            .filter_map(|t| t["name"].as_str())
            .collect()
    }
}

/// The model's answer: an assistant message (text and/or `tool_calls`) and what it used.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelReply {
    pub message: Value,
    pub usage: Usage,
}

pub trait Model {
    fn complete(&mut self, request: &ModelRequest) -> ModelReply;
}

/// A model that answers from a script, in order, and remembers every request.
#[derive(Debug, Default)]
pub struct ScriptedModel {
    steps: Vec<ModelReply>,
    next: usize,
    /// Once the script is used up, answer with its last step again (an agent that never stops).
    repeat_last: bool,
    pub seen: Vec<ModelRequest>,
}

impl ScriptedModel {
    pub fn new(steps: Vec<ModelReply>) -> Self {
        Self {
            steps,
            ..Default::default()
        }
    }

    /// A model that gives the same answer forever.
    pub fn repeating(step: ModelReply) -> Self {
        Self {
            steps: vec![step],
            repeat_last: true,
            ..Default::default()
        }
    }

    /// A final text answer.
    pub fn says(text: &str, usage: Usage) -> ModelReply {
        ModelReply {
            message: json!({"role": "assistant", "content": text}),
            usage,
        }
    }

    /// A call of one tool.
    pub fn calls(id: &str, tool: &str, arguments: Value, usage: Usage) -> ModelReply {
        ModelReply {
            message: json!({"role": "assistant", "content": "",
                            "tool_calls": [{"id": id, "name": tool, "arguments": arguments}]}),
            usage,
        }
    }
}

impl Model for ScriptedModel {
    fn complete(&mut self, request: &ModelRequest) -> ModelReply {
        self.seen.push(request.clone());
        let step = match self.steps.get(self.next) {
            Some(s) => s.clone(),
            None if self.repeat_last && !self.steps.is_empty() => {
                self.steps[self.steps.len() - 1].clone()
            }
            None => Self::says("(the script has ended)", Usage::default()),
        };
        self.next += 1;
        step
    }
}
