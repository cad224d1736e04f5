//! Fake tools over an in-memory project: what an application's tool layer would be. Two read
//! tools and two write tools, so read-only mode and the path guard have something to act on.

use serde_json::{Value, json};
use std::collections::BTreeMap;

#[derive(Debug, Default)]
pub struct FakeTools {
    /// Path → content.
    pub files: BTreeMap<String, String>,
    /// Every call that actually ran, with its arguments.
    pub ran: Vec<(String, Value)>,
}

impl FakeTools {
    pub fn with_files(files: &[(&str, &str)]) -> Self {
        Self {
            files: files
                .iter()
                .map(|(p, c)| (p.to_string(), c.to_string()))
                .collect(),
            ran: vec![],
        }
    }

    /// The tools as the model is offered them.
    pub fn definitions(&self) -> Vec<Value> {
        let path = json!({"type": "object", "required": ["path"], "properties": {"path": {"type": "string"}}});
        vec![
            json!({"name": "read_file", "description": "Read a file of the project", "parameters": path}),
            json!({"name": "list_files", "description": "List the project's files", "parameters": {"type": "object"}}),
            json!({"name": "write_file", "description": "Write a file of the project",
                   "parameters": {"type": "object", "required": ["path", "content"],
                                  "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}),
            json!({"name": "delete_file", "description": "Delete a file of the project", "parameters": path}),
        ]
    }

    /// Runs one tool: its result, or an error the model is told.
    pub fn call(&mut self, name: &str, arguments: &Value) -> Result<Value, String> {
        self.ran.push((name.to_string(), arguments.clone()));
        let path = || {
            arguments["path"]
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{name}: the path argument is missing"))
        };
        match name {
            "read_file" => {
                let p = path()?;
                self.files
                    .get(&p)
                    .map(|c| Value::String(c.clone()))
                    .ok_or_else(|| format!("no such file: {p}"))
            }
            "list_files" => Ok(json!(self.files.keys().collect::<Vec<_>>())),
            "write_file" => {
                let p = path()?;
                let content = arguments["content"].as_str().unwrap_or_default();
                self.files.insert(p.clone(), content.to_string());
                Ok(json!(format!("wrote {} bytes to {p}", content.len())))
            }
            "delete_file" => {
                let p = path()?;
                self.files
                    .remove(&p)
                    .map(|_| json!(format!("deleted {p}")))
                    .ok_or_else(|| format!("no such file: {p}"))
            }
            other => Err(format!("no such tool: {other}")),
        }
    }

    /// Whether a tool of this name ran at all.
    pub fn ran_tool(&self, name: &str) -> bool {
        self.ran.iter().any(|(n, _)| n == name)
    }
}
