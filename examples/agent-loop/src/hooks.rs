//! The application's side of Sluice: one `Gateway.Run` per trigger point, with the structured
//! payload of that point, and the gateway's decision handed back in a form the loop can act on.

use serde_json::Value;
use sluice_proto::client::{Client, ClientAuth};
use sluice_proto::convert::{from_proto, to_proto};
use sluice_proto::{self as proto, Action};
use std::collections::HashMap;

#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// The gateway could not decide (no sandbox, bad request, gateway down). The loop stops: an agent
    /// whose policies cannot run must not go on without them.
    #[error("the gateway refused {trigger_point} for target {target:?}: {code:?}: {message}")]
    Gateway {
        trigger_point: &'static str,
        target: String,
        code: tonic::Code,
        message: String,
    },
    #[error("the gateway answered {trigger_point} without an object payload")]
    NotAnObject { trigger_point: &'static str },
    /// The answer is an object, but a field the loop needs has the wrong shape.
    #[error("the gateway answered {trigger_point} with {field} that is not {expected}")]
    BadField {
        trigger_point: &'static str,
        field: &'static str,
        expected: &'static str,
    },
    /// No chain serves a trigger point listed in `Hooks::required`.
    #[error(
        "no chain serves {trigger_point} for target {target:?}, and this loop requires one there (Hooks::required)"
    )]
    Required {
        trigger_point: &'static str,
        target: String,
    },
}

/// What the gateway decided at one trigger point.
#[derive(Clone, Debug)]
pub struct Decision {
    pub trigger_point: &'static str,
    /// The payload the loop sent.
    pub sent: Value,
    pub action: Action,
    /// The payload to go on with: the sent one, or the hooks' rewrite.
    pub payload: Value,
    /// For block and skip: what the user (or, for tools, the model) is told.
    pub message: String,
    /// Every hook that ran, in order (platform baseline hooks first, as `baseline/<hook>`), with its action.
    pub hooks: Vec<(String, Action)>,
    /// False when no chain serves this trigger point (the payload goes on unchanged).
    pub served: bool,
}

impl Decision {
    /// Block and skip end the walk: the model call or tool call does not happen.
    pub fn stops(&self) -> bool {
        matches!(self.action, Action::Block | Action::Skip)
    }

    /// The hook that ended the walk, if one did.
    pub fn stopped_by(&self) -> Option<&str> {
        self.stops()
            .then(|| self.hooks.last().map(|(n, _)| n.as_str()))
            .flatten()
    }
}

/// A gateway client bound to one conversation of one target.
#[derive(Clone)]
pub struct Hooks {
    client: Client,
    pub namespace: String,
    pub target: String,
    pub session_id: String,
    /// Caller context passed with every call (user id, plan...): what capability gates see.
    pub context: HashMap<String, String>,
    /// Trigger points that must have a chain. By default (empty) a trigger point no chain serves
    /// (`NOT_FOUND`) lets the payload through; listed here, `NOT_FOUND` is `HookError::Required`
    /// instead, so a policy that was deleted or renamed stops the agent rather than vanishing.
    pub required: Vec<&'static str>,
}

impl Hooks {
    pub fn new(client: Client, namespace: &str, target: &str, session_id: &str) -> Self {
        Self {
            client,
            namespace: namespace.into(),
            target: target.into(),
            session_id: session_id.into(),
            context: HashMap::new(),
            required: Vec::new(),
        }
    }

    /// The same client, with `NOT_FOUND` an error at these trigger points (see `required`).
    pub fn requiring(mut self, trigger_points: &[&'static str]) -> Self {
        self.required.extend_from_slice(trigger_points);
        self
    }

    /// Connects to a gateway on plain HTTP/2 (a loopback gateway needs nothing more).
    pub async fn connect(
        gateway: &str,
        namespace: &str,
        target: &str,
        session_id: &str,
    ) -> anyhow::Result<Self> {
        Self::connect_with(
            gateway,
            &ClientAuth::default(),
            namespace,
            target,
            session_id,
        )
        .await
    }

    /// Connects with TLS (`auth.ca`), a client certificate (`auth.cert`/`auth.key`) and a bearer
    /// token, as the gateway's caller policy asks.
    pub async fn connect_with(
        gateway: &str,
        auth: &ClientAuth,
        namespace: &str,
        target: &str,
        session_id: &str,
    ) -> anyhow::Result<Self> {
        let client = auth.connect(gateway).await?;
        Ok(Self::new(client, namespace, target, session_id))
    }

    /// Runs `payload` through the chains at `trigger_point`. No chain there → the payload goes on,
    /// unless `trigger_point` is in `required`.
    pub async fn check(
        &self,
        trigger_point: &'static str,
        payload: Value,
    ) -> Result<Decision, HookError> {
        let request = proto::RunRequest {
            namespace: self.namespace.clone(),
            target: self.target.clone(),
            trigger_point: trigger_point.into(),
            payload: Some(proto::run_request::Payload::Value(to_proto(&payload))),
            context: self.context.clone(),
            session_id: self.session_id.clone(),
        };
        let response = match self.client.clone().run(request).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::NotFound => {
                if self.required.contains(&trigger_point) {
                    return Err(HookError::Required {
                        trigger_point,
                        target: self.target.clone(),
                    });
                }
                return Ok(Decision {
                    trigger_point,
                    sent: payload.clone(),
                    action: Action::Pass,
                    payload,
                    message: String::new(),
                    hooks: vec![],
                    served: false,
                });
            }
            Err(s) => {
                return Err(HookError::Gateway {
                    trigger_point,
                    target: self.target.clone(),
                    code: s.code(),
                    message: s.message().to_string(),
                });
            }
        };
        let out = match &response.payload {
            Some(proto::run_response::Payload::Value(v)) => from_proto(v),
            _ => return Err(HookError::NotAnObject { trigger_point }),
        };
        if !out.is_object() {
            return Err(HookError::NotAnObject { trigger_point });
        }
        Ok(Decision {
            trigger_point,
            sent: payload,
            action: Action::try_from(response.action).unwrap_or(Action::Block),
            payload: out,
            message: response.message,
            hooks: response
                .hooks
                .iter()
                .map(|h| {
                    (
                        h.name.clone(),
                        Action::try_from(h.action).unwrap_or(Action::Pass),
                    )
                })
                .collect(),
            served: true,
        })
    }
}
