"""The HookChains the client tests serve from a real local gateway: one per trigger point, each
small enough to say what the client must carry back (actions, payload rewrites, messages, findings,
hook errors, the caller context)."""

INPUT = """
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: support-input, namespace: default}
spec:
  target: support-bot
  triggerPoint: input
  pool: {warm: 1, max: 2}
  hooks:
    - name: redact-phone
      action: modify
      settings: {mask: "[phone]"}
      code: |
        import re
        def execute(context, settings):
            text = re.sub(r"\\d{3}-\\d{4}-\\d{4}", settings["mask"], context["outgoing"])
            if text == context["outgoing"]:
                return {"action": "pass"}
            return {"action": "modify", "outgoing": text}
    - name: block-injection
      action: block
      code: |
        def execute(context, settings):
            if "ignore previous instructions" in context["outgoing"].lower():
                user = context["caller"].get("user", "someone")
                return {"action": "block", "message": f"Sorry {user}, I can't do that."}
            return {"action": "pass"}
"""

OUTPUT = """
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: support-output, namespace: default}
spec:
  target: support-bot
  triggerPoint: output
  streaming: {flushChars: 16, lookbackChars: 14}
  pool: {warm: 1, max: 2}
  hooks:
    - name: redact-phone
      action: modify
      code: |
        import re
        def execute(context, settings):
            text = re.sub(r"\\d{3}-\\d{4}-\\d{4}", "[phone]", context["outgoing"])
            return {"action": "modify", "outgoing": text} if text != context["outgoing"] else {"action": "pass"}
    - name: no-forbidden
      action: block
      code: |
        def execute(context, settings):
            if "FORBIDDEN" in context["outgoing"]:
                return {"action": "block", "message": "The reply was withheld."}
            return {"action": "pass"}
"""

BEFORE_MODEL = """
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: agent-before-model, namespace: default}
spec:
  target: agent
  triggerPoint: before_model
  pool: {warm: 1, max: 2}
  hooks:
    - name: turn-limit
      action: block
      settings: {max_turns: 3}
      code: |
        def execute(context, settings):
            if context["outgoing"]["turn"] > settings["max_turns"]:
                return {"action": "block", "message": "turn limit reached"}
            return {"action": "pass"}
    - name: read-only
      action: modify
      code: |
        def execute(context, settings):
            p = dict(context["outgoing"])
            p["tools"] = [t for t in p["tools"] if not t["name"].startswith("write")]
            p["messages"] = p["messages"] + [{"role": "system", "content": "read-only mode"}]
            return {"action": "modify", "outgoing": p}
"""

AFTER_MODEL = """
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: agent-after-model, namespace: default}
spec:
  target: agent
  triggerPoint: after_model
  failurePolicy: Open
  pool: {warm: 1, max: 2}
  hooks:
    - name: flaky
      action: detect
      code: |
        def execute(context, settings):
            if context["outgoing"]["message"]["content"] == "boom":
                raise RuntimeError("flaky hook fell over")
            return {"action": "pass"}
    - name: secrets
      action: detect
      code: |
        def execute(context, settings):
            content = context["outgoing"]["message"]["content"]
            if "secret" in content:
                return {"action": "detect", "findings": {"kind": "secret", "count": content.count("secret"), "ratio": 0.5}}
            return {"action": "pass"}
"""

BEFORE_TOOL = """
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: agent-before-tool, namespace: default}
spec:
  target: agent
  triggerPoint: before_tool
  pool: {warm: 1, max: 2}
  hooks:
    - name: path-guard
      action: block
      code: |
        def execute(context, settings):
            path = str(context["outgoing"]["arguments"].get("path", ""))
            if ".." in path:
                user = context["caller"].get("user", "?")
                return {"action": "block", "message": f"{user}: {path} is outside the project"}
            return {"action": "pass"}
"""

AFTER_TOOL = """
apiVersion: sluice.dev/v1alpha1
kind: HookChain
metadata: {name: agent-after-tool, namespace: default}
spec:
  target: agent
  triggerPoint: after_tool
  pool: {warm: 1, max: 2}
  hooks:
    - name: mask-passwords
      action: modify
      code: |
        def execute(context, settings):
            p = dict(context["outgoing"])
            if isinstance(p["result"], str) and "password" in p["result"]:
                p["result"] = p["result"].replace("password", "[redacted]")
                return {"action": "modify", "outgoing": p}
            return {"action": "pass"}
"""

ALL = {
    "input.yaml": INPUT,
    "output.yaml": OUTPUT,
    "before-model.yaml": BEFORE_MODEL,
    "after-model.yaml": AFTER_MODEL,
    "before-tool.yaml": BEFORE_TOOL,
    "after-tool.yaml": AFTER_TOOL,
}
